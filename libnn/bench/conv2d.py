"""`libnn bench conv2d`: fused cuDNN graphs vs unfused vs our kernels vs PyTorch (pooling: `bench pool2d`).

Paths per case (BN statistics pre-folded to per-channel fp32 scale and shift, as a layer holds them):
cudnn (one fused graph conv→mul→add→act), cudnn unfused (cuDNN conv, then BN and the
activation as separate element-wise kernels, as an unfused framework runs them), cudnn+epilogue (cuDNN
conv, then our one fused epilogue kernel), folded BN (BN folded into w and b ahead of time, graph
conv→bias→act), custom (kernels/conv2d.cu), and PyTorch eager (conv2d, batch_norm, relu in
channels_last) when installed.

Targets (N=32 C=K=64 56² 3×3 fp16 NHWC): cudnn ≥ 1.3× faster than cudnn unfused and ≥ 1.35× faster
than PyTorch eager; custom ≥ 30% of cudnn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from libnn import dtypes
from libnn.bench import harness
from libnn.errors import LibnnError
from libnn.ops.conv2d import apply_epilogue_kernel, conv2d, conv2d_problem, fold_batchnorm


@dataclass(frozen=True)
class Case:
    name: str
    N: int
    C: int
    H: int
    K: int
    R: int
    stride: int = 1
    groups: int = 1
    dtype: str = "fp16"
    layout: str = "NHWC"

    @property
    def padding(self) -> int:
        return self.R // 2

    @property
    def flops(self) -> int:
        P = (self.H + 2 * self.padding - self.R) // self.stride + 1
        return 2 * self.N * P * P * self.K * self.R * self.R * (self.C // self.groups)


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("resnet 64@56 3x3", 8, 64, 56, 64, 3)]
    cases = []
    for dtype in ("fp16", "bf16"):
        cases += [Case("resnet 64@56 3x3", 32, 64, 56, 64, 3, dtype=dtype),
                  Case("resnet 128@28 3x3", 32, 128, 28, 128, 3, dtype=dtype),
                  Case("resnet 256@14 3x3", 32, 256, 14, 256, 3, dtype=dtype),
                  Case("resnet 512@7 3x3", 32, 512, 7, 512, 3, dtype=dtype),
                  Case("resnet 64@56 1x1", 32, 64, 56, 256, 1, dtype=dtype),
                  Case("resnet 256@14 1x1", 32, 256, 14, 1024, 1, dtype=dtype)]
    cases += [Case("resnet 64@56 3x3 N=1", 1, 64, 56, 64, 3),
              Case("depthwise 128@56 3x3", 32, 128, 56, 128, 3, groups=128),
              Case("seed CNN conv1", 256, 1, 28, 32, 3), Case("seed CNN conv2", 256, 32, 14, 64, 3),
              Case("resnet 64@56 3x3", 32, 64, 56, 64, 3, dtype="fp32", layout="NCHW"),
              Case("resnet 256@14 3x3", 32, 256, 14, 256, 3, dtype="fp32", layout="NCHW")]
    return cases


def _inputs(case: Case):
    import cupy

    rng = cupy.random.default_rng(7)
    dt = dtypes.parse(case.dtype)
    x_shape = (case.N, case.H, case.H, case.C) if case.layout == "NHWC" else (case.N, case.C, case.H, case.H)
    cg = case.C // case.groups
    w_shape = (case.K, case.R, case.R, cg) if case.layout == "NHWC" else (case.K, cg, case.R, case.R)
    x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dt)
    w = (rng.standard_normal(w_shape, dtype=cupy.float32) / math.sqrt(cg * case.R * case.R)).astype(dt)
    gamma, beta, mean = (rng.standard_normal(case.K, dtype=cupy.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, case.K, dtype=cupy.float32)
    return x, w, (gamma, beta, mean, var, 1e-5)


def _paths(case: Case, x, w, bn) -> dict[str, Callable[[Any], Any]]:
    common = dict(stride=case.stride, padding=case.padding, groups=case.groups, layout=case.layout)
    scale, shift = fold_batchnorm(*bn)
    problem = conv2d_problem(x, w, None, bn, case.stride, case.padding, 1, case.groups, "relu", case.layout, False)
    bn_only = replace(problem, activation=None)
    relu_only = replace(problem, has_scale=False, has_shift=False)
    w_folded = (w * scale.reshape((-1, 1, 1, 1))).astype(w.dtype)
    b_folded = shift.astype(w.dtype)

    def unfused(_):  # three passes, as a framework without fusion runs them
        y = conv2d(x, w, **common, path="cudnn")
        apply_epilogue_kernel(bn_only, y, scale, shift)
        return apply_epilogue_kernel(relu_only, y, None, None)

    folded = (scale, shift)  # what a layer computes once and passes on every call
    paths = {"cudnn": lambda _: conv2d(x, w, bn=folded, activation="relu", **common, path="cudnn"),
             "cudnn unfused": unfused,
             "cudnn+epilogue": lambda _: conv2d(x, w, bn=folded, activation="relu", **common, path="cudnn+epilogue"),
             "folded BN": lambda _: conv2d(x, w_folded, b_folded, activation="relu", **common, path="cudnn"),
             "custom": lambda _: conv2d(x, w, bn=folded, activation="relu", **common, path="custom")}
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return paths
    tx = torch.from_dlpack(x if case.layout == "NCHW" else x.transpose(0, 3, 1, 2))   # NCHW view of NHWC memory
    tw = torch.from_dlpack(w if case.layout == "NCHW" else w.transpose(0, 3, 1, 2))
    tbn = [torch.from_dlpack(v) for v in bn[:4]]
    torch.backends.cudnn.allow_tf32 = False

    def torch_eager(_):
        y = F.conv2d(tx, tw, stride=case.stride, padding=case.padding, groups=case.groups)
        y = F.batch_norm(y, tbn[2], tbn[3], tbn[0], tbn[1], training=False, eps=1e-5)
        return F.relu(y)

    paths["torch eager"] = torch_eager
    return paths


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    import cupy

    ceilings = harness.measure_ceilings()
    print(ceilings.describe())
    cases = _cases(quick)
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases, 1):
        harness.progress(i, len(cases), f"{case.name} N={case.N} {case.dtype} {case.layout}")
        x, w, bn = _inputs(case)
        rows += harness.time_paths(_paths(case, x, w, bn), {"case": case.name, "N": case.N,
                                                            "dtype": f"{case.dtype} {case.layout}"},
                                   flops=case.flops, ceilings=ceilings, baseline="cudnn", errors=(LibnnError,))
        cupy.get_default_memory_pool().free_all_blocks()
    print(harness.format_table(rows, ["case", "N", "dtype", "path", "ms", "per-call ms", "TFLOP/s", "%ceil", "cudnn/x",
                                      "note"]))
    print(_targets(rows))
    if json_path:
        harness.save_json(json_path, {"ceilings": ceilings, "rows": rows})
    return rows


def _targets(rows: list[dict[str, Any]]) -> str:
    def ms(path):
        return next((r.get("ms") for r in rows if r["case"] == "resnet 64@56 3x3" and r["N"] == 32
                     and r["dtype"] == "fp16 NHWC" and r["path"] == path), None)

    lines = ["targets (N=32 C=K=64 56x56 3x3 fp16 NHWC):"]
    fused = ms("cudnn")
    for path, target in (("cudnn unfused", 1.3), ("torch eager", 1.35)):
        if fused and ms(path):
            ratio = ms(path) / fused
            lines.append(f"  {path} / cudnn fused = {ratio:.2f}x  (target >= {target}: {'met' if ratio >= target else 'MISSED'})")
    if fused and ms("custom"):
        ratio = fused / ms("custom")
        lines.append(f"  custom speed / cudnn = {ratio:.2f}  (target >= 0.3: {'met' if ratio >= 0.3 else 'MISSED'})")
    return "\n".join(lines)
