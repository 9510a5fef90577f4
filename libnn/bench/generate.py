"""`libnn bench generate`: LLaMA-architecture decoding, libnn's CausalLM against Hugging Face eager.

The model: the LLaMA architecture with random weights, Hugging Face's own
`transformers.LlamaForCausalLM(config)` made on the GPU (every matrix normal with std 0.02 from seed 0,
the norms ones) and cast there to the case's dtype, saved with `save_pretrained` (safetensors) and read
by `libnn.models.CausalLM.from_pretrained`; the Hugging Face model stays in memory as the peer, so both
run the same weights.
- full: about 1.1B parameters (16 layers, hidden 2048, 32 heads of 64, 8 KV heads, FFN 8192, vocab
  32000), fp16 and bf16, batch 1, 8 and 64, prompts of 512 random token ids, then 256 greedy decode steps;
- `--quick`: 4 layers, hidden 1024, 16 heads, 4 KV heads, FFN 2816, vocab 32000 (0.11B), fp16, batch 1
  and 8, prompts of 128 tokens, 32 decode steps.

Rows per (dtype, batch):
- libnn eager: `prefill` of the prompts, then `decode_step` after `decode_step`, each fed the argmax
  of the last logits (greedy). `decode_step` checks its token ids against the vocabulary, one
  synchronisation per step (`generate` has one too: it reads each step's tokens back for its end
  tokens), so the queue never runs ahead and libnn's GPU time per step includes its host time.
- HF eager: Hugging Face's forward in `torch.inference_mode()` (its default attention implementation,
  named in the note): prefill is one forward over the prompts with use_cache (logits of the last
  position only, as its `generate` asks for), a decode step one forward of one token per sequence with
  its cache (`past_key_values`; `cache` in recent transformers 5 releases), then the argmax. This is
  what HF's `generate` runs per step, without its logits processors and stopping checks (which
  synchronise every step).

Columns: "prefill ms" is the median of 3 prefills after one untimed (CUDA events around it). "decode
ms/step" is GPU time: one event pair around each step of a loop of every decode step after a prefill of
the same prompts, the median of the steps after the warm-up ones (8; quick 4), whose plans and graphs
are built. "per-call ms/step" is the decode loop as a user sees it: a new prefill, the warm-up steps,
then the other steps back to back with nothing queued before them and one synchronisation at the end,
per step. "tokens/s" is batch / decode ms/step. "%copy weights" is the weight bytes one decode step
must read (`decode_bytes`: every parameter once, except that an untied embedding table is read only at
the batch's rows) per step time, as a % of the device-to-device copy bandwidth measured in the same run;
"%copy w+KV" adds the KV cache one step's attention reads at the median timed step's context (the same
bytes for both rows: Hugging Face's cache copies itself as it grows, which is not counted). "x HF" is
Hugging Face's per-call ms/step over libnn's: both decode loops are eager and bound by the host's time
per step, and on the H100 the event pairs around Hugging Face's unsynchronised steps read several times
the time its loop took from Python (benchmarks/RESULTS.md, seventh session), so its GPU column is not
used for the ratio. "greedy vs HF" (batch 1): how many of the first 8 tokens of
libnn's `generate` equal Hugging Face's `generate(do_sample=False)` on the first prompt before the first
difference, Hugging Face with fp32 accumulation in its fp16/bf16 GEMMs (reduced-precision reductions
off); near-ties in fp16/bf16 may part them, so a mismatch is reported, not fatal. A case that runs out
of memory or that a library declines gets the reason in its note.

Targets (issue 16, H100, the 1B shape): batch-1 decode at >= 80% of copy bandwidth in fp16 (weights
per step over step time); >= 3x Hugging Face eager tokens/s at batch 1. Not measured here yet: FP8
decode, decode attention at batch 64 and context 4096, Hugging Face with its static cache and
torch.compile, the GPT-2 small shape, and the kernel-time split per category.
"""

from __future__ import annotations

import gc
import inspect
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from libnn import dtypes
from libnn.bench import harness
from libnn.errors import LibnnError
from libnn.models.llama import CausalLM, LlamaConfig
from libnn.runtime import memory

