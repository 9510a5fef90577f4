"""FP8 (E4M3) weights in whole models: `quantize("fp8")` on BERT (its query, key and value stacked into one
packed GEMM of codes and scales), on a Sequential whose Flatten → Linear is fused (the codes' columns
permuted), on SeedCNN, and on the transformer layers (in_proj_weight stays float); nn.linear.stack_linear
and packed_self_attention's w_scale, with their errors.

On the host everything runs linear_fp8's reference path. A quantised BERT in fp64 equals, to rounding, an
independent float64 BERT (tests/test_bert.py's numpy_bert) given weights quantised by ml_dtypes and each
dense layer's input sent through ml_dtypes' E4M3 round trip: the model's activations then reach the
quantiser as the same float32 values, so every code is the same. In fp32, against the same model
unquantised, the accuracy FP8 costs is measured and bounded (the test's docstring gives the figures).

On the GPU (marked `gpu`): the packed FP8 projection of packed_self_attention against the host reference
on the same fp16 input (the same codes, so fp16 tolerance); BERT quantised in fp16 (per channel and per
tensor) against the float model, eager and graphed; SeedCNN; and a MiniLM-shaped encoder (a Hugging Face
BertModel with random weights, and the real all-MiniLM-L6-v2 where the Hugging Face cache holds it),
whose FP8 sentence embeddings are printed and bounded by their cosine to the fp32 model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from libnn import dtypes, nn
from libnn.errors import LibnnError
from libnn.models.bert import BertEncoder
from libnn.models.seed_cnn import SeedCNN, load_heldout
from libnn.nn import functional
from libnn.nn.linear import StackedLinear, share_stacked, stack_linear
from libnn.ops.quantize_fp8 import quantize_weight
from conftest import random_normal, rel_error
from test_bert import TINY, inputs, numpy_bert, random_state, right_padded, write_checkpoint
from test_linear_fp8 import ml_dequantized

# FP8 against the float model, cosine similarity (1 - cos is about half the squared relative error):
# the token states and mean-pooled sentence embeddings, and pooler_output (tanh of a dense layer on the
# first token: one more GEMM, steeper).
MIN_COSINE = {"last_hidden_state": 0.99, "pooled": 0.99, "pooler_output": 0.97}
MINILM = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
          "intermediate_size": 1536, "max_position_embeddings": 512, "hidden_act": "gelu"}
MINILM_REPO = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_MIN_COSINE = 0.99


def cosine(a, b) -> float:
    a = np.asarray(a.get() if hasattr(a, "get") else a, np.float64).ravel()
    b = np.asarray(b.get() if hasattr(b, "get") else b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def host(a):
    return a.get() if hasattr(a, "get") else a


def cosines(got, expected, mask) -> dict[str, float]:
    """The cosine of `got`'s outputs to `expected`'s: the token states over every token, the smallest of
    the sentences' pooled embeddings, and of pooler_output in the rows whose first position (which it
    reads) is a token: an unpadded model leaves zeros at the padding, a padded one does not."""
    tokens = np.asarray(mask) != 0
    found = {"last_hidden_state": cosine(host(got.last_hidden_state)[tokens], host(expected.last_hidden_state)[tokens]),
             "pooled": min(cosine(a, b) for a, b in zip(host(got.pooled), host(expected.pooled)))}
    if got.pooler_output is not None:
        rows = tokens[:, 0]
        found["pooler_output"] = min(cosine(a, b) for a, b in zip(host(got.pooler_output)[rows],
                                                                    host(expected.pooler_output)[rows]))
    return found


def quantized_state(state, per_channel):
    """The BERT state with every dense weight (2-D, outside the embeddings) quantised and dequantised by
    ml_dtypes, in float64."""
    return {k: ml_dequantized(v, per_channel) if v.ndim == 2 and not k.startswith("embeddings.") else v
            for k, v in state.items()}


@pytest.fixture
def checkpoint(rng, tmp_path):
    """(directory, state) of tests/test_bert.py's tiny BERT (2 layers, hidden 32, 4 heads, a pooler)."""
    state = random_state(rng, TINY)
    return write_checkpoint(tmp_path / "bert", TINY, state), state


