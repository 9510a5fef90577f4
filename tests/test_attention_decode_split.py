"""How attn3_decode (kernels/attention.cu's split-K decoding) cuts a decode step's keys, without a GPU:
splits fill the GPU's resident blocks once where the batch alone does not, at most DECODE_MAX_SPLITS of
them (attn3_combine adds them one by one), each at least a block's warps' worth of tiles, and the grid's
splits always cover the cache."""

import pytest

from libnn.ops import attention_kernels as ak
from libnn.ops.attention_kernels import DECODE_MAX_SPLITS, decode_launch, decode_split_tiles

SMS, BLOCKS_PER_SM = 132, 2   # an H100 at D = 64
TILE = 64                     # keys a tile (ATTN2_BN)


def splits(B, Hkv, Skv, sms=SMS, blocks=BLOCKS_PER_SM):
    return -(-Skv // (TILE * decode_split_tiles(B, Hkv, Skv, sms, blocks)))


@pytest.mark.parametrize("B, Hkv, Skv, expected_tiles", [
    (64, 8, 4096, 64),   # 512 (b, kv head) pairs fill 264 resident blocks: one split each
    (1, 8, 4096, 8),     # 8 pairs: DECODE_MAX_SPLITS splits of 8 tiles
    (8, 8, 4096, 16),    # 64 pairs: 264 // 64 = 4 splits fit the resident blocks at once (5 would not)
    (8, 8, 1024, 16),    # 64 pairs, a quarter of the SMs, over a short cache (16 tiles): one split
    (8, 8, 1025, 5),     # 17 tiles: no longer short, 4 splits (of 5 tiles, the last of 2)
    (4, 8, 1024, 2),     # 32 pairs, under a quarter of the SMs: 8 splits
    (16, 8, 4096, 64),   # 128 pairs, three quarters of the SMs: one split at any length
    (12, 8, 4096, 32),   # 96 pairs, under three quarters: 264 // 96 = 2 splits of 32 tiles
    (1, 8, 1024, 2),     # 16 tiles in 8 splits
    (1, 8, 64, 2),       # one tile: never fewer than a block's 2 warps' worth (one warp idle)
])
def test_split_sizes_at_decode_shapes(B, Hkv, Skv, expected_tiles):
    assert decode_split_tiles(B, Hkv, Skv, SMS, BLOCKS_PER_SM) == expected_tiles


@pytest.mark.parametrize("B", [1, 2, 3, 7, 8, 31, 64, 65, 1000])
@pytest.mark.parametrize("Skv", [1, 63, 64, 65, 127, 1000, 4096, 4099, 100_000])
@pytest.mark.parametrize("Hkv", [1, 3, 8, 32])
def test_splits_are_few_enough_and_cover_the_cache(B, Hkv, Skv):
    tiles = decode_split_tiles(B, Hkv, Skv, SMS, BLOCKS_PER_SM)
    n = splits(B, Hkv, Skv)
    assert tiles >= ak.DECODE_THREADS // 32
    assert 1 <= n <= DECODE_MAX_SPLITS
    assert n * tiles * TILE >= Skv > (n - 1) * tiles * TILE   # every key in a split, no split empty by shape


def test_a_device_without_room_for_a_block_is_sized_as_one_block_an_sm():
    assert decode_split_tiles(8, 8, 4096, SMS, 0) == decode_split_tiles(8, 8, 4096, SMS, 1)


def test_shared_memory_follows_the_head_dim_bucket():
    names = [decode_launch(D)[0] for D in (8, 32, 40, 64, 80, 96, 128)]
    assert names == ["attn3_decode_d32", "attn3_decode_d32", "attn3_decode_d64", "attn3_decode_d64",
                     "attn3_decode_d96", "attn3_decode_d96", "attn3_decode_d128"]
    smem = [decode_launch(D)[1] for D in (32, 64, 96, 128)]
    assert smem == sorted(smem) and smem[1] == 112_896   # two blocks an H100 SM hold (228 KB, 1 KB each reserved)


@pytest.mark.parametrize("changes", [dict(batch=0), dict(group=0), dict(head_dim=0), dict(head_dim=136),
                                     dict(head_dim=20), dict(group=17), dict(Sq=2), dict(Skv=0),
                                     dict(dtype="fp32"), dict(has_bias=True), dict(causal="top_left"),
                                     dict(batch=65536)], ids=str)
def test_what_split_decoding_does_not_take(changes):
    args = dict(dtype="fp16", head_dim=64, Sq=1, group=4, has_bias=False, causal="bottom_right", batch=8, Skv=100)
    assert ak.decode_fits(**args)
    assert not ak.decode_fits(**{**args, **changes})
