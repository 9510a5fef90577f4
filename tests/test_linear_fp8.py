"""FP8 (E4M3) linear on the host: the encoding against ml_dtypes' float8_e4m3fn (an independent
implementation), the quantisers, linear_fp8's reference path against explicit fsum loops over values
dequantised by ml_dtypes, odd and empty shapes, NaN and inf, what each GPU path supports, bad input,
and nn.Linear(dtype="fp8") / Module.quantize("fp8") on the reference path. The GPU paths are
tests/test_linear_fp8_gpu.py's."""

from __future__ import annotations

import importlib
import math
import re

import numpy as np
import pytest

import libnn
from libnn import dtypes, nn
from libnn.errors import LibnnError
from libnn.ops.linear_fp8 import LinearFp8Problem, linear_fp8, linear_fp8_problem
from libnn.ops.quantize_fp8 import (E4M3_MAX, decode_e4m3, encode_e4m3, fp8_gpu_missing, quantize_fp8,
                                    quantize_weight, require_fp8_gpu)
from libnn.registry import get_op
from conftest import random_normal, rel_error
from test_linear_reference import oracle

ml_dtypes = pytest.importorskip("ml_dtypes")
q8 = importlib.import_module("libnn.ops.quantize_fp8")
l8 = importlib.import_module("libnn.ops.linear_fp8")
E4M3 = ml_dtypes.float8_e4m3fn
DTYPES = ["fp64", "fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else [])
# the unit roundoff of each output dtype: the reference rounds its float64 result once
ROUNDOFF = {"fp64": 1e-12, "fp32": 2 ** -23, "fp16": 2 ** -10, "bf16": 2 ** -7}


def ml_dequantized(x, per_channel: bool = False) -> np.ndarray:
    """x quantised and dequantised with ml_dtypes' E4M3 (finite x): scale = max|x| / 448 per row
    (`per_channel`) or for the whole array, values clipped to ±448 and rounded by ml_dtypes."""
    x32 = np.asarray(x, np.float32)
    amax = np.abs(x32).max(axis=-1 if per_channel else None, keepdims=per_channel) if x32.size else np.float32(0)
    scale = np.asarray(amax, np.float32) / np.float32(448)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    codes = np.clip(x32 / scale, -448, 448).astype(E4M3)
    return codes.astype(np.float64) * scale.astype(np.float64)


def wide_values(rng, n: int) -> np.ndarray:
    """fp32 values of every magnitude E4M3 meets once scaled: subnormals, normals, beyond 448."""
    return (rng.standard_normal(n) * np.exp2(rng.uniform(-14, 10, n))).astype(np.float32)


# --- the encoding ------------------------------------------------------------------------------------------
def test_decode_gives_every_codes_value_as_ml_dtypes_does():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(decode_e4m3(codes), codes.view(E4M3).astype(np.float32))
    assert decode_e4m3(np.uint8(0x7E)) == E4M3_MAX and decode_e4m3(np.uint8(0x01)) == 2.0 ** -9


def test_encode_round_trips_every_finite_code_and_maps_nan_to_nan():
    codes = np.arange(256, dtype=np.uint8)
    values = decode_e4m3(codes)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(encode_e4m3(values)[finite], codes[finite])
    assert list(encode_e4m3(values[~finite])) == [0x7F, 0xFF]


def test_encode_rounds_to_nearest_even_and_saturates_as_ml_dtypes_does(rng):
    v = np.concatenate([wide_values(rng, 200_000),
                        np.array([0.0, 448.0, 447.9, 449.0, 464.0, 465.0, 480.0, 1e30, 3.4e38, 2.0 ** -10,
                                  3 * 2.0 ** -10, 5 * 2.0 ** -10, 1e-45, 1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4,
                                  15 * 2.0 ** -10], np.float32)])
    v = np.concatenate([v, -v])
    expected = np.clip(v, -448, 448).astype(E4M3).view(np.uint8)  # ml_dtypes rounds; libnn saturates
    np.testing.assert_array_equal(encode_e4m3(v), expected)


def test_encode_ties_go_to_the_even_code_and_signs_are_kept():
    ties = np.array([1 + 2 ** -4, 1 + 3 * 2 ** -4, 2.0 ** -10, 3 * 2.0 ** -10, 432.0, -0.0, -(1 + 2 ** -4)], np.float32)
    # 1.0625 -> 1.0 (0x38), 1.1875 -> 1.25 (0x3a), 2^-10 -> 0, 3·2^-10 -> 2·2^-9 (0x02), 432 -> 448 (0x7e)
    assert list(encode_e4m3(ties)) == [0x38, 0x3A, 0x00, 0x02, 0x7E, 0x80, 0xB8]


def test_infinities_are_quantised_to_nan_keeping_their_sign():
    assert list(encode_e4m3(np.array([np.inf, -np.inf, np.nan], np.float32))) == [0x7F, 0xFF, 0x7F]


# --- the quantisers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fp8_maps_the_largest_magnitude_to_448_and_dequantizes_within_half_a_step(rng, dtype):
    x = random_normal(rng, (37, 53), dtype, 3.0)
    codes, scale = quantize_fp8(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and scale.dtype == np.float32 and scale.shape == (1,)
    x64 = x.astype(np.float64)
    assert scale[0] == np.float32(np.abs(x64).max().astype(np.float32)) / np.float32(448)
    assert np.abs(decode_e4m3(codes)).max() == E4M3_MAX
    np.testing.assert_array_equal(scale[0] * decode_e4m3(codes).astype(np.float64), ml_dequantized(x))
    # half an E4M3 step: 2^-4 of the value in the normal range, 2^-10 of the scale among the subnormals
    bound = np.maximum(np.abs(x64) * 2.0 ** -4, float(scale[0]) * 2.0 ** -10)
    assert np.all(np.abs(scale[0] * decode_e4m3(codes).astype(np.float64) - x64) <= bound * (1 + 1e-6))


def test_quantize_fp8_scale_ignores_nan_and_inf_and_is_one_for_zeros():
    x = np.array([[1.0, -np.inf, 2.0], [np.nan, -4.48, 0.0]], np.float32)
    codes, scale = quantize_fp8(x)
    assert scale[0] == np.float32(4.48) / np.float32(448)
    assert codes[0, 1] == 0xFF and codes[1, 0] == 0x7F and codes[1, 1] == 0xFE  # -448
    zeros_codes, zeros_scale = quantize_fp8(np.zeros((2, 3), np.float16))
    assert zeros_scale[0] == 1 and not zeros_codes.any()
    empty_codes, empty_scale = quantize_fp8(np.zeros((0, 3), np.float32))
    assert empty_codes.shape == (0, 3) and empty_scale[0] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantize_weight_scales_each_row_or_the_tensor_to_448(rng, dtype, per_channel):
    w = random_normal(rng, (13, 29), dtype) * np.geomspace(1e-3, 10, 13)[:, None].astype(dtypes.parse(dtype))
    w[4] = 0  # a row of zeros: scale 1, codes 0
    weight = quantize_weight(w, per_channel=per_channel)
    assert weight.data.dtype == np.uint8 and weight.data.shape == w.shape
    assert weight.scale.dtype == np.float32 and weight.scale.shape == ((13,) if per_channel else (1,))
    values = decode_e4m3(weight.data)
    if per_channel:
        assert weight.scale[4] == 1 and not weight.data[4].any()
        rows = [i for i in range(13) if i != 4]
        np.testing.assert_array_equal(np.abs(values[rows]).max(axis=1), E4M3_MAX)
    else:
        assert np.abs(values).max() == E4M3_MAX
    scale = weight.scale[:, None] if per_channel else weight.scale
    np.testing.assert_array_equal(values.astype(np.float64) * scale.astype(np.float64), ml_dequantized(w, per_channel))


def test_per_channel_weights_stacked_along_their_outputs_stay_exactly_quantised(rng):
    """Q, K and V (or gate and up) concatenated: the codes and scales of each part, concatenated."""
    parts = [random_normal(rng, (n, 24), "fp16", s) for n, s in ((8, 1.0), (5, 0.01), (11, 30.0))]
    stacked = quantize_weight(np.concatenate(parts))
    each = [quantize_weight(p) for p in parts]
    np.testing.assert_array_equal(stacked.data, np.concatenate([e.data for e in each]))
    np.testing.assert_array_equal(stacked.scale, np.concatenate([e.scale for e in each]))


def test_quantize_grids_stay_within_the_kernels_limits():
    partials_max, blocks_max = q8._Q["FP8_MAX_PARTIALS"], q8._Q["FP8_MAX_QUANT_BLOCKS"]
    for total in (1, 255, 256, 257, 10**6, 10**9):
        partials, blocks = q8.quantize_grids(total)
        assert 1 <= partials <= partials_max and 1 <= blocks <= blocks_max
        assert partials == min(math.ceil(total / 256), partials_max)


# --- the reference path ---------------------------------------------------------------------------------------
SHAPES = [(1, 1, 1), (1, 7, 13), (3, 5, 7), (2, 13, 1), (11, 2, 17), (5, 16, 32)]


def draw(rng, M, N, K, dtype, per_channel=True, bias=True, residual=False):
    x = random_normal(rng, (M, K), dtype)
    weight = quantize_weight(random_normal(rng, (N, K), "fp32", 1 / math.sqrt(max(K, 1))), per_channel=per_channel)
    b = random_normal(rng, (N,), dtype) if bias else None
    r = random_normal(rng, (M, N), dtype) if residual else None
    return x, weight, b, r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_reference_is_the_product_of_the_dequantized_values(rng, dtype, activation, shape, per_channel):
    x, weight, b, r = draw(rng, *shape, dtype, per_channel, residual=shape[0] % 2 == 1)
    w64 = decode_e4m3(weight.data).astype(np.float64) * weight.scale.astype(np.float64).reshape(-1, 1)
    expected = oracle(ml_dequantized(x), w64, b, activation, r)
    got = linear_fp8(x, *weight, b, activation, residual=r)
    assert got.dtype == x.dtype and got.shape == expected.shape
    assert rel_error(got, expected) <= ROUNDOFF[dtype]


def test_reference_takes_leading_dimensions_and_strided_inputs(rng):
    x = random_normal(rng, (2, 3, 2 * 9), "fp32")[..., ::2]
    weight = quantize_weight(random_normal(rng, (4, 9), "fp32"))
    r = random_normal(rng, (2, 3, 4), "fp32")
    got = linear_fp8(x, *weight, None, "relu", residual=r)
    expected = linear_fp8(np.ascontiguousarray(x).reshape(6, 9), *weight, None, "relu", residual=r.reshape(6, 4))
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got.reshape(6, 4), expected)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4), (2, 3, 0)], ids=["M0", "N0", "K0"])
def test_reference_of_empty_problems(rng, shape):
    M, N, K = shape
    x, weight, b, r = draw(rng, M, N, K, "fp32", residual=True)
    got = linear_fp8(x, *weight, b, "relu", residual=r)
    assert got.shape == (M, N)
    if K == 0:  # an empty sum: act(b + residual)
        np.testing.assert_array_equal(got, np.maximum(b + r, 0))


