"""kv_append on the GPU: the custom path (kernels/kv_append.cu) against the reference on odd shapes (B = 1,
prime S, one and three heads, D of 2, 64, 80 and 128, partial rotary), both styles, fp16, bf16 and fp32,
int32 and int64 positions, each sequence at its own offset; k and v as the slices of a packed QKV
projection and the caches as one layer's rows of a larger cache (strided views, no copies). The caches
are poisoned (NaN bits) first: every position a token writes must hold exactly the reference's bits
(k: the custom rope's bits, the rotation kernels/rope.cu shares, and within the dtype's tolerance of the
reference, rotated in float64; v: the reference's bits, copied), and every other position its poison. Without
inv_freq (rotary_dim 0, GPT-2's learned positions) k's bits are copied as v's. With q (GQA heads, a
slice of the projection) the same launch returns q rotated: rope's bits. Positions out of range are
refused unless checked; with checked=True an out-of-range position writes nothing (the kernel never writes
outside the caches)."""

from __future__ import annotations

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops import kv_append, rope, rope_frequencies
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

# (B, S, H, D, L, rotary_dim, positions' dtype)
SHAPES = [(1, 7, 1, 64, 29, None, np.int32), (3, 1, 3, 128, 17, None, np.int64), (2, 13, 3, 80, 41, 32, np.int32),
          (3, 5, 1, 2, 9, None, np.int64), (1, 1, 1, 64, 1, None, np.int32)]


def case_id(case):
    B, S, H, D, L, R, p = case
    return f"B{B}-S{S}-H{H}-D{D}-L{L}-R{R or D}-{np.dtype(p).name}"


def poisoned(shape, dtype):
    """NaN in every element, as bits (CuPy has no bf16 arithmetic)."""
    import cupy
    bits = {2: (cupy.uint16, 0x7FFF), 4: (cupy.uint32, 0x7FFFFFFF)}[dtypes.parse(dtype).itemsize]
    return cupy.full(shape, bits[1], bits[0]).view(dtypes.parse(dtype))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("case", SHAPES, ids=case_id)
def test_custom_writes_the_references_bits_and_nothing_else(rng, case, style, dtype):
    import cupy

    B, S, H, D, L, R, position_dtype = case
    qkv = random_normal(rng, (B, S, 3 * H, D), dtype)           # q, k, v heads of one projection
    positions = (rng.integers(0, L - S + 1, (B, 1)) + np.arange(S)).astype(position_dtype)
    inv_freq = rope_frequencies(R or D)
    layers = poisoned((2, B, L, H, D), dtype)                   # two layers: write the second's rows
    v_layers = poisoned((2, B, L, H, D), dtype)
    gq = cupy.asarray(qkv)
    kv_append(gq[:, :, H:2 * H], gq[:, :, 2 * H:], cupy.asarray(positions), cupy.asarray(inv_freq), layers[1],
              v_layers[1], style=style, rotary_dim=R)
    assert libnn.get_op("kv_append").last_decision.path == "custom"
    untouched = poisoned((B, L, H, D), dtype).get()
    expected_k, expected_v = untouched.copy(), untouched.copy()
    kv_append(qkv[:, :, H:2 * H], qkv[:, :, 2 * H:], positions, inv_freq, expected_k, expected_v, style=style,
              rotary_dim=R)
    bits = f"u{dtypes.parse(dtype).itemsize}"
    got_k, got_v = layers[1].get(), v_layers[1].get()
    np.testing.assert_array_equal(got_v.view(bits), expected_v.view(bits))      # v: copied, and only there
    written = np.zeros((B, L), bool)
    rows = np.arange(B)[:, None]
    written[rows, positions] = True
    np.testing.assert_array_equal(got_k.view(bits)[~written], untouched.view(bits)[~written])
    custom = rope(gq[:, :, H:2 * H], cupy.asarray(positions), cupy.asarray(inv_freq), style=style, rotary_dim=R)
    np.testing.assert_array_equal(got_k.view(bits)[rows, positions], custom.get().view(bits))  # rope.cu's rotation
    assert rel_error(got_k[rows, positions], expected_k[rows, positions]) <= dtypes.TOLERANCE[dtype]
    for layer in (layers[0], v_layers[0]):  # the other layer's rows: untouched
        np.testing.assert_array_equal(layer.get().view(bits), untouched.view(bits))

