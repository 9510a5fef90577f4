"""BertEncoder from Hugging Face-style checkpoints written here (config.json + model.safetensors through
safetensors' NumPy API): the reference path against a float64 NumPy BERT written in this file, the
padding masks (right padding → sequence lengths, anything else → bias), key handling (prefix, task
heads, gamma/beta) and its errors, config and input errors, the fused QKV weight; on the GPU, fp32 and
fp16 against the reference path and against transformers.BertModel when it is installed."""

import json
import math

import numpy as np
import pytest
from conftest import random_normal, rel_error

from libnn import dtypes
from libnn.models.bert import BertConfig, BertEncoder
from libnn.nn import functional

TINY = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 100, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "hidden_act": "gelu",
        "max_position_embeddings": 40, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "position_embedding_type": "absolute", "initializer_range": 0.02}


def random_state(rng, config, pooler=True):
    """A BertModel state dict under Hugging Face's key names, float32, values of a size that makes
    every term of the forward pass count."""
    Hd, I, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    shapes = {"embeddings.word_embeddings.weight": (config["vocab_size"], Hd),
              "embeddings.position_embeddings.weight": (config["max_position_embeddings"], Hd),
              "embeddings.token_type_embeddings.weight": (config["type_vocab_size"], Hd),
              "embeddings.LayerNorm.weight": (Hd,), "embeddings.LayerNorm.bias": (Hd,)}
    for i in range(L):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes |= {f"{p}attention.self.{name}.weight": (Hd, Hd), f"{p}attention.self.{name}.bias": (Hd,)}
        shapes |= {f"{p}attention.output.dense.weight": (Hd, Hd), f"{p}attention.output.dense.bias": (Hd,),
                   f"{p}attention.output.LayerNorm.weight": (Hd,), f"{p}attention.output.LayerNorm.bias": (Hd,),
                   f"{p}intermediate.dense.weight": (I, Hd), f"{p}intermediate.dense.bias": (I,),
                   f"{p}output.dense.weight": (Hd, I), f"{p}output.dense.bias": (Hd,),
                   f"{p}output.LayerNorm.weight": (Hd,), f"{p}output.LayerNorm.bias": (Hd,)}
    if pooler:
        shapes |= {"pooler.dense.weight": (Hd, Hd), "pooler.dense.bias": (Hd,)}
    state = {}
    for key, shape in shapes.items():
        if key.endswith("LayerNorm.weight"):
            state[key] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif "embeddings" in key:
            state[key] = random_normal(rng, shape, "fp32")
        else:
            state[key] = random_normal(rng, shape, "fp32", 1 / math.sqrt(shape[-1]) if len(shape) == 2 else 0.3)
    return state


def write_checkpoint(directory, config, state):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


@pytest.fixture
def checkpoint(rng, tmp_path):
    """(directory, config, state) of a tiny BERT with a pooler."""
    state = random_state(rng, TINY)
    return write_checkpoint(tmp_path / "bert", TINY, state), TINY, state


# --- an independent float64 BERT --------------------------------------------------------------------
def erf(v):
    return np.vectorize(math.erf, otypes=[np.float64])(v)


NUMPY_ACTS = {"gelu": lambda v: 0.5 * v * (1 + erf(v / math.sqrt(2))),
              "gelu_new": lambda v: 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))),
              "relu": lambda v: np.maximum(v, 0)}


