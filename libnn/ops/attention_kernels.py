"""The custom paths of attention: kernels/attention.cu launched on CuPy arrays.

`bind_flash` binds o = softmax(scale · q kᵀ + bias, masked) v with one fused kernel: attn3_decode
(split-K decoding on tensor cores, then attn3_combine where there are several splits) for one query row
per sequence without bias or top-left mask — a decoder's step — where D and the GQA group fit it;
attn2_flash (FlashAttention-2 on tensor cores) when the problem fits it — fp16/bf16, head dim D <= 128
with D % 8 == 0, q, k, v, o rows 16-byte aligned, scale != 0 under a bias — otherwise attn1_naive (one
warp per query row, any D <= 256, fp32 too). `bind_unfused` binds the same in three steps that hold the
(Sq, Skv) scores in memory: S = q kᵀ on cuBLAS (cupy.matmul in fp32), our masked softmax kernel in
place, O = P v on cuBLAS. A bind reads the arrays' shapes, strides and alignment once (the kernel, its
grid and its scalars are packed then, runtime/launch.py) and keeps none of them; its runner takes each
call's arrays. `flash_attention` and `unfused_attention` bind and run once (tests, the sanitize driver).

Arguments (the op front end, libnn/ops/attention.py, validates them): q (B, Hq, Sq, D), k and v
(B, Hkv, Skv, D), o (B, Hq, Sq, D), any element strides with the last one 1, one dtype (fp16, bf16,
fp32); Hq % Hkv == 0; seq_lens_q / seq_lens_kv None or int32 (B,) device arrays with 0 <= L <= S; bias
None or (B, Hq, Sq, Skv) in the io dtype, broadcast dimensions at stride 0; causal None, "top_left" or
"bottom_right". The kernels' semantics, limits and launch table are in kernels/attention.cu.
"""

from __future__ import annotations

import math

from libnn import dtypes
from libnn.runtime import contracts, launch
from libnn.runtime.arrays import allocator, data_pointer
from libnn.runtime.device import blocks_by_shared_memory, current_device_id, multiprocessors

_FILE = "attention.cu"
_VERSIONS = ("attn1_naive", "attn2_flash", "attn3_decode")  # 1) baseline, 2) and 3) where they apply
_CAUSAL = {None: 0, "top_left": 1, "bottom_right": 2}
MAX_HEAD_DIM = 256            # attn1: 8 elements per lane
FLASH_BUCKETS = (32, 64, 96, 128)
_ATTN = contracts.params(_FILE, "ATTN_PARAMS")  # attn1's and attn2's parameters
_SOFTMAX = contracts.params(_FILE, "attn_softmax_##SUFFIX")
_ZERO = contracts.params(_FILE, "attn_zero_empty_batches")
_DECODE = contracts.params(_FILE, "ATTN3_PARAMS")
_COMBINE = contracts.params(_FILE, "attn3_combine_##SUFFIX")
_K = contracts.constants(_FILE)
FLASH_WARPS = _K["ATTN2_WARPS"]
_BN = _K["ATTN2_BN"]          # keys per attn2 tile
_ROWS_PER_ATTN1_BLOCK = _K["ATTN1_THREADS"] // 32  # a warp per query row
_SOFTMAX_THREADS = _K["SOFTMAX_THREADS"]
_ZERO_THREADS = _K["ZERO_THREADS"]
DECODE_THREADS, DECODE_MAX_GROUP = _K["ATTN3_THREADS"], _K["ATTN3_MAX_G"]
_DECODE_WARPS, _DECODE_STAGES, _COMBINE_THREADS = DECODE_THREADS // 32, _K["ATTN3_STAGES"], _K["COMBINE_THREADS"]
DECODE_MAX_SPLITS = 8  # splits of a (b, kv head)'s keys at most: attn3_combine adds them one by one
DECODE_SHORT_TILES = 16  # a cache of at most this many tiles is one split from a quarter of the SMs' blocks on


