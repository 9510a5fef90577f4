"""SeedCNN (the shipped digit classifier) and the layers it brought: Flatten, Dropout, Softmax,
LogSoftmax, Embedding, and the softmax op."""

import math
import subprocess
import sys

import numpy as np
import pytest

from libnn import dtypes
from libnn.models.seed_cnn import WEIGHTS, SeedCNN, load_heldout, preprocess_digits
from libnn.nn.activation import ReLU
from libnn.nn.basic import Dropout, Embedding, Flatten, LogSoftmax, Softmax
from libnn.nn.linear import Linear
from libnn.nn.sequential import Sequential
from libnn.ops.softmax import softmax
from libnn.runtime.device import gpu_missing
from conftest import random_normal, rel_error

# The training script's torch model, state_dict() less BatchNorm's num_batches_tracked counters.
EXPECTED_KEYS = {
    "features.0.weight": (32, 1, 3, 3), "features.0.bias": (32,),
    "features.1.weight": (32,), "features.1.bias": (32,),
    "features.1.running_mean": (32,), "features.1.running_var": (32,),
    "features.4.weight": (64, 32, 3, 3), "features.4.bias": (64,),
    "features.5.weight": (64,), "features.5.bias": (64,),
    "features.5.running_mean": (64,), "features.5.running_var": (64,),
    "classifier.1.weight": (128, 3136), "classifier.1.bias": (128,),
    "classifier.3.weight": (10, 128), "classifier.3.bias": (10,),
}


@pytest.fixture(scope="module")
def heldout():
    return load_heldout()


def log_softmax_formula(x, dim):
    x = np.asarray(x, np.float64)
    z = x - x.max(axis=dim, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=dim, keepdims=True))


# --- the model on the CPU ----------------------------------------------------------------------------
def test_reference_path_classifies_the_heldout_split_at_least_95_percent(heldout):
    images, labels = heldout
    assert images.shape == (len(labels), 1, 28, 28) and images.dtype == np.float32 and labels.dtype == np.int64
    log_probs = SeedCNN.pretrained(path="reference")(images)
    assert log_probs.shape == (len(labels), 10) and log_probs.dtype == np.float32
    np.testing.assert_allclose(np.exp(log_probs.astype(np.float64)).sum(axis=1), 1, rtol=1e-5)
    assert (log_probs.argmax(axis=1) == labels).mean() >= 0.95


def test_loading_and_running_the_model_needs_neither_torch_nor_sklearn():
    code = ("import sys\n"
            "sys.modules['torch'] = sys.modules['sklearn'] = None  # any import of them fails\n"
            "from libnn.models import SeedCNN\n"
            "from libnn.models.seed_cnn import load_heldout\n"
            "images, labels = load_heldout()\n"
            "print((SeedCNN.pretrained(path='reference')(images[:20]).argmax(1) == labels[:20]).mean())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) >= 0.9


def test_state_dict_keys_and_shapes_are_the_training_models():
    assert {k: v.shape for k, v in SeedCNN().state_dict().items()} == EXPECTED_KEYS
    from libnn.nn import weights

    shipped = weights.read(WEIGHTS)
    assert {k: v.shape for k, v in shipped.items()} == EXPECTED_KEYS
    assert all(v.dtype == np.float32 for v in shipped.values())


def test_training_scripts_torch_model_has_the_expected_keys():
    pytest.importorskip("torch")
    from libnn.models.train_seed_cnn import torch_model

    state = torch_model().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items() if "num_batches_tracked" not in k} == EXPECTED_KEYS


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_a_pytorch_state_dict_loads_as_it_is_and_gives_torchs_answer(rng, layout):
    torch = pytest.importorskip("torch")
    from libnn.models.train_seed_cnn import torch_model

    reference = torch_model().double().eval()
    with torch.no_grad():  # batch-norm statistics that are not the identity
        for bn in (reference.features[1], reference.features[5]):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
    x = rng.standard_normal((3, 1, 28, 28))
    model = SeedCNN(dtype="fp64", path="reference", layout=layout)
    model.load_state_dict(reference.state_dict())  # torch tensors, num_batches_tracked included
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    assert rel_error(model(x), expected) <= 1e-12


def test_nhwc_and_nchw_models_agree_on_the_shipped_weights(heldout):
    images = heldout[0][:16].astype(np.float64)
    nhwc = SeedCNN.pretrained(dtype="fp64", path="reference")
    nchw = SeedCNN.pretrained(dtype="fp64", path="reference", layout="NCHW")
    assert rel_error(nhwc(images), nchw(images)) <= 1e-12


