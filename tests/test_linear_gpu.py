"""linear on the GPU: every path against the float64 reference on fresh random inputs, odd shapes
included, outputs poisoned, with and without a residual; the exact-GELU pass; plus plan caching,
streams, bound calls, foreign arrays and bad input."""

import math

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.errors import PathUnavailableError
from libnn.ops import activations
from libnn.ops.linear import bind_epilogue_pass, custom_versions, launch_custom_version, linear, linear_problem
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1, 1), (1, 7, 13), (13, 1, 129), (3, 5, 7), (17, 31, 64), (127, 257, 63), (64, 128, 256),
          (1000, 1001, 1003), (256, 384, 4096)]
GPU_DTYPES = ["fp16", "bf16", "fp32"]


def tolerance(dtype: str, allow_tf32: bool = False) -> float:
    return dtypes.TOLERANCE["tf32" if allow_tf32 else dtype]


def draw(rng, M, N, K, dtype, bias=True):
    """Host inputs scaled by 1/√K so outputs stay O(1) in every dtype."""
    scale = 1 / math.sqrt(max(K, 1))
    x, w = random_normal(rng, (M, K), dtype), random_normal(rng, (N, K), dtype, scale)
    b = random_normal(rng, (N,), dtype) if bias else None
    return x, w, b


