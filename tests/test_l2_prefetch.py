"""The L2 prefetch hint's argument checks that need no GPU (runtime/l2_prefetch.py): what is not a hint is
refused with a TypeError naming the op and `prefetch`; the kernels' prefetch parameters as contracts pack
them; the budget read from kernels/common.cuh."""

import numpy as np
import pytest

from libnn.ops import linear, rms_norm_linear
from libnn.ops.linear_fp8 import linear_fp8
from libnn.runtime import contracts, l2_prefetch, launch


@pytest.mark.parametrize("prefetch", [np.ones(4, np.float16), (np.ones(4, np.float16),), "w", 3, (), [None]],
                         ids=["numpy", "tuple of numpy", "str", "int", "empty tuple", "list of None"])
def test_what_is_not_a_hint_is_refused_by_name(prefetch):
    x, w = np.ones((1, 8), np.float16), np.ones((4, 8), np.float16)
    with pytest.raises(TypeError, match=r"linear: prefetch must be None, a CuPy array or a tuple of 1 to 2"):
        linear(x, w, prefetch=prefetch)
    with pytest.raises(TypeError, match=r"rms_norm_linear: prefetch must be None"):
        rms_norm_linear(x, np.ones(8, np.float16), w, prefetch=prefetch)
    with pytest.raises(TypeError, match=r"linear_fp8: prefetch must be None"):
        linear_fp8(x, np.ones((4, 8), np.uint8), np.ones(1, np.float32), prefetch=prefetch)


def test_more_arrays_than_the_kernel_has_ranges_are_refused():
    with pytest.raises(TypeError, match=r"a tuple of 3"):
        l2_prefetch.hinted_arrays("linear", (None, None, None))


def test_no_hint_is_an_empty_tuple():
    assert l2_prefetch.hinted_arrays("linear", None) == ()


def test_kernel_parameters_pack_a_slot_per_hinted_array():
    gemv = contracts.params("gemv.cu", "GEMV_PARAMS")
    base = dict(x=launch.ARRAY, w=launch.ARRAY, bias=None, residual=None, gamma=None, y=launch.ARRAY, N=4, K=8,
                eps=0.0, act=0)
    none = gemv.pack(**base, **l2_prefetch.kernel_parameters(()))
    one = gemv.pack(**base, **l2_prefetch.kernel_parameters((4096,)))
    two = gemv.pack(**base, **l2_prefetch.kernel_parameters((100, 200)))
    tail = [p.name for p in gemv.params][-4:]
    assert tail == ["prefetch0", "prefetch0_bytes", "prefetch1", "prefetch1_bytes"]
    assert none[-4:] == (contracts.NULL, 0, contracts.NULL, 0)
    assert one[-4] is launch.ARRAY and one[-3] == 4096 and one[-2:] == (contracts.NULL, 0)
    assert two[-4] is launch.ARRAY and two[-2] is launch.ARRAY and (two[-3], two[-1]) == (100, 200)


def test_the_budget_is_common_cuh_s():
    assert l2_prefetch.budget() == contracts.constants("common.cuh")["L2_PREFETCH_BYTES"] > 0
