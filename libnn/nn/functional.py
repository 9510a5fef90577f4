"""Stateless helpers that layers and models share (PyTorch's nn.functional in spirit): how a layer's
`path` names each op's path, moving a host mask to the layer's device, padding masks as the attention
op's lengths and bias (kernels/key_padding.cu), the mean over a mask's positions (kernels/masked_mean.cu),
token packing, a GEMM on a Linear's weight in whatever form a layer holds it (float, or FP8 codes
with scales), and packed self-attention. The transformer layers (nn/transformer.py) and the BERT model
(models/bert.py) both build on them."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from libnn import dtypes
from libnn.ops.attention import CheckedLengths, KeyPaddingBias, PackedSequences, attention
from libnn.ops.linear import linear
from libnn.ops.linear_fp8 import linear_fp8
from libnn.registry import get_op
from libnn.runtime import contracts, launch
from libnn.runtime.arrays import array_module, as_array, contiguous, describe, is_cupy, stream_key
from libnn.runtime.cache import PlanCache
from libnn.runtime.device import current_device_id
from libnn.runtime.stream import capturing

_KP = contracts.params("key_padding.cu", "KP_PARAMS")  # every key_padding kernel's parameters
_KP_THREADS = contracts.constant("key_padding.cu", "KP_THREADS")
_MM = contracts.params("masked_mean.cu", "MM_PARAMS")  # every masked_mean kernel's parameters
_MM_THREADS = contracts.constant("masked_mean.cu", "MM_THREADS")
_MM_COLS = contracts.constant("masked_mean.cu", "MM_COLS")
_launches: PlanCache = PlanCache("nn.functional launches")


def op_path(path: str | dict[str, str], op: str) -> str:
    """The path for `op` out of a layer's `path` (one name for every op, or a dict by op name)."""
    if isinstance(path, dict):
        return path.get(op, "auto")
    return path


def fp8_path(path: str) -> str:
    """A linear path name for linear_fp8: the same name where linear_fp8 has that path, else "auto" (it
    has no cudnn path), so a model built with one path for every op can be quantised."""
    return path if path in get_op("linear_fp8").paths else "auto"


def dense(x: Any, w: Any, b: Any = None, activation: str | None = None, *, w_scale: Any = None,
          residual: Any = None, prefetch: Any = None, path: str = "auto") -> Any:
    """act(x @ W.T + b + residual) for a Linear's weight in either form: W = w through libnn.ops.linear,
    or with `w_scale` W = w_scale · e4m3(w), `w` then E4M3 codes, through linear_fp8 (on fp8_path(path)).
    For layers that run a Linear's weight in another shape (stacked with others, its columns
    permuted), quantised or not, with one call. `prefetch`: the ops' L2 prefetch hint (what the next
    kernel reads first; runtime/l2_prefetch.py)."""
    if w_scale is None:
        return linear(x, w, b, activation, residual=residual, prefetch=prefetch, path=path)
    return linear_fp8(x, w, w_scale, b, activation, residual=residual, prefetch=prefetch, path=fp8_path(path))


def on_device_of(a: Any, like: Any, where: str, name: str) -> Any:
    """`a` as an array on `like`'s device (masks and ids may come from the host for a GPU layer)."""
    a = np.asarray(a) if isinstance(a, (list, tuple)) else as_array(a, where, name)
    if is_cupy(like) and not is_cupy(a):
        import cupy
        return cupy.asarray(a)
    if is_cupy(a) and not is_cupy(like):
        raise TypeError(f"{where}: {name} is on the GPU but the layer's input is a host array; pass both on one device")
    return a


class KeyPadding(NamedTuple):
    """A (B, S) padding mask in the forms the attention op and the layers around it take
    (key_padding_and_tokens)."""
    valid: Any          # (B, S) booleans, True at the tokens: the mask itself where it is boolean
    seq_lens_kv: Any    # CheckedLengths, or None where nothing is padded
    bias: Any           # KeyPaddingBias (B, 1, 1, S) of the holes, or None where there are none
    tokens: int | None  # how many tokens the mask holds; None while a CUDA graph is captured