# --- BERT on the host ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantised_bert_in_fp64_is_the_fp8_computation_of_an_independent_bert(rng, checkpoint, per_channel):
    """The model quantised from its fp32 weights, then run in fp64, against numpy_bert on ml_dtypes'
    dequantised weights with every dense layer's input quantised as linear_fp8 does (one scale per
    call, max|x| / 448, in float32). Both are float64 from the same codes: they agree to rounding."""
    directory, state = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference").quantize("fp8", per_channel=per_channel)
    model.to("fp64")
    ids, types = inputs(rng, 3, 11)
    expected = numpy_bert(quantized_state(state, per_channel), TINY, ids, token_type_ids=types,
                          dense_input=ml_dequantized)
    out = model(ids, token_type_ids=types)
    for name, value in zip(("last_hidden_state", "pooled", "pooler_output"), expected):
        assert out[name].dtype == np.float64
        assert rel_error(out[name], value) <= 1e-12, name


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantised_bert_stays_close_to_the_float_model(rng, checkpoint, per_channel):
    """FP8 against the same model unquantised, fp32 on the host, right-padded batch. Measured over eight
    random tiny BERTs (weights N(0, 1/K): every sublayer's output as large as its residual, so each GEMM's
    FP8 error, about 3%, reaches the output): 1 - cos of the token states 0.8e-3 to 1.4e-3, of the pooled
    embeddings up to 2.3e-3, of pooler_output up to 9e-3; per tensor as per channel. Held to MIN_COSINE
    (0.99, 0.99, 0.97): about four times those."""
    directory, _ = checkpoint
    float_model = BertEncoder.from_pretrained(directory, path="reference")
    model = BertEncoder.from_pretrained(directory, path="reference").quantize("fp8", per_channel=per_channel)
    ids, types = inputs(rng, 3, 11)
    mask = right_padded([11, 6, 3], 11)
    found = cosines(model(ids, mask, types), float_model(ids, mask, types), mask)
    print(f"FP8 BERT cosine to fp32 ({'per channel' if per_channel else 'per tensor'}): "
          + ", ".join(f"{k} {v:.5f}" for k, v in found.items()))
    assert all(found[k] >= MIN_COSINE[k] for k in found), found


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantised_bert_packs_codes_and_scales_with_the_layers_as_views(checkpoint, per_channel):
    """After quantize, query/key/value hold codes and scales that are views of the packed ones; the
    packed scales are one per row, a per-tensor scale repeated over its layer's rows."""
    directory, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    attn = model.encoder.layer[1].attention.self
    floats = [layer.weight.copy() for layer in (attn.query, attn.key, attn.value)]
    model.quantize("fp8", per_channel=per_channel)
    qkv = attn.packed()
    assert isinstance(qkv, StackedLinear) and qkv.weight.dtype == np.uint8 and qkv.weight.shape == (96, 32)
    assert qkv.weight_scale.dtype == np.float32 and qkv.weight_scale.shape == (96,) and qkv.bias.shape == (96,)
    for i, (layer, w) in enumerate(zip((attn.query, attn.key, attn.value), floats)):
        rows = slice(32 * i, 32 * (i + 1))
        expected = quantize_weight(w, per_channel=per_channel)
        np.testing.assert_array_equal(qkv.weight[rows], expected.data)
        np.testing.assert_array_equal(qkv.weight_scale[rows], np.broadcast_to(expected.scale, (32,)))
        assert layer.weight_scale.shape == ((32,) if per_channel else (1,))
        for name, packed in (("weight", qkv.weight), ("bias", qkv.bias), ("weight_scale", qkv.weight_scale)):
            assert np.shares_memory(getattr(layer, name), packed), name
    assert attn.packed() is qkv  # nothing replaced: the same stack
    assert any("fp8" in line and "linear_fp8" in line for line in model.describe())