def test_describe_shows_conv_bn_relu_and_linear_relu_fused():
    lines = SeedCNN().describe()
    assert lines[0] == "features.0+1+2: Conv2d+BatchNorm2d+relu fused (BN folded into the weights)"
    assert "features.4+5+6: Conv2d+BatchNorm2d+relu fused (BN folded into the weights)" in lines
    assert "classifier.0+1+2: Flatten+Linear+relu fused (weight columns in NHWC order, no transpose)" in lines
    assert "classifier.1+2: Linear+relu fused (activation in the epilogue)" in SeedCNN(layout="NCHW").describe()


@pytest.mark.parametrize("shape", [(1, 28, 28), (2, 28, 28, 1), (2, 3, 28, 28), (2, 1, 32, 32), (0, 1, 28, 28),
                                   (2, 1, 28, 28, 1)])
def test_bad_input_shape_says_what_the_model_expects(shape):
    with pytest.raises(ValueError, match=r"SeedCNN: expected input \(N, 1, 28, 28\).*got " + re_shape(shape)):
        SeedCNN(path="reference")(np.zeros(shape, np.float32))


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_bad_input_dtype_path_and_layout_are_refused():
    with pytest.raises(TypeError, match="SeedCNN: expected a floating-point input, got dtype int64"):
        SeedCNN()(np.zeros((1, 1, 28, 28), np.int64))
    with pytest.raises(TypeError, match="SeedCNN: x must be an array"):
        SeedCNN()([[0.0]])
    with pytest.raises(ValueError, match=r"SeedCNN: path must be one of \('auto', 'custom', 'reference'\), "
                                         "got 'cudnn'"):
        SeedCNN(path="cudnn")
    with pytest.raises(ValueError, match="SeedCNN: layout must be one of"):
        SeedCNN(layout="NCWH")
    state = dict(SeedCNN().state_dict())
    del state["classifier.3.bias"]
    with pytest.raises(KeyError, match=r"missing keys \['classifier.3.bias'\]"):
        SeedCNN().load_state_dict(state)


def test_input_of_another_float_dtype_is_cast_to_the_models(heldout):
    images = heldout[0][:4]
    model = SeedCNN.pretrained(path="reference")
    np.testing.assert_array_equal(model(images.astype(np.float64)), model(images))


def test_preprocess_digits_is_bilinear_resize_then_scaling_to_plus_minus_one(heldout):
    flat = np.full((2, 64), 8.0)
    np.testing.assert_allclose(preprocess_digits(flat), 0.0, atol=1e-7)  # constant stays constant
    ramp = np.tile(np.arange(8.0) * 2, (8, 1))[None]  # linear in x: bilinear keeps it linear inside
    row = preprocess_digits(ramp)[0, 0, 10]
    assert np.all(np.diff(row) >= 0) and row[0] == -1 and math.isclose(row[-1], (14 / 16 - 0.5) / 0.5, rel_tol=1e-6)
    assert heldout[0].min() >= -1 and heldout[0].max() <= 1
    with pytest.raises(ValueError, match=r"preprocess_digits: expected images \(N, 8, 8\) or \(N, 64\)"):
        preprocess_digits(np.zeros((2, 28, 28)))


def test_preprocess_digits_matches_torch_interpolate(rng):
    torch = pytest.importorskip("torch")
    images = rng.integers(0, 17, (5, 8, 8)).astype(np.float64)
    expected = torch.nn.functional.interpolate(torch.from_numpy(images[:, None] / 16), size=(28, 28),
                                               mode="bilinear", align_corners=False).numpy()
    np.testing.assert_allclose(preprocess_digits(images), (expected - 0.5) / 0.5, atol=1e-6)


# --- the CLI -----------------------------------------------------------------------------------------
def libnn(*args):
    return subprocess.run([sys.executable, "-m", "libnn", *args], capture_output=True, text=True, timeout=600)


def test_cli_run_cnn_prints_accuracy_and_where_it_ran():
    result = libnn("run", "cnn", "--batch", "120")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    if gpu_missing():
        assert "running the reference path on the CPU" in out and "conv2d reference" in out
    else:
        assert "running on the GPU" in out
    accuracy = float(out.split("held-out accuracy: ")[1].split("%")[0])
    assert accuracy >= 95
    assert "ms per batch of 120" in out


