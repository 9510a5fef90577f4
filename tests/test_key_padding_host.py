"""nn.functional's padding masks on the CPU: key_padding_and_tokens with nonempty lengths on the host
(a row without tokens attends to its first position, its bias row all zeros), and the GPU branches'
launches against stand-ins for CuPy and the launch: the captured key padding's one kernel
(kernels/key_padding.cu) per mask and bias width, and masked_mean's kernel (kernels/masked_mean.cu),
vectorised where F and x's alignment allow. Each bound once per signature; the packed arguments are
checked against the compiled kernels (NVRTC, no GPU)."""

import sys
import types

import numpy as np
import pytest

from libnn import dtypes
from libnn.nn import functional
from libnn.nn.functional import KeyPadding, key_padding, key_padding_and_tokens, masked_mean
from libnn.ops.attention import CheckedLengths, KeyPaddingBias
from libnn.runtime import launch

from conftest import random_normal
from gpu_stand_ins import CUDA, device_empty, on_device, report_a_gpu


# --- the host branch ------------------------------------------------------------------------------------
def test_nonempty_lengths_give_a_row_without_tokens_its_first_position_and_no_holes():
    """nonempty=True: lengths clamped to 1 where a row has no token, flagged nonempty; that row's bias
    is 0 throughout (the holes lie before a row's last token, and it has none); the other rows' lengths
    and bias are the true ones. nonempty=False keeps the 0."""
    mask = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 1, 1]], np.int64)
    padding = key_padding_and_tokens(mask, "fp16", nonempty=True)
    assert isinstance(padding, KeyPadding) and padding.tokens == 5
    np.testing.assert_array_equal(padding.valid, mask != 0)
    assert padding.seq_lens_kv.nonempty and padding.seq_lens_kv.lengths.tolist() == [3, 1, 4]
    assert padding.seq_lens_kv.lengths.dtype == np.int32
    bias = padding.bias.bias
    assert isinstance(padding.bias, KeyPaddingBias) and bias.shape == (3, 1, 1, 4) and bias.dtype == np.float16
    np.testing.assert_array_equal(np.isneginf(bias[:, 0, 0]), [[0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert np.all(bias[1] == 0), "the row without tokens attends to its first position: no -inf there"
    plain = key_padding_and_tokens(mask, "fp16")
    assert not plain.seq_lens_kv.nonempty and plain.seq_lens_kv.lengths.tolist() == [3, 0, 4]
    np.testing.assert_array_equal(plain.bias.bias, bias)


def test_nonempty_right_padding_is_lengths_alone_and_a_full_mask_nothing():
    right = np.array([[True, True, False], [False, False, False]])
    padding = key_padding_and_tokens(right, np.float32, nonempty=True)
    assert padding.valid is right, "a boolean mask is its own valid"
    assert padding.bias is None and padding.seq_lens_kv.lengths.tolist() == [2, 1] and padding.seq_lens_kv.nonempty
    assert key_padding_and_tokens(np.ones((2, 3), np.int32), "fp32", nonempty=True)[1:] == (None, None, 6)
    lens = key_padding_and_tokens(np.array([[1, 1, 0], [1, 0, 0]]), "fp32", nonempty=True).seq_lens_kv
    assert lens.nonempty and lens.lengths.tolist() == [2, 1], "no row without tokens: the true lengths"


def test_key_padding_and_tokens_refuses_a_nonempty_that_is_not_a_bool():
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="^key_padding: nonempty must be True or False, got"):
            key_padding_and_tokens(np.ones((1, 2), bool), "fp16", nonempty=bad)


# --- the GPU branches against stand-ins ----------------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """CuPy's allocations by NumPy (at CuPy's alignment), a GPU and a stream reported, a CUDA graph being
    captured, and every bind and launch recorded: returns a namespace of binds (file, kernel, grid,
    block, args) and launches (the arrays passed)."""
    seen = types.SimpleNamespace(binds=[], launches=[])

    def bind(file, kernel, grid, block, args, **options):
        seen.binds.append((file, kernel, grid, block, args))
        return lambda *passed: seen.launches.append(passed)

    def zeros(shape, dtype):
        out = device_empty(shape, dtype)
        out[...] = 0
        return out

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        empty=device_empty, zeros=zeros, bool_=np.bool_, int32=np.int32, cuda=CUDA,
        ascontiguousarray=lambda a: on_device(np.ascontiguousarray(a))))
    monkeypatch.setattr(launch, "bind", bind)
    monkeypatch.setattr(functional, "capturing", lambda: True)
    monkeypatch.setattr(functional, "current_device_id", lambda: 0)
    report_a_gpu(monkeypatch)
    functional._launches.clear()
    yield seen
    functional._launches.clear()  # bound with the stand-ins: no later test may find them


MASKS = {"bool": np.bool_, "uint8": np.uint8, "int16": np.int16, "int32": np.int32, "int64": np.int64}


@pytest.mark.parametrize("mask_dtype", list(MASKS))
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("nonempty", [False, True])
def test_captured_key_padding_is_one_launch_reading_the_mask_as_it_is(rng, fake_gpu, mask_dtype, dtype, nonempty):
    """While captured: one kernel named by the mask's and the bias's widths, a warp per row (4 rows per
    128-thread block), the mask passed as the caller's array (no conversion), valid written unless the
    mask is boolean (a null pointer then: the mask is its own), the lengths int32 (B,), the bias (B, S)
    in the dtype, returned as (B, 1, 1, S); min_length 1 for nonempty lengths, the dtype's -inf bits.
    Bound once: a second call binds nothing."""
    B, S = 5, 9
    mask = on_device((rng.random((B, S)) < 0.5).astype(MASKS[mask_dtype]))
    for _ in range(2):
        padding = key_padding_and_tokens(mask, dtype, nonempty=nonempty)
        sent_mask, sent_valid, lengths, bias = fake_gpu.launches[-1]
        assert sent_mask is mask and padding.tokens is None
        if mask_dtype == "bool":
            assert sent_valid is None and padding.valid is mask
        else:
            assert padding.valid is sent_valid and sent_valid.shape == (B, S) and sent_valid.dtype == np.bool_
        assert isinstance(padding.seq_lens_kv, CheckedLengths) and padding.seq_lens_kv.lengths is lengths
        assert padding.seq_lens_kv.nonempty is nonempty
        assert lengths.shape == (B,) and lengths.dtype == np.int32
        assert bias.shape == (B, S) and bias.dtype == dtypes.parse(dtype)
        assert padding.bias.bias.shape == (B, 1, 1, S) and np.shares_memory(padding.bias.bias, bias)
    ((file, kernel, grid, block, args),) = fake_gpu.binds
    width = np.dtype(MASKS[mask_dtype]).itemsize * 8
    bias_width = dtypes.parse(dtype).itemsize * 8
    assert (file, kernel, grid, block) == ("key_padding.cu", f"key_padding_mask{width}_bias{bias_width}", (2,), (128,))
    packed = dict(zip(functional._KP.names, args))
    assert all(packed[n] is launch.ARRAY for n in ("mask", "valid", "lengths", "bias"))
    assert [packed[n] for n in ("B", "S", "min_length")] == [B, S, int(nonempty)]
    minus_inf = np.array(-np.inf, dtypes.parse(dtype)).view(f"u{bias_width // 8}")[()]
    assert packed["minus_inf"] == minus_inf and isinstance(packed["minus_inf"], np.uint64)


def test_key_padding_while_captured_converts_nothing_and_key_padding_keeps_its_pair(rng, fake_gpu):
    """key_padding (the transformer layers' (lengths, bias)) takes the same launch; a strided mask is
    made contiguous first, the kernel reading rows S words apart."""
    valid = on_device(rng.random((3, 8)) < 0.5)
    lens, bias = key_padding(valid, np.float16)
    assert not lens.nonempty and bias.bias.shape == (3, 1, 1, 8)
    strided = on_device(np.ones((3, 16), np.int32))[:, ::2]
    key_padding(strided, np.float16)
    sent = fake_gpu.launches[-1][0]
    assert sent.flags.c_contiguous and sent.shape == (3, 8) and sent.dtype == np.int32
    assert [kernel for _, kernel, *_ in fake_gpu.binds] == ["key_padding_mask8_bias16", "key_padding_mask32_bias16"]


@pytest.mark.parametrize("mask_bits", [8, 16, 32, 64])
@pytest.mark.parametrize("bias_bits", [16, 32, 64])
def test_key_padding_kernels_take_what_the_launch_packs(mask_bits, bias_bits):
    """Every key_padding kernel's compiled parameters and __launch_bounds__ are those the launch packs
    (compiled with NVRTC, no GPU)."""
    from test_kernel_contracts import assert_packed, max_threads

    kernel = f"key_padding_mask{mask_bits}_bias{bias_bits}"
    args = functional._KP.pack(mask=None, valid=None, lengths=None, bias=None, B=3, S=7, min_length=1,
                               minus_inf=0xFC00)
    assert_packed(args, functional._KP, kernel)
    assert max_threads("key_padding.cu", kernel) == functional._KP_THREADS == 128


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("F, offset, version", [(64, 0, "masked_mean2_vec"), (384, 0, "masked_mean2_vec"),
                                               (7, 0, "masked_mean1_scalar"), (64, 1, "masked_mean1_scalar")],
                         ids=["64", "384", "odd-F", "misaligned"])
def test_masked_mean_launches_a_block_per_entry_and_64_columns(rng, fake_gpu, dtype, F, offset, version):
    """masked_mean on the GPU: the 16-byte version where F is a multiple of 16 bytes' elements and x is
    16-byte aligned, the scalar one otherwise; grid (B, ceil(F / 64)), 256 threads; a boolean valid
    passed as it is, a new (B, F) output in x's dtype. Bound once per signature."""
    B, S = 3, 5
    t = dtypes.parse(dtype)
    raw = device_empty((B * S * F + offset,), t)
    x = raw[offset:].reshape(B, S, F)
    x[...] = random_normal(rng, (B, S, F), dtype)
    valid = on_device(rng.random((B, S)) < 0.5)
    for _ in range(2):
        out = masked_mean(x, valid)
        sent_x, sent_valid, sent_out = fake_gpu.launches[-1]
        assert sent_x is x and sent_valid is valid and sent_out is out
        assert out.shape == (B, F) and out.dtype == t
    ((file, kernel, grid, block, args),) = fake_gpu.binds
    suffix = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "fp64": "f64"}[dtype]
    assert (file, kernel, grid, block) == ("masked_mean.cu", f"{version}_{suffix}", (B, -(-F // 64)), (256,))
    packed = dict(zip(functional._MM.names, args))
    assert all(packed[n] is launch.ARRAY for n in ("x", "valid", "out"))
    assert [packed[n] for n in ("S", "F")] == [S, F]


def test_masked_mean_of_nothing_is_zeros_without_a_launch(fake_gpu):
    out = masked_mean(on_device(np.ones((2, 0, 3), np.float32)), on_device(np.ones((2, 0), bool)))
    assert out.shape == (2, 3) and not out.any() and fake_gpu.launches == []


def test_masked_mean_refuses_more_features_than_its_grid_takes_before_allocating(fake_gpu):
    F = 65535 * 64 + 1  # one column past the grid's y limit: a (1, 1, F) fp16 x of 8 MB
    x = on_device(np.ones((1, 1, F), np.float16))
    with pytest.raises(ValueError, match=r"^masked_mean: x has F=4194241 features per position, more than "
                                         r"kernels/masked_mean.cu takes \(4194240: 64 per block"):
        masked_mean(x, on_device(np.ones((1, 1), bool)))
    assert fake_gpu.launches == []


@pytest.mark.parametrize("kernel", [f"masked_mean{v}_{s}" for v in ("1_scalar", "2_vec")
                                    for s in ("f16", "bf16", "f32", "f64")])
def test_masked_mean_kernels_take_what_the_launch_packs(kernel):
    from test_kernel_contracts import assert_packed, max_threads

    args = functional._MM.pack(x=None, valid=None, out=None, S=5, F=7)
    assert_packed(args, functional._MM, kernel)
    assert max_threads("masked_mean.cu", kernel) == functional._MM_THREADS == 256