def test_nan_and_inf_in_x_make_their_rows_nan_and_leave_the_scale_to_the_finite_values(rng):
    x, weight, b, _ = draw(rng, 4, 6, 8, "fp32")
    clean = linear_fp8(x, *weight, b)
    x[1, 3], x[2, 0] = np.inf, np.nan
    got = linear_fp8(x, *weight, b)
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    np.testing.assert_array_equal(got[[0, 3]], clean[[0, 3]])


def test_a_quantised_mlp_stays_within_a_few_percent_of_the_float_one(rng):
    """The accuracy FP8 costs, measured on the reference path: two layers of U(±1/√K) weights on N(0, 1)
    inputs. E4M3 keeps 3 mantissa bits: a rounding's relative error is up to 2^-4, about 2.7% RMS; each
    GEMM rounds both operands (√2 of it) and two GEMMs compound (√2 again): about 5.4%, held to 8%."""
    float_model = nn.Sequential(nn.Linear(256, 512, activation="relu", seed=1), nn.Linear(512, 128, seed=2))
    x = random_normal(rng, (64, 256), "fp32")
    expected = float_model(x)
    errors = {}
    for per_channel in (True, False):
        model = nn.Sequential(nn.Linear(256, 512, activation="relu", seed=1), nn.Linear(512, 128, seed=2))
        errors[per_channel] = rel_error(model.quantize("fp8", per_channel=per_channel)(x), expected)
    print(f"relative L2 error of the FP8 MLP: per channel {errors[True]:.4f}, per tensor {errors[False]:.4f}")
    assert 0 < errors[True] <= 0.08 and 0 < errors[False] <= 0.08


