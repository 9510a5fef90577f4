"""Bad input, as a new user gives it, to the layers, the weight loader, the memory check, device
discovery and the CLI: each gets a clear error of a documented type naming the function (or layer),
the argument, and the file where there is one; never a raw NumPy/CuPy traceback, never a wrong result.

Organised by function. The constructor sweeps at the end cover, per public constructor, the classes
of input issue 14 lists: types (float, None, str, array, bool where ints are expected), ranges (0,
negative, huge), dtypes (int, bool, complex, None, unknown names) and devices.

Bad-input classes swept per public function (here, or in the op's or model's own test file):
T types · R ranges (0, negative) · H huge, refused before allocating · K ranks and shapes ·
D dtypes (int, bool, complex, strings, objects) · V devices (unknown, a GPU where there is none, a
GPU path on host arrays) · C choices and flags (unknown names, truthy non-bools, paths) · F files
(missing, a directory, empty, truncated, another format, wrong JSON shapes). x: tested; o: the
function has an argument of the class that the sweep leaves uncovered (the notes say why); -: the
function has no argument of the class. "k of n": n counts the classes marked x or o.

    function                                  T R H K D V C F   classes
    nn.Linear, Conv2d, Embedding, BatchNorm2d x x x - x x x -   6 of 6
    nn.LayerNorm                              x x x x x x x -   7 of 7
    nn.RMSNorm (and test_rms_norm_layer.py)   x x x - x x x -   6 of 6
    nn.MultiheadAttention                     x x x - x x x -   6 of 6
    nn.TransformerEncoderLayer                x x x - x x x -   6 of 6
    nn.MaxPool2d, AvgPool2d                   x x - - - - x -   3 of 3
    nn.Conv2dBNAct                            x - - x - - x -   3 of 3
    nn.Sequential (and [index])               x x - - - - x -   3 of 3
    nn.Dropout                                x x - - - - x -   3 of 3
    nn.Flatten, Softmax, LogSoftmax           x - - - - - x -   2 of 2
    nn.GELU                                   - - - - - - x -   1 of 1
    forward: activations, BatchNorm2d         x - - x x - - -   3 of 3
    forward: pooling layers, Flatten          x x - x x - - -   4 of 4
    forward: MultiheadAttention, Encoder      x - - x x - x -   4 of 4
    Module.load_state_dict                    x - - x x - - -   3 of 3
    Module.to                                 x - - - x x - -   3 of 3
    Module.use_path                           - - - - - - x -   1 of 1
    Module.load, weights.read                 x - - - x - - x   3 of 3
    Module.save, weights.write                x - - - x - - x   3 of 3
    ops.conv2d                                x x x x x x x -   7 of 7
    ops.max_pool2d, avg_pool2d                x x x x x x x -   7 of 7
    ops.attention                             x x x x x x x -   7 of 7
    ops.attention, layout THD (packed)        x x x x x x x -   7 of 7
    ops.linear (and test_linear_errors.py)    x - x x x x x -   6 of 6
    ops.layer_norm                            x x x x x x x -   7 of 7
    ops.rms_norm (test_rms_norm_reference.py) x x x x x x x -   7 of 7
    ops.softmax, log-softmax                  x x x x x x x -   7 of 7
    ops.embedding (test_embedding_reference)  x x x x x x x -   7 of 7
    nn.Embedding(check_ids=)                  x - - - - - x -   2 of 2
    ops.fft_conv2d, fft_conv1d                x x x x x x x -   7 of 7
    ops.rope (test_rope_reference.py)         x x x x x x x -   7 of 7
    ops.rope_frequencies                      x x x - - - x -   4 of 4
    Module.graphed (arguments and calls)      x x x x - x x -   6 of 6
    graphs.SequenceInputs                     x x - - - - - -   2 of 2
    functional.key_padding(_and_tokens)       x - - x x - - -   3 of 3
    functional.masked_mean                    x - - x x - - -   3 of 3
    functional.packed_self_attention          x x - x x x x -   6 of 6
    functional.TokenPacking, gather_rows      x x - x x - - -   4 of 4
    BertConfig.from_dict, BertEncoder(config) x x - - - - x -   3 of 3
    BertEncoder.from_pretrained               x x x - x x x x   7 of 7
    BertEncoder.forward (test_bert.py)        - x - x x - - -   3 of 3
    ops.swiglu (test_swiglu_reference.py)     x - x x x x x -   6 of 6
    LlamaConfig.from_dict, CausalLM(config)   x x x - x x x -   6 of 6
    CausalLM.from_pretrained (test_llama.py)  x x x - x x x x   7 of 7
    CausalLM.prefill, decode_step             x x x x x x - -   6 of 6
    CausalLM.generate, stream (test_llama.py) x x x x x x - -   6 of 6

Notes: TokenPacking and gather_rows
check their arrays and, on the host, the capacity against the token count and every row index; on the
GPU neither is read back (a synchronisation per call): TokenPacking's maps come from the device.

The LLaMA rows (here and in test_llama.py): CausalLM(config)'s H, D, V and C are its max_batch/max_len
(the KV cache), dtype, device and path, as from_pretrained's; V for prefill, decode_step, generate and
stream is ids on the GPU given to a model on the host (a stand-in CuPy array: no GPU needed). swiglu
has no argument with a range of its own (R): its sizes are x's shape, empty shapes included in
test_swiglu_reference.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from libnn import nn
from libnn.nn import weights
from libnn.runtime import device as device_module
from libnn.runtime import memory
from libnn.runtime.device import gpu_missing

NO_GPU = gpu_missing() is not None


def run_libnn(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """`libnn ARGS` in a fresh interpreter, after `prelude` (e.g. hiding a package)."""
    code = f"import sys\n{prelude}\nfrom libnn.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


# --- libnn.runtime.memory.require ------------------------------------------------------------------

def test_require_refuses_with_the_function_argument_and_both_byte_counts():
    # more than the machine's physical RAM: never available, whatever other processes free meanwhile
    # (available + 1 raced with the suite's other workers: one freed memory between the two reads)
    request = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") + 1
    with pytest.raises(MemoryError, match=rf"^op: x needs .* \({request} bytes\), more than the .* "
                                          rf"\(\d+ bytes\) of host RAM available$"):
        memory.require(request, "cpu", "op", "x")


def test_require_lets_what_fits_through():
    memory.require(1024, "cpu", "op", "x")
    assert memory.available_bytes("cpu") > 0


def test_available_bytes_names_a_bad_device():
    with pytest.raises(ValueError, match=r"available_bytes: device must be one of \('cpu', 'gpu'\), got 'tpu'"):
        memory.available_bytes("tpu")


def test_array_bytes_does_not_overflow():
    assert memory.array_bytes((10**9, 10**9), np.float32) == 4 * 10**18


# --- libnn.runtime.device.gpu_missing --------------------------------------------------------------

class FakeCudaError(Exception):
    pass


@pytest.fixture
def fake_cupy(monkeypatch):
    """A CuPy whose runtime answers like one on a machine without a working driver."""
    runtime = types.SimpleNamespace(CUDARuntimeError=FakeCudaError, driverGetVersion=lambda: 0)

    def no_device():
        raise FakeCudaError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
                            "version")

    runtime.getDeviceCount = no_device
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    caches = (device_module.module_missing, device_module.gpu_missing, device_module.driver_missing)
    for cache in caches:
        cache.cache_clear()
    yield runtime
    for cache in caches:
        cache.cache_clear()


def test_no_driver_library_says_there_is_no_driver(fake_cupy, monkeypatch):
    monkeypatch.setattr(device_module, "DRIVER_LIBRARY", "libnn-no-such-driver.so.1")
    reason = device_module.gpu_missing()
    assert reason == "no NVIDIA driver is installed (libnn-no-such-driver.so.1 does not load)"


def test_a_driver_reporting_version_0_says_no_driver_runs(fake_cupy, monkeypatch):
    monkeypatch.setattr(device_module, "driver_missing", lambda: None)  # a stub libcuda loads
    assert device_module.gpu_missing() == "no NVIDIA driver is running (the CUDA driver reports version 0)"


def test_with_a_driver_the_runtime_error_is_kept(fake_cupy, monkeypatch):
    monkeypatch.setattr(device_module, "driver_missing", lambda: None)
    fake_cupy.driverGetVersion = lambda: 13000
    assert device_module.gpu_missing().startswith("no CUDA device (cudaErrorInsufficientDriver")


# --- ops: conv2d, max_pool2d, avg_pool2d, attention ----------------------------------------------
# Each case uses shapes no other test binds, so that the first call of its signature runs the checks.

OP_INTS = [(1.5, TypeError, "got float 1.5"), (None, TypeError, "got NoneType None"),
           (np.array([1, 1]), TypeError, "got ndarray"), ("1", TypeError, "got str '1'"),
           (True, TypeError, "got bool True"), ([1, 1.5], TypeError, r"got list \[1, 1.5\]"),
           ((1, 1, 1), TypeError, "got tuple"), ({1: 2}, TypeError, "got dict")]


@pytest.mark.parametrize("argument", ["stride", "padding", "dilation"])
@pytest.mark.parametrize("value, error, got", OP_INTS, ids=repr)
def test_conv2d_sizes_of_the_wrong_type_are_type_errors(argument, value, error, got):
    from libnn.ops.conv2d import conv2d

    with pytest.raises(error, match=rf"^conv2d: {argument} must be an int or a pair of ints, {got}"):
        conv2d(np.ones((1, 7, 5, 2)), np.ones((3, 3, 3, 2)), **{argument: value})


@pytest.mark.parametrize("value, error", [(1.5, TypeError), (None, TypeError), (True, TypeError),
                                          (np.array(1), TypeError), (0, ValueError), (-2, ValueError)], ids=repr)
def test_conv2d_groups_must_be_a_positive_int(value, error):
    from libnn.ops.conv2d import conv2d

    with pytest.raises(error, match=r"^conv2d: groups must be (an int|a positive int), got"):
        conv2d(np.ones((1, 7, 5, 2)), np.ones((3, 3, 3, 2)), groups=value)


def test_a_float_option_is_refused_even_after_its_int_twin_was_bound():
    from libnn.ops.conv2d import conv2d

    x, w = np.ones((1, 7, 6, 2)), np.ones((3, 3, 3, 2))
    conv2d(x, w, stride=1, groups=1)  # 1.0 and True equal 1 as dict keys: the key carries their types
    for options in (dict(stride=1.0), dict(stride=[1, 1.0]), dict(groups=True)):
        with pytest.raises(TypeError, match="must be an int"):
            conv2d(x, w, **options)


@pytest.mark.parametrize("layout, w_shape", [("NHWC", (3, 0, 3, 2)), ("NHWC", (3, 3, 0, 2)), ("NCHW", (3, 2, 3, 0))])
def test_conv2d_refuses_a_zero_size_kernel_instead_of_returning_zeros(layout, w_shape):
    from libnn.ops.conv2d import conv2d

    x = np.ones((1, 5, 5, 2)) if layout == "NHWC" else np.ones((1, 2, 5, 5))
    with pytest.raises(ValueError, match=r"^conv2d: w's kernel must be at least 1x1, got \dx\d"):
        conv2d(x, np.ones(w_shape), b=np.ones(3), layout=layout)


def test_conv2d_reference_refuses_huge_padding_before_allocating():
    from libnn.ops.conv2d import conv2d

    with pytest.raises(MemoryError, match=r"^conv2d: padding \(1000000, 1000000\) on x of 1x5x5x2 .* needs .* "
                                          r"\(\d+ bytes\), more than the .* of host RAM available$"):
        conv2d(np.ones((1, 5, 5, 2), np.float32), np.ones((3, 3, 3, 2), np.float32), padding=10**6)


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
@pytest.mark.parametrize("argument", ["kernel_size", "stride", "padding"])
@pytest.mark.parametrize("value, error, got", [v for v in OP_INTS if v[0] is not None], ids=repr)
def test_pooling_sizes_of_the_wrong_type_are_named_by_the_pooling_op(pool, argument, value, error, got):
    from libnn import ops

    kwargs = {"kernel_size": 2, argument: value}
    with pytest.raises(error, match=rf"^{pool}: {argument} must be an int or a pair of ints, {got}"):
        getattr(ops, pool)(np.ones((1, 5, 7, 2)), **kwargs)


def test_pooling_kernel_size_none_is_a_type_error():
    from libnn.ops import max_pool2d

    with pytest.raises(TypeError, match=r"^max_pool2d: kernel_size must be an int or a pair of ints, got NoneType"):
        max_pool2d(np.ones((1, 5, 7, 2)), None)


def test_pooling_reference_refuses_what_would_not_fit_before_allocating():
    from libnn.ops import avg_pool2d

    x = np.ones((1, 2000, 2000, 1), np.float32)  # 1001·1001 windows of 1000·1000 taps each, stacked: 8 TB
    with pytest.raises(MemoryError, match=r"^avg_pool2d: kernel_size \(1000, 1000\) at stride \(1, 1\) on x of "
                                          r"1x2000x2000x1 .* needs .*, more than the .* of host RAM available$"):
        avg_pool2d(x, 1000, stride=1)


@pytest.mark.parametrize("scale, error", [("0.5", TypeError), (np.array(0.5), TypeError), (np.array([0.5]), TypeError),
                                          (True, TypeError), (1 + 2j, TypeError), (float("nan"), ValueError),
                                          (float("inf"), ValueError)], ids=repr)
def test_attention_scale_must_be_a_finite_real_number(scale, error):
    from libnn.ops import attention

    q = np.ones((1, 1, 3, 4))
    with pytest.raises(error, match=r"^attention: scale must be a finite number or None \(1/sqrt\(D\)\), got"):
        attention(q, q, q, scale=scale)


def test_attention_scale_true_is_refused_after_scale_1_was_bound():
    from libnn.ops import attention

    q = np.ones((1, 1, 3, 5))
    attention(q, q, q, scale=1)
    with pytest.raises(TypeError, match="scale must be a finite number or None"):
        attention(q, q, q, scale=True)


def test_attention_reference_refuses_huge_scores_before_allocating():
    from libnn.ops import attention

    q = np.ones((1, 1, 10**6, 1), np.float32)
    with pytest.raises(MemoryError, match=r"^attention: the 1000000x1000000 scores of 1x1 \(B x Hq\) heads .* needs "
                                          r".* \(\d+ bytes\), more than the .* of host RAM available$"):
        attention(q, q, q)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w: _conv(x, w, allow_tf32="no"), TypeError, "^conv2d: allow_tf32 must be True or False, got str 'no'"),
    (lambda x, w: _conv(x, w, bn=5), TypeError, r"^conv2d: bn must be a tuple \(scale, shift\) or .* got int"),
    (lambda x, w: _conv(x, w, bn=(*[np.ones(3)] * 4, "1e-5")), TypeError,
     "^conv2d: batch norm eps must be a real number, got str"),
    (lambda x, w: _conv(x, w, bn=(*[np.ones(3)] * 4, True)), TypeError,
     "^conv2d: batch norm eps must be a real number"),
    (lambda x, w: _conv(x, w, bn=(*[np.ones(3)] * 4, float("inf"))), ValueError,
     "^conv2d: batch norm eps must be > 0 and finite, got inf"),
    (lambda x, w: _conv(x, w, bn=(*[np.ones(3)] * 4, float("nan"))), ValueError, "^conv2d: batch norm eps must be > 0"),
], ids=["allow_tf32", "bn-int", "eps-str", "eps-bool", "eps-inf", "eps-nan"])
def test_conv2d_flags_and_batch_norm_are_checked(call, error, match):
    with pytest.raises(error, match=match):
        call(np.ones((1, 6, 5, 2)), np.ones((3, 3, 3, 2)))


def _conv(x, w, **kwargs):
    from libnn.ops import conv2d

    return conv2d(x, w, **kwargs)


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
def test_avg_pool_count_include_pad_must_be_a_bool(value):
    from libnn.ops import avg_pool2d

    with pytest.raises(TypeError, match="^avg_pool2d: count_include_pad must be True or False"):
        avg_pool2d(np.ones((1, 6, 6, 1)), 3, padding=1, count_include_pad=value)


@pytest.mark.parametrize("causal", [[True], "yes", 2.5], ids=repr)
def test_attention_causal_must_be_one_of_its_choices(causal):
    from libnn.ops import attention

    q = np.ones((1, 1, 3, 4))
    with pytest.raises(ValueError, match=r"^attention: causal must be False, True, 'top_left' or 'bottom_right'"):
        attention(q, q, q, causal=causal)


# --- ops.linear ------------------------------------------------------------------------------------
# Shapes here (K = 11, 13...) are bound by no other test: the first call of each signature runs the checks.

@pytest.mark.parametrize("value", ["no", None, 1, 0.0, [True], np.array([True])], ids=repr)
def test_linear_allow_tf32_must_be_a_bool(value):
    from libnn.ops import linear

    with pytest.raises(TypeError, match=r"^linear: allow_tf32 must be True or False, got "):  # "no" ran with TF32
        linear(np.ones((2, 11), np.float32), np.ones((3, 11), np.float32), allow_tf32=value)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(w=[[1.0] * 11] * 3), TypeError, r"^linear: w must be an array .* got builtins.list"),
    (dict(b=[0.0] * 3), TypeError, r"^linear: b must be an array .* got builtins.list"),
    (dict(x=np.float32(1.0)), ValueError, r"^linear: x must have at least 1 dimension \(\.\.\., in_features\), got a "
                                          "scalar"),
    (dict(w=np.ones(11, np.float32)), ValueError, r"^linear: w must be 2-D \(out_features, in_features\), got shape "
                                                  r"\(11,\)"),
    (dict(b=np.ones((1, 3), np.float32)), ValueError, r"^linear: b must have shape \(3,\) to match w's out_features, "
                                                      r"got \(1, 3\)"),
    (dict(x=np.ones((2, 11), bool), w=np.ones((3, 11), bool)), TypeError,
     r"^linear: x must be a floating-point array \(fp16, bf16, fp32, fp64\), got bool"),
    (dict(x=np.ones((2, 11), np.complex64), w=np.ones((3, 11), np.complex64)), TypeError,
     r"^linear: x must be a floating-point array .* got complex64"),
    (dict(activation=["relu"]), ValueError, r"^linear: activation must be one of \(None, 'relu', 'gelu', 'gelu_erf'\), "
                                            r"got \['relu'\]"),
    (dict(activation="relu6"), ValueError, r"^linear: activation must be one of .* got 'relu6'"),
    (dict(path=["reference"]), TypeError, r"^linear: path must be a string, 'auto' or one of \[.*\]; got list"),
], ids=["w-list", "b-list", "x-scalar", "w-1d", "b-2d", "x-bool", "x-complex", "activation-list", "activation-relu6",
        "path-list"])
def test_linear_arguments_out_of_their_domain(kwargs, error, match):
    from libnn.ops import linear

    args = {"x": np.ones((2, 11), np.float32), "w": np.ones((3, 11), np.float32), **kwargs}
    with pytest.raises(error, match=match):
        linear(args.pop("x"), args.pop("w"), **args)


# --- ops.layer_norm --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(weight=[1.0] * 13), TypeError, r"^layer_norm: weight must be an array .* got builtins.list"),
    (dict(eps=None), TypeError, r"^layer_norm: eps must be a finite number > 0, got NoneType None"),
    (dict(eps=True), TypeError, r"^layer_norm: eps must be a finite number > 0, got bool True"),
    (dict(eps=np.array([1e-5])), TypeError, r"^layer_norm: eps must be a finite number > 0, got ndarray"),
    (dict(eps=float("inf")), ValueError, r"^layer_norm: eps must be a finite number > 0, got inf"),
    (dict(x=np.ones((2, 13), bool)), TypeError, r"^layer_norm: x must be a floating-point array .* got bool"),
    (dict(x=np.ones((2, 13), np.complex128)), TypeError, r"^layer_norm: x must be a floating-point array .* got "
                                                         "complex128"),
    (dict(bias=np.ones(14, np.float32)), ValueError, r"^layer_norm: bias must have shape \(13,\) to match x's last "
                                                     r"dimension \(x is \(2, 13\)\), got \(14,\)"),
    (dict(return_sum="yes", residual=np.ones((2, 13), np.float32)), TypeError,
     "^layer_norm: return_sum must be True or False"),
    (dict(path=None), TypeError, r"^layer_norm: path must be a string, 'auto' or one of"),
], ids=["weight-list", "eps-None", "eps-bool", "eps-array", "eps-inf", "x-bool", "x-complex", "bias-shape",
        "return_sum-str", "path-None"])
def test_layer_norm_arguments_out_of_their_domain(kwargs, error, match):
    from libnn.ops import layer_norm

    args = {"x": np.ones((2, 13), np.float32), **kwargs}
    with pytest.raises(error, match=match):
        layer_norm(args.pop("x"), **args)


@pytest.mark.parametrize("return_sum", [False, True])
def test_layer_norm_reference_refuses_what_would_not_fit_before_allocating(return_sum):
    from libnn.ops import layer_norm

    x = np.broadcast_to(np.float32(1.5), (2**20, 2**20))  # a view: 4 TiB as float32, no memory behind it
    kwargs = dict(residual=x, return_sum=True) if return_sum else {}
    needed = 2**40 * (3 * 8 + 4 * (2 if return_sum else 1))
    with pytest.raises(MemoryError, match=rf"^layer_norm: x of shape \(1048576, 1048576\) in float64 \(a copy and 2 "
                                          rf"temporaries of its size\) needs .* \({needed} bytes\), more than the .* "
                                          r"of host RAM available$"):
        layer_norm(x, **kwargs)


# --- ops.softmax and log-softmax (softmax(log=True)) ------------------------------------------------

@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("x, kwargs, error, match", [
    ([1.0, 2.0], {}, TypeError, r"x must be an array .* got builtins.list"),
    (np.ones((2, 17)), dict(dim=1.0), TypeError, "dim must be an int, got float 1.0"),
    (np.ones((2, 17)), dict(dim="1"), TypeError, "dim must be an int, got str '1'"),
    (np.ones((2, 17)), dict(dim=None), TypeError, "dim must be an int, got NoneType None"),
    (np.ones((2, 17)), dict(dim=np.array([1])), TypeError, "dim must be an int, got ndarray"),
    (np.ones((2, 17)), dict(dim=2), ValueError, r"dim 2 is out of range for x of shape \(2, 17\) \(expected -2..1\)"),
    (np.ones((2, 17)), dict(dim=-3), ValueError, r"dim -3 is out of range"),
    (np.float64(1.0), {}, ValueError, r"x must have at least 1 dimension, got a scalar \(shape \(\)\)"),
    (np.ones((2, 17), np.int32), {}, TypeError, r"x must be a floating-point array \(fp16, bf16, fp32, fp64\), got "
                                                "int32"),
    (np.ones((2, 17), bool), {}, TypeError, "x must be a floating-point array .* got bool"),
    (np.ones((2, 17), np.complex64), {}, TypeError, "x must be a floating-point array .* got complex64"),
    (np.ones((2, 17)), dict(path="custom"), TypeError, r"path 'custom' runs on the GPU, but the arrays are host"),
    (np.ones((2, 17)), dict(path="cupy"), TypeError, r"path 'cupy' runs on the GPU, but the arrays are host"),
    (np.ones((2, 17)), dict(path="fused"), ValueError, r"unknown path 'fused'; expected 'auto' or one of"),
], ids=["x-list", "dim-float", "dim-str", "dim-None", "dim-array", "dim-2", "dim-minus-3", "x-scalar", "x-int",
        "x-bool", "x-complex", "path-custom", "path-cupy", "path-unknown"])
def test_softmax_arguments_out_of_their_domain_name_softmax_or_log_softmax(log, x, kwargs, error, match):
    from libnn.ops import softmax

    name = "log_softmax" if log else "softmax"
    op_named = "path" in kwargs  # the registry's messages name the op, which is softmax for both
    with pytest.raises(error, match=f"^{'softmax' if op_named else name}: {match}"):
        softmax(x, log=log, **kwargs)


@pytest.mark.parametrize("value", ["no", 1, None, [True], np.array(True)], ids=repr)
def test_softmax_log_must_be_a_bool(value):
    from libnn.ops import softmax

    with pytest.raises(TypeError, match=r"^softmax: log must be a bool, got "):  # "no" computed the log-softmax
        softmax(np.ones((3, 17)), log=value)


# --- ops.embedding and nn.Embedding(check_ids=) -------------------------------------------------------
# The op's other classes are swept in tests/test_embedding_reference.py (test_bad_input_is_refused_with_a_clear_error).

def test_embedding_reference_refuses_what_would_not_fit_before_allocating():
    from libnn.ops import embedding

    weight = np.broadcast_to(np.float32(0.5), (1, 2**40))  # a view: a 4 TiB row, no memory behind it
    with pytest.raises(MemoryError, match=r"^embedding: the float64 sums of shape \(1024, 1099511627776\) \(1024 "
                                          r"tokens of 1099511627776\) needs .* \(\d+ bytes\), more than the .* of "
                                          "host RAM available$"):
        embedding(np.zeros(1024, np.int64), weight)


@pytest.mark.parametrize("value", [None, "SYNC", "never", ["sync"], True, 1], ids=repr)
def test_embedding_check_ids_must_be_lazy_or_sync(value):
    with pytest.raises(ValueError, match=rf"^Embedding: check_ids must be one of \('lazy', 'sync'\), got "
                                         rf"{re.escape(repr(value))}$"):
        nn.Embedding(10, 4, check_ids=value)


# --- ops.fft_conv2d and fft_conv1d -------------------------------------------------------------------
# The rest of their sweep: tests/test_fft_conv_reference.py (padding types and ranges, huge padding, modes,
# causal's combinations, channels, kernel larger than the input, integer and complex x).

@pytest.mark.parametrize("stride", [np.array([1, 1]), None, 1.5, "1", [1, 1]], ids=repr)
def test_fft_conv_stride_of_the_wrong_type_is_a_type_error(stride):
    from libnn.ops import fft_conv2d

    with pytest.raises(TypeError, match=r"^fft_conv2d: stride must be the int 1, got "):  # an array: NumPy's own error
        fft_conv2d(np.ones((1, 3, 9, 7)), np.ones((2, 3, 3, 3)), stride=stride)


@pytest.mark.parametrize("causal", ["no", None, 1, 0.0, np.array(True), [True]], ids=repr)
def test_fft_conv1d_causal_must_be_a_bool(causal):
    from libnn.ops import fft_conv1d

    with pytest.raises(TypeError, match=r"^fft_conv1d: causal must be True or False, got "):  # "no" ran causal
        fft_conv1d(np.ones((1, 3, 19)), np.ones((2, 3, 4)), causal=causal)


def test_fft_conv1d_causal_is_refused_even_after_its_bool_twin_was_bound():
    from libnn.ops import fft_conv1d

    x, w = np.ones((1, 3, 23)), np.ones((2, 3, 4))
    fft_conv1d(x, w, causal=True)  # 1 equals True as a dict key: the key carries its type
    with pytest.raises(TypeError, match="causal must be True or False, got int 1"):
        fft_conv1d(x, w, causal=1)


@pytest.mark.parametrize("op, x, w, kernel", [
    ("fft_conv2d", (1, 3, 8, 8), (2, 3, 0, 3), "1x1, got 0x3"),
    ("fft_conv2d", (1, 3, 8, 8), (2, 3, 3, 0), "1x1, got 3x0"),
    ("fft_conv1d", (1, 3, 8), (2, 3, 0), "1, got 0")])
def test_fft_conv_refuses_a_zero_size_kernel_instead_of_returning_zeros(op, x, w, kernel):
    from libnn import ops

    with pytest.raises(ValueError, match=rf"^{op}: w's kernel must be at least {kernel} \(w shape "):
        getattr(ops, op)(np.ones(x), np.ones(w), np.ones(2))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=[[[[1.0]]]]), TypeError, r"x must be an array .* got builtins.list"),
    (dict(x=np.ones((3, 8, 8))), ValueError, r"x must be 4-D \(N, C, H, W\) and w 4-D \(K, C, kh, kw\), got "
                                             r"\(3, 8, 8\) and \(2, 3, 3, 3\)"),
    (dict(w=np.ones((2, 3, 3))), ValueError, r"w must be 4-D, got shape \(2, 3, 3\)"),
    (dict(b=np.ones(3)), ValueError, r"b must have shape \(2,\), got \(3,\)"),
    (dict(w=np.ones((2, 3, 3, 3), np.float32)), TypeError, "w has dtype fp32 but x has fp64"),
    (dict(x=np.ones((1, 3, 8, 8), bool), w=np.ones((2, 3, 3, 3), bool)), TypeError,
     "x must be real floating point .* got bool"),
    (dict(mode=None), ValueError, r"mode must be one of \('valid', 'same', 'full'\), got None"),
    (dict(padding=(1, -1)), ValueError, r"padding must be an int >= 0 or a tuple of 2 ints >= 0, got \(1, -1\)"),
], ids=["x-list", "x-rank", "w-rank", "b-shape", "w-dtype", "x-bool", "mode-None", "padding-negative"])
def test_fft_conv2d_arguments_out_of_their_domain(kwargs, error, match):
    from libnn.ops import fft_conv2d

    args = {"x": np.ones((1, 3, 8, 8)), "w": np.ones((2, 3, 3, 3)), **kwargs}
    with pytest.raises(error, match=f"^fft_conv2d: {match}"):
        fft_conv2d(args.pop("x"), args.pop("w"), **args)


@pytest.mark.parametrize("op, x, w", [("fft_conv2d", (1, 3, 8, 8), (2, 3, 3, 3)), ("fft_conv1d", (1, 3, 8), (2, 3, 3))])
@pytest.mark.parametrize("path", ["cufft", "custom"])
def test_fft_conv_gpu_paths_on_host_arrays_say_so(op, x, w, path):
    from libnn import ops

    # the registered op is fft_conv, which both functions run
    with pytest.raises(TypeError, match=rf"^fft_conv: path '{path}' runs on the GPU, but the arrays are host \(NumPy\) "
                                        r"arrays; move them with cupy.asarray"):
        getattr(ops, op)(np.ones(x), np.ones(w), path=path)


def test_fft_conv2d_reference_refuses_what_would_not_fit_before_allocating():
    from libnn.ops import fft_conv2d

    x = np.broadcast_to(np.float32(1.0), (1, 1, 2**17, 2**17))  # a view: 64 GiB as float32, no memory behind it
    with pytest.raises(MemoryError, match=r"^fft_conv2d: padding x \(131072, 131072\) to the FFT size \(131072, "
                                          r"131072\) needs .* \(\d+ bytes\), more than the .* of host RAM "
                                          "available$"):
        fft_conv2d(x, np.ones((1, 1, 3, 3), np.float32))


# --- ops.rope_frequencies (ops.rope's sweep: tests/test_rope_reference.py) ------------------------------

def test_rope_frequencies_refuses_a_huge_rotary_dim_before_allocating():
    from libnn.ops import rope_frequencies

    with pytest.raises(MemoryError, match=r"^rope_frequencies: rotary_dim=2199023255552 \(1099511627776 frequencies "
                                          r"and their temporaries\) needs .* \(\d+ bytes\), more than the .* of host "
                                          "RAM available$"):
        rope_frequencies(2**41)


# --- ops.rms_norm (its sweep: tests/test_rms_norm_reference.py; nn.RMSNorm: the constructor sweep) --------

def test_rms_norm_reference_refuses_what_would_not_fit_before_allocating():
    from libnn.ops import rms_norm

    x = np.broadcast_to(np.float32(1.5), (2**20, 2**20))  # a view: 4 TiB as float32, no memory behind it
    with pytest.raises(MemoryError, match=r"^rms_norm: .*x.* needs .* \(\d+ bytes\), more than the .* of host RAM "
                                          "available$"):
        rms_norm(x)


# --- ops.attention, layout THD (packed sequences) -------------------------------------------------------
# The rest of its sweep: tests/test_attention_packed.py (layout and packed together, seq_lens and attn_bias
# refused, ranks, token counts, offsets' shape, max_len 0, float lengths, lengths out of range).

def _packed(lengths=(3, 5), H=2, D=8, dtype=np.float32, spare=2):
    from libnn.ops.attention import PackedSequences

    lengths = np.asarray(lengths, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = np.ones((int(offsets[-1]) + spare, H, D), dtype)
    return q, lengths, offsets, PackedSequences(lengths, offsets, int(lengths.max()))


@pytest.mark.parametrize("checked", ["no", 1, None], ids=repr)
def test_packed_sequences_checked_must_be_a_bool(checked):
    from libnn.ops.attention import PackedSequences

    _, lengths, offsets, _ = _packed()
    with pytest.raises(TypeError, match=r"^PackedSequences: checked must be True or False, got "):  # "no" skipped it
        PackedSequences(lengths, offsets, 5, checked=checked)


@pytest.mark.parametrize("packed, error, match", [
    (lambda p: p(lengths="35", offsets=[0, 3, 8]), TypeError, r"^attention: packed.lengths must be an array .* got "
                                                              "builtins.str"),
    (lambda p: p(max_len=5.0), ValueError, r"^attention: packed.max_len must be a positive int, got 5.0"),
    (lambda p: p(max_len=True), ValueError, r"^attention: packed.max_len must be a positive int, got True"),
    (lambda p: p(max_len=None), ValueError, r"^attention: packed.max_len must be a positive int, got None"),
    (lambda p: p(max_len=-3), ValueError, r"^attention: packed.max_len must be a positive int, got -3"),
    (lambda p: p(offsets=np.array([0.0, 3.0, 8.0])), TypeError, r"^attention: packed.offsets must hold integers, got "
                                                                "dtype float64"),
    (lambda p: p(lengths=np.array([[3, 5]])), ValueError, r"^attention: packed.lengths must be \(B,\) and "
                                                          r"packed.offsets \(B \+ 1,\), got \(1, 2\) and \(3,\)"),
    (lambda p: p(offsets=np.array([0, 4, 8])), ValueError, r"^attention: packed sequences must lie within the 10 rows, "
                                                           r"one after another"),
], ids=["lengths-str", "max_len-float", "max_len-bool", "max_len-None", "max_len-negative", "offsets-float",
        "lengths-2d", "overlapping"])
def test_packed_sequences_are_checked(packed, error, match):
    from libnn.ops import attention
    from libnn.ops.attention import PackedSequences

    q, lengths, offsets, _ = _packed()

    def make(lengths=lengths, offsets=offsets, max_len=5):
        return PackedSequences(lengths, offsets, max_len)
    with pytest.raises(error, match=match):
        attention(q, q, q, layout="THD", packed=packed(make))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(q=np.ones((10, 2, 8), np.int32)), TypeError, r"^attention: q must be a floating-point array .* got int32"),
    (dict(k=np.ones((10, 2, 8), np.float16)), TypeError, "^attention: k has dtype fp16 but q has fp32"),
    (dict(k=np.ones((10, 3, 8), np.float32), v=np.ones((10, 3, 8), np.float32)), ValueError,
     r"^attention: q's 2 heads must be a multiple of k/v's 3 heads"),
    (dict(v=np.ones((10, 2, 4), np.float32)), ValueError, "^attention: q, k and v must share the head dimension D"),
    (dict(scale="0.5"), TypeError, r"^attention: scale must be a finite number or None \(1/sqrt\(D\)\), got str"),
    (dict(scale=float("nan")), ValueError, r"^attention: scale must be a finite number or None"),
    (dict(causal="top-left"), ValueError, r"^attention: causal must be False, True, 'top_left' or 'bottom_right', got "
                                          "'top-left'"),
    (dict(path="custom"), TypeError, r"^attention: path 'custom' runs on the GPU, but the arrays are host"),
    (dict(q=[[[1.0]]]), TypeError, r"^attention: q must be an array .* got builtins.list"),
], ids=["q-int", "k-fp16", "heads", "head-dim", "scale-str", "scale-nan", "causal-unknown", "path-custom", "q-list"])
def test_packed_attention_checks_the_dense_arguments_too(kwargs, error, match):
    from libnn.ops import attention

    q, _, _, packed = _packed()
    args = {"q": q, "k": q, "v": q, **kwargs}
    with pytest.raises(error, match=match):
        attention(args.pop("q"), args.pop("k"), args.pop("v"), layout="THD", packed=packed, **args)


def test_packed_reference_needs_the_memory_of_one_sequence_not_of_all_tokens_as_one():
    """The reference computes one sequence at a time: two short sequences among 2**20 tokens need their
    own scores, not the 2**20 x 2**20 of the whole (48 TiB: refused until the check counted per
    sequence); one sequence of 2**20 tokens is refused by its own scores, before anything is allocated."""
    from libnn.ops import attention
    from libnn.ops.attention import PackedSequences

    tokens = np.broadcast_to(np.ones((1, 2, 8), np.float32), (2**20, 2, 8))  # a view: 64 MiB, no memory behind it
    lengths, offsets = np.array([3, 5], np.int32), np.array([0, 3, 8], np.int32)
    o = attention(tokens, tokens, tokens, layout="THD", packed=PackedSequences(lengths, offsets, 5))
    assert o.shape == (2**20, 2, 8) and (o[:8] == 1).all() and not o[8:].any()
    whole = PackedSequences(np.array([2**20]), np.array([0, 2**20]), 2**20)
    with pytest.raises(MemoryError, match=r"^attention: the 1048576x1048576 scores of 1x2 \(B x Hq\) heads .* needs .* "
                                          r"\(\d+ bytes\), more than the .* of host RAM available$"):
        attention(tokens, tokens, tokens, layout="THD", packed=whole)


# --- Module.graphed and SequenceInputs (libnn.nn.graphs) ---------------------------------------------
# Its checks run before anything touches a GPU; buckets and max_captures: tests/test_graph_buckets.py.

class DeviceArrayStandIn:
    """Enough of a CuPy array (shape, dtype, device) for graphed()'s checks of its arguments, which run
    before any capture: libnn takes a type from a module named cupy.* with a `device` for CuPy's."""
    __module__ = "cupy.standin"

    def __init__(self, *shape):
        self.shape, self.ndim, self.dtype, self.device = shape, len(shape), np.dtype(np.float32), 0
        self.data = types.SimpleNamespace(device_id=0)