def test_quantised_bert_parameters_are_final_after_quantize(checkpoint):
    """quantize() packs the codes at once (as load and to() do): a forward pass replaces no parameter,
    which a CUDA graph capture relies on."""
    directory, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference").quantize("fp8")
    before = [id(v) for _, v in model.named_parameters()]
    model(np.arange(12).reshape(2, 6))
    assert [id(v) for _, v in model.named_parameters()] == before


def test_a_replaced_scale_or_weight_rebuilds_the_packed_codes(rng, checkpoint):
    """Replacing a layer's weight_scale (or loading a state) stacks again, and the output follows: the
    model with key's scales doubled equals numpy_bert with key's dequantised weight doubled."""
    directory, state = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference").quantize("fp8").to("fp64")
    attn = model.encoder.layer[0].attention.self
    old = attn.packed()
    attn.key.weight_scale = attn.key.weight_scale * 2
    assert attn.packed() is not old and np.shares_memory(attn.key.weight_scale, attn.packed().weight_scale)
    ids, types = inputs(rng, 2, 9)
    changed = quantized_state(state, True)
    changed["encoder.layer.0.attention.self.key.weight"] = changed["encoder.layer.0.attention.self.key.weight"] * 2
    expected = numpy_bert(changed, TINY, ids, token_type_ids=types, dense_input=ml_dequantized)
    assert rel_error(model(ids, token_type_ids=types).last_hidden_state, expected[0]) <= 1e-12
    # a quantised state loads into another quantised model, which packs it and gives the same output
    other = BertEncoder.from_pretrained(directory, path="reference").quantize("fp8").to("fp64")
    other.load_state_dict(model.state_dict())
    assert "encoder.layer.0.attention.self.key.weight_scale" in model.state_dict()
    np.testing.assert_array_equal(other(ids, token_type_ids=types).last_hidden_state,
                                  model(ids, token_type_ids=types).last_hidden_state)


def test_quantised_bert_moves_and_casts_keeping_its_codes(rng, checkpoint):
    """to("fp16") casts biases, norms and embeddings but keeps codes and scales; the packed weight is
    rebuilt from the same codes and the model runs in fp16 (the reference path on the host)."""
    directory, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference").quantize("fp8", per_channel=False)
    codes = model.encoder.layer[0].attention.self.packed().weight.copy()
    model.to("fp16")
    qkv = model.encoder.layer[0].attention.self.packed()
    np.testing.assert_array_equal(qkv.weight, codes)
    assert qkv.bias.dtype == np.float16 and qkv.weight_scale.dtype == np.float32
    ids, types = inputs(rng, 2, 7)
    assert model(ids, token_type_ids=types).last_hidden_state.dtype == np.float16


# --- stack_linear and packed_self_attention ---------------------------------------------------------------------
def test_stack_linear_stacks_mixed_scale_kinds_exactly(rng):
    """A per-channel and a per-tensor layer stack into one GEMM whose output is the two layers' outputs
    side by side (the activations quantised once, as each layer does for the same x)."""
    layers = [nn.Linear(24, 8, dtype="fp64", seed=1).quantize(), nn.Linear(24, 5, dtype="fp64", seed=2).quantize(
        per_channel=False)]
    x = random_normal(rng, (3, 24), "fp64")
    expected = np.concatenate([layer(x) for layer in layers], axis=1)
    stacked = stack_linear(layers)
    assert stacked.weight_scale.shape == (13,) and layers[1].weight_scale.shape == (1,)
    np.testing.assert_array_equal(stacked.weight_scale[8:], np.full(5, layers[1].weight_scale[0]))
    np.testing.assert_allclose(stacked(x), expected, rtol=1e-14, atol=1e-14)
    # the layers, views of the stack now, give what they gave
    np.testing.assert_array_equal(np.concatenate([layer(x) for layer in layers], axis=1), expected)
    assert stack_linear(layers, stacked) is stacked


