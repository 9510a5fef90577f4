"""layer_norm on the GPU: every path and every kernel version against the float64 reference over a
sweep of shapes and dtypes, outputs poisoned; rows with a large mean offset; misaligned rows; the
cuDNN graph reused across calls and eps values; the visible fallback when cuDNN declines; and the
fused residual (x + residual normalized, the sum returned) on every path and kernel version, against
the reference and against the unfused add then layer_norm."""

import importlib
import warnings

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.nn.norm import LayerNorm
from libnn.ops.layer_norm import layer_norm
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

# the module, not the function `libnn.ops.layer_norm` that libnn/ops/__init__.py binds over its name
layer_norm_op = importlib.import_module("libnn.ops.layer_norm")

SHAPES = [(1, 1), (3, 7), (17, 384), (128, 768), (5, 1023), (2, 3, 4096), (1, 12289),
          (4, 20000),     # beyond the fp32 register kernels: ln3_loop for fp32
          (2, 40000),     # beyond every register kernel: ln3_loop for all dtypes
          (300000, 8)]    # more rows than the grid has blocks: the grid-stride loops
DTYPES = ["fp16", "bf16", "fp32"]
PATHS = ["cudnn", "custom"]


def tolerance(dtype):
    return dtypes.TOLERANCE[dtype]


def gpu(a):
    import cupy
    return None if a is None else cupy.asarray(a)


def make(rng, shape, dtype, offset=0.0, affine="weight+bias"):
    N = shape[-1]
    x = (rng.standard_normal(shape) * 2 + offset).astype(dtypes.parse(dtype))
    weight = random_normal(rng, (N,), dtype) if "weight" in affine else None
    bias = random_normal(rng, (N,), dtype) if "bias" in affine else None
    return x, weight, bias


def reference(x, weight, bias, eps=1e-5, residual=None):
    as64 = (lambda a: None if a is None else a.astype(np.float64))
    return layer_norm(as64(x), as64(weight), as64(bias), residual=as64(residual), eps=eps, path="reference")


