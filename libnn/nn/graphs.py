"""Whole-model CUDA graphs: capture a model's forward pass once per input signature, then replay it.

`model.graphed()` (or `GraphedModule(model)`) returns a callable with the model's signature. The first
call with a new signature (each array argument's shape, dtype and device, every other argument's value):
1. copies the inputs into static buffers the graph will read;
2. runs the model once as usual on them, with every check (token ids, sequence lengths), on the
   caller's stream;
3. runs it `warmup` more times in graph mode on the module's private stream: the code paths the capture
   will take (no host synchronisation; a padding mask as a bias, not lengths), building every plan,
   handle, workspace and kernel they need (cuDNN graphs, cuBLASLt plans, NVRTC modules);
4. captures one more pass into a CUDA graph.
Every later call with that signature copies the inputs into the static buffers and launches the graph:
one launch for the whole model instead of one (plus Python) per op. A new signature captures anew;
captures are cached per signature, at most `max_captures` of them (the least recently used is dropped).

**Parameters.** A call compares the model's `version` (libnn.nn.module) with the one the captures were
made at, one integer: replacing a parameter (load_state_dict, to(), `layer.weight = w`) drops every
capture, and the next call captures with the new parameters. Each capture holds the parameters it baked
in, so their memory is never freed under a graph.

**Caller-filled inputs.** `bufs = g.inputs(*args, **kwargs)` captures if needed and returns the graph's
input buffers, one per array argument (positional ones first, then keyword ones in the order given);
fill them (`bufs[0][...] = x`, or write into them from a kernel), then `g(*bufs)` with exactly those
objects replays with no copy, or `g.replay()` replays the last capture `inputs()` or a call used. Any
other array is copied in, as before; an array that is (a view of) one of the graph's buffers but not the
one this call fills at its position (another shape, dtype, capture or position) is refused. The buffers
keep what was last written to them.

**Buckets.** `graphed(buckets=(1, 2, 4, 8, 16, 32, 64))` pads dim 0 of every array argument (the batch)
up to the next bucket and captures one graph per bucket: a server whose batch sizes vary captures at
most len(buckets) graphs. Padding rows are copies of the last real row (every value in them is one the
caller gave: valid token ids, a mask with tokens; zeros could give a row with no token), and the models
are row-independent, so nothing of them reaches a real row. The result is sliced back to the real batch
(every array in the output is batch-major: its dim 0 is sliced). A batch larger than the largest bucket
is refused (ValueError naming the buckets): split it, or add a bucket. `g.inputs(...)` then returns the
real rows of each buffer (views), and the padding rows are refreshed on every call.

`seq_buckets=(...)` pads dim 1 (the sequence) too, for models that declare their sequence inputs with a
`graph_sequence_inputs` attribute (a SequenceInputs; BertEncoder does): padded positions are zeros and
masked (attention_mask 0; a mask of ones is built where the caller gave none), and the output fields it
names are sliced back along dim 1. A sequence longer than the largest seq bucket is refused likewise.

**Packed tokens.** A model that computes only its tokens, packed without the padding (BertEncoder,
`unpad=True`: its SequenceInputs names `tokens`), needs the number of rows to pack them into when it
is captured. Every call of at least its `pack_from` positions therefore counts the mask's tokens on
the host (one read-back of the mask, which waits for the work queued before it) and captures one
graph per `token_bucket` of the count (steps of 1/16 to 1/8 of it): batches with similar token
counts share a capture. Caller-filled buffers (`g(*bufs)`, `g.replay()`) keep the capture they belong
to, counted the same way: one whose mask now holds more tokens than it packs is recorded again for
the larger count (same buffers, new outputs; `stats()` counts it as a capture).

`g.stats()` gives, per signature (per bucket with buckets: `(8,)`, or `(8, 128)` with seq_buckets), the
number of captures, the last one's warm-up and capture time, the replays, and the pad waste: the share
of padded rows (row × position with seq_buckets) among all rows replayed.

**Outputs** are the static arrays the graph writes (or views of them): the next call with the same
signature, or into the same bucket, overwrites them, so copy what you keep (`out.copy()`), as with
PyTorch's CUDA graphs. Another signature or bucket never overwrites them: each capture keeps its own
outputs. Replays read the inputs without the checks of step 2: values are not validated again (a token
id out of range is not caught).

**Streams.** Replays run on the caller's current stream. All captures of one GraphedModule draw their
memory from one pool and may share intermediate buffers (see `_memory_pool`), so replays of one
GraphedModule must not run on two streams at once.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

from libnn.errors import LibnnError
from libnn.runtime import memory
from libnn.runtime.arrays import is_cupy
from libnn.runtime.stream import graph_mode


class Graphable(Protocol):
    """What a graph needs of a model: calling it, its `version` (a libnn.nn.Module's: see
    libnn.nn.module) and its parameters. A protocol rather than Module itself because Module.graphed()
    builds a GraphedModule: this module sits below libnn.nn.module, not beside it."""
    version: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any]]: ...


@dataclass(frozen=True)
class SequenceInputs:
    """How a model takes sequences, for graphed(seq_buckets=...): every array argument is (batch, seq,
    ...); `mask` is the argument, at `mask_position` among forward's parameters, that marks tokens 1 and
    padding 0; `outputs` names the output fields with the sequence on dim 1 (the others are sliced on
    the batch only). A model that computes only the tokens, packed (BertEncoder), names in `tokens` the
    keyword that takes how many rows to pack them into: every graphed call of at least `pack_from`
    positions counts the mask's tokens (one read-back) and passes token_bucket(count), which keys the
    capture like any other value."""
    mask: str
    mask_position: int
    outputs: tuple[str, ...]
    tokens: str | None = None     # forward's keyword for the packed capacity, if the model packs its tokens
    pack_from: int = 1            # the fewest positions (batch × seq) for which the model packs them

    def __post_init__(self):
        def wrong(name: str, expected: str, value: Any) -> str:
            return f"SequenceInputs: {name} must be {expected}, got {type(value).__name__} {value!r}"

        if not isinstance(self.mask, str):
            raise TypeError(wrong("mask", "the mask argument's name (a str)", self.mask))
        # a lone string would be taken for its characters: `name in outputs` tests substrings
        if not isinstance(self.outputs, tuple) or not all(isinstance(o, str) for o in self.outputs):
            raise TypeError(wrong("outputs", "a tuple of output field names (str)", self.outputs))
        if not (self.tokens is None or isinstance(self.tokens, str)):
            raise TypeError(wrong("tokens", "None or a keyword's name (a str)", self.tokens))
        for name, minimum in (("mask_position", 0), ("pack_from", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(wrong(name, "an int", value))
            if value < minimum:
                raise ValueError(f"SequenceInputs: {name} must be an int >= {minimum}, got {value}")


@dataclass
class CaptureStats:
    """One signature's (or bucket's) captures and replays."""
    warmup_seconds: float = 0.0   # the last capture's checked pass and graph-mode warm-ups: plans, kernels
    capture_seconds: float = 0.0  # the last capture's recording and instantiation
    replays: int = 0
    captures: int = 0             # more than one: dropped (parameters replaced, least recently used) and redone
    rows: int = 0                 # real rows replayed (row × position with seq_buckets)
    padded_rows: int = 0          # padding rows replayed

    @property
    def pad_waste(self) -> float:
        """The share of padding among the rows the replays computed."""
        total = self.rows + self.padded_rows
        return self.padded_rows / total if total else 0.0


class _Bucket(NamedTuple):
    rows: int
    seq: int | None
    rows_bucket: int
    seq_bucket: int | None
    auto_mask: bool               # the caller gave no mask: the capture has one of its own


@dataclass(eq=False)
class _Region:
    """What one call fills of a capture's buffers: the caller's part of each (`inputs`), the padding
    around it, and the output sliced to it. Built once per (capture, rows, seq)."""
    inputs: list[Any]
    seq_pads: list[Any]                    # each buffer's padded positions of the real rows: zeroed
    row_pads: list[tuple[Any, Any]]        # (padding rows, last real row) per buffer
    output: Any
    rows: int
    padded_rows: int
    seq: int | None = None


@dataclass(eq=False)
class _Capture:
    buffers: list[Any]           # the static input buffers, in _arrays order
    auto_mask: Any               # the mask the capture built (seq_buckets, caller gave none), or None
    bucket: tuple[int, int | None] | None
    stats: CaptureStats
    graph: Any = None
    output: Any = None
    tokens: int | None = None    # the packed capacity it replays now (SequenceInputs.tokens); grows (_grow)
    key_tokens: int | None = None  # the packed capacity in its key
    mask_index: int | None = None  # the mask's position among the buffers, when `tokens` is set
    call: tuple[tuple, dict] | None = None  # the static call (the buffers for the arrays), recorded again by _grow
    parameters: tuple[Any, ...] = ()   # the parameters baked in: held, never freed under the graph
    regions: dict[tuple[int, int | None], _Region] = field(default_factory=dict)
    last: _Region | None = None  # the region whose padding the buffers hold now
    dropped: bool = False


class GraphedModule:
    def __init__(self, module: Graphable, *, warmup: int = 2, buckets: Sequence[int] | None = None,
                 seq_buckets: Sequence[int] | None = None, max_captures: int = 32):
        name = f"{type(module).__name__}.graphed()"
        if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral):
            raise TypeError(f"{name}: warmup must be an int, got {type(warmup).__name__} {warmup!r}")
        if warmup < 1:
            raise ValueError(f"{name}: warmup must be >= 1 (plans must be built before the capture), got {warmup}")
        if isinstance(max_captures, bool) or not isinstance(max_captures, numbers.Integral) or max_captures < 1:
            raise ValueError(f"{name}: max_captures must be a positive integer, got {max_captures!r}")
        self.module, self.warmup, self.max_captures = module, warmup, int(max_captures)
        self.buckets = validated_buckets(buckets, "buckets", name)
        self.seq_buckets = validated_buckets(seq_buckets, "seq_buckets", name)
        self._sequence: SequenceInputs | None = getattr(module, "graph_sequence_inputs", None)
        if self.seq_buckets is not None and self._sequence is None:
            raise ValueError(f"{name}: seq_buckets needs a model that declares its sequence inputs "
                             f"(graph_sequence_inputs, as BertEncoder does); {type(module).__name__} has none")
        self._name = name
        self._captures: LRU = LRU(self.max_captures)
        self._stats: dict[tuple, CaptureStats] = {}
        self._owners: dict[int, tuple[_Capture, int]] = {}  # id(buffer) -> its capture and position
        self._version = module.version
        self._last: tuple[_Capture, _Region] | None = None
        self._stream = None    # one private stream for every capture: its handles and workspaces stay valid
        self._pool = None

    # --- the calls -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, tokens = self._with_tokens(args, kwargs)
        entry, region, arrays = self._locate(args, kwargs)
        self._last = entry, region
        return self._replay(entry, region, arrays, tokens)

    def inputs(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The graph's input buffers for a call like this one (captured now if needed): one per array
        argument, positional ones first, then keyword ones in the order given. With buckets, the real
        rows (and positions) of each buffer. Fill them and call `g(*buffers)` or `g.replay()`."""
        args, kwargs, _ = self._with_tokens(args, kwargs)
        entry, region, _ = self._locate(args, kwargs)
        self._last = entry, region
        positional = sum(1 for a in args if is_cupy(a))
        by_name = dict(zip(sorted(k for k in kwargs if is_cupy(kwargs[k])), region.inputs[positional:]))
        return tuple(region.inputs[:positional]) + tuple(by_name[k] for k in kwargs if k in by_name)

    def replay(self) -> Any:
        """Replay the capture the last call or `inputs()` used, on what its buffers hold now."""
        if self._last is None:
            raise LibnnError(f"{self._name}.replay(): nothing was captured yet; call g(...) or g.inputs(...) first")
        entry, region = self._last
        if self.module.version != self._version or entry.dropped:
            raise LibnnError(f"{self._name}.replay(): that capture was dropped (a parameter was replaced or a "
                             f"setting changed, or max_captures={self.max_captures} newer ones pushed it out); call "
                             "g.inputs(...) again and refill the buffers it returns")
        tokens = None
        if entry.tokens is not None:
            mask = region.inputs[entry.mask_index]
            tokens = self._count_tokens(mask, entry.bucket[0] if entry.bucket else mask.shape[0])
        return self._replay(entry, region, None, tokens)

    def stats(self) -> dict[tuple, CaptureStats]:
        """Per signature, or per bucket ((rows,) or (rows, seq)) with buckets: captures, the last
        capture's times, replays and pad waste; signatures dropped since are kept."""
        return dict(self._stats)

    # --- finding the capture ---------------------------------------------------------------------
    def _with_tokens(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, int | None]:
        """For a model that packs its tokens (SequenceInputs.tokens): kwargs with the packed capacity
        for this call's mask, token_bucket of its count, which keys the capture, and the count. A mask
        that is a capture's own buffer keeps that capture's capacity, so that caller-filled buffers
        replay the capture they belong to (which grows if they hold more tokens: see _replay)."""
        spec = getattr(self.module, "graph_sequence_inputs", None)
        if spec is None or spec.tokens is None or spec.tokens in kwargs:
            return args, kwargs, None
        mask = _mask_argument(spec, args, kwargs)
        if not is_cupy(mask) or mask.ndim != 2 or 0 in mask.shape:
            return args, kwargs, None  # no mask (nothing to pack) or one the model's checks refuse
        rows, seq = mask.shape
        rows_bucket = rows if self.buckets is None else bucket_for(rows, self.buckets, "buckets", self._name)
        seq_bucket = seq if self.seq_buckets is None else bucket_for(seq, self.seq_buckets, "seq_buckets", self._name)
        if rows_bucket * seq_bucket < spec.pack_from:
            return args, kwargs, None
        tokens = self._count_tokens(mask, rows_bucket)
        capacity = token_bucket(tokens, rows_bucket * seq_bucket)
        owner = self._owners.get(id(_root(mask)))
        if owner is not None and owner[0].tokens is not None:
            capacity = owner[0].key_tokens
        return args, {**kwargs, spec.tokens: capacity}, tokens

    @staticmethod
    def _count_tokens(mask: Any, rows_bucket: int) -> int:
        """The tokens of `mask` (rows, seq) once its rows are padded to `rows_bucket` with copies of the
        last: one read-back."""
        import cupy

        per_row = cupy.count_nonzero(mask, axis=1).get()
        return int(per_row.sum()) + (rows_bucket - mask.shape[0]) * int(per_row[-1])

    def _locate(self, args: tuple, kwargs: dict) -> tuple[_Capture, _Region, list[Any]]:
        if self.module.version != self._version:
            self._drop_all()
        if self.buckets is None and self.seq_buckets is None:
            key, arrays = self._signature(args, kwargs, 0)
            bucket = None
        else:
            key, arrays, bucket = self._bucket_key(args, kwargs)
        entry = self._captures.get(key)
        if entry is None:
            entry = self._capture(key, args, kwargs, arrays, bucket)
        if bucket is None:
            return entry, entry.regions[None, None], arrays
        region = entry.regions.get((bucket.rows, bucket.seq))
        if region is None:
            region = entry.regions[bucket.rows, bucket.seq] = self._region(entry, bucket.rows, bucket.seq)
        return entry, region, arrays

    def _signature(self, args: tuple, kwargs: dict, lead: int) -> tuple[tuple, list[Any]]:
        """The key of a call (each array's shape past its first `lead` dims, dtype and device; every
        other argument's value), and its arrays in _arrays order."""
        arrays: list[Any] = []
        key = [self._describe(a, i, arrays, lead) for i, a in enumerate(args)]
        if kwargs:
            key += [(k, self._describe(kwargs[k], k, arrays, lead)) for k in sorted(kwargs)]
        return tuple(key), arrays

    def _describe(self, value: Any, name: int | str, arrays: list[Any], lead: int) -> tuple:
        """One argument's part of the key; `name` is its position or keyword (formatted only for errors)."""
        if is_cupy(value):
            arrays.append(value)
            return value.shape[lead:], value.dtype, value.data.device_id
        if isinstance(name, int):
            name = f"#{name}"
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            raise TypeError(f"{self._name}: argument {name} is a host array; CUDA graphs replay GPU work only: "
                            f"pass cupy arrays (cupy.asarray(...))")
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"{self._name}: argument {name} must be a cupy array or a hashable value (it becomes "
                            f"part of the capture's key), got {type(value).__name__}") from None
        return _VALUE, value

    def _bucket_key(self, args: tuple, kwargs: dict) -> tuple[tuple, list[Any], _Bucket]:
        lead = 1 if self.seq_buckets is None else 2
        signature, arrays = self._signature(args, kwargs, lead)
        if not arrays:
            raise ValueError(f"{self._name}: buckets pad the array arguments, and this call has none")
        rows, seq = arrays[0].shape[0] if arrays[0].ndim else 0, None
        if lead == 2:
            seq = arrays[0].shape[1] if arrays[0].ndim > 1 else 0
        for i, a in enumerate(arrays):
            if a.ndim < lead or a.shape[0] != rows or (lead == 2 and a.shape[1] != seq):
                what = "(batch, seq, ...)" if lead == 2 else "(batch, ...)"
                raise ValueError(f"{self._name}: with buckets every array argument is {what} with the same "
                                 f"batch{' and seq' if lead == 2 else ''} as the first, {tuple(arrays[0].shape)}; "
                                 f"argument {_array_names(args, kwargs)[i]} has shape {tuple(a.shape)}")
        if rows == 0:
            raise ValueError(f"{self._name}: the batch is empty (0 rows); there is nothing to pad or replay")
        rows_bucket = rows if self.buckets is None else bucket_for(rows, self.buckets, "buckets", self._name)
        seq_bucket = None if seq is None else bucket_for(seq, self.seq_buckets, "seq_buckets", self._name)
        auto_mask = self._sequence is not None and lead == 2 and not self._mask_given(args, kwargs)
        bucket = _Bucket(rows, seq, rows_bucket, seq_bucket, auto_mask)
        return (rows_bucket, seq_bucket, auto_mask, signature), arrays, bucket

    def _mask_given(self, args: tuple, kwargs: dict) -> bool:
        return _mask_argument(self._sequence, args, kwargs) is not None

    # --- replaying -------------------------------------------------------------------------------
    def _replay(self, entry: _Capture, region: _Region, arrays: list[Any] | None, tokens: int | None = None) -> Any:
        self._fill(entry, region, arrays)
        if tokens is not None and tokens > entry.tokens:
            self._grow(entry, tokens)
        _launch(entry.graph)
        stats = entry.stats
        stats.replays += 1
        stats.rows += region.rows
        stats.padded_rows += region.padded_rows
        return region.output

    def _fill(self, entry: _Capture, region: _Region, arrays: list[Any] | None) -> None:
        """Copy in the arrays that are not the buffers themselves (None: the caller filled them all),
        and write the padding."""
        if arrays is not None:
            for i, (view, value) in enumerate(zip(region.inputs, arrays)):
                if value is not view:
                    self._copy_in(entry, i, view, value)
        if entry.last is not region:  # another region's real positions may lie in this one's padding
            _clear_padding(entry, region)
        if region.row_pads:
            _pad_rows(region)

    def _copy_in(self, entry: _Capture, position: int, view: Any, value: Any) -> None:
        owner = self._owners.get(id(_root(value)))
        if owner is None:
            _copy(view, value)
        elif not (owner[0] is entry and owner[1] == position and _same_memory(value, view)):
            self._refuse(owner, position, value, view)
        # else: a fresh view of the very region this call fills, which is filled already

    def _refuse(self, owner: tuple[_Capture, int], position: int, value: Any, view: Any) -> None:
        buffer = owner[0].buffers[owner[1]]
        wanted = ("a new capture (a signature or bucket not captured yet)" if view is None else
                  f"its buffer region of shape {tuple(view.shape)} {view.dtype}")
        raise ValueError(f"{self._name}: array argument {position} (shape {tuple(value.shape)}, {value.dtype}) is "
                         f"a view of the graph's input buffer {owner[1]} of shape {tuple(buffer.shape)} "
                         f"{buffer.dtype}, but this call fills {wanted} at that position: pass back what "
                         "g.inputs(...) returned for this very call, in its order, or arrays of your own")

    # --- capturing -------------------------------------------------------------------------------
    def _capture(self, key: tuple, args: tuple, kwargs: dict, arrays: list[Any], bucket: _Bucket | None) -> _Capture:
        import cupy

        for position, value in enumerate(arrays):  # a new capture has no buffers: any of ours is misplaced
            owner = self._owners.get(id(_root(value)))
            if owner is not None:
                self._refuse(owner, position, value, None)
        start = time.perf_counter()
        pool = self._memory_pool()
        size = None if bucket is None else (bucket.rows_bucket, bucket.seq_bucket)
        shapes = [_padded_shape(a.shape, size) for a in arrays]
        if size is not None:  # a bucket far above the call's batch: refused before the capture allocates it
            memory.require(sum(math.prod(shape) * a.dtype.itemsize for shape, a in zip(shapes, arrays)), "gpu",
                           self._name, f"the input buffers of bucket {tuple(b for b in size if b is not None)}")
        with cupy.cuda.using_allocator(pool.malloc):
            buffers = [cupy.empty(shape, a.dtype) for shape, a in zip(shapes, arrays)]
            auto_mask = cupy.empty(size, cupy.bool_) if bucket is not None and bucket.auto_mask else None
        stats_key = key if bucket is None else tuple(b for b in size if b is not None)
        entry = _Capture(buffers, auto_mask, size, self._stats.setdefault(stats_key, CaptureStats()))
        spec = getattr(self.module, "graph_sequence_inputs", None)
        if spec is not None and spec.tokens is not None and spec.tokens in kwargs:
            entry.tokens = entry.key_tokens = kwargs[spec.tokens]
            mask = _mask_argument(spec, args, kwargs)
            entry.mask_index = next((i for i, a in enumerate(arrays) if a is mask), None)
        where = (None, None) if bucket is None else (bucket.rows, bucket.seq)
        region = self._region(entry, *where)
        self._fill(entry, region, arrays)
        static_args, static_kwargs = self._static_call(args, kwargs, buffers, auto_mask)
        entry.call = static_args, static_kwargs
        self.module(*static_args, **static_kwargs)  # the checked pass: bad input fails here, as it would eagerly
        warmed, captured = self._record(entry, static_args, static_kwargs, pool)
        if bucket is not None:
            _check_batch_major(entry.output, size, self._sequence, self._name)
        region.output = self._output(entry, *where)
        entry.parameters = tuple(v for _, v in self.module.named_parameters())
        entry.stats.captures += 1
        entry.stats.warmup_seconds, entry.stats.capture_seconds = warmed - start, captured - warmed
        self._check_version()  # a pass that replaced parameters (a repacked weight) made older captures stale
        for evicted in self._captures.put(key, entry):
            self._forget(evicted)
        self._owners.update({id(b): (entry, i) for i, b in enumerate(buffers)})
        entry.regions[where] = region
        return entry

    def _record(self, entry: _Capture, args: tuple, kwargs: dict, pool: Any) -> tuple[float, float]:
        """Warm up in graph mode on the private stream, then capture; returns when each ended."""
        import cupy

        if self._stream is None:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        stream = self._stream
        cupy.cuda.get_current_stream().synchronize()  # the buffers are filled before the private stream reads them
        with cupy.cuda.using_allocator(pool.malloc), stream, graph_mode():
            for _ in range(self.warmup):
                self.module(*args, **kwargs)
            stream.synchronize()
            warmed = time.perf_counter()
            stream.begin_capture()
            try:
                entry.output = self.module(*args, **kwargs)
            except Exception as exc:
                stream.end_capture()
                raise LibnnError(f"{type(self.module).__name__}: the forward pass could not be captured in a CUDA "
                                 f"graph ({type(exc).__name__}: {exc}); call the model directly instead") from exc
            entry.graph = stream.end_capture()
            entry.graph.upload(stream)
            stream.synchronize()
        return warmed, time.perf_counter()

    def _grow(self, entry: _Capture, tokens: int) -> None:
        """Record `entry` again to pack `tokens` tokens: its buffers (filled by the caller with a mask
        of more tokens than it was captured for) stay, the graph and the outputs are new."""
        args, kwargs = entry.call
        capacity = token_bucket(tokens, entry.buffers[entry.mask_index].size)
        kwargs = {**kwargs, self.module.graph_sequence_inputs.tokens: capacity}
        start = time.perf_counter()
        warmed, captured = self._record(entry, args, kwargs, self._memory_pool())
        entry.call, entry.tokens = (args, kwargs), capacity
        for where, region in entry.regions.items():
            region.output = self._output(entry, *where)
        entry.stats.captures += 1
        entry.stats.warmup_seconds, entry.stats.capture_seconds = warmed - start, captured - warmed

    def _memory_pool(self) -> Any:
        """The one pool every capture of this module draws from. Each capture's input buffers and
        outputs stay allocated as long as the capture lives, so no other capture is ever given their
        addresses: a bucket's output survives replays of every other bucket. Intermediates are freed
        back to the pool as the capture records, and a later capture may be given the same addresses
        for its own intermediates. That is safe because a replay writes every intermediate before it
        reads it, and replays never overlap: they run one after the other on the caller's stream, and
        a capture's warm-ups start only after that stream has drained (see _record). (PyTorch asks that
        graphs sharing a pool be replayed in capture order because it lets earlier outputs be freed
        and reused; here outputs are never freed under a live capture, so any order is safe.) What
        stays unsafe is replaying two captures of one GraphedModule on two streams at once."""
        if self._pool is None:
            import cupy

            self._pool = cupy.cuda.MemoryPool()
        return self._pool

    def _static_call(self, args: tuple, kwargs: dict, buffers: list[Any], auto_mask: Any) -> tuple[tuple, dict]:
        args, kwargs = _substitute(args, kwargs, buffers)
        if auto_mask is not None:
            spec = self._sequence
            if len(args) > spec.mask_position:
                args = args[:spec.mask_position] + (auto_mask,) + args[spec.mask_position + 1:]
            else:
                kwargs = {**kwargs, spec.mask: auto_mask}
        return args, kwargs

    def _region(self, entry: _Capture, rows: int | None, seq: int | None) -> _Region:
        """The region (rows, seq) of a capture's buffers; (None, None) without buckets: all of them."""
        output = self._output(entry, rows, seq)
        if entry.bucket is None:
            return _Region(entry.buffers, [], [], output, _rows_of(entry.buffers), 0)
        rows_bucket, seq_bucket = entry.bucket
        if (rows, seq) == entry.bucket:
            inputs = list(entry.buffers)
        else:
            inputs = [b[:rows] if seq is None else b[:rows, :seq] for b in entry.buffers]
        seq_pads = [b[:rows, seq:] for b in entry.buffers] if seq is not None and seq < seq_bucket else []
        row_pads = [(b[rows:], b[rows - 1]) for b in entry.buffers] if rows < rows_bucket else []
        real_rows = rows * (seq or 1)
        return _Region(inputs, seq_pads, row_pads, output, real_rows,
                       rows_bucket * (seq_bucket or 1) - real_rows, seq)

    def _output(self, entry: _Capture, rows: int | None, seq: int | None) -> Any:
        """The capture's output cut to (rows, seq): views of its static arrays (None before recording)."""
        if entry.output is None or entry.bucket is None or (rows, seq) == entry.bucket:
            return entry.output
        return sliced(entry.output, rows, seq, self._sequence.outputs if seq is not None else ())

    # --- dropping --------------------------------------------------------------------------------
    def _check_version(self) -> None:
        if self.module.version != self._version:
            self._drop_all()

    def _drop_all(self) -> None:
        """A parameter was replaced or a setting changed: every capture reads stale addresses or
        computes what the module no longer does."""
        for entry in self._captures.clear():
            self._forget(entry)
        self._version = self.module.version

    def _forget(self, entry: _Capture) -> None:
        entry.dropped = True
        for b in entry.buffers:
            self._owners.pop(id(b), None)


