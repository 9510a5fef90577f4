"""The custom path of fft_conv: a batched complex-to-complex FFT with our own kernels
(kernels/fft_conv.cu), launched on CuPy arrays. libnn/ops/fft_conv.py is the op's front end (checks,
paths, the cuFFT path's element-wise passes) and calls `fft_c2c` here; this module is apart only to keep
that file readable, as ops/attention_kernels.py is for attention.

`fft_c2c(x, inverse)` transforms the last axis of a C-contiguous cupy complex64 array whose last
dimension n is a power of two, unnormalized in both directions (forward sign -1; the inverse has no 1/n,
the caller scales):
- n <= 4096: one launch of a shared-memory kernel over all rows.
- 4096 < n <= 2**24: the four-step algorithm. A row is viewed as an (n1, n2) row-major matrix,
  x[a*n2 + b], with n2 = 4096 and n1 = n / 4096 (so the strided column FFTs are the short ones):
      1. length-n1 FFTs down the columns:   Y[k1, b]  = sum_a x[a*n2 + b] W_n1^(a*k1)
      2. twiddle:                           Y[k1, b] *= W_n^(k1*b)
      3. length-n2 FFTs along the rows:     Z[k1, k2] = sum_b Y[k1, b] W_n2^(b*k2)
      4. transpose:                         X[k2*n1 + k1] = Z[k1, k2]
  Step 1 runs the kernel on the columns in place of a transpose (elem_stride = n2, batch_stride = 1)
  when there are few rows (one launch per row, the kernel's batch has one stride); with more rows it
  transposes each matrix, runs row FFTs and transposes back, three launches whatever the row count.

Error: relative rms error ~ eps * log2(n) for fp32 (eps = 6e-8), twiddles from sincospif on exact
arguments (see kernels/fft_conv.cu).
"""

from __future__ import annotations

import functools

import numpy as np

from libnn.runtime import contracts, kernels, launch
from libnn.runtime.arrays import describe, is_cupy
from libnn.runtime.device import current_device_id

_FILE = "fft_conv.cu"
_FFT = contracts.params(_FILE, "fft_radix2_c2c")  # fft_radix4_c2c takes the same parameters
_TWIDDLE = contracts.params(_FILE, "fft_twiddle")
VERSIONS = ("fft_radix2_c2c", "fft_radix4_c2c")  # 1) baseline, 2) default; `fft_c2c(version=...)` takes one
_DEFAULT_VERSION = "fft_radix4_c2c"
MAX_BLOCK_LOG2N = 12    # one block transforms up to 4096 points
MAX_LOG2N = 24          # four-step with n1, n2 <= 4096
_MAX_BATCH = 2**31 - 1  # the kernels take the batch as an int
_STRIDED_ROWS = 8       # four-step step 1: up to this many rows, one strided column launch per row


# --- launches ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _sm_limits(device_id: int) -> tuple[int, int, int, int]:
    """(SM count, shared memory, threads, registers) per SM."""
    import cupy

    rt = cupy.cuda.runtime
    return tuple(rt.deviceGetAttribute(a, device_id) for a in (
        rt.cudaDevAttrMultiProcessorCount, rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor,
        rt.cudaDevAttrMaxThreadsPerMultiProcessor, rt.cudaDevAttrMaxRegistersPerMultiprocessor))


