"""Split-K decoding (kernels/attention.cu's attn3_decode + attn3_combine, the custom path's kernel for one
query row per sequence) against the float64 reference on the GPU: a decoder's step reading its KV cache
(q (B, 1, Hq, D), k and v one layer's cache rows (B, L, Hkv, D) with each sequence's length), MHA, GQA and
MQA groups up to 16 (the rows of one mma tile), head dims 8 to 128 (every bucket, zero-filled past D),
caches from 1 to 4099 positions (splits of one tile to many, the last one partial, warps without a tile;
one split, whose block writes o itself, at short caches and at batches that fill the GPU alone),
lengths 0 (zeros out), 1 and full, fp16 and bf16 (fp32 goes to attn2/attn1), outputs poisoned. The op's
custom path picks attn3 for these problems and attn2/attn1 still run them when forced. Tolerances:
relative L2 error fp16/bf16 1e-2 (dtypes.TOLERANCE)."""

from __future__ import annotations

import numpy as np
import pytest

from libnn import dtypes
from libnn.ops import attention
from libnn.ops.attention import CheckedLengths
from conftest import random_normal, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_gpu_memory")]

# (B, Hq, Hkv, D, L)
SHAPES = [(1, 4, 4, 64, 1), (3, 32, 8, 64, 333), (2, 8, 1, 128, 1000), (5, 12, 4, 32, 64), (1, 2, 1, 128, 4099),
          (7, 6, 6, 64, 97), (2, 16, 1, 80, 701), (3, 10, 2, 8, 130), (1, 1, 1, 120, 64),
          (67, 12, 6, 64, 1031)]   # 402 (b, kv head) blocks fill an H100 (264 at D = 64): one split of 17 tiles


def case_id(case):
    return "B{}-Hq{}-Hkv{}-D{}-L{}".format(*case)


def lengths_for(rng, B: int, L: int) -> np.ndarray:
    """Random lengths with an empty sequence, a one-token one and a full one where the batch has room."""
    lengths = rng.integers(1, L + 1, B)
    for b, fixed in zip(range(B), (L, 1, 0)):
        lengths[b] = fixed if B > 2 else max(1, fixed)
    return lengths.astype(np.int32)


def decode_inputs(rng, case, dtype):
    B, Hq, Hkv, D, L = case
    q = random_normal(rng, (B, 1, Hq, D), dtype)
    k, v = (random_normal(rng, (B, L, Hkv, D), dtype) for _ in range(2))
    return q, k, v, lengths_for(rng, B, L)


def reference(q, k, v, lengths):
    return attention(*(a.astype(np.float64) for a in (q, k, v)), layout="BSHD", seq_lens_kv=lengths,
                     path="reference")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", SHAPES, ids=case_id)
def test_split_decoding_matches_the_reference(rng, case, dtype):
    import cupy
    from libnn.ops.attention_kernels import flash_version

    q, k, v, lengths = decode_inputs(rng, case, dtype)
    gq, gk, gv = (cupy.asarray(a) for a in (q, k, v))
    views = [a.transpose(0, 2, 1, 3) for a in (gq, gk, gv)]
    assert flash_version(*views, cupy.empty_like(views[0])) == "attn3_decode"
    got = attention(gq, gk, gv, layout="BSHD", seq_lens_kv=CheckedLengths(cupy.asarray(lengths)),
                    path="custom").get()
    expected = reference(q, k, v, lengths)
    empty = lengths == 0
    assert np.all(got[empty] == 0), "a sequence with no key gives zeros"
    assert rel_error(got[~empty], expected[~empty]) <= dtypes.TOLERANCE[dtype]


@pytest.mark.parametrize("version", ["attn1_naive", "attn2_flash", "attn3_decode"])
def test_every_version_the_problem_takes_agrees(rng, version):
    import cupy
    from libnn.ops.attention_kernels import flash_attention

    case = (3, 32, 8, 64, 333)
    q, k, v, lengths = decode_inputs(rng, case, "fp16")
    views = [cupy.asarray(a).transpose(0, 2, 1, 3) for a in (q, k, v)]
    o = cupy.empty_like(views[0])
    flash_attention(*views, o, scale=1 / 8, causal=None, seq_lens_kv=cupy.asarray(lengths), version=version)
    expected = reference(q, k, v, lengths)
    got = o.transpose(0, 2, 1, 3).get()
    empty = lengths == 0
    assert np.all(got[empty] == 0)
    assert rel_error(got[~empty], expected[~empty]) <= 1e-2


