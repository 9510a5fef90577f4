"""rope on the CPU: the reference against an element-by-element formula, against Hugging Face's
apply_rotary_pos_emb (LLaMA, GPT-NeoX's partial rotary) and GPT-J's rotate_every_two written out in
NumPy here, and Meta's complex multiplication; positions at a different offset per sequence, decode
steps against a prefill, packed tokens; `out=` and in place; rope_frequencies (default, linear,
llama3 against hand-computed values, and transformers itself where it is installed); the errors bad
input gets; the custom path's launch geometry and its kernels' parameters (compiled to PTX by NVRTC,
no GPU)."""

import importlib
import math

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops import rope, rope_frequencies
from conftest import random_normal, rel_error

rope_module = importlib.import_module("libnn.ops.rope")  # libnn.ops.rope is the function


def positions_at(rng, B, S, high=5000, dtype=np.int64):
    """Each sequence at its own random offset: offset_b + 0 .. S - 1."""
    return (rng.integers(0, high, (B, 1)) + np.arange(S)).astype(dtype)


def naive(x, positions, inv_freq, style, rotary_dim):
    """Element by element in float64, with math.cos and math.sin of the fp32 angle (the op's angle:
    float32(position) * inv_freq, one fp32 rounding)."""
    x = np.asarray(x, np.float64)
    y = x.copy()
    half = rotary_dim // 2
    lead = x.shape[:-2]
    for index in np.ndindex(*lead):
        for h in range(x.shape[-2]):
            for i in range(half):
                angle = float(np.float32(positions[index]) * np.float32(inv_freq[i]))
                j0, j1 = (i, i + half) if style == "half" else (2 * i, 2 * i + 1)
                a, b = x[index + (h, j0)], x[index + (h, j1)]
                y[index + (h, j0)] = a * math.cos(angle) - b * math.sin(angle)
                y[index + (h, j1)] = b * math.cos(angle) + a * math.sin(angle)
    return y


# Hugging Face's LLaMA rotary embedding, written out in NumPy (float64 after the fp32 angle):
# LlamaRotaryEmbedding.forward and modeling_llama.rotate_half / apply_rotary_pos_emb
def hf_cos_sin(inv_freq, position_ids):
    inv_freq_expanded = inv_freq[None, :, None].astype(np.float32)                 # (1, half, 1)
    position_ids_expanded = position_ids[:, None, :].astype(np.float32)            # (B, 1, S)
    freqs = (inv_freq_expanded * position_ids_expanded).transpose(0, 2, 1)         # (B, S, half), fp32
    emb = np.concatenate((freqs, freqs), axis=-1).astype(np.float64)
    return np.cos(emb), np.sin(emb)