def to_gpu(*arrays):
    import cupy
    return [None if a is None else cupy.asarray(a) for a in arrays]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["cublaslt", "custom"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("epilogue", [(False, None), (True, None), (True, "relu"), (True, "gelu"), (False, "gelu"),
                                      (True, "gelu_erf")],
                         ids=lambda e: "+".join(filter(None, ["bias" if e[0] else None, e[1]])) or "plain")
def test_gpu_path_matches_reference(rng, path, dtype, shape, epilogue):
    bias, activation = epilogue
    x, w, b = draw(rng, *shape, dtype, bias)
    expected = linear(x, w, b, activation, path="reference").astype(np.float64)
    y = linear(*to_gpu(x, w, b), activation, path=path)
    assert y.shape == expected.shape and y.dtype == x.dtype
    if (path, dtype, activation) == ("cublaslt", "fp32", "gelu"):
        # cuBLASLt's GELU epilogue evaluates tanh approximately (absolute error ~5e-6, see the next
        # test): a relative bound alone fails whenever the outputs happen to be tiny
        assert rel_error(y, expected) <= tolerance(dtype) or np.abs(y.get() - expected).max() <= CUBLASLT_GELU_ABS_ERROR
    else:
        assert rel_error(y, expected) <= tolerance(dtype) or conditioned_error(y, expected, x, w, b) <= tolerance(dtype)


def conditioned_error(y, expected, x, w, b, r=None) -> float:
    """‖y − expected‖ / ‖|x|·|w|ᵀ + |b| + |r|‖: the error relative to the size of the terms summed (the
    activations change it by at most their slope, ≤ 1.13), the bound a correctly rounded dot product
    meets. It differs from rel_error only when the terms cancel (seen: a 1×1×1 fp32 case whose output,
    0.0021, was 1e-3 of its terms, at 1.3e-5 relative error)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    scale = np.abs(x64) @ np.abs(w64).T + (0 if b is None else np.abs(b.astype(np.float64)))
    scale = scale + (0 if r is None else np.abs(r.astype(np.float64)).reshape(scale.shape))
    got = y.get().astype(np.float64)
    if not np.isfinite(got).all():
        return np.inf
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(scale), 1e-300))


# Measured on the H100 (cuBLASLt 13.1): 5.2e-6 at v = -1.52 over 4097 points in [-6, 6].
CUBLASLT_GELU_ABS_ERROR = 1e-5


def test_cublaslt_fp32_gelu_epilogue_error_is_bounded():
    import cupy

    v = np.linspace(-6, 6, 4097).astype(np.float32).reshape(-1, 1)
    one, zero = np.ones((1, 1), np.float32), np.zeros(1, np.float32)
    got = linear(*to_gpu(v, one, zero), "gelu", path="cublaslt").get()
    error = np.abs(got - linear(v.astype(np.float64), one.astype(np.float64), zero.astype(np.float64), "gelu"))
    print(f"cuBLASLt fp32 GELU: max abs error {error.max():.2e} at v = {v.ravel()[error.argmax()]:.3f}")
    assert error.max() <= CUBLASLT_GELU_ABS_ERROR
    assert np.abs(linear(cupy.asarray(v), cupy.asarray(one), cupy.asarray(zero), "gelu", path="custom").get()
                  - linear(v.astype(np.float64), one.astype(np.float64), zero.astype(np.float64), "gelu")).max() <= 1e-6


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("shape", [(1, 7, 13), (127, 257, 63), (512, 512, 1024)], ids=str)
def test_cublaslt_tf32_is_within_tf32_tolerance(rng, shape):
    x, w, b = draw(rng, *shape, "fp32")
    expected = linear(x, w, b, "gelu", path="reference")
    assert rel_error(linear(*to_gpu(x, w, b), "gelu", allow_tf32=True, path="cublaslt"), expected) <= tolerance("fp32", True)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (33, 65, 17), (130, 260, 136), (1000, 1001, 1003)], ids=str)
def test_every_custom_kernel_version_matches_reference(rng, dtype, shape):
    x, w, b = draw(rng, *shape, dtype)
    expected = linear(x, w, b, "gelu", path="reference")
    for version in custom_versions(linear_problem(x, w, b, "gelu", False)):
        y = launch_custom_version(version, *to_gpu(x, w, b), "gelu")
        assert rel_error(y, expected) <= tolerance(dtype), version


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_misaligned_views_are_computed_correctly(rng):
    """A view starting 2 bytes into an allocation defeats 16-byte loads; paths must notice."""
    import cupy

    x, w, b = draw(rng, 65, 72, 64, "fp16")
    big = cupy.asarray(np.concatenate([np.zeros(1, np.float16), x.ravel()]))
    x_view = big[1:].reshape(x.shape)
    assert x_view.data.ptr % 16 == 2
    expected = linear(x, w, b, "relu", path="reference")
    for path in ["cublaslt", "custom"]:
        assert rel_error(linear(x_view, *to_gpu(w, b), "relu", path=path), expected) <= tolerance("fp16"), path


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_auto_picks_cublaslt_and_handles_leading_dims_and_strided_input(rng):
    import cupy

    x, w, b = draw(rng, 6 * 5, 24, 40, "bf16")
    x3 = cupy.asarray(x).reshape(6, 5, 40)
    y = linear(x3[:, ::-1], *to_gpu(w, b), "gelu")  # negative strides: copied to a contiguous array
    assert libnn.get_op("linear").last_decision.path == "cublaslt"
    expected = linear(x.reshape(6, 5, 40)[:, ::-1], w, b, "gelu", path="reference")
    assert y.shape == (6, 5, 24) and rel_error(y, expected) <= tolerance("bf16")


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_nan_and_inf_reach_the_output(rng, path, activation):
    import cupy

    x, w, b = to_gpu(*draw(rng, 4, 8, 16, "fp32"))
    x[1, 3], x[2, 0] = cupy.nan, cupy.inf
    y = linear(x, w, b, activation, path=path).get()
    assert np.isnan(y[1]).all() and not np.isfinite(y[2]).any()
    assert np.isfinite(y[[0, 3]]).all()


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_relu_of_nan_is_nan(rng, path):
    import cupy

    x, w, b = to_gpu(*draw(rng, 2, 8, 16, "fp32"))
    x[0, 0] = cupy.nan
    y = linear(x, w, b, "relu", path=path).get()
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()


def test_empty_and_zero_k_inputs(rng):
    import cupy

    w, b = to_gpu(*draw(rng, 1, 5, 4, "fp16")[1:])
    for path in ["cublaslt", "custom"]:
        assert linear(cupy.empty((0, 4), cupy.float16), w, b, path=path).shape == (0, 5)
        y = linear(cupy.empty((3, 0), cupy.float16), cupy.empty((5, 0), cupy.float16), b, "relu", path=path)
        np.testing.assert_allclose(y.get(), np.broadcast_to(np.maximum(b.get(), 0), (3, 5)))


def test_second_call_builds_no_new_plan_and_a_new_shape_does(rng):
    x, w, b = to_gpu(*draw(rng, 37, 41, 43, "bf16"))
    linear(x, w, b, "gelu", path="cublaslt")
    before = libnn.cache_info()["cublaslt plans"].builds
    linear(x * 2, w, b, "gelu", path="cublaslt")
    assert libnn.cache_info()["cublaslt plans"].builds == before
    linear(x[:36], w, b, "gelu", path="cublaslt")
    assert libnn.cache_info()["cublaslt plans"].builds == before + 1


def test_stream_context_is_honoured(rng):
    import cupy

    x, w, b = to_gpu(*draw(rng, 300, 200, 100, "fp16"))
    expected = linear(x, w, b, "gelu", path="cublaslt").get()
    s = cupy.cuda.Stream(non_blocking=True)
    with libnn.stream(s):
        for path in ["cublaslt", "custom"]:
            y = linear(x, w, b, "gelu", path=path)
            s.synchronize()
            assert rel_error(y, expected) <= tolerance("fp16")
    assert s.ptr in {key[-1] for key in libnn.cache_keys("cublaslt plans")}  # a plan per stream


def test_torch_tensors_are_taken_without_a_copy(rng):
    torch = pytest.importorskip("torch")
    x, w, b = draw(rng, 9, 10, 11, "fp32")
    tx = torch.from_numpy(x).cuda()
    y = linear(tx, torch.from_numpy(w).cuda(), torch.from_numpy(b).cuda(), "relu")
    assert rel_error(y, linear(x, w, b, "relu")) <= tolerance("fp32")
    bf = torch.from_numpy(x).cuda().to(torch.bfloat16)
    assert linear(bf, torch.from_numpy(w).cuda().to(torch.bfloat16)).dtype == dtypes.bfloat16


def test_gpu_arrays_to_reference_path_are_rejected(rng):
    x, w, b = to_gpu(*draw(rng, 2, 3, 4, "fp32"))
    with pytest.raises(TypeError, match="path 'reference' runs on the CPU, but the arrays are on the GPU"):
        linear(x, w, b, path="reference")


def test_fp64_on_a_forced_gpu_path_names_the_supported_dtypes(rng):
    x, w, b = to_gpu(*draw(rng, 2, 3, 4, "fp64"))
    with pytest.raises(PathUnavailableError, match=r"path 'cublaslt' cannot run .*fp64 is not supported \(supported: fp16, bf16, fp32\)"):
        linear(x, w, b, path="cublaslt")
    with pytest.raises(libnn.NoPathError, match="no path can compute"):
        linear(x, w, b)


def test_mixed_devices_are_rejected(rng):
    x, w, b = draw(rng, 2, 3, 4, "fp32")
    with pytest.raises(libnn.LibnnError, match="all arrays must be on one device, got x on gpu:0, w on cpu"):
        linear(to_gpu(x)[0], w, to_gpu(b)[0])


def test_linear_layer_on_gpu_matches_reference(rng):
    layer = libnn.nn.Linear(48, 33, activation="gelu", dtype="bf16", device="gpu", seed=5)
    x = random_normal(rng, (7, 48), "bf16")
    host = libnn.nn.Linear(48, 33, activation="gelu", dtype="bf16", seed=5)
    assert rel_error(layer(to_gpu(x)[0]), host(x).astype(np.float64)) <= tolerance("bf16")


def test_kernel_loader_targets_this_gpu():
    from libnn.runtime import kernels
    from libnn.runtime.device import compute_capability, current_device_id

    major, minor = compute_capability(current_device_id())
    assert kernels.target_arch(current_device_id()) in (f"sm_{major}{minor}", f"compute_{major}{minor}")
    assert kernels.load("gemm.cu").get_function("gemm1_naive_f32") is not None


def test_plan_inspection_lists_timed_candidates():
    from libnn.inspect import linear_plans

    report = linear_plans(256, 512, 1024, "bf16", activation="gelu", time=True)
    assert report.rows and all(r["time_ms"] > 0 for r in report.rows)
    assert any("fastest" in r["note"] for r in report.rows) and "heuristic #1" in report.rows[0]["note"]


# --- residual: act(x @ w.T + b + residual) -----------------------------------------------------------
RESIDUAL_SHAPES = [(1, 1, 1), (1, 7, 13), (13, 1, 129), (17, 31, 64), (127, 257, 63), (64, 128, 256),
                   (1000, 1001, 1003), (256, 384, 4096)]
RESIDUAL_EPILOGUES = [(False, None), (True, None), (True, "relu"), (True, "gelu"), (False, "relu"),
                      (True, "gelu_erf"), (False, "gelu_erf")]


def assert_close(y, expected, x, w, b, r, dtype, path, activation, allow_tf32=False):
    """Within the dtype's tolerance, relative to the output or (where the terms cancel) to the terms."""
    tol = tolerance(dtype, allow_tf32)
    if (path, dtype, activation, allow_tf32) == ("cublaslt", "fp32", "gelu", False):
        assert rel_error(y, expected) <= tol or np.abs(y.get() - expected).max() <= CUBLASLT_GELU_ABS_ERROR
    else:
        assert rel_error(y, expected) <= tol or conditioned_error(y, expected, x, w, b, r) <= tol


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["cublaslt", "custom"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", RESIDUAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("epilogue", RESIDUAL_EPILOGUES,
                         ids=lambda e: "+".join(filter(None, ["bias" if e[0] else None, e[1]])) or "plain")
def test_gpu_path_with_residual_matches_reference(rng, path, dtype, shape, epilogue):
    """The residual is added before the activation on every path (cuBLASLt: C with beta = 1, its
    epilogue after; custom: the kernel's epilogue; gelu_erf on cuBLASLt: the GEMM then the pass); the
    residual is read, never written, and the output is a fresh array."""
    bias, activation = epilogue
    x, w, b = draw(rng, *shape, dtype, bias)
    r = random_normal(rng, shape[:2], dtype)
    expected = linear(x, w, b, activation, residual=r, path="reference").astype(np.float64)
    xg, wg, bg, rg = to_gpu(x, w, b, r)
    y = linear(xg, wg, bg, activation, residual=rg, path=path)
    assert y.shape == expected.shape and y.dtype == x.dtype and y.data.ptr != rg.data.ptr
    np.testing.assert_array_equal(rg.get(), r)
    assert_close(y, expected, x, w, b, r, dtype, path, activation)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("activation", [None, "relu", "gelu_erf"])
@pytest.mark.parametrize("shape", [(1, 7, 13), (127, 257, 63), (512, 512, 1024)], ids=str)
def test_cublaslt_tf32_with_residual_is_within_tf32_tolerance(rng, shape, activation):
    x, w, b = draw(rng, *shape, "fp32")
    r = random_normal(rng, shape[:2], "fp32")
    expected = linear(x, w, b, activation, residual=r, path="reference")
    y = linear(*to_gpu(x, w, b), activation, residual=to_gpu(r)[0], allow_tf32=True, path="cublaslt")
    assert_close(y, expected, x, w, b, r, "fp32", "cublaslt", activation, allow_tf32=True)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ["gelu", "gelu_erf"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (33, 65, 17), (130, 260, 136), (1000, 1001, 1003)], ids=str)