# --- what the GPU paths take -----------------------------------------------------------------------------------
def problem(**changes) -> LinearFp8Problem:
    fields = dict(M=3, N=32, K=64, dtype="fp16", per_channel=True, has_bias=True, activation=None, device="gpu:0")
    return LinearFp8Problem(**{**fields, **changes})


@pytest.fixture
def capability(monkeypatch):
    """Stand in for the GPU's compute capability (no GPU here): capability.set((9, 0))."""
    class Stand:
        def set(self, cc):
            monkeypatch.setattr(q8, "compute_capability", lambda device_id: cc)
    return Stand()


def test_gpu_paths_refuse_fp8_below_compute_capability_8_9(capability):
    op = get_op("linear_fp8")
    capability.set((8, 0))
    for path in ("cublaslt", "custom"):
        reason = op.paths[path].supports(problem())
        assert reason and "compute capability 8.9 or newer" in reason and "GPU 0 is sm_80" in reason
    with pytest.raises(LibnnError, match=r"Linear.quantize: FP8 \(E4M3\) needs a GPU of compute capability 8.9"):
        require_fp8_gpu("Linear.quantize", 0)
    for cc in ((8, 9), (9, 0), (10, 0)):
        capability.set(cc)
        assert fp8_gpu_missing(0) is None
        assert [op.paths[p].supports(problem()) for p in ("cublaslt", "custom")] == [None, None]


