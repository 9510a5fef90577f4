"""Text generation with decoder-only transformers, whatever their architecture: CausalLM, with a preallocated
KV cache, read from a checkpoint directory (config.json and model.safetensors, or shards listed by
model.safetensors.index.json) without PyTorch or transformers.

    model = CausalLM.from_pretrained("TinyLlama-1.1B/", dtype="fp16", device="gpu", max_batch=8, max_len=2048)
    tokens = model.generate([[1, 15043, 29892], [1, 450]], max_new_tokens=32)   # one array per sequence
    for step in model.stream(ids, 32, lengths=lens, temperature=0.8, top_p=0.95, seed=0): ...

Architectures (each in its module, which registers it here when imported; libnn.models imports every
one, as libnn.ops imports every op for the registry):
    llama   Hugging Face's LlamaForCausalLM (Llama 2/3-style, TinyLlama, SmolLM)   libnn.models.llama
    gpt2    Hugging Face's GPT2LMHeadModel                                        libnn.models.gpt2
from_pretrained picks one by config.json's model_type (without one, by its `architectures`; with
neither, LLaMA's, whose config then names what it refuses), CausalLM(config) by the config's class.
An Architecture gives its config class (Hugging Face's fields, each checked), its base model (a
DecoderModel: the embeddings, the layers and the final norm under Hugging Face's names and key prefix,
"model" or "transformer") and how a checkpoint's keys map onto them. Everything else is here, shared:
the module tree is the base model and lm_head (None where it is tied to the word embeddings), loaded
through Module.load_state_dict (every key, shape and dtype checked before anything changes: a model is
never half-loaded), and every logit comes from the final norm and lm_head on each sequence's last
position only.

KV cache: k and v are each (layers, max_batch, max_len, Hkv, D) in the model's dtype (BSHD per layer:
the layout of the QKV projection's output: kv_append writes each token's k, rotated where the
architecture has rotary embeddings, and its v into its sequence's row at its position, prefill and decode
alike, and attention reads the cache as a strided BSHD view), for `max_batch` sequences of up to
`max_len` tokens, allocated zeroed at the first prefill (anew after new parameters or a move) and refused
before allocation when it would not fit (from_pretrained and the constructor check it first too).
Sequence b of a batch lives in row b; `lengths` per sequence say how many positions of its row are
filled, so one batch holds prompts of different lengths (right-padded input_ids: tokens first, then
anything). Decode appends one token per sequence at its own position (position = its current length)
and attends with seq_lens_kv = the new lengths.

Decode steps as CUDA graphs (the default on the GPU, `decode_graphs=True`): a step launched op by op from
Python costs about ten launches per layer of host time, far more than the GPU's work at small batches, so
each step is one replay of a graph captured per batch bucket (1, 2, 4, ... up to max_batch; a batch pads up
to its bucket) through libnn.nn.graphs.GraphedModule. The graph reads the step's tokens and positions
from its input buffers (copied in per step, a few bytes), and the cache is one fixed buffer, so one
capture serves every step and every position. A bucket's padding rows repeat the last real sequence's
token and position and write into cache rows no sequence of the batch owns. The first step of a bucket
captures it (one eager pass with every check, warm-ups, the capture). New parameters or a move drop the
graphs with the cache. `decode_graphs=False` runs every step eagerly; prefill is always eager.
`generate` and `stream` queue each step before reading the last one's tokens back; however a generation
ends, the cache then holds the prompt and every generated token but the last. `quantize("fp8")` puts the
projections in E4M3 (linear_fp8).

Paged KV cache (`kv_layout="paged"`, `page_size` a power of two, default 64): k and v are each a pool of
pages per layer, (layers, pages + 1, Hkv, page_size, D) (per layer the container cuDNN's paged attention
reads, (pages, Hkv, page_size, D)), and a page table (max_batch, ceil(max_len / page_size)) int32 on the
model's device lists each cache row's pages. Pages are handed out on demand from a free list on the host:
a prefill gives every page back and takes ceil(length / page_size) for each prompt, and a decode step takes
one for a sequence whose new token starts a page, before the step runs (a graph replay reads the table
from its fixed buffer, updated in place, a few bytes, only when a page was taken, copied from pinned memory
on the stream: a step that takes a page queues without waiting for the GPU, as one that takes none). The
pool holds `kv_pages` pages, by default max_batch * ceil(max_len / page_size), every row's worst case, so
that a page is always free; the sequences' pages interleave as they grow, which is what the page table is
for. A smaller pool is shared by the batch's sequences as they grow: what a call could need is refused
before it runs (a prefill's prompts, generate's prompts and every token but the last, a decode step's new
pages), naming the pages, and the model stays usable. Page `pages` is a spare page that every table entry
not handed out names: the prompt's padding positions past a sequence's last page and a graph bucket's
padding rows write there, and no sequence reads it. kv_append writes through the table, and attention reads
through it (cuDNN's SDPA on the GPU, or for a decode step the custom split-K kernel, which reads pages of 64
tokens or more; the pages gathered in NumPy on the reference path). The dense cache is the default.

The reference path runs the whole model on the host (device="cpu", dtype fp32 or fp64): every op's
float64 reference, what the CPU tests compare against independent NumPy models.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from libnn import dtypes
from libnn.models import checkpoint
from libnn.nn import checks
from libnn.nn.functional import dense, gather_rows, on_device_of, op_path
from libnn.nn.graphs import GraphedModule
from libnn.nn.linear import Linear
from libnn.nn.module import Module, uninitialised
from libnn.nn.norm import RMSNorm
from libnn.ops.argmax import argmax
from libnn.ops.attention import CheckedLengths, CheckedPageTable, attention
from libnn.ops.kv_append import kv_append
from libnn.ops.rms_norm_linear import rms_norm_linear
from libnn.ops.swiglu import swiglu
from libnn.registry import get_op
from libnn.runtime import memory
from libnn.runtime.arrays import array_module, as_array, is_cupy, min_max

DEFAULT_MAX_LEN = 2048   # the cache's length when from_pretrained is given none (at most the model's positions)
# a config.json with neither model_type nor an architecture libnn runs is read as LLaMA's (the first
# architecture, whose config defaults to it), and its checks name what they refuse
DEFAULT_MODEL_TYPE = "llama"
SEED_LIMIT = 2**32       # NumPy's and CuPy's RandomState take seeds below this
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest positive normal float32
KV_LAYOUTS = ("dense", "paged")
DEFAULT_PAGE_SIZE = 64  # a paged cache's tokens per page when none is given (cuDNN's own tests use 32 to 128)
PAGED_ATTENTION_PATHS = ("auto", "cudnn", "reference")  # attention's paths that read paged k and v
PAGED_GPU_DTYPES = ("fp16", "bf16")  # cuDNN's paged attention's


# --- configs -------------------------------------------------------------------------------------------------
class DecoderConfig:
    """What CausalLM reads of an architecture's config (a frozen dataclass of Hugging Face's fields with
    this as its base): vocab_size, hidden_size, num_hidden_layers, num_key_value_heads, head_dim,
    tie_word_embeddings, eos_token_id (a tuple), bos_token_id and pad_token_id (or None), the positions
    under the field POSITIONS_FIELD names; from_dict(fields, source) and check(where), which refuse what
    the architecture does not run; parameter_count(); summary(), the sizes a checkpoint's keys depend on,
    for its errors."""
    POSITIONS_FIELD: ClassVar[str]  # the config's field of the model's positions, which max_len must not pass

    @property
    def max_positions(self) -> int:
        return getattr(self, self.POSITIONS_FIELD)

    def cache_bytes(self, max_batch: int, max_len: int, dtype: Any, page_size: int | None = None,
                    pages: int | None = None) -> int:
        """The KV cache's bytes: k and v for every layer, sequence, position, KV head; paged (`page_size`),
        `pages` pages (default every sequence's positions rounded up to whole pages) and the spare page."""
        positions = (max_batch * max_len if page_size is None else
                     paged_positions(max_batch, max_len, page_size, pages))
        elements = 2 * self.num_hidden_layers * positions * self.num_key_value_heads * self.head_dim
        return elements * dtypes.parse(dtype).itemsize

    def check_tokens(self, where: str) -> None:
        """eos_token_id a tuple, and every token id the config names within the vocabulary."""
        if not isinstance(self.eos_token_id, (tuple, list)):
            raise TypeError(f"{where}: eos_token_id must be a tuple of token ids (from_dict makes one of an id or "
                            f"a list), got {type(self.eos_token_id).__name__} {self.eos_token_id!r}")
        named = [(name, getattr(self, name)) for name in ("bos_token_id", "pad_token_id")]
        for name, value in named + [("eos_token_id", value) for value in self.eos_token_id]:
            if value is not None and not 0 <= checks.size(where, name, value, None) < self.vocab_size:
                raise ValueError(f"{where}: {name} {value} is outside the vocabulary [0, {self.vocab_size})")


def _check_fields(where: str, config: Any) -> None:
    """config.json's value must be an object of fields."""
    if not isinstance(config, dict):
        raise TypeError(f"{where} must be a JSON object of the config's fields by name, got {type(config).__name__}")


def checked_model_type(where: str, config: Any, default: str, model_types: tuple[str, ...],
                       class_names: tuple[str, ...]) -> str:
    """The checks every architecture's config starts with, each error naming `where`: config.json's value
    is an object of fields, its model_type (`default` where absent) one of `model_types`, its
    architectures (where given) one of `class_names`, and it is no quantized checkpoint. The model type."""
    _check_fields(where, config)
    model_type = config.get("model_type", default)
    if model_type not in model_types:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {list(model_types)})")
    _check_architectures(where, config, class_names)
    _refuse_quantized(where, config)
    return model_type


