"""What a repeated eager call of SeedCNN does on the host, and the caches that spare it work: Sequential's
fusion plan (made once per version), the model's input parameter, nn.Conv2d's conv2d options, the pooling
layers' sizes and FlattenLinear's permuted weight. Each cache is checked to be made again when what it
came from changes, and the cached calls to give what the layers give one by one. The GPU path runs
against a stand-in for CuPy and the kernel launch (as tests/test_cached_calls_host.py does)."""

import importlib.machinery
import sys
import types

import numpy as np
import pytest

import libnn
from libnn import dtypes, nn
from libnn.models.seed_cnn import SeedCNN
from libnn.nn import conv as conv_layers
from libnn.nn import pool as pool_layers
from libnn.nn import sequential
from libnn.ops import conv2d, max_pool2d
from libnn.runtime import launch

from conftest import random_normal, rel_error
from gpu_stand_ins import CUDA, device_empty, on_device, report_a_gpu

CONV = sys.modules["libnn.ops.conv2d"]
OPS = ("conv2d", "pool2d", "linear", "softmax")


# --- the GPU path against a stand-in for CuPy and the launch ----------------------------------------------
class StandInCupy(types.ModuleType):
    """NumPy's functions under CuPy's name, the arrays they make taken for device arrays."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture
def fake_gpu(monkeypatch):
    """CuPy made by NumPy, a GPU and a stream reported, and every kernel launch recorded: returns the
    launches, each as the arrays passed."""
    launches = []
    cupy = StandInCupy("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.empty = device_empty
    cupy.ndarray = lambda shape, dtype, memptr=None: device_empty(shape, dtype)  # memptr: CUDA.alloc's stand-in
    cupy.asarray = lambda a, dtype=None: on_device(np.asarray(a, dtype))
    cupy.ascontiguousarray = lambda a: on_device(np.ascontiguousarray(a))
    cupy.cuda = CUDA
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch, "bind", lambda file, kernel, grid, block, args, **options:
                        lambda *passed: launches.append(passed))
    report_a_gpu(monkeypatch)
    for name in OPS:
        libnn.get_op(name).calls.clear()
    yield launches
    for name in OPS:  # bound with the stand-ins: no later test may find them
        libnn.get_op(name).calls.clear()


def gpu_model(dtype="fp16") -> SeedCNN:
    model = SeedCNN.pretrained(dtype=dtype, path="custom")
    return model.to("gpu")


def builds() -> dict[str, int]:
    return {name: libnn.get_op(name).calls.stats.builds for name in OPS}


def test_a_repeated_call_plans_keys_and_binds_nothing_again(rng, fake_gpu, monkeypatch):
    """The second call of the same signature runs the 7 kernels with nothing of the first call's set-up:
    no fusion plan, Sequential indexing, conv options, pooling sizes, folded or permuted weight, bind."""
    launches = fake_gpu
    model = gpu_model()
    x = on_device(random_normal(rng, (1, 1, 28, 28), "fp16"))
    first = model(x)
    assert first.shape == (1, 10) and first.dtype == np.float16 and len(launches) == 7
    bound = builds()

    def refuse(*args, **kwargs):
        raise AssertionError("called again by a cached call")
    for owner, name in ((nn.Sequential, "_fuse"), (nn.Sequential, "__getitem__"),
                        (conv_layers.Conv2d, "conv2d_options"), (conv_layers, "conv_options"),
                        (conv_layers.Conv2dBNAct, "_remake"), (pool_layers.MaxPool2d, "_op_sizes"),
                        (sequential, "_permuted_columns")):
        monkeypatch.setattr(owner, name, refuse)
    second = model(x)
    assert second.shape == (1, 10) and len(launches) == 14 and builds() == bound
    # the fp16 input goes to the first conv as it is (a view of it in NHWC, no cast), every later op
    # reads what the op before it wrote
    assert np.shares_memory(launches[7][0], x) and launches[7][0].shape == (1, 28, 28, 1)
    for earlier, later in zip(launches[7:13], launches[8:14]):
        assert np.shares_memory(later[0], earlier[-1])


def test_an_input_of_another_dtype_is_cast_once_and_a_host_input_refused_as_before(rng, fake_gpu):
    launches = fake_gpu
    model = gpu_model()
    x = on_device(random_normal(rng, (2, 1, 28, 28), "fp32"))
    model(x)
    sent = launches[0][0]
    assert sent.dtype == np.float16 and not np.shares_memory(sent, x)
    np.testing.assert_array_equal(sent.reshape(x.shape), x.astype(np.float16))
    with pytest.raises(TypeError, match=r"^SeedCNN: x is a numpy.ndarray in host memory but the model's weights "
                                        r"are a cupy.DeviceArray on GPU 0; move x"):
        model(np.asarray(x))


def test_conv2d_passes_an_epilogue_as_given_and_folds_or_refuses_the_rest_as_before(rng, fake_gpu):
    """An fp32 (scale, shift) pair, or an fp32 bias alone, on contiguous x and w reaches the kernel as the
    caller's own arrays at every call (no check or copy per call); a 5-tuple bn, bn with a bias and an
    fp16 bias are folded or converted at every call, from that call's values; a bad bn is refused at
    the bind, and again when its call comes back."""
    launches = fake_gpu
    x, w = (on_device(random_normal(rng, shape, "fp16")) for shape in ((1, 5, 5, 3), (4, 3, 3, 3)))

    def refuse(*args):
        raise AssertionError("the epilogue's vectors checked and converted again in a cached call")

    def vector(dtype="fp32", low=None):  # at CuPy's alignment, as its allocations are (a keyed pointer bit)
        v = device_empty((4,), dtypes.parse(dtype))
        v[...] = random_normal(rng, (4,), dtype) if low is None else rng.uniform(low, 2, 4)
        return v

    def calls_as_given():
        scale, shift = vector(), vector()
        conv2d(x, w, bn=(scale, shift), path="custom")
        assert launches[-1][2] is scale and launches[-1][3] is shift and launches[-1][0] is x
        bias = vector()
        conv2d(x, w, bias, path="custom")
        assert launches[-1][2] is None and launches[-1][3] is bias
        return scale, shift
    calls_as_given()  # the binds
    with pytest.MonkeyPatch.context() as patch:  # cached calls: each passes its own arrays
        patch.setattr(CONV, "_epilogue_vectors", refuse)
        scale, shift = calls_as_given()
    gamma, beta, mean, var = vector(), vector(), vector(), vector(low=0.5)
    bias16 = vector("fp16")
    for _ in range(2):
        conv2d(x, w, bn=(gamma, beta, mean, var, 1e-5), path="custom")
        expected_scale = gamma / np.sqrt(var + 1e-5)
        np.testing.assert_allclose(launches[-1][2], expected_scale, rtol=1e-6)
        np.testing.assert_allclose(launches[-1][3], beta - mean * expected_scale, rtol=1e-5, atol=1e-6)
        conv2d(x, w, bias16, bn=(scale, shift), path="custom")
        np.testing.assert_allclose(launches[-1][3], shift + bias16.astype(np.float32) * scale, rtol=1e-6)
        gamma = vector()  # the next round's values: folded from them, not from the bind's
    for _ in range(2):
        with pytest.raises(ValueError, match=r"conv2d: bn\[1\] must have shape \(4,\) to match w's 4 output"):
            conv2d(x, w, bn=(scale, vector()[:3]), path="custom")
        with pytest.raises(TypeError, match=r"conv2d: bn must be a tuple"):
            conv2d(x, w, bn=iter((scale, shift)), path="custom")


# --- Sequential's fusion plan -------------------------------------------------------------------------------
def conv_block(dtype="fp64"):
    kw = dict(dtype=dtype)
    rng = np.random.default_rng(5)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, seed=0, **kw), nn.BatchNorm2d(6, **kw), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(6, 4, 3, seed=1, **kw), nn.SiLU())
    bn = model[1]
    bn.load_state_dict({k: rng.uniform(0.5, 1.5, 6).astype(v.dtype) for k, v in bn.state_dict().items()})
    return model


def layer_by_layer(model, x):
    for i in range(len(model)):
        x = model[i](x)
    return x


def test_the_plan_is_made_once_and_again_after_a_parameter_or_layer_is_replaced(rng):
    model = conv_block()
    x = rng.standard_normal((2, 8, 8, 3))
    plan = model.fused()
    assert [names for names, _ in plan] == ["0+1+2", "3", "4+5"]
    model(x)
    model(x)
    assert model.fused() is plan

    model[4].weight = model[4].weight * 2  # a parameter reassigned
    assert model.fused() is not plan
    assert rel_error(model(x), layer_by_layer(model, x)) <= 1e-12

    plan = model.fused()
    model[1].running_var[:] = 3.0  # changed in place: the version, and so the plan, stay (module docstring)
    assert model.fused() is plan

    setattr(model, "2", nn.ReLU6())  # a layer replaced
    assert model.fused() is not plan and model.describe()[0].startswith("0+1+2: Conv2d+BatchNorm2d+relu6 fused")
    assert rel_error(model(x), layer_by_layer(model, x)) <= 1e-12

    plan = model.fused()
    model.load_state_dict({k: v + 0.25 for k, v in model.state_dict().items()})
    assert model.fused() is not plan
    assert rel_error(model(x), layer_by_layer(model, x)) <= 1e-12

    model.to("fp32")
    assert model(x.astype(np.float32)).dtype == np.float32


def test_the_plan_is_made_again_when_fold_bn_is_set(rng):
    model = conv_block()
    x = rng.standard_normal((1, 6, 6, 3))
    folded = model(x)
    assert model.describe()[0].endswith("(BN folded into the weights)")
    model.fold_bn = False
    assert model.describe()[0].endswith("(BN as the epilogue)")
    assert rel_error(model(x), folded) <= 1e-12 and rel_error(model(x), layer_by_layer(model, x)) <= 1e-12


def test_a_module_that_overrides_call_is_called_and_forward_is_looked_up_at_every_call(rng, monkeypatch):
    """Sequential calls forward itself, without Module.__call__'s frame, only for modules that keep it:
    an override of __call__ runs, and a forward patched after the plan was made is the one called."""
    seen = []

    class Logged(nn.Module):
        def __call__(self, x):
            seen.append("__call__")
            return self.forward(x) * 2

        def forward(self, x):
            return x + 1

    x = rng.standard_normal((2, 3))
    model = nn.Sequential(nn.ReLU(), Logged())
    np.testing.assert_array_equal(model(x), (np.maximum(x, 0) + 1) * 2)
    assert seen == ["__call__"]

    plain = nn.Sequential(nn.ReLU(), nn.Dropout())
    plain(x)
    monkeypatch.setattr(nn.Dropout, "forward", lambda self, x: -x)
    np.testing.assert_array_equal(plain(x), -np.maximum(x, 0))


def test_use_path_after_a_call_reaches_the_folded_conv(rng):
    """The folded conv is a clone of the model's Conv2d made at the first call: a path use_path sets on
    the model later is the clone's too (here a GPU path, refused for host arrays by the first op)."""
    model = SeedCNN.pretrained()
    x = rng.standard_normal((1, 1, 28, 28)).astype(np.float32)
    model(x)
    model.use_path("custom")
    with pytest.raises(TypeError, match=r"^conv2d: path 'custom' runs on the GPU"):
        model(x)
    model.use_path("reference")
    assert model(x).shape == (1, 10)