def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return np.concatenate((-x2, x1), axis=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = np.expand_dims(cos, unsqueeze_dim)
    sin = np.expand_dims(sin, unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


# GPT-J's (modeling_gptj): sin and cos repeated per pair, rotate_every_two
def gptj_rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return np.stack((-x2, x1), axis=-1).reshape(x.shape)


def gptj_apply_rotary_pos_emb(tensor, sin, cos):
    sin = np.repeat(sin[:, :, None, :], 2, axis=-1)
    cos = np.repeat(cos[:, :, None, :], 2, axis=-1)
    return (tensor * cos) + (gptj_rotate_every_two(tensor) * sin)


# --- the reference against independent formulas -----------------------------------------------------------
CASES = [  # (x's shape, rotary_dim)
    ((1, 1, 1, 2), None), ((2, 5, 3, 8), None), ((3, 4, 1, 10), None), ((2, 3, 2, 12), 8),
    ((7, 3, 6), None), ((5, 2, 9), 4),
]


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("shape,rotary_dim", CASES, ids=lambda v: str(v))
def test_reference_matches_the_element_by_element_formula(rng, shape, rotary_dim, style):
    R = rotary_dim or shape[-1]
    x = random_normal(rng, shape, "fp64")
    positions = positions_at(rng, 1, shape[0])[0] if len(shape) == 3 else positions_at(rng, *shape[:2])
    inv_freq = rope_frequencies(R)
    y = rope(x, positions, inv_freq, style=style, rotary_dim=rotary_dim)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, naive(x, positions, inv_freq, style, R)) <= 1e-13
    assert libnn.get_op("rope").last_decision.path == "reference"


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_half_style_is_hugging_faces_apply_rotary_pos_emb(rng, theta):
    """q and k (B, S, H, D) against HF's LLaMA code (which takes (B, H, S, D), cos/sin unsqueezed at
    dim 1), with every sequence at its own offset."""
    B, S, H, Hkv, D = 3, 7, 4, 2, 64
    q, k = random_normal(rng, (B, S, H, D), "fp64"), random_normal(rng, (B, S, Hkv, D), "fp64")
    positions = positions_at(rng, B, S)
    inv_freq = rope_frequencies(D, theta)
    cos, sin = hf_cos_sin(inv_freq, positions)
    q_hf, k_hf = hf_apply_rotary_pos_emb(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), cos, sin)
    assert rel_error(rope(q, positions, inv_freq), q_hf.transpose(0, 2, 1, 3)) <= 1e-14
    assert rel_error(rope(k, positions, inv_freq), k_hf.transpose(0, 2, 1, 3)) <= 1e-14


def test_partial_rotary_is_gpt_neox_s(rng):
    """GPT-NeoX: rotate_half on q[..., :rotary_ndims], the rest concatenated back unchanged."""
    B, S, H, D, R = 2, 5, 3, 80, 20
    q = random_normal(rng, (B, S, H, D), "fp64")
    positions = positions_at(rng, B, S)
    inv_freq = rope_frequencies(R)
    cos, sin = hf_cos_sin(inv_freq, positions)
    q_rot, _ = hf_apply_rotary_pos_emb(q[..., :R], q[..., :R], cos, sin, unsqueeze_dim=2)  # (B, S, H, D) layout
    expected = np.concatenate((q_rot, q[..., R:]), axis=-1)
    y = rope(q, positions, inv_freq, rotary_dim=R)
    assert rel_error(y, expected) <= 1e-14
    np.testing.assert_array_equal(y[..., R:], q[..., R:])


def test_interleaved_style_is_gpt_j_s_and_meta_s_complex_multiplication(rng):
    B, S, H, D, R = 2, 6, 3, 16, 16
    x = random_normal(rng, (B, S, H, D), "fp64")
    positions = positions_at(rng, B, S)
    inv_freq = rope_frequencies(R)
    angle = (positions.astype(np.float32)[..., None] * inv_freq).astype(np.float64)   # (B, S, R / 2)
    y = rope(x, positions, inv_freq, style="interleaved")
    assert rel_error(y, gptj_apply_rotary_pos_emb(x, np.sin(angle), np.cos(angle))) <= 1e-14
    # Meta's apply_rotary_emb: pairs as complex numbers times exp(i angle)
    pairs = x.reshape(B, S, H, R // 2, 2)
    rotated = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angle)[:, :, None, :]
    assert rel_error(y, np.stack((rotated.real, rotated.imag), axis=-1).reshape(x.shape)) <= 1e-14


def test_the_styles_differ_by_a_permutation_of_the_head_dimension(rng):
    """interleaved(x) = P half(P^-1 x) with P placing element i at 2i and i + R/2 at 2i + 1."""
    x = random_normal(rng, (2, 3, 2, 12), "fp64")
    positions = positions_at(rng, 2, 3)
    inv_freq = rope_frequencies(12)
    order = np.stack((np.arange(6), np.arange(6) + 6), axis=-1).reshape(-1)  # half's index at each interleaved place
    inverse = np.argsort(order)
    np.testing.assert_allclose(rope(x, positions, inv_freq, style="interleaved"),
                               rope(x[..., inverse], positions, inv_freq)[..., order], rtol=0, atol=1e-14)
    assert not np.allclose(rope(x, positions, inv_freq, style="interleaved"), rope(x, positions, inv_freq))


