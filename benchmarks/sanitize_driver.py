"""Every custom kernel once, on odd shapes, for compute-sanitizer (benchmarks/sanitize.sh runs it
under memcheck, racecheck and initcheck; alone it is a quick check that every item still runs).

Odd shapes: M = 1, primes, sizes that are not multiples of 8 and that cross a tile edge by one,
misaligned (offset) views, masks; tiny, because the sanitizer slows kernels 10-100x. Covered:
- every op's paths of kind "custom" (read from the registry, so a new custom path is called too), through
  the public functions, with problems picked to reach each kernel version the op dispatches to;
- the numbered versions ops expose for tests (linear's gemm.cu versions, layer_norm's, the FFT's, the
  attention kernels), and the conv epilogue kernel (kernels/epilogue.cu);
- SeedCNN and a one-layer BERT encoder forced onto the custom paths (kernels no op calls directly).
Arrays are allocated one cudaMalloc each (CuPy's pool off), so that an access past an array's end is
past an allocation's end, where memcheck sees it. Each item prints one line; an item that raises is reported and the exit status is 1 (the sanitizer's own
findings are its exit status under --error-exitcode). The last lines list the kernels loaded per file
of kernels/, and the files none was loaded from.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

ITEMS: list[tuple[str, Callable[[], Any]]] = []


def item(name: str):
    def register(fn):
        ITEMS.append((name, fn))
        return fn
    return register


def rng():
    return np.random.default_rng(3)


def dev(a):
    import cupy

    return None if a is None else cupy.asarray(a)


def normal(shape, dtype, scale=1.0, generator=None):
    from libnn import dtypes

    g = generator or rng()
    return dev((g.standard_normal(shape) * scale).astype(dtypes.parse(dtype)))


def offset_view(a):
    """`a`'s values one element past an aligned start (misaligned for vector loads)."""
    import cupy

    flat = cupy.zeros(a.size + 1, a.dtype)
    view = flat[1:].reshape(a.shape)
    view.view(f"u{a.dtype.itemsize}")[...] = a.view(f"u{a.dtype.itemsize}")
    return view


def custom_paths(op: str) -> list[str]:
    from libnn.registry import get_op

    return [p.name for p in get_op(op).ordered() if p.kind == "custom" and p.device == "gpu"]


