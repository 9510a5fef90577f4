"""swiglu on the CPU: the reference against an element-by-element float64 oracle (math.exp, no NumPy
arithmetic), its rounding, the extremes (very negative gates, infinities, NaN), empty inputs, strided
inputs, the errors bad input gets, bound calls, and the custom path's choices without a GPU: which
layouts it reads in place (row_stride), when the 16-byte version may run, and the launch geometry of
kernels/swiglu.cu's LAUNCH table, whose kernels are compiled to PTX by NVRTC and checked against the
declared parameters."""

import importlib
import math
import re

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops import swiglu
from conftest import random_normal, rel_error

sw = importlib.import_module("libnn.ops.swiglu")  # the module: libnn.ops.swiglu is the function

DTYPES = ["fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else [])


def oracle(x):
    """silu(gate) * up element by element with math.exp, in float64 (Python floats)."""
    rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    F = rows.shape[1] // 2
    out = np.empty((rows.shape[0], F))
    for r, row in enumerate(rows):
        for f in range(F):
            g, u = float(row[f]), float(row[F + f])
            out[r, f] = (g / (1.0 + math.exp(-g)) if g > -700 else -0.0) * u
    return out.reshape(*x.shape[:-1], F)


@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (2, 5, 22), (4, 256), (6,), (1, 1, 2)], ids=str)
def test_reference_is_silu_of_the_first_half_times_the_second(rng, shape):
    x = random_normal(rng, shape, "fp64", 3.0)
    y = swiglu(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == x.dtype
    assert rel_error(y, oracle(x)) <= 1e-14
    assert libnn.get_op("swiglu").last_decision.path == "reference"


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rounds_once_to_the_input_dtype(rng, dtype):
    x = random_normal(rng, (5, 2 * 33), dtype, 4.0)
    y = swiglu(x)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.astype(np.float64), swiglu(x.astype(np.float64)).astype(x.dtype).astype(np.float64))


def test_the_halves_are_gate_then_up():
    """Gate first: silu(0) = 0 kills the output whatever up is, and up = 0 likewise."""
    x = np.array([[0.0, 2.0, 5.0, 0.0]])  # gate (0, 2), up (5, 0)
    np.testing.assert_array_equal(swiglu(x), [[0.0, 0.0]])
    x = np.array([[1.0, 3.0]])  # gate 1, up 3: silu(1) * 3
    np.testing.assert_allclose(swiglu(x), [[3.0 / (1.0 + math.exp(-1.0))]], rtol=1e-15)


def test_extremes_follow_pytorch():
    """Gates far below 0 give -0 (exp(-gate) overflows to inf without a warning), far above 0 give the
    gate; an infinite gate: silu(+inf) = inf, silu(-inf) = -inf / inf = NaN (as PyTorch's x *
    sigmoid(x)); NaN anywhere stays NaN in its own output only."""
    gate = np.array([-1000.0, -80.0, 80.0, np.inf, -np.inf, np.nan, 1.0])
    up = np.array([2.0, 1.0, 0.5, 1.0, 1.0, 1.0, np.nan])
    with np.errstate(all="raise"):  # no floating-point warning escapes the reference
        y = swiglu(np.concatenate([gate, up])[None])[0]
    assert y[0] == 0.0 and np.signbit(y[0])
    assert -1e-30 < y[1] <= 0.0 and y[2] == 40.0 and y[3] == np.inf
    assert np.isnan(y[4]) and np.isnan(y[5]) and np.isnan(y[6])


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0), (0,)], ids=str)
def test_empty_input_gives_an_empty_output(shape):
    y = swiglu(np.ones(shape, np.float32))
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == np.float32


def test_strided_inputs_are_read_by_value(rng):
    x = random_normal(rng, (6, 40), "fp64")
    for view in (x[:, :20], x[::2, 10:30], x.T.copy().T, np.asfortranarray(x), x[:, ::2]):
        assert rel_error(swiglu(view), oracle(np.ascontiguousarray(view))) <= 1e-14


def test_a_bound_call_reads_new_data(rng):
    calls = libnn.get_op("swiglu").calls
    calls.clear()
    builds = calls.stats.builds
    a, b = random_normal(rng, (3, 16), "fp64"), random_normal(rng, (3, 16), "fp64")
    ya, yb = swiglu(a), swiglu(b)
    assert calls.stats.builds == builds + 1  # one signature
    assert rel_error(ya, oracle(a)) <= 1e-14 and rel_error(yb, oracle(b)) <= 1e-14
    swiglu(a[:, :8])  # another shape: another bound call
    assert calls.stats.builds == builds + 2