def test_a_decode_step_at_each_sequences_own_position_is_that_row_of_the_prefill(rng):
    """Sequences of one batch at different lengths: token s of a prefill from 0 equals the same token
    fed alone at position s, each sequence with its own s (what a decode step passes)."""
    B, S, H, D = 4, 9, 2, 32
    x = random_normal(rng, (B, S, H, D), "fp32")
    inv_freq = rope_frequencies(D, 500000.0)
    prefill = rope(x, np.broadcast_to(np.arange(S), (B, S)), inv_freq)
    lengths = rng.integers(0, S, B)  # sequence b decodes its token at position lengths[b]
    step = x[np.arange(B), lengths][:, None]                            # (B, 1, H, D)
    decoded = rope(step, lengths[:, None].astype(np.int32), inv_freq)
    np.testing.assert_array_equal(decoded[:, 0], prefill[np.arange(B), lengths])


def test_packed_tokens_are_the_batch_s_tokens_one_after_another(rng):
    B, S, H, D = 3, 5, 2, 16
    x = random_normal(rng, (B, S, H, D), "fp32")
    positions = positions_at(rng, B, S, dtype=np.int32)
    inv_freq = rope_frequencies(D)
    for style in ("half", "interleaved"):
        packed = rope(x.reshape(B * S, H, D), positions.reshape(-1), inv_freq, style=style)
        np.testing.assert_array_equal(packed, rope(x, positions, inv_freq, style=style).reshape(B * S, H, D))


def test_int32_and_int64_positions_agree_and_large_ones_round_to_fp32_as_documented(rng):
    x = random_normal(rng, (2, 3, 2, 8), "fp32")
    inv_freq = rope_frequencies(8)
    positions = positions_at(rng, 2, 3, high=100000)
    np.testing.assert_array_equal(rope(x, positions.astype(np.int32), inv_freq), rope(x, positions, inv_freq))
    # 2^24 + 1 is the first integer fp32 cannot hold: it rotates as 2^24 does (so does Hugging Face's)
    at = (lambda p: rope(x, np.full((2, 3), p, np.int64), inv_freq))
    np.testing.assert_array_equal(at(2**24 + 1), at(2**24))
    assert not np.array_equal(at(2**24 - 1), at(2**24))


def test_position_zero_is_the_identity_and_negative_positions_rotate_back(rng):
    x = random_normal(rng, (1, 4, 3, 10), "fp64")
    inv_freq = rope_frequencies(10)
    np.testing.assert_array_equal(rope(x, np.zeros((1, 4), np.int32), inv_freq), x)
    p = positions_at(rng, 1, 4)
    back = rope(rope(x, p, inv_freq, style="interleaved"), -p, inv_freq, style="interleaved")
    assert rel_error(back, x) <= 1e-14


@pytest.mark.parametrize("dtype", ["fp32", "fp16"] + (["bf16"] if dtypes.bfloat16 is not None else []))
def test_reference_rounds_once_to_the_input_dtype_and_passes_the_rest_through_bitwise(rng, dtype):
    x = random_normal(rng, (2, 5, 3, 24), dtype)
    x[0, 0, 0, 20] = np.nan  # past rotary_dim: passes through as it is
    positions, inv_freq = positions_at(rng, 2, 5), rope_frequencies(16)
    y = rope(x, positions, inv_freq, rotary_dim=16)
    assert y.dtype == x.dtype
    expected = rope(x.astype(np.float64), positions, inv_freq, rotary_dim=16).astype(x.dtype)
    np.testing.assert_array_equal(y.astype(np.float64), expected.astype(np.float64))  # NaN where it was
    np.testing.assert_array_equal(y[..., 16:].view(f"u{y.itemsize}"), x[..., 16:].view(f"u{x.itemsize}"))


