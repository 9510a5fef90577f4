"""MultiheadAttention and TransformerEncoderLayer: the reference path against a float64 NumPy forward
written here, the one-GEMM packed projection and strided views, the masks (right padding → sequence
lengths, anything else → bias), PyTorch's names and results (when torch is importable), errors, and
the GPU paths against the reference."""

import math

import numpy as np
import pytest
from conftest import random_normal, rel_error

from libnn import dtypes
from libnn.nn import functional, transformer
from libnn.nn.functional import key_padding
from libnn.nn.transformer import MultiheadAttention, TransformerEncoderLayer
from libnn.ops.attention import KeyPaddingBias

E, H = 32, 4


# --- an independent float64 forward -----------------------------------------------------------------
def numpy_mha(state, query, key, value, num_heads, key_padding_mask=None, attn_mask=None, causal=False,
              prefix=""):
    g = {k[len(prefix):]: np.asarray(v, np.float64) for k, v in state.items() if k.startswith(prefix)}
    W, Wo = g["in_proj_weight"], g["out_proj.weight"]
    b = g.get("in_proj_bias", np.zeros(W.shape[0]))
    bo = g.get("out_proj.bias", np.zeros(Wo.shape[0]))
    B, Sq, Emb = query.shape
    Skv, D = key.shape[1], Emb // num_heads

    def heads(x, i):
        y = np.asarray(x, np.float64) @ W[i * Emb:(i + 1) * Emb].T + b[i * Emb:(i + 1) * Emb]
        return y.reshape(B, -1, num_heads, D).transpose(0, 2, 1, 3)

    q, k, v = heads(query, 0), heads(key, 1), heads(value, 2)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
    if attn_mask is not None:
        mask = attn_mask if attn_mask.ndim == 2 else attn_mask.reshape(B, num_heads, Sq, Skv)
        scores = np.where(mask, -np.inf, scores) if mask.dtype == bool else scores + mask
    if key_padding_mask is not None:
        scores = np.where(key_padding_mask[:, None, None, :], -np.inf, scores)
    if causal:
        scores = np.where(np.arange(Skv)[None, :] > np.arange(Sq)[:, None], -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    o = (weights @ v).transpose(0, 2, 1, 3).reshape(B, Sq, Emb)
    return o @ Wo.T + bo


def numpy_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + (0 if bias is None else bias)


def numpy_encoder_layer(state, src, num_heads, activation, norm_first, eps=1e-5, key_padding_mask=None,
                        attn_mask=None, causal=False):
    g = {k: np.asarray(v, np.float64) for k, v in state.items()}
    x = np.asarray(src, np.float64)
    act = {"relu": lambda v: np.maximum(v, 0),
           "gelu": lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))}[activation]

    def norm(y, name):
        return numpy_layer_norm(y, g[f"{name}.weight"], g.get(f"{name}.bias"), eps)

    def ff(y):
        h = act(y @ g["linear1.weight"].T + g.get("linear1.bias", 0))
        return h @ g["linear2.weight"].T + g.get("linear2.bias", 0)

    def sa(y):
        return numpy_mha(state, y, y, y, num_heads, key_padding_mask, attn_mask, causal, prefix="self_attn.")

    if norm_first:
        x = x + sa(norm(x, "norm1"))
        return x + ff(norm(x, "norm2"))
    x = norm(x + sa(x), "norm1")
    return norm(x + ff(x), "norm2")


def randomized(layer, rng, dtype="fp32"):
    """Give every parameter of `layer` fresh N(0, 0.3²) values (biases and norms too), so that zero
    biases and unit norms do not hide a mistake."""
    state = {k: random_normal(rng, v.shape, dtype, 0.3) for k, v in layer.state_dict().items()}
    for k, value in state.items():
        if k.startswith("norm") and k.endswith("weight"):
            state[k] = (1 + value).astype(value.dtype)
    layer.load_state_dict(state)
    return state


def right_padding(lengths, S):
    """key_padding_mask (True = pad) for sequences of `lengths` padded on the right."""
    return np.arange(S)[None, :] >= np.asarray(lengths)[:, None]