def test_stack_linear_of_float_layers_has_no_scales_and_runs_linear(rng):
    layers = [nn.Linear(6, 4, bias=False, dtype="fp64", seed=i) for i in range(3)]
    x = random_normal(rng, (2, 6), "fp64")
    expected = np.concatenate([layer(x) for layer in layers], axis=1)
    stacked = stack_linear(layers)
    assert stacked.weight_scale is None and stacked.bias is None and stacked.weight.shape == (12, 6)
    np.testing.assert_allclose(stacked(x, "relu"), np.maximum(expected, 0), rtol=1e-14, atol=0)


def test_share_stacked_makes_the_layers_views_of_arrays_moved_whole(rng):
    """What a model moving its stacks to another device does: a copy of the stacked arrays, shared."""
    layers = [nn.Linear(8, 4, seed=1).quantize(per_channel=False), nn.Linear(8, 4, seed=2).quantize(per_channel=False)]
    stacked = stack_linear(layers)
    copies = [a.copy() for a in stacked[:3]]
    shared = share_stacked(layers, *copies)
    assert np.shares_memory(layers[1].weight, copies[0]) and np.shares_memory(layers[0].bias, copies[1])
    assert np.shares_memory(layers[1].weight_scale, copies[2]) and layers[1].weight_scale.shape == (1,)
    assert stack_linear(layers, shared) is shared and stack_linear(layers, stacked) is not stacked
    with pytest.raises(ValueError, match=r"^share_stacked: weight_scale must be \(8,\) for these 2 layers, got None"):
        share_stacked(layers, copies[0], copies[1])
    with pytest.raises(ValueError, match=r"^share_stacked: weight must be \(8, 8\) for these 2 layers, got \(4, 8\)"):
        share_stacked(layers, copies[0][:4], copies[1], copies[2])


@pytest.mark.parametrize("layers, match", [
    (lambda: [], r"layers must be a non-empty sequence of nn.Linear, got \[\]"),
    (lambda: [nn.Linear(4, 2), nn.LayerNorm(4)], r"layers must be a non-empty sequence of nn.Linear, got "
                                                 r"\['Linear', 'LayerNorm'\]"),
    (lambda: [nn.Linear(4, 2), nn.Linear(5, 2)], r"layers must agree on in_features to run as one GEMM, got \[4, 5\]"),
    (lambda: [nn.Linear(4, 2).quantize(), nn.Linear(4, 2)],
     r"layers must agree on quantized to run as one GEMM, got \['fp8', None\]"),
    (lambda: [nn.Linear(4, 2), nn.Linear(4, 2, bias=False)], r"layers must agree on bias .* got \[True, False\]"),
    (lambda: [nn.Linear(4, 2), nn.Linear(4, 2, dtype="fp16")],
     r"layers must agree on weight dtype .* got \['fp32', 'fp16'\]"),
    (lambda: [nn.Linear(4, 2).quantize(), nn.Linear(4, 2, dtype="fp16").quantize()],
     r"layers must agree on bias dtype .* got \['fp32', 'fp16'\]"),
], ids=["empty", "not-linear", "in-features", "quantised-and-float", "bias", "weight-dtype", "bias-dtype"])
def test_stack_linear_refuses_layers_that_cannot_share_a_gemm(layers, match):
    with pytest.raises((TypeError, ValueError), match=f"^stack_linear: {match}"):
        stack_linear(layers())


def test_stack_linear_refuses_layers_on_two_devices(monkeypatch):
    import libnn.runtime.arrays as arrays

    layers = [nn.Linear(4, 2), nn.Linear(4, 2)]
    monkeypatch.setattr(arrays, "place", lambda a: "gpu:0" if a is layers[1].weight else "cpu")
    with pytest.raises(LibnnError, match=r"^stack_linear: all arrays must be on one device, got .*layers\[1\]\.weight "
                                         r"on gpu:0"):
        stack_linear(layers)