def run(path, x, weight, bias, eps=1e-5, **residual):
    try:
        return layer_norm(gpu(x), gpu(weight), gpu(bias), eps=eps, path=path, **residual)
    except libnn.LibraryError as exc:
        pytest.skip(f"the library declined this case (auto falls back): {exc}")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_path_matches_reference(rng, path, dtype, shape):
    affine = ["weight+bias", "weight", "bias", "none"][rng.integers(4)]
    x, weight, bias = make(rng, shape, dtype, affine=affine)
    y = run(path, x, weight, bias)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, reference(x, weight, bias)) <= tolerance(dtype), affine


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 768), (5, 1023), (3, 4096), (2, 40000)], ids=lambda s: "x".join(map(str, s)))
def test_large_mean_offset_does_not_cancel(rng, path, dtype, shape):
    """x = 100 + 2·N(0, 1): E[x²] − E[x]² in fp32 would keep two digits of the variance."""
    x, weight, bias = make(rng, shape, dtype, offset=100.0)
    y = run(path, x, weight, bias)
    # cuDNN's fp32 kernel does not cancel either, but its sums keep ~2 ulps less of the offset than
    # ours (1.004e-5 seen at 5x1023 on the H100): it gets 2e-5 there, still far below E[x²]−E[x]²'s 1e-2
    limit = 2e-5 if (path, dtype) == ("cudnn", "fp32") else tolerance(dtype)
    assert rel_error(y, reference(x, weight, bias)) <= limit


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_kernel_version_matches_reference(rng, dtype, shape):
    x, weight, bias = make(rng, shape, dtype, offset=float(rng.uniform(-50, 50)))
    xg, wg, bg = gpu(x).reshape(-1, shape[-1]), gpu(weight), gpu(bias)
    problem = layer_norm_op.layer_norm_problem(xg, wg, bg, None, 1e-5, False)
    expected = reference(x, weight, bias).reshape(-1, shape[-1])
    for version in layer_norm_op.custom_versions(problem, layer_norm_op._aligned(problem, xg, wg, bg)):
        y = layer_norm_op.launch_custom(problem, xg, wg, bg, version=version)
        assert rel_error(y, expected) <= tolerance(dtype), version


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 256), (4, 1024), (3, 2048), (2, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_misaligned_rows_take_the_element_wise_kernels(rng, dtype, shape):
    """x one element past a 16-byte boundary: N % V == 0, but no 16-byte access is allowed. custom
    reads it element-wise; cuDNN (whose graphs declare 16-byte alignment) refuses it clearly."""
    import cupy

    x, weight, bias = make(rng, shape, dtype)
    storage = cupy.empty(x.size + 1, x.dtype)
    storage[1:] = gpu(x).ravel()
    xg = storage[1:].reshape(shape)
    assert xg.flags.c_contiguous and xg.data.ptr % 16 != 0
    expected = reference(x, weight, bias)
    problem = layer_norm_op.layer_norm_problem(xg, gpu(weight), gpu(bias), None, 1e-5, False)
    assert "ln2_block" not in layer_norm_op.custom_versions(problem, aligned=False)
    assert layer_norm_op.custom_version(problem, aligned=False) == ("ln1_warp" if shape[-1] <= 1024 else "ln3_loop")
    assert rel_error(layer_norm(xg, gpu(weight), gpu(bias), path="custom"), expected) <= tolerance(dtype)
    with pytest.raises(libnn.LibraryError, match="cuDNN needs 16-byte aligned buffers; x is not"):
        layer_norm(xg, gpu(weight), gpu(bias), path="cudnn")
    y = layer_norm(xg, gpu(weight), gpu(bias))
    assert libnn.get_op("layer_norm").last_decision.path == "custom"
    assert rel_error(y, expected) <= tolerance(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_feature_normalizes_to_the_bias(rng, path, dtype):
    """N = 1: x − mean is 0, so y = bias; exactly so in our kernels (x − x[0] is an exact 0)."""
    x, weight, bias = make(rng, (6, 1), dtype, offset=100.0)
    y = run(path, x, weight, bias)
    expected = np.broadcast_to(bias, (6, 1))
    if path == "custom":
        np.testing.assert_array_equal(y.get(), expected)
    else:
        assert rel_error(y, expected) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_empty_input_gives_an_empty_output(path):
    y = run(path, np.ones((0, 16), np.float16), np.ones(16, np.float16), None)
    assert y.shape == (0, 16)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_picks_a_path_and_says_which(rng, dtype):
    x, weight, bias = make(rng, (8, 768), dtype)
    y = layer_norm(gpu(x), gpu(weight), gpu(bias))
    assert libnn.get_op("layer_norm").last_decision.path in PATHS
    assert rel_error(y, reference(x, weight, bias)) <= tolerance(dtype)


def test_cached_calls_reuse_the_graph_for_any_eps(rng):
    """eps is a pass-by-value input, not part of the graph: a new eps builds nothing and is honoured."""
    x, weight, bias = make(rng, (4, 96), "fp16")
    run("cudnn", x, weight, bias, eps=1e-5)
    graphs, calls = libnn.cache_info()["cudnn graphs"], libnn.cache_info()["layer_norm calls"]
    builds, call_builds = graphs.builds, calls.builds
    y = run("cudnn", x, weight, bias, eps=1e-5)
    assert graphs.builds == builds and calls.builds == call_builds  # the bound call was reused
    y_eps = run("cudnn", x, weight, bias, eps=4.0)
    assert graphs.builds == builds
    assert rel_error(y, reference(x, weight, bias)) <= tolerance("fp16")
    assert rel_error(y_eps, reference(x, weight, bias, eps=4.0)) <= tolerance("fp16")
    assert rel_error(y_eps, y.get()) > 10 * tolerance("fp16")  # eps = 4 (var is about 4) really changed y


def test_library_failure_under_auto_falls_back_visibly(rng, monkeypatch):
    """auto tries custom first; a library failure there (simulated: an NVRTC error) warns and runs
    cudnn. A cuDNN refusal on the forced path surfaces with cuDNN's words."""
    from libnn.backends import cudnn as backend

    def fail(*args, **kwargs):
        raise libnn.LibraryError("NVRTC could not load layer_norm.cu (simulated)")

    monkeypatch.setattr(layer_norm_op, "bind_custom", fail)
    libnn.get_op("layer_norm").calls.clear()  # bound calls of earlier tests would not bind again
    x, weight, bias = make(rng, (3, 64), "bf16")
    with pytest.warns(libnn.FallbackWarning, match="path 'custom' failed.*simulated"):
        y = layer_norm(gpu(x), gpu(weight), gpu(bias))
    assert libnn.get_op("layer_norm").last_decision.path == "cudnn"
    assert rel_error(y, reference(x, weight, bias)) <= tolerance("bf16")

    def refuse(*args, **kwargs):
        raise libnn.LibraryError("cuDNN cannot run this: no engine supports this graph (simulated)")

    monkeypatch.setattr(backend, "graph_for", refuse)
    libnn.get_op("layer_norm").calls.clear()
    with pytest.raises(libnn.LibraryError, match="no engine supports"):
        layer_norm(gpu(x), gpu(weight), gpu(bias), path="cudnn")


def test_layer_on_gpu_matches_reference(rng):
    host = LayerNorm(384, eps=1e-12)
    host.load_state_dict({"weight": random_normal(rng, (384,), "fp32"), "bias": random_normal(rng, (384,), "fp32")})
    layer = LayerNorm(384, eps=1e-12, dtype="fp16", device="gpu")
    layer.load_state_dict(host.state_dict())
    x = random_normal(rng, (2, 7, 384), "fp16")
    y = layer(gpu(x))
    assert y.shape == x.shape and y.dtype == np.float16
    assert rel_error(y, reference(x, layer.weight.get(), layer.bias.get(), eps=1e-12)) <= tolerance("fp16")


# --- the fused residual: layer_norm(x, weight, bias, residual=r[, return_sum=True]) ----------------------
# rows 1 and primes; widths 1, odd, the BERT widths, 1000 and an odd width past 1024 (ln3_loop), and
# more rows than ln1_warp's grid has warps (the grid-stride loop)
RESIDUAL_SHAPES = [(1, 1), (3, 7), (13, 31), (1, 384), (17, 768), (7, 1000), (5, 4099), (2, 3, 768), (1, 4099),
                   (3, 20000), (300007, 8)]


def make_residual(rng, shape, dtype):
    """A residual with its own offset and spread, so that x + r is not x's distribution shifted."""
    return (rng.standard_normal(shape) * 3 + float(rng.uniform(-20, 20))).astype(dtypes.parse(dtype))


def exact_sum(x, r):
    """x + r rounded once to x's dtype: the bits the kernels write (their fp32 sum rounded to the dtype;
    of two fp16/bf16 values it is exact, and where fp32 must round, its error is far below half a unit
    of the dtype, so the second rounding lands where a single one would)."""
    return (x.astype(np.float64) + r.astype(np.float64)).astype(x.dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RESIDUAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_residual_path_matches_reference(rng, path, dtype, shape):
    affine = ["weight+bias", "weight", "bias", "none"][rng.integers(4)]
    x, weight, bias = make(rng, shape, dtype, offset=float(rng.uniform(-10, 10)), affine=affine)
    r = make_residual(rng, shape, dtype)
    expected = reference(x, weight, bias, residual=r)
    y = run(path, x, weight, bias, residual=gpu(r))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, expected) <= tolerance(dtype), affine
    y2, h = run(path, x, weight, bias, residual=gpu(r), return_sum=True)
    assert h.shape == x.shape and h.dtype == x.dtype
    # as the op documents: with return_sum, cuDNN normalizes h as stored (rounded to the dtype, as
    # PyTorch's layer_norm(x + r) does); the custom path the unrounded sum. At |x + r| ~ 30, rounding
    # h to bf16 moves y by ~1%, so each path is held to its own oracle.
    expected2 = reference(exact_sum(x, r), weight, bias) if path == "cudnn" else expected
    assert rel_error(y2, expected2) <= tolerance(dtype), affine
    if path == "custom":
        np.testing.assert_array_equal(h.get(), exact_sum(x, r))
        np.testing.assert_array_equal(y2.get(), y.get())  # the sum written or not, y is the same
    else:
        assert rel_error(h, exact_sum(x, r)) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 384), (17, 768), (5, 4099)], ids=lambda s: "x".join(map(str, s)))
