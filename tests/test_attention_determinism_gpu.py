"""cuDNN attention repeats bit for bit: the same decode-shaped call (one query row per sequence, GQA, a long
cache with each sequence's length) many times on the same inputs gives one output, matching the float64
reference. cuDNN 9.19's lean-attention decode plan gave up to 45 distinct outputs in 60 such calls; libnn
leaves out the plans NONDETERMINISTIC_CUDNN_PLANS names unless config.allow_nondeterministic, and cuDNN's
plan for the problem is then none of them. Tolerance: relative L2 error fp16 1e-2 (dtypes.TOLERANCE)."""

from __future__ import annotations

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.backends import cudnn as cudnn_backend
from libnn.ops import attention
from libnn.ops.attention import (NONDETERMINISTIC_CUDNN_PLANS, CheckedLengths, attention_graph_builder,
                                 attention_problem)
from conftest import random_normal, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_gpu_memory")]

# (B, Hq, Hkv, D, cache length): where the lean plan differed from call to call on the H100
SHAPES = [(64, 32, 8, 64, 4096), (8, 32, 8, 64, 257)]


def decode_inputs(rng, B, Hq, Hkv, D, L):
    import cupy

    q = cupy.asarray(random_normal(rng, (B, 1, Hq, D), "fp16"))
    k, v = (cupy.asarray(random_normal(rng, (B, L, Hkv, D), "fp16")) for _ in range(2))
    lengths = cupy.asarray(rng.integers(L // 2, L + 1, B).astype(np.int32))
    return q, k, v, lengths


@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "B{}-Hq{}-Hkv{}-D{}-L{}".format(*c))
def test_cudnn_decode_attention_repeats_bit_for_bit(rng, case):
    import cupy

    q, k, v, lengths = decode_inputs(rng, *case)
    call = lambda: attention(q, k, v, seq_lens_kv=CheckedLengths(lengths, nonempty=True), layout="BSHD",
                             path="cudnn")
    first = call()
    expected = attention(*(cupy.asnumpy(a).astype(np.float64) for a in (q, k, v)), layout="BSHD",
                         seq_lens_kv=cupy.asnumpy(lengths), path="reference")
    assert rel_error(cupy.asnumpy(first), expected) < dtypes.TOLERANCE["fp16"]
    differing = sum(not bool((call().view(cupy.uint16) == first.view(cupy.uint16)).all()) for _ in range(60))
    assert differing == 0, f"{differing} of 60 identical calls gave other bits than the first"


def test_the_plans_left_out_are_not_run_unless_allowed(rng, monkeypatch):
    """By default cuDNN's graph for a decode problem runs none of NONDETERMINISTIC_CUDNN_PLANS; allowed,
    the problem differs (so its graph is cached apart) and still builds."""
    q, k, v, _ = decode_inputs(rng, *SHAPES[0])
    names = {}
    for allow in (False, True):
        monkeypatch.setattr(libnn.config, "allow_nondeterministic", allow)
        problem = attention_problem(q, k, v, None, None, False, "BSHD", False, True)
        assert problem.deterministic is not allow
        names[allow] = cudnn_backend.graph_for(problem, attention_graph_builder(problem), problem.describe,
                                             use_disk_cache=False).plan_name  # a plan built here, named
    assert not any(bad in names[False] for bad in NONDETERMINISTIC_CUDNN_PLANS), names
    if not any(bad in names[True] for bad in NONDETERMINISTIC_CUDNN_PLANS):
        pytest.skip(f"cuDNN's first plan here is {names[True]!r}, none of those left out: nothing to compare")
    assert names[False] != names[True]