def test_empty_batches_give_empty_outputs():
    inv_freq = rope_frequencies(8)
    assert rope(np.ones((0, 3, 2, 8), np.float32), np.zeros((0, 3), np.int32), inv_freq).shape == (0, 3, 2, 8)
    assert rope(np.ones((0, 2, 8), np.float32), np.zeros(0, np.int64), inv_freq).shape == (0, 2, 8)


def test_bound_calls_read_the_arrays_of_each_call(rng):
    op = libnn.get_op("rope")
    inv_freq = rope_frequencies(8)
    x1, x2 = random_normal(rng, (2, 3, 2, 8), "fp32"), random_normal(rng, (2, 3, 2, 8), "fp32")
    p1, p2 = positions_at(rng, 2, 3), positions_at(rng, 2, 3)
    y1 = rope(x1, p1, inv_freq)
    builds = op.calls.stats.builds
    y2 = rope(x2, p2, inv_freq)
    assert op.calls.stats.builds == builds  # the same signature: the bound call ran
    np.testing.assert_array_equal(y2, naive(x2, p2, inv_freq, "half", 8).astype(np.float32))
    np.testing.assert_array_equal(rope(x1, p1, inv_freq), y1)


# --- out= and in place ----------------------------------------------------------------------------------
def test_out_receives_the_result_and_out_x_rotates_in_place(rng):
    x = random_normal(rng, (2, 4, 3, 16), "fp32")
    positions, inv_freq = positions_at(rng, 2, 4), rope_frequencies(16)
    expected = rope(x, positions, inv_freq, style="interleaved")
    out = np.full_like(x, np.nan)
    assert rope(x, positions, inv_freq, style="interleaved", out=out) is out
    np.testing.assert_array_equal(out, expected)
    x_before = x.copy()
    assert rope(x, positions, inv_freq, style="interleaved", out=x) is x
    np.testing.assert_array_equal(x, expected)
    assert not np.array_equal(x, x_before)


def test_in_place_on_the_q_slice_of_a_packed_qkv_projection(rng):
    """q and k as strided views of one (B, S, (H + 2 Hkv) D) projection output, rotated in place."""
    B, S, H, Hkv, D = 2, 5, 4, 2, 8
    qkv = random_normal(rng, (B, S, (H + 2 * Hkv) * D), "fp32")
    q = qkv[..., :H * D].reshape(B, S, H, D)
    k = qkv[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D)
    v_before = qkv[..., (H + Hkv) * D:].copy()
    positions, inv_freq = positions_at(rng, B, S), rope_frequencies(D)
    expected_q, expected_k = rope(q.copy(), positions, inv_freq), rope(k.copy(), positions, inv_freq)
    rope(q, positions, inv_freq, out=q)
    rope(k, positions, inv_freq, out=k)
    np.testing.assert_array_equal(qkv[..., :H * D].reshape(B, S, H, D), expected_q)
    np.testing.assert_array_equal(qkv[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D), expected_k)
    np.testing.assert_array_equal(qkv[..., (H + Hkv) * D:], v_before)


def test_out_that_overlaps_x_without_being_it_is_refused(rng):
    buffer = random_normal(rng, (3, 4, 2, 8), "fp32")
    x, out = buffer[:2], buffer[1:]  # out starts one sequence into x
    with pytest.raises(ValueError, match=r"^rope: out overlaps x without being x itself"):
        rope(x, np.zeros((2, 4), np.int32), rope_frequencies(8), out=out)
    with pytest.raises(ValueError, match=r"^rope: out overlaps x"):  # same pointer, other strides
        rope(buffer[:, :2], np.zeros((3, 2), np.int32), rope_frequencies(8),
             out=buffer[:, ::2])