def key_padding(valid: Any, dtype: Any) -> tuple[Any, Any]:
    """(seq_lens_kv, bias) for the attention op from `valid` (B, S) booleans, True where a key may be
    attended to: (None, None) when nothing is padded; (lengths, None) when each row is a prefix of
    Trues (right padding); otherwise (lengths, bias), the lengths up to each row's last True and the
    bias (B, 1, 1, S) of -inf at the Falses before it, 0 elsewhere, in `dtype`. The lengths let cuDNN
    skip the padding; the bias masks only the holes. Decided on the host for NumPy; for CuPy with one
    reduction (one synchronisation). While a CUDA graph is captured nothing can be read back, and a
    replay may bring any mask: always lengths and bias, computed on the device by one kernel
    (kernels/key_padding.cu)."""
    padding = key_padding_and_tokens(valid, dtype)
    return padding.seq_lens_kv, padding.bias


def key_padding_and_tokens(mask: Any, dtype: Any, *, nonempty: bool = False) -> KeyPadding:
    """key_padding's (seq_lens_kv, bias) for a (B, S) `mask` of booleans or integers (nonzero at a
    token, read in its own dtype), with the mask as booleans (`valid`) and the number of tokens, read
    back in the same synchronisation (None while a CUDA graph is captured, where one kernel writes
    valid, the lengths and the bias).

    `nonempty`: every length at least 1, and the lengths marked so (CheckedLengths(nonempty=True)), so
    that the attention op never looks for batch entries without a key to zero (one launch per layer
    saved). A row with no token then attends to its first position: the bias is -inf only at holes
    before a row's last token, so such a row's bias is 0 throughout (never a row of -inf, never NaN).
    The lengths are otherwise the true ones."""
    _check_mask("key_padding", mask)
    dtype = _bias_dtype(dtype)
    if not isinstance(nonempty, (bool, np.bool_)):  # "no" would clamp the lengths
        raise TypeError(f"key_padding: nonempty must be True or False, got {type(nonempty).__name__} {nonempty!r}")
    B, S = mask.shape
    if is_cupy(mask) and capturing() and B and S:  # counted from the mask: in range by construction
        return _captured_key_padding(contiguous(mask), dtype, bool(nonempty))
    valid = mask if mask.dtype == np.bool_ else mask != 0
    if B == 0 or S == 0:
        return KeyPadding(valid, None, None, 0)
    xp = array_module(valid)
    position = xp.arange(S, dtype=xp.int32)[None, :]
    lengths = xp.where(valid, position + 1, 0).max(axis=1).astype(xp.int32)  # up to the last True
    inside = position < lengths[:, None]

    def holes() -> KeyPaddingBias:  # -inf at the Falses before each row's last True: what the lengths cannot
        # mask; the True at each row's end stays finite, so the bias never empties a row (KeyPaddingBias)
        return KeyPaddingBias(xp.where(valid | ~inside, 0.0, -np.inf).astype(dtype)[:, None, None, :])

    is_prefix, shortest, tokens = (int(v) for v in xp.stack([xp.all(inside == valid).astype(xp.int32),
                                                              lengths.min(), xp.count_nonzero(valid)]).tolist())
    if nonempty and shortest == 0:  # a row without tokens gets its first position (`inside`, which holes()
        lengths = xp.maximum(lengths, 1)  # reads, keeps the true lengths)
    lens = CheckedLengths(lengths, nonempty=bool(nonempty))
    if is_prefix:
        return KeyPadding(valid, None if shortest == S else lens, None, tokens)
    return KeyPadding(valid, lens, holes(), tokens)


