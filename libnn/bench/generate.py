"""`libnn bench generate`: LLaMA- and GPT-2-architecture decoding, libnn's CausalLM (decode steps as CUDA
graphs over its dense KV cache and, on LLaMA, over a paged one; and eager) against Hugging Face's, eager and
with its static cache and torch.compile.

The models, each with random weights: Hugging Face's own `transformers.LlamaForCausalLM(config)` and
`GPT2LMHeadModel(config)` made on the GPU (every matrix normal with std 0.02 from seed 0, GPT-2's Conv1D
weights and position table included; the norms ones, their biases zeros) and cast there to the case's
dtype, saved with `save_pretrained` (safetensors) and read by `libnn.models.CausalLM.from_pretrained`;
the Hugging Face model stays in memory as the peer, so both run the same weights.
- full: LLaMA at about 1.1B parameters (16 layers, hidden 2048, 32 heads of 64, 8 KV heads, FFN 8192, vocab
  32000), fp16 and bf16; then GPT-2 small (12 layers, n_embd 768, 12 heads of 64, 1024 positions, vocab
  50257, 124M), fp16 only and without the HF static+compile peer (to keep the bench within minutes);
  each at batch 1, 8 and 64, prompts of 512 random token ids, then 256 greedy decode steps (which fit
  GPT-2's 1024 positions);
- `--quick`: LLaMA with 4 layers, hidden 1024, 16 heads, 4 KV heads, FFN 2816, vocab 32000 (0.11B), and
  GPT-2 with 2 layers, n_embd 256, 4 heads (14.7M; no compiled peer), fp16, batch 1 and 8, prompts of 128
  tokens, 32 decode steps.
Both plans run the paged row on LLaMA in fp16 at each of their batches (`paged_dtypes`), not on GPT-2.

Rows per (dtype, batch):
- libnn graph: `prefill` of the prompts, then `decode_step(tokens, check_ids=False)` after `decode_step`,
  each fed the argmax of the last logits (greedy, libnn's argmax op as `generate` takes it), as
  `from_pretrained` makes the model: each decode step one CUDA graph replay (captured per batch bucket at
  the first step). The argmax is in range, so the step skips its token check (a read-back per step) and
  the queue runs ahead as it does in `generate`, which queues each step before reading the last one's
  tokens back. Its time includes decode_step's copy of
  the graph's logits into an array of the caller's ((B, vocab) values, as the argmax then reads).
- libnn graph paged: the same, on the same checkpoint loaded with `kv_layout="paged", page_size=64`: k and
  v in pages that a page table lists, a page taken from the host's free list (and the table uploaded from
  pinned memory, queued without waiting for the GPU) at a step whose token starts one (in the quick plan
  only the first decode step after each prefill, a warm-up step; in the full plan 3 of the timed steps),
  attention through the table on cuDNN (the custom decode kernels read no pages). Its cost against the
  dense cache is a line under the targets.
- libnn eager: the same checkpoint loaded with `decode_graphs=False`: every op of a step launched from
  Python.
- HF eager: Hugging Face's forward in `torch.inference_mode()` (its default attention implementation,
  named in the note): prefill is one forward over the prompts with use_cache (logits of the last
  position only, as its `generate` asks for), a decode step one forward of one token per sequence with
  its cache (`past_key_values`; `cache` in recent transformers 5 releases), then the argmax. This is
  what HF's `generate` runs per step, without its logits processors and stopping checks (which
  synchronise every step).
- HF static+compile: transformers' documented recipe for fast decoding, on the dtypes the plan names
  (`compile_dtypes`; none with `hf_compile=False`): a `StaticCache` made once per case for the batch and
  the plan's max_len (its tensors keep their addresses, which the compiled graphs bake in; each prefill
  resets it in place), the prompts through the eager forward (the recipe compiles no prefill), each decode
  step through `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`, inductor's kernels
  replayed as a CUDA graph. Each case compiles afresh (the last case's compiled code and graphs dropped
  first). The compile, the graph's recording and its first replay happen in 3 decode steps before any
  timing; their seconds are the "compile s" column, outside every other. Where the compile or the run
  fails, the row's note says why and the bench goes on.

Columns: "prefill ms" is the median of 3 prefills after one untimed (CUDA events around it). "decode
ms/step" is GPU time (`runtime.timing.time_gpu`): a new prefill of the same prompts, the warm-up steps (8;
quick 4: their plans and graphs built) and a synchronisation, then a spin kernel that keeps the GPU busy
while the host queues the other steps, one event pair around each, and the median of those pairs. The
spin is what makes a pair time its step's GPU work alone. Until it was added the pairs began on an idle
GPU, so a step that the host queued more slowly than the GPU ran it was timed with the host's queueing
in it: the pair opened as the host began the step, the GPU waited for the work, then ran it; such a row
read more GPU time than per-call time (the paged row on the H100, and Hugging Face's eager row below).
The spin lasts 1.5 times the warm-up steps' wall time per step for each timed step, at most 0.2 s: a
row whose host takes longer than that to queue its timed steps (Hugging Face's eager one in the full
plan) still has pairs past the spin that time the host.
"per-call ms/step" is the decode loop as a user sees it: a new prefill, the warm-up steps, then the other
steps back to back with nothing queued before them and one synchronisation at the end, per step.
"tokens/s" is batch / decode ms/step. "%copy weights" is the weight bytes one decode step must read
(`decode_bytes`: every parameter once, except that an untied embedding table and GPT-2's position table
are read only at the batch's rows) per step time, as a % of the device-to-device copy bandwidth measured
in the same run; "%copy w+KV" adds the KV cache one step's attention reads at the median timed step's
context (the same bytes for every row: Hugging Face's dynamic cache copies itself as it grows, which is
not counted). "x HF" and "x HF compile" (on libnn's rows) are the Hugging Face row's per-call ms/step
over libnn's: Hugging Face's eager loop is bound by the host's time per step, which the per-call column
holds, and its event pairs time the host (before the spin they read several times the time its loop
took from Python on the H100: benchmarks/RESULTS.md, seventh session), so the GPU columns are not used
for the ratios. "greedy vs HF" (batch 1): how many of the first 8 tokens agree, before the first
difference, with Hugging Face's `generate(do_sample=False)` on the first prompt (Hugging Face with fp32
accumulation in its fp16/bf16 GEMMs, reduced-precision reductions off): libnn's `generate` on each libnn
row, the compiled loop's own prefill and steps on its row; near-ties in fp16/bf16 may part them, so a
mismatch is reported, not fatal.
A case that runs out of memory or that a library declines gets the reason in its note.

Kernel time per decode step of the libnn graph and libnn graph paged rows, by category
(`harness.kernel_split`, torch.profiler, as `bench models` splits its encoders): GEMM, attention, norms
(RMSNorm, GPT-2's LayerNorm) and glue (everything else: rope, swiglu, the embedding gather, the KV cache's
writes, the argmax, copies), over 5 decode steps after a new prefill, the warm-up steps and one untimed
step, beside the row's GPU ms per step; the costliest glue kernels named. Kernels launched programmatically
start early and wait for the one ahead, so their kernel times overlap and add up to more than the step:
beside them each category's share of the critical path ("path ms": the part of a kernel's time past the
end of the work ahead of it) and the idle time between kernels, which add up to the step's span.

Targets (issue 16, H100, the 1B shape; judged on the LLaMA rows, the GPT-2 rows have none of their own):
batch-1 decode at >= 80% of copy bandwidth in fp16 (weights per step over step time); >= 3x Hugging Face
eager tokens/s at batch 1; FP8 decode at >= 1.7x the fp16 graph's tokens/s at batch 1; decode attention
at batch 64 and context 4096 at >= 90% of copy bandwidth on the cache read. Under them, with no target: the
paged row's decode ms/step over the dense graph row's at each batch, GPU and per call.
"""