def test_packed_self_attention_with_w_scale_is_the_three_fp8_projections(rng):
    """The packed FP8 projection equals q, k and v computed by their own quantised layers."""
    E, H = 16, 2
    layers = [nn.Linear(E, E, dtype="fp64", seed=i).quantize() for i in range(3)]
    x = random_normal(rng, (2, 5, E), "fp64")
    qkv = stack_linear(layers)
    got = functional.packed_self_attention(x, qkv.weight, qkv.bias, H, w_scale=qkv.weight_scale, path="reference")
    q, k, v = (layer(x).reshape(2, 5, H, E // H).transpose(0, 2, 1, 3) for layer in layers)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(E // H)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(2, 5, E)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("w_qkv, w_scale, match", [
    (np.ones((12, 4), np.float32), np.ones(12, np.float32),
     r"with w_scale, w_qkv must hold E4M3 codes \(uint8\), got dtype fp32"),
    (np.ones((12, 4), np.uint8), None,
     r"w_qkv holds uint8 codes \(a quantised weight\) but w_scale is None; pass the codes' float32 scales as w_scale"),
    (np.ones((12, 4), np.uint8), np.ones(12, np.float16),
     r"w_scale must be float32 of shape \(12,\) \(one scale per row of w_qkv\) or \(1,\), got dtype fp16 and shape "
     r"\(12,\)"),
    (np.ones((12, 4), np.uint8), np.ones(4, np.float32), r"w_scale must be float32 of shape \(12,\) .* got dtype fp32 "
                                                         r"and shape \(4,\)"),
    (np.ones((12, 4), np.uint8), 0.5, r"w_scale must be float32 of shape \(12,\) .* got float"),
], ids=["float-codes", "codes-without-scales", "scale-dtype", "scale-shape", "scale-not-an-array"])
def test_packed_self_attention_checks_codes_and_scales(w_qkv, w_scale, match):
    with pytest.raises(TypeError, match=f"^packed_self_attention: {match}"):
        functional.packed_self_attention(np.ones((2, 3, 4), np.float32), w_qkv, None, 2, w_scale=w_scale)


def test_packed_self_attention_refuses_scales_on_another_device(monkeypatch):
    class DeviceArray(np.ndarray):  # stands in for a CuPy array: is_cupy looks at the type
        pass

    monkeypatch.setattr(functional, "is_cupy", lambda a: isinstance(a, DeviceArray))
    with pytest.raises(TypeError, match="^packed_self_attention: x and w_scale must be on one device"):
        functional.packed_self_attention(np.ones((2, 3, 4), np.float32), np.ones((12, 4), np.uint8), None, 2,
                                         w_scale=np.ones(12, np.float32).view(DeviceArray))


def test_dense_runs_fp8_on_a_path_linear_fp8_has(rng):
    """A model-wide "cudnn" reaches the FP8 GEMM as auto (linear_fp8 has no cudnn path), as
    Linear.quantize sets it."""
    layer = nn.Linear(8, 4, seed=0).quantize()
    x = random_normal(rng, (2, 8), "fp32")
    np.testing.assert_array_equal(functional.dense(x, layer.weight, layer.bias, w_scale=layer.weight_scale,
                                                   path="cudnn"), layer(x))
    assert functional.fp8_path("cudnn") == "auto" and functional.fp8_path("custom") == "custom"


