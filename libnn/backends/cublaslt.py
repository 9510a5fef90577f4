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
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from libnn import dtypes
from libnn.config import config
from libnn.errors import LibraryError
from libnn.runtime.arrays import allocator, refuse_misaligned
from libnn.runtime.cache import PlanCache
from libnn.runtime.device import current_device_id, gpu_index
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


class _LtPlan:
    """What the float and the FP8 plans share: the hot call, and autotuning over the heuristic's candidates.
    A plan has `problem`, `count` candidates and `choose(index)` (setting `_algo`, the chosen algorithm's
    host pointer), `_alpha` and `_beta` (host pointers), `_workspace_bytes`, `_device_id`, `_bias_ptr` (the
    bias pointer its descriptor holds, None before one is set), `_descriptors()` and `_set_bias(ptr)`."""

    _name = "matmul"  # in the error of a failed call

    def _descriptors(self) -> tuple[int, int, tuple[int, int, int, int]]:
        """(the cuBLASLt handle, the matmul descriptor, the layouts of A, B, C and D)."""
        raise NotImplementedError

    def _set_bias(self, ptr: int) -> None:
        """Set the bias pointer into the descriptor and remember it in `_bias_ptr`."""
        raise NotImplementedError

    def _matmul_runner(self, stream_ptr: int) -> Callable[..., None]:
        """run(x, w, b, y, r=None) on `stream_ptr`: one `cublasLtMatmul` with the plan's descriptors (A is w,
        B is x, D is y), the workspace of that stream, and the bias pointer set into the descriptor only
        when it changed; the residual r, planned for, is C (else C is y). bind_linear calls this closure
        itself, once per linear: keep its work to the bias check and the call."""
        from nvmath.bindings import cublasLt

        matmul, error, set_bias = cublasLt.matmul, cublasLt.cuBLASLtError, self._set_bias
        handle, desc, (a_layout, b_layout, c_layout, d_layout) = self._descriptors()
        alpha, beta, size = self._alpha, self._beta, self._workspace_bytes
        space = workspace(size, self._device_id, stream_ptr)  # held: its pointer stays valid
        space_ptr = space.data.ptr

        def run(x, w, b, y, r=None):
            if b is not None and b.data.ptr != self._bias_ptr:
                set_bias(b.data.ptr)
            y_ptr = y.data.ptr
            try:
                matmul(handle, desc, alpha, w.data.ptr, a_layout, x.data.ptr, b_layout, beta,
                       y_ptr if r is None else r.data.ptr, c_layout, y_ptr, d_layout, self._algo, space_ptr, size,
                       stream_ptr)
            except error as exc:
                raise LibraryError(f"cuBLASLt {self._name} failed for {self.problem.describe()}: {exc}") from exc
        run.workspace = space
        return run

    def _time_candidates(self, run: Callable[[Any], Any], runs: int) -> list[float]:
        """Time `run(None)` with every candidate (median of `runs`, CUDA events), keep the fastest and return
        the times in milliseconds, in the candidates' order."""
        times = []
        for index in range(self.count):
            self.choose(index)
            times.append(time_gpu(run, [None], warmup=2, runs=runs).median_ms)
        self.choose(min(range(self.count), key=times.__getitem__))
        return times


@dataclass
class GemmPlan(_LtPlan):
    problem: Any
    matmul: Any
    candidates: list[Candidate]
    chosen: int = 0                     # index into candidates; 0 is the heuristic's first choice
    plan_seconds: float = 0.0

    @property
    def count(self) -> int:
        return len(self.candidates)

    def _descriptors(self) -> tuple[int, int, tuple[int, int, int, int]]:
        m = self.matmul
        return m.handle, m.mm_desc, (m.a_layout_ptr, m.b_layout_ptr, m.c_layout_ptr, m.d_layout_ptr)

    def _set_bias(self, ptr: int) -> None:
        self.matmul.mm_desc_ifc.bias_pointer = self._bias_ptr = ptr

    def runner(self, stream_ptr: int) -> Callable[..., None]:
        """run(x, w, b, y, r=None) on `stream_ptr`: one `cublasLtMatmul` (`_LtPlan._matmul_runner`)."""
        return self._matmul_runner(stream_ptr)

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
        self._device_id = gpu_index(self.problem.device)
        self._bias_ptr = None
        self.choose(self.chosen)

    def autotune(self, x, w, b, y, runs: int = 10, r=None) -> None:
        """Time every candidate on these operands (median of `runs`, CUDA events) and keep the fastest."""
        run = self.runner(current_stream().ptr)
        for c, time_ms in zip(self.candidates, self._time_candidates(lambda _: run(x, w, b, y, r), runs)):
            c.time_ms = time_ms