from __future__ import annotations

import gc
import inspect
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from libnn import dtypes
from libnn.bench import harness
from libnn.errors import LibnnError
from libnn.models.decoder import CausalLM, DecoderConfig
from libnn.models.gpt2 import GPT2Config
from libnn.models.llama import LlamaConfig
from libnn.ops.argmax import argmax
from libnn.runtime import memory

# Hugging Face LlamaConfig fields; max_position_embeddings only bounds the cache (prompt + steps).
SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 2048}
QUICK_SHAPE = {**SHAPE, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
               "num_attention_heads": 16, "num_key_value_heads": 4}
# Hugging Face GPT2Config fields: GPT-2 small; n_positions (wpe's rows) bounds prompt + steps.
GPT2_SHAPE = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}
GPT2_QUICK_SHAPE = {**GPT2_SHAPE, "n_embd": 256, "n_layer": 2, "n_head": 4}
INIT_STD = 0.02    # the weight matrices' standard deviation (Hugging Face's initializer_range)
GREEDY_TOKENS = 8   # tokens of libnn's generate compared with Hugging Face's at batch 1
LIBNN, LIBNN_EAGER, HF, HF_COMPILED = "libnn graph", "libnn eager", "HF eager", "HF static+compile"
LIBNN_FP8 = "libnn graph fp8"  # the fp16 checkpoint's projections quantised to E4M3 (CausalLM.quantize)
LIBNN_PAGED = "libnn graph paged"  # the same decode graphs over a paged KV cache
PATHS = (LIBNN, LIBNN_PAGED, LIBNN_FP8, LIBNN_EAGER, HF, HF_COMPILED)
FP8_DTYPES = ("fp16",)  # the activations' dtype of the FP8 rows
PAGE_SIZE = 64  # the paged rows' tokens per page, given explicitly: a change of the library's default moves no row
# libnn's rows, each a CausalLM of the same checkpoint: from_pretrained's options (LIBNN_FP8's model is then
# quantised); the rows differ from LIBNN by these alone
LIBNN_OPTIONS = {LIBNN: {}, LIBNN_PAGED: {"kv_layout": "paged", "page_size": PAGE_SIZE}, LIBNN_FP8: {},
                 LIBNN_EAGER: {"decode_graphs": False}}