@pytest.mark.parametrize("x, error, message", [
    (np.ones((3, 7)), ValueError, r"x's last dimension must be even, gate and up halves of 2F \(one gate_up GEMM's "
                                  r"output\), got 7 \(x of shape \(3, 7\)\)"),
    (np.ones(5), ValueError, r"x's last dimension must be even.*got 5"),
    (np.float64(3.0), ValueError, r"x must have at least 1 dimension \(\.\.\., 2F\), got a 0-d array"),
    (np.ones((3, 8), np.int32), TypeError, r"x must be a floating-point array \(fp16, bf16, fp32, fp64\), got int32"),
    (np.ones((3, 8), np.complex64), TypeError, r"x must be a floating-point array .* got complex64"),
    (np.ones((3, 8), bool), TypeError, r"x must be a floating-point array .* got bool"),
    ([[1.0, 2.0]], TypeError, r"x must be an array \(numpy.ndarray, cupy.ndarray, or anything with DLPack"),
])
def test_bad_input_gets_a_clear_error(x, error, message):
    with pytest.raises(error, match="^swiglu: " + message):
        swiglu(x)


def test_paths_are_refused_by_name():
    x = np.ones((2, 8))
    with pytest.raises(TypeError, match=r"^swiglu: path 'custom' runs on the GPU, but the arrays are host "
                                        r"\(NumPy\) arrays; move them with cupy.asarray"):
        swiglu(x, path="custom")
    with pytest.raises(ValueError, match=r"^swiglu: unknown path 'cudnn'; expected 'auto' or one of "
                                         r"\['custom', 'reference'\]"):
        swiglu(x, path="cudnn")
    with pytest.raises(TypeError, match=r"swiglu\(\) takes 1 positional argument"):
        swiglu(x, "reference")  # path is keyword-only


def test_auto_tries_custom_then_reference():
    assert libnn.get_op("swiglu").order == ("custom", "reference")
    assert list(libnn.get_op("swiglu").paths) == ["custom", "reference"]


def test_reference_refuses_what_would_not_fit_before_allocating():
    x = np.broadcast_to(np.float32(1.5), (2**20, 2**20, 2**10))  # a view: 4 PiB as float32
    with pytest.raises(MemoryError, match=r"^swiglu: x of shape \(1048576, 1048576, 1024\) in float64 \(4 arrays "
                                          r"of the output's size\) needs"):
        swiglu(x)


def test_problem_describes_itself_and_counts_its_bytes():
    p = sw.swiglu_problem(np.ones((2, 3, 22), np.float16))
    assert (p.M, p.F, p.out_shape, p.dtype, p.device) == (6, 11, (2, 3, 11), "fp16", "cpu")
    assert p.describe() == "swiglu M=6 F=11 fp16"
    assert p.output_bytes == 6 * 11 * 2 and p.bytes_moved == 3 * 6 * 11 * 2


# --- the custom path, without a GPU ---------------------------------------------------------------------
def test_row_stride_reads_row_slices_in_place_and_copies_the_rest():
    x = np.zeros((4, 5, 32), np.float16)
    assert sw.row_stride(x) == 32
    assert sw.row_stride(x[:, :, :16]) == 32         # the first half of every row: read in place
    assert sw.row_stride(x[1:3]) == 32               # a window of whole sequences
    assert sw.row_stride(x[:, 2:4]) is None          # a window of each sequence: two strides between rows
    assert sw.row_stride(x[1]) == 32
    assert sw.row_stride(x[:1, :1]) == 32            # one row
    assert sw.row_stride(x[0, 0]) == 32              # 1-D
    assert sw.row_stride(x[:, ::2]) is None          # leading dimensions that do not flatten to one stride
    assert sw.row_stride(x[..., ::2]) is None        # a strided last dimension
    assert sw.row_stride(x[0, 0, ::2]) is None
    assert sw.row_stride(x[::-1]) is None            # negative strides
    assert sw.row_stride(np.broadcast_to(x[:1], (4, 5, 32))) is None  # broadcast rows overlap
    assert sw.row_stride(np.asfortranarray(x[0])) is None


