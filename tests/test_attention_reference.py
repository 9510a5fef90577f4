"""attention on the CPU: the float64 reference against an explicit loop over rows and keys, the masks'
alignments, GQA, layouts, broadcast bias, fully masked rows, and the errors bad arguments raise."""

import math

import numpy as np
import pytest
from conftest import random_normal, rel_error

from libnn.ops.attention import attention


def looped(q, k, v, scale, causal=None, lens_q=None, lens_kv=None, bias=None):
    """Attention one query row at a time, written independently of the op (BHSD, float64)."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    o = np.zeros((B, Hq, Sq, D))
    for b in range(B):
        Lq = Sq if lens_q is None else lens_q[b]
        Lk = Skv if lens_kv is None else lens_kv[b]
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Lq):
                keys = [j for j in range(Lk) if causal is None or (causal == "top_left" and j <= i)
                        or (causal == "bottom_right" and j <= i + Lk - Lq)]
                scores = [scale * float(q[b, h, i] @ k[b, kh, j]) + (0.0 if bias is None else
                          float(bias[b % bias.shape[0], h % bias.shape[1], i % bias.shape[2], j])) for j in keys]
                finite = [s for s in scores if s != -math.inf]
                if not finite:
                    continue
                top = max(finite)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                o[b, h, i] = sum(w / total * v[b, kh, j] for w, j in zip(weights, keys))
    return o


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("Sq,Skv", [(1, 1), (5, 5), (3, 7), (7, 3), (1, 9)])
def test_attention_reference_matches_loop(rng, causal, Sq, Skv):
    q = random_normal(rng, (2, 4, Sq, 8), "fp64")
    k = random_normal(rng, (2, 2, Skv, 8), "fp64")
    v = random_normal(rng, (2, 2, Skv, 8), "fp64")
    got = attention(q, k, v, causal=causal or False, path="reference")
    assert rel_error(got, looped(q, k, v, 1 / math.sqrt(8), causal)) < 1e-12


def test_attention_reference_padding_and_bias_match_loop(rng):
    B, H, Sq, Skv, D = 3, 2, 6, 9, 4
    q, k, v = (random_normal(rng, s, "fp64") for s in [(B, H, Sq, D), (B, 1, Skv, D), (B, 1, Skv, D)])
    bias = random_normal(rng, (B, 1, 1, Skv), "fp64")
    bias[1, 0, 0, 2] = -np.inf
    lens_q, lens_kv = [6, 3, 0], [9, 4, 5]
    for causal in (None, "top_left", "bottom_right"):
        got = attention(q, k, v, scale=0.3, causal=causal or False, seq_lens_q=lens_q, seq_lens_kv=lens_kv,
                        attn_bias=bias, path="reference")
        assert rel_error(got, looped(q, k, v, 0.3, causal, lens_q, lens_kv, bias)) < 1e-12


def test_attention_fully_masked_rows_are_zeros(rng):
    q, k, v = (random_normal(rng, (1, 1, 4, 8), "fp32") for _ in range(3))
    # bottom-right with Sq > Skv: the first rows see no key; an all -inf bias row; kv length 0
    o = attention(q, k[:, :, :2], v[:, :, :2], causal="bottom_right", path="reference")
    assert np.all(o[0, 0, :2] == 0) and np.all(np.isfinite(o)) and np.any(o[0, 0, 2:] != 0)
    bias = np.zeros((1, 1, 4, 4), np.float32)
    bias[0, 0, 1] = -np.inf
    o = attention(q, k, v, attn_bias=bias, path="reference")
    assert np.all(o[0, 0, 1] == 0) and np.all(np.isfinite(o))
    o = attention(q, k, v, seq_lens_kv=[0], path="reference")
    assert np.all(o == 0)


@pytest.mark.parametrize("stale", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_attention_reference_ignores_stale_keys_and_values_past_the_lengths(rng, causal, stale):
    """Keys and values past a sequence's length weigh nothing, so a stale NaN or inf there (a KV cache row
    left from an earlier sequence) leaves the result the loop's, which never reads them; GQA, BSHD."""
    B, Hq, Hkv, Sq, Skv, D = 3, 4, 2, 3, 11, 8
    q = random_normal(rng, (B, Hq, Sq, D), "fp64")
    k, v = (random_normal(rng, (B, Hkv, Skv, D), "fp64") for _ in range(2))
    lens_kv = [11, 5, 3]
    expected = looped(q, k, v, 0.25, causal, None, lens_kv)
    for b, length in enumerate(lens_kv):
        k[b, :, length:], v[b, :, length:] = stale, stale
    got = attention(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)), scale=0.25, causal=causal or False,
                    seq_lens_kv=lens_kv, layout="BSHD", path="reference")
    assert np.all(np.isfinite(got)) and rel_error(got.transpose(0, 2, 1, 3), expected) < 1e-12


def test_attention_layouts_agree(rng):
    q, k, v = (random_normal(rng, (2, 3, 5, 8), "fp32") for _ in range(3))
    bhsd = attention(q, k, v, causal=True, path="reference")
    bshd = attention(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)), causal=True, layout="BSHD", path="reference")
    assert bshd.shape == (2, 5, 3, 8) and bshd.flags.c_contiguous
    assert rel_error(bshd.transpose(0, 2, 1, 3), bhsd) < 1e-6


