"""The path registry's policy: auto order, supports(), visible fallback, forced-path errors."""

import warnings
from dataclasses import dataclass

import pytest

from libnn.errors import FallbackWarning, LibraryError, NoPathError, PathUnavailableError
from libnn.registry import Op


@dataclass(frozen=True)
class Problem:
    dtype: str
    device: str = "cpu"

    def describe(self):
        return f"toy {self.dtype}"


def make_op(fail_fast: bool = False) -> Op:
    op = Op("toy-op", order=("fast", "slow", "gpu-only"))

    @op.path("fast", kind="library", device="cpu", supports=lambda p: None if p.dtype == "fp16" else "fp16 only")
    def fast(problem, value):
        if fail_fast:
            raise LibraryError("LIBRARY SAYS: no engine supports this graph")
        return ("fast", value)

    @op.path("slow", kind="reference", device="cpu")
    def slow(problem, value):
        return ("slow", value)

    @op.path("gpu-only", kind="custom", device="gpu")
    def gpu_only(problem, value):
        raise AssertionError("never runs on host arrays")

    return op


def test_auto_takes_the_first_supported_path_in_order():
    op = make_op()
    assert op.dispatch(Problem("fp16"), "auto", 1) == ("fast", 1)
    assert op.dispatch(Problem("fp32"), "auto", 1) == ("slow", 1)
    assert op.last_decision.passed_over["fast"] == "fp16 only"


def test_library_failure_falls_back_visibly_with_the_library_message():
    op = make_op(fail_fast=True)
    with pytest.warns(FallbackWarning, match="path 'fast' failed.*no engine supports this graph"):
        assert op.dispatch(Problem("fp16"), "auto", 2) == ("slow", 2)
    assert "no engine supports" in op.last_decision.passed_over["fast"]


def test_forced_path_surfaces_the_library_error_without_fallback():
    op = make_op(fail_fast=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(LibraryError, match="no engine supports this graph"):
            op.dispatch(Problem("fp16"), "fast", 3)


def test_forcing_an_unsupported_problem_names_the_reason():
    with pytest.raises(PathUnavailableError, match="path 'fast' cannot run toy fp32: fp16 only"):
        make_op().dispatch(Problem("fp32"), "fast", 0)


def test_no_path_error_lists_every_reason():
    op = Op("toy-op-2", order=("only",))
    op.path("only", kind="library", device="cpu", supports=lambda p: "never")(lambda p, v: v)
    with pytest.raises(NoPathError, match="only: never"):
        op.dispatch(Problem("fp32"), "auto", 0)


def test_gpu_path_is_passed_over_for_host_arrays():
    op = make_op()
    op.dispatch(Problem("fp32"), "auto", 0)
    assert op.last_decision.passed_over["gpu-only"] == "runs on the GPU, the arrays are on the CPU"
    with pytest.raises(TypeError, match="runs on the GPU, but the arrays are host"):
        op.dispatch(Problem("fp32"), "gpu-only", 0)


def test_a_path_slower_for_a_problem_is_tried_after_the_others():
    op = Op("toy-deferring-op", order=("fast", "other"))

    @op.path("fast", kind="custom", device="cpu", slower=lambda p: "long rows: measured slower" if p.dtype == "long" else None)
    def fast(problem, value):
        return "fast"

    @op.path("other", kind="library", device="cpu")
    def other(problem, value):
        return "other"

    assert op.dispatch(Problem("short"), "auto", 1) == "fast"
    assert op.dispatch(Problem("long"), "auto", 1) == "other"
    assert op.last_decision.passed_over == {"fast": "tried last: long rows: measured slower"}
    assert op.dispatch(Problem("long"), "fast", 1) == "fast"  # a forced path is never deferred


def test_auto_follows_the_declared_order_not_the_registration_order():
    op = Op("toy-ordered-op", order=("first", "second"))
    op.path("second", kind="reference", device="cpu")(lambda problem, value: "second")
    op.path("first", kind="library", device="cpu")(lambda problem, value: "first")
    assert op.dispatch(Problem("fp32"), "auto", 0) == "first"
    assert [p.name for p in op.ordered()] == ["first", "second"]


def test_a_path_outside_the_declared_order_is_refused():
    op = Op("toy-strict-op", order=("only",))
    with pytest.raises(ValueError, match="path 'other' is not in the op's declared order"):
        op.path("other", kind="library", device="cpu")


def test_a_bound_call_fallback_is_kept_and_warned_once():
    op = make_op(fail_fast=True)
    with pytest.warns(FallbackWarning):
        assert op.call("key", lambda: Problem("fp16"), "auto", 1) == ("slow", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert op.call("key", lambda: Problem("fp16"), "auto", 2) == ("slow", 2)
    assert op.last_decision.path == "slow" and "no engine" in op.last_decision.passed_over["fast"]


def test_a_binding_path_binds_once_per_signature_and_reads_its_arguments_at_each_call():
    op = Op("toy-binding-op", order=("bound",))
    binds = []

    @op.path("bound", kind="library", device="cpu", binds=True)
    def bound(problem, value):
        binds.append(value)
        return lambda value: ("ran", problem.dtype, value)

    assert op.call(("sig", 1), lambda: Problem("fp16"), "auto", 10) == ("ran", "fp16", 10)
    assert op.call(("sig", 1), lambda: pytest.fail("a bound signature is not checked again"), "auto", 11) \
        == ("ran", "fp16", 11)
    assert binds == [10] and op.calls.stats.builds == 1


def test_an_unhashable_option_runs_unbound_after_the_checks():
    op = make_op()
    assert op.call(("sig", [1]), lambda: Problem("fp16"), "auto", 1) == ("fast", 1)
    assert len(op.calls) == 0


def test_running_out_of_memory_inside_a_path_names_the_op_and_keeps_libnn_s_own_refusals():
    """CuPy's OutOfMemoryError and NumPy's are MemoryError subclasses that name neither the op nor the
    call: the front end names the op; a MemoryError libnn raised itself (which names them) passes as it is."""
    class LibraryOutOfMemory(MemoryError):
        pass

    op = Op("toy-memory-op", order=("only",))
    raised = {}

    @op.path("only", kind="reference", device="cpu")
    def only(problem, value):
        raise raised["error"]

    raised["error"] = LibraryOutOfMemory("Out of memory allocating 1,024 bytes")
    with pytest.raises(MemoryError, match=r"^toy-memory-op: out of memory: Out of memory allocating 1,024 bytes") as caught:
        op.call(("sig",), lambda: Problem("fp16"), "auto", 1)
    assert isinstance(caught.value.__cause__, LibraryOutOfMemory)
    raised["error"] = MemoryError("toy: x needs 2 GiB, more than the 1 GiB of host RAM available")
    with pytest.raises(MemoryError, match=r"^toy: x needs 2 GiB"):
        op.call(("sig",), lambda: Problem("fp16"), "auto", 1)


@pytest.mark.parametrize("path", [["auto"], None, 3, ("custom",)])
def test_a_path_that_is_not_a_string_names_the_op_and_the_paths(path):
    """A list used to fail deep in the bound-call cache as 'unhashable type: list'."""
    with pytest.raises(TypeError, match=r"^toy-op: path must be a string, 'auto' or one of \['fast', 'slow', 'gpu-only'\]; got"):
        make_op().call(("sig", 1), lambda: Problem("fp16"), path, 1)
