"""embedding: rows of a table gathered by ids, with a position table's and a token-type table's rows
added and an optional LayerNorm: BERT's embedding layer as one op.

    e[..., s, :] = weight[ids[..., s]] + position_weight[position_offset + s] + type_weight[type_ids[..., s]]
    y = layer_norm(e, norm_weight, norm_bias, eps)   with normalize=True,   else y = e

ids has any shape; s counts along its last axis (a 0-d ids is one token at position 0). Each table is
(rows, hidden) and all share weight's hidden size and dtype; position_weight and type_weight are
optional (no such term), and type_ids is optional where type_weight is given (every token of type 0,
Hugging Face's default). norm_weight and norm_bias are (hidden,) or None (1 and 0), as in layer_norm,
and only with normalize=True. y is ids.shape + (hidden,), in weight's dtype, on its device; fp16/bf16
compute in fp32 on the GPU paths.

Out-of-range indices. The positions are checked on the host before anything runs (the shapes tell:
position_offset + S must not exceed position_weight's rows): a ValueError. The ids and type ids are
values on the device, which a GPU path cannot read without a synchronisation, so: GPU paths write NaN
rows for out-of-range ids (and type ids), and never read outside a table. With `id_errors=` (an
IdErrors) the custom path also records a bad token there, in host memory the kernel writes, so that
the caller finds out without a synchronisation per call (nn.Embedding raises at a later call, or at
`raise_id_errors()`); callers that want the error in the call itself check the ranges first, with one
synchronisation (nn.Embedding with check_ids="sync", and BertEncoder, once per forward). The
reference path, on the host, raises an IndexError naming the argument.

Paths, in `auto` order (custom first on the count of passes over the (tokens, hidden) activations,
one against the cupy path's five or more; not yet timed: `libnn bench` has no embedding case):
- custom:    kernels/embedding.cu: one warp per token (a block for hidden > 1024) gathers the rows
             (16 bytes at a time where hidden and the pointers allow), sums them and normalizes in
             fp32, and writes y once. Per call: y from cupy.empty and one packed launch (ids of a
             dtype other than int32/int64, or non-contiguous arrays, are converted or copied first).
             The only path that records into `id_errors`.
- cupy:      cupy.take, the adds in fp32, then libnn.ops.layer_norm: what BertEmbeddings did, kept to
             compare against (a pass per term and one more for the norm). Indices are clipped for the
             gather and the rows of out-of-range tokens set to NaN with cupy.where, so both GPU paths
             give the same NaN rows.
- reference: NumPy in float64, rounded to weight's dtype once at the end (fp64 too).
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.ops import row_kernels
from libnn.ops.layer_norm import layer_norm
from libnn.registry import Op, option_key
from libnn.runtime import contracts, launch, memory
from libnn.runtime.arrays import allocator, as_array, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32")
KERNEL_IDS = (np.dtype(np.int32), np.dtype(np.int64))  # what kernels/embedding.cu reads; others convert
INT32_LIMIT = 2**31 - 1

op = Op("embedding", order=("custom", "cupy", "reference"))


@dataclass(frozen=True)
class EmbeddingProblem:
    """Everything that decides how an embedding call runs."""
    shape: tuple[int, ...]      # ids' shape
    rows: int                   # weight's rows
    H: int                      # hidden size
    dtype: str                  # the tables' short dtype name
    position_rows: int | None   # None: no position table
    position_offset: int
    type_rows: int | None       # None: no type table
    has_type_ids: bool          # False with a type table: every token of type 0
    normalize: bool
    has_norm_weight: bool
    has_norm_bias: bool
    eps: float
    device: str                 # "cpu" or "gpu:N"
    # where the custom path records an out-of-range token (None: nowhere); not part of the problem's
    # equality: it changes no result, only where the kernel reports
    id_errors: "IdErrors | None" = field(default=None, compare=False, repr=False)

    @property
    def M(self) -> int:
        """Tokens: the product of ids' shape."""
        return math.prod(self.shape)

    @property
    def S(self) -> int:
        """Positions per sequence: ids' last dimension (1 for a 0-d ids)."""
        return self.shape[-1] if self.shape else 1

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.shape, self.H)

    def describe(self) -> str:
        terms = ["word", *(["position"] if self.position_rows is not None else []),
                 *(["type" if self.has_type_ids else "type 0"] if self.type_rows is not None else [])]
        norm = f" + layer_norm eps={self.eps:g}" if self.normalize else ""
        return f"embedding ids {self.shape} hidden={self.H} {self.dtype} ({' + '.join(terms)}{norm})"

    @property
    def output_bytes(self) -> int:
        """y's bytes: what the registry checks against free GPU memory when a GPU path binds."""
        return memory.array_bytes(self.out_shape, dtypes.parse(self.dtype))

    @property
    def bytes_moved(self) -> int:
        """y written and each token's word row read (the position and type tables are small enough to
        be read from L2 after their first use)."""
        return 2 * self.output_bytes


