"""`libnn bench fft_conv`: FFT convolution (cuFFT and our FFT) against direct convolution (cuDNN),
CuPy's fftconvolve and PyTorch, over image size × kernel size, single channel and multi-channel.

Two times per path: `_ms`, the GPU time (CUDA events, the host kept ahead), and `_call_ms`, the time per
call as a user's loop sees it (harness.time_per_call: back-to-back calls, nothing queued before them),
which is the host's cost of a call when the GPU work is small. "cupy/cufft" compares GPU times,
"cupy/cufft call" per-call times.

Prints the table, the crossover kernel size per image size (the smallest kernel from which the FFT
path is faster than direct cuDNN), and saves a heat map of the speed-up direct time / FFT time over
image × kernel size as a PNG (with matplotlib, when installed).

Goals: the cufft path ≥ 1.2× faster per call than CuPy's fftconvolve wherever both run; small calls
≤ 60 µs per call; `auto` never more than 10% slower than the better of direct and FFT.
"""

from __future__ import annotations

import math
from typing import Any

from libnn.bench import harness
from libnn.nn.conv import Conv2d
from libnn.ops.conv2d import conv2d
from libnn.ops.fft_conv import fft_conv2d
from libnn.registry import get_op

IMAGES = (64, 256, 1024, 2048)
KERNELS = (3, 7, 15, 31, 63, 127)
DIRECT_FLOP_LIMIT = 4e11  # direct convolutions above this take seconds: skipped, marked "-"