@pytest.mark.parametrize("warmup, error, match", [
    ("2", TypeError, "warmup must be an int, got str '2'"), (1.5, TypeError, "warmup must be an int, got float 1.5"),
    (None, TypeError, "warmup must be an int, got NoneType None"), (True, TypeError, "warmup must be an int, got bool"),
    (0, ValueError, r"warmup must be >= 1 \(plans must be built before the capture\), got 0"),
    (-3, ValueError, "warmup must be >= 1 .* got -3"),
], ids=repr)
def test_graphed_warmup_must_be_a_positive_int(warmup, error, match):
    with pytest.raises(error, match=rf"^Linear.graphed\(\): {match}"):
        nn.Linear(3, 2).graphed(warmup=warmup)


@pytest.mark.parametrize("build, call, error, match", [
    (dict(), lambda g: g([1, 2]), TypeError, r"argument #0 must be a cupy array or a hashable value \(it becomes part "
                                             r"of the capture's key\), got list"),
    (dict(), lambda g: g(DeviceArrayStandIn(2, 3), scale={"a": 1}), TypeError,
     "argument scale must be a cupy array or a hashable value"),
    (dict(buckets=(1, 2)), lambda g: g(3), ValueError, "buckets pad the array arguments, and this call has none"),
    (dict(buckets=(1, 2)), lambda g: g(DeviceArrayStandIn(0, 3)), ValueError, r"the batch is empty \(0 rows\)"),
    (dict(buckets=(1, 2)), lambda g: g(DeviceArrayStandIn(5, 3)), ValueError,
     r"a batch of 5 is larger than the largest of buckets \[1, 2\]; split the call, or add a larger bucket"),
    (dict(buckets=(1, 2)), lambda g: g(DeviceArrayStandIn(2, 3), DeviceArrayStandIn(3, 3)), ValueError,
     r"with buckets every array argument is \(batch, \.\.\.\) with the same batch as the first, \(2, 3\); argument #1 "
     r"has shape \(3, 3\)"),
    (dict(buckets=(1, 2)), lambda g: g(DeviceArrayStandIn()), ValueError,
     r"with buckets every array argument is \(batch, \.\.\.\) .* argument #0 has shape \(\)"),
], ids=["unhashable", "unhashable-keyword", "no-array", "empty-batch", "batch-too-large", "batch-mismatch", "0-d"])
def test_graphed_calls_check_their_arguments_before_capturing(build, call, error, match):
    with pytest.raises(error, match=rf"^Linear.graphed\(\): {match}"):
        call(nn.Linear(3, 2).graphed(**build))