class IdErrors:
    """Where the custom path records an out-of-range id (or type id) without a synchronisation: one
    8-byte word of host memory into which kernels/embedding.cu stores 1 + the index of a bad token
    (among ids' tokens, row-major) of any launch that was given it; 0 while none was. The host reads
    it at any time: a launch's record is there once its kernel has run. `IdErrors.allocate()` puts the
    word in pinned host memory, which a kernel writes through the host pointer itself (CUDA's unified
    addressing, on every 64-bit platform CUDA supports)."""

    def __init__(self, word: np.ndarray, owner: Any = None):
        """`word`: a (1,) uint64 host array that the device can write (tests pass ordinary memory);
        `owner`: what keeps its memory allocated, held as long as this is."""
        if not (isinstance(word, np.ndarray) and word.dtype == np.uint64 and word.shape == (1,)):
            raise TypeError(f"IdErrors: word must be a (1,) uint64 numpy array, got {word!r}")
        self.word, self.pointer, self._owner = word, word.ctypes.data, owner
        self._cell = ctypes.c_uint64.from_buffer(word)  # `take` reads through it: a third of NumPy's indexing
        word[0] = 0

    @classmethod
    def allocate(cls) -> "IdErrors":
        """A cleared word of pinned host memory, mapped into the device's address space (where unified
        addressing gives the kernel the host pointer itself) and portable to every device's context."""
        import cupy

        runtime = cupy.cuda.runtime
        memory = cupy.cuda.PinnedMemory(8, runtime.hostAllocMapped | runtime.hostAllocPortable)
        return cls(np.ctypeslib.as_array((ctypes.c_uint64 * 1).from_address(memory.ptr)), owner=memory)

    def take(self) -> int:
        """1 + the index of a bad token recorded since the last take (0: none), and clear the word."""
        cell = self._cell
        bad = cell.value
        if bad:
            cell.value = 0
        return bad