SPLIT_PATHS = (LIBNN, LIBNN_PAGED)  # the rows whose decode step's kernel time is split by category
SPEEDUPS = {HF: "x HF", HF_COMPILED: "x HF compile"}  # the peers libnn's rows are compared with
COMPILE_WARMUP = 3  # compiled decode steps before any timing: the compile, the graph's recording, a replay
# What a case that fails may raise: libnn declining it, running out of GPU memory (CuPy's
# OutOfMemoryError is a MemoryError, torch's a RuntimeError), a library's own error. The compiled peer
# may fail in any way torch.compile can (dynamo, inductor, triton, the host compiler): anything it
# raises is its row's note.
CASE_ERRORS = (LibnnError, MemoryError, RuntimeError)
PATH_ERRORS = {**dict.fromkeys(LIBNN_OPTIONS, CASE_ERRORS), HF: CASE_ERRORS, HF_COMPILED: (Exception,)}
# The decode step's kernel-time split (harness.kernel_split), tried in order; everything else is glue.
# Norms before GEMM: GEMM's pattern takes any "sm90_" kernel, which a cuDNN norm kernel could be too.
NORM_KERNELS = re.compile(r"norm|^rms\d_|^ln\d_")
SPLIT_CATEGORIES = (("attention", harness.ATTENTION_KERNELS), ("norms", NORM_KERNELS), ("GEMM", harness.GEMM_KERNELS))
SPLIT_STEPS = 5  # decode steps profiled
COLUMNS = ("model", "dtype", "batch", "path", "prefill ms", "decode ms/step", "per-call ms/step", "tokens/s",
           "%copy weights", "%copy w+KV", *SPEEDUPS.values(), "x fp16", "compile s", "greedy vs HF", "note")
SPLIT_COLUMNS = ("model", "dtype", "batch", "path", "decode ms/step", *(f"{c} ms" for c, _ in SPLIT_CATEGORIES),
                 f"{harness.GLUE} ms", "kernels ms", *(f"{c} path ms" for c, _ in SPLIT_CATEGORIES),
                 f"{harness.GLUE} path ms", "idle ms", "glue %", "top glue", "note")


@dataclass(frozen=True)
class Architecture:
    """One model family of the bench: its rows' name, libnn's config class, transformers' config and
    model classes (by name: transformers is imported only when the bench runs), the fields Hugging Face's
    config gets beside the plan's shape, and the base model's learned position table (None: rotary),
    which a decode step reads only at its sequences' rows."""
    label: str
    config: type[DecoderConfig]
    hf_config: str
    hf_model: str
    hf_fields: dict[str, Any]
    position_table: str | None


ARCHITECTURES = {"llama": Architecture("LLaMA", LlamaConfig, "LlamaConfig", "LlamaForCausalLM",
                                       {"tie_word_embeddings": False}, None),
                 "gpt2": Architecture("GPT-2", GPT2Config, "GPT2Config", "GPT2LMHeadModel", {}, "wpe")}


@dataclass(frozen=True)
class Plan:
    shape: dict[str, int]   # Hugging Face config fields of the architecture
    dtypes: tuple[str, ...]
    batches: tuple[int, ...]
    prompt: int          # tokens per prompt
    steps: int           # decode steps after the prefill
    warmup: int          # decode steps left out of the timings
    prefill_runs: int = 3
    compile_dtypes: tuple[str, ...] = ("fp16",)  # where the HF static+compile peer runs (a compile per case)
    paged_dtypes: tuple[str, ...] = ("fp16",)    # where the libnn graph paged row runs
    architecture: str = "llama"  # ARCHITECTURES' key

    @property
    def config(self) -> DecoderConfig:
        """libnn's config of the shape."""
        return ARCHITECTURES[self.architecture].config.from_dict(dict(self.shape))

    @property
    def max_len(self) -> int:
        """The KV cache's length: the prompt and every decode step's token, the greedy comparison's
        (generate appends all its tokens but the last), or the kernel split's (the warm-up steps, one
        untimed step and the profiled ones), whichever is most."""
        return self.prompt + max(self.steps, GREEDY_TOKENS - 1, self.warmup + 1 + SPLIT_STEPS)


# The compiled peer in fp16 only on the LLaMA plans: each case's compile takes far longer than its timing.
# GPT-2 in fp16 without it, so that the full bench stays within minutes (the plan's note in the output).
# The paged cache in fp16 on LLaMA, the targets' model; GPT-2's plans without it, to keep the bench short.
FULL = (Plan(SHAPE, ("fp16", "bf16"), (1, 8, 64), prompt=512, steps=256, warmup=8),
        Plan(GPT2_SHAPE, ("fp16",), (1, 8, 64), prompt=512, steps=256, warmup=8, compile_dtypes=(), paged_dtypes=(),
             architecture="gpt2"))
QUICK = (Plan(QUICK_SHAPE, ("fp16",), (1, 8), prompt=128, steps=32, warmup=4),
         Plan(GPT2_QUICK_SHAPE, ("fp16",), (1, 8), prompt=128, steps=32, warmup=4, compile_dtypes=(), paged_dtypes=(),
              architecture="gpt2"))


# --- arithmetic ---------------------------------------------------------------------------------------------
def decode_bytes(config: DecoderConfig, batch: int, context: int, itemsize: int) -> tuple[int, int]:
    """(weight bytes, KV cache bytes) one decode step reads at `batch` sequences that each hold `context`
    tokens once the step's token is in the cache. Weights: every parameter once (the projections, the
    norms, lm_head), except that an untied embedding table and a learned position table (GPT-2's wpe, of
    max_positions rows) are read only at the batch's rows (a tied embedding table is lm_head's weight
    and is read whole). KV: k and v of every layer, sequence, position and KV head."""
    H = config.hidden_size
    weights = config.parameter_count()
    if not config.tie_word_embeddings:
        weights += batch * H - config.vocab_size * H
    if ARCHITECTURES[config.model_type].position_table is not None:
        weights += batch * H - config.max_positions * H
    kv = 2 * config.num_hidden_layers * batch * context * config.num_key_value_heads * config.head_dim
    return weights * itemsize, kv * itemsize


