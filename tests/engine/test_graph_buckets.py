"""Graph buckets and keys, the graph options' validation, and the CPU device graph."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.device import CpuGraph, Device, DeviceCaptureLock
from engine.executor.graph_buckets import GraphBuckets, GraphKey, GraphOptions, bucket_ladder


def test_ladder():
    assert bucket_ladder(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert bucket_ladder(20) == (1, 2, 4, 8, 16, 32)
    assert bucket_ladder(5) == (1, 2, 4, 8)
    assert bucket_ladder(8) == (1, 2, 4, 8)
    assert bucket_ladder(1) == (1,)


def test_bucket_of_each_size():
    b = GraphBuckets(64)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 33: 48,
                48: 48, 49: 64, 64: 64}
    assert {n: b.bucket(n) for n in expected} == expected
    assert b.bucket(65) is None and b.bucket(0) is None
    assert b.all() == [1, 2, 4, 8, 16, 32, 48, 64]
    # the limit is the configured size, the buffers hold its bucket
    b20 = GraphBuckets(20)
    assert (b20.bucket(20), b20.bucket(21), b20.largest) == (32, None, 32)


def test_padding_off_and_explicit_sizes():
    off = GraphBuckets(12, padding=False)
    assert [off.bucket(n) for n in (1, 3, 7, 12)] == [1, 3, 7, 12]
    assert off.bucket(13) is None and off.largest == 12 and off.all() == list(range(1, 13))
    explicit = GraphBuckets(999, sizes=(24, 4, 12, 4))
    assert explicit.sizes == (4, 12, 24) and explicit.limit == 24
    assert [explicit.bucket(n) for n in (1, 4, 5, 13, 24, 25)] == [4, 4, 12, 24, 24, None]


def test_key_and_options():
    assert GraphKey(8).num_seqs == 8
    verify = GraphKey(num_tokens=24, tokens_per_seq=3)    # 8 sequences, 2 drafts each
    assert verify.num_seqs == 8 and verify != GraphKey(24)
    cfg = EngineConfig(model="m", max_num_seqs=40, block_size=16, enable_graph=True,
                       graph_max_seq_len=100)
    opts = GraphOptions.from_engine_config(cfg, max_model_len=2048)
    assert (opts.max_batch_size, opts.max_seq_len, opts.max_blocks_per_seq) == (40, 100, 7)
    # never wider than the model's length
    opts = GraphOptions.from_engine_config(
        EngineConfig(model="m", graph_max_seq_len=4096), max_model_len=512)
    assert opts.max_seq_len == 512


@pytest.mark.parametrize("field,value,match", [
    ("graph_max_batch_size", 0, "graph_max_batch_size"),
    ("graph_max_seq_len", -1, "graph_max_seq_len"),
    ("graph_batch_sizes", [4, 0], "graph_batch_sizes"),
    ("graph_batch_sizes", [], "graph_batch_sizes"),
    ("graph_batch_sizes", 8, "graph_batch_sizes"),
    ("graph_warmup_batch_sizes", ["a"], "graph_warmup_batch_sizes"),
])
def test_bad_graph_options(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", enable_graph=True, **{field: value})


def test_lists_become_tuples():
    cfg = EngineConfig(model="m", graph_batch_sizes=[1, 8], graph_warmup_batch_sizes=[8])
    assert cfg.graph_batch_sizes == (1, 8) and cfg.graph_warmup_batch_sizes == (8,)
    hash(cfg)


def test_cpu_graph_replays_the_captured_callable():
    dev = Device("cpu")
    calls = []
    graph = dev.capture_graph(lambda: calls.append(1), dev.graph_pool_handle(),
                              dev.new_stream(high_priority=True))
    assert isinstance(graph, CpuGraph) and calls == []     # a capture runs nothing
    graph.replay()
    graph.replay()
    assert calls == [1, 1]
    assert dev.capture_warmup_iters == 0
    with pytest.raises(RuntimeError, match="never captured"):
        CpuGraph().replay()


def test_capture_lock():
    lock = DeviceCaptureLock()
    with lock.held_if(False):
        assert not lock.locked()
    with lock.held_if(True):
        assert lock.locked()
    assert not lock.locked()