def _build(problem, x, w, b, y, r) -> GemmPlan:
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
    shape, dtype = (problem.M, problem.N), x.dtype
    new = allocator(shape, dtype)
    stream_ptr = current_stream().ptr
    matmul = plan_for(problem, x, w, b, new(), stream_ptr, r).runner(stream_ptr)

    def run(x, w, b, r):
        y = new()  # pool memory: always 256-byte aligned, as at planning
        matmul(x, w, b, y, r)
        return y
    return run


# --- FP8 (E4M3) GEMMs, for linear_fp8 --------------------------------------------------------------------
# nvmath's Matmul takes an operand's data type from its array's dtype, and FP8 operands only as torch
# float8 tensors (or arrays whose dtype is named float8_e4m3fn); libnn keeps E4M3 codes in uint8 CuPy
# arrays, which it would take for integers, and MatmulOptions has no field that retypes an operand. So the
# FP8 GEMM is planned here through nvmath's low-level cuBLASLt bindings (descriptor, layouts, preference,
# heuristic), one plan per key like GemmPlan, and run by GemmPlan's hot call (_LtPlan's): one cublasLtMatmul.
#
# Layout (cuBLASLt's FP8 GEMMs take A transposed and B not: "TN", both operands K-major). libnn's
#     y.T (N, M) = w (N, K) @ x.T (K, M)
# is that product as the row-major arrays lie: A is w's bytes read as a column-major (K, N) matrix with
# op(A) = A^T, B is xq's bytes read as a column-major (K, M) matrix, C and D are the row-major (M, N)
# residual and output read as column-major (N, M). cuBLASLt's m, n, k are libnn's N, M, K, and the bias
# epilogue adds its vector along D's rows: the output features.
#
# Scales are device pointers to float32: A's the weight's scale, B's the activations' (x_scale, which the
# quantiser rewrites on the GPU at every call). D = act(scaleA · scaleB · A·B + β·C + bias); D is
# fp16/bf16, so no D scale. A weight scale per output channel uses cuBLASLt's outer-vector scaling
# (A_SCALE_MODE = B_SCALE_MODE = OUTER_VEC_32F, cuBLAS 12.9 and newer), in which both operands' scales are
# vectors, of cuBLASLt's m (N, the weight's) and n (M, one per row of x) elements: the quantiser then
# writes its one activation scale M times. A GPU or cuBLASLt that has no such kernel for the problem
# declines it in the heuristic or the call, which raises LibraryError (linear_fp8's auto then runs custom).
_fp8_plans: PlanCache = PlanCache("cublaslt fp8 plans")
_FP8_OUTPUT_TYPES = {"fp16": "CUDA_R_16F", "bf16": "CUDA_R_16BF"}
_FP8_HEURISTIC_LIMIT = 8


def _fp8_epilogue(has_bias: bool, activation: str | None):
    from nvmath.bindings import cublasLt

    name = {(False, None): "DEFAULT", (False, "relu"): "RELU", (False, "gelu"): "GELU",
            (True, None): "BIAS", (True, "relu"): "RELU_BIAS", (True, "gelu"): "GELU_BIAS"}[has_bias, activation]
    return getattr(cublasLt.Epilogue, name)


def _attribute_setter(set_attribute, dtype_of, target: int):
    """put(attribute, value): one cuBLASLt attribute of `target` (a descriptor or preference), the value
    in the width nvmath's bindings give for the attribute."""
    def put(attribute, value) -> None:
        buffer = np.array([int(value)], dtype=dtype_of(attribute))
        set_attribute(target, attribute, buffer.ctypes.data, buffer.itemsize)
    return put


def _destroy_fp8_plan(desc: int, layouts: tuple[int, ...]) -> None:
    from nvmath.bindings import cublasLt

    for layout in layouts:
        cublasLt.matrix_layout_destroy(layout)
    cublasLt.matmul_desc_destroy(desc)


