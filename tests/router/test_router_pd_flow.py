"""The router's PD flow over real gRPC against scripted nodes (the boundary): reservation
then prefill, token streaming, replay on a node's death without loss or duplicates, full
nodes, cancellation; and the discovery feed (in-memory registry) driving the node pool."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.discovery import MemoryRegistry, MemoryStore, NodeLoad, NodeRecord
from engine.sampling_params import SamplingParams
from router.backend import NodeRequest
from router.discovery_feed import follow
from router.errors import InvalidRequest, NoNodeAvailable, Overloaded, RepeatedFailure
from router.metrics import RouterMetrics
from router.node_pool import NodePool
from router.pd_backend import PdBackend
from router.policies import make_policy
from tests.router.pd_fakes import (
    PROMPT,
    Shared,
    _cluster,
    _collect,
    _expected,
    _run,
)


def test_reserve_then_prefill_with_the_reservation_and_stream_tokens():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{}], [{}])
        tokens, steps = await _collect(backend, "r1", PROMPT, 6)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, pool, tokens, steps

    shared, pool, tokens, steps = _run(main())
    assert tokens == _expected(PROMPT, 6)
    assert steps[-1].finish_reason == "length" and all(s.finish_reason is None
                                                       for s in steps[:-1])
    pre = shared.prefill_requests[0]
    assert (pre.reservation_id, list(pre.block_ids), pre.num_cached_blocks) == (
        "res-r1", [5, 6, 7], 1)
    assert pre.decode_address == pool.get("decode-0").address
    assert pre.push_token == b"token-r1", "the reservation's token goes to the prefill node"
    assert list(pre.prompt_token_ids) == PROMPT and pre.sampling.max_tokens == 6
    assert [n.inflight for n in pool.all()] == [0, 0]


def test_decode_death_mid_stream_replays_on_another_pair_without_loss_or_duplicates():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{"die_after": 3}, {}], [{}, {}])
        tokens, steps = await _collect(backend, "r2", PROMPT, 8)
        live = [n.node_id for n in pool.nodes("decode")]
        replays = backend.metrics.replays._value.get()
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens, steps, live, replays

    shared, tokens, steps, live, replays = _run(main())
    assert tokens == _expected(PROMPT, 8)          # identical to an uninterrupted run
    assert live == ["decode-1"]                     # the dead node left routing at once
    assert replays == 1
    second = shared.reserve_requests[1][1]
    assert second.request_id == "r2.r1"
    assert list(second.prompt_token_ids) == PROMPT + tokens[:3]
    assert second.sampling.max_tokens == 5


def test_a_silent_decode_node_is_dropped_after_the_stall_timeout_and_replayed():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{"hang_after": 2}, {}], [{}])
        backend.stall_timeout_s = 0.5
        tokens, _ = await _collect(backend, "r8", PROMPT, 6)
        live = [n.node_id for n in pool.nodes("decode")]
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens, live

    shared, tokens, live = _run(main())
    assert tokens == _expected(PROMPT, 6)
    assert live == ["decode-1"]
    assert "r8" in shared.cancelled             # the hung call was cancelled, not leaked


def test_prefill_failure_drops_the_prefill_node_and_replays():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{}], [{"fail": True}, {}])
        tokens, _ = await _collect(backend, "r3", PROMPT, 4)
        live = [n.node_id for n in pool.nodes("prefill")]
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens, live

    shared, tokens, live = _run(main())
    assert tokens == _expected(PROMPT, 4)
    assert live == ["prefill-1"]
    assert [r.request_id for r in shared.prefill_requests] == ["r3", "r3.r1"]
    # the first attempt's decode call was cancelled (its reservation released), not left
    # to wait out the lease
    assert "r3" in shared.cancelled


def test_a_prefill_refusal_reports_its_root_cause_not_the_decode_abort():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(
            shared, [{}], [{"refuse": grpc.StatusCode.INVALID_ARGUMENT}])
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            await _collect(backend, "r7", PROMPT, 4)
        live = [n.node_id for n in pool.all()]
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, live

    shared, live = _run(main())
    assert len(shared.prefill_requests) == 1        # a bad request is not retried elsewhere
    assert live == ["decode-0", "prefill-0"]        # and no node is blamed for it


def test_every_decode_node_full_is_overloaded_and_no_nodes_is_unavailable():
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(shared, [{"full": True}, {"full": True}], [{}])
        backend.queue_timeout_s = 0             # no waiting for room: 429 at once
        with pytest.raises(Overloaded, match="full"):
            await _collect(backend, "r4", PROMPT, 4)
        for s in servers:
            await s.stop(None)
        await backend.close()
        empty = PdBackend(NodePool(), make_policy("least-load"), RouterMetrics(NodePool()),
                          max_model_len=512, queue_timeout_s=0.3)
        with pytest.raises(NoNodeAvailable, match=r"no prefill node .*waited 0.3 s"):
            await _collect(empty, "r5", PROMPT, 4)
        return shared

    shared = _run(main())
    assert len(shared.reserve_requests) == 2       # each full node tried once
    assert shared.prefill_requests == []


def test_a_request_waits_for_room_when_every_decode_node_is_full():
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(shared, [{"full": True}, {"full": True}], [{}])
        backend.queue_timeout_s = 10

        async def free_one_later():
            while len(shared.reserve_requests) < 4:      # both refused, twice over
                await asyncio.sleep(0.01)
            shared.decodes[1].full = False
        freer = asyncio.create_task(free_one_later())
        tokens, _ = await _collect(backend, "r9", PROMPT, 4)
        await freer
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens

    shared, tokens = _run(main())
    assert tokens == _expected(PROMPT, 4)
    assert len(shared.reserve_requests) >= 5 and len(shared.prefill_requests) == 1


def test_closing_the_stream_early_cancels_the_decode_call():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{}], [{}])
        gen = backend.generate(NodeRequest("r6", PROMPT, SamplingParams(max_tokens=50)))
        got = [await anext(gen), await anext(gen)]
        await gen.aclose()
        for _ in range(100):
            if shared.cancelled:
                break
            await asyncio.sleep(0.01)
        inflight = [n.inflight for n in pool.all()]
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, got, inflight

    shared, got, inflight = _run(main())
    assert [s.token_ids[0] for s in got] == _expected(PROMPT, 2)
    assert shared.cancelled == ["r6"]
    assert inflight == [0, 0]


def test_discovery_feed_adds_updates_and_removes_nodes():
    async def main():
        store = MemoryStore()
        node_reg, router_reg = MemoryRegistry("c", store), MemoryRegistry("c", store)
        pool = NodePool()
        await node_reg.register(NodeRecord("decode-a", "decode", "127.0.0.1:1", "inc1",
                                           fingerprint={"block_size": 4}))
        task = asyncio.create_task(follow(router_reg, pool))
        await asyncio.sleep(0.05)
        seen = [(n.node_id, n.block_size) for n in pool.all()]
        await node_reg.publish_load(NodeLoad(running=2, waiting=1, free_blocks=9,
                                             block_hashes=(7, 8), incarnation="inc1"))
        await asyncio.sleep(0.05)
        node = pool.get("decode-a")
        loaded = (node.running, node.waiting, node.free_blocks, node.block_hashes)
        await node_reg.deregister()
        await asyncio.sleep(0.05)
        after = pool.all()
        task.cancel()
        return seen, loaded, after

    seen, loaded, after = _run(main())
    assert seen == [("decode-a", 4)]
    assert loaded == (2, 1, 9, frozenset({7, 8}))
    assert after == []


def test_a_draining_decode_node_sends_new_requests_elsewhere_and_keeps_its_streams():
    """The refusal of a draining node (UNAVAILABLE + replay hint) must neither mark it
    failed nor close its channel: closing a grpc.aio channel cancels every stream on it."""
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{}, {}], [{}])
        long_run = asyncio.create_task(_collect(backend, "a", PROMPT, 60))   # on decode-0
        while not any(r.request_id == "a" for r in shared.prefill_requests):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)                      # a few tokens of "a" have streamed
        shared.decodes[0].draining = True
        b, c = await asyncio.gather(_collect(backend, "b", PROMPT[:3], 5),    # decode-1
                                    _collect(backend, "c", PROMPT[:4], 5))    # decode-0
        a = await long_run
        live = [n.node_id for n in pool.nodes("decode")]
        failures = backend.metrics.node_failures.labels("decode")._value.get()
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, a[0], b[0], c[0], live, failures

    shared, a, b, c, live, failures = _run(main())
    # "a" streamed to its end on the draining node: never cut, so never replayed
    assert a == _expected(PROMPT, 60)
    assert [r.request_id for _, r in shared.reserve_requests if r.request_id[0] == "a"] == ["a"]
    assert b == _expected(PROMPT[:3], 5) and c == _expected(PROMPT[:4], 5)
    # "c" was refused by decode-0 and ran on decode-1 under its second id
    assert [r.request_id for _, r in shared.reserve_requests if r.request_id[0] == "c"] == [
        "c", "c.r1"]
    assert live == ["decode-0", "decode-1"] and failures == 0


def test_discovery_dropping_a_hung_prefill_node_replays_its_pending_prefill_at_once():
    """A hung prefill node never answers; its etcd lease runs out and discovery drops it.
    The request must move on then, not after the decode node's reservation lease (here:
    never, the fake decode node has none, so the old behaviour hangs past the deadline)."""
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{}], [{"hang": True}, {}])
        task = asyncio.ensure_future(_collect(backend, "r9", PROMPT, 5))
        while not shared.prefill_requests:
            await asyncio.sleep(0.01)
        assert pool.get("prefill-0").address and len(shared.prefill_requests) == 1
        pool.remove("prefill-0")                       # the discovery DELETE
        tokens, _ = await task
        live = [n.node_id for n in pool.nodes("prefill")]
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens, live

    shared, tokens, live = _run(main())
    assert tokens == _expected(PROMPT, 5)
    assert live == ["prefill-1"]
    assert [r.request_id for r in shared.prefill_requests] == ["r9", "r9.r1"]


def test_an_internal_error_on_one_pair_is_replayed_on_another_not_a_500():
    """A push broken inside gRPC or a node (INTERNAL; seen when a decode node drained under
    a push) must cost a replay, not the client's request."""
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(
            shared, [{}], [{"refuse": grpc.StatusCode.INTERNAL}, {}])
        tokens, _ = await _collect(backend, "r10", PROMPT, 4)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens

    shared, tokens = _run(main())
    assert tokens == _expected(PROMPT, 4)
    assert [r.request_id for r in shared.prefill_requests] == ["r10", "r10.r1"]