@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("case", SHAPES, ids=case_id)
def test_q_rotated_in_the_same_launch_is_ropes(rng, case, style, dtype):
    """q (4 heads per KV head, GQA, as the QKV projection's slice) rotated by the launch that writes k:
    rope's own bits on the GPU, the float64 reference within the dtype's tolerance; the caches as without q."""
    import cupy

    B, S, H, D, L, R, position_dtype = case
    Hq = 4 * H
    qkv = random_normal(rng, (B, S, Hq + 2 * H, D), dtype)
    positions = (rng.integers(0, L - S + 1, (B, 1)) + np.arange(S)).astype(position_dtype)
    inv_freq = rope_frequencies(R or D)
    gq, gp, gf = cupy.asarray(qkv), cupy.asarray(positions), cupy.asarray(inv_freq)
    k_cache, v_cache = poisoned((B, L, H, D), dtype), poisoned((B, L, H, D), dtype)
    q, k, v = gq[:, :, :Hq], gq[:, :, Hq:Hq + H], gq[:, :, Hq + H:]
    rotated = kv_append(k, v, gp, gf, k_cache, v_cache, q=q, style=style, rotary_dim=R)
    assert rotated.shape == (B, S, Hq, D) and rotated.dtype == q.dtype
    bits = f"u{dtypes.parse(dtype).itemsize}"
    own = rope(q, gp, gf, style=style, rotary_dim=R)
    np.testing.assert_array_equal(rotated.get().view(bits), own.get().view(bits))
    expected_q = rope(qkv[:, :, :Hq].astype(np.float64), positions, inv_freq, style=style, rotary_dim=R)
    assert rel_error(rotated, expected_q) <= dtypes.TOLERANCE[dtype]
    rows = np.arange(B)[:, None]
    k_alone, v_alone = poisoned((B, L, H, D), dtype), poisoned((B, L, H, D), dtype)
    assert kv_append(k, v, gp, gf, k_alone, v_alone, style=style, rotary_dim=R) is None
    np.testing.assert_array_equal(k_cache.get().view(bits), k_alone.get().view(bits))
    np.testing.assert_array_equal(v_cache.get()[rows, positions].view(bits), v_alone.get()[rows, positions].view(bits))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("case", SHAPES, ids=case_id)
def test_custom_without_inv_freq_copies_k_and_v_bits_and_nothing_else(rng, case, dtype):
    """inv_freq None: a null pointer the kernel never reads (rotary_dim 0); k and v as views of one packed
    projection, the caches one layer's rows of two."""
    import cupy

    B, S, H, D, L, _, position_dtype = case
    qkv = random_normal(rng, (B, S, 3 * H, D), dtype)
    positions = (rng.integers(0, L - S + 1, (B, 1)) + np.arange(S)).astype(position_dtype)
    k_layers, v_layers = poisoned((2, B, L, H, D), dtype), poisoned((2, B, L, H, D), dtype)
    gq = cupy.asarray(qkv)
    kv_append(gq[:, :, H:2 * H], gq[:, :, 2 * H:], cupy.asarray(positions), None, k_layers[1], v_layers[1])
    assert libnn.get_op("kv_append").last_decision.path == "custom"
    bits = f"u{dtypes.parse(dtype).itemsize}"
    untouched = poisoned((B, L, H, D), dtype).get().view(bits)
    rows = np.arange(B)[:, None]
    written = np.zeros((B, L), bool)
    written[rows, positions] = True
    for layers, source in ((k_layers, qkv[:, :, H:2 * H]), (v_layers, qkv[:, :, 2 * H:])):
        got = layers[1].get().view(bits)
        np.testing.assert_array_equal(got[rows, positions], source.view(bits))
        np.testing.assert_array_equal(got[~written], untouched[~written])
        np.testing.assert_array_equal(layers[0].get().view(bits), untouched)


def test_positions_out_of_range_are_refused_or_with_checked_write_nothing(rng):
    import cupy

    B, S, H, D, L = 2, 3, 2, 64, 8
    k, v = (cupy.asarray(random_normal(rng, (B, S, H, D), "fp16")) for _ in range(2))
    inv_freq = cupy.asarray(rope_frequencies(D))
    positions = cupy.asarray(np.array([[0, 1, 2], [6, 7, 8]], np.int32))
    k_cache, v_cache = poisoned((B, L, H, D), "fp16"), poisoned((B, L, H, D), "fp16")
    with pytest.raises(ValueError, match=r"kv_append: positions must lie in \[0, 8\).*from 0 to 8"):
        kv_append(k, v, positions, inv_freq, k_cache, v_cache)
    assert cupy.isnan(k_cache).all()
    kv_append(k, v, positions, inv_freq, k_cache, v_cache, checked=True)
    written = ~cupy.isnan(v_cache).any(axis=(2, 3)).get()
    expected = np.zeros((B, L), bool)
    expected[0, :3] = expected[1, 6:8] = True
    np.testing.assert_array_equal(written, expected)


def test_a_bound_call_reads_new_arrays_each_call(rng):
    import cupy

    B, S, H, D, L = 2, 1, 2, 64, 6
    inv_freq = cupy.asarray(rope_frequencies(D))
    for step in range(3):
        k, v = (cupy.asarray(random_normal(rng, (B, S, H, D), "fp32")) for _ in range(2))
        k_cache, v_cache = poisoned((B, L, H, D), "fp32"), poisoned((B, L, H, D), "fp32")
        at = cupy.asarray(np.array([[step], [step + 2]], np.int32))
        kv_append(k, v, at, inv_freq, k_cache, v_cache)
        cupy.testing.assert_array_equal(v_cache[0, step], v[0, 0])
        cupy.testing.assert_array_equal(v_cache[1, step + 2], v[1, 0])


def test_caches_sharing_memory_are_refused_at_every_call(rng):
    import cupy

    B, S, H, D, L = 2, 1, 2, 64, 6
    k, v = (cupy.asarray(random_normal(rng, (B, S, H, D), "fp16")) for _ in range(2))
    inv_freq, at = cupy.asarray(rope_frequencies(D)), cupy.zeros((B, S), cupy.int32)
    kv_append(k, v, at, inv_freq, poisoned((B, L, H, D), "fp16"), poisoned((B, L, H, D), "fp16"))
    one = poisoned((B, L, H, D), "fp16")
    with pytest.raises(ValueError, match="kv_append: k_cache and v_cache share memory"):
        kv_append(k, v, at, inv_freq, one, one)  # the same signature: the bound call checks the pointers
