"""The paged KV cache on the GPU (issue 16, marked gpu): kv_append's custom path through a page table
against the reference (pools poisoned with NaN bits first: every row a token writes holds the reference's
bits for v and rope.cu's rotation for k, every other row its poison), a page out of range refused or,
with checked=True, writing nothing; cuDNN's SDPA over paged k and v against the reference (decode and
causal prefill, GQA, pools stored as cuDNN's containers (pages, Hkv, page_size, D) and passed as their
BSHD view); CausalLM(kv_layout="paged") in fp16 against the dense cache step by step, with decode graphs
on and off, and greedy generation.

Tolerances (relative L2): attention fp16/bf16 1e-2 against the float64 reference; the decoder's paged
against dense logits in fp16 1e-2 (both run cuDNN's SDPA, which may pick other engines for the paged
graph). Greedy tokens: the paged model fed the dense model's tokens (teacher forcing) picks the same
argmax at every step where the dense logits' top two differ by more than 0.05 (a near tie that rounding
may flip is no disagreement); whole generations must match where no step had such a tie."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_normal, rel_error
from decoder_cases import padded, prompts, write_checkpoint
from test_kv_append_gpu import poisoned
from test_llama import CONFIG, random_state

import libnn
from libnn import dtypes
from libnn.models import CausalLM
from libnn.ops import attention, kv_append, rope, rope_frequencies

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.05  # fp16 logits whose top two differ by less may swap under another engine's rounding


def page_table(rng, B: int, max_pages: int, pages: int) -> np.ndarray:
    return rng.permutation(pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)


# --- kv_append ----------------------------------------------------------------------------------------------
# (B, S, H, D, page_size, max_pages, rotary_dim, positions' dtype)
CASES = [(3, 7, 2, 64, 4, 4, None, np.int32), (1, 1, 1, 128, 16, 3, None, np.int64),
         (2, 13, 3, 80, 1, 17, 32, np.int32), (3, 1, 1, 64, 64, 2, None, np.int64)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-S{}-H{}-D{}-P{}-M{}-R{}-{}".format(*c[:7],
                                                                                            np.dtype(c[7]).name))
def test_kv_append_custom_writes_the_references_bits_into_the_pages_and_nothing_else(rng, case, rotated, dtype):
    import cupy

    B, S, H, D, P, M, R, position_dtype = case
    pages = B * M + 1
    table = page_table(rng, B, M, pages)
    qkv = random_normal(rng, (B, S, 3 * H, D), dtype)
    positions = (rng.integers(0, M * P - S + 1, (B, 1)) + np.arange(S)).astype(position_dtype)
    inv_freq = rope_frequencies(R or D) if rotated else None
    stored = [poisoned((pages, H, P, D), dtype) for _ in range(2)]  # cuDNN's containers, passed as BSHD views
    g = cupy.asarray(qkv)
    kv_append(g[:, :, H:2 * H], g[:, :, 2 * H:], cupy.asarray(positions),
              None if inv_freq is None else cupy.asarray(inv_freq), *(s.transpose(0, 2, 1, 3) for s in stored),
              page_table=cupy.asarray(table), rotary_dim=R if rotated else None)
    assert libnn.get_op("kv_append").last_decision.path == "custom"
    bits = f"u{dtypes.parse(dtype).itemsize}"
    untouched = poisoned((pages, P, H, D), dtype).get()
    expected_k, expected_v = untouched.copy(), untouched.copy()
    kv_append(qkv[:, :, H:2 * H], qkv[:, :, 2 * H:], positions, inv_freq, expected_k, expected_v, page_table=table,
              rotary_dim=R if rotated else None)
    got_k, got_v = (s.transpose(0, 2, 1, 3).get() for s in stored)
    np.testing.assert_array_equal(got_v.view(bits), expected_v.view(bits))
    rows = np.arange(B)[:, None]
    page, slot = table[rows, positions // P], positions % P
    written = np.zeros((pages, P), bool)
    written[page, slot] = True
    np.testing.assert_array_equal(got_k.view(bits)[~written], untouched.view(bits)[~written])
    if rotated:
        custom = rope(g[:, :, H:2 * H], cupy.asarray(positions), cupy.asarray(inv_freq), rotary_dim=R).get()
        np.testing.assert_array_equal(got_k.view(bits)[page, slot], custom.view(bits))
        assert rel_error(got_k[page, slot], expected_k[page, slot]) <= dtypes.TOLERANCE[dtype]
    else:
        np.testing.assert_array_equal(got_k.view(bits)[page, slot], qkv[:, :, H:2 * H].view(bits))


def test_kv_append_refuses_pages_out_of_range_or_with_checked_writes_nothing_there(rng):
    import cupy

    B, S, H, D, P = 2, 3, 2, 64, 4
    k, v = (cupy.asarray(random_normal(rng, (B, S, H, D), "fp16")) for _ in range(2))
    table = cupy.asarray(np.array([[0, 1], [2, 9]], np.int32))  # page 9 of 4
    positions = cupy.asarray(np.array([[0, 1, 2], [3, 4, 5]], np.int32))  # sequence 1's 4 and 5: page 9
    k_pool, v_pool = poisoned((4, P, H, D), "fp16"), poisoned((4, P, H, D), "fp16")
    with pytest.raises(ValueError, match=r"kv_append: page_table entries must lie in \[0, 4\).*from 0 to 9"):
        kv_append(k, v, positions, None, k_pool, v_pool, page_table=table)
    assert cupy.isnan(v_pool).all()
    kv_append(k, v, positions, None, k_pool, v_pool, page_table=table, checked=True)
    written = ~cupy.isnan(v_pool).any(axis=(2, 3)).get()
    expected = np.zeros((4, P), bool)
    expected[0, :3] = expected[2, 3] = True
    np.testing.assert_array_equal(written, expected)


# --- attention ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("page_size, max_pages", [(16, 5), (64, 2), (1, 37)])
@pytest.mark.parametrize("Hq, Hkv, D", [(8, 2, 64), (4, 4, 128), (6, 1, 80)])
def test_cudnn_paged_attention_matches_the_reference(rng, dtype, page_size, max_pages, Hq, Hkv, D):
    import cupy

    B = 3
    pages = B * max_pages + 1
    Skv = page_size * max_pages
    table = page_table(rng, B, max_pages, pages)
    stored = [random_normal(rng, (pages, Hkv, page_size, D), dtype) for _ in range(2)]
    k, v = (s.transpose(0, 2, 1, 3) for s in stored)  # BSHD views of cuDNN's containers
    gk, gv = (cupy.asarray(s).transpose(0, 2, 1, 3) for s in stored)
    lens = np.array([Skv, 1, Skv // 2 + 3])
    for Sq, causal, lens_q in ((1, False, None), (Skv // 2 + 3, True, np.array([Skv // 2 + 3, 1, 5]))):
        q = random_normal(rng, (B, Sq, Hq, D), dtype)
        lens_kv = lens if lens_q is None else lens_q
        expected = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=causal,
                             seq_lens_q=lens_q, seq_lens_kv=lens_kv, layout="BSHD", page_table=table)
        got = attention(cupy.asarray(q), gk, gv, causal=causal, layout="BSHD", page_table=cupy.asarray(table),
                        seq_lens_q=None if lens_q is None else cupy.asarray(lens_q, cupy.int32),
                        seq_lens_kv=cupy.asarray(lens_kv, cupy.int32), path="cudnn")  # (auto: custom at Sq 1)
        assert libnn.get_op("attention").last_decision.path == "cudnn"
        assert rel_error(got, expected) <= dtypes.TOLERANCE[dtype], f"Sq={Sq}"


def test_paged_attention_on_the_gpu_refuses_a_page_out_of_range(rng):
    import cupy

    q = cupy.asarray(random_normal(rng, (2, 1, 4, 64), "fp16"))
    k = cupy.asarray(random_normal(rng, (5, 16, 2, 64), "fp16"))
    table = cupy.asarray(np.array([[0, 1], [2, 5]], np.int32))
    with pytest.raises(ValueError, match=r"attention: page_table entries must lie in \[0, 5\).*from 0 to 5"):
        attention(q, k, k.copy(), layout="BSHD", page_table=table, seq_lens_kv=cupy.asarray([3, 20], cupy.int32))


# --- CausalLM -----------------------------------------------------------------------------------------------
MAX_BATCH, MAX_LEN = 5, 96


@pytest.fixture
def directory(tmp_path, rng):
    config = dict(CONFIG, max_position_embeddings=MAX_LEN)
    return write_checkpoint(tmp_path / "gqa", config, random_state(rng, config))


def models(directory, page_size: int, decode_graphs: bool, kv_pages: int | None = None) -> tuple[CausalLM, CausalLM]:
    kwargs = dict(dtype="fp16", device="gpu", max_batch=MAX_BATCH, max_len=MAX_LEN, decode_graphs=decode_graphs)
    return (CausalLM.from_pretrained(directory, **kwargs),
            CausalLM.from_pretrained(directory, kv_layout="paged", page_size=page_size, kv_pages=kv_pages, **kwargs))


def margin(logits: np.ndarray) -> np.ndarray:
    """Each row's top logit minus its second."""
    top = np.sort(logits.astype(np.float32), axis=-1)
    return top[:, -1] - top[:, -2]


