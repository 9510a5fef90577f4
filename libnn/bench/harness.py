"""The benchmark harness every op's suite uses.

Timing follows one method: CUDA events around the region on the current stream, after warm-up, the
median of many runs, inputs rotated among several sets whose total exceeds the L2 cache so that
repeated runs do not measure the cache. Rates are reported against ceilings measured on the same
device in the same run (a device-to-device copy for bandwidth, a cuBLASLt bf16 GEMM for matrix math).
`time_gpu` and `Timing` live in libnn.runtime.timing (the library's autotuners time with them too)
and are imported here, so that every suite keeps calling `harness.time_gpu`.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from libnn.dtypes import bfloat16
from libnn.ops.linear import linear
from libnn.runtime.timing import HOLD_KERNEL, Timing, hold_stream, time_gpu  # noqa: F401  (Timing: re-exported)


def time_host(fn: Callable[[], Any], *, calls: int = 2000, repeats: int = 5) -> float:
    """Median over `repeats` of the host wall time per call, in microseconds: the cost of issuing
    work (Python, argument checks, plan lookup, launch) when the GPU keeps up."""
    import cupy

    per_call = []
    for _ in range(repeats):
        cupy.cuda.get_current_stream().synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        cupy.cuda.get_current_stream().synchronize()
    return statistics.median(per_call)


def time_per_call(fn: Callable[[], Any], *, calls: int = 2000, repeats: int = 5, warmup: int = 20) -> float:
    """Milliseconds per call as a user's loop sees it: `calls` back-to-back calls with nothing queued
    before them, then one synchronisation, the whole divided by `calls`; the median over `repeats`.
    When the GPU work is tiny this is the host's cost of a call; when it is large, the GPU time."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(repeats):
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        stream.synchronize()
        per_call.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(per_call)


@dataclass
class Ceilings:
    device: str
    copy_gbs: float        # device-to-device copy, bytes read + written per second
    gemm_bf16_tflops: float

    def describe(self) -> str:
        return (f"{self.device}: copy {self.copy_gbs / 1e3:.2f} TB/s, "
                f"bf16 GEMM {self.gemm_bf16_tflops:.0f} TFLOP/s (measured now)")


def measure_ceilings(gemm_size: int = 8192) -> Ceilings:
    """The two ceilings every rate is compared with, measured on this device now."""
    import cupy

    nbytes = 1 << 30
    src, dst = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    src.fill(7)
    copy = time_gpu(lambda _: cupy.copyto(dst, src), [None], warmup=3, runs=20)
    rng = cupy.random.default_rng(0)
    a = [rng.standard_normal((gemm_size, gemm_size), dtype=cupy.float32).astype(bfloat16) for _ in range(2)]
    gemm = time_gpu(lambda m: linear(m, m, path="cublaslt"), a, warmup=3, runs=20)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"].decode()
    return Ceilings(name, 2 * nbytes / copy.median_s / 1e9, 2 * gemm_size**3 / gemm.median_s / 1e12)


@dataclass
class Result:
    """One row of a benchmark: a case on one path."""
    case: str
    path: str
    median_ms: float
    rate: float | None = None          # TFLOP/s or GB/s, per `unit`
    unit: str = "TFLOP/s"
    of_ceiling: float | None = None    # rate / measured ceiling
    extra: dict[str, Any] = field(default_factory=dict)


def time_paths(paths: dict[str, Callable[[Any], Any]], row: dict[str, Any], *, flops: int, ceilings: "Ceilings",
               baseline: str, errors: tuple[type[BaseException], ...], note_chars: int = 60) -> list[dict[str, Any]]:
    """One row per path (`row` plus the path's name) with its median GPU time (ms), its per-call time
    as a user sees it (per-call ms: back-to-back calls, nothing pre-queued), TFLOP/s and % of the bf16
    GEMM ceiling, and "<baseline>/x": the baseline path's time over this one's. A path that raises one
    of `errors` (a library declining the case) gets its message's first line as the row's note."""
    rows = []
    for path, fn in paths.items():
        result = {**row, "path": path}
        try:
            t = time_gpu(fn, [None], warmup=3, runs=20)
        except errors as exc:
            result["note"] = str(exc).splitlines()[0][:note_chars]
            rows.append(result)
            continue
        tflops = flops / t.median_s / 1e12
        result.update({"ms": t.median_ms, "per-call ms": time_per_call(lambda: fn(None), calls=20, repeats=3, warmup=2),
                       "TFLOP/s": tflops, "%ceil": 100 * tflops / ceilings.gemm_bf16_tflops})
        rows.append(result)
    base = next((r.get("ms") for r in rows if r["path"] == baseline), None)
    for r in rows:
        if base and r.get("ms"):
            r[f"{baseline}/x"] = base / r["ms"]
    return rows


# --- kernel time by category -------------------------------------------------------------------------
# Kernel-name patterns (searched in the lower-cased name) the suites' splits share. cuDNN's SDPA kernels
# carry "sm90_" as cuBLAS's GEMMs do, so a split lists attention before GEMM. libnn's GEMVs (kernels/gemv.cu,
# linear_fp8.cu's fp8_gemv3) count as GEMM, the RMS norms and SwiGLU fused into them with them.
ATTENTION_KERNELS = re.compile(r"sdpa|fmha|flash|attn|attention")
GEMM_KERNELS = re.compile(r"gemm|gemv|xmma|cutlass|nvjet|cublas|sm90_|sm80_")
KernelCategories = Sequence[tuple[str, re.Pattern[str]]]
GLUE = "glue"  # every kernel no category's pattern finds
TOP_GLUE = 3   # the costliest glue kernels a split names


