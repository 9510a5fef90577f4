"""Every kernel Python launches agrees with its kernel file: the kernel exists, and the arguments Python
packs have the kernel's count, order and widths; the tile, warp and shared-memory constants Python
launches with are the .cu's own. No GPU: each kernel file is compiled to PTX by NVRTC, and its
`.entry name(.param .u64 ..., .param .u32 ...)` lines give each kernel's exact parameter list.

Python reads each kernel's parameter list from its .cu (libnn/runtime/contracts.py) and packs the
arguments by name; these tests check that reading against the compiled kernels, and that every launch
site names exactly the parameters the kernel declares. A swapped int/long long, a missing argument or a
drifted tile size fails here instead of corrupting memory on the GPU.
"""

from __future__ import annotations

import ast
import importlib
import math
import os
import re
from dataclasses import replace
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from libnn import dtypes
from libnn.runtime import contracts, kernels

if os.environ.get("CI"):
    import cuda.bindings.nvrtc  # noqa: F401  (CI installs libnn[test]: a missing NVRTC is a failure there)
else:
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings) is not installed")

OPS = Path(__file__).resolve().parents[1] / "libnn" / "ops"
linear = importlib.import_module("libnn.ops.linear")
conv2d = importlib.import_module("libnn.ops.conv2d")
attention_kernels = importlib.import_module("libnn.ops.attention_kernels")
activations = importlib.import_module("libnn.ops.activations")
embedding = importlib.import_module("libnn.ops.embedding")
layer_norm = importlib.import_module("libnn.ops.layer_norm")
rms_norm = importlib.import_module("libnn.ops.rms_norm")
swiglu = importlib.import_module("libnn.ops.swiglu")
pool2d = importlib.import_module("libnn.ops.pool2d")
softmax = importlib.import_module("libnn.ops.softmax")
fft_conv = importlib.import_module("libnn.ops.fft_conv")
fft_conv_kernels = importlib.import_module("libnn.ops.fft_conv_kernels")

