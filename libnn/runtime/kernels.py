"""The kernel loader: `kernels/*.cu` compiled at run time by NVRTC, cached, and loaded through CuPy.

NVRTC is called through cuda-bindings (NVIDIA's official bindings) rather than through CuPy's
compiler so that one function serves both the run-time loader and the GPU-less compile check that CI
runs: compiling needs no GPU, only loading does. The cubin goes to a disk cache keyed by the file's
contents, the options, the target architecture and the NVRTC version, and is loaded with
`cupy.RawModule(path=...)`.

Kernel files include no CUDA toolkit headers (fp16/bf16 are handled as raw 16-bit words with PTX
conversions), so the NVRTC of either wheel stack compiles them without a CUDA toolkit installed. They
may include libnn's own headers, `kernels/*.cuh`, which are part of every cache key.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from libnn.errors import KernelCompileError
from libnn.runtime.cache import PlanCache, cache_dir, entry_lock, register_stats, write_atomically
from libnn.runtime.device import compute_capability, current_device_id
from libnn.runtime.nvrtc import bindings, check, nvrtc_version, supported_archs

# -Xptxas=-v puts the resource report (registers, shared memory, spills) into every cached log.
# NVRTC's default dialect is C++17 already; -std=c++17 or -lineinfo silence that report on NVRTC 13.0
# for sm_90 (seen on the H100 image), so neither is passed.
VERBOSE = "-Xptxas=-v"
DEFAULT_OPTIONS = (VERBOSE,)
# A failed compile shows at most this many of its log's error lines: an arch without bf16 or cp.async
# (sm_75) makes ptxas write one line per instruction, thousands in all.
SHOWN_ERROR_LINES = 10


def kernel_dir() -> Path:
    """kernels/ of a source checkout, or the copy packaged in the wheel."""
    checkout = Path(__file__).resolve().parents[2] / "kernels"
    if checkout.is_dir():
        return checkout
    from importlib import resources
    return Path(str(resources.files("libnn._kernels")))


def kernel_files() -> list[Path]:
    return sorted(kernel_dir().glob("*.cu"))


def header_contents(directory: Path) -> bytes:
    """The contents of every libnn header a kernel file may include, for cache keys."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(directory.glob("*.cuh")))


@dataclass(frozen=True)
class CompiledFile:
    path: Path
    arch: str          # "sm_90"
    options: tuple[str, ...]
    cubin: bytes       # or PTX text, for a compute_XX target
    log: str           # NVRTC's log, with ptxas' resource report when verbose
    file: Path | None = None  # where the disk cache keeps `cubin`

    def resources(self) -> list["KernelResources"]:
        """Registers, shared memory and spills per kernel, from ptxas' report in the log. A verbose
        compile whose log lacks the report (NVRTC 13.0 answers a compile it has made before without
        one, see `fresh_report`) is compiled again so that it has one, and its cache entry's log is
        replaced."""
        found = parse_ptxas_report(self.log)
        if found or VERBOSE not in self.options:
            return found
        if self.file is None:
            return parse_ptxas_report(fresh_report(self.path, self.arch, self.options))
        log = self.file.with_suffix(".log")
        with entry_lock(self.file.with_suffix(".lock")):
            # a process that held the lock before this one may have put the report in already
            if found := parse_ptxas_report(log.read_text()):
                return found
            report = fresh_report(self.path, self.arch, self.options)
            write_atomically(log, report.encode())
        return parse_ptxas_report(report)


REPORT_PROBE = "libnn_report_probe_"  # the name prefix of fresh_report's empty kernel


def fresh_report(path: Path, arch: str, options: tuple[str, ...]) -> str:
    """The log of a compile of `path` that no cache can answer. NVRTC 13.0 (the H100 image) gives a
    program it has compiled before, in this process or in another, back with an empty log: on the
    H100 the second compile of a file had no ptxas report, in a new process too. An empty kernel with
    a unique name appended to the source makes the program new; parse_ptxas_report leaves it out."""
    import uuid

    probe = f'\nextern "C" __global__ void {REPORT_PROBE}{uuid.uuid4().hex}() {{}}\n'
    return _compile_uncached(path, path.read_bytes() + probe.encode(), arch, options).log


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    arch: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> list[KernelResources]:
    """Registers, static shared memory, stack and spills per kernel from `-Xptxas=-v` output."""
    found, kernel, arch, frame = [], None, None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            kernel, arch, frame = m.group(1), m.group(2), (0, 0, 0)
        elif (m := _FRAME.search(line)) and kernel:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and kernel:
            found.append(KernelResources(kernel, arch, int(m.group(1)), int(m.group(2) or 0), *frame))
            kernel = None
    return [r for r in found if not r.kernel.startswith(REPORT_PROBE)]


