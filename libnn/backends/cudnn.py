"""cuDNN frontend graphs: build, cache (memory and disk), inspect and execute.

A graph is built once per key (everything that changes it: shapes, strides, dtypes, attributes,
device, stream) by a builder function that reads like the math (one node per line), then planned
with heuristics modes A and FALLBACK and the first plan that builds is kept. Built plans are also
serialized to the disk cache, keyed additionally by the GPU and the cuDNN versions, so that a second
process deserializes them instead of running the heuristics and NVRTC again.

Tensors are addressed by UID in the variant pack, so a cached graph holds no arrays.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from libnn.errors import LibraryError
from libnn.runtime.cache import PlanCache, cache_dir, write_atomically
from libnn.runtime.device import current_device_id
from libnn.runtime.handles import cudnn_handle, workspace
from libnn.runtime.stream import current_stream, stream_capturing
from libnn.runtime.timing import time_gpu

_graphs: PlanCache = PlanCache("cudnn graphs")

HEUR_MODES = ("A", "B", "FALLBACK")


def data_type(short_name: str):
    import cudnn

    return {"fp16": cudnn.data_type.HALF, "bf16": cudnn.data_type.BFLOAT16,
            "fp32": cudnn.data_type.FLOAT}[short_name]


def _first_line(exc: BaseException) -> str:
    """cuDNN's messages carry the whole backend log; the first line says what happened."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"


def _library_errors() -> tuple[type[BaseException], ...]:
    import cudnn

    return (cudnn.cudnnGraphNotSupportedError, ValueError, RuntimeError)


@dataclass
class Graph:
    """A planned cuDNN graph and what it took to get it."""
    graph: Any
    source: str                  # "built" or "disk cache"
    build_seconds: float
    plan_name: str
    workspace_bytes: int
    # where graph_for cached it: the graph runs on that stream's handle and workspace, looked up once
    handle: Any = None
    device_id: int = 0
    stream_ptr: int = 0

    def executor(self, uids: Sequence[int]) -> Callable[..., None]:
        """execute(*arrays), the arrays in the order of `uids`, at the frontend's cheapest entry point
        that this frontend version has (see `RawExecute`), else its generic `execute`."""
        space = workspace(self.workspace_bytes, self.device_id, self.stream_ptr)  # held: stays valid
        try:
            return RawExecute(self, uids, space)
        except (AttributeError, TypeError, *_library_errors()):  # a frontend without the raw-pointer entry
            graph, handle, space_ptr = self.graph, self.handle, space.data.ptr

            def execute(*arrays: Any) -> None:
                try:
                    graph.execute({uid: a.data.ptr for uid, a in zip(uids, arrays)}, space_ptr, handle=handle)
                except _library_errors() as exc:
                    raise LibraryError(f"cuDNN execute failed: {_first_line(exc)}") from exc
            return execute


class RawExecute:
    """A graph's execute at the frontend's raw-pointer entry point, the one its own `execute` ends in
    once it has turned the caller's dict into the backend's sorted pointer array: here that array is
    built once per bound call and only the pointers are written per call. `libnn bench overhead`
    ("floors") measures it against `execute` and `execute_plan_at_index`. It reaches private
    attributes of the frontend's pygraph (1.28: `_lowered_graph._execute_with_raw_ptrs`, the variant
    pack's sorted uids, the built plan's backend index); `Graph.executor` falls back to the public
    `execute` where they are missing."""

    def __init__(self, graph: Graph, uids: Sequence[int], space: Any):
        g = graph.graph
        lowered = g._lowered_graph
        lowered._prepare_variant_pack_template()
        order = list(lowered._get_variant_pack_uids_sorted())
        if sorted(order) != sorted(uids):
            raise TypeError(f"the graph's variant pack holds uids {order}, the call passes {list(uids)}")
        plan = g._materialize_backend_plan(g._plan_index) if g._plans else None
        self._plan_index = -1 if plan is None or plan.cpp_index is None else plan.cpp_index
        self._execute = lowered._execute_with_raw_ptrs
        self._slots = [order.index(uid) for uid in uids]   # argument i goes to slot _slots[i]
        self._pointers = np.zeros(len(order), np.int64)
        self._address, self._count = self._pointers.ctypes.data, len(order)
        self._space, self._space_ptr = space, space.data.ptr
        self._handle = graph.handle.backend_handle
        self._lock = threading.Lock()

    def __call__(self, *arrays: Any) -> None:
        pointers = self._pointers
        with self._lock:
            for slot, a in zip(self._slots, arrays):
                pointers[slot] = a.data.ptr
            try:
                self._execute(self._address, self._count, self._space_ptr, self._handle, self._plan_index)
            except _library_errors() as exc:
                raise LibraryError(f"cuDNN execute failed: {_first_line(exc)}") from exc


