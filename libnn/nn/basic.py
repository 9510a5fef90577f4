"""Shape and lookup layers with PyTorch's semantics: Flatten, Dropout, Softmax, LogSoftmax, Embedding.

Flatten is the one layer here that knows a layout: a 4-D input is an image batch stored in `layout`
("NHWC" by default, what libnn's conv and pooling layers produce), standing for the NCHW tensor
PyTorch would hold. Flatten puts the features in PyTorch's (C, H, W) order, so a Linear after it takes
a PyTorch checkpoint's weight as it is. Softmax and LogSoftmax take `dim` on the array's own axes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from libnn.nn import checks
from libnn import dtypes
from libnn.nn.module import Module, init_normal
from libnn.ops.conv2d import LAYOUTS
from libnn.ops.embedding import GPU_DTYPES as EMBEDDING_DTYPES
from libnn.ops.embedding import IdErrors, embedding
from libnn.ops.softmax import softmax
from libnn.runtime.arrays import array_module, as_array, describe, is_cupy, min_max


class Flatten(Module):
    """Dimensions start_dim..end_dim merged into one, as torch.nn.Flatten. For a 4-D input in NHWC
    the features come out in PyTorch's (C, H, W) order: one transpose, a copy of the activation
    (unless C or H·W is 1), small next to the convolution that produced it."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1, *, layout: str = "NHWC"):
        super().__init__()
        checks.choice("Flatten", "layout", layout, LAYOUTS)
        for name, dim in (("start_dim", start_dim), ("end_dim", end_dim)):
            checks.size("Flatten", name, dim, minimum=None)  # the range depends on the input's rank
        self.start_dim, self.end_dim, self.layout = int(start_dim), int(end_dim), layout

    def forward(self, x: Any) -> Any:
        x = as_array(x, "Flatten", "x")
        ndim = max(x.ndim, 1)  # PyTorch flattens a scalar to shape (1,)
        start, end = (_dim(d, ndim, f"Flatten: {name}") for d, name in ((self.start_dim, "start_dim"),
                                                                        (self.end_dim, "end_dim")))
        if start > end:
            raise ValueError(f"Flatten: start_dim {self.start_dim} comes after end_dim {self.end_dim} "
                             f"for x of shape {tuple(x.shape)}")
        if x.ndim == 0:
            return x.reshape(1)
        if start == end:
            return x
        if x.ndim == 4 and self.layout == "NHWC":
            x = x.transpose(0, 3, 1, 2)  # the NCHW tensor this array stores
        shape = x.shape[:start] + (math.prod(x.shape[start:end + 1]),) + x.shape[end + 1:]
        return array_module(x).ascontiguousarray(x).reshape(shape)

    def __repr__(self) -> str:
        return f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim}, layout={self.layout!r})"


