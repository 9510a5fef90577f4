"""CausalLM (LLaMA) on the CPU reference path against an independent float64 LLaMA written here in plain
NumPy (no libnn op: full recomputation of every position, no KV cache), on a tiny random config (2
layers, hidden 64, 4 heads of 16, 2 KV heads, vocab 97, intermediate 96) saved as a Hugging Face-style
checkpoint by the test: logits of a padded batch of prompts of different lengths at prefill and at
several decode steps; greedy generation against the reference's argmax step by step; sampling (seeded,
top_k, top_p); the config's end token (these, the bad configs and checkpoints, and the checks against
transformers below are tests/decoder_cases.py's, which TestLlama runs for LLaMA); end tokens stopping
their sequence only; sharded checkpoints; the errors bad configs, checkpoints and generation arguments
get, each naming the file, key or argument, with the model usable after them.

Against transformers' LlamaForCausalLM (random weights, save_pretrained in safetensors; skipped where torch
and transformers are not installed; transformers in fp32 on the host, every position recomputed at each
step): the reference path in fp64 on the host, logits within 1e-5 for 16 decode steps and the same greedy
tokens; on the GPU (marked gpu), 64 decode steps fed transformers' greedy tokens (teacher forcing: a
near-tie that rounding flips cannot steer the text elsewhere) with every step's logits within 1e-4 (fp32),
2e-2 (fp16) or 4e-2 (bf16) of transformers', fp32 greedy generation giving transformers' 64 tokens, and
64 seeded sampling steps reproducible; grouped-query attention untied and multi-query attention tied.
The decode steps run as the model's default has them (CUDA graphs on the GPU).

Tolerances: tests/decoder_cases.py's."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import rel_error
from decoder_cases import HF_MAX_LEN, HF_STEPS, V, DecoderCases, hf_prompts, load, padded, prompts, write_checkpoint

from libnn.models import CausalLM, LlamaConfig

H, I, L, HEADS, KV_HEADS = 64, 96, 2, 4, 2
D = H // HEADS
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": H,
          "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
          "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
          "use_cache": True, "torch_dtype": "float32", "transformers_version": "4.46.0"}


# --- the checkpoint ---------------------------------------------------------------------------------------
def random_state(rng, config: dict, dtype=np.float32) -> dict[str, np.ndarray]:
    """Hugging Face LlamaForCausalLM's tensors, drawn so that the logits spread (weights ~ 1/sqrt(fan-in)
    times 1.5, norms around 1)."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["hidden_size"] // config["num_attention_heads"]
    hq, hkv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])

    def w(rows, cols):
        return (rng.standard_normal((rows, cols)) * 1.5 / math.sqrt(cols)).astype(dtype)

    def norm():
        return (1 + 0.2 * rng.standard_normal(h)).astype(dtype)

    state = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], h)).astype(dtype),
             "model.norm.weight": norm()}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        state.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                      p + "self_attn.q_proj.weight": w(hq * d, h), p + "self_attn.k_proj.weight": w(hkv * d, h),
                      p + "self_attn.v_proj.weight": w(hkv * d, h), p + "self_attn.o_proj.weight": w(h, hq * d),
                      p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                      p + "mlp.down_proj.weight": w(h, i)})
    if not config.get("tie_word_embeddings"):
        state["lm_head.weight"] = w(config["vocab_size"], h)
    return state


