"""FFT convolution on the CPU: the float64 reference against direct convolution (conv2d's reference),
every mode, odd and prime sizes, causal 1-D; and the errors."""

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