def test_cublaslt_takes_n_and_k_multiples_of_16_and_fp16_or_bf16(capability):
    capability.set((9, 0))
    op = get_op("linear_fp8")
    assert op.paths["cublaslt"].supports(problem(M=1)) is None and op.paths["custom"].supports(problem(N=7, K=5)) is None
    assert "N and K must be multiples of 16" in op.paths["cublaslt"].supports(problem(N=24, K=64))
    assert "N and K must be multiples of 16" in op.paths["cublaslt"].supports(problem(K=40))
    for path in ("cublaslt", "custom"):
        assert "dtype fp32 is not supported (supported: fp16, bf16)" in op.paths[path].supports(problem(dtype="fp32"))


# --- bad input ----------------------------------------------------------------------------------------------------
@pytest.fixture
def args(rng):
    x, weight, b, _ = draw(rng, 4, 3, 8, "fp32")
    return x, weight.data, weight.scale, b


def test_a_float_weight_is_refused_naming_quantize_weight(args, rng):
    x, _, scale, b = args
    with pytest.raises(TypeError, match=r"linear_fp8: w must be a 2-D uint8 array of E4M3 codes .* what quantize_weight returns; "
                                        r"got dtype float32 and shape \(3, 8\)"):
        linear_fp8(x, random_normal(rng, (3, 8), "fp32"), scale, b)


@pytest.mark.parametrize("scale", [np.ones(3, np.float16), np.ones(2, np.float32), np.ones((3, 1), np.float32)],
                         ids=["fp16", "length2", "2d"])
def test_w_scale_must_be_float32_per_tensor_or_per_channel(args, scale):
    x, w, _, b = args
    with pytest.raises(TypeError, match=r"w_scale must be float32 of shape \(1,\) \(per tensor\) or \(3,\)"):
        linear_fp8(x, w, scale, b)


def test_feature_and_shape_mismatches_name_the_argument(args, rng):
    x, w, scale, b = args
    with pytest.raises(ValueError, match=r"linear_fp8: x has 7 features .* but w has 8"):
        linear_fp8(x[:, :7], w, scale, b)
    with pytest.raises(ValueError, match=r"linear_fp8: b must have shape \(3,\) .* got \(4,\)"):
        linear_fp8(x, w, scale, random_normal(rng, (4,), "fp32"))
    with pytest.raises(ValueError, match=r"linear_fp8: residual must have the output's shape \(4, 3\)"):
        linear_fp8(x, w, scale, b, residual=random_normal(rng, (4, 4), "fp32"))
    with pytest.raises(ValueError, match=r"linear_fp8: x must have at least 1 dimension"):
        linear_fp8(np.float32(1.0), w, scale, b)