@pytest.mark.parametrize("dtype, F, ldx, x_ptr, y_ptr, expected", [
    ("fp16", 64, 128, 0, 0, True),
    ("fp16", 4, 8, 0, 0, False),       # F not a whole vector of 8 halves
    ("fp16", 64, 136, 0, 256, True),   # a wider row stride, still whole vectors
    ("fp16", 64, 132, 0, 0, False),    # rows 8 bytes off a vector
    ("fp16", 64, 128, 2, 0, False),    # x one element past an aligned start
    ("bf16", 8, 16, 16, 32, True),
    ("fp32", 4, 8, 0, 0, True),        # 4 floats per vector
    ("fp32", 11008, 22016, 0, 0, True),
    ("fp32", 7, 14, 0, 0, False),
    ("fp32", 4, 8, 4, 0, False),
])
def test_the_vector_version_needs_whole_vectors_and_aligned_pointers(dtype, F, ldx, x_ptr, y_ptr, expected):
    p = sw.SwigluProblem((3, 2 * F), dtype, "gpu:0")
    assert sw.aligned(p, ldx, x_ptr, y_ptr) is expected
    assert sw.custom_versions(p, expected) == (("swiglu1_scalar", "swiglu2_vec") if expected else ("swiglu1_scalar",))


@pytest.mark.parametrize("dtype, M, F, version, launch", [
    ("fp16", 1, 11008, "swiglu2_vec", ("swiglu2_vec_f16", (6, 1), (256, 1))),    # LLaMA-7B decode: 1376 vectors
    ("bf16", 4096, 11008, "swiglu2_vec", ("swiglu2_vec_bf16", (6, 4096), (256, 1))),
    ("fp32", 64, 2048, "swiglu2_vec", ("swiglu2_vec_f32", (2, 64), (256, 1))),
    ("fp16", 1000, 7, "swiglu1_scalar", ("swiglu1_scalar_f16", (1, 125), (32, 8))),  # short rows: 8 a block
    ("fp32", 3, 1, "swiglu1_scalar", ("swiglu1_scalar_f32", (1, 1), (32, 8))),
    ("fp16", 10**6, 11, "swiglu1_scalar", ("swiglu1_scalar_f16", (1, 65535), (32, 8))),  # rows past the cap
    ("fp32", 2, 100, "swiglu1_scalar", ("swiglu1_scalar_f32", (1, 1), (128, 2))),
])
def test_the_launch_is_the_kernel_files_launch_table(dtype, M, F, version, launch):
    p = sw.SwigluProblem((M, 2 * F), dtype, "gpu:0")
    assert sw.custom_launch(p, version) == launch


def test_the_kernel_parameters_and_threads_are_read_from_the_kernel_file():
    assert sw._SWIGLU.names == ("x", "y", "M", "F", "ldx")
    assert [p.kind for p in sw._SWIGLU.params] == ["ptr", "ptr", "i64", "i32", "i64"]
    assert sw.SWIGLU_THREADS == 256


def test_every_launched_kernel_exists_with_the_declared_parameters_and_fits_its_bounds():
    """Compiled to PTX by NVRTC (no GPU): each kernel the custom path launches is an entry of
    kernels/swiglu.cu taking (x, y, M, F, ldx) as .u64 .u64 .u64 .u32 .u64, and its __launch_bounds__
    admits every block the launch table gives; the file exports nothing else."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    from libnn.runtime import kernels

    ptx = kernels.compile_file("swiglu.cu", "compute_90").cubin.decode()
    entries = {name: (re.findall(r"\.param\s+\.(\w+)", params), directives)
               for name, params, directives in re.findall(r"\.entry\s+(\w+)\s*\((.*?)\)([^{]*)\{", ptx, re.S)}
    launched = set()
    for dtype in sw.GPU_DTYPES:
        for M, F in ((1, 1), (5, 7), (3, 64), (1000, 11008), (7, 100000)):
            p = sw.SwigluProblem((M, 2 * F), dtype, "gpu:0")
            for version in sw.custom_versions(p, sw.aligned(p, 2 * F, 0, 0)):
                name, grid, block = sw.custom_launch(p, version)
                assert min(grid) >= 1 and max(grid) <= 65535
                launched.add((name, math.prod(block)))
    for name, threads in launched:
        params, directives = entries[name]
        assert params == ["u64", "u64", "u64", "u32", "u64"], (name, params)
        bound = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", directives)
        assert bound and threads <= math.prod(int(v) for v in bound.groups()), (name, threads)
    assert set(entries) == {name for name, _ in launched}
