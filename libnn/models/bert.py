"""BERT encoders from Hugging Face checkpoints: a directory with config.json and model.safetensors
(or a sharded model.safetensors.index.json), read without PyTorch or transformers.

    model = BertEncoder.from_pretrained("all-MiniLM-L6-v2/", dtype="fp16", device="gpu")
    out = model(input_ids, attention_mask)        # ids from any tokenizer, NumPy or CuPy
    out.last_hidden_state, out.pooled, out.pooler_output

The module tree carries Hugging Face's key names (embeddings.word_embeddings, encoder.layer.{i}.
attention.self.query, ..., pooler.dense), so a checkpoint loads through Module.load_state_dict: every
key and shape is checked before anything changes. A "bert." prefix (BertFor... checkpoints) is
stripped; the task heads those checkpoints carry (cls.*, classifier.*, qa_outputs.*) and the
position_ids buffer are set aside and listed in `load_report`; old checkpoints' LayerNorm.gamma/beta
are read as weight/bias. Anything else that does not match is an error naming the keys.

What runs, per layer (see `describe()`): q, k and v in ONE GEMM on a packed (3H, H) weight, bias in
its epilogue, and attention on strided views of its output; the other three GEMMs with bias (and the
intermediate activation, where the GEMM's epilogue has it) fused; residual add, then LayerNorm. The
packed QKV weight is built at load (nn.linear.stack_linear); query/key/value's parameters then become
views into it, so the weights are held once, and it is rebuilt whenever they are replaced
(load_state_dict, to(), quantize()).

`model.quantize("fp8")` holds every Linear's weight as E4M3 codes with float32 scales (per output
channel, or per tensor with per_channel=False) and runs its GEMMs on linear_fp8: the packed QKV weight
is then the three layers' codes stacked, with their scales stacked alongside (a per-tensor scale
repeated over its layer's rows). Embeddings, LayerNorms and biases keep the model's dtype.

An attention_mask whose rows are each tokens followed by padding (right padding, what tokenizers
produce) becomes the attention op's sequence lengths, anything else an additive -inf bias. A row with
no token at all pools to zeros (Hugging Face averages every position there); its hidden states stay
finite (BertEncoder.forward says how).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.models import checkpoint
from libnn.nn import checks
from libnn.nn.basic import Embedding
from libnn.nn.functional import (TokenPacking, key_padding_and_tokens, on_device_of, op_path,
                                 masked_mean, packed_self_attention)
from libnn.nn.graphs import SequenceInputs, token_bucket
from libnn.nn.linear import Linear, StackedLinear, stack_linear
from libnn.nn.module import Module, uninitialised
from libnn.nn.norm import LayerNorm
from libnn.ops.embedding import embedding
from libnn.ops.linear import FUSED_ACTIVATIONS
from libnn.registry import get_op
from libnn.runtime.arrays import array_module, as_array, is_cupy, min_max

MODEL_TYPES = ("bert",)
# Hugging Face's hidden_act → libnn's activation. HF's "gelu" is the exact erf GELU; its tanh
# approximations ("gelu_new", "gelu_pytorch_tanh", "gelu_fast": one formula) are libnn's "gelu".
HIDDEN_ACTS = {"gelu": "gelu_erf", "relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
               "gelu_fast": "gelu"}
POSITION_EMBEDDING_TYPES = ("absolute",)
# The config's sizes and the least each may be (no encoder layers leaves the embeddings, still a model).
SIZES = {"vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 0, "num_attention_heads": 1, "intermediate_size": 1,
         "max_position_embeddings": 1, "type_vocab_size": 1}
# Unpadding packs the tokens when their rows are at most this share of the padded positions: it adds
# gathers (the hidden state in and out; without THD attention also, per layer, q, k, v out to the
# padded layout and the attention's output back, about a quarter of a layer's memory traffic), so
# near-full batches run padded.
PACKED_AT_MOST = 0.875
# ... and when the padded batch's forward pass would take at least this many FLOPs: a graphed call
# reads the token count back (a synchronisation, and the GPU idles while the host picks the capture),
# and a small batch's short, latency-bound GEMMs gain little from fewer rows, so below this the
# padded pass is faster (benchmarks/RESULTS.md, unpadding: MiniLM at batch 32 is below, BERT-base at
# batch 32 above).
PACK_FROM_FLOPS = 3e11
TASK_HEADS = ("cls", "classifier", "qa_outputs")  # BertFor...'s heads: set aside at load
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")  # constant buffers some checkpoints hold


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BertConfig that decide the network, with HF's defaults."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    position_embedding_type: str = "absolute"
    model_type: str = "bert"

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: str = "config") -> BertConfig:
        """The config of a Hugging Face config.json's fields, each checked; `source` (the file) is
        named in every error."""
        where = f"BertEncoder: {source}"
        if not isinstance(config, dict):
            raise TypeError(f"{where} must be a JSON object of the config's fields by name, got "
                            f"{type(config).__name__}")
        model_type = config.get("model_type", "bert")
        if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
            raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {list(MODEL_TYPES)})")
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise ValueError(f"{where}: a BERT decoder (is_decoder / add_cross_attention) is not supported; "
                             "BertEncoder runs the bidirectional encoder")
        act = config.get("hidden_act", "gelu")
        if not isinstance(act, str) or act not in HIDDEN_ACTS:
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: {list(HIDDEN_ACTS)})")
        position = config.get("position_embedding_type", "absolute")
        if not isinstance(position, str) or position not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"{where}: position_embedding_type {position!r} is not supported (supported: "
                             f"{list(POSITION_EMBEDDING_TYPES)})")
        if config.get("embedding_size", config.get("hidden_size")) != config.get("hidden_size"):
            raise ValueError(f"{where}: embedding_size {config['embedding_size']} differs from hidden_size "
                             f"{config['hidden_size']} (an ALBERT/ELECTRA-style projection), which is not supported")
        known = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in config]
        if missing:
            raise ValueError(f"{where} lacks {missing}")
        values = {k: v for k, v in config.items() if k in known}
        values.update(model_type=model_type, hidden_act=act, position_embedding_type=position)
        result = cls(**values)
        result.check(where)
        return result

    def check(self, where: str) -> None:
        """Every size an int of its range, eps a positive number, the heads dividing the width (so that
        no layer constructor meets them first and blames itself)."""
        for name, minimum in SIZES.items():
            checks.size(where, name, getattr(self, name), minimum)
        if self.pad_token_id is not None:
            checks.size(where, "pad_token_id", self.pad_token_id, minimum=None)
        checks.positive_float(where, "layer_norm_eps", self.layer_norm_eps)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{where}: hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")

    @property
    def flops_per_token(self) -> int:
        """The FLOPs of the encoder layers' GEMMs per position (q, k, v and output projections, the two
        feed-forward GEMMs; 2 per multiply-add): what packing saves for each padding position."""
        H, I = self.hidden_size, self.intermediate_size
        return 2 * self.num_hidden_layers * (4 * H * H + 2 * H * I)

    def parameter_count(self, pooler: bool) -> int:
        """The number of values in the model's parameters."""
        H, I = self.hidden_size, self.intermediate_size
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size + 2) * H
        layer = 4 * H * (H + 1) + 2 * H * I + I + 5 * H  # q, k, v, output; intermediate, output; 2 LayerNorms
        return embeddings + self.num_hidden_layers * layer + pooler * H * (H + 1)

    @property
    def activation(self) -> str:
        return HIDDEN_ACTS[self.hidden_act]


