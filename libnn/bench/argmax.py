"""`libnn bench argmax`: a decoder's greedy token from its logits (B, vocab): kernels/argmax.cu (custom)
against cupy.argmax itself (bf16 as float32 from its bits, which CuPy needs, converted once outside the
timing; not the cupy path, whose NaN rule adds passes) and PyTorch's torch.argmax, eager, captured in a
torch.cuda.graph, and through torch.compile, on the same values.

Each row reports the GPU time (queued back to back after a warm-up: the median of CUDA-event pairs), the
per-call time as a user's loop sees it (calls back to back, nothing queued before them, one synchronisation
at the end), and the logits' bytes read per GPU second against the copy bandwidth measured in the same run.
The vocabularies: LLaMA 2 (32000), GPT-2 (50257, odd) and LLaMA 3 (128256); batch 1, 8 and 64.

Target: the custom kernel's GPU time below every peer's (CuPy's, and torch's eager, graphed and compiled) at
every row.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from libnn import dtypes
from libnn.bench import harness
from libnn.ops.argmax import argmax, as_cupy_float

PEER_ERRORS = (RuntimeError, ValueError, TypeError, AssertionError, ImportError)  # torch.compile's failures


def _cases(quick: bool) -> list[tuple[int, int, str]]:
    """(batch, vocab, dtype)."""
    if quick:
        return [(1, 32000, "fp16"), (8, 32000, "fp16")]
    return [(1, 32000, "fp16"), (8, 32000, "fp16"), (64, 32000, "fp16"), (1, 50257, "fp16"), (1, 128256, "bf16"),
            (64, 128256, "bf16"), (1, 32000, "fp32")]


def _torch_paths(values: np.ndarray, dtype: str) -> dict[str, Callable[[Any], Any]]:
    """torch.argmax of the same values, eager, replayed from a torch.cuda.graph, and compiled."""
    import torch

    x = torch.from_numpy(values).cuda().to(harness.torch_dtype(dtype))
    compiled = torch.compile(lambda t: torch.argmax(t, dim=-1))
    eager = lambda _: torch.argmax(x, dim=-1)  # noqa: E731
    return {"torch eager": eager, "torch graph": harness.torch_graph(eager), "torch.compile": lambda _: compiled(x)}


def rows(ceilings: harness.Ceilings, quick: bool) -> list[dict[str, Any]]:
    import cupy

    found = []
    cases = _cases(quick)
    for i, (batch, vocab, dtype) in enumerate(cases):
        harness.progress(i, len(cases), f"argmax {batch}x{vocab} {dtype}")
        values = np.random.default_rng(i).standard_normal((batch, vocab), dtype=np.float32)
        x = cupy.asarray(values.astype(dtypes.parse(dtype)))
        as_cupy = as_cupy_float(x)   # (bf16: converted once, outside the timing)
        paths: dict[str, Callable[[Any], Any]] = {"custom": lambda _: argmax(x, path="custom"),
                                                  "cupy": lambda _: cupy.argmax(as_cupy, axis=-1)}
        expected = cupy.argmax(as_cupy, axis=-1).get()
        try:
            paths.update(_torch_paths(values, dtype))
        except ImportError:
            pass
        nbytes = x.nbytes
        for path, fn in paths.items():
            row = {"case": f"{batch}x{vocab}", "dtype": dtype, "path": path}
            try:
                t = harness.time_gpu(fn, [None], warmup=5, runs=100)
                per_call = harness.time_per_call(lambda: fn(None), calls=200, repeats=5)
            except PEER_ERRORS as exc:
                row["note"] = str(exc).splitlines()[0][:60]
                found.append(row)
                continue
            gbs = nbytes / t.median_s / 1e9
            row.update({"GPU us": 1e3 * t.median_ms, "per-call us": 1e3 * per_call, "GB/s": gbs,
                        "%copy": 100 * gbs / ceilings.copy_gbs})
            found.append(row)
        if not (argmax(x, path="custom").get() == expected).all():
            raise AssertionError(f"bench argmax: the custom path disagrees with CuPy's at {batch}x{vocab} {dtype}")
    return found


def targets(found: list[dict[str, Any]]) -> str:
    def time_of(case: str, dtype: str, path: str) -> float | None:
        return next((r.get("GPU us") for r in found if (r["case"], r["dtype"], r["path"]) == (case, dtype, path)),
                    None)

    faster = [f"{r['case']} {r['dtype']} {r['path']}" for r in found if r["path"] != "custom"
              and r.get("GPU us") is not None and time_of(r["case"], r["dtype"], "custom") is not None
              and time_of(r["case"], r["dtype"], "custom") >= r["GPU us"]]
    verdict = "met" if not faster else "MISSED: " + ", ".join(faster)
    return f"targets:\n  custom's GPU time below every peer's at every row: {verdict}"


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    found = rows(ceilings, quick)
    print(harness.format_table(found, ["case", "dtype", "path", "GPU us", "per-call us", "GB/s", "%copy", "note"]))
    print(targets(found))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": found})
    return found
