"""Bad input to linear gets a clear error naming the argument, what was expected and what came."""

import re

import numpy as np
import pytest

import libnn
from libnn.ops.linear import linear
from libnn.runtime.device import gpu_missing
from conftest import random_normal


@pytest.fixture
def xw(rng):
    return random_normal(rng, (4, 8), "fp32"), random_normal(rng, (3, 8), "fp32")


def test_feature_mismatch_names_both_sizes(xw, rng):
    x, _ = xw
    with pytest.raises(ValueError, match=r"x has 8 features .* w has 7"):
        linear(x, random_normal(rng, (3, 7), "fp32"))


def test_weight_must_be_2d(xw):
    x, w = xw
    with pytest.raises(ValueError, match=r"w must be 2-D .* got shape \(3, 8, 1\)"):
        linear(x, w[..., None])


def test_bias_shape_must_match_out_features(xw, rng):
    x, w = xw
    with pytest.raises(ValueError, match=r"b must have shape \(3,\) .* got \(4,\)"):
        linear(x, w, random_normal(rng, (4,), "fp32"))


@pytest.mark.parametrize("arg", ["w", "b", "residual"])
def test_dtype_mismatch_names_the_argument(xw, rng, arg):
    x, w = xw
    b, r = random_normal(rng, (3,), "fp32"), random_normal(rng, (4, 3), "fp32")
    if arg == "w":
        w = w.astype(np.float16)
    elif arg == "b":
        b = b.astype(np.float64)
    else:
        r = r.astype(np.float16)
    with pytest.raises(TypeError, match=rf"linear: {arg} has dtype .* but x has fp32"):
        linear(x, w, b, residual=r)


@pytest.mark.parametrize("shape", [(3, 4), (4,), (3,), (1, 4, 3), (4, 1)], ids=str)
def test_residual_of_the_wrong_shape_names_expected_and_got(xw, rng, shape):
    x, w = xw
    with pytest.raises(ValueError, match=rf"linear: residual must have the output's shape \(4, 3\) .* "
                                         rf"got {re.escape(str(shape))}"):
        linear(x, w, residual=random_normal(rng, shape, "fp32"))


def test_residual_shape_follows_leading_dimensions(rng):
    x, w = random_normal(rng, (2, 5, 8), "fp32"), random_normal(rng, (3, 8), "fp32")
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(2, 5, 3\) .* got \(10, 3\)"):
        linear(x, w, residual=random_normal(rng, (10, 3), "fp32"))


def test_non_array_residual_is_rejected(xw):
    with pytest.raises(TypeError, match="linear: residual must be an array .* got builtins.list"):
        linear(*xw, residual=[[0.0] * 3] * 4)


def test_a_bad_residual_is_refused_on_every_call_not_only_the_first(xw, rng):
    """The bound call's key holds the residual's signature: a good call first must not let a bad one through."""
    x, w = xw
    linear(x, w, residual=random_normal(rng, (4, 3), "fp32"))
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        linear(x, w, residual=random_normal(rng, (4, 1), "fp32"))
    with pytest.raises(TypeError, match="residual has dtype fp16"):
        linear(x, w, residual=random_normal(rng, (4, 3), "fp16"))


def test_integer_input_is_rejected(rng):
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        linear(np.ones((2, 3), np.int32), np.ones((4, 3), np.int32))


def test_unknown_activation(xw):
    with pytest.raises(ValueError, match="activation must be one of"):
        linear(*xw, activation="swish")


def test_unknown_path_lists_the_known_ones(xw):
    with pytest.raises(ValueError, match=r"unknown path 'triton'.*'cublaslt', 'custom', 'cutlass', 'cudnn', 'reference'"):
        linear(*xw, path="triton")


@pytest.mark.parametrize("path", ["cublaslt", "cudnn", "custom"])
def test_host_arrays_to_a_gpu_path_say_how_to_move_them(xw, path):
    with pytest.raises(TypeError, match=rf"path '{path}' runs on the GPU, but the arrays are host .*cupy.asarray"):
        linear(*xw, path=path)


def test_non_array_input_is_rejected(xw):
    with pytest.raises(TypeError, match="x must be an array .* got builtins.list"):
        linear([[1.0] * 8], xw[1])


def test_paths_report_availability_and_reasons():
    rows = {r["path"]: r for r in libnn.paths("linear")}
    assert list(rows) == ["gemv", "cutlass", "cublaslt", "cudnn", "custom", "reference"]
    assert rows["reference"]["available"] == "yes"
    if gpu_missing():
        assert rows["cublaslt"]["available"] == "no" and rows["cublaslt"]["reason"]


