"""Out of GPU memory: a call whose buffers cannot fit in the GPU's memory raises MemoryError naming the
op and the bytes needed, before it allocates them, and the next call that fits works; a CuPy
OutOfMemoryError raised inside an op (memory taken by someone else between the op's check and its
allocation) also comes out as a MemoryError that names the op.

The huge calls have small inputs and huge outputs or temporaries (a GEMM with K = 1, a convolution
with huge padding, the S×S scores of unfused attention, an FFT of a hugely padded input), so nothing
the test itself allocates is large. Every allocation an op asks CuPy for goes through a recording
allocator: "refused before allocating" means no request of a GiB or more reached it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import random_normal, rel_error
from libnn import dtypes
from libnn.ops import attention, conv2d, fft_conv2d, linear

pytestmark = pytest.mark.gpu

GiB = 2**30


class RecordingAllocator:
    """CuPy's pool behind an allocator that records every request, and can refuse those of at least
    `fail_from` bytes with CuPy's own OutOfMemoryError (as the pool raises it when cudaMalloc fails)."""

    def __init__(self, fail_from: int | None = None):
        import cupy

        self.pool = cupy.get_default_memory_pool()
        self.requests: list[int] = []
        self.fail_from = fail_from

    def __call__(self, size: int):
        import cupy

        self.requests.append(size)
        if self.fail_from is not None and size >= self.fail_from:
            raise cupy.cuda.memory.OutOfMemoryError(size, self.pool.total_bytes())
        return self.pool.malloc(size)

    def __enter__(self):
        import cupy

        cupy.cuda.set_allocator(self)
        return self

    def __exit__(self, *exc):
        import cupy

        cupy.cuda.set_allocator(self.pool.malloc)


def byte_figures(message: str) -> list[float]:
    """Every size in a message, in bytes: '137438953472 bytes', '128.0 GiB', '512 MiB'..."""
    units = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6,
             "GB": 1e9, "TB": 1e12}
    return [float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b",
                                                        message)]


def gpu(*arrays):
    import cupy

    return [None if a is None else cupy.asarray(a) for a in arrays]


def huge_linear():
    """y (2**20, 65536) fp16 = 128 GiB from x (2**20, 1) and w (65536, 1): 2 MiB of inputs."""
    x, w = gpu(np.ones((2**20, 1), np.float16), np.ones((65536, 1), np.float16))
    return "linear", 2**20 * 65536 * 2, lambda: linear(x, w)


def huge_conv2d():
    """padding 60000 around a 1×1 image: y (1, 120001, 120001, 8) fp16 = 214 GiB."""
    x, w = gpu(np.ones((1, 1, 1, 8), np.float16), np.ones((8, 1, 1, 8), np.float16))
    return "conv2d", 120001**2 * 8 * 2, lambda: conv2d(x, w, padding=60000)


def huge_unfused_attention():
    """Sq = Skv = 2**18, D = 8: 4 MiB per input, the fp32 scores 256 GiB."""
    q = gpu(np.ones((1, 1, 2**18, 8), np.float16))[0]
    return "attention", 2**36 * 4, lambda: attention(q, q, q, path="unfused")


def huge_fft_conv2d():
    """padding 100000 around an 8×8 image: a 200008² transform per channel pair, about 1.2 TiB."""
    x, w = gpu(np.ones((1, 1, 8, 8), np.float32), np.ones((1, 1, 3, 3), np.float32))
    return "fft_conv2d", 200008**2 * 8, lambda: fft_conv2d(x, w, padding=100000)


HUGE = [huge_linear, huge_conv2d, huge_unfused_attention, huge_fft_conv2d]


@pytest.mark.parametrize("make", HUGE, ids=lambda f: f.__name__)
def test_a_call_that_cannot_fit_is_refused_naming_the_op_and_the_bytes(make):
    import cupy

    op, needed, call = make()
    total = cupy.cuda.runtime.memGetInfo()[1]
    assert needed > total, f"the test's call needs {needed} bytes, which this GPU's {total} could hold"
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    with RecordingAllocator() as allocator:
        with pytest.raises(MemoryError) as caught:
            call()
    message = str(caught.value)
    print(f"{op}: {type(caught.value).__module__}.{type(caught.value).__name__}: {message}")
    assert op in message, f"the MemoryError does not name {op}: {message!r}"
    figures = byte_figures(message)
    assert any(f >= 0.5 * needed for f in figures), \
        f"the MemoryError does not give the bytes needed (~{needed}): {message!r}"
    large = [n for n in allocator.requests if n >= GiB]
    assert not large, f"{op} asked CuPy for {large} bytes before refusing; the size check must come first"
    # a first call may keep a workspace or constants for its signature; nothing near the refused size
    assert pool.used_bytes() - used < 256 * 2**20, "the refused call left memory in use"


@pytest.mark.parametrize("make", HUGE, ids=lambda f: f.__name__)
def test_the_next_call_that_fits_works(make, rng):
    op, _, call = make()
    with pytest.raises(MemoryError):
        call()
    x, w, b = (random_normal(rng, (33, 17), "fp16"), random_normal(rng, (65, 17), "fp16", 0.25),
               random_normal(rng, (65,), "fp16"))
    expected = linear(x, w, b, "relu", path="reference")
    assert rel_error(linear(*gpu(x, w, b), "relu"), expected) <= dtypes.TOLERANCE["fp16"]
    xc, wc = random_normal(rng, (2, 9, 9, 8), "fp16"), random_normal(rng, (8, 3, 3, 8), "fp16", 0.1)
    assert rel_error(conv2d(*gpu(xc, wc), padding=1), conv2d(xc, wc, padding=1, path="reference")) \
        <= dtypes.TOLERANCE["fp16"]


def moderate_linear(rng):
    """y (4096, 32768) fp16 = 256 MiB: fits on any GPU libnn runs on."""
    x, w = random_normal(rng, (4096, 64), "fp16"), random_normal(rng, (32768, 64), "fp16", 0.125)
    return x, w


@pytest.mark.parametrize("path", ["auto", "custom"])
def test_cupy_out_of_memory_inside_an_op_is_a_memory_error(rng, path):
    """CuPy's OutOfMemoryError derives from MemoryError; this checks nothing else comes out (a
    LibraryError, a crash, a FallbackWarning loop), and that the same call works once memory is free
    again (the bound call cached by the failed call is not broken)."""
    import cupy

    x, w = moderate_linear(rng)
    xg, wg = gpu(x, w)
    with RecordingAllocator(fail_from=128 * 2**20):
        with pytest.raises(MemoryError) as caught:
            linear(xg, wg, path=path)
    print(f"{type(caught.value).__module__}.{type(caught.value).__name__}: {caught.value}")
    y = linear(xg, wg, path=path)
    rows = slice(0, 64)  # the reference of a slice: cheap
    assert rel_error(y[rows], linear(x[rows], w, path="reference")) <= dtypes.TOLERANCE["fp16"]
    cupy.cuda.Device().synchronize()


def test_cupy_out_of_memory_inside_an_op_names_the_op_and_the_bytes(rng):
    """Issue 14: every MemoryError names the op and the bytes. CuPy's own message names neither the
    op nor what it was computing ('Out of memory allocating 268,435,456 bytes (allocated so far: ...)');
    this fails while libnn lets it through unchanged."""
    x, w = moderate_linear(rng)
    xg, wg = gpu(x, w)
    with RecordingAllocator(fail_from=128 * 2**20):
        with pytest.raises(MemoryError) as caught:
            linear(xg, wg)
    message = str(caught.value)
    assert "linear" in message, f"the MemoryError does not name the op: {message!r}"
