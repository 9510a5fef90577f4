"""rms_norm on the CPU: the reference against a row-by-row float64 oracle, its rounding, the N = 1, zero
and empty cases, the fused residual (x + residual normalized, the sum returned), the errors bad input
gets, bound calls keyed by the residual and return_sum, and the custom path's choice of kernel version
and launch, with the kernels it launches checked against kernels/rms_norm.cu's compiled entry points
(NVRTC, no GPU)."""

import importlib
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops.rms_norm import rms_norm
from conftest import random_normal, rel_error

rms = importlib.import_module("libnn.ops.rms_norm")  # the module: libnn.ops.rms_norm is the function
ln = importlib.import_module("libnn.ops.layer_norm")

DTYPES = ["fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else [])


def row_oracle(x, weight, eps):
    """Row by row with math.fsum (an exactly rounded sum of squares): independent of the reference's
    NumPy means."""
    rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    N = rows.shape[1]
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        rstd = 1 / math.sqrt(math.fsum(v * v for v in row) / N + eps)
        out[r] = [v * rstd for v in row]
    if weight is not None:
        out *= np.asarray(weight, np.float64)
    return out.reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 16), (4, 129), (6,)], ids=str)
@pytest.mark.parametrize("has_weight", [True, False], ids=["weight", "no-weight"])
def test_reference_matches_row_oracle(rng, shape, has_weight):
    x = random_normal(rng, shape, "fp64", 3.0) + rng.uniform(-5, 5)
    weight = random_normal(rng, (shape[-1],), "fp64") if has_weight else None
    y = rms_norm(x, weight, eps=1e-3)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, row_oracle(x, weight, 1e-3)) <= 1e-12
    assert libnn.get_op("rms_norm").last_decision.path == "reference"


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rounds_once_to_the_input_dtype(rng, dtype):
    x, w = random_normal(rng, (5, 33), dtype) + 10, random_normal(rng, (33,), dtype)
    y = rms_norm(x, w)
    expected = rms_norm(x.astype(np.float64), w.astype(np.float64))
    assert y.dtype == x.dtype and rel_error(y, expected.astype(y.dtype)) == 0


def test_the_default_eps_is_llamas():
    """1e-6, LlamaRMSNorm's default (layer_norm's is 1e-5): visible on a row whose mean square is tiny."""
    x = np.full((1, 4), 1e-3)
    np.testing.assert_allclose(rms_norm(x), row_oracle(x, None, 1e-6), rtol=1e-12)
    assert rel_error(rms_norm(x), row_oracle(x, None, 1e-5)) > 0.1


def test_a_single_feature_is_its_sign_times_the_weight_up_to_eps(rng):
    """N = 1: y = x / sqrt(x² + eps) · w, which is sign(x) · w for |x|² >> eps."""
    x = random_normal(rng, (5, 1), "fp64", 100.0)
    x += 10 * np.sign(x)  # |x| >= 10: x² / (x² + eps) is 1 within 1e-8
    w = random_normal(rng, (1,), "fp64")
    y = rms_norm(x, w, eps=1e-6)
    np.testing.assert_allclose(y, x / np.sqrt(x * x + 1e-6) * w, rtol=1e-14)
    np.testing.assert_allclose(y, np.sign(x) * w, rtol=1e-8)


def test_a_zero_row_normalizes_to_zeros():
    """sqrt(0 + eps) > 0: a row of zeros gives zeros, never NaN."""
    y = rms_norm(np.zeros((2, 9), np.float32), np.ones(9, np.float32))
    np.testing.assert_array_equal(y, np.zeros((2, 9), np.float32))


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_input_gives_an_empty_output(shape):
    y = rms_norm(np.ones(shape, np.float32), np.ones(shape[-1], np.float32))
    assert y.shape == shape and y.dtype == np.float32


# --- the fused residual -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 16), (4, 129), (6,)], ids=str)
def test_residual_is_added_before_normalizing(rng, shape):
    x, r = random_normal(rng, shape, "fp64", 3.0), random_normal(rng, shape, "fp64", 2.0) + rng.uniform(-5, 5)
    weight = random_normal(rng, (shape[-1],), "fp64")
    y = rms_norm(x, weight, residual=r, eps=1e-3)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, row_oracle(x + r, weight, 1e-3)) <= 1e-12
    # float64 in: the add is exact to the last bit either way, so fused and unfused agree bitwise
    np.testing.assert_array_equal(y, rms_norm(x + r, weight, eps=1e-3))


