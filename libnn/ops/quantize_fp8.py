"""FP8 (E4M3) quantisation: the encoding, weights quantised once at load, activations quantised per call.

E4M3 ("E4M3FN" in OCP's FP8 specification, cuBLASLt's CUDA_R_8F_E4M3) has 1 sign, 4 exponent (bias 7) and
3 mantissa bits, no infinity, NaN at S.1111.111, 448 as its largest finite value and 2^-9 as its smallest
subnormal. CuPy and NumPy have no float8 dtype, so E4M3 values live here as their codes in uint8 arrays,
each with a float32 scale: the value is scale · e4m3(code).

- `encode_e4m3(q)` / `decode_e4m3(codes)`: codes of fp32 values (round to nearest even; |q| beyond 448
  saturates to ±448; NaN and ±inf become NaN, E4M3 having no infinity) and back, exactly. The same array
  operations in NumPy and CuPy, and the same fp32 operations as kernels/quantize_fp8.cu, whose opening
  comment gives the formula: NumPy and the kernel agree bit for bit. (CuPy compiles its elementwise
  kernels to flush fp32 subnormals to zero: a weight row whose largest magnitude is below 448 · 2^-126,
  whose scale would be subnormal, quantises to zeros there; nothing else differs.)
- `quantize_weight(w, per_channel=True)` → `Fp8Weight(data, scale)`: a weight (N, K) quantised once, at
  load, with one scale per output channel (scale (N,): w[n] / (max|w[n]| / 448)) or per tensor (scale (1,)),
  on w's device (CuPy's elementwise ops on the GPU). Per channel is the default: it is more accurate and
  weights stacked along N (Q, K and V; gate and up) stay exactly quantised when their codes and scales
  are concatenated.
- `quantize_fp8(x)` → `(codes, scale)`: activations, one scale for the whole tensor (max|x| / 448, 1 for
  all zeros; NaN and inf take no part in it), NumPy on the host, kernels/quantize_fp8.cu on the GPU, where
  the scale is computed and kept in device memory: nothing comes back to the host, so linear_fp8's call
  can be captured in a CUDA graph. `bind_quantize` is the bound form linear_fp8's GPU paths run.
- `fp8_gpu_missing(device_id)`: why a GPU cannot run FP8 GEMMs (compute capability below 8.9), or None.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from libnn import dtypes
from libnn.errors import LibnnError
from libnn.runtime import contracts, launch, memory
from libnn.runtime.arrays import array_module, as_array, contiguous, is_cupy
from libnn.runtime.device import compute_capability

E4M3_MAX = 448.0
FP8_MIN_CAPABILITY = (8, 9)  # Ada; Hopper is 9.0: the first GPUs whose tensor cores take E4M3
_F32_MAX = float(np.finfo(np.float32).max)
_NAN_CODE = 0x7F


class Fp8Weight(NamedTuple):
    """A weight in E4M3: `data` (N, K) uint8 codes and `scale` float32, (N,) per output channel or (1,)
    per tensor; the weight is scale[n or 0] · e4m3(data[n, k]). `linear_fp8(x, *weight, b)` takes it."""
    data: Any
    scale: Any


def _e4m3_values() -> np.ndarray:
    """The value of every code 0..255, in float32 (exact)."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 15, codes & 7
    magnitude = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    magnitude[(e == 15) & (m == 7)] = np.nan
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def encode_e4m3(q: Any) -> Any:
    """The E4M3 codes (uint8) of fp32 array `q`, on its device (see the module docstring)."""
    xp = array_module(q)
    q = xp.ascontiguousarray(q, dtype=xp.float32)
    sign = ((q.view(xp.uint32) >> 24) & 0x80).astype(xp.uint8)
    a = xp.abs(q)
    finite = a <= _F32_MAX  # False for NaN and inf
    a = xp.where(finite, xp.minimum(a, xp.float32(E4M3_MAX)), xp.float32(0))
    # E = floor(log2 a) read from the exponent bits, clamped to E4M3's normal range: E = -6 is also the
    # subnormals' scale, and r = 16 carries into the next exponent in 8E + 48 + r by itself
    exponent = xp.clip((a.view(xp.uint32) >> 23).astype(xp.int32) - 127, -6, 8)
    power = ((130 - exponent).astype(xp.uint32) << 23).view(xp.float32)  # 2^(3 - E), exact
    r = xp.rint(a * power).astype(xp.int32)                                # half to even
    code = (8 * exponent + 48 + r).astype(xp.uint8)
    return xp.where(finite, code, xp.uint8(_NAN_CODE)).astype(xp.uint8) | sign


