"""kernels/gemv.cu on the GPU, through the ops that run it: linear's gemv path (bias, residual and every
activation in the epilogue) and rms_norm_linear's (the RMS norm staged in front, SwiGLU in the epilogue;
with E4M3 weights kernels/linear_fp8.cu's version 3 with the same fusions, 1 to 8 rows),
against the float64 reference on odd shapes (N = 1, primes, K = 8 and non-multiples of 256 chunks, a
decode step's 3072 x 2048, a K of 8192 and a long row near the kernel's limit), fp16 and bf16, outputs
poisoned; the bound call against new arrays; strided inputs copied; misaligned ones refused visibly
under auto; a rows-at-once problem passed to the next path; results repeat bit for bit; rms_norm_linear's
unfused path at more rows. Tolerances: relative L2 error fp16/bf16 1e-2 (dtypes.TOLERANCE)."""

import warnings

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.errors import FallbackWarning
from libnn.ops import linear, rms_norm_linear
from libnn.ops.linear_fp8 import bind_gemv3_kernel
from libnn.ops.quantize_fp8 import quantize_weight
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

DTYPES = ["fp16", "bf16"]
# (N, K): N = 1 and primes; K = 8 (one chunk), 1000 (125 chunks: a batch partly past the row), 2056
# (257 chunks: a second batch of one chunk); a decode step's QKV 3072 x 2048 and down 2048 x 8192
SHAPES = [(1, 8), (7, 1000), (131, 2056), (3072, 2048), (2048, 8192), (5, 24576)]
GLU_SHAPES = [(2, 8), (14, 1000), (262, 2056), (16384, 2048)]


def gpu(a):
    import cupy
    return cupy.asarray(a)


def weights(rng, N, K, dtype):
    """w scaled so that the outputs stay O(1) whatever K is."""
    return random_normal(rng, (N, K), dtype, 1 / np.sqrt(K))


def reference_norm_linear(x, g, w, b=None, glu=None, eps=1e-6):
    return rms_norm_linear(*(np.asarray(a).astype(np.float64) if a is not None else None for a in (x, g, w, b)),
                           eps=eps, glu=glu, path="reference")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("N, K", SHAPES, ids=str)
def test_linear_gemv_matches_reference(rng, N, K, activation, dtype):
    x, w = random_normal(rng, (1, K), dtype), weights(rng, N, K, dtype)
    b, r = random_normal(rng, (N,), dtype), random_normal(rng, (1, N), dtype)
    y = linear(gpu(x), gpu(w), gpu(b), activation, residual=gpu(r), path="gemv")
    expected = linear(*(a.astype(np.float64) for a in (x, w, b)), activation, residual=r.astype(np.float64),
                      path="reference")
    assert y.shape == (1, N) and y.dtype == x.dtype
    assert rel_error(y, expected) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", SHAPES, ids=str)
def test_rms_norm_linear_gemv_matches_reference(rng, N, K, dtype):
    x, g, w = random_normal(rng, (1, 1, K), dtype, 3.0), random_normal(rng, (K,), dtype), weights(rng, N, K, dtype)
    b = random_normal(rng, (N,), dtype)
    y = rms_norm_linear(gpu(x), gpu(g), gpu(w), gpu(b), eps=1e-5, path="gemv")
    assert y.shape == (1, 1, N) and y.dtype == x.dtype
    assert rel_error(y, reference_norm_linear(x, g, w, b, eps=1e-5)) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", GLU_SHAPES, ids=str)
