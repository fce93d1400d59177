"""Decode-side reservations (cluster/kv_transfer/kv_receiver.py KvReceiver): exact block
accounting, strict validation that writes nothing on a bad chunk, admission only when
complete, leases."""

from __future__ import annotations

import pytest
import torch

from cluster.kv_transfer.kv_receiver import (
    KEY,
    KEY_VALUE,
    VALUE,
    CapacityError,
    Draining,
    KvReceiver,
    PushDenied,
    PushRejected,
    ReleaseReason,
    ReservationState,
    UnknownReservation,
)
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.kv_cache import gather_blocks
from tests.tiny_models import make_tiny_model

BS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("models"))[0]


@pytest.fixture
def rx(folder):
    eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=BS,
                                 num_gpu_blocks=32, max_num_seqs=3))
    return KvReceiver(eng, default_lease_s=30.0)


def _reserve(rx: KvReceiver, rid: str, prompt: list[int], params, **kw):
    # no engine loop attached: the engine applies commands at once, futures are done
    return rx.reserve(rid, prompt, params, **kw).result(timeout=0)


def _greedy(n=4):
    return SamplingParams(max_tokens=n, temperature=0.0)


def _chunk(rx: KvReceiver, n_blocks: int, fill: float = 1.0) -> torch.Tensor:
    shape = (n_blocks, *rx.engine.kv_cache.block_shape)
    return torch.full(shape, fill, dtype=torch.float32)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _fill_all(rx: KvReceiver, rid: str, fill: float = 1.0) -> None:
    res = rx.get(rid)
    ids = res.push_block_ids
    for layer in range(len(rx.engine.kv_cache.k)):
        for kind in (KEY, VALUE):
            t = _chunk(rx, len(ids), fill)
            rx.write(rid, layer, kind, ids, list(t.shape), "float32", _bytes(t),
                     token=res.token)


def _snapshot(rx: KvReceiver) -> list[torch.Tensor]:
    kv = rx.engine.kv_cache
    return [t.clone() for t in kv.k + kv.v]


def test_reserve_gives_blocks_for_the_prompt_and_skips_cached_prefix(rx):
    bm = rx.engine.block_manager
    free0 = bm.num_free_blocks
    prompt = list(range(10, 19))                       # 9 tokens -> 3 blocks of 4
    res = _reserve(rx, "a", prompt, _greedy())
    assert len(res.block_ids) == 3 and res.num_cached_blocks == 0
    assert bm.num_free_blocks == free0 - 3
    _fill_all(rx, res.reservation_id)
    seq = rx.complete(res.reservation_id, 7, token=res.token).result(timeout=0)
    assert seq.output_token_ids == [7] and "a" in rx.engine.requests
    assert seq.num_cached_tokens == 9 and rx.engine.has_unfinished()
    assert [o.token_ids for o in rx.engine.take_outputs([])] == [[7]]   # admission
    while rx.engine.has_unfinished():
        rx.engine.run_once()
    assert bm.num_free_blocks == free0
    # the same 8-token prefix is now in this node's prefix cache: 2 blocks are skipped
    res2 = _reserve(rx, "b", prompt[:8] + [99, 98], _greedy())
    assert res2.num_cached_blocks == 2 and len(res2.block_ids) == 3
    assert res2.push_block_ids == res2.block_ids[2:]
    rx.release(res2.reservation_id, ReleaseReason.CALLER_CANCELLED)
    assert bm.num_free_blocks == free0


@pytest.mark.parametrize("bad", ["unknown", "layer", "kind", "dtype", "shape", "bytes",
                                 "stray_block", "duplicate_block", "run_of_one_kind",
                                 "run_past_last_layer", "run_shape"])
def test_bad_chunk_is_refused_and_writes_nothing(rx, bad):
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    ids = res.push_block_ids
    t = _chunk(rx, len(ids), 5.0)
    args = dict(reservation_id=res.reservation_id, layer=0, kind=KEY, block_ids=ids,
                shape=list(t.shape), dtype="float32", data=_bytes(t), token=res.token)
    if bad == "unknown":
        args["reservation_id"] = "nope"
    elif bad == "layer":
        args["layer"] = 99
    elif bad == "kind":
        args["kind"] = 3
    elif bad == "run_of_one_kind":                   # a layer run must carry K and V
        args["num_layers"] = 2
    elif bad in ("run_past_last_layer", "run_shape"):
        n = len(rx.engine.kv_cache.k)
        run = torch.zeros(n, 2, *t.shape)
        args.update(kind=KEY_VALUE, num_layers=n, shape=list(run.shape), data=_bytes(run))
        if bad == "run_past_last_layer":
            args["layer"] = 1
        else:
            args["shape"] = [n, 1, *t.shape]
    elif bad == "dtype":
        args["dtype"] = "bfloat16"
    elif bad == "shape":
        args["shape"] = [len(ids), 1, 1, 1]
    elif bad == "bytes":
        args["data"] = args["data"][:-4]
    elif bad == "stray_block":
        args["block_ids"] = ids[:-1] + [31]
    elif bad == "duplicate_block":
        args["block_ids"] = [ids[0]] * len(ids)
    before = _snapshot(rx)
    err = UnknownReservation if bad == "unknown" else PushRejected
    with pytest.raises(err) as info:
        rx.write(**args)
    assert str(info.value)       # a message that names the problem
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(rx), strict=True))


