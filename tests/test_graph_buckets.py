"""CUDA graphs for changing batch sizes: the bucket logic on the CPU (validation, the bucket chosen,
the least-recently-used cap, outputs sliced back), and on the GPU buckets that equal unpadded eager
calls row for row (SeedCNN, and a small random BertEncoder with sequence buckets and padding masks)."""

import numpy as np
import pytest

from libnn import dtypes, nn
from libnn.models import BertConfig, BertEncoder, SeedCNN
from libnn.models.bert import BertOutput
from libnn.nn.graphs import LRU, bucket_for, sliced
from conftest import random_normal, rel_error

FP16 = dtypes.TOLERANCE["fp16"]
SMALL_BERT = {"vocab_size": 50, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 128, "max_position_embeddings": 64, "hidden_act": "gelu"}


# --- CPU: the logic -------------------------------------------------------------------------------
@pytest.mark.parametrize("buckets", [(), (4, 2), (1, 1, 2), (0, 4), (-1, 2), (1.5, 4), (True, 4), "1248", 8])
def test_buckets_must_be_increasing_positive_ints(buckets):
    with pytest.raises(ValueError, match="buckets must be a non-empty sequence of positive integers in increasing"):
        nn.Linear(3, 2).graphed(buckets=buckets)


def test_seq_buckets_need_a_model_with_sequence_inputs_and_max_captures_a_positive_int():
    with pytest.raises(ValueError, match="seq_buckets must be a non-empty sequence"):
        BertEncoder(BertConfig.from_dict(SMALL_BERT)).graphed(seq_buckets=(16, 8))
    with pytest.raises(ValueError, match="seq_buckets needs a model that declares its sequence inputs .* Linear"):
        nn.Linear(3, 2).graphed(buckets=(1, 2), seq_buckets=(8, 16))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="max_captures must be a positive integer"):
            nn.Linear(3, 2).graphed(max_captures=bad)
    assert BertEncoder(BertConfig.from_dict(SMALL_BERT)).graphed(buckets=[1, 2], seq_buckets=np.array([8, 16])).seq_buckets == (8, 16)


def test_bucket_for_picks_the_smallest_that_fits_and_refuses_beyond_the_largest():
    buckets = (1, 2, 4, 8, 16, 32, 64)
    assert [bucket_for(n, buckets, "buckets", "m") for n in (1, 2, 3, 5, 8, 13, 17, 63, 64)] == \
        [1, 2, 4, 8, 8, 16, 32, 64, 64]
    with pytest.raises(ValueError, match=r"m: a batch of 65 is larger than the largest of buckets \[1, 2, 4, 8, 16, "
                                         r"32, 64\]; split the call, or add a larger bucket"):
        bucket_for(65, buckets, "buckets", "m")
    with pytest.raises(ValueError, match=r"a sequence length of 129 is larger than the largest of seq_buckets \[128\]"):
        bucket_for(129, (128,), "seq_buckets", "m")


