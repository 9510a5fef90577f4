"""attention with seq_lens_kv only, and with a KeyPaddingBias (holes before each row's last key, as
nn.functional.key_padding builds them): rows of batch entries with no key come out as zeros, the
rest match the float64 reference, on every GPU path, outputs poisoned; odd batch and lengths."""

import numpy as np
import pytest

from libnn import dtypes
from libnn.errors import LibraryError, PathUnavailableError
from libnn.nn.functional import key_padding
from libnn.ops.attention import KeyPaddingBias, attention
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

PATHS = ["cudnn", "custom", "unfused"]


def valid_mask(rng, B: int, S: int) -> np.ndarray:
    """(B, S) booleans: random holes, a last valid key per row at a random place, one row with none."""
    valid = rng.random((B, S)) < 0.6
    for b, last in enumerate(rng.integers(0, S, B)):
        valid[b, last] = True
        valid[b, last + 1:] = False
    valid[B // 2] = False  # a batch entry with no key at all
    return valid


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("holes", [False, True], ids=["lengths", "lengths+holes"])
@pytest.mark.parametrize("B, H, S, D", [(3, 2, 17, 64), (5, 3, 128, 32), (2, 1, 7, 64)])
def test_rows_without_keys_are_zeros_and_the_rest_match(rng, path, dtype, holes, B, H, S, D):
    import cupy

    valid = valid_mask(rng, B, S)
    if not holes:  # right padding only: each row the prefix up to its last key
        valid = np.maximum.accumulate(valid[:, ::-1], axis=1)[:, ::-1]
    lens, bias = key_padding(cupy.asarray(valid), dtypes.parse(dtype))
    assert holes or bias is None, "right padding needs no bias"
    q, k, v = (random_normal(rng, (B, S, H, D), dtype) for _ in range(3))
    kwargs = dict(seq_lens_kv=lens, attn_bias=bias, layout="BSHD")
    try:
        got = attention(*(cupy.asarray(a) for a in (q, k, v)), path=path, **kwargs).get()
    except (LibraryError, PathUnavailableError) as exc:  # unaligned bias rows (odd S), say
        if path == "cudnn":
            pytest.skip(f"cuDNN declines: {str(exc)[:200]}")
        raise
    plain_bias = None if bias is None else (bias.bias if isinstance(bias, KeyPaddingBias) else bias).get()
    expected = attention(*(a.astype(np.float64) for a in (q, k, v)), layout="BSHD", path="reference",
                         seq_lens_kv=None if lens is None else lens.lengths.get(),
                         attn_bias=None if plain_bias is None else plain_bias.astype(np.float64))
    empty = ~valid.any(axis=1)
    assert np.all(got[empty] == 0), "a batch entry with no key gives zeros"
    assert rel_error(got[~empty], expected[~empty]) <= 1e-2


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("B, S", [(1, 1), (3, 17), (5, 128), (2, 1000)])
def test_key_padding_as_captured_equals_the_host_result(rng, monkeypatch, dtype, B, S):
    """While a graph is captured key_padding runs its one kernel (kernels/key_padding.cu) whatever the
    mask: the same lengths, and a bias that is the host's where the host gives one and zeros otherwise."""
    import cupy

    from libnn.nn import functional

    valid = valid_mask(rng, B, S) if B > 1 else rng.random((B, S)) < 0.5
    host_lens, host_bias = key_padding(valid, dtypes.parse(dtype))
    monkeypatch.setattr(functional, "capturing", lambda: True)
    lens, bias = key_padding(cupy.asarray(valid), dtypes.parse(dtype))
    expected_lens = np.full(B, S) if host_lens is None else host_lens.lengths
    assert lens.lengths.get().tolist() == list(expected_lens)
    assert isinstance(bias, KeyPaddingBias) and bias.bias.shape == (B, 1, 1, S)
    assert bias.bias.dtype == dtypes.parse(dtype)
    expected_bias = np.zeros((B, 1, 1, S)) if host_bias is None else host_bias.bias.astype(np.float64)
    np.testing.assert_array_equal(bias.bias.get().astype(np.float64), expected_bias)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_causal_rows_that_see_only_holes_are_zeros(rng, path, dtype):
    """Causal top-left with a key-padding bias: row i sees keys 0..i, and where those are all holes
    before the row's last key the row has no key, so zeros (the bias is a plain one under a causal mask)."""
    import cupy

    B, H, S, D = 3, 2, 16, 64
    valid = np.ones((B, S), bool)
    valid[:, :5] = False  # keys 0..4 are holes: rows 0..4 see no key
    lens, bias = key_padding(cupy.asarray(valid), dtypes.parse(dtype))
    q, k, v = (random_normal(rng, (B, S, H, D), dtype) for _ in range(3))
    try:
        got = attention(*(cupy.asarray(a) for a in (q, k, v)), causal=True, seq_lens_kv=lens, attn_bias=bias,
                        layout="BSHD", path=path).get()
    except (LibraryError, PathUnavailableError) as exc:
        if path == "cudnn":
            pytest.skip(f"cuDNN declines: {str(exc)[:200]}")
        raise
    expected = attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True, layout="BSHD", path="reference",
                         seq_lens_kv=lens.lengths.get(), attn_bias=bias.bias.get().astype(np.float64))
    assert np.all(got[:, :5] == 0), "rows that see only holes give zeros"
    assert rel_error(got[:, 5:], expected[:, 5:]) <= 1e-2