def model_bytes(model: CausalLM, batch: int) -> int:
    """The parameter bytes one decode step of `model` reads, as they are held (E4M3 codes and their
    scales once quantised): every parameter once, an untied embedding table and a learned position table
    at the batch's rows only (as decode_bytes)."""
    total = sum(a.nbytes for _, a in model.named_parameters() if a is not None)
    position_table = ARCHITECTURES[model.config.model_type].position_table
    tables = ([model.base_model.word_embeddings] if model.lm_head is not None else []) + \
        ([getattr(model.base_model, position_table).weight] if position_table is not None else [])
    for table in tables:
        total += batch * table.nbytes // table.shape[0] - table.nbytes
    return total


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


def model_label(config: DecoderConfig) -> str:
    """The architecture and the parameter count: "LLaMA 1.10B", "GPT-2 124M"."""
    name, params = ARCHITECTURES[config.model_type].label, config.parameter_count()
    return f"{name} {params / 1e9:.2f}B" if params >= 1e9 else f"{name} {params / 1e6:.3g}M"


def case_paths(plan: Plan, dtype: str, hf_compile: bool) -> tuple[str, ...]:
    """The rows of one case, in PATHS' order: the compiled peer only where it is on and the plan
    compiles this dtype, the paged cache only on the plan's paged dtypes, FP8 on FP8_DTYPES."""
    return tuple(p for p in PATHS if (p != HF_COMPILED or (hf_compile and dtype in plan.compile_dtypes))
                 and (p != LIBNN_PAGED or dtype in plan.paged_dtypes) and (p != LIBNN_FP8 or dtype in FP8_DTYPES))


def add_speedups(rows: Sequence[dict[str, Any]]) -> None:
    """On each libnn row of one case, for each peer row that has a per-call time (SPEEDUPS): the peer's
    per-call ms/step over the row's."""
    per_call = {r["path"]: r.get("per-call ms/step") for r in rows}
    for r in rows:
        if r["path"] not in LIBNN_OPTIONS or not r.get("per-call ms/step"):
            continue
        for peer, column in SPEEDUPS.items():
            if per_call.get(peer):
                r[column] = per_call[peer] / r["per-call ms/step"]
        if r["path"] == LIBNN_FP8 and per_call.get(LIBNN):
            r["x fp16"] = per_call[LIBNN] / r["per-call ms/step"]


def why(exc: BaseException, chars: int = 90) -> str:
    """An exception on one line: its type and the start of its message, whitespace collapsed (torch.compile
    puts the cause on the lines after a first one such as "backend='inductor' raised:")."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:chars]}"


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

    from libnn.runtime.timing import time_gpu

    stream = cupy.cuda.get_current_stream()
    prefills = []
    for i in range(1 + plan.prefill_runs):
        stream.synchronize()
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        runner.prefill()
        end.record(stream)
        stream.synchronize()
        if i:
            prefills.append(cupy.cuda.get_elapsed_time(begin, end))
    step_ms = time_gpu(_decode_loop(runner), [None], warmup=plan.warmup, runs=plan.steps - plan.warmup).median_ms
    step = _decode_loop(runner)
    for _ in range(plan.warmup):
        step(None)
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(plan.steps - plan.warmup):
        step(None)
    stream.synchronize()
    per_call = (time.perf_counter() - start) / (plan.steps - plan.warmup) * 1e3
    return {"prefill ms": statistics.median(prefills), "decode ms/step": step_ms, "per-call ms/step": per_call}


def _decode_loop(runner: Runner) -> Callable[[Any], None]:
    """A new prefill of the runner's prompts, and a call that runs the next decode step on the last
    step's tokens (its argument unused: time_gpu's inputs)."""
    state = {"tokens": runner.prefill()}

    def step(_: Any) -> None:
        state["tokens"] = runner.step(state["tokens"])

    return step


# --- the frameworks ---------------------------------------------------------------------------------------
def _libnn_runner(model: CausalLM, ids: Any) -> Runner:
    return Runner(prefill=lambda: argmax(model.prefill(ids)),
                  step=lambda tokens: argmax(model.decode_step(tokens, check_ids=False)))


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


def _hf_compiled_runner(hf: Any, ids: Any, max_len: int) -> tuple[Runner, dict[str, float]]:
    """Hugging Face's static cache and compiled decode step (the module docstring) for the prompts ids
    (B, S), and {"compile s": the seconds of the first prefill and COMPILE_WARMUP steps}. Under
    torch.no_grad, as Hugging Face's generate runs: CUDA graph trees then start a new generation at each
    call, so a step's outputs may be overwritten by the next (each is reduced to its argmax first)."""
    import torch
    from transformers import StaticCache

    keep, cache_name = _forward_names(hf)
    cache = {cache_name: StaticCache(config=hf.config, max_cache_len=max_len)}
    compiled = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    # a forward that takes cache_position (transformers 4.x) is given the positions the pass writes, kept on
    # the device so that the compiled step reads them without a synchronisation; one that does not (5.24)
    # counts them in the StaticCache itself
    takes_positions = "cache_position" in inspect.signature(hf.forward).parameters
    state: dict[str, Any] = {}

    def at(positions: Any) -> dict[str, Any]:
        """The forward's cache_position argument (where it takes one); the next pass's position kept."""
        if not takes_positions:
            return {}
        state["next"] = positions[-1:] + 1
        return {"cache_position": positions}

    def prefill():
        cache[cache_name].reset()  # in place: the compiled step's graphs keep the cache's addresses
        with torch.no_grad():
            out = hf(input_ids=ids, use_cache=True, **cache, **keep,
                     **at(torch.arange(ids.shape[1], device=ids.device)))
        return out.logits[:, -1].argmax(-1)

    def step(tokens):
        with torch.no_grad():
            out = compiled(input_ids=tokens[:, None], use_cache=True, **cache, **keep, **at(state.get("next")))
        return out.logits[:, -1].argmax(-1)

    start = time.perf_counter()
    tokens = prefill()
    for _ in range(COMPILE_WARMUP):
        tokens = step(tokens)
    torch.cuda.synchronize()
    return Runner(prefill, step), {"compile s": time.perf_counter() - start}


