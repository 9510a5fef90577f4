"""layer_norm on the CPU: the reference against a row-by-row oracle, its numerics under a large mean
offset, the N = 1 and empty cases, the fused residual (x + residual normalized, the sum returned), the
errors bad input gets, bound calls keyed by the residual and return_sum, the custom path's choice of
kernel version and launch, and the LayerNorm layer."""

import importlib
import math
from types import SimpleNamespace

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.nn.norm import LayerNorm
from libnn.ops.layer_norm import layer_norm
from conftest import random_normal, rel_error

ln = importlib.import_module("libnn.ops.layer_norm")  # the module: libnn.ops.layer_norm is the function
emb = importlib.import_module("libnn.ops.embedding")


def row_oracle(x, weight, bias, eps):
    """Row by row with math.fsum (exactly rounded sums): independent of the reference's NumPy means."""
    rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    N = rows.shape[1]
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        mean = math.fsum(row) / N
        var = math.fsum((v - mean) ** 2 for v in row) / N
        out[r] = [(v - mean) / math.sqrt(var + eps) for v in row]
    if weight is not None:
        out *= weight
    if bias is not None:
        out += bias
    return out.reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 16), (4, 129), (6,)], ids=str)
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias", "none"])
def test_reference_matches_row_oracle(rng, shape, affine):
    x = random_normal(rng, shape, "fp64", 3.0) + rng.uniform(-5, 5)
    N = shape[-1]
    weight = random_normal(rng, (N,), "fp64") if "weight" in affine else None
    bias = random_normal(rng, (N,), "fp64") if "bias" in affine else None
    y = layer_norm(x, weight, bias, eps=1e-3)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, row_oracle(x, weight, bias, 1e-3)) <= 1e-12
    assert libnn.get_op("layer_norm").last_decision.path == "reference"


def test_reference_is_not_fooled_by_a_large_mean_offset(rng):
    """A mean 1e4 times the spread: (x - mean)² is taken after the mean, so the variance keeps its digits."""
    x = random_normal(rng, (8, 300), "fp64") + 1e4
    w, b = random_normal(rng, (300,), "fp64"), random_normal(rng, (300,), "fp64")
    assert rel_error(layer_norm(x, w, b), row_oracle(x, w, b, 1e-5)) <= 1e-10
    assert rel_error(layer_norm(x, w, b), layer_norm(x - 1e4, w, b)) <= 1e-10


@pytest.mark.parametrize("dtype", ["fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else []))
def test_reference_rounds_once_to_the_input_dtype(rng, dtype):
    x = random_normal(rng, (5, 33), dtype) + 100
    w, b = random_normal(rng, (33,), dtype), random_normal(rng, (33,), dtype)
    y = layer_norm(x, w, b)
    expected = layer_norm(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    assert y.dtype == x.dtype and rel_error(y, expected.astype(y.dtype)) == 0


def test_a_single_feature_normalizes_to_the_bias(rng):
    """N = 1: x - mean is 0 exactly, so y = bias whatever x and the weight are (and 0 without bias)."""
    x = random_normal(rng, (5, 1), "fp32", 100.0)
    w, b = random_normal(rng, (1,), "fp32"), random_normal(rng, (1,), "fp32")
    np.testing.assert_array_equal(layer_norm(x, w, b), np.broadcast_to(b, (5, 1)))
    np.testing.assert_array_equal(layer_norm(x, w), np.zeros((5, 1), np.float32))


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_input_gives_an_empty_output(shape):
    N = shape[-1]
    y = layer_norm(np.ones(shape, np.float32), np.ones(N, np.float32), np.zeros(N, np.float32))
    assert y.shape == shape and y.dtype == np.float32


# --- the fused residual -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 16), (4, 129), (6,)], ids=str)
@pytest.mark.parametrize("affine", ["weight+bias", "none"])
def test_residual_is_added_before_normalizing(rng, shape, affine):
    x, r = random_normal(rng, shape, "fp64", 3.0) + rng.uniform(-5, 5), random_normal(rng, shape, "fp64", 2.0)
    N = shape[-1]
    weight, bias = (random_normal(rng, (N,), "fp64"), random_normal(rng, (N,), "fp64")) if affine != "none" \
        else (None, None)
    y = layer_norm(x, weight, bias, residual=r, eps=1e-3)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, row_oracle(x + r, weight, bias, 1e-3)) <= 1e-12
    # float64 in, the add is exact to the last bit either way: fused and unfused agree bitwise
    np.testing.assert_array_equal(y, layer_norm(x + r, weight, bias, eps=1e-3))


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else []))
def test_return_sum_gives_the_sum_rounded_once_to_the_input_dtype(rng, dtype):
    x, r = random_normal(rng, (4, 3, 40), dtype, 2.0), random_normal(rng, (4, 3, 40), dtype)
    w, b = random_normal(rng, (40,), dtype), random_normal(rng, (40,), dtype)
    y, h = layer_norm(x, w, b, residual=r, return_sum=True)
    assert h.shape == x.shape and h.dtype == x.dtype and y.dtype == x.dtype
    np.testing.assert_array_equal(h, (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype))
    np.testing.assert_array_equal(y, layer_norm(x, w, b, residual=r))
    # y normalizes the unrounded sum: exactly the float64 result of x + r, rounded once
    wide = (lambda a: a.astype(np.float64))
    np.testing.assert_array_equal(y, layer_norm(wide(x) + wide(r), wide(w), wide(b)).astype(x.dtype))


