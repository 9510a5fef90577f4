"""kernels/key_padding.cu and kernels/masked_mean.cu on the GPU against NumPy, outputs poisoned (0xFF:
NaN in every float, 255 in a bool, -1 in an int32), odd shapes: the captured key padding's valid,
lengths and holes bias bit for bit, for int64, int32, bool and uint8 masks, fp16, bf16 and fp32
biases, true and nonempty lengths; masked_mean within its dtype's rounding of the float64 mean, the
same bits on every run, positions the mask drops never read (NaN there), zeros for a row without a
token. And attention under nonempty lengths: nothing zeroed, a row without tokens attends to its
first key, every row finite."""

import numpy as np
import pytest

from libnn import dtypes
from libnn.errors import LibraryError, PathUnavailableError
from libnn.nn import functional
from libnn.nn.functional import key_padding_and_tokens, masked_mean
from libnn.ops.attention import attention
from conftest import random_normal, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_gpu_memory")]

MASK_DTYPES = {"int64": np.int64, "int32": np.int32, "bool": np.bool_, "uint8": np.uint8}


def masks(rng, B: int, S: int, dtype) -> list[np.ndarray]:
    """(B, S) masks in `dtype`, nonzero at a token (not only 1): one whose rows are, in a random order,
    holes (random), all padding, full, right padding and left padding; all padding; all tokens."""
    kinds = rng.permutation(5)
    mixed = np.zeros((B, S), bool)
    for b in range(B):
        kind, cut = kinds[b % 5], rng.integers(0, S + 1)
        mixed[b] = {0: rng.random(S) < 0.5, 1: np.zeros(S, bool), 2: np.ones(S, bool),
                    3: np.arange(S) < cut, 4: np.arange(S) >= cut}[kind]
    found = []
    for m in (mixed, np.zeros((B, S), bool), np.ones((B, S), bool)):
        if np.dtype(dtype) == np.bool_:
            found.append(m)
        else:  # any nonzero value is a token
            found.append(np.where(m, rng.integers(1, 100, (B, S)), 0).astype(dtype))
    return found


