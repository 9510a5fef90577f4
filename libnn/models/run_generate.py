"""`libnn generate DIR`: a LLaMA or GPT-2 checkpoint (CausalLM.from_pretrained) continues prompts given
as token ids, or as text through the checkpoint's tokenizer.json where the optional `tokenizers` package is
installed, on the GPU if there is one, else on the reference path on the CPU. Prints each sequence's new
tokens (and their text), then the prompt and new tokens, the time to the first token and the decode's
tokens/s; with `stream`, each step's tokens as they come first.

Times are wall clock (time.perf_counter) around CausalLM.stream, whose steps arrive as host arrays: each
waits for the GPU's work, so a step's time is the GPU's and the host's together. "prefill" runs from the
call to the first step's tokens (the prompts checked and uploaded, the prefill, the first token drawn:
the time to the first token); "decode" from the first step's tokens to the last step's, and its tokens/s
counts the tokens of those steps, not the rows of sequences that had already ended. What the caller does
with each step (printing it) is not counted. A first run on a GPU also pays for one-time work (NVRTC
compiles, plan builds, the decode graph's capture); `warmup` does that first, untimed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from libnn.models.llama import CausalLM
from libnn.runtime.device import gpu_missing

TOKENIZER = "tokenizer.json"
# The warm-up's tokens: the prefill and one decode step, which compile every kernel, build every plan and
# capture the decode graph of the batch's bucket (a decode step's shapes do not change with its position).
WARMUP_TOKENS = 2
# U+FFFD, what a tokenizer decodes a character to while only some of its bytes have come (byte-level BPE)
PARTIAL = "\ufffd"


@dataclass
class Generation:
    """A timed generation: each sequence's new tokens (its end token included where one came) and the
    times, in seconds, as the module docstring defines them."""
    tokens: list[np.ndarray]
    steps: int           # the steps that ran; the first one's tokens come from the prefill
    prefill_s: float     # the call to the first step's tokens (0 when no step ran)
    decode_s: float      # the first step's tokens to the last step's
    decode_tokens: int   # the tokens of the steps after the first

    @property
    def tokens_per_s(self) -> float | None:
        """The decode's tokens per second; None where no decode step ran."""
        return self.decode_tokens / self.decode_s if self.steps > 1 else None


def timed_generation(model: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                     on_step: Callable[[int, np.ndarray], None] | None = None, **sampling: Any) -> Generation:
    """model.stream(prompts, max_new_tokens, **sampling), timed step by step; on_step(step, tokens) sees
    each step's (B,) tokens (-1 for a sequence that has ended) as they come, its own time left out."""
    steps: list[np.ndarray] = []
    marks: list[float] = []
    paused = 0.0
    start = time.perf_counter()
    for tokens in model.stream(prompts, max_new_tokens, **sampling):
        marks.append(time.perf_counter() - paused)
        steps.append(tokens)
        if on_step is not None:
            before = time.perf_counter()
            on_step(len(steps) - 1, tokens)
            paused += time.perf_counter() - before
    table = np.stack(steps, axis=1) if steps else np.zeros((len(prompts), 0), np.int64)
    return Generation(tokens=[row[row >= 0] for row in table], steps=len(steps),
                      prefill_s=marks[0] - start if marks else 0.0,
                      decode_s=marks[-1] - marks[0] if marks else 0.0,
                      decode_tokens=int((table[:, 1:] >= 0).sum()))


def load_tokenizer(directory: str | Path) -> Any:
    """The `tokenizers` Tokenizer of the checkpoint's tokenizer.json, which text prompts need."""
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise ModuleNotFoundError("--prompt takes text, which needs the optional `tokenizers` package (pip install "
                                  "tokenizers) and the checkpoint's tokenizer.json; without them give token ids "
                                  "with --prompt-ids", name="tokenizers") from None
    path = Path(directory) / TOKENIZER
    if not path.is_file():
        raise FileNotFoundError(f"--prompt takes text, which needs the checkpoint's tokenizer.json, and "
                                f"{str(path)!r} is not there; give token ids with --prompt-ids")
    return Tokenizer.from_file(str(path))


class TextPieces:
    """Each sequence's text as its tokens come. A token decoded alone would lose SentencePiece's spaces and
    split characters of several bytes, so each step decodes the whole sequence again and the piece is
    what is new past the text already shown; a text that ends in a partial character waits for its
    remaining bytes."""

    def __init__(self, tokenizer: Any, batch: int):
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.shown = [""] * batch

    def step(self, tokens: np.ndarray) -> list[str]:
        pieces = []
        for b, token in enumerate(tokens.tolist()):
            if token < 0:  # the sequence has ended
                pieces.append("")
                continue
            self.ids[b].append(token)
            text = self.tokenizer.decode(self.ids[b], skip_special_tokens=True)
            if text.endswith(PARTIAL):
                text = self.shown[b]
            pieces.append(text[len(self.shown[b]):])
            self.shown[b] = text
        return pieces


