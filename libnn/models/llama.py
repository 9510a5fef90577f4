"""LLaMA-architecture decoders (Hugging Face's LlamaForCausalLM: Llama 2/3-style, TinyLlama, SmolLM) for
text generation with a preallocated KV cache, read from a checkpoint directory (config.json and
model.safetensors, or shards listed by model.safetensors.index.json) without PyTorch or transformers.

    model = CausalLM.from_pretrained("TinyLlama-1.1B/", dtype="fp16", device="gpu", max_batch=8, max_len=2048)
    tokens = model.generate([[1, 15043, 29892], [1, 450]], max_new_tokens=32)   # one array per sequence
    for step in model.stream(ids, 32, lengths=lens, temperature=0.8, top_p=0.95, seed=0): ...

The module tree carries Hugging Face's key names (model.embed_tokens, model.layers.{i}.input_layernorm,
.self_attn.{q,k,v,o}_proj, .post_attention_layernorm, .mlp.{gate,up,down}_proj, model.norm, lm_head), so a
checkpoint loads through Module.load_state_dict: every key, shape and dtype is checked before anything
changes, and a model is never half-loaded. With tie_word_embeddings the logits reuse embed_tokens' table
(a checkpoint's lm_head.weight, if it holds one, is set aside and reported, as are the rotary inv_freq
buffers old conversions saved). At load q, k and v are stacked into one (Hq + 2 Hkv) D x H weight and gate
and up into one 2I x H weight, one GEMM each; the projections' parameters are views into them.

What runs, per decoder layer (pre-norm; ops in libnn.ops, each on its `auto` path):
    n  = rms_norm(x, input_layernorm)
    q, k, v = views of linear(n, W_qkv)                      one GEMM
    q = rope(q); kv_append(k, v)                              k rotated and v written into the KV cache at
                                                             each token's position, one kernel
    o  = attention(q, K cache, V cache)                      causal + padding lengths (prefill); q of one
                                                             token against each sequence's cached length (decode)
    h  = linear(o, W_o, residual=x)                          the residual in the GEMM's epilogue
    x' = linear(swiglu(linear(rms_norm(h), W_gate_up)), W_down, residual=h)
then model.norm and lm_head on each sequence's last position only. Both residual adds sit in GEMM
epilogues, so rms_norm runs plain (its residual/return_sum fusion would move the add out of the GEMM
into the norm, the same traffic).

KV cache: k and v are each (layers, max_batch, max_len, Hkv, D) in the model's dtype (BSHD per layer:
the layout of the QKV projection's output: kv_append writes each token's rotated k and its v into its
sequence's row at its position, prefill and decode alike, and attention reads the cache as a strided BSHD
view), for `max_batch` sequences of up to `max_len`
tokens, allocated zeroed at the first prefill (anew after new parameters or a move) and refused before
allocation when it would not fit (from_pretrained and the constructor check it first too). Sequence b of a
batch lives in row b; `lengths` per sequence say how many positions of its row are filled, so one
batch holds prompts of different lengths (right-padded input_ids: tokens first, then anything). Decode
appends one token per sequence at its own position (rope position = its current length) and attends
with seq_lens_kv = the new lengths.

Decode steps as CUDA graphs (the default on the GPU, `decode_graphs=True`): a step launched op by op from
Python costs about 12 launches per layer of host time, far more than the GPU's work at small batches, so
each step is one replay of a graph captured per batch bucket (1, 2, 4, ... up to max_batch; a batch pads up
to its bucket) through libnn.nn.graphs.GraphedModule. The graph reads the step's tokens and positions
from its input buffers (copied in per step, a few bytes), and the cache is one fixed buffer, so one
capture serves every step and every position. A bucket's padding rows repeat the last real sequence's
token and position and write into cache rows no sequence of the batch owns. The first step of a bucket
captures it (one eager pass with every check, warm-ups, the capture). New parameters or a move drop the
graphs with the cache. `decode_graphs=False` runs every step eagerly; prefill is always eager.
GPT-2 checkpoints, FP8 weights and a paged cache are not done yet.

The reference path runs the whole model on the host (device="cpu", dtype fp32 or fp64): every op's
float64 reference, what the CPU tests compare against an independent NumPy LLaMA.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.models import checkpoint
from libnn.nn import checks
from libnn.nn.basic import Embedding
from libnn.nn.functional import gather_rows, on_device_of, op_path
from libnn.nn.graphs import GraphedModule
from libnn.nn.linear import Linear
from libnn.nn.module import Module, uninitialised
from libnn.nn.norm import RMSNorm
from libnn.ops.attention import CheckedLengths, attention
from libnn.ops.embedding import embedding
from libnn.ops.kv_append import kv_append
from libnn.ops.linear import linear
from libnn.ops.rope import SCALING_TYPES, rope, rope_frequencies
from libnn.ops.swiglu import swiglu
from libnn.registry import get_op
from libnn.runtime import memory
from libnn.runtime.arrays import array_module, as_array, is_cupy, min_max

MODEL_TYPES = ("llama",)
ARCHITECTURES = ("LlamaForCausalLM",)
HIDDEN_ACTS = ("silu",)
OPS = ("linear", "attention", "rms_norm", "embedding", "rope", "kv_append", "swiglu")  # the ops a forward pass calls
# The config's sizes and the least each may be (no decoder layers leaves embeddings and lm_head, still a model).
SIZES = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 0, "num_attention_heads": 1,
         "num_key_value_heads": 1, "head_dim": 2, "max_position_embeddings": 1}
DERIVED = ("num_key_value_heads", "head_dim")  # sizes a config may leave null: from the heads and hidden_size
# Options Hugging Face's LlamaConfig has that change the network, with the only value libnn runs.
FIXED = {"attention_bias": False, "mlp_bias": False}
DEFAULT_MAX_LEN = 2048   # the cache's length when from_pretrained is given none (at most max_position_embeddings)
SEED_LIMIT = 2**32       # NumPy's and CuPy's RandomState take seeds below this
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest positive normal float32
# Checkpoint keys that are no parameters: rotary inv_freq buffers (older conversions saved them).
BUFFER_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)


# --- config -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face LlamaConfig that decide the network, with Hugging Face's defaults,
    normalised: num_key_value_heads and head_dim filled in, the rotary frequencies' parameters in
    rope_theta and rope_scaling (None, or a dict of type "linear" or "llama3") whichever form the file
    used (rope_theta/rope_scaling, or transformers 5's rope_parameters), eos_token_id a tuple."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    model_type: str = "llama"

    @classmethod
    def from_dict(cls, config: Any, source: str = "config") -> LlamaConfig:
        """The config of a Hugging Face config.json's fields, each checked; `source` (the file) is named
        in every error. Fields libnn does not read (initializer_range, use_cache, torch_dtype, ...) are
        left aside; options that would change the network to one libnn does not run are refused by name."""
        where = f"CausalLM: {source}"
        if not isinstance(config, dict):
            raise TypeError(f"{where} must be a JSON object of the config's fields by name, got {type(config).__name__}")
        model_type = config.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {list(MODEL_TYPES)}; "
                             "GPT-2 is not supported yet)")
        architectures = config.get("architectures")
        if architectures is not None:
            if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
                raise TypeError(f"{where}: architectures must be a list of class names, got {architectures!r}")
            if not set(architectures) & set(ARCHITECTURES):
                raise ValueError(f"{where}: architectures {architectures} are not supported (supported: "
                                 f"{list(ARCHITECTURES)}: a causal LM with its lm_head)")
        if config.get("quantization_config") is not None:  # null: not quantized
            raise ValueError(f"{where}: quantized checkpoints (quantization_config of method "
                             f"{_get(config['quantization_config'], 'quant_method')!r}) are not supported; "
                             "libnn loads fp32, fp16 and bf16 weights")
        act = config.get("hidden_act", "silu")
        if act not in HIDDEN_ACTS:
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: {list(HIDDEN_ACTS)}, "
                             "LLaMA's SwiGLU)")
        for name, only in FIXED.items():
            if config.get(name, only) is not only:
                raise ValueError(f"{where}: {name}={config[name]!r} is not supported (only {only}: LLaMA's "
                                 "projections have no bias)")
        values: dict[str, Any] = {"model_type": model_type, "hidden_act": act}
        for f in fields(cls):
            # null is Hugging Face's "derive it" for these two alone; any other size must be given as an int
            if f.name in SIZES and f.name in config and (config[f.name] is not None or f.name not in DERIVED):
                values[f.name] = checks.size(where, f.name, config[f.name], SIZES[f.name])
        values.setdefault("num_key_value_heads", values.get("num_attention_heads", cls.num_attention_heads))
        if "head_dim" not in values:
            hidden = values.get("hidden_size", cls.hidden_size)
            heads = values.get("num_attention_heads", cls.num_attention_heads)
            if hidden % heads:
                raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                 "(and there is no head_dim)")
            values["head_dim"] = hidden // heads
        if "rms_norm_eps" in config:
            values["rms_norm_eps"] = checks.positive_float(where, "rms_norm_eps", config["rms_norm_eps"])
        if "tie_word_embeddings" in config:
            values["tie_word_embeddings"] = checks.flag(where, "tie_word_embeddings", config["tie_word_embeddings"])
        for name in ("bos_token_id", "pad_token_id"):
            if name in config:
                values[name] = None if config[name] is None else checks.size(where, name, config[name], 0)
        if "eos_token_id" in config:
            values["eos_token_id"] = _token_ids(where, "eos_token_id", config["eos_token_id"])
        values["rope_theta"], values["rope_scaling"] = _rope(where, config)
        result = cls(**values)
        result.check(where)
        return result

    def check(self, where: str) -> None:
        """Every size an int of its range, the heads grouping evenly, head_dim even, the token ids in the
        vocabulary, the rotary frequencies computable (so that no layer meets a bad value first and
        blames itself)."""
        for name, minimum in SIZES.items():
            checks.size(where, name, getattr(self, name), minimum)
        checks.positive_float(where, "rms_norm_eps", self.rms_norm_eps)
        checks.flag(where, "tie_word_embeddings", self.tie_word_embeddings)
        for name, supported in (("model_type", MODEL_TYPES), ("hidden_act", HIDDEN_ACTS)):
            if getattr(self, name) not in supported:
                raise ValueError(f"{where}: {name} {getattr(self, name)!r} is not supported (supported: "
                                 f"{list(supported)})")
        if not isinstance(self.eos_token_id, (tuple, list)):
            raise TypeError(f"{where}: eos_token_id must be a tuple of token ids (from_dict makes one of an id or "
                            f"a list), got {type(self.eos_token_id).__name__} {self.eos_token_id!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"{where}: head_dim {self.head_dim} is odd; rotary embedding turns pairs")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= checks.size(where, name, value, None) < self.vocab_size:
                raise ValueError(f"{where}: {name} {value} is outside the vocabulary [0, {self.vocab_size})")
        for value in self.eos_token_id:
            if not 0 <= checks.size(where, "eos_token_id", value, None) < self.vocab_size:
                raise ValueError(f"{where}: eos_token_id {value} is outside the vocabulary [0, {self.vocab_size})")
        _theta(where, self.rope_theta)
        try:
            rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: rope_theta {self.rope_theta!r}, rope_scaling {self.rope_scaling!r}: "
                             f"{exc}") from None

    @property
    def inv_freq(self) -> np.ndarray:
        """The rotary frequencies, (head_dim / 2,) float32, as Hugging Face computes them."""
        return rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)

    def parameter_count(self) -> int:
        H, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        Hq, Hkv = self.num_attention_heads, self.num_key_value_heads
        layer = H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * I + 2 * H
        return self.vocab_size * H * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + H

    def cache_bytes(self, max_batch: int, max_len: int, dtype: Any) -> int:
        """The KV cache's bytes: k and v for every layer, sequence, position, KV head."""
        elements = 2 * self.num_hidden_layers * max_batch * max_len * self.num_key_value_heads * self.head_dim
        return elements * dtypes.parse(dtype).itemsize


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def _token_ids(where: str, name: str, value: Any) -> tuple[int, ...]:
    """An id, a list of ids (Llama 3 lists several end tokens) or None (no end token), as a tuple."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    return tuple(checks.size(where, name, v, 0) for v in items)


def _rope(where: str, config: dict) -> tuple[float, Mapping | None]:
    """(rope_theta, rope_scaling or None) from either form of the config: rope_theta and rope_scaling
    (transformers 4), or rope_parameters (transformers 5: the type, theta and scaling in one dict).
    Both forms at once must agree. The scaling type must be one libnn.ops.rope_frequencies computes."""
    scaling, parameters = config.get("rope_scaling"), config.get("rope_parameters")
    for name, value in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{where}: {name} must be null or an object, got {type(value).__name__} {value!r}")
    theta = _theta(where, (parameters or {}).get("rope_theta", config.get("rope_theta", 10000.0)))
    chosen = {k: v for k, v in (scaling or parameters or {}).items() if k != "rope_theta"}
    if scaling and parameters and chosen != {k: v for k, v in parameters.items() if k != "rope_theta"}:
        raise ValueError(f"{where}: rope_scaling {scaling!r} and rope_parameters {parameters!r} disagree; "
                         "give one of them")
    for source in (config, chosen):
        factor = source.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            raise ValueError(f"{where}: partial_rotary_factor {factor!r} is not supported (LLaMA rotates the "
                             "whole head)")
    chosen.pop("partial_rotary_factor", None)
    if chosen and "rope_type" not in chosen and "type" not in chosen:  # transformers fails on it too
        raise ValueError(f"{where}: rope_scaling {chosen!r} has no rope_type (or type); name the scaling "
                         f"(supported: {', '.join(map(repr, SCALING_TYPES))})")
    kind = chosen.get("rope_type", chosen.get("type", "default"))
    if kind not in SCALING_TYPES:
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported (supported: "
                         f"{', '.join(map(repr, SCALING_TYPES))})")
    return theta, (None if kind == "default" else chosen)


def _theta(where: str, theta: Any) -> float:
    """rope_theta: a number > 0 that float32 holds (the frequencies are computed in float32, as transformers
    does: a larger theta is inf there, and every frequency but the first 0)."""
    if isinstance(theta, (bool, np.bool_)) or not isinstance(theta, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: rope_theta must be a finite number > 0, got {type(theta).__name__} {theta!r}")
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"{where}: rope_theta must be a finite number > 0, got {theta!r}")
    if theta > FLOAT32_MAX:
        raise ValueError(f"{where}: rope_theta {theta!r} is beyond float32's largest number ({FLOAT32_MAX:.4g}), "
                         "in which the rotary frequencies are computed")
    return float(theta)


# --- layers, under Hugging Face's names -------------------------------------------------------------------
def _stacked(owner: Module, layers: Sequence[Linear], held: str) -> Any:
    """The weights of `layers` stacked along their output rows, built once and kept on `owner` under
    `held`: the layers' parameters then become views into it (the weights are held once), and a
    replaced parameter (load_state_dict, to()) makes the next call stack them again."""
    found = getattr(owner, held, None)
    if found is not None and all(a is b for a, b in zip(found[0], (layer.weight for layer in layers))):
        return found[1]
    return _share(owner, layers, held, array_module(layers[0].weight).concatenate([layer.weight for layer in layers]))


def _share(owner: Module, layers: Sequence[Linear], held: str, w: Any) -> Any:
    """Make `layers`' weights views into the stacked `w`, and keep it on `owner` under `held`."""
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        layer.register_parameter("weight", w[start:start + rows])
        start += rows
    object.__setattr__(owner, held, (tuple(layer.weight for layer in layers), w))
    return w