class Fp8GemmPlan(_LtPlan):
    """One cuBLASLt FP8 GEMM of `problem` (linear_fp8's: M, N, K, dtype, per_channel, has_bias,
    activation, has_residual, device), planned once: its descriptor, layouts, the heuristic's candidates
    and the one it runs. The descriptors are freed with the plan."""

    _name = "FP8 matmul"

    def __init__(self, problem: Any, w, w_scale, x_scale, b, r) -> None:
        from nvmath import CudaDataType
        from nvmath.bindings import cublas, cublasLt

        start = time.perf_counter()
        self.problem = problem
        self.handle = cublaslt_handle()
        self._device_id = gpu_index(problem.device)
        M, N, K = problem.M, problem.N, problem.K
        fp8, out = CudaDataType.CUDA_R_8F_E4M3, getattr(CudaDataType, _FP8_OUTPUT_TYPES[problem.dtype])
        self.desc = cublasLt.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, CudaDataType.CUDA_R_32F)
        a, b_, d = (cublasLt.matrix_layout_create(fp8, K, N, K), cublasLt.matrix_layout_create(fp8, K, M, K),
                    cublasLt.matrix_layout_create(out, N, M, N))
        self.layouts = (a, b_, d)  # C is laid out as D
        weakref.finalize(self, _destroy_fp8_plan, self.desc, self.layouts).atexit = False
        A = cublasLt.MatmulDescAttribute
        put = _attribute_setter(cublasLt.matmul_desc_set_attribute, cublasLt.get_matmul_desc_attribute_dtype,
                                self.desc)
        put(A.TRANSA, cublas.Operation.T)
        put(A.TRANSB, cublas.Operation.N)
        put(A.EPILOGUE, _fp8_epilogue(problem.has_bias, problem.activation))
        if problem.has_bias:
            put(A.BIAS_DATA_TYPE, out)
        if problem.per_channel:
            outer = getattr(getattr(cublasLt, "MatmulMatrixScale", None), "OUTER_VEC_32F", None)
            if outer is None:
                raise LibraryError(f"cuBLASLt cannot plan {problem.describe()}: this nvmath-python's bindings have no "
                                   "outer-vector scaling (MatmulMatrixScale.OUTER_VEC_32F) for per-channel scales")
            put(A.A_SCALE_MODE, outer)
            put(A.B_SCALE_MODE, outer)
        # the pointers that change between calls live in these slots, each set into the descriptor when
        # it differs from the one set last (reading the slots' addresses once: .ctypes costs microseconds)
        self._pointers = np.zeros(3, np.uint64)
        self._pointer_attributes = (A.A_SCALE_POINTER, A.B_SCALE_POINTER, A.BIAS_POINTER)
        self._pointer_addresses = [self._pointers.ctypes.data + 8 * i for i in range(3)]
        self._bias_ptr = None
        self._set_scales(w_scale, x_scale)
        if b is not None:
            self._set_bias(b.data.ptr)
        self.candidates, self.count = self._heuristic(w, r)
        self._scalars = np.array([1.0, 0.0 if r is None else 1.0], np.float32)  # alpha, beta: held for the pointers
        self._alpha, self._beta = self._scalars.ctypes.data, self._scalars.ctypes.data + 4
        self._workspace_bytes = max(int(self.candidates[i].workspace_size) for i in range(self.count))
        if self._workspace_bytes and (problem.has_bias or problem.activation):
            self._workspace_bytes += 16  # as nvmath's Matmul.plan pads it with an epilogue ("library issue")
        self.choose(0)
        self.plan_seconds = time.perf_counter() - start

    def _heuristic(self, w, r):
        """(the heuristic's candidates, how many it found) for these operands' alignment; LibraryError
        where it finds none."""
        from nvmath.bindings import cublasLt

        P = cublasLt.MatmulPreferenceAttribute
        preference = cublasLt.matmul_preference_create()
        try:
            put = _attribute_setter(cublasLt.matmul_preference_set_attribute,
                                    cublasLt.get_matmul_preference_attribute_dtype, preference)
            put(P.MAX_WORKSPACE_BYTES, config.cublaslt_workspace_bytes)
            # B (xq) and D (y) come from CuPy's pool, 256-byte aligned; C is the residual, or D
            put(P.MIN_ALIGNMENT_A_BYTES, _alignment(w))
            put(P.MIN_ALIGNMENT_B_BYTES, 256)
            put(P.MIN_ALIGNMENT_C_BYTES, 256 if r is None else _alignment(r))
            put(P.MIN_ALIGNMENT_D_BYTES, 256)
            results = cublasLt.MatmulHeuristicResult(_FP8_HEURISTIC_LIMIT)
            count = np.zeros(1, np.int32)
            a, b_, d = self.layouts
            cublasLt.matmul_algo_get_heuristic(self.handle, self.desc, a, b_, d, d, preference, _FP8_HEURISTIC_LIMIT,
                                               results.ptr, count.ctypes.data)
        except cublasLt.cuBLASLtError as exc:
            raise LibraryError(f"cuBLASLt cannot plan {self.problem.describe()}: {exc}") from exc
        finally:
            cublasLt.matmul_preference_destroy(preference)
        if count[0] == 0:
            raise LibraryError(f"cuBLASLt has no FP8 algorithm for {self.problem.describe()} on this GPU")
        return results, int(count[0])

    def choose(self, index: int) -> None:
        """Run candidate `index` (0: the heuristic's first choice) from now on."""
        self.chosen = index
        self._algo = self.candidates[index]["algo"].ctypes.data

    def _descriptors(self) -> tuple[int, int, tuple[int, int, int, int]]:
        a, b, d = self.layouts
        return self.handle, self.desc, (a, b, d, d)  # C is laid out as D

    def _set_scales(self, w_scale, x_scale) -> None:
        """Set the scale pointers into the descriptor where they changed since the last call."""
        from nvmath.bindings import cublasLt

        for i, a in enumerate((w_scale, x_scale)):
            if a is not None and a.data.ptr != self._pointers[i]:
                self._pointers[i] = a.data.ptr
                cublasLt.matmul_desc_set_attribute(self.desc, self._pointer_attributes[i], self._pointer_addresses[i], 8)

    def _set_bias(self, ptr: int) -> None:
        from nvmath.bindings import cublasLt

        self._pointers[2] = self._bias_ptr = ptr
        cublasLt.matmul_desc_set_attribute(self.desc, self._pointer_attributes[2], self._pointer_addresses[2], 8)

    def runner(self, stream_ptr: int, x_scale) -> Callable[..., None]:
        """run(xq, w, w_scale, b, y, r=None) on `stream_ptr`: the scale pointers (w_scale's, and the
        activations' `x_scale`, the quantiser's buffer) set into the descriptor where they changed, then one
        cublasLtMatmul (`_LtPlan._matmul_runner`: the workspace of that stream, the residual r as C
        (planned for) or else y)."""
        matmul, set_scales = self._matmul_runner(stream_ptr), self._set_scales

        def run(xq, w, w_scale, b, y, r=None):
            set_scales(w_scale, x_scale)
            matmul(xq, w, b, y, r)
        run.workspace = matmul.workspace
        return run

    def autotune(self, xq, w, w_scale, x_scale, b, y, r=None, runs: int = 10) -> list[float]:
        """Time every candidate on these operands (median of `runs`, CUDA events), keep the fastest and
        return the times in milliseconds."""
        run = self.runner(current_stream().ptr, x_scale)
        return self._time_candidates(lambda _: run(xq, w, w_scale, b, y, r), runs)


