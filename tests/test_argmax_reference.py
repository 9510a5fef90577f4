"""argmax without a GPU: the reference path's semantics (NumPy's: the first maximum, the first NaN before any
number), its shapes and dtypes, and the errors of bad input, naming the op and the argument."""

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops import argmax


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
def test_reference_takes_the_first_maximum_and_the_first_nan(dtype):
    x = np.array([[1, 3, 3, 2], [np.nan, 1, np.nan, np.inf], [-np.inf] * 4, [0, -1, np.inf, 5]])
    got = argmax(x.astype(dtypes.parse(dtype)))
    assert got.dtype == np.int64 and got.tolist() == [1, 0, 0, 2]


def test_shapes_reduce_the_last_axis():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[..., ::-1]
    assert argmax(x).shape == (2, 3) and not argmax(x).any()
    one = argmax(np.array([0.5, 2.0, 1.0], np.float32))
    assert isinstance(one, np.ndarray) and one.shape == () and int(one) == 1
    assert argmax(np.zeros((0, 5), np.float32)).shape == (0,)


def test_paths_are_custom_cupy_reference_in_auto_order():
    assert [(p["path"], p["kind"]) for p in libnn.paths("argmax")] == [
        ("custom", "custom"), ("cupy", "library"), ("reference", "reference")]


@pytest.mark.parametrize("bad, error, message", [
    (np.float32(1.0), ValueError, "argmax: x must have at least 1 dimension"),
    (np.zeros((3, 0), np.float32), ValueError, "argmax: x's last dimension must hold at least one value"),
    (np.arange(6).reshape(2, 3), TypeError, "argmax: x must be a floating-point array"),
    (np.zeros(3, np.complex64), TypeError, "argmax: x must be a floating-point array"),
])
def test_bad_input_is_named(bad, error, message):
    with pytest.raises(error, match=message):
        argmax(bad)


def test_a_gpu_path_on_host_arrays_says_why_not():
    with pytest.raises(TypeError, match="argmax: path 'custom' runs on the GPU, but the arrays are host"):
        argmax(np.ones((2, 3), np.float32), path="custom")


def test_rows_past_the_kernels_int_indices_go_to_another_path():
    """kernels/argmax.cu indexes a row with int: rows of 2^31 values or more are refused by the custom path
    (naming N and the limit), which auto then passes over for cupy."""
    from libnn.ops.argmax import INT32_MAX, ArgmaxProblem, _custom_support

    assert _custom_support(ArgmaxProblem((1, INT32_MAX), "fp16", "gpu:0")) is None
    why = _custom_support(ArgmaxProblem((3, INT32_MAX + 1), "fp16", "gpu:0"))
    assert why and f"N = {INT32_MAX + 1}" in why and f"N <= {INT32_MAX}" in why
    assert "dtype fp64" in _custom_support(ArgmaxProblem((3, 5), "fp64", "gpu:0"))
