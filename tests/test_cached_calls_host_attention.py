"""The cached calls of attention (dense k and v, layouts BHSD and BSHD) and of embedding / nn.Embedding on
the CPU, through the whole front end, as tests/test_cached_calls_host.py does for the row ops: keys that
hold each option with its type (a value the checks refuse never finds the bound call of an equal value
they take), and the GPU paths run against a stand-in for CuPy, the kernel launch and the cuDNN graph,
which checks what each call passes: the caller's own arrays, a new output, and only the pointers the
signature has (no null pointer, no constant, no view made per call where the kernel or graph reads
pointers alone)."""

import sys
import types

import numpy as np
import pytest

import libnn
from libnn import nn
from libnn.ops import attention, embedding
from libnn.ops.attention import CheckedLengths, KeyPaddingBias
from libnn.ops.embedding import IdErrors
from libnn.runtime import contracts, device, launch

from conftest import random_normal
from gpu_stand_ins import CUDA, DeviceArray, on_device, report_a_gpu

AT = sys.modules["libnn.ops.attention"]
EM = sys.modules["libnn.ops.embedding"]
OPS = ("attention", "embedding")


# --- keys: every option with its type (reference path, host arrays) ------------------------------------
def test_attention_scale_keys_as_a_float_and_refused_types_never_find_its_bound_call(rng):
    """None and an exact float scale are their own keys: an exact int equal to the float finds its bound
    call (the checks take it as the same scale), every other type is keyed apart and checked again."""
    q = random_normal(rng, (1, 2, 3, 4), "fp64")
    o = attention(q, q, q, scale=1.0)
    np.testing.assert_array_equal(attention(q, q, q, scale=1), o)
    np.testing.assert_array_equal(attention(q, q, q, scale=np.float32(1.0)), o)
    assert not np.array_equal(attention(q, q, q), o)  # None: 1/sqrt(4), its own bound call
    for bad in (True, np.True_, "1.0", complex(1.0)):
        with pytest.raises(TypeError, match=r"attention: scale must be a finite number or None \(1/sqrt\(D\)\), got"):
            attention(q, q, q, scale=bad)
    with pytest.raises(TypeError, match="got list"):
        attention(q, q, q, scale=[1.0])  # unhashable: no key, checked as before


def test_attention_causal_options_are_keyed_with_their_type(rng):
    q = random_normal(rng, (1, 2, 3, 4), "fp64")
    top_left = attention(q, q, q, causal="top_left")
    np.testing.assert_array_equal(attention(q, q, q, causal=True), top_left)
    np.testing.assert_array_equal(attention(q, q, q, causal=np.True_), top_left)
    np.testing.assert_array_equal(attention(q, q, q, causal=None), attention(q, q, q, causal=False))
    for bad in (1, 0, 1.0, "yes", [True]):
        with pytest.raises(ValueError, match="attention: causal must be False, True, 'top_left' or 'bottom_right'"):
            attention(q, q, q, causal=bad)


def test_attention_key_padding_bias_of_none_is_refused_as_before(rng):
    q = random_normal(rng, (1, 2, 3, 4), "fp64")
    with pytest.raises(ValueError, match=r"attention: a KeyPaddingBias must have shape \(B, 1, 1, Skv\) = "
                                         r"\(1, 1, 1, 3\) \(or \(1, 1, 1, Skv\)\), got None"):
        attention(q, q, q, attn_bias=KeyPaddingBias(None))


def test_embedding_options_are_keyed_with_their_type(rng):
    weight, ids = rng.standard_normal((5, 3)), np.array([[0, 4], [2, 1]])
    positions = rng.standard_normal((4, 3))
    y = embedding(ids, weight, position_weight=positions, eps=1.0, normalize=True)
    np.testing.assert_array_equal(embedding(ids, weight, position_weight=positions, eps=1, normalize=True), y)
    np.testing.assert_array_equal(embedding(ids, weight, position_weight=positions, eps=1.0, normalize=np.True_), y)
    np.testing.assert_array_equal(embedding(ids, weight, position_weight=positions, position_offset=np.int64(0),
                                            eps=1.0, normalize=True), y)
    for bad in (0, 1, "no"):
        with pytest.raises(TypeError, match="embedding: normalize must be True or False, got"):
            embedding(ids, weight, position_weight=positions, normalize=bad)
    for bad in (0.0, False):
        with pytest.raises(TypeError, match="embedding: position_offset must be an int, got"):
            embedding(ids, weight, position_weight=positions, position_offset=bad)
    for bad in (True, "1e-5"):
        with pytest.raises(TypeError, match="embedding: eps must be a finite number > 0, got"):
            embedding(ids, weight, position_weight=positions, eps=bad, normalize=True)
    errors = IdErrors(np.zeros(1, np.uint64))
    embedding(ids, weight, id_errors=errors)
    for bad in (types.SimpleNamespace(), "yes"):
        with pytest.raises(TypeError, match="embedding: id_errors must be None or a libnn.ops.embedding.IdErrors"):
            embedding(ids, weight, id_errors=bad)


