"""nn.RMSNorm on the CPU: PyTorch's and Hugging Face's parameter (`weight`, ones at first), what it
computes (with a residual, and the sum returned for a pre-norm block), state_dict round trips and
dtype moves, its repr, and the bad-input sweep of tests/test_bad_input.py's classes (types, ranges,
huge sizes, dtypes, devices, flags and paths) for its constructor and forward."""

import math

import numpy as np
import pytest

from libnn import nn
from libnn.nn.norm import RMSNorm
from libnn.runtime.device import gpu_missing
from conftest import random_normal, rel_error


def oracle(x, weight, eps):
    rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.stack([row / math.sqrt(math.fsum(v * v for v in row) / row.size + eps) for row in rows])
    return (out * (1 if weight is None else np.asarray(weight, np.float64))).reshape(x.shape)


def test_layer_has_a_weight_of_ones_by_pytorchs_name():
    layer = RMSNorm(6)
    assert set(layer.state_dict()) == {"weight"}
    np.testing.assert_array_equal(layer.weight, np.ones(6, np.float32))
    assert (layer.dim, layer.eps) == (6, 1e-6)
    assert RMSNorm(6, elementwise_affine=False).state_dict() == {}
    assert nn.RMSNorm is RMSNorm


def test_layer_computes_rms_norm_with_its_weight(rng):
    layer = RMSNorm(12, eps=1e-3, dtype="fp64")
    layer.load_state_dict({"weight": random_normal(rng, (12,), "fp64")})
    x = random_normal(rng, (2, 3, 12), "fp64")
    assert rel_error(layer(x), oracle(x, layer.weight, 1e-3)) <= 1e-12
    plain = RMSNorm(12, elementwise_affine=False, dtype="fp64")
    assert rel_error(plain(x), oracle(x, None, 1e-6)) <= 1e-12


def test_layer_adds_a_residual_and_returns_the_sum_for_a_pre_norm_block(rng):
    layer = RMSNorm(16, dtype="fp32")
    layer.load_state_dict({"weight": random_normal(rng, (16,), "fp32")})
    x, r = random_normal(rng, (3, 16), "fp32"), random_normal(rng, (3, 16), "fp32", 4.0)
    y = layer(x, r)
    y2, h = layer(x, residual=r, return_sum=True)
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_array_equal(y, y2)
    assert rel_error(y, oracle(x.astype(np.float64) + r, layer.weight, 1e-6)) <= 1e-6


def test_layer_state_dict_round_trips_and_checks_shapes(rng):
    a, b = RMSNorm(4), RMSNorm(4)
    a.load_state_dict({"weight": random_normal(rng, (4,), "fp32")})
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.weight, b.weight)
    with pytest.raises(ValueError, match=r"weight has shape \(5,\), the layer expects \(4,\)"):
        b.load_state_dict({"weight": np.ones(5, np.float32)})


def test_layer_to_dtype_casts_its_weight():
    assert RMSNorm(3).to("fp16").weight.dtype == np.float16


def test_layer_repr_names_its_configuration():
    assert repr(RMSNorm(2048, eps=1e-5, path="custom")) == (
        "RMSNorm(2048, eps=1e-05, elementwise_affine=True, path='custom')")


# --- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [2.0, None, "8", np.array([8]), True, (8,)], ids=repr)
def test_dim_of_the_wrong_type_is_a_type_error(dim):
    with pytest.raises(TypeError, match=r"^RMSNorm: dim must be an int"):
        RMSNorm(dim)


@pytest.mark.parametrize("dim", [0, -4])
def test_dim_below_one_is_a_value_error(dim):
    with pytest.raises(ValueError, match=rf"^RMSNorm: dim must be a positive int, got {dim}$"):
        RMSNorm(dim)


def test_a_huge_layer_is_refused_with_the_bytes_needed_and_available():
    with pytest.raises(MemoryError, match=r"^RMSNorm: dim needs .* \(\d+ bytes\), more than the .* \(\d+ bytes\) of "
                                          "host RAM available$"):
        RMSNorm(10**13)


@pytest.mark.parametrize("eps, error", [(0, ValueError), (-1e-6, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("1e-6", TypeError), (None, TypeError),
                                        (True, TypeError), (np.array([1e-6]), TypeError)], ids=repr)
def test_eps_must_be_a_finite_positive_number(eps, error):
    with pytest.raises(error, match=r"^RMSNorm: eps must be (> 0|finite|a real number), got"):
        RMSNorm(8, eps=eps)


@pytest.mark.parametrize("dtype, error, match", [
    (np.int32, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got int32"),
    (np.complex64, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got complex64"),
    (None, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got None"),
    ("bogus", ValueError, "dtype 'bogus': unknown dtype"),
], ids=repr)
def test_weight_dtypes_must_be_floats(dtype, error, match):
    with pytest.raises(error, match=rf"^RMSNorm: {match}"):
        RMSNorm(8, dtype=dtype)


@pytest.mark.parametrize("device", ["tpu", None, 0])
def test_unknown_devices_are_named(device):
    with pytest.raises(ValueError, match=rf"^RMSNorm: device must be one of \('cpu', 'gpu', 'cuda'\), got {device!r}"):
        RMSNorm(8, device=device)


@pytest.mark.skipif(gpu_missing() is None, reason="checks the message on machines without a GPU")
def test_gpu_device_without_a_gpu_says_so():
    with pytest.raises(ValueError, match=r"^RMSNorm: device='gpu' needs a GPU, and there is none here"):
        RMSNorm(8, device="gpu")


@pytest.mark.parametrize("value", ["no", 0, None])
def test_elementwise_affine_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"^RMSNorm: elementwise_affine must be True or False"):
        RMSNorm(8, elementwise_affine=value)


@pytest.mark.parametrize("path", ["cublaslt", None, 3])
def test_unknown_paths_are_named(path):
    with pytest.raises(ValueError, match=r"^RMSNorm: path must be"):
        RMSNorm(8, path=path)


@pytest.mark.parametrize("x, error, match", [
    (np.ones((2, 4), np.int64), TypeError, r"^rms_norm: x must be a floating-point"),
    (np.ones((2, 5), np.float32), ValueError,
     r"^rms_norm: weight must have shape \(5,\) to match x's last dimension .* got \(4,\)"),
    (np.ones((2, 4), np.float64), TypeError, r"^rms_norm: weight has dtype fp32 but x has fp64"),
    (np.float32(1.0), ValueError, r"^rms_norm: x must have at least 1 dimension"),
    ([[1.0] * 4], TypeError, r"^rms_norm: x must be an array"),
], ids=["int", "width", "dtype", "0-d", "list"])
def test_forward_names_what_is_wrong_with_x(x, error, match):
    with pytest.raises(error, match=match):
        RMSNorm(4)(x)


def test_forward_with_return_sum_and_no_residual_says_what_to_pass():
    with pytest.raises(ValueError, match=r"^rms_norm: return_sum=True returns x \+ residual, but residual is None"):
        RMSNorm(4)(np.ones((2, 4), np.float32), return_sum=True)
