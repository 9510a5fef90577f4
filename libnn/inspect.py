"""Inspect the plans a library's heuristic offers: which algorithms, their knobs, their measured time,
which one the heuristic put first, which was fastest, and which one libnn will run."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

from libnn import dtypes
from libnn.backends import cublaslt, cudnn
from libnn.bench.harness import format_table
from libnn.config import config
from libnn.ops import activations
from libnn.ops.attention import UID_K, UID_O, UID_Q, UID_V, attention, attention_graph_builder, attention_problem
from libnn.ops.conv2d import (UID_SCALE, UID_SHIFT, UID_W, UID_X, UID_Y, conv2d, conv2d_graph_builder, conv2d_problem,
                              output_shape)
from libnn.ops.linear import ACTIVATIONS, LinearProblem


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

    activations.check("linear", activation, ACTIVATIONS)
    dt = dtypes.parse(dtype)
    rng = cupy.random.default_rng(0)

    def draw(*shape):
        return (rng.standard_normal(shape, dtype=cupy.float32) / math.sqrt(k)).astype(dt)

    x, w, b = draw(m, k), draw(n, k), draw(n) if bias else None
    y = cupy.empty((m, n), dt)
    problem = LinearProblem(m, n, k, dtypes.short_name(dt), bias, activation, allow_tf32,
                            f"gpu:{cupy.cuda.runtime.getDevice()}")
    plan = cublaslt.plan_for(problem, x, w, b, y, cupy.cuda.get_current_stream().ptr)
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


def conv_plans(n: int, c: int, h: int, w: int, k: int, r: int, s: int, stride: int = 1, padding: int = 0,
               dilation: int = 1, groups: int = 1, dtype: str = "fp16", layout: str = "NHWC",
               activation: str | None = "relu", bn: bool = True, time: bool = False,
               modes: tuple[str, ...] = ("A", "B", "FALLBACK"), progress: bool = False) -> PlanReport:
    """Every plan cuDNN's heuristics modes offer for the fused conv graph, each built (and with
    `time`, timed); marks each mode's first choice, the fastest, and the plan libnn runs."""
    import cupy

    dt = dtypes.parse(dtype)
    rng = cupy.random.default_rng(0)
    x_shape = (n, h, w, c) if layout == "NHWC" else (n, c, h, w)
    w_shape = (k, r, s, c // groups) if layout == "NHWC" else (k, c // groups, r, s)
    x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dt)
    wt = (rng.standard_normal(w_shape, dtype=cupy.float32) / math.sqrt(c // groups * r * s)).astype(dt)
    vectors = [rng.standard_normal(k, dtype=cupy.float32) for _ in range(2)] if bn else None
    problem = conv2d_problem(x, wt, None, vectors, stride, padding, dilation, groups, activation, layout, False)
    y = cupy.empty(output_shape(problem), dt)
    buffers = {UID_X: x, UID_W: wt, UID_Y: y}
    if bn:
        buffers.update({UID_SCALE: vectors[0], UID_SHIFT: vectors[1]})

    def run_libnn():  # what libnn runs, from its own cache
        conv2d(x, wt, bn=vectors, stride=stride, padding=padding, dilation=dilation, groups=groups,
               activation=activation, layout=layout, path="cudnn")

    return _cudnn_report(problem, conv2d_graph_builder(problem), buffers, run_libnn, modes, time, progress)


def attention_plans(b: int, h: int, s: int, d: int, s_kv: int | None = None, h_kv: int | None = None,
                    dtype: str = "bf16", causal: bool = False, layout: str = "BHSD", time: bool = False,
                    modes: tuple[str, ...] = ("A", "B", "FALLBACK"), progress: bool = False) -> PlanReport:
    """Every plan cuDNN's heuristics offer for the fused attention (SDPA) graph; as conv_plans."""
    import cupy

    dt = dtypes.parse(dtype)
    rng = cupy.random.default_rng(0)
    s_kv, h_kv = s_kv or s, h_kv or h

    def tensor(heads, seq):
        shape = (b, heads, seq, d) if layout == "BHSD" else (b, seq, heads, d)
        return rng.standard_normal(shape, dtype=cupy.float32).astype(dt)

    q, k, v = tensor(h, s), tensor(h_kv, s_kv), tensor(h_kv, s_kv)
    problem = attention_problem(q, k, v, None, None, causal, layout, False, False)
    buffers = {UID_Q: q, UID_K: k, UID_V: v, UID_O: cupy.empty_like(q)}

    def run_libnn():
        attention(q, k, v, causal=causal, layout=layout, path="cudnn")

    return _cudnn_report(problem, attention_graph_builder(problem), buffers, run_libnn, modes, time, progress)


def _cudnn_report(problem: Any, builder: Any, buffers: dict[int, Any], run_libnn: Any, modes: tuple[str, ...],
                  time: bool, progress: bool) -> PlanReport:
    """The plans of `builder`'s graph per heuristics mode, each built (and timed), with marks for each
    mode's first choice, the fastest, and the plan libnn runs (after `run_libnn()` fills its cache)."""
    def report(info):
        if progress:
            print(f"  mode {info.mode} plan {info.index}: {info.name} "
                  f"{'%.4f ms' % info.time_ms if info.time_ms else ('built' if info.built else 'not built')}",
                  file=sys.stderr, flush=True)

    plans = cudnn.enumerate_plans(builder, buffers, modes, time_plans=time, on_plan=report)
    run_libnn()
    ran = cudnn.graph_for(problem, builder, problem.describe())
    timed = [p for p in plans if p.time_ms is not None]
    fastest = min(timed, key=lambda p: p.time_ms) if timed else None
    rows = []
    for p in plans:
        marks = []
        if p.index == 0:
            marks.append(f"heuristic {p.mode} #1")
        if fastest is not None and p is fastest:
            marks.append("fastest")
        if p.name == ran.plan_name:
            marks.append("libnn runs")
        rows.append({"mode": p.mode, "index": p.index, "plan": p.name, "engine": p.engine_id,
                     "knobs": " ".join(f"{kk}={v}" for kk, v in p.knobs.items()) or "-",
                     "behavior": " ".join(p.behavior_notes) or "-",
                     "workspace_MiB": None if p.workspace_bytes is None else p.workspace_bytes / 2**20,
                     "built": "yes" if p.built else f"no: {p.error}", "time_ms": p.time_ms,
                     "TFLOP/s": problem.flops / (p.time_ms / 1e3) / 1e12 if p.time_ms else None,
                     "note": ", ".join(marks)})
    summary = [f"libnn runs {ran.plan_name} (heuristics mode A's first plan that builds; "
               f"graph {ran.source} in {ran.build_seconds * 1e3:.1f} ms)",
               "numerical notes per plan are not exposed by cuDNN frontend 1.28's Python API"]
    if fastest is not None:
        first = next((p for p in plans if p.mode == "A" and p.time_ms is not None), None)
        if first is not None:
            summary.append(f"heuristic A's first choice {first.name} takes {first.time_ms:.4f} ms, the fastest "
                           f"({fastest.name}, mode {fastest.mode}) {fastest.time_ms:.4f} ms: "
                           f"{100 * (first.time_ms / fastest.time_ms - 1):.1f}% slower than the fastest")
    return PlanReport(f"cuDNN plans for {problem.describe()}", rows, summary)
