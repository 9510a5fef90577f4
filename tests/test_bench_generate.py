"""`libnn bench generate`'s arithmetic, on the CPU: the bytes a decode step reads, the context of the
median timed step, the rates against the copy bandwidth, the greedy-token comparison, libnn's ratios
against the Hugging Face rows, which rows a case has (the paged KV cache's on LLaMA in fp16), the options
each libnn row's model is loaded with, a case's rows and kernel splits, the table's columns, the decode
step's kernel categories, one-line errors, the targets' verdicts and the paged-against-dense line, and the
plans the bench runs. Its timings belong to the benchmark, not to a test."""

import statistics
from types import SimpleNamespace

import pytest

from libnn.bench import generate, harness
from libnn.cli import parser
from libnn.models.decoder import CausalLM
from libnn.models.gpt2 import GPT2Config
from libnn.models.llama import LlamaConfig

TINY = {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 6, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}
TINY_GPT2 = {"vocab_size": 10, "n_positions": 16, "n_embd": 4, "n_layer": 2, "n_head": 2, "bos_token_id": 0,
             "eos_token_id": 0}
PLANS = {"full llama": generate.FULL[0], "full gpt2": generate.FULL[1], "quick llama": generate.QUICK[0],
         "quick gpt2": generate.QUICK[1]}


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


def test_decode_bytes_of_gpt2_read_the_tied_table_whole_and_the_position_table_at_the_batch_rows():
    config = GPT2Config.from_dict(TINY_GPT2)
    # per layer: ln_1 and ln_2 (weight and bias of 4), c_attn 4x12 + 12, c_proj 4x4 + 4, c_fc 4x16 + 16,
    # mlp c_proj 16x4 + 4
    layer = 2 * 8 + (48 + 12) + (16 + 4) + (64 + 16) + (64 + 4)
    wte, wpe_rows, ln_f = 10 * 4, 3 * 4, 8
    weights, kv = generate.decode_bytes(config, batch=3, context=5, itemsize=2)
    assert weights == 2 * (2 * layer + wte + wpe_rows + ln_f)
    assert weights == 2 * (config.parameter_count() - (16 - 3) * 4)
    assert kv == 2 * (2 * 2 * 3 * 5 * 2 * 2)  # k and v, 2 layers, 3 sequences, 5 positions, 2 heads of 2


@pytest.mark.parametrize("config", [LlamaConfig.from_dict(TINY),
                                    LlamaConfig.from_dict({**TINY, "tie_word_embeddings": True}),
                                    GPT2Config.from_dict(TINY_GPT2)], ids=["llama", "llama tied", "gpt2"])
def test_a_models_parameter_bytes_are_its_configs_decode_bytes(config):
    model = CausalLM(config, dtype="fp32", device="cpu", max_batch=3, max_len=8)
    assert generate.model_bytes(model, 3) == generate.decode_bytes(config, batch=3, context=0, itemsize=4)[0]


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


def test_model_label_names_the_architecture_and_rounds_the_parameter_count():
    assert generate.model_label(LlamaConfig.from_dict(generate.SHAPE)) == "LLaMA 1.10B"
    assert generate.model_label(LlamaConfig.from_dict(generate.QUICK_SHAPE)) == "LLaMA 111M"
    assert generate.model_label(GPT2Config.from_dict(generate.GPT2_SHAPE)) == "GPT-2 124M"
    assert generate.model_label(GPT2Config.from_dict(generate.GPT2_QUICK_SHAPE)) == "GPT-2 14.7M"
    assert [generate.model_label(p.config) for p in PLANS.values()] == ["LLaMA 1.10B", "GPT-2 124M", "LLaMA 111M",
                                                                        "GPT-2 14.7M"]


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
    assert "--quick runs the small LLaMA model" in generate.targets(rows, quick=True)
    assert "not measured" not in generate.targets([], quick=False)  # the GPT-2 shape has its rows now
    fp8 = [{"path": generate.LIBNN_FP8, "dtype": "fp16", "batch": 1, "x fp16": 1.8},
           {"path": generate.LIBNN_FP8, "dtype": "fp16", "batch": 8, "x fp16": 1.1}]
    assert "batch-1 decode FP8: 1.80x the fp16 graph's tokens/s, per call (target >= 1.7x: met)" in \
        generate.targets(fp8, quick=False)
    attention = [{"batch": 64, "context": 4096, "path": p, "%copy": c} for p, c in (("cudnn", 93.0), ("custom", 40.0))]
    assert "decode attention, batch 64, context 4096: 93% of copy bandwidth on the cache read (cudnn; target >= " \
           "90%: met)" in generate.targets([], quick=False, attention_rows=attention)
    assert "paged" not in text  # no paged rows, no line


