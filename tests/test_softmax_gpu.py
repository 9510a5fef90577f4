"""softmax on the GPU: both GPU paths (custom: kernels/softmax.cu; cupy: CuPy arithmetic) against the
float64 reference over shapes that reach every kernel version (rows in a warp group, rows per block,
slices strided over inner positions), fp16/bf16/fp32/fp64, softmax and log-softmax, outputs poisoned;
NaN, +inf, all -inf and large values; strided inputs; grids smaller than the table's; offsets past
2**31; bound calls reading new arrays each call; empty arrays. Two host tests: the shapes reach every
kernel version, and the reference refuses, before allocating, what would not fit."""

import importlib
import math

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops.softmax import softmax
from conftest import random_normal, rel_error

softmax_module = importlib.import_module("libnn.ops.softmax")  # libnn.ops.softmax is also the function's name
gpu = pytest.mark.gpu

PATHS = ["custom", "cupy"]
DTYPES = ["fp16", "bf16", "fp32", "fp64"]
# (shape, dim): kernel versions in comments, for fp32 (the version depends on the shape only)
SHAPES = [
    ((1,), 0), ((31,), 0), ((33,), -1), ((1000,), 0), ((4097,), -1), ((70000,), 0),
    ((7, 1), -1), ((5, 31), 1), ((3, 32), -1), ((17, 33), -1),           # warp1 (L = 1, 32), warp2
    ((11, 100), 1), ((6, 200), -1), ((4, 500), -1), ((13, 1000), 1),     # warp4, 8, 16, 32
    ((2, 1024), -1),                                                      # warp32, the largest row
    ((3, 2000), -1), ((5, 3000), 1), ((3, 4097), -1), ((2, 70000), 1),   # block of 256, 512, 1024
    ((2, 2**20 + 3), -1),                                                 # block: a row of 2**20+
    ((129, 33), 0), ((1000, 3), 0), ((1, 13), 0), ((31, 7), 0),          # cols (dim 0)
    ((5, 33, 17), 1), ((3, 7, 31), 0), ((2, 3, 4097), -1), ((4, 4097, 3), 1),
    ((2, 70000, 2), 1), ((1, 2**20 + 3, 3), 1),                           # cols: n of 2**20+
    ((3, 5, 2, 4), 0), ((2, 3, 5, 7), 1), ((2, 10, 7, 7), 1),            # NCHW channels: cols
    ((2, 3, 4, 257), -1), ((1, 1, 1, 1), 1), ((2, 5, 3, 11), 2),
]


def shape_id(case):
    shape, dim = case
    return f"{'x'.join(map(str, shape))}-dim{dim}"


def reference(x, dim, log):
    """The float64 oracle of x as given (already rounded to its dtype)."""
    return softmax(np.asarray(x).astype(np.float64), dim, log=log, path="reference")


def problem_of(shape, dim, log=False, dtype="fp32"):
    return softmax_module.SoftmaxProblem(shape, dim % len(shape), log, dtype, "gpu:0")


# --- host tests -------------------------------------------------------------------------------------
def test_the_shapes_reach_every_kernel_version():
    launches = [softmax_module.custom_launch(problem_of(shape, dim)) for shape, dim in SHAPES]
    names = {name for name, _, _ in launches}
    assert names == {*(f"softmax_warp{v}" for v in (1, 2, 4, 8, 16, 32)), "softmax_block", "softmax_cols"}
    assert {block for name, _, block in launches if name == "softmax_block"} == {(256,), (512,), (1024,)}
    assert {block[1] for name, _, block in launches if name == "softmax_cols"} >= {1, 2, 4, 16}


@pytest.mark.parametrize("log", [False, True])
def test_reference_refuses_what_would_not_fit_before_allocating(log):
    x = np.broadcast_to(np.float32(1.5), (2**20, 2**20))  # a view: 4 TiB as float32, no memory behind it
    name = "log_softmax" if log else "softmax"
    with pytest.raises(MemoryError, match=rf"^{name}: x of shape \(1048576, 1048576\) in float64 \(a copy and 3 "
                                          r"temporaries of its size\) needs 32.0 TiB \(35184372088832 bytes\), "
                                          r"more than the .* of host RAM available$"):
        softmax(x, log=log)


