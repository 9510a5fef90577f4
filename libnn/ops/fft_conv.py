"""fft_conv2d and fft_conv1d: convolution through the frequency domain, for large kernels.

They compute exactly what conv2d (NCHW, stride 1, dilation 1, groups 1) computes, a cross-correlation
of x (N, C, H, W) with w (K, C, kh, kw) plus bias, but in O(HW log HW) per channel pair instead of
O(HW·kh·kw): both are zero-padded to an FFT size F ≥ the padded input, transformed, multiplied per
frequency as a batched complex matrix product (C → K for every frequency, one cuBLAS batched GEMM,
not a loop), transformed back and cropped. For cross-correlation the filter spectrum is conjugated.

`mode`: "valid" (with `padding`), "same" (output H×W), "full" (output H+kh-1 × W+kw-1).
fp32; fp16/bf16 inputs are computed in fp32 and rounded once. fft_conv1d is the 1-D case on
(N, C, L); `causal=True` pads kl-1 on the left only, so y[t] depends on x[≤ t] (long convolutions).

Paths, in `auto` order:
- cufft:     cuFFT through CuPy (real-to-complex transforms, FFT sizes rounded up to 2,3,5,7-smooth
             numbers, CuPy's plan cache).
- custom:    our FFT (kernels/fft.cu, complex-to-complex, power-of-two sizes).
- reference: numpy.fft in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.registry import Op, option_key
from libnn.runtime.arrays import as_array, device_of, signature, stream_key

MODES = ("valid", "same", "full")
MAX_FFT_BYTES_FRACTION = 0.8  # refuse transforms whose buffers would exceed this share of free memory

op = Op("fft_conv", order=("cufft", "custom", "reference"))


@dataclass(frozen=True)
class FFTConvProblem:
    N: int
    C: int
    K: int
    spatial: tuple[int, ...]        # (H, W) or (L,)
    kernel: tuple[int, ...]         # (kh, kw) or (kl,)
    pads: tuple[tuple[int, int], ...]  # (before, after) per spatial dim
    has_bias: bool
    dtype: str
    device: str

    def describe(self) -> str:
        return (f"fft_conv{len(self.spatial)}d N={self.N} C={self.C} K={self.K} input {self.spatial} "
                f"kernel {self.kernel} pads {self.pads} {self.dtype}")

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(n + a + b for n, (a, b) in zip(self.spatial, self.pads))

    @property
    def out(self) -> tuple[int, ...]:
        return tuple(p - k + 1 for p, k in zip(self.padded, self.kernel))


def smooth_size(n: int, primes: tuple[int, ...] = (2, 3, 5, 7)) -> int:
    """The smallest m ≥ n whose prime factors are all in `primes` (fast cuFFT sizes)."""
    m = n
    while True:
        r = m
        for p in primes:
            while r % p == 0:
                r //= p
        if r == 1:
            return m
        m += 1


def _pads(mode: str, padding, kernel: tuple[int, ...], name: str) -> tuple[tuple[int, int], ...]:
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
    if mode == "same":
        return tuple(((k - 1) // 2, k // 2) for k in kernel)
    if mode == "full":
        return tuple((k - 1, k - 1) for k in kernel)
    pad = (padding,) * len(kernel) if isinstance(padding, (int, np.integer)) else tuple(padding)
    if len(pad) != len(kernel) or any(int(p) != p or p < 0 for p in pad):
        raise ValueError(f"{name}: padding must be an int or {len(kernel)} ints >= 0, got {padding!r}")
    return tuple((int(p), int(p)) for p in pad)


def _check(name: str, x, w, b, pads_for, stride) -> FFTConvProblem:
    dims = w.ndim - 2
    if stride != 1:
        raise ValueError(f"{name}: stride must be 1 (got {stride}); FFT convolution computes every output "
                         f"position, use libnn.ops.conv2d for strided convolutions")
    if x.ndim != dims + 2 or w.ndim != dims + 2:
        raise ValueError(f"{name}: x must be {dims + 2}-D (N, C, {'H, W' if dims == 2 else 'L'}) and w "
                         f"{dims + 2}-D (K, C, {'kh, kw' if dims == 2 else 'kl'}), got {tuple(x.shape)} and {tuple(w.shape)}")
    for arg, a in (("x", x), ("w", w), ("b", b)):
        if a is not None and (a.dtype.kind not in "f" and dtypes.short_name(a.dtype) != "bf16"):
            raise TypeError(f"{name}: {arg} must be real floating point (fp16, bf16, fp32, fp64), got {a.dtype}")
    for arg, a in (("w", w), ("b", b)):
        if a is not None and a.dtype != x.dtype:
            raise TypeError(f"{name}: {arg} has dtype {dtypes.short_name(a.dtype)} but x has {dtypes.short_name(x.dtype)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: w has {w.shape[1]} input channels but x has {x.shape[1]}")
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"{name}: b must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    kernel, spatial = tuple(w.shape[2:]), tuple(x.shape[2:])
    pads = pads_for(kernel)
    problem = FFTConvProblem(x.shape[0], x.shape[1], w.shape[0], spatial, kernel, pads, b is not None,
                             dtypes.short_name(x.dtype), device_of({"x": x, "w": w, "b": b}, name))
    if any(o < 1 for o in problem.out):
        raise ValueError(f"{name}: kernel {kernel} is larger than the padded input {problem.padded}; "
                         f"pad x or use mode='same' or mode='full'")
    return problem


def fft_conv2d(x: Any, w: Any, b: Any = None, *, padding: Any = 0, mode: str = "valid", stride: int = 1,
               path: str = "auto") -> Any:
    """conv2d (NCHW, cross-correlation) through the FFT; see the module docstring."""
    return _run("fft_conv2d", x, w, b, lambda kernel: _pads(mode, padding, kernel, "fft_conv2d"), stride, path, 2,
                (mode, option_key(padding)))


def fft_conv1d(x: Any, w: Any, b: Any = None, *, padding: Any = 0, mode: str = "valid", causal: bool = False,
               stride: int = 1, path: str = "auto") -> Any:
    """conv1d (N, C, L) through the FFT; `causal` pads kl-1 on the left and returns length L."""
    def pads(kernel):
        return ((kernel[0] - 1, 0),) if causal else _pads(mode, padding, kernel, "fft_conv1d")
    return _run("fft_conv1d", x, w, b, pads, stride, path, 1, (mode, option_key(padding), causal))


def _run(name, x, w, b, pads_for, stride, path, dims, options: tuple):
    x, w = as_array(x, name, "x"), as_array(w, name, "w")
    b = None if b is None else as_array(b, name, "b")
    key = (name, signature(x), signature(w), signature(b), stride, options, path, stream_key())

    def prepare():
        if w.ndim != dims + 2:
            raise ValueError(f"{name}: w must be {dims + 2}-D, got shape {tuple(w.shape)}")
        return _check(name, x, w, b, pads_for, stride)
    return op.call(key, prepare, path, x, w, b)



def fft_shape(problem: FFTConvProblem, power_of_two: bool) -> tuple[int, ...]:
    return tuple(1 << (p - 1).bit_length() if power_of_two else smooth_size(p) for p in problem.padded)


def _check_memory(problem: FFTConvProblem, shape: tuple[int, ...]) -> None:
    """Refuse, with the size needed, transforms whose buffers would not fit in free GPU memory."""
    import cupy

    bins = int(np.prod(shape))
    needed = 8 * bins * (problem.N * problem.C + problem.K * problem.C + 2 * problem.N * problem.K)
    free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    if needed > MAX_FFT_BYTES_FRACTION * free:
        raise MemoryError(f"{problem.describe()}: the padded transforms ({shape}) need {needed / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB is free; use libnn.ops.conv2d or a smaller batch")


# Up to this many channel pairs the contraction is a broadcast multiply-and-sum; above it, one batched
# GEMM over frequencies. A GEMM per frequency with C = K = 1 is millions of 1x1 products: on the H100
# it made a 2048² single-channel convolution 6× slower than CuPy's fftconvolve.
GEMM_CHANNEL_PAIRS = 16


def _contract(xf, wf, xp):
    """Y[n, k, f] = sum_c X[n, c, f] · conj(W[k, c, f])."""
    n, c = xf.shape[:2]
    k = wf.shape[0]
    if c * k <= GEMM_CHANNEL_PAIRS:
        return (xf[:, None] * xp.conj(wf)[None]).sum(axis=2)
    bins = int(np.prod(xf.shape[2:]))
    a = xp.ascontiguousarray(xf.reshape(n, c, bins).transpose(2, 0, 1))          # (F, N, C)
    bt = xp.ascontiguousarray(xp.conj(wf.reshape(k, c, bins)).transpose(2, 1, 0))  # (F, C, K)
    return xp.matmul(a, bt).transpose(1, 2, 0).reshape(n, k, *xf.shape[2:])


def _pad(x, problem, xp):
    if not any(a or b for a, b in problem.pads):
        return x  # the transforms zero-pad at the end themselves
    return xp.pad(x, ((0, 0), (0, 0), *problem.pads))


def _finish(y, problem, b, dtype, xp):
    y = y[(slice(None), slice(None), *(slice(0, o) for o in problem.out))]
    if b is not None:
        y = y + b.astype(y.dtype).reshape(1, -1, *(1,) * len(problem.out))
    return xp.ascontiguousarray(y).astype(dtype, copy=False)


def _real_fft_conv(problem, x, w, b, xp, compute):
    """The cuFFT / numpy path: real-to-complex transforms of size fft_shape."""
    axes = tuple(range(2, 2 + len(problem.spatial)))
    shape = fft_shape(problem, power_of_two=False)
    xf = xp.fft.rfftn(_pad(x.astype(compute), problem, xp), s=shape, axes=axes)
    wf = xp.fft.rfftn(w.astype(compute), s=shape, axes=axes)
    y = xp.fft.irfftn(_contract(xf, wf, xp), s=shape, axes=axes)
    return _finish(y, problem, b, x.dtype, xp)


def _gpu_support(problem: FFTConvProblem) -> str | None:
    if problem.dtype not in ("fp16", "bf16", "fp32"):
        return f"dtype {problem.dtype} is not supported (supported: fp16, bf16, fp32)"
    return None


@op.path("cufft", kind="library", device="gpu", supports=_gpu_support)
def _cufft(problem, x, w, b):
    import cupy

    _check_memory(problem, fft_shape(problem, power_of_two=False))
    return _real_fft_conv(problem, x, w, b, cupy, cupy.float32)


def _custom_support(problem: FFTConvProblem) -> str | None:
    from libnn.ops.fft_kernels import MAX_LOG2N

    if reason := _gpu_support(problem):
        return reason
    if max(fft_shape(problem, power_of_two=True)) > 2**MAX_LOG2N:
        return f"our FFT handles lengths up to 2**{MAX_LOG2N}"
    return None


@op.path("custom", kind="custom", device="gpu", supports=_custom_support)
def _custom(problem, x, w, b):
    import cupy

    from libnn.ops.fft_kernels import fft_c2c

    shape = fft_shape(problem, power_of_two=True)
    _check_memory(problem, shape)

    def fftn(a, inverse=False):  # complex-to-complex along each spatial axis, last axis first
        for axis in range(a.ndim - 1, 1, -1):
            a = cupy.ascontiguousarray(cupy.moveaxis(a, axis, -1))
            a = cupy.moveaxis(fft_c2c(a, inverse=inverse), -1, axis)
        return cupy.ascontiguousarray(a)

    def zero_padded_complex(a):
        full = cupy.zeros((*a.shape[:2], *shape), cupy.complex64)
        full[(slice(None), slice(None), *(slice(0, n) for n in a.shape[2:]))] = a
        return full

    xf = fftn(zero_padded_complex(_pad(x.astype(cupy.float32), problem, cupy)))
    wf = fftn(zero_padded_complex(w.astype(cupy.float32)))
    y = fftn(_contract(xf, wf, cupy), inverse=True)
    y = y.real / np.prod(shape)
    return _finish(y, problem, b, x.dtype, cupy)


@op.path("reference", kind="reference", device="cpu")
def _reference(problem, x, w, b):
    return _real_fft_conv(problem, x, w, b, np, np.float64)
