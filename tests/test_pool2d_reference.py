"""Pooling on the CPU: the reference against explicit loops, PyTorch's padding rules, and errors."""

import numpy as np
import pytest

from libnn.ops.pool2d import avg_pool2d, max_pool2d
from conftest import rel_error


def loop_oracle(x, mode, k, s, p, count_include_pad):
    N, H, W, C = x.shape
    P, Q = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    y = np.empty((N, P, Q, C))
    for n in range(N):
        for i in range(P):
            for j in range(Q):
                for c in range(C):
                    vals = [x[n, h, w, c] for h in range(i * s - p, i * s - p + k) for w in range(j * s - p, j * s - p + k)
                            if 0 <= h < H and 0 <= w < W]
                    if mode == "max":
                        y[n, i, j, c] = max(vals)
                    else:
                        y[n, i, j, c] = sum(vals) / (k * k if count_include_pad else len(vals))
    return y


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("k, s, p", [(1, 1, 0), (2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 1)])
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_pool_reference_matches_loops(rng, mode, k, s, p, count_include_pad, layout):
    x = rng.standard_normal((2, 7, 6, 3))
    expected = loop_oracle(x, mode, k, s, p, count_include_pad)
    if layout == "NCHW":
        x, expected = x.transpose(0, 3, 1, 2), expected.transpose(0, 3, 1, 2)
    if mode == "max":
        y = max_pool2d(x, k, s, p, layout=layout)
    else:
        y = avg_pool2d(x, k, s, p, count_include_pad=count_include_pad, layout=layout)
    assert rel_error(y, expected) <= 1e-14


def test_stride_defaults_to_kernel_size():
    assert max_pool2d(np.ones((1, 8, 8, 1)), 2).shape == (1, 4, 4, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kernel_size=3, padding=2), r"padding \(2, 2\) must be at most half the kernel size"),
    (dict(kernel_size=9), r"the 9x9 window is larger than the padded 4x4 input"),
    (dict(kernel_size=0), r"kernel_size must be an int or a pair of ints >= 1"),
    (dict(kernel_size=2, layout="HWCN"), r"layout must be one of"),
])
def test_bad_pool_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        max_pool2d(np.ones((1, 4, 4, 1)), **kwargs)
