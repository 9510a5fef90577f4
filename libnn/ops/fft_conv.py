"""fft_conv2d and fft_conv1d: convolution through the frequency domain, for large kernels.

They compute exactly what conv2d (NCHW, stride 1, dilation 1, groups 1) computes, a cross-correlation
of x (N, C, H, W) with w (K, C, kh, kw) plus bias, but in O(HW log HW) per channel pair instead of
O(HW·kh·kw): both are zero-padded to an FFT size F ≥ the padded input, transformed, multiplied per
frequency (Y[n, k] = Σ_c X[n, c] · conj(W[k, c]); the filter spectrum is conjugated for
cross-correlation), transformed back and cropped.

`mode`: "valid" (with `padding`: an int or one int per spatial dim, ≥ 0), "same" (output H×W), "full"
(output H+kh-1 × W+kw-1); `padding` applies to "valid" only and must be left at 0 with the others.
fp32; fp16/bf16 inputs are computed in fp32 and rounded once. fft_conv1d is the 1-D case on (N, C, L);
`causal=True` pads kl-1 on the left only, so y[t] depends on x[≤ t] (long convolutions); it sets the
padding itself, so `mode` and `padding` must be left at "valid" and 0 (anything else is a ValueError).

NaN and Inf spread: a transform mixes every input value into every frequency, so one NaN or Inf in
image n of x makes every output of image n NaN (all K channels), and one in filter k of w makes
channel k of every image NaN. conv2d poisons only the outputs whose window reads the bad value. This is
a property of the FFT, not emulated away: check inputs with `isfinite` first where it matters.

Sizes are checked before anything is allocated: the padded input when the arguments are checked (at
most 2**31 - 1 per dimension), then, on every path, the bytes its transforms need against free GPU
memory or host RAM (libnn.runtime.memory.require names the size and what is available).

Paths, in `auto` order:
- cufft:     cuFFT's real-to-complex transforms (FFT sizes rounded up to 2,3,5,7-smooth numbers).
             Bound per signature (see libnn.registry): the first call sizes the problem, checks the
             memory it needs against free GPU memory, creates its two cuFFT plans and its workspaces
             (padded inputs, spectra, the inverse transform's output; kept up to KEEP_WORKSPACE_BYTES,
             taken from CuPy's pool at each call above). A later call launches
               1. fft_pad (kernels/fft_conv.cu): x and w, cast to fp32 and zero-padded, into one buffer;
               2. one batched R2C transform of it (x's and w's spectra at once);
               3. the spectrum product: fft_cmul for C·K ≤ GEMM_CHANNEL_PAIRS, else a batched GEMM
                  (CuPy's matmul, cuBLAS) on transposed copies of the spectra;
               4. one batched C2R transform;
               5. fft_crop: crop, 1/F normalisation, bias and cast into a new output array.
             The filter spectrum is computed at every call (w's contents may change between calls).
             Kept workspaces belong to the bound call and are reused by every call on its stream (the
             stream is part of the signature): calls on one stream run in order on the GPU, and calls
             from several threads on one stream take the bound call's lock while they launch. A bound
             call holds its plans and kept workspaces until it is dropped (`op.calls` keeps the last
             MAX_BOUND_CALLS signatures; `libnn.get_op("fft_conv").calls.clear()` releases them all).
- custom:    our FFT (kernels/fft_conv.cu, complex-to-complex, power-of-two sizes); bound for its size and
             memory check, CuPy element-wise steps per call.
- reference: numpy.fft in float64.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.ops.fft_conv_kernels import MAX_LOG2N, fft_c2c
from libnn.registry import Op, option_key
from libnn.runtime import contracts, launch, memory
from libnn.runtime.arrays import as_array, device_of, signature, stream_key

MODES = ("valid", "same", "full")
# cuFFT plans (CuPy's take int sizes) and kernels/fft_conv.cu index one spatial dimension, and the cufft path
# one whole transform, with an int
MAX_PADDED = 2**31 - 1
# A bound cufft call keeps its workspaces (several times the padded input) up to this size; larger ones
# come from CuPy's pool at each call (microseconds, against the milliseconds such transforms take), so
# that a few large signatures do not hold gigabytes between calls.
KEEP_WORKSPACE_BYTES = 64 << 20
# Bound calls kept (each with its cuFFT plans and their work areas, and workspaces up to the size above):
# a few dozen signatures, not the registry's default thousands.
MAX_BOUND_CALLS = 32

op = Op("fft_conv", order=("cufft", "custom", "reference"), max_calls=MAX_BOUND_CALLS)


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
        return (f"{self.name} N={self.N} C={self.C} K={self.K} input {self.spatial} "
                f"kernel {self.kernel} pads {self.pads} {self.dtype}")

    @property
    def name(self) -> str:
        return f"fft_conv{len(self.spatial)}d"

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(n + a + b for n, (a, b) in zip(self.spatial, self.pads))

    @property
    def out(self) -> tuple[int, ...]:
        return tuple(p - k + 1 for p, k in zip(self.padded, self.kernel))


def smooth_size(n: int) -> int:
    """The smallest m ≥ n whose prime factors are all 2, 3, 5 or 7 (fast cuFFT sizes): the least of
    p·2^a ≥ n over the products p of powers of 3, 5 and 7 below the next power of two, O(log³ n)."""
    best = 1 << max(n - 1, 0).bit_length()
    p7 = 1
    while p7 < best:
        p5 = p7
        while p5 < best:
            p3 = p5
            while p3 < best:
                fits = p3 << (-(-n // p3) - 1).bit_length() if p3 < n else p3  # p3·2^a, the least ≥ n
                best = min(best, fits)
                p3 *= 3
            p5 *= 5
        p7 *= 7
    return best


def _padding(name: str, padding: Any, dims: int) -> tuple[int, ...]:
    """`padding` as `dims` Python ints ≥ 0."""
    def integer(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if integer(padding):
        pad = (int(padding),) * dims
    elif isinstance(padding, (tuple, list)) and all(integer(p) for p in padding):
        pad = tuple(int(p) for p in padding)
    else:
        raise TypeError(f"{name}: padding must be an int or a tuple of {dims} ints, got "
                        f"{type(padding).__name__} {padding!r}")
    if len(pad) != dims or any(p < 0 for p in pad):
        raise ValueError(f"{name}: padding must be an int >= 0 or a tuple of {dims} ints >= 0, got {padding!r}")
    return pad


def _options(name: str, mode: str, padding: Any, dims: int) -> tuple[int, ...]:
    """Checks mode and padding (before the bound-call lookup: 2.0 == 2 would find padding=2's call);
    returns the padding as ints."""
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
    pad = _padding(name, padding, dims)
    if mode != "valid" and any(pad):
        raise ValueError(f"{name}: padding applies to mode='valid' only; mode={mode!r} pads itself, got "
                         f"padding={padding!r}")
    return pad


def _pads(mode: str, pad: tuple[int, ...], kernel: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    if mode == "same":
        return tuple(((k - 1) // 2, k // 2) for k in kernel)
    if mode == "full":
        return tuple((k - 1, k - 1) for k in kernel)
    return tuple((p, p) for p in pad)


def fft_conv_problem(name: str, x, w, b, pads_for, stride) -> FFTConvProblem:
    """The FFTConvProblem op `name` (fft_conv1d or fft_conv2d) solves, after checking every argument as
    the op does (arrays already); `pads_for(kernel)` gives the (before, after) padding per spatial dim."""
    dims = w.ndim - 2
    if isinstance(stride, (bool, np.bool_)) or not isinstance(stride, (int, np.integer)):  # an array: no `!=`
        raise TypeError(f"{name}: stride must be the int 1, got {type(stride).__name__} {stride!r}")
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
    if 0 in kernel:  # a sum over no taps: the output would be zeros (or the bias) and look fine
        raise ValueError(f"{name}: w's kernel must be at least {'x'.join('1' * dims)}, got "
                         f"{'x'.join(map(str, kernel))} (w shape {tuple(w.shape)})")
    pads = pads_for(kernel)
    problem = FFTConvProblem(x.shape[0], x.shape[1], w.shape[0], spatial, kernel, pads, b is not None,
                             dtypes.short_name(x.dtype), device_of({"x": x, "w": w, "b": b}, name))
    if max(problem.padded) > MAX_PADDED:
        raise ValueError(f"{name}: padding {pads} makes the padded input {problem.padded}; FFT convolution "
                         f"handles at most {MAX_PADDED} (2**31 - 1) per dimension")
    if any(o < 1 for o in problem.out):
        raise ValueError(f"{name}: kernel {kernel} is larger than the padded input {problem.padded}; "
                         f"pad x or use mode='same' or mode='full'")
    return problem


def fft_conv2d(x: Any, w: Any, b: Any = None, *, padding: Any = 0, mode: str = "valid", stride: int = 1,
               path: str = "auto") -> Any:
    """conv2d (NCHW, cross-correlation) through the FFT; see the module docstring (modes, padding, and
    how one NaN or Inf spreads to every output of its image or filter)."""
    pad = _options("fft_conv2d", mode, padding, 2)
    return _run("fft_conv2d", x, w, b, lambda kernel: _pads(mode, pad, kernel), stride, path, 2, (mode, pad))


def fft_conv1d(x: Any, w: Any, b: Any = None, *, padding: Any = 0, mode: str = "valid", causal: bool = False,
               stride: int = 1, path: str = "auto") -> Any:
    """conv1d (N, C, L) through the FFT; `causal` pads kl-1 on the left and returns length L (mode and
    padding must then be left at 'valid' and 0). NaN/Inf spread as the module docstring says."""
    pad = _options("fft_conv1d", mode, padding, 1)
    if causal and (mode != "valid" or any(pad)):
        bad = f"mode={mode!r}" if mode != "valid" else f"padding={padding!r}"
        raise ValueError(f"fft_conv1d: causal=True pads kl-1 on the left itself; mode and padding must be "
                         f"left at 'valid' and 0, got {bad}")

    def pads(kernel):  # called when a new signature is checked: causal is keyed with its type
        if not isinstance(causal, (bool, np.bool_)):  # "no" would mean yes
            raise TypeError(f"fft_conv1d: causal must be True or False, got {type(causal).__name__} {causal!r}")
        return ((kernel[0] - 1, 0),) if causal else _pads(mode, pad, kernel)
    return _run("fft_conv1d", x, w, b, pads, stride, path, 1, (mode, pad, option_key(causal)))


def _run(name, x, w, b, pads_for, stride, path, dims, options: tuple):
    x, w = as_array(x, name, "x"), as_array(w, name, "w")
    b = None if b is None else as_array(b, name, "b")
    key = (name, signature(x), signature(w), signature(b), stride, options, path, stream_key())

    def prepare():
        if w.ndim != dims + 2:
            raise ValueError(f"{name}: w must be {dims + 2}-D, got shape {tuple(w.shape)}")
        return fft_conv_problem(name, x, w, b, pads_for, stride)
    return op.call(key, prepare, path, x, w, b)


def fft_shape(problem: FFTConvProblem, power_of_two: bool) -> tuple[int, ...]:
    """The transform size per spatial dim, at least 2: CuPy takes an array with a size-1 transform axis
    for F-order and refuses to plan its R2C/C2R transform; a longer transform of the zero-padded data
    gives the same convolution."""
    return tuple(1 << (n - 1).bit_length() if power_of_two else smooth_size(n)
                 for n in (max(2, p) for p in problem.padded))


_PAD = contracts.params("fft_conv.cu", "fft_pad_##SUFFIX")
_CROP = contracts.params("fft_conv.cu", "fft_crop_##SUFFIX")
_CMUL = contracts.params("fft_conv.cu", "fft_cmul")

# Up to this many channel pairs the contraction is one pass over the spectra (fft_cmul on the GPU, a
# broadcast multiply-and-sum on the host); above it, one batched GEMM over frequencies. A GEMM per
# frequency with C = K = 1 is millions of 1x1 products: on the H100 it made large single-channel
# convolutions several times slower than CuPy's fftconvolve (benchmarks/RESULTS.md, FFT convolution).
GEMM_CHANNEL_PAIRS = 16


def transform_bytes(problem: FFTConvProblem, shape: tuple[int, ...], real_bytes: int, broadcast: bool) -> int:
    """The bytes a call allocates for transforms of `shape` with reals of `real_bytes` (complex twice
    that): the padded inputs and outputs and their spectra, the GEMM's transposed copies when the
    channels take the GEMM, else (`broadcast`) the N·K·C product a broadcast multiply makes before its sum."""
    p = problem
    size, bins = math.prod(shape), math.prod(shape[:-1]) * (shape[-1] // 2 + 1)
    inputs, outputs = (p.N + p.K) * p.C, p.N * p.K
    total = (inputs + outputs) * (size * real_bytes + bins * 2 * real_bytes)
    if p.C * p.K > GEMM_CHANNEL_PAIRS:
        total += (inputs + p.K * p.C + outputs) * bins * 2 * real_bytes
    elif broadcast:
        total += p.N * p.K * p.C * bins * 2 * real_bytes
    return total + outputs * math.prod(p.out) * np.dtype(dtypes.parse(p.dtype)).itemsize


def _require(problem: FFTConvProblem, shape: tuple[int, ...], nbytes: int, device: str) -> None:
    memory.require(nbytes, device, problem.name, f"padding x {problem.spatial} to the FFT size {shape}")


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
    """The numpy path (and the GPU's for empty problems): real-to-complex transforms of size fft_shape."""
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


def _cufft_support(problem: FFTConvProblem) -> str | None:
    if reason := _gpu_support(problem):
        return reason
    if math.prod(fft_shape(problem, power_of_two=False)) > MAX_PADDED:
        return f"one transform of {fft_shape(problem, power_of_two=False)} points is more than cuFFT's int sizes hold"
    return None


@op.path("cufft", kind="library", device="gpu", supports=_cufft_support, binds=True)
def _cufft(problem, x, w, b):
    import cupy

    if min(problem.N, problem.C, problem.K) == 0:  # nothing to transform: CuPy's FFT handles empty axes
        return functools.partial(_real_fft_conv, problem, xp=cupy, compute=cupy.float32)
    return bind_cufft(problem, x, w, b)


def _planar(values: tuple) -> tuple:
    """A 1-D problem's size (L,) as the 2-D (1, L) the kernels take."""
    return values if len(values) == 2 else (1, *values)


def bind_cufft(problem: FFTConvProblem, x, w, b):
    """The cufft path's runner for arrays of this signature (see the module docstring for its launches)."""
    import cupy
    from cupy.cuda import cufft

    p = problem
    shape = fft_shape(p, power_of_two=False)
    _require(p, shape, transform_bytes(p, shape, 4, broadcast=False), "gpu")
    rows_in, rows_x, rows_y = (p.N + p.K) * p.C, p.N * p.C, p.N * p.K
    half = (*shape[:-1], shape[-1] // 2 + 1)  # the R2C spectrum's shape

    def workspaces():
        """The padded inputs, their spectra, the spectrum product and the inverse transform's output."""
        return (cupy.empty((rows_in, *shape), cupy.float32), cupy.empty((rows_in, *half), cupy.complex64),
                cupy.empty((rows_y, *half), cupy.complex64), cupy.empty((rows_y, *shape), cupy.float32))

    padded, spectra, product, back = first = workspaces()
    kept = first if sum(a.nbytes for a in first) <= KEEP_WORKSPACE_BYTES else None
    if len(shape) == 1:  # Plan1d made here, not taken from CuPy's plan cache: its work area is this call's
        forward = cufft.Plan1d(shape[0], cufft.CUFFT_R2C, rows_in)
        inverse = cufft.Plan1d(shape[0], cufft.CUFFT_C2R, rows_y)
    else:
        # get_fft_plan makes a PlanNd outside CuPy's plan cache, unless this thread's cache holds one of
        # the same layout already (cupy.fft made it): that one, and its work area, is then shared, as
        # cupy.fft's own calls share it across streams
        from cupyx.scipy.fftpack import get_fft_plan

        forward = get_fft_plan(padded, axes=(-2, -1), value_type="R2C")
        inverse = get_fft_plan(product, shape=shape, axes=(-2, -1), value_type="C2R")

    (H, W), (kh, kw), (OH, OW), (Fh, Fw) = (_planar(v) for v in (p.spatial, p.kernel, p.out, shape))
    ph, pw = (0,) * (2 - len(p.pads)) + tuple(before for before, _ in p.pads)  # a 1-D problem has no rows to pad
    suffix = dtypes.KERNEL_SUFFIX[p.dtype]
    pad = launch.bind("fft_conv.cu", f"fft_pad_{suffix}", (_grid(padded.size),), (256,),
                      _PAD.pack(x=launch.ARRAY, w=launch.ARRAY, out=launch.ARRAY, rows_x=rows_x, total=padded.size,
                                H=H, W=W, ph=ph, pw=pw, kh=kh, kw=kw, Fh=Fh, Fw=Fw))
    out_shape = (p.N, p.K, *p.out)
    crop = launch.bind("fft_conv.cu", f"fft_crop_{suffix}", (_grid(math.prod(out_shape)),), (256,),
                       _CROP.pack(y=launch.ARRAY, bias=launch.ARRAY, out=launch.ARRAY, total=math.prod(out_shape),
                                  K=p.K, OH=OH, OW=OW, Fh=Fh, Fw=Fw, scale=1 / math.prod(shape)))
    if p.C * p.K <= GEMM_CHANNEL_PAIRS:
        cmul = launch.bind("fft_conv.cu", "fft_cmul", (_grid(product.size),), (256,),
                           _CMUL.pack(spectra=launch.ARRAY, y=launch.ARRAY, N=p.N, C=p.C, K=p.K,
                                      bins=math.prod(half)))

        def multiply(spectra, product):
            cmul(spectra, product)
    else:
        def multiply(spectra, product):
            xf, wf = spectra[:rows_x].reshape(p.N, p.C, *half), spectra[rows_x:].reshape(p.K, p.C, *half)
            cupy.copyto(product.reshape(p.N, p.K, *half), _contract(xf, wf, cupy))

    dtype, forward_dir, inverse_dir = x.dtype, cufft.CUFFT_FORWARD, cufft.CUFFT_INVERSE
    strided = [a is not None and not a.flags.c_contiguous for a in (x, w, b)]
    lock = threading.Lock()

    def run(x, w, b):
        if any(strided):
            x, w, b = (cupy.ascontiguousarray(a) if s else a for a, s in zip((x, w, b), strided))
        y = cupy.empty(out_shape, dtype)
        with lock:  # kept workspaces (and the plans, which cuFFT does not share between threads): one call at a time
            padded, spectra, product, back = kept or workspaces()
            pad(x, w, padded)
            forward.fft(padded, spectra, forward_dir)
            multiply(spectra, product)
            inverse.fft(product, back, inverse_dir)
            crop(back, b, y)
        return y
    return run


def _grid(total: int) -> int:
    """Blocks of 256 for a grid-stride pass over `total` elements (capped: each thread loops)."""
    return max(1, min(-(-total // 256), launch.GRID_STRIDE_BLOCKS_X))


def _custom_support(problem: FFTConvProblem) -> str | None:
    if reason := _gpu_support(problem):
        return reason
    if max(fft_shape(problem, power_of_two=True)) > 2**MAX_LOG2N:
        return f"our FFT handles lengths up to 2**{MAX_LOG2N}"
    return None


@op.path("custom", kind="custom", device="gpu", supports=_custom_support, binds=True)
def _custom(problem, x, w, b):
    shape = fft_shape(problem, power_of_two=True)
    # complex64 buffers of the full size and their copies between axes: about the bytes of the float64
    # reals and complex128 half-spectra the reference counts
    _require(problem, shape, transform_bytes(problem, shape, 8, broadcast=True), "gpu")
    return functools.partial(_run_custom, problem, shape)


def _run_custom(problem, shape, x, w, b):
    import cupy

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
    shape = fft_shape(problem, power_of_two=False)
    _require(problem, shape, transform_bytes(problem, shape, 8, broadcast=True), "cpu")
    return _real_fft_conv(problem, x, w, b, np, np.float64)
