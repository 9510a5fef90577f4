"""kernels/attention.cu through its launchers (libnn/ops/attention_kernels.py): the flash path (attn2 where
it applies, attn1 otherwise), attn1 forced, and the unfused path, each against a float64 NumPy reference
over shapes, masks, GQA, biases and strided layouts, with o poisoned (NaN) before every call."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import random_normal, rel_error

from libnn import dtypes

pytestmark = pytest.mark.gpu


def reference(q, k, v, *, scale, causal, lens_q=None, lens_kv=None, bias=None):
    """(o, empty): float64 masked softmax attention of (B, H, S, D) host arrays, and which rows (B, Hq, Sq)
    have no allowed key or only -inf logits (they must come out as zeros)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, Hq, Sq, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    k, v = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    Lq = np.full(B, Sq) if lens_q is None else np.asarray(lens_q)
    Lk = np.full(B, Skv) if lens_kv is None else np.asarray(lens_kv)
    i, j = np.arange(Sq)[None, :, None], np.arange(Skv)[None, None, :]
    allowed = (j < Lk[:, None, None]) & (i < Lq[:, None, None])
    if causal == "top_left":
        allowed = allowed & (j <= i)
    elif causal == "bottom_right":
        allowed = allowed & (j <= i + (Lk - Lq)[:, None, None])
    s = np.where(allowed[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    empty = m == -np.inf
    p = np.exp(s - np.where(empty, 0.0, m))
    p /= np.where(empty, 1.0, p.sum(axis=-1, keepdims=True))
    return np.where(empty, 0.0, p @ v), empty[..., 0]


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    causal: str | None = None
    lens_q: tuple[int, ...] | None = None
    lens_kv: tuple[int, ...] | None = None
    bias: str | None = None      # None, "full" (with a row of -inf), "keys" (B,1,1,Skv), "heads" (1,Hq,Sq,Skv)
    layout: str = "BHSD"         # BHSD, BSHD (viewed as BHSD), packed (B,S,3,H,D) slices, misaligned (+1 element)


CASES = {
    "s1": Case(1, 2, 2, 1, 1, 32),
    "s17_top_left": Case(2, 3, 3, 17, 17, 64, "top_left"),
    "s128": Case(2, 4, 4, 128, 128, 128),
    "s1000_d80_bottom_right": Case(1, 2, 2, 1000, 1000, 80, "bottom_right"),
    "decode_sq1_skv1000": Case(2, 4, 4, 1, 1000, 128),
    "decode_bottom_right": Case(2, 4, 4, 1, 1000, 64, "bottom_right"),
    "sq17_skv128_top_left": Case(2, 2, 2, 17, 128, 64, "top_left"),
    "sq128_skv17_bottom_right": Case(2, 2, 2, 128, 17, 32, "bottom_right"),   # early rows see no key
    "gqa_8_2": Case(1, 8, 2, 128, 200, 64, "top_left"),
    "mqa_8_1": Case(2, 8, 1, 100, 100, 128, "bottom_right"),
    "padding_with_zero_lengths": Case(3, 2, 2, 128, 130, 64, "top_left", (128, 0, 50), (100, 70, 0)),
    "padding_bottom_right": Case(3, 2, 2, 70, 150, 32, "bottom_right", (70, 33, 1), (150, 20, 64)),
    "bias_full_inf_row": Case(2, 2, 2, 64, 96, 64, bias="full"),
    "bias_keys_broadcast": Case(2, 4, 4, 33, 70, 32, "top_left", bias="keys"),
    "bias_heads_broadcast_gqa": Case(2, 4, 2, 100, 128, 128, bias="heads"),
    "bias_padding_d96": Case(2, 2, 2, 200, 300, 96, "top_left", (200, 150), (300, 10), bias="full"),
    "bshd_view": Case(2, 4, 2, 128, 130, 64, "bottom_right", layout="BSHD"),
    "packed_qkv": Case(2, 3, 3, 100, 100, 64, "top_left", layout="packed"),
    "misaligned": Case(1, 2, 2, 40, 40, 64, layout="misaligned"),
    "d20": Case(1, 2, 2, 33, 33, 20, "top_left"),
    "d256": Case(1, 2, 2, 40, 40, 256),
    "no_keys": Case(1, 2, 2, 5, 0, 64),
}


def _device_views(c: Case, dtype, rng):
    """Host (q, k, v) in (B, H, S, D) and their device views in c.layout, plus o (B, Hq, Sq, D) to write."""
    import cupy

    dt = dtypes.parse(dtype)
    shapes = [(c.B, c.Hq, c.Sq, c.D), (c.B, c.Hkv, c.Skv, c.D), (c.B, c.Hkv, c.Skv, c.D)]
    if c.layout == "packed":
        assert c.Hq == c.Hkv and c.Sq == c.Skv
        packed = cupy.asarray(random_normal(rng, (c.B, c.Sq, 3, c.Hq, c.D), dt))
        views = [packed[:, :, n].transpose(0, 2, 1, 3) for n in range(3)]
        o = cupy.empty(shapes[0], dt)
    elif c.layout == "BSHD":
        views = [cupy.asarray(random_normal(rng, (s[0], s[2], s[1], s[3]), dt)).transpose(0, 2, 1, 3) for s in shapes]
        o = cupy.empty((c.B, c.Sq, c.Hq, c.D), dt).transpose(0, 2, 1, 3)
    elif c.layout == "misaligned":  # every row 2 or 4 bytes past a 16-byte boundary
        def shifted(shape):
            return cupy.empty(math.prod(shape) + 1, dt)[1:].reshape(shape)
        views = []
        for s in shapes:
            a = shifted(s)
            a[...] = cupy.asarray(random_normal(rng, s, dt))
            views.append(a)
        o = shifted(shapes[0])
    else:
        views = [cupy.asarray(random_normal(rng, s, dt)) for s in shapes]
        o = cupy.empty(shapes[0], dt)
    return [cupy.asnumpy(a) for a in views], views, o


def _bias(c: Case, dtype, rng):
    """(host bias broadcast to (B, Hq, Sq, Skv), device bias view with stride-0 broadcast dims), or Nones."""
    import cupy

    if c.bias is None:
        return None, None
    dt = dtypes.parse(dtype)
    shape = {"full": (c.B, c.Hq, c.Sq, c.Skv), "keys": (c.B, 1, 1, c.Skv), "heads": (1, c.Hq, c.Sq, c.Skv)}[c.bias]
    host = random_normal(rng, shape, dt)
    if c.bias == "full":
        host[0, 0, min(1, c.Sq - 1), :] = -np.inf   # a row every key of which the bias masks
    if c.bias == "keys":
        host[0, 0, 0, -3:] = -np.inf                 # key padding by bias
    full = (c.B, c.Hq, c.Sq, c.Skv)
    return np.broadcast_to(host, full), cupy.broadcast_to(cupy.asarray(host), full)


def _run(path: str, q, k, v, o, **kw):
    from libnn.ops.attention_kernels import flash_attention, unfused_attention

    if path == "unfused":
        unfused_attention(q, k, v, o, **kw)
    else:
        flash_attention(q, k, v, o, version="attn1_naive" if path == "attn1" else None, **kw)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["flash", "attn1", "unfused"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_kernels_match_float64_reference(rng, name, dtype, path):
    """Relative L2 error within dtypes.TOLERANCE (fp32 1e-5, fp16/bf16 1e-2); rows with no allowed key
    exactly zero; o is NaN (poisoned allocation) until written."""
    import cupy

    c = CASES[name]
    (q, k, v), (qd, kd, vd), o = _device_views(c, dtype, rng)
    bias, bias_d = _bias(c, dtype, rng)
    lens = {n: None if L is None else cupy.asarray(np.array(L, np.int32)) for n, L in
            (("seq_lens_q", c.lens_q), ("seq_lens_kv", c.lens_kv))}
    scale = 1 / math.sqrt(c.D)
    _run(path, qd, kd, vd, o, scale=scale, causal=c.causal, bias=bias_d, **lens)
    expected, empty = reference(q, k, v, scale=scale, causal=c.causal, lens_q=c.lens_q, lens_kv=c.lens_kv, bias=bias)
    got = cupy.asnumpy(o).astype(np.float64)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} elements of o unwritten or NaN"
    assert np.all(got[empty] == 0), "rows with no allowed key must be exact zeros"
    assert rel_error(got, expected) <= dtypes.TOLERANCE[dtype]


def test_flash_version_takes_attn2_only_where_it_applies():
    import cupy

    from libnn.ops.attention_kernels import flash_version

    def arrays(dtype, D, offset=0):
        base = cupy.zeros(2 * 4 * 64 * D + offset, dtypes.parse(dtype))[offset:]
        return [base.reshape(2, 4, 64, D)] * 4

    assert flash_version(*arrays("bf16", 128)) == "attn2_flash"
    assert flash_version(*arrays("fp16", 80)) == "attn2_flash"
    assert flash_version(*arrays("fp32", 64)) == "attn1_naive"
    assert flash_version(*arrays("fp16", 20)) == "attn1_naive"      # D % 8
    assert flash_version(*arrays("fp16", 160)) == "attn1_naive"     # D > 128
    assert flash_version(*arrays("fp16", 64, offset=1)) == "attn1_naive"


def test_flash_supports_names_the_limit():
    from libnn.ops.attention_kernels import flash_supports

    assert flash_supports("bf16", 256) is None and flash_supports("fp32", 1) is None
    assert "257" in flash_supports("fp16", 257)
    assert "fp64" in flash_supports("fp64", 64)
