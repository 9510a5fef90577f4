"""rms_norm_linear: a pre-norm decoder's projection, linear(rms_norm(x)), optionally followed by SwiGLU, as one
op so that a decode step can run it as one kernel:

    n = rms_norm(x, norm_weight, eps=eps)          (..., K)  libnn.ops.rms_norm
    v = linear(n, w, b)                            (..., N)  libnn.ops.linear
    y = v, or with glu="swiglu" swiglu(v)          (..., N) or (..., N / 2)  libnn.ops.swiglu

x is (..., K); norm_weight (K,); w (N, K) (a stacked QKV or gate_up weight); b (N,) or None; with
glu="swiglu", N is even and v's first half is the gate (Hugging Face's gate_proj rows first). Every array
in one dtype, on one device; y in x's dtype, on x's device. This is LLaMA's input_layernorm → q/k/v
projection, post_attention_layernorm → gate_up → SwiGLU, and model.norm → lm_head.

Paths, in `auto` order:
- gemv:      one row of x (a batch-1 decode step), fp16/bf16, K a multiple of 8 up to 24576, x, w and
             norm_weight 16-byte aligned: kernels/gemv.cu with the RMS norm staged in front of the GEMV
             (n rounded to x's dtype, as rms_norm returns it) and SwiGLU in its epilogue: one kernel where
             the unfused path runs three (benchmarks/RESULTS.md, fourteenth session).
- unfused:   the three ops above, each on its own `auto` path (cuBLASLt for the GEMM from 2 rows on).
- reference: the three ops' reference paths (NumPy in float64, each rounded to x's dtype as the unfused
             ops round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.errors import LibraryError
from libnn.ops.linear import bind_gemv_kernel, gemv_support, linear, refuse_unaligned_gemv
from libnn.ops.rms_norm import rms_norm
from libnn.ops.swiglu import swiglu
from libnn.registry import Op
from libnn.runtime import memory
from libnn.runtime.arrays import allocator, as_array, contiguous, copying_strided, device_of, signature, stream_key

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

    @property
    def out_features(self) -> int:
        return self.N // 2 if self.glu else self.N

    def describe(self) -> str:
        extras = "+".join(filter(None, ["bias" if self.has_bias else None, self.glu])) or "no epilogue"
        return f"rms_norm_linear M={self.M} N={self.N} K={self.K} {self.dtype} ({extras})"

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes((self.M, self.out_features), dtypes.parse(self.dtype))


def rms_norm_linear_problem(x, norm_weight, w, b, eps, glu) -> RMSNormLinearProblem:
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
    for name, a in (("norm_weight", norm_weight), ("w", w), ("b", b)):
        if a is not None and a.dtype != x.dtype:
            raise TypeError(f"{where}: {name} has dtype {dtypes.short_name(a.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
    if glu not in GLUS:
        raise ValueError(f"{where}: glu must be one of {list(GLUS)}, got {glu!r}")
    if glu and N % 2:
        raise ValueError(f"{where}: with glu={glu!r} w's out_features must be even (gate and up halves), got {N}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) or not eps > 0 \
            or not math.isfinite(eps):
        raise ValueError(f"{where}: eps must be a finite number > 0, got {eps!r}")
    device = device_of({"x": x, "norm_weight": norm_weight, "w": w, "b": b}, where)
    return RMSNormLinearProblem(M=math.prod(x.shape[:-1]), N=N, K=K, dtype=dtypes.short_name(x.dtype),
                                has_bias=b is not None, glu=glu, eps=float(eps), device=device)


def rms_norm_linear(x: Any, norm_weight: Any, w: Any, b: Any = None, *, eps: float = 1e-6, glu: str | None = None,
                    path: str = "auto") -> Any:
    """linear(rms_norm(x, norm_weight, eps=eps), w, b), then swiglu where glu="swiglu", for x (..., K),
    norm_weight (K,), w (N, K), b (N,) or None; returns a new (..., N) array, (..., N / 2) with glu, in x's
    dtype, on x's device. `path` is "auto" or one of `libnn.paths("rms_norm_linear")`."""
    where = "rms_norm_linear"
    x, g, w = as_array(x, where, "x"), as_array(norm_weight, where, "norm_weight"), as_array(w, where, "w")
    b = None if b is None else as_array(b, where, "b")
    key = (signature(x), signature(g), signature(w), None if b is None else signature(b), eps, glu, path,
           stream_key())
    return op.call(key, rms_norm_linear_problem, path, x, g, w, b, checks=(x, g, w, b, eps, glu))


# --- gemv path: kernels/gemv.cu (its launch: libnn.ops.linear.bind_gemv_kernel) ----------------------------
def _gemv_support(problem: RMSNormLinearProblem) -> str | None:
    return gemv_support(problem.M, problem.K, problem.dtype)


@op.path("gemv", kind="custom", device="gpu", supports=_gemv_support, binds=True)
def _gemv(problem: RMSNormLinearProblem, x, g, w, b):
    """One launch for x of any leading shape holding one row; strided arrays are copied first."""
    refuse_unaligned_gemv(contiguous(x), contiguous(w))
    if contiguous(g).data.ptr % 16:
        raise LibraryError("kernels/gemv.cu needs norm_weight 16-byte aligned; it is not")
    kernel = bind_gemv_kernel(problem.dtype, problem.N, problem.K, None, problem.glu is not None,
                                        problem.device, problem.eps)
    new = allocator((*x.shape[:-1], problem.out_features), x.dtype)

    def run(x, g, w, b):
        y = new()
        kernel(x, w, b, None, g, y)
        return y
    return copying_strided(run, x, g, w, b)


# --- unfused and reference paths: the three ops ---------------------------------------------------------
def _composed(sub_path: str):
    """rms_norm, linear and swiglu in turn, each on `sub_path`."""
    def run(problem: RMSNormLinearProblem, x, g, w, b):
        v = linear(rms_norm(x, g, eps=problem.eps, path=sub_path), w, b, path=sub_path)
        return swiglu(v, path=sub_path) if problem.glu else v
    return run


op.path("unfused", kind="library", device="gpu")(_composed("auto"))
op.path("reference", kind="reference", device="cpu")(_composed("reference"))