@pytest.mark.parametrize("dtype", ["fp64"] + DTYPES)
def test_return_sum_gives_the_sum_rounded_once_to_the_input_dtype(rng, dtype):
    x, r = random_normal(rng, (4, 3, 40), dtype, 2.0), random_normal(rng, (4, 3, 40), dtype)
    w = random_normal(rng, (40,), dtype)
    y, h = rms_norm(x, w, residual=r, return_sum=True)
    assert h.shape == x.shape and h.dtype == x.dtype and y.dtype == x.dtype
    wide = (lambda a: a.astype(np.float64))
    np.testing.assert_array_equal(h, (wide(x) + wide(r)).astype(x.dtype))
    np.testing.assert_array_equal(y, rms_norm(x, w, residual=r))
    # y normalizes the unrounded sum: exactly the float64 result of x + r, rounded once
    np.testing.assert_array_equal(y, rms_norm(wide(x) + wide(r), wide(w)).astype(x.dtype))


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_input_with_return_sum_gives_two_empty_outputs(shape):
    y, h = rms_norm(np.ones(shape, np.float32), residual=np.full(shape, 2.0, np.float32), return_sum=True)
    assert y.shape == h.shape == shape and y.dtype == h.dtype == np.float32


def test_strided_arrays_are_read_by_value(rng):
    x = random_normal(rng, (6, 10), "fp64")
    r = random_normal(rng, (6, 20), "fp64")[:, ::2]
    w = random_normal(rng, (20,), "fp64")[::2]
    assert not r.flags.c_contiguous and not w.flags.c_contiguous
    expected = row_oracle(x + np.ascontiguousarray(r), np.ascontiguousarray(w), 1e-6)
    assert rel_error(rms_norm(x, w, residual=r), expected) <= 1e-12


def test_bound_calls_are_keyed_by_the_residual_and_return_sum(rng):
    """One x, four calls that differ only in the residual's presence, its signature and return_sum:
    each finds its own bound call (a key without them would hand back the first call's result)."""
    calls = libnn.get_op("rms_norm").calls
    calls.clear()  # no earlier test's bound call may hold one of these signatures
    x, r = random_normal(rng, (3, 16), "fp64"), random_normal(rng, (3, 16), "fp64")
    builds = calls.stats.builds
    plain = rms_norm(x)
    fused = rms_norm(x, residual=r)
    y, h = rms_norm(x, residual=r, return_sum=True)
    strided = rms_norm(x, residual=np.asfortranarray(r))
    assert calls.stats.builds == builds + 4
    assert rel_error(fused, plain) > 1e-2
    np.testing.assert_array_equal(y, fused)
    np.testing.assert_array_equal(strided, fused)
    np.testing.assert_array_equal(h, x + r)
    # the same signatures with new data: no new bound call, new results
    x2, r2 = random_normal(rng, (3, 16), "fp64"), random_normal(rng, (3, 16), "fp64")
    y2, h2 = rms_norm(x2, residual=r2, return_sum=True)
    assert calls.stats.builds == builds + 4
    np.testing.assert_array_equal(h2, x2 + r2)
    assert rel_error(y2, row_oracle(x2 + r2, None, 1e-6)) <= 1e-12
    # eps is part of the signature: a new eps is a new bound call, and honoured
    assert rel_error(rms_norm(x, eps=100.0), row_oracle(x, None, 100.0)) <= 1e-12
    assert calls.stats.builds == builds + 5
    # a residual the checks refuse never finds a bound call
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm(x, residual=r[:, :8])


