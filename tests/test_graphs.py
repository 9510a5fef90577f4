"""Whole-model CUDA graphs: replay equals eager, a new input shape captures anew, replacing a
parameter drops stale captures, and bad arguments are refused with a clear message."""

import numpy as np
import pytest

from libnn import dtypes, nn
from libnn.errors import LibnnError
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


# --- the parameter version counter (CPU) ----------------------------------------------------------
def test_version_bumps_on_register_assignment_load_and_to_through_nested_modules():
    inner = nn.Sequential(nn.Linear(4, 3, seed=0), nn.ReLU())
    model = nn.Sequential(inner, nn.Linear(3, 2, seed=1))
    layer = inner[0]

    def bumped(change) -> bool:
        before = (layer.version, inner.version, model.version)
        change()
        return all(a != b for a, b in zip(before, (layer.version, inner.version, model.version)))

    assert bumped(lambda: layer.register_parameter("bias", np.ones(3, np.float32)))
    assert bumped(lambda: setattr(layer, "weight", layer.weight * 2))
    assert bumped(lambda: model.load_state_dict({k: v.copy() for k, v in model.state_dict().items()}))
    assert bumped(lambda: model.to("fp64"))
    assert model.state_dict()["0.0.weight"] is layer.weight  # the assigned parameter is the registered one


def test_version_keeps_still_when_nothing_is_replaced():
    model = nn.Sequential(nn.Linear(4, 3, seed=0))
    before = model.version
    model.to("cpu")                                # the same arrays again
    model.load_state_dict(model.state_dict())      # the very same objects
    model[0].weight[0, 0] = 5.0                    # in place: same array, same address
    model[0].path = "auto"                         # a setting set to the value it has
    model[0]._cache = object()                     # a private attribute: a cache, not a setting
    assert model.version == before


def test_a_setting_set_to_a_new_value_changes_the_version():
    """A capture bakes in what the layer computes, not only its parameters' addresses: a new path, eps,
    stride or activation makes every capture (and Sequential's fusion) again."""
    model = nn.Sequential(nn.Linear(4, 3, seed=0), nn.LayerNorm(3), nn.Conv2d(1, 1, 3, seed=0))
    for module, name, value in ((model[0], "path", "reference"), (model[0], "activation", "relu"),
                                (model[1], "eps", 1e-3), (model[2], "stride", 2)):
        before = model.version
        setattr(module, name, value)
        assert model.version != before, name


def test_version_reaches_every_parent_of_a_shared_module_and_follows_children_added_later():
    shared = nn.Linear(3, 3, seed=0)
    a, b = nn.Sequential(shared), nn.Sequential(shared)
    before = (a.version, b.version)
    shared.weight = shared.weight + 1
    assert a.version != before[0] and b.version != before[1]

    model = nn.Sequential(nn.ReLU())
    before = model.version
    model.head = nn.Linear(3, 2, seed=1)           # a child added after construction
    assert model.version != before
    before = model.version
    model.head.bias = model.head.bias + 1
    assert model.version != before
    old = model.head
    model.head = None                              # removed: its later changes are no longer the model's
    before = model.version
    old.bias = old.bias + 1
    assert model.version == before and "head" not in dict(model.named_parameters())


def test_sequential_rebuilds_its_fusion_plan_after_a_parameter_is_assigned(rng):
    model = nn.Sequential(nn.Linear(5, 4, seed=0, dtype="fp64"), nn.ReLU())
    x = random_normal(rng, (3, 5), "fp64")
    model(x)
    model[0].weight = model[0].weight * -1.0
    expected = np.maximum(x @ model[0].weight.T + model[0].bias, 0)
    assert rel_error(model(x), expected) < 1e-12