# --- GPU paths against a stand-in for CuPy, the launch and the cuDNN graph ---------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """CuPy's allocations and conversions made by NumPy, a GPU, a stream and cuDNN reported, every kernel
    launch and cuDNN graph execution recorded: returns a namespace of binds (kernel, packed args), launches
    (the arrays passed), graphs (the uids of each executor) and executed (the arrays passed)."""
    seen = types.SimpleNamespace(binds=[], launches=[], graphs=[], executed=[])

    def bind(file, kernel, grid, block, args, **options):
        seen.binds.append((kernel, args))
        return lambda *passed: seen.launches.append(passed)

    def executor(uids):
        seen.graphs.append(list(uids))
        return lambda *passed: seen.executed.append(passed)

    def new(shape, dtype, memptr=None):  # memptr: arrays.allocator's, from the stand-in CUDA.alloc
        return on_device(np.empty(shape, dtype))

    def asarray(a, dtype=None):
        return a if dtype is None or a.dtype == dtype else on_device(np.asarray(a, dtype))

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        ndarray=new, empty=new, asarray=asarray, int32=np.int32, int64=np.int64,
        ascontiguousarray=lambda a, dtype=None: on_device(np.ascontiguousarray(a, dtype)), cuda=CUDA))
    monkeypatch.setattr(launch, "bind", bind)
    report_a_gpu(monkeypatch)
    monkeypatch.setattr(device, "module_missing", lambda name: None)  # cudnn "imports"
    monkeypatch.setattr(AT, "cudnn_backend", types.SimpleNamespace(
        graph_for=lambda key, build, describe, **options: types.SimpleNamespace(executor=executor)))
    monkeypatch.setattr(AT, "device_constant", lambda n, value, dtype: on_device(np.full(n, value, dtype)))
    monkeypatch.setattr(IdErrors, "allocate", classmethod(lambda cls: cls(np.zeros(1, np.uint64))))
    for name in OPS:
        libnn.get_op(name).calls.clear()
    yield seen
    for name in OPS:  # bound with the stand-ins: no later test may find them
        libnn.get_op(name).calls.clear()


def same(sent: tuple, expected: tuple) -> bool:
    """Whether a launch or graph execution was passed exactly these objects (arrays by identity), in order."""
    return len(sent) == len(expected) and all(s is e for s, e in zip(sent, expected))


def _qkv(rng, layout: str, B=2, Hq=4, Hkv=2, Sq=8, Skv=16, D=64):
    """q, k and v on the stand-in device in `layout`, fp16."""
    q_shape, kv_shape = ((B, Hq, Sq, D), (B, Hkv, Skv, D)) if layout == "BHSD" else ((B, Sq, Hq, D), (B, Skv, Hkv, D))
    return tuple(on_device(random_normal(rng, shape, "fp16")) for shape in (q_shape, kv_shape, kv_shape))


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_attention_cudnn_without_lengths_or_bias_runs_its_graph_on_q_k_v_and_a_new_o(rng, fake_gpu, layout, causal):
    """No lengths, no bias: the graph takes q, k, v and o alone (no list of extras, no zeroing), each call
    its own arrays and an o contiguous in the layout; the same signature binds once."""
    q, k, v = _qkv(rng, layout)
    outputs = []
    for _ in range(3):
        o = attention(q, k, v, causal=causal, layout=layout, path="cudnn")
        sent = fake_gpu.executed[-1]
        assert same(sent, (q, k, v, o))
        assert o.shape == q.shape and o.dtype == q.dtype and o.flags.c_contiguous
        outputs.append(o)
    assert fake_gpu.graphs == [[AT.UID_Q, AT.UID_K, AT.UID_V, AT.UID_O]]
    assert len({id(o) for o in outputs}) == 3
    assert fake_gpu.launches == []  # no row can be empty: nothing zeroed


def test_attention_cudnn_with_a_key_padding_bias_and_lengths_passes_them_and_full_query_lengths(rng, fake_gpu):
    """A KeyPaddingBias and checked kv lengths: the graph takes the bias, the query lengths as full (made
    once, at the bind) and the caller's kv lengths; batch entries without keys are zeroed in one launch."""
    q, k, v = _qkv(rng, "BSHD")
    bias = on_device(random_normal(rng, (2, 1, 1, 16), "fp16"))
    lens = on_device(np.array([5, 16], np.int32))
    for _ in range(2):
        o = attention(q, k, v, attn_bias=KeyPaddingBias(bias), seq_lens_kv=CheckedLengths(lens), layout="BSHD",
                      path="cudnn")
        sent = fake_gpu.executed[-1]
        assert same(sent[:5], (q, k, v, o, bias)) and sent[6] is lens
        assert np.array_equal(sent[5], [8, 8]) and sent[5].dtype == np.int32
        assert same(fake_gpu.launches[-1], (lens, o))
    assert fake_gpu.graphs == [[AT.UID_Q, AT.UID_K, AT.UID_V, AT.UID_O, AT.UID_BIAS, AT.UID_LENS_Q, AT.UID_LENS_KV]]
    assert [kernel for kernel, _ in fake_gpu.binds] == ["attn_zero_empty_batches"]


