"""embedding on the CPU: the reference against a token-by-token oracle over shapes and options, its
rounding, the errors bad input gets (with the function, the argument, what was expected and what came),
the bound calls' keys, and the custom path's launch choices (pure Python: every kernel name it can ask
for is one kernels/embedding.cu defines)."""

import importlib
import math
import re

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops import row_kernels
from libnn.ops.embedding import embedding
from libnn.runtime import kernels
from conftest import random_normal, rel_error

emb = importlib.import_module("libnn.ops.embedding")  # the module: libnn.ops.embedding is the function


def token_oracle(ids, weight, position_weight=None, position_offset=0, type_ids=None, type_weight=None,
                 norm_weight=None, norm_bias=None, eps=1e-5, normalize=False):
    """Token by token in Python floats, math.fsum for the norm's sums: independent of the reference's
    NumPy gathers, broadcasts and means."""
    ids = np.asarray(ids)
    H = weight.shape[1]
    S = ids.shape[-1] if ids.ndim else 1
    out = np.empty((*ids.shape, H))
    for index in np.ndindex(*ids.shape):
        s = index[-1] if index else 0
        row = [float(v) for v in weight[int(ids[index])]]
        if position_weight is not None:
            assert position_offset + s < position_weight.shape[0] and S <= position_weight.shape[0]
            row = [a + float(b) for a, b in zip(row, position_weight[position_offset + s])]
        if type_weight is not None:
            t = 0 if type_ids is None else int(type_ids[index])
            row = [a + float(b) for a, b in zip(row, type_weight[t])]
        if normalize:
            mean = math.fsum(row) / H
            var = math.fsum((v - mean) ** 2 for v in row) / H
            row = [(v - mean) / math.sqrt(var + eps) for v in row]
            if norm_weight is not None:
                row = [v * float(w) for v, w in zip(row, norm_weight)]
            if norm_bias is not None:
                row = [v + float(b) for v, b in zip(row, norm_bias)]
        out[index] = row
    return out


def tables(rng, dtype, H, rows=50, position_rows=20, type_rows=3):
    """Random non-zero tables; the word table offset so that a norm has a mean to remove."""
    return {"weight": random_normal(rng, (rows, H), dtype, 2.0) + np.asarray(1.5, dtypes.parse(dtype)),
            "position_weight": random_normal(rng, (position_rows, H), dtype),
            "type_weight": random_normal(rng, (type_rows, H), dtype, 0.5),
            "norm_weight": random_normal(rng, (H,), dtype),
            "norm_bias": random_normal(rng, (H,), dtype)}


OPTIONS = {
    "word": {},
    "word+pos": {"position_weight": True},
    "word+pos+type": {"position_weight": True, "type_weight": True, "type_ids": True},
    "word+type0": {"type_weight": True},
    "bert": {"position_weight": True, "type_weight": True, "type_ids": True, "normalize": True,
             "norm_weight": True, "norm_bias": True},
    "norm-no-affine": {"position_weight": True, "normalize": True},
    "norm-weight-only": {"type_weight": True, "normalize": True, "norm_weight": True},
}


def arguments(rng, t, ids, option, position_offset=0, eps=1e-5):
    """The keyword arguments of one option set, drawn from the tables `t`."""
    kwargs = {name: t[name] for name in ("position_weight", "type_weight", "norm_weight", "norm_bias")
              if option.get(name)}
    if option.get("type_ids"):
        kwargs["type_ids"] = rng.integers(0, t["type_weight"].shape[0], ids.shape)
    if option.get("normalize"):
        kwargs["normalize"], kwargs["eps"] = True, eps
    if "position_weight" in kwargs:
        kwargs["position_offset"] = position_offset
    return kwargs


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("H", [1, 7, 32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 4), (6,), ()], ids=str)
def test_reference_matches_token_oracle(rng, shape, H, option):
    t = tables(rng, "fp64", H)
    ids = rng.integers(0, 50, shape)
    offset = int(rng.integers(0, 20 - (shape[-1] if shape else 1) + 1))
    kwargs = arguments(rng, t, ids, OPTIONS[option], position_offset=offset, eps=1e-3)
    y = embedding(ids, t["weight"], **kwargs)
    assert y.shape == (*shape, H) and y.dtype == np.float64
    assert libnn.get_op("embedding").last_decision.path == "reference"
    expected = token_oracle(ids, t["weight"], **kwargs)
    if OPTIONS[option].get("normalize") and H == 1:  # one element: e - mean is 0, y is the bias (or 0)
        assert np.all(np.abs(expected - (t["norm_bias"] if "norm_bias" in kwargs else 0)) == 0)
    assert rel_error(y, expected) <= 1e-12


