"""attention(layout="THD", packed=PackedSequences(...)): sequences packed one after another along the
tokens. The reference path against the dense reference of each sequence padded (BSHD with lengths),
its checks, and on the GPU cuDNN's ragged SDPA against the reference on packed q, k, v views of one
QKV projection (the unpadded encoder's case), odd lengths (0, 1, primes) and rows no sequence covers."""

import numpy as np
import pytest
from conftest import random_normal, rel_error

from libnn import dtypes
from libnn.ops.attention import PackedSequences, attention


def packed_case(rng, lengths, H, D, dtype, spare=3):
    """qkv (T, 3, H, D) for sequences of `lengths` one after another, `spare` rows past the last, and
    the PackedSequences; q, k, v are strided views of qkv."""
    lengths = np.asarray(lengths, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(offsets[-1]) + spare
    qkv = random_normal(rng, (T, 3, H, D), dtype)
    return qkv, PackedSequences(lengths, offsets, int(max(lengths.max(initial=0), 1)))


def padded_reference(qkv, packed, causal=False):
    """Each sequence through the dense reference, padded to (B, S, H, D) with its lengths; the rows of
    the tokens back in packed order, zeros elsewhere."""
    lengths, offsets, S = np.asarray(packed.lengths), np.asarray(packed.offsets), packed.max_len
    B, (T, _, H, D) = len(lengths), qkv.shape
    padded = np.zeros((B, S, 3, H, D), qkv.dtype)
    for b in range(B):
        padded[b, :lengths[b]] = qkv[offsets[b]:offsets[b] + lengths[b]]
    o = attention(padded[:, :, 0], padded[:, :, 1], padded[:, :, 2], seq_lens_q=lengths, seq_lens_kv=lengths,
                  causal=causal, layout="BSHD", path="reference")
    out = np.zeros((T, H, D), qkv.dtype)
    for b in range(B):
        out[offsets[b]:offsets[b] + lengths[b]] = o[b, :lengths[b]]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[1], [7, 0, 13, 1], [2, 3, 5, 11]])
def test_packed_reference_equals_each_sequence_padded(rng, lengths, causal):
    qkv, packed = packed_case(rng, lengths, 3, 8, "fp64")
    got = attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout="THD", packed=packed, causal=causal)
    assert got.shape == (qkv.shape[0], 3, 8)
    np.testing.assert_allclose(got, padded_reference(qkv, packed, causal), rtol=1e-12, atol=1e-12)
    assert not got[int(packed.offsets[-1]):].any()  # rows no sequence covers


def test_packed_sequences_read_only_their_own_rows(rng):
    """Changing one sequence's rows leaves every other sequence's output as it was."""
    qkv, packed = packed_case(rng, [4, 6, 5], 2, 8, "fp64")
    before = attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout="THD", packed=packed)
    qkv[4:10] = random_normal(rng, (6, 3, 2, 8), "fp64")
    after = attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout="THD", packed=packed)
    np.testing.assert_array_equal(after[:4], before[:4])
    np.testing.assert_array_equal(after[10:], before[10:])
    assert not np.allclose(after[4:10], before[4:10])


def bad_calls(qkv, packed):
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    B = len(packed.lengths)
    return [
        (dict(q=q, k=k, v=v, layout="THD"), TypeError, "packed=PackedSequences"),
        (dict(q=q, k=k, v=v, layout="BSHD", packed=packed), TypeError, "go together"),
        (dict(q=q, k=k, v=v, layout="THD", packed=packed, seq_lens_kv=[1] * B), ValueError, "takes no seq_lens_kv"),
        (dict(q=q, k=k, v=v, layout="THD", packed=packed, attn_bias=np.zeros((1, 1, 1, 1))), ValueError,
         "takes no attn_bias"),
        (dict(q=q[None], k=k[None], v=v[None], layout="THD", packed=packed), ValueError, "must be 3-D"),
        (dict(q=q, k=k[1:], v=v[1:], layout="THD", packed=packed), ValueError, "the same tokens"),
        (dict(q=q, k=k, v=v, layout="THD", packed=PackedSequences(packed.lengths, packed.offsets[1:], 4)),
         ValueError, r"\(B \+ 1,\)"),
        (dict(q=q, k=k, v=v, layout="THD", packed=PackedSequences(packed.lengths, packed.offsets, 0)), ValueError,
         "max_len must be a positive int"),
        (dict(q=q, k=k, v=v, layout="THD", packed=PackedSequences(packed.lengths.astype(np.float32), packed.offsets,
                                                                   9)), TypeError, "packed.lengths must hold integers"),
        (dict(q=q, k=k, v=v, layout="THD", packed=PackedSequences(packed.lengths + 40, packed.offsets, 60)),
         ValueError, "must lie within the"),
        (dict(q=q, k=k, v=v, layout="THD", packed=PackedSequences(packed.lengths, packed.offsets, 2)), ValueError,
         "lengths <= max_len 2"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_packed_bad_input_is_refused_clearly(rng, case):
    qkv, packed = packed_case(rng, [3, 5], 2, 8, "fp32")
    kwargs, error, message = bad_calls(qkv, packed)[case]
    with pytest.raises(error, match=message):
        attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


# --- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("lengths, H, D", [([1], 1, 8), ([7, 0, 13, 1], 3, 32), ([2, 128, 5, 97, 11], 12, 64),
                                           ([31] * 9, 4, 128)])
def test_packed_cudnn_matches_reference(rng, dtype, causal, lengths, H, D):
    import cupy

    qkv, packed = packed_case(rng, lengths, H, D, dtype)
    expected = attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout="THD", packed=packed, causal=causal)
    g = cupy.asarray(qkv)
    on_gpu = PackedSequences(cupy.asarray(packed.lengths), cupy.asarray(packed.offsets), packed.max_len)
    for _ in range(2):  # the bound call again, on new values
        got = attention(g[:, 0], g[:, 1], g[:, 2], layout="THD", packed=on_gpu, causal=causal, path="cudnn")
        assert got.shape == expected.shape and got.dtype == g.dtype
        assert rel_error(got, expected) <= dtypes.TOLERANCE[dtype]
        assert not bool(got[int(packed.offsets[-1]):].any())
        qkv = random_normal(rng, qkv.shape, dtype)
        g[...] = cupy.asarray(qkv)
        expected = attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout="THD", packed=packed, causal=causal)


@pytest.mark.gpu
def test_packed_gpu_lengths_out_of_range_are_refused(rng):
    import cupy

    qkv, packed = packed_case(rng, [3, 5], 2, 8, "fp16")
    g = cupy.asarray(qkv)
    bad = PackedSequences(cupy.asarray(packed.lengths + 4), cupy.asarray(packed.offsets), 9)
    with pytest.raises(ValueError, match="must lie within the"):
        attention(g[:, 0], g[:, 1], g[:, 2], layout="THD", packed=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["custom", "unfused"])
def test_packed_layout_is_refused_by_the_kernels_paths_by_name(rng, path):
    import cupy

    from libnn.errors import PathUnavailableError

    qkv, packed = packed_case(rng, [3, 5], 2, 8, "fp16")
    g = cupy.asarray(qkv)
    packed = PackedSequences(cupy.asarray(packed.lengths), cupy.asarray(packed.offsets), packed.max_len)
    with pytest.raises(PathUnavailableError, match="layout THD .packed sequences. runs on cudnn and reference"):
        attention(g[:, 0], g[:, 1], g[:, 2], layout="THD", packed=packed, path=path)
