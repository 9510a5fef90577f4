"""Shared test helpers: random inputs, the relative L2 error, tolerances, and GPU fixtures.

Tests marked `gpu` skip cleanly where there is no GPU; everything else runs in CI on the CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib

import numpy as np
import pytest

from libnn import dtypes
from libnn.runtime.device import gpu_missing

BASE_SEED = pytest.StashKey[int]()
CACHE_DIR = pytest.StashKey[str]()
CACHE_DIR_KEY = "libnn_cache_dir"  # of xdist's workerinput
PRECOMPILES = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption("--random-seed", action="store_true",
                     help="draw a fresh base seed for the rng fixture instead of LIBNN_TEST_SEED (default 0); "
                          "the seed is printed in the header and by every test that uses rng")


def pytest_configure(config):
    # One fresh kernel/plan cache per run, shared by the run's xdist workers and every subprocess (they
    # inherit the environment): each kernel file is compiled once per architecture in the whole run
    # (the cache's entry locks make the others wait for it), and nothing from earlier runs is reused.
    # A worker takes the controller's directory; the controller, or a run without xdist, makes it.
    if hasattr(config, "workerinput"):
        os.environ["LIBNN_CACHE_DIR"] = config.workerinput[CACHE_DIR_KEY]
    else:
        os.environ["LIBNN_CACHE_DIR"] = config.stash[CACHE_DIR] = tempfile.mkdtemp(prefix="libnn-test-cache-")
        # taken out of the environment: the pytest runs some tests start in subprocesses must not start it again
        if os.environ.pop("LIBNN_TEST_PRECOMPILE", None) == "1" or config.getoption("numprocesses", None):
            config.stash[PRECOMPILES] = precompile_kernels()
    value = os.environ.get("LIBNN_TEST_SEED", "0")
    if config.getoption("--random-seed") or value == "random":
        config.stash[BASE_SEED] = int(np.random.SeedSequence().entropy % 2**32)
    elif value.isdigit():
        config.stash[BASE_SEED] = int(value)
    else:
        raise pytest.UsageError(f"LIBNN_TEST_SEED must be a non-negative integer or 'random', got {value!r}")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller, before a worker starts: the run's cache directory goes with it."""
    node.workerinput[CACHE_DIR_KEY] = node.config.stash[CACHE_DIR]


def pytest_unconfigure(config):
    for child in config.stash.get(PRECOMPILES, []):  # all done long before, unless the run was cut short
        child.kill()
        child.wait()
    if CACHE_DIR in config.stash:  # the controller, after every worker has finished
        shutil.rmtree(config.stash[CACHE_DIR], ignore_errors=True)


def precompile_kernels() -> list[subprocess.Popen]:
    """Under pytest-xdist (or with LIBNN_TEST_PRECOMPILE=1, for a serial run of the whole suite on a GPU
    machine): start compiling every kernels/*.cu for sm_80, sm_90 (test_kernels_compile's
    targets) and this GPU's architecture into the run's cache, one background process per file and
    architecture, before the workers start. NVRTC compiles on one core and takes tens of seconds for
    some files (gemm.cu for sm_80: about a minute on the H100 host under load); without this the first
    test to need a file compiled it while every other worker needing it waited on the cache entry's
    lock, file after file, and the compile tests compiled in turn on a single worker. A worker that
    reaches an entry before its compile has finished waits on the same lock and then reads it. Nothing
    is started without NVRTC, and a compile that fails here fails again, with its message, in the test
    that needs it."""
    import importlib.util

    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings.nvrtc") is None:
        return []
    from libnn.runtime import kernels

    device_archs = set() if gpu_missing() else {kernels.target_arch(0)}
    script = "import sys; from libnn.runtime import kernels; kernels.compile_file(sys.argv[1], sys.argv[2]).resources()"
    # the largest files first: they finish last. The GPU's own architecture, which the GPU tests wait
    # for, runs at normal priority; the others, for the compile tests alone, niced behind it.
    files = sorted(kernels.kernel_files(), key=lambda path: -path.stat().st_size)
    return [subprocess.Popen([sys.executable, "-c", script, str(path), arch], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=None if arch in device_archs else _lower_priority)
            for arch in sorted(device_archs) + sorted({"sm_80", "sm_90"} - device_archs) for path in files] \
        + _precompile_cutlass()