def numpy_bert(state, config, input_ids, attention_mask=None, token_type_ids=None, dense_input=None):
    """Hugging Face's BertModel forward in float64, from the state dict's keys: returns
    (last_hidden_state, mean-pooled over the mask, pooler_output or None). `dense_input`, a function,
    maps each dense layer's input before its product (tests/test_fp8_models.py: the E4M3 round trip)."""
    g = {k: np.asarray(v, np.float64) for k, v in state.items()}
    B, S = input_ids.shape
    Hd, nh = config["hidden_size"], config["num_attention_heads"]
    hd, eps, act = Hd // nh, config["layer_norm_eps"], NUMPY_ACTS[config["hidden_act"]]
    mask = np.ones((B, S)) if attention_mask is None else np.asarray(attention_mask, np.float64)
    types = np.zeros((B, S), np.int64) if token_type_ids is None else token_type_ids

    def ln(x, p):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * g[p + ".weight"] + g[p + ".bias"]

    def dense(x, p):
        return (x if dense_input is None else dense_input(x)) @ g[p + ".weight"].T + g[p + ".bias"]

    x = (g["embeddings.word_embeddings.weight"][input_ids] + g["embeddings.position_embeddings.weight"][:S]
         + g["embeddings.token_type_embeddings.weight"][types])
    x = ln(x, "embeddings.LayerNorm")
    masked = (mask == 0)[:, None, None, :]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (dense(x, f"{p}attention.self.{n}").reshape(B, S, nh, hd).transpose(0, 2, 1, 3)
                   for n in ("query", "key", "value"))
        scores = np.where(masked, -np.inf, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd))
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        ctx = (weights / weights.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(B, S, Hd)
        x = ln(dense(ctx, f"{p}attention.output.dense") + x, f"{p}attention.output.LayerNorm")
        x = ln(dense(act(dense(x, f"{p}intermediate.dense")), f"{p}output.dense") + x, f"{p}output.LayerNorm")
    pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
    pooler = np.tanh(dense(x[:, 0], "pooler.dense")) if "pooler.dense.weight" in g else None
    return x, pooled, pooler


def inputs(rng, B, S, config=TINY):
    ids = rng.integers(0, config["vocab_size"], (B, S))
    types = rng.integers(0, config["type_vocab_size"], (B, S))
    return ids, types


def right_padded(lengths, S):
    return (np.arange(S)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)


def assert_matches(out, expected, tol, mask=None):
    """out against (hidden, pooled, pooler) at the tokens `mask` marks (every position without one):
    unpadded models leave zeros at the padding, so pooler_output, which reads the first position, is
    compared in the rows whose first position is a token."""
    hidden, pooled, pooler = expected
    tokens = np.ones(hidden.shape[:2], bool) if mask is None else np.asarray(mask) != 0
    assert rel_error(at(out.last_hidden_state, tokens), hidden[tokens]) < tol
    assert rel_error(out.pooled, pooled) < tol
    if pooler is None:
        assert out.pooler_output is None
    else:
        rows = tokens[:, 0]
        assert rel_error(at(out.pooler_output, rows), pooler[rows]) < tol


def at(a, where):
    """a[where] for host or GPU arrays (`where` on the host)."""
    return (a.get() if hasattr(a, "get") else a)[where]


# --- CPU: reference path against NumPy --------------------------------------------------------------
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_bert_reference_matches_numpy_bert(rng, tmp_path, hidden_act):
    config = TINY | {"hidden_act": hidden_act}
    state = random_state(rng, config)
    model = BertEncoder.from_pretrained(write_checkpoint(tmp_path, config, state), path="reference")
    ids, types = inputs(rng, 3, 11)
    out = model(ids, token_type_ids=types)
    assert out.last_hidden_state.shape == (3, 11, 32) and out.last_hidden_state.dtype == np.float32
    assert out.pooled.shape == (3, 32) and out.pooler_output.shape == (3, 32)
    assert out["pooled"] is out.pooled
    assert_matches(out, numpy_bert(state, config, ids, token_type_ids=types), 1e-5)


def test_bert_reference_fp64_has_no_hidden_rounding(rng, checkpoint):
    directory, config, state = checkpoint
    model = BertEncoder.from_pretrained(directory, dtype="fp64", path="reference")
    ids, types = inputs(rng, 2, 9)
    out = model(ids, right_padded([9, 4], 9), types)
    assert out.last_hidden_state.dtype == np.float64
    assert_matches(out, numpy_bert(state, config, ids, right_padded([9, 4], 9), types), 1e-10, right_padded([9, 4], 9))


def test_bert_right_padding_runs_as_sequence_lengths(rng, checkpoint, monkeypatch):
    directory, config, state = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    calls = []
    real = functional.attention
    monkeypatch.setattr(functional, "attention", lambda q, k, v, **kw: calls.append(kw) or real(q, k, v, **kw))
    ids, types = inputs(rng, 3, 12)
    mask = right_padded([12, 5, 1], 12)
    out = model(ids, mask, types)
    assert calls[0]["seq_lens_kv"].lengths.tolist() == [12, 5, 1] and calls[0]["attn_bias"] is None
    assert_matches(out, numpy_bert(state, config, ids, mask, types), 1e-5, mask)
    model(ids, np.ones_like(mask), types)
    assert calls[-1]["seq_lens_kv"] is None and calls[-1]["attn_bias"] is None  # nothing padded: no mask


def test_bert_other_masks_run_as_bias(rng, checkpoint, monkeypatch):
    directory, config, state = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    calls = []
    real = functional.attention
    monkeypatch.setattr(functional, "attention", lambda q, k, v, **kw: calls.append(kw) or real(q, k, v, **kw))
    ids, types = inputs(rng, 3, 10)
    left = right_padded([10, 6, 2], 10)[:, ::-1].astype(bool)  # left padding, and a boolean mask
    out = model(ids, left, types)
    # left padding: every row's last token is real, so the lengths are full and the bias masks the holes
    assert calls[0]["seq_lens_kv"].lengths.tolist() == [10] * 3 and calls[0]["attn_bias"].bias.shape == (3, 1, 1, 10)
    assert_matches(out, numpy_bert(state, config, ids, left, types), 1e-5, left)
    holes = (rng.random((3, 10)) < 0.7).astype(np.int32)
    holes[:, 3] = 1
    assert_matches(model(ids, holes, types), numpy_bert(state, config, ids, holes, types), 1e-5, holes)


def test_bert_row_without_tokens_attends_to_its_first_position_and_leaves_the_others(rng, checkpoint, monkeypatch):
    """An all-padding row: the attention gets lengths of at least 1, vouched nonempty (so the GPU zeroes
    no batch entry after each layer), the row's hidden states are finite and its pooled embedding zeros;
    the rows with tokens are what they are without it (and Hugging Face's). Hugging Face attends to every
    position of such a row, libnn to its first: neither is compared there."""
    directory, config, state = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference", unpad=False)
    calls = []
    real = functional.attention
    monkeypatch.setattr(functional, "attention", lambda q, k, v, **kw: calls.append(kw) or real(q, k, v, **kw))
    ids, types = inputs(rng, 3, 10)
    for mask in (right_padded([10, 0, 4], 10), right_padded([10, 0, 4], 10)[:, ::-1].copy()):
        out = model(ids, mask, types)
        lens = calls[-1]["seq_lens_kv"]
        assert lens.nonempty and lens.lengths[1] == 1
        assert np.all(np.isfinite(out.last_hidden_state)) and not out.pooled[1].any()
        rows = [0, 2]
        alone = model(ids[rows], mask[rows], types[rows])
        for name in ("last_hidden_state", "pooled", "pooler_output"):
            np.testing.assert_allclose(out[name][rows], alone[name], rtol=1e-6, atol=1e-6)
        hidden, pooled, pooler = numpy_bert(state, config, ids[rows], mask[rows], types[rows])
        assert_matches(alone, (hidden, pooled, pooler), 1e-5, mask[rows])


@pytest.fixture
def pack_small_batches(monkeypatch):
    """Small test batches packed as large ones are (PACK_FROM_FLOPS keeps them padded)."""
    from libnn.models import bert

    monkeypatch.setattr(bert, "PACK_FROM_FLOPS", 1)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("B, S", [(1, 1), (1, 13), (5, 17), (3, 40)])
def test_bert_unpadded_equals_padded_at_the_tokens_and_zeros_at_the_padding(rng, checkpoint, B, S, ragged,
                                                                          pack_small_batches, monkeypatch):
    """unpad=True (packed tokens) gives unpad=False's values at every token, for right padding,
    holes, a row without tokens and a full row; pooled unchanged. The attention
    on the packed sequences (ragged: layout THD, the GPU's choice for fp16/bf16) or on q, k and v
    unpacked for it."""
    monkeypatch.setattr(BertEncoder, "_ragged_attention", lambda self: ragged)
    directory, _, _ = checkpoint
    packed = BertEncoder.from_pretrained(directory, dtype="fp64", path="reference")
    padded = BertEncoder.from_pretrained(directory, dtype="fp64", path="reference", unpad=False)
    ids, types = inputs(rng, B, S)
    lengths = rng.integers(0, S + 1, B)
    lengths[0] = max(1, S // 3)
    holes = (rng.random((B, S)) < 0.6).astype(np.int64)
    for mask in (right_padded(lengths, S), holes, np.zeros((B, S), np.int64), np.ones((B, S), np.int64)):
        got, expected = packed(ids, mask, types), padded(ids, mask, types)
        tokens = mask != 0
        np.testing.assert_allclose(got.last_hidden_state[tokens], expected.last_hidden_state[tokens], rtol=1e-12,
                                   atol=1e-12)
        np.testing.assert_allclose(got.pooled, expected.pooled, rtol=1e-12, atol=1e-12)


def test_bert_packs_only_when_it_saves_positions(rng, checkpoint, monkeypatch):
    """The layers see packed rows (2-D) for a well-padded batch whose padded pass takes PACK_FROM_FLOPS
    or more, and the padded (B, S, H) layout for a nearly full one, a smaller one, or with unpad=False."""
    from libnn.models import bert

    directory, _, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    shapes = []
    real = model.encoder.layer[0].forward
    monkeypatch.setattr(model.encoder.layer[0], "forward", lambda x, *a: shapes.append(x.shape) or real(x, *a))
    ids, types = inputs(rng, 4, 32)
    model(ids, right_padded([32, 3, 9, 1], 32), types)
    flops = BertConfig.from_dict(TINY).flops_per_token
    monkeypatch.setattr(bert, "PACK_FROM_FLOPS", 128 * flops)
    packed = model(ids, right_padded([32, 3, 9, 1], 32), types).last_hidden_state
    assert not packed[right_padded([32, 3, 9, 1], 32) == 0].any()  # packed: zeros at the padding
    model(ids, right_padded([32, 32, 32, 31], 32), types)
    model.unpad = False
    model(ids, right_padded([32, 3, 9, 1], 32), types)
    assert shapes == [(4, 32, 32), (48, 32), (4, 32, 32), (4, 32, 32)]


def test_bert_max_tokens_below_the_count_is_refused(rng, checkpoint):
    directory, _, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    ids, types = inputs(rng, 2, 8)
    with pytest.raises(ValueError, match="attention_mask holds 9 tokens but max_tokens is 8"):
        model(ids, right_padded([8, 1], 8), types, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens"):
        model(ids, right_padded([8, 1], 8), types, max_tokens=0)
    got = model(ids, right_padded([8, 1], 8), types, max_tokens=9).last_hidden_state  # packed, as asked
    tokens = right_padded([8, 1], 8) == 1
    np.testing.assert_array_equal(got[tokens], model(ids, right_padded([8, 1], 8), types).last_hidden_state[tokens])
    assert not got[~tokens].any()


def test_token_bucket_covers_the_count_within_an_eighth():
    from libnn.nn.graphs import token_bucket

    for tokens in [0, 1, 15, 16, 17, 100, 1000, 4097, 17000, 32768]:
        bucket = token_bucket(tokens, 10**6)
        assert tokens <= bucket <= max(16, tokens * 9 // 8 + 16)
    assert token_bucket(17000, 16384) == 16384  # never past every position
    assert len({token_bucket(t, 10**6) for t in range(8192, 16384)}) <= 16


def test_bert_padded_sequence_equals_it_alone(rng, checkpoint):
    """The tokens of a padded row give what the unpadded sequence gives, and padding does not enter
    its mean-pooled embedding."""
    directory, _, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    ids, types = inputs(rng, 2, 14)
    batch = model(ids, right_padded([14, 6], 14), types)
    alone = model(ids[1:, :6], token_type_ids=types[1:, :6])
    assert rel_error(batch.last_hidden_state[1, :6], alone.last_hidden_state[0]) < 1e-6
    assert rel_error(batch.pooled[1], alone.pooled[0]) < 1e-6
    assert rel_error(batch.pooler_output[1], alone.pooler_output[0]) < 1e-6


def test_bert_prefixed_checkpoint_with_task_heads_loads_and_reports(rng, tmp_path, checkpoint):
    directory, config, state = checkpoint
    heads = {"cls.predictions.bias": np.zeros(100, np.float32),
             "cls.predictions.transform.dense.weight": np.zeros((32, 32), np.float32),
             "classifier.weight": np.zeros((3, 32), np.float32), "qa_outputs.bias": np.zeros(2, np.float32),
             "bert.embeddings.position_ids": np.arange(40, dtype=np.int64)[None]}
    prefixed = {f"bert.{k}": v for k, v in state.items()} | heads
    model = BertEncoder.from_pretrained(write_checkpoint(tmp_path / "prefixed", config, prefixed), path="reference")
    assert model.load_report.prefix_stripped == "bert."
    assert model.load_report.ignored == sorted(heads)
    assert any("ignored 5" in line and "classifier.weight" in line for line in model.describe())
    ids, types = inputs(rng, 2, 7)
    plain = BertEncoder.from_pretrained(directory, path="reference")
    assert rel_error(model(ids, token_type_ids=types).last_hidden_state,
                     plain(ids, token_type_ids=types).last_hidden_state) == 0


def test_bert_reads_gamma_beta_and_sharded_checkpoints(rng, tmp_path, checkpoint):
    from safetensors.numpy import save_file

    directory, config, state = checkpoint
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in state.items()}
    model = BertEncoder.from_pretrained(write_checkpoint(tmp_path / "old", config, old), path="reference")
    assert len(model.load_report.renamed) == 2 + 4 * config["num_hidden_layers"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(config))
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, str(sharded / name))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: name for name, part in shards.items() for k in part}}))
    ids, types = inputs(rng, 2, 5)
    expected = BertEncoder.from_pretrained(directory, path="reference")(ids, token_type_ids=types).last_hidden_state
    for m in (model, BertEncoder.from_pretrained(sharded, path="reference")):
        assert rel_error(m(ids, token_type_ids=types).last_hidden_state, expected) == 0