def test_attention_cudnn_with_nonempty_lengths_zeroes_nothing_and_is_keyed_apart(rng, fake_gpu):
    """CheckedLengths(nonempty=True) with a KeyPaddingBias: the same graph and arrays, but no batch entry
    can be without a key, so nothing is bound or launched after the graph. The flag is in the key: the
    same arrays as plain CheckedLengths find their own bound call, which zeroes."""
    q, k, v = _qkv(rng, "BSHD")
    bias = on_device(random_normal(rng, (2, 1, 1, 16), "fp16"))
    lens = on_device(np.array([1, 16], np.int32))
    for _ in range(2):
        o = attention(q, k, v, attn_bias=KeyPaddingBias(bias), seq_lens_kv=CheckedLengths(lens, nonempty=True),
                      layout="BSHD", path="cudnn")
        sent = fake_gpu.executed[-1]
        assert same(sent[:5], (q, k, v, o, bias)) and sent[6] is lens
    assert fake_gpu.binds == [] and fake_gpu.launches == []
    o = attention(q, k, v, attn_bias=KeyPaddingBias(bias), seq_lens_kv=CheckedLengths(lens), layout="BSHD",
                  path="cudnn")
    assert [kernel for kernel, _ in fake_gpu.binds] == ["attn_zero_empty_batches"]
    assert same(fake_gpu.launches[-1], (lens, o))
    assert len(AT.op.calls) == 2


def test_checked_lengths_nonempty_must_be_a_bool():
    assert CheckedLengths(np.ones(2, np.int32)).nonempty is False
    assert CheckedLengths(np.ones(2, np.int32), nonempty=np.True_).nonempty is True
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="CheckedLengths: nonempty must be True or False, got"):
            CheckedLengths(np.ones(2, np.int32), nonempty=bad)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_attention_custom_passes_the_callers_arrays_as_they_are_and_a_new_o(rng, fake_gpu, layout):
    """The flash kernel reads pointers: q, k and v go as they are (no (B, H, S, D) view per call), o is
    new and contiguous in the layout, the absent bias and lengths are null; checked kv lengths go as the
    caller's int32 array."""
    q, k, v = _qkv(rng, layout)
    for _ in range(2):
        o = attention(q, k, v, layout=layout, path="custom")
        sent = fake_gpu.launches[-1]
        assert same(sent, (q, k, v, o, None, None, None)) and o.shape == q.shape and o.flags.c_contiguous
    lens = on_device(np.array([3, 16], np.int32))
    o = attention(q, k, v, seq_lens_kv=CheckedLengths(lens), layout=layout, path="custom")
    assert same(fake_gpu.launches[-1], (q, k, v, o, None, None, lens))
    assert [kernel for kernel, _ in fake_gpu.binds] == ["attn2_flash_d64_f16"] * 2  # one per signature