def test_the_overlap_check_of_disjoint_neighbours_and_of_reversed_views():
    a = np.zeros((4, 3, 2, 8), np.float32)
    check = rope_module.overlap_check(a[:2], a[2:])
    base = a.ctypes.data
    check(base, base + a[2:].ctypes.data - base)           # neighbours: no shared byte
    check(base, base)                                       # the same array: in place
    with pytest.raises(ValueError):
        check(base, base + 4)
    reversed_view = a[::-1]
    assert rope_module.overlap_check(reversed_view, reversed_view.copy()) is not None
    with pytest.raises(ValueError):  # a[::-1] as out of a: the same bytes, other strides
        rope_module.overlap_check(a, reversed_view)(a.ctypes.data, reversed_view.ctypes.data)
    assert rope_module.overlap_check(a[:0], a) is None and rope_module.overlap_check(a, None) is None


def test_an_out_that_overlaps_itself_is_refused():
    x = np.ones((2, 3, 2, 8), np.float32)
    out = np.broadcast_to(np.zeros((1, 3, 2, 8), np.float32), x.shape)
    with pytest.raises(ValueError, match=r"^rope: out must not overlap itself \(a broadcast view\)"):
        rope(x, np.zeros((2, 3), np.int32), rope_frequencies(8), out=out)
    assert rope_module.overlaps_itself((2, 3), (4, 4), 4)        # element (1, 0) is element (0, 1)
    assert rope_module.overlaps_itself((2, 3), (0, 4), 4)        # a broadcast row
    assert not rope_module.overlaps_itself((2, 3), (12, 4), 4)   # contiguous
    assert not rope_module.overlaps_itself((2, 3), (4, 8), 4)    # transposed
    assert not rope_module.overlaps_itself((3, 2), (-8, 4), 4)   # reversed rows
    assert not rope_module.overlaps_itself((1, 3), (0, 4), 4)    # a stride of a dimension of 1 is never taken