def _check_architectures(where: str, config: dict, supported: tuple[str, ...]) -> None:
    """config.json's `architectures`, where given, must name one of the `supported` classes: a causal LM
    with its lm_head."""
    architectures = config.get("architectures")
    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise TypeError(f"{where}: architectures must be a list of class names, got {architectures!r}")
    if not set(architectures) & set(supported):
        raise ValueError(f"{where}: architectures {architectures} are not supported (supported: {list(supported)}: "
                         "a causal LM with its lm_head)")


def _refuse_quantized(where: str, config: dict) -> None:
    """A quantization_config other than null is refused, naming its method."""
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(f"{where}: quantized checkpoints (quantization_config of method {method!r}) are not "
                         "supported; libnn loads fp32, fp16 and bf16 weights")


def token_ids(where: str, name: str, value: Any) -> tuple[int, ...]:
    """An id, a list of ids (Llama 3 lists several end tokens) or None (no end token), as a tuple."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    return tuple(checks.size(where, name, v, 0) for v in items)


def token_fields(where: str, config: dict) -> dict[str, Any]:
    """The special tokens config.json gives (bos_token_id, pad_token_id: an id or null; eos_token_id: an
    id, a list or null), each checked, for a config's constructor."""
    values: dict[str, Any] = {}
    for name in ("bos_token_id", "pad_token_id"):
        if name in config:
            values[name] = None if config[name] is None else checks.size(where, name, config[name], 0)
    if "eos_token_id" in config:
        values["eos_token_id"] = token_ids(where, "eos_token_id", config["eos_token_id"])
    return values


# --- architectures ------------------------------------------------------------------------------------------
class DecoderModel(Module):
    """An architecture's base model (Hugging Face's LlamaModel, GPT2Model) under CausalLM, which calls it
    (x, the hidden states, (B, S, hidden_size); `step` the forward pass's Step):
      - forward(ids, step) → x after the last layer: the embeddings, then every layer with the step;
      - final_norm(rows) → the normalized hidden rows lm_head reads;
      - final_rms_norm() → that norm where it is an RMSNorm with a weight, which lm_head's GEMM then takes
        in front (norm_then_dense: rms_norm_linear), else None (the default);
      - word_embeddings → the (vocab, hidden) table: a tied lm_head, and the model's dtype and device;
      - rotary_frequencies() → the rotary inv_freq (host float32), or None: k enters the cache unrotated;
      - pack() and move_packed_to_gpu(): weights stacked at load (several layers' weights in one GEMM),
        built now, and moved whole before CausalLM.to("gpu") moves the rest (the layers' parameters
        stay views into them); by default there are none;
      - describe(placement) → the lines of describe() up to lm_head, the first naming the architecture."""
    EMBEDDINGS: ClassVar[str]  # the word embeddings' module: a tied lm_head is "<prefix>.<EMBEDDINGS>"

    @property
    def word_embeddings(self) -> Any:
        return getattr(self, self.EMBEDDINGS).weight

    def rotary_frequencies(self) -> np.ndarray | None:
        return None

    @staticmethod
    def run_layers(x: Any, step: Step, layers: Iterable[Module]) -> Any:
        """x through `layers` in turn, each called as layer(x, step, index)."""
        for index, layer in enumerate(layers):
            x = layer(x, step, index)
        return x

    def pack(self) -> None:
        """Build the stacked weights now (none by default)."""

    def move_packed_to_gpu(self) -> None:
        """Move the stacked weights whole to the GPU (none by default)."""

    def final_norm(self, rows: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define final_norm()")

    def final_rms_norm(self) -> RMSNorm | None:
        return None

    def describe(self, placement: str) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} does not define describe()")