# --- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(residual=np.ones((3, 7))), ValueError, r"residual must have x's shape \(3, 8\), got \(3, 7\)"),
    (dict(residual=np.ones((1, 8))), ValueError, r"residual must have x's shape \(3, 8\), got \(1, 8\)"),
    (dict(residual=np.ones(8)), ValueError, r"residual must have x's shape \(3, 8\), got \(8,\)"),
    (dict(residual=np.ones((3, 8), np.float32)), TypeError,
     r"residual has dtype fp32 but x has fp64; cast them to one dtype"),
    (dict(residual=[[1.0] * 8] * 3), TypeError, r"residual must be an array .* got builtins.list"),
    (dict(return_sum=True), ValueError, r"return_sum=True returns x \+ residual, but residual is None"),
    (dict(residual=np.ones((3, 8)), return_sum=1), TypeError, r"return_sum must be True or False, got 1"),
    (dict(residual=np.ones((3, 8)), return_sum="yes"), TypeError, r"return_sum must be True or False, got 'yes'"),
])
def test_bad_residual_gets_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match="^rms_norm: " + message):
        rms_norm(np.ones((3, 8)) * np.arange(8), **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(weight=np.ones(7)), ValueError,
     r"weight must have shape \(8,\) to match x's last dimension \(x is \(3, 8\)\), got \(7,\)"),
    (dict(weight=np.ones((1, 8))), ValueError, r"weight must have shape \(8,\) to match x's last dimension"),
    (dict(weight=np.ones(8, np.float32)), TypeError, r"weight has dtype fp32 but x has fp64; cast them to one dtype"),
    (dict(weight=[1.0] * 8), TypeError, r"weight must be an array"),
    (dict(eps=0.0), ValueError, r"eps must be a finite number > 0, got 0.0"),
    (dict(eps=-1e-6), ValueError, r"eps must be a finite number > 0, got -1e-06"),
    (dict(eps=float("nan")), ValueError, r"eps must be a finite number > 0, got nan"),
    (dict(eps=float("inf")), ValueError, r"eps must be a finite number > 0, got inf"),
    (dict(eps="1e-6"), TypeError, r"eps must be a finite number > 0, got str '1e-6'"),
    (dict(eps=None), TypeError, r"eps must be a finite number > 0, got NoneType None"),
    (dict(eps=True), TypeError, r"eps must be a finite number > 0, got bool True"),
    (dict(x=np.float64(3.0)), ValueError, r"x must have at least 1 dimension \(\.\.\., N\), got a 0-d array"),
    (dict(x=np.ones((3, 8), np.int32)), TypeError, r"x must be a floating-point array .* got int32"),
    (dict(x=np.ones((3, 8), np.complex64)), TypeError, r"x must be a floating-point array .* got complex64"),
    (dict(x=[[1.0, 2.0]]), TypeError, r"x must be an array"),
    (dict(path="cudnn"), TypeError, r"path 'cudnn' runs on the GPU, but the arrays are host \(NumPy\) arrays"),
    (dict(path="custom"), TypeError, r"path 'custom' runs on the GPU.*cupy.asarray"),
    (dict(path="triton"), ValueError,
     r"unknown path 'triton'; expected 'auto' or one of \['custom', 'cudnn', 'reference'\]"),
])
def test_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(x=np.ones((3, 8)))
    args.update(kwargs)
    with pytest.raises(error, match="^rms_norm: " + message):
        rms_norm(args.pop("x"), **args)


def test_the_weight_is_keyword_free_and_bias_is_not_an_argument():
    """rms_norm(x, weight) positionally; a bias (layer_norm's third argument) is refused by Python."""
    x = np.ones((2, 4))
    np.testing.assert_array_equal(rms_norm(x, 2 * np.ones(4)), 2 * rms_norm(x))
    with pytest.raises(TypeError):
        rms_norm(x, np.ones(4), np.zeros(4))


def test_auto_tries_custom_then_cudnn_then_reference():
    assert list(libnn.get_op("rms_norm").paths) == ["custom", "cudnn", "reference"]
    assert libnn.get_op("rms_norm").order == ("custom", "cudnn", "reference")


def test_problem_describes_itself_and_counts_its_bytes():
    p = rms.rms_norm_problem(np.ones((2, 3, 8), np.float16), np.ones(8, np.float16), np.ones((2, 3, 8), np.float16),
                             1e-6, True)
    assert (p.M, p.N, p.dtype, p.has_weight, p.has_residual, p.return_sum) == (6, 8, "fp16", True, True, True)
    assert p.describe() == "rms_norm of x + residual, returning the sum M=6 N=8 fp16 eps=1e-06 (weight)"
    assert p.bytes_moved == 4 * 6 * 8 * 2