def test_a_single_feature_with_a_residual_normalizes_to_the_bias(rng):
    x, r = random_normal(rng, (5, 1), "fp32", 100.0), random_normal(rng, (5, 1), "fp32", 10.0)
    w, b = random_normal(rng, (1,), "fp32"), random_normal(rng, (1,), "fp32")
    y, h = layer_norm(x, w, b, residual=r, return_sum=True)
    np.testing.assert_array_equal(y, np.broadcast_to(b, (5, 1)))
    np.testing.assert_array_equal(h, x + r)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_input_with_return_sum_gives_two_empty_outputs(shape):
    x = np.ones(shape, np.float32)
    y, h = layer_norm(x, residual=np.full(shape, 2.0, np.float32), return_sum=True)
    assert y.shape == h.shape == shape and y.dtype == h.dtype == np.float32


def test_a_strided_residual_is_read_by_value(rng):
    x = random_normal(rng, (6, 10), "fp64")
    wide = random_normal(rng, (6, 20), "fp64")
    r = wide[:, ::2]
    assert not r.flags.c_contiguous
    np.testing.assert_array_equal(layer_norm(x, residual=r), layer_norm(x + np.ascontiguousarray(r)))


def test_bound_calls_are_keyed_by_the_residual_and_return_sum(rng):
    """One x, four calls that differ only in the residual's presence, its signature and return_sum:
    each finds its own bound call (a key without them would hand back the first call's result)."""
    calls = libnn.get_op("layer_norm").calls
    calls.clear()  # no earlier test's bound call may hold one of these signatures
    x = random_normal(rng, (3, 16), "fp64")
    r = random_normal(rng, (3, 16), "fp64")
    builds = calls.stats.builds
    plain = layer_norm(x)
    fused = layer_norm(x, residual=r)
    y, h = layer_norm(x, residual=r, return_sum=True)
    strided = layer_norm(x, residual=np.asfortranarray(r))
    assert calls.stats.builds == builds + 4
    assert rel_error(fused, plain) > 1e-2
    np.testing.assert_array_equal(y, fused)
    np.testing.assert_array_equal(strided, fused)
    np.testing.assert_array_equal(h, x + r)
    # the same signatures with new data: no new bound call, new results
    x2, r2 = random_normal(rng, (3, 16), "fp64"), random_normal(rng, (3, 16), "fp64")
    y2, h2 = layer_norm(x2, residual=r2, return_sum=True)
    assert calls.stats.builds == builds + 4
    np.testing.assert_array_equal(h2, x2 + r2)
    assert rel_error(y2, row_oracle(x2 + r2, None, None, 1e-5)) <= 1e-12
    # a residual the checks refuse never finds a bound call
    with pytest.raises(ValueError, match="residual must have x's shape"):
        layer_norm(x, residual=r[:, :8])


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(residual=np.ones((3, 7))), ValueError, r"residual must have x's shape \(3, 8\), got \(3, 7\)"),
    (dict(residual=np.ones((1, 8))), ValueError, r"residual must have x's shape \(3, 8\), got \(1, 8\)"),
    (dict(residual=np.ones(8)), ValueError, r"residual must have x's shape \(3, 8\), got \(8,\)"),
    (dict(residual=np.ones((3, 8), np.float32)), TypeError,
     r"residual has dtype fp32 but x has fp64; cast them to one dtype"),
    (dict(residual=[[1.0] * 8] * 3), TypeError, r"residual must be an array .* got builtins.list"),
    (dict(return_sum=True), ValueError, r"return_sum=True returns x \+ residual, but residual is None"),
    (dict(residual=np.ones((3, 8)), return_sum=1), TypeError, r"return_sum must be True or False, got 1"),
    (dict(residual=np.ones((3, 8)), return_sum=[True]), TypeError, r"return_sum must be True or False, got \[True\]"),
])
def test_bad_residual_gets_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match="layer_norm: " + message):
        layer_norm(np.ones((3, 8)) * np.arange(8), **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(weight=np.ones(7)), ValueError,
     r"weight must have shape \(8,\) to match x's last dimension \(x is \(3, 8\)\), got \(7,\)"),
    (dict(bias=np.ones((1, 8))), ValueError, r"bias must have shape \(8,\) to match x's last dimension"),
    (dict(weight=np.ones(8, np.float32)), TypeError, r"weight has dtype fp32 but x has fp64; cast them to one dtype"),
    (dict(bias=np.ones(8, np.float16)), TypeError, r"bias has dtype fp16 but x has fp64"),
    (dict(eps=0.0), ValueError, r"eps must be a finite number > 0, got 0.0"),
    (dict(eps=-1e-5), ValueError, r"eps must be a finite number > 0, got -1e-05"),
    (dict(eps=float("nan")), ValueError, r"eps must be a finite number > 0, got nan"),
    (dict(eps="1e-5"), TypeError, r"eps must be a finite number > 0, got str '1e-5'"),
    (dict(x=np.float64(3.0)), ValueError, r"x must have at least 1 dimension \(\.\.\., N\), got a 0-d array"),
    (dict(x=np.ones((3, 8), np.int32)), TypeError, r"x must be a floating-point array .* got int32"),
    (dict(x=[[1.0, 2.0]]), TypeError, r"x must be an array"),
    (dict(path="cudnn"), TypeError, r"path 'cudnn' runs on the GPU, but the arrays are host \(NumPy\) arrays"),
    (dict(path="custom"), TypeError, r"path 'custom' runs on the GPU.*cupy.asarray"),
    (dict(path="triton"), ValueError,
     r"unknown path 'triton'; expected 'auto' or one of \['custom', 'cudnn', 'reference'\]"),
])
def test_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(x=np.ones((3, 8)))
    args.update(kwargs)
    with pytest.raises(error, match="layer_norm: " + message):
        layer_norm(args.pop("x"), **args)