# --- SeedCNN's input parameter ------------------------------------------------------------------------------
def test_the_input_follows_the_first_conv_after_a_cast_or_a_replaced_weight(rng):
    model = SeedCNN.pretrained()
    x = rng.standard_normal((2, 1, 28, 28)).astype(np.float32)
    expected = model(x)
    assert expected.dtype == np.float32
    model.to("fp64")
    assert model(x).dtype == np.float64 and rel_error(model(x), expected) < 1e-5
    model.features[0].weight = model.features[0].weight.astype(np.float32)
    with pytest.raises(TypeError, match=r"^conv2d: w has dtype fp64 but x has fp32"):
        model(x.astype(np.float64))  # the input takes fp32, the folded weight was built from the new one


# --- nn.Conv2d's options ------------------------------------------------------------------------------------
def test_conv_layer_options_are_keyed_once_and_again_after_one_is_set(rng):
    layer = nn.Conv2d(3, 4, 3, padding=1, dtype="fp64", seed=0)
    x = rng.standard_normal((1, 8, 8, 3))
    layer(x)
    options = layer.conv2d_options()
    layer(x)
    assert layer.conv2d_options() is options
    layer.stride = (2, 2)
    assert layer.conv2d_options() is not options
    y = layer(x)
    assert y.shape == (1, 4, 4, 4)
    assert rel_error(y, conv2d(x, layer.filters(), layer.bias, stride=2, padding=1)) == 0
    layer.use_path("custom")  # a GPU path: refused for host arrays, so the layer passed it
    with pytest.raises(TypeError, match=r"^conv2d: path 'custom' runs on the GPU"):
        layer(x)


