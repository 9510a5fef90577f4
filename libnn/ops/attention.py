"""attention: o = softmax(scale · q kᵀ + bias, masked) v, scaled dot-product attention for inference.

Shapes for layout="BHSD": q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D), o (B, Hq, Sq, D); for
layout="BSHD" the middle two dimensions are swapped: q (B, Sq, Hq, D)... Hq must be a multiple of Hkv
(Hq = Hkv: multi-head; Hkv = 1: multi-query; else grouped-query, query head h reading kv head
h // (Hq / Hkv)). Any strides are taken as they are, as long as the last dimension is contiguous, so
the q, k and v views of one packed QKV projection run without a copy. o is a new array, contiguous in
`layout`.

Masks and their alignment, for row i of batch b with Lq = seq_lens_q[b] (default Sq) and
Lk = seq_lens_kv[b] (default Skv): key j is allowed when j < Lk and
- causal=False:                     always;
- causal=True or "top_left":        j <= i (PyTorch's is_causal);
- causal="bottom_right":            j <= i + Lk - Lq (the last query sees every key: decode, chunked prefill).
`bias` is added to the scores; its shape broadcasts to (B, Hq, Sq, Skv) with size-1 batch/head/query
dimensions (a key-padding bias (B, 1, 1, Skv), a relative-position bias (1, Hq, Sq, Skv)), in q's
dtype, and -inf in it masks a key. Rows i >= Lq and rows where no key is allowed come out as zeros on
every path, never NaN. NaN in the inputs spreads as in the reference: a NaN score (a NaN in a query row, or
in a key the row may see) makes the row NaN, a NaN value its column in the rows that see its key; a key
past its sequence's length weighs nothing, so a NaN in its k or v (a stale row of a KV cache) changes
nothing (the reference and unfused paths zero those values, the custom kernels never read them, cuDNN's
decode keeps them out); except on cudnn with several query rows, where cuDNN 9.19 multiplies a value past a
length by a zero weight, so a NaN there makes the rows NaN (tests/test_attention_nan_gpu.py).

Paths, in `auto` order (except that small encoder attention and a decode step that the split-K kernel
takes, see _cudnn_slower, try cudnn last):
- cudnn:      the cuDNN frontend's fused SDPA graph (fp16/bf16), cached per problem like the conv graphs;
              plans that can give other bits on the same inputs left out (NONDETERMINISTIC_CUDNN_PLANS)
              unless config.allow_nondeterministic; a dense one-row problem's plans timed, the fastest
              kept (_decode_timing_arrays).
- custom:     kernels/attention.cu: a flash-attention kernel on tensor cores for fp16/bf16 with D a
              multiple of 8 up to 128 and 16-byte aligned rows (online softmax, the S×S scores never
              stored), a split-K decoding kernel on tensor cores for one query row per sequence (a
              decoder's step from its cache: fp16/bf16, no bias or top-left mask, D a multiple of 8 up
              to 128, up to 16 query heads per kv head, deterministic), and a warp-per-row kernel for
              the rest: fp32, D up to 256, any alignment.
- unfused:    the textbook three passes: Q·Kᵀ on cuBLAS, our masked softmax kernel, P·V on cuBLAS;
              S×S scores in memory. Kept as the benchmark's middle rung.
- reference:  NumPy in float64.

Packed sequences (layout="THD"): q (T, Hq, D), k and v (T, Hkv, D) hold B sequences one after another
along the tokens, as `packed=PackedSequences(lengths, offsets, max_len)` says: sequence b is rows
offsets[b] .. offsets[b] + lengths[b] - 1 of each (self-attention over variable-length sequences with
no padding between them: what an unpadded encoder computes). Each sequence attends to itself only,
under the same causal options; no attn_bias (leave a masked token out of the packing). o is (T, Hq,
D), zeros in rows no sequence covers. Paths: cudnn (its SDPA with ragged offsets) and reference.

Paged K/V (`page_table=`, layouts BHSD and BSHD): k and v are pools of pages, (pages, Hkv, page_size, D)
in BHSD, (pages, page_size, Hkv, D) in BSHD (any strides, last dimension contiguous), and page_table
(B, max_pages) int32 lists each sequence's pages: key j of sequence b is row j % page_size of page
page_table[b, j // page_size], so Skv = max_pages * page_size, and seq_lens_kv says how many of them
each sequence holds (a decoder's KV cache whose pages are handed out as sequences grow). Every table
entry must lie in [0, pages) (checked with one read-back per call, unless the table comes as
CheckedPageTable(table)); entries past a sequence's length are never read as keys but must still name a
page. No attn_bias. Paths: cudnn (its SDPA reading the pages itself through its paged-cache load, cuDNN
9.5 or newer; page_size a power of two, and the padding mask always on, as cuDNN's paged attention
requires), custom for a decode step that its split-K kernel takes (one query row; pages of a power-of-two
size >= 64; first under auto, as for a dense cache) and reference (the pages gathered into a dense cache
in NumPy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.backends import cudnn as cudnn_backend
from libnn.config import config
from libnn.ops import paging
from libnn.ops.attention_kernels import (bind_flash, bind_paged_decode, bind_unfused,
                                        bind_zero_empty_batches, decode_fits, decode_page_size_fits,
                                        decode_shared_memory_fits, flash_fits, flash_supports)
from libnn.registry import Op, option_key
from libnn.runtime import memory
from libnn.runtime.arrays import (allocator, array_module, as_array, data_pointer, device_constant, device_of, is_cupy,
                                  min_max, signature, stream_key)
from libnn.runtime.device import gpu_index

LAYOUTS = ("BHSD", "BSHD", "THD")
CAUSAL = {False: None, None: None, True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}
CUDNN_DTYPES = ("fp16", "bf16")
GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("attention", order=("cudnn", "custom", "unfused", "reference"))


# cuDNN plans that gave other bits on identical inputs, though cuDNN does not mark them NONDETERMINISTIC:
# cuDNN 9.19's SDPA engine 8 with kernel config 35 (knob 24), which splits a decode step's keys over blocks
# and adds the parts in a lean_reduction kernel (on the H100, 2 distinct outputs in 60 identical calls at
# batch 8 with 256 keys, 45 at batch 64 with 4096: benchmarks/RESULTS.md, thirteenth session). Names are
# matched as substrings of cuDNN's plan names; left out unless config.allow_nondeterministic.
NONDETERMINISTIC_CUDNN_PLANS = ("eng8_k24=35",)


@dataclass(frozen=True)
class AttentionProblem:
    """Everything that decides how an attention call runs; also the cuDNN graph's cache key."""
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    dtype: str
    layout: str
    q_strides: tuple[int, int, int, int]   # element strides in (B, H, S, D) order
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    scale: float
    causal: str | None                      # None, "top_left" or "bottom_right"
    has_seq_lens_q: bool
    has_seq_lens_kv: bool
    bias_shape: tuple[int, int, int, int] | None
    aligned: bool                           # every pointer and row stride a multiple of 16 bytes
    device: str
    bias_keeps_a_key: bool = False          # a KeyPaddingBias: it never empties a row the lengths leave
    lens_kv_nonempty: bool = False          # seq_lens_kv came as CheckedLengths(nonempty=True): every Lk >= 1
    tokens: int = 0                         # layout THD: the rows of q (and o); Sq = Skv = the longest sequence
    pages: int = 0                          # paged k and v: the pools' pages (0: dense k and v)
    page_size: int = 0                      # paged k and v: keys per page; Skv = max_pages * page_size
    # cuDNN plans left out by name (NONDETERMINISTIC_CUDNN_PLANS, or none under allow_nondeterministic): the
    # names themselves, so that a plan stored on disk under one list is never loaded under another
    excluded_plans: tuple[str, ...] = NONDETERMINISTIC_CUDNN_PLANS

    def describe(self) -> str:
        masks = ", ".join(filter(None, [f"causal {self.causal}" if self.causal else None,
                                        "padding" if self.has_seq_lens_q or self.has_seq_lens_kv else None,
                                        f"bias {self.bias_shape}" if self.bias_shape else None,
                                        f"{self.pages} pages of {self.page_size}" if self.pages else None]))
        masks = masks or "no mask"
        heads = f"Hq={self.Hq}" + (f" Hkv={self.Hkv}" if self.Hkv != self.Hq else "")
        return (f"attention B={self.B} {heads} Sq={self.Sq} Skv={self.Skv} D={self.D} {self.dtype} "
                f"{self.layout} ({masks})")

    @property
    def deterministic(self) -> bool:
        """Whether cuDNN's plans that can give other bits on the same inputs are left out."""
        return bool(self.excluded_plans)

    @property
    def flops(self) -> int:
        return attention_flops(self.B, self.Hq, self.Sq, self.Skv, self.D, self.causal)

    @property
    def output_bytes(self) -> int:
        return memory.array_bytes(_output_shape(self), dtypes.parse(self.dtype))

    @property
    def o_strides(self) -> tuple[int, int, int, int]:
        """o is contiguous in `layout`; its element strides in (B, H, S, D) order."""
        H, S, D = self.Hq, self.Sq, self.D
        return (H * S * D, S * D, D, 1) if self.layout == "BHSD" else (S * H * D, D, H * D, 1)  # BSHD, THD