def test_attention_gqa_equals_repeated_heads(rng):
    q = random_normal(rng, (1, 6, 5, 8), "fp64")
    k, v = (random_normal(rng, (1, 2, 7, 8), "fp64") for _ in range(2))
    grouped = attention(q, k, v, path="reference")
    repeated = attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), path="reference")
    assert rel_error(grouped, repeated) < 1e-14


def test_attention_strided_views_of_packed_qkv(rng):
    B, S, H, D = 2, 5, 3, 8
    qkv = random_normal(rng, (B, S, 3, H, D), "fp32")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    got = attention(q, k, v, layout="BSHD", path="reference")
    expected = attention(*(np.ascontiguousarray(a) for a in (q, k, v)), layout="BSHD", path="reference")
    assert rel_error(got, expected) == 0


@pytest.mark.parametrize("kwargs,message", [
    ({"k": np.zeros((1, 2, 5, 4))}, "share the head dimension"),
    ({"k": np.zeros((1, 3, 5, 8)), "v": np.zeros((1, 3, 5, 8))}, "multiple of k/v's 3 heads"),
    ({"v": np.zeros((1, 2, 6, 8))}, "k and v must have the same shape"),
    ({"q": np.zeros((1, 4, 5))}, "q must be 4-D"),
    ({"k": np.zeros((1, 2, 5, 8), np.float32)}, "k has dtype fp32 but q has fp64"),
    ({"layout": "SBHD"}, "layout must be one of"),
    ({"causal": "left"}, "causal must be"),
    ({"seq_lens_q": [1, 2]}, r"seq_lens_q must have shape \(1,\)"),
    ({"seq_lens_kv": [6]}, r"seq_lens_kv must lie in \[0, 5\]"),
    ({"seq_lens_q": [-1]}, r"seq_lens_q must lie in \[0, 5\]"),
    ({"seq_lens_q": [1.5]}, "must hold integers"),
    ({"attn_bias": np.zeros((1, 4, 5, 4))}, "bias must have shape"),
    ({"attn_bias": np.zeros((2, 4, 5, 5))}, "bias must have shape"),
    ({"attn_bias": np.zeros((1, 1, 1, 5), np.float32)}, "bias has dtype fp32"),
    ({"scale": float("nan")}, "scale must be a finite number"),
])
def test_attention_rejects_bad_arguments(kwargs, message):
    args = {"q": np.ones((1, 4, 5, 8)), "k": np.ones((1, 2, 5, 8)), "v": np.ones((1, 2, 5, 8))}
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        attention(args.pop("q"), args.pop("k"), args.pop("v"), path="reference", **args)


def test_attention_gpu_path_on_host_arrays_is_refused():
    from libnn.errors import PathUnavailableError

    a = np.ones((1, 1, 2, 8), np.float16)
    with pytest.raises((TypeError, PathUnavailableError), match="cudnn"):
        attention(a, a, a, path="cudnn")


def test_attention_empty_batch_or_sequence_gives_empty_or_zero_output(rng):
    q = np.ones((0, 2, 3, 8), np.float32)
    assert attention(q, q, q, path="reference").shape == (0, 2, 3, 8)
    q, k = np.ones((1, 2, 3, 8), np.float32), np.ones((1, 2, 0, 8), np.float32)
    o = attention(q, k, k, path="reference")  # no keys at all: every row is zeros
    assert o.shape == (1, 2, 3, 8) and np.all(o == 0)


def test_attention_takes_numpy_scalars_as_scale_and_checked_lengths(rng):
    from libnn.ops.attention import CheckedLengths

    q = random_normal(rng, (2, 2, 5, 8), "fp64")
    expected = attention(q, q, q, scale=0.5, seq_lens_kv=[3, 5], path="reference")
    got = attention(q, q, q, scale=np.float32(0.5), seq_lens_kv=CheckedLengths(np.array([3, 5])), path="reference")
    assert rel_error(got, expected) == 0
    with pytest.raises(TypeError, match="scale must be a finite number"):
        attention(q, q, q, scale=True, path="reference")


def test_a_key_padding_bias_of_another_shape_is_refused(rng):
    from libnn.ops.attention import KeyPaddingBias

    q = random_normal(rng, (2, 3, 5, 8), "fp32")
    with pytest.raises(ValueError, match=r"a KeyPaddingBias must have shape \(B, 1, 1, Skv\) = \(2, 1, 1, 5\) "
                                         r"\(or \(1, 1, 1, Skv\)\), got \(1, 3, 5, 5\)"):
        attention(q, q, q, attn_bias=KeyPaddingBias(np.zeros((1, 3, 5, 5), np.float32)))


@pytest.mark.parametrize("causal, kept", [(False, True), ("top_left", False), ("bottom_right", False)])
def test_a_key_padding_bias_is_a_plain_bias_under_a_causal_mask(monkeypatch, causal, kept):
    """Under a causal mask a row may see only the holes before its last key (row 0 of [hole, key]):
    the promise that the bias never empties a row holds without one only."""
    from libnn.ops.attention import KeyPaddingBias, op

    bound = []
    real_bind = op.bind
    monkeypatch.setattr(op, "bind", lambda problem, *args: bound.append(problem) or real_bind(problem, *args))
    op.calls.clear()
    q = np.ones((1, 1, 2, 8), np.float32)
    o = attention(q, q, q, causal=causal, attn_bias=KeyPaddingBias(np.array([[[[-np.inf, 0.0]]]], np.float32)))
    assert bound[-1].bias_keeps_a_key is kept
    if causal == "top_left":
        assert np.all(o[0, 0, 0] == 0), "row 0 sees only the hole: a row without keys, zeros"
