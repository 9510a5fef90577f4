"""conv2d and pooling on the GPU: every path against the float64 reference over a sweep of shapes,
dtypes and layouts, outputs poisoned; the cuDNN plan cache in memory and across processes."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops.activations import apply
from libnn.ops.conv2d import conv2d, fold_batchnorm
from libnn.ops.pool2d import avg_pool2d, max_pool2d
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

# (N, C, H, W, K, R, S, stride, padding, dilation, groups)
SHAPES = [
    (1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1),
    (2, 3, 13, 11, 5, 3, 3, 1, 1, 1, 1),
    (1, 16, 17, 17, 24, 3, 3, 2, 1, 1, 1),
    (2, 64, 14, 14, 64, 3, 3, 1, 1, 1, 1),
    (1, 32, 9, 9, 32, 3, 3, 1, 2, 2, 1),
    (3, 8, 10, 7, 16, 1, 1, 1, 0, 1, 1),
    (1, 16, 12, 12, 32, 3, 3, 1, 1, 1, 4),
    (2, 32, 15, 15, 32, 3, 3, 1, 1, 1, 32),   # depthwise
    (1, 7, 23, 29, 13, 5, 5, 2, 2, 1, 1),
]
DTYPES = ["fp16", "bf16", "fp32"]
PATHS = ["cudnn", "cudnn+epilogue", "custom"]


def tolerance(dtype):
    return dtypes.TOLERANCE[dtype]


def make(rng, shape, dtype, layout):
    N, C, H, W, K, R, S, stride, padding, dilation, groups = shape
    x = random_normal(rng, (N, C, H, W), dtype)
    w = random_normal(rng, (K, C // groups, R, S), dtype, 1 / math.sqrt(C // groups * R * S))
    if layout == "NHWC":
        x, w = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), np.ascontiguousarray(w.transpose(0, 2, 3, 1))
    b = random_normal(rng, (K,), dtype)
    bn = (random_normal(rng, (K,), "fp32"), random_normal(rng, (K,), "fp32"), random_normal(rng, (K,), "fp32"),
          rng.uniform(0.5, 2, K).astype(np.float32), 1e-5)
    return x, w, b, bn, dict(stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout)


def gpu(a):
    import cupy
    return cupy.asarray(a)


def run(path, x, w, b, bn, kwargs, activation):
    if path == "reference":
        return conv2d(x, w, b, bn=bn, activation=activation, path="reference", **kwargs)
    return conv2d(gpu(x), gpu(w), gpu(b), bn=tuple(gpu(v) for v in bn[:4]) + (bn[4],), activation=activation,
                  path=path, **kwargs)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_conv_path_matches_reference(rng, path, dtype, layout, shape):
    x, w, b, bn, kwargs = make(rng, shape, dtype, layout)
    activation = ["relu", "relu6", "gelu", "silu", None][rng.integers(5)]
    bn64 = tuple(v.astype(np.float64) for v in bn[:4]) + (bn[4],)
    if path == "cudnn+epilogue":
        # two passes: the convolution is rounded to the I/O dtype before the epilogue reads it back,
        # so the reference rounds there too (a cancelling shift would otherwise magnify that rounding)
        conv = run("reference", x, w, None, None, kwargs, None).astype(np.float64)
        scale, shift = fold_batchnorm(*bn64)
        channel = (1, 1, 1, -1) if layout == "NHWC" else (1, -1, 1, 1)
        expected = apply(conv * scale.reshape(channel) + (shift + b.astype(np.float64) * scale).reshape(channel),
                         activation)
    else:
        expected = run("reference", x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), bn64, kwargs,
                       activation)
    try:
        y = run(path, x, w, b, bn, kwargs, activation)
    except (libnn.LibraryError, libnn.PathUnavailableError) as exc:  # refused by cuDNN, or by libnn's rule
        pytest.skip(f"the library declined this case (auto falls back): {exc}")
    assert y.shape == expected.shape and y.dtype == x.dtype
    if (path, dtype) == ("cudnn", "fp32") and activation in ("gelu", "silu"):
        # cuDNN's pointwise GELU and swish evaluate tanh and exp approximately (like cuBLASLt's GELU,
        # tests/test_linear_gpu.py): a relative bound alone fails whenever the outputs happen to be tiny
        assert rel_error(y, expected) <= tolerance(dtype) or np.abs(y.get() - expected).max() <= 1e-5, activation
    else:
        assert rel_error(y, expected) <= tolerance(dtype), activation


# 1×1 outputs (7×7 input, 4×4 kernel dilated by 2): cuDNN 9.19's fused conv→relu engine wrote NCHW
# results misplaced (y[n, k] at y[k, n], garbage for C > 1; found by the property tests on the H100),
# so the fused path refuses NCHW 1×1 outputs with an epilogue and auto runs cudnn+epilogue
ONE_BY_ONE = [(2, 1, 7, 7, 2, 4, 4, 1, 0, 2, 1), (2, 2, 7, 7, 2, 4, 4, 1, 0, 2, 1),
              (2, 8, 7, 7, 2, 4, 4, 1, 0, 2, 1), (2, 1, 7, 7, 8, 4, 4, 1, 0, 2, 1), (3, 5, 3, 3, 7, 3, 3, 1, 0, 1, 1)]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["auto", "cudnn", "cudnn+epilogue"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", ONE_BY_ONE, ids=lambda s: "-".join(map(str, s)))
def test_cudnn_one_by_one_output_lands_in_place(rng, path, layout, shape):
    x, w, b, _, kwargs = make(rng, shape, "fp16", layout)
    expected = run("reference", x.astype(np.float64), w.astype(np.float64), None, None, kwargs, "relu")
    if (path, layout) == ("cudnn", "NCHW"):
        with pytest.raises(libnn.PathUnavailableError, match="misplace NCHW 1x1 outputs with an epilogue"):
            conv2d(gpu(x), gpu(w), activation="relu", path=path, **kwargs)
        return
    try:
        y = conv2d(gpu(x), gpu(w), activation="relu", path=path, **kwargs)
    except libnn.LibraryError as exc:
        pytest.skip(f"the library declined this case (auto falls back): {exc}")
    assert y.shape == expected.shape
    assert rel_error(y, expected) <= tolerance("fp16")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_always_finds_a_path_and_says_which(rng, dtype):
    x, w, b, bn, kwargs = make(rng, (2, 16, 9, 9, 8, 3, 3, 1, 1, 1, 1), dtype, "NHWC")
    y = run("auto", x, w, b, bn, kwargs, "relu")
    decision = libnn.get_op("conv2d").last_decision
    assert decision.path in PATHS
    expected = run("reference", x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                   tuple(v.astype(np.float64) for v in bn[:4]) + (bn[4],), kwargs, "relu")
    assert rel_error(y, expected) <= tolerance(dtype)


# dense (conv3_igemm, or conv4_igemm in fp32), grouped (conv1_direct) and depthwise (conv2_depthwise)
BOUND_SHAPES = [(2, 16, 9, 7, 24, 3, 3, 1, 1, 1, 1), (1, 16, 8, 8, 32, 3, 3, 2, 1, 1, 4),
                (2, 32, 9, 9, 32, 3, 3, 1, 1, 1, 32)]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("shape", BOUND_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_a_bound_custom_call_equals_a_fresh_one_on_new_values(rng, dtype, layout, shape):
    """The custom path's bound call reads every array at each call: given other arrays, then other
    values in those same arrays (x, w, b and the batch norm's four), it returns what a newly bound call
    returns, bit for bit (the same kernel on the same inputs), and the reference's result."""
    import cupy

    op = libnn.get_op("conv2d")

    def custom(x, w, b, bn, kwargs):
        return run("custom", x, w, b, bn, kwargs, "relu")

    def reference(x, w, b, bn, kwargs):
        return run("reference", x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                   tuple(v.astype(np.float64) for v in bn[:4]) + (bn[4],), kwargs, "relu")

    def on_gpu(x, w, b, bn):
        return gpu(x), gpu(w), gpu(b), tuple(gpu(v) for v in bn[:4]) + (bn[4],)

    first, second, third = (make(rng, shape, dtype, layout) for _ in range(3))
    custom(*first)  # binds (or finds the bound call of an earlier test)
    builds = op.calls.stats.builds
    x, w, b, bn = on_gpu(*second[:4])
    other_arrays = custom(x, w, b, bn, second[4])
    nx, nw, nb, nbn = on_gpu(*third[:4])
    for old, new in zip((x, w, b, *bn[:4]), (nx, nw, nb, *nbn[:4])):
        old[...] = new
    other_values = custom(x, w, b, bn, third[4])
    assert op.calls.stats.builds == builds  # one signature: the bound call ran both times
    op.calls.clear()
    fresh = custom(x, w, b, bn, third[4])
    assert op.calls.stats.builds == builds + 1
    assert cupy.array_equal(other_values, fresh)  # poisoned memory: an unwritten output is NaN, never equal
    assert rel_error(other_arrays, reference(*second)) <= tolerance(dtype)
    assert rel_error(other_values, reference(*third)) <= tolerance(dtype)


def test_second_call_reuses_the_graph(rng):
    x, w, b, bn, kwargs = make(rng, (1, 8, 6, 6, 8, 3, 3, 1, 1, 1, 1), "fp16", "NHWC")
    run("cudnn", x, w, b, bn, kwargs, "relu")
    builds = libnn.cache_info()["cudnn graphs"].builds
    run("cudnn", x, w, b, bn, kwargs, "relu")
    assert libnn.cache_info()["cudnn graphs"].builds == builds


WARM_START = """
import json, cupy, numpy as np
import libnn
from libnn.ops.conv2d import conv2d
from libnn.backends import cudnn
calls, graphs = {"graph builds": 0}, []
def counting(real):
    def wrapped(*args, **kwargs):
        calls["graph builds"] += 1
        return real(*args, **kwargs)
    return wrapped
def recording(real):
    def wrapped(*args, **kwargs):
        graphs.append(real(*args, **kwargs))
        return graphs[-1]
    return wrapped
cudnn.planned_graph = counting(cudnn.planned_graph)  # every cuDNN graph libnn builds goes through it
cudnn.graph_for = recording(cudnn.graph_for)  # every planned graph an op runs comes from it
x = cupy.asarray(np.random.default_rng(0).standard_normal((32, 56, 56, 64)).astype(np.float16))
w = cupy.asarray((np.random.default_rng(1).standard_normal((64, 3, 3, 64)) / 24).astype(np.float16))
b = cupy.asarray(np.random.default_rng(2).standard_normal(64).astype(np.float16))
y = conv2d(x, w, b, padding=1, activation="relu", path="cudnn")
print(json.dumps({**calls, "nvrtc compiles": libnn.cache_info()["kernel compiles"].builds, "source": graphs[0].source,
                  "checksum": float(cupy.abs(y.astype(cupy.float32)).sum())}))
"""


def test_plan_cache_round_trip_across_processes(tmp_path):
    """A second process finds the plan on disk: it deserializes it (no graph build, no NVRTC) and gets the
    same result. How fast that is belongs to `libnn bench models` (cold start), not to a test."""
    env = {**__import__("os").environ, "LIBNN_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", WARM_START], env=env, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]
    print(runs)
    assert runs[0]["source"] == "built" and runs[0]["graph builds"] >= 1
    assert runs[1]["source"] == "disk cache"
    assert runs[1]["graph builds"] == 0 and runs[1]["nvrtc compiles"] == 0
    assert runs[0]["checksum"] == runs[1]["checksum"]