def accepts(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


DTYPES = ("fp16", "bf16", "fp32")


# --- linear -------------------------------------------------------------------------------------------
@item("linear: every gemm.cu version, odd M, N, K")
def _linear_versions():
    from libnn.ops.linear import custom_versions, launch_custom_version, linear_problem

    for dtype in DTYPES:
        for M, N, K in ((1, 1, 1), (1, 7, 13), (13, 17, 29), (129, 131, 67)):
            x, w, b = normal((M, K), dtype), normal((N, K), dtype, 0.2), normal((N,), dtype)
            for version in custom_versions(linear_problem(x, w, b, "gelu", False)):
                launch_custom_version(version, x, w, b, "gelu")


@item("linear: custom paths, gelu_erf pass, residual, strided and offset x")
def _linear_paths():
    from libnn.ops import linear

    for path in custom_paths("linear"):
        if path == "gemv":  # one row only: its own item below
            continue
        for dtype in DTYPES:
            x, w, b = normal((3, 5, 19), dtype), normal((23, 19), dtype, 0.2), normal((23,), dtype)
            linear(x, w, b, "gelu_erf", path=path)
            linear(offset_view(x), w, None, "relu", path=path)
            linear(x[:, ::2], w, b, path=path)
            if accepts(linear, "residual"):
                linear(x, w, b, "gelu", residual=normal((3, 5, 23), dtype), path=path)


@item("linear and rms_norm_linear: kernels/gemv.cu, one row, N 1 and primes, K 8 to 2056, bias, residual, gelu_erf, "
      "the norm in front, SwiGLU behind, L2 prefetch hints (one and two arrays, one of an odd size and address); "
      "E4M3 weights on linear_fp8.cu version 3 with the same fusions and hints, 1 to 8 rows")
def _gemv():
    from libnn.ops import linear, rms_norm_linear
    from libnn.ops.linear_fp8 import bind_gemv3_kernel
    from libnn.ops.quantize_fp8 import quantize_weight

    hint = normal((1 << 20,), "fp16")
    hints = (hint, normal((1001,), "fp16")[1:].view(np.uint8)[1:])  # the second 3 bytes past 16
    for dtype in ("fp16", "bf16"):
        for N, K in ((1, 8), (7, 1000), (131, 2056)):
            x, w, b, g = normal((1, K), dtype), normal((N, K), dtype, 0.2), normal((N,), dtype), normal((K,), dtype)
            linear(x, w, b, "gelu_erf", residual=normal((1, N), dtype), path="gemv")
            linear(x, w, None, None, prefetch=hint, path="gemv")
            rms_norm_linear(x, g, w, b, prefetch=hints, path="gemv")
            rms_norm_linear(x, g, normal((2 * N, K), dtype, 0.2), glu="swiglu", path="gemv")
        for M, N, K in ((1, 1, 16), (3, 7, 1000), (8, 131, 2064)):   # E4M3 weights: linear_fp8.cu version 3
            x, g = normal((M, K), dtype), normal((K,), dtype)
            w = quantize_weight(normal((2 * N, K), "fp32", 0.2))
            glu = bind_gemv3_kernel(dtype, M, 2 * N, K, True, None, "gpu:0", True, 1e-6)
            glu(x, w.data, w.scale, normal((2 * N,), dtype), None, g, normal((M, N), dtype))
            per_tensor = quantize_weight(normal((N, K), "fp32", 0.2), per_channel=False)
            normed = bind_gemv3_kernel(dtype, M, N, K, False, None, "gpu:0", False, 1e-6, (hint.nbytes, 997))
            normed(x, per_tensor.data, per_tensor.scale, None, None, g, normal((M, N), dtype), *hints)


@item("linear: the cutlass path (CUTLASS sm90 GEMM with the exact GELU), with and without bias and residual")
def _linear_cutlass():
    from libnn.backends import cutlass
    from libnn.ops import linear

    if reason := cutlass.missing(0):
        print(f"  linear cutlass: not run: {reason}")
        return
    for dtype in ("fp16", "bf16"):
        for M, N, K in ((1, 8, 8), (37, 136, 72), (300, 264, 520)):
            x, w, b = normal((M, K), dtype), normal((N, K), dtype, 0.2), normal((N,), dtype)
            linear(x, w, b, "gelu_erf", residual=normal((M, N), dtype), path="cutlass")
            linear(x, w, None, "gelu_erf", path="cutlass")


# --- conv2d -------------------------------------------------------------------------------------------
@item("conv2d: custom paths (direct, depthwise, implicit GEMM fp16/bf16 and fp32), NHWC and NCHW")
def _conv2d():
    from libnn.ops import conv2d

    for path in custom_paths("conv2d"):
        for dtype in DTYPES:
            for layout in ("NHWC", "NCHW"):
                def shape(N, H, W, C):
                    return (N, H, W, C) if layout == "NHWC" else (N, C, H, W)

                def filters(K, R, S, Cg):
                    return (K, R, S, Cg) if layout == "NHWC" else (K, Cg, R, S)

                scale, shift = normal((13,), "fp32"), normal((13,), "fp32")
                # dense: the implicit GEMM of the dtype
                conv2d(normal(shape(2, 7, 9, 5), dtype), normal(filters(13, 3, 3, 5), dtype, 0.2),
                       normal((13,), dtype), padding=1, bn=(scale, shift), activation="relu", layout=layout,
                       path=path)
                conv2d(normal(shape(1, 11, 5, 3), dtype), normal(filters(13, 5, 2, 3), dtype, 0.2), stride=(2, 3),
                       dilation=(1, 2), padding=(2, 0), activation="silu", layout=layout, path=path)
                # depthwise
                conv2d(normal(shape(3, 6, 7, 13), dtype), normal(filters(13, 3, 3, 1), dtype), groups=13,
                       padding=1, activation="relu6", layout=layout, path=path)
                # grouped: the direct kernel
                conv2d(normal(shape(1, 5, 5, 6), dtype), normal(filters(9, 3, 1, 2), dtype), groups=3,
                       bn=(normal((9,), "fp32"), normal((9,), "fp32"), normal((9,), "fp32"),
                           dev(np.full(9, 0.7, np.float32)), 1e-5), activation="gelu", layout=layout, path=path)


@item("conv2d: the epilogue kernel (kernels/epilogue.cu) on odd sizes")
def _conv_epilogue():
    from libnn.ops.conv2d import apply_epilogue_kernel, conv2d_problem, output_shape

    for dtype in DTYPES:
        for layout in ("NHWC", "NCHW"):
            x = normal((1, 3, 5, 7) if layout == "NHWC" else (1, 7, 3, 5), dtype)
            w = normal((11, 1, 1, 7) if layout == "NHWC" else (11, 7, 1, 1), dtype)
            problem = conv2d_problem(x, w, normal((11,), dtype), (normal((11,), "fp32"), normal((11,), "fp32")),
                                     1, 0, 1, 1, "gelu", layout, False)
            y = normal(output_shape(problem), dtype)
            apply_epilogue_kernel(problem, y, normal((11,), "fp32"), normal((11,), "fp32"))


# --- attention ----------------------------------------------------------------------------------------
@item("attention: custom and unfused paths, flash and per-row kernels, masks, GQA, bias")
def _attention():
    import cupy

    from libnn.ops import attention

    paths = custom_paths("attention")
    cases = [  # (B, Hq, Hkv, Sq, Skv, D, dtype)
        (1, 1, 1, 1, 1, 8, "fp16"), (2, 4, 2, 13, 67, 64, "fp16"), (1, 3, 1, 65, 17, 40, "bf16"),
        (1, 2, 2, 7, 129, 128, "bf16"), (2, 2, 1, 5, 11, 20, "fp16"), (1, 2, 2, 9, 33, 96, "fp32"),
        (1, 1, 1, 3, 5, 256, "fp32"),
    ]
    for path in paths:
        for B, Hq, Hkv, Sq, Skv, D, dtype in cases:
            q, k, v = normal((B, Hq, Sq, D), dtype), normal((B, Hkv, Skv, D), dtype), normal((B, Hkv, Skv, D), dtype)
            attention(q, k, v, path=path)
            attention(q, k, v, causal="bottom_right", seq_lens_q=cupy.asarray(np.arange(B, dtype=np.int32) % Sq + 1),
                      seq_lens_kv=cupy.asarray(np.full(B, Skv - 1 if Skv > 1 else 1, np.int32)), path=path)
            attention(q, k, v, causal=True, attn_bias=normal((B, 1, 1, Skv), dtype), path=path)
            attention(offset_view(q), k, v, attn_bias=normal((1, Hq, Sq, Skv), dtype), path=path)
            # BSHD views of a packed projection: rows 3·Hq·D apart
            packed = normal((B, Sq, 3, Hq, D), dtype)
            attention(packed[:, :, 0], packed[:, :, 1], packed[:, :, 2], layout="BSHD", path=path)


@item("attention: both fused kernel versions where they apply")
def _attention_versions():
    from libnn.ops.attention import attention_problem, custom_versions
    from libnn.ops.attention_kernels import flash_attention

    for dtype, D in (("fp16", 64), ("bf16", 32), ("fp16", 24), ("fp32", 72)):
        q, k, v = normal((1, 2, 19, D), dtype), normal((1, 2, 71, D), dtype), normal((1, 2, 71, D), dtype)
        o = normal((1, 2, 19, D), dtype)
        problem = attention_problem(q, k, v, None, 0.3, "top_left", "BHSD", False, False)
        for version in custom_versions(problem):  # o, fresh from the pool, has aligned rows
            flash_attention(q, k, v, o, scale=0.3, causal="top_left", version=version)


# --- layer_norm ---------------------------------------------------------------------------------------
@item("layer_norm: custom paths over the warp, block and looping kernels, aligned and not, residual")
def _layer_norm():
    from libnn.ops import layer_norm

    for path in custom_paths("layer_norm"):
        for dtype in DTYPES:
            for M, N in ((1, 1), (3, 13), (5, 64), (2, 1000), (3, 1031), (2, 2048), (1, 4104), (2, 40000)):
                x, weight, bias = normal((M, N), dtype), normal((N,), dtype), normal((N,), dtype)
                layer_norm(x, weight, bias, path=path)
                layer_norm(offset_view(x), None, bias, path=path)
                if accepts(layer_norm, "residual"):
                    layer_norm(x, weight, None, residual=normal((M, N), dtype), path=path)


@item("rms_norm: custom paths over the warp, block and looping kernels, aligned and not, residual and sum")
def _rms_norm():
    from libnn.ops import rms_norm

    for path in custom_paths("rms_norm"):
        for dtype in DTYPES:
            for M, N in ((1, 1), (3, 13), (5, 64), (2, 1000), (3, 1031), (2, 2048), (1, 4104), (2, 40000)):
                x, weight = normal((M, N), dtype), normal((N,), dtype)
                rms_norm(x, weight, path=path)
                rms_norm(offset_view(x), None, path=path)
                rms_norm(x, weight, residual=normal((M, N), dtype), return_sum=True, path=path)


# --- rope ---------------------------------------------------------------------------------------------
@item("rope: custom paths, both styles, partial rotary, packed tokens, int32 and int64 positions, in place")
def _rope():
    from libnn.ops import rope, rope_frequencies

    g = rng()
    for path in custom_paths("rope"):
        for dtype in DTYPES:
            for shape, rotary in (((1, 7, 3, 64), None), ((2, 5, 1, 80), 32), ((11, 3, 128), None)):
                x = normal(shape, dtype)
                positions = dev(g.integers(0, 100000, shape[:-2]).astype(np.int64 if len(shape) == 4 else np.int32))
                inv_freq = dev(rope_frequencies(rotary or shape[-1]))
                for style in ("half", "interleaved"):
                    rope(x, positions, inv_freq, style=style, rotary_dim=rotary, path=path)
                rope(x, positions, inv_freq, rotary_dim=rotary, out=x, path=path)


# --- kv_append ----------------------------------------------------------------------------------------
@item("kv_append: custom paths, rotated and not, partial rotary, k and v (and q) as slices of one projection")
def _kv_append():
    from libnn.ops import kv_append, rope_frequencies

    g = rng()
    for path in custom_paths("kv_append"):
        for dtype in DTYPES:
            for B, S, H, D, L, rotary in ((1, 1, 1, 2, 1, None), (2, 5, 3, 64, 11, None), (3, 1, 2, 80, 7, 32)):
                qkv = normal((B, S, 3 * H, D), dtype)
                caches = normal((2, 2, B, L, H, D), dtype)  # two layers: the second's rows
                positions = dev((g.integers(0, L - S + 1, (B, 1)) + np.arange(S)).astype(np.int32))
                for inv_freq in (dev(rope_frequencies(rotary or D)), None):
                    kv_append(qkv[:, :, H:2 * H], qkv[:, :, 2 * H:], positions, inv_freq, caches[0, 1],
                              caches[1, 1], rotary_dim=rotary if inv_freq is not None else None, path=path)
                kv_append(qkv[:, :, H:2 * H], qkv[:, :, 2 * H:], positions, dev(rope_frequencies(rotary or D)),
                          caches[0, 1], caches[1, 1], q=qkv[:, :, :H], rotary_dim=rotary, path=path)


@item("attention: split-K decoding (attn3), one query row against cache rows, GQA up to 16, every head-dim "
      "bucket, warps without a tile, lengths 0, 1 and full; paged, pages out of order")
def _attention_decode():
    import cupy

    from libnn.ops import attention

    for dtype in ("fp16", "bf16"):
        for B, Hq, Hkv, D, L in ((1, 1, 1, 8, 1), (3, 8, 1, 64, 70), (2, 6, 2, 96, 33), (4, 4, 4, 32, 600),
                                (2, 16, 1, 128, 200)):
            q, k, v = normal((B, 1, Hq, D), dtype), normal((B, L, Hkv, D), dtype), normal((B, L, Hkv, D), dtype)
            lengths = cupy.asarray(np.array([L, 1, 0, L // 2][:B], np.int32))
            attention(q, k, v, layout="BSHD", seq_lens_kv=lengths, path="custom")
        # paged: pools of 7 pages of 64 keys, each sequence's 3 pages out of order, lengths 0, 1, 150
        q, k, v = normal((3, 1, 8, 64), dtype), normal((7, 64, 2, 64), dtype), normal((7, 64, 2, 64), dtype)
        table = cupy.asarray(np.array([[6, 0, 3], [2, 5, 1], [4, 6, 0]], np.int32))
        attention(q, k, v, layout="BSHD", seq_lens_kv=cupy.asarray(np.array([0, 1, 150], np.int32)),
                  page_table=table, path="custom")


# --- linear_fp8 ---------------------------------------------------------------------------------------
@item("linear_fp8: activation quantisation, the custom GEMM (M 13) and GEMV (M <= 8; N 4500: several 16-row "
      "tiles per block), odd shapes, per channel and per tensor")
def _linear_fp8():
    from libnn.ops.linear_fp8 import linear_fp8
    from libnn.ops.quantize_fp8 import quantize_weight

    for dtype in ("fp16", "bf16"):
        for M, N, K in ((1, 1, 1), (3, 17, 13), (5, 64, 48), (2, 33, 1000), (13, 19, 40), (1, 4500, 64),
                        (8, 4500, 24)):
            for per_channel in (True, False):
                w = quantize_weight(normal((N, K), "fp32"), per_channel=per_channel)
                x, b = normal((M, K), dtype), normal((N,), dtype)
                for path in custom_paths("linear_fp8"):
                    linear_fp8(x, w.data, w.scale, b, "gelu_erf", residual=normal((M, N), dtype), path=path)
                    linear_fp8(offset_view(x), w.data, w.scale, None, None, path=path)


# --- swiglu -------------------------------------------------------------------------------------------
@item("swiglu: custom paths, both kernel versions, F = 1 and 7, row slices in place, misaligned, strided")
def _swiglu():
    from libnn.ops import swiglu
    from libnn.ops.swiglu import launch_custom

    for path in custom_paths("swiglu"):
        for dtype in DTYPES:
            for shape in ((1, 2), (3, 14), (5, 128), (2, 3, 2000), (1, 2 * 11008)):
                x = normal(shape, dtype)
                swiglu(x, path=path)
                swiglu(offset_view(x), path=path)
            wide = normal((7, 3 * 64), dtype)
            swiglu(wide[:, :128], path=path)       # rows 192 wide: the vector version in place
            swiglu(wide[:, ::3][:, :40], path=path)  # strided: copied first
    for dtype in DTYPES:
        x = normal((37, 2 * 1000), dtype)
        for version in ("swiglu1_scalar", "swiglu2_vec"):
            launch_custom(x, version, ((1, 1), (32, 1)))


# --- argmax -------------------------------------------------------------------------------------------
@item("argmax: odd lengths, misaligned rows, row slices, NaN and ties, rows past the grid")
def _argmax():
    from libnn import dtypes
    from libnn.ops import argmax

    for path in custom_paths("argmax"):
        for dtype in DTYPES:
            for shape in ((1,), (3, 7), (5, 131), (1, 32000), (8, 50257), (2, 3, 1000)):
                x = normal(shape, dtype)
                argmax(x, path=path)
                argmax(offset_view(x), path=path)
            wide = normal((6, 1030), dtype)
            argmax(wide[:, 1:1001], path=path)   # rows one stride apart, each misaligned: read in place
            argmax(wide.T[:40], path=path)       # strided: copied first
            nans = rng().standard_normal((4, 999))
            nans[:, ::7] = np.nan
            argmax(dev(nans.astype(dtypes.parse(dtype))), path=path)
        argmax(normal((70000, 33), "fp16"), path=path)   # more rows than the grid's blocks


# --- softmax ------------------------------------------------------------------------------------------
@item("softmax: custom paths, rows and columns, log, odd lengths")
def _softmax():
    from libnn.ops import softmax

    for path in custom_paths("softmax"):
        for dtype in (*DTYPES, "fp64"):
            for shape, dim in (((1,), 0), ((7, 13), -1), ((3, 1000), -1), ((5, 17, 3), 1), ((2, 4097), 1),
                               ((3, 5, 9), 0), ((2, 70000), -1)):
                for log in (False, True):
                    try:
                        softmax(normal(shape, dtype, 4.0), dim, log=log, path=path)
                    except Exception as exc:  # a dtype the path does not take is fine; nothing else
                        from libnn.errors import PathUnavailableError
                        if not isinstance(exc, PathUnavailableError):
                            raise


# --- pooling ------------------------------------------------------------------------------------------
@item("pool2d: max (16-byte NHWC and general) and avg, padding, odd channels")
def _pool2d():
    from libnn.ops import avg_pool2d, max_pool2d

    for path in custom_paths("pool2d"):
        for dtype in DTYPES:
            for layout in ("NHWC", "NCHW"):
                for N, H, W, C in ((1, 1, 1, 1), (2, 7, 9, 13), (1, 6, 5, 16)):
                    shape = (N, H, W, C) if layout == "NHWC" else (N, C, H, W)
                    x = normal(shape, dtype)
                    k = min(H, W, 3)
                    max_pool2d(x, k, 1, k // 2, layout=layout, path=path)
                    max_pool2d(offset_view(x), (k, 1), (2, 1), layout=layout, path=path)
                    avg_pool2d(x, k, None, k // 2, count_include_pad=False, layout=layout, path=path)


# --- FFT ----------------------------------------------------------------------------------------------
@item("fft: every fft_conv.cu version on small power-of-two lengths; fft_conv custom path")
def _fft():
    import cupy

    from libnn.ops import fft_conv1d, fft_conv2d
    from libnn.ops.fft_conv_kernels import VERSIONS, fft_c2c

    # one block up to 2**12; four-step beyond, with strided column launches up to 8 rows, a transpose above
    for version in VERSIONS:
        for rows, log2n in ((3, 1), (3, 2), (1, 5), (3, 10), (2, 12), (3, 13), (9, 13), (1, 14)):
            x = (normal((rows, 1 << log2n), "fp32") + 1j * normal((rows, 1 << log2n), "fp32")).astype(cupy.complex64)
            fft_c2c(x, version=version)
            fft_c2c(x, inverse=True, version=version)
    for path in custom_paths("fft_conv"):
        for dtype in DTYPES:
            fft_conv2d(normal((1, 3, 7, 9), dtype), normal((5, 3, 3, 4), dtype), normal((5,), dtype), mode="same",
                       path=path)
            fft_conv1d(normal((2, 2, 29), dtype), normal((3, 2, 5), dtype), causal=True, path=path)


# --- embedding ----------------------------------------------------------------------------------------
@item("embedding: custom paths, warp and block rows, positions, types, norm, misaligned table")
def _embedding():
    import libnn.ops

    embedding = getattr(libnn.ops, "embedding", None)
    if embedding is None:
        return
    g = rng()
    for path in custom_paths("embedding"):
        for dtype in DTYPES:
            for shape, H in (((1,), 1), ((3, 7), 13), ((2, 5), 64), ((1, 9), 1031), ((2, 3), 2048)):
                ids = dev(g.integers(0, 11, shape))
                weight, positions, types = normal((11, H), dtype), normal((12, H), dtype), normal((2, H), dtype)
                embedding(ids, weight, path=path)
                embedding(ids.astype("int32"), offset_view(weight), position_weight=positions, position_offset=2,
                          type_ids=dev(g.integers(0, 2, shape)), type_weight=types, path=path)
                embedding(ids, weight, position_weight=positions, type_weight=types, normalize=True,
                          norm_weight=normal((H,), dtype), norm_bias=normal((H,), dtype), path=path)


# --- whole models on the custom paths -----------------------------------------------------------------
@item("models: SeedCNN (bs 3) and a one-layer BERT encoder (bs 2, seq 7, padded) on the custom paths, eager and "
      "graphed (the capture computes the mask with kernels/key_padding.cu)")
def _models():
    import cupy

    from libnn.models import BertConfig, BertEncoder, SeedCNN
    from libnn.registry import get_op, ops

    for dtype in ("fp16", "fp32"):
        SeedCNN.pretrained(dtype=dtype, device="gpu", path="custom")(normal((3, 1, 28, 28), dtype))
    custom = {name: "custom" for name in ops() if "custom" in get_op(name).paths}
    config = BertConfig.from_dict({"vocab_size": 101, "hidden_size": 24, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "intermediate_size": 40, "max_position_embeddings": 16})
    model = BertEncoder(config, dtype="fp16", device="gpu", path=custom)
    ids = cupy.asarray(rng().integers(0, 101, (2, 7)))
    mask = cupy.asarray([[1] * 7, [1] * 4 + [0] * 3])
    model(ids, mask)
    model.graphed()(ids, mask)


def loaded_kernels() -> dict[str, list[str]]:
    """The kernels loaded in this process, by file of kernels/ (read from the kernel cache)."""
    from libnn.runtime import kernels

    found: dict[str, set[str]] = {}
    for file, kernel in kernels.loaded_functions():
        found.setdefault(file, set()).add(kernel)
    return {f: sorted(names) for f, names in sorted(found.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run the items whose name starts with one of these")
    parser.add_argument("--list", action="store_true", help="list the items and exit")
    parser.add_argument("--pool", action="store_true",
                        help="keep CuPy's memory pool (default: one cudaMalloc per array, so that memcheck sees "
                             "an access past an array's end)")
    args = parser.parse_args(argv)
    if args.list:
        for name, _ in ITEMS:
            print(name)
        return 0
    from libnn.runtime.device import gpu_missing

    if reason := gpu_missing():
        print(f"sanitize_driver: needs a GPU: {reason}", file=sys.stderr)
        return 2
    import cupy

    if not args.pool:
        # CuPy's pool carves arrays out of large cudaMalloc blocks, so a read or write past an array's end
        # lands in its neighbour and memcheck, which knows allocations as cudaMalloc made them, sees
        # nothing: one cudaMalloc per array makes every array's end an allocation's end
        cupy.cuda.set_allocator(None)
    failed = 0
    for name, fn in ITEMS:
        if args.only is not None and not any(name.startswith(prefix) for prefix in args.only):
            continue
        start = time.perf_counter()
        try:
            fn()
            cupy.cuda.Device().synchronize()
            print(f"ok      {time.perf_counter() - start:7.2f} s  {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 (every item reports; the exit status says one failed)
            failed += 1
            print(f"FAILED  {time.perf_counter() - start:7.2f} s  {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=4)
    from libnn.runtime.kernels import kernel_files

    loaded = loaded_kernels()
    for file, names in loaded.items():
        print(f"kernels/{file}: {len(names)} kernels: {' '.join(names)}")
    unused = [p.name for p in kernel_files() if p.suffix == ".cu" and p.name not in loaded]
    print(f"kernels/ files no kernel was loaded from: {' '.join(unused) or 'none'}")
    print(f"sanitize_driver: {len(ITEMS) - failed if args.only is None else 'selected'} items ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
