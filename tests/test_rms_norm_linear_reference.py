"""rms_norm_linear on the CPU: the reference path is rms_norm, linear and swiglu's references in turn (odd
shapes, with and without bias and SwiGLU, leading dimensions kept); every argument checked with a message
naming the op and the argument; the paths listed in auto's order; the model-level choice between the fused
op and the three ops (models.decoder.fused_norm_path). No GPU needed."""

import numpy as np
import pytest

import libnn
from libnn.models.decoder import fused_norm_path
from libnn.ops import linear, linear_fp8, rms_norm, rms_norm_linear, swiglu
from libnn.ops.quantize_fp8 import quantize_weight
from conftest import random_normal


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("glu", [None, "swiglu"])
@pytest.mark.parametrize("shape, N, bias", [((1, 8), 2, False), ((3, 13), 14, True), ((2, 5, 40), 22, True)], ids=str)
def test_reference_is_the_three_ops_in_turn(rng, shape, N, bias, glu, dtype):
    K = shape[-1]
    x, g, w = random_normal(rng, shape, dtype), random_normal(rng, (K,), dtype), random_normal(rng, (N, K), dtype)
    b = random_normal(rng, (N,), dtype) if bias else None
    y = rms_norm_linear(x, g, w, b, eps=1e-5, glu=glu)
    v = linear(rms_norm(x, g, eps=1e-5), w, b)
    expected = swiglu(v) if glu else v
    assert y.shape == (*shape[:-1], N // 2 if glu else N) and y.dtype == x.dtype
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("glu", [None, "swiglu"])
def test_with_e4m3_weights_the_reference_is_rms_norm_then_linear_fp8(rng, glu):
    x, g = random_normal(rng, (3, 32), "fp32"), random_normal(rng, (32,), "fp32")
    weight = quantize_weight(random_normal(rng, (10, 32), "fp32", 0.2))
    y = rms_norm_linear(x, g, weight.data, w_scale=weight.scale, glu=glu)
    v = linear_fp8(rms_norm(x, g), weight.data, weight.scale)
    np.testing.assert_array_equal(y, swiglu(v) if glu else v)


def test_e4m3_weights_are_checked():
    x, g = np.ones((1, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(TypeError, match="rms_norm_linear: with w_scale, w must be uint8 E4M3 codes"):
        rms_norm_linear(x, g, np.ones((2, 8), np.float32), w_scale=np.ones(1, np.float32))
    with pytest.raises(TypeError, match=r"rms_norm_linear: w_scale must be float32 of shape \(1,\) \(per tensor\) or \(2,\)"):
        rms_norm_linear(x, g, np.ones((2, 8), np.uint8), w_scale=np.ones(3, np.float32))


def test_the_norm_is_applied(rng):
    """Scaling x leaves the result unchanged (RMS norm in front), up to eps."""
    x, g, w = random_normal(rng, (2, 16), "fp64"), random_normal(rng, (16,), "fp64"), random_normal(rng, (4, 16), "fp64")
    np.testing.assert_allclose(rms_norm_linear(100 * x, g, w, eps=1e-12), rms_norm_linear(x, g, w, eps=1e-12), rtol=1e-9)


@pytest.mark.parametrize("args, kwargs, error, message", [
    (((2, 8), (8,), (4, 6)), {}, ValueError, "rms_norm_linear: x has 8 features in its last dimension but w has 6"),
    (((2, 8), (7,), (4, 8)), {}, ValueError, r"rms_norm_linear: norm_weight must have shape \(8,\), x's features, got \(7,\)"),
    (((2, 8), (8,), (4, 8, 1)), {}, ValueError, "rms_norm_linear: w must be 2-D"),
    (((2, 8), (8,), (5, 8)), {"glu": "swiglu"}, ValueError, "with glu='swiglu' w's out_features must be even"),
    (((2, 8), (8,), (4, 8)), {"glu": "geglu"}, ValueError, r"rms_norm_linear: glu must be one of \[None, 'swiglu'\], got 'geglu'"),
    (((2, 8), (8,), (4, 8)), {"eps": 0.0}, ValueError, "rms_norm_linear: eps must be a finite number > 0, got 0.0"),
    (((2, 8), (8,), (4, 8)), {"eps": float("nan")}, ValueError, "eps must be a finite number > 0"),
    ((None, (8,), (4, 8)), {}, ValueError, "x must have at least 1 dimension"),
], ids=["K", "norm-shape", "w-rank", "odd-N", "glu", "eps0", "eps-nan", "scalar"])
def test_bad_arguments_are_named(args, kwargs, error, message):
    xs, gs, ws = args
    x = np.float32(1.0) if xs is None else np.ones(xs, np.float32)
    with pytest.raises(error, match=message):
        rms_norm_linear(x, np.ones(gs, np.float32), np.ones(ws, np.float32), **kwargs)


def test_dtypes_must_agree():
    with pytest.raises(TypeError, match="rms_norm_linear: w has dtype fp64 but x has fp32"):
        rms_norm_linear(np.ones((1, 8), np.float32), np.ones(8, np.float32), np.ones((2, 8)))
    with pytest.raises(TypeError, match="rms_norm_linear: x must be a floating-point array"):
        rms_norm_linear(np.ones((1, 8), np.int32), np.ones(8, np.int32), np.ones((2, 8), np.int32))


def test_paths_in_auto_order():
    assert [r["path"] for r in libnn.paths("rms_norm_linear")] == ["gemv", "unfused", "reference"]


@pytest.mark.parametrize("path, expected", [
    ("auto", "auto"), ("reference", "reference"), ("gemv", "gemv"),
    ("cudnn", None),                                   # rms_norm's and linear's cudnn paths, as asked
    ("cupy", "auto"),                                  # embedding's path alone: none of the three forced
    ("custom", None),
    ({"attention": "custom"}, "auto"),                 # nothing of the three forced
    ({"linear": "cublaslt"}, None),                    # the GEMMs forced: the three ops run
    ({"swiglu": "custom"}, None),
    ({"linear": "cublaslt", "rms_norm_linear": "gemv"}, "gemv"),  # its own entry decides
], ids=str)
def test_fused_norm_path_leaves_forced_ops_their_paths(path, expected):
    assert fused_norm_path(path) == expected
