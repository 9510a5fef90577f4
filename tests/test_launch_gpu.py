"""Packed launches on the GPU (runtime/launch.py): a plain launch (CuPy's driver binding of
cuLaunchKernel) and a programmatic one (cuLaunchKernelEx through cuda-bindings) compute the same as the
reference, each launch reads the pointers of the arrays it is passed, a launch the driver refuses names
the kernel and the driver's error, and a thread in which CuPy has made no context current launches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import random_normal
from libnn.errors import LibraryError
from libnn.ops import activations
from libnn.runtime import launch

pytestmark = pytest.mark.gpu

ACT_RELU = activations.KERNEL_CODES["relu"]


def channel_epilogue(K: int, total: int, *, programmatic: bool, block: int = 256) -> launch.Launch:
    """kernels/epilogue.cu's y = act(y * scale[k] + shift[k]) for channels-last y of `total` elements."""
    return launch.bind("epilogue.cu", "channel_epilogue_f32", (min(-(-total // block), 64),), (block,),
                       [launch.ARRAY, launch.ARRAY, launch.ARRAY, np.int64(total), np.int32(K), np.int64(1),
                        np.int32(ACT_RELU)], programmatic=programmatic)


def expected(y, scale, shift):
    return np.maximum(y * scale + shift, 0)


@pytest.mark.parametrize("programmatic", [False, True], ids=["plain", "programmatic"])
def test_each_launch_computes_on_the_arrays_it_is_passed(rng, programmatic):
    import cupy

    rows, K = 37, 13  # odd sizes: the grid-stride loop's tail
    kernel = channel_epilogue(K, rows * K, programmatic=programmatic)
    for _ in range(3):  # new arrays at every launch: the pointers are read at each one
        y, scale, shift = (random_normal(rng, shape, "fp32") for shape in ((rows, K), (K,), (K,)))
        y_gpu = cupy.asarray(y)
        kernel(y_gpu, cupy.asarray(scale), cupy.asarray(shift))
        np.testing.assert_allclose(cupy.asnumpy(y_gpu), expected(y, scale, shift), rtol=1e-6, atol=1e-6)


def test_a_null_array_is_passed_as_a_null_pointer(rng):
    import cupy

    y, scale = random_normal(rng, (5, 3), "fp32"), random_normal(rng, (3,), "fp32")
    y_gpu = cupy.asarray(y)
    channel_epilogue(3, 15, programmatic=False)(y_gpu, cupy.asarray(scale), None)  # shift null: 0
    np.testing.assert_allclose(cupy.asnumpy(y_gpu), np.maximum(y * scale, 0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("programmatic", [False, True], ids=["plain", "programmatic"])
def test_a_refused_launch_names_the_kernel_and_the_drivers_error(rng, programmatic):
    import cupy

    kernel = channel_epilogue(3, 15, programmatic=programmatic, block=2048)  # over 1024 threads a block
    y = cupy.asarray(random_normal(rng, (5, 3), "fp32"))
    with pytest.raises(LibraryError, match=r"launching kernels/epilogue.cu:channel_epilogue_f32 failed: "
                                           r".*CUDA_ERROR_INVALID_VALUE"):
        kernel(y, None, None)
    kernel_ok = channel_epilogue(3, 15, programmatic=programmatic)  # the stream is still usable
    kernel_ok(y, None, None)
    cupy.cuda.get_current_stream().synchronize()


def test_a_new_thread_launches_a_kernel_bound_in_another(rng):
    """The thread's first CUDA call is the launch (its arrays allocated in the main thread): the driver
    API finds no current context there until the launch makes the device's primary context current."""
    import cupy

    y, scale, shift = (random_normal(rng, shape, "fp32") for shape in ((9, 7), (7,), (7,)))
    arrays = [cupy.asarray(a) for a in (y, scale, shift)]
    kernel = channel_epilogue(7, 63, programmatic=False)
    cupy.cuda.get_current_stream().synchronize()
    failures = []

    def work():
        try:
            kernel(*arrays)
        except Exception as exc:  # reported below: an exception in a thread would pass silently
            failures.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not failures, failures
    cupy.cuda.Device().synchronize()
    np.testing.assert_allclose(cupy.asnumpy(arrays[0]), expected(y, scale, shift), rtol=1e-6, atol=1e-6)