def test_fused_residual_matches_add_then_layer_norm(rng, path, dtype, shape):
    """The fused call against the two passes it replaces: the sum written in the dtype (rounded once,
    as an add kernel writes it; made on the host, since CuPy's bf16 arithmetic is not assumed), then
    layer_norm of it. They differ by that rounding only, within the dtype's tolerance."""
    x, weight, bias = make(rng, shape, dtype)
    r = make_residual(rng, shape, dtype)
    unfused = run(path, exact_sum(x, r), weight, bias)
    fused = run(path, x, weight, bias, residual=gpu(r))
    assert rel_error(fused, unfused.get()) <= tolerance(dtype)
    assert rel_error(fused, reference(x, weight, bias, residual=r)) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 768), (5, 1023), (3, 4096), (3, 6144), (2, 12288), (2, 12289),
                                   (2, 40000)], ids=lambda s: "x".join(map(str, s)))
def test_every_kernel_version_adds_the_residual(rng, dtype, shape):
    """Each version the rows allow (6144 and 12288 reach ln2_block_vec4: fp32 and fp16/bf16), with the
    sum written and without: y the same either way, the sum x + r rounded once."""
    x, weight, bias = make(rng, shape, dtype, offset=float(rng.uniform(-50, 50)))
    r = make_residual(rng, shape, dtype)
    xg, wg, bg, rg = gpu(x), gpu(weight), gpu(bias), gpu(r)
    problem = layer_norm_op.layer_norm_problem(xg, wg, bg, rg, 1e-5, True)
    expected = reference(x, weight, bias, residual=r)
    for version in layer_norm_op.custom_versions(problem, layer_norm_op._aligned(problem, xg, wg, bg, rg)):
        y, h = layer_norm_op.launch_custom(problem, xg, wg, bg, rg, version=version)
        assert rel_error(y, expected) <= tolerance(dtype), version
        np.testing.assert_array_equal(h.get(), exact_sum(x, r), err_msg=version)
        y_only = layer_norm_op.bind_custom(
            layer_norm_op.layer_norm_problem(xg, wg, bg, rg, 1e-5, False), xg, wg, bg, rg, version)(xg, wg, bg, rg)
        np.testing.assert_array_equal(y_only.get(), y.get(), err_msg=version)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 256), (3, 2048)], ids=lambda s: "x".join(map(str, s)))