def _forward_names(hf: Any) -> tuple[dict[str, int], str]:
    """What this transformers version's forward calls two of its arguments: the one that asks for the
    logits of the last position only ({} where there is none: every position's logits), and the cache,
    which is also the output's field. `logits_to_keep` from 4.50 (`num_logits_to_keep` before); the cache
    is `cache` in recent 5.x releases, which warn that `past_key_values` is deprecated."""
    parameters = inspect.signature(hf.forward).parameters
    keep = next(({name: 1} for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), {})
    return keep, "cache" if "cache" in parameters else "past_key_values"


def _hf_model(plan: Plan, dtype: str) -> Any:
    """transformers' model of the plan's architecture (LlamaForCausalLM, GPT2LMHeadModel) with random
    weights, made on the GPU and cast there (no float32 copy of the model on the host). Every matrix
    (GPT-2's Conv1D weights and its position table too) is drawn here, normal with std 0.02 from seed 0,
    rather than left to the installed version's initialiser, so that every version gives the same weights
    and none are zeros; the norms' weights stay ones (LayerNorm's biases zeros). No end token, so that
    Hugging Face's generate runs every step, as libnn's does with eos_token_id=()."""
    import torch
    import transformers

    architecture = ARCHITECTURES[plan.architecture]
    config = getattr(transformers, architecture.hf_config)(**plan.shape, **architecture.hf_fields, bos_token_id=1,
                                                           eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, architecture.hf_model)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, INIT_STD)
    return model.to(harness.torch_dtype(dtype)).eval()


@dataclass
class Models:
    """One dtype's models of the same checkpoint."""
    hf: Any                     # transformers' model (LlamaForCausalLM, GPT2LMHeadModel), the peer
    libnn: dict[str, CausalLM]  # by row (LIBNN_OPTIONS' keys the case has): LIBNN and LIBNN_EAGER always
    load: dict[str, Any]        # seconds per part, and Hugging Face's attention implementation


def _models(plan: Plan, dtype: str) -> Models:
    """The Hugging Face model and libnn's CausalLMs of the same checkpoint (a temporary directory), with
    the seconds each part took."""
    import torch

    start = time.perf_counter()
    hf = _hf_model(plan, dtype)
    torch.cuda.synchronize()
    made = time.perf_counter()
    loads, models = {}, {}
    with tempfile.TemporaryDirectory() as directory:
        # safetensors: the default since transformers 4.35 and the only format in 5, which no longer
        # takes safe_serialization=
        hf.save_pretrained(directory)
        if not (Path(directory) / "model.safetensors").is_file() and \
                not (Path(directory) / "model.safetensors.index.json").is_file():
            raise RuntimeError(f"bench generate: save_pretrained wrote no safetensors checkpoint (found "
                               f"{sorted(p.name for p in Path(directory).iterdir())})")
        saved = time.perf_counter()
        for path in (p for p in case_paths(plan, dtype, hf_compile=False) if p in LIBNN_OPTIONS):
            begin = time.perf_counter()
            try:
                model = CausalLM.from_pretrained(directory, dtype=dtype, device="gpu", max_batch=max(plan.batches),
                                                 max_len=plan.max_len, **LIBNN_OPTIONS[path])
                models[path] = model.quantize("fp8") if path == LIBNN_FP8 else model
            except CASE_ERRORS as exc:  # e.g. FP8 on a GPU below sm_89: the other rows' notes say why
                if path in (LIBNN, LIBNN_EAGER):
                    raise
                loads[f"{path} note"] = why(exc)
                continue
            loads[f"{path} load s"] = time.perf_counter() - begin
    return Models(hf, models, {"made s": made - start, "saved s": saved - made, **loads,
                               "attention": getattr(hf.config, "_attn_implementation", None)})


def _runner(path: str, models: Models, prompts: Any, plan: Plan) -> tuple[Runner, dict[str, Any]]:
    """`path`'s generation loop over the prompts (B, S) (NumPy int64), with what making it reported."""
    import cupy
    import torch

    if path in LIBNN_OPTIONS and path not in models.libnn:
        raise LibnnError(models.load[f"{path} note"])
    if path in models.libnn:
        return _libnn_runner(models.libnn[path], cupy.asarray(prompts)), {}
    ids = torch.from_numpy(prompts).cuda()
    if path == HF:
        return _hf_runner(models.hf, ids), {}
    return _hf_compiled_runner(models.hf, ids, plan.max_len)


def _hf_greedy(hf: Any, prompt: Any) -> list[int]:
    """The first GREEDY_TOKENS tokens of Hugging Face's generate(do_sample=False) on one prompt (1, S),
    NumPy int64, with fp32 accumulation in its fp16/bf16 GEMMs."""
    import torch

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
    return out[0, prompt.shape[1]:].tolist()


