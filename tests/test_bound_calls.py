"""The ops' front end on the CPU: a bound call per signature, whose key holds everything the checks
read, so a changed shape, stride, dtype or option is checked again, and arrays are read at each call."""

import importlib
import math
import sys
import types
from dataclasses import replace

import numpy as np
import pytest

import libnn
from libnn.runtime import launch
from libnn.ops import attention, conv2d, layer_norm, linear, max_pool2d, softmax

from conftest import random_normal
from gpu_stand_ins import CUDA, host_ndarray


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


class DLPackVector:
    """A host array that speaks DLPack and has no NumPy `strides` (as a torch tensor's are a method)."""

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype = a.shape, a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_conv2d_keys_a_foreign_bn_array_by_what_the_checks_take_it_as(rng):
    """bn's arrays are keyed by their signature; one that is neither NumPy's nor CuPy's is keyed by its type
    and the array as_array takes it as, so it computes as the NumPy bn does and a wrong one is refused by
    name (reading its `strides` raised AttributeError before)."""
    x, w = random_normal(rng, (1, 6, 6, 3), "fp64"), random_normal(rng, (2, 3, 3, 3), "fp64")
    scale, shift = random_normal(rng, (2,), "fp64"), random_normal(rng, (2,), "fp64")
    expected = conv2d(x, w, bn=(scale, shift))
    for _ in range(2):  # the bind, then the bound call
        np.testing.assert_array_equal(conv2d(x, w, bn=(DLPackVector(scale), DLPackVector(shift))), expected)
    with pytest.raises(ValueError, match=r"bn\[1\] must have shape \(2,\)"):
        conv2d(x, w, bn=(DLPackVector(scale), DLPackVector(np.zeros(3))))


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
    monkeypatch.setattr(arrays, "_current_stream", None)  # a GPU machine's kept getter, forgotten here
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
    monkeypatch.setattr(arrays, "_current_stream", None)
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


# --- attention's custom and unfused paths: what the bind keeps, what each call passes (no GPU) -------------
def _aligned(rng, shape, dtype):
    """random_normal's values in an array whose first element starts on 16 bytes, as CuPy's would."""
    values = random_normal(rng, shape, dtype)
    buffer = np.empty(values.nbytes + 16, np.uint8)
    start = -buffer.ctypes.data % 16
    a = buffer[start:start + values.nbytes].view(values.dtype).reshape(shape)
    a[...] = values
    return a


def _attention_arrays(rng, case):
    """(q, k, v, seq_lens_q, seq_lens_kv, bias) for one of the cases below, host arrays."""
    B, Hq, Hkv, Sq, Skv, D = case["shape"]
    bhsd = case["layout"] == "BHSD"
    q = _aligned(rng, (B, Hq, Sq, D) if bhsd else (B, Sq, Hq, D), case["dtype"])
    k, v = (_aligned(rng, (B, Hkv, Skv, D) if bhsd else (B, Skv, Hkv, D), case["dtype"]) for _ in range(2))
    lens = ((rng.integers(0, Sq + 1, B).astype(np.int32), rng.integers(0, Skv + 1, B).astype(np.int32))
            if case["lens"] else (None, None))
    bias = None if case["bias"] is None else _aligned(rng, case["bias"], case["dtype"])
    return (q, k, v, *lens, bias)


def _attention_stubs(monkeypatch):
    """launch.bind recorded (each bound launch records the arrays it is called with) and CuPy's array
    functions stood in for by NumPy's: the binds and their runners run on host arrays."""
    binds, launches = [], []

    def bind(file, kernel, grid, block, args, *, shared_mem=0):
        binds.append((file, kernel, grid, block, args, shared_mem))
        return lambda *arrays: launches.append(arrays)

    monkeypatch.setattr(launch, "bind", bind)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        empty=np.empty, ndarray=host_ndarray, cuda=CUDA, zeros=np.zeros, broadcast_to=np.broadcast_to,
        ascontiguousarray=np.ascontiguousarray, matmul=np.matmul, float32=np.float32, where=np.where,
        arange=np.arange))
    return binds, launches