def test_dtypes_and_activation_are_checked(args):
    x, w, scale, b = args
    with pytest.raises(TypeError, match=r"linear_fp8: b has dtype fp16 but x has fp32"):
        linear_fp8(x, w, scale, b.astype(np.float16))
    with pytest.raises(TypeError, match=r"linear_fp8: x must be a floating-point array .* got int32"):
        linear_fp8(x.astype(np.int32), w, scale)
    with pytest.raises(ValueError, match=re.escape("linear_fp8: activation must be one of (None, 'relu', 'gelu', "
                                                   "'gelu_erf'), got 'silu'")):
        linear_fp8(x, w, scale, b, "silu")


def test_paths_are_checked(args):
    x, w, scale, b = args
    with pytest.raises(ValueError, match=r"linear_fp8: unknown path 'cudnn'"):
        linear_fp8(x, w, scale, b, path="cudnn")
    with pytest.raises(TypeError, match=r"linear_fp8: path 'cublaslt' runs on the GPU, but the arrays are host"):
        linear_fp8(x, w, scale, b, path="cublaslt")


def test_quantizers_refuse_what_they_cannot_quantise(rng):
    with pytest.raises(TypeError, match=r"quantize_weight: w must be a floating-point array .* got int8"):
        quantize_weight(np.ones((2, 3), np.int8))
    with pytest.raises(ValueError, match=r"quantize_weight: w must be 2-D .* got shape \(3,\)"):
        quantize_weight(np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"quantize_weight: per_channel must be True or False, got str 'yes'"):
        quantize_weight(np.ones((2, 3), np.float32), per_channel="yes")
    with pytest.raises(TypeError, match=r"quantize_fp8: x must be a floating-point array .* got uint8"):
        quantize_fp8(np.ones(3, np.uint8))


def test_the_problem_is_public_for_tools(args):
    x, w, scale, b = args
    p = linear_fp8_problem(x, w, scale, b, "gelu")
    assert (p.M, p.N, p.K, p.dtype, p.per_channel, p.has_bias, p.activation, p.device) == \
        (4, 3, 8, "fp32", True, True, "gelu", "cpu")
    assert "per-channel scales" in p.describe() and p.flops == 2 * 4 * 3 * 8


# --- nn.Linear(dtype="fp8") and Module.quantize -----------------------------------------------------------------
def test_linear_fp8_layer_holds_codes_scales_and_an_fp16_bias(rng):
    layer = nn.Linear(24, 10, activation="gelu", dtype="fp8", seed=3)
    assert layer.weight.dtype == np.uint8 and layer.weight.shape == (10, 24)
    assert layer.weight_scale.dtype == np.float32 and layer.weight_scale.shape == (10,)
    assert layer.bias.dtype == np.float16 and layer.quantized == "fp8"
    assert list(layer.state_dict()) == ["weight", "bias", "weight_scale"]
    x = random_normal(rng, (5, 24), "fp16")
    np.testing.assert_array_equal(layer(x), linear_fp8(x, layer.weight, layer.weight_scale, layer.bias, "gelu"))
    assert "quantized='fp8'" in repr(layer)
    # the layer built in fp16 and quantised holds the same values
    same = nn.Linear(24, 10, activation="gelu", dtype="fp16", seed=3).quantize("FP8")
    np.testing.assert_array_equal(same.weight, layer.weight)


def test_quantize_swaps_every_linear_weight_and_keeps_the_rest(rng):
    model = nn.Sequential(nn.Linear(16, 32, activation="relu", seed=1), nn.Linear(32, 8, seed=2))
    version = model.version
    x = random_normal(rng, (3, 16), "fp32")
    assert model.quantize("fp8", per_channel=False) is model and model.version != version
    assert [m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear)] == [np.uint8, np.uint8]
    assert [m.weight_scale.shape for m in model.modules() if isinstance(m, nn.Linear)] == [(1,), (1,)]
    assert all(m.bias.dtype == np.float32 for m in model.modules() if isinstance(m, nn.Linear))
    y = model(x)
    version = model.version
    model.quantize("fp8")  # already quantised: unchanged
    assert model.version == version
    np.testing.assert_array_equal(model(x), y)


def test_to_a_dtype_casts_the_bias_but_keeps_codes_and_scales(rng):
    layer = nn.Linear(8, 4, dtype="fp8", seed=0)
    weight, scale = layer.weight, layer.weight_scale
    layer.to("fp32")
    assert layer.weight is weight and layer.weight_scale is scale and layer.bias.dtype == np.float32
    assert layer(random_normal(rng, (2, 8), "fp32")).dtype == np.float32