def test_a_misaligned_residual_takes_the_element_wise_kernels(rng, dtype, shape):
    """x aligned, the residual one element past a 16-byte boundary: no 16-byte access of it is allowed."""
    import cupy

    x, weight, bias = make(rng, shape, dtype)
    r = make_residual(rng, shape, dtype)
    storage = cupy.empty(r.size + 1, r.dtype)
    storage[1:] = gpu(r).ravel()
    rg = storage[1:].reshape(shape)
    assert rg.flags.c_contiguous and rg.data.ptr % 16 != 0
    problem = layer_norm_op.layer_norm_problem(gpu(x), gpu(weight), gpu(bias), rg, 1e-5, True)
    assert not layer_norm_op._aligned(problem, gpu(x), gpu(weight), gpu(bias), rg)
    y, h = layer_norm(gpu(x), gpu(weight), gpu(bias), residual=rg, return_sum=True, path="custom")
    assert rel_error(y, reference(x, weight, bias, residual=r)) <= tolerance(dtype)
    np.testing.assert_array_equal(h.get(), exact_sum(x, r))
    with pytest.raises(libnn.LibraryError, match="cuDNN needs 16-byte aligned buffers; residual is not"):
        layer_norm(gpu(x), gpu(weight), gpu(bias), residual=rg, path="cudnn")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_strided_and_batched_residuals_are_read_by_value(rng, path):
    x, weight, bias = make(rng, (2, 5, 384), "fp16")
    wide = make_residual(rng, (2, 5, 768), "fp16")
    r = wide[..., ::2]
    rg = gpu(wide)[..., ::2]
    assert not rg.flags.c_contiguous
    y, h = run(path, x, weight, bias, residual=rg, return_sum=True)
    assert y.shape == h.shape == x.shape
    assert rel_error(y, reference(x, weight, bias, residual=r)) <= tolerance("fp16")
    assert rel_error(h, exact_sum(x, r)) <= tolerance("fp16")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_a_bound_residual_call_with_new_data_gives_new_results(rng, path):
    """The second call has the first one's signature: it reuses the bound call (no new build) and
    reads the new arrays, not the ones it was bound with."""
    calls = libnn.get_op("layer_norm").calls
    x, weight, bias = make(rng, (6, 768), "bf16")
    r = make_residual(rng, (6, 768), "bf16")
    y, h = run(path, x, weight, bias, residual=gpu(r), return_sum=True)
    builds = calls.stats.builds
    x2, weight2, bias2 = make(rng, (6, 768), "bf16")
    r2 = make_residual(rng, (6, 768), "bf16")
    y2, h2 = run(path, x2, weight2, bias2, residual=gpu(r2), return_sum=True)
    assert calls.stats.builds == builds
    assert rel_error(y2, reference(x2, weight2, bias2, residual=r2)) <= tolerance("bf16")
    assert rel_error(h2, exact_sum(x2, r2)) <= tolerance("bf16")
    assert rel_error(y2, y.get()) > 0.1 and rel_error(h2, h.get()) > 0.1