def test_rms_norm_linear_gemv_with_swiglu_matches_reference(rng, N, K, dtype):
    x, g, w = random_normal(rng, (1, K), dtype), random_normal(rng, (K,), dtype), weights(rng, N, K, dtype)
    y = rms_norm_linear(gpu(x), gpu(g), gpu(w), glu="swiglu", path="gemv")
    assert y.shape == (1, N // 2)
    assert rel_error(y, reference_norm_linear(x, g, w, glu="swiglu")) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_takes_gemv_at_one_row_and_unfused_at_more(rng, dtype):
    K, N = 264, 96
    g, w = random_normal(rng, (K,), dtype), weights(rng, N, K, dtype)
    for rows, path in ((1, "gemv"), (5, "unfused")):
        x = random_normal(rng, (rows, K), dtype)
        y = rms_norm_linear(gpu(x), gpu(g), gpu(w), glu="swiglu")
        assert libnn.get_op("rms_norm_linear").last_decision.path == path
        assert rel_error(y, reference_norm_linear(x, g, w, glu="swiglu")) <= dtypes.TOLERANCE[dtype]
    linear(gpu(x[:1]), gpu(w))
    assert libnn.get_op("linear").last_decision.path == "gemv"


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_the_bound_call_reads_new_arrays_each_call(rng):
    K, N = 512, 40
    g, w = gpu(random_normal(rng, (K,), "fp16")), gpu(weights(rng, N, K, "fp16"))
    for _ in range(3):  # one signature, three calls: each result is its own call's
        x = random_normal(rng, (1, K), "fp16")
        y = rms_norm_linear(gpu(x), g, w)
        assert rel_error(y, reference_norm_linear(x, g.get(), w.get())) <= 1e-2


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_strided_inputs_are_copied(rng):
    """x a column slice of a wider row, w every other row of a larger weight, the norm's weight every other
    value: all copied first (and the GEMV, which reads w and gamma before its wait, waits for the copies)."""
    K, N = 256, 24
    wide = random_normal(rng, (1, 2 * K), "fp16")
    big = weights(rng, 2 * N, K, "fp16")
    g = random_normal(rng, (2 * K,), "fp16")
    y = rms_norm_linear(gpu(wide)[:, K:], gpu(g)[::2], gpu(big)[::2], path="gemv")
    assert rel_error(y, reference_norm_linear(wide[:, K:], g[::2], big[::2])) <= 1e-2


def test_misaligned_x_falls_back_visibly(rng):
    """x one element past an aligned start: the 16-byte loads cannot take it; auto says so and runs
    cuBLASLt (the next path), forced gemv raises the same reason."""
    import cupy

    K, N = 64, 16
    x = random_normal(rng, (1, K), "fp16")
    buf = cupy.zeros(K + 1, cupy.float16)
    buf[1:] = cupy.asarray(x[0])
    shifted, w = buf[1:].reshape(1, K), gpu(weights(rng, N, K, "fp16"))
    with pytest.warns(FallbackWarning, match="kernels/gemv.cu needs x and w 16-byte aligned; x is not"):
        y = linear(shifted, w)
    assert rel_error(y, x.astype(np.float64) @ w.get().astype(np.float64).T) <= 1e-2
    with pytest.raises(libnn.LibraryError, match="x is not"):
        linear(shifted, w, path="gemv")


def test_two_rows_are_refused_by_name():
    with pytest.raises(libnn.PathUnavailableError, match="M=2: the GEMV kernel takes one row"):
        linear(gpu(np.ones((2, 16), np.float16)), gpu(np.ones((8, 16), np.float16)), path="gemv")


def test_results_repeat_bit_for_bit(rng):
    K, N = 2048, 3072
    x, g, w = (gpu(random_normal(rng, s, "bf16")) for s in ((1, K), (K,), (N, K)))
    first = rms_norm_linear(x, g, w, glu="swiglu", path="gemv").get()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):
            assert np.array_equal(rms_norm_linear(x, g, w, glu="swiglu", path="gemv").get().view(np.uint16),
                                  first.view(np.uint16))


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_unfused_matches_reference(rng, dtype):
    x, g, w = random_normal(rng, (3, 7, 40), dtype), random_normal(rng, (40,), dtype), weights(rng, 22, 40, dtype)
    y = rms_norm_linear(gpu(x), gpu(g), gpu(w), glu="swiglu", path="unfused")
    assert y.shape == (3, 7, 11)
    assert rel_error(y, reference_norm_linear(x, g, w, glu="swiglu")) <= dtypes.TOLERANCE[dtype]


# --- E4M3 weights: rms_norm_linear with w_scale (kernels/gemv.cu's E4M3 kernels at one row where K % 16 == 0,
# kernels/linear_fp8.cu version 3 otherwise; both fused) --------------------------------------------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("glu", [None, "swiglu"])
@pytest.mark.parametrize("M, N, K", [(1, 2, 16), (1, 14, 1000), (1, 262, 2064), (1, 34, 513), (1, 16384, 2048),
                                     (1, 6, 3960), (1, 6, 3968), (1, 6, 3976), (1, 2, 24576), (1, 2, 24592),
                                     (3, 262, 2064), (3, 34, 513), (8, 34, 513)],
                         ids=str)
