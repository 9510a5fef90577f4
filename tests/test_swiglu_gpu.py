"""swiglu on the GPU: the custom path (kernels/swiglu.cu) against the float64 reference on odd shapes (F = 1,
7, primes, LLaMA-7B's 11008, M = 1 and primes), fp16, bf16 and fp32, outputs poisoned; both kernel versions
forced, on a grid and block far smaller than the table's; misaligned views (the element-wise version) and row
slices of a wider array read in place (the 16-byte version where they allow it); strided views copied; extreme
values; empty inputs; a bound call reading new arrays at every call. About 30 cases. Tolerances: relative L2
error fp32 1e-5, fp16/bf16 1e-2 (dtypes.TOLERANCE)."""

import importlib

import numpy as np
import pytest

import libnn
from libnn import dtypes
from libnn.ops import swiglu
from conftest import random_normal, rel_error

pytestmark = pytest.mark.gpu

sw = importlib.import_module("libnn.ops.swiglu")  # the module: libnn.ops.swiglu is the function

DTYPES = ["fp16", "bf16", "fp32"]
# (leading dims..., F): F = 1 and 7 (less than a 16-byte vector), 64 (whole vectors), 1000, 11008 (LLaMA-7B's
# intermediate size, at decode's M = 1); M = 1, 3, 13 and a 3-D batch
SHAPES = [(1, 1), (3, 7), (13, 64), (2, 3, 1000), (1, 11008)]


def gpu(a):
    import cupy
    return cupy.asarray(a)


def reference(x):
    """The float64 oracle of x as given (already rounded to its dtype)."""
    return swiglu(np.asarray(x).astype(np.float64), path="reference")


def make(rng, lead_and_f, dtype, scale=3.0):
    *lead, F = lead_and_f
    return random_normal(rng, (*lead, 2 * F), dtype, scale)


def to_device_at(a, view: str):
    """`a` on the GPU laid out as `view` says: "offset" (one element past a 256-byte aligned start),
    "rows" (the first 2F columns of rows 3F wide, like q's slice of a QKV projection)."""
    import cupy

    bits = f"u{a.dtype.itemsize}"
    if view == "offset":
        out = cupy.zeros(a.size + 1, a.dtype)[1:].reshape(a.shape)
    else:
        out = cupy.zeros((*a.shape[:-1], a.shape[-1] * 3 // 2), a.dtype)[..., :a.shape[-1]]
    out.view(bits)[...] = cupy.asarray(np.ascontiguousarray(a).view(bits))
    return out


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_custom_matches_reference(rng, shape, dtype):
    """y poisoned with NaN before the kernel writes it: an unwritten element fails (rel_error is inf)."""
    x = make(rng, shape, dtype)
    y = swiglu(gpu(x), path="custom")
    assert y.shape == (*shape[:-1], shape[-1]) and y.dtype == x.dtype
    assert rel_error(y, reference(x)) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_runs_the_custom_kernel(rng, dtype):
    x = make(rng, (5, 96), dtype)
    y = swiglu(gpu(x))
    assert libnn.get_op("swiglu").last_decision.path == "custom"
    assert rel_error(y, reference(x)) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_misaligned_view_takes_the_element_wise_version(rng, dtype):
    """One element past an aligned start: no 16-byte loads (the vector version is refused for it), the
    result as good."""
    x = make(rng, (7, 64), dtype)
    view = to_device_at(x, "offset")
    assert view.data.ptr % 16
    with pytest.raises(ValueError, match=r"^swiglu: kernels/swiglu.cu version 'swiglu2_vec' cannot run"):
        sw.launch_custom(view, "swiglu2_vec")
    assert rel_error(swiglu(view), reference(x)) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_slices_of_a_wider_array_are_read_in_place_with_vectors(rng, dtype):
    """x[..., :2F] of rows 3F wide: row stride 3F, whole vectors for F = 64, so the 16-byte version runs
    on the view as it lies, without a copy."""
    x = make(rng, (2, 5, 64), dtype)
    view = to_device_at(x, "rows")
    assert not view.flags.c_contiguous and sw.row_stride(view) == 3 * 64
    for version in sw.VERSIONS:
        assert rel_error(sw.launch_custom(view, version), reference(x)) <= dtypes.TOLERANCE[dtype]
    assert rel_error(swiglu(view), reference(x)) <= dtypes.TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_version_strides_over_rows_and_columns_on_a_small_grid(rng, dtype):
    """One block of 32 x 1 threads for 37 rows of 1000 outputs (125 to 250 vectors): both loops wrap many
    times; the table's geometry agrees."""
    x = make(rng, (37, 1000), dtype)
    expected = reference(x)
    for version in sw.VERSIONS:
        for geometry in (None, ((1, 1), (32, 1)), ((3, 2), (64, 4))):
            y = sw.launch_custom(gpu(x), version, geometry)
            assert rel_error(y, expected) <= dtypes.TOLERANCE[dtype], (version, geometry)


@pytest.mark.usefixtures("poisoned_gpu_memory")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_strided_input_is_copied_and_gives_the_contiguous_result(rng, dtype):
    x = make(rng, (6, 2 * 24), dtype)
    view = gpu(np.zeros((6, 2 * x.shape[1]), x.dtype))[:, ::2]  # x's shape, every other column of a wider array
    view.view(f"u{x.itemsize}")[...] = gpu(x.view(f"u{x.itemsize}"))
    assert sw.row_stride(view) is None
    y = swiglu(view)
    assert y.flags.c_contiguous and rel_error(y, reference(x)) <= dtypes.TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_extremes_follow_the_reference(dtype):
    """Very negative gates give -0, large ones the gate times up; infinities and NaN as the reference
    (silu(+inf) = inf, silu(-inf) = NaN, NaN stays in its own element)."""
    gate = np.array([-1000.0, -80.0, -8.0, 8.0, 30.0, np.inf, -np.inf, np.nan, 1.0, 0.0])
    up = np.array([2.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0, np.nan, 5.0])
    x = np.concatenate([gate, up])[None].astype(dtypes.parse(dtype))
    y = swiglu(gpu(x)).get().astype(np.float64)
    expected = reference(x).astype(x.dtype).astype(np.float64)  # rounded to the dtype, as every path returns it
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_allclose(y[finite], expected[finite], rtol=dtypes.TOLERANCE[dtype], atol=0)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 6)], ids=str)
def test_an_empty_input_gives_an_empty_result(shape):
    import cupy

    y = swiglu(cupy.ones(shape, cupy.float16))
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == cupy.float16


@pytest.mark.usefixtures("poisoned_gpu_memory")
def test_a_bound_call_reads_new_arrays_at_every_call(rng):
    """Three calls of one signature: one bound call, three results, each of its own input."""
    calls = libnn.get_op("swiglu").calls
    calls.clear()
    builds = calls.stats.builds
    inputs = [make(rng, (9, 128), "bf16") for _ in range(3)]
    outputs = [swiglu(gpu(x)) for x in inputs]
    assert calls.stats.builds == builds + 1
    for x, y in zip(inputs, outputs):
        assert rel_error(y, reference(x)) <= dtypes.TOLERANCE["bf16"]
    assert rel_error(outputs[0], reference(inputs[1])) > 0.1
