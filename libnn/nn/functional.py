"""Stateless helpers that layers and models share (PyTorch's nn.functional in spirit): how a layer's
`path` names each op's path, moving a host mask to the layer's device, padding masks as the attention
op's lengths and bias, and packed self-attention. The transformer layers (nn/transformer.py) and the
BERT model (models/bert.py) both build on them."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from libnn.ops.attention import CheckedLengths, KeyPaddingBias, attention
from libnn.ops.linear import linear
from libnn.runtime.arrays import array_module, as_array, contiguous, is_cupy
from libnn.runtime.stream import capturing


def op_path(path: str | dict[str, str], op: str) -> str:
    """The path for `op` out of a layer's `path` (one name for every op, or a dict by op name)."""
    if isinstance(path, dict):
        return path.get(op, "auto")
    return path


def on_device_of(a: Any, like: Any, where: str, name: str) -> Any:
    """`a` as an array on `like`'s device (masks and ids may come from the host for a GPU layer)."""
    a = np.asarray(a) if isinstance(a, (list, tuple)) else as_array(a, where, name)
    if is_cupy(like) and not is_cupy(a):
        import cupy
        return cupy.asarray(a)
    if is_cupy(a) and not is_cupy(like):
        raise TypeError(f"{where}: {name} is on the GPU but the layer's input is a host array; pass both on one device")
    return a


def key_padding(valid: Any, dtype: Any) -> tuple[Any, Any]:
    """(seq_lens_kv, bias) for the attention op from `valid` (B, S) booleans, True where a key may be
    attended to: (None, None) when nothing is padded; (lengths, None) when each row is a prefix of
    Trues (right padding); otherwise (lengths, bias), the lengths up to each row's last True and the
    bias (B, 1, 1, S) of -inf at the Falses before it, 0 elsewhere, in `dtype`. The lengths let cuDNN
    skip the padding; the bias masks only the holes. Decided on the host for NumPy; for CuPy with one
    reduction (one synchronisation). While a CUDA graph is captured nothing can be read back, and a
    replay may bring any mask: always lengths and bias, computed on the device by two kernels."""
    xp = array_module(valid)
    B, S = valid.shape
    if B == 0 or S == 0:
        return None, None
    if is_cupy(valid) and capturing():  # counted from the mask: in range by construction
        valid = contiguous(valid.astype(bool, copy=False))
        lengths = _lengths_kernel()(valid, S, size=B)
        return CheckedLengths(lengths), KeyPaddingBias(_holes(valid, lengths, dtype)[:, None, None, :])
    position = xp.arange(S, dtype=xp.int32)[None, :]
    lengths = xp.where(valid, position + 1, 0).max(axis=1).astype(xp.int32)  # up to the last True
    inside = position < lengths[:, None]

    def holes() -> KeyPaddingBias:  # -inf at the Falses before each row's last True: what the lengths cannot
        # mask; the True at each row's end stays finite, so the bias never empties a row (KeyPaddingBias)
        return KeyPaddingBias(xp.where(valid | ~inside, 0.0, -np.inf).astype(dtype)[:, None, None, :])

    is_prefix, shortest = (int(v) for v in xp.stack([xp.all(inside == valid).astype(xp.int32),
                                                      lengths.min()]).tolist())
    if is_prefix:
        return (None if shortest == S else CheckedLengths(lengths)), None
    return CheckedLengths(lengths), holes()


def packed_self_attention(x: Any, w_qkv: Any, b_qkv: Any, num_heads: int, *, seq_lens_kv: Any = None,
                          bias: Any = None, causal: bool = False, path: str | dict[str, str] = "auto") -> Any:
    """Attention of x (B, S, E) to itself before the output projection: ONE GEMM with the packed
    (3E, E) weight, then the attention op on q, k, v as strided BSHD views of its output. Returns
    (B, S, E)."""
    B, S, E = x.shape
    qkv = linear(x, w_qkv, b_qkv, path=op_path(path, "linear")).reshape(B, S, 3, num_heads, E // num_heads)
    o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, seq_lens_kv=seq_lens_kv,
                  attn_bias=bias, layout="BSHD", path=op_path(path, "attention"))
    return o.reshape(B, S, E)


@functools.cache
def _lengths_kernel():
    """lengths[b] = 1 + the position of row b's last True (0 for none), one thread per row."""
    import cupy

    return cupy.ElementwiseKernel("raw bool valid, int32 S", "int32 length",
                                  "int n = 0; for (int j = 0; j < S; j++) if (valid[i * S + j]) n = j + 1; "
                                  "length = n;", "libnn_key_lengths")


@functools.cache
def _holes_kernel():
    """bias = -inf (as the dtype's bits) at the Falses before each row's length, 0 elsewhere."""
    import cupy

    return cupy.ElementwiseKernel("raw bool valid, raw int32 lengths, int32 S, T minus_inf", "T bias",
                                  "bias = (valid[i] || i % S >= lengths[i / S]) ? T(0) : minus_inf;",
                                  "libnn_key_holes")


def _holes(valid: Any, lengths: Any, dtype: Any) -> Any:
    """The (B, S) holes bias in `dtype`, written as raw words of its size (bf16 included)."""
    import cupy

    bias = cupy.empty(valid.shape, dtype)
    words = f"u{bias.dtype.itemsize}"
    _holes_kernel()(valid, lengths, valid.shape[1], np.array(-np.inf, bias.dtype).view(words)[()], bias.view(words))
    return bias