@dataclass
class LoadReport:
    """What from_pretrained did with the checkpoint's keys besides loading them."""
    files: list[str] = field(default_factory=list)
    prefix_stripped: str | None = None
    renamed: dict[str, str] = field(default_factory=dict)   # checkpoint key -> module key
    ignored: list[str] = field(default_factory=list)        # task heads and buffers, set aside

    def lines(self) -> list[str]:
        out = [f"loaded from {', '.join(self.files)}"]
        if self.prefix_stripped:
            out.append(f"stripped the key prefix {self.prefix_stripped!r}")
        if self.renamed:
            out.append(f"renamed {len(self.renamed)} keys (LayerNorm gamma/beta → weight/bias)")
        if self.ignored:
            out.append(f"ignored {len(self.ignored)} task-head/buffer keys: {', '.join(self.ignored)}")
        return out


@dataclass
class BertOutput:
    """last_hidden_state (B, S, H); pooled: the mean of each sequence's unmasked tokens (B, H), the
    sentence embedding; pooler_output: tanh(pooler.dense(first token)) (B, H), or None without a
    pooler. Also readable as out["last_hidden_state"]."""
    last_hidden_state: Any
    pooled: Any
    pooler_output: Any = None

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]


# --- the module tree, with Hugging Face's names -----------------------------------------------------
class BertEmbeddings(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        pad = c.pad_token_id if c.pad_token_id is not None and 0 <= c.pad_token_id < c.vocab_size else None
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size, padding_idx=pad, dtype=dtype, device=device)
        self.position_embeddings = Embedding(c.max_position_embeddings, c.hidden_size, dtype=dtype, device=device)
        self.token_type_embeddings = Embedding(c.type_vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype, device=device,
                                   path=op_path(path, "layer_norm"))
        # one path name for the whole model ("cudnn", "cublaslt") that the embedding op lacks leaves it on
        # auto, as the gather it replaced had no path at all
        self.path = op_path(path, "embedding")
        if self.path not in get_op("embedding").paths:
            self.path = "auto"

    def forward(self, input_ids: Any, token_type_ids: Any) -> Any:
        """word + position + token type (None: type 0, Hugging Face's default), then LayerNorm, in one
        op (one kernel on the GPU). The tables are read straight: BertEncoder.forward has checked the
        ids' ranges already (one synchronisation for all of them, where each Embedding would take its own)."""
        norm = self.LayerNorm
        return embedding(input_ids, self.word_embeddings.weight, position_weight=self.position_embeddings.weight,
                         type_ids=token_type_ids, type_weight=self.token_type_embeddings.weight,
                         norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps, normalize=True, path=self.path)


