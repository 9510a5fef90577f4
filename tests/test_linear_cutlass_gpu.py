"""linear's cutlass path on the GPU (kernels/nvcc/gemm_cutlass.cu, Hopper): the exact GELU in the GEMM's
epilogue against the float64 reference on odd shapes (M = 1 and primes; N and K multiples of 8, the
path's limit), outputs poisoned, with and without bias and residual; against its unfused twin
(cuBLASLt's GEMM + the GELU pass); what `auto` picks; misaligned arrays, streams and CUDA graphs."""

import warnings

import numpy as np
import pytest

import libnn
from libnn.backends import cutlass
from libnn.errors import FallbackWarning, LibraryError, PathUnavailableError
from libnn.ops.linear import linear
from conftest import rel_error
from test_linear_gpu import draw, to_gpu, tolerance

pytestmark = pytest.mark.gpu

SHAPES = [(1, 8, 8), (13, 24, 40), (7, 8, 1032), (257, 136, 64), (1009, 3072, 768), (4099, 1536, 384)]
DTYPES = ["fp16", "bf16"]
DEFAULT = cutlass.TILES[0]


@pytest.fixture(autouse=True)
def cutlass_available():
    if reason := libnn.get_op("linear").paths["cutlass"].missing():
        pytest.skip(f"linear's cutlass path cannot run here: {reason}")
    from libnn.runtime.device import current_device_id
    if reason := cutlass.missing(current_device_id()):
        pytest.skip(f"linear's cutlass path cannot run here: {reason}")


