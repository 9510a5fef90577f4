"""Launch configurations on the CPU: launch.bind's for cuLaunchKernelEx, with (programmatic=True) and
without (CUDA's programmatic stream serialization attribute, the grid, block, shared memory and
stream given), and the FP8 GEMV asking for it on sm_90 and newer only (griddepcontrol needs sm_90; the
GEMV runs from sm_89), and the decode GEMVs not asking for it where the call copies an operand they read
before their wait. The launches themselves run in the GPU tests (test_linear_fp8_gpu.py, the decoder's)."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest

from libnn.runtime import launch
from gpu_stand_ins import CUDA, device_empty, host_ndarray

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
@pytest.mark.parametrize("K, file", [(64, "gemv.cu"), (72, "linear_fp8.cu")])  # K % 16 != 0: version 3
def test_the_fp8_gemv_launches_programmatically_from_sm_90(monkeypatch, capability, programmatic, K, file):
    binds = []
    monkeypatch.setattr(launch, "bind", lambda *args, **kwargs: binds.append((args[0], kwargs)))
    monkeypatch.setattr(launch, "compute_capability", lambda device_id: capability)
    monkeypatch.setattr(l8, "multiprocessors", lambda device_id: 132)
    monkeypatch.setattr(importlib.import_module("libnn.ops.linear").device_info, "multiprocessors",
                        lambda device_id: 132)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=host_ndarray, cuda=CUDA))  # no GPU needed
    problem = l8.LinearFp8Problem(M=1, N=48, K=K, dtype="fp16", per_channel=True, has_bias=False,
                                  activation=None, has_residual=False, device="gpu:0")
    l8.bind_gemv(problem, np.ones((1, K), np.float16), np.ones((48, K), np.uint8), None, None)
    assert binds[-1][0] == file and binds[-1][1]["programmatic"] is programmatic


def _record_binds_on_sm_90(monkeypatch) -> list:
    """launch.bind recorded as (file, kwargs) on a stand-in sm_90 GPU of 132 SMs, CuPy stood in for."""
    binds = []
    monkeypatch.setattr(launch, "bind", lambda *args, **kwargs: binds.append((args[0], kwargs)))
    monkeypatch.setattr(launch, "compute_capability", lambda device_id: (9, 0))
    monkeypatch.setattr(l8, "multiprocessors", lambda device_id: 132)
    monkeypatch.setattr(importlib.import_module("libnn.ops.linear").device_info, "multiprocessors",
                        lambda device_id: 132)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=host_ndarray, cuda=CUDA,
                                                                   ascontiguousarray=_copy))
    return binds


def _copy(a):
    """cupy.ascontiguousarray's stand-in: a C-contiguous copy at CuPy's alignment."""
    copy = device_empty(a.shape, a.dtype)
    copy[...] = a
    return copy


def _strided(shape, dtype):
    """A view of `shape` that is not C-contiguous (every other column of one twice as wide), 16-byte aligned."""
    wide = device_empty((*shape[:-1], 2 * shape[-1]), dtype)
    wide[...] = 1
    return wide[..., ::2]


def _contiguous(shape, dtype):
    a = device_empty(shape, dtype)
    a[...] = 1
    return a


# A decode GEMV reads w, w_scale and gamma before its pdl_wait. Where the call copies one of them (it came
# strided), the copy is a kernel just ahead of the GEMV, which a programmatic launch could overtake: that
# GEMV is launched plainly, after the copy. In place (C-contiguous), it starts early.
@pytest.mark.parametrize("strided", [None, "w", "w_scale"])
@pytest.mark.parametrize("K, file", [(64, "gemv.cu"), (72, "linear_fp8.cu")])
def test_the_fp8_gemv_waits_for_the_copy_of_a_strided_weight_or_scale(monkeypatch, strided, K, file):
    binds = _record_binds_on_sm_90(monkeypatch)
    problem = l8.LinearFp8Problem(M=1, N=48, K=K, dtype="fp16", per_channel=True, has_bias=False,
                                  activation=None, has_residual=False, device="gpu:0")
    w = (_strided if strided == "w" else _contiguous)((48, K), np.uint8)
    w_scale = (_strided if strided == "w_scale" else _contiguous)((48,), np.float32)
    l8.bind_gemv(problem, _contiguous((1, K), np.float16), w, w_scale, None)
    assert binds[-1][0] == file and binds[-1][1]["programmatic"] is (strided is None)


@pytest.mark.parametrize("strided", [None, "w"])
def test_linears_gemv_waits_for_the_copy_of_a_strided_weight(monkeypatch, strided):
    linear = importlib.import_module("libnn.ops.linear")
    binds = _record_binds_on_sm_90(monkeypatch)
    problem = linear.LinearProblem(M=1, N=40, K=64, dtype="fp16", has_bias=False, activation=None,
                                   allow_tf32=False, device="gpu:0")
    w = (_strided if strided else _contiguous)((40, 64), np.float16)
    linear.op.paths["gemv"].bind(problem, (_contiguous((1, 64), np.float16), w, None, None))
    assert binds[-1][0] == "gemv.cu" and binds[-1][1]["programmatic"] is (strided is None)


@pytest.mark.parametrize("e4m3, strided", [(False, None), (False, "norm_weight"), (False, "w"), (True, None),
                                            (True, "norm_weight"), (True, "w"), (True, "w_scale")])
def test_rms_norm_linears_gemv_waits_for_the_copy_of_a_strided_operand(monkeypatch, strided, e4m3):
    rnl = importlib.import_module("libnn.ops.rms_norm_linear")
    binds = _record_binds_on_sm_90(monkeypatch)
    K, N = 64, 40
    arrays = {"norm_weight": ((K,), np.float16), "w": ((N, K), np.uint8 if e4m3 else np.float16),
              "w_scale": ((N,), np.float32)}
    g, w, s = ((_strided if name == strided else _contiguous)(*arrays[name]) for name in arrays)
    problem = rnl.RMSNormLinearProblem(M=1, N=N, K=K, dtype="fp16", has_bias=False, glu=None, eps=1e-6,
                                       device="gpu:0", e4m3=e4m3, per_channel=e4m3)
    rnl.op.paths["gemv"].bind(problem, (_contiguous((1, K), np.float16), g, w, None, s if e4m3 else None))
    assert binds[-1][0] == "gemv.cu" and binds[-1][1]["programmatic"] is (strided is None)


# the kernels launched programmatically (runtime/launch.py's programmatic_supported on sm_90 and newer), by
# file: each may start before the kernel ahead of it finishes, so each must wait (pdl_wait) before it reads
# that kernel's output or writes what it may still read
PROGRAMMATIC = {"rms_norm.cu": "rms", "swiglu.cu": "swiglu", "rope.cu": "rope1", "kv_append.cu": "kv_append1",
                "linear_fp8.cu": "fp8_gemv3", "gemv.cu": "gemv"}


@pytest.mark.parametrize("file, prefix", PROGRAMMATIC.items())
def test_every_kernel_launched_programmatically_waits_before_its_work(file, prefix):
    """Each exported kernel of those files calls pdl_wait before its device function; the GEMVs wait
    before they quantise or stage x (their weight loads, of what no kernel writes, come first)."""
    import re
    from pathlib import Path

    import libnn

    source = (Path(libnn.__file__).parent.parent / "kernels" / file).read_text()
    kernels = [chunk[:chunk.index("}")] for chunk in source.split('extern "C" __global__')[1:]]
    launched = [k for k in kernels if re.search(r"\b" + prefix, k)]  # a kernel's text up to its body's end
    assert launched, f"no exported {prefix}* kernel found in kernels/{file}"
    for kernel in launched:
        name = " ".join(kernel.split()[:4])  # for the message: the macro's signature line
        if "gemv3<" in kernel or "gemvk::gemv<" in kernel:  # the GEMVs wait inside, checked below
            continue
        work = re.search(r"\b\w+k::\w+<", kernel)  # the call of the kernel's device function (rmsk::, ropek::...)
        assert "pdl_wait();" in kernel, f"kernels/{file}: {name} is launched programmatically but never waits"
        assert work and kernel.index("pdl_wait();") < work.start(), f"kernels/{file}: {name} works before pdl_wait"
    if file == "linear_fp8.cu":
        assert re.search(r"pdl_wait\(\);[^\n]*\n\s*const float sx = quantize_x", source)
    if file == "gemv.cu":
        assert re.search(r"pdl_wait\(\);[^\n]*\n\s*const float sx = E4M3 \? stage_x_e4m3<DT>\([^;]*: stage_x<", source)


@pytest.mark.parametrize("capability, expected", [((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)])
def test_programmatic_launches_from_sm_90(monkeypatch, capability, expected):
    monkeypatch.setattr(launch, "compute_capability", lambda device_id: capability)
    assert launch.programmatic_supported("gpu:0") is expected
