"""LLaMA-architecture decoders (Hugging Face's LlamaForCausalLM: Llama 2/3-style, TinyLlama, SmolLM) for
CausalLM (libnn.models.decoder: generation, the KV cache, decode graphs, sampling), which loads them from a
checkpoint directory without PyTorch or transformers:

    model = CausalLM.from_pretrained("TinyLlama-1.1B/", dtype="fp16", device="gpu", max_batch=8, max_len=2048)

This module holds LlamaConfig (Hugging Face's fields, each checked) and the base model, and registers the
architecture with CausalLM when imported.

The module tree carries Hugging Face's key names (model.embed_tokens, model.layers.{i}.input_layernorm,
.self_attn.{q,k,v}_proj, .self_attn.o_proj, .post_attention_layernorm, .mlp.{gate,up,down}_proj, model.norm,
lm_head). With tie_word_embeddings the logits reuse embed_tokens' table (a checkpoint's lm_head.weight,
if it holds one, is set aside and reported, as are the rotary inv_freq buffers old conversions saved).
At load q, k and v are stacked into one (Hq + 2 Hkv) D x H weight and gate and up into one 2I x H weight,
one GEMM each; the projections' parameters are views into them.

What runs, per decoder layer (pre-norm; ops in libnn.ops, each on its `auto` path):
    q, k, v = views of rms_norm_linear(x, input_layernorm, W_qkv)       rms_norm then one GEMM
    kv_append(k, v, q=q)                                     q and k rotated (RoPE), k and v written into
                                                             the KV cache at each token's position, one kernel
    o  = attention(q, K cache, V cache)                      causal + padding lengths (prefill); q of one
                                                             token against each sequence's cached length (decode)
    h  = linear(o, W_o, residual=x)                          the residual in the GEMM's epilogue
    a  = rms_norm_linear(h, post_attention_layernorm, W_gate_up, glu="swiglu")
    x' = linear(a, W_down, residual=h)
then rms_norm_linear(model.norm, lm_head) on each sequence's last position only. rms_norm_linear is one
kernel at batch 1 (kernels/gemv.cu: the norm staged in front of the GEMV, SwiGLU in its epilogue; FP8
weights: kernels/linear_fp8.cu's GEMV with the same fusions) and rms_norm, linear (linear_fp8) and swiglu
in turn otherwise, or where the model's path forces one of them (models.decoder.norm_then_dense). Both
residual adds sit in GEMM epilogues, so rms_norm runs plain (its residual/return_sum fusion would move the
add out of the GEMM into the norm, the same traffic).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from libnn.models.decoder import (FLOAT32_MAX, Architecture, CausalLM, DecoderConfig, DecoderModel, Layers,
                                  LoadReport, Step, checked_model_type, layer_range, norm_then_dense, path_for,
                                  register, token_fields)
from libnn.nn import checks
from libnn.nn.basic import Embedding
from libnn.nn.linear import Linear, StackedLinear, share_stacked, stack_linear
from libnn.nn.module import Module
from libnn.nn.norm import RMSNorm
from libnn.ops.embedding import embedding
from libnn.ops.rope import SCALING_TYPES, rope_frequencies
from libnn.runtime.arrays import as_array

# CausalLM: this module's since LLaMA was libnn's one decoder; the class is libnn.models.decoder's
__all__ = ["CausalLM", "LlamaConfig", "LlamaModel", "LLAMA"]

MODEL_TYPES = ("llama",)
CLASS_NAMES = ("LlamaForCausalLM",)
HIDDEN_ACTS = ("silu",)
OPS = ("linear", "attention", "rms_norm", "embedding", "kv_append", "swiglu", "rms_norm_linear")  # the ops a forward pass calls
# The config's sizes and the least each may be (no decoder layers leaves embeddings and lm_head, still a model).
SIZES = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 0, "num_attention_heads": 1,
         "num_key_value_heads": 1, "head_dim": 2, "max_position_embeddings": 1}
DERIVED = ("num_key_value_heads", "head_dim")  # sizes a config may leave null: from the heads and hidden_size
# Options Hugging Face's LlamaConfig has that change the network, with the only value libnn runs.
FIXED = {"attention_bias": False, "mlp_bias": False}
# Checkpoint keys that are no parameters: rotary inv_freq buffers (older conversions saved them).
BUFFER_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)


# --- config -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
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
    POSITIONS_FIELD = "max_position_embeddings"

    @classmethod
    def from_dict(cls, config: Any, source: str = "config") -> LlamaConfig:
        """The config of a Hugging Face config.json's fields, each checked; `source` (the file) is named
        in every error. Fields libnn does not read (initializer_range, use_cache, torch_dtype, ...) are
        left aside; options that would change the network to one libnn does not run are refused by name."""
        where = f"CausalLM: {source}"
        model_type = checked_model_type(where, config, "llama", MODEL_TYPES, CLASS_NAMES)
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
        values.update(token_fields(where, config))
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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"{where}: head_dim {self.head_dim} is odd; rotary embedding turns pairs")
        self.check_tokens(where)
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

    def summary(self) -> str:
        return (f"{self.num_hidden_layers} layers, hidden {self.hidden_size}, tie_word_embeddings="
                f"{self.tie_word_embeddings}")


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
def _stacked(owner: Module, layers: Sequence[Linear], held: str) -> StackedLinear:
    """`layers` stacked into one GEMM (nn.linear.stack_linear: float weights, or E4M3 codes with their
    scales once quantised), kept on `owner` under `held` and built anew when a layer's parameter was
    replaced (load_state_dict, to(), quantize())."""
    stacked = stack_linear(layers, getattr(owner, held, None))
    object.__setattr__(owner, held, stacked)
    return stacked


def _moved_to_gpu(owner: Module, layers: Sequence[Linear], held: str) -> None:
    """The stack of `layers` copied to the GPU whole, the layers' parameters views of the copy."""
    import cupy

    s = _stacked(owner, layers, held)
    on_gpu = [None if a is None else cupy.asarray(a) for a in (s.weight, s.bias, s.weight_scale)]
    object.__setattr__(owner, held, share_stacked(layers, *on_gpu))