@pytest.mark.parametrize("change, error, match", [
    (dict(outputs="last_hidden_state"), TypeError, r"outputs must be a tuple of output field names \(str\), got str "
                                                   "'last_hidden_state'"),  # `in` would test substrings
    (dict(outputs=["last_hidden_state"]), TypeError, "outputs must be a tuple of output field names"),
    (dict(outputs=("last_hidden_state", 1)), TypeError, "outputs must be a tuple of output field names"),
    (dict(mask=1), TypeError, r"mask must be the mask argument's name \(a str\), got int 1"),
    (dict(tokens=8), TypeError, r"tokens must be None or a keyword's name \(a str\), got int 8"),
    (dict(mask_position="1"), TypeError, "mask_position must be an int, got str '1'"),
    (dict(mask_position=True), TypeError, "mask_position must be an int, got bool True"),
    (dict(mask_position=-1), ValueError, "mask_position must be an int >= 0, got -1"),
    (dict(pack_from=0), ValueError, "pack_from must be an int >= 1, got 0"),
    (dict(pack_from=1.5), TypeError, "pack_from must be an int, got float 1.5"),
], ids=repr)
def test_sequence_inputs_are_checked_when_declared(change, error, match):
    from libnn.nn.graphs import SequenceInputs

    fields = {"mask": "attention_mask", "mask_position": 1, "outputs": ("last_hidden_state",), **change}
    with pytest.raises(error, match=f"^SequenceInputs: {match}"):
        SequenceInputs(**fields)


def test_bert_declares_valid_sequence_inputs():
    from libnn.models.bert import BertConfig, BertEncoder

    for unpad in (False, True):
        spec = BertEncoder(BertConfig.from_dict(BERT), unpad=unpad).graph_sequence_inputs
        assert spec.outputs == ("last_hidden_state",) and spec.pack_from >= 1


# --- nn.functional ------------------------------------------------------------------------------------

@pytest.mark.parametrize("function", ["key_padding", "key_padding_and_tokens"])
@pytest.mark.parametrize("valid, dtype, error, match", [
    ([[True, False]], np.float32, TypeError,
     r"valid must be a \(B, S\) array of booleans, True at the tokens, got list"),
    (np.array([True, False]), np.float32, ValueError, r"valid must be a \(B, S\) array of booleans, got shape \(2,\)"),
    (np.ones((2, 2, 2), bool), np.float32, ValueError, r"valid must be .* got shape \(2, 2, 2\)"),
    (np.array([[0.0, -np.inf]]), np.float32, TypeError,  # an additive mask would read as its opposite
     r"valid must hold booleans \(or 0/1 integers\), True at the tokens, got dtype float64"),
    (np.array([[True, False, True]]), np.int32, TypeError,
     r"dtype must be a floating-point dtype \(the attention's q dtype\), got <class 'numpy.int32'>"),
    (np.array([[True, False, True]]), "bogus", TypeError, "dtype must be a floating-point dtype .* got 'bogus'"),
    (np.array([[True, False, True]]), None, TypeError, "dtype must be a floating-point dtype .* got None"),
], ids=["list", "1-d", "3-d", "float-mask", "int-dtype", "unknown-dtype", "None-dtype"])
def test_key_padding_checks_the_mask_and_dtype(function, valid, dtype, error, match):
    from libnn.nn import functional

    with pytest.raises(error, match=f"^key_padding: {match}"):
        getattr(functional, function)(valid, dtype)


def test_key_padding_takes_0_1_integers_and_short_dtype_names():
    from libnn.nn import functional

    lengths, bias = functional.key_padding(np.array([[1, 0, 1], [1, 1, 0]]), "fp16")
    np.testing.assert_array_equal(lengths.lengths, [3, 2])
    assert bias.bias.dtype == np.float16 and bias.bias.ravel().tolist() == [0, -np.inf, 0, 0, 0, 0]


@pytest.mark.parametrize("x, valid, error, match", [
    (np.ones((3, 4)), np.ones((2, 3), bool), ValueError,  # NumPy broadcast it to a (2, 4) result
     r"x must be \(B, S, F\) and valid \(B, S\) with x's first two dimensions, got x \(3, 4\) and valid \(2, 3\)"),
    (np.ones((2, 3, 4)), np.ones((2, 4), bool), ValueError,
     r"x must be \(B, S, F\) and valid .* got x \(2, 3, 4\) and valid \(2, 4\)"),
    (np.ones((2, 3, 4), np.int64), np.ones((2, 3), bool), TypeError,  # the mean was rounded to an integer
     r"x must be a floating-point array \(fp16, bf16, fp32, fp64\), got int64"),
    ([[[1.0]]], np.ones((1, 1), bool), TypeError, "x must be an array .* got builtins.list"),
    (np.ones((2, 3, 4)), [[True] * 3] * 2, TypeError, r"valid must be a \(B, S\) array of booleans"),
    (np.ones((2, 3, 4)), np.ones((2, 3)), TypeError, "valid must hold booleans .* got dtype float64"),
], ids=["x-2d", "valid-shape", "x-int", "x-list", "valid-list", "valid-float"])
def test_masked_mean_checks_its_arrays(x, valid, error, match):
    from libnn.nn.functional import masked_mean

    with pytest.raises(error, match=f"^masked_mean: {match}"):
        masked_mean(x, valid)


@pytest.mark.parametrize("valid, capacity, error, match", [
    (np.array([True, False]), 4, ValueError, r"valid must be a \(B, S\) array of booleans, got shape \(2,\)"),
    (np.array([[0.0, 1.0]]), 4, TypeError, "valid must hold booleans .* got dtype float64"),
    (np.ones((2, 3), bool), 4.0, TypeError, "capacity must be an int >= 0 .* got float 4.0"),
    (np.ones((2, 3), bool), None, TypeError, "capacity must be an int >= 0 .* got NoneType None"),
    (np.ones((2, 3), bool), -1, TypeError, "capacity must be an int >= 0 .* got int -1"),
    (np.ones((2, 3), bool), 5, ValueError, "capacity 5 is below the 6 tokens valid marks"),
], ids=["1-d", "float-mask", "float-capacity", "None-capacity", "negative-capacity", "too-small"])
def test_token_packing_checks_the_mask_and_capacity(valid, capacity, error, match):
    from libnn.nn.functional import TokenPacking

    with pytest.raises(error, match=f"^TokenPacking: {match}"):
        TokenPacking(valid, capacity)


@pytest.mark.parametrize("x, rows, error, match", [
    (np.ones((3, 2)), np.array([0, 3], np.int32), IndexError, r"rows must be -1 \(a zero row\) or in 0..2, got 0..3"),
    (np.ones((3, 2)), np.array([-2, 0], np.int32), IndexError, r"rows must be -1 .* got -2..0"),
    (np.ones((3, 2)), np.array([0, 1]), TypeError, "rows must be int32 row indices, got dtype int64"),
    (np.ones((3, 2)), np.array([[0]], np.int32), ValueError, r"rows must be 1-D, got shape \(1, 1\)"),
    (np.ones(3), np.array([0], np.int32), ValueError, r"x must be 2-D, got shape \(3,\)"),
    ([[1.0]], np.array([0], np.int32), TypeError, "x must be a 2-D array, got list"),
], ids=["past-the-end", "below--1", "int64-rows", "2-d-rows", "1-d-x", "list-x"])
def test_gather_rows_checks_its_arrays_and_host_indices(x, rows, error, match):
    from libnn.nn.functional import gather_rows

    with pytest.raises(error, match=f"^gather_rows: {match}"):
        gather_rows(x, rows)