class LlamaAttention(Module):
    """self_attn: q_proj, k_proj, v_proj and o_proj, no bias; q, k and v run as one GEMM."""

    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = _path_for(path, "linear")
        H, D = c.hidden_size, c.head_dim
        self.q_proj = Linear(H, c.num_attention_heads * D, bias=False, dtype=dtype, device=device, path=lin)
        self.k_proj = Linear(H, c.num_key_value_heads * D, bias=False, dtype=dtype, device=device, path=lin)
        self.v_proj = Linear(H, c.num_key_value_heads * D, bias=False, dtype=dtype, device=device, path=lin)
        self.o_proj = Linear(c.num_attention_heads * D, H, bias=False, dtype=dtype, device=device, path=lin)

    def stacks(self) -> list[tuple[tuple[Linear, ...], str]]:
        """The layers stacked into one weight, and the attribute the stack is kept under."""
        return [((self.q_proj, self.k_proj, self.v_proj), "_qkv")]

    def packed(self) -> Any:
        """The ((Hq + 2 Hkv) D, H) weight of q_proj, k_proj and v_proj stacked."""
        return _stacked(self, *self.stacks()[0])


class LlamaMLP(Module):
    """mlp: gate_proj, up_proj and down_proj, no bias; gate and up run as one GEMM."""

    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = _path_for(path, "linear")
        H, I = c.hidden_size, c.intermediate_size
        self.gate_proj = Linear(H, I, bias=False, dtype=dtype, device=device, path=lin)
        self.up_proj = Linear(H, I, bias=False, dtype=dtype, device=device, path=lin)
        self.down_proj = Linear(I, H, bias=False, dtype=dtype, device=device, path=lin)

    def stacks(self) -> list[tuple[tuple[Linear, ...], str]]:
        """The layers stacked into one weight, and the attribute the stack is kept under."""
        return [((self.gate_proj, self.up_proj), "_gate_up")]

    def packed(self) -> Any:
        """The (2I, H) weight of gate_proj and up_proj stacked: swiglu's gate half first."""
        return _stacked(self, *self.stacks()[0])