# --- the independent reference: LLaMA in float64, every position recomputed ------------------------------
class NumpyLlama:
    """Hugging Face's LlamaForCausalLM forward pass in float64 NumPy, one sequence at a time, no cache.
    The rotary angle is Hugging Face's: fp32(position) * inv_freq, inv_freq = 1 / theta^(2i / D) in
    float32 (that rounding is part of the function every implementation computes); cos and sin in
    float64."""

    def __init__(self, config: dict, state: dict):
        self.c = config
        self.w = {k: v.astype(np.float64) for k, v in state.items()}
        if config.get("tie_word_embeddings"):
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        f32 = np.float32
        exponent = np.arange(0, D, 2).astype(f32) / f32(D)
        self.inv_freq = (f32(1) / (f32(config["rope_theta"]) ** exponent)).astype(f32)

    def rms(self, x, weight):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.c["rms_norm_eps"]) * weight

    def rotate(self, t, positions):
        angle = (positions.astype(np.float32)[:, None] * self.inv_freq[None, :]).astype(np.float64)
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        a, b = t[..., :D // 2], t[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def logits(self, tokens) -> np.ndarray:
        """The logits after the last of `tokens`, (vocab,)."""
        w, c = self.w, self.c
        hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
        S = len(tokens)
        positions = np.arange(S)
        x = w["model.embed_tokens.weight"][np.asarray(tokens)]
        causal = np.tril(np.ones((S, S), bool))
        for n in range(c["num_hidden_layers"]):
            p = f"model.layers.{n}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q = self.rotate((h @ w[p + "self_attn.q_proj.weight"].T).reshape(S, hq, D), positions)
            k = self.rotate((h @ w[p + "self_attn.k_proj.weight"].T).reshape(S, hkv, D), positions)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(S, hkv, D)
            out = np.empty((S, hq, D))
            for head in range(hq):
                kv = head // (hq // hkv)
                scores = np.where(causal, q[:, head] @ k[:, kv].T / math.sqrt(D), -np.inf)
                weights_ = np.exp(scores - scores.max(axis=-1, keepdims=True))
                out[:, head] = (weights_ / weights_.sum(axis=-1, keepdims=True)) @ v[:, kv]
            x = x + out.reshape(S, hq * D) @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        return self.rms(x[-1], w["model.norm.weight"]) @ w["lm_head.weight"].T

    def greedy(self, tokens, steps: int) -> list[int]:
        tokens, out = list(tokens), []
        for _ in range(steps):
            out.append(int(np.argmax(self.logits(tokens))))
            tokens.append(out[-1])
        return out


VARIANTS = {"gqa": {}, "tied-mha": {"tie_word_embeddings": True, "num_key_value_heads": HEADS}}


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request, tmp_path, rng):
    """(directory, config dict, state) of a tiny random LLaMA: GQA with its own lm_head, or MHA tied."""
    config = dict(CONFIG, **VARIANTS[request.param])
    state = random_state(rng, config)
    return write_checkpoint(tmp_path / request.param, config, state), config, state


def test_an_end_token_stops_its_sequence_only(rng, checkpoint):
    """The end token is the first greedy token of one sequence that no other sequence produces in the
    steps run (nor that one later): that sequence ends after it (it is returned), the others run all
    their steps; stream yields -1 for a sequence that has ended; a list of end tokens works as one."""
    directory, config, state = checkpoint
    model, reference = load(directory), NumpyLlama(config, state)
    seqs = prompts(rng)
    greedy = [reference.greedy(s, 5) for s in seqs]
    ending = [b for b, g in enumerate(greedy)
              if g[0] not in g[1:] and not any(g[0] in other for c, other in enumerate(greedy) if c != b)]
    if not ending:
        pytest.skip("every first token of the drawn model recurs; another seed draws another model")
    b = ending[0]
    eos = greedy[b][0]
    out = model.generate(seqs, 5, eos_token_id=eos)
    assert out[b].tolist() == [eos]
    assert [o.tolist() for c, o in enumerate(out) if c != b] == [g for c, g in enumerate(greedy) if c != b]
    steps = list(model.stream(seqs, 5, eos_token_id=[V - 1, eos] if eos != V - 1 else [eos]))
    assert len(steps) == 5 and all(s.shape == (4,) and s.dtype == np.int64 for s in steps)
    assert [int(s[b]) for s in steps] == [eos, -1, -1, -1, -1]
    # every sequence ending stops the loop
    firsts = [g[0] for g in greedy]
    assert [len(o) for o in model.generate(seqs, 5, eos_token_id=firsts)] == [1, 1, 1, 1]
    assert len(list(model.stream(seqs, 5, eos_token_id=firsts))) == 1


def test_top_k_and_top_p_keep_only_their_tokens(rng):
    """The sampler alone on fixed logits: every draw lies in the top-k set, or the smallest set of most
    likely tokens whose mass before each is below top_p."""
    from libnn.models.decoder import Sampler

    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04]] * 64, np.float32))
    k2 = Sampler("test", 1.0, 2, None, 7, 5)
    assert set(np.unique(np.concatenate([k2(logits) for _ in range(10)]))) == {0, 1}
    p = Sampler("test", 1.0, None, 0.85, 8, 5)  # mass before: 0, .5, .8, .9 -> keeps 0, 1, 2
    assert set(np.unique(np.concatenate([p(logits) for _ in range(20)]))) == {0, 1, 2}
    full = Sampler("test", 1.0, None, None, 9, 5)
    counts = np.bincount(np.concatenate([full(logits) for _ in range(200)]), minlength=5) / (64 * 200)
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.1, 0.06, 0.04], atol=0.02)  # the softmax's frequencies


