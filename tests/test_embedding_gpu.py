"""embedding on the GPU: both GPU paths and every kernel version against the float64 reference over
odd shapes (batch 1 and primes; sequences of 1, 7, 128; hidden 1, 7, 32, 384, 768, 1000 and past
1024), fp16/bf16 (relative L2 <= 1e-2) and fp32 (<= 1e-5), with and without positions, token types
and the norm, at random position offsets, outputs poisoned (unwritten elements are NaN); out-of-range
ids giving NaN in exactly their tokens' rows; misaligned tables and ids of every integer dtype; more
tokens than the grid has threads (the grid-stride loops and the kernel's position steps); a bound call
reading new data. Random non-zero tables, seeded per test (conftest's rng)."""

import importlib

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops.embedding import embedding
from conftest import random_normal, rel_error

emb = importlib.import_module("libnn.ops.embedding")  # the module: libnn.ops.embedding is the function

pytestmark = pytest.mark.gpu

PATHS = ["custom", "cupy"]
DTYPES = ["fp16", "bf16", "fp32"]
SHAPES = [(1, 1), (1, 7), (1, 128), (3, 1), (7, 7), (13, 128), (2, 3, 7)]  # ids: batch 1 and primes
HIDDEN = [1, 7, 32, 384, 768, 1000]
OPTIONS = {
    "word": {},
    "word+pos+type": {"position_weight": True, "type_weight": True, "type_ids": True},
    "word+type0+norm": {"type_weight": True, "normalize": True},
    "bert": {"position_weight": True, "type_weight": True, "type_ids": True, "normalize": True,
             "norm_weight": True, "norm_bias": True},
}
BERT = OPTIONS["bert"]
ROWS, POSITION_ROWS, TYPE_ROWS = 300, 512, 2


def tolerance(dtype):
    return dtypes.TOLERANCE[dtype]


def gpu(a):
    import cupy
    return cupy.asarray(a) if isinstance(a, np.ndarray) else a


def make(rng, shape, H, dtype, option, id_dtype=np.int64, rows=ROWS, position_rows=POSITION_ROWS):
    """(ids, weight, keyword arguments) on the host: random non-zero tables, the word table offset so
    that the norm has a mean to remove, a random position offset, eps BERT's 1e-12."""
    S = shape[-1] if shape else 1
    weight = random_normal(rng, (rows, H), dtype, 2.0) + np.asarray(rng.uniform(-3, 3), dtypes.parse(dtype))
    ids = np.asarray(rng.integers(0, rows, shape)).astype(id_dtype)  # 0-d: an array, not a NumPy scalar
    kwargs = {}
    if option.get("position_weight"):
        kwargs["position_weight"] = random_normal(rng, (position_rows, H), dtype)
        kwargs["position_offset"] = int(rng.integers(0, position_rows - S + 1))
    if option.get("type_weight"):
        kwargs["type_weight"] = random_normal(rng, (TYPE_ROWS, H), dtype, 0.5)
    if option.get("type_ids"):
        kwargs["type_ids"] = np.asarray(rng.integers(0, TYPE_ROWS, shape)).astype(id_dtype)
    if option.get("normalize"):
        kwargs["normalize"], kwargs["eps"] = True, 1e-12
    for name in ("norm_weight", "norm_bias"):
        if option.get(name):
            kwargs[name] = random_normal(rng, (H,), dtype)
    return ids, weight, kwargs


def reference(ids, weight, kwargs):
    as64 = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind not in "iu" else v)
            for k, v in kwargs.items()}
    return embedding(ids, weight.astype(np.float64), **as64, path="reference")


def run(path, ids, weight, kwargs):
    return embedding(gpu(ids), gpu(weight), **{k: gpu(v) for k, v in kwargs.items()}, path=path)


def host(y) -> np.ndarray:
    return y.get().astype(np.float64)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_path_matches_reference(rng, path, dtype, shape, H, option):
    ids, weight, kwargs = make(rng, shape, H, dtype, OPTIONS[option])
    y = run(path, ids, weight, kwargs)
    assert y.shape == (*shape, H) and y.dtype == weight.dtype
    assert libnn.get_op("embedding").last_decision.path == path
    assert rel_error(y, reference(ids, weight, kwargs)) <= tolerance(dtype), kwargs.get("position_offset")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [7, 32, 384, 768, 1000, 1024, 1032, 1025, 4096, 12289])
