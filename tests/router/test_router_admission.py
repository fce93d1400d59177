"""The router's admission queue (router/admission.py) through PdBackend over real gRPC
against scripted nodes: FIFO order behind a full decode node, nobody refused within the
bounds, and 429 with a Retry-After hint at once past the queue depth."""

from __future__ import annotations

import asyncio

from router.errors import Overloaded
from tests.router.pd_fakes import PROMPT, Shared, _cluster, _collect, _expected, _run


def test_a_burst_beyond_capacity_queues_in_order_and_nobody_is_refused():
    """One decode node that holds 3, kept full; 20 more requests arrive one after another
    (each once the previous is queued). None is refused, every one gets its exact tokens,
    and they reach the node in the order they queued (FIFO: no overtaking)."""
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{"capacity": 3}], [{}])
        backend.queue_timeout_s = 25
        node = shared.decodes[0]
        first = [asyncio.ensure_future(_collect(backend, f"f{i}", PROMPT + [i], 20))
                 for i in range(3)]
        while node.active < 3:
            await asyncio.sleep(0.005)
        queued = []
        for i in range(20):
            queued.append(asyncio.ensure_future(_collect(backend, f"q{i:02d}",
                                                         PROMPT + [50 + i], 3)))
            while backend.admission.depth < i + 1 and node.active == 3:
                await asyncio.sleep(0.005)
        results = await asyncio.gather(*first, *queued)
        order = [rid.split(".")[0] for rid in node.admitted if rid.startswith("q")]
        depth = backend.admission.depth
        for s in servers:
            await s.stop(None)
        await backend.close()
        return results, order, depth

    results, order, depth = _run(main())
    for i, (tokens, _) in enumerate(results[:3]):
        assert tokens == _expected(PROMPT + [i], 20)
    for i, (tokens, _) in enumerate(results[3:]):
        assert tokens == _expected(PROMPT + [50 + i], 3), f"queued request {i}"
    assert order == [f"q{i:02d}" for i in range(20)], "a later request overtook a waiting one"
    assert depth == 0


def test_past_the_queue_depth_the_answer_is_429_at_once_with_retry_after():
    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{"capacity": 1}], [{}])
        backend.admission.max_depth = 2
        backend.queue_timeout_s = 25
        tasks = [asyncio.ensure_future(_collect(backend, f"d{i}", PROMPT + [i], 30))
                 for i in range(6)]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return outcomes

    outcomes = _run(main())
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    served = [o for o in outcomes if not isinstance(o, BaseException)]
    # one in service, two waiting; the other three are refused at once, with the hint
    assert len(served) == 3 and len(refused) == 3
    assert all("--queue-depth 2" in o.message and o.retry_after_s >= 1 for o in refused)


def test_requests_wait_for_the_only_decode_node_to_come_back():
    """The only decode node dies mid-stream (as under `pdserve up`, whose supervisor
    restarts it) and a second request arrives while it is gone. Neither fails: both wait
    (within --queue-timeout) until discovery brings the node back, under a new
    incarnation, and then get their exact tokens; the first one without repeats."""
    from router.node_pool import NodeState
    from tests.router.pd_fakes import FakeDecode, _serve

    async def main():
        shared = Shared()
        pool, backend, servers = await _cluster(shared, [{"die_after": 2}], [{}])
        backend.queue_timeout_s = 20
        first = asyncio.ensure_future(_collect(backend, "a", PROMPT, 6))
        while pool.nodes("decode") and not first.done():    # until the router drops it
            await asyncio.sleep(0.01)
        assert not first.done(), "the request should wait for a decode node"
        second = asyncio.ensure_future(_collect(backend, "b", PROMPT + [7], 4))
        await asyncio.sleep(0.5)              # both wait; neither is refused meanwhile
        assert not first.done() and not second.done()
        from protos import node_pb2_grpc
        server, addr = await _serve(FakeDecode(shared),
                                    node_pb2_grpc.add_DecodeNodeServicer_to_server)
        servers.append(server)
        pool.upsert(NodeState("decode-0", "decode", addr, incarnation="restarted"))
        out = await asyncio.gather(first, second)
        for s in servers:
            await s.stop(None)
        await backend.close()
        return out

    (a, _), (b, _) = _run(main())
    assert a == _expected(PROMPT, 6)
    assert b == _expected(PROMPT + [7], 4)
