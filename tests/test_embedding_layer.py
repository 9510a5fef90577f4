"""nn.Embedding's id checks on the CPU: check_ids="lazy" (the GPU gather records a bad id in host memory
and the layer raises at its next call or at raise_id_errors(), with no synchronisation per call) and
"sync"; ops.embedding's id_errors= (checked, keyed, baked into the custom path's launch). The GPU's side
is tests/test_embedding_layer_gpu.py."""

import importlib
import sys
import types

import numpy as np
import pytest

from libnn import nn
from libnn.nn import basic
from libnn.ops.embedding import IdErrors, embedding
from libnn.runtime import launch
from gpu_stand_ins import CUDA, host_ndarray

emb = importlib.import_module("libnn.ops.embedding")  # the module: libnn.ops.embedding is the function


def host_errors() -> IdErrors:
    return IdErrors(np.zeros(1, np.uint64))


def test_id_errors_take_returns_the_record_once():
    errors = host_errors()
    assert errors.take() == 0
    errors.word[0] = 8  # token 7
    assert errors.take() == 8 and errors.take() == 0
    with pytest.raises(TypeError, match=r"IdErrors: word must be a \(1,\) uint64 numpy array"):
        IdErrors(np.zeros(1, np.int64))


def test_embedding_checks_and_keys_id_errors(rng):
    weight, ids = rng.standard_normal((5, 3)), np.array([[0, 4], [2, 1]])
    errors = host_errors()
    np.testing.assert_array_equal(embedding(ids, weight, id_errors=errors), weight[ids])  # the reference raises, records nothing
    with pytest.raises(TypeError, match="embedding: id_errors must be None or a libnn.ops.embedding.IdErrors, got "
                                        "str 'yes'"):
        embedding(ids, weight, id_errors="yes")
    with pytest.raises(IndexError, match=r"embedding: ids must be in \[0, 5\)"):
        embedding(np.array([5]), weight, id_errors=errors)


def _stub_gpu(monkeypatch):
    """launch.bind recorded and CuPy's array constructors stood in for by NumPy's: the custom bind runs on host
    arrays."""
    binds = []

    def bind(file, kernel, grid, block, args, *, shared_mem=0):
        binds.append(dict(zip(emb._EMB.names, args)))
        return lambda *arrays: None

    monkeypatch.setattr(launch, "bind", bind)
    monkeypatch.setattr(emb, "_aligned", lambda problem, arrays: False)  # host arrays have no .data.ptr
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=np.empty, ndarray=host_ndarray,
                                                                   cuda=CUDA))
    return binds


def test_the_custom_path_bakes_the_id_errors_word_into_its_launch(monkeypatch, rng):
    binds = _stub_gpu(monkeypatch)
    ids, weight = np.array([[1, 2]]), rng.standard_normal((4, 8)).astype(np.float32)
    arrays = (ids, weight, None, None, None, None, None)
    errors = host_errors()
    for id_errors, bad in ((None, emb.contracts.NULL), (errors, errors.pointer)):
        problem = emb.embedding_problem(ids, weight, None, 0, None, None, None, None, 1e-5, False, id_errors)
        emb.bind_custom(problem, *arrays)
        assert binds[-1]["bad"] == bad
    assert emb._records_no_id_errors(problem) == "records no out-of-range ids (id_errors= is the custom path's)"


def test_an_empty_table_records_token_0(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(full=np.full))
    errors = host_errors()
    ids, weight = np.array([3]), np.zeros((0, 4), np.float32)
    problem = emb.embedding_problem(ids, weight, None, 0, None, None, None, None, 1e-5, False, errors)
    assert np.isnan(emb._nan_result(problem)).all() and errors.take() == 1


@pytest.fixture
def lazy_layer(monkeypatch, rng):
    """An Embedding whose arrays count as GPU arrays, gathering through a stand-in for the custom kernel
    (NaN rows for bad ids, 1 + the last bad token's index recorded, as kernels/embedding.cu does)."""
    layer = nn.Embedding(10, 4, seed=0)
    monkeypatch.setattr(basic, "is_cupy", lambda a: True)
    monkeypatch.setattr(IdErrors, "allocate", classmethod(lambda cls: host_errors()))
    synchronised = []
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: synchronised.append(1)))))

    def kernel(ids, weight, *, id_errors):
        flat = ids.reshape(-1)
        bad = (flat < 0) | (flat >= weight.shape[0])
        if bad.any():
            id_errors.word[0] = np.flatnonzero(bad)[-1] + 1
        rows = np.take(weight, np.clip(flat, 0, weight.shape[0] - 1), axis=0)
        rows[bad] = np.nan
        return rows.reshape(*ids.shape, weight.shape[1])

    monkeypatch.setattr(basic, "embedding", kernel)
    layer.synchronised = synchronised
    return layer


