"""`libnn bench models`: whole models, libnn's CUDA-graph replay and eager calls against PyTorch's.

Parts (`--only` picks some, comma-separated):
- cnn: the seed CNN (libnn.models.SeedCNN, the shipped weights) at batch 1, 256 and 4096 in fp32 and
  fp16.
- block: conv→BN→ReLU, N=32 C=K=64 56² fp16 NHWC (one `Sequential`, fused into one cuDNN graph).
- encoder: BERT encoders loaded from a Hugging Face checkpoint directory (a `transformers.BertModel`
  with random weights, saved with `save_pretrained` and read by `BertEncoder.from_pretrained`): the
  MiniLM-L6 shape (6 layers, hidden 384, 12 heads of 32, FFN 1536) and BERT-base (12 layers, 768,
  12×64, 3072), fp16 and bf16, sequence 128, right-padded with lengths uniform in 4..128 (fixed seed),
  batch 1, 32 and 256. Each case also gets the kernel-time split of libnn's graph replay by category
  (torch.profiler: GEMM, attention, LayerNorm, other glue) and the cosine of libnn's last hidden
  state to Hugging Face's in fp32 over the real tokens.
- server: the encoder in fp16 at sequence 128, graphed with batch buckets (1, 2, 4, ..., 64), fed a
  fixed-seed random sequence of batch sizes 1..64 after one warm-up call per bucket, against the same
  calls on static graphs captured at each exact batch size (no padding; the caller's buffers replayed
  with no copy), the best a CUDA graph can do for those batch sizes.
- cold: the cold start (a new process with a cold and then a warm plan cache, to the first result).

Rows per case: libnn graph (one CUDA graph per input shape, replayed on its input buffers, filled once
through `g.inputs()`, as the torch.cuda.graph peer replays its static inputs, and so are the other
libnn graph rows; the first call's split into eager warm-up and capture beside it), libnn graph with
the inputs copied in (`g(*inputs)` each call: the same replay after one device copy per input), libnn eager (op by op from Python), for the seed CNN libnn forced to
its custom path, for the encoders libnn's graph with unpad=False (every padding position computed, as
Hugging Face does; the default packs the tokens, and each call reads their count back), and the peers in the same run: PyTorch eager (Hugging Face transformers for the
encoders), the same captured in a `torch.cuda.graph` (static inputs, replayed), and `torch.compile`
of it (on the cases the targets name: a compile takes tens of seconds). "ms" is GPU time (queue pre-filled);
"per-call ms" is back-to-back calls with nothing queued before, what a user's loop sees.

Targets: seed CNN bs1 graph ≤ 0.040 ms and faster than torch's graph; conv→BN→ReLU graph faster than
torch's graph; encoder graphs ≥ 1.3× Hugging Face captured in a CUDA graph at every batch and ≥ 1.3×
torch.compile at batch 32 and 256; MiniLM at batch 256 ≤ 2.5 ms; glue ≤ 20% of the kernel time at
batch 256; cosine ≥ 0.9999; cold start ≤ 3 s; the bucketed server loop within 15% of the exact static
graphs' throughput.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from libnn import dtypes
from libnn.bench import harness
from libnn.errors import LibnnError
from libnn.models.bert import BertConfig, BertEncoder
from libnn.models.seed_cnn import SeedCNN
from libnn.models.train_seed_cnn import torch_model
from libnn.nn import BatchNorm2d, Conv2d, ReLU, Sequential

PARTS = ("cnn", "block", "encoder", "server", "cold")
SERVER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ENCODER = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
           "intermediate_size": 1536, "max_position_embeddings": 512, "hidden_act": "gelu"}
SHAPES = {"MiniLM": ENCODER,
          "BERT-base": {**ENCODER, "hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072}}
SEQ = 128
SHORTEST = 4  # padded batches: lengths uniform in SHORTEST..SEQ
BLOCK = {"N": 32, "C": 64, "K": 64, "HW": 56}
# the kernel-time split's categories (harness.kernel_split), tried in order; everything else is glue
KERNEL_CATEGORIES = (("attention", harness.ATTENTION_KERNELS), ("GEMM", harness.GEMM_KERNELS),
                     ("LayerNorm", re.compile(r"layernorm|layer_norm|^ln\d|_ln_|ln1_")))


@dataclass(frozen=True)
class Case:
    model: str      # "seed CNN", "conv-BN-ReLU", "MiniLM" or "BERT-base"
    batch: int
    dtype: str
    compile: bool   # also time torch.compile


def _cases(quick: bool, parts: tuple[str, ...]) -> list[Case]:
    cases = []
    if "cnn" in parts:
        cnn = [("fp32", 1), ("fp16", 1)] if quick else [(d, b) for d in ("fp32", "fp16") for b in (1, 256, 4096)]
        cases += [Case("seed CNN", b, d, (b, d) == (1, "fp16") and not quick) for d, b in cnn]
    if "block" in parts:
        cases.append(Case("conv-BN-ReLU", BLOCK["N"], "fp16", False))
    if "encoder" in parts:
        if quick:
            cases.append(Case("MiniLM", 1, "fp16", False))
        else:
            # torch.compile takes about a minute per shape: the batches the targets name, in fp16
            cases += [Case(shape, b, d, d == "fp16" and b in (32, 256))
                      for shape in SHAPES for d in ("fp16", "bf16") for b in (1, 32, 256)]
    return cases


# --- libnn's side ---------------------------------------------------------------------------------
def _libnn_model(case: Case, path: str = "auto", checkpoint: str | None = None, unpad: bool = True):
    """The libnn model and its inputs for `case`, on the GPU (an encoder unpadded or not)."""
    import cupy

    rng = cupy.random.default_rng(11)
    if case.model == "seed CNN":
        model = SeedCNN.pretrained(dtype=case.dtype, device="gpu", path=path)
        x = rng.standard_normal((case.batch, 1, 28, 28), dtype=cupy.float32).astype(dtypes.parse(case.dtype))
        return model, (x,)
    if case.model == "conv-BN-ReLU":
        C, K, HW = BLOCK["C"], BLOCK["K"], BLOCK["HW"]
        kw = dict(layout="NHWC", dtype=case.dtype, device="gpu")
        model = Sequential(Conv2d(C, K, 3, padding=1, path=path, **kw), BatchNorm2d(K, **kw), ReLU())
        x = rng.standard_normal((case.batch, HW, HW, C), dtype=cupy.float32).astype(dtypes.parse(case.dtype))
        return model, (x,)
    model = BertEncoder.from_pretrained(checkpoint, dtype=case.dtype, device="gpu", path=path, unpad=unpad)
    ids, mask = _encoder_inputs(case)
    return model, (cupy.asarray(ids), cupy.asarray(mask))


def _encoder_inputs(case: Case):
    """Token ids (B, SEQ) and a right-padded attention mask with lengths uniform in SHORTEST..SEQ, as
    NumPy int64 (both frameworks get the same)."""
    import numpy as np

    rng = np.random.default_rng(11)
    ids = rng.integers(0, ENCODER["vocab_size"], (case.batch, SEQ), dtype=np.int64)
    lengths = rng.integers(SHORTEST, SEQ + 1, case.batch)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    return ids, mask


def _libnn_timings(case: Case, checkpoint: str | None) -> list[tuple[str, Callable[[Any], Any], dict[str, Any]]]:
    model, inputs = _libnn_model(case, checkpoint=checkpoint)
    graphed = model.graphed()
    start = time.perf_counter()
    graphed(*inputs)
    first_call = time.perf_counter() - start
    stats = next(iter(graphed.stats().values()))
    split = {"first call s": first_call, "warm-up s": stats.warmup_seconds, "capture s": stats.capture_seconds}
    found = [("libnn graph", _replay_on_buffers(graphed, inputs), split),
             ("libnn graph, inputs copied", lambda _: graphed(*inputs), {}),
             ("libnn eager", lambda _: model(*inputs), {})]
    if case.model == "seed CNN":
        custom, custom_inputs = _libnn_model(case, path="custom")
        found.append(("libnn custom graph", _replay_on_buffers(custom.graphed(), custom_inputs), {}))
    if case.model in SHAPES:  # the fusion's twin: every position computed, as Hugging Face does
        padded, padded_inputs = _libnn_model(case, checkpoint=checkpoint, unpad=False)
        found.append(("libnn graph padded", _replay_on_buffers(padded.graphed(), padded_inputs), {}))
    return found


def _replay_on_buffers(graphed: Any, inputs: tuple[Any, ...]) -> Callable[[Any], Any]:
    """The replay of `graphed`'s capture for `inputs` on its own input buffers, filled with them once
    (g.inputs), as the torch.cuda.graph peer replays its static inputs."""
    for buffer, array in zip(graphed.inputs(*inputs), inputs):
        buffer[...] = array
    return lambda _: graphed.replay()


# --- PyTorch's side -------------------------------------------------------------------------------
def _torch_model(case: Case, checkpoint: str | None):
    """The same network in PyTorch and its inputs (keyword arguments). The seed CNN and the block have
    random weights (only their time is compared); the encoders are the checkpoint libnn loads."""
    import torch

    dtype = harness.torch_dtype(case.dtype)
    if case.model == "seed CNN":
        model = torch_model().cuda().eval().to(dtype).to(memory_format=torch.channels_last)
        x = torch.randn(case.batch, 1, 28, 28, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        return model, {"input": x}
    if case.model == "conv-BN-ReLU":
        from torch import nn

        C, K, HW = BLOCK["C"], BLOCK["K"], BLOCK["HW"]
        model = nn.Sequential(nn.Conv2d(C, K, 3, padding=1), nn.BatchNorm2d(K), nn.ReLU())
        model = model.cuda().eval().to(dtype).to(memory_format=torch.channels_last)
        x = torch.randn(case.batch, C, HW, HW, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        return model, {"input": x}
    from transformers import BertModel

    model = BertModel.from_pretrained(checkpoint, add_pooling_layer=False, torch_dtype=dtype).cuda().eval()
    ids, mask = _encoder_inputs(case)
    return model, {"input_ids": torch.from_numpy(ids).cuda(), "attention_mask": torch.from_numpy(mask).cuda()}


def _torch_timings(case: Case, checkpoint: str | None) -> list[tuple[str, Callable[[Any], Any], dict[str, Any]]]:
    try:
        import torch
        if case.model in SHAPES:
            import transformers  # noqa: F401
    except ImportError:
        return []
    torch.backends.cudnn.benchmark = True
    model, inputs = _torch_model(case, checkpoint)
    peer = "HF" if case.model in SHAPES else "torch"

    def eager(_):
        with torch.inference_mode():
            return model(**inputs)

    found = [(f"{peer} eager", eager, {})]
    try:
        found.append((f"{peer} eager in torch.cuda.graph", harness.torch_graph(eager), {}))
    except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured is reported, not fatal
        found.append((f"{peer} eager in torch.cuda.graph", None, {"note": str(exc).splitlines()[0][:70]}))
    if case.compile:
        compiled = torch.compile(model)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(**inputs)
            torch.cuda.synchronize()

        def run_compiled(_):
            with torch.inference_mode():
                return compiled(**inputs)

        found.append(("torch.compile", run_compiled, {"first call s": time.perf_counter() - start}))
    return found


# --- one case -------------------------------------------------------------------------------------
def _rows_for(case: Case, checkpoint: str | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    rows = []
    timings = _libnn_timings(case, checkpoint) + _torch_timings(case, checkpoint)
    for path, fn, extra in timings:
        row = {"model": case.model, "batch": case.batch, "dtype": case.dtype, "path": path, **extra}
        if fn is not None:
            try:
                row["ms"] = harness.time_gpu(fn, [None], warmup=3, runs=30).median_ms
                # enough back-to-back calls for ~0.1 s per repeat: 20 calls of a 30 µs graph are noise
                calls = max(20, min(2000, int(100 / max(row["ms"], 1e-3))))
                row["per-call ms"] = harness.time_per_call(lambda: fn(None), calls=calls, repeats=5,
                                                           warmup=min(calls, 50))
            except (LibnnError, RuntimeError) as exc:
                row["note"] = str(exc).splitlines()[0][:70]
        rows.append(row)
    base = next((r.get("ms") for r in rows if r["path"] == "libnn graph"), None)
    for r in rows:
        if base and r.get("ms"):
            r["x libnn graph"] = r["ms"] / base
    split = None
    if case.model in SHAPES:
        graph = timings[0][1]
        split = {"model": case.model, "batch": case.batch, "dtype": case.dtype,
                 **harness.kernel_split(graph, KERNEL_CATEGORIES)}
        rows[0]["cos vs HF fp32"] = _cosine_to_hf(case, checkpoint, graph(None).last_hidden_state)
    return rows, split


def _cosine_to_hf(case: Case, checkpoint: str, hidden: Any) -> float | None:
    """Cosine similarity of libnn's last hidden state `hidden` (the case's dtype) to Hugging Face's in
    fp32, over the real (unpadded) tokens."""
    try:
        import torch
        from transformers import BertModel
    except ImportError:
        return None
    import cupy
    import numpy as np

    ours = cupy.asnumpy(hidden).astype(np.float64)
    reference = BertModel.from_pretrained(checkpoint, add_pooling_layer=False).cuda().eval()
    ids, mask = _encoder_inputs(case)
    with torch.inference_mode():
        theirs = reference(input_ids=torch.from_numpy(ids).cuda(),
                           attention_mask=torch.from_numpy(mask).cuda()).last_hidden_state.double().cpu().numpy()
    real = mask.astype(bool)
    a, b = ours[real].ravel(), theirs[real].ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _checkpoints(directory: str, cases: list[Case]) -> dict[str, str]:
    """One Hugging Face checkpoint directory per encoder shape the cases use: a BertModel with random
    weights (fixed seed), saved as transformers saves it (config.json, model.safetensors)."""
    found = {}
    shapes = sorted({c.model for c in cases if c.model in SHAPES})
    if not shapes:
        return found
    import torch
    from transformers import BertConfig, BertModel

    for shape in shapes:
        torch.manual_seed(0)
        path = os.path.join(directory, shape)
        BertModel(BertConfig(**SHAPES[shape]), add_pooling_layer=False).save_pretrained(path)
        found[shape] = path
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


def run(quick: bool = False, json_path: str | None = None, only: str | None = None) -> list[dict[str, Any]]:
    import cupy

    parts = _parts(only)
    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    cases = _cases(quick, parts)
    if any(c.model in SHAPES for c in cases) and not _has_transformers():
        print("encoder cases skipped: they load a Hugging Face checkpoint, and transformers (with torch) is "
              "not installed")
        cases = [c for c in cases if c.model not in SHAPES]
    steps = len(cases) + ("server" in parts) + ("cold" in parts)
    rows: list[dict[str, Any]] = []
    splits: list[dict[str, Any]] = []
    server = cold = None
    with tempfile.TemporaryDirectory() as directory:
        checkpoints = _checkpoints(directory, cases)
        for i, case in enumerate(cases, 1):
            harness.progress(i, steps, f"{case.model} batch {case.batch} {case.dtype}")
            case_rows, split = _rows_for(case, checkpoints.get(case.model))
            rows += case_rows
            splits += [split] if split else []
            cupy.get_default_memory_pool().free_all_blocks()
    if "server" in parts:
        harness.progress(len(cases) + 1, steps, "server loop")
        server = _server_loop(quick)
        cupy.get_default_memory_pool().free_all_blocks()
    if "cold" in parts:
        harness.progress(steps, steps, "cold start")
        cold = _cold_start()
    print(harness.format_table(rows, ["model", "batch", "dtype", "path", "ms", "per-call ms", "x libnn graph",
                                      "cos vs HF fp32", "first call s", "warm-up s", "capture s", "note"]))
    if splits:
        print("kernel time per forward of libnn's graph replay, by category (torch.profiler):")
        print(harness.format_table(splits, ["model", "batch", "dtype", "GEMM ms", "attention ms", "LayerNorm ms",
                                            "glue ms", "kernels ms", "glue %", "top glue", "note"]))
    if server:
        print(_format_server(server))
    print(_targets(rows, splits, cold, server))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": rows, "kernel_split": splits,
                                      "cold_start": cold, "server_loop": server})
    return rows


def _has_transformers() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _parts(only: str | None) -> tuple[str, ...]:
    if only is None:
        return PARTS
    parts = tuple(p.strip() for p in only.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"bench models: --only must name parts among {', '.join(PARTS)} (comma-separated), "
                         f"got {only!r}")
    return parts


def _targets(rows: list[dict[str, Any]], splits: list[dict[str, Any]], cold: dict[str, dict[str, float]] | None,
             server: dict[str, Any] | None) -> str:
    def ms(model, batch, dtype, path="libnn graph"):
        return next((r.get("ms") for r in rows if (r["model"], r["batch"], r["dtype"], r["path"])
                     == (model, batch, dtype, path)), None)

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = ["targets (libnn graph replay, GPU time; peers in the same run):"]
    if (t := ms("seed CNN", 1, "fp16")) is not None:
        peer = ms("seed CNN", 1, "fp16", "torch eager in torch.cuda.graph")
        lines.append(f"  seed CNN bs1 fp16: {t:.4f} ms (target <= 0.040: {verdict(t <= 0.040)})"
                     + (f"; torch graph {peer:.4f} ms, {peer / t:.2f}x (target > 1: {verdict(peer > t)})" if peer else ""))
    if (t := ms("conv-BN-ReLU", BLOCK["N"], "fp16")) is not None:
        peer = ms("conv-BN-ReLU", BLOCK["N"], "fp16", "torch eager in torch.cuda.graph")
        if peer:
            lines.append(f"  conv-BN-ReLU graph: {t:.4f} ms vs torch graph {peer:.4f} ms, {peer / t:.2f}x "
                         f"(target > 1: {verdict(peer > t)})")
    for shape in SHAPES:
        for dtype in ("fp16", "bf16"):
            for batch in (1, 32, 256):
                if (t := ms(shape, batch, dtype)) is None:
                    continue
                line = f"  {shape} {dtype} bs{batch}: {t:.3f} ms"
                if peer := ms(shape, batch, dtype, "HF eager in torch.cuda.graph"):
                    line += f"; vs HF graph {peer / t:.2f}x (>= 1.3: {verdict(peer / t >= 1.3)})"
                if batch in (32, 256) and (peer := ms(shape, batch, dtype, "torch.compile")):
                    line += f"; vs torch.compile {peer / t:.2f}x (>= 1.3: {verdict(peer / t >= 1.3)})"
                if (shape, batch) == ("MiniLM", 256):
                    line += f"; <= 2.5 ms: {verdict(t <= 2.5)}"
                lines.append(line)
    for split in splits:
        if split["batch"] == 256 and split.get("glue %") is not None:
            glue = 100 - 100 * (split["GEMM ms"] + split["attention ms"]) / split["kernels ms"]
            lines.append(f"  {split['model']} {split['dtype']} bs256: everything but GEMM and attention "
                         f"{glue:.0f}% of kernel time (target <= 20%: {verdict(glue <= 20)})")
    for r in rows:
        if (cos := r.get("cos vs HF fp32")) is not None:
            lines.append(f"  {r['model']} {r['dtype']} bs{r['batch']}: cosine to HF fp32 {cos:.7f} "
                         f"(target >= 0.9999: {verdict(cos >= 0.9999)})")
    for label, times in (cold or {}).items():
        lines.append(f"  cold start, plan {label}: {times['process s']:.2f} s to the first result "
                     f"({times['in-process s']:.2f} s after the interpreter started)"
                     + (f"  (target <= 3: {verdict(times['process s'] <= 3)})" if label == "cache warm" else ""))
    if server:
        ratio = server["x exact static"]
        lines.append(f"  server loop, bucketed vs exact static graphs: {ratio:.2f}x the throughput  (target >= 0.85: "
                     f"{verdict(ratio >= 0.85)})")
    return "\n".join(lines)