def flash_supports(dtype: str, head_dim: int) -> str | None:
    """None when the custom paths take this dtype and head dim, else why not."""
    if dtype not in dtypes.KERNEL_SUFFIX:
        return f"the custom attention kernels take fp16, bf16 and fp32, not {dtype}"
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"the custom attention kernels take head dims 1 to {MAX_HEAD_DIM}, got D={head_dim}"
    return None


def _kernel_strides(a) -> tuple[int, ...]:
    """Strides in elements as the kernels take them: 0 along size-1 dimensions, which also marks a
    broadcast bias dimension (never stepped, so never in an alignment check). Not attention.py's
    _problem_strides, which keys plans and fills size-1 dimensions with contiguous strides instead."""
    return tuple(0 if n == 1 else s // a.itemsize for n, s in zip(a.shape, a.strides))


def _rows_aligned(a) -> bool:
    """Every row of `a` starts on 16 bytes: the pointer and all strides but the last's."""
    return data_pointer(a) % 16 == 0 and all(s % (16 // a.itemsize) == 0 for s in _kernel_strides(a)[:-1])


def flash_fits(dtype: str, head_dim: int, has_bias: bool, scale: float) -> bool:
    """Whether attn2_flash takes a problem, alignment aside (every row of q, k, v, o must also start on
    16 bytes): fp16/bf16, D <= 128 with D % 8 == 0, scale != 0 under a bias."""
    return (dtype in ("fp16", "bf16") and head_dim <= FLASH_BUCKETS[-1] and head_dim % 8 == 0
            and (not has_bias or scale != 0))


def decode_launch(head_dim: int) -> tuple[str, int]:
    """(kernel name without dtype suffix, dynamic shared memory) of attn3_decode for a head dim, from
    kernels/attention.cu's LAUNCH table: Q's 16 rows, then each warp's stages of a K and a V tile."""
    bucket = next(b for b in FLASH_BUCKETS if head_dim <= b)
    row = (bucket + 8) * 2
    return f"attn3_decode_d{bucket}", 16 * row + _DECODE_WARPS * _DECODE_STAGES * 2 * _BN * row


def decode_fits(dtype: str, head_dim: int, Sq: int, group: int, has_bias: bool, causal: str | None, *,
                batch: int, Skv: int) -> bool:
    """Whether attn3_decode takes a problem, alignment aside (q's, k's and v's rows must start on 16
    bytes): fp16 or bf16, one query row, at least one key position (an empty cache has no split), no
    bias, no top-left mask (with one row, bottom-right masks nothing), no empty dimension, D <= 128 with
    D % 8 == 0 (attn2's
    buckets), at most DECODE_MAX_GROUP query heads per kv head (the rows of one mma tile), and a batch
    within the grid's z limit (launch.MAX_GRID_YZ; kv heads go along x, the splits along y). The device
    must also give a block the kernel's shared memory (decode_shared_memory_fits)."""
    return (dtype in ("fp16", "bf16") and Sq == 1 and Skv >= 1 and not has_bias and causal != "top_left"
            and 1 <= group <= DECODE_MAX_GROUP and head_dim % 8 == 0 and 8 <= head_dim <= FLASH_BUCKETS[-1]
            and 1 <= batch <= launch.MAX_GRID_YZ)


def decode_shared_memory_fits(head_dim: int, device_id: int) -> bool:
    """Whether a block of device `device_id` may have attn3_decode's shared memory at this head dim (an
    H100 takes every bucket, an A100 up to 96, an sm_86/89 GPU 32)."""
    return blocks_by_shared_memory(device_id, decode_launch(head_dim)[1]) > 0


def flash_version(q, k, v, o, bias=None, scale: float = 1.0, causal: str | None = None) -> str:
    """The kernel `flash_attention` runs for these arrays: attn3_decode where it applies, else attn2_flash
    where it applies, else attn1_naive."""
    dtype, D = dtypes.short_name(q.dtype), q.shape[3]
    if (decode_fits(dtype, D, q.shape[2], q.shape[1] // k.shape[1], bias is not None, causal, batch=q.shape[0],
                    Skv=k.shape[2])
            and all(_rows_aligned(a) for a in (q, k, v)) and decode_shared_memory_fits(D, current_device_id())):
        return "attn3_decode"
    fits = flash_fits(dtype, D, bias is not None, scale) and all(_rows_aligned(a) for a in (q, k, v, o))
    return "attn2_flash" if fits else "attn1_naive"


def decode_split_tiles(B: int, Hkv: int, Skv: int, sms: int, blocks_per_sm: int) -> int:
    """attn3_decode's key tiles (of ATTN2_BN keys) per split of a full cache. One split, whose blocks write o
    themselves, where the batch's own (b, kv head) blocks are enough: three quarters of the SMs, or a quarter
    of them over a cache of at most DECODE_SHORT_TILES tiles; there attn3_combine's launch and the partials'
    round trip cost more than the extra blocks gain. Elsewhere as many splits as fit the blocks (Hkv x splits
    x B) in the GPU's resident blocks (`sms` x `blocks_per_sm`) at once, not one over (a second wave of a
    few blocks is slower than one split fewer), at most DECODE_MAX_SPLITS, and never fewer tiles a split
    than a block's warps, which take a split's tiles in turn (the measurements: benchmarks/RESULTS.md,
    twentieth session). The launch's splits are ceil(Skv / (64 x this)); the kernel spreads a shorter
    sequence (its length is on the GPU) over them as its own tiles allow."""
    tiles, blocks = -(-Skv // _BN), B * Hkv
    if 4 * blocks >= 3 * sms or (4 * blocks >= sms and tiles <= DECODE_SHORT_TILES):
        return max(_DECODE_WARPS, tiles)
    splits = min(DECODE_MAX_SPLITS, max(1, sms * max(1, blocks_per_sm) // blocks))
    return max(_DECODE_WARPS, -(-tiles // splits))


def decode_page_size_fits(page_size: int) -> bool:
    """Whether attn3_decode reads pages of this many keys: a power of two of at least a tile (64 keys), so
    that no tile straddles two pages."""
    return page_size >= _BN and page_size & (page_size - 1) == 0


def bind_paged_decode(q, k, v, o, max_pages: int, *, scale: float):
    """run(q, k, v, o, bias, lens_q, lens_kv, page_table) -> None: attn3_decode over paged k and v, for
    arrays of these shapes, strides and dtype: q and o (B, Hq, 1, D) views, k and v the pools' (pages, Hkv,
    page_size, D) views, each call's page_table (B, max_pages) int32 C-contiguous (bias is None: none is
    taken). The caller checks that the problem fits (decode_fits, decode_page_size_fits,
    decode_shared_memory_fits) and that every table entry lies in the pools."""
    return _bind_decode(q, k, v, o, scale, max_pages)


def _bind_decode(q, k, v, o, scale: float, max_pages: int | None = None):
    """run(q, k, v, o, bias, lens_q, lens_kv, page_table=None): attn3_decode's splits into fp32 partials
    (from CuPy's pool at each call), then attn3_combine into o; both launched programmatically where the
    GPU can. With one split attn3_decode writes o itself and nothing is merged. With `max_pages`
    (bind_paged_decode) k and v are pools of pages and each call passes a table of that many pages a
    sequence."""
    B, Hq, _, D = q.shape
    Hkv, rows = k.shape[1], k.shape[2]   # paged: a page's keys
    Skv = rows * max_pages if max_pages is not None else rows
    device = current_device_id()
    name, smem = decode_launch(D)
    split_tiles = decode_split_tiles(B, Hkv, Skv, multiprocessors(device), blocks_by_shared_memory(device, smem))
    splits = -(-Skv // (split_tiles * _BN))
    suffix = dtypes.KERNEL_SUFFIX[dtypes.short_name(q.dtype)]
    (q_sb, q_sh), (k_sb, k_sh, k_ss), (v_sb, v_sh, v_ss) = (_kernel_strides(q)[:2], _kernel_strides(k)[:3],
                                                            _kernel_strides(v)[:3])
    o_sb, o_sh = _kernel_strides(o)[:2]
    paging = dict(t_sb=max_pages, page_shift=rows.bit_length() - 1) if max_pages is not None else \
        dict(t_sb=0, page_shift=0)
    A = launch.ARRAY
    programmatic = launch.programmatic_supported(f"gpu:{device}")
    split = launch.bind(_FILE, f"{name}_{suffix}", (Hkv, splits, B), (DECODE_THREADS,),
                        _DECODE.pack(q=A, k=A, v=A, part_o=A, part_ml=A, o=A, o_sb=o_sb, o_sh=o_sh, lens_q=A,
                                     lens_kv=A, Hq=Hq, Hkv=Hkv, Skv=Skv, D=D, splits=splits,
                                     scale_log2=scale * math.log2(math.e), q_sb=q_sb, q_sh=q_sh, k_sb=k_sb,
                                     k_sh=k_sh, k_ss=k_ss, v_sb=v_sb, v_sh=v_sh, v_ss=v_ss, page_table=A, **paging),
                        shared_mem=smem, programmatic=programmatic)
    if splits == 1:
        def run_direct(q, k, v, o, bias, lens_q, lens_kv, page_table=None):
            split(q, k, v, None, None, o, lens_q, lens_kv, page_table)
        return run_direct
    combine = launch.bind(_FILE, f"attn3_combine_{suffix}", (B * Hq,), (_COMBINE_THREADS,),
                          _COMBINE.pack(part_o=A, part_ml=A, o=A, Hq=Hq, D=D, splits=splits, o_sb=o_sb, o_sh=o_sh),
                          programmatic=programmatic)
    new_part_o, new_part_ml = allocator((B, Hq, splits, D), "float32"), allocator((B, Hq, splits, 2), "float32")

    def run(q, k, v, o, bias, lens_q, lens_kv, page_table=None):
        part_o, part_ml = new_part_o(), new_part_ml()
        split(q, k, v, part_o, part_ml, None, lens_q, lens_kv, page_table)
        combine(part_o, part_ml, o)
    return run


def _bias_staged(bias) -> bool:
    """Whether attn2 can stage the bias's rows with 16-byte copies as it is: contiguous rows, aligned,
    Skv % 8 == 0."""
    return _kernel_strides(bias)[3] == 1 and bias.shape[3] % 8 == 0 and _rows_aligned(bias)


def _padded_bias(bias):
    """A copy of bias that attn2 can stage: rows contiguous and padded to a multiple of 8 elements, the
    broadcast dimensions kept at size 1 and viewed back at stride 0 (a broadcast bias is not
    materialised). Made at every call that needs it: the bias's values may have changed."""
    import cupy

    Skv = bias.shape[3]
    stored = bias[tuple(slice(0, 1) if s == 0 else slice(None) for s in _kernel_strides(bias)[:3])]
    padded = cupy.zeros((*stored.shape[:3], -(-Skv // 8) * 8), bias.dtype)
    padded[..., :Skv] = stored
    return cupy.broadcast_to(padded[..., :Skv], bias.shape)


def _args(q, k, v, o, scale, causal, lens_q, lens_kv, bias) -> tuple:
    """The parameters attn1 and attn2 share, by the names ATTN_PARAMS gives them, each pointer as given."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    strides = {}
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o)):
        strides[f"{name}_sb"], strides[f"{name}_sh"], strides[f"{name}_ss"] = _kernel_strides(a)[:3]
    (strides["b_sb"], strides["b_sh"], strides["b_si"],
     strides["b_sj"]) = _kernel_strides(bias) if bias is not None else (0, 0, 0, 0)
    return _ATTN.pack(q=q, k=k, v=v, o=o, bias=bias, lens_q=lens_q, lens_kv=lens_kv, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq,
                      Skv=Skv, D=D, causal=_CAUSAL[causal], scale_log2=scale * math.log2(math.e), **strides)


def _softmax_args(s, bias, lens_q, lens_kv, B: int, Hq: int, Sq: int, Skv: int, scale: float, causal) -> tuple:
    """attn_softmax's parameters, by name, each pointer as given."""
    b_sb, b_sh, b_si, b_sj = _kernel_strides(bias) if bias is not None else (0, 0, 0, 0)
    return _SOFTMAX.pack(s=s, bias=bias, lens_q=lens_q, lens_kv=lens_kv, B=B, Hq=Hq, Sq=Sq, Skv=Skv,
                         causal=_CAUSAL[causal], scale_log2=scale * math.log2(math.e), b_sb=b_sb, b_sh=b_sh,
                         b_si=b_si, b_sj=b_sj)


def _placeholders(declared: contracts.Params, packed: tuple) -> tuple:
    """`packed` with every pointer replaced by launch.ARRAY: a bound launch writes each call's there."""
    return tuple(launch.ARRAY if p.kind == "ptr" else value for p, value in zip(declared.params, packed))


def flash_launch(head_dim: int, has_bias: bool, warps: int = FLASH_WARPS) -> tuple[str, int, int, int]:
    """(kernel name without dtype suffix, threads, query rows per block, dynamic shared memory) of attn2
    for a head dim, from kernels/attention.cu's LAUNCH table."""
    bucket = next(b for b in FLASH_BUCKETS if head_dim <= b)
    rows = 16 * warps
    smem = (rows + 4 * _BN) * (bucket + 8) * 2 + (2 * rows * (_BN + 8) * 2 if has_bias else 0)
    return f"attn2_flash_{'bias_' if has_bias else ''}d{bucket}", 32 * warps, rows, smem


def _nothing(*arrays) -> None:
    """The runner of a problem with no query row: no launch (a grid of no block is an error)."""


def bind_flash(q, k, v, o, bias=None, *, scale: float, causal: str | None, version: str | None = None):
    """run(q, k, v, o, bias, lens_q, lens_kv) -> None: o = softmax(scale · q kᵀ + bias, masked) v, fused,
    for arrays of these shapes, strides, dtype and alignment (read here, not kept); `version` forces a
    kernel of kernels/attention.cu (attention.custom_versions lists those a problem can take; attn2_flash
    only where flash_version picks it). The kernel reads only pointers, so a call may pass the arrays
    these views view instead of the views. Under attn2, a bias it cannot stage is copied at each call."""
    B, Hq, Sq, D = q.shape
    if B * Hq * Sq == 0:
        return _nothing
    chosen = flash_version(q, k, v, o, bias, scale, causal)
    flash = flash_fits(dtypes.short_name(q.dtype), D, bias is not None, scale) and all(
        _rows_aligned(a) for a in (q, k, v, o))
    if version not in (None, chosen, "attn1_naive") and not (version == "attn2_flash" and flash):
        raise ValueError(f"attention: kernel {version!r} does not take this problem (it would run {chosen}); "
                         f"choose from {_VERSIONS}")
    if (version or chosen) == "attn3_decode":
        return _bind_decode(q, k, v, o, scale)
    suffix = dtypes.KERNEL_SUFFIX[dtypes.short_name(q.dtype)]
    if (version or chosen) == "attn1_naive":
        blocks = -(-B * Hq * Sq // _ROWS_PER_ATTN1_BLOCK)
        return launch.bind(_FILE, f"attn1_naive_{suffix}", (blocks,), (32 * _ROWS_PER_ATTN1_BLOCK,),
                           _placeholders(_ATTN, _args(q, k, v, o, scale, causal, None, None, bias)))
    copies_bias = bias is not None and not _bias_staged(bias)
    if copies_bias:  # the geometry of the copies the calls will pass
        bias = _padded_bias(bias)
    name, threads, rows, smem = flash_launch(D, bias is not None)
    kernel = launch.bind(_FILE, f"{name}_{suffix}", (-(-Sq // rows) * B * Hq,), (threads,),
                         _placeholders(_ATTN, _args(q, k, v, o, scale, causal, None, None, bias)), shared_mem=smem)
    if not copies_bias:
        return kernel

    def run(q, k, v, o, bias, lens_q, lens_kv):
        kernel(q, k, v, o, _padded_bias(bias), lens_q, lens_kv)
    return run


def flash_attention(q, k, v, o, *, scale: float, causal: str | None, seq_lens_q=None, seq_lens_kv=None,
                    bias=None, version: str | None = None) -> None:
    """bind_flash's kernel bound for these arrays and run once on them."""
    bind_flash(q, k, v, o, bias, scale=scale, causal=causal, version=version)(q, k, v, o, bias, seq_lens_q,
                                                                              seq_lens_kv)


def bind_unfused(q, k, v, o, bias=None, *, scale: float, causal: str | None):
    """run(q, k, v, o, bias, lens_q, lens_kv) -> None: o = softmax(scale · q kᵀ + bias, masked) v in three
    steps with the fp32 scores in memory (cuBLAS, attn_softmax, cuBLAS), for arrays of these shapes,
    strides and dtype (read here, not kept). The call passes the (B, H, S, D) views themselves: the
    matmuls read them."""
    import cupy

    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if B * Hq * Sq == 0:
        return _nothing
    if Skv == 0:  # no keys: every row is empty
        def zeros(q, k, v, o, bias, lens_q, lens_kv):
            o[...] = 0
        return zeros
    suffix = dtypes.KERNEL_SUFFIX[dtypes.short_name(q.dtype)]
    softmax = launch.bind(_FILE, f"attn_softmax_{suffix}", (B * Hq * Sq,), (_SOFTMAX_THREADS,),
                          _placeholders(_SOFTMAX, _softmax_args(None, bias, None, None, B, Hq, Sq, Skv, scale,
                                                                causal)))
    grouped = (B, Hkv, Hq // Hkv * Sq, D)  # the g query heads of a kv head in one GEMM

    def run(q, k, v, o, bias, lens_q, lens_kv):
        # fp32 copies, contiguous
        q32 = cupy.ascontiguousarray(q, dtype=cupy.float32).reshape(grouped)
        k32 = cupy.ascontiguousarray(k, dtype=cupy.float32)
        v32 = cupy.ascontiguousarray(v, dtype=cupy.float32)
        if lens_kv is not None:  # zeros past a sequence's length, as the kernels read: 0 · a stale NaN is NaN
            v32 = cupy.where(cupy.arange(Skv)[:, None] < lens_kv[:, None, None, None], v32, cupy.float32(0))
        s = cupy.matmul(q32, k32.transpose(0, 1, 3, 2))   # (B, Hkv, g*Sq, Skv) = (B, Hq, Sq, Skv), contiguous
        softmax(s, bias, lens_q, lens_kv)
        o[...] = cupy.matmul(s, v32).reshape(B, Hq, Sq, D)
    return run


def unfused_attention(q, k, v, o, *, scale: float, causal: str | None, seq_lens_q=None, seq_lens_kv=None,
                      bias=None) -> None:
    """bind_unfused's passes bound for these arrays and run once on them."""
    bind_unfused(q, k, v, o, bias, scale=scale, causal=causal)(q, k, v, o, bias, seq_lens_q, seq_lens_kv)


def bind_zero_empty_batches(B: int, batch_bytes: int):
    """run(lens_kv, o) -> None: o[b] = 0 (every bit) where lens_kv[b] <= 0, for a C-contiguous o of B batch
    entries of batch_bytes each (an even number: 16-bit words) and int32 (B,) lengths on the device."""
    return launch.bind(_FILE, "attn_zero_empty_batches", (B,), (_ZERO_THREADS,),
                       _ZERO.pack(lens_kv=launch.ARRAY, o=launch.ARRAY, words=batch_bytes // 2))