def test_lru_pushes_out_the_least_recently_used():
    cache = LRU(2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1            # "a" is now the most recently used
    assert cache.put("c", 3) == [2]       # so "b" goes
    assert cache.get("b") is None and len(cache) == 2
    assert sorted(cache.clear()) == [1, 3] and len(cache) == 0


def test_outputs_are_sliced_to_the_real_rows_and_positions_as_views(rng):
    hidden, pooled = random_normal(rng, (8, 16, 5), "fp32"), random_normal(rng, (8, 5), "fp32")
    out = sliced(BertOutput(hidden, pooled, None), 3, 7, ("last_hidden_state",))
    assert out.last_hidden_state.shape == (3, 7, 5) and out.pooled.shape == (3, 5) and out.pooler_output is None
    assert np.shares_memory(out.last_hidden_state, hidden) and np.shares_memory(out.pooled, pooled)
    nested = sliced({"a": (hidden, [pooled])}, 2, None, ())
    assert nested["a"][0].shape == (2, 16, 5) and nested["a"][1][0].shape == (2, 5)


def test_bucketed_graph_refuses_host_arrays():
    with pytest.raises(TypeError, match="host array; CUDA graphs replay GPU work only"):
        nn.Linear(3, 2).graphed(buckets=(1, 2))(np.ones((1, 3), np.float32))


# --- GPU: buckets equal unpadded eager calls ------------------------------------------------------
@pytest.mark.gpu
def test_seed_cnn_buckets_equal_unpadded_eager_row_for_row(rng):
    import cupy

    model = SeedCNN.pretrained(dtype="fp16", device="gpu")
    buckets = (1, 2, 4, 8, 16, 32)
    graphed = model.graphed(buckets=buckets)
    batches = (8, 1, 2, 3, 5, 13, 16, 31, 32, 7)  # 8 first: the smaller batches then pad over real rows of before
    for n in batches:
        x = cupy.asarray(random_normal(rng, (n, 1, 28, 28), "fp16"))
        got = graphed(x)
        assert got.shape == (n, 10)
        expected = model(x).get()
        for row in range(n):
            assert rel_error(got[row], expected[row]) <= FP16, (n, row)
    stats = graphed.stats()
    assert set(stats) == {(b,) for b in buckets} and all(s.captures == 1 for s in stats.values())
    assert stats[(32,)].replays == 2 and stats[(32,)].pad_waste == pytest.approx(1 / 64)
    assert stats[(8,)].pad_waste == pytest.approx((0 + 3 + 1) / 24)  # batches 8, 5 and 7


@pytest.mark.gpu
def test_batch_over_the_largest_bucket_is_refused_with_the_buckets(rng):
    import cupy

    graphed = SeedCNN.pretrained(dtype="fp16", device="gpu").graphed(buckets=(1, 2, 4))
    with pytest.raises(ValueError, match=r"a batch of 5 is larger than the largest of buckets \[1, 2, 4\]"):
        graphed(cupy.asarray(random_normal(rng, (5, 1, 28, 28), "fp16")))
    assert graphed.stats() == {}


@pytest.mark.gpu
def test_a_bucket_too_large_for_gpu_memory_is_refused_before_its_capture_allocates(rng):
    import cupy

    graphed = SeedCNN.pretrained(dtype="fp16", device="gpu").graphed(buckets=(2**40,))
    with pytest.raises(MemoryError, match=r"^SeedCNN.graphed\(\): the input buffers of bucket \(1099511627776,\) "
                                          r"needs .* more than the .* of free GPU memory available$"):
        graphed(cupy.asarray(random_normal(rng, (1, 1, 28, 28), "fp16")))
    assert graphed.stats() == {}
    small = SeedCNN.pretrained(dtype="fp16", device="gpu").graphed(buckets=(2,))
    assert small(cupy.asarray(random_normal(rng, (1, 1, 28, 28), "fp16"))).shape == (1, 10)


@pytest.mark.gpu
def test_a_bucket_output_survives_replays_of_other_buckets_and_the_lru_cap_recaptures(rng):
    import cupy

    model = SeedCNN.pretrained(dtype="fp16", device="gpu")
    graphed = model.graphed(buckets=(4, 8, 16), max_captures=2)
    x5 = cupy.asarray(random_normal(rng, (5, 1, 28, 28), "fp16"))
    held = graphed(x5)
    kept = held.copy()
    graphed(cupy.asarray(random_normal(rng, (13, 1, 28, 28), "fp16")))   # bucket 16: its own memory
    assert cupy.array_equal(held, kept)
    graphed(cupy.asarray(random_normal(rng, (3, 1, 28, 28), "fp16")))    # bucket 4 pushes bucket 8 out
    again = graphed(x5)
    assert rel_error(again, model(x5).get()) <= FP16
    assert graphed.stats()[(8,)].captures == 2 and graphed.stats()[(16,)].captures == 1


@pytest.mark.gpu
def test_buckets_follow_replaced_parameters(rng):
    import cupy

    model = SeedCNN.pretrained(dtype="fp16", device="gpu")
    graphed = model.graphed(buckets=(2, 4, 8))
    x = cupy.asarray(random_normal(rng, (3, 1, 28, 28), "fp16"))
    before = graphed(x).copy()
    state = model.state_dict()
    model.load_state_dict({k: v * 0.5 if k.endswith("weight") else v.copy() for k, v in state.items()})
    after = graphed(x).copy()
    assert rel_error(after, model(x).get()) <= FP16 and rel_error(after, before.get()) > 1e-2
    model.classifier[3].weight = model.classifier[3].weight * 2  # logits doubled: log-softmax changes
    again = graphed(x).copy()
    assert rel_error(again, model(x).get()) <= FP16 and rel_error(again, after.get()) > 1e-2


@pytest.mark.gpu
def test_bucket_inputs_are_the_real_rows_of_the_buffers(rng):
    import cupy

    model = SeedCNN.pretrained(dtype="fp16", device="gpu")
    graphed = model.graphed(buckets=(4, 8))
    buffer, = graphed.inputs(cupy.asarray(random_normal(rng, (6, 1, 28, 28), "fp16")))
    assert buffer.shape == (6, 1, 28, 28)
    x = cupy.asarray(random_normal(rng, (6, 1, 28, 28), "fp16"))
    buffer[...] = x
    assert rel_error(graphed(buffer), model(x).get()) <= FP16
    buffer[...] = -x
    assert rel_error(graphed.replay(), model(-x).get()) <= FP16


def _small_bert():
    return BertEncoder(BertConfig.from_dict(SMALL_BERT), dtype="fp16", device="gpu")


def _bert_inputs(rng, batch, seq, mask_kind):
    import cupy

    ids = rng.integers(1, SMALL_BERT["vocab_size"], (batch, seq))
    types = rng.integers(0, 2, (batch, seq))
    lengths = rng.integers(1, seq + 1, batch)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    mask = {"none": None, "right": mask, "left": mask[:, ::-1].copy()}[mask_kind]
    return cupy.asarray(ids), None if mask is None else cupy.asarray(mask), cupy.asarray(types)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq, mask_kind", [(1, 5, "none"), (3, 16, "right"), (5, 9, "right"),
                                                    (8, 32, "left"), (2, 1, "none"), (7, 31, "left")])