class LlamaDecoderLayer(Module):
    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        norm = _path_for(path, "rms_norm")
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, device=device, path=norm)
        self.self_attn = LlamaAttention(c, dtype, device, path)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, device=device,
                                                path=norm)
        self.mlp = LlamaMLP(c, dtype, device, path)
        self.config, self.path = c, path

    def forward(self, x: Any, step: _Step, index: int) -> Any:
        """x (B, S, H) → the next layer's input; `step` holds the positions, the cache and the lengths
        of a prefill (S tokens per sequence) or a decode step (S = 1)."""
        c, path = self.config, self.path
        B, S, _ = x.shape
        Hq, Hkv = c.num_attention_heads, c.num_key_value_heads
        n = self.input_layernorm(x)
        qkv = linear(n, self.self_attn.packed(), path=_path_for(path, "linear"))
        qkv = qkv.reshape(B, S, Hq + 2 * Hkv, c.head_dim)  # contiguous: a view
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
        q = rope(q, step.positions, step.inv_freq, path=_path_for(path, "rope"))
        keys, values = step.cache.store(index, step, k, v, _path_for(path, "kv_append"))
        o = attention(q, keys, values, causal=step.causal, seq_lens_q=step.seq_lens_q,
                      seq_lens_kv=step.seq_lens_kv, layout="BSHD", path=_path_for(path, "attention"))
        h = self.self_attn.o_proj(o.reshape(B, S, Hq * c.head_dim), residual=x)
        gate_up = linear(self.post_attention_layernorm(h), self.mlp.packed(), path=_path_for(path, "linear"))
        return self.mlp.down_proj(swiglu(gate_up, path=_path_for(path, "swiglu")), residual=h)


class _Layers(Module):
    """model.layers.{i}."""

    def __init__(self, layers: list[Module]):
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __iter__(self):
        return iter(self._children.values())

    def __len__(self) -> int:
        return len(self._children)


