"""rope on the GPU: the custom path (kernels/rope.cu) against the float64 reference on odd shapes (B = 1,
prime S, H of 1 and 3, D of 32, 64, 80 and 128, partial rotary, packed tokens), both styles, fp16, bf16
and fp32, int32 and int64 positions, outputs poisoned; positions up to 100000; in place on the q and k
slices of a packed QKV projection; `out` a window of a KV cache; broadcast positions and an x whose last
dimension is strided (copied); a grid and block far smaller than the table's; bound calls reading new
arrays each call; refused overlaps; empty batches. Tolerances: relative L2 error fp32 1e-5, fp16/bf16
1e-2 (dtypes.TOLERANCE)."""

import importlib

import numpy as np
import pytest

import libnn
from libnn.errors import LibnnError, NoPathError
from libnn import dtypes
from libnn.ops import rope, rope_frequencies
from conftest import random_normal, rel_error

rope_module = importlib.import_module("libnn.ops.rope")  # libnn.ops.rope is the function
gpu = pytest.mark.gpu

# (x's shape, rotary_dim, positions' dtype); a 3-D shape is packed tokens (T, H, D)
SHAPES = [
    ((1, 7, 1, 32), None, np.int32),     # B = 1, S prime, one head
    ((2, 13, 3, 64), None, np.int64),
    ((3, 5, 3, 128), None, np.int32),
    ((1, 31, 1, 80), None, np.int64),    # D = 80: a row's 40 pairs leave lanes of the block idle
    ((2, 11, 3, 80), 32, np.int32),      # partial rotary: 48 elements pass through
    ((3, 2, 1, 128), 64, np.int64),
    ((37, 3, 64), None, np.int64),       # packed tokens
]


def case_id(case):
    shape, rotary_dim, position_dtype = case
    return f"{'x'.join(map(str, shape))}-R{rotary_dim or shape[-1]}-{np.dtype(position_dtype).name}"


def positions_for(rng, shape, dtype=np.int64, high=5000):
    """Each sequence at its own offset (packed tokens: one sequence)."""
    B, S = (1, shape[0]) if len(shape) == 3 else shape[:2]
    positions = (rng.integers(0, high, (B, 1)) + np.arange(S)).astype(dtype)
    return positions[0] if len(shape) == 3 else positions


def reference(x, positions, inv_freq, **kwargs):
    """The float64 oracle of x as given (already rounded to its dtype)."""
    return rope(np.asarray(x).astype(np.float64), positions, inv_freq, path="reference", **kwargs)


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("case", SHAPES, ids=case_id)
def test_custom_matches_reference(rng, case, style, dtype):
    """The poisoned output (NaN) makes an unwritten element fail (rel_error is inf on NaN); the elements
    past rotary_dim are the input's bits."""
    import cupy

    shape, rotary_dim, position_dtype = case
    R = rotary_dim or shape[-1]
    x, positions = random_normal(rng, shape, dtype), positions_for(rng, shape, position_dtype)
    inv_freq = rope_frequencies(R)
    y = rope(cupy.asarray(x), cupy.asarray(positions), cupy.asarray(inv_freq), style=style, rotary_dim=rotary_dim,
             path="custom")
    assert y.shape == x.shape and y.dtype == x.dtype
    expected = reference(x, positions, inv_freq, style=style, rotary_dim=rotary_dim)
    assert rel_error(y, expected) <= dtypes.TOLERANCE[dtype]
    bits = f"u{x.itemsize}"
    np.testing.assert_array_equal(y.get()[..., R:].view(bits), x[..., R:].view(bits))


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_positions_up_to_100000_keep_fp32_accuracy(rng, style):
    """Angles up to 10^5 radians: sincosf's full-range reduction, against cos and sin in float64 of the
    same fp32 angle, within 1e-5 in fp32 (with __sincosf this would be ~1e-2 off)."""
    import cupy

    shape = (4, 9, 3, 128)
    x = random_normal(rng, shape, "fp32")
    positions = positions_for(rng, shape, np.int64, high=100000 - 9)
    positions[0, -1] = 100000
    inv_freq = rope_frequencies(128, 500000.0)
    y = rope(cupy.asarray(x), cupy.asarray(positions), cupy.asarray(inv_freq), style=style)
    assert libnn.get_op("rope").last_decision.path == "custom"
    assert rel_error(y, reference(x, positions, inv_freq, style=style)) <= 1e-5


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_in_place_on_the_q_and_k_slices_of_a_packed_qkv_projection(rng):
    """out=q on strided views of one (B, S, (H + 2 Hkv) D) buffer: no copy, v untouched."""
    import cupy

    B, S, H, Hkv, D = 2, 7, 3, 1, 64
    host = random_normal(rng, (B, S, (H + 2 * Hkv) * D), "fp16")
    qkv = cupy.asarray(host)
    q = qkv[..., :H * D].reshape(B, S, H, D)
    k = qkv[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D)
    positions = positions_for(rng, (B, S, H, D), np.int32)
    inv_freq, freq_d = rope_frequencies(D), cupy.asarray(rope_frequencies(D))
    assert rope(q, cupy.asarray(positions), freq_d, out=q) is q
    assert rope(k, cupy.asarray(positions), freq_d, out=k) is k
    got = qkv.get()
    expected_q = reference(host[..., :H * D].reshape(B, S, H, D), positions, inv_freq)
    expected_k = reference(host[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D), positions, inv_freq)
    assert rel_error(got[..., :H * D].reshape(B, S, H, D), expected_q) <= 1e-2
    assert rel_error(got[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D), expected_k) <= 1e-2
    np.testing.assert_array_equal(got[..., (H + Hkv) * D:].view(np.uint16), host[..., (H + Hkv) * D:].view(np.uint16))


