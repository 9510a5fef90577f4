"""FFT convolution on the CPU: the float64 reference against direct convolution (conv2d's reference),
every mode, odd and prime sizes, causal 1-D; how NaN and Inf spread; sizes refused before allocating;
and the errors."""

import time

import numpy as np
import pytest

from libnn.ops.conv2d import conv2d
from libnn.ops.fft_conv import fft_conv1d, fft_conv2d, smooth_size
from conftest import rel_error


def direct(x, w, b, pads):
    return conv2d(np.pad(x, ((0, 0), (0, 0), *pads)), w, b, layout="NCHW", path="reference")


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 1, 1), (2, 3, 13, 17, 4, 5, 3), (1, 2, 31, 29, 3, 7, 7),
                                   (1, 1, 8, 8, 1, 8, 8), (2, 4, 11, 7, 5, 1, 1)], ids=str)
@pytest.mark.parametrize("mode", ["valid", "same", "full"])
def test_fft_conv2d_reference_matches_direct(rng, shape, mode):
    N, C, H, W, K, kh, kw = shape
    x, w, b = rng.standard_normal((N, C, H, W)), rng.standard_normal((K, C, kh, kw)), rng.standard_normal(K)
    pads = {"valid": ((0, 0), (0, 0)), "same": (((kh - 1) // 2, kh // 2), ((kw - 1) // 2, kw // 2)),
            "full": ((kh - 1, kh - 1), (kw - 1, kw - 1))}[mode]
    y = fft_conv2d(x, w, b, mode=mode)
    expected = direct(x, w, b, pads)
    assert y.shape == expected.shape and rel_error(y, expected) <= 1e-12


def test_valid_mode_takes_explicit_padding(rng):
    x, w = rng.standard_normal((1, 2, 9, 9)), rng.standard_normal((3, 2, 4, 4))
    assert rel_error(fft_conv2d(x, w, padding=2), direct(x, w, None, ((2, 2), (2, 2)))) <= 1e-12


@pytest.mark.parametrize("L, kl", [(1, 1), (50, 7), (127, 127), (1000, 33)])
def test_causal_fft_conv1d_sees_only_the_past(rng, L, kl):
    x, w = rng.standard_normal((2, 3, L)), rng.standard_normal((4, 3, kl))
    y = fft_conv1d(x, w, causal=True)
    expected = direct(x[:, :, None, :], w[:, :, None, :], None, ((0, 0), (kl - 1, 0)))[:, :, 0, :]
    assert y.shape == (2, 4, L) and rel_error(y, expected) <= 1e-12
    x2 = x.copy()
    x2[..., L // 2:] += 1.0  # changing the future leaves the past unchanged
    np.testing.assert_allclose(fft_conv1d(x2, w, causal=True)[..., : L // 2], y[..., : L // 2], atol=1e-10)


def test_smooth_sizes():
    assert [smooth_size(n) for n in (1, 11, 13, 17, 97, 127, 1000)] == [1, 12, 14, 18, 98, 128, 1000]


def _smooth_by_search(n):
    m = max(n, 1)
    while True:
        r = m
        for p in (2, 3, 5, 7):
            while r % p == 0:
                r //= p
        if r == 1:
            return m
        m += 1


def test_smooth_size_is_the_least_smooth_number_and_fast_for_huge_sizes():
    assert [smooth_size(n) for n in range(1, 5000)] == [_smooth_by_search(n) for n in range(1, 5000)]
    start = time.perf_counter()
    assert smooth_size(2 * 10**12 + 7) == 2000376000000  # 2^9 * 3^6 * 5^6 * 7^3
    assert time.perf_counter() - start < 0.1


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, on purpose
@pytest.mark.parametrize("channels", [(3, 4), (5, 6)], ids=["broadcast", "gemm"])
@pytest.mark.parametrize("where", ["x", "w"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_one_nan_or_inf_spreads_to_its_whole_image_or_filter(rng, channels, where, bad):
    """The documented FFT property: every output of the image (x) or filter channel (w) that holds the
    value becomes NaN; the other images and channels stay finite."""
    C, K = channels
    x, w = rng.standard_normal((2, C, 12, 11)), rng.standard_normal((K, C, 5, 4))
    (x if where == "x" else w)[1, 2, 3, 1] = bad
    y = fft_conv2d(x, w, rng.standard_normal(K))
    poisoned = y[1] if where == "x" else y[:, 1]
    clean = np.delete(y, 1, axis=0 if where == "x" else 1)
    assert np.isnan(poisoned).all() and np.isfinite(clean).all()


def test_sizes_are_checked_before_anything_is_computed():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"fft_conv1d: padding .* makes the padded input \(2000000000016,\); .* at most 2147483647"):
        fft_conv1d(np.ones((1, 1, 16)), np.ones((1, 1, 3)), padding=10**12)
    # in range per dimension, but 512 channels of 2e8 points need terabytes: memory.require refuses
    with pytest.raises(MemoryError, match=r"fft_conv1d: padding x \(16,\) to the FFT size .* needs .* more than .* host RAM"):
        fft_conv1d(np.ones((64, 8, 16)), np.ones((8, 8, 3)), padding=10**8)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(causal=True, mode="bogus"), r"fft_conv1d: mode must be one of .* got 'bogus'"),
    (dict(causal=True, padding=-5), r"fft_conv1d: padding must be an int >= 0 .* got -5"),
    (dict(causal=True, padding=2), r"fft_conv1d: causal=True pads kl-1 on the left itself; .* got padding=2"),
    (dict(causal=True, mode="same"), r"fft_conv1d: causal=True .* got mode='same'"),
    (dict(causal=True, mode="full"), r"fft_conv1d: causal=True .* got mode='full'"),
    (dict(mode="same", padding=1), r"fft_conv1d: padding applies to mode='valid' only"),
    (dict(padding=(1, 1)), r"fft_conv1d: padding must be an int >= 0 or a tuple of 1 ints"),
])
def test_fft_conv1d_refuses_contradictory_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fft_conv1d(np.ones((1, 2, 16)), np.ones((3, 2, 4)), **kwargs)


@pytest.mark.parametrize("padding", [1.5, None, np.array([1, 1]), True, (1.5, 2), "2", 2.0])
def test_non_integer_padding_is_a_type_error(padding):
    x, w = np.ones((1, 2, 9, 9)), np.ones((3, 2, 3, 3))
    fft_conv2d(x, w, padding=2)  # binds padding=2: 2.0 == 2 must not find its call
    with pytest.raises(TypeError, match=r"fft_conv2d: padding must be an int or a tuple of 2 ints, got"):
        fft_conv2d(x, w, padding=padding)


def test_causal_with_default_mode_and_padding_runs(rng):
    x, w = rng.standard_normal((1, 2, 20)), rng.standard_normal((3, 2, 5))
    assert fft_conv1d(x, w, causal=True, mode="valid", padding=0).shape == (1, 3, 20)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(w=np.ones((2, 3, 9, 9))), ValueError, r"kernel \(9, 9\) is larger than the padded input \(8, 8\)"),
    (dict(w=np.ones((2, 4, 3, 3))), ValueError, r"w has 4 input channels but x has 3"),
    (dict(stride=2), ValueError, r"stride must be 1 .* use libnn.ops.conv2d"),
    (dict(mode="circular"), ValueError, r"mode must be one of"),
    (dict(x=np.ones((1, 3, 8, 8), np.int32), w=np.ones((2, 3, 3, 3), np.int32)), TypeError, r"x must be real floating point"),
    (dict(x=np.ones((1, 3, 8, 8), np.complex64), w=np.ones((2, 3, 3, 3), np.complex64)), TypeError, r"x must be real floating point"),
])
def test_bad_input(kwargs, error, message):
    args = dict(x=np.ones((1, 3, 8, 8)), w=np.ones((2, 3, 3, 3)))
    args.update(kwargs)
    x, w = args.pop("x"), args.pop("w")
    with pytest.raises(error, match=message):
        fft_conv2d(x, w, **args)