def test_targets_end_with_the_paged_caches_step_time_over_the_dense_ones_at_each_batch():
    def graph(path, batch, gpu, per_call, dtype="fp16"):
        return {"path": path, "dtype": dtype, "batch": batch, "decode ms/step": gpu, "per-call ms/step": per_call}

    rows = [graph(generate.LIBNN, 1, 0.40, 0.50), graph(generate.LIBNN_PAGED, 1, 0.42, 0.55),
            graph(generate.LIBNN, 8, 0.80, 1.00), graph(generate.LIBNN_PAGED, 8, 0.72, 1.10),
            graph(generate.LIBNN, 64, 2.00, 2.50),
            {"path": generate.LIBNN_PAGED, "dtype": "fp16", "batch": 64, "note": "not run: MemoryError"},
            graph(generate.LIBNN, 1, 0.45, 0.55, "bf16"), graph(generate.HF, 1, 9.0, 9.0)]
    last = generate.targets(rows, quick=True).splitlines()[-1]
    assert last == ("  paged KV cache (pages of 64 tokens) against dense, fp16 decode ms/step paged over dense (no "
                    "target): batch 1 1.05x GPU, 1.10x per call; batch 8 0.90x GPU, 1.10x per call; batch 64 not "
                    "measured")
    assert generate.paged_vs_dense(rows) == [last]  # bf16 has no paged row: no line of its own
    no_dense = generate.paged_vs_dense([graph(generate.LIBNN_PAGED, 8, 0.72, 1.10)])
    assert no_dense == [last.split(": batch")[0] + ": batch 8 not measured"]


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS)
def test_plans_fit_their_models_positions_and_read_as_libnn_configs(plan):
    config = plan.config
    assert isinstance(config, generate.ARCHITECTURES[plan.architecture].config)
    assert plan.max_len == plan.prompt + plan.steps <= config.max_positions  # GPT-2's n_positions: 1024
    assert 0 <= plan.warmup < plan.steps and plan.prefill_runs >= 1
    assert config.head_dim == 64 and set(plan.dtypes) <= {"fp16", "bf16"}
    # a compile per case: one dtype's worth on LLaMA, none on GPT-2 (the bench's time)
    assert plan.compile_dtypes == {"llama": ("fp16",), "gpt2": ()}[plan.architecture]
    # the paged cache beside the dense one on LLaMA in fp16 (each of the plan's batches runs case_paths' rows)
    assert plan.paged_dtypes == {"llama": ("fp16",), "gpt2": ()}[plan.architecture]
    assert (generate.LIBNN_PAGED in generate.case_paths(plan, "fp16", hf_compile=True)) == \
        (plan.architecture == "llama")


def test_the_cache_holds_the_greedy_comparison_after_a_short_decode():
    plan = generate.Plan(TINY, ("fp16",), (1,), prompt=10, steps=3, warmup=1)
    assert plan.max_len == 10 + generate.GREEDY_TOKENS - 1


def test_the_cache_holds_the_kernel_splits_steps_after_the_warm_up():
    plan = generate.Plan(TINY, ("fp16",), (1,), prompt=10, steps=8, warmup=4)
    assert plan.max_len == 10 + 4 + 1 + generate.SPLIT_STEPS  # warm-up, one untimed step, the profiled ones