def test_incomplete_push_is_refused_and_releases_blocks(rx):
    bm = rx.engine.block_manager
    free0 = bm.num_free_blocks
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    ids = res.push_block_ids
    t = _chunk(rx, len(ids))
    rx.write(res.reservation_id, 0, KEY, ids, list(t.shape), "float32", _bytes(t),
             token=res.token)
    with pytest.raises(PushRejected, match="incomplete: missing layer 0 V"):
        rx.complete(res.reservation_id, 7, token=res.token)
    assert bm.num_free_blocks == free0 and not rx.reservations
    assert "a" not in rx.engine.requests


def test_written_bytes_land_in_the_reserved_blocks(rx):
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    ids = res.push_block_ids
    t = torch.randn(len(ids), *rx.engine.kv_cache.block_shape)
    rx.write(res.reservation_id, 1, VALUE, ids, list(t.shape), "float32", _bytes(t),
             token=res.token)
    assert torch.equal(gather_blocks(rx.engine.kv_cache.v[1], torch.tensor(ids)), t)


def test_a_layer_run_lands_every_layer_and_completes_the_push(rx):
    """KEY_VALUE chunks (a step's layers in runs) fill the same blocks as K and V chunks
    per layer would, and complete the push."""
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    ids = res.push_block_ids
    n = len(rx.engine.kv_cache.k)
    run = torch.randn(n, 2, len(ids), *rx.engine.kv_cache.block_shape)
    split = n // 2                                    # two runs: [0, split), [split, n)
    for first, stop in ((0, split), (split, n)):
        part = run[first:stop]
        rx.write(res.reservation_id, first, KEY_VALUE, ids, list(part.shape), "float32",
                 _bytes(part), token=res.token, num_layers=stop - first)
    kv = rx.engine.kv_cache
    for layer in range(n):
        assert torch.equal(gather_blocks(kv.k[layer], torch.tensor(ids)), run[layer, 0])
        assert torch.equal(gather_blocks(kv.v[layer], torch.tensor(ids)), run[layer, 1])
    seq = rx.complete(res.reservation_id, 7, token=res.token).result(timeout=0)
    assert seq.output_token_ids == [7]


def test_lease_expiry_returns_blocks(rx):
    bm = rx.engine.block_manager
    free0 = bm.num_free_blocks
    res = _reserve(rx, "a", list(range(10, 30)), _greedy(), lease_s=5.0)
    assert rx.expire(now=res.deadline - 1.0) == []
    assert bm.num_free_blocks == free0 - 5
    assert [r.request_id for r in rx.expire(now=res.deadline + 0.01)] == ["a"]
    assert bm.num_free_blocks == free0 and not rx.reservations
    with pytest.raises(UnknownReservation):
        rx.complete(res.reservation_id, 7, token=res.token)


def test_full_and_too_long_are_refused(rx):
    for i in range(3):
        _reserve(rx, f"r{i}", [5, 6, 7], _greedy())
    with pytest.raises(CapacityError, match="full"):
        _reserve(rx, "r3", [5, 6, 7], _greedy())
    for res in list(rx.reservations.values()):
        rx.release(res.reservation_id, ReleaseReason.CALLER_CANCELLED)
    with pytest.raises(ValueError, match="needs 40 KV blocks"):
        _reserve(rx, "long", list(range(3, 163)), _greedy())
    with pytest.raises(ValueError, match="empty"):
        _reserve(rx, "empty", [], _greedy())
    assert rx.engine.block_manager.num_free_blocks == 31


def test_first_token_that_stops_finishes_at_admission(rx):
    bm = rx.engine.block_manager
    free0 = bm.num_free_blocks
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    _fill_all(rx, res.reservation_id)
    # 2: the tiny model's EOS
    seq = rx.complete(res.reservation_id, 2, token=res.token).result(timeout=0)
    assert seq.is_finished and seq.finish_reason == "stop"
    assert bm.num_free_blocks == free0