def test_reference_is_not_fooled_by_a_large_mean_offset(rng):
    """Rows 1e4 above their spread: the variance is taken after the mean, so it keeps its digits."""
    t = tables(rng, "fp64", 300)
    ids = rng.integers(0, 50, (4, 9))
    y = embedding(ids, t["weight"] + 1e4, position_weight=t["position_weight"], normalize=True)
    assert rel_error(y, embedding(ids, t["weight"], position_weight=t["position_weight"], normalize=True)) <= 1e-10


@pytest.mark.parametrize("dtype", ["fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else []))
def test_reference_rounds_once_to_the_tables_dtype(rng, dtype):
    t = tables(rng, dtype, 33)
    ids, type_ids = rng.integers(0, 50, (3, 8)), rng.integers(0, 3, (3, 8))
    kwargs = dict(position_weight=t["position_weight"], type_ids=type_ids, type_weight=t["type_weight"],
                  norm_weight=t["norm_weight"], norm_bias=t["norm_bias"], normalize=True)
    y = embedding(ids, t["weight"], **kwargs)
    as64 = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind != "i" else v)
            for k, v in kwargs.items()}
    expected = embedding(ids, t["weight"].astype(np.float64), **as64)
    assert y.dtype == t["weight"].dtype and rel_error(y, expected.astype(y.dtype)) == 0


def test_without_type_ids_every_token_is_type_0(rng):
    t = tables(rng, "fp64", 16)
    ids = rng.integers(0, 50, (2, 5))
    y = embedding(ids, t["weight"], type_weight=t["type_weight"])
    zeros = embedding(ids, t["weight"], type_ids=np.zeros((2, 5), np.int64), type_weight=t["type_weight"])
    np.testing.assert_array_equal(y, zeros)
    np.testing.assert_array_equal(y, t["weight"][ids] + t["type_weight"][0])


@pytest.mark.parametrize("id_dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_any_integer_dtype_indexes(rng, id_dtype):
    t = tables(rng, "fp32", 8)
    ids = rng.integers(0, 50, (2, 6)).astype(id_dtype)
    types = rng.integers(0, 3, (2, 6)).astype(id_dtype)
    y = embedding(ids, t["weight"], type_ids=types, type_weight=t["type_weight"])
    np.testing.assert_array_equal(y, t["weight"][ids.astype(np.int64)] + t["type_weight"][types.astype(np.int64)])


def test_non_contiguous_arrays_are_read_as_their_values(rng):
    t = tables(rng, "fp64", 12)
    ids = rng.integers(0, 50, (6, 10))[::2, ::3]
    wide = np.repeat(t["weight"], 2, axis=1)[:, ::2]  # a strided view holding weight's values
    assert not ids.flags.c_contiguous and not wide.flags.c_contiguous
    positions = t["position_weight"]
    np.testing.assert_array_equal(embedding(ids, wide, position_weight=positions),
                                  embedding(np.ascontiguousarray(ids), t["weight"], position_weight=positions))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)], ids=str)
def test_no_tokens_give_an_empty_output(rng, shape):
    t = tables(rng, "fp32", 8)
    y = embedding(np.zeros(shape, np.int64), t["weight"], position_weight=t["position_weight"], normalize=True)
    assert y.shape == (*shape, 8) and y.dtype == np.float32


def test_a_zero_hidden_size_gives_an_empty_output_after_the_range_check():
    weight = np.zeros((4, 0), np.float32)
    assert embedding(np.array([[1, 3]]), weight, normalize=True).shape == (1, 2, 0)
    with pytest.raises(IndexError, match=r"embedding: ids must be in \[0, 4\)"):
        embedding(np.array([[1, 4]]), weight)


