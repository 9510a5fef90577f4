"""Transformer layers with PyTorch's parameter names: MultiheadAttention and TransformerEncoderLayer
(batch_first=True only), for inference.

Self-attention projects q, k and v with ONE GEMM on the packed (3E, E) `in_proj_weight`, and the
attention op reads q, k and v as strided (B, S, H, D) views of that GEMM's output (layout "BSHD"), so
nothing is copied between the projection and the attention. Cross-attention slices `in_proj_weight`
by rows (views, no copies): one GEMM for q and one for k and v together when key is value.

Masks follow PyTorch: `key_padding_mask` (B, Skv) is True at padding (or a float mask that is added);
`attn_mask` (Sq, Skv) or (B·num_heads, Sq, Skv) is True where attention is not allowed (or a float
mask that is added). A boolean padding mask whose rows are each a run of keys followed by padding
(right padding, what tokenizers produce) becomes the attention op's `seq_lens_kv`, its fastest mask;
any other becomes an additive -inf bias. A query row that may attend to no key gives zeros (PyTorch
gives NaN there).

`path` is a path name given to every op the layer calls ("auto", "reference", "custom"), or a dict
naming one per op, e.g. {"linear": "cublaslt", "attention": "cudnn"} (ops not named run "auto").

`quantize("fp8")` (Module.quantize) turns the nn.Linear children into FP8 layers: out_proj, linear1 and
linear2 run linear_fp8. `in_proj_weight` and `in_proj_bias` are MultiheadAttention's own parameters,
under PyTorch's names, not an nn.Linear's: they keep their dtype, and the q, k, v projection keeps
running on linear.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from libnn.nn import checks
from libnn.nn.functional import key_padding, on_device_of, op_path, packed_self_attention
from libnn.nn.linear import Linear
from libnn.nn.module import Module, full, init_uniform
from libnn.nn.norm import LayerNorm
from libnn.ops.attention import KeyPaddingBias, attention
from libnn.ops.linear import linear
from libnn.runtime.arrays import array_module

# PyTorch's TransformerEncoderLayer activation names → libnn's: PyTorch's "gelu" is the exact erf GELU.
ENCODER_ACTIVATIONS = {"relu": "relu", "gelu": "gelu_erf"}


def _additive(mask: Any, dtype: Any, where: str, name: str) -> Any:
    """A boolean mask (True = masked) as 0/-inf, or a float mask as it is, in `dtype`."""
    xp = array_module(mask)
    if mask.dtype == np.bool_:
        return xp.where(mask, -np.inf, 0.0).astype(dtype)
    if mask.dtype.kind == "f" or str(mask.dtype) == "bfloat16":
        return mask.astype(dtype, copy=False)
    raise TypeError(f"{where}: {name} must be boolean (True = masked) or floating point (added to the "
                    f"scores), got dtype {mask.dtype}")


def _heads(layer: str, width: tuple[str, Any], heads: tuple[str, Any], batch_first: Any) -> tuple[int, int]:
    """The model width and the number of heads, checked: positive ints, the width a multiple of the
    heads; and batch_first, which must be True."""
    (width_name, E), (heads_name, H) = width, heads
    E, H = checks.size(layer, width_name, E), checks.size(layer, heads_name, H)
    if E % H:
        raise ValueError(f"{layer}: {width_name} ({E}) must be divisible by {heads_name} ({H})")
    if not checks.flag(layer, "batch_first", batch_first):
        raise ValueError(f"{layer}: only batch_first=True is supported (inputs (batch, seq, {width_name})); "
                         f"transpose (seq, batch, {width_name}) inputs with x.transpose(1, 0, 2)")
    return E, H


class MultiheadAttention(Module):
    """PyTorch's nn.MultiheadAttention for inference, batch_first=True: parameters `in_proj_weight`
    (3E, E), `in_proj_bias` (3E,), `out_proj.weight`, `out_proj.bias`. `dropout` is accepted for
    PyTorch's signature and ignored (inference)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, *,
                 batch_first: bool = True, dtype: Any = "fp32", device: str = "cpu",
                 path: str | dict[str, str] = "auto", seed: int | None = None):
        super().__init__()
        where = "MultiheadAttention"
        embed_dim, num_heads = _heads(where, ("embed_dim", embed_dim), ("num_heads", num_heads), batch_first)
        dropout, bias = checks.probability(where, "dropout", dropout), checks.flag(where, "bias", bias)
        parsed, seed = checks.float_dtype(where, dtype), checks.seed(where, seed)
        checks.path(where, path, ("linear", "attention"), per_op=True)
        checks.parameters_fit(where, f"embed_dim={embed_dim}", 4 * embed_dim * (embed_dim + bias), parsed,
                              checks.device(where, device))
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.batch_first, self.path = dropout, batch_first, path
        # PyTorch's init: Xavier-uniform packed projection, zero biases.
        bound = math.sqrt(6 / (4 * embed_dim))
        self.register_parameter("in_proj_weight", init_uniform((3 * embed_dim, embed_dim), bound, dtype, device, seed))
        self.register_parameter("in_proj_bias", full((3 * embed_dim,), 0.0, dtype, device) if bias else None)
        self.out_proj = Linear(embed_dim, embed_dim, bias, dtype=dtype, device=device, path=op_path(path, "linear"),
                               seed=None if seed is None else seed + 2)
        if bias:
            self.out_proj.register_parameter("bias", full((embed_dim,), 0.0, dtype, device))

    def forward(self, query: Any, key: Any = None, value: Any = None, key_padding_mask: Any = None,
                need_weights: bool = False, attn_mask: Any = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Any, None]:
        """Self-attention when key and value are None or are `query` itself; cross-attention otherwise.
        `is_causal=True` applies the top-left causal mask (with or without `attn_mask`). Returns
        (output (B, Sq, E), None): the attention weights are never formed."""
        if need_weights:
            raise ValueError("MultiheadAttention: need_weights=True is not supported: the fused attention never "
                             "forms the attention weights; pass need_weights=False")
        where, like = "MultiheadAttention", self.in_proj_weight
        query = checks.float_input(where, query, like, "query")
        is_causal = checks.flag(where, "is_causal", is_causal)
        self_attention = (key is None and value is None) or (key is query and value is query)
        if not self_attention and (key is None or value is None):
            raise ValueError("MultiheadAttention: pass both key and value (cross-attention) or neither "
                             "(self-attention)")
        self._check_input(query, "query")
        B, Sq = query.shape[:2]
        if not self_attention:
            key, value = checks.float_input(where, key, like, "key"), checks.float_input(where, value, like, "value")
            self._check_input(key, "key")
            self._check_input(value, "value")
            if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
                raise ValueError(f"MultiheadAttention: key and value must be (batch, seq_len_kv, embed_dim) with "
                                 f"query's batch {B} and one seq_len_kv, got key {tuple(key.shape)} and value "
                                 f"{tuple(value.shape)}")
        Skv = Sq if self_attention else key.shape[1]
        lens, bias = self._masks(query, key_padding_mask, attn_mask, B, Sq, Skv)
        if self_attention:
            o = packed_self_attention(query, self.in_proj_weight, self.in_proj_bias, self.num_heads,
                                      seq_lens_kv=lens, bias=bias, causal=is_causal, path=self.path)
        else:
            o = self._cross_attention(query, key, value, lens, bias, is_causal)
        return self.out_proj(o), None

    def _check_input(self, a: Any, name: str) -> None:
        if a.ndim != 3:
            raise ValueError(f"MultiheadAttention: {name} must be 3-D (batch, seq_len, embed_dim) (batch_first=True), "
                             f"got shape {tuple(a.shape)}")
        if a.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiheadAttention: {name} has {a.shape[-1]} features in its last dimension but "
                             f"embed_dim is {self.embed_dim}")

    def _masks(self, query: Any, key_padding_mask: Any, attn_mask: Any, B: int, Sq: int, Skv: int):
        """(seq_lens_kv, additive bias) for the attention op, from PyTorch's two masks."""
        where = "MultiheadAttention"
        lens = bias = None
        if key_padding_mask is not None:
            kpm = on_device_of(key_padding_mask, query, where, "key_padding_mask")
            if tuple(kpm.shape) != (B, Skv):
                raise ValueError(f"{where}: key_padding_mask must have shape (batch, seq_len_kv) = {(B, Skv)}, "
                                 f"got {tuple(kpm.shape)}")
            if kpm.dtype == np.bool_:
                lens, bias = key_padding(~kpm, query.dtype)
            else:
                bias = _additive(kpm, query.dtype, where, "key_padding_mask")[:, None, None, :]
        if attn_mask is not None:
            mask = on_device_of(attn_mask, query, where, "attn_mask")
            if tuple(mask.shape) == (Sq, Skv):
                mask = mask[None, None]
            elif tuple(mask.shape) == (B * self.num_heads, Sq, Skv):
                mask = mask.reshape(B, self.num_heads, Sq, Skv)
            else:
                raise ValueError(f"{where}: attn_mask must have shape (seq_len_q, seq_len_kv) = {(Sq, Skv)} or "
                                 f"(batch * num_heads, seq_len_q, seq_len_kv) = {(B * self.num_heads, Sq, Skv)}, "
                                 f"got {tuple(mask.shape)}")
            mask = _additive(mask, query.dtype, where, "attn_mask")
            if isinstance(bias, KeyPaddingBias):  # holes plus a mask may empty rows: a plain bias
                bias = bias.bias
            bias = mask if bias is None else bias + mask
        return lens, bias

    def _cross_attention(self, query: Any, key: Any, value: Any, lens: Any, bias: Any, causal: bool) -> Any:
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        B, Sq, Skv = query.shape[0], query.shape[1], key.shape[1]
        w, b = self.in_proj_weight, self.in_proj_bias

        def rows(i: int, j: int) -> tuple[Any, Any]:  # rows i·E to j·E of the packed projection: views
            return w[i * E:j * E], None if b is None else b[i * E:j * E]

        lin = op_path(self.path, "linear")
        q = linear(query, *rows(0, 1), path=lin).reshape(B, Sq, H, D)
        if key is value:  # one GEMM for k and v, read as strided views like the packed self-attention
            kv = linear(key, *rows(1, 3), path=lin).reshape(B, Skv, 2, H, D)
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k = linear(key, *rows(1, 2), path=lin).reshape(B, Skv, H, D)
            v = linear(value, *rows(2, 3), path=lin).reshape(B, Skv, H, D)
        o = attention(q, k, v, causal=causal, seq_lens_kv=lens, attn_bias=bias, layout="BSHD",
                      path=op_path(self.path, "attention"))
        return o.reshape(B, Sq, E)

    def __repr__(self) -> str:
        return (f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"bias={self.in_proj_bias is not None}, batch_first=True, path={self.path!r})")