def test_cudnn_failure_under_auto_falls_back_visibly(rng, monkeypatch):
    from libnn.backends import cudnn as backend

    def refuse(*args, **kwargs):
        raise libnn.LibraryError("cuDNN cannot run this: no engine supports this graph (simulated)")

    monkeypatch.setattr(backend, "graph_for", refuse)
    libnn.get_op("conv2d").calls.clear()  # bound calls of earlier tests would not bind again
    x, w, b, bn, kwargs = make(rng, (1, 8, 6, 6, 8, 3, 3, 1, 1, 1, 1), "fp16", "NHWC")
    with pytest.warns(libnn.FallbackWarning, match="path 'cudnn' failed.*no engine supports this graph"):
        run("auto", x, w, b, bn, kwargs, "relu")
    assert libnn.get_op("conv2d").last_decision.path == "custom"
    with pytest.raises(libnn.LibraryError, match="no engine supports"):
        run("cudnn", x, w, b, bn, kwargs, "relu")


POOL_SHAPES = [(1, 1, 1, 1, 1, 1, 0), (2, 13, 11, 3, 2, 2, 0), (1, 17, 17, 16, 3, 2, 1), (4, 28, 28, 64, 2, 2, 0),
               (1, 9, 12, 5, 3, 1, 1)]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("shape", POOL_SHAPES, ids=str)