def test_a_bias_a_top_left_mask_or_two_query_rows_are_not_split_decoded(rng):
    import cupy
    from libnn.ops.attention_kernels import flash_version

    q, k, v = (cupy.asarray(random_normal(rng, (2, 8, S, 64), "fp16")) for S in (1, 40, 40))
    o = cupy.empty_like(q)
    assert flash_version(q, k, v, o) == "attn3_decode"
    assert flash_version(q, k, v, o, causal="bottom_right") == "attn3_decode"  # one row: nothing masked
    assert flash_version(q, k, v, o, causal="top_left") == "attn2_flash"
    assert flash_version(q, k, v, o, bias=cupy.zeros((2, 8, 1, 40), q.dtype)) == "attn2_flash"
    q2 = cupy.asarray(random_normal(rng, (2, 8, 2, 64), "fp16"))
    assert flash_version(q2, k, v, cupy.empty_like(q2)) == "attn2_flash"
    q32 = q.astype(cupy.float32)
    assert flash_version(q32, k.astype(cupy.float32), v.astype(cupy.float32), cupy.empty_like(q32)) == "attn1_naive"
    group17 = cupy.asarray(random_normal(rng, (2, 17, 1, 64), "fp16"))
    k1 = k[:, :1]
    assert flash_version(group17, k1, v[:, :1], cupy.empty_like(group17)) == "attn2_flash"  # 17 heads a kv head
    wide = [cupy.asarray(random_normal(rng, (2, 8, S, 136), "fp16")) for S in (1, 40, 40)]
    assert flash_version(*wide, cupy.empty_like(wide[0])) == "attn1_naive"  # D > 128: no bucket


def test_an_empty_cache_is_not_split_decoded_and_gives_zeros(rng):
    import cupy
    from libnn.ops.attention_kernels import flash_version

    q = cupy.asarray(random_normal(rng, (2, 8, 1, 64), "fp16"))
    k = v = cupy.zeros((2, 2, 0, 64), cupy.float16)
    assert flash_version(q, k, v, cupy.empty_like(q)) != "attn3_decode"
    got = attention(q, k, v, path="custom")
    assert got.shape == q.shape and bool((got == 0).all())


def test_one_bound_decode_repeats_bit_for_bit_with_each_length(rng):
    """Split decoding is reproducible: attn3_combine adds a head's splits in their order, so the same call
    gives the same bits every time; later calls with other lengths (other splits empty) still write every
    row (poisoned memory would show NaN) and match the reference."""
    import cupy

    case = (4, 32, 8, 64, 1000)
    q, k, v, _ = (cupy.asarray(a) for a in decode_inputs(rng, case, "fp16"))
    for lengths in ([1000, 1, 0, 517], [3, 999, 64, 65], [1000, 1000, 1000, 1000]):
        L = cupy.asarray(np.array(lengths, np.int32))
        first = attention(q, k, v, layout="BSHD", seq_lens_kv=L, path="custom")
        assert all(bool((attention(q, k, v, layout="BSHD", seq_lens_kv=L, path="custom").view(cupy.uint16)
                         == first.view(cupy.uint16)).all()) for _ in range(20))
        expected = reference(*(cupy.asnumpy(a) for a in (q, k, v)), np.array(lengths, np.int32))
        assert rel_error(cupy.asnumpy(first), expected) < dtypes.TOLERANCE["fp16"]


# (B, Hq, Hkv, D, page_size, max_pages)
PAGED = [(3, 32, 8, 64, 64, 9), (2, 8, 1, 128, 128, 5), (4, 12, 4, 80, 64, 3), (1, 16, 2, 32, 256, 2),
         (5, 6, 6, 64, 64, 1), (67, 12, 6, 64, 64, 7)]


