"""`libnn bench linear`: cuBLASLt vs our kernels vs PyTorch on the shapes the foundation issue names.

Every row has the median GPU time (ms, CUDA events, inputs rotated past L2) and the time per call as a
user's loop sees it (per-call ms: back-to-back calls, one synchronisation, see harness.time_per_call),
for libnn's paths and for PyTorch alike.

Cases (each on every path that supports it):
- the epilogue's cost: M=8192 K=4096 N=16384 bf16 with bias+GELU next to the plain GEMM of the same
  shape (target: epilogue ≤ 1.05× plain, ≥ 1.3× faster than PyTorch eager);
- square 4096³ in bf16, fp16 and fp32 (target: custom ≥ 50% of cuBLASLt in bf16), with every
  numbered variant of kernels/gemm.cu;
- decode-like M = 1 and 16 (K = N = 4096): GPU time and host time per call (target: ≤ 15 µs of
  Python overhead for a cached call);
- an odd shape (M, N, K not multiples of 8), where the aligned fast kernels cannot run;
- BERT's FFN in fp16 (M = 256·128, N = 1536, K = 384, and M = 32·128, N = 3072, K = 768): the exact
  GELU (gelu_erf) on cutlass (one CUTLASS kernel, the erf GELU in its epilogue), on cuBLASLt (GEMM,
  then the bias_act_rows pass), on cudnn (one cuDNN graph) and on custom (erf in gemm3's epilogue),
  next to cuBLASLt's plain GEMM + bias (target: gelu_erf ≤ 1.10× that; the targets also give the
  whole FFN, both GEMMs, with and without the GELU), and the pass alone in GB/s against the copy
  ceiling (target ≥ 85%), with PyTorch's GELU on the same tensor;
- the FFN's second GEMM with the residual added in its epilogue (cuBLASLt, cudnn, custom), next to
  PyTorch's linear then add.
A path that declines a case (cuDNN without an engine for the graph) gets a row with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from libnn import dtypes
from libnn.bench import harness
from libnn.errors import LibraryError, PathUnavailableError
from libnn.ops.linear import LinearProblem, bind_epilogue_pass, custom_versions, launch_custom_version, linear


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
    residual: bool = False      # add a residual of the output's shape
    variants: bool = False      # also time each numbered custom kernel
    host_overhead: bool = False  # also measure host time per call
    gelu_pass: bool = False     # also time the GEMM's GELU pass alone (and PyTorch's GELU) in GB/s
    cudnn: bool = False         # also time the cudnn path (the FFN cases: fp16, N and K multiples of 8)

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
    Case("ffn1 gelu_erf", 256 * 128, 1536, 384, "fp16", activation="gelu_erf", gelu_pass=True, cudnn=True),
    Case("ffn1 plain", 256 * 128, 1536, 384, "fp16", activation=None, cudnn=True),
    Case("ffn2 +residual", 256 * 128, 384, 1536, "fp16", activation=None, residual=True, cudnn=True),
    Case("ffn1 gelu_erf", 32 * 128, 3072, 768, "fp16", activation="gelu_erf", gelu_pass=True, cudnn=True),
    Case("ffn1 plain", 32 * 128, 3072, 768, "fp16", activation=None, cudnn=True),
    Case("ffn2 +residual", 32 * 128, 768, 3072, "fp16", activation=None, residual=True, cudnn=True),
]
QUICK = [Case("square", 1024, 1024, 1024, "bf16", variants=True), Case("decode", 1, 1024, 1024, "bf16", host_overhead=True),
         Case("ffn1 gelu_erf", 32 * 128, 3072, 768, "fp16", activation="gelu_erf", gelu_pass=True, cudnn=True),
         Case("ffn1 plain", 32 * 128, 3072, 768, "fp16", activation=None, cudnn=True)]


def _inputs(case: Case, l2_bytes: int) -> list[tuple[Any, Any, Any, Any]]:
    """Enough (x, w, b, residual) sets that, rotated, they exceed twice the L2 cache; drawn from
    N(0,1)/√K (the residual from N(0,1)), never zeros; b and residual None where the case has none."""
    import cupy

    dtype = dtypes.parse(case.dtype)
    per_set = (case.M * case.K + case.N * case.K + case.N + (case.M * case.N if case.residual else 0)) * dtype.itemsize
    count = min(8, max(2, math.ceil(2 * l2_bytes / per_set)))
    rng = cupy.random.default_rng(1234)
    scale = 1 / math.sqrt(case.K)

    def draw(*shape, scale=scale):
        return (rng.standard_normal(shape, dtype=cupy.float32) * scale).astype(dtype)

    return [(draw(case.M, case.K), draw(case.N, case.K), draw(case.N) if case.bias else None,
             draw(case.M, case.N, scale=1.0) if case.residual else None) for _ in range(count)]


def _torch_fn(case: Case) -> Callable | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    torch.backends.cuda.matmul.allow_tf32 = case.allow_tf32

    def run(args):
        x, w, b, r = (None if a is None else torch.from_dlpack(a) for a in args)
        y = F.linear(x, w, b)
        if r is not None:
            y += r
        if case.activation == "relu":
            y = F.relu(y)
        elif case.activation == "gelu":
            y = F.gelu(y, approximate="tanh")
        elif case.activation == "gelu_erf":
            y = F.gelu(y)
        return y
    return run


def _paths(case: Case) -> dict[str, Callable]:
    def forced(path: str) -> Callable:
        return lambda args: linear(*args[:3], case.activation, residual=args[3], allow_tf32=case.allow_tf32, path=path)

    runs = {"cutlass": forced("cutlass")} if case.activation == "gelu_erf" else {}
    runs["cublaslt"] = forced("cublaslt")
    if case.cudnn:
        runs["cudnn"] = forced("cudnn")
    if not case.allow_tf32:
        runs["custom"] = forced("custom")
    if case.variants:
        problem = LinearProblem(case.M, case.N, case.K, case.dtype, case.bias, case.activation, case.allow_tf32,
                                "gpu:0", case.residual)
        for version in custom_versions(problem):
            runs[f"custom {version}"] = (lambda v: lambda args: launch_custom_version(v, *args[:3], case.activation,
                                                                                      args[3]))(version)
    if torch := _torch_fn(case):
        runs["torch eager"] = torch
    return runs


def _how(case: Case, path: str) -> str:
    """How a path computes the case's epilogue, for the table."""
    if case.activation == "gelu_erf" and path == "cublaslt":
        return "GEMM + pass"
    if path == "cutlass":
        return "erf in GEMM epilogue"
    if path == "cudnn" and (case.activation or case.residual or case.bias):
        return "one cuDNN graph"
    if case.activation == "gelu_erf" and path == "custom":
        return "erf in GEMM" if case.dtype != "fp32" else "GEMM + pass"
    if path == "torch eager" and (case.activation or case.residual):
        return "linear + " + " + ".join(filter(None, ["add" if case.residual else None, case.activation]))
    if path != "torch eager" and (case.activation or case.residual):
        return "in GEMM epilogue"
    return ""