@dataclass
class LoadReport:
    """What from_pretrained did with the checkpoint's keys besides loading them."""
    files: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)      # buffers, and lm_head.weight where tied
    key_prefix: str | None = None                         # added to keys saved from the base model alone
    transposed: list[str] = field(default_factory=list)   # weights stored (in, out), made (out, in)

    def lines(self) -> list[str]:
        out = [f"loaded from {', '.join(self.files)}"]
        if self.key_prefix:
            out.append(f"added the key prefix {self.key_prefix!r} (a checkpoint of the base model alone)")
        if self.transposed:
            out.append(f"transposed {len(self.transposed)} Conv1D weights from (in, out) to Linear's (out, in)")
        if self.ignored:
            out.append(f"ignored {len(self.ignored)} keys (tied lm_head, buffers): {', '.join(self.ignored)}")
        return out


@dataclass(frozen=True)
class Architecture:
    """An architecture CausalLM runs, as its module registers it (`register`)."""
    model_type: str                # config.json's model_type
    class_name: str                # Hugging Face's class, as config.json's architectures names it
    config_class: type             # a DecoderConfig dataclass
    prefix: str                    # the base model's name in the module tree (Hugging Face's base_model_prefix)
    base_model: Callable[..., DecoderModel]  # (config, dtype, device, path) → the base model
    ops: tuple[str, ...]           # the ops a forward pass calls (a path dict may name them)
    # (the checkpoint's tensors by key, the model they load into (uninitialised), the context of load
    # errors) → (its state under the model's keys, the report): what is set aside, renamed or transposed
    checkpoint_state: Callable[[dict[str, np.ndarray], "CausalLM", str], tuple[dict[str, Any], LoadReport]]


ARCHITECTURES: dict[str, Architecture] = {}  # by model_type, in the order their modules registered them


def register(architecture: Architecture) -> Architecture:
    """Add `architecture` to those CausalLM runs (its module does, when imported)."""
    ARCHITECTURES[architecture.model_type] = architecture
    return architecture


def architecture_of(config: Any) -> Architecture:
    """The architecture whose config class `config` is an instance of."""
    for architecture in ARCHITECTURES.values():
        if isinstance(config, architecture.config_class):
            return architecture
    names = [a.config_class.__name__ for a in ARCHITECTURES.values()]
    raise TypeError(f"CausalLM: config must be a {' or a '.join(names)} (built by its from_dict(...)), got "
                    f"{type(config).__name__}")


def architecture_for(config: Any, source: str) -> Architecture:
    """The architecture the fields of a config.json (from `source`, named in errors) ask for: its model_type;
    without one, the first of its architectures libnn runs; with neither, DEFAULT_MODEL_TYPE's."""
    where = f"CausalLM: {source}"
    _check_fields(where, config)
    model_type = config.get("model_type")
    if model_type is None:
        names = config.get("architectures")
        names = names if isinstance(names, list) else []
        model_type = next((a.model_type for a in ARCHITECTURES.values() if a.class_name in names), DEFAULT_MODEL_TYPE)
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {list(ARCHITECTURES)})")
    return ARCHITECTURES[model_type]


def path_for(path: str | dict[str, str], op: str) -> str:
    """The path `op` runs on: the dict's entry, or the one name where the op has such a path (a model-wide
    "cudnn" leaves rope and swiglu, which have none, on auto)."""
    name = op_path(path, op)
    return name if name == "auto" or name in get_op(op).paths else "auto"


# what rms_norm_linear computes, op by op (a quantised Linear's GEMM takes linear's path too: nn.functional.dense)
COMPOSED_OPS = ("rms_norm", "linear", "swiglu")


def fused_norm_path(path: str | dict[str, str]) -> str | None:
    """rms_norm_linear's path under a model's `path`: its own entry in a dict; None where the spec forces a
    path on rms_norm, linear or swiglu (a dict entry, or one name that one of them has and rms_norm_linear
    has not, such as "cudnn"), so that the model runs those ops on the paths asked for; else "auto"."""
    own = get_op("rms_norm_linear").paths
    if isinstance(path, dict) and "rms_norm_linear" not in path:
        forced = any(op_path(path, op) != "auto" for op in COMPOSED_OPS)
    else:
        name = op_path(path, "rms_norm_linear")
        forced = name not in ("auto", *own) and any(name in get_op(op).paths for op in COMPOSED_OPS)
    return None if forced else path_for(path, "rms_norm_linear")


def norm_then_dense(x: Any, norm: RMSNorm, weight: Any, bias: Any, w_scale: Any, path: str | dict[str, str],
                    glu: str | None = None) -> Any:
    """dense(norm(x)) for a Linear's weight in either form (nn.functional.dense: E4M3 codes with w_scale),
    then swiglu where glu: one rms_norm_linear call (one kernel at batch 1) where the norm has a weight
    and `path` leaves the choice to it (fused_norm_path); otherwise the norm, the GEMM and swiglu in
    turn, each on its own path."""
    fused = fused_norm_path(path)
    if norm.weight is not None and fused is not None:
        return rms_norm_linear(x, norm.weight, weight, bias, w_scale=w_scale, eps=norm.eps, glu=glu, path=fused)
    y = dense(norm(x), weight, bias, w_scale=w_scale, path=path_for(path, "linear"))
    return swiglu(y, path=path_for(path, "swiglu")) if glu else y


class Layers(Module):
    """A base model's numbered layers (model.layers.{i}, transformer.h.{i})."""

    def __init__(self, layers: list[Module]):
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._children.values())

    def __len__(self) -> int:
        return len(self._children)


