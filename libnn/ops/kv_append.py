"""kv_append: a decoder's new keys and values into its KV cache, k rotated (RoPE) on the way, in one pass.

k and v are (B, S, H, D): the S new tokens of B sequences (one per sequence at a decode step, the prompt
at prefill); positions (B, S) int32 or int64 are the tokens' absolute positions (each sequence its own);
k_cache and v_cache are (B, L, H, D), one layer's cache rows for those sequences. For every token (b, s)
at p = positions[b, s] and head h:

    k_cache[b, p, h] = rope(k[b, s, h], p)      rope's function exactly (style, rotary_dim, inv_freq)
    v_cache[b, p, h] = v[b, s, h]

The caches are written in place. With `q` (B, S, Hq, D), the queries of the same tokens, the same launch
also rotates q as `rope(q, positions, inv_freq, style=, rotary_dim=)` does and returns it (a new array):
a decoder's query and key rotated by one kernel, where rope and kv_append took two. Without q nothing is
returned. Two tokens of one sequence at one position leave either's values there (which one is not
defined).

Paged caches (`page_table`, int32 (B, max_pages)): k_cache and v_cache are pools of pages (pages,
page_size, H, D), any strides with a contiguous last dimension (a pool stored (pages, H, page_size, D),
the layout cuDNN's paged attention reads, passed as its (0, 2, 1, 3) view), and sequence b's position p
lives in page page_table[b, p // page_size] at row p % page_size: L = max_pages * page_size positions per
sequence. page_size must be a power of two (cuDNN's paged attention reads no other; the kernel addresses
pages by shift and mask). Two sequences whose tables share a page write the same rows (a spare page that
padding tokens may all write, say). With inv_freq None, k is written as it comes (rotary_dim
0: a decoder with learned positions, GPT-2): k_cache[b, p, h] = k[b, s, h], the bits copied, as v's.

Positions must lie in [0, L) and page-table entries in [0, pages): checked with one synchronisation (a
read-back of their ranges) on every call, unless `checked=True`, the caller's word that they do (a
decoder that tracks its sequences' lengths and pages on the host, inside a CUDA graph above all). The
kernel itself never writes outside the caches: a position or a page out of range writes nothing there.

Paths, in `auto` order (no library has this op):
- custom:    kernels/kv_append.cu, rope.cu's geometry and its rotation (kernels/rope.cuh) with the cache
             row addressed by the position (through the page table where there is one), the v row copied
             by the same threads; strides as they come where the last dimension is contiguous (k and v as
             views into one QKV projection, the cache rows as views of a larger cache).
- reference: rope's reference of k (k itself without inv_freq) and of q, then k and v written with NumPy's
             indexing (the page table's rows gathered by NumPy where there is one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.registry import Op, option_key
from libnn.ops import paging
from libnn.ops.rope import POSITION_DTYPES, overlaps_itself, rope, rotary_dim_of
from libnn.runtime import contracts, launch
from libnn.runtime.arrays import allocator, as_array, device_of, min_max, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32")

op = Op("kv_append", order=("custom", "reference"))


@dataclass(frozen=True)
class KVAppendProblem:
    """Everything that decides how a kv_append call runs."""
    B: int                 # sequences
    S: int                 # new tokens per sequence
    H: int                 # KV heads
    D: int                 # head dimension
    L: int                 # cache positions per sequence (paged: max_pages * page_size)
    rotary_dim: int
    style: str
    dtype: str
    position_dtype: str
    checked: bool          # the caller vouches for the positions' and the pages' range
    device: str
    pages: int = 0         # paged caches: the pools' pages (0: dense caches)
    page_size: int = 0     # paged caches: positions per page, a power of two
    Hq: int = 0            # q's heads, rotated in the same launch (0: no q)

    def describe(self) -> str:
        k = f"{self.style} k" if self.rotary_dim else "k (no rotation)"
        paged = f" ({self.pages} pages of {self.page_size})" if self.pages else ""
        q = f", q of {self.Hq} heads rotated" if self.Hq else ""
        return (f"kv_append {k}, v (B={self.B}, S={self.S}, H={self.H}, D={self.D}) into caches of "
                f"{self.L} positions{paged}{q}, {self.dtype}, positions {self.position_dtype}")


def kv_append_problem(k, v, positions, inv_freq, k_cache, v_cache, style, rotary_dim, checked,
                      page_table=None, q=None) -> KVAppendProblem:
    if k.ndim != 4:
        raise ValueError(f"kv_append: k must be (B, S, H, D), got shape {tuple(k.shape)}")
    if not dtypes.is_float(k.dtype):
        raise TypeError(f"kv_append: k must be a floating-point array (fp16, bf16, fp32, fp64), got {k.dtype}")
    if tuple(v.shape) != tuple(k.shape) or v.dtype != k.dtype:
        raise ValueError(f"kv_append: v must have k's shape {tuple(k.shape)} and dtype {dtypes.short_name(k.dtype)}, "
                         f"got {tuple(v.shape)} {dtypes.short_name(v.dtype)}")
    B, S, H, D = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if page_table is not None and (cache.ndim != 4 or (cache.shape[2], cache.shape[3]) != (H, D)
                                       or 0 in cache.shape[:2]):
            raise ValueError(f"kv_append: {name} must be a pool of pages (pages, page_size, H, D) = (pages, "
                             f"page_size, {H}, {D}) with a page_table, for k of shape {tuple(k.shape)}, got "
                             f"{tuple(cache.shape)}")
        if page_table is None and (cache.ndim != 4 or (cache.shape[0], cache.shape[2], cache.shape[3]) != (B, H, D)):
            raise ValueError(f"kv_append: {name} must be (B, L, H, D) = ({B}, L, {H}, {D}) for k of shape "
                             f"{tuple(k.shape)}, got {tuple(cache.shape)}")
        if cache.dtype != k.dtype:
            raise TypeError(f"kv_append: {name} has dtype {dtypes.short_name(cache.dtype)} but k has "
                            f"{dtypes.short_name(k.dtype)}")
        if overlaps_itself(tuple(cache.shape), tuple(cache.strides), cache.itemsize):
            raise ValueError(f"kv_append: {name} must not overlap itself (a broadcast view): shape "
                             f"{tuple(cache.shape)}, strides {tuple(cache.strides)} bytes")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or tuple(v_cache.strides) != tuple(k_cache.strides):
        raise ValueError(f"kv_append: k_cache and v_cache must have one shape and strides, got {tuple(k_cache.shape)} "
                         f"{tuple(k_cache.strides)} and {tuple(v_cache.shape)} {tuple(v_cache.strides)}")
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"kv_append: positions must be an int32 or int64 array, got dtype {positions.dtype}")
    if tuple(positions.shape) != (B, S):
        raise ValueError(f"kv_append: positions must have shape (B, S) = {(B, S)} for k of shape {tuple(k.shape)}, "
                         f"got {tuple(positions.shape)}")
    R = _rotary_dim(D, inv_freq, style, rotary_dim)
    if q is not None:
        if q.ndim != 4 or (q.shape[0], q.shape[1], q.shape[3]) != (B, S, D) or q.dtype != k.dtype:
            raise ValueError(f"kv_append: q must be (B, S, Hq, D) = ({B}, {S}, Hq, {D}) in k's dtype "
                             f"{dtypes.short_name(k.dtype)}, got {tuple(q.shape)} {dtypes.short_name(q.dtype)}")
        if inv_freq is None:
            raise ValueError("kv_append: q is rotated with k; without inv_freq there is no rotation, so pass q "
                             "only with inv_freq")
    if not isinstance(checked, bool):
        raise TypeError(f"kv_append: checked must be True or False, got {type(checked).__name__} {checked!r}")
    device = device_of({"k": k, "v": v, "positions": positions, "inv_freq": inv_freq, "k_cache": k_cache,
                        "v_cache": v_cache, "page_table": page_table, "q": q}, "kv_append")
    problem = KVAppendProblem(B=B, S=S, H=H, D=D, L=k_cache.shape[1], rotary_dim=R, style=style,
                              dtype=dtypes.short_name(k.dtype), position_dtype=positions.dtype.name, checked=checked,
                              device=device, Hq=0 if q is None else q.shape[2])
    return problem if page_table is None else _paged_problem(problem, page_table, k_cache.shape[0])


def _paged_problem(problem: KVAppendProblem, page_table, pages: int) -> KVAppendProblem:
    """The problem of paged caches: page_table (B, max_pages) int32 checked, L = max_pages x page_size (the
    pools' second dimension, a power of two)."""
    B, page_size = problem.B, problem.L
    paging.check_page_table("kv_append", page_table, B, f"k of batch {B}")
    if page_size & (page_size - 1):
        raise ValueError(f"kv_append: the pools' page_size (their second dimension) must be a power of two, got "
                         f"{page_size}")
    return replace(problem, L=page_table.shape[1] * page_size, pages=pages, page_size=page_size)


def kv_append(k: Any, v: Any, positions: Any, inv_freq: Any, k_cache: Any, v_cache: Any, *, q: Any = None,
              page_table: Any = None, style: str = "half", rotary_dim: int | None = None, checked: bool = False,
              path: str = "auto") -> Any:
    """Write k rotated at `positions` (RoPE: see `rope`) and v into k_cache and v_cache (B, L, H, D) at
    each token's position: k_cache[b, positions[b, s]] = rope(k[b, s]), v_cache[b, positions[b, s]] =
    v[b, s], for k and v (B, S, H, D). With `page_table` (B, max_pages) int32 the caches are pools of
    pages (pages, page_size, H, D) and position p of sequence b is row p % page_size of page
    page_table[b, p // page_size] (see the module docstring). inv_freq None writes k unrotated
    (rotary_dim None or 0 then; style is not read). Positions are checked to lie in [0, L), and the
    page table's entries in [0, pages) (one synchronisation), unless `checked`. With `q` (B, S, Hq, D)
    (inv_freq needed), returns q rotated as rope rotates it, from the same launch; else None. `path` is
    "auto" or one of `libnn.paths("kv_append")`."""
    k, v = as_array(k, "kv_append", "k"), as_array(v, "kv_append", "v")
    positions = as_array(positions, "kv_append", "positions")
    inv_freq = None if inv_freq is None else as_array(inv_freq, "kv_append", "inv_freq")
    k_cache, v_cache = as_array(k_cache, "kv_append", "k_cache"), as_array(v_cache, "kv_append", "v_cache")
    page_table = None if page_table is None else as_array(page_table, "kv_append", "page_table")
    q = None if q is None else as_array(q, "kv_append", "q")
    key = (signature(k), signature(v), signature(positions), signature(inv_freq), signature(k_cache),
           signature(v_cache), signature(page_table), signature(q), option_key(style), option_key(rotary_dim),
           option_key(checked), path, stream_key())
    return op.call(key, lambda: kv_append_problem(k, v, positions, inv_freq, k_cache, v_cache, style, rotary_dim,
                                                  checked, page_table, q),
                   path, k, v, positions, inv_freq, k_cache, v_cache, page_table, q)


def _rotary_dim(D: int, inv_freq, style, rotary_dim) -> int:
    """rope's checks of inv_freq, style and rotary_dim, and the rotary_dim R they give (D by default); 0
    without inv_freq, where rotary_dim must be None or 0."""
    if inv_freq is not None:
        return rotary_dim_of("kv_append", "k", D, inv_freq, style, rotary_dim)
    if rotary_dim is not None and not (isinstance(rotary_dim, (int, np.integer)) and not isinstance(rotary_dim, bool)
                                       and rotary_dim == 0):
        raise ValueError(f"kv_append: rotary_dim {rotary_dim!r} needs inv_freq (rotary_dim / 2 frequencies); with "
                         "inv_freq None k is written unrotated (rotary_dim None or 0)")
    return 0


def _check_positions(problem: KVAppendProblem, positions, page_table, vouched: bool) -> None:
    """Positions in [0, L) and page-table entries in [0, pages), read back together (one synchronisation
    on the GPU) unless `vouched` for; skipped while a CUDA graph is captured (min_max gives None: the
    graph's checked first pass ran it)."""
    if vouched or not positions.size:
        return
    ranges = min_max([positions] + ([] if page_table is None else [page_table]))
    if not ranges:
        return
    if ranges[0][0] < 0 or ranges[0][1] >= problem.L:
        raise ValueError(f"kv_append: positions must lie in [0, {problem.L}) (the caches' length L), got values "
                         f"from {ranges[0][0]} to {ranges[0][1]}")
    if page_table is not None and (ranges[1][0] < 0 or ranges[1][1] >= problem.pages):
        raise ValueError(f"kv_append: page_table entries must lie in [0, {problem.pages}) (the pools' pages), got "
                         f"values from {ranges[1][0]} to {ranges[1][1]}")


def _extent(cache) -> int:
    """The bytes from a cache's first element to past its last (its strides are positive: the problem's
    checks refuse a self-overlapping cache, and its last dimension is contiguous)."""
    return sum((n - 1) * abs(st) for n, st in zip(cache.shape, cache.strides)) + cache.itemsize if cache.size else 0


def _check_disjoint(k_pointer: int, v_pointer: int, nbytes: int) -> None:
    """k_cache and v_cache (one shape and strides, `nbytes` each) must not share memory: every token's v
    would overwrite its k, or the kernel's non-aliasing promise break."""
    if nbytes and k_pointer < v_pointer + nbytes and v_pointer < k_pointer + nbytes:
        raise ValueError("kv_append: k_cache and v_cache share memory; pass two separate caches")


# --- custom path: kernels/kv_append.cu -----------------------------------------------------------------------
_KV = contracts.params("kv_append.cu", "KV_PARAMS")  # every kv_append kernel's parameters
KV_THREADS = contracts.constant("kv_append.cu", "KV_THREADS")
KV_MAX_BX = contracts.constant("kv_append.cu", "KV_MAX_BX")
_POSITION_SUFFIX = {"int32": "i32", "int64": "i64"}


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def custom_launch(problem: KVAppendProblem) -> tuple[str, tuple[int, int, int], tuple[int, int]]:
    """(kernel name, grid, block) from kernels/kv_append.cu's LAUNCH table."""
    bx = min(KV_MAX_BX, max(32, _pow2_at_least(problem.D)))
    by = min(KV_THREADS // bx, _pow2_at_least(problem.S))
    cap = launch.GRID_STRIDE_BLOCKS
    grid = (min(-(-problem.S // by), cap), min(problem.H + problem.Hq, cap), min(problem.B, cap))
    name = f"kv_append1_{dtypes.KERNEL_SUFFIX[problem.dtype]}_{_POSITION_SUFFIX[problem.position_dtype]}"
    return name, grid, (bx, by)


def _rows(a) -> tuple[int, int, int] | None:
    """a's (B, S-or-L, H) strides in elements where its last dimension is contiguous, else None."""
    if a.strides[3] != a.itemsize or any(s % a.itemsize for s in a.strides):
        return None
    return tuple(s // a.itemsize for s in a.strides[:3])


def _custom_support(problem: KVAppendProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


def bind_custom(problem: KVAppendProblem, k, v, positions, inv_freq, k_cache, v_cache, page_table, q):
    """The runner of kernels/kv_append.cu for arrays of this signature: one packed launch; k, v, positions
    or the page table the kernel cannot address as they lie are copied first, a cache it cannot address
    is refused."""
    import cupy

    cache_rows = _rows(k_cache)
    if cache_rows is None:
        raise ValueError("kv_append: the caches' last dimension must be contiguous on the GPU path (the kernel "
                         f"writes rows of D elements), got strides {tuple(k_cache.strides)} bytes")
    new_q = None if q is None else allocator(tuple(q.shape), q.dtype)
    if problem.B * problem.S * problem.H == 0:
        if new_q is None or problem.B * problem.S == 0:  # nothing to write, nothing (or an empty q) to rotate
            return lambda *arrays: None if new_q is None else new_q()
        # no KV heads: q alone to rotate, which rope does
        return lambda k, v, positions, inv_freq, k_cache, v_cache, page_table, q: rope(
            q, positions, inv_freq, style=problem.style, rotary_dim=problem.rotary_dim)
    contiguous = (problem.S * problem.H * problem.D, problem.H * problem.D, problem.D)
    k_rows, v_rows = _rows(k), _rows(v)
    position_strides = tuple(s // positions.itemsize for s in positions.strides)
    copy_positions = any(s % positions.itemsize for s in positions.strides)
    if copy_positions:
        position_strides = (problem.S, 1)
    table_strides = (0, 0) if page_table is None else tuple(s // page_table.itemsize for s in page_table.strides)
    copy_table = page_table is not None and any(s % page_table.itemsize for s in page_table.strides)
    if copy_table:
        table_strides = (page_table.shape[1], 1)
    name, grid, block = custom_launch(problem)
    (kb, ks, kh), (vb, vs, vh), (cb, cs, ch) = k_rows or contiguous, v_rows or contiguous, cache_rows
    q_rows = None if q is None else _rows(q)  # None with a q: copied to a contiguous one first
    qb, qs, qh = q_rows or (problem.S * problem.Hq * problem.D, problem.Hq * problem.D, problem.D)
    A = launch.ARRAY
    kernel = launch.bind("kv_append.cu", name, grid, block,
                         _KV.pack(k=A, v=A, positions=A, inv_freq=A, k_cache=A, v_cache=A, B=problem.B, S=problem.S,
                                  H=problem.H, D=problem.D, R=problem.rotary_dim, L=problem.L, kb=kb, ks=ks, kh=kh,
                                  vb=vb, vs=vs, vh=vh, cb=cb, cs=cs, ch=ch, pb=position_strides[0],
                                  ps=position_strides[1], interleaved=problem.style == "interleaved",
                                  page_table=A, tb=table_strides[0], tp=table_strides[1],
                                  page_shift=max(0, problem.page_size.bit_length() - 1), pages=problem.pages,
                                  q=A, q_out=A, Hq=problem.Hq, qb=qb, qs=qs, qh=qh),
                         programmatic=launch.programmatic_supported(problem.device))

    copy_freq = inv_freq is not None and not inv_freq.flags.c_contiguous  # None: a null pointer, never read (R = 0)
    cache_bytes = _extent(k_cache)

    def run(k, v, positions, inv_freq, k_cache, v_cache, page_table, q):
        _check_disjoint(k_cache.data.ptr, v_cache.data.ptr, cache_bytes)
        _check_positions(problem, positions, page_table, problem.checked)
        q_out = None if q is None else new_q()
        kernel(k if k_rows else cupy.ascontiguousarray(k), v if v_rows else cupy.ascontiguousarray(v),
               cupy.ascontiguousarray(positions) if copy_positions else positions,
               cupy.ascontiguousarray(inv_freq) if copy_freq else inv_freq, k_cache, v_cache,
               cupy.ascontiguousarray(page_table) if copy_table else page_table,  # None: a null table (dense)
               None if q is None else q if q_rows else cupy.ascontiguousarray(q), q_out)
        return q_out
    return run


op.path("custom", kind="custom", device="gpu", supports=_custom_support, binds=True)(bind_custom)


# --- reference -----------------------------------------------------------------------------------------------
@op.path("reference", kind="reference", device="cpu")
def _reference(problem: KVAppendProblem, k, v, positions, inv_freq, k_cache, v_cache, page_table, q):
    # on the host the check costs no synchronisation: NumPy would wrap a -1
    _check_positions(problem, positions, page_table, False)
    if np.shares_memory(k_cache, v_cache):
        raise ValueError("kv_append: k_cache and v_cache share memory; pass two separate caches")
    rotated = k if not problem.rotary_dim else rope(k, positions, inv_freq, style=problem.style,
                                                     rotary_dim=problem.rotary_dim, path="reference")
    rotated_q = None if q is None else rope(q, positions, inv_freq, style=problem.style,
                                            rotary_dim=problem.rotary_dim, path="reference")
    rows = np.broadcast_to(np.arange(problem.B)[:, None], (problem.B, problem.S))
    if page_table is not None:  # (page, row in the page) of each token
        rows, positions = page_table[rows, positions // problem.page_size], positions % problem.page_size
    k_cache[rows, positions] = rotated
    v_cache[rows, positions] = v
    return rotated_q