def test_cli_run_cnn_refuses_bad_arguments():
    result = libnn("run", "cnn", "--batch", "0")
    assert result.returncode == 2 and "libnn run: --batch must be at least 1, got 0" in result.stderr
    assert libnn("run", "mlp").returncode == 2  # argparse: not a known model
    if gpu_missing():
        result = libnn("run", "cnn", "--path", "custom")
        assert result.returncode == 2 and "--path custom runs on the GPU" in result.stderr


def test_cli_paths_lists_softmax():
    result = libnn("paths", "softmax")
    assert result.returncode == 0 and "custom" in result.stdout and "reference" in result.stdout


# --- Flatten, Dropout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("start,end,shape", [(1, -1, (2, 60)), (0, -1, (120,)), (1, 2, (2, 12, 5)),
                                             (-2, -1, (2, 3, 20)), (0, 1, (6, 4, 5)), (2, 2, (2, 3, 4, 5))])
def test_flatten_nchw_is_numpy_reshape_with_pytorch_dims(rng, start, end, shape):
    x = rng.standard_normal((2, 3, 4, 5))
    y = Flatten(start, end, layout="NCHW")(x)
    assert y.shape == shape
    np.testing.assert_array_equal(y, x.reshape(shape))


@pytest.mark.parametrize("start,end", [(1, -1), (2, 3), (0, 2)])
def test_flatten_nhwc_orders_features_as_pytorch_does_on_nchw(rng, start, end):
    nchw = rng.standard_normal((2, 3, 4, 5))
    nhwc = np.ascontiguousarray(nchw.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(Flatten(start, end)(nhwc), Flatten(start, end, layout="NCHW")(nchw))


def test_flatten_layout_only_concerns_4d_inputs(rng):
    x = rng.standard_normal((2, 3, 4))
    np.testing.assert_array_equal(Flatten()(x), x.reshape(2, 12))
    np.testing.assert_array_equal(Flatten(0)(np.float64(3.0)), [3.0])  # a scalar flattens to (1,)


def test_flatten_matches_torch(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 3, 4, 5))
    for start, end in [(1, -1), (0, 2), (-3, -2), (2, 2)]:
        expected = torch.nn.Flatten(start, end)(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(Flatten(start, end, layout="NCHW")(x), expected)


def test_flatten_errors_name_the_dims():
    x = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="Flatten: start_dim 2 comes after end_dim 1"):
        Flatten(2, 1)(x)
    with pytest.raises(ValueError, match=r"Flatten: end_dim 3 is out of range for a 3-D input \(expected -3..2\)"):
        Flatten(0, 3)(x)
    with pytest.raises(TypeError, match="Flatten: start_dim must be an int, got float"):
        Flatten(1.0)(x)
    with pytest.raises(ValueError, match="Flatten: layout must be one of"):
        Flatten(layout="HWC")


@pytest.mark.parametrize("activation", [None, "relu", "own"])
def test_sequential_fuses_flatten_nhwc_linear_and_matches_the_layers_one_by_one(rng, activation):
    fc = Linear(4 * 3 * 5, 7, activation="relu" if activation == "own" else None, dtype="fp64", seed=2)
    layers = [Flatten(), fc] + ([ReLU()] if activation == "relu" else [])
    model = Sequential(*layers)
    fused = model.fused()
    assert len(fused) == 1 and type(fused[0][1]).__name__ == "FlattenLinear"
    x = rng.standard_normal((2, 4, 3, 5))  # NHWC

    def one_by_one():
        y = x
        for layer in layers:
            y = layer(y)
        return y

    assert rel_error(model(x), one_by_one()) <= 1e-14
    state = model.state_dict()
    assert set(state) == {"1.weight", "1.bias"} and state["1.weight"] is fc.weight  # the parameter stays PyTorch's
    model.load_state_dict({k: v * 2 for k, v in state.items()})  # a reload refreshes the permuted copy
    assert rel_error(model(x), one_by_one()) <= 1e-14


def test_flatten_linear_on_other_ranks_flattens_as_the_layers_do(rng):
    model = Sequential(Flatten(), Linear(12, 3, dtype="fp64", seed=0))
    x = rng.standard_normal((2, 3, 4))
    np.testing.assert_array_equal(model(x), model[1](x.reshape(2, 12)))
    with pytest.raises(ValueError, match="linear: x has 20 features"):
        model(rng.standard_normal((2, 2, 2, 5)))


def test_dropout_is_the_identity_and_keeps_p(rng):
    x = rng.standard_normal((3, 4))
    layer = Dropout(0.3)
    assert layer(x) is x and layer.p == 0.3 and Dropout().p == 0.5
    with pytest.raises(ValueError, match=r"Dropout: p must be a probability in \[0, 1\], got 1.5"):
        Dropout(1.5)


