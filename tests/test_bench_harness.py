"""The benchmark harness's kernel-time split on the CPU: kernel names to categories (the first pattern
that finds one, else glue), and the per-call arithmetic over a profiler's (name, ms) pairs; the critical
path's shares of (name, start, end) intervals and their reading from a Chrome trace; bench models'
categories as they were before the split moved to the harness. The profiler itself runs on the
GPU, in the benchmarks."""

import re

import pytest

from libnn.bench import harness, models

CATEGORIES = (("attention", harness.ATTENTION_KERNELS), ("GEMM", harness.GEMM_KERNELS),
              ("norm", re.compile(r"norm")))


def test_the_first_category_whose_pattern_finds_the_name_wins_case_insensitively():
    assert harness.kernel_category("cudnn_generated_fort_native_SDPA_sm90_x", CATEGORIES) == "attention"  # not GEMM
    assert harness.kernel_category("sm90_xmma_gemm_bf16", CATEGORIES) == "GEMM"
    assert harness.kernel_category("gemv_glu_f16", CATEGORIES) == "GEMM"          # libnn's GEMVs too
    assert harness.kernel_category("fp8_gemv3_bf16", CATEGORIES) == "GEMM"
    assert harness.kernel_category("LayerNorm_fwd", CATEGORIES) == "norm"
    assert harness.kernel_category("elementwise_add", CATEGORIES) == harness.GLUE


def test_split_kernel_times_per_call_by_category_with_the_costliest_glue_named():
    times = [("nvjet_a", 4.0), ("nvjet_b", 2.0), ("fmha_x", 1.0), ("layernorm_y", 0.5), ("copy_" + "z" * 50, 1.5),
             ("add", 0.4), ("mul", 0.2), ("fill", 0.1), ("idle", 0.0), ("negative", -1.0)]
    split = harness.split_kernel_times(times, CATEGORIES, calls=2)
    assert split["GEMM ms"] == pytest.approx(3.0) and split["attention ms"] == pytest.approx(0.5)
    assert split["norm ms"] == pytest.approx(0.25) and split["glue ms"] == pytest.approx(1.1)
    assert split["kernels ms"] == pytest.approx(4.85)
    assert split["glue %"] == pytest.approx(100 * 1.1 / 4.85)
    assert split["top glue"] == f"copy_{'z' * 35} 0.750, add 0.200, mul 0.100"  # names cut to 40 characters
    assert list(split) == ["attention ms", "GEMM ms", "norm ms", "glue ms", "kernels ms", "glue %", "top glue"]


def test_a_split_of_no_kernel_time_has_no_glue_share():
    split = harness.split_kernel_times([], CATEGORIES, calls=5)
    assert split["kernels ms"] == 0 and split["glue %"] is None and split["top glue"] == ""


def test_kernels_of_one_name_add_up_in_the_glue_list():
    split = harness.split_kernel_times([("add", 1.0), ("add", 3.0), ("mul", 2.0)], CATEGORIES, calls=1)
    assert split["top glue"] == "add 4.000, mul 2.000"


def test_a_programmatic_launch_counts_on_the_critical_path_only_past_the_end_of_the_kernel_ahead():
    """gemv_a runs 0..10; kv starts early at 8 and waits, ending at 12 (2 past gemv_a); attn starts after a gap
    at 13; gemv_b starts at 14 under attn and ends at 20; a copy inside gemv_b's time adds nothing."""
    intervals = [("attn", 13.0, 16.0), ("gemv_a", 0.0, 10.0), ("kv", 8.0, 12.0), ("gemv_b", 14.0, 20.0),
                 ("Memcpy DtoD", 17.0, 18.0)]
    shares, idle = harness.critical_path_shares(intervals)
    assert shares == [("gemv_a", 10.0), ("kv", 2.0), ("attn", 3.0), ("gemv_b", 4.0), ("Memcpy DtoD", 0.0)]
    assert idle == 1.0
    assert sum(share for _, share in shares) + idle == 20.0   # the span, first start to last end


def test_no_activity_has_no_path_and_no_idle_time():
    assert harness.critical_path_shares([]) == ([], 0.0)


def test_a_chrome_traces_gpu_activities_in_ms():
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemv_f16", "ts": 1000.0, "dur": 14.5},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 1020.0, "dur": 1.0},
        {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 1030.0, "dur": 0.5},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 900.0, "dur": 50.0},        # host side: not the GPU's
        {"cat": "kernel", "name": "no duration", "ts": 1040.0},                # an instant: no interval
        {"ph": "M", "name": "process_name"}]}
    assert harness.trace_intervals(trace) == [("gemv_f16", 1.0, 1.0145), ("Memcpy DtoD (Device -> Device)", 1.02, 1.021),
                                              ("Memset (Device)", 1.03, 1.0305)]
    assert harness.trace_intervals({}) == []


def test_the_critical_path_split_is_per_call_by_category_with_the_idle_time():
    intervals = [("gemv_a", 0.0, 10.0), ("kv_append", 8.0, 12.0), ("fmha_x", 13.0, 16.0), ("layernorm", 15.0, 17.0)]
    split = harness.critical_path_split(intervals, CATEGORIES, calls=2)
    assert split == pytest.approx({"attention path ms": 1.5, "GEMM path ms": 5.0, "norm path ms": 0.5,
                                   "glue path ms": 1.0, "idle ms": 0.5})
    assert list(split) == ["attention path ms", "GEMM path ms", "norm path ms", "glue path ms", "idle ms"]


@pytest.mark.parametrize("name, category", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("sm90_xmma_gemm_f16f16_f16f32", "GEMM"),
    ("ln1_warp_vec8_f16", "LayerNorm"),
    ("ln3_loop_bf16", "LayerNorm"),
    ("bias_act_rows_gelu_erf_f16", "glue"),
    ("rms1_warp_vec8_f16", "glue"),  # bench models' encoders have no RMSNorm: its split is as it was
])
def test_bench_models_categories_are_kept(name, category):
    assert harness.kernel_category(name, models.KERNEL_CATEGORIES) == category