_VALUE = object()  # marks a non-array argument in a key: no array's (shape, dtype, device) can equal it


class LRU:
    """At most `capacity` items by key; a get makes the item the most recently used, a put beyond
    the capacity pushes out the least recently used, which put returns."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: Any, item: Any) -> list[Any]:
        self._items[key] = item
        self._items.move_to_end(key)
        evicted = []
        while len(self._items) > self.capacity:
            evicted.append(self._items.popitem(last=False)[1])
        return evicted

    def clear(self) -> list[Any]:
        items = list(self._items.values())
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)


def token_bucket(tokens: int, limit: int) -> int:
    """The rows to pack `tokens` tokens into: rounded up to a step of 1/16 to 1/8 of the count (16 at
    least), so that varying counts share captures and GEMM plans, and at most `limit` (every position
    of the padded batch)."""
    step = max(16, 1 << max(0, tokens.bit_length() - 4))
    return min(limit, -(-max(tokens, 1) // step) * step)


def _mask_argument(spec: SequenceInputs, args: tuple, kwargs: dict) -> Any:
    """The mask argument of a call (None when not given)."""
    return args[spec.mask_position] if len(args) > spec.mask_position else kwargs.get(spec.mask)


def validated_buckets(buckets: Sequence[int] | None, name: str, where: str) -> tuple[int, ...] | None:
    """`buckets` as a tuple of positive ints in increasing order (None stays None); ValueError otherwise."""
    if buckets is None:
        return None
    try:
        values = tuple(buckets)
    except TypeError:
        values = None
    if (not values or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0 for b in values)
            or any(a >= b for a, b in zip(values, values[1:]))):
        raise ValueError(f"{where}: {name} must be a non-empty sequence of positive integers in increasing "
                         f"order, e.g. (1, 2, 4, 8), got {buckets!r}")
    return tuple(int(b) for b in values)


def bucket_for(n: int, buckets: tuple[int, ...], name: str, where: str) -> int:
    """The smallest bucket >= n; ValueError (naming the buckets) when n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        what = "a batch of" if name == "buckets" else "a sequence length of"
        raise ValueError(f"{where}: {what} {n} is larger than the largest of {name} {list(buckets)}; split the "
                         f"call, or add a larger bucket")
    return buckets[i]