def test_every_kernel_version_matches_reference(rng, dtype, H):
    ids, weight, kwargs = make(rng, (3, 11), H, dtype, BERT)
    expected = reference(ids, weight, kwargs)
    for normalize in (True, False):
        args = _arrays(ids, weight, kwargs, normalize)
        problem = _problem(args, kwargs, normalize)
        want = expected if normalize else reference(ids, weight, _unnormalized(kwargs))
        versions = emb.custom_versions(problem, emb.kernel_is_aligned(problem, *args))
        assert versions[-1] == "emb3_loop" and (H > 1024 or versions[0] == "emb1_warp")
        for version in versions:
            y = emb.launch_custom(problem, *args, version=version)
            assert rel_error(y, want) <= tolerance(dtype), (version, normalize)


def _unnormalized(kwargs):
    return {k: v for k, v in kwargs.items() if k not in ("normalize", "eps", "norm_weight", "norm_bias")}


def _arrays(ids, weight, kwargs, normalize=True):
    """The runner's arguments on the GPU: ids, weight, position_weight, type_ids, type_weight,
    norm_weight, norm_bias."""
    k = kwargs if normalize else _unnormalized(kwargs)
    return tuple(gpu(a) for a in (ids, weight, k.get("position_weight"), k.get("type_ids"), k.get("type_weight"),
                                  k.get("norm_weight"), k.get("norm_bias")))


def _problem(args, kwargs, normalize=True):
    ids, weight, position_weight, type_ids, type_weight, norm_weight, norm_bias = args
    return emb.embedding_problem(ids, weight, position_weight, kwargs.get("position_offset", 0), type_ids, type_weight,
                      norm_weight, norm_bias, kwargs.get("eps", 1e-5), normalize)


