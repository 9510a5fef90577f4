"""cuBLASLt GEMMs with fused epilogues, through nvmath-python's stateful Matmul.

Layout. cuBLASLt's bias epilogue adds a vector along the rows of its result (the M of A), and libnn's
bias runs along the output features. So libnn computes the transposed product
    y.T (N, M) = w (N, K) @ x.T (K, M)
where x.T is a free view of the row-major x, and writes it into y.T, the column-major view of a
row-major (M, N) output buffer allocated from CuPy's pool. The output never needs a copy.

Plans. A `GemmPlan` (one nvmath Matmul, planned once) is cached per problem, operand alignment,
device and stream. Alignment is part of the key because cuBLASLt picks kernels for the alignment of
the pointers seen at planning time. nvmath does the planning (heuristics, descriptors, algorithms);
the hot call then goes straight to `cublasLtMatmul` through nvmath's low-level bindings with the
plan's descriptors, because `Matmul.execute` spends tens of microseconds per call on bookkeeping
(a new event, logging checks, workspace checks) that a cached inference plan does not need.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from libnn.config import config
from libnn.errors import LibraryError
from libnn.runtime.cache import PlanCache
from libnn.runtime.device import current_device_id
from libnn.runtime.handles import cublaslt_handle, workspace
from libnn.runtime.stream import current_stream

# nvmath logs to the root logger unless given one; a logger of our own keeps its INFO lines (and
# their cost) out of the application's logs.
_log = logging.getLogger("libnn.nvmath")
_log.setLevel(logging.WARNING)

_plans: PlanCache = PlanCache("cublaslt plans")


def _alignment(a: Any) -> int:
    ptr = a.data.ptr
    return min(256, ptr & -ptr) if ptr else 256


def _epilog(has_bias: bool, activation: str | None):
    from nvmath.linalg.advanced import MatmulEpilog

    name = {(False, None): None, (False, "relu"): "RELU", (False, "gelu"): "GELU",
            (True, None): "BIAS", (True, "relu"): "RELU_BIAS", (True, "gelu"): "GELU_BIAS"}[has_bias, activation]
    return None if name is None else getattr(MatmulEpilog, name)


@dataclass
class Candidate:
    """One algorithm cuBLASLt's heuristic offered for a plan."""
    index: int
    algorithm: Any                      # nvmath Algorithm
    time_ms: float | None = None        # measured by `GemmPlan.autotune`

    def describe(self) -> dict[str, Any]:
        a = self.algorithm
        return {"index": self.index, "algo_id": a.algorithm_id, "tile": _show(a.tile), "stages": _show(a.stages),
                "split_k": a.split_k, "reduction": a.reduction_scheme, "swizzle": a.cta_swizzling,
                "cluster": _show(getattr(a, "cluster_shape", None)),
                "workspace_MiB": getattr(a.algorithm, "workspace_size", 0) / 2**20,
                "waves": getattr(a.algorithm, "waves_count", None), "time_ms": self.time_ms}


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "x".join(str(v) for v in value)
    return str(getattr(value, "name", value))


@dataclass
class GemmPlan:
    problem: Any
    matmul: Any
    candidates: list[Candidate]
    chosen: int = 0                     # index into candidates; 0 is the heuristic's first choice
    plan_seconds: float = 0.0

    def run(self, x, w, b, y, stream_ptr: int) -> None:
        from nvmath.bindings import cublasLt

        m = self.matmul
        if b is not None and b.data.ptr != self._bias_ptr:
            m.mm_desc_ifc.bias_pointer = self._bias_ptr = b.data.ptr
        space = workspace(self._workspace_bytes, self._device_id, stream_ptr)
        try:
            cublasLt.matmul(m.handle, m.mm_desc, self._alpha, w.data.ptr, m.a_layout_ptr, x.data.ptr,
                            m.b_layout_ptr, self._beta, y.data.ptr, m.c_layout_ptr, y.data.ptr, m.d_layout_ptr,
                            self._algo, space.data.ptr, self._workspace_bytes, stream_ptr)
        except cublasLt.cuBLASLtError as exc:
            raise LibraryError(f"cuBLASLt matmul failed for {self.problem.describe()}: {exc}") from exc

    def choose(self, index: int) -> None:
        """Run candidate `index` from now on."""
        self.chosen = index
        self._algo = self.matmul.algorithm_object_to_buffer[self.candidates[index].algorithm]["algo"].ctypes.data

    def __post_init__(self) -> None:
        # host pointers the matmul call needs, read once: numpy's .ctypes costs microseconds per access
        self._alpha, self._beta = self.matmul.alpha.ctypes.data, self.matmul.beta.ctypes.data
        self._workspace_bytes = self.matmul.workspace.size
        self._device_id = int(self.problem.device.split(":")[1])
        self._bias_ptr = None
        self.choose(self.chosen)

    def autotune(self, x, w, b, y, runs: int = 10) -> None:
        """Time every candidate on these operands (median of `runs`, CUDA events) and keep the fastest."""
        from libnn.bench.harness import time_gpu

        stream_ptr = current_stream().ptr
        for c in self.candidates:
            self.choose(c.index)
            c.time_ms = time_gpu(lambda _: self.run(x, w, b, y, stream_ptr), [None], warmup=2, runs=runs).median_ms
        self.choose(min(range(len(self.candidates)), key=lambda i: self.candidates[i].time_ms))


def _build(problem, x, w, b, y) -> GemmPlan:
    import time

    from nvmath.linalg.advanced import Matmul, MatmulComputeType, MatmulOptions

    compute_type = MatmulComputeType.COMPUTE_32F_FAST_TF32 if problem.dtype == "fp32" and problem.allow_tf32 else None
    options = MatmulOptions(inplace=True, compute_type=compute_type, logger=_log, handle=cublaslt_handle(),
                            memory_limit=config.cublaslt_workspace_bytes, device_id=current_device_id())
    start = time.perf_counter()
    try:
        matmul = Matmul(w, x.T, c=y.T, beta=0.0, options=options, stream=current_stream())
        epilog = _epilog(problem.has_bias, problem.activation)
        algorithms = matmul.plan(epilog=epilog, epilog_inputs={"bias": b} if b is not None else None,
                                 stream=current_stream())
    except Exception as exc:  # cuBLASLtError, "Planning failed to find any suitable algorithm", ...
        raise LibraryError(f"cuBLASLt cannot plan {problem.describe()}: {type(exc).__name__}: {exc}") from exc
    matmul.release_operands()  # the plan keeps descriptors, not the first call's arrays
    plan = GemmPlan(problem, matmul, [Candidate(i, a) for i, a in enumerate(algorithms)],
                    plan_seconds=time.perf_counter() - start)
    if config.autotune and len(plan.candidates) > 1:
        plan.autotune(x, w, b, y)
    return plan


def plan_for(problem, x, w, b, y, stream_ptr: int) -> GemmPlan:
    """The plan for `problem` with these operands' alignment on the given stream (the device is in
    the problem)."""
    key = (problem, _alignment(x), _alignment(w), b is not None and _alignment(b), stream_ptr)
    return _plans.get(key, lambda: _build(problem, x, w, b, y))


def linear(problem, x, w, b):
    """y = act(x @ w.T + b) on cuBLASLt; x (M, K), w (N, K), b (N,) C-contiguous CuPy arrays."""
    import cupy

    y = cupy.empty((problem.M, problem.N), x.dtype)  # pool memory: always 256-byte aligned
    stream_ptr = current_stream().ptr
    plan_for(problem, x, w, b, y, stream_ptr).run(x, w, b, y, stream_ptr)
    return y
