"""FFT convolution and our FFT on the GPU: every path against the float64 reference, our FFT against
cuFFT on transforms alone, and cuFFT's plan cache."""

import math
import threading

import numpy as np
import pytest

import libnn
from libnn.ops.fft_conv import fft_conv1d, fft_conv2d
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu


def gpu(a):
    import cupy
    return cupy.asarray(a)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["cufft", "custom"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 1, 1), (2, 3, 13, 17, 4, 5, 3), (1, 2, 64, 61, 3, 31, 31),
                                   (2, 4, 127, 128, 5, 9, 9)], ids=str)
@pytest.mark.parametrize("mode", ["valid", "same", "full"])
def test_fft_conv2d_paths_match_reference(rng, path, dtype, shape, mode):
    N, C, H, W, K, kh, kw = shape
    x = random_normal(rng, (N, C, H, W), dtype)
    w = random_normal(rng, (K, C, kh, kw), dtype, 1 / math.sqrt(C * kh * kw))
    b = random_normal(rng, (K,), dtype)
    expected = fft_conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), mode=mode)
    y = fft_conv2d(gpu(x), gpu(w), gpu(b), mode=mode, path=path)
    size = max(H + kh, W + kw) ** 2
    tol = 1e-5 * math.log2(size + 1) if dtype == "fp32" else 1e-2
    assert y.dtype == x.dtype and rel_error(y, expected) <= tol


@pytest.mark.parametrize("path", ["cufft", "custom"])
@pytest.mark.parametrize("L, kl", [(1000, 64), (4096, 4096), (1 << 17, 1 << 17)])
def test_long_causal_conv1d(rng, path, L, kl):
    x, w = random_normal(rng, (1, 2, L), "fp32"), random_normal(rng, (2, 2, kl), "fp32", 1 / math.sqrt(2 * kl))
    expected = fft_conv1d(x.astype(np.float64), w.astype(np.float64), causal=True)
    y = fft_conv1d(gpu(x), gpu(w), causal=True, path=path)
    assert rel_error(y, expected) <= 1e-5 * math.log2(2 * L)


@pytest.mark.parametrize("version", ["fft_radix2_c2c", "fft_radix4_c2c"])
@pytest.mark.parametrize("log2n", [1, 2, 3, 5, 8, 12, 13, 16, 20])
@pytest.mark.parametrize("inverse", [False, True])
def test_our_fft_matches_cufft(rng, version, log2n, inverse):
    import cupy

    from libnn.ops.fft_conv_kernels import VERSIONS, fft_c2c

    assert version in VERSIONS
    n = 1 << log2n
    rows = max(1, (1 << 18) // n)
    x = (rng.standard_normal((rows, n)) + 1j * rng.standard_normal((rows, n))).astype(np.complex64)
    ours = fft_c2c(gpu(x), inverse=inverse, version=version)
    theirs = cupy.fft.ifft(gpu(x), axis=-1) * n if inverse else cupy.fft.fft(gpu(x), axis=-1)
    expected = np.fft.ifft(x.astype(np.complex128)) * n if inverse else np.fft.fft(x.astype(np.complex128))
    assert rel_error(ours.get().view(np.float32), expected.view(np.float64)) <= 1e-6 * (log2n + 1)
    assert rel_error(theirs.get().view(np.float32), expected.view(np.float64)) <= 1e-6 * (log2n + 1)


def _case(rng, shape, dtype="fp32", bias=True):
    """Fresh x, w, b for (N, C, H, W, K, kh, kw), on the GPU, with the float64 reference for `mode`."""
    N, C, H, W, K, kh, kw = shape
    x = random_normal(rng, (N, C, H, W), dtype)
    w = random_normal(rng, (K, C, kh, kw), dtype, 1 / math.sqrt(C * kh * kw))
    b = random_normal(rng, (K,), dtype) if bias else None
    return x, w, b


def _expected(x, w, b, **kwargs):
    return fft_conv2d(x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64), **kwargs)


def _on_gpu(x, w, b):
    return gpu(x), gpu(w), None if b is None else gpu(b)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("shape", [(1, 1, 32, 32, 1, 7, 7), (2, 5, 20, 23, 6, 5, 3), (1, 1, 2048, 2048, 1, 5, 5)],
                         ids=["cmul", "gemm", "workspaces-from-the-pool"])  # the last is above KEEP_WORKSPACE_BYTES
