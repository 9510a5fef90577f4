"""The reference path against an independent oracle: explicit loops with math.fsum (exactly rounded
sums) and math.tanh, on tiny inputs; the residual operand; the memory check before allocating."""

import math

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops.linear import linear
from conftest import random_normal, rel_error


def oracle(x, w, b, activation, residual=None):
    x64, w64 = np.asarray(x, np.float64).reshape(-1, x.shape[-1]), np.asarray(w, np.float64)
    r64 = None if residual is None else np.asarray(residual, np.float64).reshape(x64.shape[0], w64.shape[0])
    out = np.empty((x64.shape[0], w64.shape[0]))
    for m in range(x64.shape[0]):
        for n in range(w64.shape[0]):
            terms = [float(x64[m, k]) * float(w64[n, k]) for k in range(x64.shape[1])]
            terms += [] if b is None else [float(b[n])]
            terms += [] if r64 is None else [float(r64[m, n])]
            v = math.fsum(terms)
            if activation == "relu":
                v = max(v, 0.0)
            elif activation == "gelu":
                v = 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
            elif activation == "gelu_erf":
                v = 0.5 * v * (1 + math.erf(v / math.sqrt(2)))
            out[m, n] = v
    return out.reshape(*x.shape[:-1], w.shape[0])


DTYPES = ["fp64", "fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (2, 13, 1), (11, 2, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_matches_loop_oracle(rng, dtype, activation, shape, bias):
    M, N, K = shape
    x, w = random_normal(rng, (M, K), dtype), random_normal(rng, (N, K), dtype)
    b = random_normal(rng, (N,), dtype) if bias else None
    y = linear(x, w, b, activation, path="reference")
    assert y.dtype == dtypes.parse(dtype) and y.shape == (M, N)
    # both see the same rounded inputs and round once to `dtype` at the end: they agree to the bit
    # unless a float64 sum lands within 1e-16 of a rounding boundary of `dtype`
    assert rel_error(y, oracle(x, w, b, activation).astype(y.dtype)) <= 1e-12


def test_reference_keeps_leading_dimensions(rng):
    x, w, b = random_normal(rng, (2, 3, 5), "fp64"), random_normal(rng, (4, 5), "fp64"), random_normal(rng, (4,), "fp64")
    y = linear(x, w, b, "gelu")
    assert y.shape == (2, 3, 4)
    assert rel_error(y, oracle(x, w, b, "gelu")) <= 1e-12


def test_auto_runs_host_arrays_on_the_reference_path(rng):
    x, w = random_normal(rng, (3, 4), "fp32"), random_normal(rng, (5, 4), "fp32")
    linear(x, w)
    assert libnn.get_op("linear").last_decision.path == "reference"


def test_empty_batch_gives_empty_output(rng):
    y = linear(np.empty((0, 4), np.float32), random_normal(rng, (5, 4), "fp32"))
    assert y.shape == (0, 5) and y.dtype == np.float32


def test_zero_features_gives_activation_of_bias(rng):
    b = random_normal(rng, (5,), "fp32")
    y = linear(np.empty((3, 0), np.float32), np.empty((5, 0), np.float32), b, "relu")
    np.testing.assert_array_equal(y, np.broadcast_to(np.maximum(b, 0), (3, 5)))


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_nan_and_inf_propagate_to_their_rows(rng, activation):
    x, w = random_normal(rng, (4, 6), "fp32"), random_normal(rng, (3, 6), "fp32")
    x[1, 2], x[2, 0] = np.nan, np.inf
    y = linear(x, w, None, activation)
    assert np.isnan(y[1]).all()
    assert not np.isfinite(y[2]).any() or activation == "relu"  # relu(-inf) is 0
    assert np.isfinite(y[[0, 3]]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (11, 2, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_with_residual_matches_loop_oracle(rng, dtype, activation, shape, bias):
    """The residual is added before the activation: act(x @ w.T + b + residual), rounded once."""
    M, N, K = shape
    x, w, r = random_normal(rng, (M, K), dtype), random_normal(rng, (N, K), dtype), random_normal(rng, (M, N), dtype)
    b = random_normal(rng, (N,), dtype) if bias else None
    y = linear(x, w, b, activation, residual=r, path="reference")
    assert y.dtype == dtypes.parse(dtype) and y.shape == (M, N)
    assert rel_error(y, oracle(x, w, b, activation, r).astype(y.dtype)) <= 1e-12


def test_reference_residual_with_leading_dimensions_and_strides(rng):
    x, w, b = random_normal(rng, (2, 3, 5), "fp64"), random_normal(rng, (4, 5), "fp64"), random_normal(rng, (4,), "fp64")
    r = random_normal(rng, (3, 2, 4), "fp64").transpose(1, 0, 2)  # a strided view of the output's shape
    y = linear(x, w, b, "relu", residual=r)
    assert y.shape == (2, 3, 4)
    assert rel_error(y, oracle(x, w, b, "relu", np.ascontiguousarray(r))) <= 1e-12


def test_reference_residual_is_not_written(rng):
    x, w, r = random_normal(rng, (3, 4), "fp32"), random_normal(rng, (5, 4), "fp32"), random_normal(rng, (3, 5), "fp32")
    before = r.copy()
    y = linear(x, w, None, "gelu_erf", residual=r)
    np.testing.assert_array_equal(r, before)
    assert not np.shares_memory(y, r)


def test_zero_features_with_residual_gives_activation_of_bias_plus_residual(rng):
    b, r = random_normal(rng, (5,), "fp32"), random_normal(rng, (3, 5), "fp32")
    y = linear(np.empty((3, 0), np.float32), np.empty((5, 0), np.float32), b, "relu", residual=r)
    np.testing.assert_allclose(y, np.maximum(b.astype(np.float64) + r, 0), rtol=1e-6)


def test_reference_refuses_a_product_too_large_for_host_memory_before_allocating():
    """x of 2**36 rows costs nothing as a broadcast view; its float64 product (4 TiB) cannot fit."""
    x = np.broadcast_to(np.float32(0.5), (2**36, 2))
    w = np.full((8, 2), 0.25, np.float32)
    with pytest.raises(MemoryError, match=r"linear: the float64 reference of x @ w.T \(M=68719476736, N=8, K=2\) "
                                          r"needs .*TiB \(\d+ bytes\), more than the .* of host RAM available"):
        linear(x, w, path="reference")