# --- out-of-range ids: an IndexError on the host ---------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 50, 10**12])
def test_out_of_range_ids_raise_index_error_naming_ids(rng, bad):
    t = tables(rng, "fp32", 8)
    ids = rng.integers(0, 50, (2, 5))
    ids[1, 3] = bad
    with pytest.raises(IndexError, match=re.escape(f"embedding: ids must be in [0, 50) (the rows of weight), got "
                                                   f"{bad} at position (1, 3) (1 out of range;")):
        embedding(ids, t["weight"])


@pytest.mark.parametrize("bad", [-2, 3])
def test_out_of_range_type_ids_raise_index_error_naming_type_ids(rng, bad):
    t = tables(rng, "fp32", 8)
    ids = rng.integers(0, 50, (2, 5))
    types = np.zeros((2, 5), np.int32)
    types[0, 4] = types[1, 0] = bad
    with pytest.raises(IndexError, match=re.escape(f"embedding: type_ids must be in [0, 3) (the rows of "
                                                   f"type_weight), got {bad} at position (0, 4) (2 out of range;")):
        embedding(ids, t["weight"], type_ids=types, type_weight=t["type_weight"])


def test_an_empty_table_refuses_every_id():
    with pytest.raises(IndexError, match=r"embedding: ids must be in \[0, 0\) \(the rows of weight\), got 0"):
        embedding(np.zeros((1, 2), np.int64), np.zeros((0, 4), np.float32))


# --- checks: clear errors ---------------------------------------------------------------------------
def bad_call(rng, **changes):
    t = tables(rng, "fp32", 8)
    kwargs = dict(ids=rng.integers(0, 50, (2, 5)), weight=t["weight"], position_weight=t["position_weight"],
                  type_ids=rng.integers(0, 3, (2, 5)), type_weight=t["type_weight"], norm_weight=t["norm_weight"],
                  norm_bias=t["norm_bias"], normalize=True)
    kwargs.update(changes)
    ids, weight = kwargs.pop("ids"), kwargs.pop("weight")
    return embedding(ids, weight, **kwargs)


