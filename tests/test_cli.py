"""The `libnn` command, run as a user runs it (a subprocess), on whatever machine the tests run on."""

import json
import subprocess
import sys

import pytest
from conftest import compile_kernel_files

from libnn.runtime.device import gpu_missing


def libnn(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "libnn", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_help_lists_every_subcommand():
    out = libnn("--help").stdout
    for command in ["info", "paths", "demo", "bench", "plans", "check-kernels", "run", "generate"]:
        assert command in out


def test_info_reports_the_gpu_or_why_there_is_none():
    out = libnn("info").stdout
    assert "python" in out and "cuBLASLt" in out
    data = json.loads(libnn("info", "--json").stdout)
    assert (data["gpus"] == []) == (data["gpu_missing"] is not None)


def test_paths_lists_linear_paths():
    out = libnn("paths", "linear").stdout
    for path in ["cublaslt", "custom", "reference"]:
        assert path in out


def test_demo_says_where_it_ran_and_is_accurate():
    out = libnn("demo", "--batch", "4").stdout
    if gpu_missing():
        assert "running the reference path on the CPU" in out and "path 'reference'" in out
    else:
        assert "running on the GPU" in out
    error = float(out.split("reference: ")[1].split()[0])
    assert error < 1e-2


@pytest.mark.skipif(not gpu_missing(), reason="checks the message on machines without a GPU")
@pytest.mark.parametrize("args", [["bench", "linear"], ["plans", "linear", "--m", "8", "--n", "8", "--k", "8"]])
def test_gpu_commands_explain_that_they_need_a_gpu(args):
    result = libnn(*args, check=False)
    assert result.returncode == 2 and "needs a GPU" in result.stderr


def test_check_kernels_reports_resources():
    pytest.importorskip("cuda.bindings.nvrtc")
    compile_kernel_files("sm_90")
    rows = json.loads(libnn("check-kernels", "--arch", "sm_90", "--json").stdout)
    assert rows and {"kernel", "registers", "spill_bytes"} <= set(rows[0])


def test_plans_attention_names_the_missing_arguments():
    result = subprocess.run([sys.executable, "-m", "libnn", "plans", "attention", "--b", "1"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "missing --h --s --d" in result.stderr


def test_every_bench_module_resolves_its_module_level_names():
    """A bench runs only on a GPU, so a name its module lost (bench models' cold-start script was
    deleted once) would show only there: pyflakes-style, every global a bench function reads exists."""
    import ast
    import builtins
    import importlib
    import pkgutil

    import libnn.bench

    for info in pkgutil.iter_modules(libnn.bench.__path__):
        module = importlib.import_module(f"libnn.bench.{info.name}")
        tree = ast.parse(open(module.__file__).read())
        local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
                  for a in n.args + n.kwonlyargs + n.posonlyargs + [x for x in (n.vararg, n.kwarg) if x]}
        local |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        local |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                  for a in n.names}
        local |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name}
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        missing = sorted(name for name in read - local if not hasattr(builtins, name) and not hasattr(module, name))
        assert not missing, f"libnn/bench/{info.name}.py reads names it never defines: {missing}"