def test_conv2d_with_finds_conv2ds_bound_calls_and_refuses_what_it_refuses(rng):
    x, w, b = rng.standard_normal((1, 6, 6, 2)), rng.standard_normal((3, 3, 3, 2)), rng.standard_normal(3)
    op = libnn.get_op("conv2d")
    y = conv2d(x, w, b, stride=(1, 1), padding=1, activation="relu")
    size = len(op.calls)
    options = CONV.conv_options(stride=(1, 1), padding=1)
    assert rel_error(CONV.conv2d_with(options, x, w, b, activation="relu"), y) == 0
    assert len(op.calls) == size  # the same key: the bound call conv2d made
    for bad in ((1.0, 1.0), [1, True], "1"):  # never the bound call of (1, 1): refused as conv2d refuses them
        with pytest.raises(TypeError) as by_conv2d:
            conv2d(x, w, b, stride=bad, padding=1)
        with pytest.raises(TypeError) as by_options:
            CONV.conv2d_with(CONV.conv_options(stride=bad, padding=1), x, w, b)
        assert str(by_options.value) == str(by_conv2d.value)


# --- the pooling layers' sizes ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [nn.MaxPool2d, nn.AvgPool2d])
def test_pooling_passes_square_sizes_as_ints_and_computes_what_the_pairs_do(rng, kind):
    x = rng.standard_normal((2, 7, 9, 3))
    op = max_pool2d if kind is nn.MaxPool2d else libnn.ops.avg_pool2d
    for args, sizes in (((2,), (2, 2, 0)), (((2, 3), None, 1), ((2, 3), (2, 3), 1)),
                        ((3, (1, 2), (1, 0)), (3, (1, 2), (1, 0)))):
        layer = kind(*args)
        assert layer._op_sizes() == sizes
        np.testing.assert_array_equal(layer(x), op(x, layer.kernel_size, layer.stride, layer.padding))