def test_bound_cufft_call_reads_new_arrays_and_returns_a_new_output(rng, shape):
    op = libnn.get_op("fft_conv")
    first = _case(rng, shape)
    y1 = fft_conv2d(*_on_gpu(*first), mode="same", path="cufft")
    builds = op.calls.stats.builds
    second = _case(rng, shape, bias=False)
    y2 = fft_conv2d(*_on_gpu(*second), mode="same", path="cufft")
    third = _case(rng, shape)
    y3 = fft_conv2d(*_on_gpu(*third), mode="same", path="cufft")
    assert op.calls.stats.builds == builds + 1  # the bias-less call is a signature of its own; y3 binds nothing
    for y, case in ((y1, first), (y2, second), (y3, third)):  # y1 is not overwritten by later calls
        assert rel_error(y, _expected(*case, mode="same")) <= 1e-5 * math.log2((shape[2] + shape[5]) * (shape[3] + shape[6]))
    assert len({y1.data.ptr, y2.data.ptr, y3.data.ptr}) == 3


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_bound_cufft_calls_of_several_signatures_interleave(rng):
    shapes = [(1, 1, 40, 40, 1, 9, 9), (2, 2, 17, 30, 3, 4, 6), (1, 1, 40, 40, 1, 9, 9)]
    for dtype in ("fp32", "fp16"):
        for shape in shapes + shapes:
            case = _case(rng, shape, dtype)
            y = fft_conv2d(*_on_gpu(*case), path="cufft")
            assert y.dtype == case[0].dtype
            assert rel_error(y, _expected(*case)) <= (1e-5 * math.log2(64 * 64) if dtype == "fp32" else 1e-2)


def test_bound_cufft_call_on_another_stream_binds_its_own(rng):
    import cupy

    op = libnn.get_op("fft_conv")
    shape = (2, 3, 33, 31, 2, 7, 5)
    case = _case(rng, shape)
    fft_conv2d(*_on_gpu(*case), path="cufft")
    builds = op.calls.stats.builds
    results = []
    for stream in (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)):
        with stream:
            case = _case(rng, shape)
            results.append((fft_conv2d(*_on_gpu(*case), path="cufft"), case))
            stream.synchronize()
    assert op.calls.stats.builds == builds + 2  # counted before the reference binds its own call
    for y, case in results:
        assert rel_error(y, _expected(*case)) <= 1e-5 * math.log2(64 * 64)


def test_bound_cufft_call_from_threads_on_one_stream(rng):
    """Threads on one stream share the bound call's workspaces: its lock keeps their launches apart."""
    shape = (1, 2, 64, 64, 2, 11, 11)
    cases = [_case(rng, shape) for _ in range(8)]
    inputs = [_on_gpu(*c) for c in cases]
    fft_conv2d(*inputs[0], path="cufft")  # bound before the threads start
    results = [None] * len(cases)

    def work(i):
        for _ in range(5):
            results[i] = fft_conv2d(*inputs[i], path="cufft")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for y, case in zip(results, cases):
        assert rel_error(y, _expected(*case)) <= 1e-5 * math.log2(128 * 128)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["cufft", "custom"])
def test_strided_inputs(rng, path):
    N, C, H, W, K, kh, kw = 2, 3, 19, 21, 4, 5, 5
    x_wide, b_wide = random_normal(rng, (N, C, H, 2 * W), "fp32"), random_normal(rng, (2 * K,), "fp32")
    w = random_normal(rng, (K, C, kh, kw), "fp32", 1 / math.sqrt(C * kh * kw))
    y = fft_conv2d(gpu(x_wide)[..., ::2], gpu(w), gpu(b_wide)[::2], path=path)
    assert rel_error(y, _expected(x_wide[..., ::2], w, b_wide[::2])) <= 1e-5 * math.log2(32 * 32)


@pytest.mark.parametrize("path", ["cufft", "custom"])
@pytest.mark.parametrize("channels", [(3, 4), (5, 6)], ids=["cmul", "gemm"])
@pytest.mark.parametrize("where", ["x", "w"])
def test_one_nan_spreads_to_its_whole_image_or_filter(rng, path, channels, where):
    """The documented FFT property (the module docstring): all outputs of that image, or of that filter's
    channel, are NaN; every other output is finite."""
    C, K = channels
    x, w, b = _case(rng, (2, C, 12, 11, K, 5, 4))
    (x if where == "x" else w)[1, 2, 3, 1] = np.nan
    y = fft_conv2d(*_on_gpu(x, w, b), path=path).get()
    poisoned = y[1] if where == "x" else y[:, 1]
    clean = np.delete(y, 1, axis=0 if where == "x" else 1)
    assert np.isnan(poisoned).all() and np.isfinite(clean).all()


def test_sizes_that_do_not_fit_are_refused_with_the_size_needed():
    import cupy

    with pytest.raises(MemoryError, match=r"fft_conv2d: padding x \(64, 64\) to the FFT size \(189, 189\) needs "
                                          r".* \(\d+ bytes\), more than .* free GPU memory"):
        fft_conv2d(cupy.ones((512, 512, 64, 64), cupy.float16), cupy.ones((512, 512, 60, 60), cupy.float16),
                   mode="full", path="cufft")


def test_auto_prefers_cufft():
    import cupy

    fft_conv2d(cupy.ones((1, 1, 8, 8), cupy.float32), cupy.ones((1, 1, 3, 3), cupy.float32))
    assert libnn.get_op("fft_conv").last_decision.path == "cufft"