class TransformerEncoderLayer(Module):
    """PyTorch's nn.TransformerEncoderLayer for inference, batch_first=True: children `self_attn`,
    `linear1`, `linear2`, `norm1`, `norm2`. The feed-forward activation ("relu", or "gelu": PyTorch's
    exact erf GELU) runs in linear1's GEMM epilogue. `dropout` is accepted and ignored (inference)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, *, dtype: Any = "fp32", device: str = "cpu",
                 path: str | dict[str, str] = "auto", seed: int | None = None):
        super().__init__()
        where = "TransformerEncoderLayer"
        d_model, nhead = _heads(where, ("d_model", d_model), ("nhead", nhead), batch_first)
        dim_feedforward = checks.size(where, "dim_feedforward", dim_feedforward)
        checks.probability(where, "dropout", dropout)
        checks.choice(where, "activation", activation, tuple(ENCODER_ACTIVATIONS))
        layer_norm_eps = checks.positive_float(where, "layer_norm_eps", layer_norm_eps)
        norm_first, bias = checks.flag(where, "norm_first", norm_first), checks.flag(where, "bias", bias)
        parsed, seed = checks.float_dtype(where, dtype), checks.seed(where, seed)
        checks.path(where, path, ("linear", "attention", "layer_norm"), per_op=True)
        elements = 4 * d_model * (d_model + 1) + 2 * d_model * dim_feedforward + dim_feedforward + 5 * d_model
        checks.parameters_fit(where, f"d_model={d_model}, dim_feedforward={dim_feedforward}", elements, parsed,
                              checks.device(where, device))
        seeds = [None if seed is None else seed + 10 * i for i in range(3)]
        self.d_model, self.norm_first, self.activation, self.path = d_model, norm_first, activation, path
        self.self_attn = MultiheadAttention(d_model, nhead, dropout, bias, batch_first=batch_first, dtype=dtype,
                                            device=device, path=path, seed=seeds[0])
        lin = op_path(path, "linear")
        self.linear1 = Linear(d_model, dim_feedforward, bias, activation=ENCODER_ACTIVATIONS[activation],
                              dtype=dtype, device=device, path=lin, seed=seeds[1])
        self.linear2 = Linear(dim_feedforward, d_model, bias, dtype=dtype, device=device, path=lin, seed=seeds[2])
        norm = op_path(path, "layer_norm")
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype, device=device, path=norm)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, dtype=dtype, device=device, path=norm)

    def forward(self, src: Any, src_mask: Any = None, src_key_padding_mask: Any = None,
                is_causal: bool = False) -> Any:
        """src (B, S, d_model) → (B, S, d_model); masks as for MultiheadAttention."""
        src = checks.float_input("TransformerEncoderLayer", src, self.linear1.weight, "src")
        is_causal = checks.flag("TransformerEncoderLayer", "is_causal", is_causal)
        if src.ndim != 3 or src.shape[-1] != self.d_model:
            raise ValueError(f"TransformerEncoderLayer: src must be 3-D (batch, seq_len, d_model={self.d_model}) "
                             f"(batch_first=True), got shape {tuple(src.shape)}")
        x = src
        # every residual add is fused: into linear2's GEMM epilogue, or into the LayerNorm that follows it
        if self.norm_first:
            x = x + self._attend(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return self.linear2(self.linear1(self.norm2(x)), residual=x)
        x = self.norm1(self._attend(x, src_mask, src_key_padding_mask, is_causal), residual=x)
        return self.norm2(self.linear2(self.linear1(x), residual=x))

    def _attend(self, x: Any, mask: Any, key_padding_mask: Any, is_causal: bool) -> Any:
        return self.self_attn(x, key_padding_mask=key_padding_mask, attn_mask=mask, is_causal=is_causal)[0]

    def describe(self) -> list[str]:
        return [(f"self_attn: q, k, v in one GEMM ({3 * self.d_model}x{self.d_model}), attention on strided "
                 "BSHD views of its output"),
                f"linear1: bias+{ENCODER_ACTIVATIONS[self.activation]} in the GEMM epilogue",
                "linear2, self_attn.out_proj: bias in the GEMM epilogue; linear2 adds its residual there too",
                f"{'pre' if self.norm_first else 'post'}-norm residual blocks (norm1, norm2)"
                + ("" if self.norm_first else "; norm1 adds the attention's residual as it reads its rows")]