# --- the custom path's kernel versions ----------------------------------------------------------------
@pytest.mark.parametrize("dtype, N, aligned, version, launch", [
    ("fp16", 4096, True, "rms2_block", ("rms2_block_vec2", 1000, 256)),   # LLaMA-1B's hidden size
    ("bf16", 2048, True, "rms2_block", ("rms2_block_vec2", 1000, 128)),      # 256 groups of 8: 128 threads of 2
    ("fp16", 64, True, "rms1_warp", ("rms1_warp_vec1", 250, 128)),        # a head dimension
    ("fp32", 1000, False, "rms1_warp", ("rms1_warp_sca8", 250, 128)),
    ("fp32", 127, False, "rms1_warp", ("rms1_warp_sca1", 250, 128)),
    ("bf16", 5003, False, "rms3_loop", ("rms3_loop", 1000, 512)),         # past 1024 and not 16-byte groups
    ("fp32", 20000, True, "rms3_loop", ("rms3_loop", 1000, 512)),         # longer than a block holds
])
def test_the_custom_path_picks_the_version_and_launch_of_the_kernel_files_launch_table(dtype, N, aligned, version,
                                                                                        launch):
    p = SimpleNamespace(dtype=dtype, N=N, M=1000)
    assert rms.custom_version(p, aligned) == version
    assert rms._launch(version, p, aligned) == launch


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_rms_norm_and_layer_norm_run_a_row_width_with_the_same_version_and_launch(dtype):
    """Both kernel files build row_kernels.py's versions (kernels/row_norm.cuh's ROW_KERNELS table), so a
    row of width N runs as rms<k>_... where layer_norm runs ln<k>_...."""
    for width in [1, 7, 64, 127, 1000, 1024, 1025, 4096, 5003, 16384, 20000, 32768, 40000]:
        for aligned in (True, False):
            p = SimpleNamespace(dtype=dtype, N=width, M=77)
            versions = rms.custom_versions(p, aligned)
            assert [v.replace("rms", "ln", 1) for v in versions] == list(ln.custom_versions(p, aligned))
            for v in versions:
                name, grid, block = rms._launch(v, p, aligned)
                assert (name.replace("rms", "ln", 1), grid, block) == ln._launch(v.replace("rms", "ln", 1), p, aligned)


def test_the_kernel_parameters_are_read_from_the_kernel_file():
    assert rms._RMS.names == ("x", "res", "w", "y", "s", "M", "N", "eps")
    assert [p.kind for p in rms._RMS.params] == ["ptr"] * 5 + ["i64", "i32", "f32"]


def _launched_kernels() -> set[tuple[str, int]]:
    """(kernel name, block threads) of every launch the custom path can make."""
    found = set()
    for dtype in rms.GPU_DTYPES:
        for N in (1, 7, 64, 100, 127, 200, 300, 500, 768, 1000, 1024, 3000, 4096, 5003, 8192, 12288, 20000, 40000):
            p = SimpleNamespace(dtype=dtype, N=N, M=5)
            for aligned in (True, False):
                for version in rms.custom_versions(p, aligned):
                    name, _, block = rms._launch(version, p, aligned)
                    found.add((f"{name}_{dtypes.KERNEL_SUFFIX[dtype]}", block))
    return found


def test_every_launched_kernel_exists_with_the_declared_parameters_and_fits_its_bounds():
    """Compiled to PTX by NVRTC (no GPU): each kernel the custom path launches is an entry of
    kernels/rms_norm.cu taking RMS_PARAMS' eight parameters (.u64 for pointers and M, .u32 N, .f32
    eps), and its __launch_bounds__ admits the block it is launched with."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    from libnn.runtime import kernels

    ptx = kernels.compile_file("rms_norm.cu", "compute_90").cubin.decode()
    entries = {name: (re.findall(r"\.param\s+\.(\w+)", params), directives)
               for name, params, directives in re.findall(r"\.entry\s+(\w+)\s*\((.*?)\)([^{]*)\{", ptx, re.S)}
    launched = _launched_kernels()
    # per dtype version 1 at VPT 1, 2, 4 (and 8 for fp32) both ways, version 2 at VPT 2, 4, 8, version 3
    assert len({name for name, _ in launched}) == 3 * (6 + 3 + 1) + 2
    for name, block in launched:
        assert name in entries, name
        params, directives = entries[name]
        assert params == ["u64"] * 6 + ["u32", "f32"], (name, params)
        bound = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", directives)
        assert bound and block <= math.prod(int(v) for v in bound.groups()), (name, block)
    assert set(entries) == {name for name, _ in launched}  # and the file exports nothing else