# Hugging Face LlamaConfig fields; max_position_embeddings only bounds the cache (prompt + steps).
SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 2048}
QUICK_SHAPE = {**SHAPE, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
               "num_attention_heads": 16, "num_key_value_heads": 4}
INIT_STD = 0.02    # the weight matrices' standard deviation (Hugging Face's initializer_range)
GREEDY_TOKENS = 8   # tokens of libnn's generate compared with Hugging Face's at batch 1
LIBNN, HF = "libnn eager", "HF eager"
# What a case that fails may raise: libnn declining it, running out of GPU memory (CuPy's
# OutOfMemoryError is a MemoryError, torch's a RuntimeError), a library's own error.
CASE_ERRORS = (LibnnError, MemoryError, RuntimeError)


@dataclass(frozen=True)
class Plan:
    shape: dict[str, int]   # Hugging Face LlamaConfig fields
    dtypes: tuple[str, ...]
    batches: tuple[int, ...]
    prompt: int          # tokens per prompt
    steps: int           # decode steps after the prefill
    warmup: int          # decode steps left out of the timings
    prefill_runs: int = 3

    @property
    def max_len(self) -> int:
        """The KV cache's length: the prompt and every decode step's token, or the greedy comparison's
        (generate appends all its tokens but the last)."""
        return self.prompt + max(self.steps, GREEDY_TOKENS - 1)


FULL = Plan(SHAPE, ("fp16", "bf16"), (1, 8, 64), prompt=512, steps=256, warmup=8)
QUICK = Plan(QUICK_SHAPE, ("fp16",), (1, 8), prompt=128, steps=32, warmup=4)


# --- arithmetic ---------------------------------------------------------------------------------------------
def decode_bytes(config: LlamaConfig, batch: int, context: int, itemsize: int) -> tuple[int, int]:
    """(weight bytes, KV cache bytes) one decode step reads at `batch` sequences that each hold `context`
    tokens once the step's token is in the cache. Weights: every parameter once (the projections, the
    norms, lm_head), except that an untied embedding table is read only at the batch's rows (a tied one
    is lm_head's weight and is read whole). KV: k and v of every layer, sequence, position and KV head."""
    H = config.hidden_size
    weights = config.parameter_count()
    if not config.tie_word_embeddings:
        weights += batch * H - config.vocab_size * H
    kv = 2 * config.num_hidden_layers * batch * context * config.num_key_value_heads * config.head_dim
    return weights * itemsize, kv * itemsize


def median_context(prompt: int, steps: int, warmup: int) -> int:
    """The context the median timed decode step attends to: step i (from 0) after a prompt of `prompt`
    tokens reads prompt + i + 1 positions, and steps warmup..steps-1 are timed."""
    return prompt + 1 + (warmup + steps - 1) // 2


def rates(weight_bytes: int, kv_bytes: int, batch: int, step_ms: float, copy_gbs: float) -> dict[str, float]:
    """tokens/s and the bytes one step reads per step time as a % of the copy bandwidth (GB/s)."""
    seconds = step_ms / 1e3
    return {"tokens/s": batch / seconds,
            "%copy weights": 100 * weight_bytes / seconds / 1e9 / copy_gbs,
            "%copy w+KV": 100 * (weight_bytes + kv_bytes) / seconds / 1e9 / copy_gbs}


def matching_prefix(ours: Sequence[int], theirs: Sequence[int]) -> int:
    """How many tokens agree before the first difference (after one, the two continue from different
    texts, so later agreement says nothing)."""
    n = 0
    for a, b in zip(ours, theirs):
        if int(a) != int(b):
            break
        n += 1
    return n


def model_label(config: LlamaConfig) -> str:
    params = config.parameter_count()
    return f"LLaMA {params / 1e9:.2f}B" if params >= 1e9 else f"LLaMA {params / 1e6:.3g}M"


# --- timing -------------------------------------------------------------------------------------------------
@dataclass
class Runner:
    """One framework's generation loop: `prefill()` runs the prompts into a fresh cache and returns the
    first greedy tokens (B,) on the GPU; `step(tokens)` runs one decode step and returns the next."""
    prefill: Callable[[], Any]
    step: Callable[[Any], Any]


