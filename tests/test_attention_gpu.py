"""attention on the GPU: every path against the float64 reference over sequence lengths, head dims,
masks, GQA and dtypes, outputs poisoned; strided (packed QKV) inputs; fallback under auto; graph cache."""

import functools
import warnings
import zlib

import numpy as np
import pytest

from libnn import cache_info, dtypes
from libnn.errors import LibraryError
from libnn.ops.attention import attention, op
from conftest import BASE_SEED, random_normal, rel_error

pytestmark = pytest.mark.gpu

# (B, Hq, Hkv, Sq, Skv, D)
SHAPES = [(1, 1, 1, 1, 1, 32), (2, 4, 4, 17, 17, 64), (1, 8, 2, 128, 128, 80), (2, 4, 1, 1000, 1000, 128),
          (1, 2, 2, 4096, 4096, 64), (3, 8, 8, 1, 1000, 128), (2, 4, 2, 17, 300, 32), (1, 2, 2, 300, 17, 64)]
MASKS = ["none", "top_left", "bottom_right", "padding", "bias", "padding+bottom_right"]
PATHS = ["cudnn", "custom", "unfused"]


def draw(rng, shape, dtype, mask):
    B, Hq, Hkv, Sq, Skv, D = shape
    q = random_normal(rng, (B, Hq, Sq, D), dtype)
    k, v = (random_normal(rng, (B, Hkv, Skv, D), dtype) for _ in range(2))
    kwargs = {}
    if mask.endswith(("top_left", "bottom_right")):
        kwargs["causal"] = mask.split("+")[-1]
    if mask.startswith("padding"):
        kwargs["seq_lens_q"] = rng.integers(0 if B > 1 else 1, Sq + 1, B).astype(np.int32)
        kwargs["seq_lens_kv"] = rng.integers(1, Skv + 1, B).astype(np.int32)
        if B > 1:
            kwargs["seq_lens_kv"][-1] = 0  # a batch entry with no keys: its rows are zeros
    elif mask == "bias":
        kwargs["attn_bias"] = random_normal(rng, (1, Hq, Sq, Skv) if Sq * Skv <= 1 << 20 else (B, 1, 1, Skv), dtype)
    return q, k, v, kwargs


@functools.lru_cache(maxsize=2)
def case_with_reference(base_seed: int, shape, mask: str, dtype: str):
    """q, k, v, the options and the float64 reference's output of one (shape, mask, dtype) case, drawn
    from the run's base seed and the case, not the path: the three paths' tests (consecutive, so
    usually on one xdist worker) share the reference, seconds per case at 4096² on the host, computed
    once instead of three times. The arrays are read, never written, by the tests."""
    q, k, v, kwargs = draw(np.random.default_rng([base_seed, zlib.crc32(f"{shape}-{mask}-{dtype}".encode())]),
                           shape, dtype, mask)
    return q, k, v, kwargs, attention(q, k, v, path="reference", **kwargs)


def on_gpu(q, k, v, kwargs):
    import cupy

    moved = {name: cupy.asarray(a) if isinstance(a, np.ndarray) else a for name, a in kwargs.items()}
    return cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), moved


def run_or_skip(path, q, k, v, kwargs):
    """The forced path's result; a graph cuDNN declines is a skip (auto falls back, tested below)."""
    try:
        return attention(q, k, v, path=path, **kwargs)
    except LibraryError as exc:
        if path == "cudnn":
            pytest.skip(f"cuDNN declines: {str(exc)[:200]}")
        raise


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_path_matches_reference(request, path, dtype, mask, shape):
    q, k, v, kwargs, expected = case_with_reference(request.config.stash[BASE_SEED], shape, mask, dtype)
    if reason := op.paths[path].supports(_problem(q, k, v, kwargs)):
        pytest.skip(reason)
    got = run_or_skip(path, *on_gpu(q, k, v, kwargs))
    assert got.shape == expected.shape and got.dtype == q.dtype
    error = rel_error(got, expected)
    assert error <= dtypes.TOLERANCE[dtype], f"relative error {error:.2e}"
    if mask.startswith("padding"):  # rows past a query length, and the batch with no keys, are exact zeros
        out = got.get()
        for b, (lq, lk) in enumerate(zip(kwargs["seq_lens_q"], kwargs["seq_lens_kv"])):
            assert np.all(out[b, :, lq:] == 0) and (lk > 0 or np.all(out[b] == 0))


