"""CausalLM (GPT-2) on the CPU reference path against an independent float64 GPT-2 written here in plain
NumPy (no libnn op: full recomputation of every position, no KV cache), on a tiny random config (2 blocks,
n_embd 64, 4 heads of 16, vocab 97, 64 positions; n_inner 4 n_embd or 96) saved as a Hugging Face-style
checkpoint by the test, its Conv1D weights stored (in, out) as Hugging Face stores them: logits of a padded
batch of prompts of different lengths at prefill and at several decode steps; greedy generation against the
reference's argmax; sampling seeded; the config's end token; the errors bad configs and checkpoints get, each
naming the file and the field or key (these, and the checks against transformers below, are
tests/decoder_cases.py's, which TestGPT2 runs for GPT-2); the Conv1D weights transposed at load and the keys
kept; lm_head.weight and the old attention buffers set aside and reported; a GPT2Model checkpoint without
the "transformer." prefix; `libnn generate` on a GPT-2 directory.

Against transformers' GPT2LMHeadModel (random weights with random biases and LayerNorm affines, eager
attention, save_pretrained in safetensors; skipped where torch and transformers are not installed;
transformers in fp32 on the host, every position recomputed at each step): the reference path in fp64 on
the host, logits within 1e-5 for 16 teacher-forced decode steps and the same greedy tokens; on the GPU
(marked gpu), 64 decode steps fed transformers' greedy tokens (teacher forcing) with every step's logits
within 1e-4 (fp32), 2e-2 (fp16) or 4e-2 (bf16) of transformers', fp32 greedy generation giving
transformers' 64 tokens (both n_inner variants), 64 seeded sampling steps reproducible, and decode graphs
against eager steps.

Tolerances (relative L2 error of the logits): fp64 1e-12 (the reference path computes every op in float64:
the differences are summation order), fp32 5e-6 (one rounding per op), as tests/decoder_cases.py holds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import rel_error
from decoder_cases import HF_MAX_LEN, HF_STEPS, V, DecoderCases, hf_prompts, load, padded, prompts, write_checkpoint

from libnn.models import CausalLM, GPT2Config

H, L, HEADS, POSITIONS = 64, 2, 4, 64
D = H // HEADS
CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": POSITIONS,
          "n_embd": H, "n_layer": L, "n_head": HEADS, "n_inner": None, "activation_function": "gelu_new",
          "layer_norm_epsilon": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "scale_attn_weights": True,
          "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "attn_pdrop": 0.1,
          "embd_pdrop": 0.1, "resid_pdrop": 0.1, "initializer_range": 0.02, "summary_type": "cls_index",
          "summary_use_proj": True, "use_cache": True, "transformers_version": "4.57.6"}
VARIANTS = {"default": {}, "n_inner-96": {"n_inner": 96}}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


# --- the checkpoint ---------------------------------------------------------------------------------------
def inner(config: dict) -> int:
    return config.get("n_inner") or 4 * config["n_embd"]


def random_state(rng, config: dict, dtype=np.float32) -> dict[str, np.ndarray]:
    """Hugging Face GPT2LMHeadModel's tensors as save_pretrained writes them (no lm_head.weight: tied; Conv1D
    weights (in, out)), drawn so that the logits spread (weights ~ 1/sqrt(fan-in) times 1.5, LayerNorm
    affines around 1 and 0, biases and position rows that matter)."""
    h, i = config["n_embd"], inner(config)

    def w(fan_in, fan_out):
        return (rng.standard_normal((fan_in, fan_out)) * 1.5 / math.sqrt(fan_in)).astype(dtype)

    def vector(n, around=0.0, spread=0.1):
        return (around + spread * rng.standard_normal(n)).astype(dtype)

    state = {"transformer.wte.weight": rng.standard_normal((config["vocab_size"], h)).astype(dtype),
             "transformer.wpe.weight": (0.5 * rng.standard_normal((config["n_positions"], h))).astype(dtype),
             "transformer.ln_f.weight": vector(h, 1.0, 0.2), "transformer.ln_f.bias": vector(h)}
    for n in range(config["n_layer"]):
        p = f"transformer.h.{n}."
        state.update({p + "ln_1.weight": vector(h, 1.0, 0.2), p + "ln_1.bias": vector(h),
                      p + "attn.c_attn.weight": w(h, 3 * h), p + "attn.c_attn.bias": vector(3 * h),
                      p + "attn.c_proj.weight": w(h, h), p + "attn.c_proj.bias": vector(h),
                      p + "ln_2.weight": vector(h, 1.0, 0.2), p + "ln_2.bias": vector(h),
                      p + "mlp.c_fc.weight": w(h, i), p + "mlp.c_fc.bias": vector(i),
                      p + "mlp.c_proj.weight": w(i, h), p + "mlp.c_proj.bias": vector(h)})
    return state


# --- the independent reference: GPT-2 in float64, every position recomputed ------------------------------
class NumpyGPT2:
    """Hugging Face's GPT2LMHeadModel forward pass in float64 NumPy, one sequence at a time, no cache: Conv1D
    is x @ W + b with W (in, out); the tanh GELU (gelu_new); logits from wte's table."""

    def __init__(self, config: dict, state: dict):
        self.c = config
        self.w = {k: v.astype(np.float64) for k, v in state.items()}

    def norm(self, x, prefix):
        centered = x - x.mean(axis=-1, keepdims=True)
        scale = np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + self.c["layer_norm_epsilon"])
        return centered / scale * self.w[prefix + ".weight"] + self.w[prefix + ".bias"]

    def conv1d(self, x, prefix):
        return x @ self.w[prefix + ".weight"] + self.w[prefix + ".bias"]

    @staticmethod
    def gelu(v):
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))

    def logits(self, tokens) -> np.ndarray:
        """The logits after the last of `tokens`, (vocab,)."""
        w, heads = self.w, self.c["n_head"]
        S = len(tokens)
        x = w["transformer.wte.weight"][np.asarray(tokens)] + w["transformer.wpe.weight"][:S]
        causal = np.tril(np.ones((S, S), bool))
        for n in range(self.c["n_layer"]):
            p = f"transformer.h.{n}."
            q, k, v = np.split(self.conv1d(self.norm(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
            q, k, v = (t.reshape(S, heads, D) for t in (q, k, v))
            out = np.empty((S, heads, D))
            for head in range(heads):
                scores = np.where(causal, q[:, head] @ k[:, head].T / math.sqrt(D), -np.inf)
                weights_ = np.exp(scores - scores.max(axis=-1, keepdims=True))
                out[:, head] = (weights_ / weights_.sum(axis=-1, keepdims=True)) @ v[:, head]
            x = x + self.conv1d(out.reshape(S, heads * D), p + "attn.c_proj")
            x = x + self.conv1d(self.gelu(self.conv1d(self.norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
        return self.norm(x[-1], "transformer.ln_f") @ w["transformer.wte.weight"].T

    def greedy(self, tokens, steps: int) -> list[int]:
        tokens, out = list(tokens), []
        for _ in range(steps):
            out.append(int(np.argmax(self.logits(tokens))))
            tokens.append(out[-1])
        return out


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request, tmp_path, rng):
    """(directory, config dict, state) of a tiny random GPT-2: n_inner 4 n_embd (null) or 96."""
    config = dict(CONFIG, **VARIANTS[request.param])
    state = random_state(rng, config)
    return write_checkpoint(tmp_path / request.param, config, state), config, state


# --- loading ----------------------------------------------------------------------------------------------
def test_load_transposes_the_conv1d_weights_once_and_keeps_hugging_faces_keys(checkpoint):
    directory, config, state = checkpoint
    model = load(directory, "fp32")
    assert set(model.state_dict()) == set(state)  # lm_head: tied, no key of its own
    assert model.lm_head is None and model.transformer.wte.weight.shape == (V, H)
    loaded = model.state_dict()
    for key in (f"transformer.h.{n}.{name}.weight" for n in range(L) for name in CONV1D):
        np.testing.assert_array_equal(loaded[key], state[key].T)  # Linear's (out, in)
        assert loaded[key].flags.c_contiguous
    assert model.load_report.transposed == sorted(f"transformer.h.{n}.{name}.weight" for n in range(L) for name in CONV1D)
    assert list(model.transformer.h)[1].mlp.c_fc.activation == "gelu"
    text = "\n".join(model.describe())
    assert model.describe()[0].startswith(f"CausalLM (GPT-2): 2 layers, n_embd 64, 4 heads of 16, n_inner "
                                          f"{inner(config)}, vocab 97, 64 positions, fp32 on the CPU")
    for phrase in ("lm_head: tied to transformer.wte", "kv_append, no rotation", "transposed 8 Conv1D weights",
                   "KV cache: k and v (layers, 4, 32, 4, 16)", "eager: one launch per op"):
        assert phrase in text, phrase


def test_lm_head_and_the_attention_buffers_are_set_aside_and_reported(tmp_path, rng):
    """lm_head.weight (tied to wte), and the attn.bias (the causal mask) and attn.masked_bias buffers old
    checkpoints saved: ignored, listed in load_report and describe(), the logits as without them."""
    state = random_state(rng, CONFIG)
    extra = {"lm_head.weight": state["transformer.wte.weight"].copy(),
             "transformer.h.0.attn.bias": np.tril(np.ones((1, 1, POSITIONS, POSITIONS), np.float32)),
             "transformer.h.1.attn.masked_bias": np.array(-1e4, np.float32)}
    plain = load(write_checkpoint(tmp_path / "plain", CONFIG, state))
    model = load(write_checkpoint(tmp_path / "extra", CONFIG, dict(state, **extra)))
    assert model.load_report.ignored == sorted(extra)
    assert "ignored 3 keys (tied lm_head, buffers)" in "\n".join(model.describe())
    seqs = prompts(rng)
    np.testing.assert_array_equal(model.prefill(*padded(seqs)), plain.prefill(*padded(seqs)))


def test_a_gpt2model_checkpoint_without_the_prefix_loads_with_it_added(tmp_path, rng):
    """The original gpt2 files hold GPT2Model's keys (wte.weight, h.0.attn.c_attn.weight, ..., and the
    attn.bias buffers): the prefix is added, the buffers set aside, the logits those of the prefixed file."""
    state = random_state(rng, CONFIG)
    bare = {k.removeprefix("transformer."): v for k, v in state.items()}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, POSITIONS, POSITIONS), np.float32))
    model = load(write_checkpoint(tmp_path / "bare", CONFIG, bare))
    prefixed = load(write_checkpoint(tmp_path / "prefixed", CONFIG, state))
    assert model.load_report.key_prefix == "transformer." and prefixed.load_report.key_prefix is None
    assert model.load_report.ignored == ["h.0.attn.bias"]
    assert "added the key prefix 'transformer.'" in "\n".join(model.describe())
    seqs = prompts(rng)
    np.testing.assert_array_equal(model.prefill(*padded(seqs)), prefixed.prefill(*padded(seqs)))


def test_a_model_built_from_a_config_runs_and_counts_its_parameters():
    config = GPT2Config.from_dict(dict(CONFIG, n_inner=96))
    model = CausalLM(config, dtype="fp64", max_batch=2, max_len=16)
    assert model.architecture.model_type == "gpt2" and model.base_model is model.transformer
    assert sum(a.size for a in model.state_dict().values()) == config.parameter_count()
    out = model.generate([[3, 4, 5], [6]], 4, eos_token_id=())
    assert [len(o) for o in out] == [4, 4] and all(0 <= t < V for o in out for t in o)
    with pytest.raises(TypeError, match=r"^CausalLM: config must be a LlamaConfig or a GPT2Config \(built by its "
                                        r"from_dict\(...\)\), got dict"):
        CausalLM(CONFIG)


def test_a_config_without_model_type_is_read_by_its_architectures(tmp_path, rng):
    config = {k: v for k, v in CONFIG.items() if k != "model_type"}
    model = load(write_checkpoint(tmp_path, config, random_state(rng, CONFIG)))
    assert isinstance(model.config, GPT2Config) and model.describe()[0].startswith("CausalLM (GPT-2)")


def test_the_cache_is_refused_past_n_positions(tmp_path, rng):
    directory = write_checkpoint(tmp_path, CONFIG, random_state(rng, CONFIG))
    with pytest.raises(ValueError, match=r"^CausalLM.from_pretrained: max_len 65 is beyond the model's n_positions 64"):
        load(directory, max_len=65)
    assert load(directory, max_len=None).max_len == POSITIONS  # the default: min(2048, n_positions)


# --- bad configs and checkpoints --------------------------------------------------------------------------
BAD_CONFIGS = [
    ({"activation_function": "relu"}, ValueError,
     r"activation_function 'relu' is not supported \(supported: \['gelu_new', 'gelu_pytorch_tanh', 'gelu_fast'\]: "
     r"the tanh GELU\)"),
    ({"activation_function": "gelu"}, ValueError, r"activation_function 'gelu' is not supported"),
    ({"scale_attn_weights": False}, ValueError, r"scale_attn_weights=False is not supported \(only True"),
    ({"scale_attn_by_inverse_layer_idx": True}, ValueError, r"scale_attn_by_inverse_layer_idx=True is not supported"),
    ({"add_cross_attention": True}, ValueError, r"add_cross_attention=True is not supported"),
    ({"tie_word_embeddings": False}, ValueError, r"tie_word_embeddings=False is not supported \(only True: lm_head"),
    ({"architectures": ["GPT2DoubleHeadsModel"]}, ValueError,
     r"architectures \['GPT2DoubleHeadsModel'\] are not supported \(supported: \['GPT2LMHeadModel'\]"),
    ({"model_type": "gpt_neo"}, ValueError, r"model_type 'gpt_neo' is not supported \(supported: \['llama', 'gpt2'\]"),
    ({"quantization_config": {"quant_method": "gptq"}}, ValueError, r"quantized checkpoints .*'gptq'.* not supported"),
    ({"n_embd": 66}, ValueError, r"n_embd 66 is not a multiple of n_head 4"),
    ({"n_head": 0}, ValueError, r"n_head must be a positive int, got 0"),
    ({"n_layer": 2.0}, TypeError, r"n_layer must be an int, got float 2.0"),
    ({"n_inner": 0}, ValueError, r"n_inner must be a positive int, got 0"),
    ({"n_positions": None}, TypeError, r"n_positions must be an int, got NoneType None"),
    ({"layer_norm_epsilon": 0}, ValueError, r"layer_norm_epsilon must be > 0, got 0"),
    ({"eos_token_id": 97}, ValueError, r"eos_token_id 97 is outside the vocabulary \[0, 97\)"),
    ({"bos_token_id": 50256}, ValueError, r"bos_token_id 50256 is outside the vocabulary \[0, 97\)"),
]
BAD_CHECKPOINTS = [
    (lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"), KeyError,
     r"missing keys \['transformer.h.1.mlp.c_fc.bias'\], unexpected keys \[\]"),
    (lambda s: s.update({"transformer.h.2.ln_1.weight": np.ones(H, np.float32)}), KeyError,
     r"missing keys \[\], unexpected keys \['transformer.h.2.ln_1.weight'\]"),
    (lambda s: s.update({"transformer.h.0.attn.c_attn.weight": np.zeros((3 * H, H), np.float32)}), ValueError,
     r"transformer.h.0.attn.c_attn.weight has shape \(192, 64\), the layer expects \(64, 192\) \(a Conv1D weight, "
     r"stored \(in_features, out_features\)\)"),
    (lambda s: s.update({"transformer.h.1.mlp.c_proj.weight": np.zeros(H, np.float32)}), ValueError,
     r"transformer.h.1.mlp.c_proj.weight has shape \(64,\), the layer expects \(256, 64\) \(a Conv1D weight"),
    (lambda s: s.update({"transformer.ln_f.bias": np.zeros(H + 1, np.float32)}), ValueError,
     r"transformer.ln_f.bias has shape \(65,\), the layer expects \(64,\)"),
    (lambda s: s.update({"transformer.wpe.weight": np.zeros((POSITIONS, H), np.complex64)}), TypeError,
     r"transformer.wpe.weight has dtype complex64"),
]


@pytest.fixture(params=BAD_CONFIGS, ids=lambda case: str(case[0])[:40])
def bad_config(request):
    return request.param


@pytest.fixture(params=BAD_CHECKPOINTS, ids=lambda case: case[2][:40])
def bad_checkpoint(request):
    return request.param


def test_the_config_fills_hugging_faces_defaults():
    c = GPT2Config.from_dict({"model_type": "gpt2"})
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (50257, 1024, 768, 12, 12)
    assert (c.intermediate_size, c.head_dim, c.eos_token_id, c.activation) == (3072, 64, (50256,), "gelu")
    assert GPT2Config.from_dict(dict(CONFIG, activation_function="gelu_pytorch_tanh")).activation == "gelu"
    assert GPT2Config.from_dict(dict(CONFIG, reorder_and_upcast_attn=True)) == GPT2Config.from_dict(CONFIG)


# --- libnn generate -------------------------------------------------------------------------------------------
def test_libnn_generate_runs_a_gpt2_directory(capsys, tmp_path, rng):
    """The CLI through libnn.cli.main on the CPU: the printed tokens are CausalLM.generate's."""
    from test_cli_generate import generate, printed_sequences

    directory = write_checkpoint(tmp_path, CONFIG, random_state(rng, CONFIG))
    seqs = [[5, 17, 33, 2, 90], [40, 3]]
    code, out, err = generate(capsys, str(directory), "--prompt-ids", "5,17,33,2,90", "--prompt-ids", "40,3",
                              "--max-new-tokens", "6", "--device", "cpu", "--dtype", "fp32", "--eos-token-id")
    assert code == 0, err
    assert any(line.startswith("CausalLM (GPT-2): 2 layers") for line in out.splitlines()), out
    model = CausalLM.from_pretrained(directory, dtype="fp32", device="cpu", max_batch=2)
    assert printed_sequences(out) == [t.tolist() for t in model.generate(seqs, 6, eos_token_id=())]


# --- against transformers: the reference path on the host, and on the GPU (marked gpu) ------------------------
HF_N_INNER = {"default": None, "n_inner-96": 96}


def hf_checkpoint(tmp_path, variant: str = "default"):
    """transformers' GPT2LMHeadModel with random weights (std 0.1: logits that spread), its biases and
    LayerNorm affines drawn too (transformers starts them at 0 and 1, which would hide a bias or an affine
    left out), eager attention, saved with save_pretrained in safetensors; the model in fp32 on the host as
    the reference."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=V, n_positions=2 * HF_MAX_LEN, n_embd=H, n_layer=L, n_head=HEADS,
                                     n_inner=HF_N_INNER[variant], initializer_range=0.1, bos_token_id=1,
                                     eos_token_id=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif ".ln_" in name:  # ln_1, ln_2, ln_f weights
                p.normal_(1.0, 0.2)
    model.save_pretrained(tmp_path)  # safetensors: the default since transformers 4.35, the only format in 5
    assert (tmp_path / "model.safetensors").is_file(), sorted(p.name for p in tmp_path.iterdir())
    return model


@pytest.fixture(params=list(HF_N_INNER))
def hf_variant(request) -> str:
    return request.param


class TestGPT2(DecoderCases):
    """tests/decoder_cases.py's checks, for GPT-2: against NumpyGPT2 on the checkpoint fixture's two
    configs, against transformers' GPT2LMHeadModel on hf_checkpoint's two, and BAD_CONFIGS and
    BAD_CHECKPOINTS refused."""
    config = CONFIG
    reference = NumpyGPT2
    random_state = staticmethod(random_state)
    hf_checkpoint = staticmethod(hf_checkpoint)
    config_description = "2 layers, n_embd 64, n_inner 256"


@pytest.mark.gpu
def test_sampling_on_the_gpu_is_seeded_and_top_k_1_is_greedy(tmp_path, rng):
    """64 sampled tokens per sequence: the same seed gives the same tokens (fp16); top_k=1 gives the greedy
    ones (fp32, where no two logits round to a tie, which top_k keeps both of and greedy does not)."""
    hf_checkpoint(tmp_path)
    seqs = hf_prompts(rng)

    def run(model, **kwargs):
        return [o.tolist() for o in model.generate(seqs, HF_STEPS["gpu"], eos_token_id=(), **kwargs)]

    half, single = (CausalLM.from_pretrained(tmp_path, dtype=dtype, device="gpu", max_batch=3, max_len=HF_MAX_LEN)
                    for dtype in ("fp16", "fp32"))
    assert run(half, temperature=1.0, seed=3) == run(half, temperature=1.0, seed=3)
    assert run(half, temperature=0.8, top_k=20, top_p=0.9, seed=5) == \
        run(half, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    assert run(single, temperature=1.0, top_k=1, seed=4) == run(single)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("batch", [3, 4])
def test_graph_decode_steps_match_eager_steps(tmp_path, rng, dtype, batch):
    """The same checkpoint with decode graphs (buckets 1, 2, 4) and without, 6 greedy steps: logits within
    1e-5 (fp32) or 1e-2 (fp16) of the eager steps', bit-identical in fp32 where the batch fills its bucket
    (the graph replays the eager pass's own kernels on the same shapes); a batch of 3 pads to 4."""
    import cupy

    directory = write_checkpoint(tmp_path, CONFIG, random_state(rng, CONFIG))
    kwargs = dict(dtype=dtype, device="gpu", max_batch=4, max_len=POSITIONS)
    graphed = CausalLM.from_pretrained(directory, decode_graphs=True, **kwargs)
    eager = CausalLM.from_pretrained(directory, decode_graphs=False, **kwargs)
    ids, lengths = padded(prompts(rng, (9, 4, 1, 6)[:batch]))
    tokens = cupy.argmax(eager.prefill(ids, lengths).astype(cupy.float32), axis=-1)
    graphed.prefill(ids, lengths)
    for step in range(6):
        expected = eager.decode_step(tokens)
        got = graphed.decode_step(tokens)
        error = rel_error(got, expected.astype("float32").get())
        assert error <= {"fp32": 1e-5, "fp16": 1e-2}[dtype], f"step {step}: relative error {error:.3g}"
        if batch == 4 and dtype == "fp32":
            assert (got == expected).all(), f"step {step}: not bit-identical"
        tokens = cupy.argmax(expected.astype(cupy.float32), axis=-1)
    assert set(graphed.decode_graph_stats()) == {(4,)}
    assert "one CUDA graph replay per step" in "\n".join(graphed.describe())
