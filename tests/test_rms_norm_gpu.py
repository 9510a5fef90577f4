"""rms_norm on the GPU: every path against the float64 reference on odd shapes and every dtype, plain,
with a residual and with the sum returned, outputs poisoned; every kernel version of
kernels/rms_norm.cu (the grid-stride loops and the longest rows included); misaligned rows; strided
arrays; empty inputs; bound calls reading new data; the cuDNN graph reused across eps values; the
visible fallback from custom to cudnn under auto; and the layer. About 60 cases: the GPU suite stays
fast."""

import importlib

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.nn.norm import RMSNorm
from libnn.ops.rms_norm import rms_norm
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

# the module, not the function `libnn.ops.rms_norm` that libnn/ops/__init__.py binds over its name
rms = importlib.import_module("libnn.ops.rms_norm")

# M = 1 and primes; N = 1, 7 (less than a 16-byte group), 64 (a head), 127 (prime), 1000 (fp32's widest
# warp rows, VPT 8), 4096 (a row per block: LLaMA-1B's hidden size), 5003 (odd past 1024: the loop)
SHAPES = [(1, 1), (3, 7), (13, 64), (1, 127), (7, 1000), (2, 3, 4096), (5, 5003)]
DTYPES = ["fp16", "bf16", "fp32"]
PATHS = ["custom", "cudnn"]
EPS = 1e-6


def tolerance(dtype):
    return dtypes.TOLERANCE[dtype]


def gpu(a):
    import cupy
    return None if a is None else cupy.asarray(a)


def make(rng, shape, dtype, has_weight=True):
    """x with an offset of its own (RMS norm does not centre, so the mean matters), and a weight."""
    x = (rng.standard_normal(shape) * 2 + float(rng.uniform(-3, 3))).astype(dtypes.parse(dtype))
    weight = random_normal(rng, (shape[-1],), dtype) if has_weight else None
    return x, weight


def make_residual(rng, shape, dtype):
    """A residual with its own offset and spread, so that x + r is not x's distribution shifted."""
    return (rng.standard_normal(shape) * 3 + float(rng.uniform(-20, 20))).astype(dtypes.parse(dtype))


def reference(x, weight, eps=EPS, residual=None):
    as64 = (lambda a: None if a is None else a.astype(np.float64))
    return rms_norm(as64(x), as64(weight), residual=as64(residual), eps=eps, path="reference")


def exact_sum(x, r):
    """x + r rounded once to x's dtype: the bits the kernels write (their fp32 sum, exact for two fp16 or
    bf16 values of these magnitudes, rounded to the dtype)."""
    return (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype)