def paged_inputs(rng, case, dtype):
    """q, pools of pages (BSHD: (pages, page_size, Hkv, D)) with three spare pages, a shuffled table (no
    sequence's pages in order) and lengths with an empty, a one-token and a full sequence."""
    B, Hq, Hkv, D, P, max_pages = case
    pages = B * max_pages + 3
    q = random_normal(rng, (B, 1, Hq, D), dtype)
    k, v = (random_normal(rng, (pages, P, Hkv, D), dtype) for _ in range(2))
    table = rng.permutation(pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    return q, k, v, table, lengths_for(rng, B, max_pages * P)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", PAGED, ids=lambda c: "B{}-Hq{}-Hkv{}-D{}-P{}x{}".format(*c))
def test_paged_split_decoding_matches_the_reference(rng, case, dtype):
    """attn3_decode reads each tile from the page the table names; auto runs it first, as for a dense cache."""
    import cupy

    from libnn.registry import get_op

    q, k, v, table, lengths = paged_inputs(rng, case, dtype)
    expected = attention(*(a.astype(np.float64) for a in (q, k, v)), layout="BSHD", seq_lens_kv=lengths,
                         page_table=table, path="reference")
    empty = lengths == 0
    for path in ("custom", "auto"):
        got = attention(*(cupy.asarray(a) for a in (q, k, v)), layout="BSHD", seq_lens_kv=cupy.asarray(lengths),
                        page_table=cupy.asarray(table), path=path).get()
        assert get_op("attention").last_decision.path == "custom"
        assert np.all(got[empty] == 0), "a sequence with no key gives zeros"
        assert rel_error(got[~empty], expected[~empty]) <= dtypes.TOLERANCE[dtype]


def test_pages_smaller_than_a_tile_are_not_split_decoded_and_auto_runs_cudnn(rng):
    import cupy

    from libnn.registry import get_op

    q, k, v, table, lengths = paged_inputs(rng, (2, 8, 2, 64, 16, 20), "fp16")
    args = [cupy.asarray(a) for a in (q, k, v)]
    with pytest.raises(Exception, match="pages of a power-of-two size >= 64"):
        attention(*args, layout="BSHD", seq_lens_kv=cupy.asarray(lengths), page_table=cupy.asarray(table),
                  path="custom")
    got = attention(*args, layout="BSHD", seq_lens_kv=cupy.asarray(lengths), page_table=cupy.asarray(table)).get()
    assert get_op("attention").last_decision.path == "cudnn"
    expected = attention(*(a.astype(np.float64) for a in (q, k, v)), layout="BSHD", seq_lens_kv=lengths,
                         page_table=table, path="reference")
    assert rel_error(got[lengths > 0], expected[lengths > 0]) <= dtypes.TOLERANCE["fp16"]


def test_short_sequences_in_a_long_cache_spread_over_the_splits_and_match_the_reference(rng):
    """The splits are sized by the cache's 4099 positions; each sequence's keys go over them as far as its own
    length goes (1, 64, 65, 129, 700 keys: one tile, a tile boundary, a warp's second tile, several splits)."""
    import cupy

    q, k, v, _ = decode_inputs(rng, (5, 32, 8, 64, 4099), "fp16")
    lengths = np.array([1, 64, 65, 129, 700], np.int32)
    got = attention(*(cupy.asarray(a) for a in (q, k, v)), layout="BSHD",
                    seq_lens_kv=CheckedLengths(cupy.asarray(lengths)), path="custom").get()
    assert rel_error(got, reference(q, k, v, lengths)) <= dtypes.TOLERANCE["fp16"]


def decode_splits(case) -> int:
    """The splits attn3_decode's launcher gives this problem on this GPU."""
    from libnn.ops import attention_kernels as ak
    from libnn.runtime.device import blocks_by_shared_memory, current_device_id, multiprocessors

    B, _, Hkv, D, L = case
    device = current_device_id()
    smem = ak.decode_launch(D)[1]
    tiles = ak.decode_split_tiles(B, Hkv, L, multiprocessors(device), blocks_by_shared_memory(device, smem))
    return -(-L // (tiles * 64))


@pytest.mark.parametrize("case, splits", [((67, 12, 6, 64, 1031), "one"), ((3, 32, 8, 64, 333), "several")],
                         ids=["full batch", "small batch"])
def test_one_split_is_written_by_the_decode_kernel_and_several_are_combined(rng, case, splits):
    """With one split a (b, kv head)'s block has nothing to merge: it writes o, and no combine kernel runs
    (on an H100 the 402 blocks of the full batch fill its 264 resident ones; the small batch's 24 do not)."""
    import cupy
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    n = decode_splits(case)
    if (n == 1) != (splits == "one"):
        pytest.skip(f"this GPU gives {case} {n} split(s)")
    q, k, v, lengths = (cupy.asarray(a) for a in decode_inputs(rng, case, "fp16"))
    lengths = CheckedLengths(lengths)
    attention(q, k, v, layout="BSHD", seq_lens_kv=lengths, path="custom")
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attention(q, k, v, layout="BSHD", seq_lens_kv=lengths, path="custom")
        torch.cuda.synchronize()
    ran = sorted(e.key for e in prof.key_averages() if e.key.startswith("attn3"))
    assert ran == (["attn3_decode_d64_f16"] if n == 1 else ["attn3_combine_f16", "attn3_decode_d64_f16"])
