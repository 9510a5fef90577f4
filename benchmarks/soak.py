"""Soak: many calls of whole models, eager and graphed, on the GPU; memory must stay flat after warm-up
and every result must be bit-identical to the first call's.

Models: SeedCNN (the shipped weights, fp16) at batch 1 and 64, the MiniLM-shaped encoder (6 layers,
hidden 384, 12 heads, FFN 1536, random weights, fp16) at batch 8, sequence 128, with an attention mask
that pads half the rows, and a LLaMA-architecture decoder (the 1.1B benchmark model's attention: 32 heads
of 64, 8 KV heads; 4 layers, hidden 2048, FFN 2048, vocab 4096, random weights, fp16) generating 8 tokens
by seeded top-k sampling for 8 prompts of 37 to 200 tokens (a call is one `generate`: a prefill and 8
decode steps; it runs a tenth of `--calls` and of `--warmup`). Each runs `--calls` times eagerly and
through `model.graphed()` (the decoder: its decode steps as CUDA graphs, `decode_graphs`).

Per run: after `--warmup` calls, the CuPy pool's bytes in use and held and the device's used bytes
(cudaMemGetInfo) are read; again after the last call. Every `--check-every`-th result and the last
are compared bit for bit with the first call's (a device-side comparison of the raw bits, so NaN
compares too). A run fails when any result differs, or when memory in use grew by more than
`--tolerance-mib` (the pool's bytes in use must not grow at all by default: a steady loop frees
what it allocates; the device's used bytes get the tolerance, for library workspaces that may
appear late).

    python benchmarks/soak.py                         # 10000 calls of everything (~1-2 min on an H100)
    python benchmarks/soak.py --calls 500 --models cnn1 encoder decoder --modes graphed

Prints a table and exits 1 on any drift or growth, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

MODELS = ("cnn1", "cnn64", "encoder", "decoder")
MODES = ("eager", "graphed")
ENCODER = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
           "intermediate_size": 1536, "max_position_embeddings": 512, "hidden_act": "gelu"}
DECODER = {"vocab_size": 4096, "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 2048, "max_position_embeddings": 256}
DECODER_CALLS = 10  # the decoder's call (a prefill and 8 decode steps) runs a tenth of --calls and --warmup
MiB = 2**20


@dataclass
class Result:
    model: str
    mode: str
    calls: int = 0
    seconds: float = 0.0
    pool_used: tuple[int, int] = (0, 0)     # after warm-up, at the end
    pool_held: tuple[int, int] = (0, 0)
    device_used: tuple[int, int] = (0, 0)
    checked: int = 0
    mismatches: list[int] = field(default_factory=list)   # call numbers whose result differed
    error: str | None = None

    def failures(self, tolerance: int) -> list[str]:
        found = []
        if self.error:
            found.append(self.error)
        if self.mismatches:
            found.append(f"{len(self.mismatches)} of {self.checked} checked results differ from the first "
                         f"(calls {self.mismatches[:5]})")
        if self.pool_used[1] > self.pool_used[0]:
            found.append(f"pool bytes in use grew by {(self.pool_used[1] - self.pool_used[0]) / MiB:.2f} MiB")
        if self.pool_held[1] - self.pool_held[0] > tolerance:
            found.append(f"pool bytes held grew by {(self.pool_held[1] - self.pool_held[0]) / MiB:.2f} MiB")
        if self.device_used[1] - self.device_used[0] > tolerance:
            found.append(f"device memory used grew by {(self.device_used[1] - self.device_used[0]) / MiB:.2f} MiB")
        return found


def build(name: str, mode: str) -> Callable[[], Any]:
    """One call of the model on its inputs, on the GPU, fp16, eager or graphed (`mode`)."""
    import cupy

    rng = cupy.random.default_rng(7)
    if name.startswith("cnn"):
        from libnn.models import SeedCNN

        batch = int(name[3:])
        model = SeedCNN.pretrained(dtype="fp16", device="gpu")
        inputs = (rng.standard_normal((batch, 1, 28, 28), dtype=cupy.float32).astype(cupy.float16),)
    elif name == "encoder":
        from libnn.models import BertConfig, BertEncoder

        model = BertEncoder(BertConfig.from_dict(ENCODER), pooler=False, dtype="fp16", device="gpu")
        batch, seq = 8, 128
        ids = rng.integers(0, ENCODER["vocab_size"], (batch, seq), dtype=cupy.int64)
        lengths = cupy.asarray([seq, seq, 100, 77, seq, 31, seq, 1])  # half the rows padded on the right
        mask = (cupy.arange(seq)[None, :] < lengths[:, None]).astype(cupy.int64)
        inputs = (ids, mask)
    else:
        return _decoder_call(mode == "graphed")
    run = model.graphed() if mode == "graphed" else model
    return lambda: run(*inputs)


def _decoder_call(decode_graphs: bool) -> Callable[[], Any]:
    """generate(8 tokens, seeded top-k sampling) for 8 right-padded prompts: the tokens, (8, 8) on the GPU."""
    import cupy
    import numpy as np

    from libnn.models import CausalLM, LlamaConfig

    model = CausalLM(LlamaConfig.from_dict(DECODER), dtype="fp16", device="gpu", max_batch=8, max_len=256,
                     decode_graphs=decode_graphs)
    rng = np.random.default_rng(7)
    lengths = np.array([200, 37, 164, 99, 141, 200, 73, 158])
    ids = rng.integers(0, DECODER["vocab_size"], (8, 200))
    return lambda: cupy.asarray(np.stack(model.generate(ids, 8, lengths=lengths, temperature=1.0, top_k=50, seed=11,
                                                        eos_token_id=())))


def outputs(result: Any) -> list[Any]:
    """The arrays of a model's result (SeedCNN: one; the encoder: last_hidden_state and pooled)."""
    if hasattr(result, "last_hidden_state"):
        return [a for a in (result.last_hidden_state, result.pooled, result.pooler_output) if a is not None]
    return [result]