def test_auto_tries_custom_then_cudnn_then_reference():
    assert list(libnn.get_op("layer_norm").paths) == ["custom", "cudnn", "reference"]


# --- the layer ----------------------------------------------------------------------------------------
def test_layer_has_pytorch_parameters_and_initial_values():
    layer = LayerNorm(6)
    state = layer.state_dict()
    assert set(state) == {"weight", "bias"}
    assert state["weight"].shape == (6,) and state["bias"].shape == (6,)
    np.testing.assert_array_equal(layer.weight, np.ones(6, np.float32))
    np.testing.assert_array_equal(layer.bias, np.zeros(6, np.float32))
    assert set(LayerNorm((6,), bias=False).state_dict()) == {"weight"}
    assert LayerNorm(6, elementwise_affine=False).state_dict() == {}


def test_layer_computes_layer_norm_with_its_parameters(rng):
    layer = LayerNorm(12, eps=1e-3, dtype="fp64")
    layer.load_state_dict({"weight": random_normal(rng, (12,), "fp64"), "bias": random_normal(rng, (12,), "fp64")})
    x = random_normal(rng, (2, 3, 12), "fp64")
    assert rel_error(layer(x), row_oracle(x, layer.weight, layer.bias, 1e-3)) <= 1e-12
    plain = LayerNorm(12, elementwise_affine=False, dtype="fp64")
    assert rel_error(plain(x), row_oracle(x, None, None, 1e-5)) <= 1e-12


