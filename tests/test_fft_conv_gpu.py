"""FFT convolution and our FFT on the GPU: every path against the float64 reference, our FFT against
cuFFT on transforms alone, and cuFFT's plan cache."""

import math

import numpy as np
import pytest

import libnn
from libnn.ops.fft_conv import fft_conv1d, fft_conv2d
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu


def gpu(a):
    import cupy
    return cupy.asarray(a)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("path", ["cufft", "custom"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 1, 1), (2, 3, 13, 17, 4, 5, 3), (1, 2, 64, 61, 3, 31, 31),
                                   (2, 4, 127, 128, 5, 9, 9)], ids=str)
@pytest.mark.parametrize("mode", ["valid", "same", "full"])
def test_fft_conv2d_paths_match_reference(rng, path, dtype, shape, mode):
    N, C, H, W, K, kh, kw = shape
    x = random_normal(rng, (N, C, H, W), dtype)
    w = random_normal(rng, (K, C, kh, kw), dtype, 1 / math.sqrt(C * kh * kw))
    b = random_normal(rng, (K,), dtype)
    expected = fft_conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), mode=mode)
    y = fft_conv2d(gpu(x), gpu(w), gpu(b), mode=mode, path=path)
    size = max(H + kh, W + kw) ** 2
    tol = 1e-5 * math.log2(size + 1) if dtype == "fp32" else 1e-2
    assert y.dtype == x.dtype and rel_error(y, expected) <= tol


@pytest.mark.parametrize("path", ["cufft", "custom"])
@pytest.mark.parametrize("L, kl", [(1000, 64), (4096, 4096), (1 << 17, 1 << 17)])
def test_long_causal_conv1d(rng, path, L, kl):
    x, w = random_normal(rng, (1, 2, L), "fp32"), random_normal(rng, (2, 2, kl), "fp32", 1 / math.sqrt(2 * kl))
    expected = fft_conv1d(x.astype(np.float64), w.astype(np.float64), causal=True)
    y = fft_conv1d(gpu(x), gpu(w), causal=True, path=path)
    assert rel_error(y, expected) <= 1e-5 * math.log2(2 * L)


@pytest.mark.parametrize("version", ["fft_radix2_c2c", "fft_radix4_c2c"])
@pytest.mark.parametrize("log2n", [1, 2, 3, 5, 8, 12, 13, 16, 20])
@pytest.mark.parametrize("inverse", [False, True])
def test_our_fft_matches_cufft(rng, version, log2n, inverse):
    import cupy

    from libnn.ops.fft_kernels import fft_c2c, versions

    if version not in versions():
        pytest.skip(f"{version} is not built")
    n = 1 << log2n
    rows = max(1, (1 << 18) // n)
    x = (rng.standard_normal((rows, n)) + 1j * rng.standard_normal((rows, n))).astype(np.complex64)
    ours = fft_c2c(gpu(x), inverse=inverse, version=version)
    theirs = cupy.fft.ifft(gpu(x), axis=-1) * n if inverse else cupy.fft.fft(gpu(x), axis=-1)
    expected = np.fft.ifft(x.astype(np.complex128)) * n if inverse else np.fft.fft(x.astype(np.complex128))
    assert rel_error(ours.get().view(np.float32), expected.view(np.float64)) <= 1e-6 * (log2n + 1)
    assert rel_error(theirs.get().view(np.float32), expected.view(np.float64)) <= 1e-6 * (log2n + 1)


def test_second_call_makes_no_new_cufft_plan(rng):
    import cupy

    x, w = gpu(random_normal(rng, (2, 3, 40, 40), "fp32")), gpu(random_normal(rng, (4, 3, 9, 9), "fp32"))
    fft_conv2d(x, w, path="cufft")
    cache = cupy.fft.config.get_plan_cache()
    size = cache.get_curr_size()
    fft_conv2d(x, w, path="cufft")
    assert cache.get_curr_size() == size


def test_sizes_that_do_not_fit_are_refused_with_the_size_needed():
    import cupy

    with pytest.raises(MemoryError, match=r"need .* GiB"):
        fft_conv2d(cupy.ones((512, 512, 64, 64), cupy.float16), cupy.ones((512, 512, 60, 60), cupy.float16),
                   mode="full", path="cufft")


def test_auto_prefers_cufft():
    import cupy

    fft_conv2d(cupy.ones((1, 1, 8, 8), cupy.float32), cupy.ones((1, 1, 3, 3), cupy.float32))
    assert libnn.get_op("fft_conv").last_decision.path == "cufft"