class BertSelfAttention(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        lin = op_path(path, "linear")
        for name in ("query", "key", "value"):
            setattr(self, name, Linear(c.hidden_size, c.hidden_size, dtype=dtype, device=device, path=lin))
        self.num_heads, self.path = c.num_attention_heads, path
        self._packed: StackedLinear | None = None

    def packed(self) -> StackedLinear:
        """query, key and value stacked (stack_linear): the (3H, H) weight (E4M3 codes with (3H,) scales
        once quantised) and (3H,) bias, built once: the three layers' parameters are then views into
        them (the weights are held once), and a replaced parameter (load_state_dict, to(), quantize())
        makes the next call build them again."""
        self._packed = stack_linear((self.query, self.key, self.value), self._packed)
        return self._packed

    def forward(self, x: Any, seq_lens_kv: Any, bias: Any, packing: TokenPacking | None = None) -> Any:
        qkv = self.packed()
        return packed_self_attention(x, qkv.weight, qkv.bias, self.num_heads, seq_lens_kv=seq_lens_kv, bias=bias,
                                     path=self.path, packing=packing, w_scale=qkv.weight_scale)


class _DenseLayerNorm(Module):
    """dense, then LayerNorm of (its output + the residual): BertSelfOutput and BertOutput."""

    def __init__(self, in_features: int, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.dense = Linear(in_features, c.hidden_size, dtype=dtype, device=device, path=op_path(path, "linear"))
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype, device=device,
                                   path=op_path(path, "layer_norm"))

    def forward(self, x: Any, residual: Any) -> Any:
        return self.LayerNorm(self.dense(x, residual=residual))  # the residual added in the GEMM's epilogue


class BertAttention(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.self = BertSelfAttention(c, dtype, device, path)
        self.output = _DenseLayerNorm(c.hidden_size, c, dtype, device, path)

    def forward(self, x: Any, seq_lens_kv: Any, bias: Any, packing: TokenPacking | None = None) -> Any:
        return self.output(self.self(x, seq_lens_kv, bias, packing), x)


class BertIntermediate(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.dense = Linear(c.hidden_size, c.intermediate_size, activation=c.activation, dtype=dtype, device=device,
                            path=op_path(path, "linear"))

    def forward(self, x: Any) -> Any:
        return self.dense(x)


class BertLayer(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.attention = BertAttention(c, dtype, device, path)
        self.intermediate = BertIntermediate(c, dtype, device, path)
        self.output = _DenseLayerNorm(c.intermediate_size, c, dtype, device, path)

    def forward(self, x: Any, seq_lens_kv: Any, bias: Any, packing: TokenPacking | None = None) -> Any:
        """x (B, S, H), or with `packing` the packed tokens (capacity, H): every layer but the attention
        works row by row, and the attention takes the packing (packed_self_attention)."""
        x = self.attention(x, seq_lens_kv, bias, packing)
        return self.output(self.intermediate(x), x)


class _Layers(Module):
    """encoder.layer.{i}."""

    def __init__(self, layers: list[Module]):
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __getitem__(self, index: int) -> Module:
        return self._children[str(index)]

    def __iter__(self):
        return iter(self._children.values())

    def __len__(self) -> int:
        return len(self._children)


class _Encoder(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.layer = _Layers([BertLayer(c, dtype, device, path) for _ in range(c.num_hidden_layers)])


class BertPooler(Module):
    def __init__(self, c: BertConfig, dtype: Any, device: str, path: Any):
        super().__init__()
        self.dense = Linear(c.hidden_size, c.hidden_size, dtype=dtype, device=device, path=op_path(path, "linear"))

    def forward(self, hidden: Any) -> Any:
        return array_module(hidden).tanh(self.dense(hidden[:, 0]))  # tanh: no GEMM epilogue has it


class BertEncoder(Module):
    """A BERT encoder (Hugging Face's BertModel) for inference. Build it from a checkpoint directory
    with `from_pretrained`, or from a BertConfig (random weights) for tests.

    `unpad=True` (the default) computes only the tokens: with an attention_mask, the embeddings' rows
    of the tokens are packed together, every GEMM, LayerNorm and activation runs on those rows alone,
    and the attention runs on the packed sequences (attention layout "THD", on cuDNN, for fp16/bf16;
    otherwise q, k and v are gathered out to the padded (B, S) layout for it and its output gathered
    back). A batch padded to twice its tokens then costs about half. Only batches large
    enough to win it back are packed (PACK_FROM_FLOPS) and only when packing saves at least an eighth
    of the rows (PACKED_AT_MOST); the others run every position. last_hidden_state at the padding is
    then no defined value: zeros where the batch was packed (as PyTorch's nested-tensor encoders
    give), what Hugging Face computes there where it ran padded (values no token reads; zeroing them
    would cost small batches a pass). Every token's value, pooled, and pooler_output, which reads each
    row's first position, wherever that is a token (left padding puts padding there), are the same
    either way. `unpad=False` runs every position, as Hugging Face does."""

    def __init__(self, config: BertConfig, *, pooler: bool = True, dtype: Any = "fp32", device: str = "cpu",
                 path: str | dict[str, str] = "auto", unpad: bool = True):
        super().__init__()
        _check_fits("BertEncoder", config, pooler, dtype, device, "the config")
        checks.path("BertEncoder", path, ("linear", "attention", "layer_norm", "embedding"), per_op=True)
        self.config, self.path = config, path
        self.unpad = checks.flag("BertEncoder", "unpad", unpad)
        self.embeddings = BertEmbeddings(config, dtype, device, path)
        self.encoder = _Encoder(config, dtype, device, path)
        self.pooler = BertPooler(config, dtype, device, path) if pooler else None
        self.load_report: LoadReport | None = None
        self._pack()

    @property
    def graph_sequence_inputs(self) -> SequenceInputs:
        """For graphed(seq_buckets=...): sequences are padded with zeros at positions attention_mask
        marks 0 (forward's second parameter); only last_hidden_state has the sequence dimension to
        slice back. pooled averages the unmasked tokens and pooler_output reads the first: padding
        changes neither. With `unpad`, graphs pass forward's `max_tokens`."""
        return SequenceInputs(mask="attention_mask", mask_position=1, outputs=("last_hidden_state",),
                              tokens="max_tokens" if self.unpad else None, pack_from=self._pack_from())

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, dtype: Any = "fp32", device: str = "cpu",
                        path: str | dict[str, str] = "auto", unpad: bool = True) -> BertEncoder:
        """Load config.json and model.safetensors from `directory` into a BertEncoder in `dtype`
        ("fp32", "fp16", "bf16", ...) on `device` ("cpu" or "gpu"). `path` goes to every op ("auto",
        "reference", ...) or is a dict by op name; `unpad` as for the constructor. Raises, naming the
        keys, if the checkpoint's weights do not match the config."""
        where = "BertEncoder.from_pretrained"
        directory, config_file, config_json = checkpoint.read_config(directory, where)
        config = BertConfig.from_dict(config_json, str(config_file))
        # refused before the checkpoint is read: the model is built on the host, then moved
        _check_fits(where, config, True, dtype, device, str(config_file))
        raw, files = checkpoint.read_tensors(directory, where, others=("*.bin", "*.h5"))
        state, report = _checkpoint_state(raw)
        report.files = files
        with uninitialised():  # every parameter is replaced by the checkpoint's, or the load fails
            model = cls(config, pooler=any(k.startswith("pooler.") for k in state), dtype=dtype, device="cpu",
                        path=path, unpad=unpad)
        checkpoint.load_state(model, state, f"{where}({str(directory)!r}): the checkpoint does not match its config "
                                            f"({config.num_hidden_layers} layers, hidden {config.hidden_size})")
        model.load_report = report
        return model.to(device) if device != "cpu" else model

    def load_state_dict(self, state: dict[str, Any], *, assign: bool = False) -> None:
        super().load_state_dict(state, assign=assign)
        self._pack()

    def to(self, target: Any) -> BertEncoder:
        super().to(target)
        self._pack()
        return self

    def quantize(self, dtype: str = "fp8", *, per_channel: bool = True) -> BertEncoder:
        """Every Linear's weight in `dtype` ("fp8": E4M3 codes, float32 scales; see Module.quantize), in
        place, and the packed QKV weights stacked again from the codes."""
        super().quantize(dtype, per_channel=per_channel)
        self._pack()
        return self

    def _pack(self) -> None:
        """Build the packed QKV weights now rather than in the next forward pass, so that the
        parameters are final before anything (a CUDA graph capture) records their addresses."""
        for layer in self.encoder.layer:
            layer.attention.self.packed()

    def forward(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                max_tokens: int | None = None) -> BertOutput:
        """input_ids (B, S) integers; attention_mask (B, S), 1/True for a token and 0/False for
        padding; token_type_ids (B, S) (default all 0). Host arrays are moved to the model's device.
        With `unpad` (see the class), `max_tokens` is the number of rows the tokens are packed into
        (default: token_bucket of their count); graphed() passes it, as a capture cannot read the
        count back. A mask with more tokens than `max_tokens` is refused.

        A row with no token (all padding: a fixed-size batch's unused rows, say) stays finite, never
        NaN. Computed padded, its attention reads its first position alone, as the key lengths are
        taken as at least 1 (decided once per call, with no synchronisation of its own, so that the
        attention need not zero batch entries without a key after every layer); Hugging Face attends
        to every position uniformly there, so the two differ in such a row. Packed (`unpad`), it has no
        packed rows, and its hidden states are zeros. The rows with tokens are the same either way, and
        `pooled` is zeros for such a row."""
        like = self.embeddings.word_embeddings.weight
        c = self.config
        input_ids = self._ids(input_ids, "input_ids", like)
        B, S = input_ids.shape
        if S > c.max_position_embeddings:
            raise ValueError(f"BertEncoder: input_ids has {S} tokens per sequence but the model has "
                             f"{c.max_position_embeddings} positions (max_position_embeddings)")
        if token_type_ids is not None:
            token_type_ids = self._ids(token_type_ids, "token_type_ids", like, (B, S))
        _check_ranges({"input_ids": (input_ids, c.vocab_size, "vocab_size"),
                       "token_type_ids": (token_type_ids, c.type_vocab_size, "type_vocab_size")})
        valid = lens = bias = tokens = None
        if attention_mask is not None:
            mask = on_device_of(attention_mask, like, "BertEncoder", "attention_mask")
            if tuple(mask.shape) != (B, S):
                raise ValueError(f"BertEncoder: attention_mask must have input_ids' shape {(B, S)}, got "
                                 f"{tuple(mask.shape)}")
            if mask.dtype != np.bool_ and mask.dtype.kind not in "iu":
                raise TypeError(f"BertEncoder: attention_mask must be boolean or integer (1 = token, 0 = padding), "
                                f"got dtype {mask.dtype}")
            # lengths of at least 1: the attention then has no batch entry without a key to zero after each layer
            valid, lens, bias, tokens = key_padding_and_tokens(mask, like.dtype, nonempty=True)
        x = self.embeddings(input_ids, token_type_ids)
        packing = self._packing(valid, tokens, max_tokens)
        h = x if packing is None else packing.pack(x)
        for layer in self.encoder.layer:
            h = layer(h, lens, bias, packing)
        x = h if packing is None else packing.unpack(h)
        return BertOutput(x, _mean_pool(x, valid), None if self.pooler is None else self.pooler(x))

    def _packing(self, valid: Any, tokens: int | None, max_tokens: Any) -> TokenPacking | None:
        """How this call packs its tokens, or None to run every position: without `unpad` or a mask,
        below _pack_from() positions (unless `max_tokens` is given), when packing would save
        less than PACKED_AT_MOST of the positions, and while a graph is captured without `max_tokens`
        (the count cannot be read back there)."""
        if max_tokens is not None:
            max_tokens = checks.size("BertEncoder", "max_tokens", max_tokens)
            if tokens is not None and tokens > max_tokens:
                raise ValueError(f"BertEncoder: attention_mask holds {tokens} tokens but max_tokens is {max_tokens}; "
                                 "pass at least the number of tokens, or None")
        positions = 0 if valid is None else valid.shape[0] * valid.shape[1]
        if not self.unpad or valid is None or (max_tokens is None and positions < self._pack_from()):
            return None
        if max_tokens is not None:
            capacity = max_tokens
        elif tokens is not None:
            capacity = token_bucket(tokens, positions)
        else:  # captured without max_tokens: the count cannot be read back
            return None
        if capacity > PACKED_AT_MOST * positions:
            return None
        return TokenPacking(valid, capacity, ragged=self._ragged_attention())

    def _pack_from(self) -> int:
        """The fewest positions (batch × sequence) whose padded forward pass takes PACK_FROM_FLOPS."""
        return max(1, math.ceil(PACK_FROM_FLOPS / self.config.flops_per_token))

    def _ragged_attention(self) -> bool:
        """Whether the packed tokens' attention runs packed (layout THD, on cuDNN: fp16/bf16, a head
        dimension that is a multiple of 8, the attention path auto or cudnn, cuDNN present); else q, k
        and v are unpacked for it."""
        like = self.embeddings.word_embeddings.weight
        c = self.config
        return (is_cupy(like) and dtypes.short_name(like.dtype) in ("fp16", "bf16")
                and (c.hidden_size // c.num_attention_heads) % 8 == 0
                and op_path(self.path, "attention") in ("auto", "cudnn")
                and get_op("attention").paths["cudnn"].missing() is None)

    @staticmethod
    def _ids(a: Any, name: str, like: Any, shape: tuple[int, int] | None = None) -> Any:
        a = on_device_of(a, like, "BertEncoder", name)
        if a.ndim != 2:
            raise ValueError(f"BertEncoder: {name} must be 2-D (batch, seq_len), got shape {tuple(a.shape)}"
                             + (f"; for one sequence pass {name}[None]" if a.ndim == 1 else ""))
        if a.dtype.kind not in "iu":
            raise TypeError(f"BertEncoder: {name} must hold integers, got dtype {a.dtype}")
        if shape is not None and tuple(a.shape) != shape:
            raise ValueError(f"BertEncoder: {name} must have input_ids' shape {shape}, got {tuple(a.shape)}")
        return a

    def describe(self) -> list[str]:
        """What runs, and what was fused at load."""
        c = self.config
        act = c.activation
        act_where = ("in the GEMM epilogue" if act in FUSED_ACTIVATIONS else
                     "a pass after cuBLASLt's GEMM")
        heads = f"{c.num_attention_heads} heads of {c.hidden_size // c.num_attention_heads}"
        last = f"0-{c.num_hidden_layers - 1}" if c.num_hidden_layers > 1 else "0"
        dtype = dtypes.short_name(self.embeddings.word_embeddings.weight.dtype)
        lines = [(f"BertEncoder: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads}, intermediate "
                  f"{c.intermediate_size}, {dtype}"),
                 "embeddings: word + position + token_type and LayerNorm in one op (one kernel on the GPU)",
                 (f"encoder.layer.{last}.attention.self: query+key+value fused into one packed "
                  f"({3 * c.hidden_size}x{c.hidden_size}) GEMM with its bias in the epilogue; attention on "
                  "strided BSHD views of its output (no copies)"),
                 "encoder.layer.*.attention.output.dense: bias and the residual in the GEMM epilogue; LayerNorm",
                 f"encoder.layer.*.intermediate.dense: bias in the GEMM epilogue; {act} ({c.hidden_act!r}) {act_where}",
                 "encoder.layer.*.output.dense: bias and the residual in the GEMM epilogue; LayerNorm",
                 ("unpadded (large, well-padded batches): the layers compute the tokens alone, packed; the "
                  "attention runs on the packed sequences (THD) on cuDNN, else on them gathered to the padded layout"
                  if self.unpad else "padded: every position is computed")]
        if self.pooler is not None:
            lines.append("pooler.dense: bias in the GEMM epilogue, tanh after")
        quantized = sorted({m.quantized for m in self.modules() if isinstance(m, Linear) and m.quantized})
        if quantized:
            lines.append(f"Linear weights in {', '.join(quantized)} (E4M3 codes, float32 scales): their GEMMs, the "
                         "packed QKV one included, run linear_fp8")
        if self.load_report is not None:
            lines += self.load_report.lines()
        return lines


# --- helpers ----------------------------------------------------------------------------------------
def _check_fits(where: str, config: Any, pooler: bool, dtype: Any, device: str, source: str) -> None:
    """The config (from `source`), dtype and device checked, and the parameters refused before any is
    drawn if they would not fit (the host builds them all, even for the GPU)."""
    parsed = checkpoint.check_model_arguments(where, config, BertConfig, dtype, device)
    elements = config.parameter_count(checks.flag(where, "pooler", pooler))
    checks.parameters_fit(where, f"the model of {source} (vocab_size={config.vocab_size}, hidden_size="
                                 f"{config.hidden_size}, {config.num_hidden_layers} layers: {elements} parameters)",
                          elements, parsed, device)


def _check_ranges(checks: dict[str, tuple[Any, int, str]]) -> None:
    """Each ids array (None: skipped) within [0, upper): one synchronisation for all of them on the
    GPU, none while a CUDA graph is captured (its warm-up passes checked them)."""
    present = {name: c for name, c in checks.items() if c[0] is not None and c[0].size}
    if not present:
        return
    ranges = min_max([ids for ids, _, _ in present.values()])
    for (name, (_, upper, what)), (lo, hi) in zip(present.items(), ranges or []):
        if lo < 0 or hi >= upper:
            raise ValueError(f"BertEncoder: {name} must lie in [0, {upper}) ({what} {upper}), got values from "
                             f"{int(lo)} to {int(hi)}")


def _mean_pool(x: Any, valid: Any) -> Any:
    """The mean of each sequence's unmasked tokens (of every position without a mask), accumulated in
    float32 (float64 on the host); a row with no token gives zeros, not NaN."""
    if valid is not None:
        return masked_mean(x, valid)
    xp = array_module(x)
    return x.astype(xp.float32 if is_cupy(x) else np.float64).mean(axis=1).astype(x.dtype)


def _checkpoint_state(raw: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], LoadReport]:
    """The checkpoint's tensors under the module tree's keys: the "bert." prefix stripped, LayerNorm
    gamma/beta renamed, task heads and buffers set aside."""
    report = LoadReport()
    state: dict[str, np.ndarray] = {}
    prefixed = any(k.startswith("bert.") for k in raw)
    for key, value in raw.items():
        name = key[len("bert."):] if prefixed and key.startswith("bert.") else key
        if name.split(".")[0] in TASK_HEADS or name in BUFFERS:
            report.ignored.append(key)
            continue
        if name.endswith((".gamma", ".beta")):
            renamed = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
            report.renamed[key] = name = renamed
        if name in state:
            raise ValueError(f"BertEncoder.from_pretrained: the checkpoint holds {name!r} twice (with and without "
                             "the 'bert.' prefix, or as gamma/beta and weight/bias)")
        state[name] = as_array(value, "BertEncoder.from_pretrained", key)
    report.prefix_stripped = "bert." if prefixed else None
    report.ignored.sort()
    return state, report