def test_pool_matches_reference(rng, mode, dtype, layout, shape):
    N, H, W, C, k, s, p = shape
    x = random_normal(rng, (N, H, W, C) if layout == "NHWC" else (N, C, H, W), dtype)
    pool = max_pool2d if mode == "max" else avg_pool2d
    expected = pool(x.astype(np.float64), k, s, p, layout=layout)
    y = pool(gpu(x), k, s, p, layout=layout, path="custom")
    assert y.shape == expected.shape and rel_error(y, expected) <= tolerance(dtype)


def test_max_pool_propagates_nan():
    x = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
    x[0, 1, 1, 0] = np.nan
    y = max_pool2d(gpu(x), 2).get()
    assert np.isnan(y[0, 0, 0, 0]) and np.isfinite(y.ravel()[1:]).all()


@pytest.mark.parametrize("fold_bn", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_fused_conv_model_on_gpu_matches_reference(rng, fold_bn, dtype):
    from test_nn_conv import layer_by_layer, model

    host = model(fold_bn)
    gpu_model = model(fold_bn, dtype=dtype, device="gpu")
    gpu_model.load_state_dict({k: v.astype(dtypes.parse(dtype)) for k, v in host.state_dict().items()})
    x = rng.standard_normal((4, 16, 16, 3))
    y = gpu_model(gpu(x.astype(dtypes.parse(dtype))))
    assert rel_error(y, layer_by_layer(host, x)) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_strided_fp32_bias_and_scale_shift_are_read_as_values(rng, path):
    """Strided fp32 views as b and bn=(scale, shift): the paths read packed (K,) vectors, so the op
    must pass them packed (an fp32 view once reached the kernels as it was)."""
    import cupy

    x, w, _, _, kwargs = make(rng, (2, 8, 9, 9, 6, 3, 3, 1, 1, 1, 1), "fp16", "NHWC")
    b, scale, shift = (random_normal(rng, (12,), "fp32")[::2] for _ in range(3))
    expected = conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                      bn=(scale.astype(np.float64), shift.astype(np.float64)), path="reference", **kwargs)
    strided = [cupy.asarray(np.repeat(v, 2))[::2] for v in (b, scale, shift)]
    assert not strided[0].flags.c_contiguous
    try:
        y = conv2d(gpu(x), gpu(w), strided[0], bn=(strided[1], strided[2]), path=path, **kwargs)
    except libnn.LibraryError as exc:
        pytest.skip(f"the library declined this case (auto falls back): {exc}")
    assert rel_error(y, expected) <= tolerance("fp16")