def test_gather_rows_on_the_host_gives_zeros_for_minus_1():
    from libnn.nn.functional import gather_rows

    x = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(gather_rows(x, np.array([2, -1, 0], np.int32)), [[4, 5], [0, 0], [0, 1]])


@pytest.mark.parametrize("x, w_qkv, heads, match", [
    ((2, 3, 4), (12, 4), 0, "num_heads must be a positive int, got 0"),
    ((2, 3, 4), (12, 4), -2, "num_heads must be a positive int, got -2"),
    ((2, 3, 4), (12, 4), 1.5, "num_heads must be a positive int, got 1.5"),
    ((2, 3, 4), (12, 4), True, "num_heads must be a positive int, got True"),
    ((2, 3, 4), (12, 4), 3, r"w_qkv must be \(3E, E\), 3 projections of num_heads=3 heads each, got shape \(12, 4\)"),
    ((2, 3, 4), (10, 4), 2, r"w_qkv must be \(3E, E\), .* got shape \(10, 4\)"),
    ((3, 4), (12, 4), 2, r"x must be \(B, S, E\), got shape \(3, 4\)"),
], ids=["heads-0", "heads-negative", "heads-float", "heads-bool", "heads-not-dividing", "w-rows", "x-2d"])
def test_packed_self_attention_checks_heads_and_shapes(x, w_qkv, heads, match):
    from libnn.nn.functional import packed_self_attention

    with pytest.raises(ValueError, match=f"^packed_self_attention: {match}"):
        packed_self_attention(np.ones(x, np.float32), np.ones(w_qkv, np.float32), None, heads)


@pytest.mark.parametrize("x, w_qkv, path, error, match", [
    (np.ones((2, 3, 4), np.int32), np.ones((12, 4), np.int32), "auto", TypeError,
     r"x must be a floating-point array \(fp16, bf16, fp32, fp64\), got int32"),
    (np.ones((2, 3, 4), np.float32), np.ones((12, 4), np.float16), "auto", TypeError,
     "w_qkv has dtype fp16 but x has fp32; cast them to one dtype"),
    (np.ones((2, 3, 4), np.float32), np.ones((12, 4), np.float32), 3, TypeError,
     "path must be a string or a dict of op name to path, got int 3"),
], ids=["int", "mixed-dtypes", "path-int"])
def test_packed_self_attention_checks_dtypes_and_path(x, w_qkv, path, error, match):
    from libnn.nn.functional import packed_self_attention

    with pytest.raises(error, match=f"^packed_self_attention: {match}"):
        packed_self_attention(x, w_qkv, None, 2, path=path)


def test_packed_self_attention_refuses_arrays_on_two_devices():
    from libnn.nn import functional

    class DeviceArray(np.ndarray):  # stands in for a CuPy array: is_cupy looks at the type
        pass

    x = np.ones((2, 3, 4), np.float32)
    w = np.ones((12, 4), np.float32).view(DeviceArray)
    original = functional.is_cupy
    functional.is_cupy = lambda a: isinstance(a, DeviceArray)
    try:
        with pytest.raises(TypeError, match="^packed_self_attention: x and w_qkv must be on one device"):
            functional.packed_self_attention(x, w, None, 2)
    finally:
        functional.is_cupy = original


# --- nn.Sequential ---------------------------------------------------------------------------------

def test_sequential_refuses_a_child_that_is_not_a_module():
    with pytest.raises(TypeError, match=r"Sequential: module 1 must be a libnn.nn.Module, got function"):
        nn.Sequential(nn.ReLU(), lambda x: x)


@pytest.mark.parametrize("index", [3, -4, 10**12])
def test_sequential_index_out_of_range_is_an_index_error(index):
    with pytest.raises(IndexError, match=rf"Sequential: index {index} is out of range for 3 modules"):
        nn.Sequential(nn.ReLU(), nn.SiLU(), nn.GELU())[index]


def test_sequential_of_nothing_has_no_item_0():
    with pytest.raises(IndexError, match="out of range for 0 modules"):
        nn.Sequential()[0]


@pytest.mark.parametrize("index", ["0", 1.0, None])
def test_sequential_index_must_be_an_int(index):
    with pytest.raises(TypeError, match="Sequential: index must be an int"):
        nn.Sequential(nn.ReLU())[index]


def test_sequential_negative_index_counts_from_the_end():
    layers = (nn.ReLU(), nn.SiLU(), nn.GELU())
    seq = nn.Sequential(*layers)
    assert seq[-1] is layers[2] and seq[0] is layers[0] and len(seq) == 3


# --- nn.BatchNorm2d --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
def test_batchnorm_refuses_non_float_input(rng, dtype):
    x = (rng.standard_normal((2, 3, 3, 4)) * 10).astype(dtype)
    with pytest.raises(TypeError, match=rf"BatchNorm2d: x must be a floating-point array .* got dtype {np.dtype(dtype)}"):
        nn.BatchNorm2d(4)(x)


def test_batchnorm_refuses_a_2d_input_instead_of_broadcasting(rng):
    with pytest.raises(ValueError, match=r"BatchNorm2d: x must be 4-D \(N, H, W, C\), got shape \(8, 4\)"):
        nn.BatchNorm2d(4)(rng.standard_normal((8, 4)))


@pytest.mark.parametrize("layout, shape", [("NHWC", (2, 3, 3, 5)), ("NCHW", (2, 5, 3, 3))])
def test_batchnorm_refuses_a_channel_mismatch(rng, layout, shape):
    with pytest.raises(ValueError, match=rf"BatchNorm2d: x has 5 channels .*layout {layout}\) but the layer has "
                                         r"num_features=4"):
        nn.BatchNorm2d(4, layout=layout)(rng.standard_normal(shape))


def test_batchnorm_float_input_still_computes_the_affine_map(rng):
    layer = nn.BatchNorm2d(3, dtype="fp64")
    layer.load_state_dict({"weight": np.array([1.0, 2.0, 3.0]), "bias": np.array([0.5, -0.5, 1.0]),
                           "running_mean": np.array([0.1, 0.2, 0.3]), "running_var": np.array([1.0, 4.0, 0.25])})
    x = rng.standard_normal((2, 4, 4, 3))
    expected = (x - [0.1, 0.2, 0.3]) / np.sqrt(np.array([1.0, 4.0, 0.25]) + 1e-5) * [1, 2, 3] + [0.5, -0.5, 1.0]
    np.testing.assert_allclose(layer(x), expected, rtol=1e-12)


@pytest.mark.parametrize("layout", ["NCWH", "nhwc", None])
def test_batchnorm_refuses_an_unknown_layout_at_construction(layout):
    with pytest.raises(ValueError, match=rf"BatchNorm2d: layout must be one of \('NHWC', 'NCHW'\), got {layout!r}"):
        nn.BatchNorm2d(4, layout=layout)


# --- activations -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU])
@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_, np.complex128])
def test_activations_refuse_non_float_input(rng, layer, dtype):
    x = (rng.standard_normal((4, 5)) * 3).astype(dtype)
    with pytest.raises(TypeError, match=rf"{layer.__name__}: x must be a floating-point array"):
        layer()(x)


@pytest.mark.parametrize("layer", [nn.ReLU, nn.GELU])
def test_activations_refuse_a_list(layer):
    with pytest.raises(TypeError, match=rf"{layer.__name__}: x must be an array"):
        layer()([1.0, 2.0])


# --- nn.Conv2dBNAct ---------------------------------------------------------------------------------

@pytest.mark.parametrize("build, error, match", [
    (lambda: nn.Conv2dBNAct(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(4), None), ValueError,
     "the BatchNorm2d has num_features=4 but the Conv2d before it has out_channels=6"),
    (lambda: nn.Conv2dBNAct(nn.Linear(2, 3), nn.BatchNorm2d(3), None), TypeError, "conv must be a Conv2d, got Linear"),
    (lambda: nn.Conv2dBNAct(nn.Conv2d(2, 3, 3), nn.ReLU(), None), TypeError, "bn must be a BatchNorm2d, got ReLU"),
    (lambda: nn.Conv2dBNAct(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), "tanh"), ValueError, "activation must be one of"),
    (lambda: nn.Conv2dBNAct(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), None, fold="no"), TypeError,
     "fold must be True or False"),
], ids=["channels", "conv", "bn", "activation", "fold"])
def test_conv_bn_fusion_checks_its_parts(build, error, match):
    with pytest.raises(error, match=f"^Conv2dBNAct: {match}"):
        build()


def test_sequential_conv_then_mismatched_batchnorm_is_named_not_a_broadcast_error():
    model = nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="num_features=4 but the Conv2d before it has out_channels=6"):
        model(np.ones((1, 5, 5, 2), np.float32))


# --- nn.MultiheadAttention and nn.TransformerEncoderLayer: forward ---------------------------------

@pytest.mark.parametrize("layer, call, error, match", [
    ("MultiheadAttention", lambda m: m(np.ones((2, 3, 8)), is_causal="no"), TypeError,
     "is_causal must be True or False, got str 'no'"),  # truthy: it applied the causal mask
    ("TransformerEncoderLayer", lambda m: m(np.ones((2, 3, 8), np.float32), is_causal=1), TypeError,
     "is_causal must be True or False, got int 1"),
    ("MultiheadAttention", lambda m: m(np.ones((2, 3, 8), np.int32)), TypeError,
     "query must be a floating-point array .* got dtype int32"),
    ("MultiheadAttention", lambda m: m(np.ones((2, 3, 8), np.float32), np.ones((2, 3, 8), np.complex64),
                                       np.ones((2, 3, 8), np.complex64)), TypeError,
     "key must be a floating-point array .* got dtype complex64"),
    ("TransformerEncoderLayer", lambda m: m(np.ones((2, 3, 8), bool)), TypeError,
     "src must be a floating-point array .* got dtype bool"),
    ("TransformerEncoderLayer", lambda m: m([[[1.0] * 8]]), TypeError, "src must be an array"),
], ids=["mha-is_causal", "encoder-is_causal", "mha-int", "mha-complex-key", "encoder-bool", "encoder-list"])
def test_transformer_layers_check_their_inputs_and_flags(layer, call, error, match):
    with pytest.raises(error, match=f"^{layer}: {match}"):
        call(CONSTRUCTORS[layer]())


# --- pooling layers --------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [nn.MaxPool2d, nn.AvgPool2d])
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kernel_size=0), ValueError, "kernel_size must be a positive int or a pair of them, got 0"),
    (dict(kernel_size=1.5), TypeError, "kernel_size must be an int or a pair of ints, got float 1.5"),
    (dict(kernel_size=None), TypeError, "kernel_size must be an int or a pair of ints, got NoneType"),
    (dict(kernel_size=(2, 2, 2)), TypeError, "kernel_size must be an int or a pair of ints"),
    (dict(kernel_size=2, stride=0), ValueError, "stride must be a positive int or a pair of them, got 0"),
    (dict(kernel_size=2, stride=np.array([1, 1])), TypeError, "stride must be an int or a pair of ints"),
    (dict(kernel_size=2, padding=-1), ValueError, "padding must be a non-negative int or a pair of them, got -1"),
    (dict(kernel_size=2, padding=2), ValueError, r"padding \(2, 2\) must be at most half the kernel size \(2, 2\)"),
    (dict(kernel_size=2, layout="NCWH"), ValueError, "layout must be one of"),
])
def test_pooling_layers_check_their_own_arguments(layer, kwargs, error, match):
    with pytest.raises(error, match=f"^{layer.__name__}: {match}") as caught:
        layer(**kwargs)
    assert "conv2d" not in str(caught.value)


# --- Module.load_state_dict and Module.to ---------------------------------------------------------

def test_load_state_dict_copies_the_callers_arrays(rng):
    model = nn.Sequential(nn.Linear(3, 2, seed=0))
    weight, bias = rng.standard_normal((2, 3)).astype(np.float32), np.zeros(2, np.float32)
    model.load_state_dict({"0.weight": weight, "0.bias": bias})
    x = rng.standard_normal((4, 3)).astype(np.float32)
    before, version = model(x), model.version
    weight[...] = 99.0  # the caller reuses its buffer
    assert not np.any(model.state_dict()["0.weight"] == 99.0) and model.version == version
    np.testing.assert_array_equal(model(x), before)


@pytest.mark.parametrize("value, dtype", [(np.ones((2, 3), np.complex64), "complex64"),
                                          (np.full((2, 3), "a"), "<U1"),
                                          (np.array([[1.0, None, 2.0]] * 2, dtype=object), "object")], ids=str)
def test_load_state_dict_refuses_values_that_are_not_real_numbers_naming_the_key(value, dtype):
    layer = nn.Linear(3, 2, seed=0)
    weight = layer.weight
    with pytest.raises(TypeError, match=rf"^Linear.load_state_dict: weight has dtype {dtype}; parameters take real "
                                        r"numbers"):
        layer.load_state_dict({"weight": value, "bias": np.zeros(2)})
    assert layer.weight is weight  # nothing changed


@pytest.mark.parametrize("state", [[("weight", np.ones((2, 3)))], None, "weights.npz"], ids=repr)
def test_load_state_dict_needs_a_dict(state):
    with pytest.raises(TypeError, match=r"^Linear.load_state_dict: state must be a dict of arrays by key, got"):
        nn.Linear(3, 2).load_state_dict(state)


@pytest.mark.parametrize("target, error", [("tpu", ValueError), ("int32", ValueError), (np.int32, TypeError),
                                           (None, TypeError), (3, TypeError), (np.complex64, TypeError)], ids=repr)
def test_to_names_devices_and_float_dtypes(target, error):
    with pytest.raises(error, match=r"^Linear.to: target must be a device \('cpu', 'gpu', 'cuda'\) or a "
                                    r"floating-point dtype \(fp16, bf16, fp32 or fp64\), got"):
        nn.Linear(3, 2).to(target)


def test_to_a_float_dtype_and_back_to_cpu_works():
    layer = nn.Linear(3, 2).to("fp64").to(np.float16).to("cpu")
    assert layer.weight.dtype == np.float16


@pytest.mark.skipif(not NO_GPU, reason="checks the message on machines without a GPU")
@pytest.mark.parametrize("target", ["gpu", "cuda"], ids=["to-gpu", "to-cuda"])  # an id "gpu" marks it a GPU test
def test_to_gpu_without_a_gpu_says_so(target):
    with pytest.raises(ValueError, match=rf"^Sequential.to: device='{target}' needs a GPU, and there is none here"):
        nn.Sequential(nn.Linear(3, 2)).to(target)


# --- nn.weights.read and Module.load ---------------------------------------------------------------

def _safetensors_bytes(tmp_path) -> bytes:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    good = tmp_path / "good.safetensors"
    safetensors_numpy.save_file({"w": np.arange(64, dtype=np.float32) + 1}, str(good))
    return good.read_bytes()


def _npz_bytes(tmp_path) -> bytes:
    good = tmp_path / "good.npz"
    np.savez(good, w=np.arange(1000.0) + 1, b=np.ones(3))
    return good.read_bytes()


