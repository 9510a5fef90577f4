"""`libnn bench linear`: cuBLASLt vs our kernels vs PyTorch on the shapes the foundation issue names.

Cases (each on every path that supports it):
- the epilogue's cost: M=8192 K=4096 N=16384 bf16 with bias+GELU next to the plain GEMM of the same
  shape (target: epilogue ≤ 1.05× plain, ≥ 1.3× faster than PyTorch eager);
- square 4096³ in bf16, fp16 and fp32 (target: custom ≥ 50% of cuBLASLt in bf16), with every
  numbered variant of kernels/gemm.cu;
- decode-like M = 1 and 16 (K = N = 4096): GPU time and host time per call (target: ≤ 15 µs of
  Python overhead for a cached call);
- an odd shape (M, N, K not multiples of 8), where the aligned fast kernels cannot run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from libnn import dtypes
from libnn.bench import harness
from libnn.ops.linear import custom_versions, launch_custom_version, linear


@dataclass(frozen=True)
class Case:
    name: str
    M: int
    N: int
    K: int
    dtype: str
    bias: bool = True
    activation: str | None = "gelu"
    allow_tf32: bool = False
    variants: bool = False      # also time each numbered custom kernel
    host_overhead: bool = False  # also measure host time per call

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K


CASES = [
    Case("epilogue bias+gelu", 8192, 16384, 4096, "bf16"),
    Case("plain GEMM", 8192, 16384, 4096, "bf16", bias=False, activation=None),
    Case("square", 4096, 4096, 4096, "bf16", variants=True),
    Case("square", 4096, 4096, 4096, "fp16", variants=True),
    Case("square", 4096, 4096, 4096, "fp32", variants=True),
    Case("square tf32", 4096, 4096, 4096, "fp32", allow_tf32=True),
    Case("decode", 1, 4096, 4096, "bf16", host_overhead=True),
    Case("decode", 16, 4096, 4096, "bf16", host_overhead=True),
    Case("odd", 1000, 1001, 1003, "bf16"),
]
QUICK = [Case("square", 1024, 1024, 1024, "bf16", variants=True), Case("decode", 1, 1024, 1024, "bf16", host_overhead=True)]


def _inputs(case: Case, l2_bytes: int) -> list[tuple[Any, Any, Any]]:
    """Enough input sets that, rotated, they exceed twice the L2 cache; drawn from N(0,1)/√K, never zeros."""
    import cupy

    dtype = dtypes.parse(case.dtype)
    per_set = (case.M * case.K + case.N * case.K + case.N) * dtype.itemsize
    count = min(8, max(2, math.ceil(2 * l2_bytes / per_set)))
    rng = cupy.random.default_rng(1234)
    scale = 1 / math.sqrt(case.K)

    def draw(*shape):
        return (rng.standard_normal(shape, dtype=cupy.float32) * scale).astype(dtype)

    return [(draw(case.M, case.K), draw(case.N, case.K), draw(case.N) if case.bias else None) for _ in range(count)]


def _torch_fn(case: Case) -> Callable | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    torch.backends.cuda.matmul.allow_tf32 = case.allow_tf32

    def run(args):
        x, w, b = (None if a is None else torch.from_dlpack(a) for a in args)
        y = F.linear(x, w, b)
        if case.activation == "relu":
            y = F.relu(y)
        elif case.activation == "gelu":
            y = F.gelu(y, approximate="tanh")
        return y
    return run


def _paths(case: Case) -> dict[str, Callable]:
    def forced(path: str) -> Callable:
        return lambda args: linear(*args, case.activation, allow_tf32=case.allow_tf32, path=path)

    runs = {"cublaslt": forced("cublaslt")}
    if not case.allow_tf32:
        runs["custom"] = forced("custom")
    if case.variants:
        for version in custom_versions(case.dtype):
            runs[f"custom {version}"] = (lambda v: lambda args: launch_custom_version(v, *args, case.activation))(version)
    if torch := _torch_fn(case):
        runs["torch eager"] = torch
    return runs


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    cases = QUICK if quick else CASES
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases, 1):
        harness.progress(i, len(cases), f"{case.name} M={case.M} N={case.N} K={case.K} {case.dtype}")
        inputs = _inputs(case, props["l2CacheSize"])
        case_rows = []
        for path, fn in _paths(case).items():
            runs = 5 if path.endswith("v1") and case.M * case.N * case.K > 2**33 else 30
            t = harness.time_gpu(fn, inputs, warmup=3, runs=runs)
            tflops = case.flops / t.median_s / 1e12
            row = {"case": case.name, "shape": f"{case.M}x{case.N}x{case.K}", "dtype": case.dtype + (
                   " tf32" if case.allow_tf32 else ""), "epilogue": "+".join(filter(None, [
                   "bias" if case.bias else None, case.activation])) or "-", "path": path,
                   "ms": t.median_ms, "TFLOP/s": tflops,
                   "%ceil": 100 * tflops / ceilings.gemm_bf16_tflops}
            if case.host_overhead:
                args = inputs[0]
                row["host_us"] = harness.time_host(lambda: fn(args), calls=500)
            case_rows.append(row)
        if "cublaslt" in {r["path"] for r in case_rows}:
            base = next(r["ms"] for r in case_rows if r["path"] == "cublaslt")
            for r in case_rows:
                r["cublaslt/x"] = base / r["ms"]  # >1: faster than cuBLASLt
        rows += case_rows
        del inputs
        cupy.get_default_memory_pool().free_all_blocks()
    columns = ["case", "shape", "dtype", "epilogue", "path", "ms", "TFLOP/s", "%ceil", "cublaslt/x", "host_us"]
    print(harness.format_table(rows, columns))
    print(_targets(rows))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": rows})
    return rows


def _targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets, each with the measured value and whether it is met."""
    def ms(case, path, dtype="bf16"):
        return next((r["ms"] for r in rows if r["case"] == case and r["path"] == path and r["dtype"] == dtype), None)

    lines = ["targets:"]
    epi, plain, torch = ms("epilogue bias+gelu", "cublaslt"), ms("plain GEMM", "cublaslt"), ms("epilogue bias+gelu", "torch eager")
    if epi and plain:
        lines.append(f"  bias+gelu epilogue / plain GEMM = {epi / plain:.3f}  (target <= 1.05: {'met' if epi / plain <= 1.05 else 'MISSED'})")
    if epi and torch:
        lines.append(f"  torch eager / cublaslt = {torch / epi:.2f}x  (target >= 1.3: {'met' if torch / epi >= 1.3 else 'MISSED'})")
    lt, custom = ms("square", "cublaslt"), ms("square", "custom")
    if lt and custom:
        lines.append(f"  custom / cublaslt TFLOP/s at 4096^3 bf16 = {lt / custom:.2f}  (target >= 0.5: {'met' if lt / custom >= 0.5 else 'MISSED'})")
    for r in rows:
        if r.get("host_us") is not None and r["path"] in ("cublaslt", "custom"):
            lines.append(f"  host time per cached call, M={r['shape'].split('x')[0]} {r['path']}: {r['host_us']:.1f} us (target <= 15)")
    return "\n".join(lines)