# --- the KV cache and one forward pass's inputs ---------------------------------------------------------------
def _zeroed_pair(shape: tuple[int, ...], like: Any) -> tuple[Any, Any]:
    """Two zeroed arrays of `like`'s dtype on its device, made as unsigned integers of the element's width
    (zero bits are 0.0 in every dtype, and CuPy makes no bf16 array)."""
    xp, bits = array_module(like), f"u{like.dtype.itemsize}"
    return xp.zeros(shape, bits).view(like.dtype), xp.zeros(shape, bits).view(like.dtype)


class KVCache:
    """k and v, each (layers, max_batch, max_len, Hkv, D), zeroed once; written by kv_append, k rotated
    on the way where the model has rotary embeddings. Sequence b owns row b whole: `begin` and `extend`
    have nothing to hand out."""

    def __init__(self, c: DecoderConfig, max_batch: int, max_len: int, like: Any):
        shape = (c.num_hidden_layers, max_batch, max_len, c.num_key_value_heads, c.head_dim)
        self.k, self.v = _zeroed_pair(shape, like)
        self.max_batch, self.max_len = max_batch, max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def begin(self, lengths: np.ndarray) -> None:
        """A prefill's prompts of `lengths` replace the cache's sequences (rows 0..B-1 are theirs)."""

    def extend(self, lengths: np.ndarray) -> None:
        """Room for each sequence's first lengths[b] positions (a row holds max_len)."""

    def store(self, layer: int, step: Step, q: Any, k: Any, v: Any, path: str) -> tuple[Any, Any, Any, Any]:
        """Write this pass's k (rotated where step.inv_freq is given) and v into layer `layer`'s cache rows
        0..B-1 at their tokens' positions; return the keys and values attention reads, its page table
        (None: dense) and q (rotated by the same kernel where step.inv_freq is given): the prefill's window
        (B, S, Hkv, D), or for a decode step every sequence's whole row (B, max_len, Hkv, D), its length in
        step.seq_lens_kv. The positions are the model's own (prefill: 0..S-1; decode: each sequence's
        length, below max_len by the checks of CausalLM._decode), so kv_append need not read them back."""
        B, S = k.shape[:2]
        keys, values = self.k[layer, :B], self.v[layer, :B]
        q = _rotated_q(q, kv_append(k, v, step.positions, step.inv_freq, keys, values, q=_q_for(q, step),
                                    checked=True, path=path))
        return (keys[:, :S], values[:, :S], None, q) if step.causal else (keys, values, None, q)


def _q_for(q: Any, step: Step) -> Any:
    """q for kv_append to rotate with k: where the step has rotary frequencies (none: GPT-2's learned
    positions, q goes to attention as it is)."""
    return None if step.inv_freq is None else q


def _rotated_q(q: Any, rotated: Any) -> Any:
    return q if rotated is None else rotated


def paged_positions(max_batch: int, max_len: int, page_size: int, pages: int | None = None) -> int:
    """A paged cache's positions per layer: `pages` pages (default max_batch rows of whole pages, every
    sequence's longest), and the spare page."""
    return ((worst_case_pages(max_batch, max_len, page_size) if pages is None else pages) + 1) * page_size