def kernel_category(name: str, categories: KernelCategories) -> str:
    """The first category whose pattern finds the kernel `name` (case-insensitive), else glue."""
    lowered = name.lower()
    return next((category for category, pattern in categories if pattern.search(lowered)), GLUE)


def split_kernel_times(times: Iterable[tuple[str, float]], categories: KernelCategories,
                       calls: int) -> dict[str, Any]:
    """ms per call by category from (kernel name, ms over `calls` calls) pairs: "<category> ms" for each
    category and glue, "kernels ms" (the total), "glue %" (of the total) and "top glue" (the costliest
    glue kernels, their names cut to 40 characters)."""
    totals = {category: 0.0 for category, _ in categories} | {GLUE: 0.0}
    glue: dict[str, float] = {}
    for name, ms in times:
        if ms <= 0:
            continue
        category = kernel_category(name, categories)
        totals[category] += ms / calls
        if category == GLUE:
            glue[name[:40]] = glue.get(name[:40], 0.0) + ms / calls
    total = sum(totals.values())
    split: dict[str, Any] = {f"{category} ms": ms for category, ms in totals.items()}
    split["kernels ms"] = total
    split["glue %"] = 100 * totals[GLUE] / total if total else None
    split["top glue"] = ", ".join(f"{k} {v:.3f}" for k, v in sorted(glue.items(), key=lambda kv: -kv[1])[:TOP_GLUE])
    return split


def critical_path_shares(intervals: Iterable[tuple[str, float, float]]) -> tuple[list[tuple[str, float]], float]:
    """Each GPU activity's share of the critical path, from (name, start, end) intervals in start order: the
    part of [start, end) past the latest end of the activities that started before it. A kernel launched
    programmatically, which starts early and waits for the one ahead, counts only from that one's end, so
    the shares add up to the time some activity ran. Returns the (name, share) pairs and the idle time
    (gaps where nothing ran) between the first start and the last end; in the intervals' unit."""
    shares: list[tuple[str, float]] = []
    idle, reach = 0.0, None
    for name, start, end in sorted(intervals, key=lambda interval: interval[1]):
        reach = start if reach is None else reach
        idle += max(0.0, start - reach)
        shares.append((name, max(0.0, end - max(start, reach))))
        reach = max(reach, end)
    return shares, idle


GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace events' categories that ran on the GPU


def trace_intervals(trace: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(name, start ms, end ms) of every GPU activity (kernels, copies, memsets) of a torch.profiler Chrome
    trace: its "traceEvents", whose "ts" and "dur" are in µs."""
    return [(event["name"], event["ts"] / 1e3, (event["ts"] + event["dur"]) / 1e3)
            for event in trace.get("traceEvents", []) if event.get("cat") in GPU_ACTIVITIES and "dur" in event]


def critical_path_split(intervals: Iterable[tuple[str, float, float]], categories: KernelCategories,
                        calls: int) -> dict[str, Any]:
    """ms per call by category of the activities' critical_path_shares (intervals in ms): "<category> path
    ms" for each category and glue, and "idle ms", the gaps between them."""
    shares, idle = critical_path_shares(intervals)
    split = split_kernel_times(shares, categories, calls)
    names = [category for category, _ in categories] + [GLUE]
    return {**{f"{name} path ms": split[f"{name} ms"] for name in names}, "idle ms": idle / calls}


def kernel_split(fn: Callable[[Any], Any], categories: KernelCategories, replays: int = 5) -> dict[str, Any]:
    """split_kernel_times of `replays` calls of `fn(None)` after one untimed call, from torch.profiler
    (CUPTI sees every kernel in the process, CuPy's and CUDA graph replays included), and the same calls'
    critical_path_split from its trace (the kernel times of programmatic launches overlap; their path
    shares do not); {"note": ...} where torch is not installed. The calls are queued behind
    timing.hold_stream, so they run back to back as in a GPU time, and "idle ms" is the GPU's idle time
    inside them, not the host's gaps between them."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {"note": "torch is not installed: no profiler"}
    start = time.perf_counter()
    fn(None)
    torch.cuda.synchronize()
    per_call = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # twice the calls' unprofiled time (time_gpu's margin is 1.5): the profiler adds host time per launch
        hold_stream(min(0.2, 2 * per_call * replays))
        for _ in range(replays):
            fn(None)
        torch.cuda.synchronize()
    split = split_kernel_times(((e.key, e.self_device_time_total / 1e3) for e in prof.key_averages()
                                if e.key != HOLD_KERNEL), categories, replays)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    intervals = [interval for interval in trace_intervals(trace) if interval[0] != HOLD_KERNEL]
    return split | critical_path_split(intervals, categories, replays)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table; floats are shown with 3 significant digits."""
    if not rows:
        return "(no results)"
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    text = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(t.ljust(w) for t, w in zip(row, widths)) for row in text]
    return "\n".join(lines)


def torch_dtype(dtype: str) -> Any:
    """PyTorch's dtype for a libnn short dtype name (fp32, fp16, bf16): the benchmarks' peers."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


def torch_graph(eager: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`eager` captured in a torch.cuda.graph on its static inputs (warmed up on a side stream, as
    PyTorch's documentation does it); returns the replay, called as eager is."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager(None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager(None)
    return lambda _: graph.replay()


def progress(i: int, total: int, label: str) -> None:
    """One line per step on stderr, so that long runs show where they are without cluttering stdout."""
    print(f"[{i}/{total}] {label}", file=sys.stderr, flush=True)


def save_json(path: str, payload: dict[str, Any]) -> None:
    def plain(o: Any) -> Any:
        return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)

    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=plain)