# --- the rows and their columns --------------------------------------------------------------------------
def test_a_case_has_the_compiled_peer_only_where_the_plan_compiles_its_dtype_and_compile_is_on():
    plan = generate.Plan(TINY, ("fp16", "bf16"), (1,), prompt=4, steps=8, warmup=2, compile_dtypes=("fp16",))
    everything = (generate.LIBNN, generate.LIBNN_PAGED, generate.LIBNN_FP8, generate.LIBNN_EAGER, generate.HF,
                  generate.HF_COMPILED)
    assert generate.case_paths(plan, "fp16", hf_compile=True) == everything
    # paged and FP8: fp16 only
    assert generate.case_paths(plan, "bf16", hf_compile=True) == (generate.LIBNN, generate.LIBNN_EAGER, generate.HF)
    assert generate.case_paths(plan, "fp16", hf_compile=False) == everything[:5]


def test_a_case_has_the_paged_row_beside_the_dense_graph_only_on_the_plans_paged_dtypes():
    both = generate.Plan(TINY, ("fp16", "bf16"), (1,), prompt=4, steps=8, warmup=2, paged_dtypes=("fp16", "bf16"))
    for dtype in both.dtypes:
        paths = generate.case_paths(both, dtype, hf_compile=False)
        assert paths[:2] == (generate.LIBNN, generate.LIBNN_PAGED)
    dense = generate.Plan(TINY, ("fp16",), (1,), prompt=4, steps=8, warmup=2, paged_dtypes=())
    assert generate.LIBNN_PAGED not in generate.case_paths(dense, "fp16", hf_compile=True)


def test_every_libnn_row_is_a_model_loaded_with_its_options_and_every_row_has_its_errors():
    assert set(generate.PATHS) == set(generate.PATH_ERRORS)
    assert set(generate.LIBNN_OPTIONS) == set(generate.PATHS) - {generate.HF, generate.HF_COMPILED}
    assert set(generate.SPLIT_PATHS) <= set(generate.LIBNN_OPTIONS)
    config = LlamaConfig.from_dict(TINY)
    models = {path: CausalLM(config, dtype="fp32", device="cpu", max_batch=2, max_len=8, **options)
              for path, options in generate.LIBNN_OPTIONS.items()}
    assert models[generate.LIBNN_PAGED].page_size == generate.PAGE_SIZE == 64
    assert all(m.page_size is None for path, m in models.items() if path != generate.LIBNN_PAGED)
    assert [path for path, m in models.items() if not m.decode_graphs] == [generate.LIBNN_EAGER]


@pytest.mark.parametrize("paged_runs", [True, False], ids=["paged runs", "paged fails"])
def test_a_case_gives_a_row_per_path_and_a_kernel_split_per_graph_row(monkeypatch, paged_runs):
    plan = generate.Plan(TINY, ("fp16",), (3,), prompt=5, steps=8, warmup=2)
    paths = generate.case_paths(plan, "fp16", hf_compile=True)

    def path_row(case, path, ceilings):
        row = {**case.base, "path": path, "per-call ms/step": 2.0, "decode ms/step": 1.0}
        if path == generate.LIBNN_PAGED and not paged_runs:
            return {**case.base, "path": path, "note": "not run: CudnnError: no paged plan"}, None
        split = {**case.base, "path": path, "attention ms": 0.5} if path in generate.SPLIT_PATHS else None
        return row, split

    monkeypatch.setattr(generate, "_path_row", path_row)
    monkeypatch.setattr(generate, "_free", lambda: None)
    models = generate.Models(None, {generate.LIBNN: SimpleNamespace(config=plan.config)}, {"attention": "sdpa"})
    rows, splits = generate._case_rows(plan, "fp16", 3, models, None, hf_compile=True)
    base = {"model": generate.model_label(plan.config), "dtype": "fp16", "batch": 3}
    assert [r["path"] for r in rows] == list(paths)
    paged = rows[paths.index(generate.LIBNN_PAGED)]
    assert paged["note"] == ("pages of 64 tokens" if paged_runs else "not run: CudnnError: no paged plan")
    assert ("x HF" in paged) == paged_runs  # a libnn row's ratios to the peers
    assert splits == [{**base, "path": generate.LIBNN, "attention ms": 0.5},
                      {**base, "path": generate.LIBNN_PAGED,
                       **({"attention ms": 0.5} if paged_runs else {"note": "not run"})}]