def decode_e4m3(codes: Any) -> Any:
    """The float32 values of E4M3 codes (uint8), on their device; NaN for 0x7f and 0xff."""
    xp = array_module(codes)
    return xp.asarray(E4M3_VALUES)[codes]


def finite_amax(a: Any, axis: int | None = None) -> Any:
    """max |a| over the finite elements (0 where there are none), in float32, along `axis` (None: all)."""
    xp = array_module(a)
    magnitude = xp.abs(a.astype(xp.float32))
    magnitude = xp.where(magnitude <= _F32_MAX, magnitude, xp.float32(0))
    if magnitude.size == 0:
        shape = () if axis is None else tuple(n for i, n in enumerate(a.shape) if i != axis % a.ndim)
        return xp.zeros(shape, xp.float32)
    return magnitude.max(axis=axis)


def scale_of(amax: Any) -> Any:
    """amax / 448 in float32 (rounded to nearest), 1 where that is not > 0: the scale that maps the
    largest finite magnitude onto E4M3's largest value."""
    xp = array_module(amax)
    s = xp.asarray(amax, dtype=xp.float32) / xp.float32(E4M3_MAX)
    return xp.where(s > 0, s, xp.float32(1)).astype(xp.float32)


def quantize_weight(w: Any, *, per_channel: bool = True) -> Fp8Weight:
    """`w` (N, K), a floating-point NumPy or CuPy array, as E4M3 codes and float32 scales on its device:
    scale[n] = max|w[n]| / 448 with `per_channel` (scale (N,)), else one scale (1,) for the whole
    matrix; data = e4m3(w / scale). fp64 weights are rounded to fp32 first."""
    w = as_array(w, "quantize_weight", "w")
    if not isinstance(per_channel, (bool, np.bool_)):
        raise TypeError(f"quantize_weight: per_channel must be True or False, got {type(per_channel).__name__} "
                        f"{per_channel!r}")
    if w.ndim != 2:
        raise ValueError(f"quantize_weight: w must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if not dtypes.is_float(w.dtype):
        raise TypeError(f"quantize_weight: w must be a floating-point array (fp16, bf16, fp32, fp64), got {w.dtype}")
    xp = array_module(w)
    w32 = w.astype(xp.float32)
    if per_channel:
        scale = scale_of(finite_amax(w32, axis=1))
        return Fp8Weight(encode_e4m3(w32 / scale[:, None]), scale)
    scale = scale_of(finite_amax(w32)).reshape(1)
    return Fp8Weight(encode_e4m3(w32 / scale), scale)


def quantize_fp8(x: Any) -> tuple[Any, Any]:
    """(codes, scale) of `x` quantised to E4M3 with one scale for the tensor: codes uint8 of x's shape,
    scale float32 (1,), both on x's device (kernels/quantize_fp8.cu on the GPU, for fp16, bf16 and fp32;
    NumPy on the host, for any floating-point dtype). x ≈ scale · decode_e4m3(codes)."""
    x = as_array(x, "quantize_fp8", "x")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"quantize_fp8: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    if not is_cupy(x):
        memory.require(3 * 4 * x.size, "cpu", "quantize_fp8", f"x of shape {tuple(x.shape)} in float32 (3 copies)")
        scale = scale_of(finite_amax(x)).reshape(1)
        return encode_e4m3(x.astype(np.float32) / scale), scale
    import cupy

    name = dtypes.short_name(x.dtype)
    if name not in dtypes.KERNEL_SUFFIX:
        raise TypeError(f"quantize_fp8: x on the GPU must be fp16, bf16 or fp32, got {name}")
    q = cupy.empty(x.shape, cupy.uint8)
    if x.size == 0:
        return q, cupy.ones(1, cupy.float32)
    run, scale = bind_quantize(name, x.size, 1)
    run(contiguous(x), q)
    return q, scale


# --- the GPU quantiser: kernels/quantize_fp8.cu ------------------------------------------------------------
_AMAX = contracts.params("quantize_fp8.cu", "FP8_AMAX_PARAMS")
_QUANTIZE = contracts.params("quantize_fp8.cu", "FP8_QUANTIZE_PARAMS")
_Q = contracts.constants("quantize_fp8.cu")


def quantize_grids(total: int) -> tuple[int, int]:
    """The grids of kernels/quantize_fp8.cu's two kernels for `total` elements (its LAUNCH table)."""
    blocks = math.ceil(total / _Q["FP8_THREADS"])
    return min(blocks, _Q["FP8_MAX_PARTIALS"]), min(blocks, _Q["FP8_MAX_QUANT_BLOCKS"])


def bind_quantize(dtype: str, total: int, scale_count: int) -> tuple[Callable[[Any, Any], None], Any]:
    """(run, scale) for quantising C-contiguous CuPy arrays of `total` (>= 1) elements of `dtype` (fp16,
    bf16, fp32) on the current stream: run(x, q) writes x's codes into q (uint8, `total` elements) and
    its scale into `scale`, a float32 device array of `scale_count` copies of it that this runner owns
    and rewrites at every call (work on one stream is ordered, so the next call's GEMM reads its own).
    Two packed launches; the scale and the partial maxima between them stay on the GPU."""
    import cupy

    partials, blocks = quantize_grids(total)
    scratch = cupy.empty(scale_count + partials, cupy.float32)
    scale, partial = scratch[:scale_count], scratch[scale_count:]
    suffix, threads = dtypes.KERNEL_SUFFIX[dtype], (_Q["FP8_THREADS"],)
    amax = launch.bind("quantize_fp8.cu", f"fp8_amax_{suffix}", (partials,), threads,
                       _AMAX.pack(x=launch.ARRAY, partial=np.uint64(partial.data.ptr), total=total))
    encode = launch.bind("quantize_fp8.cu", f"fp8_quantize_{suffix}", (blocks,), threads,
                         _QUANTIZE.pack(x=launch.ARRAY, q=launch.ARRAY, scale=np.uint64(scale.data.ptr),
                                        partial=np.uint64(partial.data.ptr), partials=partials, total=total,
                                        scale_count=scale_count))

    def run(x, q):
        amax(x)
        encode(x, q)
    run.scratch = scratch  # held with the runner: the launches point into it
    return run, scale


def fp8_gpu_missing(device_id: int) -> str | None:
    """None if GPU `device_id` runs FP8 (E4M3) GEMMs (compute capability 8.9 or newer: Ada, Hopper,
    Blackwell), else why not."""
    cc = compute_capability(device_id)
    if cc >= FP8_MIN_CAPABILITY:
        return None
    return (f"FP8 (E4M3) needs a GPU of compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer "
            f"(Ada, Hopper, Blackwell); GPU {device_id} is sm_{cc[0]}{cc[1]}")


def require_fp8_gpu(where: str, device_id: int) -> None:
    """Refuse FP8 on a GPU older than compute capability 8.9, naming `where` (a function or layer)."""
    if reason := fp8_gpu_missing(device_id):
        raise LibnnError(f"{where}: {reason}")


QUANTIZED_DTYPES = ("fp8",)  # what Module.quantize takes


def check_quantize(where: str, dtype: Any, per_channel: Any, arrays: Any) -> None:
    """The arguments of a layer's quantize(dtype, per_channel=) and the GPUs its parameters `arrays` are
    on, checked before anything is quantised: a refusal leaves the model as it was."""
    if not isinstance(dtype, str) or dtype.lower() not in QUANTIZED_DTYPES:
        raise ValueError(f"{where}: dtype must be one of {QUANTIZED_DTYPES} (E4M3 weights with float32 scales), "
                         f"got {dtype!r}")
    if not isinstance(per_channel, (bool, np.bool_)):
        raise TypeError(f"{where}: per_channel must be True or False, got {type(per_channel).__name__} {per_channel!r}")
    for device_id in sorted({a.data.device_id for a in arrays if is_cupy(a)}):
        require_fp8_gpu(where, device_id)
