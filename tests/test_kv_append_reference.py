"""kv_append on the CPU reference path: each token's k rotated exactly as rope's reference rotates it and
its v copied, at its own position of its sequence's cache row, every other cache position untouched;
without inv_freq (learned positions, GPT-2) k copied as v is; positions out of [0, L) refused
(checked=True included: on the host the check costs nothing); and the errors bad arguments get, each naming
kv_append and the argument."""

from __future__ import annotations

import numpy as np
import pytest

from libnn.ops import kv_append, rope, rope_frequencies
from conftest import random_normal

B, S, H, D, L = 3, 5, 2, 8, 11


def arrays(rng, dtype="fp32", S=S):
    k, v = random_normal(rng, (B, S, H, D), dtype), random_normal(rng, (B, S, H, D), dtype)
    positions = (rng.integers(0, L - S, (B, 1)) + np.arange(S)).astype(np.int32)
    caches = random_normal(rng, (2, B, L, H, D), dtype)
    return k, v, positions, rope_frequencies(D), caches[0], caches[1]


def assert_only_tokens_written(k_cache, v_cache, before_k, before_v, expected_k, v, positions, row_of):
    """Token s of sequence b is in the caches at row_of(b, p) (p its position), k as `expected_k` and v as
    given; every other cache row kept its value (`before_k`, `before_v`)."""
    written = np.zeros(k_cache.shape[:2], bool)
    for b in range(positions.shape[0]):
        for s in range(positions.shape[1]):
            row = row_of(b, int(positions[b, s]))
            np.testing.assert_array_equal(k_cache[row], expected_k[b, s])
            np.testing.assert_array_equal(v_cache[row], v[b, s])
            written[row] = True
    np.testing.assert_array_equal(k_cache[~written], before_k[~written])
    np.testing.assert_array_equal(v_cache[~written], before_v[~written])


@pytest.mark.parametrize("style, rotary_dim", [("half", None), ("interleaved", None), ("half", 4)])
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_tokens_land_at_their_positions_rotated_and_nothing_else_moves(rng, style, rotary_dim, dtype):
    k, v, positions, _, k_cache, v_cache = arrays(rng, dtype)
    inv_freq = rope_frequencies(rotary_dim or D)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    assert kv_append(k, v, positions, inv_freq, k_cache, v_cache, style=style, rotary_dim=rotary_dim) is None
    rotated = rope(k, positions, inv_freq, style=style, rotary_dim=rotary_dim, path="reference")
    assert_only_tokens_written(k_cache, v_cache, before_k, before_v, rotated, v, positions, lambda b, p: (b, p))


def test_a_decode_step_writes_one_position_per_sequence_and_broadcast_positions_work(rng):
    k, v, _, inv_freq, k_cache, v_cache = arrays(rng, S=1)
    at = np.array([[0], [7], [L - 1]], np.int64)
    kv_append(k, v, at, inv_freq, k_cache, v_cache)
    for b in range(B):
        np.testing.assert_array_equal(v_cache[b, at[b, 0]], v[b, 0])
    k2, v2 = k[:, :1].repeat(4, 1), v[:, :1].repeat(4, 1)
    prefill = np.broadcast_to(np.arange(4, dtype=np.int32), (B, 4))  # what a prefill passes
    kv_append(k2, v2, prefill, inv_freq, k_cache, v_cache)
    np.testing.assert_array_equal(v_cache[:, :4], v2)


@pytest.mark.parametrize("rotary_dim", [None, 0])
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_without_inv_freq_k_is_copied_unrotated_like_v(rng, rotary_dim, dtype):
    k, v, positions, _, k_cache, v_cache = arrays(rng, dtype)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    kv_append(k, v, positions, None, k_cache, v_cache, rotary_dim=rotary_dim)
    rows = np.arange(B)[:, None]
    np.testing.assert_array_equal(k_cache[rows, positions], k)
    np.testing.assert_array_equal(v_cache[rows, positions], v)
    written = np.zeros((B, L), bool)
    written[rows, positions] = True
    np.testing.assert_array_equal(k_cache[~written], before_k[~written])
    np.testing.assert_array_equal(v_cache[~written], before_v[~written])


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("bad", [-1, L])
def test_positions_outside_the_cache_are_refused(rng, bad, checked):
    k, v, positions, inv_freq, k_cache, v_cache = arrays(rng)
    positions[1, 2] = bad
    before = k_cache.copy()
    extreme = "from -1 to" if bad < 0 else f"to {L}$"
    with pytest.raises(ValueError, match=rf"kv_append: positions must lie in \[0, {L}\).* {extreme}"):
        kv_append(k, v, positions, inv_freq, k_cache, v_cache, checked=checked)
    np.testing.assert_array_equal(k_cache, before)


