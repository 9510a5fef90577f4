"""Property tests: every op × every GPU path against the float64 reference path, on problems
hypothesis draws (tests/property_cases.py: shapes with 1, primes and non-multiples of 8, fp16, bf16
and fp32, strided, offset and padded-row inputs, masks and options, and the tolerances).

The GPU paths are read from the registry when the tests are collected, so a path registered later
(softmax's, say) is covered with no change here. Each op and path runs LIBNN_HYPOTHESIS_EXAMPLES
supported examples (default 200), split over SHARDS tests with seeds of their own. Hypothesis is
derandomized: every run draws the same shapes and options, and the values come from the run's base
seed (LIBNN_TEST_SEED, or --random-seed) and each example's own seed, so a failure reproduces by running the test again; hypothesis prints the
failing Spec.

A problem a path does not take (PathUnavailableError: dtype, head dim, alignment...) or a library
path declines (LibraryError: cuDNN has no engine for a graph; `auto` falls back, which other tests
check) is rejected, not counted; `pytest --hypothesis-show-statistics` lists the rejections and their
reasons, and hypothesis fails a test none of whose examples ran. GPU memory is poisoned (NaN) so
that an output element never written shows.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, note, seed, settings
from hypothesis import strategies as st

from conftest import BASE_SEED, rel_error
from libnn.errors import LibraryError, PathUnavailableError
from libnn.registry import get_op
from property_cases import APPROXIMATE_ACTIVATION_ABS_ERROR, STRATEGIES, build, on_device, strategy_for

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("LIBNN_HYPOTHESIS_EXAMPLES", "200"))
_QUIET = [getattr(HealthCheck, name) for name in ("too_slow", "filter_too_much", "data_too_large",
                                                  "function_scoped_fixture", "large_base_example")
          if hasattr(HealthCheck, name)]
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=_QUIET)


def gpu_paths(op: str) -> list[str]:
    """The op's GPU paths in its `auto` order, as registered now."""
    return [p.name for p in get_op(op).ordered() if p.device == "gpu"]


CASES = [(op, path) for op in STRATEGIES for path in gpu_paths(op)]


@pytest.fixture(scope="module")
def base_seed(request) -> int:
    return request.config.stash[BASE_SEED]


@pytest.fixture
def path_available(request):
    op, path = request.node.callspec.params["op"], request.node.callspec.params["path"]
    if reason := get_op(op).paths[path].missing():
        pytest.skip(f"{op} path {path!r} cannot run here: {reason}")


def run_gpu(case, path: str):
    """The path's output, or a rejected example where the path does not take the problem."""
    try:
        return case.call(on_device(case), path)
    except PathUnavailableError as exc:
        event(f"rejected: {path} does not support it ({str(exc).rsplit(': ', 1)[-1][:90]})")
    except LibraryError as exc:
        if get_op(case.op).paths[path].kind != "library":
            raise
        event(f"rejected: the library declined ({str(exc)[:90]})")
    assume(False)


def check_close(case, path: str, got, expected) -> None:
    """`got` (device) against the reference's `expected`, within the case's tolerance (see
    property_cases for the tolerances and the two exceptions to the relative error)."""
    import cupy

    got = cupy.asnumpy(got)
    assert got.shape == expected.shape, f"shape {got.shape}, reference {expected.shape}"
    assert got.dtype == expected.dtype, f"dtype {got.dtype}, reference {expected.dtype}"
    if case.exact:
        same = np.array_equal(got.astype(np.float64), expected.astype(np.float64))
        assert same, f"not exact: max difference {np.abs(got.astype(np.float64) - expected).max():.3e}"
        return
    tolerance = case.tolerance_for(path)
    error = rel_error(got, expected)
    if error <= tolerance:
        return
    found = [f"relative L2 error {error:.3e} > {tolerance:.1e}"]
    difference = np.linalg.norm(got.astype(np.float64) - expected.astype(np.float64))
    if case.magnitude is not None and np.isfinite(difference):
        scale = np.linalg.norm(np.asarray(case.magnitude(case.arrays), np.float64))
        conditioned = difference / max(scale, 1e-300)
        if conditioned <= tolerance:
            return
        found.append(f"error relative to the summed terms {conditioned:.3e}")
    if case.approximate_activation and case.dtype == "fp32" and np.isfinite(difference):
        worst = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max())
        if worst <= APPROXIMATE_ACTIVATION_ABS_ERROR:
            return
        found.append(f"max abs error {worst:.3e} > {APPROXIMATE_ACTIVATION_ABS_ERROR:.0e}")
    pytest.fail(f"{case.op} path {path!r}: " + "; ".join(found))


def check_one_example(op: str, path: str, base_seed: int, data) -> None:
    spec = data.draw(strategy_for(op, path), label="spec")
    case = build(spec, base_seed)
    note(f"LIBNN_TEST_SEED={base_seed}")
    got = run_gpu(case, path)
    event(f"{case.dtype}")
    check_close(case, path, got, case.call(case.arrays, "reference"))


def sharded(shard: int):
    """The property test of shard `shard`: EXAMPLES / SHARDS examples per op and path, drawn from the
    shard's own hypothesis seed (derandomized draws come from the test function, one sequence for every
    shard otherwise)."""
    @pytest.mark.usefixtures("path_available", "poisoned_gpu_memory")
    @pytest.mark.parametrize("op, path", CASES, ids=[f"{op}-{path}" for op, path in CASES])
    @seed(shard)
    @settings(SETTINGS, max_examples=-(-EXAMPLES // SHARDS))
    @given(data=st.data())
    def test(op, path, base_seed, data):
        check_one_example(op, path, base_seed, data)
    return test


# An op and path's examples are split over SHARDS tests, so that pytest-xdist runs them at once: as one
# test, cuDNN's paths (a graph built per drawn shape) took up to a minute each and ended the GPU suite.
SHARDS = 4
test_gpu_path_matches_reference_shard0 = sharded(0)
test_gpu_path_matches_reference_shard1 = sharded(1)
test_gpu_path_matches_reference_shard2 = sharded(2)
test_gpu_path_matches_reference_shard3 = sharded(3)
