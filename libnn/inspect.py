"""Inspect the plans a library's heuristic offers: which algorithms, their knobs, their measured time,
which one the heuristic put first, which was fastest, and which one libnn will run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from libnn.bench.harness import format_table


@dataclass
class PlanReport:
    title: str
    rows: list[dict[str, Any]]
    summary: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "candidates": self.rows, "summary": self.summary}

    def table(self) -> str:
        columns = [c for c in self.rows[0] if any(r.get(c) is not None for r in self.rows)] if self.rows else []
        return "\n".join([self.title, format_table(self.rows, columns), *self.summary])


def linear_plans(m: int, n: int, k: int, dtype: str = "bf16", bias: bool = True, activation: str | None = None,
                 allow_tf32: bool = False, time: bool = False) -> PlanReport:
    """The cuBLASLt algorithms for linear on (m, n, k); with `time`, each one's median time."""
    import cupy

    from libnn import dtypes
    from libnn.backends import cublaslt
    from libnn.config import config
    from libnn.ops.linear import LinearProblem

    dt = dtypes.parse(dtype)
    rng = cupy.random.default_rng(0)

    def draw(*shape):
        return (rng.standard_normal(shape, dtype=cupy.float32) / math.sqrt(k)).astype(dt)

    x, w, b = draw(m, k), draw(n, k), draw(n) if bias else None
    y = cupy.empty((m, n), dt)
    problem = LinearProblem(m, n, k, dtypes.short_name(dt), bias, activation, allow_tf32,
                            f"gpu:{cupy.cuda.runtime.getDevice()}")
    plan = cublaslt.plan_for(problem, x, w, b, y)
    if time:
        chosen_before = plan.chosen
        plan.autotune(x, w, b, y, runs=20)
        if not config.autotune:
            plan.choose(chosen_before)  # inspecting must not change what later calls run
    rows = []
    for c in plan.candidates:
        row = c.describe()
        if c.time_ms is not None:
            row["TFLOP/s"] = problem.flops / (c.time_ms / 1e3) / 1e12
        marks = ["heuristic #1"] if c.index == 0 else []
        if time and c.time_ms == min(x.time_ms for x in plan.candidates):
            marks.append("fastest")
        if c.index == plan.chosen:
            marks.append("libnn runs")
        row["note"] = ", ".join(marks)
        rows.append(row)
    summary = [f"planned in {plan.plan_seconds * 1e3:.1f} ms; {len(plan.candidates)} candidates; "
               f"libnn runs #{plan.chosen} ({'autotuned' if config.autotune else 'heuristic order'}; "
               f"set LIBNN_AUTOTUNE=1 to run the fastest measured)"]
    if time:
        first, best = plan.candidates[0].time_ms, min(c.time_ms for c in plan.candidates)
        summary.append(f"the heuristic's first choice takes {first:.4f} ms, the fastest {best:.4f} ms: "
                       f"{100 * (first / best - 1):.1f}% slower than the fastest")
    return PlanReport(f"cuBLASLt plans for {problem.describe()}", rows, summary)