# --- GPU paths against the reference ----------------------------------------------------------------
@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES, ids=shape_id)
def test_gpu_path_matches_reference(rng, case, dtype, path, log):
    """Relative L2 error within dtypes.TOLERANCE (fp16/bf16 1e-2, fp32 1e-5, fp64 1e-12); the
    poisoned output (NaN) makes an unwritten element fail (rel_error is inf on NaN)."""
    import cupy

    shape, dim = case
    x = random_normal(rng, shape, dtype, scale=3)
    y = softmax(cupy.asarray(x), dim, log=log, path=path)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, reference(x, dim, log)) <= dtypes.TOLERANCE[dtype]


LARGE = {"fp16": 3e4, "bf16": 1e4, "fp32": 1e4, "fp64": 1e300}  # fp16: x - max must stay below 65504


def special_rows(rng, n, dtype):
    """Eight slices of n: plain; one NaN; one +inf; all -inf; -inf at every third place (the first
    included); values up to ±LARGE (exp overflows without the max); -inf then a NaN last; a +inf
    among -inf."""
    rows = rng.standard_normal((8, n)) * 3
    rows[1, rng.integers(n)] = np.nan
    rows[2, rng.integers(n)] = np.inf
    rows[3] = -np.inf
    rows[4, ::3] = -np.inf
    rows[5] = rng.uniform(-LARGE[dtype], LARGE[dtype], n)
    rows[6] = -np.inf
    rows[6, -1] = np.nan
    rows[7, ::2] = -np.inf
    rows[7, rng.integers(n)] = np.inf
    return rows.astype(dtypes.parse(dtype))


def layouts(rows):
    """(x, dim) with the rows of `rows` as slices: along the last dim (row kernels), along dim 0 of the
    transpose (inner = 8), along dim 1 of (2, n, 4)."""
    n = rows.shape[1]
    return [(rows, -1), (np.ascontiguousarray(rows.T), 0),
            (np.ascontiguousarray(rows.reshape(2, 4, n).transpose(0, 2, 1)), 1)]


def assert_matches_with_specials(y, expected, tolerance):
    """NaN exactly where the reference has NaN, ±inf exactly where it has them (log-softmax of -inf),
    the finite values within `tolerance`."""
    got = y.get().astype(np.float64)
    nan, inf = np.isnan(expected), np.isinf(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[inf], expected[inf])
    finite = ~nan & ~inf
    assert rel_error(got[finite], expected[finite]) <= tolerance


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 33, 1000, 4097])
def test_nan_inf_and_large_values_follow_pytorch(rng, n, dtype, path, log):
    """PyTorch's semantics, which the float64 reference has: a NaN or a +inf makes its whole slice
    NaN, a slice all -inf is NaN, -inf elements of a finite slice give 0 (log: -inf), and values of
    ±1e4 (fp16 ±3e4, fp64 ±1e300) do not overflow. Each case as rows and as strided slices."""
    import cupy

    for x, dim in layouts(special_rows(rng, n, dtype)):
        y = softmax(cupy.asarray(x), dim, log=log, path=path)
        assert_matches_with_specials(y, reference(x, dim, log), dtypes.TOLERANCE[dtype])


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_a_strided_input_gives_the_contiguous_result(rng, path, dim):
    import cupy

    base = cupy.asarray(random_normal(rng, (6, 40, 50), "fp32", scale=3))
    x = base[:, ::2, 1:].transpose(2, 0, 1)  # (49, 6, 20), no dimension contiguous
    assert not x.flags.c_contiguous
    for log in (False, True):
        y = softmax(x, dim, log=log, path=path)
        assert y.shape == x.shape and y.flags.c_contiguous
        assert rel_error(y, reference(x.get(), dim, log)) <= dtypes.TOLERANCE["fp32"]


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [((300, 1), -1), ((300, 10), -1), ((300, 33), -1), ((90, 1000), -1),
                                  ((5, 3000), -1), ((7, 5, 40), 1), ((40, 9), 0)], ids=shape_id)
