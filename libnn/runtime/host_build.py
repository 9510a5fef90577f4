"""Shared libraries built by nvcc from `kernels/nvcc/*.cu`, cached on disk and loaded with ctypes.

Most kernel files are device code alone, compiled by NVRTC (`runtime.kernels`) and launched from
Python. A few kernels are instantiated from NVIDIA's C++ template libraries (CUTLASS), whose kernel
parameters (TMA descriptors among them) only their C++ host-side adapters can build: those files are
compiled by nvcc, host and device code together, into a shared library with a small `extern "C"`
entry point, and called through ctypes. This needs nvcc and a host C++ compiler at run time; without
them `nvcc_missing()` says so and the paths that need a library stay unavailable.

The library goes to the disk cache keyed by the file's contents, libnn's headers, the defines, the
target architecture, nvcc's version and `headers_version` (the version of the external headers,
which are too many to hash on every start).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from libnn.errors import KernelCompileError
from libnn.runtime.cache import PlanCache, cache_dir, entry_lock, register_stats
from libnn.runtime.kernels import header_contents, kernel_dir

# nvcc's options for every library: C++17, host code position-independent, assertions off, and the CUDA
# runtime linked statically (nvcc's default), so the library needs no libcudart of a given version.
NVCC_OPTIONS = ("-std=c++17", "-O3", "-shared", "-Xcompiler=-fPIC", "--expt-relaxed-constexpr", "-DNDEBUG")
SHOWN_ERROR_LINES = 10
# a CUTLASS instantiation takes about a minute on one core; a compile that runs past this is stuck
COMPILE_TIMEOUT_S = 900


def nvcc_dir() -> Path:
    """kernels/nvcc/, beside the NVRTC kernel files."""
    return kernel_dir() / "nvcc"


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str | None:
    """nvcc from $CUDA_HOME (or $CUDA_PATH), the PATH, or /usr/local/cuda, or None."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (candidate := Path(home) / "bin" / "nvcc").is_file():
            return str(candidate)
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    """nvcc's own version line, e.g. 'Cuda compilation tools, release 13.0, V13.0.88' ('' without nvcc)."""
    nvcc = nvcc_path()
    if nvcc is None:
        return ""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    return next((line for line in out.splitlines() if "release" in line), out.strip())


@functools.lru_cache(maxsize=None)
def nvcc_missing() -> str | None:
    """None if nvcc and its host compiler are here, else what is missing."""
    if nvcc_path() is None:
        return "nvcc is not installed (set CUDA_HOME, or put a CUDA toolkit's nvcc on the PATH)"
    if shutil.which(os.environ.get("NVCC_CCBIN", "c++")) is None and shutil.which("g++") is None:
        return "no host C++ compiler for nvcc (c++ or g++ on the PATH)"
    if not nvcc_version():
        return f"{nvcc_path()} --version gave no version"
    return None


# cache_info()["library builds"]: hits are libraries found in the disk cache, builds are nvcc runs.
_builds = register_stats("library builds")
_builds_lock = threading.Lock()
_libraries: PlanCache = PlanCache("shared libraries")


def library_file(name: str, arch: str, defines: dict[str, str], include_dirs: tuple[Path, ...],
                 headers_version: str) -> Path:
    """kernels/nvcc/<name> built for `arch` ('sm_90a') with `defines`, from the disk cache when an
    identical build was done before. KernelCompileError with nvcc's first errors if it fails."""
    source_path = nvcc_dir() / name
    source = source_path.read_bytes()
    options = _options(arch, defines, include_dirs)
    key = hashlib.sha256(b"\0".join([source, header_contents(kernel_dir()), *(o.encode() for o in options),
                                     headers_version.encode(), nvcc_version().encode()])).hexdigest()[:32]
    stored = cache_dir() / "libraries" / f"{source_path.stem}-{arch}-{key}.so"
    if stored.exists():
        _count_hit()
        return stored
    # one process builds an entry while the others (pytest-xdist workers) wait for it, then read it
    with entry_lock(stored.with_suffix(".lock")):
        if stored.exists():
            _count_hit()
            return stored
        start = time.perf_counter()
        _build(source_path, options, stored)
        with _builds_lock:
            _builds.builds += 1
            _builds.build_seconds += time.perf_counter() - start
    return stored


def _count_hit() -> None:
    with _builds_lock:
        _builds.hits += 1


def _options(arch: str, defines: dict[str, str], include_dirs: tuple[Path, ...]) -> list[str]:
    return [*NVCC_OPTIONS, f"-arch={arch}", *(f"-D{k}={v}" for k, v in sorted(defines.items())),
            *(f"-I{d}" for d in (*include_dirs, kernel_dir()))]


def _build(source_path: Path, options: list[str], stored: Path) -> None:
    stored.parent.mkdir(parents=True, exist_ok=True)
    # nvcc writes the library under a temporary name in the cache's directory, renamed whole when done
    handle, partial = tempfile.mkstemp(suffix=".so", dir=stored.parent)
    os.close(handle)
    try:
        done = subprocess.run([nvcc_path(), *options, str(source_path), "-o", partial], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            log = (done.stderr + done.stdout).splitlines()
            errors = [line for line in log if " error" in line or "fatal" in line] or log
            raise KernelCompileError(f"nvcc could not build kernels/nvcc/{source_path.name} "
                                     f"({' '.join(o for o in options if o.startswith(('-D', '-arch')))}): "
                                     + "\n".join(errors[:SHOWN_ERROR_LINES]))
        os.replace(partial, stored)
    except subprocess.TimeoutExpired as exc:
        raise KernelCompileError(f"nvcc did not finish kernels/nvcc/{source_path.name} in {COMPILE_TIMEOUT_S} s") \
            from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def load(name: str, arch: str, defines: dict[str, str], include_dirs: tuple[Path, ...],
         headers_version: str) -> ctypes.CDLL:
    """The loaded library of kernels/nvcc/<name> for these options (built or read from the disk cache
    on first use, then kept for the process)."""
    key = (name, arch, tuple(sorted(defines.items())), include_dirs, headers_version)
    return _libraries.get(key, lambda: ctypes.CDLL(str(library_file(name, arch, defines, include_dirs,
                                                                    headers_version))))