# --- auto's order: cutlass first for gelu_erf on Hopper, cublaslt first for the rest (no GPU needed) -----------
@pytest.fixture
def every_library_present(monkeypatch):
    """Resolution as on an H100 machine with every library installed (and nvcc): the paths' availability
    checks answer "present", so only supports() and slower() decide."""
    from libnn.backends import cutlass
    from libnn.runtime import device, memory

    monkeypatch.setattr(device, "gpu_missing", lambda: None)
    monkeypatch.setattr(device, "module_missing", lambda name: None)
    monkeypatch.setattr(cutlass, "missing", lambda device_id: None)
    monkeypatch.setattr(device, "multiprocessors", lambda device_id: 132)  # an H100 SXM
    monkeypatch.setattr(memory, "gpu_available_bytes", lambda: 80 * 2**30)  # a bind checks the output fits


GEMV_M4096 = "M=4096: the GEMV kernel takes one row (a batch-1 decode step); from 2 rows cuBLASLt is faster"


def gpu_problem(activation, dtype="fp16", M=4096, N=3072, K=768, bias=True, residual=False):
    from libnn.ops.linear import LinearProblem

    return LinearProblem(M=M, N=N, K=K, dtype=dtype, has_bias=bias, activation=activation, allow_tf32=False,
                         device="gpu:0", has_residual=residual)


def resolved(problem):
    candidates, passed_over = libnn.get_op("linear").resolve(problem, "auto")
    return [p.name for p in candidates], passed_over


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("residual", [False, True])
def test_auto_puts_cutlass_first_for_gelu_erf(every_library_present, dtype, residual):
    """CUTLASS's GEMM with the erf GELU in its epilogue beats cuBLASLt's GEMM + the exact-GELU pass, which
    beats cudnn's fused graph, at BERT's FFN shapes on the H100: the declared order stands."""
    names, passed_over = resolved(gpu_problem("gelu_erf", dtype, residual=residual))
    assert names == ["cutlass", "cublaslt", "cudnn", "custom"]
    assert passed_over == {"reference": "runs on the CPU, the arrays are on the GPU", "gemv": GEMV_M4096}


@pytest.mark.parametrize("M, N, tiles", [(128, 3072, "16 output tiles of 128x192"), (2048, 1536, "128 output tiles of 128x192"),
                                         (2112, 1536, "108 output tiles of 128x256"),
                                         (8191, 256, "128 output tiles of 128x192")], ids=str)
def test_gelu_erf_whose_tiles_do_not_fill_the_gpu_tries_cutlass_last(every_library_present, M, N, tiles):
    """An encoder at batch 1 (FFN rows up to 128): cuBLASLt's GEMM + pass first, cutlass after custom."""
    names, passed_over = resolved(gpu_problem("gelu_erf", M=M, N=N))
    assert names == ["cublaslt", "cudnn", "custom", "cutlass"]
    assert passed_over["cutlass"] == f"tried last: {tiles} fill less than the GPU's 132 SMs"


@pytest.mark.parametrize("M, N", [(4096, 3072), (32768, 1536), (8448, 1024)], ids=str)
def test_gelu_erf_whose_tiles_fill_the_gpu_runs_on_cutlass(every_library_present, M, N):
    assert resolved(gpu_problem("gelu_erf", M=M, N=N))[0][0] == "cutlass"


@pytest.mark.parametrize("M, N, tile", [
    (4096, 1536, "128x192"),   # MiniLM's FFN at batch 32: 192 tiles of 128x256 are 1.45 waves, 256 of 128x192 two full
    (2112, 1536, "128x256"),   # 108 tiles of 128x256 are one wave; 136 of 128x192 would spill into a second
    (16493, 1536, "128x256"),  # 6 waves of 128x256 against 8 of 128x192: the same area, so the default
    (4096, 3072, "128x256"),   # 3 waves against 4: a tie
    (64, 1024, "128x192"),     # one wave either way: the smaller tile's wave is shorter
], ids=str)
def test_the_cutlass_tile_is_the_one_with_the_least_wave_area(M, N, tile):
    from libnn.backends import cutlass

    assert str(cutlass.tile_for(M, N, 132)) == tile


def test_gelu_erf_without_nvcc_keeps_cublaslt_first(every_library_present, monkeypatch):
    from libnn.backends import cutlass

    monkeypatch.setattr(cutlass, "missing", lambda device_id: "nvcc is not installed (simulated)")
    names, passed_over = resolved(gpu_problem("gelu_erf"))
    assert names == ["cublaslt", "cudnn", "custom"]
    assert passed_over["cutlass"] == "nvcc is not installed (simulated)"


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_auto_keeps_cublaslt_first_where_its_epilogue_computes_the_activation(every_library_present, activation):
    names, passed_over = resolved(gpu_problem(activation))
    assert names == ["cublaslt", "cudnn", "custom"]
    assert passed_over == {"reference": "runs on the CPU, the arrays are on the GPU", "gemv": GEMV_M4096,
                           "cutlass": "only the gelu_erf epilogue (cuBLASLt fuses every other activation)"}


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_auto_puts_gemv_first_at_one_row(every_library_present, activation, dtype):
    """A batch-1 decode step's GEMM: kernels/gemv.cu first, every activation in its epilogue."""
    names, _ = resolved(gpu_problem(activation, dtype, M=1, N=3072, K=2048, residual=True))
    assert names[0] == "gemv" and "cublaslt" in names


