"""Property tests of the reference path on the CPU (CI): the problems tests/property_cases.py draws
for the GPU tests, at most 20 examples per op, against formulas written independently of it (loops
over output elements, a direct convolution for the FFT one) or against invariants (softmax sums to
1, layer_norm has zero mean and unit variance). They also keep the shared strategies honest: every
problem they draw must be one the op accepts.

The reference computes in float64 and rounds to the input dtype once, so it must agree with a
float64 formula to within that rounding: 1e-6 for fp32 (a few ulps), 1e-2 for fp16 and bf16.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import BASE_SEED, rel_error
from libnn.ops import activations, conv2d
from libnn.registry import ops
from property_cases import (STRATEGIES, attention_specs, build, conv2d_specs, embedding_specs, fft_conv_specs,
                            layer_norm_specs, linear_specs, pool2d_specs, rms_norm_specs, rope_specs,
                            softmax_specs, swiglu_specs)

DTYPES = ("fp16", "bf16", "fp32")
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
ROUNDING = {"fp32": 1e-6, "fp16": 1e-2, "bf16": 1e-2}


@pytest.fixture(scope="module")
def base_seed(request) -> int:
    return request.config.stash[BASE_SEED]


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def assert_rounded_from(got, exact, dtype: str) -> None:
    assert got.dtype == np.dtype(dtypes_parse(dtype)) and got.shape == exact.shape
    error = rel_error(got, exact)
    assert error <= ROUNDING[dtype], f"relative error {error:.3e} > {ROUNDING[dtype]:.0e}"


def dtypes_parse(name):
    from libnn import dtypes
    return dtypes.parse(name)


def residual_of(a):
    return 0.0 if a.get("residual") is None else f64(a["residual"])


@SETTINGS
@given(spec=linear_specs(DTYPES))
def test_linear_reference_is_the_dot_products(base_seed, spec):
    case = build(spec, base_seed)
    a, p = case.arrays, spec.params
    x, w = f64(a["x"]), f64(a["w"])
    exact = np.einsum("...k,nk->...n", x, w) + (0.0 if a["b"] is None else f64(a["b"]))
    exact = activations.apply(exact, p["activation"])
    if a["residual"] is not None:
        # residual semantics belong to the op; check the reference on what it does without one
        a = dict(a, residual=None)
    assert_rounded_from(case.call(a, "reference"), exact, case.dtype)


@SETTINGS
@given(spec=conv2d_specs(DTYPES))
def test_conv2d_reference_is_the_direct_sum(base_seed, spec):
    case = build(spec, base_seed)
    a, p = case.arrays, spec.params
    x, w = f64(a["x"]), f64(a["w"])
    if p["layout"] == "NCHW":  # to NHWC and KRSC
        x, w = x.transpose(0, 2, 3, 1), w.transpose(0, 2, 3, 1)
    N, H, W, C = x.shape
    K, R, S, Cg = w.shape
    (sh, sw), (ph, pw), (dh, dw), G = p["stride"], p["padding"], p["dilation"], p["groups"]
    P, Q = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1, (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    out = np.zeros((N, P, Q, K))
    for k in range(K):
        g = k // (K // G)
        for i in range(P):
            for j in range(Q):
                for r in range(R):
                    for s in range(S):
                        h, v = i * sh - ph + r * dh, j * sw - pw + s * dw
                        if 0 <= h < H and 0 <= v < W:
                            out[:, i, j, k] += x[:, h, v, g * Cg:(g + 1) * Cg] @ w[k, r, s]
    scale = shift = None
    if p["bn"] == "scale_shift":
        scale, shift = f64(a["bn0"]), f64(a["bn1"])
    elif p["bn"] == "batchnorm":
        scale = f64(a["bn0"]) / np.sqrt(f64(a["bn3"]) + 1e-5)
        shift = f64(a["bn1"]) - f64(a["bn2"]) * scale
    if a["b"] is not None:
        shift = (0 if shift is None else shift) + f64(a["b"]) * (1 if scale is None else scale)
    out = out * (1 if scale is None else scale) + (0 if shift is None else shift)
    out = activations.apply(out, p["activation"])
    if p["layout"] == "NCHW":
        out = out.transpose(0, 3, 1, 2)
    assert_rounded_from(case.call(a, "reference"), out, case.dtype)


@SETTINGS
@given(spec=attention_specs(DTYPES))
def test_attention_reference_is_a_masked_softmax_per_row(base_seed, spec):
    case = build(spec, base_seed)
    a, p = case.arrays, spec.params
    B, Hq, Hkv, Sq, Skv, D = (p[k] for k in ("B", "Hq", "Hkv", "Sq", "Skv", "D"))
    q, k, v = (f64(a[n]) if p["layout"] == "BHSD" else f64(a[n]).transpose(0, 2, 1, 3) for n in "qkv")
    bias = None if a["attn_bias"] is None else np.broadcast_to(f64(a["attn_bias"]), (B, Hq, Sq, Skv))
    scale = 1 / math.sqrt(D) if p["scale"] is None else p["scale"]
    out = np.zeros((B, Hq, Sq, D))
    for b in range(B):
        Lq = Sq if a["seq_lens_q"] is None else int(a["seq_lens_q"][b])
        Lk = Skv if a["seq_lens_kv"] is None else int(a["seq_lens_kv"][b])
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            for i in range(Lq):
                keys = [j for j in range(Lk)
                        if p["causal"] is False or (j <= i if p["causal"] is True else j <= i + Lk - Lq)]
                if not keys:
                    continue  # a row with no key is zeros
                scores = np.array([q[b, h, i] @ k[b, kv, j] * scale + (0 if bias is None else bias[b, h, i, j])
                                   for j in keys])
                weights = np.exp(scores - scores.max())
                out[b, h, i] = (weights / weights.sum()) @ v[b, kv, keys]
    if p["layout"] == "BSHD":
        out = out.transpose(0, 2, 1, 3)
    assert_rounded_from(case.call(a, "reference"), out, case.dtype)


@SETTINGS
@given(spec=layer_norm_specs(DTYPES))
def test_layer_norm_reference_has_zero_mean_and_unit_variance(base_seed, spec):
    case = build(spec, base_seed)
    a = dict(case.arrays, residual=None, weight=None, bias=None)  # the normalisation alone
    y = f64(case.call(a, "reference"))
    x = f64(a["x"])
    centered = x - x.mean(axis=-1, keepdims=True)
    exact = centered / np.sqrt((centered ** 2).mean(axis=-1, keepdims=True) + spec.params["eps"])
    assert_rounded_from(case.call(a, "reference"), exact, case.dtype)
    if x.shape[-1] > 1 and spec.params["eps"] < 1e-4 and case.dtype == "fp32":
        variance = centered.var(axis=-1)
        rows = variance > 1e-3  # rows whose spread eps does not dominate
        assert np.allclose(y.mean(axis=-1)[rows], 0, atol=1e-5)
        assert np.allclose(y.var(axis=-1)[rows], 1, atol=1e-4)


@SETTINGS
@given(spec=softmax_specs(DTYPES))
def test_softmax_reference_sums_to_one(base_seed, spec):
    case = build(spec, base_seed)
    p = spec.params
    x = f64(case.arrays["x"])
    y = f64(case.call(case.arrays, "reference"))
    dim = p["dim"]
    probabilities = np.exp(y) if p["log"] else y
    assert np.all(probabilities >= 0) and np.all(probabilities <= 1 + 1e-2)
    assert np.allclose(probabilities.sum(axis=dim), 1, rtol=0, atol=ROUNDING[case.dtype] * 5)
    shifted = np.exp(x - x.max(axis=dim, keepdims=True))
    exact = shifted / shifted.sum(axis=dim, keepdims=True)
    if p["log"]:
        exact = np.log(exact)
    assert_rounded_from(case.call(case.arrays, "reference"), exact, case.dtype)


@SETTINGS
@given(spec=pool2d_specs(DTYPES))
def test_pool2d_reference_is_the_window_max_or_mean(base_seed, spec):
    case = build(spec, base_seed)
    p = spec.params
    x = f64(case.arrays["x"])
    if p["layout"] == "NCHW":
        x = x.transpose(0, 2, 3, 1)
    N, H, W, C = x.shape
    (kh, kw), (ph, pw) = p["kernel"], p["padding"]
    sh, sw = p["kernel"] if p["stride"] is None else p["stride"]
    P, Q = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    out = np.zeros((N, P, Q, C))
    for i in range(P):
        for j in range(Q):
            rows = [h for h in range(i * sh - ph, i * sh - ph + kh) if 0 <= h < H]
            cols = [v for v in range(j * sw - pw, j * sw - pw + kw) if 0 <= v < W]
            window = x[:, rows][:, :, cols]
            if p["mode"] == "max":
                out[:, i, j] = window.max(axis=(1, 2))
            else:
                divisor = kh * kw if p["count_include_pad"] else len(rows) * len(cols)
                out[:, i, j] = window.sum(axis=(1, 2)) / divisor
    if p["layout"] == "NCHW":
        out = out.transpose(0, 3, 1, 2)
    got = case.call(case.arrays, "reference")
    if p["mode"] == "max":
        assert np.array_equal(f64(got), out)
    else:
        assert_rounded_from(got, out, case.dtype)


@SETTINGS
@given(spec=fft_conv_specs(DTYPES))
def test_fft_conv_reference_is_the_direct_convolution(base_seed, spec):
    case = build(spec, base_seed)
    a, p = case.arrays, spec.params
    x, w = f64(a["x"]), f64(a["w"])
    if p["dims"] == 1:  # as a 2-D convolution of height 1
        x, w = x[:, :, None, :], w[:, :, None, :]
    kernel = w.shape[2:]
    if p["causal"]:
        x = np.pad(x, ((0, 0), (0, 0), (0, 0), (kernel[1] - 1, 0)))
        padding = (0, 0)
    elif p["mode"] == "same":
        x = np.pad(x, ((0, 0), (0, 0), *(((k - 1) // 2, k // 2) for k in kernel)))
        padding = (0, 0)
    elif p["mode"] == "full":
        padding = tuple(k - 1 for k in kernel)
    else:
        padding = tuple(p["padding"]) if p["dims"] == 2 else (0, p["padding"][0])
    exact = conv2d(x, w, f64(a["b"]), padding=padding, layout="NCHW", path="reference")
    if p["dims"] == 1:
        exact = exact[:, :, 0]
    tolerance = max(ROUNDING[case.dtype], 1e-9 * math.log2(2 * max(x.shape[2:]) + 2))
    got = case.call(a, "reference")
    assert got.dtype == a["x"].dtype and got.shape == exact.shape
    assert rel_error(got, exact) <= tolerance


@SETTINGS
@given(spec=embedding_specs(DTYPES))
def test_embedding_reference_is_the_sum_of_the_rows(base_seed, spec):
    case = build(spec, base_seed)
    a, p = case.arrays, spec.params
    ids = a["ids"].astype(np.int64)
    exact = f64(a["weight"])[ids]
    if a["position_weight"] is not None:
        positions = p["position_offset"] + np.arange(ids.shape[-1])
        exact = exact + f64(a["position_weight"])[positions]
    if a["type_weight"] is not None:
        types = np.zeros_like(ids) if a["type_ids"] is None else a["type_ids"].astype(np.int64)
        exact = exact + f64(a["type_weight"])[types]
    if p["normalize"]:
        centered = exact - exact.mean(axis=-1, keepdims=True)
        exact = centered / np.sqrt((centered ** 2).mean(axis=-1, keepdims=True) + p["eps"])
        exact = exact * (1 if a["norm_weight"] is None else f64(a["norm_weight"])) \
            + (0 if a["norm_bias"] is None else f64(a["norm_bias"]))
    assert_rounded_from(case.call(a, "reference"), exact, case.dtype)


@SETTINGS
@given(spec=rope_specs(DTYPES))
def test_rope_reference_rotates_each_pair_by_its_angle(base_seed, spec):
    """Each pair (j0, j1) is (a, b) turned by angle = fp32(position) * inv_freq[i]: a cos - b sin,
    b cos + a sin, written with complex numbers here; the elements past rotary_dim are x's."""
    case = build(spec, base_seed)
    a, p = case.arrays, spec.params
    x, R = f64(a["x"]), p["rotary_dim"] or p["D"]
    angle = (a["positions"].astype(np.float32)[..., None] * a["inv_freq"]).astype(np.float64)[..., None, :]
    j0, j1 = (np.arange(R // 2), np.arange(R // 2) + R // 2) if p["style"] == "half" else \
        (np.arange(0, R, 2), np.arange(1, R, 2))
    turned = (x[..., j0] + 1j * x[..., j1]) * np.exp(1j * angle)
    exact = x.copy()
    exact[..., j0], exact[..., j1] = turned.real, turned.imag
    got = case.call(a, "reference")
    assert_rounded_from(got, exact, case.dtype)
    np.testing.assert_array_equal(f64(got)[..., R:], x[..., R:])


@SETTINGS
@given(spec=rms_norm_specs(DTYPES))
def test_rms_norm_reference_divides_each_row_by_its_root_mean_square(base_seed, spec):
    """y = h / sqrt(mean(h²) + eps) · weight for h = x + residual, and (eps small against the rows'
    mean square, no weight) each row of y has mean square 1."""
    case = build(spec, base_seed)
    a, eps = case.arrays, spec.params["eps"]
    h = f64(a["x"]) + residual_of(a)
    weight = 1.0 if a["weight"] is None else f64(a["weight"])
    exact = h / np.sqrt((h ** 2).mean(axis=-1, keepdims=True) + eps) * weight
    assert_rounded_from(case.call(a, "reference"), exact, case.dtype)
    y = f64(case.call(dict(a, weight=None), "reference"))
    rows = (h ** 2).mean(axis=-1) > 1e4 * eps
    if case.dtype == "fp32":
        assert np.allclose((y ** 2).mean(axis=-1)[rows], 1, atol=1e-4)


@SETTINGS
@given(spec=swiglu_specs(DTYPES))
def test_swiglu_reference_is_the_gate_half_through_silu_times_the_up_half(base_seed, spec):
    """y = g · sigmoid(g) · u for g, u the two halves of x's last dimension, with sigmoid written as
    (1 + tanh(g / 2)) / 2 here (no exponential to overflow); where up is positive, y has the sign of
    the gate (silu keeps it)."""
    case = build(spec, base_seed)
    x, F = f64(case.arrays["x"]), spec.params["F"]
    gate, up = x[..., :F], x[..., F:]
    exact = gate * (1 + np.tanh(gate / 2)) / 2 * up
    got = case.call(case.arrays, "reference")
    assert got.shape == (*x.shape[:-1], F)
    assert_rounded_from(got, exact, case.dtype)
    positive = (up > 0) & (f64(got) != 0)
    assert np.all(np.sign(f64(got))[positive] == np.sign(gate)[positive])


def test_every_registered_op_has_a_property_strategy():
    """A new op gets its hypothesis strategy in tests/property_cases.py, and so its GPU paths their
    property test against the reference. The ops libnn registers are read in a fresh interpreter: the
    registry tests add toy ops to this one's, in whatever order the run takes."""
    found = subprocess.run([sys.executable, "-c", "import libnn; from libnn.registry import ops; print(*ops())"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert set(found) <= set(ops())
    missing = sorted(set(found) - set(STRATEGIES))
    assert not missing, f"ops without a strategy in tests/property_cases.py: {missing}"
