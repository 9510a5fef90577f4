"""`libnn run cnn`: SeedCNN's shipped weights on its held-out digits, on the GPU when there is one,
else on the NumPy reference path. Prints where it ran, the path each op took, the accuracy, and the
latency of one batch: the median of timed passes, with CUDA events on the GPU, wall time on the CPU."""

from __future__ import annotations

import statistics
import time

import numpy as np

from libnn.models.seed_cnn import PATHS, SeedCNN, load_heldout
from libnn.registry import get_op
from libnn.runtime.device import gpu_missing
from libnn.runtime.timing import time_gpu

OPS = ("conv2d", "pool2d", "linear", "softmax")  # the ops SeedCNN calls, for the "paths taken" line
GPU_RUNS, CPU_RUNS = 20, 3


def run(batch: int = 64, path: str = "auto", dtype: str = "fp32") -> int:
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    if path not in PATHS:
        raise ValueError(f"--path must be one of {PATHS}, got {path!r}")
    reason = gpu_missing()
    if reason and path not in ("auto", "reference"):
        raise ValueError(f"--path {path} runs on the GPU, and there is none ({reason}); use --path reference")
    device = "cpu" if reason else "gpu"
    print(f"libnn run cnn: no GPU ({reason}): running the reference path on the CPU" if reason
          else "libnn run cnn: running on the GPU")

    images, labels = load_heldout()
    model = SeedCNN.pretrained(dtype=dtype, device=device, path=path)
    xp = np
    if device == "gpu":
        import cupy as xp
    batches = [xp.asarray(images[i:i + batch]) for i in range(0, len(images), batch)]
    predicted = np.concatenate([_to_host(model(b).argmax(axis=1)) for b in batches])
    correct = int((predicted == labels).sum())

    first = batches[0]
    if device == "gpu":
        timing = time_gpu(model, [first], warmup=3, runs=GPU_RUNS)
        latency, how = timing.median_ms, f"median of {timing.runs}, CUDA events"
    else:
        latency, how = _wall_ms(model, first, CPU_RUNS), f"median of {CPU_RUNS}, wall time"
    taken = ", ".join(f"{op} {get_op(op).last_decision.path}" for op in OPS if get_op(op).last_decision)
    print(f"SeedCNN {dtype}, paths taken: {taken}")
    print(f"held-out accuracy: {correct / len(labels):.2%} ({correct}/{len(labels)})")
    print(f"latency: {latency:.3f} ms per batch of {len(first)} ({how})")
    return 0


def _to_host(a):
    return a.get() if hasattr(a, "get") else a


def _wall_ms(model, x, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        model(x)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