def _time(fn, runs=10) -> float | None:
    try:
        return harness.time_gpu(lambda _: fn(), [None], warmup=2, runs=runs).median_ms
    except Exception as exc:  # a path that cannot run this size: reported, not fatal
        print(f"    skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return None


def _time_call(fn, gpu_ms: float | None) -> float | None:
    """Per-call ms over enough calls for about 50 ms a repeat (20 to 1000); None where `fn` could not
    be timed on the GPU (its error is printed there)."""
    if gpu_ms is None:
        return None
    return harness.time_per_call(fn, calls=max(20, min(1000, round(50 / max(gpu_ms, 1e-3)))), repeats=3, warmup=2)


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    import cupy

    images, kernels = ((64, 256), (3, 15)) if quick else (IMAGES, KERNELS)
    rng = cupy.random.default_rng(11)
    rows: list[dict[str, Any]] = []
    total = len(images) * len(kernels)
    step = 0
    for channels in (1, 16):
        for size in images:
            x = rng.standard_normal((1, channels, size, size), dtype=cupy.float32)
            for k in kernels:
                step += 1
                if k >= size:
                    continue
                harness.progress(step, total * 2, f"C=K={channels} image {size}^2 kernel {k}^2")
                w = rng.standard_normal((channels, channels, k, k), dtype=cupy.float32) / math.sqrt(channels * k * k)
                flops = 2 * channels * channels * (size - k + 1) ** 2 * k * k
                row = {"C=K": channels, "image": size, "kernel": k,
                       "direct_ms": _time(lambda: conv2d(x, w, layout="NCHW", path="cudnn"), runs=5)
                       if flops <= DIRECT_FLOP_LIMIT else None}
                fft_paths = {"cufft": lambda: fft_conv2d(x, w, path="cufft"),
                             "custom": lambda: fft_conv2d(x, w, path="custom")}
                if channels == 1:
                    import cupyx.scipy.signal as signal
                    x2, w2 = x[0, 0], w[0, 0, ::-1, ::-1]
                    fft_paths["cupy"] = lambda: signal.fftconvolve(x2, w2, mode="valid")
                for name, fn in fft_paths.items():
                    row[f"{name}_ms"] = _time(fn)
                    row[f"{name}_call_ms"] = _time_call(fn, row[f"{name}_ms"])
                row["torch_ms"] = _torch_time(x, w) if flops <= DIRECT_FLOP_LIMIT else None
                layer = Conv2d(channels, channels, k, layout="NCHW", device="gpu", algo="auto", seed=0)
                layer.load_state_dict({"weight": w, "bias": cupy.zeros(channels, cupy.float32)})
                row["auto"] = "fft" if layer.uses_fft(x) else "direct"
                if row["direct_ms"] and row["cufft_ms"]:
                    row["direct/fft"] = row["direct_ms"] / row["cufft_ms"]
                    chosen = row["cufft_ms"] if row["auto"] == "fft" else row["direct_ms"]
                    row["auto/best"] = chosen / min(row["direct_ms"], row["cufft_ms"])
                for ratio, column in (("cupy/cufft", "ms"), ("cupy/cufft call", "call_ms")):
                    if row.get(f"cupy_{column}") and row.get(f"cufft_{column}"):
                        row[ratio] = row[f"cupy_{column}"] / row[f"cufft_{column}"]
                rows.append(row)
                # each case's bound calls hold cuFFT plans (and small workspaces): released before the next
                # case, so that the large cases are not refused for memory the earlier ones hold
                get_op("fft_conv").calls.clear()
                cupy.get_default_memory_pool().free_all_blocks()
    print(harness.format_table(rows, ["C=K", "image", "kernel", "direct_ms", "cufft_ms", "cufft_call_ms", "custom_ms",
                                      "custom_call_ms", "cupy_ms", "cupy_call_ms", "torch_ms", "direct/fft",
                                      "cupy/cufft", "cupy/cufft call", "auto", "auto/best"]))
    print(crossovers(rows))
    print(_goals(rows))
    if json_path:
        harness.save_json(json_path, {"rows": rows})
        _heatmap(rows, json_path.rsplit(".", 1)[0] + ".png")
    return rows


def _torch_time(x, w) -> float | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    torch.backends.cudnn.allow_tf32 = False
    return _time(lambda: F.conv2d(tx, tw), runs=5)


def _goals(rows: list[dict[str, Any]]) -> str:
    vs_cupy = [r["cupy/cufft call"] for r in rows if r.get("cupy/cufft call")]
    vs_cupy_gpu = [r["cupy/cufft"] for r in rows if r.get("cupy/cufft")]
    auto = [r["auto/best"] for r in rows if r.get("auto/best")]
    small = [r["cufft_call_ms"] for r in rows
             if r["C=K"] == 1 and r["image"] <= 256 and r["kernel"] <= 7 and r.get("cufft_call_ms")]
    lines = ["goals:"]
    if vs_cupy:
        lines.append(f"  cufft path vs CuPy fftconvolve per call: worst {min(vs_cupy):.2f}x, best {max(vs_cupy):.2f}x "
                     f"(goal >= 1.2x everywhere: {'met' if min(vs_cupy) >= 1.2 else 'MISSED'})")
    if vs_cupy_gpu:
        lines.append(f"  (GPU time alone: worst {min(vs_cupy_gpu):.2f}x, best {max(vs_cupy_gpu):.2f}x)")
    if small:
        lines.append(f"  small calls (one channel, image <= 256, kernel <= 7): up to {max(small) * 1e3:.0f} us per call "
                     f"(goal <= 60 us: {'met' if max(small) <= 0.06 else 'MISSED'})")
    if auto:
        lines.append(f"  auto vs the better of direct and FFT: worst {100 * (max(auto) - 1):.0f}% slower "
                     f"(goal <= 10%: {'met' if max(auto) <= 1.1 else 'MISSED'})")
    return "\n".join(lines)


def crossovers(rows: list[dict[str, Any]]) -> str:
    lines = ["crossover (smallest kernel where cufft beats direct cuDNN):"]
    for channels in sorted({r["C=K"] for r in rows}):
        for size in sorted({r["image"] for r in rows if r["C=K"] == channels}):
            faster = [r["kernel"] for r in rows if r["C=K"] == channels and r["image"] == size
                      and r.get("direct/fft") is not None and r["direct/fft"] > 1]
            lines.append(f"  C=K={channels:<3} image {size:>5}^2: " + (f"kernel >= {min(faster)}" if faster else "direct always faster (of those measured)"))
    return "\n".join(lines)


def _heatmap(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no heat map")
        return
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, channels in zip(axes, (1, 16)):
        sel = [r for r in rows if r["C=K"] == channels]
        images, kernels = sorted({r["image"] for r in sel}), sorted({r["kernel"] for r in sel})
        grid = np.full((len(images), len(kernels)), np.nan)
        for r in sel:
            if r.get("direct/fft"):
                grid[images.index(r["image"]), kernels.index(r["kernel"])] = math.log2(r["direct/fft"])
        im = ax.imshow(grid, cmap="RdBu", vmin=-6, vmax=6, origin="lower")
        ax.set_xticks(range(len(kernels)), kernels)
        ax.set_yticks(range(len(images)), images)
        ax.set_xlabel("kernel size")
        ax.set_ylabel("image size")
        ax.set_title(f"log2(direct cuDNN / cuFFT), C=K={channels}")
        for i in range(len(images)):
            for j in range(len(kernels)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{2 ** grid[i, j]:.2g}x", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes, label="log2 speed-up of FFT over direct (blue: FFT faster)")
    fig.savefig(path, dpi=110)
    print(f"heat map: {path}")