def attention_flops(B: int, Hq: int, Sq: int, Skv: int, D: int, causal: Any) -> int:
    """4·B·Hq·Sq·Skv·D, halved under a causal mask (the two GEMMs, as FlashAttention counts them)."""
    full = 4 * B * Hq * Sq * Skv * D
    return full // 2 if causal else full


def _bhsd(a, layout: str):
    """The (B, H, S, D) view of an array in `layout` (no copy)."""
    return a if layout == "BHSD" else a.transpose(0, 2, 1, 3)


def _problem_strides(a) -> tuple[int, ...]:
    """Element strides as the problem (a plan-cache key) records them: a size-1 dimension's (never used
    to move, and arbitrary in NumPy and CuPy) replaced by the one a contiguous array would have, so it
    neither keys a second graph nor fails an alignment check. Not attention_kernels._kernel_strides."""
    strides = [s // a.itemsize for s in a.strides]
    for i in reversed(range(a.ndim - 1)):
        if a.shape[i] == 1:
            strides[i] = strides[i + 1] * a.shape[i + 1]
    return tuple(strides)


class PackedSequences:
    """Sequences packed one after another along the token dimension, for attention(layout="THD"):
    sequence b is rows offsets[b] .. offsets[b] + lengths[b] - 1, and no sequence is longer than
    `max_len`. `lengths` (B,) and `offsets` (B + 1,) are integer arrays on the host or on q's device;
    device arrays are checked with one reduction per call (as seq_lens are; skipped while a CUDA graph
    is captured) unless `checked=True`, the caller's word that they are in range (offsets counted from
    a mask, say)."""

    def __init__(self, lengths: Any, offsets: Any, max_len: int, *, checked: bool = False):
        if not isinstance(checked, (bool, np.bool_)):  # "no" would skip the range check
            raise TypeError(f"PackedSequences: checked must be True or False, got {type(checked).__name__} "
                            f"{checked!r}")
        self.lengths, self.offsets, self.max_len, self.checked = lengths, offsets, max_len, checked
        self._element_offsets: dict[int, Any] = {}

    def element_offsets(self, stride: int) -> Any:
        """offsets × `stride` (a tensor's token stride) as int32 on the offsets' device: cuDNN's ragged
        offsets count elements, not tokens. Made once per stride, so a layer stack pays it once."""
        found = self._element_offsets.get(stride)
        if found is None:
            xp = array_module(self.offsets)
            found = self._element_offsets[stride] = (xp.asarray(self.offsets, xp.int64) * stride).astype(xp.int32)
        return found


class CheckedLengths:
    """Sequence lengths the caller already knows lie in [0, S] (counted from a padding mask, say):
    `attention(seq_lens_kv=CheckedLengths(lengths))` skips their range check and its synchronisation,
    which a layer stack would otherwise pay once per layer. `nonempty=True` (as seq_lens_kv) is the
    caller's word that every length is also at least 1: under key padding alone no batch entry is then
    without a key, and the cudnn path launches nothing after its graph to zero such entries (a layer
    stack's launch per layer). A length of 0 passed so is not looked for: its rows are then undefined."""

    def __init__(self, lengths: Any, *, nonempty: bool = False):
        if not isinstance(nonempty, (bool, np.bool_)):  # "no" would skip the zeroing
            raise TypeError(f"CheckedLengths: nonempty must be True or False, got {type(nonempty).__name__} "
                            f"{nonempty!r}")
        self.lengths, self.nonempty = lengths, bool(nonempty)


class CheckedPageTable:
    """A page table whose entries the caller already knows lie in [0, pages) (a decoder that hands its
    pages out on the host): `attention(page_table=CheckedPageTable(table))` skips their range check and
    its synchronisation, which a layer stack would otherwise pay once per layer, and which a CUDA graph
    capture cannot run."""

    def __init__(self, table: Any):
        self.table = table


class KeyPaddingBias:
    """A key-padding bias (B or 1, 1, 1, Skv) whose -inf entries all lie before each row's last
    allowed key (seq_lens_kv - 1, or Skv - 1), which it leaves finite: holes in a padding mask, as
    nn.functional.key_padding builds them. `attention(attn_bias=KeyPaddingBias(bias))` takes the
    caller's word for it: the rows without keys then follow from the lengths alone, and no pass over
    the bias looks for rows it empties, which a layer stack would otherwise pay once per layer. Under
    a causal mask a row may see only holes (keys before its last one), so there it is a plain bias."""

    def __init__(self, bias: Any):
        self.bias = bias


def _seq_lens(lens, name: str, B: int, S: int, like):
    """Validated int32 sequence lengths on `like`'s device, or None. Device arrays are checked with
    one reduction (a synchronisation; skipped while a CUDA graph is prepared or captured, and for
    CheckedLengths), host sequences on the host before their upload."""
    if lens is None:
        return None
    checked = isinstance(lens, CheckedLengths)
    lens = lens.lengths if checked else lens
    on_gpu = is_cupy(lens)
    if on_gpu:
        if not is_cupy(like):
            raise TypeError(f"attention: {name} is on the GPU but q is a host array; pass both on one device")
        if lens.data.device_id != like.data.device_id:  # the pointers' devices: no cupy.cuda.Device made per call
            raise ValueError(f"attention: {name} is on GPU {lens.device.id} but q is on GPU {like.device.id}")
    else:
        lens = as_array(np.asarray(lens) if isinstance(lens, (list, tuple)) else lens, "attention", name)
    if lens.ndim != 1 or lens.shape[0] != B:
        raise ValueError(f"attention: {name} must have shape ({B},), one length per batch entry, "
                         f"got {tuple(lens.shape)}")
    if lens.dtype.kind not in "iu":
        raise TypeError(f"attention: {name} must hold integers, got dtype {lens.dtype}")
    if B and not checked and (ranges := min_max([lens])):
        (lo, hi), = ranges
        if lo < 0 or hi > S:
            raise ValueError(f"attention: {name} must lie in [0, {S}] (the padded sequence length), "
                             f"got values from {lo} to {hi}")
    if not is_cupy(like):
        return lens.astype(np.int32, copy=False)
    if on_gpu and lens.dtype == _INT32:  # what cupy.asarray would return: the caller's array itself
        return lens
    import cupy
    return cupy.asarray(lens, dtype=cupy.int32)


_INT32 = np.dtype(np.int32)


def attention_problem(q, k, v, bias, scale, causal, layout, has_lens_q, has_lens_kv, *,
                      reference_fits: bool = True, page_table: Any = None) -> AttentionProblem:
    """The AttentionProblem attention(q, k, v, attn_bias=bias, scale, causal, layout) solves, with or
    without each sequence-length array, after checking every argument as attention does (arrays
    already); for tools that build a path's plan themselves. `reference_fits=False` leaves out the
    check that host arrays' reference computation fits in RAM (layout THD checks it per sequence).
    With `page_table` (an array) k and v are pools of pages (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"attention: layout must be one of {LAYOUTS}, got {layout!r}")
    dims = "(B, H, S, D)" if layout == "BHSD" else "(B, S, H, D)"
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"attention: {name} must be 4-D {dims} for layout {layout}, got shape {tuple(a.shape)}")
    if not dtypes.is_float(q.dtype):
        raise TypeError(f"attention: q must be a floating-point array (fp16, bf16, fp32, fp64), got {q.dtype}")
    for name, a in (("k", k), ("v", v), ("bias", bias)):
        if a is not None and a.dtype != q.dtype:
            raise TypeError(f"attention: {name} has dtype {dtypes.short_name(a.dtype)} but q has "
                            f"{dtypes.short_name(q.dtype)}; cast them to one dtype")
    if not isinstance(causal, (bool, np.bool_, str, type(None))) or causal not in CAUSAL:
        raise ValueError(f"attention: causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    qv, kv, vv = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    B, Hq, Sq, D = qv.shape
    Bk, Hkv, Skv, Dk = kv.shape
    pages, page_size = Bk, Skv  # (paged k and v: the pools' pages and keys per page)
    if page_table is not None:  # the batch and the keys are the table's: (B, max_pages) pages of page_size
        paging.check_page_table("attention", page_table, B, f"q of batch {B} (k and v hold {pages} pages)")
        Bk, Skv = B, page_table.shape[1] * page_size
    if Dk != D or vv.shape[3] != D:
        raise ValueError(f"attention: q, k and v must share the head dimension D; got q {D}, k {Dk}, v {vv.shape[3]}")
    if Bk != B or (page_table is None and vv.shape[0] != B):
        raise ValueError(f"attention: q, k and v must share the batch size; got q {B}, k {Bk}, v {vv.shape[0]}")
    if tuple(vv.shape) != tuple(kv.shape):
        raise ValueError(f"attention: k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"attention: q's {Hq} heads must be a multiple of k/v's {Hkv} heads (MHA, GQA or MQA)")
    bias_shape = None
    if bias is not None:
        full = (B, Hq, Sq, Skv)
        if bias.ndim != 4 or any(n not in (1, f) for n, f in zip(bias.shape[:3], full[:3])) or bias.shape[3] != Skv:
            raise ValueError(f"attention: bias must have shape (B, Hq, Sq, Skv) = {full}, each of the first "
                             f"three dimensions possibly 1 (broadcast), got {tuple(bias.shape)}")
        bias_shape = tuple(int(n) for n in bias.shape)
    _check_scale(scale)
    device = device_of({"q": q, "k": k, "v": v, "bias": bias, "page_table": page_table}, "attention")
    arrays = [a for a in (qv, kv, vv, bias) if a is not None]
    aligned = all(data_pointer(a) % 16 == 0 and all((s * a.itemsize) % 16 == 0 for s in _problem_strides(a)[:-1])
                  for a in arrays)
    problem = AttentionProblem(B, Hq, Hkv, Sq, Skv, D, dtypes.short_name(q.dtype), layout,
                               _problem_strides(qv), _problem_strides(kv), _problem_strides(vv),
                               float(1 / math.sqrt(D) if scale is None else scale) if D else 1.0, CAUSAL[causal],
                               has_lens_q, has_lens_kv, bias_shape, aligned, device,
                               excluded_plans=() if config.allow_nondeterministic else NONDETERMINISTIC_CUDNN_PLANS)
    if page_table is not None:
        problem = replace(problem, pages=pages, page_size=page_size)
    if device == "cpu" and reference_fits:  # host arrays run on the reference path
        _reference_fits(problem)
    return problem


def _check_scale(scale: Any) -> None:
    if scale is None:
        return
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"attention: scale must be a finite number or None (1/sqrt(D)), got "
                        f"{type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"attention: scale must be a finite number or None (1/sqrt(D)), got {scale!r}")


def _reference_fits(p: AttentionProblem) -> None:
    """Refuse a problem whose reference computation would not fit in host RAM before any of it is
    allocated: the reference forms the S×S scores in float64, and holds about three arrays of their
    size at once (scores, masked scores, weights), beside q, o and k, v repeated to every query head."""
    scores = p.B * p.Hq * p.Sq * p.Skv
    vectors = p.B * p.Hq * p.D * (2 * p.Sq + 2 * p.Skv)
    memory.require(8 * (3 * scores + vectors), "cpu", "attention",
                   f"the {p.Sq}x{p.Skv} scores of {p.B}x{p.Hq} (B x Hq) heads (the reference path's float64 "
                   "buffers)")


def attention(q: Any, k: Any, v: Any, *, scale: float | None = None, causal: bool | str = False,
              seq_lens_q: Sequence[int] | Any = None, seq_lens_kv: Sequence[int] | Any = None,
              attn_bias: Any = None, layout: str = "BHSD", packed: PackedSequences | None = None,
              page_table: Any = None, path: str = "auto") -> Any:
    """Scaled dot-product attention; see the module docstring for shapes, masks and paths. `scale`
    defaults to 1/sqrt(D). Returns o in q's dtype and device, contiguous in `layout`. Layout "THD"
    takes `packed` (PackedSequences) in place of seq_lens_q and seq_lens_kv. With `page_table`
    ((B, max_pages) int32, or a CheckedPageTable) k and v are pools of pages (module docstring)."""
    if page_table is not None:
        return _paged_attention(q, k, v, scale, causal, seq_lens_q, seq_lens_kv, attn_bias, layout, packed,
                                page_table, path)
    if layout == "THD" or packed is not None:
        return _packed_attention(q, k, v, scale, causal, seq_lens_q, seq_lens_kv, attn_bias, layout, packed, path)
    q, k, v = as_array(q, "attention", "q"), as_array(k, "attention", "k"), as_array(v, "attention", "v")
    bias, keeps_a_key = attn_bias, False
    if attn_bias is not None:
        keeps_a_key = isinstance(attn_bias, KeyPaddingBias)
        bias = attn_bias.bias if keeps_a_key else attn_bias
        bias = None if bias is None else as_array(bias, "attention", "attn_bias")
    # The key of signature() and option_key() without their calls in the common cases (as layer_norm's): an
    # absent bias's signature is None; a scale of None or an exact float is its own key (of option_key's other
    # keys, only an exact int's can equal a float, and the checks take that int as the same scale); causal is
    # keyed with its type, so that 1 never finds the bound call of True and skips the check that refuses it.
    kv_nonempty = isinstance(seq_lens_kv, CheckedLengths) and seq_lens_kv.nonempty
    key = (signature(q), signature(k), signature(v), None if bias is None else signature(bias), keeps_a_key,
           scale if scale is None or type(scale) is float else option_key(scale), type(causal), causal, layout,
           seq_lens_q is None, seq_lens_kv is None, kv_nonempty, path, config.allow_nondeterministic, stream_key())
    return op.call(key, _padded_problem, path, q, k, v, seq_lens_q, seq_lens_kv, bias,
                   checks=(q, k, v, bias, scale, causal, layout, seq_lens_q is not None, seq_lens_kv is not None,
                           keeps_a_key, kv_nonempty))


def _padded_problem(q, k, v, bias, scale, causal, layout: str, has_lens_q: bool, has_lens_kv: bool,
                    keeps_a_key: bool, kv_nonempty: bool) -> AttentionProblem:
    """attention()'s checks and problem for dense k and v in layout BHSD or BSHD: what Op.call runs on a
    signature's first call (`keeps_a_key`: the bias came as a KeyPaddingBias; `kv_nonempty`: seq_lens_kv
    as CheckedLengths(nonempty=True))."""
    _check_head_contiguous(q, k, v)
    problem = attention_problem(q, k, v, bias, scale, causal, layout, has_lens_q, has_lens_kv)
    if keeps_a_key:
        _check_key_padding_bias(problem)
    return replace(problem, bias_keeps_a_key=keeps_a_key and problem.causal is None, lens_kv_nonempty=kv_nonempty)


def _check_head_contiguous(q, k, v) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.size and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
            raise ValueError(f"attention: the last (head) dimension of {name} must be contiguous, got "
                             f"strides {a.strides} (bytes); pass ascontiguousarray({name})")


def _paged_attention(q, k, v, scale, causal, seq_lens_q, seq_lens_kv, attn_bias, layout, packed, page_table, path):
    """attention() over paged k and v. The runners take the page table (or its CheckedPageTable) where
    the others take the bias (a paged problem has none)."""
    q, k, v = (as_array(a, "attention", n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    for name, given in (("attn_bias", attn_bias), ("packed", packed)):
        if given is not None:
            raise ValueError(f"attention: page_table takes no {name}: paged k and v run in layouts BHSD and BSHD "
                             "with the padding lengths as their only mask besides causal")
    if layout not in ("BHSD", "BSHD"):
        raise ValueError(f"attention: page_table needs layout 'BHSD' or 'BSHD', got {layout!r}")
    checked = isinstance(page_table, CheckedPageTable)
    table = as_array(page_table.table if checked else page_table, "attention", "page_table")
    pages = CheckedPageTable(table) if checked else table
    key = (signature(q), signature(k), signature(v), signature(table), checked, option_key(scale),
           option_key(causal), layout, seq_lens_q is None, seq_lens_kv is None, "paged", path,
           config.allow_nondeterministic, stream_key())

    def prepare():
        _check_head_contiguous(q, k, v)
        return attention_problem(q, k, v, None, scale, causal, layout, seq_lens_q is not None,
                                 seq_lens_kv is not None, page_table=table)
    return op.call(key, prepare, path, q, k, v, seq_lens_q, seq_lens_kv, pages)


def _page_table(problem: AttentionProblem, page_table) -> Any:
    """The page table a runner got (an array or a CheckedPageTable), its entries checked to lie in
    [0, pages) with one read-back unless it came checked (skipped while a CUDA graph is captured)."""
    if isinstance(page_table, CheckedPageTable):
        return page_table.table
    if page_table.size and (ranges := min_max([page_table])):
        (lo, hi), = ranges
        if lo < 0 or hi >= problem.pages:
            raise ValueError(f"attention: page_table entries must lie in [0, {problem.pages}) (the pages of k and v), "
                             f"got values from {lo} to {hi}")
    return page_table


def _packed_attention(q, k, v, scale, causal, seq_lens_q, seq_lens_kv, attn_bias, layout, packed, path):
    """attention() for layout THD. The runners take the PackedSequences where the others take
    seq_lens_q (a THD problem has no other lengths)."""
    q, k, v = (as_array(a, "attention", n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    if not isinstance(packed, PackedSequences) or layout != "THD":
        raise TypeError(f"attention: layout 'THD' and packed=PackedSequences(lengths, offsets, max_len) go together; "
                        f"got layout {layout!r} and packed of type {type(packed).__name__}")
    for name, given in (("seq_lens_q", seq_lens_q), ("seq_lens_kv", seq_lens_kv), ("attn_bias", attn_bias)):
        if given is not None:
            raise ValueError(f"attention: layout THD takes no {name}: the sequences' lengths are packed's, and a "
                             "masked token is one left out of the packing")
    lengths, offsets = (as_array(np.asarray(a) if isinstance(a, (list, tuple)) else a, "attention", f"packed.{name}")
                        for a, name in ((packed.lengths, "lengths"), (packed.offsets, "offsets")))
    key = (signature(q), signature(k), signature(v), option_key(scale), option_key(causal), "THD", signature(lengths),
           signature(offsets), option_key(packed.max_len), packed.checked, path,
           config.allow_nondeterministic, stream_key())

    def prepare():
        for name, a in (("q", q), ("k", k), ("v", v)):
            if a.ndim != 3:
                raise ValueError(f"attention: {name} must be 3-D (T, H, D) for layout THD, got shape {tuple(a.shape)}")
        if not (k.shape[0] == v.shape[0] == q.shape[0]):
            raise ValueError(f"attention: q, k and v must hold the same tokens (T) for layout THD; got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        max_len = packed.max_len
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"attention: packed.max_len must be a positive int, got {max_len!r}")
        if lengths.ndim != 1 or offsets.shape != (lengths.shape[0] + 1,):
            raise ValueError(f"attention: packed.lengths must be (B,) and packed.offsets (B + 1,), got "
                             f"{tuple(lengths.shape)} and {tuple(offsets.shape)}")
        for name, a in (("packed.lengths", lengths), ("packed.offsets", offsets)):
            if a.dtype.kind not in "iu":
                raise TypeError(f"attention: {name} must hold integers, got dtype {a.dtype}")
            if is_cupy(a) != is_cupy(q):
                raise TypeError(f"attention: {name} and q must be on one device (host or GPU)")
        # the checks of the dense layouts on the (1, T, H, D) view, then the packed geometry
        flat = attention_problem(q[None], k[None], v[None], None, scale, causal, "BSHD", True, True,
                                 reference_fits=False)
        B, (tq, tk, tv) = lengths.shape[0], (a.strides[0] // a.itemsize for a in (q, k, v))
        if q.shape[0] * max(tq, tk, tv, flat.Hq * flat.D) >= 2**31:
            raise ValueError(f"attention: layout THD counts offsets in int32 elements: {q.shape[0]} tokens of "
                             f"stride up to {max(tq, tk, tv, flat.Hq * flat.D)} is too many")
        problem = replace(flat, B=B, Sq=max_len, Skv=max_len, layout="THD", tokens=q.shape[0],
                          q_strides=(max_len * tq, flat.q_strides[1], tq, 1),
                          k_strides=(max_len * tk, flat.k_strides[1], tk, 1),
                          v_strides=(max_len * tv, flat.v_strides[1], tv, 1))
        if problem.device == "cpu":  # the reference computes one sequence at a time, none longer than T or max_len
            longest = min(max_len, q.shape[0])
            _reference_fits(replace(problem, B=1, Sq=longest, Skv=longest))
        return problem
    return op.call(key, prepare, path, q, k, v, packed, None, None)


def _packed_arrays(problem: AttentionProblem, packed: PackedSequences, like) -> tuple[Any, Any]:
    """packed's lengths and offsets as int32 arrays on q's device, checked (one reduction for device
    arrays, none while a graph is captured or for checked=True): 0 <= lengths <= max_len, each sequence
    within the T rows."""
    p, xp = problem, array_module(like)
    lengths, offsets = (xp.asarray(packed.lengths, xp.int32), xp.asarray(packed.offsets, xp.int32))
    if not packed.checked and (ranges := min_max([lengths, offsets, offsets[1:] - offsets[:-1] - lengths])):
        (lo_len, hi_len), (lo_off, hi_off), (lo_gap, _) = ranges
        if lo_len < 0 or hi_len > p.Sq or lo_off < 0 or hi_off > p.tokens or lo_gap < 0:
            raise ValueError(f"attention: packed sequences must lie within the {p.tokens} rows, one after another "
                             f"(offsets[b] + lengths[b] <= offsets[b + 1]), with 0 <= lengths <= max_len {p.Sq}; "
                             f"got lengths {lo_len}..{hi_len}, offsets {lo_off}..{hi_off}")
    return lengths, offsets


def _check_key_padding_bias(problem: AttentionProblem) -> None:
    p = problem
    if p.bias_shape is None or p.bias_shape[1:3] != (1, 1):
        raise ValueError(f"attention: a KeyPaddingBias must have shape (B, 1, 1, Skv) = {(p.B, 1, 1, p.Skv)} "
                         f"(or (1, 1, 1, Skv)), got {p.bias_shape}")


def _lengths(problem: AttentionProblem, q, seq_lens_q, seq_lens_kv):
    """The caller's sequence lengths, validated, as int32 arrays on q's device (or None)."""
    return (_seq_lens(seq_lens_q, "seq_lens_q", problem.B, problem.Sq, q),
            _seq_lens(seq_lens_kv, "seq_lens_kv", problem.B, problem.Skv, q))


def _output_shape(problem: AttentionProblem) -> tuple[int, ...]:
    """o's shape in `layout` (o is new and contiguous)."""
    p = problem
    if p.layout == "THD":
        return (p.tokens, p.Hq, p.D)
    return (p.B, p.Hq, p.Sq, p.D) if p.layout == "BHSD" else (p.B, p.Sq, p.Hq, p.D)