# --- CPU: reference path against NumPy --------------------------------------------------------------
def test_mha_state_dict_has_pytorch_names():
    assert set(MultiheadAttention(E, H, seed=0).state_dict()) == {"in_proj_weight", "in_proj_bias",
                                                                   "out_proj.weight", "out_proj.bias"}
    assert set(MultiheadAttention(E, H, bias=False, seed=0).state_dict()) == {"in_proj_weight", "out_proj.weight"}
    layer = TransformerEncoderLayer(E, H, 64, seed=0)
    assert set(layer.state_dict()) == {f"self_attn.{k}" for k in ("in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                                  "out_proj.bias")} | {
        f"{m}.{p}" for m in ("linear1", "linear2", "norm1", "norm2") for p in ("weight", "bias")}
    assert layer.self_attn.in_proj_weight.shape == (3 * E, E) and layer.linear1.weight.shape == (64, E)


@pytest.mark.parametrize("bias", [True, False])
def test_mha_self_attention_reference_matches_numpy(rng, bias):
    mha = MultiheadAttention(E, H, bias=bias, path="reference")
    state = randomized(mha, rng)
    x = random_normal(rng, (3, 7, E), "fp32")
    out, weights = mha(x)
    assert weights is None and out.shape == (3, 7, E) and out.dtype == np.float32
    assert rel_error(out, numpy_mha(state, x, x, x, H)) < 1e-5
    assert rel_error(mha(x, x, x)[0], out) == 0  # key is value is query: the same self-attention


@pytest.mark.parametrize("same_kv", [True, False])
def test_mha_cross_attention_reference_matches_numpy(rng, same_kv):
    mha = MultiheadAttention(E, H, path="reference")
    state = randomized(mha, rng)
    q, k = random_normal(rng, (2, 5, E), "fp32"), random_normal(rng, (2, 9, E), "fp32")
    v = k if same_kv else random_normal(rng, (2, 9, E), "fp32")
    kpm = right_padding([9, 4], 9)
    out, _ = mha(q, k, v, key_padding_mask=kpm)
    assert out.shape == (2, 5, E)
    assert rel_error(out, numpy_mha(state, q, k, v, H, key_padding_mask=kpm)) < 1e-5


def test_mha_self_attention_is_one_gemm_on_strided_views(rng, monkeypatch):
    """The packed projection runs as ONE GEMM and attention reads q, k, v as views of its output (out_proj,
    an nn.Linear, runs through functional.linear too: the last GEMM counted)."""
    gemms, seen = [], {}
    real_linear, real_attention = functional.linear, functional.attention

    def counting_linear(x, w, b=None, activation=None, **kw):
        gemms.append(w.shape)
        return real_linear(x, w, b, activation, **kw)

    def viewing_attention(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, **kw)
        return real_attention(q, k, v, **kw)

    for module in (functional, transformer):  # packed_self_attention's calls, and cross-attention's
        monkeypatch.setattr(module, "linear", counting_linear)
        monkeypatch.setattr(module, "attention", viewing_attention)
    mha = MultiheadAttention(E, H, path="reference", seed=1)
    x = random_normal(rng, (2, 6, E), "fp32")
    mha(x)
    assert gemms == [(3 * E, E), (E, E)]
    assert seen["layout"] == "BSHD" and seen["q"].shape == (2, 6, H, E // H)
    q, v = seen["q"], seen["v"]
    assert q.base is not None and q.base is v.base and q.strides[1] == 3 * E * q.itemsize  # rows of one buffer
    gemms.clear()
    k = random_normal(rng, (2, 4, E), "fp32")
    mha(x, k, k)
    assert gemms == [(E, E), (2 * E, E), (E, E)]  # q, then k and v together, then out_proj
    assert seen["k"].base is seen["v"].base and seen["k"].strides[1] == 2 * E * 4
    gemms.clear()
    mha(x, k, k.copy())
    assert gemms == [(E, E), (E, E), (E, E), (E, E)]


def test_key_padding_right_padding_becomes_lengths_else_lengths_and_a_bias_for_the_holes():
    valid = ~right_padding([5, 2, 0], 5)
    lens, bias = key_padding(valid, np.float32)
    assert bias is None and lens.lengths.tolist() == [5, 2, 0] and lens.lengths.dtype == np.int32
    assert key_padding(np.ones((2, 5), bool), np.float32) == (None, None)
    scattered = np.array([[True, False, True, False, False], [False, False, True, True, True],
                          [False] * 5])
    lens, bias = key_padding(scattered, np.float16)
    assert lens.lengths.tolist() == [3, 5, 0], "up to each row's last key"
    assert isinstance(bias, KeyPaddingBias), "it never empties a row: attention may skip looking for such rows"
    bias = bias.bias
    assert bias.shape == (3, 1, 1, 5) and bias.dtype == np.float16
    holes = np.array([[False, True, False, False, False], [True, True, False, False, False], [False] * 5])
    assert np.array_equal(np.isneginf(bias[:, 0, 0]), holes) and np.all(bias[~holes[:, None, None, :]] == 0)


def test_mha_masks_reference_matches_numpy(rng, monkeypatch):
    mha = MultiheadAttention(E, H, path="reference")
    state = randomized(mha, rng)
    x = random_normal(rng, (3, 6, E), "fp32")
    calls = []
    real = functional.attention
    monkeypatch.setattr(functional, "attention",
                        lambda q, k, v, **kw: calls.append(kw) or real(q, k, v, **kw))
    right = right_padding([6, 3, 1], 6)
    out = mha(x, key_padding_mask=right)[0]
    assert calls[-1]["seq_lens_kv"].lengths.tolist() == [6, 3, 1] and calls[-1]["attn_bias"] is None
    assert rel_error(out, numpy_mha(state, x, x, x, H, key_padding_mask=right)) < 1e-5
    scattered = np.array([[0, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]], bool)
    out = mha(x, key_padding_mask=scattered)[0]
    # lengths up to the last key (kpm True = padding) and a bias for the holes before it
    assert calls[-1]["seq_lens_kv"].lengths.tolist() == [6, 6, 5] and calls[-1]["attn_bias"].bias.shape == (3, 1, 1, 6)
    assert rel_error(out, numpy_mha(state, x, x, x, H, key_padding_mask=scattered)) < 1e-5
    bool_mask = rng.random((6, 6)) < 0.3
    bool_mask[:, 0] = False  # every row keeps a key under the padding too
    float_mask = random_normal(rng, (3 * H, 6, 6), "fp32")
    for mask in (bool_mask, float_mask):
        out = mha(x, key_padding_mask=right, attn_mask=mask)[0]
        assert rel_error(out, numpy_mha(state, x, x, x, H, key_padding_mask=right, attn_mask=mask)) < 1e-5
    out = mha(x, is_causal=True)[0]
    assert calls[-1]["causal"] is True
    assert rel_error(out, numpy_mha(state, x, x, x, H, causal=True)) < 1e-5


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_reference_matches_numpy(rng, activation, norm_first):
    layer = TransformerEncoderLayer(E, H, 64, activation=activation, norm_first=norm_first, path="reference")
    state = randomized(layer, rng)
    assert layer.linear1.activation == {"relu": "relu", "gelu": "gelu_erf"}[activation]  # fused into linear1
    x = random_normal(rng, (2, 7, E), "fp32")
    kpm = right_padding([7, 4], 7)
    got = layer(x, src_key_padding_mask=kpm)
    assert got.shape == x.shape
    expected = numpy_encoder_layer(state, x, H, activation, norm_first, key_padding_mask=kpm)
    assert rel_error(got, expected) < 1e-5


def test_encoder_layer_without_bias_and_causal_matches_numpy(rng):
    layer = TransformerEncoderLayer(E, H, 48, bias=False, layer_norm_eps=1e-6, path="reference")
    state = randomized(layer, rng)
    assert not any(k.endswith("bias") for k in state)
    x = random_normal(rng, (2, 5, E), "fp32")
    mask = np.triu(np.full((5, 5), -np.inf, np.float32), 1)
    got = layer(x, src_mask=mask, is_causal=True)
    assert rel_error(got, numpy_encoder_layer(state, x, H, "relu", False, eps=1e-6, causal=True)) < 1e-5


@pytest.mark.parametrize("make,call,message", [
    (lambda: MultiheadAttention(E, 5), None, r"embed_dim \(32\) must be divisible by num_heads \(5\)"),
    (lambda: MultiheadAttention(E, H, batch_first=False), None, "only batch_first=True"),
    (lambda: TransformerEncoderLayer(E, H, activation="silu"), None, "activation must be one of"),
    (None, lambda m: m(np.zeros((6, E), np.float32)), r"query must be 3-D \(batch, seq_len, embed_dim\)"),
    (None, lambda m: m(np.zeros((2, 6, 16), np.float32)), "query has 16 features .* embed_dim is 32"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), np.zeros((2, 4, E), np.float32)), "pass both key and value"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), np.zeros((2, 4, E), np.float32),
                       np.zeros((2, 5, E), np.float32)), "key and value must be"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), np.zeros((2, 4, 8), np.float32),
                       np.zeros((2, 4, 8), np.float32)), "key has 8 features"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), need_weights=True), "need_weights=True is not supported"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), key_padding_mask=np.zeros((2, 5), bool)),
     r"key_padding_mask must have shape \(batch, seq_len_kv\) = \(2, 6\)"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), attn_mask=np.zeros((6, 5), bool)),
     r"attn_mask must have shape \(seq_len_q, seq_len_kv\) = \(6, 6\)"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float32), attn_mask=np.zeros((6, 6), np.int32)),
     "attn_mask must be boolean"),
    (None, lambda m: m(np.zeros((2, 6, E), np.float64)), "has dtype fp32 but x has fp64"),
])
def test_layers_reject_bad_arguments(make, call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        m = make() if make else MultiheadAttention(E, H, path="reference", seed=0)
        call(m)


def test_encoder_layer_rejects_wrong_rank_and_width():
    layer = TransformerEncoderLayer(E, H, 64, path="reference", seed=0)
    with pytest.raises(ValueError, match=r"src must be 3-D \(batch, seq_len, d_model=32\)"):
        layer(np.zeros((5, E), np.float32))
    with pytest.raises(ValueError, match=r"got shape \(2, 5, 16\)"):
        layer(np.zeros((2, 5, 16), np.float32))


# --- CPU: against PyTorch, when it is importable ----------------------------------------------------
def _torch_state(module):
    return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("bias", [True, False])
def test_mha_matches_torch(rng, bias):
    torch = pytest.importorskip("torch")
    torch.manual_seed(int(rng.integers(2**31)))
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True).eval()
    if bias:  # PyTorch initialises these to zero; make them count
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    mha = MultiheadAttention(E, H, bias=bias, path="reference")
    mha.load_state_dict(_torch_state(ref))
    x = random_normal(rng, (3, 6, E), "fp32")
    kv = random_normal(rng, (3, 8, E), "fp32")
    t = torch.from_numpy
    # grad enabled: PyTorch's plain path (its inference fast path handles padding its own way)
    cases = [((x,), {}),
             ((x,), {"key_padding_mask": right_padding([6, 2, 4], 6)}),
             ((x,), {"key_padding_mask": right_padding([6, 2, 4], 6)[:, ::-1].copy()}),
             ((x,), {"attn_mask": np.triu(np.ones((6, 6), bool), 1)}),
             ((x,), {"attn_mask": random_normal(rng, (3 * H, 6, 6), "fp32")}),
             ((x, kv, kv), {"key_padding_mask": right_padding([8, 1, 5], 8)}),
             ((x, kv, random_normal(rng, (3, 8, E), "fp32")), {})]
    for args, kwargs in cases:
        expected = ref(*(t(a) for a in (args * 3)[:3]), need_weights=False,
                       **{k: t(v) for k, v in kwargs.items()})[0].detach().numpy()
        got = mha(*args, **kwargs)[0]
        assert rel_error(got, expected) < 1e-5, (len(args), list(kwargs))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_encoder_layer_matches_torch(rng, activation, norm_first, bias):
    torch = pytest.importorskip("torch")
    torch.manual_seed(int(rng.integers(2**31)))
    ref = torch.nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, activation=activation, batch_first=True,
                                           norm_first=norm_first, bias=bias).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    layer = TransformerEncoderLayer(E, H, 64, activation=activation, norm_first=norm_first, bias=bias,
                                    path="reference")
    layer.load_state_dict(_torch_state(ref))
    x = random_normal(rng, (3, 7, E), "fp32")
    for kpm in (None, right_padding([7, 3, 5], 7)):
        expected = ref(torch.from_numpy(x), src_key_padding_mask=None if kpm is None else torch.from_numpy(kpm))
        got = layer(x, src_key_padding_mask=kpm)
        assert rel_error(got, expected.detach().numpy()) < 1e-5


