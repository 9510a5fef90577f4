"""cuBLASLt GEMMs with fused epilogues, through nvmath-python's stateful Matmul.

Layout. cuBLASLt's bias epilogue adds a vector along the rows of its result (the M of A), and libnn's
bias runs along the output features. So libnn computes the transposed product
    y.T (N, M) = w (N, K) @ x.T (K, M)
where x.T is a free view of the row-major x, and writes it into y.T, the column-major view of a
row-major (M, N) output buffer allocated from CuPy's pool. The output never needs a copy.

Residual. cuBLASLt computes D = epilogue(alpha·A·B + beta·C + bias). A residual r (the output's shape)
is C, with beta = 1, read through r.T as y is written through y.T; D is the fresh output (C and D
distinct, one layout). Without one, C is D itself and beta = 0.

Plans. A `GemmPlan` (one nvmath Matmul, planned once) is cached per problem, operand alignment,
device and stream. Alignment is part of the key because cuBLASLt picks kernels for the alignment of
the pointers seen at planning time (the residual's included: it is planned as C). nvmath does the
planning (heuristics, descriptors, algorithms); the hot call then goes straight to `cublasLtMatmul`
through nvmath's low-level bindings with the plan's descriptors, because `Matmul.execute` spends tens of
microseconds per call on bookkeeping (a new event, logging checks, workspace checks) that a cached
inference plan does not need.
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
from libnn.runtime.timing import time_gpu

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

    def runner(self, stream_ptr: int):
        """run(x, w, b, y, r=None) on `stream_ptr`: one `cublasLtMatmul` with the plan's descriptors, the
        workspace of that stream, and the bias pointer set into the descriptor only when it changed; the
        residual r, planned for, is C (else C is y)."""
        from nvmath.bindings import cublasLt

        m, matmul, error = self.matmul, cublasLt.matmul, cublasLt.cuBLASLtError
        handle, desc, a_layout, b_layout = m.handle, m.mm_desc, m.a_layout_ptr, m.b_layout_ptr
        c_layout, d_layout, alpha, beta = m.c_layout_ptr, m.d_layout_ptr, self._alpha, self._beta
        size = self._workspace_bytes
        space = workspace(size, self._device_id, stream_ptr)  # held: its pointer stays valid
        space_ptr = space.data.ptr

        def run(x, w, b, y, r=None):
            if b is not None and b.data.ptr != self._bias_ptr:
                m.mm_desc_ifc.bias_pointer = self._bias_ptr = b.data.ptr
            y_ptr = y.data.ptr
            try:
                matmul(handle, desc, alpha, w.data.ptr, a_layout, x.data.ptr, b_layout, beta,
                       y_ptr if r is None else r.data.ptr, c_layout, y_ptr, d_layout, self._algo, space_ptr, size,
                       stream_ptr)
            except error as exc:
                raise LibraryError(f"cuBLASLt matmul failed for {self.problem.describe()}: {exc}") from exc
        run.workspace = space
        return run

    def run(self, x, w, b, y, stream_ptr: int, r=None) -> None:
        """One product on `stream_ptr` (for tools; bound calls keep a `runner`)."""
        self.runner(stream_ptr)(x, w, b, y, r)

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

    def autotune(self, x, w, b, y, runs: int = 10, r=None) -> None:
        """Time every candidate on these operands (median of `runs`, CUDA events) and keep the fastest."""
        run = self.runner(current_stream().ptr)
        for c in self.candidates:
            self.choose(c.index)
            c.time_ms = time_gpu(lambda _: run(x, w, b, y, r), [None], warmup=2, runs=runs).median_ms
        self.choose(min(range(len(self.candidates)), key=lambda i: self.candidates[i].time_ms))


def _build(problem, x, w, b, y, r) -> GemmPlan:
    import time

    from nvmath.linalg.advanced import Matmul, MatmulComputeType, MatmulOptions

    compute_type = MatmulComputeType.COMPUTE_32F_FAST_TF32 if problem.dtype == "fp32" and problem.allow_tf32 else None
    options = MatmulOptions(inplace=True, compute_type=compute_type, logger=_log, handle=cublaslt_handle(),
                            memory_limit=config.cublaslt_workspace_bytes, device_id=current_device_id())
    start = time.perf_counter()
    try:
        # planned in place on C: the residual's layout and alignment are C's, and D (y) has the same layout
        c = y if r is None else r
        matmul = Matmul(w, x.T, c=c.T, beta=0.0 if r is None else 1.0, options=options, stream=current_stream())
        epilog = _epilog(problem.has_bias, problem.activation)
        algorithms = matmul.plan(epilog=epilog, epilog_inputs={"bias": b} if b is not None else None,
                                 stream=current_stream())
    except Exception as exc:  # cuBLASLtError, "Planning failed to find any suitable algorithm", ...
        raise LibraryError(f"cuBLASLt cannot plan {problem.describe()}: {type(exc).__name__}: {exc}") from exc
    matmul.release_operands()  # the plan keeps descriptors, not the first call's arrays
    plan = GemmPlan(problem, matmul, [Candidate(i, a) for i, a in enumerate(algorithms)],
                    plan_seconds=time.perf_counter() - start)
    if config.autotune and len(plan.candidates) > 1:
        plan.autotune(x, w, b, y, r=r)
    return plan


def plan_for(problem, x, w, b, y, stream_ptr: int, r=None) -> GemmPlan:
    """The plan for `problem` with these operands' alignment on the given stream (the device is in
    the problem); r is the residual when the problem has one."""
    key = (problem, _alignment(x), _alignment(w), b is not None and _alignment(b), r is not None and _alignment(r),
           stream_ptr)
    return _plans.get(key, lambda: _build(problem, x, w, b, y, r))


def bind_linear(problem, x, w, b, r=None):
    """The runner of y = act(x @ w.T + b + r) on cuBLASLt for C-contiguous (M, K), (N, K), (N,), (M, N)
    CuPy arrays of this signature, on the current stream."""
    import cupy

    shape, dtype = (problem.M, problem.N), x.dtype
    stream_ptr = current_stream().ptr
    matmul = plan_for(problem, x, w, b, cupy.empty(shape, dtype), stream_ptr, r).runner(stream_ptr)

    def run(x, w, b, r):
        y = cupy.empty(shape, dtype)  # pool memory: always 256-byte aligned, as at planning
        matmul(x, w, b, y, r)
        return y
    return run