def raw_bits(a: Any) -> Any:
    return a.view(f"u{a.dtype.itemsize}")


def memory() -> tuple[int, int, int]:
    """(pool bytes in use, pool bytes held, device bytes used), after the device is idle."""
    import cupy

    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    return pool.used_bytes(), pool.total_bytes(), total - free


def soak(name: str, mode: str, calls: int, warmup: int, check_every: int, progress_s: float) -> Result:
    import cupy

    result = Result(name, mode)
    try:
        run = build(name, mode)
        first = [cupy.array(a, copy=True) for a in outputs(run())]
        for _ in range(warmup):
            run()
        used0, held0, device0 = memory()
        start = last_report = time.perf_counter()
        for call in range(1, calls + 1):
            got = outputs(run())
            if call % check_every == 0 or call == calls:
                result.checked += 1
                if len(got) != len(first) or not all(
                        a.shape == b.shape and bool(cupy.array_equal(raw_bits(a), raw_bits(b))) for a, b in zip(got, first)):
                    result.mismatches.append(call)
            del got
            now = time.perf_counter()
            if now - last_report >= progress_s:
                used = cupy.get_default_memory_pool().used_bytes()
                print(f"  {name} {mode}: {call}/{calls} calls, {call / (now - start):.0f} calls/s, pool in use "
                      f"{used / MiB:.1f} MiB, {len(result.mismatches)} mismatches", flush=True)
                last_report = now
        cupy.cuda.Device().synchronize()
        result.seconds = time.perf_counter() - start
        result.calls = calls
        used1, held1, device1 = memory()  # the model, its captures and `first` held as at the baseline
        result.pool_used, result.pool_held, result.device_used = (used0, used1), (held0, held1), (device0, device1)
    except Exception as exc:  # noqa: BLE001 (reported in the table, and the exit status)
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return result


def table(results: list[Result], tolerance: int) -> str:
    header = ("model", "mode", "calls", "calls/s", "pool in use MiB", "pool held MiB", "device used MiB",
              "checked", "differ", "verdict")
    rows = [header]
    for r in results:
        def pair(p):
            return f"{p[0] / MiB:.1f} -> {p[1] / MiB:.1f}"
        failures = r.failures(tolerance)
        rows.append((r.model, r.mode, str(r.calls), f"{r.calls / r.seconds:.0f}" if r.seconds else "-",
                     pair(r.pool_used), pair(r.pool_held), pair(r.device_used), str(r.checked),
                     str(len(r.mismatches)), "ok" if not failures else "FAIL: " + "; ".join(failures)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Memory: 'after warm-up -> at the end'. Exit status 1 on any drift or growth.")
    parser.add_argument("--calls", type=int, default=10000, help="calls per model and mode after warm-up (default 10000)")
    parser.add_argument("--warmup", type=int, default=20, help="calls before the memory baseline (default 20)")
    parser.add_argument("--check-every", type=int, default=100,
                        help="compare every N-th result (and the last) with the first call's, bit for bit (default 100)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="cnn1 / cnn64: SeedCNN fp16 at batch 1 / 64; encoder: MiniLM shape fp16, batch 8, "
                             "seq 128; decoder: a small LLaMA generating 8 sampled tokens for 8 prompts (--calls / 10 "
                             "calls)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tolerance-mib", type=float, default=2.0,
                        help="growth of the pool's held bytes and the device's used bytes allowed, MiB (default 2); "
                             "the pool's bytes in use may not grow at all")
    parser.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines (default 10)")
    args = parser.parse_args(argv)
    for name in ("calls", "warmup", "check_every"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else 'positive'}")

    from libnn.runtime.device import gpu_missing

    if reason := gpu_missing():
        print(f"soak: needs a GPU: {reason}", file=sys.stderr)
        return 2
    tolerance = int(args.tolerance_mib * MiB)
    results = []
    for name in args.models:
        for mode in args.modes:
            calls = max(1, args.calls // DECODER_CALLS) if name == "decoder" else args.calls
            check_every = max(1, args.check_every // DECODER_CALLS) if name == "decoder" else args.check_every
            warmup = args.warmup // DECODER_CALLS if name == "decoder" else args.warmup
            print(f"soak: {name} {mode}, {calls} calls", flush=True)
            results.append(soak(name, mode, calls, warmup, check_every, args.progress))
    print(table(results, tolerance))
    failed = [r for r in results if r.failures(tolerance)]
    print(f"soak: {len(results) - len(failed)} of {len(results)} runs flat and bit-identical"
          + (f"; FAILED: {', '.join(f'{r.model} {r.mode}' for r in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