def test_libnn_rows_get_each_peers_per_call_time_over_theirs():
    rows = [{"path": generate.LIBNN, "per-call ms/step": 2.0},
            {"path": generate.LIBNN_EAGER, "per-call ms/step": 8.0},
            {"path": generate.LIBNN_PAGED, "per-call ms/step": 2.4},
            {"path": generate.HF, "per-call ms/step": 12.0},
            {"path": generate.HF_COMPILED, "per-call ms/step": 3.0}]
    generate.add_speedups(rows)
    assert rows[0]["x HF"] == pytest.approx(6.0) and rows[0]["x HF compile"] == pytest.approx(1.5)
    assert rows[1]["x HF"] == pytest.approx(1.5) and rows[1]["x HF compile"] == pytest.approx(0.375)
    assert rows[2]["x HF"] == pytest.approx(5.0) and rows[2]["x HF compile"] == pytest.approx(1.25)
    assert "x fp16" not in rows[2]  # FP8's ratio alone
    assert not any(key.startswith("x ") for r in rows[3:] for key in r)  # the peers compare with no one


def test_the_fp8_row_gets_its_speed_over_the_fp16_graph():
    rows = [{"path": generate.LIBNN, "per-call ms/step": 2.0}, {"path": generate.LIBNN_FP8, "per-call ms/step": 1.25},
            {"path": generate.HF, "per-call ms/step": 10.0}]
    generate.add_speedups(rows)
    assert rows[1]["x fp16"] == pytest.approx(1.6) and rows[1]["x HF"] == pytest.approx(8.0)
    assert "x fp16" not in rows[0]


def test_a_peer_or_a_libnn_row_that_did_not_run_gives_no_ratio():
    rows = [{"path": generate.LIBNN, "per-call ms/step": 2.0},
            {"path": generate.LIBNN_EAGER, "note": "not run: MemoryError: out of memory"},
            {"path": generate.HF, "per-call ms/step": 12.0},
            {"path": generate.HF_COMPILED, "note": "not run: BackendCompilerFailed: backend='inductor' raised"}]
    generate.add_speedups(rows)
    assert rows[0]["x HF"] == pytest.approx(6.0) and "x HF compile" not in rows[0]
    assert not any(key.startswith("x ") for key in rows[1])
    without_compile = [dict(rows[0]), rows[2]]
    without_compile[0].pop("x HF")
    generate.add_speedups(without_compile)  # --no-compile: no compiled row at all
    assert without_compile[0]["x HF"] == pytest.approx(6.0) and "x HF compile" not in without_compile[0]


def test_the_table_has_a_column_for_every_figure_a_row_gets():
    produced = {"model", "dtype", "batch", "path", "note", "greedy vs HF", "compile s", "x fp16",
                *generate.rates(1, 1, 1, 1.0, 1.0), *generate.SPEEDUPS.values(),
                "prefill ms", "decode ms/step", "per-call ms/step"}  # measure's three
    assert set(generate.COLUMNS) == produced and len(generate.COLUMNS) == len(produced)
    columns = list(generate.COLUMNS)
    assert columns.index("per-call ms/step") < columns.index("x HF") < columns.index("x HF compile") < \
        columns.index("compile s")