def measure(runner: Runner, plan: Plan) -> dict[str, float]:
    """prefill ms, decode ms/step (GPU) and per-call ms/step of `runner` (see the module docstring).
    CuPy's events on its current stream time torch's work too: both run on the legacy default stream."""
    import cupy

    stream = cupy.cuda.get_current_stream()

    def timed(fn: Callable[[], Any]) -> tuple[Any, cupy.cuda.Event, cupy.cuda.Event]:
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        out = fn()
        end.record(stream)
        return out, begin, end

    prefills = []
    for i in range(1 + plan.prefill_runs):
        stream.synchronize()
        tokens, begin, end = timed(runner.prefill)
        stream.synchronize()
        if i:
            prefills.append(cupy.cuda.get_elapsed_time(begin, end))
    steps = []
    for _ in range(plan.steps):
        tokens, begin, end = timed(lambda: runner.step(tokens))
        steps.append((begin, end))
    stream.synchronize()
    step_ms = statistics.median(cupy.cuda.get_elapsed_time(b, e) for b, e in steps[plan.warmup:])
    tokens = runner.prefill()
    for _ in range(plan.warmup):
        tokens = runner.step(tokens)
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(plan.steps - plan.warmup):
        tokens = runner.step(tokens)
    stream.synchronize()
    per_call = (time.perf_counter() - start) / (plan.steps - plan.warmup) * 1e3
    return {"prefill ms": statistics.median(prefills), "decode ms/step": step_ms, "per-call ms/step": per_call}