def versions() -> str:
    import cudnn

    return f"cudnn {cudnn.backend_version()} frontend {cudnn.__version__}"


def _builder_fingerprint(builder: Callable[[Any], Any]) -> str:
    """The builder's bytecode and constants (nested functions' included): a graph stored by an older
    builder of the same key (another node order, another GELU) is not deserialized in its place."""
    def text(code: Any) -> str:
        consts = [text(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
        return code.co_code.hex() + repr(code.co_names) + "".join(consts)
    code = getattr(builder, "__code__", None)
    return "" if code is None else hashlib.sha256(text(code).encode()).hexdigest()[:16]


def _disk_key(key: Any, builder: Callable[[Any], Any]) -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(current_device_id())
    text = repr((key, _builder_fingerprint(builder), props["name"], props["multiProcessorCount"], props["major"],
                 props["minor"], versions()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class HostScalar:
    """A float32 in host memory for a pass-by-value graph input (an epsilon, a constant of a composed
    activation): cuDNN reads the value through the pointer when the graph is launched, so it is made
    once per value (`host_scalar`) and kept. It looks like an array to `Graph.executor`, which takes
    `.data.ptr` of every buffer."""

    def __init__(self, value: float):
        self.array = np.array([value], np.float32)
        self.data = HostPointer(self.array.ctypes.data)


@dataclass(frozen=True)
class HostPointer:
    ptr: int


_host_scalars: PlanCache = PlanCache("cuDNN pass-by-value scalars")


def host_scalar(value: float) -> HostScalar:
    """The kept HostScalar holding `value`."""
    return _host_scalars.get(float(value), lambda: HostScalar(value))


def _heur_modes(names: tuple[str, ...]):
    import cudnn

    return [getattr(cudnn.heur_mode, n) for n in names]


def planned_graph(builder: Callable[[Any], Any], handle: Any, modes: tuple[str, ...]) -> Any:
    """The graph `builder` makes, validated and lowered, with the execution plans of the heuristics
    `modes` (not built yet)."""
    graph = builder(handle)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(_heur_modes(modes))
    return graph


def _build(builder: Callable[[Any], Any], description: str, key: Any, use_disk_cache: bool,
           timing_arrays: Callable[[], dict[int, Any]] | None) -> Graph:
    import cudnn

    handle = cudnn_handle()
    stored = cache_dir() / "cudnn" / f"{_disk_key((key, timing_arrays is not None), builder)}.plan"
    start = time.perf_counter()
    if use_disk_cache and stored.exists():
        graph = cudnn.pygraph(handle=handle)
        try:
            graph.deserialize(handle, list(stored.read_bytes()))
            return Graph(graph, "disk cache", time.perf_counter() - start, "deserialized",
                         graph.get_workspace_size())
        except _library_errors():
            stored.unlink(missing_ok=True)  # a stale or foreign plan: rebuild below
    try:
        graph = planned_graph(builder, handle, ("A", "FALLBACK"))
        graph.check_support()
        # nothing can be timed while the stream captures a CUDA graph: the heuristics' first, kept off the disk
        timed = timing_arrays is not None and not stream_capturing()
        index = _build_fastest_plan(graph, timing_arrays) if timed else _build_first_plan(graph)
    except _library_errors() as exc:
        raise LibraryError(f"cuDNN cannot run {description}: {_first_line(exc)}") from exc
    built = Graph(graph, "built", time.perf_counter() - start, graph.get_plan_name_at_index(index),
                  graph.get_workspace_size())
    if use_disk_cache and (timed or timing_arrays is None):
        write_atomically(stored, bytes(graph.serialize()))  # processes sharing the cache may write it at once
    return built


def _build_first_plan(graph: Any) -> int:
    """Build the heuristics' plans in rank order until one builds (what the HEURISTICS_CHOICE
    policy does), and return its index, so that the plan libnn runs can be named."""
    import cudnn

    errors = []
    for index in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(index)
            return index
        except (*_library_errors(), NotImplementedError) as exc:
            errors.append(f"[{index}] {_first_line(exc)}")
    raise cudnn.cudnnGraphNotSupportedError("no plan could be built: " + "; ".join(errors))


def _build_fastest_plan(graph: Any, timing_arrays: Callable[[], dict[int, Any]]) -> int:
    """Build every plan of the heuristics that builds, time each once (GPU time, median of 10) on the
    arrays `timing_arrays()` gives by uid, select the fastest (the heuristics' order breaks ties) and
    return its index; where no plan builds, raise as _build_first_plan does."""
    arrays = timing_arrays()  # held until every plan has run: a new o freed early could become a workspace
    handle, pack = cudnn_handle(), {uid: a.data.ptr for uid, a in arrays.items()}
    times = {}
    for index in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(index)
            times[index] = _time_plan(graph, index, pack, handle)
        except (*_library_errors(), NotImplementedError):  # a plan that does not build or run: the others may
            continue
    del arrays
    if not times:
        return _build_first_plan(graph)  # raises, naming each plan's error
    fastest = min(times, key=times.get)
    graph.build_plan_at_index(fastest)  # selected: what executes and serializes
    return fastest


def _time_plan(graph: Any, index: int, pack: dict[int, int], handle: Any) -> float:
    """The built plan `index`'s GPU time (ms, median of 10 after 2) on the pointers of `pack` (by uid),
    with a workspace of the size it asks for."""
    space = workspace(graph.get_workspace_size_plan_at_index(index)).data.ptr
    return time_gpu(lambda _: graph.execute_plan_at_index(pack, space, index=index, handle=handle), [None],
                    warmup=2, runs=10).median_ms


@dataclass
class Refusal:
    """cuDNN declined this graph; kept in the cache so that the next call fails fast."""
    error: LibraryError


def graph_for(key: Any, builder: Callable[[Any], Any], description: str | Callable[[], str],
              use_disk_cache: bool = True, timing_arrays: Callable[[], dict[int, Any]] | None = None) -> Graph:
    """The planned graph for `key` on the current device and stream, built by `builder(handle)`.
    A graph cuDNN declines raises LibraryError, now and on every later call with the same key.
    `description` (or a function returning it, so that a cached call formats nothing) names the
    problem in error messages. With `timing_arrays` (a function giving arrays to run the graph on, by
    uid) the plan kept is the fastest that builds, timed once, not the heuristics' first (see
    _build_fastest_plan); the disk cache stores that choice. Nothing can be timed while the stream
    captures a CUDA graph: a graph first built then takes the heuristics' first plan, kept in memory for
    that stream but not stored on disk."""
    device_id, stream_ptr = current_device_id(), current_stream().ptr

    def build():
        try:
            built = _build(builder, description() if callable(description) else description, key, use_disk_cache,
                           timing_arrays)
        except LibraryError as exc:
            return Refusal(LibraryError(str(exc)))  # not exc: its traceback holds the build's frames and arrays
        built.handle, built.device_id, built.stream_ptr = cudnn_handle(), device_id, stream_ptr
        return built

    found = _graphs.get((key, timing_arrays is not None, device_id, stream_ptr), build)
    if isinstance(found, Refusal):
        raise LibraryError(str(found.error))
    return found


@dataclass
class PlanInfo:
    mode: str
    index: int
    name: str
    engine_id: int | None
    knobs: dict[str, int]
    behavior_notes: list[str]
    workspace_bytes: int | None
    built: bool
    error: str | None = None
    time_ms: float | None = None


def enumerate_plans(builder: Callable[[Any], Any], buffers: dict[int, Any] | None,
                    modes: tuple[str, ...] = HEUR_MODES, time_plans: bool = False,
                    on_plan: Callable[[PlanInfo], None] | None = None) -> list[PlanInfo]:
    """Every plan each heuristics mode offers for the graph, built one by one; with `time_plans`,
    each one's median time on `buffers`."""
    handle = cudnn_handle()
    found = []
    for mode in modes:
        try:
            graph = planned_graph(builder, handle, (mode,))
        except _library_errors() as exc:
            found.append(PlanInfo(mode, -1, "-", None, {}, [], None, False, _first_line(exc)))
            continue
        for i in range(graph.get_execution_plan_count()):
            engine_id, knobs = graph.get_engine_and_knobs_at_index(i)
            info = PlanInfo(mode, i, graph.get_plan_name_at_index(i), engine_id,
                            {str(getattr(k, "name", k)).split(".")[-1]: int(v) for k, v in knobs.items()},
                            [str(getattr(n, "name", n)).split(".")[-1] for n in graph.get_behavior_notes_for_plan_at_index(i)],
                            None, False)
            try:
                graph.build_plan_at_index(i)
                info.built = True
                info.workspace_bytes = graph.get_workspace_size_plan_at_index(i)
            except (*_library_errors(), NotImplementedError) as exc:
                info.error = _first_line(exc)[:120]
            if info.built and time_plans and buffers is not None:
                info.time_ms = _time_plan(graph, i, {uid: a.data.ptr for uid, a in buffers.items()}, handle)
            found.append(info)
            if on_plan:
                on_plan(info)
    return found