def test_a_tiny_temperature_samples_the_most_likely_token():
    """Logits near 40 divided by 1e-37 would pass float32's range and tie every token at inf: each row's
    largest logit is subtracted first, so the leader stays finite and the draw is the argmax."""
    from libnn.models.decoder import Sampler

    logits = np.array([[40.0, 41.0, 39.5, 40.9], [12.0, -3.0, 11.0, 12.5]], np.float32)
    for top_p in (None, 0.5):
        assert Sampler("test", 1e-37, None, top_p, 3, 4)(logits).tolist() == [1, 3]


def test_a_sharded_checkpoint_loads_as_one_file(tmp_path, rng):
    config = dict(CONFIG)
    state = random_state(rng, config)
    one = load(write_checkpoint(tmp_path / "one", config, state))
    three = load(write_checkpoint(tmp_path / "three", config, state, shards=3))
    assert len(three.load_report.files) == 3
    seqs = prompts(rng)
    np.testing.assert_array_equal(one.prefill(*padded(seqs)), three.prefill(*padded(seqs)))


def test_load_stacks_qkv_and_gate_up_and_keeps_hugging_faces_keys(checkpoint):
    directory, config, state = checkpoint
    model = load(directory, "fp32")
    assert set(model.state_dict()) == set(state)
    layer = model.model.layers._children["0"]
    qkv = layer.self_attn.packed().weight
    assert qkv.shape == ((HEADS + 2 * config["num_key_value_heads"]) * D, H)
    np.testing.assert_array_equal(qkv[:HEADS * D], state["model.layers.0.self_attn.q_proj.weight"])
    assert layer.self_attn.k_proj.weight.base is qkv  # a view: the weights are held once
    gate_up = layer.mlp.packed().weight
    assert gate_up.shape == (2 * I, H) and layer.mlp.up_proj.weight.base is gate_up
    np.testing.assert_array_equal(gate_up[I:], state["model.layers.0.mlp.up_proj.weight"])
    assert model.lm_head is None if config["tie_word_embeddings"] else model.lm_head.weight.shape == (V, H)
    text = "\n".join(model.describe())
    assert "q_proj+k_proj+v_proj in one GEMM" in text and "eager: one launch per op" in text  # on the CPU


def test_a_cast_and_new_weights_restack_and_empty_the_cache(rng, checkpoint):
    directory, config, state = checkpoint
    model = load(directory)
    seqs = prompts(rng)
    before = model.prefill(*padded(seqs))
    model.to("fp32")
    assert model.lengths.size == 0  # the cache was emptied
    after = model.prefill(*padded(seqs))
    assert after.dtype == np.float32 and rel_error(after, before) <= 1e-5
    changed = dict(state, **{"model.norm.weight": 2 * state["model.norm.weight"]})
    model.load_state_dict(changed)
    assert rel_error(model.prefill(*padded(seqs)), before) > 1e-3