def _max_grid(kernel, threads: int, smem: int) -> int:
    """About one resident wave of blocks: the kernels grid-stride over the batch, and each block builds
    its twiddle table once, so more blocks than fit at once only rebuild tables."""
    sms, smem_sm, threads_sm, regs_sm = _sm_limits(current_device_id())
    per_sm = min(32, threads_sm // threads, smem_sm // (smem + 1024))  # 1 KB reserved per block (sm_80+)
    regs = getattr(kernel, "num_regs", 0) or 0
    if regs:
        per_sm = min(per_sm, regs_sm // (regs * threads))
    return sms * max(per_sm, 1)


def _fft_launch_shape(version: str, log2n: int, batch: int) -> tuple[int, int, int]:
    """(blocks needed, threads, dynamic shared memory bytes) from kernels/fft_conv.cu's LAUNCH table."""
    n = 1 << log2n
    if version == "fft_radix2_c2c":
        return batch, min(max(n // 2, 32), 256), (n + n // 2) * 8
    threads = 256
    per_block = threads // min(max(n // 4, 1), threads)  # P transforms per block
    return -(-batch // per_block), threads, (per_block * n + n // 2) * 8


def _launch_fft(version: str, src, dst, log2n: int, batch: int, elem_stride: int, batch_stride: int,
                inverse: bool) -> None:
    """One launch of an FFT kernel: `batch` transforms of 2**log2n points, strides in elements."""
    assert 1 <= log2n <= MAX_BLOCK_LOG2N and 1 <= batch <= _MAX_BATCH
    groups, threads, smem = _fft_launch_shape(version, log2n, batch)
    kernel = kernels.function(_FILE, version, smem)
    grid = min(groups, _max_grid(kernel, threads, smem))
    kernel((grid,), (threads,), _FFT.pack(input=src, out=dst, log2n=log2n, batch=batch, elem_stride=elem_stride,
                                          batch_stride=batch_stride, inverse=int(bool(inverse))), shared_mem=smem)


def _launch_twiddle(data, log2n1: int, log2n2: int, batch: int, inverse: bool) -> None:
    """data[b, i, j] *= W_n^(i*j) for `batch` contiguous (n1, n2) matrices."""
    kernel = kernels.function(_FILE, "fft_twiddle")
    n = 1 << (log2n1 + log2n2)
    grid = min(-(-batch * n // 256), launch.GRID_STRIDE_BLOCKS_X)
    kernel((grid,), (256,), _TWIDDLE.pack(data=data, log2n1=log2n1, log2n2=log2n2, batch_stride=n, batch=batch,
                                          inverse=int(bool(inverse))))


def _rows_fft(version: str, src, dst, log2n: int, rows: int, inverse: bool) -> None:
    """FFTs along the rows of contiguous (rows, n) arrays src -> dst (may be the same), in launches of
    at most _MAX_BATCH rows."""
    n = 1 << log2n
    src, dst = src.reshape(rows, n), dst.reshape(rows, n)
    for start in range(0, rows, _MAX_BATCH):
        count = min(_MAX_BATCH, rows - start)
        _launch_fft(version, src[start:], dst[start:], log2n, count, 1, n, inverse)


def _split(log2n: int) -> tuple[int, int]:
    """(log2 n1, log2 n2) of the four-step matrix: n2 = 4096 rows, n1 = n / 4096 (1 <= log2 n1 <= 12)."""
    return log2n - MAX_BLOCK_LOG2N, MAX_BLOCK_LOG2N


# --- the op --------------------------------------------------------------------------------------
def _log2n_and_version(x, inverse, version) -> tuple[int, str]:
    """(log2 n, kernel version) after validating the arguments; ValueError/TypeError say what is wrong."""
    if not is_cupy(x):
        raise TypeError(f"fft_c2c: x must be a cupy.ndarray on the GPU, got {describe(x) if hasattr(x, 'dtype') else type(x).__name__}")
    if x.dtype != np.complex64:
        raise ValueError(f"fft_c2c: x must have dtype complex64, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("fft_c2c: x must have at least one dimension (the FFT runs along the last), got a 0-d array")
    if not x.flags.c_contiguous:
        raise ValueError(f"fft_c2c: x must be C-contiguous, got strides {x.strides} (bytes) for shape {x.shape}; "
                         "pass cupy.ascontiguousarray(x)")
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"fft_c2c: the last dimension of x must be a power of two, got {n} (shape {x.shape})")
    log2n = n.bit_length() - 1
    if log2n > MAX_LOG2N:
        raise ValueError(f"fft_c2c: the last dimension of x must be at most 2**{MAX_LOG2N} = {1 << MAX_LOG2N}, "
                         f"got {n} = 2**{log2n}")
    version = _DEFAULT_VERSION if version is None else version
    if version not in VERSIONS:
        raise ValueError(f"fft_c2c: version must be one of {VERSIONS} or None, got {version!r}")
    return log2n, version


def fft_c2c(x, inverse: bool = False, version: str | None = None):
    """Unnormalized FFT along the last axis of a C-contiguous cupy complex64 array whose last
    dimension is a power of two (any length up to 2**24); returns a new array."""
    import cupy

    log2n, version = _log2n_and_version(x, inverse, version)
    n = 1 << log2n
    if x.size == 0 or n == 1:
        return x.copy()
    rows = x.size // n
    if log2n <= MAX_BLOCK_LOG2N:
        out = cupy.empty_like(x)
        _rows_fft(version, x, out, log2n, rows, inverse)
        return out

    log2n1, log2n2 = _split(log2n)
    n1, n2 = 1 << log2n1, 1 << log2n2
    xm = x.reshape(rows, n1, n2)
    # 1. length-n1 FFTs down the columns of each (n1, n2) matrix
    if rows <= _STRIDED_ROWS:
        y = cupy.empty((rows, n1, n2), x.dtype)
        for r in range(rows):
            _launch_fft(version, xm[r], y[r], log2n1, n2, n2, 1, inverse)
    else:
        t = cupy.ascontiguousarray(xm.transpose(0, 2, 1))            # (rows, n2, n1)
        _rows_fft(version, t, t, log2n1, rows * n2, inverse)
        y = cupy.ascontiguousarray(t.transpose(0, 2, 1))             # (rows, n1, n2)
    # 2. y[k1, b] *= W_n^(k1*b)
    _launch_twiddle(y, log2n1, log2n2, rows, inverse)
    # 3. length-n2 FFTs along the rows, in place
    _rows_fft(version, y, y, log2n2, rows * n1, inverse)
    # 4. X[k2*n1 + k1] = Z[k1, k2]
    return cupy.ascontiguousarray(y.transpose(0, 2, 1)).reshape(x.shape)