def _captured_key_padding(mask: Any, dtype: np.dtype, nonempty: bool) -> KeyPadding:
    """key_padding_and_tokens while a CUDA graph is captured: lengths and the holes bias whatever the
    mask (a replay may bring any), and valid unless the mask is boolean, written by one kernel that
    reads the mask in its own dtype (kernels/key_padding.cu)."""
    import cupy

    B, S = mask.shape
    valid = mask if mask.dtype == np.bool_ else cupy.empty((B, S), cupy.bool_)
    lengths, bias = cupy.empty(B, cupy.int32), cupy.empty((B, S), dtype)
    words = bias.dtype.itemsize
    minus_inf = int(np.array(-np.inf, bias.dtype).view(f"u{words}")[()])
    kernel = f"key_padding_mask{8 * mask.dtype.itemsize}_bias{8 * words}"
    rows_per_block = _KP_THREADS // 32
    _bound("key_padding.cu", kernel, (-(-B // rows_per_block),), (_KP_THREADS,), _KP, mask=launch.ARRAY,
           valid=launch.ARRAY, lengths=launch.ARRAY, bias=launch.ARRAY, B=B, S=S, min_length=int(nonempty),
           minus_inf=minus_inf)(mask, None if valid is mask else valid, lengths, bias)
    return KeyPadding(valid, CheckedLengths(lengths, nonempty=nonempty), KeyPaddingBias(bias[:, None, None, :]), None)


class TokenPacking:
    """The tokens of a padded batch, `valid` (B, S) True at each token, packed into `capacity` rows
    (at least the number of tokens): the rows every position-wise layer (GEMMs, LayerNorm, the
    activation) then computes are the tokens alone, not the padding. `pack` takes (B, S, F) or
    (B·S, F) rows to (capacity, F), the rows past the last token zeros; `unpack` gives them back as
    (B, S, F), zeros at the padding. Both are one gather kernel; the maps are built on the device
    (a scan and a scatter: no synchronisation, so a CUDA graph captures them). Tokens past
    `capacity` would be dropped: the caller sizes it from the count (key_padding_and_tokens).

    `ragged`: the attention runs on the packed rows too (layout THD, `sequences`: each row's tokens,
    holes left out, one sequence after another), so nothing is gathered out to the padded layout and
    back, and no mask is needed; otherwise q, k and v are unpacked for it and its output packed."""

    def __init__(self, valid: Any, capacity: int, ragged: bool = False):
        _check_mask("TokenPacking", valid)
        if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise TypeError(f"TokenPacking: capacity must be an int >= 0 (rows to pack the tokens into), got "
                            f"{type(capacity).__name__} {capacity!r}")
        if not is_cupy(valid) and (tokens := int(np.count_nonzero(valid))) > capacity:  # on the GPU: no sync
            raise ValueError(f"TokenPacking: capacity {capacity} is below the {tokens} tokens valid marks")
        xp = array_module(valid)
        self.shape, self.capacity, self.ragged = tuple(valid.shape), capacity, ragged
        flat = valid.reshape(-1)
        slot = xp.cumsum(flat, dtype=xp.int32) - 1  # each token's packed row
        self.packed_row = xp.where(flat, slot, -1).astype(xp.int32)  # per position; -1 at padding
        if is_cupy(valid):
            self.position = xp.full(capacity, -1, xp.int32)
            _scatter_positions_kernel()(flat, slot, capacity, self.position)
        else:
            self.position = np.full(capacity, -1, np.int32)  # per packed row; -1 past the last token
            tokens = np.flatnonzero(flat)
            self.position[slot[tokens]] = tokens
        if ragged:  # in the order of the slots: row b's tokens from the number before it
            counts = valid.sum(axis=1, dtype=xp.int32)
            offsets = xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(counts, dtype=xp.int32)])
            self.sequences = PackedSequences(counts, offsets, valid.shape[1], checked=True)

    def pack(self, x: Any) -> Any:
        return gather_rows(x.reshape(self.packed_row.shape[0], -1), self.position)

    def unpack(self, x: Any) -> Any:
        return gather_rows(x, self.packed_row).reshape(*self.shape, -1)