@pytest.mark.parametrize("reply_after,grace,cancelled", [(0.5, 30.0, []), (3600, 0.3, ["r9"])],
                         ids=["reply-waited-for", "hung-reply-cancelled-after-the-grace"])
def test_a_prefill_reply_still_on_its_way_when_the_request_finishes(monkeypatch, reply_after,
                                                                    grace, cancelled):
    """The decode node streamed every token, so the push was admitted and the Prefill reply
    is on its way: the router waits for it (a cancelled Prefill would make the prefill node
    count a failed push and abort the request there), for a bounded grace."""
    import router.pd_backend as pd_backend

    monkeypatch.setattr(pd_backend, "PREFILL_REPLY_GRACE_S", grace)

    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{}], [{"reply_after": reply_after}])
        tokens, steps = await _collect(backend, "r9", PROMPT, 3)
        await asyncio.sleep(0.2)          # a cancellation reaches the fake node
        inflight = [n.inflight for n in pool.all()]
        for s in servers:
            await s.stop(None)
        await backend.close()
        return shared, tokens, steps, inflight

    shared, tokens, steps, inflight = _run(main())
    assert tokens == _expected(PROMPT, 3) and steps[-1].finish_reason == "length"
    assert shared.prefill_cancelled == cancelled
    assert inflight == [0, 0]