BAD_FILES = {
    "empty.npz": (lambda tmp: b"", "is empty"),
    "empty.safetensors": (lambda tmp: b"", "is empty"),
    "truncated.npz": (lambda tmp: _npz_bytes(tmp)[:500], "is not a readable .npz archive"),
    "tail_cut.npz": (lambda tmp: _npz_bytes(tmp)[:-30], "is not a readable .npz archive"),
    "truncated.safetensors": (lambda tmp: _safetensors_bytes(tmp)[:-40], "is not a readable .safetensors file"),
    "text.safetensors": (lambda tmp: b"this is not a safetensors file at all", "is not a readable .safetensors file"),
    "npz_as.safetensors": (lambda tmp: _npz_bytes(tmp), "is not a readable .safetensors file"),
    "text.npz": (lambda tmp: b"hello, not a zip archive", "is not a readable .npz archive"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_read_names_the_file_of_a_broken_weights_file(tmp_path, name):
    make, match = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(make(tmp_path))
    with pytest.raises(ValueError, match=match) as caught:
        weights.read(path)
    assert str(path) in str(caught.value)


def test_read_refuses_object_arrays_naming_the_file_and_array(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, fine=np.ones(2), bad=np.array([1, "x", None], dtype=object))
    with pytest.raises(ValueError, match=r"objects.npz' is not a readable .npz archive \(at array 'bad'\).*"
                                         "Object arrays cannot be loaded"):
        weights.read(path)


def test_read_refuses_string_arrays_naming_the_tensor(tmp_path):
    path = tmp_path / "strings.npz"
    np.savez(path, names=np.array(["a", "b"]))
    with pytest.raises(ValueError, match=r"strings.npz': tensor 'names' has dtype <U1; weights must be numbers"):
        weights.read(path)


def test_read_refuses_a_single_array_saved_as_npz(tmp_path):
    path = tmp_path / "single.npy"
    np.save(path, np.ones(3))
    renamed = path.rename(tmp_path / "single.npz")
    with pytest.raises(ValueError, match="single.npz' is not a readable .npz archive.*a single array"):
        weights.read(renamed)


def test_load_of_a_directory_says_it_is_a_directory(tmp_path):
    with pytest.raises(ValueError, match=rf"weights file '{tmp_path}' is a directory"):
        nn.Linear(2, 3).load(tmp_path)


def test_read_of_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.npz' does not exist"):
        weights.read(tmp_path / "missing.npz")


@pytest.mark.parametrize("path", [None, 3, ["a.npz"]])
def test_read_refuses_a_path_that_is_not_a_path(path):
    with pytest.raises(TypeError, match="weights.read: path must be a str or pathlib.Path"):
        weights.read(path)


def test_read_refuses_an_unknown_suffix(tmp_path):
    path = tmp_path / "w.pt"
    path.write_bytes(b"\x80\x02")
    with pytest.raises(ValueError, match=r"w.pt': expected one of \('.safetensors', '.npz'\), got '.pt'"):
        weights.read(path)


def test_read_round_trips_a_good_file(tmp_path, rng):
    w = rng.standard_normal((3, 2)).astype(np.float32)
    path = tmp_path / "ok.npz"
    np.savez(path, weight=w)
    np.testing.assert_array_equal(weights.read(path)["weight"], w)


# --- BertEncoder.from_pretrained and BertConfig ----------------------------------------------------

BERT = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
        "max_position_embeddings": 8}


def bert_directory(tmp_path, config_text: str, index_text: str | None = None):
    """A checkpoint directory with this config.json (and model.safetensors.index.json), no weights."""
    (tmp_path / "config.json").write_text(config_text)
    if index_text is not None:
        (tmp_path / "model.safetensors.index.json").write_text(index_text)
    return tmp_path


@pytest.mark.parametrize("text, error, match", [
    ("{not json", ValueError, r"config.json' is not valid JSON: Expecting property name"),
    ("", ValueError, r"config.json' is not valid JSON"),
    ("[1, 2]", TypeError, r"config.json must be a JSON object of the config's fields by name, got list"),
    ('"bert"', TypeError, r"config.json must be a JSON object .* got str"),
], ids=["corrupt", "empty", "list", "string"])
def test_bert_config_files_that_are_not_json_objects(tmp_path, text, error, match):
    from libnn.models.bert import BertEncoder

    with pytest.raises(error, match=match) as caught:
        BertEncoder.from_pretrained(bert_directory(tmp_path, text))
    assert str(tmp_path) in str(caught.value)


@pytest.mark.parametrize("change, error, match", [
    ({"hidden_size": "8"}, TypeError, "hidden_size must be an int, got str '8'"),
    ({"hidden_size": 8.0}, TypeError, "hidden_size must be an int, got float 8.0"),
    ({"num_hidden_layers": True}, TypeError, "num_hidden_layers must be an int, got bool True"),
    ({"intermediate_size": None}, TypeError, "intermediate_size must be an int, got NoneType None"),
    ({"num_attention_heads": 0}, ValueError, "num_attention_heads must be a positive int, got 0"),
    ({"num_attention_heads": -2}, ValueError, "num_attention_heads must be a positive int, got -2"),
    ({"num_hidden_layers": -1}, ValueError, "num_hidden_layers must be a non-negative int, got -1"),
    ({"vocab_size": -5}, ValueError, "vocab_size must be a positive int, got -5"),
    ({"vocab_size": 0}, ValueError, "vocab_size must be a positive int, got 0"),
    ({"type_vocab_size": 0}, ValueError, "type_vocab_size must be a positive int, got 0"),
    ({"max_position_embeddings": [8]}, TypeError, r"max_position_embeddings must be an int, got list \[8\]"),
    ({"layer_norm_eps": "1e-12"}, TypeError, "layer_norm_eps must be a real number, got str"),
    ({"layer_norm_eps": 0}, ValueError, "layer_norm_eps must be > 0, got 0"),
    ({"pad_token_id": "0"}, TypeError, "pad_token_id must be an int, got str '0'"),
    ({"hidden_act": ["gelu"]}, ValueError, r"hidden_act \['gelu'\] is not supported"),
    ({"model_type": {"bert": 1}}, ValueError, r"model_type \{'bert': 1\} is not supported"),
    ({"position_embedding_type": ["absolute"]}, ValueError, "position_embedding_type .* is not supported"),
], ids=repr)
def test_bert_config_fields_are_checked_naming_the_file(tmp_path, change, error, match):
    import json

    from libnn.models.bert import BertEncoder

    directory = bert_directory(tmp_path, json.dumps({**BERT, **change}))
    with pytest.raises(error, match=rf"^BertEncoder: {directory / 'config.json'}: {match}"):
        BertEncoder.from_pretrained(directory)


def test_bert_huge_vocabulary_is_refused_before_the_checkpoint_is_read(tmp_path):
    import json

    from libnn.models.bert import BertEncoder

    directory = bert_directory(tmp_path, json.dumps({**BERT, "vocab_size": 10**12}))  # and no weights at all
    with pytest.raises(MemoryError, match=r"^BertEncoder.from_pretrained: the model of .*config.json \(vocab_size="
                                          r"1000000000000, hidden_size=8, 1 layers: \d+ parameters\) needs .*, more "
                                          "than the .* of host RAM available$"):
        BertEncoder.from_pretrained(directory)


@pytest.mark.parametrize("index, match", [
    ("{}", "must be a JSON object whose 'weight_map' maps each tensor's name to its shard file"),
    ('{"metadata": {}}', "must be a JSON object whose 'weight_map'"),
    ('{"weight_map": []}', "must be a JSON object whose 'weight_map'"),
    ("[1]", "must be a JSON object whose 'weight_map'"),
    ("{bad", "is not valid JSON"),
    ('{"weight_map": {"a": "../../elsewhere.safetensors"}}', "names the shard '../../elsewhere.safetensors'; "
                                                             "expected a file name in the checkpoint's directory"),
    ('{"weight_map": {"a": 3}}', "names the shard 3"),
], ids=repr)
def test_bert_shard_index_is_checked_naming_the_file(tmp_path, index, match):
    import json

    from libnn.models.bert import BertEncoder

    directory = bert_directory(tmp_path, json.dumps(BERT), index)
    with pytest.raises(ValueError, match=rf"^BertEncoder.from_pretrained: '.*model.safetensors.index.json' {match}"):
        BertEncoder.from_pretrained(directory)


@pytest.mark.parametrize("directory", [None, 3, ["model"]], ids=repr)
def test_bert_directory_must_be_a_path(directory):
    from libnn.models.bert import BertEncoder

    with pytest.raises(TypeError, match="^BertEncoder.from_pretrained: directory must be a str or pathlib.Path"):
        BertEncoder.from_pretrained(directory)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dtype="int8"), ValueError, "dtype 'int8': unknown dtype"), (dict(dtype=np.int32), TypeError, "dtype must be"),
    (dict(device="tpu"), ValueError, "device must be one of"),
], ids=repr)
def test_bert_from_pretrained_checks_dtype_and_device_before_reading(tmp_path, kwargs, error, match):
    import json

    from libnn.models.bert import BertEncoder

    with pytest.raises(error, match=f"^BertEncoder.from_pretrained: {match}"):
        BertEncoder.from_pretrained(bert_directory(tmp_path, json.dumps(BERT)), **kwargs)


@pytest.mark.skipif(not NO_GPU, reason="checks the message on machines without a GPU")
def test_bert_on_a_gpu_without_one_says_so_before_reading(tmp_path):
    import json

    from libnn.models.bert import BertEncoder

    with pytest.raises(ValueError, match="^BertEncoder.from_pretrained: device='gpu' needs a GPU, and there is none"):
        BertEncoder.from_pretrained(bert_directory(tmp_path, json.dumps(BERT)), device="gpu")


def test_bert_encoder_checks_a_config_built_by_hand():
    from libnn.models.bert import BertConfig, BertEncoder

    with pytest.raises(ValueError, match="^BertEncoder: num_attention_heads must be a positive int, got 0"):
        BertEncoder(BertConfig(**{**BERT, "num_attention_heads": 0}))
    with pytest.raises(TypeError, match="^BertEncoder: config must be a BertConfig"):
        BertEncoder(BERT)


def test_bert_checkpoint_with_a_complex_tensor_names_the_directory_and_key(tmp_path):
    import json

    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from libnn.models.bert import BertConfig, BertEncoder

    state = BertEncoder(BertConfig.from_dict(BERT)).state_dict()
    state["pooler.dense.bias"] = state["pooler.dense.bias"].astype(np.complex64)
    directory = bert_directory(tmp_path, json.dumps(BERT))
    try:
        safetensors_numpy.save_file(state, str(directory / "model.safetensors"))
    except Exception:  # noqa: BLE001  (an older safetensors has no complex dtype)
        pytest.skip("this safetensors cannot store complex64")
    with pytest.raises(TypeError, match=rf"^BertEncoder.from_pretrained\('{directory}'\): .*pooler.dense.bias has "
                                        "dtype complex64"):
        BertEncoder.from_pretrained(directory)


def test_load_state_dict_assign_must_be_a_bool():
    with pytest.raises(TypeError, match="^Linear.load_state_dict: assign must be True or False, got str 'no'"):
        nn.Linear(3, 2).load_state_dict({"weight": np.ones((2, 3)), "bias": np.ones(2)}, assign="no")


def test_load_state_dict_assign_keeps_the_array_and_a_plain_load_copies_it():
    layer = nn.Linear(3, 2)
    weight, bias = np.ones((2, 3), np.float32), np.zeros(2, np.float32)
    layer.load_state_dict({"weight": weight, "bias": bias}, assign=True)
    assert layer.weight is weight
    layer.load_state_dict({"weight": weight, "bias": bias.astype(np.float64)}, assign=True)
    assert layer.bias.dtype == np.float32  # cast to the layer's dtype: a new array all the same
    layer.load_state_dict({"weight": weight.copy(), "bias": bias})
    assert layer.bias is not bias


# --- nn.weights.write and Module.save ---------------------------------------------------------------

@pytest.mark.parametrize("make_path, state, error, match", [
    (lambda tmp: None, {}, TypeError, "^weights.write: path must be a str or pathlib.Path, got NoneType"),
    (lambda tmp: tmp / "w.pt", {}, ValueError, r"w.pt': expected one of \('.safetensors', '.npz'\), got '.pt'"),
    (lambda tmp: tmp, {}, ValueError, "expected one of"),  # a directory: no suffix
    (lambda tmp: tmp / "missing" / "w.npz", {}, FileNotFoundError, "the directory '.*missing' does not exist"),
    (lambda tmp: tmp / "w.npz", [("w", np.ones(2))], TypeError, "^weights.write: state must be a dict of arrays"),
    (lambda tmp: tmp / "w.npz", {"names": np.array(["a"])}, ValueError,
     "tensor 'names' has dtype <U1; weights must be"),
    (lambda tmp: tmp / "w.npz", {"objects": np.array([None])}, ValueError, "tensor 'objects' has dtype object"),
], ids=["None", "suffix", "directory", "no-directory", "list", "strings", "objects"])
def test_write_refuses_what_read_would_refuse_before_writing(tmp_path, make_path, state, error, match):
    path = make_path(tmp_path)
    with pytest.raises(error, match=match):
        weights.write(path, state)
    assert not (tmp_path / "w.npz").exists()


def test_save_of_a_model_into_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="the directory '.*nowhere' does not exist"):
        nn.Linear(2, 3).save(tmp_path / "nowhere" / "w.safetensors")


# --- the CLI ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, match", [("0", "must be at least 1, got 0"), ("-1", "must be at least 1, got -1"),
                                          ("two", "expected an integer, got 'two'")])
def test_demo_batch_must_be_a_positive_int(batch, match):
    result = run_libnn("demo", "--batch", batch)
    assert result.returncode == 2 and f"argument --batch: {match}" in result.stderr, result.stderr


def test_demo_run_refuses_batch_0_when_called_directly():
    from libnn.demo import run

    with pytest.raises(ValueError, match="--batch must be a positive int, got 0"):
        run(batch=0)


def test_run_cnn_without_safetensors_is_one_line_saying_what_to_install():
    result = run_libnn("run", "cnn", "--batch", "16", prelude="sys.modules['safetensors'] = None  # not installed")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "needs the safetensors package: pip install safetensors" in result.stderr


@pytest.mark.parametrize("option", ["--m", "--n", "--k"])
def test_plans_sizes_must_be_positive(option):
    args = {"--m": "8", "--n": "8", "--k": "8", option: "0"}
    result = run_libnn("plans", "linear", *[item for pair in args.items() for item in pair])
    assert result.returncode == 2 and f"argument {option}: must be at least 1, got 0" in result.stderr


def test_check_kernels_for_an_arch_too_old_is_short_and_shows_progress():
    pytest.importorskip("cuda.bindings.nvrtc")
    result = run_libnn("check-kernels", "--arch", "sm_75")
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) < 20, result.stderr
    assert lines[0].startswith("libnn check-kernels: [1/")
    assert "failed at line" in result.stderr and "of the generated PTX: Feature" in result.stderr
    assert "see the log below" not in result.stderr and "more error lines" in result.stderr


# --- constructors: huge sizes are refused before allocating ----------------------------------------

@pytest.mark.parametrize("build, name", [
    (lambda: nn.Linear(10**6, 10**5), "Linear: in_features=1000000, out_features=100000"),
    (lambda: nn.Embedding(10**9, 64), "Embedding: num_embeddings=1000000000, embedding_dim=64"),
    (lambda: nn.Conv2d(10**5, 10**5, 7), r"Conv2d: weight of shape \(100000, 100000, 7, 7\)"),
    (lambda: nn.LayerNorm(10**12), "LayerNorm: normalized_shape"),
    (lambda: nn.BatchNorm2d(10**12), "BatchNorm2d: num_features"),
    (lambda: nn.MultiheadAttention(10**6, 2), "MultiheadAttention: embed_dim=1000000"),
    (lambda: nn.TransformerEncoderLayer(10**5, 2, 10**6),
     "TransformerEncoderLayer: d_model=100000, dim_feedforward=1000000"),
])
def test_huge_layers_are_refused_with_the_bytes_needed_and_available(build, name):
    with pytest.raises(MemoryError, match=rf"^{name} needs .* \(\d+ bytes\), more than the .* \(\d+ bytes\) of "
                                          "host RAM available$"):
        build()


# --- constructors: the sweep -----------------------------------------------------------------------

CONSTRUCTORS = {
    "Linear": lambda **kw: nn.Linear(**{"in_features": 4, "out_features": 3, **kw}),
    "Conv2d": lambda **kw: nn.Conv2d(**{"in_channels": 4, "out_channels": 6, "kernel_size": 3, **kw}),
    "Embedding": lambda **kw: nn.Embedding(**{"num_embeddings": 10, "embedding_dim": 4, **kw}),
    "LayerNorm": lambda **kw: nn.LayerNorm(**{"normalized_shape": 8, **kw}),
    "RMSNorm": lambda **kw: nn.RMSNorm(**{"dim": 8, **kw}),
    "BatchNorm2d": lambda **kw: nn.BatchNorm2d(**{"num_features": 8, **kw}),
    "MaxPool2d": lambda **kw: nn.MaxPool2d(**{"kernel_size": 2, **kw}),
    "AvgPool2d": lambda **kw: nn.AvgPool2d(**{"kernel_size": 2, **kw}),
    "Flatten": lambda **kw: nn.Flatten(**kw),
    "Dropout": lambda **kw: nn.Dropout(**kw),
    "Softmax": lambda **kw: nn.Softmax(**kw),
    "LogSoftmax": lambda **kw: nn.LogSoftmax(**kw),
    "GELU": lambda **kw: nn.GELU(**kw),
    "Sequential": lambda **kw: nn.Sequential(nn.ReLU(), **kw),
    "MultiheadAttention": lambda **kw: nn.MultiheadAttention(**{"embed_dim": 8, "num_heads": 2, **kw}),
    "TransformerEncoderLayer": lambda **kw: nn.TransformerEncoderLayer(**{"d_model": 8, "nhead": 2,
                                                                         "dim_feedforward": 16, **kw}),
}