def test_reservation_states_move_only_forward_and_are_counted(rx):
    released = []
    rx.on_release = released.append
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    assert res.state is ReservationState.RESERVED
    ids = res.push_block_ids
    t = _chunk(rx, len(ids))
    rx.write(res.reservation_id, 0, KEY, ids, list(t.shape), "float32", _bytes(t),
             token=res.token)
    assert res.state is ReservationState.RECEIVING
    _fill_all(rx, res.reservation_id)
    rx.complete(res.reservation_id, 7, token=res.token).result(timeout=0)
    assert res.state is ReservationState.ADMITTED
    # admitted: the blocks are the sequence's, a late release does nothing
    assert rx.release(res.reservation_id, ReleaseReason.LEASE_EXPIRED) is None
    b = _reserve(rx, "b", [5, 6, 7], _greedy())
    assert rx.release(b.reservation_id, ReleaseReason.PREFILL_FAILED, "boom") is b
    assert rx.release(b.reservation_id, ReleaseReason.LEASE_EXPIRED) is None   # once only
    assert b.state is ReservationState.RELEASED
    assert (b.release_reason, b.detail) == (ReleaseReason.PREFILL_FAILED, "boom")
    assert released == [b]
    assert rx.transitions == {("reserved", ""): 2, ("receiving", ""): 1, ("admitted", ""): 1,
                              ("released", "prefill failed"): 1}


def test_drain_releases_unstarted_reservations_and_refuses_new_ones(rx):
    bm = rx.engine.block_manager
    free0 = bm.num_free_blocks
    released = []
    rx.on_release = released.append
    idle = _reserve(rx, "idle", [5, 6, 7, 8, 9], _greedy())
    busy = _reserve(rx, "busy", list(range(10, 19)), _greedy())
    ids = busy.push_block_ids
    t = _chunk(rx, len(ids))
    rx.write(busy.reservation_id, 0, KEY, ids, list(t.shape), "float32", _bytes(t),
             token=busy.token)
    assert rx.drain("decode node is draining") == [idle]
    assert released == [idle] and idle.release_reason is ReleaseReason.DRAINING
    with pytest.raises(Draining, match="draining"):
        _reserve(rx, "late", [5, 6, 7], _greedy())
    # the push that had begun still completes and is admitted
    _fill_all(rx, busy.reservation_id)
    seq = rx.complete(busy.reservation_id, 7, token=busy.token).result(timeout=0)
    assert busy.state is ReservationState.ADMITTED and not seq.is_finished
    assert bm.num_free_blocks == free0 - len(busy.block_ids)


@pytest.mark.parametrize("token", [b"", b"\0" * 32, "other"])
def test_wrong_token_is_denied_and_changes_nothing(rx, token):
    res = _reserve(rx, "a", list(range(10, 19)), _greedy())
    other = _reserve(rx, "b", [5, 6, 7], _greedy())
    token = other.token if token == "other" else token
    ids = res.push_block_ids
    t = _chunk(rx, len(ids), 9.0)
    before = _snapshot(rx)
    with pytest.raises(PushDenied, match="push token"):
        rx.write(res.reservation_id, 0, KEY, ids, list(t.shape), "float32", _bytes(t),
                 token=token)
    with pytest.raises(PushDenied):
        rx.complete(res.reservation_id, 7, token=token)
    with pytest.raises(PushDenied, match="does not belong to request 'b'"):
        rx.authorize(res.reservation_id, res.token, request_id="b")
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(rx), strict=True))
    assert res.state is ReservationState.RESERVED and res.chunks_received == 0
    assert rx.denied == 3 and rx.authorize(res.reservation_id, res.token, "a") is res


def test_lease_is_clamped_to_the_maximum(folder):
    eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=BS,
                                 num_gpu_blocks=32, max_num_seqs=3))
    rx = KvReceiver(eng, default_lease_s=10.0, max_lease_s=60.0)
    assert [rx.lease_for(x) for x in (None, 0, 5.0, 30.0, 49 * 86400.0)] == \
        [10.0, 10.0, 5.0, 30.0, 60.0]
    res = _reserve(rx, "a", [5, 6, 7], _greedy(), lease_s=49 * 86400.0)
    assert res.lease_s == 60.0 and rx.expire(now=res.deadline) == [res]
    with pytest.raises(ValueError, match="below the default"):
        KvReceiver(eng, default_lease_s=30.0, max_lease_s=5.0)
