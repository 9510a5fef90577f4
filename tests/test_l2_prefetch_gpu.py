"""The L2 prefetch hint on the GPU (runtime/l2_prefetch.py; kernels/common.cuh l2_prefetch_hint, called by
kernels/gemv.cu and kernels/linear_fp8.cu's version 3): it changes no result, bit for bit, on every op and
path that takes it (odd shapes, one or two hinted arrays of odd sizes and addresses, outputs poisoned); the
problem carries each array's share of the budget; a strided hint, or one on another device than the op's,
is refused by name; a decode step of a LLaMA or GPT-2 CausalLM gives no hint (it ran faster without:
benchmarks/RESULTS.md, eighteenth session)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from conftest import random_normal, rel_error
import test_gpt2
import test_llama
from decoder_cases import padded, prompts, write_checkpoint

from libnn import dtypes
from libnn.errors import FallbackWarning
from libnn.models import CausalLM
from libnn.ops import linear, rms_norm_linear
from libnn.ops.linear import linear_problem
from libnn.ops.linear_fp8 import linear_fp8
from libnn.ops.quantize_fp8 import quantize_weight
from libnn.runtime import l2_prefetch

pytestmark = pytest.mark.gpu

DTYPES = ["fp16", "bf16"]
SHAPES = [(1, 8), (7, 1000), (131, 2056), (3072, 2048)]  # (N, K) of linear's gemv path


def gpu(a):
    import cupy
    return cupy.asarray(a)


def hints(rng, count):
    """`count` arrays to prefetch: one larger than the budget, and a view starting 3 bytes into another
    (the kernel narrows it to whole 16-byte units) of a size no multiple of 16."""
    import cupy
    big = cupy.asarray(rng.integers(0, 255, l2_prefetch.budget() + 4096, dtype=np.uint8))
    odd = cupy.asarray(rng.integers(0, 255, 1000, dtype=np.uint8))[3:]
    return (big, odd)[:count]


def bits(a):
    return a.get().view(np.uint8)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", SHAPES, ids=str)
def test_linear_gemv_gives_the_same_bits_with_a_hint(rng, N, K, dtype, count):
    x, w = gpu(random_normal(rng, (1, K), dtype)), gpu(random_normal(rng, (N, K), dtype, 1 / np.sqrt(K)))
    b, r = gpu(random_normal(rng, (N,), dtype)), gpu(random_normal(rng, (1, N), dtype))
    plain = linear(x, w, b, "gelu", residual=r, path="gemv")
    hinted = linear(x, w, b, "gelu", residual=r, prefetch=hints(rng, count), path="gemv")
    expected = linear(*(a.get().astype(np.float64) for a in (x, w, b)), "gelu", residual=r.get().astype(np.float64),
                      path="reference")
    assert rel_error(hinted, expected) <= dtypes.TOLERANCE[dtype]
    assert np.array_equal(bits(hinted), bits(plain))


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("glu", [None, "swiglu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_linear_gemv_gives_the_same_bits_with_a_hint(rng, dtype, glu):
    K, N = 1000, 262
    x, g = gpu(random_normal(rng, (1, K), dtype)), gpu(random_normal(rng, (K,), dtype))
    w = gpu(random_normal(rng, (N, K), dtype, 1 / np.sqrt(K)))
    plain = rms_norm_linear(x, g, w, glu=glu, path="gemv")
    hinted = rms_norm_linear(x, g, w, glu=glu, prefetch=hints(rng, 2), path="gemv")
    assert np.array_equal(bits(hinted), bits(plain))
    unfused = rms_norm_linear(x, g, w, glu=glu, prefetch=hints(rng, 1), path="unfused")
    assert rel_error(unfused, plain.get()) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemv_gives_the_same_bits_with_a_hint(rng, dtype, M):
    K, N = 513, 34
    x, g = gpu(random_normal(rng, (M, K), dtype)), gpu(random_normal(rng, (K,), dtype))
    weight = quantize_weight(random_normal(rng, (N, K), "fp32", 1 / np.sqrt(K)))
    w, s = gpu(weight.data), gpu(weight.scale)
    for hint in (hints(rng, 1), hints(rng, 2)):
        assert np.array_equal(bits(linear_fp8(x, w, s, prefetch=hint, path="custom")),
                              bits(linear_fp8(x, w, s, path="custom")))
        if M == 1:
            assert np.array_equal(bits(rms_norm_linear(x, g, w, w_scale=s, prefetch=hint, path="gemv")),
                                  bits(rms_norm_linear(x, g, w, w_scale=s, path="gemv")))


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_strided_and_empty_inputs_with_a_hint(rng):
    """x strided (copied by the runner, the hint passed on), and an empty problem, with a hint."""
    import cupy
    K, N = 264, 37
    wide = gpu(random_normal(rng, (1, 2 * K), "fp16"))
    x, w, g = wide[:, ::2], gpu(random_normal(rng, (N, K), "fp16", 0.1)), gpu(random_normal(rng, (K,), "fp16"))
    assert np.array_equal(bits(linear(x, w, prefetch=hints(rng, 2), path="gemv")),
                          bits(linear(cupy.ascontiguousarray(x), w, path="gemv")))
    assert np.array_equal(bits(rms_norm_linear(x, g, w, prefetch=hints(rng, 1), path="gemv")),
                          bits(rms_norm_linear(cupy.ascontiguousarray(x), g, w, path="gemv")))
    empty = linear(gpu(np.ones((0, K), np.float16)), w, prefetch=hints(rng, 1))
    assert empty.shape == (0, N)


def test_a_misaligned_weight_falls_back_visibly_with_its_hint_dropped(rng):
    import cupy
    K, N = 64, 24
    x = gpu(random_normal(rng, (1, K), "fp16"))
    buffer = cupy.zeros(N * K + 8, cupy.float16)
    w = buffer[1:1 + N * K].reshape(N, K)   # 2 bytes past an aligned start: the GEMV refuses it
    w[...] = gpu(random_normal(rng, (N, K), "fp16", 0.1))
    with pytest.warns(FallbackWarning, match="path 'gemv' failed"):
        y = linear(x, w, prefetch=hints(rng, 2))
    assert rel_error(y, linear(x.get(), w.get(), path="reference")) <= dtypes.TOLERANCE["fp16"]


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_paths_without_the_prefetch_ignore_the_hint(rng):
    x, w = gpu(random_normal(rng, (4, 40), "fp16")), gpu(random_normal(rng, (24, 40), "fp16", 0.2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path in ("auto", "cublaslt", "custom"):
            assert np.array_equal(bits(linear(x, w, prefetch=hints(rng, 2), path=path)),
                                  bits(linear(x, w, path=path)))
        weight = quantize_weight(random_normal(rng, (32, 48), "fp32", 0.2))
        xq = gpu(random_normal(rng, (16, 48), "fp16"))
        assert np.array_equal(bits(linear_fp8(xq, gpu(weight.data), gpu(weight.scale), prefetch=hints(rng, 1))),
                              bits(linear_fp8(xq, gpu(weight.data), gpu(weight.scale))))


def test_the_problem_carries_each_arrays_share_of_the_budget(rng):
    """Each array's share of the budget, capped at its size, what the first leaves going to the second
    (none below sm_90); the share is no part of the problem's equality (a library plan keyed by it is the
    same with and without a hint)."""
    import cupy
    from libnn.runtime.device import compute_capability

    x, w = gpu(random_normal(rng, (1, 64), "fp16")), gpu(random_normal(rng, (8, 64), "fp16"))
    big, odd = hints(rng, 2)
    budget = l2_prefetch.budget() if compute_capability(0) >= (9, 0) else 0
    assert linear_problem(x, w, None, None, False, None, (big,)).prefetch == (budget,)
    assert linear_problem(x, w, None, None, False, None, (big, odd)).prefetch == (budget // 2, min(budget // 2, 997))
    assert linear_problem(x, w, None, None, False, None, (odd, big)).prefetch == (min(budget // 2, 997),
                                                                                  budget - min(budget // 2, 997))
    assert linear_problem(x, w, None, None, False).prefetch == ()
    small = cupy.ones(5, cupy.float16)
    assert linear_problem(x, w, None, None, False, None, (small,)).prefetch == (min(budget, 10),)
    assert linear_problem(x, w, None, None, False, None, (small,)) == linear_problem(x, w, None, None, False)


def test_a_strided_hint_is_refused_by_name(rng):
    import cupy
    x, w = gpu(random_normal(rng, (1, 64), "fp16")), gpu(random_normal(rng, (8, 64), "fp16"))
    strided = cupy.ones((8, 64), cupy.float16)[:, ::2]
    with pytest.raises(ValueError, match=r"linear: prefetch must be C-contiguous .* got shape \(8, 32\)"):
        linear(x, w, prefetch=strided)
    with pytest.raises(ValueError, match=r"rms_norm_linear: prefetch\[1\] must be C-contiguous"):
        rms_norm_linear(x, gpu(np.ones(64, np.float16)), w, prefetch=(w, strided))


def test_a_hint_for_an_op_on_the_host_is_refused_by_name():
    x, w = np.ones((1, 16), np.float16), np.ones((8, 16), np.float16)
    with pytest.raises(ValueError, match=r"linear: prefetch is on gpu:0 but the op runs on cpu"):
        linear(x, w, prefetch=gpu(w))


# --- a decode step -------------------------------------------------------------------------------------
def model(tmp_path, rng, module):
    directory = write_checkpoint(tmp_path / module.__name__, module.CONFIG, module.random_state(rng, module.CONFIG))
    return CausalLM.from_pretrained(directory, dtype="fp16", device="gpu", max_batch=1, max_len=32,
                                    decode_graphs=False)


def hints_of_a_step(rng, model, monkeypatch):
    """(op, the hinted arrays' addresses) of every hinted call of one decode step, in order."""
    seen = []
    original = l2_prefetch.hinted_arrays

    def recording(where, prefetch):
        arrays = original(where, prefetch)
        seen.append((where, tuple(a.data.ptr for a in arrays)))
        return arrays
    ids, lengths = padded(prompts(rng, (5,)))
    tokens = model.prefill(ids, lengths).argmax(-1)
    with monkeypatch.context() as patched:
        patched.setattr(l2_prefetch, "hinted_arrays", recording)
        model.decode_step(tokens)
    return seen, tokens


@pytest.mark.parametrize("module", [test_llama, test_gpt2], ids=["llama", "gpt2"])
def test_a_decode_step_gives_no_hint(tmp_path, rng, monkeypatch, module):
    lm = model(tmp_path, rng, module)
    seen, tokens = hints_of_a_step(rng, lm, monkeypatch)
    assert seen == []
    assert tokens.shape == (1,)