_SOURCE_ERROR = re.compile(r"^(.*?\.cuh?)\((\d+)\): (?:catastrophic )?error: (.*)$", re.M)
_PTXAS_ERROR = re.compile(r"^ptxas application ptx input, line (\d+); error\s*: (.*)$", re.M)
_ERROR_LINE = re.compile(r"\berror\b|\bfatal\b")


def _first_error_location(log: str) -> str | None:
    """file:line: message of the first error NVRTC or ptxas reports, or None if the log has none."""
    if m := _SOURCE_ERROR.search(log):
        return f"{m.group(1)}:{m.group(2)}: {m.group(3)}"
    if m := _PTXAS_ERROR.search(log):
        return f"line {m.group(1)} of the generated PTX: {m.group(2)}"
    return None


def _failure_message(path: Path, arch: str, log: str) -> str:
    """The first error's location and the log's first error lines (all of them can run to thousands)."""
    lines = log.splitlines()
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    where = _first_error_location(log)
    head = f"compiling kernels/{path.name} for {arch} failed " + (
        f"at {where}" if where else "(no error location found in the log; first lines below)")
    listed, kind = (errors, "error lines") if errors else (lines, "lines")
    shown = listed[:SHOWN_ERROR_LINES]
    more = (f"\n... and {len(listed) - len(shown)} more {kind} ({len(lines)} lines in the whole log)"
            if len(listed) > len(shown) else "")
    return "\n".join([head, *shown]) + more