def test_every_custom_kernel_version_with_residual_matches_reference(rng, dtype, activation, shape):
    """Every kernel of kernels/gemm.cu reads the residual (gemm2_tiled_f32 has no erf epilogue: refused)."""
    x, w, b = draw(rng, *shape, dtype)
    r = random_normal(rng, shape[:2], dtype)
    expected = linear(x, w, b, activation, residual=r, path="reference")
    for version in custom_versions(linear_problem(x, w, b, activation, False, r)):
        args = (*to_gpu(x, w, b), activation, to_gpu(r)[0])
        if (dtype, version, activation) == ("fp32", "v2", "gelu_erf"):
            with pytest.raises(ValueError, match="version v2 has no gelu_erf epilogue"):
                launch_custom_version(version, *args)
            continue
        assert rel_error(launch_custom_version(version, *args), expected) <= tolerance(dtype), version


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu_erf"])
def test_fused_residual_equals_gemm_then_add(rng, path, dtype, activation):
    """One call with the residual agrees with the GEMM + bias, then the add and the activation (in
    float64 on the host, from the GEMM's rounded output)."""
    x, w, b = to_gpu(*draw(rng, 300, 200, 136, dtype))
    r = random_normal(rng, (300, 200), dtype)
    fused = linear(x, w, b, activation, residual=to_gpu(r)[0], path=path)
    plain = linear(x, w, b, path=path).get().astype(np.float64)
    unfused = activations.apply(plain + r.astype(np.float64), activation)
    assert rel_error(fused, unfused) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_residual_with_leading_dimensions_strides_and_misalignment(rng, path):
    """A residual of the output's (..., N) shape as a strided view, and one starting 2 bytes into its
    allocation (no 16-byte access can read it; cuBLASLt plans for its alignment)."""
    import cupy

    x, w, b = draw(rng, 6 * 5, 24, 40, "fp16")
    r = random_normal(rng, (5, 6, 24), "fp16")
    r_view = cupy.asarray(r).transpose(1, 0, 2)
    expected = linear(x.reshape(6, 5, 40), w, b, "relu", residual=r.transpose(1, 0, 2), path="reference")
    y = linear(cupy.asarray(x).reshape(6, 5, 40), *to_gpu(w, b), "relu", residual=r_view, path=path)
    assert y.shape == (6, 5, 24) and rel_error(y, expected) <= tolerance("fp16")

    flat = r.transpose(1, 0, 2).reshape(30, 24)
    big = cupy.asarray(np.concatenate([np.ones(1, np.float16), flat.ravel()]))
    r_odd = big[1:].reshape(30, 24)
    assert r_odd.data.ptr % 16 == 2
    expected = linear(x, w, b, "gelu_erf", residual=flat, path="reference")
    assert rel_error(linear(*to_gpu(x, w, b), "gelu_erf", residual=r_odd, path=path), expected) <= tolerance("fp16")


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
@pytest.mark.parametrize("activation", ["relu", "gelu_erf"])
def test_bound_call_with_residual_computes_each_calls_new_data(rng, path, activation):
    """The second call with the same signature runs the bound call (no new binding) on its own arrays;
    a call without the residual is another signature."""
    op = libnn.get_op("linear")
    x1, w, b = to_gpu(*draw(rng, 37, 41, 64, "bf16"))
    r1 = to_gpu(random_normal(rng, (37, 41), "bf16"))[0]
    linear(x1, w, b, activation, residual=r1, path=path)
    bound = len(op.calls)
    x2, _, _ = draw(rng, 37, 41, 64, "bf16")
    r2 = random_normal(rng, (37, 41), "bf16")
    y = linear(*to_gpu(x2), w, b, activation, residual=to_gpu(r2)[0], path=path)
    assert len(op.calls) == bound
    expected = linear(x2, w.get(), b.get(), activation, residual=r2, path="reference")
    assert rel_error(y, expected) <= tolerance("bf16")
    bound = len(op.calls)  # the reference call above bound a call of its own
    y_plain = linear(*to_gpu(x2), w, b, activation, path=path)
    assert len(op.calls) == bound + 1
    assert rel_error(y_plain, linear(x2, w.get(), b.get(), activation, path="reference")) <= tolerance("bf16")