def test_the_split_table_has_a_column_per_category_and_for_what_the_split_adds():
    split = harness.split_kernel_times([("nvjet_tst_64x8", 2.0)], generate.SPLIT_CATEGORIES, calls=2)
    path = harness.critical_path_split([("nvjet_tst_64x8", 0.0, 2.0)], generate.SPLIT_CATEGORIES, calls=2)
    produced = {"model", "dtype", "batch", "path", "decode ms/step", "note", *split, *path}
    assert set(generate.SPLIT_COLUMNS) == produced
    assert [c for c in generate.SPLIT_COLUMNS if c.endswith(" ms") and c != "decode ms/step"] == \
        ["attention ms", "norms ms", "GEMM ms", "glue ms", "kernels ms", "attention path ms", "norms path ms",
         "GEMM path ms", "glue path ms", "idle ms"]


# --- the decode step's kernel categories -------------------------------------------------------------------
@pytest.mark.parametrize("name, category", [
    ("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", "GEMM"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __half>", "GEMM"),
    ("cutlass::Kernel2<cutlass_80_tensorop_h16816gemm>", "GEMM"),
    ("gemm3_mma_f16", "GEMM"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("attn2_flash_f16", "attention"),
    ("attn_zero_empty_batches", "attention"),
    ("rms1_warp_vec8_f16", "norms"),
    ("rms2_block_vec4_bf16", "norms"),
    ("rms3_loop_f32", "norms"),
    ("cudnn_generated_rmsnorm_fwd_sm90_kernel", "norms"),  # norms before GEMM's sm90_
    ("ln1_warp_vec8_f16", "norms"),  # GPT-2's LayerNorm (kernels/layer_norm.cu)
    ("ln2_block_vec4_f16", "norms"),
    ("ln3_loop_f16", "norms"),
    ("cudnn_generated_layernorm_fwd_sm90_kernel", "norms"),
    ("rope1_pairs_f16_i32", "glue"),
    ("kv_append1_f16_i64", "glue"),
    ("swiglu2_vec_bf16", "glue"),
    ("emb1_warp_vec8_f16", "glue"),
    ("cupy_argmax_float32_int64", "glue"),
    ("cupy_copy__float16_float16", "glue"),
])
def test_decode_kernels_fall_in_their_category(name, category):
    assert harness.kernel_category(name, generate.SPLIT_CATEGORIES) == category


def test_why_puts_an_exception_on_one_line():
    exc = RuntimeError("backend='inductor' raised:\n  CalledProcessError:   gcc    failed\n")
    assert generate.why(exc) == "RuntimeError: backend='inductor' raised: CalledProcessError: gcc failed"
    assert generate.why(ValueError("x" * 200), chars=10) == "ValueError: " + "x" * 10


def test_the_full_plans_are_the_issues_1b_and_gpt2_small_shapes_and_quick_a_smoke_test():
    llama, gpt2 = generate.FULL
    full = llama.config
    assert 1.0e9 <= full.parameter_count() <= 1.2e9
    assert (full.num_hidden_layers, full.hidden_size, full.num_attention_heads, full.num_key_value_heads,
            full.intermediate_size, full.vocab_size) == (16, 2048, 32, 8, 8192, 32000)
    assert llama.dtypes == ("fp16", "bf16") and llama.batches == (1, 8, 64)
    small = gpt2.config
    assert (small.n_layer, small.n_embd, small.n_head, small.n_positions, small.vocab_size) == \
        (12, 768, 12, 1024, 50257)
    assert small == GPT2Config()  # Hugging Face's defaults are GPT-2 small's
    assert gpt2.dtypes == ("fp16",) and gpt2.batches == llama.batches
    for plan in generate.FULL:
        assert (plan.prompt, plan.steps) == (512, 256)
    for plan in generate.QUICK:
        assert plan.dtypes == ("fp16",) and plan.batches == (1, 8) and (plan.prompt, plan.steps) == (128, 32)
    assert [p.architecture for p in generate.QUICK] == ["llama", "gpt2"]
    quick_gpt2 = generate.QUICK[1].config
    assert (quick_gpt2.n_layer, quick_gpt2.n_embd, quick_gpt2.n_head) == (2, 256, 4)


def test_the_cli_takes_bench_generate():
    args = parser().parse_args(["bench", "generate", "--quick", "--json", "out.json"])
    assert (args.op, args.quick, args.json) == ("generate", True, "out.json")
