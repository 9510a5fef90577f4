"""Conv layers and Sequential's fusion: the fused model computes what the layers compute one by one."""

import numpy as np
import pytest

from libnn import nn
from conftest import rel_error


def model(fold_bn=True, dtype="fp64", device="cpu", layout="NHWC"):
    kw = dict(dtype=dtype, device=device, layout=layout)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, seed=0, **kw), nn.BatchNorm2d(8, **kw), nn.ReLU6(),
                      nn.MaxPool2d(2, layout=layout), nn.Conv2d(8, 6, 3, stride=2, seed=3, **kw), nn.SiLU(),
                      nn.Conv2d(6, 6, 3, padding=1, groups=6, seed=5, **kw), nn.BatchNorm2d(6, **kw),
                      fold_bn=fold_bn)
    rng = np.random.default_rng(9)
    for bn in (m[1], m[7]):  # non-trivial statistics
        bn.load_state_dict({k: rng.uniform(0.5, 1.5, bn.num_features).astype(v.dtype) if "var" in k or k == "weight"
                            else rng.normal(size=bn.num_features).astype(v.dtype) for k, v in bn.state_dict().items()})
    return m


def layer_by_layer(m, x):
    for i in range(len(m)):
        x = m[i](x)
    return x


@pytest.mark.parametrize("fold_bn", [True, False])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_fused_sequential_matches_layer_by_layer(rng, fold_bn, layout):
    m = model(fold_bn, layout=layout)
    x = rng.standard_normal((2, 12, 12, 3) if layout == "NHWC" else (2, 3, 12, 12))
    assert [names for names, _ in m.fused()] == ["0+1+2", "3", "4+5", "6+7"]
    assert rel_error(m(x), layer_by_layer(m, x)) <= 1e-12


def test_state_dict_keeps_pytorch_names_and_reload_refuses_stale_fusion(rng):
    m = model()
    assert "1.running_var" in m.state_dict() and "6.weight" in m.state_dict()
    x = rng.standard_normal((1, 8, 8, 3))
    before = m(x)
    state = {k: v * 1.5 for k, v in m.state_dict().items()}
    m.load_state_dict(state)
    assert rel_error(m(x), layer_by_layer(m, x)) <= 1e-12 and rel_error(m(x), before) > 1e-3


def test_describe_says_what_was_fused():
    lines = model().describe()
    assert lines[0] == "0+1+2: Conv2d+BatchNorm2d+relu6 fused (BN folded into the weights)"
    assert "Conv2d+silu fused" in lines[2]


def test_conv_layer_weight_is_pytorch_layout_and_nhwc_copy_is_cached():
    conv = nn.Conv2d(4, 8, (3, 5), groups=2, seed=1)
    assert conv.weight.shape == (8, 2, 3, 5)
    assert conv.filters().shape == (8, 3, 5, 2) and conv.filters() is conv.filters()


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_conv_layer_fft_algo_matches_direct(rng, layout):
    kw = dict(layout=layout, dtype="fp64", seed=4)
    direct = nn.Conv2d(3, 5, 7, padding=3, algo="direct", **kw)
    fft = nn.Conv2d(3, 5, 7, padding=3, algo="fft", **kw)
    x = rng.standard_normal((2, 20, 20, 3) if layout == "NHWC" else (2, 3, 20, 20))
    bn = (rng.uniform(0.5, 2, 5), rng.normal(size=5))
    assert fft.uses_fft(x) and not direct.uses_fft(x)
    assert rel_error(fft(x, bn=bn, activation="silu"), direct(x, bn=bn, activation="silu")) <= 1e-12


def test_auto_algo_follows_the_measured_crossover():
    from libnn.nn.conv import prefers_fft

    assert prefers_fft(1, 2048, 31) and not prefers_fft(1, 1000, 7) and not prefers_fft(1, 256, 15)
    assert not prefers_fft(16, 64, 63) and prefers_fft(16, 1024, 31)
    big, small = nn.Conv2d(1, 1, 63, seed=0), nn.Conv2d(1, 1, 3, seed=0)
    assert big.uses_fft(np.ones((1, 256, 256, 1))) and big.uses_fft(np.ones((1, 70, 70, 1)))
    assert not small.uses_fft(np.ones((1, 1024, 1024, 1)))
    with pytest.raises(ValueError, match="algo='fft' needs stride 1"):
        nn.Conv2d(1, 1, 3, stride=2, algo="fft")