def test_lazy_ids_raise_at_the_next_call_and_not_before(lazy_layer):
    layer = lazy_layer
    y = layer(np.array([[1, 10], [2, 3]]))  # no synchronisation, no error yet: NaN in the bad token's row
    assert np.isnan(y[0, 1]).all() and not np.isnan(np.delete(y.reshape(4, 4), 1, axis=0)).any()
    with pytest.raises(IndexError, match=r"Embedding: ids must be in \[0, 10\) \(num_embeddings\); an earlier call "
                                         r"had an id out of range at token 1 of its ids \(row-major\)"):
        layer(np.array([1, 2]))
    np.testing.assert_array_equal(layer(np.array([1, 2])), layer.weight[[1, 2]])  # reported once, then clear


def test_raise_id_errors_synchronises_and_raises(lazy_layer):
    layer = lazy_layer
    layer.raise_id_errors()  # no lazily checked call yet: nothing to wait for
    assert layer.synchronised == []
    layer(np.array([-1, 0, 3]))
    with pytest.raises(IndexError, match="at token 0 of its ids"):
        layer.raise_id_errors()
    assert layer.synchronised == [1]
    layer.raise_id_errors()  # reported once


def test_an_empty_table_refuses_ids_at_once_without_a_sync(lazy_layer, monkeypatch):
    layer = nn.Embedding(0, 4)
    with pytest.raises(IndexError, match=r"Embedding: ids must be in \[0, 0\) \(num_embeddings\): the table is empty"):
        layer(np.array([0]))
    assert layer(np.zeros((2, 0), np.int64)).shape == (2, 0, 4)


def test_sync_and_host_ids_raise_in_the_call_itself(rng):
    for check_ids in ("lazy", "sync"):
        layer = nn.Embedding(10, 4, check_ids=check_ids)
        with pytest.raises(IndexError, match=r"Embedding: ids must be in \[0, 10\) \(num_embeddings\), got 10"):
            layer(np.array([1, 10]))
    assert repr(nn.Embedding(10, 4, check_ids="sync")) == "Embedding(10, 4, check_ids='sync')"
    with pytest.raises(ValueError, match=r"Embedding: check_ids must be one of \('lazy', 'sync'\), got 'never'"):
        nn.Embedding(10, 4, check_ids="never")


def test_each_optional_array_is_keyed_in_its_own_place(rng):
    """The five optional arrays key as one tuple (or None when all are absent): a table given as
    another argument, or a changed one, is a new signature, checked again."""
    weight, ids = rng.standard_normal((6, 4)), np.array([1, 2])
    table = rng.standard_normal((6, 4))
    plain = embedding(ids, weight)
    with_positions = embedding(ids, weight, position_weight=table)
    np.testing.assert_allclose(with_positions, plain + table[:2], rtol=1e-12)
    with pytest.raises(ValueError, match="type_ids is given but type_weight is None"):
        embedding(ids, weight, type_ids=ids)
    np.testing.assert_allclose(embedding(ids, weight, type_weight=table), plain + table[0], rtol=1e-12)
    with pytest.raises(ValueError, match="norm_weight is given but normalize is False"):
        embedding(ids, weight, norm_weight=table[0])


def test_absent_arrays_are_null_pointers_packed_once_and_launches_pass_the_rest(monkeypatch, rng):
    """The custom path packs a null pointer for each optional array the signature leaves out, and each
    launch passes the arrays there are, in the kernel's order (ids, type_ids, word, pos, type, w, b, y)."""
    binds = _stub_gpu(monkeypatch)
    launches = []
    monkeypatch.setattr(launch, "bind", lambda *a, **k: binds.append(dict(zip(emb._EMB.names, a[4]))) or
                        (lambda *arrays: launches.append(arrays)))
    ids, weight = np.array([[1, 2]]), rng.standard_normal((4, 8)).astype(np.float32)
    positions, types_, norm = (rng.standard_normal(s).astype(np.float32) for s in ((3, 8), (2, 8), (8,)))
    type_ids = np.array([[0, 1]])
    cases = [((ids, weight, None, None, None, None, None), (ids, weight)),
             ((ids, weight, positions, type_ids, types_, norm, None), (ids, type_ids, weight, positions, types_, norm)),
             ((ids, weight, None, None, types_, None, norm), (ids, weight, types_, norm))]
    for arrays, launched in cases:
        problem = emb.embedding_problem(arrays[0], weight, arrays[2], 0, arrays[3], arrays[4], arrays[5], arrays[6],
                                        1e-5, arrays[5] is not None or arrays[6] is not None)
        emb.bind_custom(problem, *arrays)(*arrays)
        sent = launches[-1]
        assert len(sent) == len(launched) + 1 and all(s is a for s, a in zip(sent, launched)), launched
        for name, a in zip(("type_ids", "pos", "type", "w", "b"), (arrays[3], arrays[2], arrays[4], arrays[5], arrays[6])):
            assert (binds[-1][name] is launch.ARRAY) == (a is not None), name