@pytest.mark.parametrize("decode_graphs", [True, False])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_paged_logits_match_dense_step_by_step_and_pick_the_same_tokens(rng, directory, page_size, decode_graphs,
                                                                        batch):
    import cupy

    dense, paged = models(directory, page_size, decode_graphs)
    ids, lengths = padded(prompts(rng, (9, 4, 1, 6, 17)[:batch]))
    expected, got = dense.prefill(ids, lengths), paged.prefill(ids, lengths)
    for step in range(40):  # the longest prompt crosses pages of 16 twice, of 64 once
        e, g = expected.astype(cupy.float32).get(), got.astype(cupy.float32).get()
        assert rel_error(g, e) <= 1e-2, f"step {step}"
        clear = margin(e) > NEAR_TIE
        np.testing.assert_array_equal(g.argmax(-1)[clear], e.argmax(-1)[clear], err_msg=f"step {step}")
        tokens = cupy.asarray(e.argmax(-1))
        expected, got = dense.decode_step(tokens), paged.decode_step(tokens)
    np.testing.assert_array_equal(paged.lengths, dense.lengths)
    if decode_graphs:
        assert paged.decode_graph_stats()


@pytest.mark.parametrize("decode_graphs", [True, False])
def test_a_pool_of_just_the_pages_the_sequences_reach_gives_the_dense_logits(rng, directory, decode_graphs):
    """17 pages of 16 (of the 30 that 5 sequences of 96 tokens could hold): prompts of 9, 4, 1, 6 and 17
    tokens and 40 steps hold 4 + 3 + 3 + 3 + 4 of them; the step that starts a page next (sequence 3's 49th
    token, two steps on) is refused with nothing changed, and a new prefill runs."""
    import cupy

    dense, paged = models(directory, 16, decode_graphs, kv_pages=17)
    ids, lengths = padded(prompts(rng, (9, 4, 1, 6, 17)))
    expected, got = dense.prefill(ids, lengths), paged.prefill(ids, lengths)
    for step in range(40):
        e, g = expected.astype(cupy.float32).get(), got.astype(cupy.float32).get()
        assert rel_error(g, e) <= 1e-2, f"step {step}"
        tokens = cupy.asarray(e.argmax(-1))
        expected, got = dense.decode_step(tokens), paged.decode_step(tokens)
    assert rel_error(got.astype(cupy.float32).get(), expected.astype(cupy.float32).get()) <= 1e-2
    tokens = cupy.asarray(expected.astype(cupy.float32).get().argmax(-1))
    for _ in range(2):
        paged.decode_step(tokens)
    with pytest.raises(ValueError, match=r"CausalLM.decode_step: sequences \[3\] need 1 new page of 16 tokens but 0 "
                                         r"of the paged KV cache's 17 \(kv_pages\) are free"):
        paged.decode_step(tokens)
    np.testing.assert_array_equal(paged.lengths, [51, 46, 43, 48, 59])
    assert paged.generate(prompts(rng, (30, 2)), 8, eos_token_id=())