def run(path, x, weight, eps=EPS, **kwargs):
    """The op on GPU copies; a graph cuDNN declines skips (auto falls back), the custom path may not."""
    try:
        return rms_norm(gpu(x), gpu(weight), eps=eps, path=path, **kwargs)
    except libnn.LibraryError as exc:
        if path != "cudnn":
            raise
        pytest.skip(f"cuDNN declined this case (auto falls back): {exc}")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_path_matches_reference_plain_with_a_residual_and_returning_the_sum(rng, path, dtype, shape):
    has_weight = shape != (1, 127)  # one shape without a weight: the kernels' null w, cuDNN's ones
    x, weight = make(rng, shape, dtype, has_weight)
    r = make_residual(rng, shape, dtype)
    y = run(path, x, weight)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, reference(x, weight)) <= tolerance(dtype)
    y_r = run(path, x, weight, residual=gpu(r))
    assert y_r.shape == x.shape and y_r.dtype == x.dtype
    assert rel_error(y_r, reference(x, weight, residual=r)) <= tolerance(dtype)
    y2, h = run(path, x, weight, residual=gpu(r), return_sum=True)
    assert h.shape == x.shape and h.dtype == x.dtype
    # as the op documents: with return_sum cuDNN normalizes h as stored (rounded to the dtype), the
    # custom path the unrounded sum; each path is held to its own oracle
    expected2 = reference(exact_sum(x, r), weight) if path == "cudnn" else reference(x, weight, residual=r)
    assert rel_error(y2, expected2) <= tolerance(dtype)
    if path == "custom":
        np.testing.assert_array_equal(h.get(), exact_sum(x, r))
        np.testing.assert_array_equal(y2.get(), y_r.get())  # the sum written or not, y is the same
    else:
        assert rel_error(h, exact_sum(x, r)) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_version_matches_reference(rng, dtype):
    """Each version the rows allow, plain and with the residual and sum: 4096, 6144, 12288 and 20000
    reach rms2_block at VPT 2, 4 and 8 (fp32: 4096, 6144, 12288; fp16/bf16: 4096, 12288, 20000), 12289
    and 40000 only the loop, and 300007 rows are more than the grid's warps (the grid-stride loops)."""
    shapes = [(1, 1), (3, 7), (17, 768), (5, 1023), (3, 4096), (3, 6144), (2, 12288), (2, 12289), (2, 20000),
              (2, 40000), (300007, 8)]
    for i, shape in enumerate(shapes):
        x, weight = make(rng, shape, dtype, has_weight=i % 3 != 2)
        r = make_residual(rng, shape, dtype)
        xg, wg, rg = gpu(x), gpu(weight), gpu(r)
        plain = rms.rms_norm_problem(xg, wg, None, EPS, False)
        fused = rms.rms_norm_problem(xg, wg, rg, EPS, True)
        expected, expected_fused = reference(x, weight), reference(x, weight, residual=r)
        for version in rms.custom_versions(fused, rms._aligned(fused, xg, wg, rg)):
            where = f"{shape} {version}"
            y = rms.launch_custom(plain, xg, wg, None, version=version)
            assert rel_error(y, expected) <= tolerance(dtype), where
            y2, h = rms.launch_custom(fused, xg, wg, rg, version=version)
            assert rel_error(y2, expected_fused) <= tolerance(dtype), where
            np.testing.assert_array_equal(h.get(), exact_sum(x, r), err_msg=where)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_rows_take_the_element_wise_kernels(rng, dtype):
    """x, then the residual, one element past a 16-byte boundary: N % V == 0 but no 16-byte access is
    allowed. custom reads them element-wise; cuDNN (whose graphs declare 16-byte alignment) refuses
    by name, and auto runs custom."""
    import cupy

    def misaligned(a):
        storage = cupy.empty(a.size + 1, a.dtype)
        storage[1:] = gpu(a).ravel()
        view = storage[1:].reshape(a.shape)
        assert view.flags.c_contiguous and view.data.ptr % 16 != 0
        return view

    for shape in [(9, 256), (3, 2048)]:
        x, weight = make(rng, shape, dtype)
        r = make_residual(rng, shape, dtype)
        for xg, rg, name in [(misaligned(x), gpu(r), "x"), (gpu(x), misaligned(r), "residual")]:
            problem = rms.rms_norm_problem(xg, gpu(weight), rg, EPS, True)
            assert not rms._aligned(problem, xg, gpu(weight), rg)
            assert "rms2_block" not in rms.custom_versions(problem, aligned=False)
            assert rms.custom_version(problem, aligned=False) == ("rms1_warp" if shape[-1] <= 1024 else "rms3_loop")
            y, h = rms_norm(xg, gpu(weight), residual=rg, return_sum=True, path="custom")
            assert rel_error(y, reference(x, weight, residual=r)) <= tolerance(dtype), (shape, name)
            np.testing.assert_array_equal(h.get(), exact_sum(x, r))
            with pytest.raises(libnn.LibraryError, match=f"cuDNN needs 16-byte aligned buffers; {name} is not"):
                rms_norm(xg, gpu(weight), residual=rg, path="cudnn")
            y = rms_norm(xg, gpu(weight), residual=rg)
            assert libnn.get_op("rms_norm").last_decision.path == "custom"
            assert rel_error(y, reference(x, weight, residual=r)) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_strided_and_batched_arrays_are_read_by_value(rng, path):
    x, _ = make(rng, (2, 5, 384), "fp16")
    wide = make_residual(rng, (2, 5, 768), "fp16")
    weight = random_normal(rng, (768,), "fp16")
    r, rg, wg = wide[..., ::2], gpu(wide)[..., ::2], gpu(weight)[::2]
    assert not rg.flags.c_contiguous and not wg.flags.c_contiguous
    try:
        y, h = rms_norm(gpu(x), wg, residual=rg, return_sum=True, path=path)
    except libnn.LibraryError as exc:
        pytest.skip(f"cuDNN declined this case: {exc}")
    assert y.shape == h.shape == x.shape
    expected = reference(exact_sum(x, r), weight[::2]) if path == "cudnn" else reference(x, weight[::2], residual=r)
    assert rel_error(y, expected) <= tolerance("fp16")
    assert rel_error(h, exact_sum(x, r)) <= tolerance("fp16")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_empty_input_gives_empty_outputs(path):
    x = np.ones((0, 16), np.float16)
    assert run(path, x, np.ones(16, np.float16)).shape == (0, 16)
    y, h = run(path, x, None, residual=gpu(x), return_sum=True)
    assert y.shape == h.shape == (0, 16)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_a_bound_call_with_new_data_gives_new_results(rng, path):
    """The second call has the first one's signature: it reuses the bound call (no new build) and reads
    the new arrays, not the ones it was bound with."""
    calls = libnn.get_op("rms_norm").calls
    x, weight = make(rng, (6, 2048), "bf16")
    r = make_residual(rng, (6, 2048), "bf16")
    y, h = run(path, x, weight, residual=gpu(r), return_sum=True)
    builds = calls.stats.builds
    x2, weight2 = make(rng, (6, 2048), "bf16")
    r2 = make_residual(rng, (6, 2048), "bf16")
    y2, h2 = run(path, x2, weight2, residual=gpu(r2), return_sum=True)
    assert calls.stats.builds == builds
    expected = reference(exact_sum(x2, r2), weight2) if path == "cudnn" else reference(x2, weight2, residual=r2)
    assert rel_error(y2, expected) <= tolerance("bf16")
    assert rel_error(h2, exact_sum(x2, r2)) <= tolerance("bf16")
    assert rel_error(y2, y.get()) > 0.1 and rel_error(h2, h.get()) > 0.1