# PTX parameter types each declared kind may compile to
PTX_TYPES = {"ptr": {"u64", "s64", "b64"}, "i64": {"u64", "s64", "b64"}, "u64": {"u64", "s64", "b64"},
             "i32": {"u32", "s32", "b32"}, "u32": {"u32", "s32", "b32"}, "f32": {"f32"}}
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)([^{]*)\{", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)")
_MAXNTID = re.compile(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)")


@cache
def ptx_entries(file: str) -> dict[str, tuple[str, ...]]:
    """Each kernel of kernels/<file> and its parameters' PTX types, in order."""
    return {name: params for name, (params, _) in _ptx(file).items()}


@cache
def _ptx(file: str) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """Each kernel of kernels/<file>: its parameters' PTX types and its __launch_bounds__ threads (None: none)."""
    ptx = kernels.compile_file(file, "compute_90").cubin.decode()
    found = {}
    for name, params, directives in _ENTRY.findall(ptx):
        m = _MAXNTID.search(directives)
        found[name] = tuple(_PARAM.findall(params)), (int(m[1]) * int(m[2]) * int(m[3]) if m else None)
    return found


def max_threads(file: str, kernel: str) -> int | None:
    return _ptx(file)[kernel][1]


def mismatches(declared: contracts.Params, kernel: str) -> list[str]:
    """How `kernel`'s compiled parameters differ from `declared` (empty: they agree)."""
    entries = ptx_entries(declared.file)
    if kernel not in entries:
        return [f"kernels/{declared.file} has no kernel {kernel}"]
    compiled = entries[kernel]
    found = []
    if len(compiled) != len(declared.params):
        found.append(f"{kernel} takes {len(compiled)} parameters, {declared.key} declares {len(declared.params)}")
    for i, (p, t) in enumerate(zip(declared.params, compiled)):
        if t not in PTX_TYPES[p.kind]:
            found.append(f"{kernel} parameter {i} ({p.name}): .{t} in the PTX, {p.kind} ({p.ctype}) declared")
    return found


def _suffixes(dtype_names) -> list[str]:
    return [dtypes.KERNEL_SUFFIX[d] for d in dtype_names]


def _conv_problem(dtype: str, C: int, K: int, groups: int):
    return conv2d.ConvProblem(N=2, H=9, W=7, C=C, K=K, R=3, S=3, P=9, Q=7, stride=(1, 1), padding=(1, 1),
                              dilation=(1, 1), groups=groups, dtype=dtype, layout="NHWC", has_scale=True,
                              has_shift=True, activation="relu", allow_tf32=False, device="gpu")


def launched() -> list[tuple[str, contracts.Params, str]]:
    """(launch site, the parameters it packs by, a kernel it launches) for every kernel libnn launches."""
    rows = []
    for dtype, versions in linear._VERSIONS.items():
        for version in versions:
            for act in linear.ACTIVATIONS:
                if (kernel := linear._kernel(version, act)) is not None:
                    rows.append(("linear.bind_custom", linear._GEMM, f"{kernel}_{dtypes.KERNEL_SUFFIX[dtype]}"))
        for act in linear.ACTIVATIONS:
            rows.append(("linear.bind_epilogue_pass", linear._BIAS_ACT_ROWS, linear.epilogue_pass_kernel(dtype, act)))
    for dtype in dtypes.KERNEL_SUFFIX:
        problems = (_conv_problem(dtype, 8, 8, 8), _conv_problem(dtype, 8, 16, 1), _conv_problem(dtype, 8, 16, 2))
        for version in sorted({v for p in problems for v in conv2d.custom_versions(p)}):
            rows.append(("conv2d.bind_custom", conv2d._CONV, f"{version}_{dtypes.KERNEL_SUFFIX[dtype]}"))
        rows.append(("conv2d.apply_epilogue_kernel", conv2d._CHANNEL_EPILOGUE,
                     f"channel_epilogue_{dtypes.KERNEL_SUFFIX[dtype]}"))
        rows.append(("attention_kernels.flash_attention", attention_kernels._ATTN,
                     f"attn1_naive_{dtypes.KERNEL_SUFFIX[dtype]}"))
        rows.append(("attention_kernels.unfused_attention", attention_kernels._SOFTMAX,
                     f"attn_softmax_{dtypes.KERNEL_SUFFIX[dtype]}"))
    for d in attention_kernels.FLASH_BUCKETS:
        for has_bias in (False, True):
            name = attention_kernels.flash_launch(d, has_bias)[0]
            rows += [("attention_kernels.flash_attention", attention_kernels._ATTN, f"{name}_{s}")
                     for s in _suffixes(("fp16", "bf16"))]
    rows += _row_kernels("embedding.launch_custom", embedding, embedding._EMB, "H")
    rows += _row_kernels("layer_norm.launch_custom", layer_norm, layer_norm._LN, "N")
    rows += _row_kernels("rms_norm.launch_custom", rms_norm, rms_norm._RMS, "N")
    for dtype in swiglu.GPU_DTYPES:
        rows += [("swiglu.bind_custom", swiglu._SWIGLU, f"{version}_{dtypes.KERNEL_SUFFIX[dtype]}")
                 for version in swiglu.VERSIONS]
    for dtype in pool2d.GPU_DTYPES:
        for name in ("maxpool_nhwc_vec", "maxpool", "avgpool"):
            rows.append(("pool2d.bind_pool", pool2d._POOL, f"{name}_{dtypes.KERNEL_SUFFIX[dtype]}"))
    for dtype in softmax.GPU_DTYPES:
        names = {softmax.custom_launch(SimpleNamespace(outer=7, n=n, inner=inner))[0]
                 for n in (1, 3, 33, 100, 1000, 5000, 100000) for inner in (1, 5)}
        rows += [("softmax.bind_custom", softmax._SM, f"{name}_{softmax.KERNEL_SUFFIX[dtype]}")
                 for name in sorted(names)]
    for dtype in dtypes.KERNEL_SUFFIX:
        suffix = dtypes.KERNEL_SUFFIX[dtype]
        rows += [("fft_conv", fft_conv._PAD, f"fft_pad_{suffix}"), ("fft_conv", fft_conv._CROP, f"fft_crop_{suffix}")]
    rows += [("fft_conv", fft_conv._CMUL, "fft_cmul"), ("fft_conv_kernels", fft_conv_kernels._TWIDDLE, "fft_twiddle")]
    rows += [("fft_conv_kernels", fft_conv_kernels._FFT, version) for version in fft_conv_kernels.VERSIONS]
    return rows


def _row_kernels(site: str, module, declared: contracts.Params, width: str) -> list:
    """The kernels a row-wise op (embedding, layer norm) launches: every version at every row width it
    takes, 16-byte and scalar."""
    names = set()
    for dtype in module.GPU_DTYPES:
        for size in (1, 7, 64, 100, 768, 1024, 3000, 4096, 8192, 20000):
            problem = SimpleNamespace(dtype=dtype, M=5, **{width: size})
            for aligned in (True, False):
                for version in module.custom_versions(problem, aligned):
                    names.add(f"{module._launch(version, problem, aligned)[0]}_{dtypes.KERNEL_SUFFIX[dtype]}")
    return [(site, declared, name) for name in sorted(names)]


@pytest.mark.parametrize("site,declared,kernel", launched(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_launched_kernel_exists_and_takes_the_declared_parameters(site, declared, kernel):
    assert mismatches(declared, kernel) == [], site


# one test per file, so that pytest-xdist workers compile the three files at once
@pytest.mark.parametrize("file,key,starts", [("gemm.cu", "GEMM_PARAMS", ("gemm",)),
                                             ("conv2d.cu", "CONV_PARAMS", ("conv",)),
                                             ("attention.cu", "ATTN_PARAMS", ("attn1_", "attn2_"))])
def test_every_exported_kernel_of_a_declared_list_takes_it(file, key, starts):
    """A kernel file's kernels that Python does not launch (other dtypes, tuning variants) still match the
    declared list when their name says they use it, so a launch added later starts from a checked list."""
    declared = contracts.params(file, key)
    names = [k for k in ptx_entries(file) if k.startswith(starts)]
    assert names
    for kernel in names:
        assert mismatches(declared, kernel) == []


def test_the_checker_sees_a_swapped_width_and_a_missing_parameter():
    gemm = contracts.params("gemm.cu", "GEMM_PARAMS")
    params = list(gemm.params)
    swapped = replace(gemm, params=(*params[:5], replace(params[5], kind="i64"), *params[6:]))
    assert mismatches(swapped, "gemm3_mma_bf16") == [
        "gemm3_mma_bf16 parameter 5 (M): .u32 in the PTX, i64 (int) declared"]
    missing = replace(gemm, params=tuple(params[:-1]))
    assert mismatches(missing, "gemm3_mma_bf16") == ["gemm3_mma_bf16 takes 9 parameters, GEMM_PARAMS declares 8"]
    floated = replace(gemm, params=(*params[:-1], replace(params[-1], kind="f32")))
    assert mismatches(floated, "gemm3_mma_bf16")


def test_pack_takes_every_parameter_by_name_and_the_kernel_types():
    gemm = contracts.params("gemm.cu", "GEMM_PARAMS")
    packed = gemm.pack(x="x", w="w", bias=None, residual="r", y="y", M=3, N=4, K=5, act=1)
    assert packed[:5] == ("x", "w", contracts.NULL, "r", "y")
    assert [type(v) for v in packed[5:]] == [np.int32] * 4 and packed[5:] == (3, 4, 5, 1)
    with pytest.raises(TypeError, match=r"kernels/gemm.cu GEMM_PARAMS: missing act; no parameter named acts"):
        gemm.pack(x="x", w="w", bias=None, residual="r", y="y", M=3, N=4, K=5, acts=1)


# --- what the launch sites pack ------------------------------------------------------------------------
def _module_params(tree: ast.Module, module) -> dict[str, contracts.Params]:
    """The module's names bound to contracts.params(...) at module level."""
    found = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "contracts.params"):
            for target in node.targets:
                found[target.id] = getattr(module, target.id)
    return found


def pack_calls() -> list[tuple[str, str, contracts.Params, set[str] | None]]:
    """(module, line, declared list, the keywords passed; None if some arrive through **) of every
    `NAME.pack(...)` in libnn/ops."""
    rows = []
    for path in sorted(OPS.glob("*.py")):
        module = importlib.import_module(f"libnn.ops.{path.stem}")
        tree = ast.parse(path.read_text())
        declared = _module_params(tree, module)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pack"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in declared):
                assert not node.args, f"{path.name}:{node.lineno}: pack takes its arguments by name only"
                names = {k.arg for k in node.keywords}
                rows.append((path.name, str(node.lineno), declared[node.func.value.id],
                             None if None in names else names))
    return rows


def test_the_launch_sites_pack_by_declared_lists():
    sites = {(m, p.key) for m, _, p, _ in pack_calls()}
    assert {("linear.py", "GEMM_PARAMS"), ("linear.py", "bias_act_rows_##ACT_NAME##_##SUFFIX"), ("conv2d.py", "CONV_PARAMS"),
            ("conv2d.py", "channel_epilogue_##SUFFIX"), ("attention_kernels.py", "ATTN_PARAMS"),
            ("attention_kernels.py", "attn_softmax_##SUFFIX"), ("embedding.py", "EMB_PARAMS"),
            ("layer_norm.py", "LN_PARAMS"), ("rms_norm.py", "RMS_PARAMS"), ("pool2d.py", "POOL_PARAMS"),
            ("softmax.py", "SM_PARAMS"), ("swiglu.py", "SWIGLU_PARAMS"),
            ("fft_conv.py", "fft_pad_##SUFFIX"), ("fft_conv.py", "fft_crop_##SUFFIX"), ("fft_conv.py", "fft_cmul"),
            ("fft_conv_kernels.py", "fft_radix2_c2c"), ("fft_conv_kernels.py", "fft_twiddle")} <= sites


@pytest.mark.parametrize("module,line,declared,names", pack_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_pack_call_names_exactly_the_kernels_parameters(module, line, declared, names):
    if names is None:
        pytest.skip("some arguments arrive through **: the packed-arguments tests below call this site")
    assert names == set(declared.names), (f"{module}:{line}: missing {set(declared.names) - names}, "
                                          f"unknown {names - set(declared.names)}")


def assert_packed(args: tuple, declared: contracts.Params, kernel: str) -> None:
    """The packed arguments have the compiled kernel's count, and each scalar its PTX type's width and kind."""
    assert mismatches(declared, kernel) == []
    compiled = ptx_entries(declared.file)[kernel]
    assert len(args) == len(compiled)
    for i, (value, t) in enumerate(zip(args, compiled)):
        if declared.params[i].kind == "ptr":
            assert not isinstance(value, np.generic) or value == contracts.NULL, (i, value)
            continue
        assert isinstance(value, np.generic), (i, value)
        assert value.dtype.itemsize * 8 == int(t[1:]), (kernel, i, declared.params[i].name, value.dtype, t)
        assert (value.dtype.kind == "f") == (t == "f32"), (kernel, i, value.dtype, t)


@pytest.mark.parametrize("dtype", list(dtypes.KERNEL_SUFFIX))
def test_conv2d_packs_what_its_kernels_take(dtype):
    for p in (_conv_problem(dtype, 8, 8, 8), _conv_problem(dtype, 8, 16, 1), _conv_problem(dtype, 8, 16, 2)):
        for version in conv2d.custom_versions(p):
            assert_packed(conv2d._conv_args(p), conv2d._CONV, f"{version}_{dtypes.KERNEL_SUFFIX[dtype]}")


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_pool2d_packs_what_its_kernels_take(layout):
    p = pool2d.PoolProblem(mode="avg", N=2, H=9, W=7, C=5, P=4, Q=3, kernel=(3, 2), stride=(2, 2), padding=(1, 0),
                           count_include_pad=True, dtype="fp16", layout=layout, device="gpu")
    assert_packed(pool2d._pool_args(p, object(), object()), pool2d._POOL, "avgpool_f16")


@pytest.mark.parametrize("has_bias", [False, True])
def test_attention_packs_what_its_kernels_take(has_bias):
    B, Hq, Hkv, Sq, Skv, D = 2, 4, 2, 5, 7, 64
    q, o = (np.zeros((B, Hq, Sq, D), np.float16) for _ in range(2))
    k, v = (np.zeros((B, Hkv, Skv, D), np.float16) for _ in range(2))
    bias = np.zeros((B, Hq, Sq, Skv), np.float16) if has_bias else None
    lens = np.full(B, 3, np.int32)
    args = attention_kernels._args(q, k, v, o, 0.125, "top_left", lens, None, bias)
    assert args[:7] == (q, k, v, o, contracts.NULL if bias is None else bias, lens, contracts.NULL)
    name = attention_kernels.flash_launch(D, has_bias)[0]
    for kernel in ("attn1_naive_f16", f"{name}_f16"):
        assert_packed(args, attention_kernels._ATTN, kernel)
    s = np.zeros((B, Hq, Sq, Skv), np.float32)
    assert_packed(attention_kernels._softmax_args(s, bias, lens, lens, B, Hq, Sq, Skv, 0.125, None),
                  attention_kernels._SOFTMAX, "attn_softmax_f16")


# --- constants -----------------------------------------------------------------------------------------
def test_activation_codes_are_common_cuh_s_and_every_kernel_compares_by_name():
    assert activations.KERNEL_CODES == {None: 0, "relu": 1, "relu6": 2, "gelu": 3, "silu": 4, "gelu_erf": 5}
    for path in [*kernels.kernel_files(), kernels.kernel_dir() / "common.cuh"]:
        assert not re.search(r"\bact\s*==\s*\d", path.read_text()), f"{path.name} compares act to a literal code"


def activation_masks() -> dict[str, int]:
    """The `enum : unsigned { NAME = mask, ... }` activation masks of common.cuh and gemm.cu, evaluated."""
    masks: dict[str, int] = {}
    for file in ("common.cuh", "gemm.cu"):
        for body in re.findall(r"enum\s*:\s*unsigned\s*\{(.*?)\}", (kernels.kernel_dir() / file).read_text(), re.S):
            for name, expr in re.findall(r"(\w+)\s*=\s*([^,]+)", body):
                expr = re.sub(r"\b(0x[0-9a-f]+|\d+)u\b", r"\1", expr)
                masks[name] = eval(expr, {}, dict(masks))  # noqa: S307  (integers, <<, |, names above)
    return masks


def test_the_ops_activations_are_those_their_kernels_compile():
    """An activation a kernel does not compile is silently the identity: each activation linear fuses into
    a gemm kernel, and each conv2d takes, has its code in the mask that kernel is compiled with."""
    masks, codes = activation_masks(), activations.KERNEL_CODES
    for act in conv2d.ACTIVATIONS:
        assert masks["ACT_CONV"] >> codes[act] & 1, act
    kernel_masks = {"gemm1_naive": "ACTS_NAIVE", "gemm2_tiled": "ACTS_FUSED", "gemm3_mma": "ACTS_FUSED",
                    "gemm3_mma_gelu_erf": "ACTS_ERF"}  # gemm.cu: gemm1_body, gemm2's epilogue, GEMM3(...)
    for version in linear._LAUNCH:
        for act in linear.ACTIVATIONS:
            if (kernel := linear._kernel(version, act)) is not None:
                assert masks[kernel_masks[kernel]] >> codes[act] & 1, (version, kernel, act)


def test_launch_geometry_is_the_kernel_files_and_its_launch_tables():
    """Threads and dynamic shared memory Python launches with follow from the .cu's constants, and are
    the figures its LAUNCH comment gives (a changed tile that the comment does not follow fails)."""
    gemm_text = (kernels.kernel_dir() / "gemm.cu").read_text()
    v3 = linear._LAUNCH["v3"]
    assert v3.block == (256, 1, 1) and (v3.tile_m, v3.tile_n) == (128, 256) and v3.dynamic_smem == 98304
    assert f"gemm3_mma_*         (256, 1, 1)  (ceil(N/256), ceil(M/128), 1)     {v3.dynamic_smem}" in gemm_text
    conv_text = (kernels.kernel_dir() / "conv2d.cu").read_text()
    p = _conv_problem("bf16", 64, 64, 1)
    grid, threads, smem = conv2d._conv_launch("conv3_igemm", p)
    assert (threads, smem) == (128, 49152) and grid == (-(-p.N * p.P * p.Q // 128), 1)
    assert f"({threads}, 1, 1)  (ceil(N*P*Q / 128), ceil(K / 64), 1)                 {smem}" in conv_text
    c = contracts.constants("attention.cu")
    assert attention_kernels.FLASH_WARPS == c["ATTN2_WARPS"] and attention_kernels._BN == c["ATTN2_BN"]
    name, threads, rows, smem = attention_kernels.flash_launch(128, False)
    bm = 16 * c["ATTN2_WARPS"]
    assert (threads, rows, smem) == (32 * c["ATTN2_WARPS"], bm, (bm + 4 * 64) * (128 + 8) * 2)


def launch_blocks() -> list[tuple[str, str, int, bool]]:
    """(file, kernel, threads per block Python launches it with, whether the kernel needs exactly that many:
    its tiles assume the block, where a grid-strided kernel takes any block up to its bounds)."""
    rows = []
    for version, spec in linear._LAUNCH.items():
        for dtype in [d for d, vs in linear._VERSIONS.items() if version in vs]:
            for kernel in {linear._kernel(version, a) for a in linear.ACTIVATIONS} - {None}:
                rows.append(("gemm.cu", f"{kernel}_{dtypes.KERNEL_SUFFIX[dtype]}", math.prod(spec.block),
                             version != "v1"))
    for dtype in dtypes.KERNEL_SUFFIX:
        suffix = dtypes.KERNEL_SUFFIX[dtype]
        for p in (_conv_problem(dtype, 8, 8, 8), _conv_problem(dtype, 8, 16, 1), _conv_problem(dtype, 8, 16, 2)):
            for version in conv2d.custom_versions(p):
                rows.append(("conv2d.cu", f"{version}_{suffix}", conv2d._conv_launch(version, p)[1],
                             version in ("conv3_igemm", "conv4_igemm")))
        rows.append(("attention.cu", f"attn1_naive_{suffix}", 32 * attention_kernels._ROWS_PER_ATTN1_BLOCK, False))
        rows.append(("attention.cu", f"attn_softmax_{suffix}", attention_kernels._SOFTMAX_THREADS, True))
        for d in attention_kernels.FLASH_BUCKETS:
            for has_bias in (False, True):
                name, threads, _, _ = attention_kernels.flash_launch(d, has_bias)
                if dtype != "fp32":
                    rows.append(("attention.cu", f"{name}_{suffix}", threads, True))
    for module, file, width in ((embedding, "embedding.cu", "H"), (layer_norm, "layer_norm.cu", "N"),
                                (rms_norm, "rms_norm.cu", "N")):
        for dtype in module.GPU_DTYPES:
            for size in (1, 7, 64, 100, 768, 1024, 3000, 4096, 8192, 20000):
                problem = SimpleNamespace(dtype=dtype, M=5, **{width: size})
                for aligned in (True, False):
                    for version in module.custom_versions(problem, aligned):
                        name, _, threads = module._launch(version, problem, aligned)
                        rows.append((file, f"{name}_{dtypes.KERNEL_SUFFIX[dtype]}", threads, False))
    for dtype in softmax.GPU_DTYPES:
        for n in (1, 3, 33, 100, 1000, 5000, 100000):
            for inner in (1, 5):
                name, _, block = softmax.custom_launch(SimpleNamespace(outer=7, n=n, inner=inner))
                rows.append(("softmax.cu", f"{name}_{softmax.KERNEL_SUFFIX[dtype]}", math.prod(block), False))
    for dtype in swiglu.GPU_DTYPES:
        for M, F in ((1, 1), (5, 7), (3, 64), (1000, 11008)):
            p = swiglu.SwigluProblem((M, 2 * F), dtype, "gpu:0")
            for version in swiglu.custom_versions(p, swiglu.aligned(p, 2 * F, 0, 0)):
                name, _, block = swiglu.custom_launch(p, version)
                rows.append(("swiglu.cu", name, math.prod(block), False))
    for version in fft_conv_kernels.VERSIONS:
        for log2n in range(1, fft_conv_kernels.MAX_BLOCK_LOG2N + 1):
            rows.append(("fft_conv.cu", version, fft_conv_kernels._fft_launch_shape(version, log2n, 64)[1], False))
    return sorted(set(rows))


@pytest.mark.parametrize("file,kernel,threads,exact", launch_blocks())
def test_each_launch_block_fits_the_kernels_launch_bounds(file, kernel, threads, exact):
    """A block larger than the kernel's __launch_bounds__ fails at launch; a tile kernel launched with
    other than its own block computes garbage. PTX's .maxntid is the bound the kernel was compiled for."""
    bound = max_threads(file, kernel)
    assert bound is not None or not exact, f"{kernel} declares no __launch_bounds__ for the block it needs"
    bound = 1024 if bound is None else bound  # no bounds: any block the GPU takes
    assert (threads == bound) if exact else (threads <= bound), (kernel, threads, bound)


def test_constants_are_read_once_per_name():
    for path in [*kernels.kernel_files(), kernels.kernel_dir() / "common.cuh"]:
        contracts.constants(path.name)  # raises where a name has two values