# --- Softmax, LogSoftmax and the softmax op -----------------------------------------------------------
@pytest.mark.parametrize("shape,dim", [((7,), 0), ((4, 9), -1), ((4, 9), 0), ((3, 5, 6), 1), ((2, 3, 4, 5), -3)])
def test_softmax_and_log_softmax_layers_match_the_numpy_formula(rng, shape, dim):
    x = rng.standard_normal(shape) * 4
    expected = log_softmax_formula(x, dim)
    assert rel_error(LogSoftmax(dim)(x), expected) <= 1e-14
    assert rel_error(Softmax(dim)(x), np.exp(expected)) <= 1e-14
    np.testing.assert_allclose(Softmax(dim)(x).sum(axis=dim), 1, rtol=1e-14)


def test_softmax_dim_defaults_to_the_last_like_the_layers_signature(rng):
    x = rng.standard_normal((3, 4))
    np.testing.assert_array_equal(Softmax()(x), softmax(x, -1))
    np.testing.assert_array_equal(LogSoftmax()(x), softmax(x, -1, log=True))


def test_log_softmax_stays_finite_where_softmax_underflows():
    x = np.array([0.0, -1000.0, 1000.0])
    np.testing.assert_allclose(softmax(x, log=True), [-1000.0, -2000.0, 0.0])
    np.testing.assert_array_equal(softmax(x), [0.0, 0.0, 1.0])


def test_softmax_propagates_nan_within_the_slice_only():
    x = np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]])
    y = softmax(x)
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
def test_softmax_reference_keeps_the_dtype_and_rounds_once(rng, dtype):
    x = random_normal(rng, (5, 13), dtype, scale=3)
    y = softmax(x, log=True)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_error(y, log_softmax_formula(x.astype(np.float64), -1)) <= dtypes.TOLERANCE[dtype]


def test_softmax_of_an_empty_slice_is_empty():
    assert softmax(np.zeros((0, 4))).shape == (0, 4) and softmax(np.zeros((3, 0)), log=True).shape == (3, 0)


def test_softmax_errors_say_what_was_expected():
    with pytest.raises(ValueError, match=r"softmax: dim 2 is out of range for x of shape \(3, 4\) \(expected -2..1\)"):
        softmax(np.zeros((3, 4)), 2)
    with pytest.raises(ValueError, match=r"log_softmax: x must have at least 1 dimension"):
        softmax(np.float64(1.0), log=True)
    with pytest.raises(TypeError, match="softmax: x must be a floating-point array.*got int64"):
        softmax(np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="softmax: dim must be an int, got NoneType"):
        softmax(np.zeros(3), None)
    with pytest.raises(ValueError, match="softmax: unknown path 'cudnn'"):
        softmax(np.zeros(3), path="cudnn")


# --- Embedding ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids_dtype", [np.int64, np.int32, np.uint8])
def test_embedding_gathers_rows_by_id(rng, ids_dtype):
    layer = Embedding(12, 5, seed=1)
    assert list(layer.state_dict()) == ["weight"] and layer.weight.shape == (12, 5)
    ids = rng.integers(0, 12, (3, 4)).astype(ids_dtype)
    y = layer(ids)
    assert y.shape == (3, 4, 5) and y.dtype == np.float32
    np.testing.assert_array_equal(y, layer.weight[ids])
    np.testing.assert_array_equal(layer(np.int64(7)), layer.weight[7])


def test_embedding_padding_idx_starts_as_zeros_and_is_kept():
    layer = Embedding(10, 4, padding_idx=-1, seed=0, dtype="fp16")
    assert layer.padding_idx == 9 and layer.weight.dtype == np.float16  # negative counts from the end, as PyTorch
    np.testing.assert_array_equal(layer.weight[9], 0)
    assert np.all(np.abs(layer.weight[:9]).sum(axis=1) > 0)
    state = {"weight": np.ones((10, 4), np.float16)}
    layer.load_state_dict(state)  # at inference the padding row is whatever the checkpoint holds
    assert layer.padding_idx == 9 and np.all(layer(np.array([9])) == 1)
    assert repr(layer) == "Embedding(10, 4, padding_idx=9)"