def _first_tokens(path: str, models: Models, prompt: Any, runner: Runner) -> list[int]:
    """The first GREEDY_TOKENS greedy tokens of `path` on one prompt (1, S): libnn's generate, or the
    compiled loop's own prefill and steps (`runner`, the case's, of batch 1)."""
    if path in models.libnn:
        return models.libnn[path].generate(prompt, GREEDY_TOKENS, eos_token_id=())[0].tolist()
    tokens = [runner.prefill()]
    while len(tokens) < GREEDY_TOKENS:
        tokens.append(runner.step(tokens[-1]))
    return [int(t[0]) for t in tokens]


def _decode_split(runner: Runner, plan: Plan) -> dict[str, Any]:
    """Kernel time per decode step by category (harness.kernel_split of SPLIT_STEPS steps after a new
    prefill, the warm-up steps and one untimed step)."""
    step = _decode_loop(runner)
    for _ in range(plan.warmup):
        step(None)
    return harness.kernel_split(step, SPLIT_CATEGORIES, replays=SPLIT_STEPS)


# --- one case -----------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One (dtype, batch): its prompts, the bytes a decode step reads, and its rows' common columns."""
    plan: Plan
    models: Models
    prompts: Any                   # (batch, prompt) NumPy int64
    nbytes: tuple[int, int]        # decode_bytes at the median timed step's context
    base: dict[str, Any]           # model, dtype, batch
    reference: list[int] | str | None  # Hugging Face's greedy tokens at batch 1, or why there are none


