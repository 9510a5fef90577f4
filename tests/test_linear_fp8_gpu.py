"""linear_fp8 on the GPU: the activation quantiser against its NumPy twin bit for bit; every GPU path
against the float64 reference computed from the same dequantised values, on odd shapes (custom) and the
shapes cuBLASLt's FP8 GEMMs take (N and K multiples of 16, any M), with and without a residual, per-channel
and per-tensor weights, outputs poisoned; bound calls that read each call's weights and scales; NaN and
inf rows; a misaligned weight falling back from cuBLASLt; CUDA-graph capture, the scale recomputed at
every replay; nn.Linear(dtype="fp8") and quantize() on a transformer layer; the refusal below sm_89.

Tolerances: relative L2 error 1e-2 for fp16 and bf16 outputs (libnn.dtypes.TOLERANCE), or the same
relative to the size of the summed terms (|x|·|W|ᵀ + |b| + |r| of the dequantised operands) where the
terms cancel. The reference quantises x exactly as the GPU does (tested here bit for bit), so the paths
differ from it only by fp32 accumulation and the output's rounding."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from libnn import dtypes, nn
from libnn.errors import FallbackWarning, LibnnError, LibraryError, NoPathError
from libnn.ops.linear_fp8 import dequantized, linear_fp8
from libnn.ops.quantize_fp8 import bind_quantize, quantize_fp8, quantize_weight
from libnn.registry import get_op
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu
q8 = importlib.import_module("libnn.ops.quantize_fp8")

GPU_DTYPES = ["fp16", "bf16"]
# (M, N, K): cuBLASLt's FP8 GEMMs take N and K multiples of 16 (M is free: decode's M = 1 included)
CUBLASLT_SHAPES = [(1, 16, 16), (1, 2048, 512), (3, 32, 48), (17, 48, 64), (130, 96, 80), (256, 384, 1024),
                   (1000, 1024, 512)]
# the custom path takes any shape: 1, primes, K not a multiple of 8 (byte loads), multiples (8-byte loads)
CUSTOM_SHAPES = [(1, 1, 1), (1, 7, 13), (13, 1, 129), (3, 5, 7), (17, 31, 64), (127, 257, 63), (64, 128, 256),
                 (130, 96, 80), (257, 100, 1003)]
EPILOGUES = [(False, None), (True, None), (True, "relu"), (True, "gelu"), (False, "gelu"), (True, "gelu_erf")]


def to_gpu(*arrays):
    import cupy
    return [None if a is None else cupy.asarray(a) for a in arrays]


def draw(rng, M, N, K, dtype, per_channel=True, bias=True, residual=False):
    """Host inputs: x N(0, 1), the weight N(0, 1/K) with rows of different sizes (per-channel scales then
    differ), quantised; bias and residual N(0, 1)."""
    x = random_normal(rng, (M, K), dtype)
    w = random_normal(rng, (N, K), "fp32", 1 / math.sqrt(K)) * np.geomspace(0.1, 10, N)[:, None].astype(np.float32)
    weight = quantize_weight(w, per_channel=per_channel)
    b = random_normal(rng, (N,), dtype) if bias else None
    r = random_normal(rng, (M, N), dtype) if residual else None
    return x, weight, b, r


def conditioned_error(y, expected, x, weight, b, r) -> float:
    """‖y − expected‖ / ‖|xd|·|wd|ᵀ + |b| + |r|‖ over the dequantised operands: the error relative to the
    terms summed, what a correctly rounded dot product meets when the terms cancel."""
    xq, x_scale = quantize_fp8(x)
    scale = np.abs(dequantized(xq, x_scale)) @ np.abs(dequantized(*weight)).T
    scale = scale + (0 if b is None else np.abs(b.astype(np.float64))) + (0 if r is None else np.abs(r.astype(np.float64)))
    got = y.get().astype(np.float64)
    if not np.isfinite(got).all():
        return np.inf
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(scale), 1e-300))


def check(y, expected, x, weight, b, r, dtype):
    assert y.shape == expected.shape and y.dtype == dtypes.parse(dtype)
    tolerance = dtypes.TOLERANCE[dtype]
    assert rel_error(y, expected) <= tolerance or conditioned_error(y, expected, x, weight, b, r) <= tolerance


def run_path(path, x, weight, b, activation, r=None):
    """linear_fp8 on the GPU on `path`; a per-channel problem cuBLASLt declines (its outer-vector scaling
    is cuBLAS 12.9+, and not every epilogue or GPU has a kernel for it) is an expected failure, reported."""
    try:
        return linear_fp8(*to_gpu(x, *weight, b), activation, residual=to_gpu(r)[0], path=path)
    except LibraryError as exc:
        if path == "cublaslt" and weight.scale.shape[0] > 1:
            pytest.xfail(f"cuBLASLt declines per-channel (outer-vector) FP8 scaling here: {exc}")
        raise


# --- the quantiser -----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (257, 1000), (1000, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_quantizer_matches_numpy_bit_for_bit(rng, dtype, shape):
    """kernels/quantize_fp8.cu against quantize_fp8's NumPy path: the same scale and the same codes, on
    values of every magnitude (subnormal codes, ties, saturation) and with NaN and ±inf among them. The
    largest shape has more elements than one grid-stride pass of either kernel covers."""
    import cupy

    x = (rng.standard_normal(shape) * np.exp2(rng.uniform(-20, 12, shape))).astype(dtypes.parse(dtype))
    flat = x.reshape(-1)
    if flat.size >= 7:
        flat[[1, 3, 5]] = [np.nan, np.inf, -np.inf]
    codes, scale = quantize_fp8(cupy.asarray(x))
    expected_codes, expected_scale = quantize_fp8(x)
    assert codes.dtype == cupy.uint8 and codes.shape == x.shape and scale.dtype == cupy.float32
    assert scale.get().view(np.uint32)[0] == expected_scale.view(np.uint32)[0]
    np.testing.assert_array_equal(codes.get(), expected_codes)


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_gpu_quantizer_writes_its_scale_as_many_times_as_asked(rng):
    import cupy

    x = cupy.asarray(random_normal(rng, (9, 40), "bf16", 5.0))
    run, scale = bind_quantize("bf16", x.size, 9)
    q = cupy.empty(x.shape, cupy.uint8)
    run(x, q)
    _, expected = quantize_fp8(x.get())
    np.testing.assert_array_equal(scale.get(), np.full(9, expected[0], np.float32))


@pytest.mark.parametrize("per_channel", [True, False])
def test_weights_quantised_on_the_gpu_equal_the_hosts(rng, per_channel):
    import cupy

    w = random_normal(rng, (67, 130), "bf16") * np.geomspace(1e-3, 1e3, 67)[:, None].astype(dtypes.bfloat16)
    on_gpu, on_host = quantize_weight(cupy.asarray(w), per_channel=per_channel), quantize_weight(w, per_channel=per_channel)
    np.testing.assert_array_equal(on_gpu.data.get(), on_host.data)
    np.testing.assert_array_equal(on_gpu.scale.get(), on_host.scale)


# --- every GPU path against the reference --------------------------------------------------------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: "+".join(filter(None, ["bias" if e[0] else None, e[1]]))
                         or "plain")
@pytest.mark.parametrize("path,shape", [("cublaslt", s) for s in CUBLASLT_SHAPES] + [("custom", s) for s in CUSTOM_SHAPES],
                         ids=[f"cublaslt-{'x'.join(map(str, s))}" for s in CUBLASLT_SHAPES]
                         + [f"custom-{'x'.join(map(str, s))}" for s in CUSTOM_SHAPES])
def test_gpu_path_matches_reference(rng, path, shape, epilogue, dtype, per_channel):
    bias, activation = epilogue
    x, weight, b, _ = draw(rng, *shape, dtype, per_channel, bias)
    expected = linear_fp8(x, *weight, b, activation, path="reference").astype(np.float64)
    y = run_path(path, x, weight, b, activation)
    check(y, expected, x, weight, b, None, dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu_erf"])
@pytest.mark.parametrize("path,shape", [("cublaslt", (5, 64, 32)), ("cublaslt", (1, 32, 128)), ("custom", (5, 7, 9)),
                                        ("custom", (33, 64, 32))], ids=["cublaslt-5x64x32", "cublaslt-1x32x128",
                                                                        "custom-5x7x9", "custom-33x64x32"])
def test_gpu_path_adds_the_residual_before_the_activation(rng, path, shape, activation, dtype, per_channel):
    x, weight, b, r = draw(rng, *shape, dtype, per_channel, residual=True)
    expected = linear_fp8(x, *weight, b, activation, residual=r, path="reference").astype(np.float64)
    y = run_path(path, x, weight, b, activation, r)
    check(y, expected, x, weight, b, r, dtype)


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_leading_dimensions_and_strided_inputs(rng, path):
    import cupy

    x, weight, b, _ = draw(rng, 6, 32, 48, "fp16", per_channel=False)
    x3 = cupy.asarray(np.concatenate([x, x], axis=1).reshape(2, 3, 96))[..., ::2]  # (2, 3, 48), strided
    r = random_normal(rng, (2, 3, 32), "fp16")
    y = linear_fp8(x3, *to_gpu(*weight, b), "relu", residual=cupy.asarray(r), path=path)
    expected = linear_fp8(x3.get(), *weight, b, "relu", residual=r, path="reference").astype(np.float64)
    assert y.shape == (2, 3, 32)
    check(y.reshape(6, 32), expected.reshape(6, 32), np.ascontiguousarray(x3.get()).reshape(6, 48), weight, b,
          r.reshape(6, 32), "fp16")


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_a_bound_call_reads_each_calls_weights_scales_and_bias(rng, path):
    """Two layers of one shape through one bound call (same signature), alternately: every call reads
    its own weight, weight scale, bias and the scale of its own x (cuBLASLt: descriptor pointers reset)."""
    layers = [draw(rng, 9, 32, 64, "bf16", per_channel=False) for _ in range(2)]
    layers[1][0][:] = layers[1][0] * 50  # a different activation scale too
    op = get_op("linear_fp8")
    for x, weight, b, _ in layers + layers:
        builds = op.calls.stats.builds
        y = linear_fp8(*to_gpu(x, *weight, b), path=path)
        check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "bf16")
    assert op.calls.stats.builds == builds  # the last call bound nothing


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_nan_and_inf_rows_are_nan_and_the_others_exact(rng, path):
    x, weight, b, _ = draw(rng, 4, 32, 64, "fp16", per_channel=False)
    x[1, 7], x[2, 0] = np.inf, np.nan
    y = linear_fp8(*to_gpu(x, *weight, b), path=path).get()
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    expected = linear_fp8(x, *weight, b, path="reference").astype(np.float64)
    assert rel_error(y[[0, 3]], expected[[0, 3]]) <= dtypes.TOLERANCE["fp16"]


def test_auto_runs_cublaslt_where_it_can_and_custom_otherwise(rng):
    op = get_op("linear_fp8")
    x, weight, b, _ = draw(rng, 130, 64, 128, "fp16", per_channel=False)
    linear_fp8(*to_gpu(x, *weight, b))
    assert op.last_decision.path == "cublaslt"
    x, weight, b, _ = draw(rng, 1, 64, 128, "fp16", per_channel=False)  # decode-sized: the GEMV first
    y = linear_fp8(*to_gpu(x, *weight, b))
    assert op.last_decision.path == "custom"
    assert op.last_decision.passed_over["cublaslt"].startswith("tried last: decode-sized M")
    check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "fp16")
    x, weight, b, _ = draw(rng, 7, 60, 128, "fp16", per_channel=False)
    y = linear_fp8(*to_gpu(x, *weight, b))
    assert op.last_decision.path == "custom" and "multiples of 16" in op.last_decision.passed_over["cublaslt"]
    check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "fp16")


# the decode GEMV: at M = 1 with K % 16 == 0 up to 24576, kernels/gemv.cu's E4M3 kernel (one row and K = 4112
# past its first 4096-code batch; its largest K), else kernels/linear_fp8.cu version 3 (M <= 8, M rows of x's
# codes within its shared memory): 16-byte loads (K % 16 == 0; K = 516 ends in a partial chunk), byte loads
# (K % 16 != 0, or the weight one byte off), the largest K at M = 1 and at M = 8, N not a multiple of the 16-row
# tile, a decode step's shapes
GEMV_SHAPES = [(1, 2048, 2048), (1, 64, 8192), (1, 3, 36736), (8, 33, 4480), (8, 33, 1024), (2, 19, 6), (5, 9, 45),
               (3, 257, 516), (2, 100, 5000), (3, 70, 1040), (1, 1, 1), (1, 7, 16), (1, 131, 4112), (1, 1, 48),
               (1, 5, 24576)]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("epilogue", [(True, "gelu_erf", True), (False, None, False), (True, "relu", False)],
                         ids=["bias+residual+gelu_erf", "plain", "bias+relu"])
def test_gemv_matches_reference(rng, dtype, shape, per_channel, epilogue):
    from libnn.ops.linear_fp8 import gemv_fits, linear_fp8_problem

    bias, activation, residual = epilogue
    x, weight, b, r = draw(rng, *shape, dtype, per_channel=per_channel, bias=bias, residual=residual)
    xg, wg, sg, bg, rg = to_gpu(x, *weight, b, r)
    assert gemv_fits(linear_fp8_problem(xg, wg, sg, bg, activation, rg))
    y = linear_fp8(xg, wg, sg, bg, activation, residual=rg, path="custom")
    check(y, linear_fp8(x, *weight, b, activation, residual=r, path="reference").astype(np.float64), x, weight, b, r,
          dtype)


def e4m3_ties() -> np.ndarray:
    """Every finite E4M3 value up to 448 and every midpoint between two neighbours (round half to even
    decides them), both signs, and -0: exact in fp16 and bf16."""
    from libnn.ops.quantize_fp8 import decode_e4m3

    values = np.unique(decode_e4m3(np.arange(0x7f, dtype=np.uint8)).astype(np.float64))
    magnitudes = np.concatenate([values, (values[:-1] + values[1:]) / 2])
    return np.concatenate([magnitudes, -magnitudes, [-0.0]])


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("spread", ["ties", "ties x3", "normal"])
@pytest.mark.parametrize("kernel", ["gemv.cu", "linear_fp8.cu"])
def test_gemv_codes_x_as_the_quantiser_does(rng, dtype, spread, kernel):
    """The GEMV quantises x itself (a reciprocal with two FMA corrections in place of the division, the
    hardware's E4M3 conversion): with an identity weight of scale 1, y is x's dequantised codes, which
    must be the quantiser's. A code one step off moves its element by 1/16 or more; the comparison allows
    an fp16 rounding of the product sx · value. "ties" has max |x| = 448, so sx = 1 and the quotient is x
    itself: it tests the conversion's rounding. "ties x3" (exact in fp16 and bf16: 7 significant bits at
    most) has sx = 3, whose reciprocal is inexact, so every quotient lands on its tie only through the
    corrections. Both decode GEMVs: K padded with zeros to a multiple of 16 for kernels/gemv.cu, and to
    one past it for version 3."""
    from libnn.ops.linear_fp8 import gemv_fits, linear_fp8_problem

    ties = e4m3_ties()
    values = rng.standard_normal(1000) * 3.7 if spread == "normal" else ties * (3 if spread == "ties x3" else 1)
    values = np.concatenate([values, np.zeros(-len(values) % 16 + (kernel == "linear_fp8.cu"))])
    x = values.astype(dtypes.parse(dtype))[None, :]
    assert spread == "normal" or np.array_equal(x[0].astype(np.float64), values)   # the ties survive the cast
    K = x.shape[1]
    codes = np.zeros((K, K), np.uint8)
    np.fill_diagonal(codes, 0x38)   # E4M3 1.0
    scale = np.ones(1, np.float32)
    xg, wg, sg = to_gpu(x, codes, scale)
    assert gemv_fits(linear_fp8_problem(xg, wg, sg, None, None, None))
    y = linear_fp8(xg, wg, sg, path="custom").get()
    expected = linear_fp8(x, codes, scale, path="reference")
    np.testing.assert_allclose(y.astype(np.float64), expected.astype(np.float64), rtol=2 ** -9, atol=0)


@pytest.mark.parametrize("kernel, K", [("gemv.cu", 64), ("linear_fp8.cu", 72)])
def test_gemv_rows_with_nan_or_inf_are_nan(rng, kernel, K):
    """At one row, with a NaN or an inf (quantised to NaN) in x, every output is NaN; the same weight
    and a finite x give finite outputs."""
    x, weight, b, _ = draw(rng, 1, 32, K, "fp16", per_channel=True)
    y = linear_fp8(*to_gpu(x, *weight, b), path="custom").get()
    check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "fp16")
    for bad in (np.inf, np.nan):
        x[0, K // 3] = bad
        assert np.isnan(linear_fp8(*to_gpu(x, *weight, b), path="custom").get()).all()


def test_gemv_at_one_row_with_a_weight_one_byte_off(rng):
    """A weight whose rows are not on 16 bytes runs version 3 (byte loads), not kernels/gemv.cu."""
    import cupy

    from libnn.ops.linear_fp8 import bind_decode_gemv_kernel

    x, weight, b, _ = draw(rng, 1, 40, 64, "fp16")
    buffer = cupy.zeros(40 * 64 + 16, cupy.uint8)
    w = buffer[1:1 + 40 * 64].reshape(40, 64)
    w[...] = cupy.asarray(weight.data)
    aligned = buffer[:40 * 64].reshape(40, 64)
    assert "linear_fp8.cu" in bind_decode_gemv_kernel("fp16", 1, 40, 64, True, None, "gpu:0", w).name
    assert "gemv.cu" in bind_decode_gemv_kernel("fp16", 1, 40, 64, True, None, "gpu:0", aligned).name
    y = linear_fp8(cupy.asarray(x), w, cupy.asarray(weight.scale), cupy.asarray(b), path="custom")
    check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "fp16")


def test_gemv_reads_a_weight_one_byte_off_and_strided_x(rng):
    import cupy

    x, weight, b, _ = draw(rng, 3, 40, 64, "bf16")
    buffer = cupy.zeros(40 * 64 + 16, cupy.uint8)
    w = buffer[1:1 + 40 * 64].reshape(40, 64)  # byte loads
    w[...] = cupy.asarray(weight.data)
    x_wide = cupy.asarray(np.concatenate([x, x], axis=1))[:, ::2]  # strided: copied to a contiguous (M, K)
    x_host = x_wide.get()
    y = linear_fp8(x_wide, w, cupy.asarray(weight.scale), cupy.asarray(b), "gelu", path="custom")
    expected = linear_fp8(x_host, *weight, b, "gelu", path="reference").astype(np.float64)
    check(y, expected, x_host, weight, b, None, "bf16")


@pytest.mark.parametrize("K", [64, 72], ids=["gemv.cu", "version 3"])
def test_the_decode_gemv_takes_a_strided_weight_and_scale(rng, K):
    """One row, w every other row of a larger weight and w_scale every other value: both copied in the call,
    which the GEMV then waits for (launched plainly, not programmatically: tests/test_launch_programmatic.py)."""
    import cupy

    x, weight, b, _ = draw(rng, 1, 40, K, "fp16")
    w = cupy.asarray(np.repeat(weight.data, 2, axis=0))[::2]
    scale = cupy.asarray(np.repeat(weight.scale, 2))[::2]
    y = linear_fp8(cupy.asarray(x), w, scale, cupy.asarray(b), path="custom")
    check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "fp16")


def test_a_misaligned_weight_falls_back_from_cublaslt_to_custom(rng):
    import cupy

    x, weight, b, _ = draw(rng, 130, 32, 64, "fp16", per_channel=False)  # past the GEMV's M: cuBLASLt first
    buffer = cupy.zeros(32 * 64 + 16, cupy.uint8)
    w = buffer[1:1 + 32 * 64].reshape(32, 64)  # one byte past an aligned start
    w[...] = cupy.asarray(weight.data)
    x_gpu, scale, b_gpu = to_gpu(x, weight.scale, b)
    with pytest.raises(LibraryError, match="16-byte aligned buffers; w is not"):
        linear_fp8(x_gpu, w, scale, b_gpu, path="cublaslt")
    with pytest.warns(FallbackWarning, match="path 'cublaslt' failed"):
        y = linear_fp8(x_gpu, w, scale, b_gpu)
    assert get_op("linear_fp8").last_decision.path == "custom"
    check(y, linear_fp8(x, *weight, b, path="reference").astype(np.float64), x, weight, b, None, "fp16")


# --- layers, graphs, refusal ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_graph_replay_quantises_each_new_input(rng, path):
    """The activation scale is computed on the GPU at every replay, not baked into the capture: a replay
    on inputs 40 times larger still matches eager calls. (Per-tensor weight scales: the per-channel
    cuBLASLt kernels are test_gpu_path_matches_reference's.)"""
    import cupy

    layer = nn.Linear(64, 48, activation="gelu", dtype="fp16", device="gpu", path=path, seed=7)
    layer.quantize("fp8", per_channel=False)
    graphed = layer.graphed()
    for scale in (1.0, 40.0, 1.0):
        x = cupy.asarray(random_normal(rng, (6, 64), "fp16", scale))
        replayed = graphed(x).copy()
        assert rel_error(replayed, layer(x).get()) <= dtypes.TOLERANCE["fp16"]
        expected = linear_fp8(x.get(), layer.weight.get(), layer.weight_scale.get(), layer.bias.get(), "gelu",
                              path="reference").astype(np.float64)
        assert rel_error(replayed, expected) <= dtypes.TOLERANCE["fp16"]
    assert [s.replays for s in graphed.stats().values()] == [3]  # one signature: captured once


@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_a_quantised_transformer_layer_stays_close_to_its_float_self(rng, dtype):
    """TransformerEncoderLayer.quantize("fp8"): out_proj, linear1 and linear2 on FP8 (the packed in_proj
    stays a float weight of its own), within 5% of the unquantised layer."""
    import cupy

    def layer():
        return nn.TransformerEncoderLayer(128, 4, 256, activation="gelu", dtype=dtype, device="gpu", seed=3)
    x = cupy.asarray(random_normal(rng, (2, 33, 128), dtype))
    expected = layer()(x).get()
    quantised = layer().quantize("fp8")
    assert {type(m).__name__ for m in quantised.modules() if getattr(m, "quantized", None)} == {"Linear"}
    error = rel_error(quantised(x), expected)
    print(f"relative L2 error of the FP8 TransformerEncoderLayer ({dtype}): {error:.4f}")
    assert error <= 0.05


def test_fp8_is_refused_below_compute_capability_8_9(rng, monkeypatch):
    import cupy

    monkeypatch.setattr(q8, "compute_capability", lambda device_id: (8, 0))
    get_op("linear_fp8").calls.clear()  # bound calls were resolved on this GPU's real capability
    x, weight, b, _ = draw(rng, 3, 16, 16, "fp16")
    with pytest.raises(NoPathError, match=r"compute capability 8.9 or newer .* GPU \d+ is sm_80"):
        linear_fp8(*to_gpu(x, *weight, b))
    layer = nn.Linear(16, 16, dtype="fp16", device="gpu")
    with pytest.raises(LibnnError, match=r"Linear.quantize: FP8 \(E4M3\) needs a GPU of compute capability 8.9"):
        layer.quantize("fp8")
    assert layer.weight.dtype == cupy.float16 and layer.quantized is None  # unchanged, still usable
    layer(cupy.asarray(x))
    with pytest.raises(LibnnError, match=r"Linear: FP8 \(E4M3\) needs a GPU of compute capability 8.9"):
        nn.Linear(16, 16, dtype="fp8", device="gpu")
