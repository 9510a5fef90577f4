"""Launch configurations on the CPU: launch.bind's for cuLaunchKernelEx, with (programmatic=True) and
without (CUDA's programmatic stream serialization attribute, the grid, block, shared memory and
stream given), and the FP8 GEMV asking for it on sm_90 and newer only (griddepcontrol needs sm_90; the
GEMV runs from sm_89). The launches themselves run in the GPU tests (test_linear_fp8_gpu.py, the decoder's)."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest

from libnn.runtime import launch
from gpu_stand_ins import CUDA, host_ndarray

l8 = importlib.import_module("libnn.ops.linear_fp8")


def test_a_programmatic_launch_carries_the_stream_serialization_attribute():
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    config = launch._launch_config((3, 2), (256,), 4096, 0, programmatic=True)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (3, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (256, 1, 1)
    assert config.sharedMemBytes == 4096 and config.numAttrs == 1
    (attribute,) = config.attrs
    assert attribute.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attribute.value.programmaticStreamSerializationAllowed == 1


def test_a_plain_launch_has_no_attribute():
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    config = launch._launch_config((7,), (128, 2), 0, 0, programmatic=False)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (7, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 2, 1)
    assert config.numAttrs == 0


@pytest.mark.parametrize("capability, programmatic", [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_the_fp8_gemv_launches_programmatically_from_sm_90(monkeypatch, capability, programmatic):
    binds = []
    monkeypatch.setattr(launch, "bind", lambda *args, **kwargs: binds.append(kwargs))
    monkeypatch.setattr(l8, "compute_capability", lambda device_id: capability)
    monkeypatch.setattr(l8, "multiprocessors", lambda device_id: 132)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=host_ndarray, cuda=CUDA))  # no GPU needed
    problem = l8.LinearFp8Problem(M=1, N=48, K=64, dtype="fp16", per_channel=True, has_bias=False,
                                  activation=None, has_residual=False, device="gpu:0")
    l8.bind_gemv(problem, np.ones((1, 64), np.float16), None, None, None)
    assert binds[-1]["programmatic"] is programmatic