def _case_rows(plan: Plan, dtype: str, batch: int, models: Models, ceilings: harness.Ceilings,
               hf_compile: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The case's rows (case_paths) and the kernel splits of its SPLIT_PATHS rows' decode steps (a row
    that did not run: a split saying so)."""
    import numpy as np

    config = models.libnn[LIBNN].config
    prompts = np.random.default_rng(batch).integers(0, config.vocab_size, (batch, plan.prompt), dtype=np.int64)
    nbytes = decode_bytes(config, batch, median_context(plan.prompt, plan.steps, plan.warmup),
                          dtypes.parse(dtype).itemsize)
    reference: list[int] | str | None = None
    if batch == 1:
        try:
            reference = _hf_greedy(models.hf, prompts[:1])
        except CASE_ERRORS as exc:
            reference = f"failed (HF generate): {why(exc, 60)}"
        _free()
    case = Case(plan, models, prompts, nbytes, {"model": model_label(config), "dtype": dtype, "batch": batch},
                reference)
    rows, splits = [], []
    for path in case_paths(plan, dtype, hf_compile):
        row, split = _path_row(case, path, ceilings)
        if "note" not in row:
            if path in (HF, HF_COMPILED):
                row["note"] = f"attention {models.load['attention']}"
            elif path == LIBNN_PAGED:
                row["note"] = f"pages of {PAGE_SIZE} tokens"
        rows.append(row)
        if path in SPLIT_PATHS:
            splits.append(split or {**case.base, "path": path, "note": "not run"})
        _free()
    add_speedups(rows)
    return rows, splits


def _path_row(case: Case, path: str, ceilings: harness.Ceilings) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One path's row of the case (or its note saying why not) and, for SPLIT_PATHS, its kernel split;
    the path's runner (its caches, its compiled graphs) goes with the return."""
    row = {**case.base, "path": path}
    try:
        runner, made = _runner(path, case.models, case.prompts, case.plan)
        row.update(made)
        row.update(measure(runner, case.plan))
        weight_bytes = model_bytes(case.models.libnn[path], row["batch"]) if path == LIBNN_FP8 else case.nbytes[0]
        row.update(rates(weight_bytes, case.nbytes[1], row["batch"], row["decode ms/step"], ceilings.copy_gbs))
    except PATH_ERRORS[path] as exc:
        row["note"] = f"not run: {why(exc)}"
        return row, None
    if case.reference is not None and path != HF:
        row["greedy vs HF"] = _greedy_vs_hf(case, path, runner)
    if path not in SPLIT_PATHS:
        return row, None
    split = {**case.base, "path": path, "decode ms/step": row["decode ms/step"]}
    try:
        split.update(_decode_split(runner, case.plan))
    except CASE_ERRORS as exc:
        split["note"] = f"not run: {why(exc)}"
    return row, split


def _greedy_vs_hf(case: Case, path: str, runner: Runner) -> str:
    """'k/8': how many of `path`'s first greedy tokens on the first prompt agree with Hugging Face's
    generate before the first difference; or why not."""
    if isinstance(case.reference, str):
        return case.reference
    try:
        ours = _first_tokens(path, case.models, case.prompts[:1], runner)
    except PATH_ERRORS[path] as exc:
        return f"failed: {why(exc, 60)}"
    return f"{matching_prefix(ours, case.reference)}/{GREEDY_TOKENS}"


def _free() -> None:
    """Both allocators' cached blocks back to the device, so that the next framework has the memory; the
    compiled peer's code, guards and CUDA graphs (and their memory pool) go too, so that each case
    compiles afresh, as a new process would, and no earlier case's batch shape makes dynamo recompile
    with dynamic shapes."""
    import cupy
    import torch

    gc.collect()
    torch._dynamo.reset()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def _peer_versions() -> str:
    """torch's and transformers' versions; an error saying why the bench needs them where one is missing."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModuleNotFoundError(f"bench generate makes its random-weight checkpoints with transformers' "
                                  f"LlamaForCausalLM and GPT2LMHeadModel and runs them as the peers: install torch "
                                  f"and transformers ({exc})") from exc
    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def run(quick: bool = False, json_path: str | None = None, hf_compile: bool = True) -> list[dict[str, Any]]:
    """The bench (the module docstring); `hf_compile=False` leaves out the HF static+compile rows."""
    import cupy

    peers = _peer_versions()
    plans = QUICK if quick else FULL
    started = time.perf_counter()
    ceilings = harness.measure_ceilings()
    print(f"{ceilings.describe()}; {peers}")
    cupy.get_default_memory_pool().free_all_blocks()
    total = sum(len(plan.dtypes) * (1 + len(plan.batches)) for plan in plans)
    counter = iter(range(1, total + 1))

    def progress(label: str) -> None:
        harness.progress(next(counter), total, label)

    rows: list[dict[str, Any]] = []
    splits: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    for plan in plans:  # each model's table as soon as it is done: a run cut short keeps what finished
        plan_rows, plan_splits, plan_loads = _plan_rows(plan, ceilings, hf_compile, progress)
        print(harness.format_table(plan_rows, COLUMNS), flush=True)
        rows += plan_rows
        splits += plan_splits
        loads += plan_loads
    if splits:
        print(f"kernel time per decode step of {' and '.join(SPLIT_PATHS)}, ms by category (torch.profiler, "
              f"{SPLIT_STEPS} steps):")
        print(harness.format_table(splits, SPLIT_COLUMNS))
    target_model = model_label(plans[0].config)  # the LLaMA shape, whose heads decode attention alone takes too
    attention_rows = decode_attention_rows(plans[0].config, ceilings)
    print("decode attention alone (one query row per sequence against its cache, fp16; %copy: the K and V "
          "bytes per GPU time):")
    print(harness.format_table(attention_rows, DECODE_ATTENTION_COLUMNS))
    print(targets([r for r in rows if r["model"] == target_model], quick, attention_rows))
    print(f"bench generate took {time.perf_counter() - started:.0f} s")
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "loads": loads, "rows": rows, "kernel_split": splits,
                                      "decode_attention": attention_rows,
                                      "plans": [{**asdict(plan), "model": model_label(plan.config),
                                                 "context": median_context(plan.prompt, plan.steps, plan.warmup)}
                                                for plan in plans]})
    return rows


def _plan_rows(plan: Plan, ceilings: harness.Ceilings, hf_compile: bool, progress: Callable[[str], None]
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One plan's rows, kernel splits and load times, dtype by dtype, its model described first;
    `progress(label)` at each model made and each case."""
    config = plan.config
    label = model_label(config)
    context = median_context(plan.prompt, plan.steps, plan.warmup)
    print(f"{label}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} heads of {config.head_dim}, {config.num_key_value_heads} KV heads, FFN "
          f"{config.intermediate_size}, vocab {config.vocab_size}; {' and '.join(plan.dtypes)}; prompts of "
          f"{plan.prompt} random tokens, {plan.steps} greedy decode steps (timed: steps {plan.warmup}.."
          f"{plan.steps - 1}, median context {context})")
    compiled = [d for d in plan.dtypes if hf_compile and d in plan.compile_dtypes]
    print(f"{label} {HF_COMPILED}: " + (
        f"{', '.join(compiled)}, a compile per case (its first prefill and {COMPILE_WARMUP} steps, in 'compile s', "
        f"outside the timings)" if compiled else
        "off (left out of this model's plan: its compiles would take longer than its other rows)" if hf_compile
        else "off"))
    rows: list[dict[str, Any]] = []
    splits: list[dict[str, Any]] = []
    loads = []
    for dtype in plan.dtypes:
        progress(f"{label} {dtype}: random-weight checkpoint (transformers) and libnn's loads")
        try:
            models = _models(plan, dtype)
        except CASE_ERRORS as exc:  # e.g. out of memory: this dtype's rows say so, the next dtype runs
            note = f"no model: {why(exc)}"
            for batch in plan.batches:
                progress(f"{label} {dtype} batch {batch}: {note}")
                rows += [{"model": label, "dtype": dtype, "batch": batch, "path": path, "note": note}
                         for path in case_paths(plan, dtype, hf_compile)]
            _free()
            continue
        itemsize = dtypes.parse(dtype).itemsize
        weights, _ = decode_bytes(config, 1, 0, itemsize)
        load = {"model": label, "dtype": dtype, **models.load}
        loads.append(load)
        print(f"{label} {dtype}: {config.parameter_count()} parameters, "
              f"{memory.format_bytes(config.parameter_count() * itemsize)}; a batch-1 decode step reads "
              f"{memory.format_bytes(weights)} of them; made {load['made s']:.1f} s, saved {load['saved s']:.1f} s, "
              f"loaded by libnn {load[f'{LIBNN} load s']:.1f} s (and {load[f'{LIBNN_EAGER} load s']:.1f} s without "
              f"decode graphs)")
        for batch in plan.batches:
            progress(f"{label} {dtype} batch {batch}")
            case_rows, case_splits = _case_rows(plan, dtype, batch, models, ceilings, hf_compile)
            rows += case_rows
            splits += case_splits
        del models
        _free()
    return rows, splits, loads


# --- decode attention alone --------------------------------------------------------------------------------
DECODE_ATTENTION = ((1, 4096), (8, 4096), (64, 4096))  # (batch, context) with the plan's heads, fp16
DECODE_ATTENTION_PATHS = ("cudnn", "custom")


def decode_attention_rows(config: DecoderConfig, ceilings: harness.Ceilings,
                          cases: Sequence[tuple[int, int]] = DECODE_ATTENTION) -> list[dict[str, Any]]:
    """A decode step's attention alone, per path: one query row per sequence against its cache rows
    (B, context, Hkv, D), every sequence `context` tokens long, fp16; GPU ms (queue pre-filled), per-call
    ms, and the K and V bytes read per GPU time as a % of the copy bandwidth."""
    import cupy

    from libnn.ops.attention import CheckedLengths, attention
    from libnn.runtime.timing import time_gpu

    rows = []
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for batch, context in cases:
        rs = cupy.random.default_rng(batch)
        q = rs.standard_normal((batch, 1, Hq, D), dtype=cupy.float32).astype(cupy.float16)
        k, v = (rs.standard_normal((batch, context, Hkv, D), dtype=cupy.float32).astype(cupy.float16)
                for _ in range(2))
        lengths = CheckedLengths(cupy.full((batch,), context, cupy.int32))
        kv_bytes = 2 * batch * context * Hkv * D * 2
        for path in DECODE_ATTENTION_PATHS:
            row = {"batch": batch, "context": context, "heads": f"{Hq}/{Hkv}x{D}", "path": path,
                   "KV MB": kv_bytes / 1e6}

            def step(_=None, path=path):
                return attention(q, k, v, layout="BSHD", seq_lens_kv=lengths, path=path)
            try:
                t = time_gpu(step, [None], warmup=3, runs=30)
            except CASE_ERRORS as exc:
                rows.append({**row, "note": why(exc)})
                continue
            rows.append({**row, "ms": t.median_ms, "per-call ms": harness.time_per_call(step, calls=30, repeats=3),
                         "%copy": 100 * kv_bytes / t.median_s / 1e9 / ceilings.copy_gbs})
        _free()
    return rows


DECODE_ATTENTION_COLUMNS = ["batch", "context", "heads", "path", "KV MB", "ms", "per-call ms", "%copy", "note"]


def targets(rows: Sequence[dict[str, Any]], quick: bool, attention_rows: Sequence[dict[str, Any]] = ()) -> str:
    """The issue's targets that this bench measures, each with its verdict, on `rows` of the 1B LLaMA shape
    (run passes those; the GPT-2 rows have no target of their own)."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = [f"targets (issue 16, set for the 1B LLaMA shape; {LIBNN} decode, GPU time per step; Hugging Face "
             f"eager in the same run):"]
    if quick:
        lines.append("  (--quick runs the small LLaMA model: the targets are set for the 1B shape)")
    for r in rows:
        if r["path"] != LIBNN or r["batch"] != 1:
            continue
        if r["dtype"] == "fp16" and (share := r.get("%copy weights")) is not None:
            lines.append(f"  batch-1 decode fp16: weights at {share:.0f}% of copy bandwidth "
                         f"(target >= 80%: {verdict(share >= 80)})")
        if (speedup := r.get("x HF")) is not None:
            lines.append(f"  batch-1 decode {r['dtype']}: {speedup:.2f}x Hugging Face eager's tokens/s, per call "
                         f"(target >= 3x: {verdict(speedup >= 3)})")
    at_target = [r for r in attention_rows if r["batch"] == 64 and r["context"] == 4096 and r.get("%copy")]
    if at_target:
        best = max(at_target, key=lambda r: r["%copy"])
        lines.append(f"  decode attention, batch 64, context 4096: {best['%copy']:.0f}% of copy bandwidth on the "
                     f"cache read ({best['path']}; target >= 90%: {verdict(best['%copy'] >= 90)})")
    for r in rows:
        if r["path"] == LIBNN_FP8 and r["batch"] == 1 and (speedup := r.get("x fp16")) is not None:
            lines.append(f"  batch-1 decode FP8: {speedup:.2f}x the fp16 graph's tokens/s, per call "
                         f"(target >= 1.7x: {verdict(speedup >= 1.7)})")
    lines += paged_vs_dense(rows)
    return "\n".join(lines)


def paged_vs_dense(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line per dtype that has LIBNN_PAGED rows: at each of their batches, the paged row's decode ms/step
    over the dense graph row's (GPU, then per call; above 1 the paged cache costs more), "not measured"
    where either row has no time. The issue sets no target for it."""
    graph_rows = {(r["path"], r["dtype"], r["batch"]): r for r in rows if r["path"] in (LIBNN, LIBNN_PAGED)}
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows if r["path"] == LIBNN_PAGED):
        parts = []
        for batch in sorted(b for p, d, b in graph_rows if p == LIBNN_PAGED and d == dtype):
            paged, dense = graph_rows[LIBNN_PAGED, dtype, batch], graph_rows.get((LIBNN, dtype, batch), {})
            ratios = [f"{paged[c] / dense[c]:.2f}x {label}" for c, label in (("decode ms/step", "GPU"),
                                                                             ("per-call ms/step", "per call"))
                      if paged.get(c) and dense.get(c)]
            parts.append(f"batch {batch} {', '.join(ratios) or 'not measured'}")
        lines.append(f"  paged KV cache (pages of {PAGE_SIZE} tokens) against dense, {dtype} decode ms/step paged "
                     f"over dense (no target): {'; '.join(parts)}")
    return lines