def fp8_plan_for(problem, xq, w, w_scale, x_scale, b, y, stream_ptr: int, r=None) -> Fp8GemmPlan:
    """The FP8 plan for `problem` with these operands' alignment on the given stream (planned with
    these scale and bias pointers; a call with others sets them first)."""
    key = (problem, _alignment(w), b is not None and _alignment(b), r is not None and _alignment(r), stream_ptr)

    def build() -> Fp8GemmPlan:
        plan = Fp8GemmPlan(problem, w, w_scale, x_scale, b, r)
        if config.autotune and plan.count > 1:
            plan.autotune(xq, w, w_scale, x_scale, b, y, r)
        return plan
    return _fp8_plans.get(key, build)


def bind_linear_fp8(problem, xq, w, w_scale, x_scale, b, r=None):
    """The runner y = act(x_scale · w_scale · (xq @ w.T) + b + r) on cuBLASLt's FP8 GEMM, run(xq, w,
    w_scale, b, r) -> y, for C-contiguous CuPy arrays of this signature: xq (M, K) and w (N, K) E4M3
    codes (uint8), w_scale float32 (1,) or (N,) with problem.per_channel, x_scale the quantiser's float32
    device buffer (M values with per_channel, else 1) that every call reads, b (N,) and r (M, N) in the
    output's dtype (fp16, bf16) or None. LibraryError where cuBLASLt declines, or an operand is not
    16-byte aligned (FP8 GEMMs need it)."""
    refuse_misaligned("cuBLASLt's FP8 GEMMs need 16-byte aligned buffers",
                      {"w": w, "w_scale": w_scale, "b": b, "residual": r})
    shape, dtype = (problem.M, problem.N), dtypes.parse(problem.dtype)
    new = allocator(shape, dtype)
    stream_ptr = current_stream().ptr
    plan = fp8_plan_for(problem, xq, w, w_scale, x_scale, b, new(), stream_ptr, r)
    matmul = plan.runner(stream_ptr, x_scale)

    def run(xq, w, w_scale, b, r):
        y = new()  # pool memory: 256-byte aligned, as planned
        matmul(xq, w, w_scale, b, y, r)
        return y
    return run