# --- Sequential (Flatten → Linear fused) and SeedCNN -------------------------------------------------------------
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_flatten_linear_permutes_the_codes_and_matches_the_layers_one_by_one(rng, per_channel, activation):
    """The fused FlattenLinear multiplies the NHWC activation by the codes with their columns permuted
    (scales per row unchanged): the same values as Flatten's transpose then the quantised Linear."""
    fc = nn.Linear(4 * 3 * 5, 7, dtype="fp64", seed=2)
    layers = [nn.Flatten(), fc] + ([nn.ReLU()] if activation else [])
    model = nn.Sequential(*layers).quantize("fp8", per_channel=per_channel)
    assert type(model.fused()[0][1]).__name__ == "FlattenLinear"
    x = rng.standard_normal((2, 4, 3, 5))  # NHWC
    expected = x
    for layer in layers:
        expected = layer(expected)
    assert fc.weight.dtype == np.uint8 and rel_error(model(x), expected) <= 1e-14
    assert set(model.state_dict()) == {"1.weight", "1.bias", "1.weight_scale"}


def test_a_quantised_linear_takes_a_following_activation_into_its_epilogue(rng):
    layers = [nn.Linear(4, 6, dtype="fp64", seed=1), nn.ReLU(), nn.Linear(6, 3, dtype="fp64", seed=2), nn.SiLU()]
    model = nn.Sequential(*layers).quantize("fp8")
    assert [type(m).__name__ for _, m in model.fused()] == ["_WithActivation", "Linear", "SiLU"]
    x = rng.standard_normal((5, 4))
    expected = x
    for layer in layers:
        expected = layer(expected)
    np.testing.assert_array_equal(model(x), expected)


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantised_seed_cnn_classifies_the_heldout_digits_as_the_float_one(per_channel):
    """SeedCNN with its two Linear layers in FP8 (fc1 through the fused Flatten → Linear): measured on
    the 360 held-out digits, fp32 on the host, every prediction the float model's (100% accuracy) and
    log-probabilities within 1.5% relative L2 of the float model's. Held to 98% agreement, 95%
    accuracy (the float model's own bound in test_seed_cnn.py) and 5%."""
    images, labels = load_heldout()
    expected = SeedCNN.pretrained()(images)
    model = SeedCNN.pretrained().quantize("fp8", per_channel=per_channel)
    assert model.classifier[1].weight.dtype == np.uint8 and model.features[0].weight.dtype == np.float32
    got = model(images)
    agreement = float(np.mean(got.argmax(1) == expected.argmax(1)))
    accuracy = float(np.mean(got.argmax(1) == labels))
    error = rel_error(got, expected)
    print(f"FP8 SeedCNN ({'per channel' if per_channel else 'per tensor'}): agreement {agreement:.4f}, accuracy "
          f"{accuracy:.4f}, log-probabilities relative L2 {error:.4f}")
    assert agreement >= 0.98 and accuracy >= 0.95 and error <= 0.05


# --- transformer layers -------------------------------------------------------------------------------------------
def test_quantised_transformer_layer_keeps_in_proj_float_and_stays_close(rng):
    """out_proj, linear1 and linear2 become FP8; in_proj_weight, MultiheadAttention's own parameter, keeps
    its dtype, and self- and cross-attention still run."""
    def layer():
        return nn.TransformerEncoderLayer(32, 4, 64, activation="gelu", seed=3)
    x = random_normal(rng, (2, 7, 32), "fp32")
    expected = layer()(x)
    quantised = layer().quantize("fp8")
    attn = quantised.self_attn
    assert attn.in_proj_weight.dtype == np.float32 and attn.in_proj_bias.dtype == np.float32
    assert [m.weight.dtype for m in (attn.out_proj, quantised.linear1, quantised.linear2)] == [np.uint8] * 3
    assert cosine(quantised(x), expected) >= 0.99
    kv = random_normal(rng, (2, 4, 32), "fp32")
    float_attn = layer().self_attn
    assert cosine(attn(x, kv, kv)[0], float_attn(x, kv, kv)[0]) >= 0.99