def test_a_residual_on_another_device_is_refused_by_name(rng):
    x, weight, bias = make(rng, (3, 8), "fp32")
    r = make_residual(rng, (3, 8), "fp32")
    with pytest.raises(libnn.LibnnError, match=r"layer_norm: all arrays must be on one device, got x on gpu:\d+, "
                                               r"weight on gpu:\d+, bias on gpu:\d+, residual on cpu"):
        layer_norm(gpu(x), gpu(weight), gpu(bias), residual=r)


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_auto_with_a_residual_tries_cudnn_first_on_long_odd_rows_and_falls_back_visibly(rng):
    """N = 4099 takes the looping kernel, so auto tries cudnn first. cuDNN either runs the add →
    layernorm graph or declines it (no engine fuses the add); then a FallbackWarning names cudnn's
    failure and custom computes it. Either way the result is right."""
    pytest.importorskip("cudnn")
    libnn.get_op("layer_norm").calls.clear()
    x, weight, bias = make(rng, (5, 4099), "fp16")
    r = make_residual(rng, (5, 4099), "fp16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, h = layer_norm(gpu(x), gpu(weight), gpu(bias), residual=gpu(r), return_sum=True)
    decision = libnn.get_op("layer_norm").last_decision
    fallbacks = [w for w in caught if issubclass(w.category, libnn.FallbackWarning)]
    if decision.path == "cudnn":
        assert not fallbacks
    else:
        assert decision.path == "custom" and "failed" in decision.passed_over["cudnn"]
        assert len(fallbacks) == 1 and "path 'cudnn' failed" in str(fallbacks[0].message)
    assert rel_error(y, reference(x, weight, bias, residual=r)) <= tolerance("fp16")
    assert rel_error(h, exact_sum(x, r)) <= tolerance("fp16")


def test_a_cudnn_refusal_of_the_fused_graph_falls_back_to_custom(rng, monkeypatch):
    """Simulated: cuDNN builds the plain graph but declines every add → layernorm one. auto warns once
    per signature, runs custom, and the plain call on the same rows still runs cudnn."""
    from libnn.backends import cudnn as backend

    pytest.importorskip("cudnn")
    real = backend.graph_for

    def decline_fused(key, *args, **kwargs):
        if key[-2]:  # graph_key's has_residual
            raise libnn.LibraryError("cuDNN cannot run this: no engine supports this graph (simulated)")
        return real(key, *args, **kwargs)

    monkeypatch.setattr(backend, "graph_for", decline_fused)
    op = libnn.get_op("layer_norm")
    op.calls.clear()
    x, weight, bias = make(rng, (5, 4099), "fp32")
    r = make_residual(rng, (5, 4099), "fp32")
    with pytest.warns(libnn.FallbackWarning, match="path 'cudnn' failed.*no engine supports this graph"):
        y = layer_norm(gpu(x), gpu(weight), gpu(bias), residual=gpu(r))
    assert op.last_decision.path == "custom"
    assert rel_error(y, reference(x, weight, bias, residual=r)) <= tolerance("fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", libnn.FallbackWarning)  # bound to custom for good: no second warning
        layer_norm(gpu(x), gpu(weight), gpu(bias), residual=gpu(r))
    assert op.last_decision.path == "custom"
    layer_norm(gpu(x), gpu(weight), gpu(bias))
    assert op.last_decision.path == "cudnn"
