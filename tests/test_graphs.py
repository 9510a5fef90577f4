"""Whole-model CUDA graphs: replay equals eager, a new input shape captures anew, replacing a
parameter drops stale captures, and bad arguments are refused with a clear message."""

import numpy as np
import pytest

from libnn import dtypes, nn
from conftest import random_normal, rel_error


def small_cnn(device="cpu", dtype="fp32"):
    kw = {"dtype": dtype, "device": device}
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, seed=1, **kw), nn.BatchNorm2d(8, **kw), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 4, 3, seed=2, **kw), nn.SiLU())


def test_graphed_refuses_host_arrays_and_bad_warmup():
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        small_cnn().graphed(warmup=0)
    with pytest.raises(TypeError, match="host array; CUDA graphs replay GPU work only"):
        small_cnn().graphed()(np.ones((1, 8, 8, 3), np.float32))


def test_use_path_forces_every_layer():
    m = small_cnn().use_path("reference")
    assert {getattr(layer, "path", "reference") for layer in m.modules()} == {"reference"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_graph_replay_equals_eager_and_recaptures_on_new_shape(rng, dtype):
    import cupy

    model = small_cnn("gpu", dtype)
    graphed = model.graphed()
    for batch in (2, 5, 2):
        x = cupy.asarray(random_normal(rng, (batch, 12, 12, 3), dtype))
        replayed = graphed(x).copy()
        # plans are per stream (the capture has its own), so allow the dtype's tolerance, not bit equality
        assert rel_error(replayed, model(x).get()) <= dtypes.TOLERANCE[dtype]
    assert len(graphed.stats()) == 2  # batch 2 captured once and replayed, batch 5 captured
    assert [s.replays for s in graphed.stats().values()] == [2, 1]


@pytest.mark.gpu
def test_graph_follows_replaced_parameters(rng):
    import cupy

    model = small_cnn("gpu")
    graphed = model.graphed()
    x = cupy.asarray(random_normal(rng, (2, 12, 12, 3), "fp32"))
    before = graphed(x).copy()
    for _ in range(3):  # new arrays each time (CPython may hand a freed array's id to the next one)
        state = {k: v * 2 if k == "0.weight" else v.copy() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        after = graphed(x).copy()
        assert rel_error(after, model(x).get()) <= 1e-5 and rel_error(after, before.get()) > 1e-3
        before = after


@pytest.mark.gpu
def test_graph_of_mlp_with_cublaslt_matches_reference(rng):
    import cupy

    model = nn.Sequential(nn.Linear(64, 128, seed=0, device="gpu"), nn.GELU(), nn.Linear(128, 10, seed=2, device="gpu"))
    x = random_normal(rng, (7, 64), "fp32")
    y = model.graphed()(cupy.asarray(x))
    assert rel_error(y, model.to("cpu")(x)) < 1e-5
