"""kernels/nvcc/*.cu build with nvcc into shared libraries without a GPU (CI has nvcc and installs the
nvidia-cutlass headers), are cached, and fail with nvcc's own message; the cutlass backend says what
is missing when it cannot run."""

import ctypes
import os

import pytest

from libnn.backends import cutlass
from libnn.errors import KernelCompileError
from libnn.runtime import host_build
from libnn.runtime.cache import cache_info

if os.environ.get("CI"):  # CI installs libnn[test,cutlass] and has nvcc: a missing one is a failure there
    assert host_build.nvcc_missing() is None, host_build.nvcc_missing()
    assert cutlass.include_dirs() is not None, "CI must install the nvidia-cutlass headers (libnn[cutlass])"

needs_build = pytest.mark.skipif(host_build.nvcc_missing() is not None or cutlass.include_dirs() is None,
                                 reason=f"no nvcc or no CUTLASS headers: {host_build.nvcc_missing()}")


@needs_build
def test_cutlass_gemm_builds_once_and_exports_its_entry_point():
    def counts():
        stats = cache_info()["library builds"]
        return stats.builds, stats.hits

    builds, hits = counts()
    path = cutlass.build("fp16")
    first = counts()
    assert path.suffix == ".so" and path.stat().st_size > 0
    assert sum(first) == builds + hits + 1  # built, or found built by another process
    assert cutlass.build("fp16") == path  # the second time from the disk cache
    assert counts() == (first[0], first[1] + 1)
    library = ctypes.CDLL(str(path))  # loads without a GPU: the CUDA runtime is linked in and starts lazily
    assert library.libnn_gemm_gelu_erf


@needs_build
def test_a_failed_build_names_the_file_its_options_and_nvccs_error():
    with pytest.raises(KernelCompileError, match=r"(?s)nvcc could not build kernels/nvcc/gemm_cutlass.cu "
                                                 r"\(.*-DELEMENT=not_a_type.*\).*not_a_type"):
        defines = {"ELEMENT": "not_a_type", **cutlass.TILES[0].defines()}
        host_build.library_file("gemm_cutlass.cu", cutlass.ARCH, defines, cutlass.include_dirs(), cutlass.version())


def test_cutlass_version_is_read_from_its_headers():
    if cutlass.include_dirs() is None:
        assert cutlass.version() == ""
    else:
        major, minor, patch = (int(p) for p in cutlass.version().split("."))
        assert (major, minor) >= (4, 2)


def test_missing_nvcc_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    for cached in (host_build.nvcc_path, host_build.nvcc_version, host_build.nvcc_missing):
        cached.cache_clear()
    try:
        if os.path.isfile("/usr/local/cuda/bin/nvcc"):
            assert host_build.nvcc_path() == "/usr/local/cuda/bin/nvcc"
        else:
            assert host_build.nvcc_missing().startswith("nvcc is not installed")
    finally:
        for cached in (host_build.nvcc_path, host_build.nvcc_version, host_build.nvcc_missing):
            cached.cache_clear()


def test_missing_headers_are_reported(monkeypatch):
    monkeypatch.setattr(cutlass, "include_dirs", lambda: None)
    cutlass.missing.cache_clear()
    try:
        assert "pip install nvidia-cutlass" in cutlass.missing(0)
    finally:
        cutlass.missing.cache_clear()