class Dropout(Module):
    """The identity: libnn is inference only, where dropout does nothing. `p` is kept for reference."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        self.p, self.inplace = checks.probability("Dropout", "p", p), checks.flag("Dropout", "inplace", inplace)

    def forward(self, x: Any) -> Any:
        return x

    def __repr__(self) -> str:
        return f"Dropout(p={self.p})"


class Softmax(Module):
    """softmax along `dim` through libnn.ops.softmax (see there for the paths)."""

    log = False

    def __init__(self, dim: int = -1, *, path: str = "auto"):
        super().__init__()
        name = type(self).__name__
        self.dim, self.path = checks.size(name, "dim", dim, minimum=None), checks.path(name, path, ("softmax",))

    def forward(self, x: Any) -> Any:
        return softmax(x, self.dim, log=self.log, path=self.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


class LogSoftmax(Softmax):
    """log-softmax along `dim`, computed as (x - max) - log(sum(exp(x - max)))."""

    log = True


class Embedding(Module):
    """A lookup table: forward(ids) returns weight[ids], of shape ids.shape + (embedding_dim,).

    `weight` is (num_embeddings, embedding_dim), initialised N(0, 1) like PyTorch, with the row
    `padding_idx` (if given; negative counts from the end) set to zeros. At inference the padding row
    is an ordinary row: it holds whatever the loaded checkpoint holds.

    ids must be integers in [0, num_embeddings); an id out of range is an IndexError, never a row of
    the table it does not name. Host ids are checked before the gather. GPU ids, with
    `check_ids="lazy"` (the default), are checked without a synchronisation: the gather
    (libnn.ops.embedding's custom kernel) writes NaN rows for such tokens and records one in host
    memory, and the layer raises at the first later call that finds the record (before running it;
    the record is there once the bad call's kernel has run) or at `raise_id_errors()`, which
    synchronises. With `check_ids="sync"` the ids are checked before the gather with one
    reduction and a synchronisation per call (skipped while a CUDA graph is being captured, see
    libnn.nn.graphs), as for fp64 tables, which the kernel does not take.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 dtype: Any = "fp32", device: str = "cpu", seed: int | None = None, check_ids: str = "lazy"):
        super().__init__()
        checks.choice("Embedding", "check_ids", check_ids, CHECK_IDS)
        # empty tables are allowed, as in PyTorch: every lookup into one is refused, none is wrong
        num_embeddings = checks.size("Embedding", "num_embeddings", num_embeddings, minimum=0)
        embedding_dim = checks.size("Embedding", "embedding_dim", embedding_dim, minimum=0)
        if padding_idx is not None:
            padding_idx = checks.size("Embedding", "padding_idx", padding_idx, minimum=None)
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx must be in [{-num_embeddings}, {num_embeddings}) "
                                 f"(num_embeddings {num_embeddings}), got {padding_idx}")
            padding_idx %= num_embeddings
        parsed, seed = checks.float_dtype("Embedding", dtype), checks.seed("Embedding", seed)
        checks.device("Embedding", device)
        checks.parameters_fit("Embedding", f"num_embeddings={num_embeddings}, embedding_dim={embedding_dim}",
                              num_embeddings * embedding_dim, parsed, device)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.check_ids = check_ids
        self._id_errors: IdErrors | None = None  # made at the first lazily checked call
        weight = init_normal((num_embeddings, embedding_dim), parsed, "cpu", seed)
        if padding_idx is not None:
            weight[padding_idx] = 0
        self.register_parameter("weight", weight)
        if device != "cpu":
            self.to(device)

    def forward(self, ids: Any) -> Any:
        ids = as_array(ids, "Embedding", "ids")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding: ids must be an integer array (int32, int64, ...), got dtype {ids.dtype}")
        weight, on_gpu = self.weight, is_cupy(ids)
        if on_gpu != is_cupy(weight):
            raise TypeError(f"Embedding: ids is {describe(ids)} but the weight is {describe(weight)}; "
                            "move ids to the weight's device (cupy.asarray / cupy.asnumpy)")
        if on_gpu and self.check_ids == "lazy" and weight.dtype in _KERNEL_DTYPES:
            errors = self._id_errors
            if errors is None:
                errors = self._id_errors = IdErrors.allocate()
            self._raise_recorded(errors)
            if self.num_embeddings == 0 and ids.size:  # every id is out of range: the shapes tell, no sync
                raise IndexError("Embedding: ids must be in [0, 0) (num_embeddings): the table is empty")
            return embedding(ids, weight, id_errors=errors)
        xp = array_module(ids)
        ranges = min_max([ids]) if ids.size else None  # on the GPU: one synchronisation
        if ranges and (ranges[0][0] < 0 or ranges[0][1] >= self.num_embeddings):
            out_of_range = (ids < 0) | (ids >= self.num_embeddings)  # the error path: name the first offender
            first = int(out_of_range.reshape(-1).argmax())
            where = tuple(int(i) for i in np.unravel_index(first, ids.shape))
            raise IndexError(f"Embedding: ids must be in [0, {self.num_embeddings}) (num_embeddings), "
                             f"got {int(ids.reshape(-1)[first])} at position {where} "
                             f"({int(out_of_range.sum())} out of range; min {ranges[0][0]}, max {ranges[0][1]})")
        return xp.take(self.weight, ids, axis=0)

    def raise_id_errors(self) -> None:
        """Wait for this layer's launches on the current stream, then raise the IndexError of any id
        out of range since the last check (check_ids="lazy"; nothing to do otherwise)."""
        if self._id_errors is not None:
            import cupy
            cupy.cuda.get_current_stream().synchronize()
            self._raise_recorded(self._id_errors)

    def _raise_recorded(self, errors: IdErrors) -> None:
        if bad := errors.take():
            raise IndexError(f"Embedding: ids must be in [0, {self.num_embeddings}) (num_embeddings); an earlier "
                             f"call had an id out of range at token {bad - 1} of its ids (row-major), and gave NaN "
                             "rows for such tokens. check_ids='lazy' finds this without a synchronisation, at the "
                             "first call after that kernel ran (this one, which did not run) or at raise_id_errors(); "
                             "check_ids='sync' raises in the call itself, at one synchronisation per call")

    def __repr__(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        check = "" if self.check_ids == "lazy" else f", check_ids={self.check_ids!r}"
        return f"Embedding({self.num_embeddings}, {self.embedding_dim}{pad}{check})"


CHECK_IDS = ("lazy", "sync")
# the tables libnn.ops.embedding's custom kernel gathers from (and so records bad ids for)
_KERNEL_DTYPES = frozenset(dtypes.parse(d) for d in EMBEDDING_DTYPES)


def _dim(dim: Any, ndim: int, where: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"{where} must be an int, got {type(dim).__name__} {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{where} {dim} is out of range for a {ndim}-D input (expected {-ndim}..{ndim - 1})")
    return int(dim) % ndim