def test_rms_norm_linear_gemv_with_e4m3_weights_matches_reference(rng, M, N, K, glu, dtype, per_channel):
    """The reference normalises, rounds to x's dtype, quantises x as the kernel does and sums the
    dequantised products in float64; the unfused path (rms_norm, linear_fp8, swiglu) alike. Past one row
    the fused kernel (which takes up to 8) is run directly, as auto no longer picks it there. At one row K
    a multiple of 16 up to 24576 runs kernels/gemv.cu's E4M3 kernel, other K version 3. Version 3's
    quantiser keeps x in registers up to 2 groups of 8 values a thread (M rows of gemv3_x_stride(K) / 8
    groups, 512 at most): K = 513, 1000 and 3960 (504 groups) at one row and (3, 513) do; K = 3976 (520)
    and 24592 at one row, (3, 2064) and (8, 513) read x again in each pass."""
    x, g = random_normal(rng, (M, K), dtype, 3.0), random_normal(rng, (K,), dtype)
    weight = quantize_weight(random_normal(rng, (N, K), "fp32", 1 / np.sqrt(K)) *
                             np.geomspace(0.1, 10, N)[:, None].astype(np.float32), per_channel=per_channel)
    b = random_normal(rng, (N,), dtype)
    if M == 1:
        y = rms_norm_linear(gpu(x), gpu(g), gpu(weight.data), gpu(b), w_scale=gpu(weight.scale), glu=glu, path="gemv")
    else:
        kernel = bind_gemv3_kernel(dtype, M, N, K, per_channel, None, "gpu:0", glu is not None, 1e-6)
        y = gpu(np.full((M, N // 2 if glu else N), np.nan, dtypes.parse(dtype)))
        kernel(gpu(x), gpu(weight.data), gpu(weight.scale), gpu(b), None, gpu(g), y)
    expected = rms_norm_linear(x, g, weight.data, b, w_scale=weight.scale, glu=glu, path="reference")
    assert y.shape == (M, N // 2 if glu else N)
    assert rel_error(y, expected) <= dtypes.TOLERANCE[dtype]
    unfused = rms_norm_linear(gpu(x), gpu(g), gpu(weight.data), gpu(b), w_scale=gpu(weight.scale), glu=glu,
                              path="unfused")
    assert rel_error(unfused, expected) <= dtypes.TOLERANCE[dtype]


@pytest.mark.parametrize("glu", [None, "swiglu"])
def test_e4m3_weights_with_misaligned_x_and_norm_weight(rng, glu):
    """kernels/gemv.cu's E4M3 kernel reads x and the norm's weight value by value where either is not on 16
    bytes (each one element past an aligned start here); its weight stays aligned."""
    import cupy

    M, N, K = 1, 38, 96
    x, g = random_normal(rng, (M, K), "bf16", 3.0), random_normal(rng, (K,), "bf16")
    weight = quantize_weight(random_normal(rng, (N, K), "fp32", 0.1))
    xg, gg = cupy.empty(K + 1, x.dtype)[1:].reshape(M, K), cupy.empty(K + 1, g.dtype)[1:]
    xg[...], gg[...] = gpu(x), gpu(g)
    y = rms_norm_linear(xg, gg, gpu(weight.data), w_scale=gpu(weight.scale), glu=glu, path="gemv")
    expected = rms_norm_linear(x, g, weight.data, w_scale=weight.scale, glu=glu, path="reference")
    assert rel_error(y, expected) <= dtypes.TOLERANCE["bf16"]


def test_e4m3_weights_past_one_row_take_the_unfused_path(rng):
    K, N = 64, 32
    x, g = random_normal(rng, (2, K), "fp16"), random_normal(rng, (K,), "fp16")
    weight = quantize_weight(random_normal(rng, (N, K), "fp32", 0.1))
    y = rms_norm_linear(gpu(x), gpu(g), gpu(weight.data), w_scale=gpu(weight.scale), glu="swiglu")
    assert libnn.get_op("rms_norm_linear").last_decision.path == "unfused"
    expected = rms_norm_linear(x, g, weight.data, w_scale=weight.scale, glu="swiglu", path="reference")
    assert rel_error(y, expected) <= 1e-2
    with pytest.raises(libnn.PathUnavailableError, match="M=2: with E4M3 weights the fused GEMV takes one row"):
        rms_norm_linear(gpu(x), gpu(g), gpu(weight.data), w_scale=gpu(weight.scale), path="gemv")