class LlamaModel(Module):
    """model: embed_tokens, layers, norm."""

    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = _Layers([LlamaDecoderLayer(c, dtype, device, path) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, device=device,
                            path=_path_for(path, "rms_norm"))


# --- the KV cache and one forward pass's inputs ---------------------------------------------------------------
class KVCache:
    """k and v, each (layers, max_batch, max_len, Hkv, D), zeroed once (as unsigned integers of the
    element's width: zero bits are 0.0 in every dtype, and CuPy makes no bf16 array); written by
    kv_append, k rotated on the way."""

    def __init__(self, c: LlamaConfig, max_batch: int, max_len: int, like: Any):
        xp = array_module(like)
        shape = (c.num_hidden_layers, max_batch, max_len, c.num_key_value_heads, c.head_dim)
        bits = f"u{like.dtype.itemsize}"
        self.k, self.v = xp.zeros(shape, bits).view(like.dtype), xp.zeros(shape, bits).view(like.dtype)
        self.max_batch, self.max_len = max_batch, max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def store(self, layer: int, step: _Step, k: Any, v: Any, path: str) -> tuple[Any, Any]:
        """Write this pass's k (rotated) and v into layer `layer`'s cache rows 0..B-1 at their tokens'
        positions; return the keys and values attention reads: the prefill's window (B, S, Hkv, D), or
        for a decode step every sequence's whole row (B, max_len, Hkv, D), its length in step.seq_lens_kv.
        The positions are the model's own (prefill: 0..S-1; decode: each sequence's length, below
        max_len by the checks of _decode), so kv_append need not read them back."""
        B, S = k.shape[:2]
        keys, values = self.k[layer, :B], self.v[layer, :B]
        kv_append(k, v, step.positions, step.inv_freq, keys, values, checked=True, path=path)
        return (keys[:, :S], values[:, :S]) if step.causal else (keys, values)


@dataclass
class _Step:
    """What every layer of one forward pass reads: the tokens' positions (B, S) int32 (rope and the
    cache's rows) and rope's frequencies, the attention's masks and the cache."""
    positions: Any
    inv_freq: Any
    cache: KVCache
    causal: bool                  # prefill (causal, top-left) or a decode step (one query, no mask)
    seq_lens_q: Any = None
    seq_lens_kv: Any = None


# --- the model --------------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    """What from_pretrained did with the checkpoint's keys besides loading them."""
    files: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # buffers, and lm_head.weight under tied embeddings

    def lines(self) -> list[str]:
        out = [f"loaded from {', '.join(self.files)}"]
        if self.ignored:
            out.append(f"ignored {len(self.ignored)} keys (tied lm_head, rotary buffers): {', '.join(self.ignored)}")
        return out


class CausalLM(Module):
    """A LLaMA-architecture causal language model for generation, with a KV cache for `max_batch`
    sequences of up to `max_len` tokens (see the module docstring). Build it from a checkpoint with
    `from_pretrained`, or from a LlamaConfig (random weights) for tests.

    - `prefill(input_ids, lengths=None)`: input_ids (B, S) integers, right-padded, lengths (B,) the
      tokens of each row (default S); fills the cache rows 0..B-1 and returns each sequence's logits at
      its last token, (B, vocab_size), in the model's dtype on its device.
    - `decode_step(tokens)`: tokens (B,), one per sequence of the last prefill; appends each at its
      sequence's own position and returns the next logits (B, vocab_size).
    - `generate(...)` and `stream(...)`: the loop over both, greedy or sampled, stopping each sequence at
      its end token.
    On the GPU each decode step replays a CUDA graph per batch bucket (`decode_graphs=False`: eagerly, one
    launch per op; see the module docstring). `path` goes to every op ("auto", a path name the ops that
    have it take, or a dict by op name)."""

    def __init__(self, config: LlamaConfig, *, dtype: Any = "fp32", device: str = "cpu", max_batch: int = 1,
                 max_len: int | None = None, path: str | dict[str, str] = "auto", init: bool = True,
                 decode_graphs: bool = True):
        """A model of `config` with random weights (PyTorch's default initialisers; RMSNorm weights 1),
        or with `init=False` uninitialised ones, for a loader that replaces every parameter (from_pretrained:
        no values are drawn, and the host memory check counts no float64 draws)."""
        super().__init__()
        init = checks.flag("CausalLM", "init", init)
        self.decode_graphs = checks.flag("CausalLM", "decode_graphs", decode_graphs)
        max_batch, max_len = _check_fits("CausalLM", config, dtype, device, max_batch, max_len, "the config", init)
        checks.path("CausalLM", path, OPS, per_op=True)
        self.config, self.path = config, path
        self.max_batch, self.max_len = max_batch, max_len
        with contextlib.nullcontext() if init else uninitialised():
            self.model = LlamaModel(config, dtype, device, path)
            self.lm_head = None if config.tie_word_embeddings else Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device,
                path=_path_for(path, "linear"))
        self.load_report: LoadReport | None = None
        self._reset()

    # -- loading ---------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, *, dtype: Any = "fp16", device: str = "gpu", max_batch: int = 1,
                        max_len: int | None = None, path: str | dict[str, str] = "auto",
                        decode_graphs: bool = True) -> CausalLM:
        """Load config.json and model.safetensors (or the shards model.safetensors.index.json lists) from
        `directory` into a CausalLM in `dtype` ("fp16", "bf16", "fp32"; "fp64" too on the CPU) on `device`
        ("gpu" or "cpu"), with a KV cache for `max_batch` sequences of `max_len` tokens (default
        min(2048, max_position_embeddings)); `decode_graphs` as for the constructor. The parameters and the
        cache are refused before anything is
        read if they would not fit; a key, shape or dtype that does not match the config is an error
        naming the file and the keys, and nothing is kept."""
        where = "CausalLM.from_pretrained"
        directory, config_file, config_json = checkpoint.read_config(directory, where)
        config = LlamaConfig.from_dict(config_json, str(config_file))
        _check_fits(where, config, dtype, device, max_batch, max_len, str(config_file), False)
        checks.path(where, path, OPS, per_op=True)  # before the checkpoint is read, not after
        checks.flag(where, "decode_graphs", decode_graphs)
        # each tensor in the shard its weight_map names
        raw, files = checkpoint.read_tensors(directory, where, others=("*.bin", "*.pth"), check_placement=True)
        state, report = _checkpoint_state(raw, config)
        report.files = files
        # every parameter is replaced by the checkpoint's, or the load fails
        model = cls(config, dtype=dtype, device="cpu", max_batch=max_batch, max_len=max_len, path=path, init=False,
                    decode_graphs=decode_graphs)
        checkpoint.load_state(model, state, f"{where}({str(directory)!r}): the checkpoint ({', '.join(files)}) does "
                                            f"not match its config ({config.num_hidden_layers} layers, hidden "
                                            f"{config.hidden_size}, tie_word_embeddings={config.tie_word_embeddings})")
        model.load_report = report
        del raw, state  # the checkpoint's arrays: the stacked weights and the cast copies hold what is kept
        return model.to(device) if device != "cpu" else model

    def load_state_dict(self, state: dict[str, Any], *, assign: bool = False) -> None:
        super().load_state_dict(state, assign=assign)
        self._prepare()

    def to(self, target: Any) -> CausalLM:
        """Move (or cast) the parameters; a move to the GPU moves the stacked QKV and gate_up weights
        whole, their projections' views with them. The KV cache is made anew (empty) in the new place."""
        if isinstance(target, str) and target in ("gpu", "cuda"):
            checks.device("CausalLM.to", target)
            import cupy

            for layer in self.model.layers:
                for owner in (layer.self_attn, layer.mlp):
                    for layers, held in owner.stacks():
                        _share(owner, layers, held, cupy.asarray(_stacked(owner, layers, held)))
        super().to(target)
        self._prepare()
        return self

    def _prepare(self) -> None:
        """After new parameters: the stacked weights built now rather than at the next forward pass (so
        that the parameters are final before anything records their addresses), the cache emptied."""
        for layer in self.model.layers:
            layer.self_attn.packed()
            layer.mlp.packed()
        self._reset()

    def _reset(self) -> None:
        """No sequence in the cache; the cache itself (and the rotary frequencies) made at the next
        prefill, on the parameters' device, in their dtype."""
        self._cache: KVCache | None = None  # its memory goes back before a new one is drawn
        self._decode_graph: GraphedModule | None = None  # its captures bake in the cache's address
        self._inv_freq = None
        self._lengths = np.zeros(self.max_batch, np.int64)  # filled positions per cache row (host)
        self._batch = 0  # sequences of the last prefill; 0: none

    def _ready_cache(self) -> KVCache:
        """The KV cache, made (zeroed) the first time, refused first if it would not fit."""
        if self._cache is None:
            like = self.model.embed_tokens.weight
            memory.require(self.config.cache_bytes(self.max_batch, self.max_len, like.dtype),
                           "gpu" if is_cupy(like) else "cpu", "CausalLM",
                           f"the KV cache ({self.max_batch} sequences of {self.max_len} tokens)")
            self._inv_freq = on_device_of(self.config.inv_freq, like, "CausalLM", "inv_freq")
            self._cache = KVCache(self.config, self.max_batch, self.max_len, like)
        return self._cache

    # -- forward passes -----------------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """The tokens each sequence of the last prefill holds in the cache now (a copy)."""
        return self._lengths[:self._batch].copy()

    def forward(self, input_ids: Any, lengths: Any = None) -> Any:
        """prefill(input_ids, lengths)."""
        return self.prefill(input_ids, lengths)

    def prefill(self, input_ids: Any, lengths: Any = None) -> Any:
        """Run the prompts input_ids (B, S), right-padded, lengths (B,) tokens each (default S; each at
        least 1), into cache rows 0..B-1, replacing whatever the cache held; return the logits at each
        sequence's last token, (B, vocab_size). Host ids are moved to the model's device."""
        ids, lengths = self._prompts(input_ids, lengths, "prefill")
        return self._prefill(ids, lengths)

    def _prefill(self, ids: Any, lengths: np.ndarray) -> Any:
        """prefill of the prompts _prompts has checked."""
        B, S = ids.shape
        xp = array_module(self.model.embed_tokens.weight)
        lens = CheckedLengths(xp.asarray(lengths, dtype=xp.int32))
        positions = xp.broadcast_to(xp.arange(S, dtype=xp.int32), (B, S))
        cache = self._ready_cache()
        self._lengths[:], self._batch = 0, 0  # the old sequences are gone even if this pass fails
        step = _Step(positions, self._inv_freq, cache, causal=True, seq_lens_q=lens, seq_lens_kv=lens)
        x = self._layers(ids, step)
        last = gather_rows(x.reshape(B * S, -1), xp.asarray(np.arange(B) * S + lengths - 1, dtype=xp.int32))
        logits = self._logits(last)
        self._lengths[:B], self._batch = lengths, B
        return logits

    def decode_step(self, tokens: Any) -> Any:
        """Append tokens (B,), one per sequence of the last prefill, each at its sequence's own position,
        and return the logits of the next token, (B, vocab_size), an array of the caller's (the decode
        graph's own output is copied: the next step overwrites it)."""
        logits = self._decode(tokens, checked=False)
        return logits.copy() if self._decode_graph is not None else logits

    def _decode(self, tokens: Any, checked: bool) -> Any:
        if not self._batch:
            raise RuntimeError("CausalLM.decode_step: no sequence to extend; call prefill (or generate) first")
        like = self.model.embed_tokens.weight
        B = self._batch
        if isinstance(tokens, (list, tuple)):
            tokens = _host_ids(tokens, "CausalLM.decode_step", "tokens")
        tokens = on_device_of(tokens, like, "CausalLM.decode_step", "tokens")
        if tuple(tokens.shape) != (B,) or tokens.dtype.kind not in "iu":
            raise ValueError(f"CausalLM.decode_step: tokens must be ({B},) integers, one per sequence of the last "
                             f"prefill, got shape {tuple(tokens.shape)} dtype {tokens.dtype}")
        positions = self._lengths[:B]
        if int(positions.max()) >= self.max_len:
            full = [int(b) for b in np.flatnonzero(positions >= self.max_len)]
            raise ValueError(f"CausalLM.decode_step: sequences {full} fill the KV cache (max_len {self.max_len}); "
                             "a longer generation needs a model with a larger max_len")
        if not checked:
            self._check_ids(tokens, "CausalLM.decode_step", "tokens")
        xp = array_module(like)
        at = xp.asarray(positions, dtype=xp.int32)
        tokens = tokens.astype(xp.int64, copy=False)  # one capture per bucket, whatever integers came
        step = self._step_logits
        if self.decode_graphs and is_cupy(like):
            if self._decode_graph is None:
                self._decode_graph = GraphedModule(_DecodeStep(self), buckets=decode_buckets(self.max_batch))
            step = self._decode_graph
        logits = step(tokens, at)
        self._lengths[:B] += 1
        return logits

    def decode_graph_stats(self) -> dict[tuple, Any]:
        """Per batch bucket ((rows,)), the decode graph's captures, capture times, replays and pad waste
        (GraphedModule.stats); empty while no step has run as a graph."""
        return {} if self._decode_graph is None else self._decode_graph.stats()

    def _step_logits(self, tokens: Any, at: Any) -> Any:
        """One decode step of tokens (B,) written at cache positions `at` (B,) int32 of rows 0..B-1: the
        next logits (B, vocab_size). Checked by the caller; what the decode graphs capture."""
        B = tokens.shape[0]
        step = _Step(at[:, None], self._inv_freq, self._ready_cache(), causal=False,
                     seq_lens_kv=CheckedLengths(at + 1))
        x = self._layers(tokens[:, None], step)
        return self._logits(x.reshape(B, -1))

    def _layers(self, ids: Any, step: _Step) -> Any:
        x = embedding(ids, self.model.embed_tokens.weight, path=_path_for(self.path, "embedding"))
        for index, layer in enumerate(self.model.layers):
            x = layer(x, step, index)
        return x

    def _logits(self, rows: Any) -> Any:
        """(B, vocab_size) from the last hidden rows (B, H): model.norm, then lm_head (embed_tokens'
        table when tied)."""
        h = self.model.norm(rows)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(h, w, path=_path_for(self.path, "linear"))

    def _check_ids(self, ids: Any, where: str, name: str) -> None:
        """ids in [0, vocab_size): one synchronisation on the GPU."""
        if not ids.size:
            return
        (lo, hi), = min_max([ids])
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"{where}: {name} must lie in [0, {self.config.vocab_size}) (vocab_size), got values "
                             f"from {lo} to {hi}")

    def _prompts(self, input_ids: Any, lengths: Any, where: str) -> tuple[Any, np.ndarray]:
        """(ids (B, S) on the model's device, token 0 in the padding, lengths (B,) int64 on the host),
        checked against the cache and the vocabulary (one synchronisation on the GPU): input_ids is a 2-D
        integer array (with lengths, or each row full) or a list of 1-D sequences (padded here; no lengths
        then)."""
        where = f"CausalLM.{where}"
        like = self.model.embed_tokens.weight
        if isinstance(input_ids, (list, tuple)) and not input_ids:
            raise ValueError(f"{where}: input_ids is an empty list: the batch has 0 sequences; the KV cache holds 1 to "
                             f"{self.max_batch} (max_batch)")
        if isinstance(input_ids, (list, tuple)) and any(not np.isscalar(s) for s in input_ids):
            if lengths is not None:
                raise ValueError(f"{where}: lengths goes with a 2-D input_ids; a list of sequences carries its own")
            rows = [s.get() if is_cupy(s) else _host_ids(s, where, f"input_ids[{i}]") for i, s in enumerate(input_ids)]
            for i, row in enumerate(rows):
                if row.ndim != 1:
                    raise ValueError(f"{where}: input_ids[{i}] must be a 1-D sequence of token ids, got shape "
                                     f"{row.shape} dtype {row.dtype}")
                if row.size and row.dtype.kind not in "iu":
                    raise TypeError(f"{where}: input_ids[{i}] must hold integers (token ids), got dtype {row.dtype}")
            lengths = np.array([row.size for row in rows], np.int64)
            padded = np.zeros((len(rows), max(1, int(lengths.max(initial=0)))), np.int64)
            for i, row in enumerate(rows):
                padded[i, :row.size] = row
            input_ids = padded
        ids = on_device_of(input_ids, like, where, "input_ids")
        if ids.ndim != 2:
            raise ValueError(f"{where}: input_ids must be 2-D (batch, seq_len) or a list of sequences, got shape "
                             f"{tuple(ids.shape)}" + ("; for one sequence pass [input_ids]" if ids.ndim == 1 else ""))
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{where}: input_ids must hold integers, got dtype {ids.dtype}")
        B, S = ids.shape
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"{where}: the batch has {B} sequences; the KV cache holds 1 to {self.max_batch} "
                             "(max_batch)")
        if lengths is None:
            lengths = np.full(B, S, np.int64)
        else:
            lengths = as_array(lengths.get() if is_cupy(lengths) else _host_ids(lengths, where, "lengths"), where,
                               "lengths")
            if tuple(lengths.shape) != (B,) or lengths.dtype.kind not in "iu":
                raise ValueError(f"{where}: lengths must be ({B},) integers, one per row of input_ids, got shape "
                                 f"{tuple(lengths.shape)} dtype {lengths.dtype}")
        if (empty := [int(b) for b in np.flatnonzero(lengths < 1)]):
            raise ValueError(f"{where}: sequences {empty} have no token (empty prompts); each needs at least one")
        if int(lengths.max()) > S:
            raise ValueError(f"{where}: lengths go up to {int(lengths.max())} but input_ids has {S} positions")
        if int(lengths.max()) > self.max_len:
            raise ValueError(f"{where}: a prompt of {int(lengths.max())} tokens is longer than the KV cache's "
                             f"max_len {self.max_len}")
        lengths = lengths.astype(np.int64)  # after the checks: a uint64 length past 2**63 would wrap
        ids = ids[:, :int(lengths.max())]
        xp = array_module(like)
        valid = xp.arange(ids.shape[1])[None, :] < xp.asarray(lengths)[:, None]
        ids = xp.where(valid, ids, 0)  # what the padding holds is never read: token 0 there
        self._check_ids(ids, where, "input_ids")
        return ids, lengths

    # -- generation -----------------------------------------------------------------------------------------
    def stream(self, input_ids: Any, max_new_tokens: int, *, lengths: Any = None, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, eos_token_id: Any = None,
               seed: int | None = None) -> Iterator[np.ndarray]:
        """Generate up to `max_new_tokens` tokens per sequence, yielding each step's tokens as they come:
        an int64 host array (B,) per step, -1 for a sequence that has already ended. Prompts as for
        prefill (a 2-D array with `lengths`, or a list of sequences). Greedy (argmax) when temperature
        is 0; otherwise sampled from softmax(logits / temperature), after top_k (the k most likely
        tokens, ties at the k-th kept) and top_p (the most likely tokens whose probability before each
        is below top_p), Hugging Face's order, on the device's array module (CuPy on the GPU, NumPy on
        the host) with a RandomState of `seed` (None: fresh entropy). A sequence ends at its first
        token in `eos_token_id` (an id or ids; None: the config's; () never), which is yielded.
        The arguments are checked here, before anything runs; the prompt and every generated token but
        the last must fit the cache (prompt length + max_new_tokens - 1 <= max_len)."""
        return self._generation("stream", input_ids, max_new_tokens, lengths, temperature, top_k, top_p,
                                eos_token_id, seed)

    def _generation(self, name: str, input_ids: Any, max_new_tokens: Any, lengths: Any, temperature: Any,
                    top_k: Any, top_p: Any, eos_token_id: Any, seed: Any) -> Iterator[np.ndarray]:
        """stream's arguments checked, every error naming the public function `name`; the steps' iterator."""
        where = f"CausalLM.{name}"
        max_new_tokens = checks.size(where, "max_new_tokens", max_new_tokens, 0)
        sample = _Sampler(where, temperature, top_k, top_p, seed, self.config.vocab_size)
        eos = self.config.eos_token_id if eos_token_id is None else _token_ids(where, "eos_token_id", eos_token_id)
        if bad := [t for t in eos if t >= self.config.vocab_size]:
            raise ValueError(f"{where}: eos_token_id {bad} outside the vocabulary [0, {self.config.vocab_size})")
        ids, lengths = self._prompts(input_ids, lengths, name)
        if max_new_tokens and int(lengths.max()) + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"{where}: max_new_tokens {max_new_tokens} after a prompt of {int(lengths.max())} "
                             f"tokens needs {int(lengths.max()) + max_new_tokens - 1} cache positions, more than "
                             f"max_len {self.max_len}")
        return self._stream(ids, lengths, max_new_tokens, sample, np.asarray(eos, np.int64))

    def _stream(self, ids: Any, lengths: np.ndarray, max_new_tokens: int, sample: _Sampler,
                eos: np.ndarray) -> Iterator[np.ndarray]:
        if not max_new_tokens:
            return
        logits = self._prefill(ids, lengths)
        done = np.zeros(len(lengths), bool)
        for step in range(max_new_tokens):
            tokens = sample(logits)
            copy = _HostCopy(tokens)
            last = step == max_new_tokens - 1
            if not last:
                # queued before the host waits for the tokens: the GPU runs the next step while the host
                # reads these and yields them (after the last token every sequence has ended, the step
                # was computed for nothing; its cache position is within max_len all the same)
                logits = self._decode(tokens, checked=True)
            host = copy.wait()
            yield np.where(done, -1, host)
            done |= np.isin(host, eos)
            if done.all() or last:
                return

    def generate(self, input_ids: Any, max_new_tokens: int, *, lengths: Any = None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: Any = None,
                 seed: int | None = None) -> list[np.ndarray]:
        """The new tokens of each sequence (int64 host arrays, the end token included where one came),
        from `stream` with the same arguments."""
        steps = list(self._generation("generate", input_ids, max_new_tokens, lengths, temperature, top_k, top_p,
                                      eos_token_id, seed))
        if not steps:
            B = len(input_ids) if isinstance(input_ids, (list, tuple)) else input_ids.shape[0]
            return [np.zeros(0, np.int64) for _ in range(B)]
        table = np.stack(steps, axis=1)
        return [row[row >= 0] for row in table]

    def describe(self) -> list[str]:
        """What runs, and what was fused at load."""
        c = self.config
        like = self.model.embed_tokens.weight
        groups = c.num_attention_heads // c.num_key_value_heads
        attention_kind = "multi-head" if groups == 1 else f"grouped-query ({groups} query heads per KV head)"
        last = f"0-{c.num_hidden_layers - 1}" if c.num_hidden_layers > 1 else "0"
        lines = [(f"CausalLM (LLaMA): {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} "
                  f"heads of {c.head_dim}, {c.num_key_value_heads} KV heads, intermediate {c.intermediate_size}, "
                  f"vocab {c.vocab_size}, {dtypes.short_name(like.dtype)} on the {'GPU' if is_cupy(like) else 'CPU'}"),
                 (f"model.layers.{last}.self_attn: q_proj+k_proj+v_proj in one GEMM; rope on q; k rotated and "
                  f"v written into the KV cache by one kernel (kv_append); {attention_kind} attention from the cache; o_proj with the residual in its "
                  "GEMM epilogue"),
                 "model.layers.*.mlp: gate_proj+up_proj in one GEMM, swiglu, down_proj with the residual in its epilogue",
                 (f"KV cache: k and v (layers, {self.max_batch}, {self.max_len}, {c.num_key_value_heads}, {c.head_dim}), "
                  f"{memory.format_bytes(c.cache_bytes(self.max_batch, self.max_len, like.dtype))}"),
                 f"lm_head: {'tied to model.embed_tokens' if self.lm_head is None else 'its own weight'}, on each "
                 "sequence's last position only",
                 ("decode: one CUDA graph replay per step, captured per batch bucket "
                  f"{list(decode_buckets(self.max_batch))}; prefill eager" if self.decode_graphs and is_cupy(like)
                  else "eager: one launch per op")]
        if self.load_report is not None:
            lines += self.load_report.lines()
        return lines