def test_with_parameters_builds_a_conv_of_the_same_configuration_holding_the_given_arrays():
    conv = nn.Conv2d(4, 6, (3, 1), stride=2, padding=(1, 0), groups=2, activation="relu", layout="NCHW",
                     dtype="fp64", algo="direct", seed=0)
    conv.path = "reference"  # as use_path sets it
    weight, bias = np.ones_like(conv.weight), np.full(6, 0.5)
    clone = conv.with_parameters(weight, bias)
    assert type(clone) is nn.Conv2d and clone is not conv
    assert clone.weight is weight and clone.bias is bias and conv.weight is not weight
    for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                 "activation", "layout", "algo", "path"):
        assert getattr(clone, name) == getattr(conv, name), name
    assert set(clone.state_dict()) == {"weight", "bias"}


# --- a conv's configuration set after the model ran --------------------------------------------------------
@pytest.mark.parametrize("fold_bn", [True, False])
@pytest.mark.parametrize("name, value, stored", [("stride", 2, (2, 2)), ("padding", (0, 2), (0, 2)),
                                                 ("dilation", 2, (2, 2))], ids=lambda v: str(v))
def test_a_fused_conv_follows_its_configuration_set_after_a_call(rng, fold_bn, name, value, stored):
    """Conv2dBNAct's folded clone was configured as the conv at the first call: a stride, padding or
    dilation set later is the clone's too (it computed the old geometry before, silently)."""
    m = model(fold_bn)
    x = rng.standard_normal((2, 12, 12, 3))
    before = m(x)
    version = m.version
    setattr(m[0], name, value)
    assert getattr(m[0], name) == stored and m.version != version
    after = m(x)
    assert rel_error(after, layer_by_layer(m, x)) <= 1e-12
    assert after.shape != before.shape or rel_error(after, before) > 1e-3


def test_a_standalone_conv_bn_act_follows_a_replaced_weight_and_bn(rng):
    """Not only Sequential's rebuild: the fused module itself makes its clone and epilogue again when the
    conv's or the BN's parameters are replaced."""
    m = model()
    fused = nn.Conv2dBNAct(m[0], m[1], "relu6")
    x = rng.standard_normal((1, 6, 6, 3))
    fused(x)
    m[0].weight = m[0].weight * 2
    m[1].running_mean = m[1].running_mean + 1
    assert rel_error(fused(x), m[2](m[1](m[0](x)))) <= 1e-12


def test_setting_the_same_configuration_keeps_the_version_and_a_wrong_one_is_refused():
    conv = nn.Conv2d(2, 4, 3, stride=2, dtype="fp64", seed=0)
    version = conv.version
    conv.stride = (2, 2)
    conv.padding = 0
    assert conv.version == version
    with pytest.raises(ValueError, match=r"^Conv2d: stride must be .*got 0"):
        conv.stride = 0
    with pytest.raises(ValueError, match=r"^Conv2d: layout must be one of \('NHWC', 'NCHW'\), got 'HWC'"):
        conv.layout = "HWC"
    with pytest.raises(TypeError, match=r"^Conv2d: groups must be an int"):
        conv.groups = 1.5
    assert conv.stride == (2, 2) and conv.version == version


def test_fft_after_a_stride_change_is_refused_and_auto_goes_direct(rng):
    """algo="auto" chose FFT at stride 1; at stride 2 it must run direct (FFT convolution has no stride),
    and algo="fft" set on a strided conv is refused at the call, as the constructor refuses it."""
    conv = nn.Conv2d(1, 1, 63, dtype="fp64", seed=0)
    x = rng.standard_normal((1, 70, 70, 1))
    assert conv.uses_fft(x)
    conv.stride = 2
    assert not conv.uses_fft(x)
    direct = nn.Conv2d(1, 1, 63, stride=2, dtype="fp64", algo="direct", seed=0)
    assert rel_error(conv(x), direct(x)) <= 1e-12
    conv.algo = "fft"
    with pytest.raises(ValueError, match="algo='fft' needs stride 1"):
        conv(x)