def test_bert_batch_and_seq_buckets_equal_unpadded_eager(rng, batch, seq, mask_kind):
    model = _small_bert()
    graphed = model.graphed(buckets=(1, 2, 4, 8), seq_buckets=(8, 16, 32))
    ids, mask, types = _bert_inputs(rng, batch, seq, mask_kind)
    got = graphed(ids, mask, token_type_ids=types)
    expected = model(ids, mask, token_type_ids=types)
    assert got.last_hidden_state.shape == (batch, seq, SMALL_BERT["hidden_size"])
    for name in ("last_hidden_state", "pooled", "pooler_output"):
        for row in range(batch):
            assert rel_error(got[name][row], expected[name][row].get()) <= FP16, (name, row)


@pytest.mark.gpu
def test_bert_seq_bucket_inputs_are_filled_by_the_caller(rng):
    model = _small_bert()
    graphed = model.graphed(buckets=(4, 8), seq_buckets=(16,))
    ids, mask, _ = _bert_inputs(rng, 3, 11, "right")
    ids_buffer, mask_buffer = graphed.inputs(ids, attention_mask=mask)
    assert ids_buffer.shape == mask_buffer.shape == (3, 11)
    for _ in range(2):
        ids, mask, _ = _bert_inputs(rng, 3, 11, "right")
        ids_buffer[...], mask_buffer[...] = ids, mask
        got = graphed(ids_buffer, attention_mask=mask_buffer)
        assert rel_error(got.last_hidden_state, model(ids, mask).last_hidden_state.get()) <= FP16
    with pytest.raises(ValueError, match="is a view of the graph's input buffer"):
        graphed(mask_buffer, attention_mask=ids_buffer)  # swapped
    stats = graphed.stats()[(4, 16)]
    assert stats.replays == 2 and stats.pad_waste == pytest.approx(1 - 33 / 64)
