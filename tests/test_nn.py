"""Layers: parameters by PyTorch's names, loading that checks before it changes anything."""

import math

import numpy as np
import pytest

from libnn import nn
from libnn.ops.linear import linear
from conftest import random_normal, rel_error


def test_linear_layer_computes_linear_with_its_parameters(rng):
    layer = nn.Linear(6, 4, activation="relu", seed=3)
    x = random_normal(rng, (2, 5, 6), "fp32")
    assert rel_error(layer(x), linear(x, layer.weight, layer.bias, "relu")) == 0
    assert layer(x).shape == (2, 5, 4)


def test_linear_layer_takes_an_activation_override_and_sequential_fuses_through_it(rng, monkeypatch):
    layer = nn.Linear(6, 4, seed=3, dtype="fp64")
    x = random_normal(rng, (3, 6), "fp64")
    assert rel_error(layer(x, activation="relu"), linear(x, layer.weight, layer.bias, "relu")) == 0
    assert layer.activation is None  # the override is for this call only
    seen = []
    forward = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, *a, **k: seen.append(k) or forward(self, *a, **k))
    y = nn.Sequential(layer, nn.ReLU())(x)
    assert seen == [{"activation": "relu"}] and rel_error(y, np.maximum(x @ layer.weight.T + layer.bias, 0)) < 1e-15


def test_state_dict_uses_pytorch_names_and_round_trips(rng):
    a, b = nn.Linear(3, 2, seed=0), nn.Linear(3, 2, seed=1)
    assert set(a.state_dict()) == {"weight", "bias"}
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.weight, b.weight)


def test_failed_load_changes_nothing(rng):
    layer = nn.Linear(3, 2, seed=0)
    before = layer.weight.copy()
    with pytest.raises(ValueError, match=r"weight has shape \(2, 4\), the layer expects \(2, 3\)"):
        layer.load_state_dict({"weight": np.zeros((2, 4), np.float32), "bias": np.ones(2, np.float32)})
    with pytest.raises(KeyError, match=r"missing keys \['bias'\], unexpected keys \['extra'\]"):
        layer.load_state_dict({"weight": before, "extra": before})
    np.testing.assert_array_equal(layer.weight, before)


def test_to_dtype_casts_every_parameter():
    layer = nn.Linear(3, 2, seed=0).to("fp16")
    assert layer.weight.dtype == np.float16 and layer.bias.dtype == np.float16


def test_gelu_is_exact_by_default_like_pytorch_and_fuses_only_where_supported(rng):
    from libnn.nn import GELU, Conv2d, Linear, Sequential

    x = random_normal(rng, (4, 8), "fp64")
    assert GELU().name == "gelu_erf" and GELU(approximate="tanh").name == "gelu"
    exact = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert rel_error(GELU()(x), exact) < 1e-15
    with pytest.raises(ValueError, match="approximate must be"):
        GELU(approximate="fast")
    mlp = Sequential(Linear(8, 8, dtype="fp64"), GELU())
    assert mlp.describe() == ["0+1: Linear+gelu_erf fused (activation in the epilogue)"]
    conv = Sequential(Conv2d(3, 4, 3, dtype="fp64"), GELU())  # conv kernels compile no erf GELU
    assert [names for names, _ in conv.fused()] == ["0", "1"]