def _precompile_cutlass() -> list[subprocess.Popen]:
    """On a GPU the cutlass path runs on (Hopper, nvcc and CUTLASS's headers here): nvcc's builds of its
    libraries (every dtype and tile), about a minute each, started with the NVRTC compiles."""
    from libnn.backends import cutlass

    if gpu_missing() or cutlass.missing(0):
        return []
    script = ("import sys; from libnn.backends import cutlass; "
              "cutlass.build(sys.argv[1], cutlass.TILES[int(sys.argv[2])])")
    return [subprocess.Popen([sys.executable, "-c", script, dtype, str(i)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for dtype in cutlass.ELEMENTS for i in range(len(cutlass.TILES))]


def _lower_priority() -> None:
    os.nice(10)


def pytest_report_header(config):
    seed = config.stash[BASE_SEED]
    return f"libnn rng base seed {seed} (LIBNN_TEST_SEED={seed} reproduces; --random-seed draws a new one)"


def pytest_collection_modifyitems(config, items):
    reason = gpu_missing()
    if reason:
        skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def rel_error(got, expected) -> float:
    """‖got − expected‖ / ‖expected‖ in float64; NaN anywhere in `got` gives inf (never passes)."""
    got = np.asarray(got.get() if hasattr(got, "get") else got).astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(got - expected) / (denom if denom else 1.0))


def random_normal(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> np.ndarray:
    """N(0, scale²) rounded to `dtype` (a short name or dtype); never zeros."""
    return (rng.standard_normal(shape) * scale).astype(dtypes.parse(dtype))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator per test, seeded from the run's base seed and the test's node id: tests draw
    different inputs from each other, and a failure reproduces by running it again. The base seed is
    printed (pytest shows it with a failure's captured output)."""
    base = request.config.stash[BASE_SEED]
    print(f"rng: base seed {base} (LIBNN_TEST_SEED={base} reproduces), node id {request.node.nodeid!r}")
    return np.random.default_rng([base, zlib.crc32(request.node.nodeid.encode())])


def start_together(tmp_path, script: str, processes: int, env: dict | None = None) -> list[subprocess.Popen]:
    """`processes` Pythons running `script`, each started after its imports only once all are ready, so
    that they reach the cache at the same moment (`go()` in the script waits for the start); `env` as
    subprocess takes it (default: this process's)."""
    prelude = textwrap.dedent(f"""
        import os, pathlib, sys, time
        ready, start = pathlib.Path({str(tmp_path / "ready")!r}), pathlib.Path({str(tmp_path / "go")!r})
        def go():
            (ready / str(os.getpid())).touch()
            while not start.exists():
                time.sleep(0.005)
    """)
    (tmp_path / "ready").mkdir()
    children = [subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(script)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for _ in range(processes)]
    deadline = time.monotonic() + 60
    while len(list((tmp_path / "ready").iterdir())) < processes:
        assert time.monotonic() < deadline, "the child processes did not get ready in 60 s"
        assert all(c.poll() is None for c in children), [c.communicate() for c in children if c.poll() is not None]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    return children


def outputs_of(children: list[subprocess.Popen], timeout: float = 120) -> list[str]:
    """Each child's stdout, once all have exited (each allowed `timeout` seconds more); a child that
    failed fails the test with its stderr."""
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=timeout)
        assert child.returncode == 0, err
        outputs.append(out)
    return outputs


def compile_kernel_files(arch: str) -> None:
    """Put every kernels/*.cu, compiled for `arch` with its resource report, into the run's cache, one
    process per file at once: a test that then compiles them all in one process (`libnn check-kernels`,
    `kernels.compile_report`) reads them instead of compiling them in turn, which took minutes (gemm.cu
    alone takes tens of seconds, and NVRTC uses one core)."""
    from libnn.runtime import kernels

    script = "import sys; from libnn.runtime import kernels; kernels.compile_file(sys.argv[1], sys.argv[2]).resources()"
    children = [subprocess.Popen([sys.executable, "-c", script, str(path), arch], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for path in kernels.kernel_files()]
    outputs_of(children, timeout=600)  # as long as test_cli gives a command: a busy machine compiles slowly


@pytest.fixture
def poisoned_gpu_memory():
    """Every GPU allocation made during the test (ours and nvmath's, through CuPy's allocator) is
    filled with 0xFF bytes first: NaN in fp16, bf16 and fp32, so unwritten outputs show."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def poisoned(size: int):
        memory = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(memory.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return memory

    cupy.cuda.set_allocator(poisoned)
    yield
    cupy.cuda.set_allocator(pool.malloc)
