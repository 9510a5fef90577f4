"""Layers: parameters by PyTorch's names, loading that checks before it changes anything."""

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