def test_embedding_layer_launches_ids_weight_and_y_alone(rng, fake_gpu):
    """nn.Embedding's lazily checked call: one bind per signature, the absent tables and vectors packed as
    null pointers and the id_errors word's address baked in once; each launch passes the caller's ids,
    the weight and a new y of ids.shape + (hidden,)."""
    layer = nn.Embedding(50, 16, dtype="fp16", seed=0)
    layer.weight = on_device(layer.weight)
    ids = on_device(rng.integers(0, 50, (2, 3)).astype(np.int64))
    for _ in range(3):
        y = layer(ids)
        sent = fake_gpu.launches[-1]
        assert same(sent, (ids, layer.weight, y))
        assert y.shape == (2, 3, 16) and y.dtype == layer.weight.dtype
    ((kernel, args),) = fake_gpu.binds
    packed = dict(zip(EM._EMB.names, args))
    assert all(packed[n] is contracts.NULL for n in ("type_ids", "pos", "type", "w", "b"))
    assert all(packed[n] is launch.ARRAY for n in ("ids", "word", "y"))
    assert packed["bad"] == layer._id_errors.pointer and packed["flags"] == EM.IDS_I64


def test_embedding_with_every_term_launches_the_arrays_there_are_in_the_kernels_order(rng, fake_gpu):
    weight, positions, types_ = (on_device(random_normal(rng, (n, 16), "fp16")) for n in (50, 8, 2))
    norm_weight = on_device(random_normal(rng, (16,), "fp16"))
    ids, type_ids = (on_device(rng.integers(0, n, (2, 3)).astype(np.int32)) for n in (50, 2))
    y = embedding(ids, weight, position_weight=positions, type_ids=type_ids, type_weight=types_,
                  norm_weight=norm_weight, normalize=True, path="custom")
    assert same(fake_gpu.launches[-1], (ids, type_ids, weight, positions, types_, norm_weight, y))
    assert y.shape == (2, 3, 16)


class OtherDeviceArray(DeviceArray):
    """A stand-in array on GPU 1."""

    device_id = 1


OtherDeviceArray.__module__ = "cupy.stand_in"


def test_attention_lengths_are_checked_at_every_call_and_converted_only_where_needed(rng, fake_gpu):
    """Lengths are not in the key, so every call checks them as before (device, shape, dtype); int32
    lengths on q's device go to the kernel as they are, others are converted to int32 at each call."""
    q, k, v = _qkv(rng, "BHSD")
    lens = np.array([3, 16], np.int32)
    o = attention(q, k, v, seq_lens_kv=CheckedLengths(on_device(lens.astype(np.int64))), path="custom")
    sent = fake_gpu.launches[-1][6]
    assert sent.dtype == np.int32 and np.array_equal(sent, lens) and fake_gpu.launches[-1][3] is o
    with pytest.raises(ValueError, match="attention: seq_lens_kv is on GPU 1 but q is on GPU 0"):
        attention(q, k, v, seq_lens_kv=CheckedLengths(lens.view(OtherDeviceArray)), path="custom")
    with pytest.raises(ValueError, match=r"attention: seq_lens_kv must have shape \(2,\), one length per batch "
                                         r"entry, got \(3,\)"):
        attention(q, k, v, seq_lens_kv=CheckedLengths(on_device(np.zeros(3, np.int32))), path="custom")
    with pytest.raises(TypeError, match="attention: seq_lens_kv must hold integers, got dtype float32"):
        attention(q, k, v, seq_lens_kv=CheckedLengths(on_device(np.zeros(2, np.float32))), path="custom")
    host = tuple(np.asarray(a) for a in (q, k, v))
    with pytest.raises(TypeError, match="attention: seq_lens_kv is on the GPU but q is a host array; pass both on "
                                        "one device"):
        attention(*host, seq_lens_kv=on_device(lens))


def test_attention_determinism_setting_is_in_the_key_and_the_cudnn_problem(rng, fake_gpu, monkeypatch):
    """config.allow_nondeterministic is read at a signature's first call: flipping it binds anew, and the
    problem the cuDNN graph is built (and cached) for says whether non-deterministic plans may run."""
    problems = []
    graph_for = AT.cudnn_backend.graph_for
    monkeypatch.setattr(AT.cudnn_backend, "graph_for", lambda key, build, describe, **options: problems.append(key)
                        or graph_for(key, build, describe))
    q, k, v = _qkv(rng, "BSHD", Sq=1)
    for allow in (False, True, False):
        monkeypatch.setattr(libnn.config, "allow_nondeterministic", allow)
        attention(q, k, v, layout="BSHD", path="cudnn")
    assert [p.deterministic for p in problems] == [True, False]
    assert len(AT.op.calls) == 2