class LlamaAttention(Module):
    """self_attn: q_proj, k_proj, v_proj and o_proj, no bias; q, k and v run as one GEMM."""

    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = path_for(path, "linear")
        H, D = c.hidden_size, c.head_dim
        self.q_proj = Linear(H, c.num_attention_heads * D, bias=False, dtype=dtype, device=device, path=lin)
        self.k_proj = Linear(H, c.num_key_value_heads * D, bias=False, dtype=dtype, device=device, path=lin)
        self.v_proj = Linear(H, c.num_key_value_heads * D, bias=False, dtype=dtype, device=device, path=lin)
        self.o_proj = Linear(c.num_attention_heads * D, H, bias=False, dtype=dtype, device=device, path=lin)

    def stacks(self) -> list[tuple[tuple[Linear, ...], str]]:
        """The layers stacked into one weight, and the attribute the stack is kept under."""
        return [((self.q_proj, self.k_proj, self.v_proj), "_qkv")]

    def packed(self) -> StackedLinear:
        """q_proj, k_proj and v_proj stacked: a ((Hq + 2 Hkv) D, H) weight (or codes and scales)."""
        return _stacked(self, *self.stacks()[0])


class LlamaMLP(Module):
    """mlp: gate_proj, up_proj and down_proj, no bias; gate and up run as one GEMM."""

    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = path_for(path, "linear")
        H, I = c.hidden_size, c.intermediate_size
        self.gate_proj = Linear(H, I, bias=False, dtype=dtype, device=device, path=lin)
        self.up_proj = Linear(H, I, bias=False, dtype=dtype, device=device, path=lin)
        self.down_proj = Linear(I, H, bias=False, dtype=dtype, device=device, path=lin)

    def stacks(self) -> list[tuple[tuple[Linear, ...], str]]:
        """The layers stacked into one weight, and the attribute the stack is kept under."""
        return [((self.gate_proj, self.up_proj), "_gate_up")]

    def packed(self) -> StackedLinear:
        """gate_proj and up_proj stacked: a (2I, H) weight (or codes and scales), swiglu's gate half first."""
        return _stacked(self, *self.stacks()[0])


def _normed(x: Any, norm: RMSNorm, stacked: StackedLinear, path: Any, glu: str | None = None) -> Any:
    """The stacked GEMM of norm(x), then glu: rms_norm_linear where it may run (norm_then_dense)."""
    return norm_then_dense(x, norm, stacked.weight, stacked.bias, stacked.weight_scale, path, glu)