@pytest.mark.parametrize("grid", [(1,), (3,)])
def test_kernels_stride_over_rows_and_slices_on_a_small_grid(rng, dtype, case, grid):
    """The LAUNCH table caps grids at 65535 blocks and relies on each kernel's grid-stride loop over
    rows or slices: one or three blocks must give the same result as the table's grid."""
    import cupy

    shape, dim = case
    x = random_normal(rng, shape, dtype, scale=3)
    xg = cupy.asarray(x)
    for log in (False, True):
        problem = softmax_module.softmax_problem(xg, dim, log)
        y = softmax_module.bind_custom(problem, xg, grid)(xg)
        assert rel_error(y, reference(x, dim, log)) <= dtypes.TOLERANCE[dtype]


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("case", [((300001, 40), -1), ((2, 3, 1100001), 1)], ids=shape_id)
def test_grids_at_the_cap_stride_over_the_rest(rng, case):
    """More rows (warp groups) or 32-slice tiles than 65535 blocks take: the table's grid strides."""
    import cupy

    shape, dim = case
    problem = problem_of(shape, dim, dtype="fp16")
    assert softmax_module.custom_launch(problem)[1] == (65535,)
    x = random_normal(rng, shape, "fp16", scale=3)
    y = softmax(cupy.asarray(x), dim, path="custom")
    assert rel_error(y, reference(x, dim, False)) <= dtypes.TOLERANCE["fp16"]


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("case", [((2**21 + 5, 1024), -1), ((2**20 + 1, 2049), -1), ((17, 2, 2**26), 1)],
                         ids=shape_id)
def test_offsets_past_2_to_the_31_elements(rng, case):
    """Over 2**31 fp16 elements (4.3 GB and more) through each kernel version: offsets are 64-bit.
    Every element is written (the poisoned output has no NaN left); the last slices, whose offsets are
    past 2**31, match the reference (the whole would need tens of GB of host float64)."""
    import cupy

    from libnn.runtime import memory

    shape, dim = case
    size = math.prod(shape)
    if memory.gpu_available_bytes() < 3 * size * 2 + 2**30:
        pytest.skip(f"needs about {3 * size * 2 / 2**30:.0f} GiB of free GPU memory")
    x = cupy.empty(shape, cupy.float16)
    flat, generator, chunk = x.reshape(-1), cupy.random.default_rng(int(rng.integers(2**32))), 2**27
    for start in range(0, size, chunk):
        flat[start:start + chunk] = generator.standard_normal(min(chunk, size - start), cupy.float32) * 3
    y = softmax(x, dim, log=True, path="custom")
    assert not bool(cupy.isnan(y).any())
    if dim == -1:
        tail_x, tail_y, tail_dim = x[-3:].get(), y[-3:].get(), -1
    else:
        tail_x, tail_y, tail_dim = x[-1, :, -1000:].get(), y[-1, :, -1000:].get(), 0
    assert rel_error(tail_y, reference(tail_x, tail_dim, True)) <= dtypes.TOLERANCE["fp16"]


# --- bound calls and the front end ------------------------------------------------------------------
@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strided", [False, True])
def test_a_bound_call_reads_new_arrays_at_every_call(rng, path, strided):
    """The second call with the same signature reuses the bound call (nothing built) and computes
    from the new x into a new y; the same x again gives the same bits."""
    import cupy

    xs = [random_normal(rng, (6, 60), "fp32", scale=3) for _ in range(2)]
    gs = [cupy.asarray(x)[:, ::2] if strided else cupy.asarray(x) for x in xs]
    stats = libnn.get_op("softmax").calls.stats
    y1 = softmax(gs[0], path=path)
    builds = stats.builds
    y2 = softmax(gs[1], path=path)
    assert stats.builds == builds
    assert y2.data.ptr != y1.data.ptr
    for y, g in ((y1, gs[0]), (y2, gs[1])):
        assert rel_error(y, reference(g.get(), -1, False)) <= dtypes.TOLERANCE["fp32"]
    np.testing.assert_array_equal(softmax(gs[0], path=path).get(), y1.get())


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("case", [((0, 4), -1), ((0, 4), 0), ((3, 0), -1), ((3, 0), 0), ((2, 0, 3), 1)],
                         ids=shape_id)
def test_an_empty_array_gives_an_empty_result(path, case):
    import cupy

    shape, dim = case
    for log in (False, True):
        y = softmax(cupy.ones(shape, cupy.float32), dim, log=log, path=path)
        assert isinstance(y, cupy.ndarray) and y.shape == shape and y.dtype == cupy.float32


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_takes_the_kernel_for_every_gpu_dtype(rng, dtype):
    import cupy

    x = random_normal(rng, (4, 10), dtype, scale=3)
    y = softmax(cupy.asarray(x), 1, log=True)
    assert libnn.get_op("softmax").last_decision.path == "custom"
    assert rel_error(y, reference(x, 1, True)) <= dtypes.TOLERANCE[dtype]
