"""Weights from files: round trips in both formats, and loads that fail leave the model unchanged."""

import numpy as np
import pytest

from libnn import dtypes, nn
from libnn.nn import weights


def model():
    return nn.Sequential(nn.Conv2d(1, 4, 3, seed=0), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1, seed=2))


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_round_trip_keeps_every_tensor(tmp_path, suffix):
    a, b = model(), model()
    b.load_state_dict({k: v + 1 for k, v in b.state_dict().items()})
    a.save(tmp_path / f"w{suffix}")
    b.load(tmp_path / f"w{suffix}")
    for key, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[key], value)


@pytest.mark.skipif(dtypes.bfloat16 is None, reason="needs ml_dtypes")
def test_bf16_tensors_come_back_as_bf16(tmp_path):
    weights.write(tmp_path / "w.safetensors", {"x": np.arange(4, dtype=np.float32).astype(dtypes.bfloat16)})
    assert weights.read(tmp_path / "w.safetensors")["x"].dtype == dtypes.bfloat16


def test_missing_and_unexpected_keys_are_listed_and_nothing_changes(tmp_path):
    m = model()
    before = {k: v.copy() for k, v in m.state_dict().items()}
    state = dict(before)
    state.pop("1.running_var")
    state["9.weight"] = np.ones(3, np.float32)
    weights.write(tmp_path / "bad.npz", state)
    with pytest.raises(KeyError, match=r"missing keys \['1.running_var'\], unexpected keys \['9.weight'\]"):
        m.load(tmp_path / "bad.npz")
    for key, value in m.state_dict().items():
        np.testing.assert_array_equal(value, before[key])


@pytest.mark.parametrize("name, error, message", [
    ("w.pt", ValueError, r"expected one of \('.safetensors', '.npz'\), got '.pt'"),
    ("absent.npz", FileNotFoundError, "does not exist"),
])
def test_unsupported_or_missing_files(tmp_path, name, error, message):
    if name.endswith(".pt"):
        (tmp_path / name).write_bytes(b"not a checkpoint")
    with pytest.raises(error, match=message):
        weights.read(tmp_path / name)