# (layer, argument, minimum): sizes that must be ints >= minimum
SIZES = [("Linear", "in_features", 1), ("Linear", "out_features", 1), ("Conv2d", "in_channels", 1),
         ("Conv2d", "out_channels", 1), ("Conv2d", "groups", 1), ("Embedding", "num_embeddings", 0),
         ("Embedding", "embedding_dim", 0), ("BatchNorm2d", "num_features", 1), ("MultiheadAttention", "embed_dim", 1),
         ("MultiheadAttention", "num_heads", 1), ("TransformerEncoderLayer", "d_model", 1),
         ("TransformerEncoderLayer", "nhead", 1), ("TransformerEncoderLayer", "dim_feedforward", 1),
         ("RMSNorm", "dim", 1)]
# (layer, argument, minimum): an int or a pair of ints >= minimum
PAIRS = [("Conv2d", "kernel_size", 1), ("Conv2d", "stride", 1), ("Conv2d", "dilation", 1), ("Conv2d", "padding", 0),
         ("MaxPool2d", "kernel_size", 1), ("MaxPool2d", "stride", 1), ("AvgPool2d", "kernel_size", 1),
         ("AvgPool2d", "stride", 1)]
WRONG_TYPES = [2.0, None, "3", np.array([3]), True]


@pytest.mark.parametrize("layer, argument, value", [
    (layer, argument, value) for layer, argument, _ in SIZES + PAIRS for value in WRONG_TYPES
    if not (value is None and argument == "stride" and layer.endswith("Pool2d"))],  # None: the kernel size
    ids=repr)
def test_sizes_of_the_wrong_type_are_type_errors(layer, argument, value):
    with pytest.raises(TypeError, match=rf"^{layer}: {argument} must be an int"):
        CONSTRUCTORS[layer](**{argument: value})


@pytest.mark.parametrize("layer, argument, minimum", SIZES + PAIRS)
@pytest.mark.parametrize("below", [1, 5])
def test_sizes_below_their_minimum_are_value_errors(layer, argument, minimum, below):
    value = minimum - below
    with pytest.raises(ValueError, match=rf"^{layer}: {argument} must be a (positive|non-negative) int(, | or a pair of them, )got {value}$"):
        CONSTRUCTORS[layer](**{argument: value})


@pytest.mark.parametrize("layer, argument, minimum", PAIRS)
def test_pairs_with_one_bad_half_are_refused(layer, argument, minimum):
    with pytest.raises(ValueError, match=rf"^{layer}: {argument} must be"):
        CONSTRUCTORS[layer](**{argument: (minimum, minimum - 1)})
    with pytest.raises(TypeError, match=rf"^{layer}: {argument} must be an int or a pair of ints"):
        CONSTRUCTORS[layer](**{argument: (minimum, 1.5)})


@pytest.mark.parametrize("layer, argument", [("LayerNorm", "eps"), ("BatchNorm2d", "eps"),
                                             ("TransformerEncoderLayer", "layer_norm_eps"), ("RMSNorm", "eps")])
@pytest.mark.parametrize("eps, error", [(0, ValueError), (-1e-5, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("1e-5", TypeError), (None, TypeError),
                                        (True, TypeError), (np.array([1e-5]), TypeError)], ids=repr)
def test_eps_must_be_a_finite_positive_number(layer, argument, eps, error):
    with pytest.raises(error, match=rf"^{layer}: {argument} must be (> 0|finite|a real number), got"):
        CONSTRUCTORS[layer](**{argument: eps})


PARAMETERISED = ["Linear", "Conv2d", "Embedding", "LayerNorm", "BatchNorm2d", "MultiheadAttention",
                 "TransformerEncoderLayer", "RMSNorm"]


@pytest.mark.parametrize("layer", PARAMETERISED)
@pytest.mark.parametrize("dtype, error, match", [
    (np.int32, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got int32"),
    (np.bool_, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got bool"),
    (np.complex64, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got complex64"),
    (None, TypeError, "dtype must be fp16, bf16, fp32 or fp64, got None"),
    ("int8", ValueError, "dtype 'int8': unknown dtype"),
    ("bogus", ValueError, "dtype 'bogus': unknown dtype"),
], ids=repr)
def test_parameter_dtypes_must_be_floats(layer, dtype, error, match):
    with pytest.raises(error, match=rf"^{layer}: {match}"):
        CONSTRUCTORS[layer](dtype=dtype)


@pytest.mark.parametrize("layer", PARAMETERISED)
@pytest.mark.parametrize("device", ["tpu", None, 0])
def test_unknown_devices_are_named(layer, device):
    with pytest.raises(ValueError, match=rf"^{layer}: device must be one of \('cpu', 'gpu', 'cuda'\), got {device!r}"):
        CONSTRUCTORS[layer](device=device)


@pytest.mark.skipif(not NO_GPU, reason="checks the message on machines without a GPU")
@pytest.mark.parametrize("layer", PARAMETERISED)
def test_gpu_device_without_a_gpu_says_so(layer):
    with pytest.raises(ValueError, match=rf"^{layer}: device='gpu' needs a GPU, and there is none here"):
        CONSTRUCTORS[layer](device="gpu")


@pytest.mark.parametrize("layer, argument", [("Linear", "bias"), ("Conv2d", "bias"), ("LayerNorm", "bias"),
                                             ("LayerNorm", "elementwise_affine"), ("Sequential", "fold_bn"),
                                             ("Dropout", "inplace"), ("MultiheadAttention", "bias"),
                                             ("MultiheadAttention", "batch_first"), ("TransformerEncoderLayer", "bias"),
                                             ("TransformerEncoderLayer", "batch_first"),
                                             ("TransformerEncoderLayer", "norm_first"),
                                             ("RMSNorm", "elementwise_affine")])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_flags_must_be_bools(layer, argument, value):
    with pytest.raises(TypeError, match=rf"^{layer}: {argument} must be True or False"):
        CONSTRUCTORS[layer](**{argument: value})


@pytest.mark.parametrize("layer, argument, value", [
    ("Linear", "activation", "relu6"), ("Linear", "activation", "tanh"), ("Linear", "activation", 1),
    ("Conv2d", "activation", "gelu_erf"), ("Conv2d", "layout", "NCWH"), ("Conv2d", "algo", "winograd"),
    ("MaxPool2d", "layout", "CHWN"), ("AvgPool2d", "layout", None), ("Flatten", "layout", "NWHC"),
    ("GELU", "approximate", "erf"), ("GELU", "approximate", None),
    ("TransformerEncoderLayer", "activation", "gelu_erf"),
    ("TransformerEncoderLayer", "activation", None), ("Linear", "path", "bogus"), ("Conv2d", "path", ["auto"]),
    ("LayerNorm", "path", "cublaslt"), ("Softmax", "path", None), ("LogSoftmax", "path", "cudnn"),
    ("MaxPool2d", "path", "cudnn"), ("AvgPool2d", "path", 3), ("TransformerEncoderLayer", "path", "gpu"),
    ("RMSNorm", "path", "cublaslt"), ("RMSNorm", "path", None),
])
def test_unknown_choices_are_named(layer, argument, value):
    with pytest.raises(ValueError, match=rf"^{layer}: {argument} must be"):
        CONSTRUCTORS[layer](**{argument: value})


@pytest.mark.parametrize("layer", ["Linear", "Conv2d", "Embedding", "MultiheadAttention", "TransformerEncoderLayer"])
@pytest.mark.parametrize("seed, error", [(-1, ValueError), (1.5, TypeError), ("0", TypeError)])
def test_seeds_must_be_non_negative_ints(layer, seed, error):
    with pytest.raises(error, match=rf"^{layer}: seed must be"):
        CONSTRUCTORS[layer](seed=seed)


@pytest.mark.parametrize("layer, argument, value, error", [
    ("Conv2d", "groups", 3, ValueError), ("Embedding", "padding_idx", 10, ValueError),
    ("Embedding", "padding_idx", -11, ValueError), ("Embedding", "padding_idx", 1.5, TypeError),
    ("Dropout", "p", 1.5, ValueError), ("Dropout", "p", -0.1, ValueError), ("Dropout", "p", "0.5", TypeError),
    ("Dropout", "p", None, TypeError), ("Softmax", "dim", 1.5, TypeError), ("LogSoftmax", "dim", None, TypeError),
    ("Flatten", "start_dim", None, TypeError), ("Flatten", "end_dim", "1", TypeError),
    ("LayerNorm", "normalized_shape", (4, 4), ValueError), ("LayerNorm", "normalized_shape", (), ValueError),
    ("LayerNorm", "normalized_shape", 0, ValueError), ("LayerNorm", "normalized_shape", -3, ValueError),
    ("LayerNorm", "normalized_shape", 2.0, ValueError), ("LayerNorm", "normalized_shape", None, ValueError),
    ("LayerNorm", "normalized_shape", np.array([4]), ValueError), ("LayerNorm", "normalized_shape", [True], ValueError),
    ("Conv2d", "algo", "fft", None), ("Dropout", "p", float("nan"), ValueError), ("Dropout", "p", True, TypeError),
    ("MultiheadAttention", "num_heads", 3, ValueError), ("TransformerEncoderLayer", "nhead", 3, ValueError),
    ("MultiheadAttention", "batch_first", False, ValueError),
    ("TransformerEncoderLayer", "batch_first", False, ValueError),
    ("MultiheadAttention", "dropout", 1.5, ValueError), ("MultiheadAttention", "dropout", "0.1", TypeError),
    ("TransformerEncoderLayer", "dropout", -0.5, ValueError), ("TransformerEncoderLayer", "dropout", None, TypeError),
])
def test_other_arguments_out_of_their_domain(layer, argument, value, error):
    kwargs = {argument: value}
    if error is None:  # algo="fft" with a stride: a combination, not one value, is wrong
        kwargs, error = {"algo": "fft", "stride": 2}, ValueError
    with pytest.raises(error, match=rf"^{layer}: "):
        CONSTRUCTORS[layer](**kwargs)


@pytest.mark.parametrize("layer", sorted(CONSTRUCTORS))
def test_every_swept_constructor_builds_with_good_arguments(layer):
    assert isinstance(CONSTRUCTORS[layer](), nn.Module)


def test_conv2d_keeps_its_arguments_as_pairs():
    conv = nn.Conv2d(4, 6, (3, 1), stride=2, padding=[1, 0], dilation=np.int64(1))
    assert (conv.kernel_size, conv.stride, conv.padding, conv.dilation) == ((3, 1), (2, 2), (1, 0), (1, 1))


def test_conv2d_forward_names_itself_for_a_list_input():
    with pytest.raises(TypeError, match="Conv2d: x must be an array"):
        nn.Conv2d(1, 1, 1)([[1.0]])


def test_a_path_per_op_names_the_op_and_bert_checks_its_path():
    from libnn.models.bert import BertConfig, BertEncoder

    with pytest.raises(ValueError, match=r"^MultiheadAttention: path\['attention'\] must be one of \['auto', 'cudnn', "
                                         r"'custom', 'reference', 'unfused'\], got 'cublaslt'"):
        nn.MultiheadAttention(8, 2, path={"linear": "cublaslt", "attention": "cublaslt"})
    with pytest.raises(ValueError, match=r"^BertEncoder: path names unknown ops \['linaer'\]; the ops are \["):
        BertEncoder(BertConfig.from_dict(BERT), path={"linaer": "reference"})
    with pytest.raises(ValueError, match=r"^TransformerEncoderLayer: path\['linear'\] must be one of .* got 'cufft'"):
        nn.TransformerEncoderLayer(8, 2, 16, path={"linear": "cufft"})
    assert nn.TransformerEncoderLayer(8, 2, 16, path={"linear": "reference", "layer_norm": "reference"}).path


@pytest.mark.parametrize("path", ["bogus", None, ["reference"]], ids=repr)
def test_use_path_refuses_a_name_no_op_has(path):
    with pytest.raises(ValueError, match=r"^Sequential.use_path: path must be one of \['auto', "):
        nn.Sequential(nn.Linear(2, 3)).use_path(path)


@pytest.mark.parametrize("call, error, match", [
    (lambda: nn.MaxPool2d(2)(np.ones((1, 4, 4, 1), np.int32)), TypeError, "^max_pool2d: x must be a floating-point"),
    (lambda: nn.AvgPool2d(2)(np.ones((1, 4, 4, 1), np.complex64)), TypeError, "^avg_pool2d: x must be a floating"),
    (lambda: nn.AvgPool2d(2)(np.ones((4, 4, 1))), ValueError, r"^avg_pool2d: x must be 4-D \(N, H, W, C\)"),
    (lambda: nn.Flatten(2, 5)(np.ones((2, 3, 4))), ValueError, "^Flatten: end_dim 5 is out of range for a 3-D input"),
    (lambda: nn.Flatten(2, 1)(np.ones((2, 3, 4))), ValueError, "^Flatten: start_dim 2 comes after end_dim 1"),
    (lambda: nn.Flatten()([1.0, 2.0]), TypeError, "^Flatten: x must be an array"),
    (lambda: nn.Softmax(dim=2)(np.ones((2, 3))), ValueError, "dim 2 is out of range"),
    (lambda: nn.LayerNorm(4)(np.ones((2, 4), np.int64)), TypeError, "^layer_norm: x must be a floating-point"),
], ids=["maxpool-int", "avgpool-complex", "avgpool-rank", "flatten-range", "flatten-order", "flatten-list",
        "softmax-dim", "layernorm-int"])
def test_layer_inputs_out_of_their_domain(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64], ids=str)
def test_conv2d_refuses_non_float_x(dtype):
    from libnn.ops import conv2d

    with pytest.raises(TypeError, match=rf"^conv2d: x must be a floating-point array .* got {np.dtype(dtype)}"):
        conv2d(np.ones((1, 4, 4, 2), dtype), np.ones((3, 3, 3, 2), dtype))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64], ids=str)
def test_attention_refuses_non_float_q(dtype):
    from libnn.ops import attention

    q = np.ones((1, 1, 3, 4), dtype)
    with pytest.raises(TypeError, match=f"^attention: q must be a floating-point array .* got {np.dtype(dtype)}"):
        attention(q, q, q)


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
def test_pooling_gpu_path_on_host_arrays_says_so(pool):
    from libnn import ops

    with pytest.raises(TypeError, match="^pool2d: path 'custom' runs on the GPU, but the arrays are host"):
        getattr(ops, pool)(np.ones((1, 4, 4, 1), np.float32), 2, path="custom")


# --- ops.swiglu (beyond test_swiglu_reference.py) -----------------------------------------------------

@pytest.mark.parametrize("x", [np.array(["a", "bb"]), np.array([1.0, None], dtype=object),
                               np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[D]"),
                               np.zeros(4, dtype=[("a", "f4")]), np.ones(4, np.longdouble), np.ones(4, np.uint8)],
                         ids=["str", "object", "datetime", "structured", "longdouble", "uint8"])
def test_swiglu_refuses_dtypes_it_has_no_path_for(x):
    """float128 included: its reference would compute in float64 and hand back float128 (fixed)."""
    from libnn.ops import swiglu

    with pytest.raises(TypeError, match=rf"^swiglu: x must be a floating-point array \(fp16, bf16, fp32, fp64\), "
                                        rf"got {re.escape(str(x.dtype))}$"):
        swiglu(x)


@pytest.mark.parametrize("x", [None, 3.0, "ab"], ids=repr)
def test_swiglu_refuses_what_is_not_an_array(x):
    from libnn.ops import swiglu

    with pytest.raises(TypeError, match=r"^swiglu: x must be an array \(numpy.ndarray, cupy.ndarray"):
        swiglu(x)


@pytest.mark.parametrize("path, error, match", [
    (None, TypeError, r"path must be a string, 'auto' or one of \['custom', 'reference'\]; got NoneType None"),
    (3, TypeError, r"path must be a string, .* got int 3"),
    (["reference"], TypeError, r"path must be a string, .* got list \['reference'\]"),
    ("", ValueError, r"unknown path ''; expected 'auto' or one of \['custom', 'reference'\]"),
    ("REFERENCE", ValueError, r"unknown path 'REFERENCE'"),
], ids=repr)
def test_swiglu_path_must_be_one_of_its_names(path, error, match):
    from libnn.ops import swiglu

    with pytest.raises(error, match="^swiglu: " + match):
        swiglu(np.ones((2, 4)), path=path)


# --- LlamaConfig and CausalLM (beyond test_llama.py) -------------------------------------------------

LLAMA = {"vocab_size": 11, "hidden_size": 8, "intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 16, "eos_token_id": 2}


def llama_config(**changes):
    from libnn.models.llama import LlamaConfig

    return LlamaConfig.from_dict({**LLAMA, **changes})


def llama_directory(tmp_path, config_text: str | None = None, weights_too: bool = False):
    """A checkpoint directory with this config.json (LLAMA's by default) and, with `weights_too`, a
    model.safetensors of random weights that matches it."""
    import json

    from libnn.models.llama import CausalLM

    (tmp_path / "config.json").write_text(json.dumps(LLAMA) if config_text is None else config_text)
    if weights_too:
        pytest.importorskip("safetensors.numpy")
        weights.write(tmp_path / "model.safetensors", CausalLM(llama_config()).state_dict())
    return tmp_path


@pytest.fixture(scope="module")
def llama():
    """A tiny random CausalLM on the host: vocab 11, a cache of 2 sequences of 8 tokens."""
    from libnn.models.llama import CausalLM

    return CausalLM(llama_config(), dtype="fp32", device="cpu", max_batch=2, max_len=8)


@pytest.mark.parametrize("change, error, match", [
    ({"rope_theta": "1e4"}, TypeError, r"rope_theta must be a finite number > 0, got str '1e4'"),
    ({"rope_theta": True}, TypeError, r"rope_theta must be a finite number > 0, got bool True"),
    ({"rope_theta": None}, TypeError, r"rope_theta must be a finite number > 0, got NoneType None"),
    ({"rope_theta": float("inf")}, ValueError, r"rope_theta must be a finite number > 0, got inf"),
    ({"rope_theta": 1e39}, ValueError, r"rope_theta 1e\+39 is beyond float32's largest number \(3.403e\+38\)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, ValueError,
     r"rope_theta 10000.0, rope_scaling .*: rope_frequencies: rope_scaling's factor must be a finite number > 0, "
     r"got '2'"),
    ({"rope_scaling": {"factor": 2.0}}, ValueError,
     r"rope_scaling \{'factor': 2.0\} has no rope_type \(or type\); name the scaling"),
    ({"rope_parameters": [1]}, TypeError, r"rope_parameters must be null or an object, got list \[1\]"),
    ({"vocab_size": None}, TypeError, r"vocab_size must be an int, got NoneType None"),
    ({"max_position_embeddings": None}, TypeError, r"max_position_embeddings must be an int, got NoneType None"),
    ({"hidden_size": "8"}, TypeError, r"hidden_size must be an int, got str '8'"),
    ({"num_key_value_heads": 0}, ValueError, r"num_key_value_heads must be a positive int, got 0"),
    ({"head_dim": 1}, ValueError, r"head_dim must be an int >= 2, got 1"),
    ({"max_position_embeddings": -3}, ValueError, r"max_position_embeddings must be a positive int, got -3"),
    ({"rms_norm_eps": "1e-5"}, TypeError, r"rms_norm_eps must be a real number, got str '1e-5'"),
    ({"rms_norm_eps": float("nan")}, ValueError, r"rms_norm_eps must be > 0, got nan"),
    ({"pad_token_id": 11}, ValueError, r"pad_token_id 11 is outside the vocabulary \[0, 11\)"),
    ({"bos_token_id": 1.0}, TypeError, r"bos_token_id must be an int, got float 1.0"),
    ({"eos_token_id": [[2]]}, TypeError, r"eos_token_id must be an int, got list \[2\]"),
    ({"tie_word_embeddings": None}, TypeError, r"tie_word_embeddings must be True or False, got NoneType None"),
    ({"attention_bias": None}, ValueError, r"attention_bias=None is not supported \(only False"),
    ({"hidden_act": None}, ValueError, r"hidden_act None is not supported \(supported: \['silu'\]"),
    ({"model_type": ["llama"]}, ValueError, r"model_type \['llama'\] is not supported"),
    ({"architectures": [1]}, TypeError, r"architectures must be a list of class names, got \[1\]"),
], ids=repr)
def test_llama_config_fields_are_checked_naming_the_source(change, error, match):
    from libnn.models.llama import LlamaConfig

    with pytest.raises(error, match=r"^CausalLM: dir/config.json: " + match):
        LlamaConfig.from_dict({**LLAMA, **change}, "dir/config.json")


def test_llama_config_takes_hugging_faces_nulls_and_refuses_what_is_not_an_object():
    """head_dim and num_key_value_heads may be null (derived, as transformers does); a null
    quantization_config is no quantization (it was refused as a quantized checkpoint: fixed)."""
    from libnn.models.llama import LlamaConfig

    c = llama_config(head_dim=None, num_key_value_heads=None, quantization_config=None)
    assert (c.head_dim, c.num_key_value_heads) == (4, 2)
    with pytest.raises(TypeError, match=r"^CausalLM: dir/config.json must be a JSON object of the config's fields "
                                        r"by name, got list"):
        LlamaConfig.from_dict([LLAMA], "dir/config.json")


@pytest.mark.parametrize("change, error, match", [
    ({"eos_token_id": 2}, TypeError, r"eos_token_id must be a tuple of token ids \(from_dict makes one of an id or a "
                                     r"list\), got int 2"),
    ({"eos_token_id": (2.5,)}, TypeError, r"eos_token_id must be an int, got float 2.5"),
    ({"bos_token_id": 1.5}, TypeError, r"bos_token_id must be an int, got float 1.5"),
    ({"tie_word_embeddings": "yes"}, TypeError, r"tie_word_embeddings must be True or False, got str 'yes'"),
    ({"hidden_act": "gelu"}, ValueError, r"hidden_act 'gelu' is not supported \(supported: \['silu'\]\)"),
    ({"rope_theta": 1e39}, ValueError, r"rope_theta 1e\+39 is beyond float32's largest number"),
    ({"num_key_value_heads": 3}, ValueError, r"num_attention_heads 2 is not a multiple of num_key_value_heads 3"),
], ids=repr)
def test_causal_lm_checks_a_config_built_by_hand(change, error, match):
    """A LlamaConfig built by its constructor has not been through from_dict: CausalLM checks it (an int
    eos_token_id was a raw "'int' object is not iterable", a float one or a str flag went through: fixed)."""
    import dataclasses

    from libnn.models.llama import CausalLM

    with pytest.raises(error, match="^CausalLM: " + match):
        CausalLM(dataclasses.replace(llama_config(), **change))
    with pytest.raises(TypeError, match=r"^CausalLM: config must be a LlamaConfig or a GPT2Config \(built by its "
                                        r"from_dict\(...\)\), got dict"):
        CausalLM(LLAMA)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_batch="2"), TypeError, r"max_batch must be an int, got str '2'"),
    (dict(max_batch=2.0), TypeError, r"max_batch must be an int, got float 2.0"),
    (dict(max_len=None, max_batch=None), TypeError, r"max_batch must be an int, got NoneType None"),
    (dict(max_len=1.5), TypeError, r"max_len must be an int, got float 1.5"),
    (dict(max_batch=0), ValueError, r"max_batch must be a positive int, got 0"),
    (dict(max_len=-1), ValueError, r"max_len must be a positive int, got -1"),
    (dict(max_len=17), ValueError, r"max_len 17 is beyond the model's max_position_embeddings 16"),
    (dict(max_batch=10**9), MemoryError, r"the KV cache \(1000000000 sequences of 16 tokens, 1 layers, 1 KV heads of "
                                         r"4\) needs .* more than the .* of host RAM available"),
    (dict(dtype="int8"), ValueError, r"dtype 'int8': unknown dtype"),
    (dict(dtype=np.int32), TypeError, r"dtype must be fp16, bf16, fp32 or fp64, got int32"),
    (dict(dtype=None), TypeError, r"dtype must be fp16, bf16, fp32 or fp64, got None"),
    (dict(device="tpu"), ValueError, r"device must be one of \('cpu', 'gpu', 'cuda'\), got 'tpu'"),
    (dict(device=0), ValueError, r"device must be one of .* got 0"),
    (dict(path="bogus"), ValueError, r"path must be one of \[.*\], got 'bogus'"),
    (dict(path={"linear": "bogus"}), ValueError, r"path\['linear'\] must be one of \[.*\], got 'bogus'"),
    (dict(init="no"), TypeError, r"init must be True or False, got str 'no'"),
], ids=repr)
def test_causal_lm_constructor_checks_its_arguments_before_drawing_anything(kwargs, error, match):
    from libnn.models.llama import CausalLM

    with pytest.raises(error, match="^CausalLM: " + match):
        CausalLM(llama_config(), **{"device": "cpu", **kwargs})