@pytest.mark.parametrize("decode_graphs", [True, False])
def test_paged_greedy_generation_gives_the_dense_tokens(rng, directory, decode_graphs):
    dense, paged = models(directory, 16, decode_graphs)
    seqs = prompts(rng, (5, 18, 2))
    expected = dense.generate(seqs, 48, eos_token_id=())
    got = paged.generate(seqs, 48, eos_token_id=())
    # the tokens may part only after a near tie in the dense model's own logits: re-run it teacher-forced
    ids, lengths = padded(seqs)
    logits = dense.prefill(ids, lengths)
    for step in range(48):
        host = logits.astype("float32").get()
        for b in range(len(seqs)):
            if margin(host)[b] <= NEAR_TIE:
                pytest.skip(f"sequence {b} meets a near tie at step {step}: tokens may part there")
        logits = dense.decode_step(host.argmax(-1))
    for b, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(g, e, err_msg=f"sequence {b}")


def test_a_paged_model_on_the_gpu_needs_fp16_or_bf16(directory):
    with pytest.raises(ValueError, match="CausalLM.from_pretrained: kv_layout 'paged' on the GPU needs dtype fp16 or "
                                         "bf16 .*, got fp32"):
        CausalLM.from_pretrained(directory, dtype="fp32", device="gpu", max_len=MAX_LEN, kv_layout="paged")