class _DecodeStep:
    """A CausalLM's decode step as GraphedModule captures it: (tokens (B,) int64, positions (B,) int32) ->
    logits (B, vocab_size), with the model's parameters and version (new parameters drop the captures)."""

    def __init__(self, model: CausalLM):
        self.model = model

    @property
    def version(self) -> int:
        return self.model.version

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        return self.model.named_parameters(prefix)

    def __call__(self, tokens: Any, positions: Any) -> Any:
        return self.model._step_logits(tokens, positions)


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch buckets decode steps are captured for: powers of two below max_batch, and max_batch."""
    return tuple(sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch}))


class _HostCopy:
    """An int64 host copy of a (B,) token array, started now on the current stream (from the GPU into
    pinned memory, without waiting) and waited for by `wait()`."""

    def __init__(self, tokens: Any):
        if not is_cupy(tokens):
            self._host, self._done = np.asarray(tokens, np.int64), None
            return
        import cupy
        import cupyx

        self._host = cupyx.empty_pinned(tokens.shape, tokens.dtype)
        tokens.get(out=self._host, blocking=False)
        self._done = cupy.cuda.get_current_stream().record()

    def wait(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        return np.array(self._host, np.int64)  # a copy: the pinned buffer goes back to its pool


# --- sampling ----------------------------------------------------------------------------------------------
class _Sampler:
    """The next token of each row of logits (B, vocab): argmax at temperature 0, else a sample after
    temperature, top_k and top_p (Hugging Face's order), drawn by the Gumbel-max trick (argmax of the
    filtered logits / temperature plus Gumbel noise: a sample of their softmax) on the logits' array
    module, from one RandomState per generation."""

    def __init__(self, where: str, temperature: Any, top_k: Any, top_p: Any, seed: Any, vocab: int):
        if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                                     np.floating)):
            raise TypeError(f"{where}: temperature must be a number >= 0, got {type(temperature).__name__} "
                            f"{temperature!r}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"{where}: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if 0 < temperature < FLOAT32_TINY or temperature > FLOAT32_MAX:  # 0 or inf in float32: NaN scores
            raise ValueError(f"{where}: temperature must be 0 (greedy) or within float32's normal range "
                             f"[{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (the logits are divided by it in float32), "
                             f"got {temperature!r}")
        if top_k is not None:
            top_k = checks.size(where, "top_k", top_k, 1)
        if top_p is not None:
            if isinstance(top_p, (bool, np.bool_)) or not isinstance(top_p, (int, float, np.integer, np.floating)):
                raise TypeError(f"{where}: top_p must be a number in (0, 1] or None, got {type(top_p).__name__} "
                                f"{top_p!r}")
            if not 0 < top_p <= 1:  # NaN included
                raise ValueError(f"{where}: top_p must be in (0, 1], got {top_p!r}")
        seed = checks.seed(where, seed)
        if seed is not None and seed >= SEED_LIMIT:
            raise ValueError(f"{where}: seed must be below 2**32, got {seed}")
        self.temperature, self.top_k, self.top_p, self.seed = float(temperature), top_k, top_p, seed
        self.vocab = vocab
        self._random = None  # made at the first sample, on the logits' array module

    def __call__(self, logits: Any) -> Any:
        xp = array_module(logits)
        z = _as_float32(logits)
        if self.temperature == 0:
            return xp.argmax(z, axis=-1)
        # each row's largest logit subtracted first: the scaled logits are then <= 0 and a tiny temperature
        # sends the others to -inf, never the leader past float32's range (which tied every token at inf)
        z = (z - z.max(axis=-1, keepdims=True)) / np.float32(self.temperature)
        if self.top_k is not None and self.top_k < self.vocab:
            kth = xp.sort(z, axis=-1)[:, -self.top_k][:, None]
            z = xp.where(z < kth, -xp.inf, z)
        if self.top_p is not None and self.top_p < 1:
            ranked = xp.sort(z, axis=-1)[:, ::-1]
            p = xp.exp(ranked - ranked[:, :1])
            p /= p.sum(axis=-1, keepdims=True)
            kept = (xp.cumsum(p, axis=-1) - p < self.top_p).sum(axis=-1)  # at least the most likely
            cutoff = xp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)
            z = xp.where(z < cutoff, -xp.inf, z)
        if self._random is None:
            self._random = xp.random.RandomState(self.seed)
        u = self._random.random_sample(z.shape).astype(xp.float32)
        gumbel = -xp.log(-xp.log(xp.clip(u, np.float32(1e-20), np.float32(1 - 2**-24))))
        return xp.argmax(z + gumbel, axis=-1)


def _host_ids(value: Any, where: str, name: str) -> np.ndarray:
    """A list (or array) of token ids or lengths on the host; a ragged nested list is named here rather
    than by NumPy's "inhomogeneous shape"."""
    try:
        return np.asarray(value)
    except ValueError:
        raise ValueError(f"{where}: {name} must be a sequence of integers, got a ragged nested list "
                         f"{reprlib.repr(value)}") from None


