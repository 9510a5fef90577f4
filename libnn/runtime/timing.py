"""GPU time of a region: CUDA events on the current stream, after warm-up, the median of many runs.

In the runtime because the library itself times things: cuBLASLt's autotune and cuDNN's plan
enumeration pick the fastest candidate by it, and `libnn run cnn` reports its latency with it. The
benchmark harness (libnn.bench.harness) builds its rows on it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from libnn.runtime import kernels

HOLD_KERNEL = "spin_wait"  # hold_stream's kernel (kernels/timing.cu), by the name a profiler shows


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int

    @property
    def median_s(self) -> float:
        return self.median_ms / 1e3


def time_gpu(fn: Callable[[Any], Any], inputs: Sequence[Any], *, warmup: int = 5, runs: int = 30,
             min_seconds: float = 0.0) -> Timing:
    """Median time of `fn(inputs[i % len(inputs)])` on the current stream, one event pair per run.

    `inputs` is a list of argument sets to rotate through; pass more than one set, together larger
    than L2, when the data would otherwise stay cached between runs.
    """
    import cupy

    stream = cupy.cuda.get_current_stream()
    start_wall = time.perf_counter()
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    stream.synchronize()
    host_per_call = (time.perf_counter() - start_wall) / max(warmup, 1)
    # Keep the GPU busy while the host queues the batch, so that each event pair brackets GPU work
    # only; without this, runs shorter than the host's launch overhead would time the host.
    hold_stream(min(0.2, 1.5 * host_per_call * runs))
    events = []
    start_wall = time.perf_counter()
    i = 0
    while i < runs or time.perf_counter() - start_wall < min_seconds:
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        fn(inputs[i % len(inputs)])
        end.record(stream)
        events.append((begin, end))
        i += 1
    stream.synchronize()
    times = sorted(cupy.cuda.get_elapsed_time(b, e) for b, e in events)
    return Timing(statistics.median(times), times[len(times) // 10], times[(len(times) * 9) // 10], len(times))


def hold_stream(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (one thread spinning on the SM clock), so that
    the work queued behind it meanwhile runs back to back, without the host's gaps between calls."""
    import cupy

    rate_khz = cupy.cuda.Device().attributes["ClockRate"]
    kernels.function("timing.cu", HOLD_KERNEL)((1,), (1,), (np.int64(seconds * rate_khz * 1e3),))