# --- GPU: against the reference path ----------------------------------------------------------------
GPU_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_mha_gpu_matches_reference(rng, dtype):
    import cupy

    ref = MultiheadAttention(E, H, path="reference")
    state = randomized(ref, rng, dtype)
    ref.load_state_dict({k: v.astype(np.float32) for k, v in state.items()})
    mha = MultiheadAttention(E, H, dtype=dtype, device="gpu")
    mha.load_state_dict(state)
    x = random_normal(rng, (4, 24, E), dtype)
    kv = random_normal(rng, (4, 40, E), dtype)
    cases = [((x,), {}), ((x,), {"key_padding_mask": right_padding([24, 9, 1, 17], 24)}),
             ((x,), {"key_padding_mask": right_padding([24, 9, 1, 17], 24)[:, ::-1].copy()}),
             ((x,), {"is_causal": True}), ((x, kv, kv), {"key_padding_mask": right_padding([40, 3, 33, 8], 40)})]
    for args, kwargs in cases:
        got = mha(*(cupy.asarray(a) for a in args), **kwargs)[0]
        assert isinstance(got, cupy.ndarray) and got.dtype == dtypes.parse(dtype)
        expected = ref(*(a.astype(np.float32) for a in args), **kwargs)[0]
        assert rel_error(got, expected) < GPU_TOLERANCE[dtype], (len(args), list(kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_gpu_matches_reference(rng, dtype, activation):
    import cupy

    ref = TransformerEncoderLayer(E, H, 64, activation=activation, path="reference")
    state = randomized(ref, rng, dtype)
    ref.load_state_dict({k: v.astype(np.float32) for k, v in state.items()})
    layer = TransformerEncoderLayer(E, H, 64, activation=activation, dtype=dtype, device="gpu")
    layer.load_state_dict(state)
    x = random_normal(rng, (3, 20, E), dtype)
    kpm = right_padding([20, 11, 2], 20)
    got = layer(cupy.asarray(x), src_key_padding_mask=cupy.asarray(kpm))
    assert rel_error(got, ref(x.astype(np.float32), src_key_padding_mask=kpm)) < GPU_TOLERANCE[dtype]

