"""The paged KV cache on the CPU reference path (issue 16): kv_append through a page table (each token at
row p % page_size of page page_table[b, p // page_size], nothing else moved), attention over paged k and
v equal to the dense reference over the same keys gathered (decode and causal prefill, GQA, both layouts,
page sizes of 1, 3 and 8), and CausalLM(kv_layout="paged") generating the dense cache's greedy tokens
with its logits step by step (LLaMA and GPT-2, page sizes 1, 4, 8 and 32 for max_len 20: 8 does not
divide it, 32 is past it; a padded batch of prompts of different lengths); the page table's invariants
(no page in two rows, each row holding ceil(length / page_size) pages); and the errors bad arguments get,
each naming the function and the argument.

Tolerances: kv_append copies bits (exact); attention's paged and dense references gather the same float64
keys (exact); the decoder's paged and dense logits in fp64 within 1e-12 (relative L2: the same ops on the
same values, the keys padded past each row's length differently)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_normal, rel_error
from decoder_cases import padded, prompts, write_checkpoint
from test_gpt2 import CONFIG as GPT2_CONFIG
from test_kv_append_reference import assert_only_tokens_written
from test_llama import CONFIG as LLAMA_CONFIG
from test_llama import random_state

import libnn
from libnn.models import CausalLM, GPT2Config, LlamaConfig
from libnn.ops import attention, kv_append, rope, rope_frequencies
from libnn.ops.attention import CheckedPageTable, attention_problem

B, S, H, D = 3, 5, 2, 8


def page_table(rng, B: int, max_pages: int, pages: int) -> np.ndarray:
    """(B, max_pages) int32: distinct pages drawn from [0, pages) in random order."""
    return rng.permutation(pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)


# --- kv_append ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4, 8])
@pytest.mark.parametrize("position_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("rotated", [True, False])
def test_kv_append_writes_each_token_into_its_page_and_nothing_else(rng, page_size, position_dtype, rotated):
    L = 13  # positions per sequence: the table spans ceil(13 / page_size) pages
    max_pages = -(-L // page_size)
    pages = B * max_pages + 2  # two pages no sequence owns
    table = page_table(rng, B, max_pages, pages)
    k, v = random_normal(rng, (B, S, H, D), "fp64"), random_normal(rng, (B, S, H, D), "fp64")
    positions = (rng.integers(0, L - S + 1, (B, 1)) + np.arange(S)).astype(position_dtype)
    inv_freq = rope_frequencies(D) if rotated else None
    k_pool, v_pool = random_normal(rng, (pages, page_size, H, D), "fp64"), random_normal(rng, (pages, page_size, H, D),
                                                                                         "fp64")
    before_k, before_v = k_pool.copy(), v_pool.copy()
    kv_append(k, v, positions, inv_freq, k_pool, v_pool, page_table=table)
    expected_k = rope(k, positions, inv_freq, path="reference") if rotated else k
    assert_only_tokens_written(k_pool, v_pool, before_k, before_v, expected_k, v, positions,
                               lambda b, p: (table[b, p // page_size], p % page_size))


def test_kv_append_into_a_pool_stored_heads_first_writes_the_same_values(rng):
    """The decoder's pools are stored (pages, H, page_size, D), cuDNN's container, and passed as their
    (pages, page_size, H, D) view."""
    page_size, max_pages = 4, 2
    table = page_table(rng, B, max_pages, B * max_pages)
    k, v = random_normal(rng, (B, S, H, D), "fp32"), random_normal(rng, (B, S, H, D), "fp32")
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    inv_freq = rope_frequencies(D)
    stored = np.zeros((2, B * max_pages, H, page_size, D), np.float32)
    plain = np.zeros((2, B * max_pages, page_size, H, D), np.float32)
    kv_append(k, v, positions, inv_freq, stored[0].transpose(0, 2, 1, 3), stored[1].transpose(0, 2, 1, 3),
              page_table=table)
    kv_append(k, v, positions, inv_freq, plain[0], plain[1], page_table=table)
    np.testing.assert_array_equal(stored.transpose(0, 1, 3, 2, 4), plain)


def kv_append_call(rng, **changes):
    page_size, max_pages, pages = 4, 3, 9
    args = dict(k=random_normal(rng, (B, S, H, D), "fp32"), v=random_normal(rng, (B, S, H, D), "fp32"),
                positions=np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)), inv_freq=rope_frequencies(D),
                k_cache=np.zeros((pages, page_size, H, D), np.float32), v_cache=np.zeros((pages, page_size, H, D),
                                                                                          np.float32),
                page_table=page_table(rng, B, max_pages, pages), checked=False)
    args.update(changes)
    return lambda: kv_append(args["k"], args["v"], args["positions"], args["inv_freq"], args["k_cache"],
                             args["v_cache"], page_table=args["page_table"], checked=args["checked"])


@pytest.mark.parametrize("changes, error, message", [
    (dict(page_table=np.zeros((B, 3), np.int64)), TypeError, "kv_append: page_table must be an int32 array"),
    (dict(page_table=np.zeros((B + 1, 3), np.int32)), ValueError,
     r"kv_append: page_table must have shape \(B, max_pages\) = \(3, max_pages >= 1\) .* got \(4, 3\)"),
    (dict(page_table=np.zeros((B, 0), np.int32)), ValueError, r"kv_append: page_table must have shape .* got \(3, 0\)"),
    (dict(page_table=np.zeros(B, np.int32)), ValueError, r"kv_append: page_table must have shape .* got \(3,\)"),
    (dict(k_cache=np.zeros((9, 4, H + 1, D), np.float32)), ValueError,
     r"kv_append: k_cache must be a pool of pages \(pages, page_size, H, D\) = \(pages, page_size, 2, 8\)"),
    (dict(k_cache=np.zeros((9, 3, H, D), np.float32), v_cache=np.zeros((9, 3, H, D), np.float32)), ValueError,
     "kv_append: the pools' page_size .* must be a power of two, got 3"),
    (dict(page_table=np.full((B, 3), 9, np.int32)), ValueError,
     r"kv_append: page_table entries must lie in \[0, 9\) \(the pools' pages\), got values from 9 to 9"),
    (dict(page_table=np.full((B, 3), -1, np.int32), checked=True), ValueError,
     r"kv_append: page_table entries must lie in \[0, 9\)"),
    (dict(positions=np.full((B, S), 12, np.int32)), ValueError, r"kv_append: positions must lie in \[0, 12\)"),
])
def test_kv_append_refuses_a_bad_page_table_or_pool_naming_it(rng, changes, error, message):
    with pytest.raises(error, match=message):
        kv_append_call(rng, **changes)()


# --- attention ----------------------------------------------------------------------------------------------
def paged_and_dense(rng, pages: int, page_size: int, max_pages: int, Hkv: int, layout: str, dtype="fp64"):
    """k and v pools in `layout`'s order, a page table, and the dense (B, Skv) k and v it gathers."""
    table = page_table(rng, B, max_pages, pages)
    pools = [random_normal(rng, (pages, Hkv, page_size, D), dtype) for _ in range(2)]  # BHSD order
    dense = [pool[table].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, max_pages * page_size, D) for pool in pools]
    if layout == "BSHD":
        pools = [pool.transpose(0, 2, 1, 3) for pool in pools]
        dense = [d.transpose(0, 2, 1, 3) for d in dense]
    return table, pools, dense