def embedding_problem(ids, weight, position_weight, position_offset, type_ids, type_weight, norm_weight, norm_bias, eps,
           normalize, id_errors: IdErrors | None = None) -> EmbeddingProblem:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding: ids must be an integer array (int32, int64, ...), got dtype {ids.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-D (rows, hidden), got shape {tuple(weight.shape)}")
    if not dtypes.is_float(weight.dtype):
        raise TypeError(f"embedding: weight must be a floating-point array (fp16, bf16, fp32, fp64), "
                        f"got {weight.dtype}")
    rows, H = weight.shape
    dtype = dtypes.short_name(weight.dtype)
    for name, table in (("position_weight", position_weight), ("type_weight", type_weight)):
        if table is None:
            continue
        if table.ndim != 2 or table.shape[1] != H:
            raise ValueError(f"embedding: {name} must be 2-D (rows, {H}) to match weight's hidden size "
                             f"(weight is {tuple(weight.shape)}), got shape {tuple(table.shape)}")
        if table.dtype != weight.dtype:
            raise TypeError(f"embedding: {name} has dtype {dtypes.short_name(table.dtype)} but weight has "
                            f"{dtype}; cast them to one dtype")
    S = ids.shape[-1] if ids.ndim else 1
    if isinstance(position_offset, bool) or not isinstance(position_offset, (int, np.integer)):
        raise TypeError(f"embedding: position_offset must be an int, got {type(position_offset).__name__} "
                        f"{position_offset!r}")
    position_offset = int(position_offset)
    if position_weight is None:
        if position_offset != 0:
            raise ValueError(f"embedding: position_offset is {position_offset} but position_weight is None; "
                             "an offset needs a position table")
    elif position_offset < 0 or position_offset + S > position_weight.shape[0]:
        raise ValueError(f"embedding: positions {position_offset}..{position_offset + S - 1} (position_offset "
                         f"{position_offset} + the {S} positions of ids' last axis) must be rows of "
                         f"position_weight, which has {position_weight.shape[0]} "
                         f"(position_offset must be in [0, {max(position_weight.shape[0] - S, 0)}])")
    if type_ids is not None:
        if type_weight is None:
            raise ValueError("embedding: type_ids is given but type_weight is None; pass the token-type table")
        if type_ids.dtype.kind not in "iu":
            raise TypeError(f"embedding: type_ids must be an integer array (int32, int64, ...), "
                            f"got dtype {type_ids.dtype}")
        if tuple(type_ids.shape) != tuple(ids.shape):
            raise ValueError(f"embedding: type_ids must have ids' shape {tuple(ids.shape)}, "
                             f"got {tuple(type_ids.shape)}")
    elif type_weight is not None and type_weight.shape[0] == 0:
        raise ValueError("embedding: type_weight has no rows, but without type_ids every token is of type 0; "
                         "pass a table with at least one row")
    if not isinstance(normalize, (bool, np.bool_)):
        raise TypeError(f"embedding: normalize must be True or False, got {type(normalize).__name__} {normalize!r}")
    for name, vector in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if vector is None:
            continue
        if not normalize:
            raise ValueError(f"embedding: {name} is given but normalize is False; pass normalize=True to "
                             "apply the LayerNorm")
        row_kernels.check_affine("embedding", name, vector, weight, "weight", "hidden size")
    row_kernels.check_eps("embedding", eps)
    if id_errors is not None and not isinstance(id_errors, IdErrors):
        raise TypeError(f"embedding: id_errors must be None or a libnn.ops.embedding.IdErrors, got "
                        f"{type(id_errors).__name__} {id_errors!r}")
    device = device_of({"ids": ids, "weight": weight, "position_weight": position_weight, "type_ids": type_ids,
                        "type_weight": type_weight, "norm_weight": norm_weight, "norm_bias": norm_bias},
                       "embedding")
    return EmbeddingProblem(
        shape=tuple(ids.shape), rows=rows, H=H, dtype=dtype,
        position_rows=None if position_weight is None else position_weight.shape[0], position_offset=position_offset,
        type_rows=None if type_weight is None else type_weight.shape[0], has_type_ids=type_ids is not None,
        normalize=bool(normalize), has_norm_weight=norm_weight is not None, has_norm_bias=norm_bias is not None,
        eps=float(eps), device=device, id_errors=id_errors)


def embedding(ids: Any, weight: Any, *, position_weight: Any = None, position_offset: int = 0, type_ids: Any = None,
              type_weight: Any = None, norm_weight: Any = None, norm_bias: Any = None, eps: float = 1e-5,
              normalize: bool = False, id_errors: IdErrors | None = None, path: str = "auto") -> Any:
    """weight[ids] + position_weight[position_offset + s] + type_weight[type_ids], then with
    normalize=True a LayerNorm over the hidden size (norm_weight, norm_bias, eps), for ids of any
    shape (s: the position along ids' last axis) and (rows, hidden) tables; returns ids.shape +
    (hidden,) in weight's dtype. position_weight and type_weight are optional; type_ids None with a
    type table means type 0 everywhere. GPU paths write NaN rows for out-of-range ids, and the custom
    path records one in `id_errors` (an IdErrors) where it is given; the reference raises IndexError.
    `path` is "auto" or one of `libnn.paths("embedding")`."""
    ids = as_array(ids, "embedding", "ids")
    weight = as_array(weight, "embedding", "weight")
    if (position_weight is None and type_ids is None and type_weight is None and norm_weight is None
            and norm_bias is None):  # a plain lookup (nn.Embedding's): no call per absent array
        optional_key = None
    else:
        position_weight, type_ids, type_weight, norm_weight, norm_bias = optional = (
            _optional(position_weight, "position_weight"), _optional(type_ids, "type_ids"),
            _optional(type_weight, "type_weight"), _optional(norm_weight, "norm_weight"),
            _optional(norm_bias, "norm_bias"))
        optional_key = tuple(map(signature, optional))
    # option_key's keys without its call in the common cases (as layer_norm's): an exact int position_offset
    # and an exact float eps are their own keys (of option_key's other keys, only an exact int's can equal a
    # float, and the checks take that int as the same eps), normalize is keyed with its type (0 never finds
    # the bound call of False), and None or an IdErrors (equal to itself alone) is its own key.
    key = (signature(ids), signature(weight), optional_key,
           position_offset if type(position_offset) is int else option_key(position_offset),
           eps if type(eps) is float else option_key(eps), type(normalize), normalize,
           id_errors if id_errors is None or type(id_errors) is IdErrors else option_key(id_errors), path, stream_key())
    return op.call(key, embedding_problem, path, ids, weight, position_weight, type_ids, type_weight, norm_weight,
                   norm_bias, checks=(ids, weight, position_weight, position_offset, type_ids, type_weight, norm_weight,
                                      norm_bias, eps, normalize, id_errors))


def _optional(a: Any, name: str) -> Any:
    """An optional array argument of embedding() as an array, or None."""
    return None if a is None else as_array(a, "embedding", name)


def _gpu_support(problem: EmbeddingProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    return None


def _empty_result(problem: EmbeddingProblem, *arrays):
    """y when there are no tokens or no hidden elements: nothing to gather."""
    import cupy
    return cupy.empty(problem.out_shape, dtypes.parse(problem.dtype))


def _nan_result(problem: EmbeddingProblem, *arrays):
    """y when a table the tokens index has no rows: every token is out of range, token 0 the one
    recorded in `problem.id_errors`. (The kernel would give the same for an empty word table, but an
    empty type table's pointer is null, which the kernel reads as no type table.)"""
    import cupy
    if problem.id_errors is not None:
        problem.id_errors.word[0] = 1
    return cupy.full(problem.out_shape, np.nan, np.float32).astype(dtypes.parse(problem.dtype))


def _no_rows(problem: EmbeddingProblem) -> bool:
    return problem.rows == 0 or (problem.has_type_ids and problem.type_rows == 0)


# --- custom path: kernels/embedding.cu ---------------------------------------------------------------
# emb1_warp, emb2_block, emb3_loop: libnn/ops/row_kernels.py's scheme over tokens' rows of H
_VERSIONS = row_kernels.RowKernels("emb", width="H")
_EMB = contracts.params("embedding.cu", "EMB_PARAMS")  # every embedding kernel's parameters
IDS_I64, TYPES_I64, NORMALIZE = 1, 2, 4  # kernels/embedding.cu's flags


# The versions that can run a problem (baseline first; `aligned`: `kernel_is_aligned` says), the one the custom
# path runs, and a version's (kernel name without the dtype suffix, grid, block): the row-kernel scheme's
custom_versions, custom_version, _launch = _VERSIONS.versions, _VERSIONS.version, _VERSIONS.launch


def _records_no_id_errors(problem: EmbeddingProblem) -> str | None:
    """The cupy path's support: it has no way to record a bad id without a pass of its own."""
    if problem.id_errors is not None:
        return "records no out-of-range ids (id_errors= is the custom path's)"
    return _gpu_support(problem)


def _custom_support(problem: EmbeddingProblem) -> str | None:
    if reason := _gpu_support(problem):
        return reason
    if problem.H > INT32_LIMIT or problem.S > INT32_LIMIT:
        return f"hidden size {problem.H} or sequence length {problem.S} past the kernels' 32-bit limit"
    return None


def _kernel_index(a):
    """ids as kernels/embedding.cu reads them: contiguous int32 or int64 (other integer dtypes widen to
    int64; uint64 values past 2^63 turn negative, out of range either way)."""
    import cupy
    if a is None or (a.dtype in KERNEL_IDS and a.flags.c_contiguous):
        return a
    return cupy.ascontiguousarray(a, dtype=a.dtype if a.dtype in KERNEL_IDS else np.int64)


def _kernel_array(a):
    import cupy
    return a if a is None or a.flags.c_contiguous else cupy.ascontiguousarray(a)


def _kernel_inputs(ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias):
    """The arrays in the form the kernel reads: each as it is where it already has that form."""
    return (_kernel_index(ids), _kernel_array(weight), _kernel_array(position_weight), _kernel_index(type_ids),
            _kernel_array(type_weight), _kernel_array(norm_weight), _kernel_array(norm_bias))


def bind_custom(problem: EmbeddingProblem, ids, weight, position_weight, type_ids, type_weight, norm_weight,
                norm_bias, version: str | None = None):
    """The runner of one version of kernels/embedding.cu (the default: the one the custom path picks)
    for arrays of this signature (their alignment and contiguity included)."""
    arrays = (ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias)
    if problem.M == 0 or problem.H == 0:
        return functools.partial(_empty_result, problem)
    if _no_rows(problem):
        return functools.partial(_nan_result, problem)
    kernel_inputs = _kernel_inputs(*arrays)
    as_given = all(k is a for k, a in zip(kernel_inputs, arrays))
    kids, ktype_ids = kernel_inputs[0], kernel_inputs[3]
    aligned = _aligned(problem, kernel_inputs)
    version = version or custom_version(problem, aligned)
    row_kernels.require_version("embedding", version, problem, aligned, custom_versions(problem, aligned))
    name, grid, block = _launch(version, problem, aligned)
    flags = (IDS_I64 if kids.dtype == np.int64 else 0) | \
        (TYPES_I64 if ktype_ids is not None and ktype_ids.dtype == np.int64 else 0) | \
        (NORMALIZE if problem.normalize else 0)
    # An array the signature leaves out is a null pointer packed once (the kernel reads null as "no such
    # term"), so each launch writes only the pointers of the arrays there are: `pick` takes those from the
    # runner's arguments (ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias) in
    # the kernel's order (ids, type_ids, word, pos, type, w, b).
    A = launch.ARRAY
    slot = [None if a is None else A for a in kernel_inputs]
    pick = operator.itemgetter(*(i for i in (0, 3, 1, 2, 4, 5, 6) if kernel_inputs[i] is not None))
    kernel = launch.bind("embedding.cu", f"{name}_{dtypes.KERNEL_SUFFIX[problem.dtype]}", (grid,), (block,),
                         _EMB.pack(ids=A, type_ids=slot[3], word=A, pos=slot[2], type=slot[4], w=slot[5], b=slot[6],
                                   y=A, M=problem.M,
                                   S=problem.S, H=problem.H, rows=problem.rows, pos_rows=problem.position_rows or 0,
                                   pos_offset=problem.position_offset, type_rows=problem.type_rows or 0, flags=flags,
                                   eps=problem.eps,
                                   bad=None if problem.id_errors is None else np.uint64(problem.id_errors.pointer)))
    new = allocator(problem.out_shape, weight.dtype)

    def run(*arrays):
        y = new()
        kernel(*pick(arrays), y)  # ids and weight are always there: `pick` gives a tuple
        return y

    def run_lookup(ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias):
        y = new()
        kernel(ids, weight, y)
        return y
    if not as_given:
        return lambda *arrays: run(*_kernel_inputs(*arrays))
    # a plain lookup (nn.Embedding's): the kernel takes ids, weight and y, without `pick`'s tuple
    return run_lookup if all(a is None for a in kernel_inputs[2:]) else run


def launch_custom(problem: EmbeddingProblem, *arrays, version: str | None = None):
    """y with one version of kernels/embedding.cu (for tests and benchmarks); arrays as `embedding`'s
    runner takes them: ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias."""
    return bind_custom(problem, *arrays, version=version)(*arrays)


def kernel_is_aligned(problem: EmbeddingProblem, *arrays) -> bool:
    """Whether the custom path may use 16-byte accesses for these arrays (for tests)."""
    return _aligned(problem, _kernel_inputs(*arrays))


def _aligned(problem: EmbeddingProblem, kernel_inputs: tuple) -> bool:
    """Whether the vec kernels may run: whole 16-byte groups per row and every table and vector pointer
    16-byte aligned (y comes from CuPy's pool, 256-byte aligned, and so does any copy made per call)."""
    _, weight, position_weight, _, type_weight, norm_weight, norm_bias = kernel_inputs
    return row_kernels.aligned(problem.dtype, problem.H, (weight, position_weight, type_weight, norm_weight, norm_bias))


@op.path("custom", kind="custom", device="gpu", supports=_custom_support, binds=True)
def _custom(problem: EmbeddingProblem, *arrays):
    return bind_custom(problem, *arrays)


# --- cupy path: take, adds, layer_norm ---------------------------------------------------------------
@op.path("cupy", kind="library", device="gpu", supports=_records_no_id_errors, binds=True)
def _cupy(problem: EmbeddingProblem, *arrays):
    import cupy

    weight_dtype = dtypes.parse(problem.dtype)
    # y is checked by the registry; e and cupy.where's copy of it, in fp32, come on top
    memory.require(problem.output_bytes + 2 * memory.array_bytes(problem.out_shape, np.float32), "gpu", "embedding",
                   f"the output and the fp32 sums of {problem.describe()}")
    if problem.M == 0 or problem.H == 0:
        return functools.partial(_empty_result, problem)
    if _no_rows(problem):
        return functools.partial(_nan_result, problem)
    p = problem
    positions = slice(p.position_offset, p.position_offset + p.S) if p.shape else p.position_offset
    f32 = cupy.float32

    def run(ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias):
        index = ids.astype(cupy.int64, copy=False)  # uint64 past 2^63 turns negative: out of range either way
        bad = (index < 0) | (index >= p.rows)
        e = cupy.take(weight, cupy.clip(index, 0, p.rows - 1), axis=0).astype(f32, copy=False)
        if position_weight is not None:
            e += position_weight[positions].astype(f32, copy=False)  # (S, H): broadcast over ids' leading axes
        if type_weight is not None:
            if type_ids is None:
                e += type_weight[0].astype(f32, copy=False)
            else:
                types = type_ids.astype(cupy.int64, copy=False)
                bad |= (types < 0) | (types >= p.type_rows)
                e += cupy.take(type_weight, cupy.clip(types, 0, p.type_rows - 1), axis=0).astype(f32, copy=False)
        y = cupy.where(bad[..., None], f32(np.nan), e).astype(weight_dtype, copy=False)
        # a NaN row stays NaN through the norm: its mean is NaN
        return layer_norm(y, norm_weight, norm_bias, eps=p.eps) if p.normalize else y
    return run


# --- reference ---------------------------------------------------------------------------------------
def _check_range(name: str, index: np.ndarray, rows: int, table: str) -> None:
    if index.size == 0:
        return
    low, high = int(index.min()), int(index.max())
    if low >= 0 and high < rows:
        return
    out_of_range = (index < 0) | (index >= rows)
    first = int(out_of_range.reshape(-1).argmax())
    where = tuple(int(i) for i in np.unravel_index(first, index.shape))
    raise IndexError(f"embedding: {name} must be in [0, {rows}) (the rows of {table}), got "
                     f"{int(index.reshape(-1)[first])} at position {where} ({int(out_of_range.sum())} out of "
                     f"range; min {low}, max {high})")


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: EmbeddingProblem, ids, weight, position_weight, type_ids, type_weight, norm_weight,
               norm_bias):
    p = problem
    _check_range("ids", ids, p.rows, "weight")
    if type_ids is not None:
        _check_range("type_ids", type_ids, p.type_rows, "type_weight")
    if p.M == 0 or p.H == 0:
        return np.empty(p.out_shape, weight.dtype)
    memory.require(3 * memory.array_bytes(p.out_shape, np.float64), "cpu", "embedding",
                   f"the float64 sums of shape {p.out_shape} ({p.M} tokens of {p.H})")
    e = np.take(weight, ids, axis=0).astype(np.float64)
    if position_weight is not None:
        positions = slice(p.position_offset, p.position_offset + p.S) if p.shape else p.position_offset
        e += position_weight[positions].astype(np.float64)
    if type_weight is not None:
        e += (type_weight[0] if type_ids is None else np.take(type_weight, type_ids, axis=0)).astype(np.float64)
    if p.normalize:
        centered = e - e.mean(axis=-1, keepdims=True)
        e = centered / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + p.eps)
        if norm_weight is not None:
            e *= norm_weight.astype(np.float64)
        if norm_bias is not None:
            e += norm_bias.astype(np.float64)
    return e.astype(weight.dtype)