# --- out-of-range ids: NaN rows, exactly those -------------------------------------------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "sum"])
@pytest.mark.parametrize("H", [7, 768, 1025, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_out_of_range_ids_give_nan_in_exactly_their_rows(rng, path, dtype, H, normalize):
    ids, weight, kwargs = make(rng, (5, 13), H, dtype, BERT if normalize else OPTIONS["word+pos+type"])
    ids[0, 0], ids[1, 12], ids[3, 5] = -1, ROWS, 2**40  # negative, one past the end, past 32 bits
    kwargs["type_ids"][2, 2], kwargs["type_ids"][4, 7] = TYPE_ROWS, -5
    kwargs["type_ids"][3, 5] = -1  # a token with both out of range
    bad = np.zeros(ids.shape, bool)
    bad[0, 0] = bad[1, 12] = bad[3, 5] = bad[2, 2] = bad[4, 7] = True
    y = host(run(path, ids, weight, kwargs))
    np.testing.assert_array_equal(np.isnan(y).all(axis=-1), bad)
    assert np.isfinite(y[~bad]).all()
    clipped = dict(kwargs, type_ids=np.where(bad, 0, kwargs["type_ids"]))
    expected = reference(np.where(bad, 0, ids), weight, clipped)
    assert rel_error(y[~bad], expected[~bad]) <= tolerance(dtype)
    with pytest.raises(IndexError, match="embedding: ids must be in"):  # the host's answer: an error
        embedding(ids, weight, **kwargs)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [8, 1000, 4096, 1025])
def test_every_kernel_version_writes_nan_rows_for_out_of_range_ids(rng, dtype, H):
    ids, weight, kwargs = make(rng, (4, 9), H, dtype, BERT)
    ids[2, 3] = -7
    kwargs["type_ids"][1, 8] = TYPE_ROWS
    bad = np.zeros(ids.shape, bool)
    bad[2, 3] = bad[1, 8] = True
    expected = reference(np.where(bad, 0, ids), weight, dict(kwargs, type_ids=np.where(bad, 0, kwargs["type_ids"])))
    args = _arrays(ids, weight, kwargs)
    problem = _problem(args, kwargs)
    for version in emb.custom_versions(problem, emb.kernel_is_aligned(problem, *args)):
        y = host(emb.launch_custom(problem, *args, version=version))
        np.testing.assert_array_equal(np.isnan(y).all(axis=-1), bad, err_msg=version)
        assert rel_error(y[~bad], expected[~bad]) <= tolerance(dtype), version


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_table_gives_nan_everywhere(path):
    y = host(run(path, np.array([[0, 1]]), np.zeros((0, 16), np.float16), {}))
    assert y.shape == (1, 2, 16) and np.isnan(y).all()
    types = {"type_ids": np.zeros((1, 2), np.int64), "type_weight": np.zeros((0, 16), np.float16)}
    y = host(run(path, np.array([[0, 1]]), np.ones((2, 16), np.float16), types))
    assert y.shape == (1, 2, 16) and np.isnan(y).all()


def test_positions_past_the_table_are_refused_on_the_host(rng):
    ids, weight, kwargs = make(rng, (2, 128), 32, "fp16", BERT, position_rows=130)
    kwargs["position_offset"] = 3
    with pytest.raises(ValueError, match=r"embedding: positions 3\.\.130 .* which has 130"):
        run("custom", ids, weight, kwargs)


# --- layouts: alignment, strides, id dtypes ----------------------------------------------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [64, 768, 2048])
def test_misaligned_tables_take_the_element_wise_kernels(rng, dtype, H):
    """weight one element past a 16-byte boundary: H % V == 0, but no 16-byte access is allowed."""
    import cupy

    ids, weight, kwargs = make(rng, (3, 17), H, dtype, BERT)
    storage = cupy.empty(weight.size + 1, weight.dtype)
    storage[1:] = gpu(weight).ravel()
    shifted = storage[1:].reshape(weight.shape)
    assert shifted.flags.c_contiguous and shifted.data.ptr % 16 != 0
    args = (gpu(ids), shifted, *_arrays(ids, weight, kwargs)[2:])
    problem = _problem(args, kwargs)
    assert not emb.kernel_is_aligned(problem, *args) and "emb2_block" not in emb.custom_versions(problem, False)
    y = embedding(gpu(ids), shifted, **{k: gpu(v) for k, v in kwargs.items()}, path="custom")
    assert rel_error(y, reference(ids, weight, kwargs)) <= tolerance(dtype)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("id_dtype", ["int32", "int64", "uint8", "int16", "uint32", "uint64"])
@pytest.mark.parametrize("path", PATHS)
def test_ids_of_every_integer_dtype(rng, path, id_dtype):
    rows = 200 if id_dtype in ("uint8", "int16") else ROWS
    ids, weight, kwargs = make(rng, (5, 7), 96, "fp16", BERT, id_dtype=np.dtype(id_dtype), rows=rows)
    kwargs["type_ids"] = kwargs["type_ids"].astype(np.int32 if id_dtype == "int64" else np.int64)  # mixed widths
    y = run(path, ids, weight, kwargs)
    assert rel_error(y, reference(ids, weight, kwargs)) <= tolerance("fp16")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_strided_ids_and_tables_are_read_as_their_values(rng, path):
    import cupy

    ids, weight, kwargs = make(rng, (6, 20), 64, "bf16", BERT)
    strided_ids = cupy.asarray(np.repeat(ids, 2, axis=1))[:, ::2]
    strided_weight = cupy.asarray(np.repeat(weight, 2, axis=0))[::2]
    assert not strided_ids.flags.c_contiguous and not strided_weight.flags.c_contiguous
    for _ in range(2):  # the bound call converts on every call
        y = embedding(strided_ids, strided_weight, **{k: gpu(v) for k, v in kwargs.items()}, path=path)
        assert rel_error(y, reference(ids, weight, kwargs)) <= tolerance("bf16")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_a_single_token_of_0_d_ids(rng, path):
    ids, weight, kwargs = make(rng, (), 40, "fp32", BERT)
    y = run(path, ids, weight, kwargs)
    assert y.shape == (40,) and rel_error(y, reference(ids, weight, kwargs)) <= tolerance("fp32")


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0)], ids=str)
def test_no_tokens_give_an_empty_output(rng, path, shape):
    ids, weight, kwargs = make(rng, shape, 16, "fp16", BERT)
    assert run(path, ids, weight, kwargs).shape == (*shape, 16)