def test_a_refusal_that_repeats_with_the_same_cause_is_a_500_at_once_not_four_replays():
    """Every decode node refuses the push as incomplete (ids and block numbers differ per
    attempt, the cause does not): the second identical refusal ends the request with a 500
    naming the cause, counted once; a refusal on one node only is replayed and served."""
    async def main():
        shared = Shared()
        _, backend, servers = await _cluster(
            shared, [{"refuse_push": True}, {"refuse_push": True}], [{}, {}])
        with pytest.raises(RepeatedFailure, match="incomplete") as err:
            await _collect(backend, "r11", PROMPT, 4)
        count = backend.metrics.registry.get_sample_value(
            "pdserve_router_repeated_failures_total", {"role": "decode", "reason": "aborted"})
        for s in servers:
            await s.stop(None)
        await backend.close()
        shared2 = Shared()
        _, backend2, servers2 = await _cluster(shared2, [{"refuse_push": True}, {}], [{}])
        tokens, _ = await _collect(backend2, "r12", PROMPT, 4)
        for s in servers2:
            await s.stop(None)
        await backend2.close()
        return shared, err.value, count, shared2, tokens

    shared, err, count, shared2, tokens = _run(main())
    assert (err.http_status, err.grpc_code) == (500, "INTERNAL")
    assert "on 2 attempts" in err.message and "decode node decode-" in err.message
    assert [r.request_id for r in shared.prefill_requests] == ["r11", "r11.r1"]
    assert count == 1
    assert tokens == _expected(PROMPT, 4)
    assert [r.request_id for r in shared2.prefill_requests] == ["r12", "r12.r1"]
