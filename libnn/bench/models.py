"""`libnn bench models`: whole models, libnn's CUDA-graph replay against eager libnn, forced paths and PyTorch.

Models: the seed CNN (libnn.models.SeedCNN, the shipped weights) at batch 1, 256 and 4096 in fp32 and
fp16, and a 6-layer BERT-style encoder (hidden 384, 12 heads, FFN 1536, sequence 128, random weights)
at batch 1, 32 and 256 in fp16. Rows: libnn graph (one CUDA graph per input shape, replayed), libnn
eager (op by op from Python), libnn forced to the custom path (graph replay), and PyTorch eager and
torch.compile (one case per model: its compile takes a minute) when installed. The first graph call's split
(eager warm-up that builds plans, capture) is reported with each graph row; the cold start (a new
process with a warm plan cache, to the first result) is measured in a subprocess.

The server loop (`_server_loop`): the encoder in fp16 at sequence 128, graphed with batch buckets
(1, 2, 4, ..., 64), fed a fixed-seed random sequence of batch sizes 1..64 after one warm-up call per
bucket, against the same calls on static graphs captured at each exact batch size (no padding; the
caller's buffers replayed with no copy), the best a CUDA graph can do for those batch sizes.

Targets: seed CNN bs1 ≤ 0.10 ms, bs256 fp16 ≤ 0.15 ms; encoder bs1 ≤ 0.35 ms, bs32 ≤ 1.8 ms; cold
start ≤ 3 s; the bucketed server loop within 15% of the exact static graphs' throughput.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from libnn import dtypes
from libnn.bench import harness

SERVER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ENCODER = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
           "intermediate_size": 1536, "max_position_embeddings": 512, "hidden_act": "gelu"}
SEQ = 128


@dataclass(frozen=True)
class Case:
    model: str      # "seed CNN" or "encoder"
    batch: int
    dtype: str
    compile: bool   # also time torch.compile (an anchor case)


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("seed CNN", 1, "fp32", False), Case("encoder", 1, "fp16", False)]
    # torch.compile takes 20-75 s per model and shape, so only one case per model compiles
    cnn = [Case("seed CNN", b, d, (b, d) == (256, "fp16")) for d in ("fp32", "fp16") for b in (1, 256, 4096)]
    encoder = [Case("encoder", b, "fp16", b == 32) for b in (1, 32, 256)]
    return cnn + encoder


def _libnn_model(case: Case, path: str = "auto"):
    """The libnn model and one input for `case`, on the GPU."""
    import cupy

    rng = cupy.random.default_rng(11)
    if case.model == "seed CNN":
        from libnn.models import SeedCNN

        model = SeedCNN.pretrained(dtype=case.dtype, device="gpu", path=path)
        x = rng.standard_normal((case.batch, 1, 28, 28), dtype=cupy.float32).astype(dtypes.parse(case.dtype))
        return model, (x,)
    from libnn.models import BertConfig, BertEncoder

    model = BertEncoder(BertConfig.from_dict(ENCODER), pooler=False, dtype=case.dtype, device="gpu", path=path)
    ids = rng.integers(0, ENCODER["vocab_size"], (case.batch, SEQ), dtype=cupy.int64)
    return model, (ids,)


def _torch_model(case: Case):
    """The same network in PyTorch (weights random: only the time is compared), and its input."""
    import torch

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[case.dtype]
    if case.model == "seed CNN":
        from libnn.models.train_seed_cnn import torch_model

        model = torch_model().cuda().eval().to(dtype).to(memory_format=torch.channels_last)
        x = torch.randn(case.batch, 1, 28, 28, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        return model, x
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**ENCODER), add_pooling_layer=False).cuda().eval().to(dtype)
    return model, torch.randint(0, ENCODER["vocab_size"], (case.batch, SEQ), device="cuda")


def _rows_for(case: Case, ceilings: harness.Ceilings) -> list[dict[str, Any]]:
    from libnn.errors import LibnnError

    rows = []
    timings: list[tuple[str, Callable[[Any], Any], dict[str, Any]]] = []
    model, inputs = _libnn_model(case)
    graphed = model.graphed()
    start = time.perf_counter()
    graphed(*inputs)
    first_call = time.perf_counter() - start
    stats = next(iter(graphed.stats().values()))
    split = {"first call s": first_call, "warm-up s": stats.warmup_seconds, "capture s": stats.capture_seconds}
    timings += [("libnn graph", lambda _: graphed(*inputs), split), ("libnn eager", lambda _: model(*inputs), {})]
    custom, custom_inputs = _libnn_model(case, path="custom")
    custom_graphed = custom.graphed()
    timings.append(("libnn custom graph", lambda _: custom_graphed(*custom_inputs), {}))
    timings += _torch_timings(case)
    for path, fn, extra in timings:
        row = {"model": case.model, "batch": case.batch, "dtype": case.dtype, "path": path, **extra}
        try:
            row["ms"] = harness.time_gpu(fn, [None], warmup=3, runs=30).median_ms
            row["per-call ms"] = harness.time_per_call(lambda: fn(None), calls=20, repeats=3, warmup=2)
        except (LibnnError, RuntimeError) as exc:
            row["note"] = str(exc).splitlines()[0][:70]
        rows.append(row)
    base = next((r.get("ms") for r in rows if r["path"] == "libnn graph"), None)
    for r in rows:
        if base and r.get("ms"):
            r["x libnn graph"] = r["ms"] / base
    return rows


def _torch_timings(case: Case) -> list[tuple[str, Callable[[Any], Any], dict[str, Any]]]:
    try:
        import torch
        if case.model == "encoder":
            import transformers  # noqa: F401
    except ImportError:
        return []
    model, x = _torch_model(case)

    def eager(_):
        with torch.inference_mode():
            return model(x)

    found = [("torch eager", eager, {})]
    if case.compile:
        compiled = torch.compile(model)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(x)
            torch.cuda.synchronize()

        def run_compiled(_):
            with torch.inference_mode():
                return compiled(x)

        found.append(("torch.compile", run_compiled, {"first call s": time.perf_counter() - start}))
    return found


COLD_START = """
import time, cupy
start = time.perf_counter()
from libnn.models import SeedCNN
model = SeedCNN.pretrained(dtype="fp16", device="gpu").graphed()
x = cupy.ones((256, 1, 28, 28), cupy.float16)
y = model(x).get()
print(f"{time.perf_counter() - start:.3f}")
"""


def _cold_start() -> dict[str, dict[str, float]]:
    """Seconds from a new process's start to the first result of the graphed seed CNN (bs256 fp16), with
    an empty kernel and plan cache (first run) and with the cache the first run left (what a deployed
    service sees)."""
    found = {}
    with tempfile.TemporaryDirectory() as cache:  # a cache of its own: the first run really starts cold
        env = {**os.environ, "LIBNN_CACHE_DIR": cache}
        for label in ("cache cold", "cache warm"):
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", COLD_START], capture_output=True, text=True, check=True,
                                 env=env)
            found[label] = {"process s": time.perf_counter() - start, "in-process s": float(out.stdout.split()[-1])}
    return found


def _server_loop(quick: bool) -> dict[str, Any]:
    """Throughput (sequences/s) of the encoder graphed with buckets, called with a fixed-seed random
    sequence of batch sizes (1..64; 1..8 with --quick), after one warm-up call per bucket. The baseline
    replays the same batch sizes on static graphs captured at each exact size, from buffers filled
    beforehand (`g.inputs`, so no copy and no padding): what the bucketed loop costs over it is the
    padded rows plus the per-call work (signature, copy into the buffers, padding rows, slicing). The
    static batch-64 graph's throughput is reported for scale: small batches cannot reach it."""
    import cupy
    import numpy as np

    from libnn.models import BertConfig, BertEncoder

    buckets = SERVER_BUCKETS[:4] if quick else SERVER_BUCKETS
    sizes = [int(n) for n in np.random.default_rng(5).integers(1, buckets[-1] + 1, 40 if quick else 200)]
    model = BertEncoder(BertConfig.from_dict(ENCODER), pooler=False, dtype="fp16", device="gpu")
    ids = cupy.random.default_rng(11).integers(0, ENCODER["vocab_size"], (buckets[-1], SEQ), dtype=cupy.int64)
    batches = {n: ids[:n] for n in sorted(set(sizes) | {buckets[-1]})}
    bucketed = model.graphed(buckets=buckets)
    for b in buckets:
        bucketed(ids[:b])
    exact = model.graphed(max_captures=len(batches))
    filled = {}
    for n, batch in batches.items():
        filled[n] = exact.inputs(batch)
        filled[n][0][...] = batch

    def bucketed_loop():
        for n in sizes:
            bucketed(batches[n])

    def exact_loop():
        for n in sizes:
            exact(*filled[n])

    def static_top():
        exact(*filled[buckets[-1]])

    sequences = sum(sizes)
    found = {"calls": len(sizes), "sequences": sequences, "buckets": list(buckets),
             "bucketed seq/s": sequences / _wall_seconds(bucketed_loop),
             "exact static seq/s": sequences / _wall_seconds(exact_loop),
             f"static bs{buckets[-1]} seq/s": buckets[-1] / _wall_seconds(static_top, calls=20)}
    found["x exact static"] = found["bucketed seq/s"] / found["exact static seq/s"]
    found["bucket stats"] = [{"bucket": key[0], "captures": s.captures, "replays": s.replays,
                              "pad waste": s.pad_waste} for key, s in sorted(bucketed.stats().items())]
    return found


