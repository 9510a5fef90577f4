"""`libnn bench pool2d`: max pooling (kernels/pool2d.cu, the only GPU path: the cuDNN frontend's Python
API has no pooling node) against the copy bandwidth the harness measures.

Target: max pooling (fp16 NHWC, 112² × 64 channels, 2×2/2 and 3×3/2) ≥ 80% of the copy bandwidth.
"""

from __future__ import annotations

from typing import Any

from libnn.bench import harness
from libnn.ops.pool2d import max_pool2d, pool2d_problem


def rows(ceilings: harness.Ceilings, quick: bool) -> list[dict[str, Any]]:
    """One row per window: the kernel's time and its bytes moved per second against the copy ceiling."""
    import cupy

    found = []
    x = cupy.random.default_rng(3).standard_normal((8 if quick else 32, 112, 112, 64), dtype=cupy.float32).astype(cupy.float16)
    for k, s, p in ((2, 2, 0), (3, 2, 1)):
        t = harness.time_gpu(lambda _: max_pool2d(x, k, s, p), [None], warmup=3, runs=30)
        gbs = pool2d_problem("max", x, k, s, p, True, "NHWC").bytes_moved / t.median_s / 1e9
        found.append({"case": f"max pool {k}x{k}/{s}", "N": x.shape[0], "dtype": "fp16 NHWC", "path": "custom",
                      "ms": t.median_ms, "GB/s": gbs, "%copy": 100 * gbs / ceilings.copy_gbs})
    return found


def targets(found: list[dict[str, Any]]) -> str:
    lines = ["targets (max pooling, fp16 NHWC):"]
    for r in found:
        lines.append(f"  {r['case']}: {r['%copy']:.0f}% of copy bandwidth  (target >= 80: {'met' if r['%copy'] >= 80 else 'MISSED'})")
    return "\n".join(lines)


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    found = rows(ceilings, quick)
    print(harness.format_table(found, ["case", "N", "dtype", "path", "ms", "GB/s", "%copy"]))
    print(targets(found))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": found})
    return found
