"""Every op with numbered kernel versions answers `custom_versions(problem, aligned=True)` alike: a
tuple of version names, baseline first, that the op's launcher accepts (checked here on the CPU from
problems of host arrays; the GPU tests run each version)."""

import importlib
import inspect

import numpy as np
import pytest

OPS_WITH_VERSIONS = ["linear", "conv2d", "attention", "layer_norm", "embedding"]


def _op_module(name):
    return importlib.import_module(f"libnn.ops.{name}")  # libnn.ops.<name> is the op's function


@pytest.mark.parametrize("name", OPS_WITH_VERSIONS)
def test_custom_versions_has_one_signature_across_ops(name):
    parameters = list(inspect.signature(_op_module(name).custom_versions).parameters.values())
    assert [p.name for p in parameters] == ["problem", "aligned"]
    assert parameters[1].default is True


@pytest.mark.parametrize("dtype, expected", [(np.float32, ("v1", "v2")), (np.float16, ("v1", "v3"))])
def test_linear_versions_follow_the_dtype(dtype, expected):
    linear = _op_module("linear")
    x, w, b = np.zeros((3, 5), dtype), np.zeros((4, 5), dtype), np.zeros(4, dtype)
    assert linear.custom_versions(linear.linear_problem(x, w, b, "gelu", False)) == expected


@pytest.mark.parametrize("dtype, D, expected", [
    (np.float16, 64, ("attn1_naive", "attn2_flash")),
    (np.float16, 24, ("attn1_naive", "attn2_flash")),
    (np.float16, 12, ("attn1_naive",)),           # rows of 24 bytes: not 16-byte aligned, D % 8 != 0
    (np.float32, 72, ("attn1_naive",)),           # attn2 is fp16/bf16 only
    (np.float64, 8, ()),                          # no custom kernel takes fp64
])
def test_attention_versions_name_flash_only_where_it_fits(dtype, D, expected):
    attention = _op_module("attention")
    q, kv = np.zeros((1, 2, 19, D), dtype), np.zeros((1, 2, 71, D), dtype)
    problem = attention.attention_problem(q, kv, kv, None, 0.3, "top_left", "BHSD", False, False)
    assert attention.custom_versions(problem) == expected
    assert attention.custom_versions(problem, aligned=False) == expected[:1]


@pytest.mark.parametrize("groups, w_shape, expected", [(6, (6, 3, 3, 1), ("conv1_direct", "conv2_depthwise")),
                                                       (1, (5, 3, 3, 6), ("conv1_direct", "conv3_igemm")),
                                                       (2, (4, 3, 3, 3), ("conv1_direct",))])
def test_conv2d_versions_are_the_baseline_and_the_pick(groups, w_shape, expected):
    conv2d = _op_module("conv2d")
    x, w = np.zeros((2, 8, 8, 6), np.float16), np.zeros(w_shape, np.float16)
    problem = conv2d.conv2d_problem(x, w, None, None, 1, 1, 1, groups, "relu", "NHWC", False)
    assert conv2d.custom_versions(problem) == expected
