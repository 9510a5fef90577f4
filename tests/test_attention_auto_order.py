"""attention's auto order without a GPU: cuDNN's SDPA first, except small non-causal self-attention (an
encoder's), which the custom flash kernel runs faster (measured on the H100: ops/attention.py
CUSTOM_FASTER_BELOW_FLOPS)."""

from dataclasses import replace

import pytest

import libnn
from libnn.ops.attention import AttentionProblem


@pytest.fixture
def every_library_present(monkeypatch):
    """Resolution as on a GPU machine with cuDNN installed: only supports() and slower() decide."""
    from libnn.runtime import device

    monkeypatch.setattr(device, "gpu_missing", lambda: None)
    monkeypatch.setattr(device, "module_missing", lambda name: None)


def encoder_problem(B=32, H=12, S=128, D=32, bias=True, **changes) -> AttentionProblem:
    """A BERT layer's attention: strided BSHD views of the packed QKV output, key-padding lengths and bias."""
    qkv = (S * 3 * H * D, D, 3 * H * D, 1)
    problem = AttentionProblem(B=B, Hq=H, Hkv=H, Sq=S, Skv=S, D=D, dtype="fp16", layout="BSHD", q_strides=qkv,
                               k_strides=qkv, v_strides=qkv, scale=D ** -0.5, causal=None, has_seq_lens_q=False,
                               has_seq_lens_kv=True, bias_shape=(B, 1, 1, S) if bias else None, aligned=True,
                               device="gpu:0", bias_keeps_a_key=bias, lens_kv_nonempty=True)
    return replace(problem, **changes)


def resolved(problem):
    candidates, passed_over = libnn.get_op("attention").resolve(problem, "auto")
    return [p.name for p in candidates], passed_over


@pytest.mark.parametrize("B, D, bias", [(1, 32, True), (32, 32, True), (1, 64, True), (32, 32, False)], ids=str)
def test_small_encoder_attention_runs_custom_first(every_library_present, B, D, bias):
    problem = encoder_problem(B=B, D=D, bias=bias)
    names, passed_over = resolved(problem)
    assert names == ["custom", "unfused", "cudnn"]
    assert passed_over["cudnn"] == (f"tried last: {problem.flops / 1e6:.0f} MFLOP of self-attention with D={D}: the "
                                    "custom flash kernel is faster below 1 GFLOP")


@pytest.mark.parametrize("changes", [
    dict(B=256),                   # 6.4 GFLOP: cuDNN is faster
    dict(B=32, D=64),              # 1.6 GFLOP
    dict(D=128, B=1),              # a head dimension the rule was not measured at
    dict(causal="top_left"),       # a decoder's prefill
    dict(Sq=1),                    # a decoder's step (cross-shaped)
    dict(aligned=False),           # the flash kernel would not take it (cudnn does not either: custom runs)
    dict(bias_shape=(32, 12, 128, 128)),  # a bias per row, staged per row
    dict(dtype="fp32"),            # no flash kernel
], ids=str)
def test_other_attention_keeps_cudnn_first_or_never_runs_it(every_library_present, changes):
    names, passed_over = resolved(encoder_problem(**changes))
    assert "cudnn" not in passed_over or not passed_over["cudnn"].startswith("tried last")
    assert names[0] == ("cudnn" if "cudnn" in names else "custom")



@pytest.fixture
def decode_kernel_fits(monkeypatch):
    """An H100's shared memory: 3 blocks of attn3_decode an SM at D <= 32, 2 at 64, 1 at 96 and 128."""
    from libnn.ops import attention_kernels

    monkeypatch.setattr(attention_kernels, "blocks_by_shared_memory", lambda device_id, smem: 233472 // (smem + 1024))


def decode_problem(B=8, Hq=32, Hkv=8, Skv=1024, D=64, **changes) -> AttentionProblem:
    """A decoder's step: q (B, 1, Hq, D) against one layer's BSHD cache (B, Skv, Hkv, D), per-sequence lengths."""
    q = (Hq * D, D, Hq * D, 1)
    kv = (Skv * Hkv * D, D, Hkv * D, 1)
    problem = AttentionProblem(B=B, Hq=Hq, Hkv=Hkv, Sq=1, Skv=Skv, D=D, dtype="fp16", layout="BSHD", q_strides=q,
                               k_strides=kv, v_strides=kv, scale=D ** -0.5, causal="bottom_right",
                               has_seq_lens_q=False, has_seq_lens_kv=True, bias_shape=None, aligned=True,
                               device="gpu:0", lens_kv_nonempty=True)
    return replace(problem, **changes)


@pytest.mark.parametrize("changes", [dict(), dict(B=1, Skv=4096), dict(B=64, Skv=4096), dict(D=128),
                                     dict(D=80), dict(Hq=16, Hkv=1), dict(dtype="bf16"), dict(causal=None),
                                     dict(pages=100, page_size=64), dict(pages=9, page_size=1024)], ids=str)
def test_a_decode_step_runs_custom_first(every_library_present, decode_kernel_fits, changes):
    names, passed_over = resolved(decode_problem(**changes))
    assert names == ["custom", "cudnn"] if "pages" in changes else ["custom", "unfused", "cudnn"]
    assert passed_over["cudnn"] == ("tried last: a decode step (one query row per sequence): the custom split-K "
                                    "kernel is faster")


@pytest.mark.parametrize("changes", [
    dict(Sq=2, causal="bottom_right"),  # a speculative step's few rows: attn3 takes one
    dict(bias_shape=(8, 1, 1, 1024)),   # a bias
    dict(D=136),                        # past the largest head-dim bucket
    dict(Hq=64, Hkv=2),                 # 32 query heads a kv head: more than one mma tile's rows
    dict(pages=100, page_size=16),      # pages smaller than a 64-key tile: custom does not read them
    dict(aligned=False),
    dict(dtype="fp32"),
], ids=str)
def test_other_decode_steps_keep_cudnn_first_or_never_run_it(every_library_present, decode_kernel_fits, changes):
    names, passed_over = resolved(decode_problem(**changes))
    assert "cudnn" not in passed_over or not passed_over["cudnn"].startswith("tried last")
    assert names[0] == ("cudnn" if "cudnn" in names else "custom")


def test_a_decode_step_keeps_cudnn_first_where_the_kernel_does_not_fit_shared_memory(every_library_present,
                                                                                      monkeypatch):
    from libnn.ops import attention_kernels

    monkeypatch.setattr(attention_kernels, "blocks_by_shared_memory", lambda device_id, smem: 0)
    names, _ = resolved(decode_problem(D=128))
    assert names[0] == "cudnn"


def test_unfused_never_takes_a_paged_problem(every_library_present, decode_kernel_fits):
    names, passed_over = resolved(decode_problem(pages=100, page_size=64))
    assert "unfused" not in names and "reads no pages" in passed_over["unfused"]