def _problem(q, k, v, kwargs):
    from libnn.ops.attention import attention_problem

    return attention_problem(q, k, v, kwargs.get("attn_bias"), None, kwargs.get("causal", False), "BHSD",
                             "seq_lens_q" in kwargs, "seq_lens_kv" in kwargs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_attention_reads_packed_qkv_views_without_a_copy(rng, path, dtype):
    import cupy

    B, S, H, D = 2, 77, 4, 64
    qkv = random_normal(rng, (B, S, 3, H, D), dtype)
    expected = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], layout="BSHD", causal=True, path="reference")
    packed = cupy.asarray(qkv)
    got = run_or_skip(path, packed[:, :, 0], packed[:, :, 1], packed[:, :, 2], {"layout": "BSHD", "causal": True})
    assert got.shape == (B, S, H, D) and got.flags.c_contiguous
    assert rel_error(got, expected) <= dtypes.TOLERANCE[dtype]


def test_attention_fully_masked_rows_are_zeros_on_every_path(rng):
    import cupy

    q, k, v = (cupy.asarray(random_normal(rng, (1, 2, 8, 64), "fp16")) for _ in range(3))
    bias = cupy.zeros((1, 1, 8, 8), cupy.float16)
    bias[0, 0, 3] = -cupy.inf
    for path in PATHS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                o = attention(q, k[:, :, :4], v[:, :, :4], causal="bottom_right", path=path)  # rows 0-3 see no key
                assert bool(cupy.all(o[:, :, :4] == 0)) and bool(cupy.all(cupy.isfinite(o))), path
                o = attention(q, k, v, attn_bias=bias, path=path)
                assert bool(cupy.all(o[:, :, 3] == 0)) and bool(cupy.all(cupy.isfinite(o))), path
            except LibraryError as exc:
                assert path == "cudnn", exc


@pytest.mark.parametrize("path", PATHS)
def test_attention_bias_masking_every_allowed_key_gives_zeros(rng, path):
    """-inf on exactly the keys the padding allows (finite beyond them): the row attends to nothing."""
    import cupy

    q, k, v = (random_normal(rng, (2, 2, 16, 64), "fp16") for _ in range(3))
    lens_kv = np.array([5, 16], np.int32)
    bias = random_normal(rng, (2, 1, 16, 16), "fp16")
    bias[0, 0, 3, :5] = -np.inf
    expected = attention(q, k, v, seq_lens_kv=lens_kv, attn_bias=bias, path="reference")
    got = run_or_skip(path, *on_gpu(q, k, v, {"seq_lens_kv": lens_kv, "attn_bias": bias}))
    assert bool(cupy.all(got[0, :, 3] == 0)) and rel_error(got, expected) <= dtypes.TOLERANCE["fp16"]


def test_attention_auto_falls_back_visibly_and_correctly(rng):
    """fp32 and D % 8 != 0 are outside cuDNN's SDPA: auto passes it over, saying why, and is right."""
    import cupy

    for dtype, D in (("fp32", 64), ("fp16", 36)):
        q, k, v = (random_normal(rng, (2, 2, 33, D), dtype) for _ in range(3))
        got = attention(*(cupy.asarray(a) for a in (q, k, v)), causal=True)
        assert op.last_decision.path == "custom" and "cudnn" in op.last_decision.passed_over
        assert rel_error(got, attention(q, k, v, causal=True, path="reference")) <= dtypes.TOLERANCE[dtype]