# --- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [True, False])
def test_packed_fp8_projection_on_the_gpu_matches_the_host_reference(rng, per_channel):
    """packed_self_attention with w_scale on the GPU (linear_fp8 on cuBLASLt, attention on cuDNN) against
    the reference path on the same fp16 input: the quantiser gives the same codes on both (bit for bit,
    test_linear_fp8_gpu.py), so they differ by fp32 accumulation and fp16 rounding: fp16 tolerance."""
    import cupy

    E, H = 64, 4
    layers = [nn.Linear(E, E, dtype="fp16", seed=i).quantize(per_channel=per_channel) for i in range(3)]
    qkv = stack_linear(layers)
    x = random_normal(rng, (3, 17, E), "fp16")
    expected = functional.packed_self_attention(x, qkv.weight, qkv.bias, H, w_scale=qkv.weight_scale, path="reference")
    got = functional.packed_self_attention(cupy.asarray(x), *(cupy.asarray(a) for a in qkv[:2]), H,
                                           w_scale=cupy.asarray(qkv.weight_scale))
    assert got.dtype == cupy.float16
    assert rel_error(got, expected) <= dtypes.TOLERANCE["fp16"]


@pytest.mark.gpu
@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_quantised_bert_on_the_gpu_stays_close_to_the_float_model(rng, checkpoint, dtype, per_channel, unpad,
                                                                monkeypatch):
    """BERT quantised on the GPU (codes made there, the packed QKV GEMM on linear_fp8) against the fp32
    model on the host, right- and left-padded; unpad packs these small batches (as test_bert.py's
    pack_small_batches). The same bounds as on the host (MIN_COSINE): fp16/bf16 rounding adds little to
    FP8's."""
    import cupy

    from libnn.models import bert

    monkeypatch.setattr(bert, "PACK_FROM_FLOPS", 1)
    directory, _ = checkpoint
    float_model = BertEncoder.from_pretrained(directory, path="reference")
    model = BertEncoder.from_pretrained(directory, dtype=dtype, device="gpu", unpad=unpad)
    model.quantize("fp8", per_channel=per_channel)
    qkv = model.encoder.layer[0].attention.self.packed()
    assert isinstance(qkv.weight, cupy.ndarray) and qkv.weight.dtype == cupy.uint8
    ids, types = inputs(rng, 4, 24)
    right = right_padded([24, 9, 1, 16], 24)
    for mask in (right, right[:, ::-1].copy()):
        out = model(cupy.asarray(ids), cupy.asarray(mask), cupy.asarray(types))
        assert out.last_hidden_state.dtype == dtypes.parse(dtype)
        found = cosines(out, float_model(ids, mask, types), mask)
        print(f"FP8 BERT on the GPU ({dtype}, {'per channel' if per_channel else 'per tensor'}, unpad={unpad}) "
              "cosine to fp32: " + ", ".join(f"{k} {v:.5f}" for k, v in found.items()))
        assert all(found[k] >= MIN_COSINE[k] for k in found), found


@pytest.mark.gpu
def test_quantised_bert_graphed_matches_eager(rng, checkpoint):
    """A captured FP8 BERT replays as it runs eagerly: the activations' scales are computed on the GPU at
    every replay, and the packed codes were final before the capture."""
    import cupy

    directory, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, dtype="fp16", device="gpu").quantize("fp8")
    graphed = model.graphed()
    ids, types = (cupy.asarray(a) for a in inputs(rng, 3, 16))
    for lengths in ([16, 5, 9], [16, 12, 1]):
        mask = cupy.asarray(right_padded(lengths, 16))
        got = graphed(ids, mask, types).last_hidden_state.copy()
        assert rel_error(got, model(ids, mask, types).last_hidden_state.get()) < dtypes.TOLERANCE["fp16"]


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantised_seed_cnn_on_the_gpu_classifies_as_the_float_one(per_channel):
    """fp16 on the GPU, the same bounds as on the host."""
    import cupy

    images, labels = load_heldout()
    expected = SeedCNN.pretrained()(images)
    model = SeedCNN.pretrained(dtype="fp16", device="gpu").quantize("fp8", per_channel=per_channel)
    got = model(cupy.asarray(images)).get().astype(np.float32)
    agreement = float(np.mean(got.argmax(1) == expected.argmax(1)))
    accuracy = float(np.mean(got.argmax(1) == labels))
    print(f"FP8 SeedCNN on the GPU (fp16): agreement {agreement:.4f}, accuracy {accuracy:.4f}, "
          f"log-probabilities relative L2 {rel_error(got, expected):.4f}")
    assert agreement >= 0.98 and accuracy >= 0.95 and rel_error(got, expected) <= 0.05