def test_embedding_errors_name_ids_and_the_range():
    layer = Embedding(10, 4)
    with pytest.raises(TypeError, match="Embedding: ids must be an integer array.*got dtype float32"):
        layer(np.zeros(3, np.float32))
    with pytest.raises(IndexError, match=r"Embedding: ids must be in \[0, 10\) \(num_embeddings\), got 10 at "
                                         r"position \(1, 0\) \(2 out of range; min -1, max 10\)"):
        layer(np.array([[1, 2], [10, -1]]))
    with pytest.raises(ValueError, match=r"Embedding: padding_idx must be in \[-10, 10\)"):
        Embedding(10, 4, padding_idx=10)
    with pytest.raises(ValueError, match="Embedding: embedding_dim must be a non-negative int"):
        Embedding(10, -4)


def test_embedding_matches_torch(rng):
    torch = pytest.importorskip("torch")
    reference = torch.nn.Embedding(20, 6, padding_idx=3)
    layer = Embedding(20, 6, padding_idx=3)
    layer.load_state_dict({k: v.detach().numpy() for k, v in reference.state_dict().items()})
    ids = rng.integers(0, 20, (4, 7))
    np.testing.assert_array_equal(layer(ids), reference(torch.from_numpy(ids)).detach().numpy())
    np.testing.assert_array_equal(layer.weight[3], 0)


# --- GPU ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected_log_probs(heldout):
    return SeedCNN.pretrained(dtype="fp64", path="reference")(heldout[0].astype(np.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "custom"])
def test_gpu_model_fp32_matches_the_reference_path(heldout, expected_log_probs, path):
    import cupy

    got = SeedCNN.pretrained(dtype="fp32", device="gpu", path=path)(cupy.asarray(heldout[0]))
    assert got.dtype == cupy.float32
    assert rel_error(got, expected_log_probs) <= 1e-4  # exact fp32 (no TF32) in cuDNN and cuBLASLt
    assert (got.get().argmax(1) == expected_log_probs.argmax(1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("path", ["auto", "custom"])
def test_gpu_model_half_precision_agrees_with_the_reference_path(heldout, expected_log_probs, dtype, path):
    import cupy

    got = SeedCNN.pretrained(dtype=dtype, device="gpu", path=path)(cupy.asarray(heldout[0]))
    assert got.dtype == dtypes.parse(dtype)
    assert (got.get().argmax(1) == expected_log_probs.argmax(1)).mean() >= 0.99
    assert rel_error(got, expected_log_probs) <= (2e-2 if dtype == "fp16" else 5e-2)  # bf16: 8-bit mantissa


@pytest.mark.gpu
def test_gpu_model_refuses_host_input():
    with pytest.raises(TypeError, match="SeedCNN: x is a numpy.ndarray in host memory but the model's weights"):
        SeedCNN(device="gpu")(np.zeros((1, 1, 28, 28), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("shape,dim", [((1,), 0), ((7,), -1), ((3, 1000), 1), ((129, 33), 0), ((5, 33, 17), 1),
                                       ((2, 3, 4, 257), -1)])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_custom_matches_reference(rng, poisoned_gpu_memory, dtype, shape, dim, log):
    import cupy

    x = random_normal(rng, shape, dtype, scale=3)
    got = softmax(cupy.asarray(x), dim, log=log, path="custom")
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_error(got, softmax(x, dim, log=log, path="reference")) <= dtypes.TOLERANCE[dtype]


@pytest.mark.gpu
def test_softmax_auto_takes_custom_on_the_gpu_and_refuses_custom_on_the_host():
    import cupy

    from libnn.ops.softmax import op

    softmax(cupy.ones((2, 3), cupy.float32))
    assert op.last_decision.path == "custom"
    with pytest.raises(TypeError, match="softmax: path 'custom' runs on the GPU"):
        softmax(np.ones(3), path="custom")


@pytest.mark.gpu
def test_embedding_on_the_gpu_gathers_and_checks_the_range(rng):
    import cupy

    host = Embedding(50, 8, seed=2)
    layer = Embedding(50, 8, seed=2, device="gpu", check_ids="sync")  # "lazy": tests/test_embedding_layer_gpu.py
    ids = rng.integers(0, 50, (4, 9))
    np.testing.assert_array_equal(layer(cupy.asarray(ids)).get(), host(ids))
    with pytest.raises(IndexError, match=r"Embedding: ids must be in \[0, 50\).*got 50"):
        layer(cupy.asarray([3, 50]))
    with pytest.raises(TypeError, match="Embedding: ids is a numpy.ndarray in host memory but the weight is"):
        layer(ids)


@pytest.mark.gpu
def test_flatten_on_the_gpu_matches_the_host(rng):
    import cupy

    x = rng.standard_normal((2, 4, 5, 3))
    np.testing.assert_array_equal(Flatten()(cupy.asarray(x)).get(), Flatten()(x))