def _wall_seconds(fn: Callable[[], Any], *, calls: int = 1) -> float:
    """Seconds per call of `fn` as a server sees it (harness.time_per_call: back-to-back, nothing queued
    before, one synchronisation at the end; the median of 3 after one untimed call)."""
    return harness.time_per_call(fn, calls=calls, repeats=3, warmup=1) / 1e3


def _format_server(server: dict[str, Any]) -> str:
    top = f"static bs{server['buckets'][-1]} seq/s"
    label = f"static bs{server['buckets'][-1]} graph"
    lines = [f"server loop: encoder fp16 seq {SEQ}, {server['calls']} calls of random batch 1..{server['buckets'][-1]} "
             f"({server['sequences']} sequences), buckets {server['buckets']}",
             f"  bucketed graphs     {server['bucketed seq/s']:10.0f} seq/s  ({server['x exact static']:.2f}x the "
             "exact static graphs)",
             f"  exact static graphs {server['exact static seq/s']:10.0f} seq/s",
             f"  {label:<19} {server[top]:10.0f} seq/s  (for scale: every call at the largest batch)",
             harness.format_table(server["bucket stats"], ["bucket", "captures", "replays", "pad waste"])]
    return "\n".join(lines)


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    import cupy

    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    cases = _cases(quick)
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases, 1):
        harness.progress(i, len(cases) + 2, f"{case.model} batch {case.batch} {case.dtype}")
        rows += _rows_for(case, ceilings)
        cupy.get_default_memory_pool().free_all_blocks()
    harness.progress(len(cases) + 1, len(cases) + 2, "server loop")
    server = _server_loop(quick)
    cupy.get_default_memory_pool().free_all_blocks()
    harness.progress(len(cases) + 2, len(cases) + 2, "cold start")
    cold = _cold_start()
    print(harness.format_table(rows, ["model", "batch", "dtype", "path", "ms", "per-call ms", "x libnn graph", "first call s",
                                      "warm-up s", "capture s", "note"]))
    print(_format_server(server))
    print(_targets(rows, cold, server))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": rows, "cold_start": cold, "server_loop": server})
    return rows


