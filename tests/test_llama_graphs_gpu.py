"""CausalLM's decode steps as CUDA graphs (one capture per batch bucket) against the same model's eager
steps, on the GPU (marked gpu), with tiny random LLaMA checkpoints of tests/test_llama.py: logits step by
step for batches that fill their bucket and batches padded up to it, greedy tokens of whole generations,
one capture per bucket however many steps replay it, new weights after a capture, and decode_step's
result surviving the next step.

Tolerances (relative L2 error of the logits, graph against eager): fp32 1e-5 and fp16 1e-2; where the
batch fills its bucket the graph replays the eager pass's own kernels on the same shapes and the logits
are bit-identical; a padded batch runs the GEMMs with more rows, which may pick other kernels."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_error
from test_llama import CONFIG, V, padded, prompts, random_state, write_checkpoint

from libnn.models import CausalLM

pytestmark = pytest.mark.gpu

MAX_BATCH = 5  # decode buckets (1, 2, 4, 5): a batch of 3 pads to 4, of 4 and 5 fills its bucket
TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2}


@pytest.fixture
def checkpoint(tmp_path, rng):
    config = dict(CONFIG, max_position_embeddings=96)
    return write_checkpoint(tmp_path / "gqa", config, random_state(rng, config)), config


def pair(directory, dtype):
    """The same checkpoint as a model with decode graphs and one without."""
    kwargs = dict(dtype=dtype, device="gpu", max_batch=MAX_BATCH, max_len=96)
    return (CausalLM.from_pretrained(directory, decode_graphs=True, **kwargs),
            CausalLM.from_pretrained(directory, decode_graphs=False, **kwargs))


def greedy(logits):
    import cupy
    return cupy.argmax(logits.astype(cupy.float32), axis=-1)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("batch", [1, 3, 4, 5])
def test_graph_decode_steps_match_eager_steps(rng, checkpoint, dtype, batch):
    graphed, eager = pair(checkpoint[0], dtype)
    ids, lengths = padded(prompts(rng, (9, 4, 1, 6, 2)[:batch]))
    tokens = greedy(eager.prefill(ids, lengths))
    graphed.prefill(ids, lengths)
    for step in range(6):
        expected = eager.decode_step(tokens)
        got = graphed.decode_step(tokens)
        error = rel_error(got, expected.astype("float32").get())
        assert error <= TOLERANCE[dtype], f"step {step}: relative error {error:.3g}"
        if batch != 3 and dtype == "fp32":  # the bucket's own shapes: the eager pass's kernels
            assert (got == expected).all(), f"step {step}: not bit-identical"
        tokens = greedy(expected)
    np.testing.assert_array_equal(graphed.lengths, eager.lengths)


def test_generation_with_graphs_gives_eagers_tokens(rng, checkpoint):
    graphed, eager = pair(checkpoint[0], "fp32")
    seqs = prompts(rng, (5, 2, 7))
    expected = eager.generate(seqs, 40, eos_token_id=())
    got = graphed.generate(seqs, 40, eos_token_id=())
    for b, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(g, e, err_msg=f"sequence {b}")
    sampled = [graphed.generate(seqs, 12, temperature=0.9, top_k=20, seed=5) for _ in range(2)]
    for a, b in zip(*sampled):
        np.testing.assert_array_equal(a, b)


def test_one_capture_per_bucket_however_many_steps(rng, checkpoint):
    graphed, _ = pair(checkpoint[0], "fp16")
    assert graphed.decode_graph_stats() == {}
    graphed.generate(prompts(rng, (4, 3, 2)), 10, eos_token_id=())
    graphed.generate(prompts(rng, (6, 1, 2)), 8, eos_token_id=())
    graphed.generate(prompts(rng, (3,)), 5, eos_token_id=())
    stats = graphed.decode_graph_stats()
    assert set(stats) == {(4,), (1,)}
    assert stats[(4,)].captures == 1 and stats[(4,)].replays == 9 + 7
    assert stats[(1,)].captures == 1 and stats[(1,)].replays == 4
    assert "one CUDA graph replay per step" in "\n".join(graphed.describe())


def test_new_weights_after_a_capture_are_used(rng, checkpoint):
    directory, config = checkpoint
    graphed, eager = pair(directory, "fp32")
    seqs = prompts(rng, (4, 6))
    graphed.generate(seqs, 4, eos_token_id=())  # captured with the old weights
    state = random_state(rng, config)
    for model in (graphed, eager):
        model.load_state_dict({k: _on_gpu(v) for k, v in state.items()})
    ids, lengths = padded(seqs)
    tokens = greedy(eager.prefill(ids, lengths))
    graphed.prefill(ids, lengths)
    for _ in range(3):
        expected = eager.decode_step(tokens)
        assert rel_error(graphed.decode_step(tokens), expected.get()) <= TOLERANCE["fp32"]
        tokens = greedy(expected)


def _on_gpu(a):
    import cupy
    return cupy.asarray(a)


def test_decode_steps_result_is_the_callers(rng, checkpoint):
    graphed, _ = pair(checkpoint[0], "fp32")
    ids, lengths = padded(prompts(rng, (3, 5)))
    tokens = greedy(graphed.prefill(ids, lengths))
    first = graphed.decode_step(tokens)
    kept = first.copy()
    graphed.decode_step(greedy(first))
    assert (first == kept).all()
    assert V == first.shape[1]


def test_unchecked_decode_steps_give_the_checked_ones_logits(rng, checkpoint):
    graphed, _ = pair(checkpoint[0], "fp32")
    ids, lengths = padded(prompts(rng, (3, 5)))
    tokens = greedy(graphed.prefill(ids, lengths))
    checked = graphed.decode_step(tokens)
    graphed.prefill(ids, lengths)
    unchecked = graphed.decode_step(tokens, check_ids=False)
    assert (checked == unchecked).all()
    with pytest.raises(TypeError, match="CausalLM.decode_step: check_ids must be"):
        graphed.decode_step(tokens, check_ids="no")