# --- the two frameworks -------------------------------------------------------------------------------------
def _greedy(logits: Any) -> Any:
    """argmax over the vocabulary of (B, vocab) CuPy logits; bf16 through its bits as float32 (CuPy's
    arithmetic takes no bf16)."""
    import cupy

    if dtypes.short_name(logits.dtype) == "bf16":
        logits = (logits.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return cupy.argmax(logits, axis=-1)


def _libnn_runner(model: CausalLM, ids: Any) -> Runner:
    return Runner(prefill=lambda: _greedy(model.prefill(ids)), step=lambda tokens: _greedy(model.decode_step(tokens)))


def _hf_runner(hf: Any, ids: Any) -> Runner:
    import torch

    keep, cache = _forward_names(hf)
    state: dict[str, Any] = {}

    def prefill():
        state["past"] = None  # the last loop's cache goes before the new one is made
        with torch.inference_mode():
            out = hf(input_ids=ids, use_cache=True, **keep)
        state["past"] = getattr(out, cache)
        return out.logits[:, -1].argmax(-1)

    def step(tokens):
        with torch.inference_mode():
            out = hf(input_ids=tokens[:, None], use_cache=True, **{cache: state["past"]})
        state["past"] = getattr(out, cache)
        return out.logits[:, -1].argmax(-1)

    return Runner(prefill, step)


def _forward_names(hf: Any) -> tuple[dict[str, int], str]:
    """What this transformers version's forward calls two of its arguments: the one that asks for the
    logits of the last position only ({} where there is none: every position's logits), and the cache,
    which is also the output's field. `logits_to_keep` from 4.50 (`num_logits_to_keep` before); the cache
    is `cache` in recent 5.x releases, which warn that `past_key_values` is deprecated."""
    parameters = inspect.signature(hf.forward).parameters
    keep = next(({name: 1} for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), {})
    return keep, "cache" if "cache" in parameters else "past_key_values"


def _hf_model(shape: dict[str, int], dtype: str) -> Any:
    """transformers' LlamaForCausalLM with random weights, made on the GPU and cast there (no float32
    copy of the model on the host). Every matrix is drawn here, normal with std 0.02 from seed 0, rather
    than left to the installed version's initialiser, so that every version gives the same weights and
    none are zeros; the RMSNorm weights stay ones. No end token, so that Hugging Face's generate runs
    every step, as libnn's does with eos_token_id=()."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    config = HFLlamaConfig(**shape, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, INIT_STD)
    return model.to(_torch_dtype(dtype)).eval()


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


def _models(plan: Plan, dtype: str) -> tuple[Any, CausalLM, dict[str, Any]]:
    """The Hugging Face model and libnn's CausalLM of the same checkpoint (a temporary directory), with
    the seconds each part took."""
    import torch

    start = time.perf_counter()
    hf = _hf_model(plan.shape, dtype)
    torch.cuda.synchronize()
    made = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        # safetensors: the default since transformers 4.35 and the only format in 5, which no longer
        # takes safe_serialization=
        hf.save_pretrained(directory)
        if not (Path(directory) / "model.safetensors").is_file() and \
                not (Path(directory) / "model.safetensors.index.json").is_file():
            raise RuntimeError(f"bench generate: save_pretrained wrote no safetensors checkpoint (found "
                               f"{sorted(p.name for p in Path(directory).iterdir())})")
        saved = time.perf_counter()
        model = CausalLM.from_pretrained(directory, dtype=dtype, device="gpu", max_batch=max(plan.batches),
                                         max_len=plan.max_len)
    loaded = time.perf_counter()
    return hf, model, {"made s": made - start, "saved s": saved - made, "libnn load s": loaded - saved,
                       "attention": getattr(hf.config, "_attn_implementation", None)}


def _greedy_vs_hf(model: CausalLM, hf: Any, prompt: Any) -> str:
    """'k/8': the first 8 greedy tokens of libnn's generate and Hugging Face's on one prompt (1, S), NumPy
    int64, agreeing up to the first difference (Hugging Face with fp32 accumulation in its GEMMs)."""
    import torch

    ours = model.generate(prompt, GREEDY_TOKENS, eos_token_id=())[0]
    matmul = torch.backends.cuda.matmul
    saved = {name: getattr(matmul, name) for name in ("allow_fp16_reduced_precision_reduction",
                                                      "allow_bf16_reduced_precision_reduction")}
    try:
        for name in saved:
            setattr(matmul, name, False)
        ids = torch.from_numpy(prompt).cuda()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                              do_sample=False)
    finally:
        for name, value in saved.items():
            setattr(matmul, name, value)
    theirs = out[0, prompt.shape[1]:].tolist()
    return f"{matching_prefix(ours.tolist(), theirs)}/{GREEDY_TOKENS}"


# --- one case -----------------------------------------------------------------------------------------------
def _case_rows(plan: Plan, dtype: str, batch: int, model: CausalLM, hf: Any, attention: str | None,
               ceilings: harness.Ceilings) -> list[dict[str, Any]]:
    import cupy
    import numpy as np
    import torch

    vocab = model.config.vocab_size
    prompts = np.random.default_rng(batch).integers(0, vocab, (batch, plan.prompt), dtype=np.int64)
    weight_bytes, kv_bytes = decode_bytes(model.config, batch, median_context(plan.prompt, plan.steps, plan.warmup),
                                          dtypes.parse(dtype).itemsize)
    base = {"model": model_label(model.config), "dtype": dtype, "batch": batch}
    rows = []
    for path, make in ((LIBNN, lambda: _libnn_runner(model, cupy.asarray(prompts))),
                       (HF, lambda: _hf_runner(hf, torch.from_numpy(prompts).cuda()))):
        row = {**base, "path": path}
        try:
            row.update(measure(make(), plan))
            row.update(rates(weight_bytes, kv_bytes, batch, row["decode ms/step"], ceilings.copy_gbs))
        except CASE_ERRORS as exc:
            row["note"] = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        if path == HF and "note" not in row:
            row["note"] = f"attention {attention}"
        rows.append(row)
        _free()
    libnn_row, hf_row = rows
    if libnn_row.get("per-call ms/step") and hf_row.get("per-call ms/step"):
        libnn_row["x HF"] = hf_row["per-call ms/step"] / libnn_row["per-call ms/step"]
    if batch == 1:
        try:
            libnn_row["greedy vs HF"] = _greedy_vs_hf(model, hf, prompts[:1])
        except CASE_ERRORS as exc:
            libnn_row["greedy vs HF"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
        _free()
    return rows


def _free() -> None:
    """Both allocators' cached blocks back to the device, so that the next framework has the memory."""
    import cupy
    import torch

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def _peer_versions() -> str:
    """torch's and transformers' versions; an error saying why the bench needs them where one is missing."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModuleNotFoundError(f"bench generate makes its random-weight checkpoint with transformers' "
                                  f"LlamaForCausalLM and runs it as the peer: install torch and transformers "
                                  f"({exc})") from exc
    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    import cupy

    peers = _peer_versions()
    plan = QUICK if quick else FULL
    started = time.perf_counter()
    ceilings = harness.measure_ceilings()
    print(f"{ceilings.describe()}; {peers}")
    cupy.get_default_memory_pool().free_all_blocks()
    config = LlamaConfig.from_dict(dict(plan.shape))
    context = median_context(plan.prompt, plan.steps, plan.warmup)
    print(f"{model_label(config)}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} heads of {config.head_dim}, {config.num_key_value_heads} KV heads, FFN "
          f"{config.intermediate_size}, vocab {config.vocab_size}; prompts of {plan.prompt} random tokens, "
          f"{plan.steps} greedy decode steps (timed: steps {plan.warmup}..{plan.steps - 1}, median context {context})")
    total = len(plan.dtypes) * (1 + len(plan.batches))
    done = 0
    rows: list[dict[str, Any]] = []
    loads = []
    for dtype in plan.dtypes:
        done += 1
        harness.progress(done, total, f"{dtype}: random-weight checkpoint (transformers) and libnn's load")
        try:
            hf, model, load = _models(plan, dtype)
        except CASE_ERRORS as exc:  # e.g. out of memory: this dtype's rows say so, the next dtype runs
            note = f"no model: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
            rows += [{"model": model_label(config), "dtype": dtype, "batch": batch, "path": path, "note": note}
                     for batch in plan.batches for path in (LIBNN, HF)]
            done += len(plan.batches)
            _free()
            continue
        weights, _ = decode_bytes(model.config, 1, 0, dtypes.parse(dtype).itemsize)
        load = {"dtype": dtype, **load}
        loads.append(load)
        print(f"{dtype}: {config.parameter_count()} parameters, "
              f"{memory.format_bytes(config.parameter_count() * dtypes.parse(dtype).itemsize)}; a batch-1 decode "
              f"step reads {memory.format_bytes(weights)} of them; made {load['made s']:.1f} s, saved "
              f"{load['saved s']:.1f} s, loaded by libnn {load['libnn load s']:.1f} s")
        for batch in plan.batches:
            done += 1
            harness.progress(done, total, f"{dtype} batch {batch}")
            rows += _case_rows(plan, dtype, batch, model, hf, load["attention"], ceilings)
        del hf, model
        _free()
    print(harness.format_table(rows, ["model", "dtype", "batch", "path", "prefill ms", "decode ms/step",
                                      "per-call ms/step", "tokens/s", "%copy weights", "%copy w+KV", "x HF",
                                      "greedy vs HF", "note"]))
    print(targets(rows, quick))
    print(f"bench generate took {time.perf_counter() - started:.0f} s")
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "plan": asdict(plan), "context": context,
                                      "loads": loads, "rows": rows})
    return rows


def targets(rows: Sequence[dict[str, Any]], quick: bool) -> str:
    """The issue's targets that this bench measures, each with its verdict, and those it does not."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = ["targets (issue 16; libnn eager decode, GPU time per step; Hugging Face eager in the same run):"]
    if quick:
        lines.append("  (--quick runs the small model: the targets are set for the 1B shape)")
    for r in rows:
        if r["path"] != LIBNN or r["batch"] != 1:
            continue
        if r["dtype"] == "fp16" and (share := r.get("%copy weights")) is not None:
            lines.append(f"  batch-1 decode fp16: weights at {share:.0f}% of copy bandwidth "
                         f"(target >= 80%: {verdict(share >= 80)})")
        if (speedup := r.get("x HF")) is not None:
            lines.append(f"  batch-1 decode {r['dtype']}: {speedup:.2f}x Hugging Face eager's tokens/s, per call "
                         f"(target >= 3x: {verdict(speedup >= 3)})")
    lines.append("  not measured here yet: FP8 decode (>= 1.7x fp16 tokens/s at batch 1), decode attention at "
                 ">= 90% of copy bandwidth on the cache read (batch 64, context 4096), Hugging Face with its "
                 "static cache and torch.compile, the GPT-2 small shape, the kernel-time split per category")
    return "\n".join(lines)