@pytest.mark.parametrize("layout", ["BSHD", "BHSD"])
@pytest.mark.parametrize("page_size, max_pages", [(1, 11), (3, 4), (8, 2)])
@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (3, 3), (2, 1)])
def test_paged_attention_equals_the_dense_reference_on_the_gathered_keys(rng, layout, page_size, max_pages, Hq, Hkv):
    pages = B * max_pages + 3
    table, (k, v), (dense_k, dense_v) = paged_and_dense(rng, pages, page_size, max_pages, Hkv, layout)
    Skv = max_pages * page_size
    lens_kv = np.array([Skv, 1, Skv // 2 + 1])
    for Sq, causal, lens_q in ((1, False, None), (7, True, np.array([7, 1, 4])), (5, "bottom_right", None)):
        shape = (B, Sq, Hq, D) if layout == "BSHD" else (B, Hq, Sq, D)
        q = random_normal(rng, shape, "fp64")
        kwargs = dict(causal=causal, seq_lens_q=lens_q, seq_lens_kv=lens_kv if Sq == 1 or lens_q is None else lens_q,
                      layout=layout)
        expected = attention(q, dense_k, dense_v, **kwargs)
        np.testing.assert_array_equal(attention(q, k, v, page_table=table, **kwargs), expected)
        np.testing.assert_array_equal(attention(q, k, v, page_table=CheckedPageTable(table), **kwargs), expected)
        assert libnn.get_op("attention").last_decision.path == "reference"


def attention_call(rng, **changes):
    pages, page_size, max_pages = 7, 4, 2
    args = dict(q=random_normal(rng, (B, 1, 4, D), "fp32"), page_table=page_table(rng, B, max_pages, pages),
                attn_bias=None, layout="BSHD", packed=None)
    args["k"], args["v"] = (random_normal(rng, (pages, page_size, 2, D), "fp32") for _ in range(2))
    args.update(changes)
    return lambda: attention(args["q"], args["k"], args["v"], page_table=args["page_table"], attn_bias=args["attn_bias"],
                             layout=args["layout"], packed=args["packed"], seq_lens_kv=[8, 1, 5])


@pytest.mark.parametrize("changes, error, message", [
    (dict(page_table=np.zeros((B, 2), np.int64)), TypeError, "attention: page_table must be an int32 array"),
    (dict(page_table=np.zeros((B - 1, 2), np.int32)), ValueError,
     r"attention: page_table must have shape \(B, max_pages\) = \(3, max_pages >= 1\) for q of batch 3 \(k and v hold 7 "
     r"pages\), got \(2, 2\)"),
    (dict(page_table=np.full((B, 2), 7, np.int32)), ValueError,
     r"attention: page_table entries must lie in \[0, 7\) \(the pages of k and v\), got values from 7 to 7"),
    (dict(page_table=np.full((B, 2), -2, np.int32)), ValueError, r"attention: page_table entries .* from -2 to -2"),
    (dict(attn_bias=np.zeros((B, 1, 1, 8), np.float32)), ValueError, "attention: page_table takes no attn_bias"),
    (dict(layout="THD"), ValueError, "attention: page_table needs layout 'BHSD' or 'BSHD', got 'THD'"),
    (dict(v=np.zeros((6, 4, 2, D), np.float32)), ValueError, "attention: k and v must have the same shape"),
    (dict(k="k"), TypeError, "attention: k must be an array"),
])
def test_paged_attention_refuses_bad_input_naming_the_argument(rng, changes, error, message):
    with pytest.raises(error, match=message):
        attention_call(rng, **changes)()


def test_the_custom_kernels_pass_paged_problems_of_small_pages_to_cudnn_which_needs_power_of_two_pages(rng):
    """Pages under a 64-key tile: the split-K decoding kernel does not read them (tests/test_attention_auto_order.py
    has the pages it reads), and the unfused path reads none."""
    op = libnn.get_op("attention")
    for page_size, cudnn_reason in ((16, None), (12, "power-of-two size, got page_size 12")):
        table = page_table(rng, 2, 3, 6)
        q = random_normal(rng, (2, 1, 4, 64), "fp16")
        k = random_normal(rng, (6, page_size, 2, 64), "fp16")
        problem = attention_problem(q, k, k.copy(), None, None, False, "BSHD", False, True, page_table=table)
        assert (problem.pages, problem.page_size, problem.Skv) == (6, page_size, 3 * page_size)
        assert "pages of a power-of-two size >= 64" in op.paths["custom"].supports(problem)
        assert "unfused reads no pages" in op.paths["unfused"].supports(problem)
        reason = op.paths["cudnn"].supports(problem)
        assert reason is None if cudnn_reason is None else cudnn_reason in reason


# --- CausalLM -----------------------------------------------------------------------------------------------
MAX_LEN, MAX_BATCH = 20, 4
ARCHITECTURES = {"llama": (LlamaConfig, LLAMA_CONFIG), "gpt2": (GPT2Config, GPT2_CONFIG)}


def dense_and_paged(name: str, page_size: int, kv_pages: int | None = None) -> tuple[CausalLM, CausalLM]:
    config_class, fields = ARCHITECTURES[name]
    config = config_class.from_dict(fields, "test")
    dense = CausalLM(config, dtype="fp64", max_batch=MAX_BATCH, max_len=MAX_LEN)
    paged = CausalLM(config, dtype="fp64", max_batch=MAX_BATCH, max_len=MAX_LEN, kv_layout="paged",
                     page_size=page_size, kv_pages=kv_pages)
    paged.load_state_dict(dict(dense.state_dict()))
    return dense, paged


def check_page_table(model: CausalLM) -> None:
    """Each sequence's row holds ceil(length / page_size) pages, no page is in two rows, the rest of the
    table names the spare page."""
    cache = model._cache
    held = -(-model.lengths // cache.page_size)
    table = cache.table
    owned = np.concatenate([table[b, :n] for b, n in enumerate(held)])
    assert len(set(owned.tolist())) == owned.size and owned.max(initial=0) < cache.pages
    rest = np.ones(table.shape, bool)
    for b, n in enumerate(held):
        rest[b, :n] = False
    assert (table[rest] == cache.pages).all()


@pytest.mark.parametrize("page_size", [1, 4, 8, 32])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_paged_cache_gives_the_dense_caches_logits_and_greedy_tokens(rng, name, page_size):
    dense, paged = dense_and_paged(name, page_size)
    ids, lengths = padded(prompts(rng, (7, 3, 1, 5)))
    expected, got = dense.prefill(ids, lengths), paged.prefill(ids, lengths)
    assert rel_error(got, expected) <= 1e-12
    check_page_table(paged)
    for step in range(MAX_LEN - 7):
        tokens = np.argmax(expected, axis=-1)
        expected, got = dense.decode_step(tokens), paged.decode_step(tokens)
        assert rel_error(got, expected) <= 1e-12, f"step {step}"
        check_page_table(paged)
    np.testing.assert_array_equal(paged.lengths, dense.lengths)
    seqs = prompts(rng, (2, 9, 4))  # a new batch: every page back, then handed out again
    for b, (e, g) in enumerate(zip(dense.generate(seqs, 11, eos_token_id=()), paged.generate(seqs, 11, eos_token_id=()))):
        np.testing.assert_array_equal(g, e, err_msg=f"sequence {b}")
    check_page_table(paged)


def test_pages_interleave_as_sequences_grow_and_the_spare_takes_the_padding(rng):
    _, paged = dense_and_paged("llama", 4)
    ids, lengths = padded(prompts(rng, (5, 2)))
    paged.prefill(ids, lengths)
    cache = paged._cache
    spare = cache.pages
    np.testing.assert_array_equal(cache.table[:2, :2], [[0, 1], [2, spare]])
    for _ in range(4):  # sequence 1 takes its second page at position 4 (step 3), sequence 0 its third at 8 (step 4)
        paged.decode_step([3, 4])
    np.testing.assert_array_equal(cache.table[:2, :3], [[0, 1, 4], [2, 3, spare]])
    assert (cache.table[2:] == spare).all()
    assert "KV cache: paged" in "\n".join(paged.describe())


# --- a pool smaller than every sequence's worst case -------------------------------------------------------
def test_a_pool_of_the_pages_a_generation_reaches_gives_the_dense_caches_tokens(rng):
    """Prompts of 7, 3, 1 and 5 tokens and 9 new ones cache 15, 11, 9 and 13 positions: 4 + 3 + 3 + 4 = 14
    pages of 4, of the 20 that 4 sequences of 20 tokens could hold. A pool of 14 gives the dense cache's
    tokens and holds no page twice; one of 13 refuses the call before it runs, and the model then runs a
    call that fits."""
    seqs = prompts(rng, (7, 3, 1, 5))
    dense, paged = dense_and_paged("llama", 4, kv_pages=14)
    expected = dense.generate(seqs, 9, eos_token_id=())
    for b, (g, e) in enumerate(zip(paged.generate(seqs, 9, eos_token_id=()), expected)):
        np.testing.assert_array_equal(g, e, err_msg=f"sequence {b}")
    check_page_table(paged)
    assert paged._cache.pages == 14 and paged._cache.k.shape[1] == 15  # and the spare
    _, small = dense_and_paged("llama", 4, kv_pages=13)
    small.load_state_dict(dict(dense.state_dict()))
    with pytest.raises(ValueError, match=r"CausalLM.generate: the prompts and max_new_tokens 9 \(every generated token "
                                         r"but the last is cached\) need 14 pages of 4 tokens, more than the paged KV "
                                         r"cache's 13 \(kv_pages\)"):
        small.generate(seqs, 9, eos_token_id=())
    for b, (g, e) in enumerate(zip(small.generate(seqs, 8, eos_token_id=()), expected)):
        np.testing.assert_array_equal(g, e[:8], err_msg=f"sequence {b}")
    check_page_table(small)


def test_prompts_past_the_pool_are_refused_and_the_cached_sequences_stay(rng):
    dense, paged = dense_and_paged("llama", 4, kv_pages=3)
    ids, lengths = padded(prompts(rng, (5, 2)))  # 2 + 1 pages
    expected, got = dense.prefill(ids, lengths), paged.prefill(ids, lengths)
    with pytest.raises(ValueError, match=r"CausalLM.prefill: the prompts need 6 pages of 4 tokens, more than the "
                                         r"paged KV cache's 3 \(kv_pages\)"):
        paged.prefill(*padded(prompts(rng, (7, 3, 1, 5))))
    np.testing.assert_array_equal(paged.lengths, [5, 2])
    tokens = np.argmax(expected, axis=-1)
    assert rel_error(paged.decode_step(tokens), dense.decode_step(tokens)) <= 1e-12


def test_a_decode_step_past_the_free_pages_is_refused_with_nothing_taken(rng):
    """6 pages for prompts of 7, 3, 1 and 5 tokens (2 + 1 + 1 + 2): the first step takes none; the second
    needs new pages for sequences 0 (its 9th position) and 1 (its 5th), finds none free and changes nothing;
    a new prefill then runs."""
    dense, paged = dense_and_paged("llama", 4, kv_pages=6)
    ids, lengths = padded(prompts(rng, (7, 3, 1, 5)))
    expected, got = dense.prefill(ids, lengths), paged.prefill(ids, lengths)
    tokens = np.argmax(expected, axis=-1)
    expected, got = dense.decode_step(tokens), paged.decode_step(tokens)
    assert rel_error(got, expected) <= 1e-12
    table = paged._cache.table.copy()
    with pytest.raises(ValueError, match=r"CausalLM.decode_step: sequences \[0, 1\] need 2 new pages of 4 tokens but 0 "
                                         r"of the paged KV cache's 6 \(kv_pages\) are free"):
        paged.decode_step(np.argmax(expected, axis=-1))
    np.testing.assert_array_equal(paged.lengths, [8, 4, 2, 6])
    np.testing.assert_array_equal(paged._cache.table, table)
    check_page_table(paged)
    ids, lengths = padded(prompts(rng, (9, 6)))
    assert rel_error(paged.prefill(ids, lengths), dense.prefill(ids, lengths)) <= 1e-12
    check_page_table(paged)


def test_a_smaller_pool_is_what_the_cache_allocates_and_describes():
    config = LlamaConfig.from_dict(LLAMA_CONFIG, "test")
    model = CausalLM(config, dtype="fp64", max_batch=MAX_BATCH, max_len=MAX_LEN, kv_layout="paged", page_size=4,
                     kv_pages=9)
    model.prefill([[1, 2, 3]])
    cache = model._cache
    assert cache.k.shape[1] == cache.v.shape[1] == 10 and cache.table.shape == (MAX_BATCH, 5)
    assert config.cache_bytes(MAX_BATCH, MAX_LEN, "fp64", 4, 9) == cache.k.nbytes + cache.v.nbytes
    assert config.cache_bytes(MAX_BATCH, MAX_LEN, "fp64", 4) == config.cache_bytes(MAX_BATCH, MAX_LEN, "fp64", 4, 20)
    assert "(layers, 9 + 1 spare pages" in "\n".join(model.describe())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(kv_layout="blocked"), ValueError, r"kv_layout must be one of \('dense', 'paged'\), got 'blocked'"),
    (dict(kv_layout=None), ValueError, r"kv_layout must be one of \('dense', 'paged'\), got None"),
    (dict(kv_layout="paged", page_size=0), ValueError, "page_size must be a positive int, got 0"),
    (dict(kv_layout="paged", page_size=-8), ValueError, "page_size must be a positive int, got -8"),
    (dict(kv_layout="paged", page_size=12), ValueError, "page_size must be a power of two .*, got 12"),
    (dict(kv_layout="paged", page_size=8.0), TypeError, "page_size must be an int, got float 8.0"),
    (dict(kv_layout="paged", page_size="8"), TypeError, "page_size must be an int, got str '8'"),
    (dict(page_size=8), ValueError, "page_size 8 goes with kv_layout='paged'"),
    (dict(kv_pages=4), ValueError, "kv_pages 4 goes with kv_layout='paged'"),
    (dict(kv_layout="paged", kv_pages=0), ValueError, "kv_pages must be a positive int, got 0"),
    (dict(kv_layout="paged", kv_pages=2.0), TypeError, "kv_pages must be an int, got float 2.0"),
    (dict(kv_layout="paged", page_size=8, kv_pages=4), ValueError,
     r"kv_pages 4 is more than max_batch 1 sequences of max_len 20 tokens can hold \(3 pages of 8\)"),
    (dict(kv_layout="paged", path="custom"), ValueError,
     r"kv_layout 'paged' needs attention on one of \('auto', 'cudnn', 'reference'\) .* got path 'custom'"),
    (dict(kv_layout="paged", path={"attention": "unfused"}), ValueError,
     "kv_layout 'paged' needs attention .* got path 'unfused' for attention"),
])
def test_bad_kv_options_are_refused_naming_the_argument(tmp_path, rng, kwargs, error, message):
    config = LlamaConfig.from_dict(LLAMA_CONFIG, "test")
    with pytest.raises(error, match=f"CausalLM: {message}"):
        CausalLM(config, max_len=MAX_LEN, **kwargs)
    directory = write_checkpoint(tmp_path / "llama", LLAMA_CONFIG, random_state(rng, LLAMA_CONFIG))
    with pytest.raises(error, match=f"CausalLM.from_pretrained: {message}"):
        CausalLM.from_pretrained(directory, dtype="fp64", device="cpu", max_len=MAX_LEN, **kwargs)


def test_from_pretrained_builds_the_paged_cache_it_is_asked_for(tmp_path, rng):
    directory = write_checkpoint(tmp_path / "llama", LLAMA_CONFIG, random_state(rng, LLAMA_CONFIG))
    model = CausalLM.from_pretrained(directory, dtype="fp64", device="cpu", max_batch=2, max_len=MAX_LEN,
                                     kv_layout="paged", page_size=8)
    dense = CausalLM.from_pretrained(directory, dtype="fp64", device="cpu", max_batch=2, max_len=MAX_LEN)
    seqs = prompts(rng, (4, 6))
    for g, e in zip(model.generate(seqs, 8, eos_token_id=()), dense.generate(seqs, 8, eos_token_id=())):
        np.testing.assert_array_equal(g, e)
    assert model._cache.page_size == 8 and model._cache.table.shape == (2, 3)
