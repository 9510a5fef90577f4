"""CausalLM.quantize("fp8"): every projection (q, k, v and gate, up stacked as E4M3 codes with per-row
scales; o, down; an untied lm_head) in FP8, the word embeddings, norms and KV cache in the model's dtype,
for the tiny random LLaMA of tests/test_llama.py. On the host (reference path, fp32 activations): logits
against the float model's, generation running end to end. On the GPU (marked gpu): fp16 activations, the
decode graphs against eager FP8 steps, and the logits' relative error against the fp16 model, printed
(the issue asks for it measured). Bounds on 1 - cosine of the logits: 1e-2 against the float model on the
host (fp32 activations, both weights and activations quantised), 3e-2 against fp16 on the
GPU, where the H100 measured up to 1.6e-2 (relative L2 error up to 0.18) over this model's prefill and six
steps: E4M3 keeps 3 mantissa bits, each weight and activation within 6%, and this tiny model's logits
are large (weights 1.5/sqrt(fan-in))."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_error
from test_llama import CONFIG, padded, prompts, random_state, write_checkpoint

from libnn.models import CausalLM

COSINE_GAP = 1e-2      # host, fp32 activations
GPU_COSINE_GAP = 3e-2  # GPU, against the fp16 model


def cosine_gap(a, b) -> float:
    a, b = (np.asarray(x.get() if hasattr(x, "get") else x, np.float64).ravel() for x in (a, b))
    return 1 - float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture
def checkpoint(tmp_path, rng):
    return write_checkpoint(tmp_path / "gqa", CONFIG, random_state(rng, CONFIG))


def test_quantized_logits_stay_close_and_generation_runs_on_the_host(rng, checkpoint):
    kwargs = dict(dtype="fp32", device="cpu", max_batch=4, max_len=32)
    plain = CausalLM.from_pretrained(checkpoint, **kwargs)
    fp8 = CausalLM.from_pretrained(checkpoint, **kwargs).quantize("fp8")
    attention = next(iter(fp8.model.layers)).self_attn
    assert attention.q_proj.weight.dtype == np.uint8 and fp8.lm_head.weight.dtype == np.uint8
    assert fp8.model.embed_tokens.weight.dtype == np.float32  # embeddings and norms keep the model's dtype
    stacked = attention.packed()
    assert stacked.weight.dtype == np.uint8 and stacked.weight_scale.shape == (stacked.weight.shape[0],)
    ids, lengths = padded(prompts(rng, (7, 3, 5)))
    gap = cosine_gap(fp8.prefill(ids, lengths), plain.prefill(ids, lengths))
    assert gap <= COSINE_GAP, f"1 - cosine {gap:.3g}"
    tokens = fp8.generate(prompts(rng, (4, 2)), 6, eos_token_id=())
    assert [len(t) for t in tokens] == [6, 6]


@pytest.mark.gpu
def test_fp8_decode_graphs_match_eager_fp8_steps_and_stay_close_to_fp16(rng, checkpoint):
    import cupy

    kwargs = dict(dtype="fp16", device="gpu", max_batch=4, max_len=32)
    fp16 = CausalLM.from_pretrained(checkpoint, **kwargs)
    graphed = CausalLM.from_pretrained(checkpoint, **kwargs).quantize("fp8")
    eager = CausalLM.from_pretrained(checkpoint, decode_graphs=False, **kwargs).quantize("fp8")
    ids, lengths = padded(prompts(rng, (7, 3, 5, 1)))
    reference = fp16.prefill(ids, lengths)
    tokens = cupy.argmax(reference.astype(cupy.float32), axis=-1)
    for model in (graphed, eager):
        model.prefill(ids, lengths)
    gaps = [cosine_gap(graphed.prefill(ids, lengths), reference)]
    errors = []
    for step in range(6):
        expected, got, plain = eager.decode_step(tokens), graphed.decode_step(tokens), fp16.decode_step(tokens)
        assert rel_error(got, expected.astype(cupy.float32).get()) <= 1e-2, f"step {step}: graph vs eager"
        gaps.append(cosine_gap(got, plain))
        errors.append(rel_error(got, plain.astype(cupy.float32).get()))
        tokens = cupy.argmax(plain.astype(cupy.float32), axis=-1)
    print(f"FP8 vs fp16 logits: 1 - cosine up to {max(gaps):.3g}, relative L2 error up to {max(errors):.3g}")
    assert max(gaps) <= GPU_COSINE_GAP