def _compile_uncached(path: Path, source: bytes, arch: str, options: tuple[str, ...]) -> CompiledFile:
    nvrtc = bindings()
    err, program = nvrtc.nvrtcCreateProgram(source, f"kernels/{path.name}".encode(), 0, [], [])
    check(err, "program creation")
    try:
        opts = [f"-arch={arch}".encode(), f"-I{path.parent}".encode(), *(o.encode() for o in options)]
        (compile_err,) = nvrtc.nvrtcCompileProgram(program, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(program)
        # NVRTC writes into the buffer it is given: it must be a fresh bytearray. A bytes object such
        # as b" " * size is immutable and, at size 1 (an empty log), CPython's shared one-byte b" ":
        # writing into it corrupted every b" " of the process (torch and numpy then failed to parse).
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(program, log)
        log_text = bytes(log).rstrip(b"\0 ").decode(errors="replace")
        if compile_err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(_failure_message(path, arch, log_text))
        get_size, get = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if arch.startswith("sm_") else \
                        (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        err, size = get_size(program)
        check(err, "output size query")
        binary = bytearray(size)
        (err,) = get(program, binary)
        check(err, "output fetch")
        return CompiledFile(path, arch, options, bytes(binary), log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


# cache_info()["kernel compiles"]: hits are compiles found in the disk cache, builds are NVRTC runs.
_compiles = register_stats("kernel compiles")
_compiles_lock = threading.Lock()


def compile_file(path: Path | str, arch: str, options: tuple[str, ...] = DEFAULT_OPTIONS,
                 use_disk_cache: bool = True, refresh: bool = False) -> CompiledFile:
    """Compile one kernel file for `arch` ('sm_90', or 'compute_90' for PTX), from the disk cache when
    an identical compile was done before (`refresh=True` compiles anyway and replaces the entry)."""
    path = Path(path) if Path(path).is_absolute() else kernel_dir() / path
    source = path.read_bytes()
    key = hashlib.sha256(b"\0".join([source, header_contents(path.parent), arch.encode(), *(o.encode() for o in options),
                                     nvrtc_version().encode()])).hexdigest()[:32]
    stored = cache_dir() / "kernels" / f"{path.stem}-{arch}-{key}"
    if not use_disk_cache:
        return _timed_compile(path, source, arch, options)
    if not refresh and (found := _cached(path, arch, options, stored)):
        return found
    # One process (or thread) compiles an entry while the others wait and then read it: the test suite's
    # pytest-xdist workers share one cache and ask for the same files at once, and NVRTC takes tens of
    # seconds for some of them.
    with entry_lock(stored.with_suffix(".lock")):
        if not refresh and (found := _cached(path, arch, options, stored)):
            return found
        compiled = _timed_compile(path, source, arch, options)
        binary = stored.with_suffix(".bin")
        # the log first: an entry is read only when both files are there, and each appears whole
        write_atomically(stored.with_suffix(".log"), compiled.log.encode())
        write_atomically(binary, compiled.cubin)
    return CompiledFile(path, arch, options, compiled.cubin, compiled.log, binary)


def _cached(path: Path, arch: str, options: tuple[str, ...], stored: Path) -> CompiledFile | None:
    """The disk cache's entry `stored` (its .bin and .log), or None if it has none yet."""
    binary, log = stored.with_suffix(".bin"), stored.with_suffix(".log")
    if not (binary.exists() and log.exists()):
        return None
    with _compiles_lock:
        _compiles.hits += 1
    return CompiledFile(path, arch, options, binary.read_bytes(), log.read_text(), binary)


def _timed_compile(path: Path, source: bytes, arch: str, options: tuple[str, ...]) -> CompiledFile:
    start = time.perf_counter()
    compiled = _compile_uncached(path, source, arch, options)
    with _compiles_lock:
        _compiles.builds += 1
        _compiles.build_seconds += time.perf_counter() - start
    return compiled


def target_arch(device_id: int) -> str:
    """sm_XY for the device, or PTX for the newest arch NVRTC knows when the device is newer still
    (the driver then compiles the PTX for the device at load)."""
    major, minor = compute_capability(device_id)
    cc = major * 10 + minor
    archs = supported_archs()
    return f"sm_{cc}" if cc in archs else f"compute_{max(a for a in archs if a <= cc)}"


_modules: PlanCache = PlanCache("kernel modules")
_functions: PlanCache = PlanCache("kernel functions")


def load(name: str, options: tuple[str, ...] = DEFAULT_OPTIONS):
    """The cupy.RawModule of kernels/<name> for the current device. Within a process a file is
    compiled (or fetched from the disk cache, keyed by its contents) once per device and options."""
    import cupy

    device_id = current_device_id()

    def build():
        compiled = compile_file(kernel_dir() / name, target_arch(device_id), options)
        return cupy.RawModule(path=str(compiled.file))  # the driver tells cubin from PTX itself

    return _modules.get((name, options, device_id), build)


def function(file: str, kernel: str, dynamic_smem: int = 0):
    """A kernel of kernels/<file> for the current device, allowed `dynamic_smem` bytes of dynamic
    shared memory (above 48 KB a kernel must opt in)."""
    def build():
        f = load(file).get_function(kernel)
        if dynamic_smem > 48 * 1024:
            f.max_dynamic_shared_size_bytes = dynamic_smem
        return f

    return _functions.get((file, kernel, dynamic_smem, current_device_id()), build)


def loaded_functions() -> list[tuple[str, str]]:
    """(file of kernels/, kernel name) of every kernel `function` has loaded in this process and still
    holds, on any device, once each: what the sanitize driver reports it has covered."""
    return list(dict.fromkeys((file, kernel) for file, kernel, *_ in _functions.keys()))


def compile_report(archs: list[str], progress: Callable[[str], None] | None = None) -> list[dict]:
    """Compile every kernel file for each arch (no GPU needed) and list each kernel's resources.
    `progress` is told each file before it compiles: a cold compile of them all takes a minute or more."""
    rows = []
    files = kernel_files()
    for i, path in enumerate(files, 1):
        if progress:
            progress(f"[{i}/{len(files)}] {path.name} for {' '.join(archs)}")
        for arch in archs:
            compiled = compile_file(path, arch)
            for r in compiled.resources():
                rows.append({"file": path.name, "arch": arch, "kernel": r.kernel, "registers": r.registers,
                             "smem_bytes": r.shared_bytes, "stack_bytes": r.stack_bytes,
                             "spill_bytes": r.spill_store_bytes + r.spill_load_bytes})
    return rows