def test_bert_without_pooler_has_no_pooler_output(rng, tmp_path):
    state = random_state(rng, TINY, pooler=False)
    model = BertEncoder.from_pretrained(write_checkpoint(tmp_path, TINY, state), path="reference")
    ids, _ = inputs(rng, 2, 6)
    out = model(ids)
    assert out.pooler_output is None and model.pooler is None
    assert_matches(out, numpy_bert(state, TINY, ids), 1e-5)


def test_bert_state_dict_keys_and_packed_qkv(rng, checkpoint):
    directory, config, state = checkpoint
    model = BertEncoder.from_pretrained(directory, path="reference")
    assert set(model.state_dict()) == set(state)
    attn = model.encoder.layer[0].attention.self
    w, b = attn.packed()[:2]
    assert w.shape == (96, 32) and b.shape == (96,)
    assert np.shares_memory(attn.key.weight, w) and np.array_equal(attn.key.weight, state[
        "encoder.layer.0.attention.self.key.weight"])
    lines = model.describe()
    assert any("query+key+value fused into one packed (96x32) GEMM" in line for line in lines)
    assert any("intermediate.dense" in line and "gelu_erf" in line for line in lines)
    # replacing a weight rebuilds the packed one
    changed = dict(state)
    changed["encoder.layer.1.attention.self.value.weight"] = state["encoder.layer.1.attention.self.value.weight"] * 2
    model.load_state_dict(changed)
    ids, types = inputs(rng, 2, 8)
    assert_matches(model(ids, token_type_ids=types), numpy_bert(changed, config, ids, token_type_ids=types), 1e-5)