@pytest.mark.parametrize("M, K, dtype, why", [
    (2, 2048, "fp16", "M=2: the GEMV kernel takes one row (a batch-1 decode step); from 2 rows cuBLASLt is faster"),
    (1, 2050, "fp16", "K=2050: the GEMV kernel takes K a multiple of 8 from 8 to 24576"),
    (1, 24584, "bf16", "K=24584: the GEMV kernel takes K a multiple of 8 from 8 to 24576"),
    (1, 2048, "fp32", "dtype fp32 is not supported (supported: fp16, bf16)"),
    (0, 2048, "fp16", "M=0: the GEMV kernel takes one row (a batch-1 decode step)"),
], ids=["two-rows", "odd-K", "long-K", "fp32", "no-rows"])
def test_gemv_passes_over_what_it_cannot_take(every_library_present, M, K, dtype, why):
    names, passed_over = resolved(gpu_problem(None, dtype, M=M, K=K))
    assert "gemv" not in names and passed_over["gemv"] == why


@pytest.mark.parametrize("problem, why", [
    (gpu_problem("gelu_erf", "fp32"), "dtype fp32 is not supported (supported: fp16, bf16"),
    (gpu_problem("gelu_erf", N=1001), "N and K must be multiples of 8 (16-byte rows of fp16), got N=1001 K=768"),
    (gpu_problem("gelu_erf", K=1003), "N and K must be multiples of 8 (16-byte rows of fp16), got N=3072 K=1003"),
], ids=["fp32", "odd-N", "odd-K"])
def test_gelu_erf_that_cudnn_cannot_take_keeps_cublaslt_first(every_library_present, problem, why):
    """No deferral when cudnn refuses the problem: cuBLASLt's GEMM + pass, then custom, as before."""
    names, passed_over = resolved(problem)
    assert names == ["cublaslt", "custom"]
    assert passed_over["cudnn"].startswith(why)
    assert "cutlass" in passed_over and "cublaslt" not in passed_over


def test_gelu_erf_without_cudnn_installed_keeps_cutlass_and_cublaslt_first(monkeypatch):
    from libnn.backends import cutlass
    from libnn.runtime import device

    monkeypatch.setattr(device, "gpu_missing", lambda: None)
    monkeypatch.setattr(device, "module_missing", lambda name: "cudnn does not import (simulated)" if name == "cudnn"
                        else None)
    monkeypatch.setattr(cutlass, "missing", lambda device_id: None)
    monkeypatch.setattr(device, "multiprocessors", lambda device_id: 132)
    names, passed_over = resolved(gpu_problem("gelu_erf"))
    assert names == ["cutlass", "cublaslt", "custom"]
    assert passed_over["cudnn"] == "cudnn does not import (simulated)"


def test_forcing_cudnn_on_a_problem_it_refuses_names_the_reason(every_library_present):
    with pytest.raises(libnn.PathUnavailableError, match=r"path 'cudnn' cannot run linear M=4096 N=1001 K=768 fp16 "
                                                         r"\(bias\+gelu_erf\): N and K must be multiples of 8"):
        libnn.get_op("linear").resolve(gpu_problem("gelu_erf", N=1001), "cudnn")


def test_a_graph_cudnn_declines_falls_back_to_custom_visibly(every_library_present, monkeypatch):
    """Under auto, a LibraryError from a library path's bind (cuBLASLt with no algorithm, cuDNN with no
    engine for the graph) warns and binds the next path (stubbed here: no GPU), down to custom."""
    from dataclasses import replace

    op = libnn.get_op("linear")

    def decline(library):
        def bind(problem, *args):
            raise libnn.LibraryError(f"{library} cannot run linear: no engine supports this graph (simulated)")
        return bind

    monkeypatch.setitem(op.paths, "cutlass", replace(op.paths["cutlass"], run=decline("CUTLASS")))
    monkeypatch.setitem(op.paths, "cublaslt", replace(op.paths["cublaslt"], run=decline("cuBLASLt")))
    monkeypatch.setitem(op.paths, "cudnn", replace(op.paths["cudnn"], run=decline("cuDNN")))
    monkeypatch.setitem(op.paths, "custom", replace(op.paths["custom"], run=lambda problem, *args: (lambda *a: "custom")))
    with pytest.warns(libnn.FallbackWarning, match="path 'cudnn' failed.*cuDNN cannot run linear"):
        assert op.dispatch(gpu_problem("gelu_erf"), "auto", None, None, None, None) == "custom"
    assert op.last_decision.path == "custom"
    assert "cuDNN cannot run" in op.last_decision.passed_over["cudnn"]
    assert "cuBLASLt cannot run" in op.last_decision.passed_over["cublaslt"]
