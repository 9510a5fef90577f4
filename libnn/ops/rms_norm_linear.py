"""rms_norm_linear: a pre-norm decoder's projection, linear(rms_norm(x)), optionally followed by SwiGLU, as one
op so that a decode step can run it as one kernel:

    n = rms_norm(x, norm_weight, eps=eps)          (..., K)  libnn.ops.rms_norm
    v = linear(n, w, b)                            (..., N)  libnn.ops.linear
        or, with w_scale, linear_fp8(n, w, w_scale, b)        libnn.ops.linear_fp8 (w E4M3 codes)
    y = v, or with glu="swiglu" swiglu(v)          (..., N) or (..., N / 2)  libnn.ops.swiglu

x is (..., K); norm_weight (K,); w (N, K) (a stacked QKV or gate_up weight); b (N,) or None; with
glu="swiglu", N is even and v's first half is the gate (Hugging Face's gate_proj rows first). Every array
in one dtype (w uint8 E4M3 codes and w_scale float32 (N,) or (1,) where given, as linear_fp8 takes them), on
one device; y in x's dtype, on x's device. This is LLaMA's input_layernorm → q/k/v
projection, post_attention_layernorm → gate_up → SwiGLU, and model.norm → lm_head.

Paths, in `auto` order:
- gemv:      one kernel where the unfused path runs three or more (benchmarks/RESULTS.md, fourteenth
             session): the RMS norm staged in front of the GEMV (n rounded to x's dtype, as rms_norm returns
             it) and SwiGLU in its epilogue. For weights in x's dtype, kernels/gemv.cu (linear's gemv path):
             one row of x (a batch-1 decode step), fp16/bf16, K a multiple of 8 to 24576, x, w and
             norm_weight 16-byte aligned. For E4M3 codes, linear_fp8's decode GEMV (kernels/gemv.cu's
             E4M3 kernel where K is a multiple of 16 and w 16-byte aligned, else kernels/linear_fp8.cu's
             version 3), n then quantised as linear_fp8 quantises x: one row too (version 3 takes up to
             8, but from 2 rows the unfused ops were faster on the H100).
             With glu, v is not rounded to x's dtype before SwiGLU (linear's output is, on the unfused
             path): the two differ by that rounding too, within the dtype's tolerance.
- unfused:   the ops above, each on its own `auto` path (cuBLASLt for the GEMM from 2 rows on).
- reference: the ops' reference paths (NumPy in float64, each rounded to x's dtype as the unfused ops
             round).

`prefetch` is linear's hint (libnn/ops/linear.py, runtime/l2_prefetch.py): what the next kernel reads
first, which the gemv path prefetches into L2 and the unfused path passes to its linear (or linear_fp8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.ops import row_kernels
from libnn.ops.linear import bind_gemv_kernel, gemv_support, linear, read_in_place, refuse_unaligned_gemv
from libnn.ops.linear_fp8 import GPU_DTYPES as FP8_DTYPES, bind_decode_gemv_kernel, gemv3_support, linear_fp8
from libnn.ops.quantize_fp8 import fp8_gpu_missing
from libnn.ops.rms_norm import rms_norm
from libnn.ops.swiglu import swiglu
from libnn.registry import Op
from libnn.runtime import l2_prefetch, memory
from libnn.runtime.arrays import (allocator, as_array, copying_strided, device_of, refuse_misaligned, signature,
                                  stream_key)
from libnn.runtime.device import gpu_index

GLUS = (None, "swiglu")
DTYPES = ("fp16", "bf16", "fp32", "fp64")

op = Op("rms_norm_linear", order=("gemv", "unfused", "reference"))


@dataclass(frozen=True)
class RMSNormLinearProblem:
    """Everything that decides how an rms_norm_linear call runs."""
    M: int
    N: int
    K: int
    dtype: str            # short name: fp16, bf16, fp32, fp64
    has_bias: bool
    glu: str | None
    eps: float
    device: str           # "cpu" or "gpu:N"
    e4m3: bool = False    # w holds E4M3 codes scaled by w_scale
    per_channel: bool = False  # with e4m3: w_scale (N,) with N > 1; else one scale
    # bytes of each array of the prefetch hint (runtime/l2_prefetch.py); not part of equality or the hash: a
    # library plan keyed by the problem is the same with and without a hint
    prefetch: tuple[int, ...] = field(default=(), compare=False)

    @property
    def out_features(self) -> int:
        return self.N // 2 if self.glu else self.N

    def describe(self) -> str:
        extras = "+".join(filter(None, ["bias" if self.has_bias else None, self.glu])) or "no epilogue"
        weight = " (E4M3 weight)" if self.e4m3 else ""
        return f"rms_norm_linear M={self.M} N={self.N} K={self.K} {self.dtype}{weight} ({extras})"

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes((self.M, self.out_features), dtypes.parse(self.dtype))


def rms_norm_linear_problem(x, norm_weight, w, b, w_scale, eps, glu, prefetch: tuple = ()) -> RMSNormLinearProblem:
    """The checked problem of an rms_norm_linear call (errors name the op and the argument)."""
    where = "rms_norm_linear"
    if x.ndim < 1:
        raise ValueError(f"{where}: x must have at least 1 dimension (..., in_features), got a 0-d array")
    if not dtypes.is_float(x.dtype) or dtypes.short_name(x.dtype) not in DTYPES:
        raise TypeError(f"{where}: x must be a floating-point array ({', '.join(DTYPES)}), got {x.dtype}")
    if w.ndim != 2:
        raise ValueError(f"{where}: w must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"{where}: x has {x.shape[-1]} features in its last dimension but w has {K} "
                         f"(w is (out_features, in_features) = {tuple(w.shape)}, x is {tuple(x.shape)})")
    if tuple(norm_weight.shape) != (K,):
        raise ValueError(f"{where}: norm_weight must have shape ({K},), x's features, got {tuple(norm_weight.shape)}")
    if b is not None and tuple(b.shape) != (N,):
        raise ValueError(f"{where}: b must have shape ({N},) to match w's out_features, got {tuple(b.shape)}")
    if w_scale is not None:
        if w.dtype != np.uint8:
            raise TypeError(f"{where}: with w_scale, w must be uint8 E4M3 codes (what quantize_weight returns), "
                            f"got dtype {w.dtype}")
        if w_scale.dtype != np.float32 or tuple(w_scale.shape) not in ((1,), (N,)):
            raise TypeError(f"{where}: w_scale must be float32 of shape (1,) (per tensor) or ({N},) (per output "
                            f"channel); got dtype {w_scale.dtype} and shape {tuple(w_scale.shape)}")
    for name, a in (("norm_weight", norm_weight), ("w", None if w_scale is not None else w), ("b", b)):
        if a is not None and a.dtype != x.dtype:
            raise TypeError(f"{where}: {name} has dtype {dtypes.short_name(a.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    if glu not in GLUS:
        raise ValueError(f"{where}: glu must be one of {list(GLUS)}, got {glu!r}")
    if glu and N % 2:
        raise ValueError(f"{where}: with glu={glu!r} w's out_features must be even (gate and up halves), got {N}")
    row_kernels.check_eps(where, eps)
    device = device_of({"x": x, "norm_weight": norm_weight, "w": w, "b": b, "w_scale": w_scale}, where)
    return RMSNormLinearProblem(M=math.prod(x.shape[:-1]), N=N, K=K, dtype=dtypes.short_name(x.dtype),
                                has_bias=b is not None, glu=glu, eps=float(eps), device=device,
                                e4m3=w_scale is not None, per_channel=w_scale is not None and w_scale.shape[0] > 1,
                                prefetch=l2_prefetch.prefetch_bytes(where, prefetch, device))


def rms_norm_linear(x: Any, norm_weight: Any, w: Any, b: Any = None, *, w_scale: Any = None, eps: float = 1e-6,
                    glu: str | None = None, prefetch: Any = None, path: str = "auto") -> Any:
    """linear(rms_norm(x, norm_weight, eps=eps), w, b), or with w_scale linear_fp8(..., w, w_scale, b) for w
    in E4M3 codes, then swiglu where glu="swiglu", for x (..., K), norm_weight (K,), w (N, K), b (N,) or
    None; returns a new (..., N) array, (..., N / 2) with glu, in x's dtype, on x's device. `prefetch`:
    None, or what the next kernel reads first (the module docstring). `path` is "auto" or one of
    `libnn.paths("rms_norm_linear")`."""
    where = "rms_norm_linear"
    x, g, w = as_array(x, where, "x"), as_array(norm_weight, where, "norm_weight"), as_array(w, where, "w")
    b = None if b is None else as_array(b, where, "b")
    s = None if w_scale is None else as_array(w_scale, where, "w_scale")
    key = (signature(x), signature(g), signature(w), None if b is None else signature(b),
           None if s is None else signature(s), eps, glu, path, stream_key())
    if prefetch is None:
        return op.call(key, rms_norm_linear_problem, path, x, g, w, b, s, checks=(x, g, w, b, s, eps, glu))
    pf = l2_prefetch.hinted_arrays(where, prefetch)
    return op.call((*key, *map(signature, pf)), rms_norm_linear_problem, path, x, g, w, b, s, pf,
                   checks=(x, g, w, b, s, eps, glu, pf))


# --- gemv path: kernels/gemv.cu, or for E4M3 codes linear_fp8's decode GEMV -------------------------------------
# (their launches: libnn.ops.linear.bind_gemv_kernel and libnn.ops.linear_fp8.bind_decode_gemv_kernel)
def _gemv_support(problem: RMSNormLinearProblem) -> str | None:
    if not problem.e4m3:
        return gemv_support(problem.M, problem.N, problem.K, problem.dtype)
    if problem.dtype not in FP8_DTYPES:
        return f"dtype {problem.dtype} is not supported with E4M3 weights (supported: {', '.join(FP8_DTYPES)})"
    if problem.M != 1:
        return (f"M={problem.M}: with E4M3 weights the fused GEMV takes one row; from 2 rows every block's "
                f"normalising x costs more than rms_norm's own kernel (benchmarks/RESULTS.md)")
    return fp8_gpu_missing(gpu_index(problem.device)) or gemv3_support(problem.M, problem.N, problem.K)


@op.path("gemv", kind="custom", device="gpu", supports=_gemv_support, binds=True)
def _gemv(problem: RMSNormLinearProblem, x, g, w, b, s, pf=()):
    """One launch for x of any leading shape; strided arrays are copied first."""
    glu = problem.glu is not None
    early_start = read_in_place(g, w, s)  # what the kernel reads before its wait: copying_strided copies it per call
    if problem.e4m3:
        kernel = bind_decode_gemv_kernel(problem.dtype, problem.M, problem.N, problem.K, problem.per_channel, None,
                                         problem.device, w, glu, problem.eps, problem.prefetch, early_start)
    else:
        # a strided array is copied (256-byte aligned) at every call: only the others' pointers matter
        refuse_unaligned_gemv(*(a if a.flags.c_contiguous else None for a in (x, w)))
        refuse_misaligned("kernels/gemv.cu needs norm_weight 16-byte aligned",
                          {"norm_weight": g if g.flags.c_contiguous else None})
        gemv = bind_gemv_kernel(problem.dtype, problem.N, problem.K, None, glu, problem.device, problem.eps,
                                problem.prefetch, early_start=early_start)

        def kernel(x, w, s, b, r, g, y, *pf):
            gemv(x, w, b, r, g, y, *pf)
    new = allocator((*x.shape[:-1], problem.out_features), x.dtype)

    def run(x, g, w, b, s, pf=()):
        y = new()
        kernel(x, w, s, b, None, g, y, *pf)
        return y
    return copying_strided(run, x, g, w, b, s)


# --- unfused and reference paths: the ops in turn --------------------------------------------------------
def _composed(sub_path: str):
    """rms_norm, linear (or linear_fp8) and swiglu in turn, each on `sub_path`."""
    def run(problem: RMSNormLinearProblem, x, g, w, b, s, pf=None):
        n = rms_norm(x, g, eps=problem.eps, path=sub_path)
        v = (linear(n, w, b, prefetch=pf, path=sub_path) if s is None
             else linear_fp8(n, w, s, b, prefetch=pf, path=sub_path))
        return swiglu(v, path=sub_path) if problem.glu else v
    return run


op.path("unfused", kind="library", device="gpu")(_composed("auto"))
op.path("reference", kind="reference", device="cpu")(_composed("reference"))