def _shares(sent, a) -> bool:
    """Whether a launch was passed `a` or a view of its memory (the kernels read only the pointer)."""
    return sent is a or (sent is not None and a is not None and np.shares_memory(sent, a)
                         and sent.__array_interface__["data"][0] == a.__array_interface__["data"][0])


ATTENTION_BINDS = {  # (B, Hq, Hkv, Sq, Skv, D)
    "attn2, BSHD, GQA, lengths": dict(shape=(2, 4, 2, 7, 13, 64), dtype="fp16", layout="BSHD", lens=True, bias=None,
                                      causal="bottom_right", kernel="attn2_flash_d64_f16"),
    "attn2, bias copied per call": dict(shape=(3, 2, 2, 5, 13, 40), dtype="bf16", layout="BHSD", lens=False,
                                        bias=(3, 1, 1, 13), causal=None, kernel="attn2_flash_bias_d64_bf16"),
    "attn1, fp32, bias": dict(shape=(2, 3, 1, 9, 6, 20), dtype="fp32", layout="BHSD", lens=True,
                              bias=(1, 3, 9, 6), causal="top_left", kernel="attn1_naive_f32"),
}


@pytest.mark.parametrize("name", list(ATTENTION_BINDS))
def test_attention_custom_binds_its_kernel_once_and_each_call_passes_that_calls_arrays(rng, monkeypatch, name):
    """The bind finds the kernel, its grid and every scalar and stride once (the packed arguments hold
    no array: launch.ARRAY in each pointer's place); every call passes its own q, k, v, a new o, its own
    lengths as int32, and its own bias (a padded copy of that call's values where attn2 cannot stage the
    rows as they are). The bound runner keeps none of the arrays it was bound with."""
    import gc
    import weakref

    attn = importlib.import_module("libnn.ops.attention")
    kernels = importlib.import_module("libnn.ops.attention_kernels")
    case = ATTENTION_BINDS[name]
    B, Hq, Hkv, Sq, Skv, D = case["shape"]
    copied = case["kernel"].startswith("attn2") and case["bias"] is not None and case["bias"][3] % 8
    binds, launches = _attention_stubs(monkeypatch)
    first = _attention_arrays(rng, case)
    problem = replace(attn.attention_problem(first[0], first[1], first[2], first[5], None, case["causal"],
                                             case["layout"], case["lens"], case["lens"]), device="gpu:0")
    run = attn.op.paths["custom"].bind(problem, first)
    kept = [weakref.ref(a) for a in first if a is not None]
    del first
    gc.collect()
    assert all(ref() is None for ref in kept), "the bound runner keeps an array it was bound with"

    def check(q, k, v, lens_q, lens_kv, bias):
        o = run(q, k, v, lens_q, lens_kv, bias)
        sent = launches[-1]
        assert o.shape == q.shape and o.dtype == q.dtype and _shares(sent[3], o)
        assert all(_shares(s, a) for s, a in zip(sent[:3], (q, k, v)))
        for s, lens in zip(sent[5:], (lens_q, lens_kv)):
            assert (s is None) if lens is None else (s.dtype == np.int32 and np.array_equal(s, lens))
        if bias is None:
            assert sent[4] is None
        elif copied:  # attn2 stages rows of 8: a padded copy of this call's bias
            assert not np.shares_memory(sent[4], bias) and np.array_equal(sent[4][..., :Skv], np.broadcast_to(
                bias, sent[4].shape))
        else:
            assert _shares(sent[4], bias)

    second = _attention_arrays(rng, case)
    check(*second)  # other arrays
    for old, new in zip(second, _attention_arrays(rng, case)):
        if old is not None:
            old[...] = new
    check(*second)  # the same arrays, holding other values
    assert len({id(sent[3]) for sent in launches}) == 2  # a new o per call
    ((file, kernel, grid, block, args, smem),) = binds
    assert (file, kernel) == ("attention.cu", case["kernel"])
    named = dict(zip(kernels._ATTN.names, args))
    assert all(named[n] is launch.ARRAY for n in ("q", "k", "v", "o", "bias", "lens_q", "lens_kv"))
    assert not any(isinstance(a, np.ndarray) for a in args)
    assert [named[n] for n in ("B", "Hq", "Hkv", "Sq", "Skv", "D")] == [B, Hq, Hkv, Sq, Skv, D]
    assert named["causal"] == {None: 0, "top_left": 1, "bottom_right": 2}[case["causal"]]
    assert named["scale_log2"] == np.float32(math.log2(math.e) / math.sqrt(D))

    def strides(H, S):  # (b, h, s) element strides of a contiguous array in the layout; 0 at size-1 dims
        taken = (H * S * D, S * D, D) if case["layout"] == "BHSD" else (S * H * D, D, H * D)
        return [0 if n == 1 else s for n, s in zip((B, H, S), taken)]
    assert [named[f"q_s{d}"] for d in "bhs"] == [named[f"o_s{d}"] for d in "bhs"] == strides(Hq, Sq)
    assert [named[f"k_s{d}"] for d in "bhs"] == [named[f"v_s{d}"] for d in "bhs"] == strides(Hkv, Skv)
    if case["kernel"].startswith("attn1"):
        assert (grid, block, smem) == ((-(-B * Hq * Sq // 8),), (256,), 0)
    else:
        _, threads, rows, flash_smem = kernels.flash_launch(D, case["bias"] is not None)
        assert (grid, block, smem) == ((-(-Sq // rows) * B * Hq,), (threads,), flash_smem)
    if case["bias"] is not None:  # broadcast dimensions at stride 0; a padded copy's rows of 16 elements
        row = -(-Skv // 8) * 8 if copied else Skv
        expected = [0 if n == 1 else s for n, s in zip(case["bias"][:3], (Hq * Sq * row, Sq * row, row))] + [1]
        if case["bias"] == (3, 1, 1, 13):
            expected[0] = row  # the copy keeps the size-1 dimensions: (B, 1, 1, 16)
        assert [named[f"b_s{d}"] for d in "bhij"] == expected


def test_attention_unfused_binds_its_softmax_once_and_each_call_runs_on_that_calls_arrays(rng, monkeypatch):
    """The unfused path's bind packs the softmax kernel once; each call multiplies its own q and k (the
    recorder sees the fp32 scores q·kᵀ of that call, GQA heads grouped), passes its own bias and
    lengths, and writes s·v into a new o (the recorder leaves s unnormalised, so o = (q·kᵀ)·v), with v's
    rows past each sequence's length as zeros: a stale NaN there never reaches o."""
    attn = importlib.import_module("libnn.ops.attention")
    kernels = importlib.import_module("libnn.ops.attention_kernels")
    case = dict(shape=(2, 4, 2, 5, 7, 3), dtype="fp32", layout="BSHD", lens=True, bias=(2, 1, 1, 7))
    B, Hq, Hkv, Sq, Skv, D = case["shape"]
    binds, launches = _attention_stubs(monkeypatch)
    required = []  # the temporaries' memory check, once per signature at the bind
    monkeypatch.setattr(attn.memory, "require", lambda needed, device, *why: required.append((needed, device)))
    first = _attention_arrays(rng, case)
    problem = replace(attn.attention_problem(first[0], first[1], first[2], first[5], 0.5, "top_left", "BSHD",
                                             True, True), device="gpu:0")
    run = attn.op.paths["unfused"].bind(problem, first)

    def check(q, k, v, lens_q, lens_kv, bias):
        o = run(q, k, v, lens_q, lens_kv, bias)
        s, sent_bias, sent_q, sent_kv = launches[-1]
        q64, k64, v64 = (np.repeat(a.transpose(0, 2, 1, 3).astype(np.float64), Hq // len(a[0, 0]), axis=1)
                         for a in (q, k, v))
        scores = q64 @ k64.swapaxes(-1, -2)
        np.testing.assert_allclose(s.reshape(B, Hq, Sq, Skv), scores, rtol=1e-5, atol=1e-5)
        assert _shares(sent_bias, bias) and np.array_equal(sent_q, lens_q) and np.array_equal(sent_kv, lens_kv)
        assert o.shape == (B, Sq, Hq, D) and o.flags.c_contiguous
        live = np.arange(Skv)[None, None, :, None] < lens_kv[:, None, None, None]
        np.testing.assert_allclose(o, (scores @ np.where(live, v64, 0)).transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-5)

    check(*first)
    stale = first[2].copy()
    for b, length in enumerate(first[4]):
        stale[b, length:] = np.nan  # BSHD: past the sequence's length
    check(first[0], first[1], stale, *first[3:])
    second = _attention_arrays(rng, case)
    check(*second)
    for old, new in zip(second, _attention_arrays(rng, case)):
        old[...] = new
    check(*second)
    asked = [needed for needed, device in required if device == "gpu"]  # (the host arrays' problem asks for "cpu")
    assert asked == [4 * (B * Hq * Sq * (Skv + 2 * D) + 3 * B * Hkv * Skv * D)]  # v twice: zeroed past the lengths
    ((file, kernel, grid, block, args, smem),) = binds
    named = dict(zip(kernels._SOFTMAX.names, args))
    assert (file, kernel, grid, block, smem) == ("attention.cu", "attn_softmax_f32", (B * Hq * Sq,), (128,), 0)
    assert all(named[n] is launch.ARRAY for n in ("s", "bias", "lens_q", "lens_kv"))
    assert [named[n] for n in ("B", "Hq", "Sq", "Skv", "causal")] == [B, Hq, Sq, Skv, 1]
    assert named["scale_log2"] == np.float32(0.5 * math.log2(math.e))
    assert [named[f"b_s{d}"] for d in "bhij"] == [Skv, 0, 0, 1]

def test_attention_cudnn_zeroes_batches_without_keys_in_one_packed_launch(rng, monkeypatch):
    """Under key padding alone (seq_lens_kv, with or without a KeyPaddingBias) only whole batch entries
    can be empty: the cudnn path's bind packs attn_zero_empty_batches once (a block per entry, the
    entry's size in 16-bit words) and each call passes its lengths and its o. Masks that can empty a
    single row keep the closed forms on the device; masks that empty nothing bind no zeroing."""
    attn = importlib.import_module("libnn.ops.attention")
    binds, launches = _attention_stubs(monkeypatch)
    B, Hq, Sq, Skv, D = 3, 2, 5, 7, 8
    q, kv = random_normal(rng, (B, Sq, Hq, D), "fp16"), random_normal(rng, (B, Skv, Hq, D), "fp16")

    def zeroing(bias=None, causal=None, lens_q=False, lens_kv=False, keeps_a_key=False, nonempty=False):
        problem = attn.attention_problem(q, kv, kv, bias, None, causal, "BSHD", lens_q, lens_kv)
        return attn._bind_zero_rows(replace(problem, device="gpu:0", bias_keeps_a_key=keeps_a_key,
                                            lens_kv_nonempty=nonempty))

    key_padding = random_normal(rng, (B, 1, 1, Skv), "fp16")
    for zero in (zeroing(lens_kv=True), zeroing(key_padding, lens_kv=True, keeps_a_key=True)):
        o, lens = np.empty((B, Sq, Hq, D), np.float16), np.array([3, 0, 7], np.int32)
        zero(o, None, lens, key_padding)
        assert launches[-1][0] is lens and launches[-1][1] is o
    assert binds == [("attention.cu", "attn_zero_empty_batches", (B,), (256,),
                      (launch.ARRAY, launch.ARRAY, Sq * Hq * D), 0)] * 2
    assert isinstance(binds[0][4][2], np.int64)
    assert zeroing() is None and zeroing(causal="top_left") is None
    for masks in ({"lens_q": True}, {"lens_kv": True, "causal": "bottom_right"}, {"bias": key_padding}):
        assert zeroing(**masks).func is attn._zero_rows_without_keys  # rows, not only batch entries
    assert len(binds) == 2


def test_attention_nonempty_kv_lengths_under_key_padding_bind_no_zeroing(rng, monkeypatch):
    """Lengths vouched nonempty (CheckedLengths(nonempty=True)), alone, with a KeyPaddingBias or under a
    top-left diagonal, leave every row a key: nothing is bound to zero rows. Query lengths, a plain bias
    and a bottom-right diagonal (Lk < Sq) can still empty rows: their zeroing stays."""
    attn = importlib.import_module("libnn.ops.attention")
    binds, _ = _attention_stubs(monkeypatch)
    B, Hq, Sq, Skv, D = 3, 2, 5, 7, 8
    q, kv = random_normal(rng, (B, Sq, Hq, D), "fp16"), random_normal(rng, (B, Skv, Hq, D), "fp16")
    key_padding = random_normal(rng, (B, 1, 1, Skv), "fp16")

    def zeroing(bias=None, causal=None, lens_q=False, keeps_a_key=False):
        problem = attn.attention_problem(q, kv, kv, bias, None, causal, "BSHD", lens_q, True)
        return attn._bind_zero_rows(replace(problem, device="gpu:0", bias_keeps_a_key=keeps_a_key,
                                            lens_kv_nonempty=True))

    assert zeroing() is None and zeroing(key_padding, keeps_a_key=True) is None
    assert zeroing(causal="top_left") is None
    for masks in ({"lens_q": True}, {"causal": "bottom_right"}, {"bias": key_padding}):
        assert zeroing(**masks).func is attn._zero_rows_without_keys, masks
    assert binds == []


def test_attention_zero_kernel_takes_what_its_launch_packs():
    """attn_zero_empty_batches's compiled parameters and __launch_bounds__ are those the bind packs
    and launches with (compiled with NVRTC, no GPU)."""
    from test_kernel_contracts import assert_packed, max_threads

    kernels = importlib.import_module("libnn.ops.attention_kernels")
    args = kernels._ZERO.pack(lens_kv=None, o=None, words=np.int64(40))
    assert_packed(args, kernels._ZERO, "attn_zero_empty_batches")
    assert max_threads("attention.cu", "attn_zero_empty_batches") == kernels._ZERO_THREADS == 256

def test_attention_causal_is_keyed_with_its_type(rng):
    """causal=1 or 0 never finds the bound call of True or False (equal as keys) and skips the check
    that refuses them."""
    q = random_normal(rng, (1, 2, 3, 4), "fp64")
    for good, bad in ((True, 1), (False, 0)):
        attention(q, q, q, causal=good)
        with pytest.raises(ValueError, match=f"causal must be False, True, 'top_left' or 'bottom_right', got {bad}"):
            attention(q, q, q, causal=bad)


def test_option_keys_keep_every_type_apart():
    """The cheap keys (an exact int, str or None is its own key, a bool's key is made once) never equal
    the key of a value of another type, and a one-element sequence never keys as its element."""
    from libnn.registry import option_key

    class Name(str):
        pass

    distinct = [1, True, 1.0, np.int64(1), "relu", Name("relu"), np.str_("relu"), None, (1,), [1.0], (True,),
                (np.int64(2),), np.int64(2), 0, False, ()]
    keys = [option_key(v) for v in distinct]
    for i, a in enumerate(keys):
        for j, b in enumerate(keys):
            assert (a == b) == (i == j), (distinct[i], distinct[j])
    assert option_key([2, 3]) == option_key((2, 3))  # a list keys as the tuple it means
    assert option_key(False) is option_key(False)


def test_a_one_element_tuple_never_finds_the_bound_call_of_its_element(rng):
    """kernel_size=np.int64(2) binds; (np.int64(2),) is refused by the checks, so it must not find it."""
    image = random_normal(rng, (1, 4, 4, 3), "fp64")
    assert max_pool2d(image, np.int64(2)).shape == (1, 2, 2, 3)
    with pytest.raises(TypeError, match="kernel_size must be an int or a pair"):
        max_pool2d(image, (np.int64(2),))


def test_count_include_pad_is_keyed_with_its_type(rng):
    """count_include_pad=1 is refused ("no" would mean yes); it must not find the bound call of True."""
    from libnn.ops import avg_pool2d

    image = random_normal(rng, (1, 4, 4, 3), "fp64")
    avg_pool2d(image, 3, 1, 1, count_include_pad=True)
    with pytest.raises(TypeError, match="count_include_pad must be True or False, got int 1"):
        avg_pool2d(image, 3, 1, 1, count_include_pad=1)