def _gelu_pass_rows(case: Case, l2_bytes: int, ceilings: harness.Ceilings) -> list[dict[str, Any]]:
    """The GELU pass alone on (M, N) outputs (as many as exceed twice L2, rotated) in GB/s, one read and
    one write of each element, and PyTorch's GELU (out of place: the same bytes) for comparison."""
    import cupy

    dtype = dtypes.parse(case.dtype)
    nbytes = case.M * case.N * dtype.itemsize
    rng = cupy.random.default_rng(99)
    ys = [rng.standard_normal((case.M, case.N), dtype=cupy.float32).astype(dtype)
          for _ in range(min(8, max(2, math.ceil(2 * l2_bytes / nbytes) + 1)))]
    b = (rng.standard_normal(case.N, dtype=cupy.float32)).astype(dtype) if case.bias else None
    gelu = bind_epilogue_pass(case.dtype, case.M, case.N, "gelu_erf")
    runs = {"bias+gelu_erf pass": lambda y: gelu(y, b)}
    try:
        import torch
        import torch.nn.functional as F

        runs["torch F.gelu"] = lambda y: F.gelu(torch.from_dlpack(y))
    except ImportError:
        pass
    rows = []
    for path, fn in runs.items():
        t = harness.time_gpu(fn, ys, warmup=3, runs=30)
        gbs = 2 * nbytes / t.median_s / 1e9
        rows.append({"case": f"{case.name} pass alone", "shape": f"{case.M}x{case.N}", "dtype": case.dtype,
                     "epilogue": "bias+gelu_erf" if path.endswith("pass") else "gelu_erf", "path": path,
                     "ms": t.median_ms, "per-call ms": harness.time_per_call(lambda: fn(ys[0]), calls=20, repeats=3,
                                                                            warmup=2),
                     "GB/s": gbs, "%copy": 100 * gbs / ceilings.copy_gbs})
    return rows


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
            variant = path.startswith("custom v")
            runs = 5 if path.endswith("v1") and case.M * case.N * case.K > 2**33 else 30
            row = {"case": case.name, "shape": f"{case.M}x{case.N}x{case.K}", "dtype": case.dtype + (
                   " tf32" if case.allow_tf32 else ""), "epilogue": "+".join(filter(None, [
                   "bias" if case.bias else None, "residual" if case.residual else None, case.activation])) or "-",
                   "path": path, "how": _how(case, path)}
            try:
                t = harness.time_gpu(fn, inputs, warmup=3, runs=runs)
            except (LibraryError, PathUnavailableError) as exc:  # cuDNN without an engine, or not installed
                row["note"] = str(exc).splitlines()[0][:80]
                case_rows.append(row)
                continue
            tflops = case.flops / t.median_s / 1e12
            row.update({"ms": t.median_ms, "TFLOP/s": tflops, "%ceil": 100 * tflops / ceilings.gemm_bf16_tflops})
            if not variant:  # the numbered kernels are there for their GPU time; v1 takes seconds per call
                args = inputs[0]
                row["per-call ms"] = harness.time_per_call(lambda: fn(args), calls=20, repeats=3, warmup=2)
            if case.host_overhead:
                args = inputs[0]
                row["host_us"] = harness.time_host(lambda: fn(args), calls=500)
            case_rows.append(row)
        if "cublaslt" in {r["path"] for r in case_rows}:
            base = next(r["ms"] for r in case_rows if r["path"] == "cublaslt")
            for r in case_rows:
                if r.get("ms"):
                    r["cublaslt/x"] = base / r["ms"]  # >1: faster than cuBLASLt
        if case.gelu_pass:
            case_rows += _gelu_pass_rows(case, props["l2CacheSize"], ceilings)
        rows += case_rows
        del inputs
        cupy.get_default_memory_pool().free_all_blocks()
    columns = ["case", "shape", "dtype", "epilogue", "path", "how", "ms", "per-call ms", "TFLOP/s", "%ceil",
               "cublaslt/x", "GB/s", "%copy", "host_us", "note"]
    print(harness.format_table(rows, columns))
    print(_targets(rows))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": rows})
    return rows