@gpu
def test_out_writes_a_window_of_a_kv_cache_and_nothing_else(rng):
    """out = cache[:, start:start + S]: sequences and positions strided apart by the cache's length."""
    import cupy

    B, S, H, D, capacity, start = 3, 5, 2, 32, 16, 6
    cache = cupy.full((B, capacity, H, D), cupy.nan, cupy.float32)
    k = random_normal(rng, (B, S, H, D), "fp32")
    positions = (start + np.arange(S) + np.zeros((B, 1), np.int64)).astype(np.int64)
    inv_freq = rope_frequencies(D)
    window = cache[:, start:start + S]
    assert rope(cupy.asarray(k), cupy.asarray(positions), cupy.asarray(inv_freq), out=window) is window
    got = cache.get()
    assert rel_error(got[:, start:start + S], reference(k, positions, inv_freq)) <= 1e-5
    assert np.isnan(got[:, :start]).all() and np.isnan(got[:, start + S:]).all()


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_broadcast_positions_and_an_x_with_a_strided_last_dimension(rng):
    """positions broadcast over the batch (a stride of 0) are read as they are; an x whose last
    dimension is strided is copied first; both match the reference."""
    import cupy

    B, S, H, D = 3, 7, 3, 64
    host = random_normal(rng, (B, S, H, 2 * D), "bf16")
    x = cupy.asarray(host)[..., ::2]
    positions = cupy.broadcast_to(cupy.arange(S, dtype=cupy.int32), (B, S))
    inv_freq = rope_frequencies(D)
    y = rope(x, positions, cupy.asarray(inv_freq), style="interleaved")
    expected = reference(host[..., ::2], np.broadcast_to(np.arange(S), (B, S)).astype(np.int32), inv_freq,
                         style="interleaved")
    assert y.flags.c_contiguous and rel_error(y, expected) <= 1e-2


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("grid,block", [((1, 1, 1), (32, 1)), ((2, 1, 2), (32, 3))])
def test_any_grid_and_block_compute_the_same(rng, grid, block):
    """The kernel strides over tokens, heads, sequences and a row's items: a single block of one warp
    (more items per row than lanes, every loop taken) gives the table's result."""
    import cupy

    shape = (3, 5, 3, 128)
    x, positions, inv_freq = (cupy.asarray(random_normal(rng, shape, "fp32")),
                              cupy.asarray(positions_for(rng, shape, np.int32)), cupy.asarray(rope_frequencies(96)))
    problem = rope_module.rope_problem(x, positions, inv_freq, "half", 96, None)
    run = rope_module.bind_custom(problem, x, positions, inv_freq, None, geometry=(grid, block))
    expected = rope(x, positions, inv_freq, rotary_dim=96, path="custom")
    np.testing.assert_array_equal(run(x, positions, inv_freq, None).get(), expected.get())


@gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_a_bound_call_reads_new_arrays_each_call(rng):
    import cupy

    op = libnn.get_op("rope")
    shape, inv_freq = (2, 5, 3, 64), rope_frequencies(64)
    freq_d = cupy.asarray(inv_freq)
    inputs = [(random_normal(rng, shape, "fp32"), positions_for(rng, shape, np.int32)) for _ in range(3)]
    outputs = []
    for i, (x, positions) in enumerate(inputs):
        outputs.append(rope(cupy.asarray(x), cupy.asarray(positions), freq_d))
        if i == 0:
            builds = op.calls.stats.builds
    assert op.calls.stats.builds == builds  # one bound call served the later two
    for (x, positions), y in zip(inputs, outputs):
        assert rel_error(y, reference(x, positions, inv_freq)) <= 1e-5


@gpu
def test_overlaps_and_strided_outputs_are_refused_and_empty_batches_launch_nothing():
    import cupy

    buffer = cupy.zeros((3, 4, 2, 8), cupy.float32)
    positions, inv_freq = cupy.zeros((2, 4), cupy.int32), cupy.asarray(rope_frequencies(8))
    with pytest.raises(ValueError, match=r"^rope: out overlaps x without being x itself"):
        rope(buffer[:2], positions, inv_freq, out=buffer[1:])
    wide = cupy.zeros((2, 4, 2, 16), cupy.float32)
    with pytest.raises(NoPathError, match=r"custom: out's last dimension is not contiguous"):
        rope(buffer[:2], positions, inv_freq, out=wide[..., ::2])
    with pytest.raises(LibnnError, match=r"^rope: all arrays must be on one device"):
        rope(buffer[:2], positions.get(), inv_freq)
    empty = rope(cupy.zeros((0, 4, 2, 8), cupy.float16), cupy.zeros((0, 4), cupy.int64), inv_freq)
    assert empty.shape == (0, 4, 2, 8) and empty.dtype == cupy.float16
