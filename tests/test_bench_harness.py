"""The benchmark harness's kernel-time split on the CPU: kernel names to categories (the first pattern
that finds one, else glue), and the per-call arithmetic over a profiler's (name, ms) pairs; bench
models' categories as they were before the split moved to the harness. The profiler itself runs on the
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