@pytest.mark.parametrize("path", ["cublaslt", "custom"])
def test_nan_in_the_residual_reaches_its_output_element(rng, path):
    import cupy

    x, w, b = to_gpu(*draw(rng, 4, 8, 16, "fp32"))
    r = to_gpu(random_normal(rng, (4, 8), "fp32"))[0]
    r[1, 2] = cupy.nan
    y = linear(x, w, b, residual=r, path=path).get()
    assert np.isnan(y[1, 2]) and np.isfinite(np.delete(y.ravel(), 1 * 8 + 2)).all()


def test_residual_on_another_device_is_rejected(rng):
    x, w, b = to_gpu(*draw(rng, 2, 3, 4, "fp32"))
    with pytest.raises(libnn.LibnnError, match="linear: all arrays must be on one device, got .*residual on cpu"):
        linear(x, w, b, residual=random_normal(rng, (2, 3), "fp32"))


def expected_gelu_erf_path(M: int, N: int) -> str:
    """auto's first path for gelu_erf here: cutlass where it can run (Hopper, nvcc, CUTLASS's headers) and
    its tiles fill the GPU, else cuBLASLt's GEMM then the exact-GELU pass."""
    from libnn.backends import cutlass
    from libnn.runtime.device import current_device_id, multiprocessors

    device = current_device_id()
    unavailable = libnn.get_op("linear").paths["cutlass"].missing() or cutlass.missing(device)
    sms = multiprocessors(device)
    small = cutlass.tile_for(M, N, sms).count(M, N) < sms if not unavailable else True
    return "cublaslt" if unavailable or small else "cutlass"