def _bad(rng, **change):
    k, v, positions, inv_freq, k_cache, v_cache = arrays(rng)
    args = dict(k=k, v=v, positions=positions, inv_freq=inv_freq, k_cache=k_cache, v_cache=v_cache)
    options = {name: change.pop(name) for name in ("style", "rotary_dim", "checked") if name in change}
    args.update(change)
    return lambda: kv_append(args["k"], args["v"], args["positions"], args["inv_freq"], args["k_cache"],
                             args["v_cache"], **options)


@pytest.mark.parametrize("change, error, message", [
    (dict(k=np.zeros((B, S, H * D), np.float32)), ValueError, r"kv_append: k must be \(B, S, H, D\), got shape"),
    (dict(k=np.ones((B, S, H, D), np.int32)), TypeError, "kv_append: k must be a floating-point array"),
    (dict(v=np.ones((B, S, H, D + 1), np.float32)), ValueError, "kv_append: v must have k's shape"),
    (dict(v=np.ones((B, S, H, D), np.float64)), ValueError, "kv_append: v must have k's shape .* and dtype fp32"),
    (dict(k_cache=np.ones((B, L, H + 1, D), np.float32)), ValueError, r"kv_append: k_cache must be \(B, L, H, D\)"),
    (dict(v_cache=np.ones((B, L, H, D), np.float64)), TypeError, "kv_append: v_cache has dtype fp64 but k has fp32"),
    (dict(v_cache=np.ones((B, L + 1, H, D), np.float32)), ValueError, "k_cache and v_cache must have one shape"),
    (dict(k_cache=np.broadcast_to(np.ones((1, L, H, D), np.float32), (B, L, H, D))), ValueError,
     "kv_append: k_cache must not overlap itself"),
    (dict(positions=np.zeros((B, S), np.float32)), TypeError, "kv_append: positions must be an int32 or int64"),
    (dict(positions=np.zeros((B, S + 1), np.int32)), ValueError, r"kv_append: positions must have shape \(B, S\)"),
    (dict(inv_freq=np.ones(D // 2, np.float64)), TypeError, "kv_append: inv_freq must be a 1-D float32 array"),
    (dict(style="neox"), ValueError, "kv_append: style must be 'half'"),
    (dict(rotary_dim=3), ValueError, "kv_append: rotary_dim must be even and in \\[2, D\\] for k's head dimension"),
    (dict(inv_freq=None, rotary_dim=4), ValueError, r"kv_append: rotary_dim 4 needs inv_freq .* with inv_freq None k is "
                                                    r"written unrotated"),
    (dict(inv_freq=None, rotary_dim=False), ValueError, r"kv_append: rotary_dim False needs inv_freq"),
    (dict(checked=1), TypeError, "kv_append: checked must be True or False"),
    (dict(k="k"), TypeError, "kv_append: k must be an array"),
])
def test_bad_arguments_are_refused_naming_the_argument(rng, change, error, message):
    with pytest.raises(error, match=message):
        _bad(rng, **change)()


def test_caches_sharing_memory_are_refused(rng):
    k, v, positions, inv_freq, k_cache, _ = arrays(rng)
    with pytest.raises(ValueError, match="kv_append: k_cache and v_cache share memory"):
        kv_append(k, v, positions, inv_freq, k_cache, k_cache)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_q_comes_back_rotated_as_rope_rotates_it(rng, style):
    B, S, H, Hq, D, L = 2, 3, 2, 6, 16, 9
    q, k, v = (random_normal(rng, (B, S, h, D), "fp64") for h in (Hq, H, H))
    positions = np.array([[0, 1, 2], [4, 5, 6]], np.int64)
    inv_freq = rope_frequencies(D)
    k_cache, v_cache = np.zeros((B, L, H, D)), np.zeros((B, L, H, D))
    rotated = kv_append(k, v, positions, inv_freq, k_cache, v_cache, q=q, style=style)
    np.testing.assert_array_equal(rotated, rope(q, positions, inv_freq, style=style))
    alone_k, alone_v = np.zeros((B, L, H, D)), np.zeros((B, L, H, D))
    assert kv_append(k, v, positions, inv_freq, alone_k, alone_v, style=style) is None
    np.testing.assert_array_equal(k_cache, alone_k)
    np.testing.assert_array_equal(v_cache, alone_v)


def test_q_is_checked():
    k = np.ones((1, 2, 2, 8))
    args = (k, k, np.zeros((1, 2), np.int32), rope_frequencies(8), np.zeros((1, 4, 2, 8)), np.zeros((1, 4, 2, 8)))
    with pytest.raises(ValueError, match=r"kv_append: q must be \(B, S, Hq, D\) = \(1, 2, Hq, 8\) in k's dtype fp64"):
        kv_append(*args, q=np.ones((1, 2, 4, 4)))
    with pytest.raises(ValueError, match="kv_append: q must be"):
        kv_append(*args, q=np.ones((1, 2, 4, 8), np.float32))
    with pytest.raises(ValueError, match="kv_append: q is rotated with k; without inv_freq there is no rotation"):
        kv_append(k, k, *args[2:3], None, *args[4:], q=np.ones((1, 2, 4, 8)))