def test_sequential_refuses_a_stale_fusion_after_a_layers_activation_is_set(rng):
    """Linear → SiLU and Conv2d → BatchNorm2d → ReLU fuse while the first layer has no activation of its
    own; one set later must run as well (the fused modules passed their own activation in its place)."""
    x = random_normal(rng, (3, 5), "fp64")
    model = nn.Sequential(nn.Linear(5, 4, seed=0, dtype="fp64"), nn.SiLU())
    model(x)
    model[0].activation = "relu"
    assert rel_error(model(x), model[1](model[0](x))) < 1e-12
    cnn = small_cnn(dtype="fp64")
    image = random_normal(rng, (2, 8, 8, 3), "fp64")
    cnn(image)
    cnn[0].activation = "gelu"
    layer_by_layer = image
    for i in range(len(cnn)):
        layer_by_layer = cnn[i](layer_by_layer)
    assert rel_error(cnn(image), layer_by_layer) < 1e-12


@pytest.mark.gpu
def test_graph_follows_a_setting_set_after_the_capture(rng):
    """eps and a stride are arguments the capture baked into its kernels: a new value captures anew."""
    import cupy

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, seed=0, device="gpu"), nn.LayerNorm(4, device="gpu"))
    graphed = model.graphed()
    x = cupy.asarray(random_normal(rng, (2, 9, 9, 3), "fp32"))
    graphed(x)
    model[1].eps = 0.5
    assert rel_error(graphed(x).copy(), model(x).get()) <= 1e-5
    model[0].stride = 2
    after = graphed(x).copy()
    assert after.shape == (2, 5, 5, 4) and rel_error(after, model(x).get()) <= 1e-5


# --- caller-filled buffers and parameter replacement (GPU) ----------------------------------------
@pytest.mark.gpu
def test_graph_inputs_filled_by_the_caller_replay_without_copy_and_equal_eager(rng):
    import cupy

    model = small_cnn("gpu", "fp16")
    graphed = model.graphed()
    first = cupy.asarray(random_normal(rng, (3, 12, 12, 3), "fp16"))
    buffer, = graphed.inputs(first)
    assert buffer.shape == first.shape and buffer.dtype == first.dtype and graphed.inputs(first)[0] is buffer
    for _ in range(2):
        x = cupy.asarray(random_normal(rng, (3, 12, 12, 3), "fp16"))
        buffer[...] = x
        assert rel_error(graphed(buffer).copy(), model(x).get()) <= dtypes.TOLERANCE["fp16"]
    x = cupy.asarray(random_normal(rng, (3, 12, 12, 3), "fp16"))
    buffer[...] = x
    assert rel_error(graphed.replay().copy(), model(x).get()) <= dtypes.TOLERANCE["fp16"]
    other = cupy.asarray(random_normal(rng, (3, 12, 12, 3), "fp16"))  # any other array is copied in
    assert rel_error(graphed(other).copy(), model(other).get()) <= dtypes.TOLERANCE["fp16"]
    assert list(graphed.stats().values())[0].replays == 4


@pytest.mark.gpu
def test_graph_refuses_its_buffers_in_the_wrong_shape_dtype_or_position(rng):
    import cupy

    graphed = small_cnn("gpu").graphed()
    buffer, = graphed.inputs(cupy.asarray(random_normal(rng, (4, 12, 12, 3), "fp32")))
    for wrong in (buffer[:2], buffer.view(cupy.int32), buffer.reshape(2, 24, 12, 3)):
        with pytest.raises(ValueError, match="is a view of the graph's input buffer 0 of shape \\(4, 12, 12, 3\\)"):
            graphed(wrong)


@pytest.mark.gpu
def test_graph_follows_parameters_assigned_as_attributes(rng):
    import cupy

    model = small_cnn("gpu")
    graphed = model.graphed()
    x = cupy.asarray(random_normal(rng, (2, 12, 12, 3), "fp32"))
    before = graphed(x).copy()
    graphed.inputs(x)  # what replay() would replay
    model[4].weight = model[4].weight * 3
    with pytest.raises(LibnnError, match="replay\\(\\): that capture was dropped"):
        graphed.replay()
    after = graphed(x).copy()
    assert rel_error(after, model(x).get()) <= 1e-5 and rel_error(after, before.get()) > 1e-3
    assert list(graphed.stats().values())[0].captures == 2