# --- rope_frequencies -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,theta", [(2, 10000.0), (64, 10000.0), (128, 500000.0), (80, 10000.0)])
def test_default_frequencies_are_theta_to_the_minus_2i_over_dim(dim, theta):
    inv_freq = rope_frequencies(dim, theta)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (dim // 2,)
    exact = np.array([theta ** (-2 * i / dim) for i in range(dim // 2)])
    # fp32 rounding of the exponent, of the power and of the reciprocal: within a few ulps
    np.testing.assert_allclose(inv_freq, exact, rtol=4 * 2**-23 * max(1, math.log(theta)), atol=0)


def test_linear_scaling_divides_every_frequency_by_its_factor():
    base = rope_frequencies(64, 10000.0)
    for key in ("rope_type", "type"):  # older configs name it "type"
        scaled = rope_frequencies(64, 10000.0, {key: "linear", "factor": 4.0})
        np.testing.assert_array_equal(scaled, base / np.float32(4.0))
    np.testing.assert_array_equal(rope_frequencies(64, 10000.0, {"rope_type": "default"}), base)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_llama3_frequencies_against_values_computed_by_hand():
    """rotary_dim 16, theta 10^4: inv_freq_i = 10^(-i/2), wavelength 2 pi 10^(i/2). With Llama 3.1's
    factors the wavelengths below 8192 / 4 = 2048 (i <= 5) are kept, 2 pi 10^3 = 6283.2 (i = 6) lies
    between 2048 and 8192 and is blended with smooth = (8192 / 6283.2 - 1) / (4 - 1), and 2 pi 10^3.5 =
    19869 (i = 7) is above 8192: divided by 8."""
    inv_freq = rope_frequencies(16, 10000.0, LLAMA3)
    base = [10000.0 ** (-i / 8) for i in range(8)]
    smooth = (8192 / (2 * math.pi * 1000.0) - 1) / 3
    assert 0.1012 < smooth < 0.1013
    expected = base[:6] + [(1 - smooth) * 1e-3 / 8 + smooth * 1e-3, base[7] / 8]
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-6, atol=0)
    assert inv_freq.dtype == np.float32
    # the regimes, without the formula: kept, blended strictly between kept and divided, divided
    plain = rope_frequencies(16, 10000.0)
    np.testing.assert_array_equal(inv_freq[:6], plain[:6])
    assert plain[6] / 8 < inv_freq[6] < plain[6]
    np.testing.assert_array_equal(inv_freq[7], plain[7] / np.float32(8))


def test_llama3_with_llama_3_2_s_settings_keeps_the_high_frequencies_and_divides_the_low_ones():
    config = {**LLAMA3, "factor": 32.0}
    inv_freq, plain = rope_frequencies(64, 500000.0, config), rope_frequencies(64, 500000.0)
    wavelength = 2 * math.pi / plain.astype(np.float64)
    np.testing.assert_array_equal(inv_freq[wavelength < 2048], plain[wavelength < 2048])
    np.testing.assert_array_equal(inv_freq[wavelength > 8192], plain[wavelength > 8192] / np.float32(32))
    medium = (wavelength >= 2048) & (wavelength <= 8192)
    assert medium.any() and np.all(inv_freq[medium] < plain[medium]) and np.all(inv_freq[medium] > plain[medium] / 32)


def test_frequencies_and_rotation_match_transformers_where_it_is_installed(rng):
    """inv_freq within 2 ulp of LlamaRotaryEmbedding's (torch's float32 pow and NumPy's may round apart:
    2 ulp seen on the H100 image, torch 2.11 and transformers 5; every other step is the same float32
    operation in the same order), and rope in fp32
    within 1e-6 of apply_rotary_pos_emb with that module's cos and sin (fp32 there, float64 here)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, S, H, D = 2, 7, 3, 64
    for theta, scaling in ((10000.0, None), (500000.0, LLAMA3), (10000.0, {"rope_type": "linear", "factor": 2.0})):
        config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, rope_theta=theta, rope_scaling=scaling,
                             max_position_embeddings=131072)
        module = LlamaRotaryEmbedding(config=config)
        inv_freq = rope_frequencies(D, theta, scaling)
        np.testing.assert_array_max_ulp(inv_freq, module.inv_freq.float().numpy(), maxulp=2)
        q = random_normal(rng, (B, S, H, D), "fp32")
        positions = positions_at(rng, B, S, high=20000)
        cos, sin = module(torch.from_numpy(q), torch.from_numpy(positions))
        q_hf, _ = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin, unsqueeze_dim=2)
        assert rel_error(rope(q, positions, module.inv_freq.float().numpy()), q_hf.numpy()) <= 1e-6


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "yarn", "factor": 4.0}, r"rope_scaling type 'yarn' is not supported \(supported: 'default', "
                                           r"'linear', 'llama3'\)"),
    ({"type": "dynamic", "factor": 2.0}, r"rope_scaling type 'dynamic' is not supported"),
    ({"factor": 2.0}, r"rope_scaling type None is not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     r"rope_scaling of type 'llama3' needs factor, low_freq_factor, high_freq_factor, "
     r"original_max_position_embeddings; missing high_freq_factor, original_max_position_embeddings"),
    ({**LLAMA3, "high_freq_factor": 1.0},
     r"rope_scaling's high_freq_factor \(1\) must be greater than its low_freq_factor \(1\)"),
    ({"rope_type": "linear", "factor": 0}, r"rope_scaling's factor must be a finite number > 0, got 0"),
    ({**LLAMA3, "original_max_position_embeddings": None},
     r"rope_scaling's original_max_position_embeddings must be a finite number > 0, got None"),
])
def test_unsupported_or_incomplete_scaling_is_refused_by_name(scaling, message):
    with pytest.raises(ValueError, match=r"^rope_frequencies: " + message):
        rope_frequencies(64, 10000.0, scaling)


def test_bad_frequency_arguments_are_refused():
    for dim in (0, 3, 2.0, True, None):
        with pytest.raises(ValueError, match=r"^rope_frequencies: rotary_dim must be an even int >= 2"):
            rope_frequencies(dim)
    for theta in (0.0, -1.0, float("inf"), "10000"):
        with pytest.raises(ValueError, match=r"^rope_frequencies: theta must be a finite number > 0"):
            rope_frequencies(64, theta)
    with pytest.raises(TypeError, match=r"^rope_frequencies: scaling must be None or a rope_scaling dict"):
        rope_frequencies(64, 10000.0, "llama3")


# --- bad input to rope ----------------------------------------------------------------------------------------
X, P, F = np.ones((2, 3, 4, 8), np.float32), np.zeros((2, 3), np.int32), rope_frequencies(8)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(x=np.ones((3, 8), np.float32)), ValueError,
     r"x must be \(B, S, H, D\) or packed tokens \(T, H, D\), got shape \(3, 8\)"),
    (dict(x=np.ones((2, 3, 4, 8), np.int32)), TypeError, r"x must be a floating-point array"),
    (dict(positions=np.zeros((2, 3), np.float32)), TypeError,
     r"positions must be an int32 or int64 array, got dtype float32"),
    (dict(positions=np.zeros((2, 3), np.uint32)), TypeError, r"positions must be an int32 or int64 array"),
    (dict(positions=np.zeros((3,), np.int32)), ValueError,
     r"positions must have shape \(2, 3\), \(B, S\) for x \(B, S, H, D\) of shape \(2, 3, 4, 8\); got \(3,\)"),
    (dict(x=np.ones((6, 4, 8), np.float32), positions=P), ValueError,
     r"positions must have shape \(6,\), \(T,\) for packed tokens x \(T, H, D\) of shape \(6, 4, 8\); got \(2, 3\)"),
    (dict(inv_freq=F.astype(np.float64)), TypeError, r"inv_freq must be a 1-D float32 array .* got a 1-D fp64 array"),
    (dict(inv_freq=F[None]), TypeError, r"inv_freq must be a 1-D float32 array"),
    (dict(inv_freq=rope_frequencies(4)), ValueError,
     r"inv_freq must have rotary_dim / 2 = 4 frequencies \(rotary_dim 8\), got shape \(2,\) "
     r"\(for partial rotary, pass rotary_dim=4\)"),
    (dict(inv_freq=rope_frequencies(4), rotary_dim=6), ValueError,
     r"inv_freq must have rotary_dim / 2 = 3 frequencies \(rotary_dim 6\), got shape \(2,\)$"),
    (dict(style="neox"), ValueError, r"style must be 'half' \(Hugging Face LLaMA / GPT-NeoX\) or 'interleaved'"),
    (dict(style=None), ValueError, r"style must be 'half'"),
    (dict(rotary_dim=5), ValueError, r"rotary_dim must be even and in \[2, D\] for x's head dimension D = 8, got 5"),
    (dict(rotary_dim=10), ValueError, r"rotary_dim must be even and in \[2, D\] .* got 10"),
    (dict(rotary_dim=0), ValueError, r"rotary_dim must be even and in \[2, D\]"),
    (dict(rotary_dim=4.0), TypeError, r"rotary_dim must be an int or None, got float 4.0"),
    (dict(rotary_dim=True), TypeError, r"rotary_dim must be an int or None, got bool True"),
    (dict(x=np.ones((2, 3, 4, 7), np.float32), inv_freq=rope_frequencies(6)), ValueError,
     r"rotary_dim defaults to x's head dimension D = 7, which is odd; pass an even rotary_dim in \[2, D\]"),
    (dict(x=np.ones((2, 3, 4, 0), np.float32), inv_freq=np.zeros(0, np.float32)), ValueError,
     r"rotary_dim defaults to x's head dimension D = 0, which is below 2"),
    (dict(out=np.ones((2, 3, 4, 9), np.float32)), ValueError, r"out must have x's shape \(2, 3, 4, 8\), got"),
    (dict(out=np.ones((2, 3, 4, 8), np.float16)), TypeError, r"out has dtype fp16 but x has fp32"),
    (dict(x=[1.0]), TypeError, r"x must be an array"),
])
def test_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(x=X, positions=P, inv_freq=F)
    args.update(kwargs)
    x, positions, inv_freq = args.pop("x"), args.pop("positions"), args.pop("inv_freq")
    with pytest.raises(error, match=r"^rope: " + message):
        rope(x, positions, inv_freq, **args)


def test_forced_gpu_path_on_host_arrays_and_unknown_paths_are_refused():
    with pytest.raises(TypeError, match=r"^rope: path 'custom' runs on the GPU, but the arrays are host"):
        rope(X, P, F, path="custom")
    with pytest.raises(ValueError, match=r"^rope: unknown path 'cudnn'; expected 'auto' or one of "
                                         r"\['custom', 'reference'\]"):
        rope(X, P, F, path="cudnn")


def test_reference_refuses_what_would_not_fit_before_allocating():
    x = np.broadcast_to(np.float32(1.5), (2**16, 2**10, 2**10, 128))  # a view: 32 TiB as float32
    positions = np.broadcast_to(np.int32(0), (2**16, 2**10))
    with pytest.raises(MemoryError, match=r"^rope: x of shape \(65536, 1024, 1024, 128\) in float64 \(a copy and "
                                          r"2 temporaries of its size\) needs"):
        rope(x, positions, rope_frequencies(128))


# --- the custom path, without a GPU: launch geometry and the kernels' parameters -------------------------------
def problem_of(B=2, S=5, H=3, D=64, R=None, dtype="fp16", position_dtype="int32", packed=False):
    return rope_module.RopeProblem(B=B, S=S, H=H, D=D, packed=packed, rotary_dim=R or D, style="half", dtype=dtype,
                                   position_dtype=position_dtype, has_out=False, out_rows_contiguous=True,
                                   device="gpu:0")


GEOMETRY = [dict(S=1, D=64), dict(S=7, D=128), dict(S=100, D=80), dict(S=3, D=256), dict(S=2, D=512, R=64),
            dict(B=70000, S=1, H=1, D=32), dict(B=1, S=10**6, H=100000, D=2)]


@pytest.mark.parametrize("kwargs", GEOMETRY, ids=str)
def test_the_launch_covers_a_row_with_at_most_the_launch_bound(kwargs):
    p = problem_of(**kwargs)
    name, grid, (bx, by) = rope_module.custom_launch(p)
    items = p.rotary_dim // 2 + p.D - p.rotary_dim
    assert bx * by <= rope_module.ROPE_THREADS and 32 <= bx <= rope_module.ROPE_MAX_BX and by >= 1
    assert bx >= items or bx == rope_module.ROPE_MAX_BX  # a row in one pass where it fits
    assert by <= max(1, 2 * p.S)                          # no block of idle token rows
    assert grid == (min(-(-p.S // by), 65535), min(p.H, 65535), min(p.B, 65535))
    assert name == "rope1_pairs_f16_i32"


def test_the_kernel_names_cover_every_dtype_and_position_type():
    names = {rope_module.custom_launch(problem_of(dtype=d, position_dtype=t))[0]
             for d in rope_module.GPU_DTYPES for t in ("int32", "int64")}
    assert names == {f"rope1_pairs_{s}_{t}" for s in ("f16", "bf16", "f32") for t in ("i32", "i64")}


def test_the_kernels_take_the_declared_parameters_and_the_launch_fits_their_bounds():
    """kernels/rope.cu compiled to PTX by NVRTC: every kernel the launcher names exists, takes what
    ROPE_PARAMS declares (count, order, widths), what custom_args packs, and a block within its
    __launch_bounds__ (tests/test_kernel_contracts.py's checker)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")
    import test_kernel_contracts as contracts_test

    for dtype in rope_module.GPU_DTYPES:
        for position_dtype in ("int32", "int64"):
            for packed in (False, True):
                p = problem_of(dtype=dtype, position_dtype=position_dtype, packed=packed, B=1 if packed else 2)
                name, _, block = rope_module.custom_launch(p)
                args = rope_module.custom_args(p, (0, 64 * 3, 64), (-5, 7, 11), (0, 1))
                contracts_test.assert_packed(args, rope_module._ROPE, name)
                assert math.prod(block) <= contracts_test.max_threads("rope.cu", name)