def test_layer_state_dict_round_trips_and_checks_shapes(rng):
    a, b = LayerNorm(4), LayerNorm(4)
    a.load_state_dict({"weight": random_normal(rng, (4,), "fp32"), "bias": random_normal(rng, (4,), "fp32")})
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.weight, b.weight)
    np.testing.assert_array_equal(a.bias, b.bias)
    with pytest.raises(ValueError, match=r"weight has shape \(5,\), the layer expects \(4,\)"):
        b.load_state_dict({"weight": np.ones(5, np.float32), "bias": np.zeros(4, np.float32)})


def test_layer_to_dtype_casts_its_parameters():
    layer = LayerNorm(3).to("fp16")
    assert layer.weight.dtype == np.float16 and layer.bias.dtype == np.float16


@pytest.mark.parametrize("normalized_shape", [(2, 3), (), 0, "8"])
def test_layer_rejects_what_it_cannot_normalize(normalized_shape):
    with pytest.raises(ValueError, match=r"LayerNorm: normalized_shape must be N or \(N,\) with N >= 1"):
        LayerNorm(normalized_shape)


def test_layer_rejects_eps_not_above_zero():
    with pytest.raises(ValueError, match=r"LayerNorm: eps must be > 0, got 0"):
        LayerNorm(4, eps=0)


def test_layer_repr_names_its_configuration():
    assert repr(LayerNorm(768, eps=1e-12, bias=False, path="custom")) == (
        "LayerNorm((768,), eps=1e-12, elementwise_affine=True, bias=False, path='custom')")


@pytest.mark.parametrize("dtype, N, aligned, version, launch", [
    ("fp16", 768, True, "ln1_warp", ("ln1_warp_vec4", 250, 128)),       # 96 groups of 8: 4 a lane
    ("fp32", 1000, False, "ln1_warp", ("ln1_warp_sca8", 250, 128)),      # fp32 builds VPT 8 to reach 1024
    ("bf16", 4096, True, "ln2_block", ("ln2_block_vec2", 1000, 256)),    # 512 groups: 256 threads of 2
    ("fp16", 20000, True, "ln2_block", ("ln2_block_vec8", 1000, 320)),
    ("fp16", 4100, False, "ln3_loop", ("ln3_loop", 1000, 512)),          # past 1024 and not 16-byte groups
    ("fp32", 20000, True, "ln3_loop", ("ln3_loop", 1000, 512)),          # longer than a block holds
])
def test_the_custom_path_picks_the_version_and_launch_of_the_kernel_files_launch_table(dtype, N, aligned, version,
                                                                                        launch):
    p = SimpleNamespace(dtype=dtype, N=N, M=1000)
    assert ln.custom_version(p, aligned) == version
    assert ln._launch(version, p, aligned) == launch


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_layer_norm_and_embedding_run_a_row_width_with_the_same_version_and_launch(dtype):
    """Both kernel files build the same versions (kernels/row_norm.cuh); libnn/ops/row_kernels.py picks
    for both, so a row of width N runs as ln<k>_... and as emb<k>_... alike."""
    for width in [1, 7, 64, 100, 768, 1024, 1025, 3000, 4096, 8192, 16384, 20000, 32768, 40000]:
        for aligned in (True, False):
            p_ln, p_emb = SimpleNamespace(dtype=dtype, N=width, M=77), SimpleNamespace(dtype=dtype, H=width, M=77)
            versions = ln.custom_versions(p_ln, aligned)
            assert [v.replace("ln", "emb", 1) for v in versions] == list(emb.custom_versions(p_emb, aligned))
            assert ln.custom_version(p_ln, aligned).replace("ln", "emb", 1) == emb.custom_version(p_emb, aligned)
            for v in versions:
                name, grid, block = ln._launch(v, p_ln, aligned)
                assert (name.replace("ln", "emb", 1), grid, block) == \
                    emb._launch(v.replace("ln", "emb", 1), p_emb, aligned)
