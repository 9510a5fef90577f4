"""nn.Embedding's lazy id check on the GPU: kernels/embedding.cu records a bad token in mapped pinned host
memory (no synchronisation per call), the layer raises at its next call or at raise_id_errors();
ops.embedding's id_errors= on the custom path (every kernel version), declined by the cupy path."""

import numpy as np
import pytest

import libnn
from libnn import nn
from libnn.ops.embedding import IdErrors, embedding

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_lazy_layer_gives_nan_rows_then_raises_naming_the_token(rng, dtype):
    import cupy

    layer = nn.Embedding(50, 8, seed=2, dtype=dtype, device="gpu")
    table = layer.weight.get().astype(np.float32)  # bf16 compared as the fp32 values it holds exactly
    good = rng.integers(0, 50, (4, 9))
    np.testing.assert_array_equal(layer(cupy.asarray(good)).get().astype(np.float32), table[good])
    y = layer(cupy.asarray([[3, 50, 7]])).get().astype(np.float32)
    assert np.isnan(y[0, 1]).all()
    np.testing.assert_array_equal(y[0, [0, 2]], table[[3, 7]])
    with pytest.raises(IndexError, match=r"ids must be in \[0, 50\).*at token 1 of its ids"):
        layer.raise_id_errors()
    layer.raise_id_errors()  # reported once
    layer(cupy.asarray([-1]))
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(IndexError, match="at token 0 of its ids"):
        layer(cupy.asarray([1]))  # the next call raises, before running
    np.testing.assert_array_equal(layer(cupy.asarray([1])).get().astype(np.float32), table[[1]])


def test_sync_layer_and_fp64_tables_raise_in_the_call():
    import cupy

    for layer in (nn.Embedding(50, 8, device="gpu", check_ids="sync"), nn.Embedding(50, 8, dtype="fp64", device="gpu")):
        with pytest.raises(IndexError, match=r"Embedding: ids must be in \[0, 50\).*got 50"):
            layer(cupy.asarray([3, 50]))


@pytest.mark.parametrize("H", [7, 768, 2048, 40000])  # emb1 sca and vec, emb2, emb3
@pytest.mark.parametrize("normalize", [False, True])
def test_every_kernel_version_records_a_bad_id_and_only_a_bad_one(rng, H, normalize):
    import cupy

    weight = cupy.asarray(rng.standard_normal((30, H)).astype(np.float32))
    errors = IdErrors.allocate()
    ids = cupy.asarray(rng.integers(0, 30, (3, 5)))
    embedding(ids, weight, normalize=normalize, id_errors=errors, path="custom")
    cupy.cuda.get_current_stream().synchronize()
    assert errors.take() == 0
    ids[2, 1] = 30
    y = embedding(ids, weight, normalize=normalize, id_errors=errors, path="custom")
    cupy.cuda.get_current_stream().synchronize()
    assert errors.take() == 2 * 5 + 1 + 1 and bool(cupy.isnan(y[2, 1]).all())


def test_the_cupy_path_declines_id_errors():
    import cupy

    weight, ids = cupy.ones((4, 8), cupy.float32), cupy.asarray([1, 2])
    with pytest.raises(libnn.PathUnavailableError, match="records no out-of-range ids"):
        embedding(ids, weight, id_errors=IdErrors.allocate(), path="cupy")
    embedding(ids, weight, id_errors=IdErrors.allocate())
    assert libnn.get_op("embedding").last_decision.path == "custom"