def test_pooling_sizes_follow_an_attribute_set_later_with_the_ops_errors(rng):
    layer = nn.MaxPool2d(2)
    x = rng.standard_normal((1, 6, 6, 2))
    assert layer(x).shape == (1, 3, 3, 2)
    layer.kernel_size = layer.stride = (3, 3)
    assert layer(x).shape == (1, 2, 2, 2)
    layer.kernel_size = (0, 0)  # never squared into 0: the op's error names the pair as it came
    with pytest.raises(ValueError, match=r"^max_pool2d: kernel_size must be an int or a pair of ints >= 1, "
                                         r"got \(0, 0\)$"):
        layer(x)
    layer.kernel_size = (np.int64(2), np.int64(2))  # not exactly int: passed as it is
    assert layer._op_sizes()[0] == (2, 2) and layer(x).shape == (1, 2, 2, 2)


# --- FlattenLinear's permuted weight ------------------------------------------------------------------------
def test_flatten_linear_permutes_once_per_weight_and_image_shape(rng):
    fc = nn.Linear(2 * 3 * 4, 5, dtype="fp64", seed=1)
    model = nn.Sequential(nn.Flatten(), fc, nn.ReLU())
    fused = model.fused()[0][1]
    x = rng.standard_normal((1, 2, 3, 4))

    def one_by_one(x):
        return np.maximum(nn.Flatten()(x) @ fc.weight.T + fc.bias, 0)
    assert rel_error(model(x), one_by_one(x)) <= 1e-15
    permuted = fused._permuted[2]
    wider = rng.standard_normal((6, 2, 3, 4))  # another batch: the same permuted weight
    assert rel_error(model(wider), one_by_one(wider)) <= 1e-15 and fused._permuted[2] is permuted
    assert fused._weight((6, 2, 3, 4)) is permuted

    fc.weight = rng.standard_normal(fc.weight.shape)  # replaced: a new plan, a new permutation
    assert rel_error(model(x), one_by_one(x)) <= 1e-15
    other = rng.standard_normal((1, 4, 3, 2))  # another (H, W, C) of the same features: permuted for it
    assert rel_error(model(other), one_by_one(other)) <= 1e-15
    with pytest.raises(ValueError, match="linear"):
        model(rng.standard_normal((1, 2, 3, 5)))  # features the Linear does not take: refused by its op