def _targets(rows: list[dict[str, Any]], cold: dict[str, dict[str, float]], server: dict[str, Any]) -> str:
    def ms(model, batch, dtype):
        return next((r.get("ms") for r in rows if (r["model"], r["batch"], r["dtype"], r["path"])
                     == (model, batch, dtype, "libnn graph")), None)

    lines = ["targets (libnn graph replay):"]
    for model, batch, dtype, target in (("seed CNN", 1, "fp32", 0.10), ("seed CNN", 256, "fp16", 0.15),
                                        ("encoder", 1, "fp16", 0.35), ("encoder", 32, "fp16", 1.8)):
        if (t := ms(model, batch, dtype)) is not None:
            lines.append(f"  {model} bs{batch} {dtype}: {t:.3f} ms  (target <= {target}: {'met' if t <= target else 'MISSED'})")
    for label, times in cold.items():
        verdict = "met" if times["process s"] <= 3 else "MISSED"
        lines.append(f"  cold start, plan {label}: {times['process s']:.2f} s to the first result "
                     f"({times['in-process s']:.2f} s after the interpreter started)"
                     + (f"  (target <= 3: {verdict})" if label == "cache warm" else ""))
    ratio = server["x exact static"]
    lines.append(f"  server loop, bucketed vs exact static graphs: {ratio:.2f}x the throughput  (target >= 0.85: "
                 f"{'met' if ratio >= 0.85 else 'MISSED'})")
    return "\n".join(lines)
