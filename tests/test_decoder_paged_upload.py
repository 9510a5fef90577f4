"""A paged KV cache's pages and page-table uploads (issue 16): which steps upload the table, which pages go
where, and that a paged decode step that takes a page queues without waiting for the GPU.

On the CPU reference path (the ops read the host table itself): the table is uploaded at each prefill
and at exactly the decode steps where some sequence's new token starts a page, never at another; pages
go out lowest first, row by row, the table after every step equal to an independent free-list model's.
On the GPU (marked gpu): a decode graph replay whose step takes a page returns while a spin kernel queued
before it still runs (the table's copy queued behind it, the host not waiting), and its logits are the
dense cache's; 40 steps queued back to back behind a spin, taking pages on the way, give the dense
cache's logits at every step (each queued upload reads the table of its own step, not a later one).

Tolerances: the CPU checks are exact (page indices); the GPU logits paged against dense in fp16 within
1e-2 relative L2, as tests/test_kv_paged_gpu.py holds them (cuDNN may pick other engines for the paged
graph)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_error
from decoder_cases import V, padded, prompts, write_checkpoint
from test_llama import CONFIG, random_state

from libnn.models import CausalLM, LlamaConfig
from libnn.models.decoder import PagedKVCache

MAX_BATCH, MAX_LEN, PAGE_SIZE = 4, 20, 4
PROMPT_LENGTHS = (5, 2, 8, 1)  # 8 fills its pages: its first step starts one


def paged_model(page_size: int = PAGE_SIZE) -> CausalLM:
    config = LlamaConfig.from_dict(CONFIG, "test")
    return CausalLM(config, dtype="fp64", max_batch=MAX_BATCH, max_len=MAX_LEN, kv_layout="paged",
                    page_size=page_size)


@pytest.fixture
def uploads(monkeypatch) -> tuple[list, list]:
    """(labels, made): the test appends a label to `labels` before each prefill or step; each
    PagedKVCache._upload call appends the last label to `made`."""
    labels: list = []
    made: list = []
    upload = PagedKVCache._upload

    def counted(cache):
        made.append(labels[-1])
        upload(cache)

    monkeypatch.setattr(PagedKVCache, "_upload", counted)
    return labels, made


def steps_that_take_a_page(lengths, steps: int, page_size: int) -> list[int]:
    """The decode steps (from 0) at which some sequence's new token starts a page: step s writes
    position lengths[b] + s."""
    return [s for s in range(steps) if any((n + s) % page_size == 0 for n in lengths)]


def test_the_table_is_uploaded_at_a_prefill_and_only_at_the_steps_that_take_a_page(rng, uploads):
    labels, made = uploads
    model = paged_model()
    ids, lengths = padded(prompts(rng, PROMPT_LENGTHS))
    labels.append("prefill")
    logits = model.prefill(ids, lengths)
    steps = MAX_LEN - max(PROMPT_LENGTHS)
    for step in range(steps):
        labels.append(step)
        logits = model.decode_step(np.argmax(logits, axis=-1), check_ids=False)
    expected = steps_that_take_a_page(PROMPT_LENGTHS, steps, PAGE_SIZE)
    assert made == ["prefill", *expected]
    assert len(expected) < steps  # steps without a page exist, and they uploaded nothing
    labels.append("second prefill")
    model.prefill(ids[:1], lengths[:1])
    assert made[-1] == "second prefill"


def free_list_table(lengths, steps: int, page_size: int, max_pages: int, spare: int) -> list[np.ndarray]:
    """The table after the prefill and after each step, by a free list handing out its lowest page first:
    at the prefill ceil(length / page_size) pages per row in row order, at a step one page for each row
    (in row order) whose new token starts a page."""
    free = list(range(spare))
    table = np.full((len(lengths), max_pages), spare, np.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-n // page_size)):
            table[b, j] = free.pop(0)
    tables = [table.copy()]
    for s in range(steps):
        for b, n in enumerate(lengths):
            if (n + s) % page_size == 0:
                table[b, (n + s) // page_size] = free.pop(0)
        tables.append(table.copy())
    return tables


@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_pages_go_out_lowest_first_row_by_row_and_the_table_follows_every_step(rng, page_size):
    model = paged_model(page_size)
    ids, lengths = padded(prompts(rng, PROMPT_LENGTHS))
    logits = model.prefill(ids, lengths)
    cache = model._cache
    steps = MAX_LEN - max(PROMPT_LENGTHS)
    expected = free_list_table(PROMPT_LENGTHS, steps, page_size, cache.max_pages, cache.pages)
    np.testing.assert_array_equal(cache.table[:len(PROMPT_LENGTHS)], expected[0], err_msg="after the prefill")
    for step in range(steps):
        logits = model.decode_step(np.argmax(logits, axis=-1))
        np.testing.assert_array_equal(cache.table[:len(PROMPT_LENGTHS)], expected[step + 1],
                                      err_msg=f"after step {step}")
    assert (cache.table[len(PROMPT_LENGTHS):] == cache.pages).all()  # rows no sequence holds: the spare


# --- on the GPU ---------------------------------------------------------------------------------------------
GPU_MAX_LEN, GPU_PAGE_SIZE = 64, 16
SPIN_SECONDS = 1.0  # far longer than a decode step takes the host to queue


@pytest.fixture
def gpu_models(tmp_path, rng) -> tuple[CausalLM, CausalLM]:
    """The same checkpoint dense and paged (pages of 16), fp16 on the GPU, decode graphs on."""
    directory = write_checkpoint(tmp_path / "llama", CONFIG, random_state(rng, CONFIG))
    kwargs = dict(dtype="fp16", device="gpu", max_batch=MAX_BATCH, max_len=GPU_MAX_LEN)
    return (CausalLM.from_pretrained(directory, **kwargs),
            CausalLM.from_pretrained(directory, kv_layout="paged", page_size=GPU_PAGE_SIZE, **kwargs))


def spin(seconds: float):
    """A kernel that keeps the GPU busy for about `seconds`, queued on the current stream, and an event
    recorded behind it."""
    import cupy

    from libnn.runtime import timing

    timing.hold_stream(seconds)
    return cupy.cuda.get_current_stream().record()


@pytest.mark.gpu
def test_a_paged_step_that_takes_a_page_returns_before_the_gpu_reaches_it(rng, gpu_models):
    import cupy

    dense, paged = gpu_models
    ids, lengths = padded(prompts(rng, (15, 31)))  # the first step fills their pages, the second starts new ones
    tokens = [cupy.asarray(rng.integers(0, V, 2)) for _ in range(2)]
    for model in gpu_models:
        model.prefill(ids, lengths)
        model.decode_step(tokens[0], check_ids=False)  # captures the bucket's graph: the next step replays it
    expected = dense.decode_step(tokens[1], check_ids=False)
    cupy.cuda.get_current_stream().synchronize()
    spun = spin(SPIN_SECONDS)
    got = paged.decode_step(tokens[1], check_ids=False)
    assert not spun.done, "the paged step that took a page waited for the GPU's queued work"
    cache = paged._cache
    np.testing.assert_array_equal(cache.table.get(), cache._host)  # the new pages reached the ops' table
    assert (cache._host[[0, 1], [1, 2]] < cache.pages).all()
    assert rel_error(got.astype(cupy.float32).get(), expected.astype(cupy.float32).get()) <= 1e-2


@pytest.mark.gpu
def test_paged_steps_queued_behind_the_gpu_across_pages_give_the_dense_logits(rng, gpu_models):
    import cupy

    seqs = prompts(rng, (5, 18, 2))
    ids, lengths = padded(seqs)
    steps = 40  # pages of 16: each sequence takes two on the way
    tokens = [cupy.asarray(t) for t in rng.integers(0, V, (steps, len(seqs)))]

    def queued_steps(model: CausalLM) -> list:
        model.prefill(ids, lengths)
        model.decode_step(tokens[0], check_ids=False)  # the capture, which synchronises
        cupy.cuda.get_current_stream().synchronize()
        spin(0.2)  # every other step, and its table upload where it takes a page, queued behind the spin
        return [model.decode_step(t, check_ids=False) for t in tokens[1:]]

    dense, paged = gpu_models
    expected, got = queued_steps(dense), queued_steps(paged)
    cupy.cuda.get_current_stream().synchronize()
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        assert rel_error(g.astype(cupy.float32).get(), e.astype(cupy.float32).get()) <= 1e-2, f"step {step}"