def test_a_tied_checkpoints_lm_head_and_rotary_buffers_are_set_aside_and_reported(tmp_path, rng):
    config = dict(CONFIG, tie_word_embeddings=True)
    state = random_state(rng, config)
    extra = {"lm_head.weight": state["model.embed_tokens.weight"].copy(),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(D // 2, np.float32)}
    model = load(write_checkpoint(tmp_path, config, dict(state, **extra)))
    assert model.load_report.ignored == sorted(extra)
    assert "ignored 2 keys" in "\n".join(model.describe())


# --- the config --------------------------------------------------------------------------------------------
def test_the_config_fills_hugging_faces_defaults():
    c = LlamaConfig.from_dict({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 4, "num_hidden_layers": 1,
                               "num_attention_heads": 2})
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta, c.rope_scaling) == (2, 4, 10000.0, None)
    assert (c.eos_token_id, c.bos_token_id, c.tie_word_embeddings, c.rms_norm_eps) == ((2,), 1, False, 1e-6)
    assert LlamaConfig.from_dict(dict(CONFIG, head_dim=32)).head_dim == 32  # head_dim given: Hq * D may differ from H
    assert LlamaConfig.from_dict(dict(CONFIG, eos_token_id=[5, 6])).eos_token_id == (5, 6)
    assert LlamaConfig.from_dict(dict(CONFIG, eos_token_id=None)).eos_token_id == ()


def test_rope_parameters_of_transformers_5_read_as_rope_theta_and_rope_scaling():
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
              "rope_type": "llama3"}
    old = LlamaConfig.from_dict(dict(CONFIG, rope_theta=500000.0, rope_scaling=llama3))
    new = LlamaConfig.from_dict({k: v for k, v in CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
                                | {"rope_parameters": dict(llama3, rope_theta=500000.0)})
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling["rope_type"] == "llama3"
    default = LlamaConfig.from_dict(dict(CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert default.rope_scaling is None and default.rope_theta == 1e6
    linear = LlamaConfig.from_dict(dict(CONFIG, rope_scaling={"type": "linear", "factor": 2.0}))
    np.testing.assert_array_equal(linear.inv_freq, LlamaConfig.from_dict(CONFIG).inv_freq / np.float32(2))


BAD_CONFIGS = [
    ({"model_type": "mistral"}, ValueError, r"model_type 'mistral' is not supported \(supported: \['llama', 'gpt2'\]"),
    ({"model_type": "gpt2"}, ValueError,  # GPT-2's config, which this one's architectures do not match
     r"architectures \['LlamaForCausalLM'\] are not supported \(supported: \['GPT2LMHeadModel'\]"),
    ({"architectures": ["LlamaForSequenceClassification"]}, ValueError,
     r"architectures \['LlamaForSequenceClassification'\] are not supported \(supported: \['LlamaForCausalLM'\]"),
    ({"architectures": "LlamaForCausalLM"}, TypeError, r"architectures must be a list of class names"),
    ({"hidden_act": "gelu"}, ValueError, r"hidden_act 'gelu' is not supported \(supported: \['silu'\]"),
    ({"attention_bias": True}, ValueError, r"attention_bias=True is not supported \(only False"),
    ({"mlp_bias": True}, ValueError, r"mlp_bias=True is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, ValueError, r"quantized checkpoints .*'gptq'.* not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ValueError,
     r"rope_scaling type 'yarn' is not supported \(supported: 'default', 'linear', 'llama3'\)"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ValueError, r"rope_scaling type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ValueError,
     r"rope_theta 10000.0, rope_scaling .*: rope_frequencies: rope_scaling of type 'llama3' needs factor, "
     r"low_freq_factor"),
    ({"rope_scaling": "linear"}, TypeError, r"rope_scaling must be null or an object, got str 'linear'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "linear", "factor": 4.0}},
     ValueError, r"rope_scaling .* and rope_parameters .* disagree"),
    ({"partial_rotary_factor": 0.5}, ValueError, r"partial_rotary_factor 0.5 is not supported"),
    ({"rope_theta": -1.0}, ValueError, r"rope_theta must be a finite number > 0, got -1.0"),
    ({"num_key_value_heads": 3}, ValueError, r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 66}, ValueError, r"hidden_size 66 is not a multiple of num_attention_heads 4"),
    ({"head_dim": 15}, ValueError, r"head_dim 15 is odd"),
    ({"vocab_size": 0}, ValueError, r"vocab_size must be a positive int, got 0"),
    ({"num_hidden_layers": 2.0}, TypeError, r"num_hidden_layers must be an int, got float 2.0"),
    ({"rms_norm_eps": 0}, ValueError, r"rms_norm_eps must be > 0, got 0"),
    ({"tie_word_embeddings": "yes"}, TypeError, r"tie_word_embeddings must be True or False"),
    ({"eos_token_id": 97}, ValueError, r"eos_token_id 97 is outside the vocabulary \[0, 97\)"),
    ({"eos_token_id": [2, "x"]}, TypeError, r"eos_token_id must be an int, got str 'x'"),
    ({"bos_token_id": -1}, ValueError, r"bos_token_id must be a non-negative int, got -1"),
]


@pytest.fixture(params=BAD_CONFIGS, ids=lambda case: str(case[0])[:40])
def bad_config(request):
    return request.param


def test_a_config_that_is_not_an_object_or_not_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(TypeError, match=r"config.json must be a JSON object of the config's fields by name, got list"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"config.json' is not valid JSON"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load(tmp_path / "missing")


# --- bad checkpoints -----------------------------------------------------------------------------------------
BAD_CHECKPOINTS = [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), KeyError,
     r"missing keys \['model.layers.1.mlp.up_proj.weight'\], unexpected keys \[\]"),
    (lambda s: s.pop("lm_head.weight"), KeyError, r"missing keys \['lm_head.weight'\]"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(H, np.float32)}), KeyError,
     r"missing keys \[\], unexpected keys \['model.layers.0.self_attn.q_proj.bias'\]"),
    (lambda s: s.update({"model.layers.2.input_layernorm.weight": np.ones(H, np.float32)}), KeyError,
     r"unexpected keys \['model.layers.2.input_layernorm.weight'\]"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((HEADS * D, H), np.float32)}),
     ValueError, r"model.layers.0.self_attn.k_proj.weight has shape \(64, 64\), the layer expects \(32, 64\)"),
    (lambda s: s.update({"model.norm.weight": np.zeros(H, np.complex64)}), TypeError,
     r"model.norm.weight has dtype complex64"),
]