@pytest.mark.parametrize("changes, error, message", [
    (dict(ids=np.ones((2, 5), np.float32)), TypeError, "embedding: ids must be an integer array (int32, int64, ...), "
                                                        "got dtype float32"),
    (dict(ids=np.ones((2, 5), bool)), TypeError, "embedding: ids must be an integer array"),
    (dict(weight=np.ones(8, np.float32)), ValueError, "embedding: weight must be 2-D (rows, hidden), got shape (8,)"),
    (dict(weight=np.ones((50, 8), np.int32)), TypeError, "embedding: weight must be a floating-point array "
                                                          "(fp16, bf16, fp32, fp64), got int32"),
    (dict(position_weight=np.ones((20, 9), np.float32)), ValueError,
     "embedding: position_weight must be 2-D (rows, 8) to match weight's hidden size (weight is (50, 8)), "
     "got shape (20, 9)"),
    (dict(position_weight=np.ones(8, np.float32)), ValueError, "embedding: position_weight must be 2-D (rows, 8)"),
    (dict(position_weight=np.ones((20, 8), np.float16)), TypeError,
     "embedding: position_weight has dtype fp16 but weight has fp32; cast them to one dtype"),
    (dict(type_weight=np.ones((3, 4), np.float32)), ValueError, "embedding: type_weight must be 2-D (rows, 8)"),
    (dict(type_weight=np.ones((3, 8), np.float64)), TypeError, "embedding: type_weight has dtype fp64 but weight "
                                                                "has fp32"),
    (dict(type_ids=np.ones((2, 5), np.float32)), TypeError, "embedding: type_ids must be an integer array "
                                                             "(int32, int64, ...), got dtype float32"),
    (dict(type_ids=np.ones((2, 4), np.int64)), ValueError, "embedding: type_ids must have ids' shape (2, 5), "
                                                            "got (2, 4)"),
    (dict(type_weight=None), ValueError, "embedding: type_ids is given but type_weight is None"),
    (dict(type_ids=None, type_weight=np.ones((0, 8), np.float32)), ValueError,
     "embedding: type_weight has no rows, but without type_ids every token is of type 0"),
    (dict(norm_weight=np.ones(7, np.float32)), ValueError, "embedding: norm_weight must have shape (8,) to match "
                                                            "weight's hidden size (weight is (50, 8)), got (7,)"),
    (dict(norm_bias=np.ones(8, np.float16)), TypeError, "embedding: norm_bias has dtype fp16 but weight has fp32"),
    (dict(normalize=False), ValueError, "embedding: norm_weight is given but normalize is False; pass "
                                        "normalize=True to apply the LayerNorm"),
    (dict(normalize=1), TypeError, "embedding: normalize must be True or False, got int 1"),
    (dict(eps=0.0), ValueError, "embedding: eps must be a finite number > 0, got 0.0"),
    (dict(eps=-1e-5), ValueError, "embedding: eps must be a finite number > 0"),
    (dict(eps=float("nan")), ValueError, "embedding: eps must be a finite number > 0, got nan"),
    (dict(eps="1e-5"), TypeError, "embedding: eps must be a finite number > 0, got str '1e-5'"),
    (dict(position_offset=16), ValueError,
     "embedding: positions 16..20 (position_offset 16 + the 5 positions of ids' last axis) must be rows of "
     "position_weight, which has 20 (position_offset must be in [0, 15])"),
    (dict(position_offset=-1), ValueError, "embedding: positions -1..3"),
    (dict(position_offset=1.0), TypeError, "embedding: position_offset must be an int, got float 1.0"),
    (dict(position_offset=True), TypeError, "embedding: position_offset must be an int, got bool True"),
    (dict(position_weight=None, position_offset=2), ValueError,
     "embedding: position_offset is 2 but position_weight is None; an offset needs a position table"),
    (dict(ids=[[1, 2]]), TypeError, "embedding: ids must be an array (numpy.ndarray, cupy.ndarray, or anything "
                                    "with DLPack / __cuda_array_interface__), got builtins.list"),
    (dict(norm_bias=[0.0] * 8), TypeError, "embedding: norm_bias must be an array"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_refused_with_a_clear_error(rng, changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        bad_call(rng, **changes)


def test_a_sequence_longer_than_the_position_table_is_refused(rng):
    t = tables(rng, "fp32", 8, position_rows=6)
    with pytest.raises(ValueError, match=re.escape("embedding: positions 0..6 (position_offset 0 + the 7 "
                                                   "positions of ids' last axis) must be rows of position_weight, "
                                                   "which has 6 (position_offset must be in [0, 0])")):
        embedding(rng.integers(0, 50, (2, 7)), t["weight"], position_weight=t["position_weight"])
    # exactly as long: fine, and the offset then has no room left
    embedding(rng.integers(0, 50, (2, 6)), t["weight"], position_weight=t["position_weight"])


def test_a_gpu_path_on_host_arrays_says_how_to_move_them(rng):
    t = tables(rng, "fp32", 8)
    with pytest.raises(TypeError, match="embedding: path 'custom' runs on the GPU, but the arrays are host"):
        embedding(rng.integers(0, 50, (2, 5)), t["weight"], path="custom")
    with pytest.raises(ValueError, match="embedding: unknown path 'fused'"):
        embedding(rng.integers(0, 50, (2, 5)), t["weight"], path="fused")


def test_op_is_registered_in_its_auto_order():
    assert list(libnn.get_op("embedding").paths) == ["custom", "cupy", "reference"]
    assert libnn.get_op("embedding").order == ("custom", "cupy", "reference")
    assert {p["path"]: p["kind"] for p in libnn.paths("embedding")} == \
        {"custom": "custom", "cupy": "library", "reference": "reference"}
    assert "embedding" in libnn.ops.__all__


# --- bound calls ------------------------------------------------------------------------------------
def test_a_bound_call_reads_new_data_and_every_option_keys_its_own(rng):
    op = libnn.get_op("embedding")
    op.calls.clear()
    t = tables(rng, "fp64", 16)
    ids = rng.integers(0, 50, (3, 4))
    first = embedding(ids, t["weight"], position_weight=t["position_weight"], normalize=True)
    builds = op.calls.stats.builds
    other_ids, other_weight = rng.integers(0, 50, (3, 4)), random_normal(rng, (50, 16), "fp64")
    again = embedding(other_ids, other_weight, position_weight=t["position_weight"], normalize=True)
    assert op.calls.stats.builds == builds  # the same signature: no new binding
    assert rel_error(again, token_oracle(other_ids, other_weight, t["position_weight"], normalize=True)) <= 1e-12
    assert rel_error(first, token_oracle(ids, t["weight"], t["position_weight"], normalize=True)) <= 1e-12
    for options in (dict(normalize=False), dict(normalize=True, eps=1e-3), dict(normalize=True, position_offset=2)):
        y = embedding(ids, t["weight"], position_weight=t["position_weight"], **options)
        assert rel_error(y, token_oracle(ids, t["weight"], t["position_weight"], **options)) <= 1e-12
    assert op.calls.stats.builds == builds + 3
    with pytest.raises(TypeError, match="position_offset must be an int"):  # 2.0 is not 2's bound call
        embedding(ids, t["weight"], position_weight=t["position_weight"], normalize=True, position_offset=2.0)


def test_the_key_names_every_array_and_option():
    """Every argument of `embedding` reaches the key (the optional arrays through `optional_key`, the
    tuple of their signatures): a new test of a new argument has to add it here."""
    import inspect
    source = inspect.getsource(embedding)
    key = source[source.index("if (position_weight is None"):source.index("return op.call")]
    for name in inspect.signature(embedding).parameters:
        assert name in key, name


# --- the custom path's launch choices (no GPU needed) -----------------------------------------------
def problem(H, dtype="fp16", shape=(4, 128)):
    return emb.EmbeddingProblem(shape=shape, rows=100, H=H, dtype=dtype, position_rows=512, position_offset=0,
                                type_rows=2, has_type_ids=True, normalize=True, has_norm_weight=True,
                                has_norm_bias=True, eps=1e-12, device="gpu:0")


def kernel_names() -> set[str]:
    """The kernels kernels/embedding.cu exports (its table is kernels/row_norm.cuh's ROW_KERNELS macro):
    the .entry names of its PTX, compiled by NVRTC without a GPU."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    ptx = kernels.compile_file("embedding.cu", "compute_90").cubin.decode()
    return set(re.findall(r"\.entry\s+(\w+)", ptx))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_every_launch_the_custom_path_can_ask_for_names_a_kernel_of_the_file(dtype):
    names = kernel_names()
    for H in [1, 7, 8, 32, 100, 384, 768, 1000, 1024, 1025, 2048, 4096, 12289, 16384, 32768, 40000]:
        p = problem(H, dtype)
        for aligned in (True, False):
            for version in emb.custom_versions(p, aligned):
                name, grid, block = emb._launch(version, p, aligned and H % row_kernels.group(dtype) == 0)
                assert f"{name}_{dtypes.KERNEL_SUFFIX[dtype]}" in names, (H, version, aligned)
                assert 1 <= grid <= 65535 and block % 32 == 0 and block <= 512


def test_the_custom_path_picks_a_warp_per_token_up_to_1024_then_a_block_then_the_loop():
    assert emb.custom_version(problem(768), aligned=True) == "emb1_warp"
    assert emb.custom_version(problem(1000), aligned=False) == "emb1_warp"
    assert emb.custom_version(problem(4096), aligned=True) == "emb2_block"
    assert emb.custom_version(problem(4096), aligned=False) == "emb3_loop"
    assert emb.custom_version(problem(40000), aligned=True) == "emb3_loop"
    assert emb._launch("emb1_warp", problem(768), True) == ("emb1_warp_vec4", 128, 128)  # 512 tokens, 4 a block
    assert emb._launch("emb1_warp", problem(7), False) == ("emb1_warp_sca1", 128, 128)
    assert emb._launch("emb2_block", problem(4096), True) == ("emb2_block_vec2", 512, 256)


def test_the_kernel_and_the_launcher_agree_on_the_flags():
    source = (kernels.kernel_dir() / "embedding.cu").read_text()
    assert "IDS_I64 = 1, TYPES_I64 = 2, NORMALIZE = 4" in source
    assert (emb.IDS_I64, emb.TYPES_I64, emb.NORMALIZE) == (1, 2, 4)