def masked_mean(x: Any, valid: Any) -> Any:
    """The mean over dim 1 of x (B, S, F) at the positions `valid` (B, S) marks, in x's dtype,
    accumulated in fp32 (fp64 for fp64): zeros for a row with none; positions `valid` drops are not
    read. One kernel on the GPU (kernels/masked_mean.cu: fp16, bf16, fp32, fp64; a block per batch
    entry and 64 columns, its threads down S; deterministic, the mean rounded once to nearest even),
    float64 on the host."""
    x = as_array(x, "masked_mean", "x")
    _check_mask("masked_mean", valid)
    if x.ndim != 3 or tuple(valid.shape) != tuple(x.shape[:2]):  # NumPy would broadcast a 2-D x
        raise ValueError(f"masked_mean: x must be (B, S, F) and valid (B, S) with x's first two dimensions, got x "
                         f"{tuple(x.shape)} and valid {tuple(valid.shape)}")
    if not dtypes.is_float(x.dtype):  # the mean would be rounded to the integer dtype
        raise TypeError(f"masked_mean: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    if is_cupy(valid) != is_cupy(x):
        raise TypeError(f"masked_mean: x and valid must be on one device, got x {describe(x)} and valid "
                        f"{describe(valid)}")
    xp = array_module(x)
    if not is_cupy(x):
        kept = valid.astype(bool)
        return (np.where(kept[:, :, None], x.astype(np.float64), 0.0).sum(axis=1)
                / np.maximum(kept.sum(axis=1, keepdims=True), 1)).astype(x.dtype)
    x, valid = contiguous(x), contiguous(valid.astype(bool, copy=False))
    B, S, F = x.shape
    if x.size == 0:  # nothing to average (S = 0) or nothing to write
        return xp.zeros((B, F), x.dtype)
    if -(-F // _MM_COLS) > launch.MAX_GRID_YZ:
        raise ValueError(f"masked_mean: x has F={F} features per position, more than kernels/masked_mean.cu "
                         f"takes ({launch.MAX_GRID_YZ * _MM_COLS}: {_MM_COLS} per block, at most "
                         f"{launch.MAX_GRID_YZ} blocks along the grid's y)")
    out = xp.empty((B, F), x.dtype)
    suffix = dtypes.KERNEL_SUFFIX_WITH_F64[dtypes.short_name(x.dtype)]
    vec = F % (16 // x.dtype.itemsize) == 0 and x.data.ptr % 16 == 0
    kernel = f"masked_mean2_vec_{suffix}" if vec else f"masked_mean1_scalar_{suffix}"
    _bound("masked_mean.cu", kernel, (B, -(-F // _MM_COLS)), (_MM_THREADS,), _MM, x=launch.ARRAY,
           valid=launch.ARRAY, out=launch.ARRAY, S=S, F=F)(x, valid, out)
    return out


def _bound(file: str, kernel: str, grid: tuple[int, ...], block: tuple[int, ...], declared: contracts.Params,
           **args: Any) -> launch.Launch:
    """kernels/<file>'s `kernel` with `args` packed by name (launch.ARRAY for each array), bound once per
    kernel, grid, scalars, stream and device: a later call with the same ones is one lookup."""
    key = (kernel, grid, *args.values(), stream_key(), current_device_id())
    return _launches.get(key, lambda: launch.bind(file, kernel, grid, block, declared.pack(**args)))


def _check_mask(where: str, valid: Any) -> None:
    """`valid` is a (B, S) array of booleans (or 0/1 integers), True at the tokens: an additive float
    mask (0 at the tokens, -inf at the padding) would read as its opposite."""
    if not (hasattr(valid, "ndim") and hasattr(valid, "dtype")):
        raise TypeError(f"{where}: valid must be a (B, S) array of booleans, True at the tokens, got "
                        f"{type(valid).__name__}")
    if valid.ndim != 2:
        raise ValueError(f"{where}: valid must be a (B, S) array of booleans, got shape {tuple(valid.shape)}")
    if valid.dtype.kind not in "biu":
        raise TypeError(f"{where}: valid must hold booleans (or 0/1 integers), True at the tokens, got dtype "
                        f"{valid.dtype}")


def _check_gather(where: str, x: Any, rows: Any) -> None:
    for name, a, ndim in (("x", x, 2), ("rows", rows, 1)):
        if not (hasattr(a, "ndim") and hasattr(a, "dtype")):
            raise TypeError(f"{where}: {name} must be a {ndim}-D array, got {type(a).__name__}")
        if a.ndim != ndim:
            raise ValueError(f"{where}: {name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if rows.dtype != np.int32:
        raise TypeError(f"{where}: rows must be int32 row indices, got dtype {rows.dtype}")
    if is_cupy(x) != is_cupy(rows):
        raise TypeError(f"{where}: x and rows must be on one device, got x {describe(x)} and rows {describe(rows)}")


def _bias_dtype(dtype: Any) -> np.dtype:
    """The bias's dtype (the attention's q dtype), parsed: a floating-point one, -inf has no integer value."""
    try:
        parsed = None if dtype is None else dtypes.parse(dtype)  # NumPy reads None as float64
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or not dtypes.is_float(parsed):
        raise TypeError(f"key_padding: dtype must be a floating-point dtype (the attention's q dtype), got {dtype!r}")
    return parsed


def gather_rows(x: Any, rows: Any) -> Any:
    """out[i] = x[rows[i]] for the rows of a 2-D `x`, zeros where rows[i] is -1. `rows` is an int32
    vector on x's device; on the host each index is checked, on the GPU (TokenPacking's maps, built on
    the device) none is: reading them back would cost a synchronisation per call."""
    _check_gather("gather_rows", x, rows)
    xp = array_module(x)
    if not is_cupy(x):
        if rows.size and not (-1 <= int(rows.min()) and int(rows.max()) < x.shape[0]):
            raise IndexError(f"gather_rows: rows must be -1 (a zero row) or in 0..{x.shape[0] - 1}, got "
                             f"{int(rows.min())}..{int(rows.max())}")
        out = np.zeros((rows.shape[0], x.shape[1]), x.dtype)
        kept = rows >= 0
        out[kept] = x[rows[kept]]
        return out
    x = contiguous(x)
    row_bytes = x.shape[1] * x.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)  # whole rows as the widest words: any dtype,
    words = x.view(f"u{word}")                                   # bf16 included, moved as raw bits
    out = xp.empty((rows.shape[0], words.shape[1]), words.dtype)
    _gather_rows_kernel()(words, rows, words.shape[1], out)
    return out.view(x.dtype)


def packed_self_attention(x: Any, w_qkv: Any, b_qkv: Any, num_heads: int, *, seq_lens_kv: Any = None,
                          bias: Any = None, causal: bool = False, path: str | dict[str, str] = "auto",
                          packing: TokenPacking | None = None, w_scale: Any = None) -> Any:
    """Attention of x (B, S, E) to itself before the output projection: ONE GEMM with the packed
    (3E, E) weight, then the attention op on q, k, v as strided BSHD views of its output. Returns
    (B, S, E). With `packing`, x is the packed tokens (capacity, E): the GEMM runs on them, and the
    attention on the packed sequences (layout THD: `packing.ragged`), or on its output unpacked to
    (B, S, 3E) (zeros at the padding, which the lengths and bias mask) with the result packed again;
    either way (capacity, E). With `w_scale`, float32 (3E,) or (1,), w_qkv is E4M3 codes (uint8, what
    nn.linear.stack_linear stacks for quantised layers) and the GEMM runs linear_fp8 (dense)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"packed_self_attention: num_heads must be a positive int, got {num_heads!r}")
    if getattr(x, "ndim", None) != (3 if packing is None else 2):
        expected = "(B, S, E)" if packing is None else "(capacity, E), the packed tokens"
        raise ValueError(f"packed_self_attention: x must be {expected}, got shape {getattr(x, 'shape', type(x))}")
    if getattr(w_qkv, "ndim", None) != 2 or w_qkv.shape[0] % (3 * num_heads):
        raise ValueError(f"packed_self_attention: w_qkv must be (3E, E), 3 projections of num_heads={num_heads} "
                         f"heads each, got shape {getattr(w_qkv, 'shape', type(w_qkv))}")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"packed_self_attention: x must be a floating-point array (fp16, bf16, fp32, fp64), got "
                        f"{x.dtype}")
    _check_qkv_dtypes(x, w_qkv, w_scale)
    for name, a in (("w_qkv", w_qkv), ("w_scale", w_scale)):
        if a is not None and is_cupy(x) != is_cupy(a):
            raise TypeError(f"packed_self_attention: x and {name} must be on one device, got x {describe(x)} and "
                            f"{name} {describe(a)}")
    if not isinstance(path, (str, dict)):
        raise TypeError(f"packed_self_attention: path must be a string or a dict of op name to path, got "
                        f"{type(path).__name__} {path!r}")
    qkv = dense(x, w_qkv, b_qkv, w_scale=w_scale, path=op_path(path, "linear"))
    if packing is not None and packing.ragged:
        T, E = qkv.shape[0], qkv.shape[-1] // 3
        qkv = qkv.reshape(T, 3, num_heads, E // num_heads)
        return attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], causal=causal, layout="THD", packed=packing.sequences,
                         path=op_path(path, "attention")).reshape(T, E)
    if packing is not None:
        qkv = packing.unpack(qkv)
    B, S, E = qkv.shape[0], qkv.shape[1], qkv.shape[-1] // 3
    qkv = qkv.reshape(B, S, 3, num_heads, E // num_heads)
    o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, seq_lens_kv=seq_lens_kv,
                  attn_bias=bias, layout="BSHD", path=op_path(path, "attention"))
    return o.reshape(B, S, E) if packing is None else packing.pack(o)


def _check_qkv_dtypes(x: Any, w_qkv: Any, w_scale: Any) -> None:
    """w_qkv in x's dtype, or with w_scale E4M3 codes (uint8) and float32 scales, one per row or one."""
    if w_scale is None:
        if w_qkv.dtype == np.uint8:
            raise TypeError("packed_self_attention: w_qkv holds uint8 codes (a quantised weight) but w_scale is None; "
                            "pass the codes' float32 scales as w_scale")
        if w_qkv.dtype != x.dtype:
            raise TypeError(f"packed_self_attention: w_qkv has dtype {dtypes.short_name(w_qkv.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; cast them to one dtype")
        return
    if w_qkv.dtype != np.uint8:
        raise TypeError(f"packed_self_attention: with w_scale, w_qkv must hold E4M3 codes (uint8), got dtype "
                        f"{dtypes.short_name(w_qkv.dtype)}")
    rows = w_qkv.shape[0]
    if getattr(w_scale, "dtype", None) != np.float32 or tuple(getattr(w_scale, "shape", ())) not in ((1,), (rows,)):
        raise TypeError(f"packed_self_attention: w_scale must be float32 of shape ({rows},) (one scale per row of "
                        f"w_qkv) or (1,), got {_dtype_and_shape(w_scale)}")


def _dtype_and_shape(a: Any) -> str:
    if not (hasattr(a, "dtype") and hasattr(a, "shape")):
        return type(a).__name__
    return f"dtype {dtypes.short_name(a.dtype)} and shape {tuple(a.shape)}"


@functools.cache
def _gather_rows_kernel():
    """out[i] = x[rows[i / width]] word by word, 0 where the row is -1 (one thread per word)."""
    import cupy

    return cupy.ElementwiseKernel("raw T x, raw int32 rows, int64 width", "T out",
                                  "const int r = rows[i / width]; out = r < 0 ? T(0) : x[r * width + i % width];",
                                  "libnn_gather_rows")


@functools.cache
def _scatter_positions_kernel():
    """position[slot] = i for each token i (valid) whose slot fits the capacity."""
    import cupy

    return cupy.ElementwiseKernel("bool valid, int32 slot, int32 capacity", "raw int32 position",
                                  "if (valid && slot < capacity) position[slot] = i;", "libnn_scatter_positions")
