"""Is there a GPU, which one, and which NVIDIA libraries are loaded.

Everything here degrades to "not available" with a reason instead of raising, because `libnn info`
must work on a machine with no GPU and no CUDA wheels at all.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import platform
import sys
from dataclasses import asdict, dataclass, field

from libnn.runtime.nvrtc import nvrtc_version


@functools.lru_cache(maxsize=None)
def module_missing(name: str) -> str | None:
    """None if `name` imports, else why not (cached: imports are slow and results do not change)."""
    try:
        importlib.import_module(name)
        return None
    except Exception as exc:  # an installed package can fail to import for many reasons
        return f"{name} does not import ({type(exc).__name__}: {exc})"


DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


@functools.lru_cache(maxsize=None)
def driver_missing() -> str | None:
    """None if the NVIDIA driver's library loads, else a sentence saying there is no driver. Without a
    driver the CUDA runtime answers cudaErrorInsufficientDriver, "CUDA driver version is insufficient
    for CUDA runtime version", which sends users to update a driver they do not have."""
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return f"no NVIDIA driver is installed ({DRIVER_LIBRARY} does not load)"
    return None


@functools.lru_cache(maxsize=None)
def gpu_missing() -> str | None:
    """None if CuPy sees a CUDA device, else the reason it does not."""
    missing = module_missing("cupy")
    if missing:
        return f"no GPU stack: {missing}; install libnn[cu12] or libnn[cu13]"
    import cupy

    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        if no_driver := driver_missing() or _driver_version_zero(runtime):
            return no_driver
        return f"no CUDA device ({exc})"
    return None if count > 0 else "no CUDA device (device count is 0)"


def _driver_version_zero(runtime) -> str | None:
    """cudaDriverGetVersion reports 0 where a driver library loads but no driver runs behind it (a
    toolkit's stub libcuda)."""
    try:
        version = runtime.driverGetVersion()
    except runtime.CUDARuntimeError:
        return None
    return "no NVIDIA driver is running (the CUDA driver reports version 0)" if version == 0 else None


def has_gpu() -> bool:
    return gpu_missing() is None


@dataclass
class GpuInfo:
    index: int
    name: str
    compute_capability: str
    sm_count: int
    memory_gib: float
    l2_mib: float


@dataclass
class Info:
    python: str
    platform: str
    gpu_missing: str | None
    gpus: list[GpuInfo] = field(default_factory=list)
    libraries: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        rows = [("python", self.python), ("platform", self.platform)]
        if self.gpus:
            for g in self.gpus:
                rows.append((f"gpu {g.index}", f"{g.name}, sm_{g.compute_capability.replace('.', '')}, "
                             f"{g.sm_count} SMs, {g.memory_gib:.1f} GiB, L2 {g.l2_mib:.0f} MiB"))
        else:
            rows.append(("gpu", f"none: {self.gpu_missing}"))
        rows += list(self.libraries.items())
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _gpus() -> list[GpuInfo]:
    import cupy

    gpus = []
    for index in range(cupy.cuda.runtime.getDeviceCount()):
        p = cupy.cuda.runtime.getDeviceProperties(index)
        gpus.append(GpuInfo(index=index, name=p["name"].decode(), compute_capability=f"{p['major']}.{p['minor']}",
                            sm_count=p["multiProcessorCount"], memory_gib=p["totalGlobalMem"] / 2**30,
                            l2_mib=p["l2CacheSize"] / 2**20))
    return gpus


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


def _probe(get) -> str:
    try:
        return str(get())
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"


def _library_versions() -> dict[str, str]:
    def cupy_version():
        import cupy
        return cupy.__version__

    def runtime():
        import cupy
        return f"runtime {_cuda_version(cupy.cuda.runtime.runtimeGetVersion())}, " \
               f"driver {_cuda_version(cupy.cuda.runtime.driverGetVersion())}"

    def cublaslt():
        from nvmath.bindings import cublasLt
        v = cublasLt.get_version()
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"

    def nvmath_version():
        import nvmath
        return nvmath.__version__

    def cudnn_backend():
        import cudnn
        v = cudnn.backend_version()
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"

    def cudnn_frontend():
        import cudnn
        return cudnn.__version__

    def cufft():
        from nvmath.bindings import cufft as nvmath_cufft
        v = nvmath_cufft.get_version()  # major * 1000 + minor * 10 (+ patch), like CUDA's own
        return f"{v // 1000}.{v % 1000 // 10}.{v % 10}"

    def nvrtc():
        return nvrtc_version()

    return {"numpy": _probe(lambda: importlib.import_module("numpy").__version__),
            "cupy": _probe(cupy_version), "CUDA": _probe(runtime), "nvmath-python": _probe(nvmath_version),
            "cuBLASLt": _probe(cublaslt), "cuDNN backend": _probe(cudnn_backend),
            "cuDNN frontend": _probe(cudnn_frontend), "cuFFT": _probe(cufft), "NVRTC": _probe(nvrtc)}


def info() -> Info:
    """What libnn sees on this machine: GPUs and library versions."""
    missing = gpu_missing()
    return Info(python=sys.version.split()[0], platform=platform.platform(), gpu_missing=missing,
                gpus=[] if missing else _gpus(), libraries=_library_versions())


def gpu_index(device: str) -> int:
    """N of a GPU device name "gpu:N" (a problem's or an array's `device`)."""
    return int(device.split(":")[1])


def current_device_id() -> int:
    import cupy
    return cupy.cuda.runtime.getDevice()


@functools.lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    """The SM count of device `device_id` (launch geometry sized to fill the GPU reads it)."""
    import cupy
    runtime = cupy.cuda.runtime
    return runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id)


@functools.lru_cache(maxsize=None)
def blocks_by_shared_memory(device_id: int, shared_mem: int) -> int:
    """How many blocks using `shared_mem` bytes of shared memory each an SM of device `device_id` holds at
    once, by shared memory alone (the driver also reserves some for each resident block: 1 KB from sm_80)."""
    import cupy
    runtime = cupy.cuda.runtime
    per_sm = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device_id)
    reserved = runtime.deviceGetAttribute(runtime.cudaDevAttrReservedSharedMemoryPerBlock, device_id)
    return per_sm // (shared_mem + reserved)


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> tuple[int, int]:
    import cupy
    p = cupy.cuda.runtime.getDeviceProperties(device_id)
    return p["major"], p["minor"]