def test_causal_lm_with_a_huge_vocabulary_is_refused_before_drawing():
    from libnn.models.llama import CausalLM

    with pytest.raises(MemoryError, match=r"^CausalLM: the model of the config \(vocab_size=1000000000000, "
                                          r"hidden_size=8, 1 layers: \d+ parameters\) needs"):
        CausalLM(llama_config(vocab_size=10**12), device="cpu")


@pytest.mark.skipif(not NO_GPU, reason="checks the message on machines without a GPU")
def test_causal_lm_on_a_gpu_without_one_says_so_before_reading(tmp_path):
    from libnn.models.llama import CausalLM

    with pytest.raises(ValueError, match="^CausalLM.from_pretrained: device='gpu' needs a GPU, and there is none"):
        CausalLM.from_pretrained(llama_directory(tmp_path))  # device="gpu" is from_pretrained's default
    with pytest.raises(ValueError, match="^CausalLM: device='gpu' needs a GPU, and there is none"):
        CausalLM(llama_config(), device="gpu")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(directory=None), TypeError, r"directory must be a str or pathlib.Path, got NoneType None"),
    (dict(directory=b"/tmp"), TypeError, r"directory must be a str or pathlib.Path, got bytes b'/tmp'"),
    (dict(max_batch="2"), TypeError, r"max_batch must be an int, got str '2'"),
    (dict(max_len=2.5), TypeError, r"max_len must be an int, got float 2.5"),
    (dict(max_batch=0), ValueError, r"max_batch must be a positive int, got 0"),
    (dict(max_len=0), ValueError, r"max_len must be a positive int, got 0"),
    (dict(dtype="complex64"), ValueError, r"dtype 'complex64': unknown dtype"),
    (dict(dtype=np.int32), TypeError, r"dtype must be fp16, bf16, fp32 or fp64, got int32"),
    (dict(device="tpu"), ValueError, r"device must be one of \('cpu', 'gpu', 'cuda'\), got 'tpu'"),
    (dict(path="bogus"), ValueError, r"path must be one of \[.*\], got 'bogus'"),
    (dict(path={"attention": "cublaslt"}), ValueError, r"path\['attention'\] must be one of \[.*\], got 'cublaslt'"),
    (dict(path=None), ValueError, r"path must be one of \[.*\], got None"),
], ids=repr)
def test_causal_lm_from_pretrained_checks_its_arguments_before_reading(tmp_path, kwargs, error, match):
    """The directory holds config.json and no weights: every argument is refused before the checkpoint
    would be found missing. The path was checked by the constructor, after the whole checkpoint was
    read, and named "CausalLM" (fixed)."""
    from libnn.models.llama import CausalLM

    kwargs = {"directory": llama_directory(tmp_path), "device": "cpu", **kwargs}
    with pytest.raises(error, match="^CausalLM.from_pretrained: " + match):
        CausalLM.from_pretrained(kwargs.pop("directory"), **kwargs)