def sliced(output: Any, rows: int, seq: int | None, seq_fields: Sequence[str]) -> Any:
    """`output` with every array cut to its first `rows` rows, and those under `seq_fields` also to
    their first `seq` positions (dim 1): views, no copies."""
    def cut(name: str | None, a: Any) -> Any:
        return a[:rows, :seq] if seq is not None and name in seq_fields else a[:rows]

    return _map_arrays(output, cut)


def _map_arrays(out: Any, fn: Callable[[str | None, Any], Any], name: str | None = None) -> Any:
    """`out` with fn(top-level field name, array) applied to every array in it: arrays, and tuples,
    lists, dicts and dataclasses of them; anything else is kept as it is."""
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return fn(name, out)
    if isinstance(out, dict):
        return {k: _map_arrays(v, fn, k if name is None else name) for k, v in out.items()}
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: _map_arrays(getattr(out, f.name), fn, f.name if name is None
                                                               else name)
                                           for f in dataclasses.fields(out) if f.init})
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*(_map_arrays(getattr(out, f), fn, f if name is None else name) for f in out._fields))
    if isinstance(out, (tuple, list)):
        return type(out)(_map_arrays(v, fn, name) for v in out)
    return out


def _check_batch_major(output: Any, size: tuple[int, int | None], spec: SequenceInputs | None, where: str) -> None:
    """Buckets slice every output array on dim 0 (and the sequence fields on dim 1): refuse an output
    that is not laid out so, rather than slice it wrongly."""
    rows, seq = size

    def check(name: str | None, a: Any) -> Any:
        seq_field = seq is not None and name in spec.outputs
        if a.ndim == 0 or a.shape[0] != rows or (seq_field and (a.ndim < 2 or a.shape[1] != seq)):
            expected = f"({rows}, {seq}, ...)" if seq_field else f"({rows}, ...)"
            raise LibnnError(f"{where}: with buckets every output array must be batch-major: output "
                             f"{name or ''} has shape {tuple(a.shape)}, expected {expected}; call graphed() "
                             "without buckets for this model")
        return a

    _map_arrays(output, check)


