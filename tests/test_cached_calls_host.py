"""The cached calls of layer_norm, rms_norm, softmax and the poolings on the CPU, through the whole front
end: keys that hold each option with its type (a value the checks refuse never finds the bound call of
an equal value they take), and GPU paths run against a stand-in for CuPy and the kernel launch, which
checks what each call passes: the caller's own arrays where they are contiguous (no view made per
call), copies where they are strided, outputs in x's shape, and no null pointer passed per call."""

import sys
import types
from dataclasses import replace

import numpy as np
import pytest

import libnn
from libnn.ops import avg_pool2d, layer_norm, max_pool2d, rms_norm, softmax
from libnn.runtime import contracts, launch

from conftest import random_normal
from gpu_stand_ins import CUDA, DeviceArray, on_device, report_a_gpu

LN = sys.modules["libnn.ops.layer_norm"]
OPS = ("layer_norm", "rms_norm", "softmax", "pool2d")


# --- keys: every option with its type --------------------------------------------------------------------
def test_layer_norm_eps_keys_as_a_float_and_refused_types_never_find_its_bound_call(rng):
    """An exact float eps is its own key: an exact int equal to it finds its bound call (the checks take
    it as the same eps), every other type is keyed apart and refused as before."""
    x = random_normal(rng, (3, 8), "fp64")
    y = layer_norm(x, eps=1.0)
    np.testing.assert_array_equal(layer_norm(x, eps=1), y)
    np.testing.assert_array_equal(layer_norm(x, eps=np.float32(1.0)), y)
    for eps in (True, np.True_, complex(1.0), (1.0,), [1.0], "1.0"):
        with pytest.raises(TypeError, match="layer_norm: eps must be a finite number > 0, got"):
            layer_norm(x, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got nan"):
        layer_norm(x, eps=float("nan"))


def test_layer_norm_return_sum_is_keyed_with_its_type(rng):
    x, r = random_normal(rng, (3, 8), "fp64"), random_normal(rng, (3, 8), "fp64")
    y = layer_norm(x, residual=r, return_sum=False)
    np.testing.assert_array_equal(layer_norm(x, residual=r, return_sum=np.False_), y)
    y_sum, h = layer_norm(x, residual=r, return_sum=True)
    np.testing.assert_array_equal(y_sum, y)
    for bad in (0, 1, "no", [True]):
        with pytest.raises(TypeError, match="return_sum must be True or False"):
            layer_norm(x, residual=r, return_sum=bad)


def test_softmax_log_zero_never_finds_the_bound_call_of_false(rng):
    x = random_normal(rng, (3, 5), "fp64")
    y = softmax(x, np.int64(1))  # accepted: a NumPy integer dim keys apart from 1, computes the same
    np.testing.assert_array_equal(softmax(x, 1), y)
    np.testing.assert_array_equal(softmax(x, 1, log=np.False_), y)
    with pytest.raises(TypeError, match="log must be a bool, got int 0"):
        softmax(x, 1, log=0)


def test_max_and_avg_pooling_of_one_signature_keep_their_own_bound_calls(rng):
    image = random_normal(rng, (1, 4, 4, 3), "fp64")
    windows = image.reshape(1, 2, 2, 2, 2, 3)
    np.testing.assert_array_equal(max_pool2d(image, 2), windows.max(axis=(2, 4)))
    np.testing.assert_allclose(avg_pool2d(image, 2), windows.mean(axis=(2, 4)), rtol=1e-15)
    np.testing.assert_array_equal(max_pool2d(image, 2), windows.max(axis=(2, 4)))
    with pytest.raises(TypeError, match="count_include_pad must be True or False"):
        avg_pool2d(image, 2, count_include_pad=np.int64(1))


# --- GPU paths against a stand-in for CuPy and the launch ------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """CuPy's allocation and copies made by NumPy, a GPU and a stream reported, and every kernel launch
    recorded: returns (binds, launches), binds as (kernel, packed args), launches as the arrays passed."""
    binds, launches = [], []

    def bind(file, kernel, grid, block, args, **options):
        binds.append((kernel, args))
        return lambda *passed: launches.append(passed)

    def new(shape, dtype, memptr=None):  # memptr: arrays.allocator's, from the stand-in CUDA.alloc
        return on_device(np.empty(shape, dtype))

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        ndarray=new, empty=new, ascontiguousarray=lambda a: on_device(np.ascontiguousarray(a)), cuda=CUDA))
    monkeypatch.setattr(launch, "bind", bind)
    report_a_gpu(monkeypatch)
    for name in OPS:
        libnn.get_op(name).calls.clear()
    yield binds, launches
    for name in OPS:  # bound with the stand-ins: no later test may find them
        libnn.get_op(name).calls.clear()


def _packed(params: contracts.Params, args: tuple) -> dict:
    return dict(zip(params.names, args))


def test_layer_norm_custom_passes_the_callers_arrays_and_no_null_pointer(rng, fake_gpu):
    """(B, S, N) hidden states: the kernel gets the caller's x itself (no (M, N) view per call) and a y
    made in x's shape; without a residual, the residual and the sum are null pointers packed once."""
    binds, launches = fake_gpu
    w, b = on_device(random_normal(rng, (64,), "fp16")), on_device(random_normal(rng, (64,), "fp16"))
    x = on_device(random_normal(rng, (2, 3, 64), "fp16"))
    for x in (x, x, on_device(random_normal(rng, (2, 3, 64), "fp16"))):  # the same signature, then maybe another
        y = layer_norm(x, w, b, path="custom")
        sent = launches[-1]
        assert len(sent) == 4 and sent[0] is x and sent[1] is w and sent[2] is b and sent[3] is y
        assert y.shape == x.shape and y.dtype == x.dtype
    assert len(binds) <= 2  # the same x binds once; a new x may bind again (its pointer's low 8 bits are keyed)
    for _, args in binds:
        packed = _packed(LN._LN, args)
        assert packed["res"] is contracts.NULL and packed["s"] is contracts.NULL
        assert all(packed[n] is launch.ARRAY for n in ("x", "w", "b", "y"))
        assert (packed["M"], packed["N"]) == (6, 64)


@pytest.mark.parametrize("return_sum", [False, True])
def test_layer_norm_custom_with_a_residual_passes_it_and_the_sum_where_one_is_returned(rng, fake_gpu, return_sum):
    binds, launches = fake_gpu
    x, r = (on_device(random_normal(rng, (4, 32), "bf16")) for _ in range(2))
    out = layer_norm(x, residual=r, return_sum=return_sum, path="custom")
    sent = launches[-1]
    if return_sum:
        y, h = out
        assert len(sent) == 6 and sent[4] is y and sent[5] is h and h.shape == x.shape
    else:
        y = out
        assert len(sent) == 5 and sent[4] is y
        assert _packed(LN._LN, binds[-1][1])["s"] is contracts.NULL
    assert sent[0] is x and sent[1] is r and sent[2] is None and sent[3] is None  # weight, bias absent: null


def test_layer_norm_custom_copies_a_strided_x_at_every_call(rng, fake_gpu):
    _, launches = fake_gpu
    wide = on_device(random_normal(rng, (3, 2, 16), "fp32"))
    x = wide[:, :, ::2]
    y = layer_norm(x, path="custom")
    sent = launches[-1]
    assert sent[0] is not x and sent[0].flags.c_contiguous and np.array_equal(sent[0], x)
    assert y.shape == x.shape == sent[0].shape


def test_layer_norm_cudnn_runs_its_graph_on_the_callers_arrays(rng, fake_gpu, monkeypatch):
    """The cudnn path's bind (the frontend stood in for): the graph is run on x itself, the identity's
    ones and zeros for an absent weight and bias, eps as its host scalar, and a y in x's shape."""
    executed = []
    graph = types.SimpleNamespace(executor=lambda uids: lambda *passed: executed.append(passed))
    epsilon = object()
    monkeypatch.setattr(LN, "cudnn_backend", types.SimpleNamespace(graph_for=lambda key, build, describe: graph,
                                                                   host_scalar=lambda value: epsilon))
    monkeypatch.setattr(LN, "device_constant", lambda n, value, dtype: on_device(np.full(n, value, dtype)))
    x = on_device(random_normal(rng, (2, 5, 16), "fp16"))
    w = on_device(random_normal(rng, (16,), "fp16"))
    problem = replace(LN.layer_norm_problem(x, w, None, None, 1e-5, False), device="gpu:0")
    run = LN.op.paths["cudnn"].bind(problem, (x, w, None, None))
    y = run(x, w, None, None)
    (sent,) = executed
    assert sent[0] is x and sent[1] is w and np.all(sent[2] == 0) and sent[3] is epsilon and sent[4] is y
    assert y.shape == x.shape


def test_rms_norm_passes_contiguous_hidden_states_as_they_are(rng, fake_gpu):
    """rms_norm's runners read pointers: a contiguous (B, S, N) x goes to the kernel as it is, and y is
    allocated in x's shape (no view made per call)."""
    _, launches = fake_gpu
    x, w = on_device(random_normal(rng, (2, 3, 32), "fp16")), on_device(random_normal(rng, (32,), "fp16"))
    y = rms_norm(x, w, path="custom")
    sent = launches[-1]
    assert sent[0] is x and sent[2] is w
    assert y.shape == x.shape and sent[3] is y


@pytest.mark.parametrize("op", ["softmax", "max_pool2d"])
def test_softmax_and_pooling_pass_a_contiguous_x_as_it_is_and_copy_a_strided_one(rng, fake_gpu, op):
    _, launches = fake_gpu
    call = {"softmax": lambda x: softmax(x, path="custom"), "max_pool2d": lambda x: max_pool2d(x, 2, path="custom")}[op]
    wide = on_device(random_normal(rng, (2, 4, 4, 16), "fp16"))
    for x in (wide[:, :, :, :8], np.ascontiguousarray(wide[:, :, :, :8]).view(DeviceArray)):
        y = call(x)
        sent = launches[-1]
        assert sent[1] is y and y.dtype == x.dtype
        assert y.shape == (x.shape if op == "softmax" else (2, 2, 2, 8))
        if x.flags.c_contiguous:
            assert sent[0] is x
        else:
            assert sent[0].flags.c_contiguous and np.array_equal(sent[0], x)
