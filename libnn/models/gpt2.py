"""GPT-2-architecture decoders (Hugging Face's GPT2LMHeadModel: GPT-2 small to XL, DistilGPT2, DialoGPT) for
CausalLM (libnn.models.decoder: generation, the KV cache, decode graphs, sampling), which loads them from a
checkpoint directory without PyTorch or transformers:

    model = CausalLM.from_pretrained("gpt2/", dtype="fp16", device="gpu", max_batch=8, max_len=1024)

This module holds GPT2Config (Hugging Face's field names: n_embd, n_layer, n_head, n_positions, n_inner,
..., each checked) and the base model, and registers the architecture with CausalLM when imported.

The module tree carries Hugging Face's key names (transformer.wte, transformer.wpe, transformer.h.{i}.ln_1,
.attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj, transformer.ln_f). lm_head is tied to wte: a
checkpoint's lm_head.weight, if it holds one, is set aside and reported, as are the attn.bias and
attn.masked_bias buffers (the causal mask, -1e4) old checkpoints saved. A checkpoint of GPT2Model alone
(keys without "transformer.", as the original gpt2 files are) loads with the prefix added. GPT-2's Conv1D
layers store their weights (in, out); each is transposed once at load into a Linear's (out, in).

What runs, per block (pre-LayerNorm; ops in libnn.ops, each on its `auto` path):
    x  = embedding(ids, wte, type_ids=positions, type_weight=wpe)   wte[ids] + wpe[position], one op: the
                                                             positions ride in as token types, so each
                                                             sequence of a decode step reads its own row
    q, k, v = views of linear(layer_norm(x, ln_1), c_attn)    one GEMM, the bias in its epilogue
    kv_append(k, v)                                          k and v into the KV cache unrotated, one kernel
    o  = attention(q, K cache, V cache)                      scale 1/sqrt(head_dim); causal + padding lengths
                                                             (prefill), one query per sequence (decode)
    h  = linear(o, attn.c_proj, residual=x)                  bias and residual in the GEMM's epilogue
    x' = linear(linear(layer_norm(h, ln_2), c_fc, "gelu"), mlp.c_proj, residual=h)
                                                             the tanh GELU (gelu_new) in c_fc's epilogue
then ln_f and lm_head (wte's table) on each sequence's last position only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn.models.decoder import (Architecture, CausalLM, DecoderConfig, DecoderModel, Layers, LoadReport, Step,
                                  checked_model_type, layer_range, path_for, register,
                                  token_fields)
from libnn.nn import checks
from libnn.nn.basic import Embedding
from libnn.nn.linear import Linear
from libnn.nn.module import Module
from libnn.nn.norm import LayerNorm
from libnn.ops.embedding import embedding
from libnn.runtime.arrays import as_array

MODEL_TYPES = ("gpt2",)
CLASS_NAMES = ("GPT2LMHeadModel",)
# Hugging Face's activation_function → libnn.ops.linear's activation: GPT-2's "gelu_new" and its other names
# ("gelu_pytorch_tanh", "gelu_fast": the same formula) are the tanh GELU of cuBLASLt's epilogue
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu"}
OPS = ("linear", "attention", "layer_norm", "embedding", "kv_append")  # the ops a forward pass calls
# The config's sizes and the least each may be (no blocks leaves the embeddings and lm_head, still a model).
SIZES = {"vocab_size": 1, "n_positions": 1, "n_embd": 1, "n_layer": 0, "n_head": 1}
# Options Hugging Face's GPT2Config has that change the network, with the only value libnn runs and why.
FIXED = {"scale_attn_weights": (True, "the scores are scaled by 1/sqrt(head_dim)"),
         "scale_attn_by_inverse_layer_idx": (False, "no layer scales its scores by its index"),
         "add_cross_attention": (False, "a decoder with no encoder to attend to"),
         "tie_word_embeddings": (True, "lm_head is wte's table")}
PREFIX = "transformer."  # the base model's keys (GPT2Model saved alone has none)
# Checkpoint keys that are no parameters: the causal mask and its fill value, buffers old checkpoints saved.
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# The layers that are Conv1D in Hugging Face's GPT-2: weights stored (in_features, out_features).
CONV1D_SUFFIXES = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


# --- config -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPT2Config(DecoderConfig):
    """The fields of a Hugging Face GPT2Config that decide the network, under its names, with its defaults
    (GPT-2 small's); eos_token_id a tuple. CausalLM reads the sizes under LLaMA's names too (hidden_size,
    num_hidden_layers, ...), as Hugging Face's attribute_map has them. Dropout and initializer fields are
    left aside (inference); reorder_and_upcast_attn too: it changes where transformers rounds, not the
    function (libnn's attention accumulates in fp32 anyway)."""
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None          # the MLP's width; None: 4 n_embd
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int | None = 50256
    eos_token_id: tuple[int, ...] = (50256,)
    pad_token_id: int | None = None
    model_type: str = "gpt2"
    POSITIONS_FIELD = "n_positions"

    @classmethod
    def from_dict(cls, config: Any, source: str = "config") -> GPT2Config:
        """The config of a Hugging Face config.json's fields, each checked; `source` (the file) is named
        in every error. Options that would change the network to one libnn does not run are refused by
        name."""
        where = f"CausalLM: {source}"
        model_type = checked_model_type(where, config, "gpt2", MODEL_TYPES, CLASS_NAMES)
        act = config.get("activation_function", "gelu_new")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ValueError(f"{where}: activation_function {act!r} is not supported (supported: "
                             f"{list(ACTIVATIONS)}: the tanh GELU)")
        for name, (only, why) in FIXED.items():
            if config.get(name, only) is not only:
                raise ValueError(f"{where}: {name}={config[name]!r} is not supported (only {only}: {why})")
        values: dict[str, Any] = {"model_type": model_type, "activation_function": act}
        values.update({name: checks.size(where, name, config[name], minimum) for name, minimum in SIZES.items()
                       if name in config})
        if config.get("n_inner") is not None:  # null: 4 n_embd
            values["n_inner"] = checks.size(where, "n_inner", config["n_inner"])
        if "layer_norm_epsilon" in config:
            values["layer_norm_epsilon"] = checks.positive_float(where, "layer_norm_epsilon",
                                                                 config["layer_norm_epsilon"])
        values.update(token_fields(where, config))
        result = cls(**values)
        result.check(where)
        return result

    def check(self, where: str) -> None:
        """Every size an int of its range, the heads dividing n_embd, the activation one libnn runs, the
        token ids in the vocabulary (so that no layer meets a bad value first and blames itself)."""
        for name, minimum in SIZES.items():
            checks.size(where, name, getattr(self, name), minimum)
        if self.n_inner is not None:
            checks.size(where, "n_inner", self.n_inner)
        checks.positive_float(where, "layer_norm_epsilon", self.layer_norm_epsilon)
        for name, supported in (("model_type", MODEL_TYPES), ("activation_function", tuple(ACTIVATIONS))):
            if getattr(self, name) not in supported:
                raise ValueError(f"{where}: {name} {getattr(self, name)!r} is not supported (supported: "
                                 f"{list(supported)})")
        if self.n_embd % self.n_head:
            raise ValueError(f"{where}: n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        self.check_tokens(where)

    # the sizes under the names CausalLM reads (Hugging Face's attribute_map)
    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def num_key_value_heads(self) -> int:
        return self.n_head  # multi-head attention: a KV head per query head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def intermediate_size(self) -> int:
        return 4 * self.n_embd if self.n_inner is None else self.n_inner

    @property
    def tie_word_embeddings(self) -> bool:
        return True

    @property
    def activation(self) -> str:
        """libnn.ops.linear's name of the MLP's activation."""
        return ACTIVATIONS[self.activation_function]

    def parameter_count(self) -> int:
        H, I = self.n_embd, self.intermediate_size
        layer = 4 * H + (3 * H * H + 3 * H) + (H * H + H) + (H * I + I) + (I * H + H)  # 2 LayerNorms, 4 GEMMs
        return (self.vocab_size + self.n_positions) * H + self.n_layer * layer + 2 * H

    def summary(self) -> str:
        return f"{self.n_layer} layers, n_embd {self.n_embd}, n_inner {self.intermediate_size}"


# --- layers, under Hugging Face's names -------------------------------------------------------------------
class GPT2Attention(Module):
    """attn: c_attn (q, k and v in one GEMM, with bias) and c_proj."""

    def __init__(self, c: GPT2Config, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = path_for(path, "linear")
        self.c_attn = Linear(c.n_embd, 3 * c.n_embd, dtype=dtype, device=device, path=lin)
        self.c_proj = Linear(c.n_embd, c.n_embd, dtype=dtype, device=device, path=lin)


class GPT2MLP(Module):
    """mlp: c_fc with the tanh GELU in its epilogue, and c_proj."""

    def __init__(self, c: GPT2Config, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = path_for(path, "linear")
        self.c_fc = Linear(c.n_embd, c.intermediate_size, activation=c.activation, dtype=dtype, device=device,
                           path=lin)
        self.c_proj = Linear(c.intermediate_size, c.n_embd, dtype=dtype, device=device, path=lin)


class GPT2Block(Module):
    def __init__(self, c: GPT2Config, dtype: Any, device: str, path: Any):
        super().__init__()
        norm = path_for(path, "layer_norm")
        self.ln_1 = LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, dtype=dtype, device=device, path=norm)
        self.attn = GPT2Attention(c, dtype, device, path)
        self.ln_2 = LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, dtype=dtype, device=device, path=norm)
        self.mlp = GPT2MLP(c, dtype, device, path)
        self.config, self.path = c, path

    def forward(self, x: Any, step: Step, index: int) -> Any:
        """x (B, S, n_embd) → the next block's input; `step` holds the positions, the cache and the lengths
        of a prefill (S tokens per sequence) or a decode step (S = 1)."""
        c = self.config
        B, S, H = x.shape
        qkv = self.attn.c_attn(self.ln_1(x)).reshape(B, S, 3 * c.n_head, c.head_dim)  # contiguous: a view
        q, k, v = qkv[:, :, :c.n_head], qkv[:, :, c.n_head:2 * c.n_head], qkv[:, :, 2 * c.n_head:]
        o = step.attend(index, q, k, v, self.path)
        h = self.attn.c_proj(o.reshape(B, S, H), residual=x)
        return self.mlp.c_proj(self.mlp.c_fc(self.ln_2(h)), residual=h)


class GPT2Model(DecoderModel):
    """transformer: wte, wpe, h, ln_f (CausalLM's base model; see DecoderModel)."""
    EMBEDDINGS = "wte"

    def __init__(self, c: GPT2Config, dtype: Any, device: str, path: Any):
        super().__init__()
        self.wte = Embedding(c.vocab_size, c.n_embd, dtype=dtype, device=device)
        self.wpe = Embedding(c.n_positions, c.n_embd, dtype=dtype, device=device)
        self.h = Layers([GPT2Block(c, dtype, device, path) for _ in range(c.n_layer)])
        self.ln_f = LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, dtype=dtype, device=device,
                              path=path_for(path, "layer_norm"))
        self.config, self.path = c, path

    def forward(self, ids: Any, step: Step) -> Any:
        """The hidden states after the last block, (B, S, n_embd), of ids (B, S) at step.positions (B, S):
        wte[ids] + wpe[positions], one op (the embedding op's token-type rows are the positions' here),
        then the blocks. The positions are the model's own, below max_len <= n_positions."""
        x = embedding(ids, self.wte.weight, type_ids=step.positions, type_weight=self.wpe.weight,
                      path=path_for(self.path, "embedding"))
        return self.run_layers(x, step, self.h)

    def final_norm(self, rows: Any) -> Any:
        return self.ln_f(rows)

    def describe(self, placement: str) -> list[str]:
        c = self.config
        return [(f"CausalLM (GPT-2): {c.n_layer} layers, n_embd {c.n_embd}, {c.n_head} heads of {c.head_dim}, "
                 f"n_inner {c.intermediate_size}, vocab {c.vocab_size}, {c.n_positions} positions, {placement}"),
                "transformer.wte + transformer.wpe: each token's word and position rows summed in one op (embedding)",
                (f"transformer.h.{layer_range(len(self.h))}.attn: c_attn (q, k and v) in one GEMM with its bias in "
                 "the epilogue; k and v written into the KV cache by one kernel (kv_append, no rotation); multi-head "
                 "attention from the cache; c_proj with its bias and the residual in its GEMM epilogue"),
                (f"transformer.h.*.mlp: c_fc with its bias and {c.activation} ({c.activation_function!r}) in its "
                 "GEMM epilogue, c_proj with its bias and the residual in its epilogue")]


# --- loading ---------------------------------------------------------------------------------------------
def checkpoint_state(raw: dict[str, np.ndarray], model: CausalLM, context: str) -> tuple[dict[str, Any], LoadReport]:
    """The checkpoint's tensors under the module tree's keys: "transformer." added where no key has it (a
    GPT2Model checkpoint), lm_head.weight (tied to wte) and the attention buffers set aside, each Conv1D
    weight (in, out) transposed to its Linear's (out, in), contiguous: once, here. A Conv1D weight of
    another shape is named with the shape the layer expects stored; every other mismatch is load_state's
    to name. The tensors are taken out of `raw` as they are mapped, so that a stored weight is freed as
    soon as its transpose is made."""
    report = LoadReport(key_prefix=None if any(k.startswith(PREFIX) for k in raw) else PREFIX)
    expected = {key: tuple(value.shape) for key, value in model.named_parameters()}
    state: dict[str, Any] = {}
    for key in sorted(raw):
        value = as_array(raw.pop(key), "CausalLM.from_pretrained", key)
        name = key if report.key_prefix is None or key == "lm_head.weight" else report.key_prefix + key
        if name == "lm_head.weight" or name.endswith(BUFFER_SUFFIXES):
            report.ignored.append(key)
            continue
        if name.endswith(CONV1D_SUFFIXES) and name in expected:
            stored = expected[name][::-1]
            if tuple(value.shape) != stored:
                raise ValueError(f"{context}: {key} has shape {tuple(value.shape)}, the layer expects {stored} "
                                 "(a Conv1D weight, stored (in_features, out_features))")
            value = np.ascontiguousarray(value.T)
            report.transposed.append(key)
        state[name] = value
    return state, report


GPT2 = register(Architecture(model_type="gpt2", class_name="GPT2LMHeadModel", config_class=GPT2Config,
                             prefix="transformer", base_model=GPT2Model, ops=OPS, checkpoint_state=checkpoint_state))