def step_printer(tokenizer: Any, batch: int) -> Callable[[int, np.ndarray], None]:
    """timed_generation's on_step for `stream`: each step's line (format_step), flushed as it comes."""
    pieces = None if tokenizer is None else TextPieces(tokenizer, batch)

    def show(step: int, tokens: np.ndarray) -> None:
        print(format_step(step, tokens, None if pieces is None else pieces.step(tokens)), flush=True)
    return show


def format_step(step: int, tokens: np.ndarray, pieces: list[str] | None = None) -> str:
    """One streamed step: `step 3: 450 29871` ('-' for a sequence that has ended), the text pieces after
    it as a JSON list where there is a tokenizer."""
    line = f"step {step}: " + " ".join("-" if t < 0 else str(t) for t in tokens.tolist())
    return line if pieces is None else f"{line}  {json.dumps(pieces, ensure_ascii=False)}"


def format_sequence(index: int, prompt: Sequence[int], tokens: np.ndarray) -> str:
    """`[0] 7 prompt tokens, 4 new: 450 4799 338 2`."""
    return f"[{index}] {len(prompt)} prompt tokens, {len(tokens)} new:" + "".join(f" {t}" for t in tokens.tolist())


def format_summary(prompts: Sequence[Sequence[int]], result: Generation) -> str:
    head = (f"batch of {len(prompts)}: {sum(map(len, prompts))} prompt tokens, "
            f"{sum(map(len, result.tokens))} new tokens")
    if not result.steps:
        return f"{head}; nothing ran (max_new_tokens 0)"
    head += f"; prefill {result.prefill_s * 1e3:.1f} ms (time to first token)"
    if result.tokens_per_s is None:
        return f"{head}; no decode step"
    return (f"{head}; decode {result.steps - 1} steps, {result.decode_tokens} tokens in {result.decode_s * 1e3:.1f} "
            f"ms: {result.tokens_per_s:.1f} tokens/s")


def run(directory: str | Path, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
        temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
        eos_token_id: Sequence[int] | None = None, dtype: str | None = None, device: str | None = None,
        max_len: int | None = None, stream: bool = False, warmup: bool = False) -> int:
    """`libnn generate`: prompts (each a str of text or a sequence of token ids) as one batch through the
    checkpoint in `directory`. device None: the GPU if there is one, else the CPU; dtype None: fp16 on the
    GPU, fp32 (the reference path) on the CPU. The sampling arguments, eos_token_id (None: the config's)
    and max_len (None: from_pretrained's default) go to CausalLM, which checks them."""
    if not prompts:
        raise ValueError("no prompt: give --prompt-ids (token ids, comma-separated) or --prompt (text), once per "
                         "sequence of the batch")
    if device is None:
        reason = gpu_missing()
        device = "cpu" if reason else "gpu"
        if reason:
            print(f"libnn generate: no GPU ({reason}): running the reference path on the CPU")
    dtype = dtype or ("fp16" if device == "gpu" else "fp32")
    tokenizer = load_tokenizer(directory) if any(isinstance(p, str) for p in prompts) else None
    ids = [tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in prompts]
    model = CausalLM.from_pretrained(directory, dtype=dtype, device=device, max_batch=len(ids), max_len=max_len)
    print(model.describe()[0])
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                "eos_token_id": None if eos_token_id is None else tuple(eos_token_id)}
    if warmup:  # no end token, so that the decode step runs whatever the first tokens are
        model.generate(ids, min(WARMUP_TOKENS, max_new_tokens), **{**sampling, "eos_token_id": ()})
    if device != "cpu":  # the load's copies finished before the clock starts
        import cupy

        cupy.cuda.Device().synchronize()
    result = timed_generation(model, ids, max_new_tokens, on_step=step_printer(tokenizer, len(ids)) if stream else None,
                              **sampling)
    for index, (prompt, tokens) in enumerate(zip(ids, result.tokens)):
        print(format_sequence(index, prompt, tokens))
        if tokenizer is not None:
            text = tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
            print(f"[{index}] text: {json.dumps(text, ensure_ascii=False)}")
    print(format_summary(ids, result))
    return 0
