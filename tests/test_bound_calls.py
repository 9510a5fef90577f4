"""The ops' front end on the CPU: a bound call per signature, whose key holds everything the checks
read, so a changed shape, stride, dtype or option is checked again, and arrays are read at each call."""

import numpy as np
import pytest

import libnn
from libnn.ops import attention, conv2d, layer_norm, linear, max_pool2d, softmax

from conftest import random_normal


def test_a_repeated_signature_builds_nothing_and_reads_the_new_arrays(rng):
    x1, x2, w = (random_normal(rng, s, "fp64") for s in ((5, 7), (5, 7), (3, 7)))
    op = libnn.get_op("linear")
    linear(x1, w)
    builds = op.calls.stats.builds
    y2 = linear(x2, w)
    assert op.calls.stats.builds == builds
    np.testing.assert_allclose(y2, x2 @ w.T, rtol=1e-12)


@pytest.mark.parametrize("bad, error", [
    (lambda x, w: (x[:, :6], w), "x has 6 features"),                       # shape
    (lambda x, w: (x, w.astype(np.float32)), "w has dtype fp32 but x has fp64"),  # dtype
    (lambda x, w: (x.astype(np.int64), w), "floating-point"),                # dtype of x
])
def test_a_changed_signature_is_checked_again(rng, bad, error):
    x, w = random_normal(rng, (5, 7), "fp64"), random_normal(rng, (3, 7), "fp64")
    linear(x, w)  # binds the good signature
    with pytest.raises((ValueError, TypeError), match=error):
        linear(*bad(x, w))
    with pytest.raises((ValueError, TypeError), match=error):  # a refused signature is never kept
        linear(*bad(x, w))


def test_strides_are_part_of_the_signature(rng):
    x, w = random_normal(rng, (5, 14), "fp64"), random_normal(rng, (3, 7), "fp64")
    contiguous = np.ascontiguousarray(x[:, ::2])
    np.testing.assert_allclose(linear(contiguous, w), contiguous @ w.T, rtol=1e-12)
    np.testing.assert_allclose(linear(x[:, ::2], w), contiguous @ w.T, rtol=1e-12)


def test_options_are_part_of_the_signature(rng):
    x, w = random_normal(rng, (4, 6), "fp64"), random_normal(rng, (5, 6), "fp64")
    plain = linear(x, w)
    np.testing.assert_allclose(linear(x, w, activation="relu"), np.maximum(plain, 0), rtol=1e-12)
    with pytest.raises(ValueError, match="activation must be one of"):
        linear(x, w, activation="swish")
    with pytest.raises(ValueError, match="unknown path 'fastest'"):
        linear(x, w, path="fastest")


def test_layer_norm_eps_and_shape_are_keyed(rng):
    x = random_normal(rng, (3, 4, 8), "fp64")
    y1, y2 = layer_norm(x, eps=1e-5), layer_norm(x, eps=10.0)
    assert not np.allclose(y1, y2)
    assert y1.shape == x.shape
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        layer_norm(x, eps=-1.0)
    for eps in ("1e-5", None, True, np.ones(1)):  # types: keyed with their type, never a bound call's eps
        with pytest.raises(TypeError, match="layer_norm: eps must be a finite number > 0, got"):
            layer_norm(x, eps=eps)


def test_conv2d_options_are_keyed_and_checked(rng):
    x, w = random_normal(rng, (1, 6, 6, 3), "fp64"), random_normal(rng, (2, 3, 3, 3), "fp64")
    assert conv2d(x, w).shape == (1, 4, 4, 2)
    assert conv2d(x, w, padding=1).shape == (1, 6, 6, 2)
    assert conv2d(x, w, padding=[1, 1]).shape == (1, 6, 6, 2)  # a list is an option like a tuple
    with pytest.raises(ValueError, match="stride must be an int or a pair"):
        conv2d(x, w, stride=0)
    with pytest.raises(ValueError, match=r"bn\[0\] must have shape \(2,\)"):
        conv2d(x, w, bn=(np.ones(3), np.zeros(2)))


def test_attention_and_softmax_and_pooling_through_the_front_end(rng):
    q = random_normal(rng, (1, 2, 5, 4), "fp64")
    o1 = attention(q, q, q)
    o2 = attention(q, q, q, seq_lens_kv=[3])
    assert not np.allclose(o1, o2)
    with pytest.raises(ValueError, match=r"seq_lens_kv must lie in \[0, 5\]"):
        attention(q, q, q, seq_lens_kv=[9])
    x = random_normal(rng, (2, 5), "fp64")
    np.testing.assert_allclose(softmax(x).sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(softmax(x, dim=0).sum(0), 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        softmax(x, dim=2)
    image = random_normal(rng, (1, 4, 4, 3), "fp64")
    assert max_pool2d(image, 2).shape == (1, 2, 2, 3)
    assert max_pool2d(image, 2, 1).shape == (1, 3, 3, 3)


def test_the_stream_key_is_0_where_cupy_is_installed_but_there_is_no_gpu(monkeypatch, rng):
    """CuPy without a driver raises on any stream query: host calls must not ask (README set-up)."""
    import sys
    import types

    from libnn.runtime import arrays

    def no_stream():
        raise RuntimeError("cudaErrorInsufficientDriver")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=no_stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(arrays, "gpu_missing", lambda: "no NVIDIA driver is installed")
    assert arrays.stream_key() == 0
    x, w = random_normal(rng, (3, 4), "fp64"), random_normal(rng, (2, 4), "fp64")
    np.testing.assert_allclose(linear(x, w), x @ w.T, rtol=1e-12)


def test_the_per_thread_default_stream_keys_bound_calls_by_thread(monkeypatch):
    """cudaStreamPerThread is one handle for a different stream in each thread: workspaces bound on it
    must not be shared between threads, so the thread is in the key there (and only there)."""
    import sys
    import threading
    import types

    from libnn.runtime import arrays

    handle = {"ptr": arrays.PER_THREAD_STREAM}
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(**handle)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(arrays, "gpu_missing", lambda: None)
    keys = [arrays.stream_key()]
    worker = threading.Thread(target=lambda: keys.append(arrays.stream_key()))
    worker.start()
    worker.join()
    assert keys[0] != keys[1] and {k[0] for k in keys} == {arrays.PER_THREAD_STREAM}
    handle["ptr"] = 0x7F00
    assert arrays.stream_key() == 0x7F00


def test_softmax_options_are_checked_whatever_call_came_first(rng):
    """log and dim are keyed with their types: log=1 or dim=True never find the bound call of True or 1
    and skip the checks; log must be a bool ("no" read as true)."""
    x = random_normal(rng, (3, 5), "fp64")
    softmax(x, 1, log=True)
    for kwargs, message in (({"log": "no"}, "log must be a bool, got str 'no'"),
                            ({"log": 1}, "log must be a bool, got int 1")):
        with pytest.raises(TypeError, match=message):
            softmax(x, 1, **kwargs)
    with pytest.raises(TypeError, match="dim must be an int, got bool True"):
        softmax(x, True)
