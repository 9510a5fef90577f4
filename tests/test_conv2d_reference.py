"""conv2d on the CPU: the reference against explicit loops, output-shape arithmetic, BN folding,
and the errors bad input gets."""

import importlib
import math
import sys
import types
from dataclasses import replace

import numpy as np
import pytest

from libnn import dtypes
from libnn.runtime import launch
from libnn.ops.activations import apply
from libnn.ops.conv2d import conv2d, fold_batchnorm
from conftest import random_normal, rel_error
from gpu_stand_ins import CUDA, host_ndarray


def loop_oracle(x, w, scale, shift, stride, padding, dilation, groups, activation):
    """NCHW x, KCRS w; explicit loops with math.fsum: independent of the reference's einsum."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    P, Q = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1, (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    Kg = K // groups
    y = np.zeros((N, K, P, Q))
    for n in range(N):
        for k in range(K):
            g = k // Kg
            for p in range(P):
                for q in range(Q):
                    terms = []
                    for c in range(Cg):
                        for r in range(R):
                            for s in range(S):
                                h, v = p * sh - ph + r * dh, q * sw - pw + s * dw
                                if 0 <= h < H and 0 <= v < W:
                                    terms.append(float(x[n, g * Cg + c, h, v]) * float(w[k, c, r, s]))
                    y[n, k, p, q] = math.fsum(terms) * (1.0 if scale is None else scale[k]) + (0.0 if shift is None else shift[k])
    return apply(y, activation)


CASES = [  # (N, C, H, W, K, R, S, stride, padding, dilation, groups)
    (1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1),
    (2, 3, 7, 5, 4, 3, 3, 1, 1, 1, 1),
    (1, 4, 9, 8, 6, 3, 2, 2, 1, 1, 2),
    (1, 6, 8, 7, 6, 3, 3, 1, 2, 2, 6),   # depthwise, dilation 2
    (2, 5, 6, 6, 3, 1, 1, 2, 0, 1, 1),   # 1x1, stride 2, odd channels
    (1, 2, 5, 9, 3, 5, 3, (2, 1), (2, 0), (1, 2), 1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("activation", [None, "relu6", "silu"])
def test_reference_matches_loop_oracle(rng, case, layout, activation):
    N, C, H, W, K, R, S, stride, padding, dilation, groups = case
    x, w = random_normal(rng, (N, C, H, W), "fp64"), random_normal(rng, (K, C // groups, R, S), "fp64")
    b = random_normal(rng, (K,), "fp64")
    gamma, beta, mean = (random_normal(rng, (K,), "fp64") for _ in range(3))
    var = rng.uniform(0.5, 2.0, K)
    scale, shift = fold_batchnorm(gamma, beta, mean, var, 1e-5)
    expected = loop_oracle(x, w, scale, shift + b * scale, _two(stride), _two(padding), _two(dilation), groups, activation)
    if layout == "NHWC":
        x, w = x.transpose(0, 2, 3, 1), w.transpose(0, 2, 3, 1)
        expected = expected.transpose(0, 2, 3, 1)
    y = conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups,
               bn=(gamma, beta, mean, var, 1e-5), activation=activation, layout=layout)
    assert y.shape == expected.shape
    assert rel_error(y, expected) <= 1e-12


def _two(v):
    return v if isinstance(v, tuple) else (v, v)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else []))
def test_reference_rounds_once_to_the_input_dtype(rng, dtype):
    x, w = random_normal(rng, (1, 5, 5, 3), dtype), random_normal(rng, (4, 3, 3, 3), dtype)
    y = conv2d(x, w, padding=1, activation="gelu")
    expected = conv2d(x.astype(np.float64), w.astype(np.float64), padding=1, activation="gelu")
    assert y.dtype == x.dtype and rel_error(y, expected.astype(y.dtype)) <= 1e-12


def test_batchnorm_folding_is_the_affine_map_of_bn():
    rng = np.random.default_rng(0)
    gamma, beta, mean, v = rng.normal(size=4), rng.normal(size=4), rng.normal(size=4), rng.uniform(0.1, 3, 4)
    scale, shift = fold_batchnorm(gamma, beta, mean, v, 1e-3)
    t = rng.normal(size=(10, 4))
    np.testing.assert_allclose(t * scale + shift, gamma * (t - mean) / np.sqrt(v + 1e-3) + beta, rtol=1e-13)


@pytest.mark.parametrize("H, R, stride, padding, dilation, expected", [
    (56, 3, 1, 1, 1, 56), (56, 3, 2, 1, 1, 28), (7, 1, 1, 0, 1, 7), (8, 3, 2, 0, 1, 3), (9, 3, 1, 2, 2, 9), (5, 5, 1, 0, 1, 1)])
def test_output_size_arithmetic(H, R, stride, padding, dilation, expected):
    y = conv2d(np.ones((1, H, H, 1)), np.ones((1, R, R, 1)), stride=stride, padding=padding, dilation=dilation)
    assert y.shape == (1, expected, expected, 1)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(w=np.ones((4, 3, 3, 2))), ValueError, r"w has 2 input channels per group but x has 3 channels in 1 group"),
    (dict(groups=2), ValueError, r"groups=2 does not divide x's 3 channels"),
    (dict(w=np.ones((3, 3, 3, 1)), groups=3, x=np.ones((1, 6, 6, 3)), K=3), None, None),
    (dict(w=np.ones((4, 9, 9, 3))), ValueError, r"the 9x9 kernel .* is larger than the padded 6x6 input"),
    (dict(padding=-1), ValueError, r"padding must be an int or a pair of ints >= 0, got -1"),
    (dict(stride=0), ValueError, r"stride must be an int or a pair of ints >= 1"),
    (dict(layout="NCWH"), ValueError, r"layout must be one of \('NHWC', 'NCHW'\)"),
    (dict(bn=(np.ones(3), np.ones(4))), ValueError, r"bn\[0\] must have shape \(4,\) to match w's 4 output channels"),
    (dict(bn=(np.ones(4), np.ones(4), np.zeros(4), np.ones(4), 0.0)), ValueError, r"eps must be > 0"),
    (dict(bn=(np.ones(4),)), ValueError, r"bn must be \(scale, shift\) or"),
    (dict(b=np.ones(5)), ValueError, r"b must have shape \(4,\)"),
    (dict(w=np.ones((4, 3, 3, 3), np.float32)), TypeError, r"w has dtype fp32 but x has fp64"),
    (dict(b=np.ones(4, np.float32)), TypeError, r"b has dtype fp32 but x has fp64; pass b in x's dtype \(or fp32"),
    (dict(x=np.ones((1, 6, 6, 3), np.float16), w=np.ones((4, 3, 3, 3), np.float16), b=np.ones(4, np.int32)),
     TypeError, r"b has dtype int32 but x has fp16"),
    (dict(activation="tanh"), ValueError, r"activation must be one of"),
    (dict(x=np.ones((6, 6, 3))), ValueError, r"x must be 4-D \(N, H, W, C\)"),
])
def test_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(x=np.ones((1, 6, 6, 3)), w=np.ones((4, 3, 3, 3)))
    args.update({k: v for k, v in kwargs.items() if k != "K"})
    x, w = args.pop("x"), args.pop("w")
    if error is None:
        assert conv2d(x, w, **args).shape == (1, 4, 4, kwargs["K"])
        return
    with pytest.raises(error, match=message):
        conv2d(x, w, **args)


def test_forcing_a_gpu_path_with_host_arrays_says_so():
    with pytest.raises(TypeError, match="path 'cudnn' runs on the GPU, but the arrays are host"):
        conv2d(np.ones((1, 4, 4, 2), np.float32), np.ones((2, 3, 3, 2), np.float32), path="cudnn")



# --- the custom path's bound call, without a GPU -----------------------------------------------------
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_custom_binds_its_kernel_once_and_each_call_passes_that_calls_arrays(rng, monkeypatch, layout):
    """The bind finds the kernel, its geometry and its scalars once; every call passes its own x, a KRSC
    copy of its own w (NCHW filters are transposed at each call), the epilogue folded from its own bn,
    and a new y. CuPy's allocations and the packed launch are stood in for by NumPy and a recorder."""
    conv = importlib.import_module("libnn.ops.conv2d")
    binds, launches = [], []

    def bind(file, kernel, grid, block, args, *, shared_mem=0):
        binds.append((file, kernel, grid, block, args, shared_mem))
        return lambda *arrays: launches.append(arrays)

    monkeypatch.setattr(launch, "bind", bind)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        empty=np.empty, ndarray=host_ndarray, cuda=CUDA, ascontiguousarray=np.ascontiguousarray))

    def arrays():
        x = random_normal(rng, (2, 7, 6, 8) if layout == "NHWC" else (2, 8, 7, 6), "fp32")
        w = random_normal(rng, (4, 3, 3, 8) if layout == "NHWC" else (4, 8, 3, 3), "fp32")
        bn = (*(random_normal(rng, (4,), "fp32") for _ in range(3)), rng.uniform(0.5, 2, 4).astype(np.float32), 1e-5)
        return x, w, random_normal(rng, (4,), "fp32"), bn

    def check(x, w, b, bn):
        y = run(x, w, b, bn)
        sent = launches[-1]
        assert sent[0] is x and sent[4] is y and y.shape == conv.output_shape(problem)
        np.testing.assert_array_equal(sent[1], w if layout == "NHWC" else w.transpose(0, 2, 3, 1))
        scale, shift = fold_batchnorm(*bn)
        np.testing.assert_allclose(sent[2], scale, rtol=1e-12)
        np.testing.assert_allclose(sent[3], shift + b * scale, rtol=1e-12)

    first, second = arrays(), arrays()
    problem = replace(conv.conv2d_problem(*first[:3], first[3], 1, 1, 1, 1, "relu", layout, False), device="gpu:0")
    run = conv.op.paths["custom"].bind(problem, first)
    check(*first)
    check(*second)  # other arrays
    third = arrays()
    for old, new in zip((*second[:3], *second[3][:4]), (*third[:3], *third[3][:4])):
        old[...] = new
    check(*second)  # the same arrays, holding other values
    assert len({id(sent[4]) for sent in launches}) == 3
    ((file, kernel, grid, block, args, smem),) = binds
    grid_of, threads, smem_of = conv._conv_launch("conv4_igemm", problem)
    assert (file, kernel, grid, block, smem) == ("conv2d.cu", "conv4_igemm_f32", grid_of, (threads,), smem_of)
    assert args[:5] == (launch.ARRAY,) * 5 and args == conv._conv_args(problem)


def test_an_fp32_bias_of_fp16_x_is_taken_as_is(rng):
    """b in fp32 for fp16 x: the epilogue reads fp32, so it is the same as the bias rounded to fp16
    only where fp16 holds it exactly; the reference computes with the fp32 values."""
    x, w = random_normal(rng, (2, 7, 5, 3), "fp16"), random_normal(rng, (4, 3, 3, 3), "fp16")
    b32 = random_normal(rng, (4,), "fp32")
    got = conv2d(x, w, b32, padding=1, activation="relu")
    expected = apply(conv2d(x.astype(np.float64), w.astype(np.float64), b32.astype(np.float64), padding=1), "relu")
    assert got.dtype == np.float16 and rel_error(got, expected) <= dtypes.TOLERANCE["fp16"]
