"""CUTLASS: GEMMs with epilogues that cuBLASLt does not offer, instantiated from NVIDIA's CUTLASS 3 templates.

One module per vendor library: this one finds CUTLASS's headers (inside the `nvidia-cutlass` wheel's
`cutlass_library` package), builds kernels/nvcc/*.cu with nvcc into shared libraries through
`runtime.host_build`, and binds their C entry points. Today it has one kernel, linear's GEMM with the
exact GELU in its epilogue (kernels/nvcc/gemm_cutlass.cu), for Hopper (sm_90a), built per output tile.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from libnn.errors import LibraryError
from libnn.runtime import host_build
from libnn.runtime.device import compute_capability

# CUTLASS's element type per libnn dtype
ELEMENTS = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}


@dataclass(frozen=True)
class Tile:
    """An output tile kernels/nvcc/gemm_cutlass.cu is built with (its TileShape), `m` x `n`, in clusters of
    `cluster_m` tiles along M (its ClusterShape)."""
    m: int
    n: int
    cluster_m: int

    def __str__(self) -> str:
        return f"{self.m}x{self.n}"

    def count(self, M: int, N: int) -> int:
        """The output tiles the GEMM of an (M, N) result runs as (whole clusters along M)."""
        clusters_m = -(-M // (self.m * self.cluster_m))
        return clusters_m * self.cluster_m * -(-N // self.n)

    def defines(self) -> dict[str, str]:
        return {"TILE_M": str(self.m), "TILE_N": str(self.n), "CLUSTER_M": str(self.cluster_m)}


# The tiles libnn builds, the default first (kernels/nvcc/gemm_cutlass.cu says why these two).
TILES = (Tile(128, 256, 2), Tile(128, 192, 1))
ARCH = "sm_90a"  # wgmma and TMA: the kernels are built for compute capability 9.0 exactly
ERROR_CAPACITY = 512


@functools.lru_cache(maxsize=None)
def include_dirs() -> tuple[Path, ...] | None:
    """CUTLASS's include directories (its headers and its tools/util headers), or None if not found."""
    try:
        import cutlass_library  # the nvidia-cutlass wheel ships the C++ headers inside this package
    except ImportError:
        return None
    root = Path(cutlass_library.__file__).parent / "source"
    dirs = (root / "include", root / "tools" / "util" / "include")
    return dirs if all((d / "cutlass").is_dir() for d in dirs) else None


@functools.lru_cache(maxsize=None)
def version() -> str:
    """CUTLASS's version from its headers (cutlass/version.h), e.g. '4.2.0'; '' if not found."""
    dirs = include_dirs()
    if dirs is None:
        return ""
    text = (dirs[0] / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts if m)


@functools.lru_cache(maxsize=None)
def missing(device_id: int) -> str | None:
    """None if CUTLASS kernels can be built and run on device `device_id`, else why not."""
    if include_dirs() is None:
        return "CUTLASS's headers are not installed (pip install nvidia-cutlass, or libnn's cutlass extra)"
    if reason := host_build.nvcc_missing():
        return reason
    major, minor = compute_capability(device_id)
    if (major, minor) != (9, 0):
        return f"the CUTLASS kernels are built for sm_90a (Hopper); this GPU is sm_{major}{minor}"
    return None


def _library(element: str, tile: Tile) -> tuple:
    """host_build's arguments for kernels/nvcc/gemm_cutlass.cu with CUTLASS element type `element` and
    output tile `tile`."""
    return "gemm_cutlass.cu", ARCH, {"ELEMENT": element, **tile.defines()}, include_dirs(), version()


def build(dtype: str, tile: Tile = TILES[0]) -> Path:
    """Build (or find in the disk cache) the library of `dtype` and `tile`, without loading it: no GPU
    needed. KernelCompileError with nvcc's message if the build fails."""
    return host_build.library_file(*_library(ELEMENTS[dtype], tile))


def tile_for(M: int, N: int, multiprocessors: int) -> Tile:
    """The tile whose waves of tiles over the GPU's SMs take the least time for an (M, N) result, modelled
    as the number of waves times a tile's area (a wave lasts as long as its tiles, however few); ties go
    to the default. Against the H100 timings of both builds it picks the faster at every BERT FFN
    shape measured (benchmarks/RESULTS.md, eleventh session)."""
    return min(TILES, key=lambda t: -(-t.count(M, N) // multiprocessors) * t.m * t.n)


@functools.lru_cache(maxsize=None)
def _gemm_gelu_erf(dtype: str, tile: Tile) -> Callable[..., int]:
    """The C entry point libnn_gemm_gelu_erf of kernels/nvcc/gemm_cutlass.cu for `dtype` and `tile`."""
    library = host_build.load(*_library(ELEMENTS[dtype], tile))
    entry = library.libnn_gemm_gelu_erf
    entry.restype = ctypes.c_int
    entry.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    return entry


def bind_gemm_gelu_erf(dtype: str, M: int, N: int, K: int, tile: Tile = TILES[0]
                       ) -> Callable[[Any, Any, Any, Any, Any], None]:
    """run(x, w, b, r, y): y = gelu_erf(x @ w.T + b + r) on the current stream, for C-contiguous CuPy
    arrays x (M, K), w (N, K), b (N,) or None, r (M, N) or None and y (M, N) of `dtype`, by the build
    of `tile`. Builds the library on first use. LibraryError with CUTLASS's own message if it declines
    or fails."""
    import cupy

    entry = _gemm_gelu_erf(dtype, tile)
    error = ctypes.create_string_buffer(ERROR_CAPACITY)

    def run(x, w, b, r, y):
        failed = entry(x.data.ptr, w.data.ptr, None if b is None else b.data.ptr, None if r is None else r.data.ptr,
                       y.data.ptr, M, N, K, cupy.cuda.get_current_stream().ptr, error, ERROR_CAPACITY)
        if failed:
            raise LibraryError(f"CUTLASS GEMM (M={M} N={N} K={K} {dtype}, tile {tile}, gelu_erf epilogue) failed: "
                               f"{error.value.decode(errors='replace')}")
    return run