def residual_like(rng, M, N, dtype):
    from conftest import random_normal
    return random_normal(rng, (M, N), dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias, residual", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["bias", "plain", "bias+residual", "residual"])
def test_cutlass_gelu_erf_matches_reference(rng, dtype, shape, bias, residual):
    M, N, K = shape
    x, w, b = draw(rng, M, N, K, dtype, bias)
    r = residual_like(rng, M, N, dtype) if residual else None
    expected = linear(x, w, b, "gelu_erf", residual=r, path="reference")
    got = linear(*to_gpu(x, w, b), "gelu_erf", residual=None if r is None else to_gpu(r)[0], path="cutlass")
    assert got.shape == (M, N) and got.dtype == x.dtype
    assert rel_error(got, expected) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", cutlass.TILES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8, 8), (131, 200, 72), (4099, 1544, 384)], ids=lambda s: "x".join(map(str, s)))
def test_every_tile_matches_the_reference(rng, dtype, tile, shape):
    """Each tile's build, whichever shape auto would give it, with bias and residual: partial tiles along
    M and N (131 rows, 200 and 1544 columns are no multiples of 128, 192 or 256) included."""
    import cupy

    M, N, K = shape
    x, w, b = draw(rng, M, N, K, dtype)
    r = residual_like(rng, M, N, dtype)
    expected = linear(x, w, b, "gelu_erf", residual=r, path="reference")
    xg, wg, bg, rg = to_gpu(x, w, b, r)
    y = cupy.empty((M, N), xg.dtype)  # poisoned: NaN where the kernel writes nothing
    cutlass.bind_gemm_gelu_erf(dtype, M, N, K, tile)(xg, wg, bg, rg, y)
    assert rel_error(y, expected) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cutlass_equals_its_unfused_twin(rng, dtype):
    """One kernel (cutlass) and GEMM + pass (cublaslt) compute the same function: within the dtype's
    tolerance of each other, both with a residual and leading dimensions."""
    x, w, b = to_gpu(*draw(rng, 6 * 37, 384, 136, dtype))
    r = to_gpu(residual_like(rng, 6 * 37, 384, dtype))[0]
    fused = linear(x.reshape(6, 37, 136), w, b, "gelu_erf", residual=r.reshape(6, 37, 384), path="cutlass")
    twin = linear(x.reshape(6, 37, 136), w, b, "gelu_erf", residual=r.reshape(6, 37, 384), path="cublaslt")
    assert fused.shape == (6, 37, 384)
    assert rel_error(fused, twin.get()) <= tolerance(dtype)


def test_auto_takes_cutlass_for_gelu_erf_where_its_tiles_fill_the_gpu(rng):
    op = libnn.get_op("linear")
    x, w, b = to_gpu(*draw(rng, filling_rows(), 4 * DEFAULT.n, 64, "fp16"))
    linear(x, w, b, "gelu_erf")
    assert op.last_decision.path == "cutlass"
    linear(x, w, b, "gelu")
    assert op.last_decision.path == "cublaslt"
    assert "only the gelu_erf epilogue" in op.last_decision.passed_over["cutlass"]
    small = linear(x[:64], w, b, "gelu_erf")  # one row of tiles: cuBLASLt's GEMM + pass, cutlass tried last
    assert op.last_decision.path == "cublaslt"
    assert op.last_decision.passed_over["cutlass"].startswith("tried last: 6 output tiles of 128x192")
    expected = linear(*[a.get() for a in (x[:64], w, b)], "gelu_erf", path="reference")
    assert rel_error(small, expected) <= tolerance("fp16")


def test_shapes_outside_the_path_are_refused_by_name(rng):
    x, w, b = to_gpu(*draw(rng, 5, 12, 16, "fp16"))
    with pytest.raises(PathUnavailableError, match="N and K must be multiples of 8.*N=12 K=16"):
        linear(x, w, b, "gelu_erf", path="cutlass")
    x32, w32, b32 = to_gpu(*draw(rng, 5, 16, 16, "fp32"))
    with pytest.raises(PathUnavailableError, match="dtype fp32 is not supported"):
        linear(x32, w32, b32, "gelu_erf", path="cutlass")
    assert linear(x, w, b, "gelu_erf").shape == (5, 12)  # auto goes on to a path that takes it
    assert libnn.get_op("linear").last_decision.path != "cutlass"


def filling_rows() -> int:
    """Rows whose (rows, 4 * n) output has at least as many tiles of the default tile as the GPU has SMs
    (and so of every tile, the others being smaller): where auto tries cutlass first."""
    from libnn.runtime.device import current_device_id, multiprocessors

    sms = multiprocessors(current_device_id())
    return DEFAULT.m * DEFAULT.cluster_m * -(-sms // (DEFAULT.cluster_m * 4))


def test_misaligned_arrays_fall_back_visibly(rng):
    """A bias one element into its buffer is not 16-byte aligned: the forced path says so in CUTLASS's
    terms, and auto (on a problem it tries cutlass first for) warns and runs the next path, with the
    right result."""
    x, w, b = draw(rng, filling_rows(), 4 * DEFAULT.n, 32, "fp16")
    xg, wg = to_gpu(x, w)
    b_buffer = to_gpu(np.concatenate([b[:1], b]))[0]
    b_view = b_buffer[1:]
    with pytest.raises(LibraryError, match="CUTLASS's TMA loads need 16-byte aligned buffers; b is not"):
        linear(xg, wg, b_view, "gelu_erf", path="cutlass")
    with pytest.warns(FallbackWarning, match="path 'cutlass' failed"):
        got = linear(xg, wg, b_view, "gelu_erf")
    assert rel_error(got, linear(x, w, b, "gelu_erf", path="reference")) <= tolerance("fp16")


def test_nan_reaches_the_output(rng):
    x, w, b = draw(rng, 16, 32, 24, "fp16")
    x[3, 5] = np.nan
    y = linear(*to_gpu(x, w, b), "gelu_erf", path="cutlass").get()
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()


def test_runs_on_the_current_stream(rng):
    import cupy

    x, w, b = to_gpu(*draw(rng, 129, 256, 128, "bf16"))
    expected = linear(x, w, b, "gelu_erf", path="cutlass").get()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = linear(x, w, b, "gelu_erf", path="cutlass")
        stream.synchronize()  # without a wait on the default stream: the kernel ran on this one
    assert np.array_equal(y.get(), expected)


def test_a_graphed_layer_replays_it(rng):
    import cupy

    layer = libnn.nn.Linear(128, 256, activation="gelu_erf", dtype="bf16", device="gpu", path="cutlass", seed=3)
    graphed = layer.graphed()
    for _ in range(2):
        x = cupy.asarray(draw(rng, 37, 256, 128, "bf16")[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback inside the capture
            replayed = graphed(x).copy()
        assert np.array_equal(replayed.get(), layer(x).get())