def _llama_files(tmp_path, name: str):
    """Broken checkpoint directories, by name: (directory, the error, a regex of its message after the
    function's name)."""
    import json

    d = llama_directory(tmp_path, weights_too=name not in ("config-deep", "config-dir", "no-directory"))
    good = (d / "model.safetensors").read_bytes() if (d / "model.safetensors").exists() else b""
    index = d / "model.safetensors.index.json"
    if name == "config-deep":
        (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
        return d, ValueError, r"'.*config.json' nests its JSON too deeply to be read"
    if name == "config-dir":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
        return d, FileNotFoundError, rf"{re.escape(repr(str(d)))} has no config.json"
    if name == "no-directory":
        return d / "missing", FileNotFoundError, r"'.*missing' has no config.json"
    if name == "empty":
        (d / "model.safetensors").write_bytes(b"")
        return d, ValueError, r"weights file '.*model.safetensors' is empty"
    if name == "truncated":
        (d / "model.safetensors").write_bytes(good[:-40])
        return d, ValueError, r"weights file '.*model.safetensors' is not a readable .safetensors file"
    if name == "another-format":
        (d / "model.safetensors").write_bytes(b"PK\x03\x04 a zip, not safetensors")
        return d, ValueError, r"weights file '.*model.safetensors' is not a readable .safetensors file"
    (d / "model.safetensors").unlink()
    if name == "shard-missing":
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-1.safetensors"}}))
        return d, FileNotFoundError, (r"'.*model.safetensors.index.json' names the shard 'model-1.safetensors', "
                                      r"which '.*' does not hold")
    if name == "shard-truncated":
        (d / "model-1.safetensors").write_bytes(good[:100])
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-1.safetensors"}}))
        return d, ValueError, r"weights file '.*model-1.safetensors' is not a readable .safetensors file"
    texts = {"index-list": "[1]", "index-empty-map": '{"weight_map": {}}', "index-not-json": "{bad",
             "index-elsewhere": '{"weight_map": {"a": "../x.safetensors"}}', "index-number": '{"weight_map": {"a": 3}}'}
    index.write_text(texts[name])
    match = {"index-not-json": r"'.*model.safetensors.index.json' is not valid JSON",
             "index-elsewhere": r"'.*model.safetensors.index.json' names the shard '../x.safetensors'; expected a file "
                                r"name in the checkpoint's directory",
             "index-number": r"'.*model.safetensors.index.json' names the shard 3"}.get(
        name, r"'.*model.safetensors.index.json' must be a JSON object whose 'weight_map' maps each tensor's name")
    return d, ValueError, match


@pytest.mark.parametrize("name", ["config-deep", "config-dir", "no-directory", "empty", "truncated", "another-format",
                                  "shard-missing", "shard-truncated", "index-list", "index-empty-map",
                                  "index-not-json", "index-elsewhere", "index-number"])
def test_causal_lm_from_pretrained_names_itself_and_the_file_of_a_broken_checkpoint(tmp_path, name):
    """A config.json nested too deeply was a raw RecursionError; a broken model.safetensors or shard gave
    weights.read's message without the function, and a shard the index names but the directory lacks
    "weights file ... does not exist" (fixed: both name CausalLM.from_pretrained, the latter the index)."""
    from libnn.models.llama import CausalLM

    directory, error, match = _llama_files(tmp_path, name)
    with pytest.raises(error, match="^CausalLM.from_pretrained: " + match):
        CausalLM.from_pretrained(directory, dtype="fp32", device="cpu")


# prefill and decode_step: (call, error, message after the function's name)
LLAMA_STEP_INPUTS = [
    (lambda m: m.prefill(None), TypeError, r"CausalLM.prefill: input_ids must be an array \(numpy.ndarray"),
    (lambda m: m.prefill("hello"), TypeError, r"CausalLM.prefill: input_ids must be an array"),
    (lambda m: m.prefill(np.array([[1, 11]])), ValueError,
     r"CausalLM.prefill: input_ids must lie in \[0, 11\) \(vocab_size\), got values from 1 to 11"),
    (lambda m: m.prefill(np.array([[-3]], np.int8)), ValueError, r"CausalLM.prefill: input_ids must lie in \[0, 11\)"),
    (lambda m: m.prefill(np.ones((2, 3), np.int64), [3, 0]), ValueError,
     r"CausalLM.prefill: sequences \[1\] have no token \(empty prompts\)"),
    (lambda m: m.prefill(np.ones((2, 3), np.int64), [3, 4]), ValueError,
     r"CausalLM.prefill: lengths go up to 4 but input_ids has 3 positions"),
    (lambda m: m.prefill(np.ones((2, 3), np.int64), np.array([3, 2**64 - 1], np.uint64)), ValueError,
     r"CausalLM.prefill: lengths go up to 18446744073709551615 but input_ids has 3 positions"),  # it wrapped to -1
    (lambda m: m.prefill(np.broadcast_to(np.int64(1), (1, 10**9))), ValueError,
     r"CausalLM.prefill: a prompt of 1000000000 tokens is longer than the KV cache's max_len 8"),
    (lambda m: m.prefill(np.ones((1, 2, 3), np.int64)), ValueError,
     r"CausalLM.prefill: input_ids must be 2-D \(batch, seq_len\) or a list of sequences, got shape \(1, 2, 3\)"),
    (lambda m: m.prefill(np.ones((0, 3), np.int64)), ValueError,
     r"CausalLM.prefill: the batch has 0 sequences; the KV cache holds 1 to 2 \(max_batch\)"),
    (lambda m: m.prefill([]), ValueError, r"CausalLM.prefill: input_ids is an empty list: the batch has 0 sequences"),
    (lambda m: m.prefill([[1, 2], [3, [4]]]), ValueError,
     r"CausalLM.prefill: input_ids\[1\] must be a sequence of integers, got a ragged nested list \[3, \[4\]\]"),
    (lambda m: m.prefill([np.ones((2, 2), np.int64)]), ValueError,
     r"CausalLM.prefill: input_ids\[0\] must be a 1-D sequence of token ids, got shape \(2, 2\)"),
    (lambda m: m.prefill(np.ones((2, 3), np.int64), [[3, 3]]), ValueError,
     r"CausalLM.prefill: lengths must be \(2,\) integers, one per row of input_ids, got shape \(1, 2\)"),
    (lambda m: m.prefill(np.ones((2, 3), np.int64), [3, [2]]), ValueError,
     r"CausalLM.prefill: lengths must be a sequence of integers, got a ragged nested list"),
    (lambda m: m.prefill(np.ones((1, 3), np.float32)), TypeError,
     r"CausalLM.prefill: input_ids must hold integers, got dtype float32"),
    (lambda m: m.prefill(np.ones((1, 3), bool)), TypeError,
     r"CausalLM.prefill: input_ids must hold integers, got dtype bool"),
    (lambda m: m.prefill(np.ones((1, 3), np.complex64)), TypeError,
     r"CausalLM.prefill: input_ids must hold integers, got dtype complex64"),
    (lambda m: m.prefill(np.array([["a", "b"]])), TypeError,
     r"CausalLM.prefill: input_ids must hold integers, got dtype <U1"),
    (lambda m: m.prefill([[1.0, 2.0]]), TypeError,
     r"CausalLM.prefill: input_ids\[0\] must hold integers \(token ids\), got dtype float64"),
    (lambda m: m.prefill([[True, False]]), TypeError,
     r"CausalLM.prefill: input_ids\[0\] must hold integers \(token ids\), got dtype bool"),
    (lambda m: m.prefill(np.ones((2, 3), np.int64), [3.0, 2.0]), ValueError,
     r"CausalLM.prefill: lengths must be \(2,\) integers, one per row of input_ids, got shape \(2,\) dtype float64"),
    (lambda m: m.decode_step(None), TypeError, r"CausalLM.decode_step: tokens must be an array"),
    (lambda m: m.decode_step(5), TypeError, r"CausalLM.decode_step: tokens must be an array"),
    (lambda m: m.decode_step(np.array([1, 11])), ValueError,
     r"CausalLM.decode_step: tokens must lie in \[0, 11\) \(vocab_size\), got values from 1 to 11"),
    (lambda m: m.decode_step(np.array([[1], [2]])), ValueError,
     r"CausalLM.decode_step: tokens must be \(2,\) integers, one per sequence of the last prefill, got shape \(2, 1\)"),
    (lambda m: m.decode_step([1, [2]]), ValueError,
     r"CausalLM.decode_step: tokens must be a sequence of integers, got a ragged nested list"),
    (lambda m: m.decode_step(np.array([1.0, 2.0])), ValueError,
     r"CausalLM.decode_step: tokens must be \(2,\) integers, .* got shape \(2,\) dtype float64"),
    (lambda m: m.decode_step(np.array([True, False])), ValueError,
     r"CausalLM.decode_step: tokens must be \(2,\) integers"),
]


@pytest.mark.parametrize("call, error, match", LLAMA_STEP_INPUTS)
def test_causal_lm_prefill_and_decode_step_refuse_bad_input_and_the_model_stays_usable(llama, call, error, match):
    """Each error names the function and the argument; a refused call changes nothing: the sequences of
    the last prefill decode on. The ragged lists were NumPy's "inhomogeneous shape", list rows of floats
    a ValueError where an array of them is a TypeError, the uint64 length past 2**63 an empty prompt, and
    the ids' range named "CausalLM" alone (fixed)."""
    llama.prefill([[1, 2, 3], [4]])
    with pytest.raises(error, match="^" + match):
        call(llama)
    if not match.startswith("CausalLM.prefill"):  # a refused prefill leaves the cache; a decode step goes on
        assert list(llama.lengths) == [3, 1]
    llama.prefill([[1, 2, 3], [4]])
    llama.decode_step(np.array([5, 6]))
    assert list(llama.lengths) == [4, 2]


# generate and stream: (keyword arguments, error, message after "CausalLM.<function>: ")
LLAMA_GENERATION_INPUTS = [
    (dict(max_new_tokens=2.0), TypeError, r"max_new_tokens must be an int, got float 2.0"),
    (dict(max_new_tokens="2"), TypeError, r"max_new_tokens must be an int, got str '2'"),
    (dict(max_new_tokens=None), TypeError, r"max_new_tokens must be an int, got NoneType None"),
    (dict(max_new_tokens=True), TypeError, r"max_new_tokens must be an int, got bool True"),
    (dict(max_new_tokens=-1), ValueError, r"max_new_tokens must be a non-negative int, got -1"),
    (dict(max_new_tokens=10**18), ValueError, r"max_new_tokens 1000000000000000000 after a prompt of 2 tokens needs "
                                              r"1000000000000000001 cache positions, more than max_len 8"),
    (dict(temperature=None), TypeError, r"temperature must be a number >= 0, got NoneType None"),
    (dict(temperature="hot"), TypeError, r"temperature must be a number >= 0, got str 'hot'"),
    (dict(temperature=1j), TypeError, r"temperature must be a number >= 0, got complex 1j"),
    (dict(temperature=np.array(0.5)), TypeError, r"temperature must be a number >= 0, got ndarray"),
    (dict(temperature=True), TypeError, r"temperature must be a number >= 0, got bool True"),
    (dict(temperature=-0.5), ValueError, r"temperature must be a finite number >= 0 \(0: greedy\), got -0.5"),
    (dict(temperature=float("nan")), ValueError, r"temperature must be a finite number >= 0 \(0: greedy\), got nan"),
    (dict(temperature=float("inf")), ValueError, r"temperature must be a finite number >= 0 \(0: greedy\), got inf"),
    (dict(temperature=1e-320), ValueError, r"temperature must be 0 \(greedy\) or within float32's normal range "
                                           r"\[1.175e-38, 3.403e\+38\] \(the logits are divided by it in float32\), "
                                           r"got 1e-320"),
    (dict(temperature=1e-40), ValueError, r"temperature must be 0 \(greedy\) or within float32's normal range"),
    (dict(temperature=1e300), ValueError, r"temperature must be 0 \(greedy\) or within float32's normal range .* "
                                          r"got 1e\+300"),
    (dict(temperature=1.0, top_k=2.0), TypeError, r"top_k must be an int, got float 2.0"),
    (dict(temperature=1.0, top_k=True), TypeError, r"top_k must be an int, got bool True"),
    (dict(temperature=1.0, top_k="5"), TypeError, r"top_k must be an int, got str '5'"),
    (dict(temperature=1.0, top_k=0), ValueError, r"top_k must be a positive int, got 0"),
    (dict(temperature=1.0, top_k=-1), ValueError, r"top_k must be a positive int, got -1"),
    (dict(temperature=1.0, top_p="0.5"), TypeError, r"top_p must be a number in \(0, 1\] or None, got str '0.5'"),
    (dict(temperature=1.0, top_p=True), TypeError, r"top_p must be a number in \(0, 1\] or None, got bool True"),
    (dict(temperature=1.0, top_p=np.array([0.5])), TypeError,
     r"top_p must be a number in \(0, 1\] or None, got ndarray"),
    (dict(temperature=1.0, top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    (dict(temperature=1.0, top_p=-0.1), ValueError, r"top_p must be in \(0, 1\], got -0.1"),
    (dict(temperature=1.0, top_p=float("inf")), ValueError, r"top_p must be in \(0, 1\], got inf"),
    (dict(eos_token_id="2"), TypeError, r"eos_token_id must be an int, got str '2'"),
    (dict(eos_token_id=2.0), TypeError, r"eos_token_id must be an int, got float 2.0"),
    (dict(eos_token_id=True), TypeError, r"eos_token_id must be an int, got bool True"),
    (dict(eos_token_id=[[2]]), TypeError, r"eos_token_id must be an int, got list \[2\]"),
    (dict(eos_token_id={2}), TypeError, r"eos_token_id must be an int, got set \{2\}"),
    (dict(eos_token_id=-1), ValueError, r"eos_token_id must be a non-negative int, got -1"),
    (dict(eos_token_id=[2, 11]), ValueError, r"eos_token_id \[11\] outside the vocabulary \[0, 11\)"),
    (dict(eos_token_id=2**70), ValueError, r"eos_token_id \[1180591620717411303424\] outside the vocabulary"),
    (dict(temperature=1.0, seed=1.5), TypeError, r"seed must be an int, got float 1.5"),
    (dict(temperature=1.0, seed="1"), TypeError, r"seed must be an int, got str '1'"),
    (dict(temperature=1.0, seed=True), TypeError, r"seed must be an int, got bool True"),
    (dict(temperature=1.0, seed=np.array([1, 2])), TypeError, r"seed must be an int, got ndarray"),
    (dict(temperature=1.0, seed=-1), ValueError, r"seed must be a non-negative int, got -1"),
    (dict(temperature=1.0, seed=2**32), ValueError, r"seed must be below 2\*\*32, got 4294967296"),
    (dict(input_ids=None), TypeError, r"input_ids must be an array \(numpy.ndarray"),
    (dict(input_ids=[[1, 11]]), ValueError, r"input_ids must lie in \[0, 11\) \(vocab_size\), got values from 1 to 11"),
    (dict(input_ids=[[1, 11]], max_new_tokens=0), ValueError, r"input_ids must lie in \[0, 11\)"),
    (dict(input_ids=[[1, 2], []]), ValueError, r"sequences \[1\] have no token \(empty prompts\)"),
    (dict(input_ids=[]), ValueError, r"input_ids is an empty list: the batch has 0 sequences"),
    (dict(input_ids=[[1], [2], [3]]), ValueError,
     r"the batch has 3 sequences; the KV cache holds 1 to 2 \(max_batch\)"),
    (dict(input_ids=[list(range(9))]), ValueError, r"a prompt of 9 tokens is longer than the KV cache's max_len 8"),
    (dict(input_ids=np.ones((1, 2, 2), np.int64)), ValueError, r"input_ids must be 2-D \(batch, seq_len\)"),
    (dict(input_ids=np.ones((1, 3))), TypeError, r"input_ids must hold integers, got dtype float64"),
    (dict(input_ids=[[1.5, 2.0]]), TypeError, r"input_ids\[0\] must hold integers \(token ids\), got dtype float64"),
    (dict(input_ids=np.ones((2, 3), np.int64), lengths=[3]), ValueError,
     r"lengths must be \(2,\) integers, one per row of input_ids"),
    (dict(input_ids=np.ones((2, 3), np.int64), lengths=[3, -1]), ValueError, r"sequences \[1\] have no token"),
    (dict(lengths=[2]), ValueError, r"lengths goes with a 2-D input_ids; a list of sequences carries its own"),
]


@pytest.mark.parametrize("function", ["generate", "stream"])
@pytest.mark.parametrize("kwargs, error, match", LLAMA_GENERATION_INPUTS, ids=repr)
def test_causal_lm_generate_and_stream_refuse_bad_arguments_when_called(llama, function, kwargs, error, match):
    """Every argument is checked when generate or stream is called (stream before its first step), and
    the error names the function called: stream's said "CausalLM.generate", and the ids' range was checked
    by the prefill inside the first step, naming "CausalLM" (fixed); a temperature whose float32 is 0 or inf
    gave NaN scores and non-greedy tokens (fixed). The model generates as before afterwards."""
    expected = [o.tolist() for o in llama.generate([[3, 4]], 2, eos_token_id=())]
    kwargs = {"input_ids": [[1, 2]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=rf"^CausalLM.{function}: " + match):
        getattr(llama, function)(kwargs.pop("input_ids"), kwargs.pop("max_new_tokens"), **kwargs)
    assert [o.tolist() for o in llama.generate([[3, 4]], 2, eos_token_id=())] == expected


def test_causal_lm_temperatures_at_float32s_limits_still_sample():
    """The smallest and largest temperatures taken: no NaN scores and no floating-point warning, greedy
    tokens at the smallest (the logits of a random model differ by far more than 1e-38 times anything)."""
    import warnings

    from libnn.models.llama import CausalLM

    model = CausalLM(llama_config(), dtype="fp32", device="cpu", max_batch=2, max_len=8)
    greedy = [o.tolist() for o in model.generate([[1, 2], [3]], 4, eos_token_id=())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        low = model.generate([[1, 2], [3]], 4, eos_token_id=(), temperature=float(np.finfo(np.float32).tiny) * 1e8,
                             seed=0)
        high = model.generate([[1, 2], [3]], 4, eos_token_id=(), temperature=float(np.finfo(np.float32).max), seed=0)
    assert [o.tolist() for o in low] == greedy
    assert all(((o >= 0) & (o < LLAMA["vocab_size"])).all() and len(o) == 4 for o in high)


def fake_gpu_array(shape, dtype=np.int64):
    """An object libnn takes for a CuPy array (its type's module is CuPy's and it has a device): ids on
    the GPU, without a GPU."""
    kind = type("ndarray", (), {"__module__": "cupy._core.core", "device": 0, "shape": shape, "ndim": len(shape),
                                "dtype": np.dtype(dtype)})
    return kind()


@pytest.mark.parametrize("call, match", [
    (lambda m: m.prefill(fake_gpu_array((1, 3))), r"CausalLM.prefill: input_ids is on the GPU"),
    (lambda m: m.generate(fake_gpu_array((1, 3)), 2), r"CausalLM.generate: input_ids is on the GPU"),
    (lambda m: m.stream(fake_gpu_array((1, 3)), 2), r"CausalLM.stream: input_ids is on the GPU"),
    (lambda m: m.decode_step(fake_gpu_array((2,))), r"CausalLM.decode_step: tokens is on the GPU"),
], ids=["prefill", "generate", "stream", "decode_step"])
def test_causal_lm_on_the_host_refuses_ids_on_the_gpu(llama, call, match):
    llama.prefill([[1, 2], [3]])
    with pytest.raises(TypeError, match="^" + match + r" but the layer's input is a host array; pass both on one "
                                                      r"device$"):
        call(llama)
    assert list(llama.lengths) == [2, 1]