def expected_key_padding(mask: np.ndarray, nonempty: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(valid, lengths, holes): lengths 1 + each row's last token (at least 1 if nonempty), holes True at
    the non-tokens before a row's last token."""
    valid = mask != 0
    S = mask.shape[1]
    last = np.where(valid.any(axis=1), S - 1 - np.argmax(valid[:, ::-1], axis=1), -1)
    lengths = np.maximum(last + 1, 1 if nonempty else 0).astype(np.int32)
    holes = ~valid & (np.arange(S)[None, :] < last[:, None])
    return valid, lengths, holes


@pytest.mark.parametrize("nonempty", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mask_dtype", list(MASK_DTYPES))
@pytest.mark.parametrize("S", [1, 7, 128, 129])
@pytest.mark.parametrize("B", [1, 3, 32])
def test_captured_key_padding_matches_numpy_bit_for_bit(rng, monkeypatch, B, S, mask_dtype, dtype, nonempty):
    """The one kernel a capture runs (capturing() forced), on the GPU: valid 0/1 bytes, the lengths, and
    the bias's bits: the dtype's -inf at the holes, +0 everywhere else (an all-padding row all +0)."""
    import cupy

    monkeypatch.setattr(functional, "capturing", lambda: True)
    t = dtypes.parse(dtype)
    words = f"u{t.itemsize}"
    minus_inf = np.array(-np.inf, t).view(words)[()]
    for mask in masks(rng, B, S, MASK_DTYPES[mask_dtype]):
        padding = key_padding_and_tokens(cupy.asarray(mask), dtype, nonempty=nonempty)
        valid, lengths, holes = expected_key_padding(mask, nonempty)
        got_valid = padding.valid.get()
        assert got_valid.dtype == np.bool_ and np.array_equal(got_valid.view(np.uint8), valid.astype(np.uint8))
        assert padding.seq_lens_kv.nonempty is nonempty
        np.testing.assert_array_equal(padding.seq_lens_kv.lengths.get(), lengths)
        bias = padding.bias.bias.get()
        assert bias.shape == (B, 1, 1, S) and bias.dtype == t
        np.testing.assert_array_equal(bias[:, 0, 0].view(words), np.where(holes, minus_inf, 0).astype(words))


def expected_mean(x: np.ndarray, valid: np.ndarray) -> np.ndarray:
    kept = valid.astype(np.float64)
    return (np.where(valid[:, :, None], x.astype(np.float64), 0).sum(axis=1)
            / np.maximum(kept.sum(axis=1, keepdims=True), 1))


# rtol: half an ulp of the dtype (the mean rounded once) plus fp32's accumulation; atol for means near 0
MEAN_TOLERANCE = {"fp16": (1e-3, 1e-5), "bf16": (4e-3, 1e-5), "fp32": (1e-5, 1e-6), "fp64": (1e-12, 1e-14)}


def check_masked_mean(rng, B: int, S: int, F: int, dtype: str, offset: int = 0) -> None:
    """masked_mean of x (B, S, F) in `dtype`, placed `offset` elements into its buffer, with NaN at every
    position the mask drops, against the float64 mean; twice, the same bits."""
    import cupy

    t = dtypes.parse(dtype)
    for valid in masks(rng, B, S, np.bool_):
        x = random_normal(rng, (B, S, F), dtype)
        x[~valid] = np.nan  # never read
        buffer = cupy.empty(B * S * F + offset, t)
        gx = buffer[offset:].reshape(B, S, F)
        gx[...] = cupy.asarray(x)
        got = masked_mean(gx, cupy.asarray(valid))
        assert got.dtype == t and got.shape == (B, F)
        host = got.get().astype(np.float64)
        assert np.all(np.isfinite(host))
        assert np.all(host[~valid.any(axis=1)] == 0), "a row without a token gives zeros"
        rtol, atol = MEAN_TOLERANCE[dtype]
        np.testing.assert_allclose(host, expected_mean(x, valid), rtol=rtol, atol=atol)
        again = masked_mean(gx, cupy.asarray(valid)).get()
        assert np.array_equal(again.view(f"u{t.itemsize}"), got.get().view(f"u{t.itemsize}")), "deterministic"


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("F", [1, 7, 64, 100, 384])
@pytest.mark.parametrize("S", [1, 7, 128, 129])
@pytest.mark.parametrize("B", [1, 3, 32])
def test_masked_mean_matches_numpy(rng, B, S, F, dtype):
    check_masked_mean(rng, B, S, F, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("B, S, F", [(3, 7, 64), (2, 129, 384)])
def test_masked_mean_of_a_misaligned_x_matches_numpy(rng, B, S, F, dtype):
    """x one element past a 16-byte boundary: the scalar version, the same means."""
    check_masked_mean(rng, B, S, F, dtype, offset=1)


@pytest.mark.parametrize("path", ["cudnn", "custom", "unfused"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("B, H, S, D", [(3, 2, 17, 64), (5, 3, 128, 32)])
def test_attention_under_nonempty_lengths_zeroes_nothing_and_a_row_without_tokens_reads_its_first_key(
        rng, path, dtype, B, H, S, D):
    """The encoder's masks (key_padding_and_tokens(nonempty=True), holes and a row without tokens): every
    row finite, the rows with tokens as the float64 reference computes them, and the row without tokens
    attending to its first key alone (o = v there), on every GPU path."""
    import cupy

    valid = rng.random((B, S)) < 0.6
    valid[:, 0] = False  # holes before the last token in every row
    valid[np.arange(B), rng.integers(1, S, B)] = True
    valid[1] = False     # no token at all
    padding = key_padding_and_tokens(cupy.asarray(valid), dtype, nonempty=True)
    assert padding.seq_lens_kv.nonempty and padding.seq_lens_kv.lengths.get()[1] == 1
    q, k, v = (random_normal(rng, (B, S, H, D), dtype) for _ in range(3))
    try:
        got = attention(*(cupy.asarray(a) for a in (q, k, v)), seq_lens_kv=padding.seq_lens_kv,
                        attn_bias=padding.bias, layout="BSHD", path=path).get()
    except (LibraryError, PathUnavailableError) as exc:  # unaligned bias rows (odd S), say
        if path == "cudnn":
            pytest.skip(f"cuDNN declines: {str(exc)[:200]}")
        raise
    assert np.all(np.isfinite(got.astype(np.float32)))
    expected = attention(*(a.astype(np.float64) for a in (q, k, v)), layout="BSHD", path="reference",
                         seq_lens_kv=padding.seq_lens_kv.lengths.get(),
                         attn_bias=padding.bias.bias.get().astype(np.float64))
    rows = valid.any(axis=1)
    assert rel_error(got[rows], expected[rows]) <= 1e-2
    first = np.broadcast_to(v[1, :1].astype(np.float64), (S, H, D))
    np.testing.assert_allclose(got[1].astype(np.float64), first, rtol=1e-2, atol=1e-2)