def sentence_cosines(directory, ids, mask) -> dict[str, float]:
    """The encoder of `directory` in fp16 with FP8 weights against it in fp32, both on the GPU: the
    cosine of the token states over the tokens, and the smallest over the sentences of the mean-pooled
    embeddings (sentence-transformers' sentence embedding, before its normalisation)."""
    import cupy

    reference = BertEncoder.from_pretrained(directory, dtype="fp32", device="gpu")
    model = BertEncoder.from_pretrained(directory, dtype="fp16", device="gpu").quantize("fp8")
    ids, mask = cupy.asarray(ids), cupy.asarray(mask)
    return cosines(model(ids, mask), reference(ids, mask), host(mask))


@pytest.mark.gpu
def test_minilm_shaped_encoder_fp8_embeddings_against_fp32(rng, tmp_path):
    """A MiniLM-L6-shaped Hugging Face BertModel (6 layers, hidden 384, 12 heads, FFN 1536) with its
    random initial weights (transformers' N(0, 0.02)), saved by transformers and loaded by libnn: FP8
    embeddings (fp16 activations) printed and held to a cosine of MINILM_MIN_COSINE (0.99) to fp32. On
    the host's reference path (torch 2.13 CPU, transformers 5.24), fp32 or fp16 activations, these
    inputs gave 1 - cos 2.9e-4 for the token states and 3.8e-4 for the worst sentence."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**MINILM), add_pooling_layer=False).save_pretrained(tmp_path)
    ids = rng.integers(1000, MINILM["vocab_size"], (8, 64))
    mask = right_padded([64, 50, 33, 20, 12, 8, 5, 2], 64)
    found = sentence_cosines(tmp_path, ids, mask)
    print("FP8 MiniLM-shaped encoder (random weights), cosine to fp32: "
          + ", ".join(f"{k} {v:.5f}" for k, v in found.items()))
    assert all(v >= MINILM_MIN_COSINE for v in found.values()), found


@pytest.mark.gpu
def test_real_minilm_fp8_sentence_embeddings_against_fp32():
    """all-MiniLM-L6-v2 from the local Hugging Face cache (nothing is downloaded: skipped where it is not
    cached), on a few sentences tokenised by its own tokenizer: FP8 sentence embeddings printed and held
    to a cosine of MINILM_MIN_COSINE (0.99) to fp32's."""
    hub = pytest.importorskip("huggingface_hub")
    transformers = pytest.importorskip("transformers")
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        directory = Path(hub.snapshot_download(MINILM_REPO, local_files_only=True))
    except LocalEntryNotFoundError:
        pytest.skip(f"{MINILM_REPO} is not in the local Hugging Face cache")
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (directory / name).exists()]
    if missing:
        pytest.skip(f"the cached {MINILM_REPO} lacks {missing}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    sentences = ["A man is eating food.", "The new movie is awesome, the best I have seen this year.",
                 "GPU kernels read the weights once per token when decoding.", "Hi",
                 "Two dogs are playing in the snow near a frozen lake while children watch from the hill."]
    batch = tokenizer(sentences, padding=True, return_tensors="np")
    found = sentence_cosines(directory, batch["input_ids"], batch["attention_mask"])
    print(f"FP8 {MINILM_REPO}, cosine to fp32: " + ", ".join(f"{k} {v:.5f}" for k, v in found.items()))
    assert all(v >= MINILM_MIN_COSINE for v in found.values()), found