class LlamaDecoderLayer(Module):
    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        norm = path_for(path, "rms_norm")
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, device=device, path=norm)
        self.self_attn = LlamaAttention(c, dtype, device, path)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, device=device,
                                                path=norm)
        self.mlp = LlamaMLP(c, dtype, device, path)
        self.config, self.path = c, path

    def forward(self, x: Any, step: Step, index: int) -> Any:
        """x (B, S, H) → the next layer's input; `step` holds the positions, the cache and the lengths
        of a prefill (S tokens per sequence) or a decode step (S = 1)."""
        c, path = self.config, self.path
        B, S, _ = x.shape
        Hq, Hkv = c.num_attention_heads, c.num_key_value_heads
        attn, mlp = self.self_attn, self.mlp
        qkv = _normed(x, self.input_layernorm, attn.packed(), path)
        qkv = qkv.reshape(B, S, Hq + 2 * Hkv, c.head_dim)  # contiguous: a view
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
        o = step.attend(index, q, k, v, path)   # q and k rotated there, by kv_append's one kernel
        h = attn.o_proj(o.reshape(B, S, Hq * c.head_dim), residual=x)
        a = _normed(h, self.post_attention_layernorm, mlp.packed(), path, glu="swiglu")
        return mlp.down_proj(a, residual=h)


class LlamaModel(DecoderModel):
    """model: embed_tokens, layers, norm (CausalLM's base model; see DecoderModel)."""
    EMBEDDINGS = "embed_tokens"

    def __init__(self, c: LlamaConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = Layers([LlamaDecoderLayer(c, dtype, device, path) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype, device=device,
                            path=path_for(path, "rms_norm"))
        self.config, self.path = c, path

    def forward(self, ids: Any, step: Step) -> Any:
        """The hidden states after the last layer, (B, S, hidden_size), of ids (B, S)."""
        x = embedding(ids, self.embed_tokens.weight, path=path_for(self.path, "embedding"))
        return self.run_layers(x, step, self.layers)

    def final_norm(self, rows: Any) -> Any:
        return self.norm(rows)

    def final_rms_norm(self) -> RMSNorm:
        return self.norm

    def rotary_frequencies(self) -> np.ndarray:
        return self.config.inv_freq

    def _stacks(self) -> list[tuple[Module, tuple[Linear, ...], str]]:
        return [(owner, layers, held) for layer in self.layers for owner in (layer.self_attn, layer.mlp)
                for layers, held in owner.stacks()]

    def pack(self) -> None:
        for owner, layers, held in self._stacks():
            _stacked(owner, layers, held)

    def move_packed_to_gpu(self) -> None:
        for owner, layers, held in self._stacks():
            _moved_to_gpu(owner, layers, held)

    def describe(self, placement: str) -> list[str]:
        c = self.config
        groups = c.num_attention_heads // c.num_key_value_heads
        attention_kind = "multi-head" if groups == 1 else f"grouped-query ({groups} query heads per KV head)"
        return [(f"CausalLM (LLaMA): {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} "
                 f"heads of {c.head_dim}, {c.num_key_value_heads} KV heads, intermediate {c.intermediate_size}, "
                 f"vocab {c.vocab_size}, {placement}"),
                (f"model.layers.{layer_range(len(self.layers))}.self_attn: q_proj+k_proj+v_proj in one GEMM; rope "
                 f"on q; k rotated and v written into the KV cache by one kernel (kv_append); {attention_kind} "
                 "attention from the cache; o_proj with the residual in its GEMM epilogue"),
                "model.layers.*.mlp: gate_proj+up_proj in one GEMM, swiglu, down_proj with the residual in its epilogue"]


def checkpoint_state(raw: dict[str, np.ndarray], model: CausalLM, context: str) -> tuple[dict[str, Any], LoadReport]:
    """The checkpoint's tensors by key (already the module tree's), with the rotary buffers and, under tied
    embeddings, lm_head.weight set aside (reported). Every other mismatch is load_state's to name."""
    report = LoadReport()
    state: dict[str, Any] = {}
    for key, value in raw.items():
        if key.endswith(BUFFER_SUFFIXES) or (model.config.tie_word_embeddings and key == "lm_head.weight"):
            report.ignored.append(key)
            continue
        state[key] = as_array(value, "CausalLM.from_pretrained", key)
    report.ignored.sort()
    return state, report


LLAMA = register(Architecture(model_type="llama", class_name="LlamaForCausalLM", config_class=LlamaConfig,
                              prefix="model", base_model=LlamaModel, ops=OPS, checkpoint_state=checkpoint_state))