def worst_case_pages(max_batch: int, max_len: int, page_size: int) -> int:
    """The pages that max_batch sequences of max_len tokens hold: a pool of them never runs out."""
    return max_batch * -(-max_len // page_size)


def pages_for(lengths: np.ndarray, page_size: int) -> int:
    """The pages that sequences of `lengths` tokens hold together."""
    return int((-(-np.asarray(lengths, np.int64) // page_size)).sum())


class PagedKVCache:
    """k and v, each a pool (layers, pages + 1, Hkv, page_size, D) zeroed once, and a page table
    (max_batch, max_pages) int32 on the model's device whose row b lists the pages of the sequence in
    cache row b; pages handed out from a free list on the host (see the module docstring): `pages` of
    them (CausalLM's kv_pages; worst_case_pages: a page is always free). Page `pages` is the spare:
    every entry not handed out names it. kv_append writes through the table, attention reads through it;
    both take the model's word for its entries (handed out here, in range)."""

    def __init__(self, c: DecoderConfig, max_batch: int, max_len: int, page_size: int, pages: int, like: Any):
        self.max_batch, self.max_len, self.page_size, self.pages = max_batch, max_len, page_size, pages
        self.max_pages = -(-max_len // page_size)
        shape = (c.num_hidden_layers, self.pages + 1, c.num_key_value_heads, page_size, c.head_dim)
        self.k, self.v = _zeroed_pair(shape, like)
        self._host = np.full((max_batch, self.max_pages), self.pages, np.int32)  # the table, kept on the host
        # the table the ops read: one buffer for the cache's life (a decode graph captures its address),
        # the host table itself on the reference path
        self.table = on_device_of(self._host, like, "CausalLM", "page_table")
        self._upload_to = None if self.table is self._host else _QueuedUpload(self.table)
        self._held = np.zeros(max_batch, np.int64)  # pages each row holds, in table order
        self._free: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.table.nbytes

    def begin(self, lengths: np.ndarray) -> None:
        """A prefill's prompts of `lengths` (B,) replace the cache's sequences: every page back on the free
        list (lowest first), every entry the spare, then each prompt's pages (which the caller has checked
        the pool holds: CausalLM._refuse_unless_pages_fit)."""
        self._free = list(range(self.pages - 1, -1, -1))
        self._host[:] = self.pages
        self._held[:] = 0
        self._take(lengths, "CausalLM.prefill")
        self._upload()

    def extend(self, lengths: np.ndarray) -> None:
        """Pages for each sequence's first lengths[b] positions (a decode step: its length + 1), the table
        uploaded where one was taken; refused, nothing taken, where the free pages are too few."""
        if self._take(lengths, "CausalLM.decode_step"):
            self._upload()

    def _take(self, lengths: np.ndarray, where: str) -> bool:
        """Pages from the free list, row by row, until row b holds ceil(lengths[b] / page_size); whether
        any was taken. Only the rows that grow are visited: most decode steps take no page. Where the free
        list holds fewer than they need, a ValueError and nothing taken."""
        needed = -(-np.asarray(lengths, np.int64) // self.page_size)
        held = self._held[:len(needed)]
        growing = np.flatnonzero(needed > held)
        if growing.size and (wanted := int((needed[growing] - held[growing]).sum())) > len(self._free):
            raise ValueError(f"{where}: sequences {growing.tolist()} need {wanted} new page{'s' * (wanted > 1)} of "
                             f"{self.page_size} tokens but {len(self._free)} of the paged KV cache's {self.pages} "
                             "(kv_pages) are free; a new prefill with fewer or shorter sequences, or a model with more "
                             "kv_pages")
        for b in growing.tolist():
            for j in range(int(held[b]), int(needed[b])):
                self._host[b, j] = self._free.pop()
            held[b] = needed[b]
        return bool(growing.size)

    def _upload(self) -> None:
        """The host table into the ops' buffer, in place (a decode graph reads its address), queued on the
        current stream behind the work already there, the host not waiting for it (_QueuedUpload); nothing
        on the reference path, whose ops read the host table itself."""
        if self._upload_to is not None:
            self._upload_to(self._host)

    def store(self, layer: int, step: Step, q: Any, k: Any, v: Any, path: str) -> tuple[Any, Any, Any, Any]:
        """As KVCache.store, through rows 0..B-1 of the page table: return layer `layer`'s pools as
        (pages + 1, page_size, Hkv, D) views (attention's BSHD order), the table (B, max_pages), the keys
        attention reads for each sequence being its pages' first seq_lens_kv rows, and q."""
        B = k.shape[0]
        keys, values = (pool[layer].transpose(0, 2, 1, 3) for pool in (self.k, self.v))
        table = self.table[:B]
        q = _rotated_q(q, kv_append(k, v, step.positions, step.inv_freq, keys, values, q=_q_for(q, step),
                                    page_table=table, checked=True, path=path))
        return keys, values, CheckedPageTable(table), q


class _QueuedUpload:
    """Host arrays copied into one device array in place, each copy queued on the current stream without
    the host waiting for the GPU. From pageable memory cudaMemcpyAsync may synchronize with the stream to
    stage the copy (CUDA's API synchronization behaviour), which at a paged decode step that takes a page
    would hold the host until the GPU had run every step queued before it. So each copy reads a pinned
    copy of its own (CuPy's pinned memory pool), held until its event says the copy has run: the host
    array changes at the next page taken, possibly while this copy is still queued, and a pinned buffer
    rewritten under a queued copy would upload the later values."""

    def __init__(self, target: Any):
        self.target = target
        self._queued: list[tuple[Any, np.ndarray]] = []  # (the copy's event, its pinned source), oldest first

    def __call__(self, host: np.ndarray) -> None:
        import cupy
        import cupyx

        self._queued = [(done, source) for done, source in self._queued if not done.done]  # a query, no wait
        source = cupyx.empty_pinned(host.shape, host.dtype)
        source[...] = host
        stream = cupy.cuda.get_current_stream()
        self.target.set(source, stream=stream)
        self._queued.append((stream.record(), source))


@dataclass
class Step:
    """What every layer of one forward pass reads: the tokens' positions (B, S) int32 (the cache's rows,
    rope's and learned positions' rows), rope's frequencies (None: no rotary embedding), the attention's
    masks and the cache."""
    positions: Any
    inv_freq: Any
    cache: KVCache | PagedKVCache
    causal: bool                  # prefill (causal, top-left) or a decode step (one query, no mask)
    seq_lens_q: Any = None
    seq_lens_kv: Any = None

    def attend(self, layer: int, q: Any, k: Any, v: Any, path: str | dict[str, str]) -> Any:
        """k and v (B, S, Hkv, D) into layer `layer`'s cache, then q's (B, S, Hq, D) attention over the
        cache: o (B, S, Hq, D), causal with padding lengths at prefill, one query per sequence against its
        cached length at a decode step. With rotary frequencies q and k come unrotated: kv_append rotates
        both in one launch as it writes k."""
        keys, values, pages, q = self.cache.store(layer, self, q, k, v, path_for(path, "kv_append"))
        return attention(q, keys, values, causal=self.causal, seq_lens_q=self.seq_lens_q,
                         seq_lens_kv=self.seq_lens_kv, layout="BSHD", page_table=pages,
                         path=path_for(path, "attention"))


# --- the model --------------------------------------------------------------------------------------------
class CausalLM(Module):
    """A decoder-only causal language model for generation, with a KV cache for `max_batch` sequences of
    up to `max_len` tokens (see the module docstring). Build it from a checkpoint with `from_pretrained`,
    or from an architecture's config (LlamaConfig, GPT2Config: random weights) for tests.

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

    def __init__(self, config: DecoderConfig, *, dtype: Any = "fp32", device: str = "cpu", max_batch: int = 1,
                 max_len: int | None = None, path: str | dict[str, str] = "auto", init: bool = True,
                 decode_graphs: bool = True, kv_layout: str = "dense", page_size: int | None = None,
                 kv_pages: int | None = None):
        """A model of `config` (its class picks the architecture) with random weights (PyTorch's default
        initialisers; norm weights 1), or with `init=False` uninitialised ones, for a loader that replaces
        every parameter (from_pretrained: no values are drawn, and the host memory check counts no
        float64 draws). `kv_layout` "dense" (the default) or "paged" with `page_size` tokens a page (a
        power of two; default DEFAULT_PAGE_SIZE) in a pool of `kv_pages` pages (default max_batch *
        ceil(max_len / page_size), every sequence's longest; fewer are shared as the sequences grow): see
        the module docstring."""
        super().__init__()
        architecture = architecture_of(config)
        init = checks.flag("CausalLM", "init", init)
        self.decode_graphs = checks.flag("CausalLM", "decode_graphs", decode_graphs)
        self.page_size = _page_size("CausalLM", kv_layout, page_size)
        max_batch, max_len, self.kv_pages = _check_fits("CausalLM", config, architecture, dtype, device, max_batch,
                                                        max_len, "the config", init, self.page_size, kv_pages)
        checks.path("CausalLM", path, architecture.ops, per_op=True)
        _check_paged("CausalLM", self.page_size, path, dtype, device)
        self.architecture, self.config, self.path = architecture, config, path
        self.max_batch, self.max_len = max_batch, max_len
        with contextlib.nullcontext() if init else uninitialised():
            setattr(self, architecture.prefix, architecture.base_model(config, dtype, device, path))
            self.lm_head = None if config.tie_word_embeddings else Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device,
                path=path_for(path, "linear"))
        self.load_report: LoadReport | None = None
        self._reset()

    # -- loading ---------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, *, dtype: Any = "fp16", device: str = "gpu", max_batch: int = 1,
                        max_len: int | None = None, path: str | dict[str, str] = "auto",
                        decode_graphs: bool = True, kv_layout: str = "dense",
                        page_size: int | None = None, kv_pages: int | None = None) -> CausalLM:
        """Load config.json and model.safetensors (or the shards model.safetensors.index.json lists) from
        `directory` into a CausalLM of the architecture its config names, in `dtype` ("fp16", "bf16",
        "fp32"; "fp64" too on the CPU) on `device` ("gpu" or "cpu"), with a KV cache for `max_batch`
        sequences of `max_len` tokens (default min(2048, the model's positions)); `decode_graphs`,
        `kv_layout`, `page_size` and `kv_pages` as for the constructor. The parameters and the cache are refused
        before anything is read if they would not fit; a key, shape or dtype that does not match the
        config is an error naming the file and the keys, and nothing is kept."""
        where = "CausalLM.from_pretrained"
        directory, config_file, config_json = checkpoint.read_config(directory, where)
        architecture = architecture_for(config_json, str(config_file))
        config = architecture.config_class.from_dict(config_json, str(config_file))
        pages = _page_size(where, kv_layout, page_size)
        _check_fits(where, config, architecture, dtype, device, max_batch, max_len, str(config_file), False, pages,
                    kv_pages)
        checks.path(where, path, architecture.ops, per_op=True)  # before the checkpoint is read, not after
        _check_paged(where, pages, path, dtype, device)
        checks.flag(where, "decode_graphs", decode_graphs)
        # each tensor in the shard its weight_map names
        raw, files = checkpoint.read_tensors(directory, where, others=("*.bin", "*.pth"), check_placement=True)
        # every parameter is replaced by the checkpoint's, or the load fails
        model = cls(config, dtype=dtype, device="cpu", max_batch=max_batch, max_len=max_len, path=path, init=False,
                    decode_graphs=decode_graphs, kv_layout=kv_layout, page_size=page_size, kv_pages=kv_pages)
        context = (f"{where}({str(directory)!r}): the checkpoint ({', '.join(files)}) does not match its config "
                   f"({config.summary()})")
        state, report = architecture.checkpoint_state(raw, model, context)
        report.files = files
        checkpoint.load_state(model, state, context)
        model.load_report = report
        del raw, state  # the checkpoint's arrays: the stacked weights and the cast copies hold what is kept
        return model.to(device) if device != "cpu" else model

    @property
    def base_model(self) -> DecoderModel:
        """The architecture's base model (self.model for LLaMA, self.transformer for GPT-2)."""
        return getattr(self, self.architecture.prefix)

    def load_state_dict(self, state: dict[str, Any], *, assign: bool = False) -> None:
        super().load_state_dict(state, assign=assign)
        self._prepare()

    def to(self, target: Any) -> CausalLM:
        """Move (or cast) the parameters; weights the architecture stacks at load (LLaMA's q, k and v,
        gate and up) move to the GPU whole, their layers' views with them. The KV cache is made anew
        (empty) in the new place."""
        if isinstance(target, str) and target in ("gpu", "cuda"):
            checks.device("CausalLM.to", target)
            self.base_model.move_packed_to_gpu()
        super().to(target)
        self._prepare()
        return self

    def quantize(self, dtype: str = "fp8", *, per_channel: bool = True) -> CausalLM:
        """Every projection's weight as E4M3 codes with float32 scales (Module.quantize: per output channel
        by default), stacked ones (q, k, v; gate and up) restacked as codes and scales, lm_head too
        unless it is tied to the word embeddings, which stay in the model's dtype as the norms and the
        KV cache do. The cache and the decode graphs are made anew. Needs a GPU of compute capability
        8.9 or newer (or the CPU's reference path)."""
        super().quantize(dtype, per_channel=per_channel)
        self._prepare()
        return self

    def _prepare(self) -> None:
        """After new parameters: the stacked weights built now rather than at the next forward pass (so
        that the parameters are final before anything records their addresses), the cache emptied."""
        self.base_model.pack()
        self._reset()

    def _reset(self) -> None:
        """No sequence in the cache; the cache itself (and the rotary frequencies) made at the next
        prefill, on the parameters' device, in their dtype."""
        self._cache: KVCache | PagedKVCache | None = None  # its memory goes back before a new one is drawn
        self._decode_graph: GraphedModule | None = None  # its captures bake in the cache's address
        self._inv_freq = None
        self._lengths = np.zeros(self.max_batch, np.int64)  # filled positions per cache row (host)
        self._batch = 0  # sequences of the last prefill; 0: none

    @property
    def _table(self) -> Any:
        """The word embeddings: the model's dtype and device."""
        return self.base_model.word_embeddings

    def _ready_cache(self) -> KVCache | PagedKVCache:
        """The KV cache, made (zeroed) the first time, refused first if it would not fit."""
        if self._cache is None:
            like = self._table
            memory.require(self.config.cache_bytes(self.max_batch, self.max_len, like.dtype, self.page_size,
                                                   self.kv_pages),
                           "gpu" if is_cupy(like) else "cpu", "CausalLM",
                           "the KV cache (" + cache_summary(self.max_batch, self.max_len, self.page_size, self.kv_pages)
                           + ")")
            inv_freq = self.base_model.rotary_frequencies()
            self._inv_freq = None if inv_freq is None else on_device_of(inv_freq, like, "CausalLM", "inv_freq")
            self._cache = (KVCache(self.config, self.max_batch, self.max_len, like) if self.page_size is None else
                           PagedKVCache(self.config, self.max_batch, self.max_len, self.page_size, self.kv_pages,
                                        like))
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
        xp = array_module(self._table)
        lens = CheckedLengths(xp.asarray(lengths, dtype=xp.int32))
        positions = xp.broadcast_to(xp.arange(S, dtype=xp.int32), (B, S))
        cache = self._ready_cache()
        self._lengths[:], self._batch = 0, 0  # the old sequences are gone even if this pass fails
        cache.begin(lengths)
        step = Step(positions, self._inv_freq, cache, causal=True, seq_lens_q=lens, seq_lens_kv=lens)
        x = self.base_model(ids, step)
        last = gather_rows(x.reshape(B * S, -1), xp.asarray(np.arange(B) * S + lengths - 1, dtype=xp.int32))
        logits = self._logits(last)
        self._lengths[:B], self._batch = lengths, B
        return logits

    def decode_step(self, tokens: Any, *, check_ids: bool = True) -> Any:
        """Append tokens (B,), one per sequence of the last prefill, each at its sequence's own position,
        and return the logits of the next token, (B, vocab_size), an array of the caller's (the decode
        graph's own output is copied: the next step overwrites it). The token ids are checked against the
        vocabulary, which reads them back (one synchronisation a step: the host then waits for the GPU
        every step); `check_ids=False` is the caller's word that they lie in [0, vocab_size) (the argmax
        of this model's logits, say), and the step is queued without waiting. An id out of range then
        gives NaN logits for its sequence (the embedding's GPU paths write NaN rows), never a read
        outside the table."""
        checks.flag("CausalLM.decode_step", "check_ids", check_ids)
        logits = self._decode(tokens, checked=not check_ids)
        return logits.copy() if self._decode_graph is not None else logits

    def _decode(self, tokens: Any, checked: bool) -> Any:
        if not self._batch:
            raise RuntimeError("CausalLM.decode_step: no sequence to extend; call prefill (or generate) first")
        like = self._table
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
        self._ready_cache().extend(positions + 1)  # (paged) a page for each token that starts one
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
        # at + 1 >= 1 (the bucket's padding rows repeat a real row's position): vouched nonempty, the
        # attention binds no kernel zeroing rows without keys
        step = Step(at[:, None], self._inv_freq, self._ready_cache(), causal=False,
                    seq_lens_kv=CheckedLengths(at + 1, nonempty=True))
        x = self.base_model(tokens[:, None], step)
        return self._logits(x.reshape(B, -1))

    def _logits(self, rows: Any) -> Any:
        """(B, vocab_size) from the last hidden rows (B, H): the final norm, then lm_head (the word
        embeddings when tied)."""
        head = (self._table, None, None) if self.lm_head is None else \
            (self.lm_head.weight, self.lm_head.bias, self.lm_head.weight_scale)
        if (norm := self.base_model.final_rms_norm()) is not None:
            return norm_then_dense(rows, norm, *head, self.path)
        return dense(self.base_model.final_norm(rows), *head[:2], w_scale=head[2], path=path_for(self.path, "linear"))

    def _refuse_unless_pages_fit(self, where: str, lengths: np.ndarray, what: str) -> None:
        """A paged cache's pool holds the pages of sequences of `lengths` tokens, or a ValueError naming
        `what` needs them; nothing to check for the dense cache, whose rows are all allocated."""
        if self.page_size is None or (needed := pages_for(lengths, self.page_size)) <= self.kv_pages:
            return
        raise ValueError(f"{where}: {what} need {needed} pages of {self.page_size} tokens, more than the paged KV "
                         f"cache's {self.kv_pages} (kv_pages); fewer or shorter sequences, or a model with more "
                         "kv_pages")

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
        like = self._table
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
        self._refuse_unless_pages_fit(where, lengths, "the prompts")
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
        the last must fit the cache (prompt length + max_new_tokens - 1 <= max_len), and a paged cache's
        pool must hold all of their pages (kv_pages)."""
        return self._generation("stream", input_ids, max_new_tokens, lengths, temperature, top_k, top_p,
                                eos_token_id, seed)

    def _generation(self, name: str, input_ids: Any, max_new_tokens: Any, lengths: Any, temperature: Any,
                    top_k: Any, top_p: Any, eos_token_id: Any, seed: Any) -> Iterator[np.ndarray]:
        """stream's arguments checked, every error naming the public function `name`; the steps' iterator."""
        where = f"CausalLM.{name}"
        max_new_tokens = checks.size(where, "max_new_tokens", max_new_tokens, 0)
        sample = Sampler(where, temperature, top_k, top_p, seed, self.config.vocab_size)
        eos = self.config.eos_token_id if eos_token_id is None else token_ids(where, "eos_token_id", eos_token_id)
        if bad := [t for t in eos if t >= self.config.vocab_size]:
            raise ValueError(f"{where}: eos_token_id {bad} outside the vocabulary [0, {self.config.vocab_size})")
        ids, lengths = self._prompts(input_ids, lengths, name)
        if max_new_tokens and int(lengths.max()) + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"{where}: max_new_tokens {max_new_tokens} after a prompt of {int(lengths.max())} "
                             f"tokens needs {int(lengths.max()) + max_new_tokens - 1} cache positions, more than "
                             f"max_len {self.max_len}")
        if max_new_tokens:
            self._refuse_unless_pages_fit(where, lengths + max_new_tokens - 1,
                                          f"the prompts and max_new_tokens {max_new_tokens} (every generated token "
                                          "but the last is cached)")
        return self._stream(ids, lengths, max_new_tokens, sample, np.asarray(eos, np.int64))

    def _stream(self, ids: Any, lengths: np.ndarray, max_new_tokens: int, sample: Sampler,
                eos: np.ndarray) -> Iterator[np.ndarray]:
        if not max_new_tokens:
            return
        logits = self._prefill(ids, lengths)
        done = np.zeros(len(lengths), bool)
        queued = False  # a step appended the last yielded tokens that no later step has read from
        try:
            for step in range(max_new_tokens):
                tokens = sample(logits)
                queued = False
                copy = _HostCopy(tokens)
                last = step == max_new_tokens - 1
                if not last:
                    # queued before the host waits for the tokens: the GPU runs the next step while the
                    # host reads these and yields them
                    logits = self._decode(tokens, checked=True)
                    queued = True
                host = copy.wait()
                yield np.where(done, -1, host)
                done |= np.isin(host, eos)
                if done.all() or last:
                    return
        finally:
            # however the generation ends (its length, every sequence's end token, the caller closing
            # it), the cache holds the prompt and every generated token but the last, as without the
            # step queued ahead: that step's token is dropped from the lengths (its k and v stay past
            # them, never read, and the next step's overwrite them)
            if queued:
                self._lengths[:len(lengths)] -= 1

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
        like = self._table
        base = self.base_model
        lines = base.describe(f"{dtypes.short_name(like.dtype)} on the {'GPU' if is_cupy(like) else 'CPU'}")
        tied = f"tied to {self.architecture.prefix}.{base.EMBEDDINGS}"
        cache_bytes = memory.format_bytes(c.cache_bytes(self.max_batch, self.max_len, like.dtype, self.page_size,
                                                        self.kv_pages))
        if self.page_size is None:
            cache = (f"KV cache: k and v (layers, {self.max_batch}, {self.max_len}, {c.num_key_value_heads}, "
                     f"{c.head_dim}), {cache_bytes}")
        else:
            max_pages = -(-self.max_len // self.page_size)
            cache = (f"KV cache: paged, k and v (layers, {self.kv_pages} + 1 spare pages, "
                     f"{c.num_key_value_heads}, {self.page_size}, {c.head_dim}), {cache_bytes}, a page table "
                     f"({self.max_batch}, {max_pages}), pages handed out as sequences grow")
        head = tied if self.lm_head is None else "its own weight"
        lines += [f"lm_head: {head}, on each sequence's last position only",
                  cache,
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
class Sampler:
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
        if self.temperature == 0:
            return argmax(logits)
        xp = array_module(logits)
        z = _as_float32(logits)
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
        return argmax(z + gumbel)


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
    if is_cupy(a) and dtypes.short_name(a.dtype) == "bf16":
        return dtypes.bf16_as_float32(a)
    return a.astype(array_module(a).float32)


# --- helpers -----------------------------------------------------------------------------------------------
def _check_fits(where: str, config: Any, architecture: Architecture, dtype: Any, device: str, max_batch: Any,
                max_len: Any, source: str, drawn: bool, page_size: int | None,
                kv_pages: Any) -> tuple[int, int, int | None]:
    """The config (from `source`), dtype, device and cache size checked, and the parameters and the KV
    cache (paged where `page_size` is given, of `kv_pages` pages: _kv_pages) refused before anything is
    drawn if they would not fit; (max_batch, max_len, the pool's pages or None). `drawn`: the
    parameters are drawn in float64 on the host (checks.parameters_fit); else read from a checkpoint,
    which the host holds as stored (counted as 4 bytes a value at most) beside the cast and stacked
    copies (the model's itemsize)."""
    parsed = checkpoint.check_model_arguments(where, config, architecture.config_class, dtype, device)
    max_batch = checks.size(where, "max_batch", max_batch)
    if max_len is None:
        max_len = min(DEFAULT_MAX_LEN, config.max_positions)
    max_len = checks.size(where, "max_len", max_len)
    if max_len > config.max_positions:
        raise ValueError(f"{where}: max_len {max_len} is beyond the model's {config.POSITIONS_FIELD} "
                         f"{config.max_positions} ({source})")
    kv_pages = _kv_pages(where, page_size, kv_pages, max_batch, max_len)
    elements = config.parameter_count()
    what = (f"the model of {source} (vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
            f"{config.num_hidden_layers} layers: {elements} parameters)")
    if drawn:
        checks.parameters_fit(where, what, elements, parsed, device)
    else:
        memory.require(elements * (4 + parsed.itemsize), "cpu", where, what)
        if device != "cpu":
            memory.require(elements * parsed.itemsize, "gpu", where, what)
    memory.require(config.cache_bytes(max_batch, max_len, parsed, page_size, kv_pages),
                   "cpu" if device == "cpu" else "gpu", where,
                   f"the KV cache ({cache_summary(max_batch, max_len, page_size, kv_pages)}, "
                   f"{config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads of {config.head_dim})")
    return max_batch, max_len, kv_pages


def cache_summary(max_batch: int, max_len: int, page_size: int | None, kv_pages: int | None) -> str:
    """What a KV cache holds, for the memory checks' messages."""
    if page_size is None:
        return f"{max_batch} sequences of {max_len} tokens"
    return f"{kv_pages} pages of {page_size} tokens for {max_batch} sequences of up to {max_len}"


def _kv_pages(where: str, page_size: int | None, kv_pages: Any, max_batch: int, max_len: int) -> int | None:
    """A paged cache's pool of pages checked: kv_pages, default worst_case_pages, from 1 up to it (more could
    never be held); None for the dense cache, which takes none."""
    if page_size is None:
        if kv_pages is not None:
            raise ValueError(f"{where}: kv_pages {kv_pages!r} goes with kv_layout='paged'; the dense cache has no "
                             "pages")
        return None
    worst = worst_case_pages(max_batch, max_len, page_size)
    if kv_pages is None:
        return worst
    kv_pages = checks.size(where, "kv_pages", kv_pages, 1)
    if kv_pages > worst:
        raise ValueError(f"{where}: kv_pages {kv_pages} is more than max_batch {max_batch} sequences of max_len "
                         f"{max_len} tokens can hold ({worst} pages of {page_size}); the extra pages would never "
                         "be used")
    return kv_pages


def _page_size(where: str, kv_layout: Any, page_size: Any) -> int | None:
    """kv_layout and page_size checked: a paged cache's page size (DEFAULT_PAGE_SIZE where none is
    given), None for the dense cache."""
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{where}: kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if kv_layout == "dense":
        if page_size is not None:
            raise ValueError(f"{where}: page_size {page_size!r} goes with kv_layout='paged'; the dense cache has "
                             "no pages")
        return None
    page_size = DEFAULT_PAGE_SIZE if page_size is None else checks.size(where, "page_size", page_size, 1)
    if page_size & (page_size - 1):
        raise ValueError(f"{where}: page_size must be a power of two (cuDNN's paged attention reads no other), got "
                         f"{page_size}")
    return page_size


def _check_paged(where: str, page_size: int | None, path: str | dict[str, str], dtype: Any, device: str) -> None:
    """A paged cache needs an attention path that reads pages: on the GPU cuDNN's, in fp16 or bf16."""
    if page_size is None:
        return
    if (name := path_for(path, "attention")) not in PAGED_ATTENTION_PATHS:
        raise ValueError(f"{where}: kv_layout 'paged' needs attention on one of {PAGED_ATTENTION_PATHS} (the paths "
                         f"that read pages), got path {name!r} for attention")
    if device != "cpu" and (short := dtypes.short_name(dtypes.parse(dtype))) not in PAGED_GPU_DTYPES:
        raise ValueError(f"{where}: kv_layout 'paged' on the GPU needs dtype fp16 or bf16 (what cuDNN's paged "
                         f"attention and the custom split-K decode kernel, the paths that read pages, take), got "
                         f"{short}")


def layer_range(count: int) -> str:
    """How describe() names a base model's `count` layers: "0-11", or "0" for one."""
    return f"0-{count - 1}" if count > 1 else "0"
