"""Bad input to linear gets a clear error naming the argument, what was expected and what came."""

import re

import numpy as np
import pytest

import libnn
from libnn.ops.linear import linear
from libnn.runtime.device import gpu_missing
from conftest import random_normal


@pytest.fixture
def xw(rng):
    return random_normal(rng, (4, 8), "fp32"), random_normal(rng, (3, 8), "fp32")


def test_feature_mismatch_names_both_sizes(xw, rng):
    x, _ = xw
    with pytest.raises(ValueError, match=r"x has 8 features .* w has 7"):
        linear(x, random_normal(rng, (3, 7), "fp32"))


def test_weight_must_be_2d(xw):
    x, w = xw
    with pytest.raises(ValueError, match=r"w must be 2-D .* got shape \(3, 8, 1\)"):
        linear(x, w[..., None])


def test_bias_shape_must_match_out_features(xw, rng):
    x, w = xw
    with pytest.raises(ValueError, match=r"b must have shape \(3,\) .* got \(4,\)"):
        linear(x, w, random_normal(rng, (4,), "fp32"))


@pytest.mark.parametrize("arg", ["w", "b", "residual"])
def test_dtype_mismatch_names_the_argument(xw, rng, arg):
    x, w = xw
    b, r = random_normal(rng, (3,), "fp32"), random_normal(rng, (4, 3), "fp32")
    if arg == "w":
        w = w.astype(np.float16)
    elif arg == "b":
        b = b.astype(np.float64)
    else:
        r = r.astype(np.float16)
    with pytest.raises(TypeError, match=rf"linear: {arg} has dtype .* but x has fp32"):
        linear(x, w, b, residual=r)


@pytest.mark.parametrize("shape", [(3, 4), (4,), (3,), (1, 4, 3), (4, 1)], ids=str)
def test_residual_of_the_wrong_shape_names_expected_and_got(xw, rng, shape):
    x, w = xw
    with pytest.raises(ValueError, match=rf"linear: residual must have the output's shape \(4, 3\) .* "
                                         rf"got {re.escape(str(shape))}"):
        linear(x, w, residual=random_normal(rng, shape, "fp32"))


def test_residual_shape_follows_leading_dimensions(rng):
    x, w = random_normal(rng, (2, 5, 8), "fp32"), random_normal(rng, (3, 8), "fp32")
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(2, 5, 3\) .* got \(10, 3\)"):
        linear(x, w, residual=random_normal(rng, (10, 3), "fp32"))


def test_non_array_residual_is_rejected(xw):
    with pytest.raises(TypeError, match="linear: residual must be an array .* got builtins.list"):
        linear(*xw, residual=[[0.0] * 3] * 4)


def test_a_bad_residual_is_refused_on_every_call_not_only_the_first(xw, rng):
    """The bound call's key holds the residual's signature: a good call first must not let a bad one through."""
    x, w = xw
    linear(x, w, residual=random_normal(rng, (4, 3), "fp32"))
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        linear(x, w, residual=random_normal(rng, (4, 1), "fp32"))
    with pytest.raises(TypeError, match="residual has dtype fp16"):
        linear(x, w, residual=random_normal(rng, (4, 3), "fp16"))


def test_integer_input_is_rejected(rng):
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        linear(np.ones((2, 3), np.int32), np.ones((4, 3), np.int32))


def test_unknown_activation(xw):
    with pytest.raises(ValueError, match="activation must be one of"):
        linear(*xw, activation="swish")


def test_unknown_path_lists_the_known_ones(xw):
    with pytest.raises(ValueError, match=r"unknown path 'cudnn'.*'cublaslt', 'custom', 'reference'"):
        linear(*xw, path="cudnn")


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_host_arrays_to_a_gpu_path_say_how_to_move_them(xw, path):
    with pytest.raises(TypeError, match=rf"path '{path}' runs on the GPU, but the arrays are host .*cupy.asarray"):
        linear(*xw, path=path)


def test_non_array_input_is_rejected(xw):
    with pytest.raises(TypeError, match="x must be an array .* got builtins.list"):
        linear([[1.0] * 8], xw[1])


def test_paths_report_availability_and_reasons():
    rows = {r["path"]: r for r in libnn.paths("linear")}
    assert list(rows) == ["cublaslt", "custom", "reference"]
    assert rows["reference"]["available"] == "yes"
    if gpu_missing():
        assert rows["cublaslt"]["available"] == "no" and rows["cublaslt"]["reason"]