@pytest.fixture(params=BAD_CHECKPOINTS, ids=lambda case: case[2][:40])
def bad_checkpoint(request):
    return request.param


def test_a_shard_holding_a_tensor_the_index_places_elsewhere_is_refused(tmp_path, rng):
    directory = write_checkpoint(tmp_path, CONFIG, random_state(rng, CONFIG), shards=2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "model-00002-of-00002.safetensors" if index["weight_map"][key].startswith(
        "model-00001") else "model-00001-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"holds {key!r}, which .* places in"):
        load(directory)


def test_a_directory_without_safetensors_names_what_it_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors .*found \['pytorch_model.bin'\]: convert"):
        load(tmp_path)


def test_sizes_that_would_not_fit_are_refused_before_anything_is_read(tmp_path, rng):
    directory = write_checkpoint(tmp_path, CONFIG, random_state(rng, CONFIG))
    with pytest.raises(MemoryError, match=r"^CausalLM.from_pretrained: the KV cache \(1000000000 sequences of 32 "
                                          r"tokens, 2 layers, 2 KV heads of 16\) needs"):
        load(directory, max_batch=10**9)
    with pytest.raises(ValueError, match=r"max_len 65 is beyond the model's max_position_embeddings 64"):
        load(directory, max_len=65)
    huge = dict(CONFIG, vocab_size=2**40)
    (directory / "config.json").write_text(json.dumps(huge))
    with pytest.raises(MemoryError, match=r"^CausalLM.from_pretrained: the model of .*config.json \(vocab_size="
                                          r"1099511627776"):
        load(directory)


# --- bad generation arguments: clear errors, and the model still usable -----------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    rng = np.random.default_rng(5)
    directory = write_checkpoint(tmp_path_factory.mktemp("small"), CONFIG, random_state(rng, CONFIG))
    return CausalLM.from_pretrained(directory, dtype="fp32", device="cpu", max_batch=2, max_len=12)


@pytest.mark.parametrize("call, error, message", [
    (lambda m: m.generate([list(range(13))], 1), ValueError,
     r"^CausalLM.generate: a prompt of 13 tokens is longer than the KV cache's max_len 12"),
    (lambda m: m.generate([list(range(10))], 4), ValueError,
     r"^CausalLM.generate: max_new_tokens 4 after a prompt of 10 tokens needs 13 cache positions, more than "
     r"max_len 12"),
    (lambda m: m.generate([[1, 97]], 2), ValueError, r"^CausalLM.generate: input_ids must lie in \[0, 97\) "
                                                     r"\(vocab_size\), got values from 1 to 97"),
    (lambda m: m.generate([[1, -1]], 2), ValueError, r"^CausalLM.generate: input_ids must lie in \[0, 97\)"),
    (lambda m: m.generate([[1, 2], []], 2), ValueError,
     r"^CausalLM.generate: sequences \[1\] have no token \(empty prompts\)"),
    (lambda m: m.generate(np.ones((2, 3), np.int64), 2, lengths=[3, 0]), ValueError,
     r"^CausalLM.generate: sequences \[1\] have no token"),
    (lambda m: m.generate([[1]], 2, temperature=1.0, top_p=0.0), ValueError,
     r"^CausalLM.generate: top_p must be in \(0, 1\], got 0.0"),
    (lambda m: m.generate([[1]], 2, temperature=1.0, top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    (lambda m: m.generate([[1]], 2, top_p=float("nan")), ValueError, r"top_p must be in \(0, 1\], got nan"),
    (lambda m: m.generate([[1]], 2, temperature=-0.5), ValueError,
     r"^CausalLM.generate: temperature must be a finite number >= 0 \(0: greedy\), got -0.5"),
    (lambda m: m.generate([[1]], 2, temperature="hot"), TypeError, r"temperature must be a number >= 0"),
    (lambda m: m.generate([[1]], 2, top_k=0), ValueError, r"top_k must be a positive int, got 0"),
    (lambda m: m.generate([[1]], 2, seed=-1), ValueError, r"seed must be a non-negative int, got -1"),
    (lambda m: m.generate([[1]], 2, seed=2**32), ValueError, r"seed must be below 2\*\*32"),
    (lambda m: m.generate([[1]], -1), ValueError, r"max_new_tokens must be a non-negative int, got -1"),
    (lambda m: m.generate([[1]], 2, eos_token_id=97), ValueError, r"eos_token_id \[97\] outside the vocabulary"),
    (lambda m: m.generate([[1], [2], [3]], 2), ValueError,
     r"^CausalLM.generate: the batch has 3 sequences; the KV cache holds 1 to 2 \(max_batch\)"),
    (lambda m: m.generate(np.array([1, 2, 3]), 2), ValueError,
     r"input_ids must be 2-D \(batch, seq_len\) or a list of sequences, got shape \(3,\); for one sequence pass"),
    (lambda m: m.generate(np.ones((1, 3)), 2), TypeError, r"input_ids must hold integers, got dtype float64"),
    (lambda m: m.generate(np.ones((2, 3), np.int64), 2, lengths=[3]), ValueError,
     r"lengths must be \(2,\) integers, one per row of input_ids"),
    (lambda m: m.generate(np.ones((2, 3), np.int64), 2, lengths=[3, 4]), ValueError,
     r"lengths go up to 4 but input_ids has 3 positions"),
    (lambda m: m.generate([[1, 2]], 2, lengths=[2]), ValueError, r"lengths goes with a 2-D input_ids"),
    (lambda m: m.prefill(np.ones((1, 13), np.int64)), ValueError,
     r"^CausalLM.prefill: a prompt of 13 tokens is longer than the KV cache's max_len 12"),
])
def test_bad_generation_input_gets_a_clear_error_and_the_model_stays_usable(small_model, call, error, message):
    expected = small_model.generate([[3, 4, 5]], 3, eos_token_id=())
    with pytest.raises(error, match=message):
        call(small_model)
    assert [o.tolist() for o in small_model.generate([[3, 4, 5]], 3, eos_token_id=())] == \
        [o.tolist() for o in expected]


def test_decode_steps_are_refused_before_a_prefill_past_the_cache_and_with_bad_tokens(tmp_path, rng):
    model = load(write_checkpoint(tmp_path, CONFIG, random_state(rng, CONFIG)), max_batch=2, max_len=4)
    with pytest.raises(RuntimeError, match=r"^CausalLM.decode_step: no sequence to extend; call prefill"):
        model.decode_step(np.array([1]))
    model.prefill([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"tokens must be \(2,\) integers, one per sequence of the last prefill, got "
                                         r"shape \(3,\)"):
        model.decode_step(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"^CausalLM.decode_step: tokens must lie in \[0, 97\)"):
        model.decode_step(np.array([1, 100]))
    model.decode_step(np.array([5, 6]))
    model.decode_step(np.array([5, 6]))  # sequence 0 now holds 4 tokens: the cache's max_len
    with pytest.raises(ValueError, match=r"^CausalLM.decode_step: sequences \[0\] fill the KV cache \(max_len 4\)"):
        model.decode_step(np.array([5, 6]))
    assert list(model.lengths) == [4, 3]


def test_zero_new_tokens_gives_empty_arrays(small_model):
    assert [o.tolist() for o in small_model.generate([[1, 2], [3]], 0)] == [[], []]
    assert list(small_model.stream([[1, 2]], 0)) == []


def test_decode_steps_vouch_their_kv_lengths_nonempty(small_model, monkeypatch):
    """A decode step's key lengths are its position + 1, never 0: they go to the attention marked so
    (CheckedLengths(nonempty=True)), which then binds no kernel zeroing rows without keys; a prefill's
    come from its prompts' lengths, checked by the attention's own front end."""
    from libnn.models import decoder

    seen = []
    attend = decoder.Step.attend
    monkeypatch.setattr(decoder.Step, "attend", lambda step, *args: seen.append(step) or attend(step, *args))
    small_model.generate([[3, 4, 5], [6]], 3, eos_token_id=())
    decode = [step for step in seen if not step.causal]
    assert decode and all(step.seq_lens_kv.nonempty for step in decode)
    assert all(int(n) >= 1 for step in decode for n in np.asarray(step.seq_lens_kv.lengths))


# --- against transformers: the reference path on the host, and on the GPU (marked gpu) ------------------------
HF_VARIANTS = {"gqa": {"num_key_value_heads": 2, "tie_word_embeddings": False},
               "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
               "llama3-scaling": {"num_key_value_heads": 2, "tie_word_embeddings": False}}
# Llama 3's frequency scaling: with head_dim 16, wavelengths of 6.3 to 2.8e3 positions against these bounds
# (4 and 16) put one frequency in the smoothed band and the rest in the scaled one
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def hf_rope_fields(transformers, variant: str) -> dict:
    """The variant's rope fields as this transformers version takes them: rope_parameters from version 5,
    rope_theta and rope_scaling before."""
    if variant != "llama3-scaling":
        return {}
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 10000.0}}
    return {"rope_theta": 10000.0, "rope_scaling": dict(LLAMA3_SCALING)}


def hf_checkpoint(tmp_path, variant: str):
    """transformers' LlamaForCausalLM with random weights (std 0.1: logits that spread), saved with
    save_pretrained in safetensors; the model in fp32 on the host as the reference."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                                      num_attention_heads=HEADS, max_position_embeddings=2 * HF_MAX_LEN,
                                      rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                                      **HF_VARIANTS[variant], **hf_rope_fields(transformers, variant))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)  # safetensors: the default since transformers 4.35, the only format in 5
    assert (tmp_path / "model.safetensors").is_file(), sorted(p.name for p in tmp_path.iterdir())
    return model


@pytest.fixture(params=list(HF_VARIANTS))
def hf_variant(request) -> str:
    return request.param


class TestLlama(DecoderCases):
    """tests/decoder_cases.py's checks, for LLaMA: against NumpyLlama on the checkpoint fixture's two
    configs (GQA untied, MHA tied), against transformers' LlamaForCausalLM on hf_checkpoint's three (GQA
    untied, MQA tied, GQA with Llama 3's rope scaling), and BAD_CONFIGS and BAD_CHECKPOINTS refused."""
    config = CONFIG
    reference = NumpyLlama
    random_state = staticmethod(random_state)
    hf_checkpoint = staticmethod(hf_checkpoint)
    config_description = "2 layers, hidden 64, tie_word_embeddings=False"


@pytest.mark.gpu
def test_sampling_on_the_gpu_is_seeded_and_top_k_1_is_greedy(tmp_path, rng):
    """64 sampled tokens per sequence: the same seed gives the same tokens; top_k=1 gives the greedy ones."""
    hf_checkpoint(tmp_path, "gqa")
    model = CausalLM.from_pretrained(tmp_path, dtype="fp16", device="gpu", max_batch=3, max_len=HF_MAX_LEN)
    seqs = hf_prompts(rng)

    def run(**kwargs):
        return [o.tolist() for o in model.generate(seqs, HF_STEPS["gpu"], eos_token_id=(), **kwargs)]

    assert run(temperature=1.0, seed=3) == run(temperature=1.0, seed=3)
    assert run(temperature=1.0, top_k=1, seed=4) == run()
    assert run(temperature=0.8, top_k=20, top_p=0.9, seed=5) == run(temperature=0.8, top_k=20, top_p=0.9, seed=5)


def test_the_cache_holds_every_generated_token_but_the_last_however_generation_ends(small_model):
    """stream queues each decode step before yielding the tokens it appends: a generation that ends at
    its length, at end tokens, or by the caller closing it leaves the same lengths (prompt + tokens - 1)."""
    small_model.generate([[1, 2, 3], [4]], 5, eos_token_id=())
    assert small_model.lengths.tolist() == [3 + 4, 1 + 4]
    first = small_model.generate([[1, 2, 3]], 5, eos_token_id=())[0]
    small_model.generate([[1, 2, 3]], 5, eos_token_id=int(first[1]))  # every sequence ends at its 2nd token
    assert small_model.lengths.tolist() == [3 + 1]
    steps = small_model.stream([[1, 2, 3], [4]], 6, eos_token_id=())
    next(steps), next(steps), next(steps)
    steps.close()
    assert small_model.lengths.tolist() == [3 + 2, 1 + 2]