# --- more tokens than the grid: grid-stride loops and the kernel's position steps --------------------
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("H, shape, version", [
    (8, (2800, 101), "emb1_warp"),     # 282800 tokens > 65535 blocks x 4 warps; 262140 % 101 != 0
    (1032, (9500, 7), "emb2_block"),   # 66500 tokens > 65535 blocks; 65535 % 7 != 0
    (1025, (9500, 7), "emb3_loop"),
], ids=["warp", "block", "loop"])
def test_more_tokens_than_the_grid_holds(rng, H, shape, version):
    ids, weight, kwargs = make(rng, shape, H, "fp16", BERT)
    args = _arrays(ids, weight, kwargs)
    problem = _problem(args, kwargs)
    assert emb.custom_version(problem, emb.kernel_is_aligned(problem, *args)) == version
    assert emb._launch(version, problem, True)[1] == 65535
    y = embedding(*args[:2], **{k: gpu(v) for k, v in kwargs.items()}, path="custom")
    assert rel_error(y, reference(ids, weight, kwargs)) <= tolerance("fp16")


# --- dispatch and bound calls ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_runs_the_custom_kernel(rng, dtype):
    ids, weight, kwargs = make(rng, (4, 128), 384, dtype, BERT)
    y = run("auto", ids, weight, kwargs)
    assert libnn.get_op("embedding").last_decision.path == "custom"
    assert rel_error(y, reference(ids, weight, kwargs)) <= tolerance(dtype)


def test_fp64_tables_have_no_gpu_path(rng):
    ids, weight, kwargs = make(rng, (2, 3), 8, "fp64", {})
    with pytest.raises(libnn.NoPathError, match="dtype fp64 is not supported"):
        run("auto", ids, weight, kwargs)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
def test_a_bound_call_reads_new_data(rng, path):
    op = libnn.get_op("embedding")
    first_ids, first_weight, kwargs = make(rng, (8, 64), 768, "fp16", BERT)
    gpu_kwargs = {k: gpu(v) for k, v in kwargs.items()}
    first = embedding(gpu(first_ids), gpu(first_weight), **gpu_kwargs, path=path)
    builds = op.calls.stats.builds
    ids, weight, _ = make(rng, (8, 64), 768, "fp16", {})
    new_kwargs = dict(kwargs, type_ids=rng.integers(0, TYPE_ROWS, (8, 64)),
                      position_weight=random_normal(rng, (POSITION_ROWS, 768), "fp16"),
                      norm_bias=random_normal(rng, (768,), "fp16"))
    y = embedding(gpu(ids), gpu(weight), **{k: gpu(v) for k, v in new_kwargs.items()}, path=path)
    assert op.calls.stats.builds == builds  # the same signature: the bound call ran
    assert rel_error(y, reference(ids, weight, new_kwargs)) <= tolerance("fp16")
    assert rel_error(first, reference(first_ids, first_weight, kwargs)) <= tolerance("fp16")
    assert rel_error(y, host(first)) > 0.1
    moved = dict(new_kwargs, position_offset=(kwargs["position_offset"] + 1) % (POSITION_ROWS - 64 + 1))
    builds = op.calls.stats.builds  # the reference calls above bound calls of their own
    shifted = embedding(gpu(ids), gpu(weight), **{k: gpu(v) for k, v in moved.items()}, path=path)
    assert op.calls.stats.builds == builds + 1  # a new offset is a new signature, and it is honoured
    assert rel_error(shifted, reference(ids, weight, moved)) <= tolerance("fp16")


def test_the_fused_kernel_matches_what_bert_computed_before(rng):
    """take + add + add + layer_norm, BertEmbeddings.forward's steps, against the one call it becomes."""
    import cupy

    from libnn.ops.layer_norm import layer_norm

    ids, weight, kwargs = make(rng, (4, 33), 384, "fp16", BERT)
    g = {k: gpu(v) for k, v in kwargs.items()}
    S = ids.shape[1]
    start = kwargs["position_offset"]
    steps = cupy.take(gpu(weight), gpu(ids), axis=0) + g["position_weight"][start:start + S]
    steps += cupy.take(g["type_weight"], g["type_ids"], axis=0)
    before = layer_norm(steps, g["norm_weight"], g["norm_bias"], eps=1e-12)
    after = embedding(gpu(ids), gpu(weight), **g)
    assert rel_error(after, host(before)) <= tolerance("fp16")


def test_arrays_on_two_devices_are_refused(rng):
    ids, weight, kwargs = make(rng, (2, 5), 16, "fp32", BERT)
    with pytest.raises(libnn.LibnnError, match="embedding: all arrays must be on one device, got ids on cpu, "
                                               "weight on gpu:0"):
        embedding(ids, gpu(weight), **{k: gpu(v) for k, v in kwargs.items()})