def _clear_padding(entry: _Capture, region: _Region) -> None:
    """Zero the padded positions of the real rows, and write the built mask for this length."""
    for pad in region.seq_pads:
        pad.fill(0)
    if entry.auto_mask is not None:
        entry.auto_mask[:, :region.seq] = True
        entry.auto_mask[:, region.seq:] = False
    entry.last = region


def _pad_rows(region: _Region) -> None:
    """Padding rows become copies of the last real row, every call: the caller may have changed it."""
    import cupy

    for pad, last in region.row_pads:
        cupy.copyto(pad, last)


def _launch(graph: Any) -> None:
    """One replay on the current stream. CuPy's Graph.launch() reads the current stream in C and calls
    cudaGraphLaunch on the executable graph (graph.graphExec): swap the mechanism here only if
    measurements show another (cuda.bindings' cudaGraphLaunch on the raw handle) cheaper."""
    graph.launch()


def _copy(dst: Any, src: Any) -> None:
    """src into dst (same shape and dtype): one memcpy when both are contiguous, on the current stream."""
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        dst.data.copy_from_device_async(src.data, src.nbytes)
    else:
        import cupy

        cupy.copyto(dst, src)


def _root(a: Any) -> Any:
    while a.base is not None:
        a = a.base
    return a


def _same_memory(a: Any, b: Any) -> bool:
    return a.data.ptr == b.data.ptr and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype


def _padded_shape(shape: tuple[int, ...], size: tuple[int, int | None] | None) -> tuple[int, ...]:
    if size is None:
        return shape
    rows, seq = size
    return (rows,) + shape[1:] if seq is None else (rows, seq) + shape[2:]


def _rows_of(buffers: list[Any]) -> int:
    return buffers[0].shape[0] if buffers and buffers[0].ndim else 0


def _array_names(args: tuple, kwargs: dict) -> list[str]:
    """The names of the array arguments, in _arrays order (for messages)."""
    return [f"#{i}" for i, a in enumerate(args) if is_cupy(a)] + [k for k in sorted(kwargs) if is_cupy(kwargs[k])]


def _arrays(args: tuple, kwargs: dict) -> list[Any]:
    """The array arguments, positional first, then keyword arguments by name."""
    return [a for a in args if is_cupy(a)] + [kwargs[k] for k in sorted(kwargs) if is_cupy(kwargs[k])]


def _substitute(args: tuple, kwargs: dict, statics: list[Any]) -> tuple[tuple, dict]:
    """args and kwargs with each array replaced by its static buffer (same order as _arrays)."""
    it = iter(statics)
    new_args = tuple(next(it) if is_cupy(a) else a for a in args)
    new_kwargs = {k: (next(it) if is_cupy(kwargs[k]) else kwargs[k]) for k in sorted(kwargs)}
    return new_args, new_kwargs