def test_auto_runs_gelu_erf_with_residual_on_its_first_path(rng):
    """gelu_erf with the residual: cutlass (residual as C, GELU in its epilogue) or cuBLASLt's GEMM
    (residual as C) then the exact-GELU pass."""
    x, w, b = draw(rng, 64, 96, 128, "fp16")
    r = random_normal(rng, (64, 96), "fp16")
    y = linear(*to_gpu(x, w, b), "gelu_erf", residual=to_gpu(r)[0])
    assert libnn.get_op("linear").last_decision.path == expected_gelu_erf_path(64, 96)
    assert rel_error(y, linear(x, w, b, "gelu_erf", residual=r)) <= tolerance("fp16")


# --- the pass after a GEMM: y = act(y + b) (kernels/epilogue.cu bias_act_rows) -------------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ["gelu_erf", "gelu", "relu", None])
@pytest.mark.parametrize("rows_n", [(1, 1), (3, 7), (37, 1001), (5, 8), (64, 1536), (6000, 1544)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_epilogue_pass_matches_reference(rng, dtype, activation, rows_n, bias):
    """16-byte path (N a multiple of 8 halves / 4 floats; 6000x1544 loops past the grid, its column
    wrapping mod N) and scalar path (odd N) against float64."""
    rows, N = rows_n
    y = random_normal(rng, (rows, N), dtype, scale=3.0)
    b = random_normal(rng, (N,), dtype) if bias else None
    expected = activations.apply(y.astype(np.float64) + (0 if b is None else b.astype(np.float64)), activation)
    yg, bg = to_gpu(y, b)
    bind_epilogue_pass(dtype, rows, N, activation)(yg, bg)
    # fp16 flushes GELU's tails below 2**-24 to 0 (gelu(-7.5) is -1.5e-14): an absolute floor of fp16's
    # smallest normal per element keeps a tiny output from reading as a 100% error
    floor = 2.0**-14 * np.sqrt(expected.size) if dtype == "fp16" else 0.0
    error = np.linalg.norm(yg.get().astype(np.float64) - expected)
    assert error <= tolerance(dtype) * np.linalg.norm(expected) + floor


def test_epilogue_pass_with_a_misaligned_bias_takes_the_scalar_path(rng):
    import cupy

    y, b = random_normal(rng, (33, 64), "bf16", scale=3.0), random_normal(rng, (64,), "bf16")
    big = cupy.asarray(np.concatenate([np.ones(1, b.dtype), b]))
    b_odd = big[1:]
    assert b_odd.data.ptr % 16 == 2
    yg = to_gpu(y)[0]
    bind_epilogue_pass("bf16", 33, 64, "gelu_erf")(yg, b_odd)
    expected = activations.apply(y.astype(np.float64) + b.astype(np.float64), "gelu_erf")
    assert rel_error(yg, expected) <= tolerance("bf16")


def test_epilogue_pass_gelu_erf_is_not_the_tanh_gelu():
    """At v = -3 the exact GELU is -4.05e-3 and the tanh approximation -3.64e-3, 10% apart: the pass
    computes the one it is asked for."""
    v = np.full((1, 4), -3.0, np.float32)
    for activation in ["gelu_erf", "gelu"]:
        yg = to_gpu(v)[0]
        bind_epilogue_pass("fp32", 1, 4, activation)(yg, None)
        expected = activations.apply(v.astype(np.float64), activation)
        np.testing.assert_allclose(yg.get(), expected, rtol=1e-3)


def test_epilogue_pass_gelu_erf_keeps_its_relative_accuracy_in_the_negative_tail():
    """v·Φ(v) for v down to -6 (GELU -5.9e-9), element by element: kernels/common.cuh's normal_cdf takes Φ
    from erfc, where 0.5·(1 + erff(v/√2)) cancels (6% relative error at v = -5 in fp32). The expected
    values come from math.erfc too: 1 + math.erf cancels in float64 as well, from about v = -7."""
    v = np.linspace(-6.0, 3.0, 4001, dtype=np.float32).reshape(1, -1)
    yg = to_gpu(v)[0]
    bind_epilogue_pass("fp32", 1, v.shape[1], "gelu_erf")(yg, None)
    expected = np.vectorize(lambda x: 0.5 * x * math.erfc(-x / math.sqrt(2)))(v.astype(np.float64))
    np.testing.assert_allclose(yg.get(), expected, rtol=2e-5, atol=0)


# --- cudnn path: matmul → add(bias) → add(residual) → activation in one cuDNN graph -------------------
# fp16/bf16 with N and K multiples of 8 (supports() refuses the rest, see the refusal test); M is free.
CUDNN_DTYPES = ["fp16", "bf16"]
# A graph per (shape, dtype, epilogue), each compiled by cuDNN's runtime fusion: 128 here, so few shapes.
CUDNN_SHAPES = [(1, 64, 136), (13, 24, 40), (127, 264, 64), (509, 1000, 1016)]
CUDNN_EPILOGUES = [(bias, residual, activation) for activation in (None, "relu", "gelu", "gelu_erf")
                   for bias in (True, False) for residual in (False, True)]


def epilogue_id(e):
    bias, residual, activation = e
    return "+".join(filter(None, ["bias" if bias else None, "residual" if residual else None, activation])) or "plain"


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", CUDNN_DTYPES)
@pytest.mark.parametrize("shape", CUDNN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("epilogue", CUDNN_EPILOGUES, ids=epilogue_id)
def test_cudnn_path_matches_reference(rng, dtype, shape, epilogue):
    """Every activation, with and without bias and residual, M = 1 and prime M, against float64 (1e-2
    relative L2); the output is a fresh array (poisoned memory shows unwritten elements) and the
    residual is read, never written."""
    bias, residual, activation = epilogue
    x, w, b = draw(rng, *shape, dtype, bias)
    r = random_normal(rng, shape[:2], dtype) if residual else None
    expected = linear(x, w, b, activation, residual=r, path="reference").astype(np.float64)
    xg, wg, bg, rg = to_gpu(x, w, b, r)
    y = linear(xg, wg, bg, activation, residual=rg, path="cudnn")
    assert y.shape == expected.shape and y.dtype == x.dtype
    if r is not None:
        np.testing.assert_array_equal(rg.get(), r)
    assert_close(y, expected, x, w, b, r, dtype, "cudnn", activation)


@pytest.mark.parametrize("dtype", CUDNN_DTYPES)
def test_cudnn_gelu_erf_is_the_exact_gelu_and_gelu_the_tanh_one(dtype):
    """At v = -3 the exact GELU is -4.050e-3 and the tanh approximation -3.637e-3, 10% apart: cuDNN's
    GELU_FWD must be the first (libnn's gelu_erf) and GELU_APPROX_TANH_FWD the second (libnn's gelu).
    y = v·1 exactly: x holds v in its first column, w is 1 in its first column, the rest 0."""
    x, w = np.zeros((8, 8)), np.zeros((8, 8))
    x[:, 0] = [-3.0, -2.5, -1.0, -0.25, 0.5, 1.0, 2.0, 3.0]
    w[:, 0] = 1.0
    x, w = x.astype(dtypes.parse(dtype)), w.astype(dtypes.parse(dtype))
    got = {a: linear(*to_gpu(x, w), activation=a, path="cudnn").get().astype(np.float64)[:, 0] for a in ("gelu_erf", "gelu")}
    exact, tanh = (activations.apply(x[:, 0].astype(np.float64), a) for a in ("gelu_erf", "gelu"))
    assert abs(got["gelu_erf"][0] / exact[0] - 1) < 1e-2 and abs(got["gelu_erf"][0] / tanh[0] - 1) > 5e-2
    assert abs(got["gelu"][0] / tanh[0] - 1) < 1e-2 and abs(got["gelu"][0] / exact[0] - 1) > 5e-2
    assert rel_error(got["gelu_erf"], exact) <= tolerance(dtype) and rel_error(got["gelu"], tanh) <= tolerance(dtype)


@pytest.mark.parametrize("activation", ["relu", "gelu_erf"])
def test_cudnn_bound_call_computes_each_calls_new_data_and_builds_one_graph(rng, activation):
    """The second call with the same signature runs the bound call on its own arrays and builds no graph;
    a new signature of the same problem (a strided x) binds again but finds the graph; a new M builds one."""
    op, graphs = libnn.get_op("linear"), libnn.cache_info()["cudnn graphs"]
    x1, w, b = to_gpu(*draw(rng, 37, 48, 64, "bf16"))
    r1 = to_gpu(random_normal(rng, (37, 48), "bf16"))[0]
    linear(x1, w, b, activation, residual=r1, path="cudnn")
    bound, built = len(op.calls), graphs.builds
    x2, _, _ = draw(rng, 37, 48, 64, "bf16")
    r2 = random_normal(rng, (37, 48), "bf16")
    y = linear(*to_gpu(x2), w, b, activation, residual=to_gpu(r2)[0], path="cudnn")
    assert len(op.calls) == bound and graphs.builds == built
    assert rel_error(y, linear(x2, w.get(), b.get(), activation, residual=r2, path="reference")) <= tolerance("bf16")
    bound = len(op.calls)  # the reference call above bound a call of its own
    wide = to_gpu(np.repeat(x2, 2, axis=1))[0][:, ::2]  # x2 again, as a strided view
    y_strided = linear(wide, w, b, activation, residual=to_gpu(r2)[0], path="cudnn")
    assert len(op.calls) == bound + 1 and graphs.builds == built
    assert rel_error(y_strided, y.get()) <= tolerance("bf16")
    linear(x1[:36], w, b, activation, residual=r1[:36], path="cudnn")
    assert graphs.builds == built + 1


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_cudnn_keeps_leading_dimensions_and_takes_strided_operands(rng):
    import cupy

    x, w, b = draw(rng, 6 * 5, 24, 40, "fp16")
    r = random_normal(rng, (5, 6, 24), "fp16")
    expected = linear(x.reshape(6, 5, 40)[:, ::-1], w, b, "gelu_erf", residual=r.transpose(1, 0, 2), path="reference")
    y = linear(cupy.asarray(x).reshape(6, 5, 40)[:, ::-1], *to_gpu(w, b), "gelu_erf",
               residual=cupy.asarray(r).transpose(1, 0, 2), path="cudnn")
    assert y.shape == (6, 5, 24) and rel_error(y, expected) <= tolerance("fp16")


@pytest.mark.parametrize("N, K", [(1001, 64), (64, 1003), (12, 8)], ids=str)
def test_cudnn_refuses_n_or_k_not_a_multiple_of_8_and_auto_runs_cublaslt(rng, N, K):
    x, w, b = draw(rng, 33, N, K, "fp16")
    args = to_gpu(x, w, b)
    with pytest.raises(PathUnavailableError, match=rf"path 'cudnn' cannot run linear M=33 N={N} K={K} fp16 "
                                                    rf"\(bias\+gelu_erf\): N and K must be multiples of 8 "
                                                    rf"\(16-byte rows of fp16\), got N={N} K={K}"):
        linear(*args, "gelu_erf", path="cudnn")
    y = linear(*args, "gelu_erf")
    decision = libnn.get_op("linear").last_decision
    assert decision.path == "cublaslt" and decision.passed_over["cudnn"].startswith("N and K must be multiples of 8")
    assert rel_error(y, linear(x, w, b, "gelu_erf", path="reference")) <= tolerance("fp16")


def test_cudnn_refuses_fp32_by_name(rng):
    with pytest.raises(PathUnavailableError, match=r"path 'cudnn' cannot run .*fp32 is not supported "
                                                    r"\(supported: fp16, bf16"):
        linear(*to_gpu(*draw(rng, 8, 8, 8, "fp32")), "gelu_erf", path="cudnn")


@pytest.mark.parametrize("M, N, K", [(4096, 3072, 768), (2048, 1536, 384)], ids=str)
def test_auto_runs_gelu_erf_on_its_first_path_at_bert_ffn_shapes(rng, M, N, K):
    """The BERT FFN's first GEMM with the exact GELU: CUTLASS's fused kernel on Hopper, else cuBLASLt's
    GEMM + the pass (both faster than cudnn's fused graph in the encoder on the H100)."""
    x, w, b = draw(rng, M, N, K, "fp16")
    y = linear(*to_gpu(x, w, b), "gelu_erf")
    decision = libnn.get_op("linear").last_decision
    first = expected_gelu_erf_path(M, N)
    assert decision.path == first and first not in decision.passed_over
    assert M * N >= 2048 * 1536  # one case of each: 4096x3072 fills the H100's 132 SMs, 2048x1536 does not
    rows = slice(0, 256)  # the float64 reference of a slice: cheap
    assert rel_error(y[rows], linear(x[rows], w, b, "gelu_erf", path="reference")) <= tolerance("fp16")


def test_cudnn_declining_the_graph_raises_cudnns_words(rng, monkeypatch):
    """A graph cuDNN has no engine for (simulated) is a LibraryError with cuDNN's words when the path is
    forced (under auto the next path binds with a FallbackWarning: tests/test_linear_errors.py)."""
    from libnn.backends import cudnn as backend

    def refuse(*args, **kwargs):
        raise libnn.LibraryError("cuDNN cannot run this: no engine supports this graph (simulated)")

    monkeypatch.setattr(backend, "graph_for", refuse)
    libnn.get_op("linear").calls.clear()  # bound calls of earlier tests would not bind again
    x, w, b = draw(rng, 40, 64, 72, "bf16")
    with pytest.raises(libnn.LibraryError, match="no engine supports"):
        linear(*to_gpu(x, w, b), "gelu_erf", path="cudnn")


def test_cudnn_declines_a_misaligned_operand_and_auto_runs_cublaslt(rng):
    """The frontend declares every tensor 16-byte aligned: a view 2 bytes into its allocation is a
    LibraryError naming it on the cudnn path; auto runs cuBLASLt on it."""
    import cupy

    x, w, b = draw(rng, 65, 72, 64, "fp16")
    big = cupy.asarray(np.concatenate([np.zeros(1, np.float16), x.ravel()]))
    x_view = big[1:].reshape(x.shape)
    assert x_view.data.ptr % 16 == 2
    with pytest.raises(libnn.LibraryError, match="cuDNN needs 16-byte aligned buffers; x is not"):
        linear(x_view, *to_gpu(w, b), "gelu_erf", path="cudnn")
    y = linear(x_view, *to_gpu(w, b), "gelu_erf")
    assert libnn.get_op("linear").last_decision.path == "cublaslt"
    assert rel_error(y, linear(x, w, b, "gelu_erf", path="reference")) <= tolerance("fp16")


@pytest.mark.parametrize("activation", [None, "relu", "gelu_erf"])
def test_cudnn_nan_reaches_its_row_through_every_activation(rng, activation):
    """NaN stays NaN, through relu too (the op's promise on every path); an inf row stays non-finite
    without an activation (relu(-inf) is 0, and gelu(-inf) = -inf·0 has no one answer)."""
    import cupy

    x, w, b = to_gpu(*draw(rng, 4, 8, 16, "fp16"))
    x[1, 3], x[2, 0] = cupy.nan, cupy.inf
    y = linear(x, w, b, activation, path="cudnn").get()
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 3]]).all()
    if activation is None:
        assert not np.isfinite(y[2]).any()


def test_cudnn_empty_and_zero_k_inputs(rng):
    import cupy

    b = to_gpu(random_normal(rng, (8,), "fp16"))[0]
    assert linear(cupy.empty((0, 16), cupy.float16), cupy.ones((8, 16), cupy.float16), b, path="cudnn").shape == (0, 8)
    y = linear(cupy.empty((3, 0), cupy.float16), cupy.empty((8, 0), cupy.float16), b, "relu", path="cudnn")
    np.testing.assert_allclose(y.get(), np.broadcast_to(np.maximum(b.get(), 0), (3, 8)))