def _gpu_support(problem: AttentionProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


# --- cudnn path -------------------------------------------------------------------------------------
def _cudnn_support(problem: AttentionProblem) -> str | None:
    if problem.dtype not in CUDNN_DTYPES:
        return f"cuDNN's fused attention takes fp16 and bf16, not {problem.dtype}"
    if problem.D % 8:
        return f"cuDNN's fused attention needs a head dimension that is a multiple of 8, got D={problem.D}"
    if not problem.aligned:
        return "cuDNN's fused attention needs 16-byte aligned pointers and strides"
    if min(problem.B, problem.Hq, problem.Sq, problem.Skv, problem.D) == 0:
        return "an empty problem (a zero dimension)"
    if problem.pages and problem.page_size & (problem.page_size - 1):
        return f"cuDNN's paged attention reads pages of a power-of-two size, got page_size {problem.page_size}"
    return None


# The uids of the tensors in attention_graph_builder's graph, for a variant pack (bias and the sequence
# lengths only when the problem has them).
UID_Q, UID_K, UID_V, UID_BIAS, UID_LENS_Q, UID_LENS_KV, UID_O = range(1, 8)
UID_RAGGED_Q, UID_RAGGED_K, UID_RAGGED_V, UID_RAGGED_O = range(8, 12)  # layout THD's element offsets
UID_PAGES_K, UID_PAGES_V = range(12, 14)  # paged k and v: their page tables (one array, passed twice)


def attention_graph_builder(problem: AttentionProblem):
    """The builder (handle -> cuDNN graph, not yet validated) of q, k, v [, bias, sequence lengths] →
    sdpa → o, one node per line; its tensors carry the uids UID_Q ... UID_O."""
    def build(handle):
        import cudnn

        p, io, f32 = problem, cudnn_backend.data_type(problem.dtype), cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        q = g.tensor(dim=[p.B, p.Hq, p.Sq, p.D], stride=list(p.q_strides), data_type=io, uid=UID_Q)
        # paged: k and v are cuDNN's containers, (pages, Hkv, page_size, D)
        kv_dims = [p.pages, p.Hkv, p.page_size, p.D] if p.pages else [p.B, p.Hkv, p.Skv, p.D]
        k = g.tensor(dim=kv_dims, stride=list(p.k_strides), data_type=io, uid=UID_K)
        v = g.tensor(dim=kv_dims, stride=list(p.v_strides), data_type=io, uid=UID_V)
        bias = lens_q = lens_kv = None
        if p.bias_shape:
            bias = g.tensor(dim=list(p.bias_shape), stride=_contiguous_strides(p.bias_shape), data_type=io,
                            uid=UID_BIAS)
        # cuDNN's paged attention runs only under the padding mask
        padded = p.has_seq_lens_q or p.has_seq_lens_kv or bool(p.pages)
        if padded:  # cuDNN's padding mask takes both lengths; a missing one is passed as full
            lens_q = g.tensor(dim=[p.B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32,
                              uid=UID_LENS_Q)
            lens_kv = g.tensor(dim=[p.B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32,
                               uid=UID_LENS_KV)
        masks = {}
        if p.causal:
            masks = {"diagonal_band_right_bound": 0,
                         "diagonal_alignment": (cudnn.diagonal_alignment.TOP_LEFT if p.causal == "top_left"
                                             else cudnn.diagonal_alignment.BOTTOM_RIGHT)}
        ragged = {}
        if p.layout == "THD":  # each tensor's sequences start at its own element offsets
            for t, uid in ((q, UID_RAGGED_Q), (k, UID_RAGGED_K), (v, UID_RAGGED_V), ("o", UID_RAGGED_O)):
                ragged[uid] = g.tensor(dim=[p.B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32,
                                       uid=uid)
                if t != "o":
                    t.set_ragged_offset(ragged[uid])
        paged = {}
        if p.pages:  # the page tables (B, 1, max_pages, 1), and the keys they span
            max_pages = p.Skv // p.page_size
            k_table, v_table = (g.tensor(dim=[p.B, 1, max_pages, 1], stride=[max_pages, max_pages, 1, 1],
                                         data_type=cudnn.data_type.INT32, uid=uid)
                                for uid in (UID_PAGES_K, UID_PAGES_V))
            paged = {"paged_attention_k_table": k_table, "paged_attention_v_table": v_table,
                     "paged_attention_max_seq_len_kv": p.Skv}
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=p.scale, bias=bias, use_padding_mask=padded,
                      seq_len_q=lens_q, seq_len_kv=lens_kv, generate_stats=False, **masks, **paged)
        o.set_output(True).set_dim([p.B, p.Hq, p.Sq, p.D]).set_stride(list(p.o_strides)).set_uid(UID_O)
        if ragged:
            o.set_ragged_offset(ragged[UID_RAGGED_O])
        if p.deterministic:  # (frontend 1.28 keeps note filters set before planning and applies them after)
            g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
            g.deselect_engines(list(p.excluded_plans))
        return g
    return build


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


def _bind_zero_rows(problem: AttentionProblem):
    """zero(o, lens_q, lens_kv, bias), which zeroes the rows of o that attend to no key: rows past the
    query length, rows of a batch entry with no keys, rows above a bottom-right diagonal, rows whose bias
    is -inf on every key the masks allow; or None where the masks cannot empty a row (_can_empty_rows:
    under key padding alone with lengths the caller vouches are nonempty, none can). cuDNN leaves rows
    past Lq undefined and writes NaN into rows with no key; libnn promises zeros. Under key padding
    alone only whole batch entries can be empty: one packed launch. All on the device (no
    synchronisation)."""
    p = problem
    if not _can_empty_rows(p):
        return None
    if (p.bias_shape is None or p.bias_keeps_a_key) and not p.has_seq_lens_q and p.causal != "bottom_right":
        kernel = bind_zero_empty_batches(p.B, p.output_bytes // p.B)  # (the cudnn path takes no empty problem)
        return lambda o, lens_q, lens_kv, bias: kernel(lens_kv, o)
    return functools.partial(_zero_rows_without_keys, p)


def _zero_rows_without_keys(problem: AttentionProblem, o, lens_q, lens_kv, bias) -> None:
    """_bind_zero_rows's zeroing where a row, not only a batch entry, can be empty: a closed form per
    row from the masks, or a pass over the bias; with a bias, a boolean temporary of the bias's shape
    (with a causal mask too, (B, H, Sq, Skv))."""
    import cupy

    p = problem
    if bias is None or p.bias_keeps_a_key:  # the masks alone: a closed form per row
        i = cupy.arange(p.Sq, dtype=cupy.int32)[None, None, :, None]
        Lq = p.Sq if lens_q is None else lens_q[:, None, None, None]
        Lk = p.Skv if lens_kv is None else lens_kv[:, None, None, None]
        has_key = (i < Lq) & (Lk > 0)
        if p.causal == "bottom_right":
            has_key &= i + Lk - Lq >= 0
    elif p.causal is None:  # the keys a row may see do not depend on the row: reduce at the bias's own shape
        # (a key-padding bias (B, 1, 1, Skv) gives (B, 1, 1, 1), not a (B, H, Sq, Skv) temporary)
        Lk = p.Skv if lens_kv is None else lens_kv[:, None, None, None]
        has_key = cupy.any((cupy.arange(p.Skv, dtype=cupy.int32) < Lk) & (bias > -cupy.inf), axis=-1, keepdims=True)
        if lens_q is not None:
            has_key = has_key & (cupy.arange(p.Sq, dtype=cupy.int32)[:, None] < lens_q[:, None, None, None])
    else:  # a -inf bias can mask exactly the keys the masks allow: look at every (row, key) pair
        allowed = allowed_keys(p.Sq, p.Skv, p.causal, lens_q, lens_kv, p.B, cupy)
        has_key = cupy.any(allowed & (bias > -cupy.inf), axis=-1, keepdims=True)
    if has_key.shape[1:] == (1, 1, 1):  # one flag per batch entry (key padding): o as (B, rest), contiguous,
        cupy.copyto(o.reshape(o.shape[0], -1), 0, where=~has_key.reshape(-1, 1))  # not a strided 4-D walk
    else:
        cupy.copyto(_bhsd(o, p.layout), 0, where=~has_key)


def _can_empty_rows(problem: AttentionProblem) -> bool:
    """Whether the masks may leave a row of o without a key. Query lengths and a plain bias may; kv
    lengths may be 0 unless the caller vouches otherwise (CheckedLengths(nonempty=True)); then, with no
    bias or a KeyPaddingBias (which leaves each row's last key), a top-left diagonal still leaves key 0
    to every row, and only a bottom-right one below Lk < Sq empties rows."""
    p = problem
    return (p.has_seq_lens_q or (p.has_seq_lens_kv and not p.lens_kv_nonempty)
            or (p.bias_shape is not None and not p.bias_keeps_a_key)
            or (p.causal == "bottom_right" and (p.Sq > p.Skv or p.has_seq_lens_kv)))


# At most this many FLOPs (attention_flops), non-causal self-attention with 32 <= D <= 64 ran faster on
# the custom flash kernel than on cuDNN's SDPA, whose time there hardly grows with the work (a fixed
# cost per call dominates): measured at an encoder's shapes, benchmarks/RESULTS.md, eleventh session.
CUSTOM_FASTER_BELOW_FLOPS = 10**9


def _cudnn_slower(problem: AttentionProblem) -> str | None:
    """Small non-causal self-attention (an encoder's), dense, with no bias or a bias broadcast along the
    query rows (a key-padding bias, which the flash kernel stages once), rows the flash kernel takes; and
    a decode step that attn3_decode takes: the custom kernel first. (cudnn then comes after unfused, which
    the custom kernels' conditions here keep from running.)"""
    p = problem
    small = (p.layout != "THD" and not p.pages and p.causal is None and p.Sq == p.Skv and 32 <= p.D <= 64
             and p.flops <= CUSTOM_FASTER_BELOW_FLOPS and p.aligned
             and (p.bias_shape is None or p.bias_shape[2] == 1)
             and flash_fits(p.dtype, p.D, p.bias_shape is not None, p.scale))
    if small:
        return (f"{p.flops / 1e6:.0f} MFLOP of self-attention with D={p.D}: the custom flash kernel is faster "
                f"below {CUSTOM_FASTER_BELOW_FLOPS / 1e9:g} GFLOP")
    if _split_decoded(p):
        return "a decode step (one query row per sequence): the custom split-K kernel is faster"
    return None


def _split_decoded(p: AttentionProblem) -> bool:
    """Whether the custom path runs `p` on attn3_decode (dense, or paged in pages it reads), which read a
    decode step's KV cache faster than cuDNN's deterministic plans at every decode shape measured but the
    shortest (120 keys at batch 1: 8.1 against 6.8 us alone), and took less of the 1.1B LLaMA's decode
    step at batch 1, 8 and 64 (benchmarks/RESULTS.md, fifteenth session)."""
    return (p.layout != "THD" and (not p.pages or decode_page_size_fits(p.page_size)) and p.aligned
            and p.device.startswith("gpu")
            and decode_fits(p.dtype, p.D, p.Sq, p.Hq // p.Hkv, p.bias_shape is not None, p.causal, batch=p.B,
                            Skv=p.Skv)
            and decode_shared_memory_fits(p.D, gpu_index(p.device)))


@op.path("cudnn", kind="library", device="gpu", requires=("cudnn",), supports=_cudnn_support, slower=_cudnn_slower,
         binds=True)
def _cudnn(problem: AttentionProblem, q, k, v, seq_lens_q, seq_lens_kv, bias):
    p = problem
    if p.layout == "THD":
        return _bind_cudnn_packed(p)
    if p.pages:
        return _bind_cudnn_paged(p)
    padded = p.has_seq_lens_q or p.has_seq_lens_kv
    uids = [UID_Q, UID_K, UID_V, UID_O] + ([UID_BIAS] if p.bias_shape else []) \
        + ([UID_LENS_Q, UID_LENS_KV] if padded else [])
    full_q = device_constant(p.B, p.Sq, np.int32) if padded else None
    full_kv = device_constant(p.B, p.Skv, np.int32) if padded else None
    contiguous_bias = bias is None or bias.flags.c_contiguous
    new = allocator(_output_shape(p), dtypes.parse(p.dtype))
    timing = _decode_timing_arrays(q, k, v, new, bias, full_q, full_kv) if p.Sq == 1 else None
    execute = cudnn_backend.graph_for(p, attention_graph_builder(p), p.describe, timing_arrays=timing).executor(uids)
    zero_rows = _bind_zero_rows(p)

    def run(q, k, v, seq_lens_q, seq_lens_kv, bias):
        o = new()
        execute(q, k, v, o)
        return o

    def run_masked(q, k, v, seq_lens_q, seq_lens_kv, bias):
        lens_q, lens_kv = _lengths(p, q, seq_lens_q, seq_lens_kv) if padded else (None, None)
        if not contiguous_bias:
            bias = bias.copy()
        o = new()
        extra = [] if bias is None else [bias]
        if padded:
            extra += [full_q if lens_q is None else lens_q, full_kv if lens_kv is None else lens_kv]
        execute(q, k, v, o, *extra)
        if zero_rows:
            zero_rows(o, lens_q, lens_kv, bias)
        return o
    # without lengths or a bias (a causal mask at most) the graph takes q, k, v and o alone, and no row is zeroed
    return run if not padded and p.bias_shape is None and zero_rows is None else run_masked


def _decode_timing_arrays(q, k, v, new_o, bias, full_q, full_kv):
    """For a one-row (decode) problem, what cuDNN's plans are timed on (graph_for's timing_arrays): the
    first call's q, k, v and bias, a new o (from `new_o`), and full lengths (no host read of the caller's). Its
    heuristics rank these plans not by speed: on the H100 with cuDNN 9.19 their deterministic first
    choice (kernel config 6) took 1.3 to 1.4 times as long as their third (3) at every decode shape
    timed (benchmarks/RESULTS.md, thirteenth session)."""
    def arrays() -> dict[int, Any]:
        found = {UID_Q: q, UID_K: k, UID_V: v, UID_O: new_o()}
        if bias is not None:
            found[UID_BIAS] = bias if bias.flags.c_contiguous else bias.copy()
        if full_q is not None:
            found.update({UID_LENS_Q: full_q, UID_LENS_KV: full_kv})
        return found
    return arrays


def _bind_cudnn_packed(problem: AttentionProblem):
    """The runner of a THD problem: cuDNN's SDPA over the packed sequences (their lengths as the
    padding mask's, ragged offsets scaled by each tensor's token stride); o starts as zeros, so rows
    no sequence covers are zeros, and every row a sequence covers has a key."""
    import cupy

    p = problem
    uids = [UID_Q, UID_K, UID_V, UID_O, UID_LENS_Q, UID_LENS_KV, UID_RAGGED_Q, UID_RAGGED_K, UID_RAGGED_V,
            UID_RAGGED_O]
    execute = cudnn_backend.graph_for(p, attention_graph_builder(p), p.describe).executor(uids)
    strides = (p.q_strides[2], p.k_strides[2], p.v_strides[2], p.o_strides[2])
    shape, dtype = _output_shape(p), dtypes.parse(p.dtype)

    def run(q, k, v, packed, _, __):
        lengths, _offsets = _packed_arrays(p, packed, q)
        o = cupy.zeros(shape, dtype)
        execute(q, k, v, o, lengths, lengths, *(packed.element_offsets(s) for s in strides))
        return o
    return run


def _bind_cudnn_paged(problem: AttentionProblem):
    """The runner of a paged problem: cuDNN's SDPA reading k and v through the page table (one array
    for both tensors' tables), under the padding mask (full lengths where the caller gave none); rows
    with no key zeroed as on the dense path. No synchronisation with a CheckedPageTable and checked (or
    no) lengths: what a CUDA graph captures."""
    import cupy

    p = problem
    uids = [UID_Q, UID_K, UID_V, UID_O, UID_LENS_Q, UID_LENS_KV, UID_PAGES_K, UID_PAGES_V]
    execute = cudnn_backend.graph_for(p, attention_graph_builder(p), p.describe).executor(uids)
    full_q, full_kv = device_constant(p.B, p.Sq, np.int32), device_constant(p.B, p.Skv, np.int32)
    zero_rows = _bind_zero_rows(p)
    new = allocator(_output_shape(p), dtypes.parse(p.dtype))

    def run(q, k, v, seq_lens_q, seq_lens_kv, page_table):
        lens_q, lens_kv = _lengths(p, q, seq_lens_q, seq_lens_kv)
        table = cupy.ascontiguousarray(_page_table(p, page_table))  # the graph's rows are max_pages apart
        o = new()
        execute(q, k, v, o, full_q if lens_q is None else lens_q, full_kv if lens_kv is None else lens_kv, table,
                table)
        if zero_rows:
            zero_rows(o, lens_q, lens_kv, None)
        return o
    return run


# --- custom and unfused paths: kernels/attention.cu ------------------------------------------------
def _kernels_support(problem: AttentionProblem) -> str | None:
    """What the custom and unfused paths share: kernels/attention.cu's dtypes and head dims, no THD."""
    if problem.layout == "THD":
        return "layout THD (packed sequences) runs on cudnn and reference"
    return _gpu_support(problem) or flash_supports(problem.dtype, problem.D)


def _custom_support(problem: AttentionProblem) -> str | None:
    if problem.pages and not _split_decoded(problem):
        return ("paged k and v (page_table) run on the custom path only as a decode step the split-K kernel "
                "takes (one query row, fp16/bf16, no bias, D a multiple of 8 up to 128, up to 16 query heads a "
                "kv head, pages of a power-of-two size >= 64); cudnn and reference run the rest")
    return _kernels_support(problem)


def _unfused_support(problem: AttentionProblem) -> str | None:
    if problem.pages:
        return "paged k and v (page_table) run on cudnn, custom (a decode step) and reference: unfused reads no pages"
    return _kernels_support(problem)


def custom_versions(problem: AttentionProblem, aligned: bool = True) -> tuple[str, ...]:
    """The numbered kernels of kernels/attention.cu that can run `problem`, baseline first (for tests and
    the sanitize driver; attention_kernels.flash_attention(version=...) takes one): attn1_naive, attn2_flash
    where it fits and attn3_decode where it fits (a paged problem: attn3_decode alone, where it fits).
    `aligned`: whether o's rows start on 16 bytes too (q's, k's and v's are the problem's; a misaligned
    bias counts against attn2 here, though flash_attention would copy it)."""
    p = problem
    if flash_supports(p.dtype, p.D):
        return ()
    flash = aligned and p.aligned and flash_fits(p.dtype, p.D, p.bias_shape is not None, p.scale)
    decode = _split_decoded(p)
    if p.pages:  # only attn3 reads pages
        return ("attn3_decode",) if decode else ()
    return ("attn1_naive",) + (("attn2_flash",) if flash else ()) + (("attn3_decode",) if decode else ())


def _kernel_views(problem: AttentionProblem, q, k, v, o, bias) -> tuple:
    """What attention_kernels takes: the (B, H, S, D) views of q, k, v and o, and bias as a
    (B, Hq, Sq, Skv) view with its broadcast dimensions at stride 0 (or None)."""
    p = problem
    return (*(_bhsd(a, p.layout) for a in (q, k, v, o)),
            None if bias is None else array_module(bias).broadcast_to(bias, (p.B, p.Hq, p.Sq, p.Skv)))


def _bind_kernels(bind, problem: AttentionProblem, q, k, v, bias, *, views_per_call: bool):
    """The runner of the custom or unfused path: `bind` (attention_kernels.bind_flash or bind_unfused)
    reads the geometry of the views of these arrays and of an o like the calls' once; each call
    validates its lengths, allocates o and runs the bound kernels. `views_per_call`: whether the bound
    kernels need the views themselves; the flash kernels read only pointers, which the views share
    with the arrays, so their calls skip making them."""
    p = problem
    new = allocator(_output_shape(p), dtypes.parse(p.dtype))
    padded = p.has_seq_lens_q or p.has_seq_lens_kv
    # o's geometry and alignment are read from a real output, as q's are: one allocation per signature
    kernels = bind(*_kernel_views(p, q, k, v, new(), bias), scale=p.scale, causal=p.causal)

    def run(q, k, v, seq_lens_q, seq_lens_kv, bias):
        o = new()
        kernels(q, k, v, o, bias, None, None)
        return o

    def run_padded(q, k, v, seq_lens_q, seq_lens_kv, bias):
        lens_q, lens_kv = _lengths(p, q, seq_lens_q, seq_lens_kv)
        o = new()
        kernels(q, k, v, o, bias, lens_q, lens_kv)
        return o

    def run_views(q, k, v, seq_lens_q, seq_lens_kv, bias):
        lens_q, lens_kv = _lengths(p, q, seq_lens_q, seq_lens_kv) if padded else (None, None)
        o = new()
        kernels(*_kernel_views(p, q, k, v, o, bias), lens_q, lens_kv)
        return o
    return run_views if views_per_call else run_padded if padded else run


def _bind_paged_decode(problem: AttentionProblem, q, k, v):
    """The custom path's runner of a paged decode step (attn3_decode reading the pages): each call checks
    its lengths and its table (unless a CheckedPageTable) as the cudnn path does."""
    import cupy

    p = problem
    new = allocator(_output_shape(p), dtypes.parse(p.dtype))
    kernels = bind_paged_decode(*_kernel_views(p, q, k, v, new(), None)[:4], p.Skv // p.page_size, scale=p.scale)

    def run(q, k, v, seq_lens_q, seq_lens_kv, page_table):
        lens_q, lens_kv = _lengths(p, q, seq_lens_q, seq_lens_kv)
        table = cupy.ascontiguousarray(_page_table(p, page_table))  # rows max_pages apart, as bound
        o = new()
        kernels(q, k, v, o, None, lens_q, lens_kv, table)
        return o
    return run


@op.path("custom", kind="custom", device="gpu", supports=_custom_support, binds=True)
def _custom(problem: AttentionProblem, q, k, v, seq_lens_q, seq_lens_kv, bias_or_pages):
    """bias_or_pages: the bias, or for a paged problem the page table."""
    if problem.pages:
        return _bind_paged_decode(problem, q, k, v)
    return _bind_kernels(bind_flash, problem, q, k, v, bias_or_pages, views_per_call=False)


@op.path("unfused", kind="custom", device="gpu", supports=_unfused_support, binds=True)
def _unfused(problem: AttentionProblem, q, k, v, seq_lens_q, seq_lens_kv, bias):
    p = problem
    # fp32 copies of q, k, v (v's twice where lengths zero it past them) and the (B, Hq, Sq, Skv) fp32 scores,
    # then the (B, Hq, Sq, D) product; checked once per signature, at the bind, as the registry checks the output
    temporaries = 4 * (p.B * p.Hq * p.Sq * (p.Skv + 2 * p.D) + (2 + p.has_seq_lens_kv) * p.B * p.Hkv * p.Skv * p.D)
    memory.require(temporaries, "gpu", "attention", f"the unfused path's fp32 scores and copies for {p.describe()}")
    return _bind_kernels(bind_unfused, problem, q, k, v, bias, views_per_call=True)


# --- reference --------------------------------------------------------------------------------------
def allowed_keys(Sq: int, Skv: int, causal: str | None, lens_q, lens_kv, B: int, xp=np) -> Any:
    """(B, 1, Sq, Skv) booleans: which key each query row may attend to (rows past Lq: none), in
    NumPy or (xp=cupy, lengths on the device) CuPy."""
    Lq = xp.full(B, Sq) if lens_q is None else xp.asarray(lens_q).astype(xp.int64)
    Lk = xp.full(B, Skv) if lens_kv is None else xp.asarray(lens_kv).astype(xp.int64)
    i = xp.arange(Sq)[None, :, None]
    j = xp.arange(Skv)[None, None, :]
    allowed = (j < Lk[:, None, None]) & (i < Lq[:, None, None])
    if causal == "top_left":
        allowed &= j <= i
    elif causal == "bottom_right":
        allowed &= j <= i + (Lk - Lq)[:, None, None]
    return allowed[:, None]


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: AttentionProblem, q, k, v, seq_lens_q, seq_lens_kv, bias):
    p = problem
    if p.layout == "THD":
        return _reference_packed(p, q, k, v, seq_lens_q)
    if p.pages:
        return _reference_paged(p, q, k, v, seq_lens_q, seq_lens_kv, bias)
    lens_q, lens_kv = _lengths(p, q, seq_lens_q, seq_lens_kv)
    group = p.Hq // p.Hkv
    q64 = _bhsd(q, p.layout).astype(np.float64)
    k64, v64 = (_bhsd(a, p.layout).astype(np.float64) for a in (k, v))  # copies, (B, Hkv, Skv, D)
    if lens_kv is not None:  # zeros past a sequence's length: its weight 0 times a stale NaN there is NaN
        past = (np.arange(p.Skv) >= lens_kv[:, None])[:, None, :, None]
        for a in (k64, v64):
            np.copyto(a, 0.0, where=past)
    k64, v64 = (np.repeat(a, group, axis=1) for a in (k64, v64))
    scores = (q64 @ k64.swapaxes(-1, -2)) * p.scale  # matmul, not einsum: BLAS keeps S=4096 fast
    if bias is not None:
        scores = scores + bias.astype(np.float64)
    scores = np.where(allowed_keys(p.Sq, p.Skv, p.causal, lens_q, lens_kv, p.B), scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    empty = row_max == -np.inf  # no key allowed (or all at -inf): the row is zeros
    weights = np.exp(scores - np.where(empty, 0.0, row_max))
    weights /= np.where(empty, 1.0, weights.sum(axis=-1, keepdims=True))
    o = np.where(empty, 0.0, weights @ v64)
    if p.layout == "BSHD":
        o = o.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(o).astype(q.dtype)


def _reference_packed(problem: AttentionProblem, q, k, v, packed: PackedSequences):
    """Layout THD on the reference path: each sequence alone, as a dense (1, L, H, D) problem."""
    p = problem
    lengths, offsets = _packed_arrays(p, packed, q)
    o = np.zeros(_output_shape(p), q.dtype)
    for start, length in zip(offsets[:-1].tolist(), lengths.tolist()):
        rows = slice(start, start + length)
        if length:
            o[rows] = attention(q[None, rows], k[None, rows], v[None, rows], scale=p.scale, causal=p.causal or False,
                                layout="BSHD", path="reference")[0]
    return o


def _reference_paged(problem: AttentionProblem, q, k, v, seq_lens_q, seq_lens_kv, page_table):
    """A paged problem on the reference path: each sequence's pages gathered into a dense cache of Skv
    keys (in `layout`), then the dense reference."""
    p = problem
    table = _page_table(p, page_table)
    dense = []
    for pool in (k, v):
        keys = _bhsd(pool, p.layout)[table]  # (B, max_pages, Hkv, page_size, D)
        keys = keys.transpose(0, 2, 1, 3, 4).reshape(p.B, p.Hkv, p.Skv, p.D)
        dense.append(keys if p.layout == "BHSD" else keys.transpose(0, 2, 1, 3))
    return _reference(replace(p, pages=0, page_size=0), q, *dense, seq_lens_q, seq_lens_kv, None)
