"""`libnn bench attention`: cuDNN's fused SDPA vs our flash kernel vs the unfused three passes vs PyTorch.

Paths per case: cudnn (libnn's call: checks, cache lookup, execute), cudnn raw (the same cached cuDNN
graph executed straight from the frontend, no libnn in between: what the frontend alone costs), custom
(kernels/attention.cu's flash kernel), unfused (cuBLAS Q·Kᵀ, our masked softmax, cuBLAS P·V) and
PyTorch's scaled_dot_product_attention with its flash and cuDNN backends when torch is installed.
FLOPs are 4·B·H·Sq·Skv·D, halved for causal masks; decode cases (Sq = 1) also report the GB/s of
reading K and V, since they are bound by memory, not math.

Targets (B=4 H=16 S=4096 D=128 bf16, non-causal): cudnn ≥ 620 TFLOP/s and within 2% of cudnn raw;
custom ≥ 40% of cudnn; a cached call's host time ≤ 20 µs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from libnn import dtypes
from libnn.backends.cudnn import graph_for
from libnn.bench import harness
from libnn.errors import LibnnError
from libnn.ops.attention import (UID_K, UID_O, UID_Q, UID_V, attention, attention_flops, attention_graph_builder,
                                attention_problem)
from libnn.runtime.handles import cudnn_handle, workspace


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    Sq: int
    Skv: int
    D: int
    causal: bool
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.B}x{self.H}x{self.Sq}" + (f"/{self.Skv}" if self.Skv != self.Sq else "") + f"x{self.D}"

    @property
    def flops(self) -> int:
        return attention_flops(self.B, self.H, self.Sq, self.Skv, self.D, self.causal)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.B * self.H * self.Skv * self.D * dtypes.parse(self.dtype).itemsize


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(2, 8, 1024, 1024, 64, causal, "bf16") for causal in (False, True)]
    shapes = [(4, 16, 4096, 4096, 128), (16, 16, 1024, 1024, 64), (1, 32, 8192, 8192, 128), (64, 32, 1, 4096, 128)]
    return [Case(*shape, causal, dtype) for dtype in ("bf16", "fp16") for shape in shapes
            for causal in (False, True) if not (causal and shape[2] == 1)]  # a causal decode row sees one key


def _inputs(case: Case):
    import cupy

    rng = cupy.random.default_rng(5)
    dt = dtypes.parse(case.dtype)
    q = rng.standard_normal((case.B, case.H, case.Sq, case.D), dtype=cupy.float32).astype(dt)
    k, v = (rng.standard_normal((case.B, case.H, case.Skv, case.D), dtype=cupy.float32).astype(dt) for _ in range(2))
    return q, k, v


def _paths(case: Case, q, k, v) -> dict[str, Callable[[Any], Any]]:
    def libnn_path(path: str):
        return lambda _: attention(q, k, v, causal=case.causal, path=path)

    paths = {"cudnn": libnn_path("cudnn"), "cudnn raw": _raw_cudnn(case, q, k, v),
             "custom": libnn_path("custom"), "unfused": libnn_path("unfused")}
    if case.Sq * case.Skv * case.B * case.H * 4 > 16 << 30:  # the unfused S×S scores would not fit
        del paths["unfused"]
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return paths
    tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))

    def torch_backend(backend):
        def run(_):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal)
        return run

    paths["torch flash"] = torch_backend(SDPBackend.FLASH_ATTENTION)
    paths["torch cudnn"] = torch_backend(SDPBackend.CUDNN_ATTENTION)
    return paths


def _raw_cudnn(case: Case, q, k, v) -> Callable[[Any], Any]:
    """The cuDNN graph libnn cached for this problem, executed directly with a prepared variant pack."""
    import cupy

    problem = attention_problem(q, k, v, None, None, case.causal, "BHSD", False, False)
    graph = graph_for(problem, attention_graph_builder(problem), problem.describe())
    o = cupy.empty_like(q)
    pack = {UID_Q: q.data.ptr, UID_K: k.data.ptr, UID_V: v.data.ptr, UID_O: o.data.ptr}
    space, handle = workspace(graph.workspace_bytes).data.ptr, cudnn_handle()
    return lambda _: graph.graph.execute(pack, space, handle=handle)


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    import cupy

    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    cases = _cases(quick)
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases, 1):
        harness.progress(i, len(cases) + 1, f"{case.name} {case.dtype}{' causal' if case.causal else ''}")
        q, k, v = _inputs(case)
        case_rows = harness.time_paths(_paths(case, q, k, v), {"case": case.name, "causal": "yes" if case.causal
                                                               else "no", "dtype": case.dtype},
                                       flops=case.flops, ceilings=ceilings, baseline="cudnn",
                                       errors=(LibnnError, RuntimeError), note_chars=70)
        if case.Sq == 1:  # decode is bound by reading K and V
            for r in case_rows:
                if r.get("ms"):
                    r["GB/s"] = case.kv_bytes / (r["ms"] / 1e3) / 1e9
        rows += case_rows
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    harness.progress(len(cases) + 1, len(cases) + 1, "host time per cached call")
    host = _host_overhead()
    print(harness.format_table(rows, ["case", "causal", "dtype", "path", "ms", "per-call ms", "TFLOP/s", "%ceil", "cudnn/x", "GB/s",
                                      "note"]))
    print(_targets(rows, host))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": rows, "host_us": host})
    return rows


def _host_overhead() -> dict[str, float]:
    """Host microseconds per cached call on a small problem (the GPU keeps up, so this is libnn's cost)."""
    import cupy

    q = cupy.random.default_rng(1).standard_normal((1, 8, 128, 64), dtype=cupy.float32).astype(cupy.float16)
    raw = _raw_cudnn(Case(1, 8, 128, 128, 64, False, "fp16"), q, q, q)
    return {"cudnn": harness.time_host(lambda: attention(q, q, q, path="cudnn")),
            "cudnn raw": harness.time_host(lambda: raw(None))}


def _targets(rows: list[dict[str, Any]], host: dict[str, float]) -> str:
    def tflops(path):
        return next((r.get("TFLOP/s") for r in rows if r["case"] == "4x16x4096x128" and r["causal"] == "no"
                     and r["dtype"] == "bf16" and r["path"] == path), None)

    lines = ["targets (B=4 H=16 S=4096 D=128 bf16, non-causal):"]
    cudnn, raw, custom = tflops("cudnn"), tflops("cudnn raw"), tflops("custom")
    if cudnn:
        lines.append(f"  cudnn {cudnn:.0f} TFLOP/s  (target >= 620: {'met' if cudnn >= 620 else 'MISSED'})")
    if cudnn and raw:
        gap = 100 * (1 - cudnn / raw)
        lines.append(f"  cudnn vs cudnn raw: {gap:.1f}% slower  (target <= 2: {'met' if gap <= 2 else 'MISSED'})")
    if cudnn and custom:
        share = 100 * custom / cudnn
        lines.append(f"  custom {custom:.0f} TFLOP/s = {share:.0f}% of cudnn  (target >= 40: {'met' if share >= 40 else 'MISSED'})")
    lines.append(f"  host time per cached call (1x8x128x64 fp16): libnn {host['cudnn']:.1f} us, frontend alone "
                 f"{host['cudnn raw']:.1f} us  (target <= 20: {'met' if host['cudnn'] <= 20 else 'MISSED'})")
    return "\n".join(lines)
