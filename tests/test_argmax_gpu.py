"""argmax on the GPU: the custom path (kernels/argmax.cu) and the cupy path against NumPy's argmax, exactly
(there is no arithmetic to be off by a rounding), on odd shapes (N = 1, 7, primes, 32000 and GPT-2's 50257
vocabularies, M = 1, 3, 64 and a 3-D batch), fp16, bf16 and fp32, outputs poisoned (an unwritten index reads
-1); ties (every index of a constant row), NaN (the first one wins, before any number), infinities; row
slices and misaligned views read in place, transposed views copied; many rows over a small grid; a bound call
reading new arrays at every call; and the greedy sampler taking it."""

import numpy as np
import pytest

from libnn import dtypes
from libnn.ops import argmax
from conftest import random_normal

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_gpu_memory")]

DTYPES = ["fp16", "bf16", "fp32"]
SHAPES = [(1, 1), (3, 7), (5, 131), (1, 32000), (64, 32000), (2, 3, 1000), (1, 50257), (4, 8193)]
PATHS = ["custom", "cupy"]


def expected(x) -> np.ndarray:
    return argmax(np.asarray(x), path="reference")


def check(got, x) -> None:
    import cupy

    assert got.dtype == np.int64 and got.shape == x.shape[:-1]
    np.testing.assert_array_equal(cupy.asnumpy(got), expected(cupy.asnumpy(x) if hasattr(x, "get") else x))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_argmax_matches_numpy(rng, shape, dtype, path):
    import cupy

    x = random_normal(rng, shape, dtype, 3.0)
    check(argmax(cupy.asarray(x), path=path), x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nan_and_infinities(dtype, path):
    """A constant row gives 0 (the first of equals); a repeated maximum its first index; the first NaN
    wins over +inf and over a later NaN; a row of -inf gives 0; +inf beats every finite value."""
    import cupy

    n = 1001   # 125 whole vectors of fp16 (250 of fp32) and element 1000 in the kernel's tail
    rows = np.full((7, n), 1.5)
    rows[1, [17, 400, 999]] = 9.0                 # a maximum three times: 17
    rows[2, [5, 600]] = np.nan                    # two NaNs: 5
    rows[2, 3] = np.inf                           # ... ahead of an earlier +inf
    rows[3] = -np.inf                             # all -inf: 0
    rows[4, 998] = np.inf                         # +inf: 998
    rows[5, 1000] = np.nan                        # the last element NaN: 1000 (the kernel's tail)
    rows[6, 0] = np.nan                           # the first element NaN: 0
    x = rows.astype(dtypes.parse(dtype))
    got = argmax(cupy.asarray(x), path=path).get()
    assert got.tolist() == [0, 17, 5, 0, 998, 1000, 0]
    check(argmax(cupy.asarray(x), path=path), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_slices_and_misaligned_views_are_read_in_place_or_copied(rng, dtype):
    """Rows one stride apart (a slice of wider logits, a view starting one element in: every row misaligned
    for 16-byte loads) go to the kernel as they lie; a transposed view is copied first. Each element of the
    view's head, middle and tail takes the maximum in turn."""
    import cupy

    wide = cupy.asarray(random_normal(rng, (6, 1030), dtype))
    for view in (wide[:, :1000], wide[:, 1:1001], wide[1:5, 3:], wide.T[:40]):
        check(argmax(view, path="custom"), view.get())
    for n in (0, 1, 7, 8, 9, 500, 991, 998, 999):   # the winner in each part of a misaligned row
        x = wide[:, 1:1001].copy()
        x[:, n] = 100
        check(argmax(x[:, :], path="custom"), x.get())
        view = wide[:, 1:1001]
        saved = view[:, n].copy()
        view[:, n] = 100
        check(argmax(view, path="custom"), view.get())
        view[:, n] = saved


def test_many_rows_over_a_strided_grid(rng):
    """More rows than a grid's 65535 blocks: each block takes several rows in turn."""
    import cupy

    x = random_normal(rng, (70000, 33), "fp16")
    check(argmax(cupy.asarray(x), path="custom"), x)


def test_a_bound_call_reads_new_arrays_each_time(rng):
    import cupy

    for _ in range(3):
        x = random_normal(rng, (8, 32000), "bf16")
        check(argmax(cupy.asarray(x)), x)


def test_auto_runs_the_custom_kernel_and_a_1d_row_gives_a_0d_index(rng):
    import cupy

    from libnn.registry import get_op

    x = random_normal(rng, (257,), "fp16")
    got = argmax(cupy.asarray(x))
    assert get_op("argmax").last_decision.path == "custom"
    assert got.shape == () and int(got) == int(np.argmax(x))


def test_the_greedy_sampler_takes_the_first_maximum_of_its_logits(rng):
    """generate's greedy step (Sampler at temperature 0) is argmax over fp16 and bf16 logits as they come."""
    import cupy

    from libnn.models.decoder import Sampler

    for dtype in ("fp16", "bf16"):
        logits = random_normal(rng, (4, 32000), dtype)
        tokens = Sampler("test", 0.0, None, None, None, 32000)(cupy.asarray(logits))
        np.testing.assert_array_equal(tokens.get(), np.argmax(logits.astype(np.float32), axis=-1))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_of_many_nans_in_long_rows(rng, dtype, path):
    """Rows of 50257 values with NaNs far apart (each block of a split reduction may meet one): the first."""
    import cupy

    x = random_normal(rng, (3, 50257), dtype).astype(np.float64)
    x[0, [300, 20000, 40000]] = np.nan
    x[1, [50256, 7]] = np.nan
    x[2, rng.random(50257) < 0.01] = np.nan
    x = x.astype(dtypes.parse(dtype))
    got = argmax(cupy.asarray(x), path=path).get()
    assert got[:2].tolist() == [300, 7]
    check(argmax(cupy.asarray(x), path=path), x)


def test_a_row_of_the_longest_length_finds_its_maximum_in_the_tail():
    """A row of 2^31 - 1 fp16 values (4 GiB): the last 7 lie past the last whole vector, in the kernel's tail,
    where an index computed as tail + thread would pass int's range; the maximum at the last element."""
    import cupy

    from libnn.ops.argmax import INT32_MAX

    x = cupy.full((INT32_MAX,), 0.5, cupy.float16)
    x[-1] = 2.0
    x[INT32_MAX // 2] = 1.0
    assert int(argmax(x, path="custom")) == INT32_MAX - 1
    x[-1] = 0.25
    assert int(argmax(x, path="custom")) == INT32_MAX // 2
    del x
    cupy.get_default_memory_pool().free_all_blocks()