def test_bert_mismatched_checkpoint_names_the_keys(rng, tmp_path, checkpoint):
    _, config, state = checkpoint
    missing = {k: v for k, v in state.items() if k != "encoder.layer.1.output.dense.bias"}
    with pytest.raises(KeyError, match=r"missing keys \['encoder.layer.1.output.dense.bias'\]"):
        BertEncoder.from_pretrained(write_checkpoint(tmp_path / "a", config, missing))
    extra = state | {"encoder.layer.2.output.dense.bias": state["encoder.layer.1.output.dense.bias"],
                     "lm_head.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(KeyError, match=r"unexpected keys \['encoder.layer.2.output.dense.bias', 'lm_head.weight'\]"):
        BertEncoder.from_pretrained(write_checkpoint(tmp_path / "b", config, extra))
    wrong = state | {"encoder.layer.0.intermediate.dense.weight": np.zeros((48, 32), np.float32)}
    with pytest.raises(ValueError, match=r"intermediate.dense.weight has shape \(48, 32\), the layer expects \(64, 32\)"):
        BertEncoder.from_pretrained(write_checkpoint(tmp_path / "c", config, wrong))
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "config.json").write_text(json.dumps(config))
        (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"")
        BertEncoder.from_pretrained(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        BertEncoder.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("change,message", [
    ({"model_type": "roberta"}, r"model_type 'roberta' is not supported \(supported: \['bert'\]\)"),
    ({"hidden_act": "swish"}, "hidden_act 'swish' is not supported"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key' is not supported"),
    ({"is_decoder": True}, "decoder"),
    ({"embedding_size": 16}, "embedding_size 16 differs from hidden_size 32"),
    ({"num_attention_heads": 5}, "hidden_size 32 is not a multiple of num_attention_heads 5"),
    ({"hidden_size": None}, r"lacks \['hidden_size'\]"),
])
def test_bert_unsupported_configs_are_refused(rng, tmp_path, change, message):
    config = {k: v for k, v in (TINY | change).items() if v is not None}
    write_checkpoint(tmp_path, config, random_state(rng, TINY))
    with pytest.raises(ValueError, match=message):
        BertEncoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("args,message", [
    ((np.zeros(5, np.int64),), r"input_ids must be 2-D \(batch, seq_len\), got shape \(5,\); for one sequence"),
    ((np.zeros((2, 5), np.float32),), "input_ids must hold integers, got dtype float32"),
    ((np.full((2, 5), 100),), r"input_ids must lie in \[0, 100\) \(vocab_size 100\), got values from 100 to 100"),
    ((np.full((2, 5), -1),), r"input_ids must lie in \[0, 100\)"),
    ((np.zeros((1, 41), np.int64),), "has 41 tokens per sequence but the model has 40 positions"),
    ((np.zeros((2, 5), np.int64), np.ones((2, 4), np.int64)), r"attention_mask must have input_ids' shape \(2, 5\)"),
    ((np.zeros((2, 5), np.int64), np.ones((2, 5), np.float32)), "attention_mask must be boolean or integer"),
    ((np.zeros((2, 5), np.int64), None, np.full((2, 5), 2)), r"token_type_ids must lie in \[0, 2\) \(type_vocab_size"),
    ((np.zeros((2, 5), np.int64), None, np.zeros((2, 4), np.int64)), r"token_type_ids must have input_ids' shape"),
])
def test_bert_rejects_bad_inputs(checkpoint, args, message):
    model = BertEncoder.from_pretrained(checkpoint[0], path="reference")
    with pytest.raises((ValueError, TypeError), match=message):
        model(*args)


def test_bert_config_defaults_follow_hugging_face():
    c = BertConfig.from_dict({"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "intermediate_size": 16})
    assert (c.hidden_act, c.layer_norm_eps, c.max_position_embeddings, c.type_vocab_size) == ("gelu", 1e-12, 512, 2)
    assert c.activation == "gelu_erf"


def test_bert_reference_matches_transformers(rng, checkpoint):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory, config, state = checkpoint
    hf = hf_model(transformers, torch, config, state)
    model = BertEncoder.from_pretrained(directory, path="reference")
    ids, types = inputs(rng, 3, 13)
    mask = right_padded([13, 7, 2], 13)
    with torch.no_grad():
        expected = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                      token_type_ids=torch.from_numpy(types))
    out = model(ids, mask, types)
    assert_matches(out, (expected.last_hidden_state.numpy(), _hf_pooled(expected, mask),
                         expected.pooler_output.numpy()), 1e-5, mask)
    padded = BertEncoder.from_pretrained(directory, path="reference", unpad=False)(ids, mask, types)
    assert rel_error(padded.last_hidden_state, expected.last_hidden_state.numpy()) < 1e-5  # every position


def _hf_pooled(expected, mask):
    """Hugging Face's last_hidden_state mean-pooled over `mask`, as BertOutput.pooled."""
    hidden = expected.last_hidden_state.double().numpy()
    return (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)


def hf_model(transformers, torch, config, state):
    """transformers.BertModel with `config` and exactly `state` (strict load), fp32, eager attention."""
    hf_config = transformers.BertConfig(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "eager"
    hf = transformers.BertModel(hf_config, add_pooling_layer="pooler.dense.weight" in state).eval()
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=True)
    return hf


# --- GPU --------------------------------------------------------------------------------------------
GPU_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 4e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_bert_gpu_matches_reference(rng, tmp_path, dtype, unpad, pack_small_batches):
    """unpad=True packs these small batches (pack_small_batches): fp16/bf16 with the attention on the
    packed sequences (layout THD), fp32 with q, k and v unpacked for it."""
    import cupy

    config = TINY | {"max_position_embeddings": 80}
    state = random_state(rng, config)
    directory = write_checkpoint(tmp_path, config, state)
    reference = BertEncoder.from_pretrained(directory, path="reference", unpad=unpad)
    model = BertEncoder.from_pretrained(directory, dtype=dtype, device="gpu", unpad=unpad)
    assert isinstance(model.encoder.layer[0].attention.self.packed()[0], cupy.ndarray)
    ids, types = inputs(rng, 4, 64)
    right = right_padded([64, 17, 1, 40], 64)
    for mask in (None, right, right[:, ::-1].copy()):
        out = model(cupy.asarray(ids), None if mask is None else cupy.asarray(mask), cupy.asarray(types))
        assert out.last_hidden_state.dtype == dtypes.parse(dtype)
        expected = reference(ids, mask, types)
        for name in ("last_hidden_state", "pooled", "pooler_output"):
            assert rel_error(out[name], expected[name]) < GPU_TOLERANCE[dtype], (name, mask is None)
    out = model(ids, right, types)  # host ids and mask are moved to the GPU
    assert isinstance(out.last_hidden_state, cupy.ndarray)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_bert_gpu_matches_transformers(rng, checkpoint, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory, config, state = checkpoint
    hf = hf_model(transformers, torch, config, state)
    model = BertEncoder.from_pretrained(directory, dtype=dtype, device="gpu")
    ids, types = inputs(rng, 3, 24)
    mask = right_padded([24, 9, 16], 24)
    with torch.no_grad():
        expected = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                      token_type_ids=torch.from_numpy(types))
    out = model(ids, mask, types)
    assert_matches(out, (expected.last_hidden_state.numpy(), _hf_pooled(expected, mask),
                         expected.pooler_output.numpy()), GPU_TOLERANCE[dtype], mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_bert_graphed_matches_eager(rng, checkpoint, dtype):
    """A captured BERT replays any attention mask (the capture takes the bias form of the mask)."""
    import cupy

    directory, _, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, dtype=dtype, device="gpu")
    graphed = model.graphed()
    ids, types = (cupy.asarray(a) for a in inputs(rng, 3, 16))
    for mask in (right_padded([16, 5, 9], 16), right_padded([16, 5, 9], 16)[:, ::-1].copy(),
                 right_padded([16, 12, 1], 16)):
        mask = cupy.asarray(mask)
        got = graphed(ids, mask, types).last_hidden_state.copy()
        assert rel_error(got, model(ids, mask, types).last_hidden_state.get()) < dtypes.TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_bert_graphed_row_without_tokens_is_finite_and_leaves_the_others(rng, checkpoint, request, dtype, packed):
    """A graph replay whose mask has a row without tokens (and holes, and left padding): every output
    finite, that row's pooled embedding zeros, the replay equal to the eager call, and the rows with
    tokens equal to what the model gives for them alone. `packed`: small batches unpadded
    (pack_small_batches), the attention on the packed sequences for fp16/bf16."""
    import cupy

    if packed:
        request.getfixturevalue("pack_small_batches")
    directory, _, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, dtype=dtype, device="gpu")
    graphed = model.graphed()
    ids, types = (cupy.asarray(a) for a in inputs(rng, 4, 16))
    holes = (rng.random(16) < 0.5).astype(np.int64)
    holes[-3] = 1
    for mask in (right_padded([16, 0, 9, 5], 16), np.stack([right_padded([7], 16)[0, ::-1], holes,
                                                            np.zeros(16, np.int64), np.ones(16, np.int64)])):
        empty = ~mask.astype(bool).any(axis=1)
        rows = np.flatnonzero(~empty)
        tokens = mask[rows].astype(bool)
        at = {"last_hidden_state": tokens, "pooled": slice(None), "pooler_output": tokens[:, 0]}  # where a token is
        mask, kept = cupy.asarray(mask), cupy.asarray(rows)
        replay = graphed(ids, mask, types)
        got = {name: replay[name].get().astype(np.float64) for name in at}
        eager, alone = model(ids, mask, types), model(ids[kept], mask[kept], types[kept])
        for name, value in got.items():
            assert np.all(np.isfinite(value)), name
            assert rel_error(value, eager[name].get()) < GPU_TOLERANCE[dtype], name
            assert rel_error(value[rows][at[name]], alone[name].get()[at[name]]) < GPU_TOLERANCE[dtype], name
        assert np.all(got["pooled"][empty] == 0)


@pytest.mark.gpu
def test_bert_graphed_forward_binds_one_mask_kernel_and_no_zeroing(rng, checkpoint, monkeypatch):
    """The captured forward's mask glue: kernels/key_padding.cu once (valid, lengths and bias from the
    int64 mask as it is) and masked_mean.cu for pooled; the attention, its lengths vouched nonempty,
    binds no kernel to zero batch entries without a key (attn_zero_empty_batches)."""
    import cupy

    from libnn.registry import get_op
    from libnn.runtime import launch

    bound = []
    real = launch.bind
    monkeypatch.setattr(launch, "bind", lambda file, kernel, *a, **kw: bound.append(kernel) or real(file, kernel, *a,
                                                                                                  **kw))
    functional._launches.clear()  # nothing bound before this test's forward
    get_op("attention").calls.clear()
    model = BertEncoder.from_pretrained(checkpoint[0], dtype="fp16", device="gpu")
    ids, types = (cupy.asarray(a) for a in inputs(rng, 3, 16))
    out = model.graphed()(ids, cupy.asarray(right_padded([16, 0, 9], 16)), types)
    assert np.all(np.isfinite(out.last_hidden_state.get().astype(np.float32)))
    assert bound.count("key_padding_mask64_bias16") == 1, bound
    assert "masked_mean2_vec_f16" in bound and "attn_zero_empty_batches" not in bound, bound


def test_bert_parameters_are_final_after_load_and_to(checkpoint):
    """QKV packing happens at load/to(), not in the first forward pass (a CUDA graph capture keys on
    the parameters' identity), and the packed weight follows a dtype change."""
    model = BertEncoder.from_pretrained(checkpoint[0], path="reference").to("fp64")
    before = [id(v) for _, v in model.named_parameters()]
    out = model(np.arange(12).reshape(2, 6))
    assert [id(v) for _, v in model.named_parameters()] == before
    assert model.encoder.layer[1].attention.self.packed()[0].dtype == np.float64
    assert out.last_hidden_state.dtype == np.float64


def test_from_pretrained_draws_no_random_initial_values(checkpoint, monkeypatch):
    """Every parameter comes from the checkpoint: drawing them first cost 1.2 s for a BERT-base."""
    directory, _, state = checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained drew random initial values")

    monkeypatch.setattr(np.random, "default_rng", refuse)
    model = BertEncoder.from_pretrained(directory, path="reference")
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value, state[key])


def test_uninitialised_ends_with_its_block_even_on_an_error():
    from libnn.nn import Linear
    from libnn.nn.module import uninitialised

    with pytest.raises(KeyError), uninitialised():
        Linear(2, 3).load_state_dict({})
    a, b = Linear(4, 4, seed=1), Linear(4, 4, seed=1)
    np.testing.assert_array_equal(a.weight, b.weight)
    assert np.all(np.abs(a.weight) <= 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_bert_graphed_unpadded_captures_per_token_bucket(rng, checkpoint, dtype, pack_small_batches):
    """Unpadded graphs capture per token bucket (the mask's count read back per call), replay the
    eager result for each count, reuse a capture for a count in its bucket, and a capture whose
    caller-filled mask gains tokens is recorded again for them (same buffers)."""
    import cupy

    directory, _, _ = checkpoint
    model = BertEncoder.from_pretrained(directory, dtype=dtype, device="gpu")
    graphed = model.graphed()
    ids, types = (cupy.asarray(a) for a in inputs(rng, 8, 32))

    def check(got, mask):
        expected = model(ids, mask, types)
        assert not got.last_hidden_state[~mask.astype(bool)].any()
        for name in ("last_hidden_state", "pooled"):
            assert rel_error(got[name], expected[name].get()) < dtypes.TOLERANCE[dtype], name

    for lengths in ([32, 3, 9, 1, 20, 5, 7, 2], [30, 3, 9, 1, 20, 5, 7, 2], [32] * 4 + [1] * 4):
        mask = cupy.asarray(right_padded(lengths, 32))
        check(graphed(ids, mask, types), mask)
    assert sum(s.captures for s in graphed.stats().values()) == 2  # 79 and 77 tokens share a bucket
    bufs = graphed.inputs(ids, cupy.asarray(right_padded([1] * 8, 32)), types)
    before = sum(s.captures for s in graphed.stats().values())
    bufs[1][...] = cupy.asarray(right_padded([2] + [1] * 7, 32))
    check(graphed(*bufs), bufs[1])
    bufs[1][...] = cupy.asarray(right_padded([32, 1, 30, 1, 1, 17, 1, 2], 32))
    check(graphed.replay(), bufs[1])  # more tokens than the capture packed: recorded again
    assert sum(s.captures for s in graphed.stats().values()) == before + 1


@pytest.mark.gpu
def test_bert_unpadded_attention_ragged_or_unpacked_agree(rng, checkpoint, pack_small_batches):
    """fp16 with the attention on the packed sequences (cuDNN, layout THD) and with q, k and v
    unpacked for it (the custom path, which takes no THD): the same tokens within fp16's tolerance."""
    import cupy

    directory, _, _ = checkpoint
    ragged = BertEncoder.from_pretrained(directory, dtype="fp16", device="gpu")
    unpacked = BertEncoder.from_pretrained(directory, dtype="fp16", device="gpu", path={"attention": "custom"})
    assert ragged._ragged_attention() and not unpacked._ragged_attention()
    ids, types = (cupy.asarray(a) for a in inputs(rng, 6, 37))
    mask = cupy.asarray(right_padded([37, 1, 20, 0, 5, 36], 37))
    a, b = ragged(ids, mask, types), unpacked(ids, mask, types)
    tokens = mask.astype(bool)
    assert rel_error(a.last_hidden_state[tokens], b.last_hidden_state[tokens].get()) <= dtypes.TOLERANCE["fp16"]
    assert not a.last_hidden_state[~tokens].any() and not b.last_hidden_state[~tokens].any()


def test_packing_starts_at_a_batch_size_that_follows_the_models_work():
    """PACK_FROM_FLOPS in positions: MiniLM (6 x 384, FFN 1536) packs from about 110 sequences of
    128, BERT-base (12 x 768, FFN 3072) from about 14."""
    from libnn.models import bert

    mini = BertConfig(vocab_size=2, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                      intermediate_size=1536)
    base = BertConfig(vocab_size=2, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072)
    assert (mini.flops_per_token, base.flops_per_token) == (21233664, 169869312)
    model = BertEncoder(mini, path="reference")
    assert 100 * 128 < model._pack_from() < 128 * 128 and model.graph_sequence_inputs.pack_from == model._pack_from()
    assert math.ceil(bert.PACK_FROM_FLOPS / base.flops_per_token) < 32 * 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("B, S, F", [(1, 1, 1), (3, 13, 7), (5, 128, 384)])
def test_masked_mean_matches_the_host_mean(rng, dtype, B, S, F):
    """BERT's pooled embedding: one kernel per dtype, accumulated in fp32 (fp64 for fp64); a row with
    no token gives zeros."""
    import cupy

    x = random_normal(rng, (B, S, F), dtype)
    valid = rng.random((B, S)) < 0.6
    valid[0] = False
    got = functional.masked_mean(cupy.asarray(x), cupy.asarray(valid))
    expected = functional.masked_mean(x, valid)
    assert got.dtype == x.dtype and got.shape == (B, F)
    assert not bool(got[0].any())
    assert rel_error(got, expected) <= dtypes.TOLERANCE[dtype]