def test_the_cudnn_graph_serves_every_eps(rng):
    """eps is a pass-by-value input, not part of the graph: a new eps builds a bound call but no graph,
    and is honoured."""
    x, weight = make(rng, (4, 96), "fp16")
    run("cudnn", x, weight)
    graphs, calls = libnn.cache_info()["cudnn graphs"], libnn.cache_info()["rms_norm calls"]
    builds, call_builds = graphs.builds, calls.builds
    y = run("cudnn", x, weight)
    assert graphs.builds == builds and calls.builds == call_builds  # the bound call was reused
    y_eps = run("cudnn", x, weight, eps=4.0)
    assert graphs.builds == builds
    assert rel_error(y, reference(x, weight)) <= tolerance("fp16")
    assert rel_error(y_eps, reference(x, weight, eps=4.0)) <= tolerance("fp16")
    assert rel_error(y_eps, y.get()) > 10 * tolerance("fp16")  # eps = 4 against a mean square of 4 to 13


def test_a_custom_failure_under_auto_falls_back_to_cudnn_visibly(rng, monkeypatch):
    """auto tries custom first; a library failure there (simulated: an NVRTC error) warns and runs cudnn."""
    pytest.importorskip("cudnn")

    def fail(*args, **kwargs):
        raise libnn.LibraryError("NVRTC could not load rms_norm.cu (simulated)")

    monkeypatch.setattr(rms, "bind_custom", fail)
    libnn.get_op("rms_norm").calls.clear()  # bound calls of earlier tests would not bind again
    x, weight = make(rng, (3, 64), "bf16")
    r = make_residual(rng, (3, 64), "bf16")
    with pytest.warns(libnn.FallbackWarning, match="path 'custom' failed.*simulated"):
        y = rms_norm(gpu(x), gpu(weight), residual=gpu(r))
    assert libnn.get_op("rms_norm").last_decision.path == "cudnn"
    assert rel_error(y, reference(x, weight, residual=r)) <= tolerance("bf16")
    libnn.get_op("rms_norm").calls.clear()  # no later test may find the cudnn-bound signature


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_the_layer_runs_on_the_gpu_through_custom(rng):
    host = RMSNorm(2048, eps=1e-5)
    host.load_state_dict({"weight": random_normal(rng, (2048,), "fp32")})
    layer = RMSNorm(2048, eps=1e-5, dtype="fp16", device="gpu")
    layer.load_state_dict(host.state_dict())
    x, r = random_normal(rng, (2, 7, 2048), "fp16"), make_residual(rng, (2, 7, 2048), "fp16")
    y, h = layer(gpu(x), gpu(r), return_sum=True)
    assert libnn.get_op("rms_norm").last_decision.path == "custom"
    assert y.shape == x.shape and y.dtype == np.float16
    assert rel_error(y, reference(x, layer.weight.get(), eps=1e-5, residual=r)) <= tolerance("fp16")
    np.testing.assert_array_equal(h.get(), exact_sum(x, r))
