"""Four threads, each on its own CuPy stream, calling linear, conv2d, attention, layer_norm and
softmax on every GPU path (read from the registry) many times on inputs of their own, get results
bit-identical to one thread computing the same calls one after another.

What this guards: the bound-call tables, plan caches, library handles and workspaces that ops share
across threads (a workspace or handle shared between two streams gives wrong values when both run at
once; a cache filled by two threads at once can bind one's plan to the other's problem). The tables
are cleared before the threads start, so the four bind the same signatures at the same moment. The
same path on the same problem runs the same kernel or plan, so the results must be equal bit for bit.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import random_normal
from libnn.errors import LibraryError, PathUnavailableError
from libnn.ops import attention, conv2d, layer_norm, linear, softmax
from libnn.registry import get_op

pytestmark = pytest.mark.gpu

THREADS = 4
ROUNDS = 20  # every (op, path) per round, per thread


def draw_inputs(rng, dtype: str) -> dict[str, dict[str, np.ndarray]]:
    """One thread's host inputs: sizes that keep each kernel busy long enough for streams to overlap."""
    return {
        "linear": {"x": random_normal(rng, (257, 384), dtype), "w": random_normal(rng, (520, 384), dtype, 0.05),
                   "b": random_normal(rng, (520,), dtype)},
        "conv2d": {"x": random_normal(rng, (4, 17, 17, 32), dtype), "w": random_normal(rng, (64, 3, 3, 32), dtype, 0.06),
                   "b": random_normal(rng, (64,), dtype)},
        "attention": {"q": random_normal(rng, (2, 4, 130, 64), dtype), "k": random_normal(rng, (2, 4, 130, 64), dtype),
                      "v": random_normal(rng, (2, 4, 130, 64), dtype),
                      "seq_lens_kv": np.array([130, 77], np.int32)},
        "layer_norm": {"x": random_normal(rng, (300, 768), dtype), "weight": random_normal(rng, (768,), dtype),
                       "bias": random_normal(rng, (768,), dtype)},
        "softmax": {"x": random_normal(rng, (64, 1000), dtype, 4.0)},
    }


CALLS = {
    "linear": lambda a, path: linear(a["x"], a["w"], a["b"], "gelu", path=path),
    "conv2d": lambda a, path: conv2d(a["x"], a["w"], a["b"], padding=1, activation="relu", path=path),
    "attention": lambda a, path: attention(a["q"], a["k"], a["v"], causal=True, seq_lens_kv=a["seq_lens_kv"],
                                           path=path),
    "layer_norm": lambda a, path: layer_norm(a["x"], a["weight"], a["bias"], path=path),
    "softmax": lambda a, path: softmax(a["x"], -1, path=path),
}


def gpu_calls() -> list[tuple[str, str]]:
    return [(op, p.name) for op in CALLS for p in get_op(op).ordered() if p.device == "gpu"]


def upload(inputs: dict) -> dict:
    import cupy

    return {op: {name: cupy.asarray(a) for name, a in arrays.items()} for op, arrays in inputs.items()}


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_four_streams_give_the_results_of_one_thread(rng, dtype):
    import cupy

    inputs = [draw_inputs(rng, dtype) for _ in range(THREADS)]
    # one thread, one stream: the expected results, and the (op, path) pairs this machine runs
    expected: list[dict[tuple[str, str], np.ndarray]] = []
    skipped: dict[tuple[str, str], str] = {}
    with cupy.cuda.Stream(non_blocking=True) as stream:
        for arrays in inputs:
            device = upload(arrays)
            results = {}
            for op, path in gpu_calls():
                if (op, path) in skipped:
                    continue
                try:
                    results[op, path] = cupy.asnumpy(CALLS[op](device[op], path), stream=stream)
                except (PathUnavailableError, LibraryError) as exc:
                    skipped[op, path] = str(exc)[:120]
            expected.append(results)
        stream.synchronize()
    runs = [key for key in expected[0] if key not in skipped]
    print(f"{len(runs)} (op, path) pairs run: {runs}; not run here: {skipped}")
    assert runs, "no GPU path ran at all"
    for op in CALLS:
        get_op(op).calls.clear()  # the threads bind every signature anew, at the same time

    barrier = threading.Barrier(THREADS)
    outputs: list[dict[tuple[str, str], list]] = [{} for _ in range(THREADS)]
    failures: list[BaseException] = []

    def work(t: int) -> None:
        try:
            with cupy.cuda.Stream(non_blocking=True) as stream:
                device = upload(inputs[t])
                stream.synchronize()
                barrier.wait(timeout=60)
                for _ in range(ROUNDS):
                    for op, path in runs:
                        outputs[t].setdefault((op, path), []).append(CALLS[op](device[op], path))
                stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 (re-raised by the main thread)
            failures.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,), name=f"stream-{t}") for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish in 300 s"
    if failures:
        raise failures[0]
    differences = []
    for t in range(THREADS):
        for key, results in outputs[t].items():
            want = expected[t][key]
            for i, result in enumerate(results):
                got = cupy.asnumpy(result)
                if got.shape != want.shape or not np.array_equal(bits(got), bits(want)):
                    worst = np.abs(got.astype(np.float64) - want.astype(np.float64)).max() \
                        if got.shape == want.shape else "shape"
                    differences.append(f"thread {t} {key} call {i}: max difference {worst}")
    assert not differences, f"{len(differences)} results differ from one thread's: " + "; ".join(differences[:10])
