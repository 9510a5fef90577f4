"""The cuDNN backend's choice of plan on the CPU, with a stand-in graph and timer: the heuristics' first plan
that builds, or, with timing arrays, the fastest that builds (the heuristics' order breaking ties), left
selected so that it is what executes and what the disk cache stores."""

from __future__ import annotations

import sys
import types

import pytest

from libnn.backends import cudnn as backend


class NotSupported(Exception):
    pass


class StandInGraph:
    """Plans by index: `times` (ms) of those that build; building any other raises as cuDNN does."""

    def __init__(self, times: dict[int, float], count: int, fails_to_run: tuple[int, ...] = ()):
        self.times, self.count, self.fails_to_run, self.built = times, count, fails_to_run, []
        self.executed: list[tuple[dict, int]] = []

    def get_execution_plan_count(self) -> int:
        return self.count

    def build_plan_at_index(self, index: int) -> None:
        self.built.append(index)
        if index not in self.times:
            raise NotSupported(f"plan {index} does not build")

    def get_workspace_size_plan_at_index(self, index: int) -> int:
        return 256 * index

    def execute_plan_at_index(self, pack, workspace_ptr, index, handle) -> float:
        self.executed.append((pack, index))
        if index in self.fails_to_run:
            raise NotSupported(f"plan {index} failed to execute")
        return self.times[index]


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(cudnnGraphNotSupportedError=NotSupported))
    monkeypatch.setattr(backend, "cudnn_handle", lambda: "handle")
    monkeypatch.setattr(backend, "workspace", lambda nbytes: array(nbytes))
    monkeypatch.setattr(backend, "time_gpu", lambda fn, inputs, **kw: types.SimpleNamespace(median_ms=fn(None)))


def array(ptr: int):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr))


def test_the_fastest_plan_that_builds_is_kept_selected(stand_ins):
    graph = StandInGraph({0: 3.0, 2: 1.0, 3: 1.0, 4: 2.0}, count=5)
    assert backend._build_fastest_plan(graph, lambda: {7: array(70), 9: array(90)}) == 2
    assert graph.built == [0, 1, 2, 3, 4, 2]  # every plan tried, then the fastest built again: selected
    assert {index for _, index in graph.executed} == {0, 2, 3, 4}
    assert all(pack == {7: 70, 9: 90} for pack, _ in graph.executed)


def test_without_timing_the_heuristics_first_plan_that_builds_is_kept(stand_ins):
    graph = StandInGraph({2: 1.0, 3: 0.5}, count=4)
    assert backend._build_first_plan(graph) == 2
    assert graph.built == [0, 1, 2] and graph.executed == []


def test_no_plan_that_builds_raises_naming_each_plans_error(stand_ins):
    with pytest.raises(NotSupported, match=r"no plan could be built: \[0\] NotSupported: plan 0 does not build; "
                                           r"\[1\] NotSupported: plan 1 does not build"):
        backend._build_fastest_plan(StandInGraph({}, count=2), lambda: {})


def test_a_plan_that_builds_but_fails_to_run_is_passed_over(stand_ins):
    graph = StandInGraph({0: 2.0, 1: 0.5, 2: 1.0}, count=3, fails_to_run=(1,))
    assert backend._build_fastest_plan(graph, lambda: {}) == 2


def test_a_refusal_keeps_the_message_not_the_builds_frames(stand_ins, monkeypatch):
    """A declined graph is cached as a Refusal; its error is a new LibraryError without a traceback, so
    the arrays the build was timed on (held by its frames) are not kept alive by the cache."""
    import weakref

    class Held:
        pass

    held = Held()
    alive = weakref.ref(held)

    def declined(builder, description, key, use_disk_cache, timing_arrays):
        arrays = {1: held}  # a frame local, as _build_fastest_plan's are
        raise backend.LibraryError(f"cuDNN cannot run {description}: {len(arrays)} array")

    monkeypatch.setattr(backend, "_build", declined)
    monkeypatch.setattr(backend, "current_device_id", lambda: 0)
    monkeypatch.setattr(backend, "current_stream", lambda: types.SimpleNamespace(ptr=0))
    for _ in range(2):
        with pytest.raises(backend.LibraryError, match="cuDNN cannot run a test graph: 1 array"):
            backend.graph_for(("declined", id(held)), None, "a test graph", timing_arrays=lambda: {})
    del held
    assert alive() is None