def test_attention_forced_cudnn_refuses_fp32_clearly():
    import cupy

    from libnn.errors import PathUnavailableError

    a = cupy.ones((1, 1, 4, 64), cupy.float32)
    with pytest.raises(PathUnavailableError, match="cuDNN's fused attention takes fp16 and bf16, not fp32"):
        attention(a, a, a, path="cudnn")


def test_attention_graph_is_built_once_per_problem(rng):
    import cupy

    graphs = cache_info()["cudnn graphs"]
    q = cupy.asarray(random_normal(rng, (1, 4, 64, 64), "bf16"))
    attention(q, q, q, path="cudnn")
    builds = graphs.builds
    for _ in range(3):
        attention(q, q, q, path="cudnn")
    assert graphs.builds == builds


BOUND_SHAPES = [(3, 4, 2, 37, 53, 40), (2, 3, 1, 1, 29, 20)]  # (B, Hq, Hkv, Sq, Skv, D): attn2 and attn1 in fp16/bf16


def _bound_case(rng, shape, dtype, layout, masks):
    """Host q, k, v in `layout` and the keyword arguments: lengths (a batch entry with no key) or a
    bias with a row that masks every key."""
    B, Hq, Hkv, Sq, Skv, D = shape
    q, k, v = (random_normal(rng, (B, H, S, D) if layout == "BHSD" else (B, S, H, D), dtype)
               for H, S in ((Hq, Sq), (Hkv, Skv), (Hkv, Skv)))
    if masks == "lengths":
        lens_kv = rng.integers(1, Skv + 1, B).astype(np.int32)
        lens_kv[-1] = 0
        kwargs = {"seq_lens_q": rng.integers(0, Sq + 1, B).astype(np.int32), "seq_lens_kv": lens_kv,
                  "causal": "bottom_right"}
    else:
        bias = random_normal(rng, (1, Hq, Sq, Skv), dtype)
        bias[0, rng.integers(Hq), rng.integers(Sq)] = -np.inf
        kwargs = {"attn_bias": bias, "causal": "top_left"}
    return q, k, v, {"layout": layout, **kwargs}


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("masks", ["lengths", "bias"])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("shape", BOUND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_bound_call_equals_a_fresh_one_on_new_values(rng, path, dtype, masks, layout, shape):
    """A path's bound call reads every array at each call: given other arrays, then other values in
    those same arrays (q, k, v, the lengths, the bias), it returns what a newly bound call returns, bit
    for bit (the same kernels on the same inputs), and the reference's result."""
    import cupy

    from libnn.ops.attention import attention_problem

    first, second, third = (_bound_case(rng, shape, dtype, layout, masks) for _ in range(3))
    q, k, v, kwargs = first
    if reason := op.paths[path].supports(attention_problem(q, k, v, kwargs.get("attn_bias"), None, kwargs["causal"],
                                                           layout, masks == "lengths", masks == "lengths")):
        pytest.skip(reason)
    run_or_skip(path, *on_gpu(*first))  # binds (or finds the bound call of an earlier test)
    builds = op.calls.stats.builds
    q, k, v, kwargs = on_gpu(*second)
    other_arrays = run_or_skip(path, q, k, v, kwargs)
    nq, nk, nv, nkwargs = on_gpu(*third)
    arrays = [n for n in ("seq_lens_q", "seq_lens_kv", "attn_bias") if n in kwargs]
    for old, new in zip((q, k, v, *(kwargs[n] for n in arrays)), (nq, nk, nv, *(nkwargs[n] for n in arrays))):
        old[...] = new
    other_values = run_or_skip(path, q, k, v, kwargs)
    assert op.calls.stats.builds == builds  # one signature: the bound call ran both times
    op.calls.clear()
    fresh = run_or_skip(path, q, k, v, kwargs)
    assert op.calls.stats.builds == builds + 1
    assert cupy.array_equal(other_values, fresh)  # poisoned memory: an unwritten output is NaN, never equal
    for got, (hq, hk, hv, hkwargs) in ((other_arrays, second), (other_values, third)):
        assert rel_error(got, attention(hq, hk, hv, path="reference", **hkwargs)) <= dtypes.TOLERANCE[dtype]