def test_state_dict_round_trips_and_float_weights_are_refused(rng):
    layer = nn.Linear(8, 4, dtype="fp8", seed=0)
    other = nn.Linear(8, 4, dtype="fp8", seed=5)
    other.load_state_dict(layer.state_dict())
    x = random_normal(rng, (2, 8), "fp16")
    np.testing.assert_array_equal(other(x), layer(x))
    state = {**layer.state_dict(), "weight": random_normal(rng, (4, 8), "fp16")}
    with pytest.raises(TypeError, match=r"weight holds uint8 codes \(a quantised layer\) but the state has float16"):
        other.load_state_dict(state)
    with pytest.raises(KeyError, match=r"missing keys \['weight_scale'\]"):
        other.load_state_dict(nn.Linear(8, 4, dtype="fp16").state_dict())
    np.testing.assert_array_equal(other(x), layer(x))  # unchanged by the refused loads


def test_quantize_keeps_the_layers_path_where_linear_fp8_has_it():
    assert nn.Linear(8, 4, path="custom").quantize().path == "custom"
    assert nn.Linear(8, 4, path="cudnn").quantize().path == "auto"


def test_bad_quantize_arguments_change_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    state = model.state_dict()
    with pytest.raises(ValueError, match=re.escape("Sequential.quantize: dtype must be one of ('fp8',) (E4M3 weights "
                                                   "with float32 scales), got 'int8'")):
        model.quantize("int8")
    with pytest.raises(TypeError, match=r"Sequential.quantize: per_channel must be True or False, got str 'no'"):
        model.quantize("fp8", per_channel="no")
    assert all(model.state_dict()[k] is v for k, v in state.items())
    with pytest.raises(ValueError, match=r"Linear: dtype 'fp4'"):
        nn.Linear(4, 4, dtype="fp4")


def test_fp8_kernels_take_the_parameters_python_packs():
    """kernels/quantize_fp8.cu and kernels/linear_fp8.cu compiled to PTX against the parameter lists
    Python packs by (tests/test_kernel_contracts.py's check, for these files)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    from test_kernel_contracts import max_threads, mismatches

    launched = [(q8._AMAX, f"fp8_amax_{s}") for s in ("f16", "bf16", "f32")]
    launched += [(q8._QUANTIZE, f"fp8_quantize_{s}") for s in ("f16", "bf16", "f32")]
    launched += [(l8._GEMM, f"fp8_gemm1_tiled_{s}") for s in ("f16", "bf16")]
    launched += [(l8._GEMV, f"fp8_gemv3_{s}") for s in ("f16", "bf16")]
    for declared, kernel in launched:
        assert mismatches(declared, kernel) == [], kernel
    assert max_threads("quantize_fp8.cu", "fp8_quantize_f16") == q8._Q["FP8_THREADS"] == 256
    assert max_threads("linear_fp8.cu", "fp8_gemm1_tiled_f16") == l8._G["FP8_GEMM_THREADS"] == 256
    assert l8._G["FP8_GEMM_BM"] == l8._G["FP8_GEMM_BN"] == 64 and l8._G["FP8_GEMM_BK"] == 32
    assert max_threads("linear_fp8.cu", "fp8_gemv3_f16") == l8._G["FP8_GEMV3_THREADS"] == 256


@pytest.mark.parametrize("M, K, fits", [(1, 36736, True), (1, 36737, False), (8, 4480, True), (8, 4481, False),
                                        (9, 16, False), (3, 1, True)])
def test_the_gemv_takes_up_to_8_rows_whose_codes_fit_its_shared_memory(M, K, fits):
    """x's codes, M rows of K rounded up to 64 then 128, plus 64 bytes, within FP8_GEMV3_XS_BYTES."""
    problem = l8.linear_fp8_problem(np.ones((M, K), np.float16), np.ones((5, K), np.uint8), np.ones(1, np.float32),
                                    None, None)
    assert l8.gemv_fits(problem) is fits


def test_linear_fp8_is_registered_with_its_paths():
    assert [p["path"] for p in libnn.paths("linear_fp8")] == ["cublaslt", "custom", "reference"]