def _as_float32(a: Any) -> Any:
    """a in float32 on its device; bf16 on the GPU from its bits (CuPy's arithmetic takes no bf16)."""
    xp = array_module(a)
    if is_cupy(a) and dtypes.short_name(a.dtype) == "bf16":
        return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32)


# --- helpers -----------------------------------------------------------------------------------------------
def _path_for(path: str | dict[str, str], op: str) -> str:
    """The path `op` runs on: the dict's entry, or the one name where the op has such a path (a model-wide
    "cudnn" leaves rope and swiglu, which have none, on auto)."""
    name = op_path(path, op)
    return name if name == "auto" or name in get_op(op).paths else "auto"


def _check_fits(where: str, config: Any, dtype: Any, device: str, max_batch: Any, max_len: Any,
                source: str, drawn: bool) -> tuple[int, int]:
    """The config (from `source`), dtype, device and cache size checked, and the parameters and the KV
    cache refused before anything is drawn if they would not fit; (max_batch, max_len). `drawn`: the
    parameters are drawn in float64 on the host (checks.parameters_fit); else read from a checkpoint,
    which the host holds as stored (counted as 4 bytes a value at most) beside the cast and stacked
    copies (the model's itemsize)."""
    parsed = checkpoint.check_model_arguments(where, config, LlamaConfig, dtype, device)
    max_batch = checks.size(where, "max_batch", max_batch)
    if max_len is None:
        max_len = min(DEFAULT_MAX_LEN, config.max_position_embeddings)
    max_len = checks.size(where, "max_len", max_len)
    if max_len > config.max_position_embeddings:
        raise ValueError(f"{where}: max_len {max_len} is beyond the model's max_position_embeddings "
                         f"{config.max_position_embeddings} ({source})")
    elements = config.parameter_count()
    what = (f"the model of {source} (vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
            f"{config.num_hidden_layers} layers: {elements} parameters)")
    if drawn:
        checks.parameters_fit(where, what, elements, parsed, device)
    else:
        memory.require(elements * (4 + parsed.itemsize), "cpu", where, what)
        if device != "cpu":
            memory.require(elements * parsed.itemsize, "gpu", where, what)
    memory.require(config.cache_bytes(max_batch, max_len, parsed), "cpu" if device == "cpu" else "gpu", where,
                   f"the KV cache ({max_batch} sequences of {max_len} tokens, {config.num_hidden_layers} layers, "
                   f"{config.num_key_value_heads} KV heads of {config.head_dim})")
    return max_batch, max_len


def _checkpoint_state(raw: dict[str, np.ndarray], config: LlamaConfig) -> tuple[dict[str, Any], LoadReport]:
    """The checkpoint's tensors by key, with the rotary buffers and, under tied embeddings, lm_head.weight
    set aside (reported)."""
    report = LoadReport()
    state: dict[str, Any] = {}
    for key, value in raw.items():
        if key.endswith(BUFFER_SUFFIXES) or (config.tie_word_embeddings and key == "lm_head.weight"):
            report.ignored.append(key)
            continue
        state[key] = as_array(value, "CausalLM.from_pretrained", key)
    report.ignored.sort()
    return state, report