def _targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets, each with the measured value and whether it is met."""
    def ms(case, path, dtype="bf16"):
        return next((r.get("ms") for r in rows if r["case"] == case and r["path"] == path and r["dtype"] == dtype), None)

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
    for shape in dict.fromkeys(r["shape"] for r in rows if r["case"] == "ffn1 gelu_erf"):
        def ffn(case, path):
            return next((r.get("ms") for r in rows if r["case"] == case and r["shape"] == shape and r["path"] == path),
                        None)
        plain = ffn("ffn1 plain", "cublaslt")
        M, N, K = (int(v) for v in shape.split("x"))
        second = next((r.get("ms") for r in rows if r["case"] == "ffn2 +residual" and r["shape"] == f"{M}x{K}x{N}"
                       and r["path"] == "cublaslt"), None)
        for path in ("cutlass", "cublaslt", "cudnn", "custom"):
            if plain and (erf := ffn("ffn1 gelu_erf", path)):
                lines.append(f"  FFN {shape} fp16: bias+gelu_erf on {path} / plain GEMM+bias on cublaslt = {erf / plain:.3f}"
                             f"  (target <= 1.10: {'met' if erf / plain <= 1.10 else 'MISSED'})")
                if second:
                    lines.append(f"    whole FFN (both GEMMs, the second's residual in its epilogue): "
                                 f"{(erf + second) / (plain + second):.3f}x the FFN without the GELU")
        for r in rows:
            if r["case"] == "ffn1 gelu_erf" and r["shape"] == shape and r.get("note"):
                lines.append(f"  FFN {shape} fp16: bias+gelu_erf on {r['path']} declined: {r['note']}")
    for r in rows:
        if r["path"] == "bias+gelu_erf pass":
            lines.append(f"  GELU pass alone {r['shape']} {r['dtype']}: {r['%copy']:.0f}% of copy bandwidth"
                         f"  (target >= 85: {'met' if r['%copy'] >= 85 else 'MISSED'})")
    return "\n".join(lines)
