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

