"""`libnn bench generate`'s arithmetic, on the CPU: the bytes a decode step reads, the context of the
median timed step, the rates against the copy bandwidth, the greedy-token comparison, the targets'
verdicts, and the plans the bench runs. Its timings belong to the benchmark, not to a test."""

import statistics

import pytest

from libnn.bench import generate
from libnn.cli import parser
from libnn.models.llama import LlamaConfig

TINY = {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 6, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}


def test_decode_bytes_count_every_weight_once_but_only_the_batch_rows_of_an_untied_embedding_table():
    config = LlamaConfig.from_dict(TINY)
    # per layer: q 4x4, k 2x4, v 2x4, o 4x4, gate 6x4, up 6x4, down 4x6, two norms of 4
    layer = 16 + 8 + 8 + 16 + 24 + 24 + 24 + 8
    lm_head, final_norm, embedding_rows = 10 * 4, 4, 3 * 4
    weights, kv = generate.decode_bytes(config, batch=3, context=5, itemsize=2)
    assert weights == 2 * (2 * layer + lm_head + final_norm + embedding_rows)
    assert kv == 2 * (2 * 2 * 3 * 5 * 1 * 2)  # k and v, 2 layers, 3 sequences, 5 positions, 1 KV head of 2


def test_decode_bytes_read_a_tied_embedding_table_whole_as_lm_head():
    tied = LlamaConfig.from_dict({**TINY, "tie_word_embeddings": True})
    weights, _ = generate.decode_bytes(tied, batch=3, context=5, itemsize=4)
    assert weights == 4 * tied.parameter_count()
    untied, _ = generate.decode_bytes(LlamaConfig.from_dict(TINY), batch=3, context=5, itemsize=4)
    assert untied - weights == 4 * 3 * 4  # the untied model's lm_head replaces the table; plus the batch's rows


@pytest.mark.parametrize("prompt, steps, warmup", [(512, 256, 8), (128, 32, 4), (10, 5, 2), (7, 1, 0)])
def test_median_context_is_the_median_timed_steps_context_rounded_down(prompt, steps, warmup):
    contexts = [prompt + i + 1 for i in range(warmup, steps)]
    assert generate.median_context(prompt, steps, warmup) == int(statistics.median(contexts))


def test_rates_against_the_copy_bandwidth():
    found = generate.rates(weight_bytes=2_000_000_000, kv_bytes=1_000_000_000, batch=4, step_ms=1.0,
                           copy_gbs=4000.0)
    assert found["tokens/s"] == pytest.approx(4000)
    assert found["%copy weights"] == pytest.approx(50)
    assert found["%copy w+KV"] == pytest.approx(75)


def test_matching_prefix_stops_at_the_first_difference():
    assert generate.matching_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert generate.matching_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert generate.matching_prefix([5, 2], [1, 2]) == 0
    assert generate.matching_prefix([1, 2, 3], [1, 2]) == 2


def test_model_label_rounds_the_parameter_count():
    assert generate.model_label(LlamaConfig.from_dict(generate.SHAPE)) == "LLaMA 1.10B"
    assert generate.model_label(LlamaConfig.from_dict(generate.QUICK_SHAPE)) == "LLaMA 111M"


def test_targets_give_the_issues_verdicts_on_libnn_batch_1_rows_only():
    rows = [{"path": generate.LIBNN, "dtype": "fp16", "batch": 1, "%copy weights": 85.0, "x HF": 3.5},
            {"path": generate.LIBNN, "dtype": "bf16", "batch": 1, "%copy weights": 40.0, "x HF": 2.0},
            {"path": generate.HF, "dtype": "fp16", "batch": 1, "%copy weights": 10.0},
            {"path": generate.LIBNN, "dtype": "fp16", "batch": 8, "%copy weights": 10.0, "x HF": 1.0},
            {"path": generate.LIBNN, "dtype": "fp16", "batch": 64, "note": "not run: OutOfMemoryError"}]
    text = generate.targets(rows, quick=False)
    assert "batch-1 decode fp16: weights at 85% of copy bandwidth (target >= 80%: met)" in text
    assert "batch-1 decode fp16: 3.50x Hugging Face eager's tokens/s, per call (target >= 3x: met)" in text
    assert "batch-1 decode bf16: 2.00x Hugging Face eager's tokens/s, per call (target >= 3x: MISSED)" in text
    assert "bf16: weights at" not in text  # the bandwidth target is set in fp16
    assert text.count("met") + text.count("MISSED") == 3 and "quick" not in text
    assert "--quick runs the small model" in generate.targets(rows, quick=True)
    assert "not measured here yet: FP8" in generate.targets([], quick=False)


@pytest.mark.parametrize("plan", [generate.FULL, generate.QUICK], ids=["full", "quick"])
def test_plans_fit_their_cache_and_read_as_libnn_configs(plan):
    config = LlamaConfig.from_dict(dict(plan.shape))
    assert plan.max_len == plan.prompt + plan.steps <= config.max_position_embeddings
    assert 0 <= plan.warmup < plan.steps and plan.prefill_runs >= 1
    assert config.head_dim == 64 and set(plan.dtypes) <= {"fp16", "bf16"}


def test_the_cache_holds_the_greedy_comparison_after_a_short_decode():
    plan = generate.Plan(TINY, ("fp16",), (1,), prompt=10, steps=3, warmup=1)
    assert plan.max_len == 10 + generate.GREEDY_TOKENS - 1


def test_the_full_plan_is_the_issues_1b_shape_and_quick_a_smoke_test():
    full = LlamaConfig.from_dict(dict(generate.FULL.shape))
    assert 1.0e9 <= full.parameter_count() <= 1.2e9
    assert (full.num_hidden_layers, full.hidden_size, full.num_attention_heads, full.num_key_value_heads,
            full.intermediate_size, full.vocab_size) == (16, 2048, 32, 8, 8192, 32000)
    assert generate.FULL.dtypes == ("fp16", "bf16") and generate.FULL.batches == (1, 8, 64)
    assert (generate.FULL.prompt, generate.FULL.steps) == (512, 256)
    assert generate.QUICK.dtypes == ("fp16",) and generate.QUICK.batches == (1, 8)
    assert (generate.QUICK.prompt, generate.QUICK.steps) == (128, 32)


def test_the_cli_takes_bench_generate():
    args = parser().parse_args(["bench", "generate", "--quick", "--json", "out.json"])
    assert (args.op, args.quick, args.json) == ("generate", True, "out.json")
