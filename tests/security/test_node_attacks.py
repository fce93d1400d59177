"""Attacks on the node links (router -> decode, router -> prefill, prefill -> decode), run
against the real node services in one process (tests/pd_harness.py: the fake
in-process transport, or real loopback sockets for the raw-TCP data plane).

Each attack must be refused, leave the victim's request to finish with the tokens the
single-node LLM gives, and leave the free blocks where they started.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
import torch

from cluster.discovery import MemoryRegistry, MemoryStore, NodeRecord
from cluster.kv_transfer.base import PushFailed
from cluster.kv_transfer.kv_receiver import ReservationState
from cluster.kv_transfer.limits import TcpLimits
from cluster.kv_transfer.tcp_framing import FRAME, REPLY
from engine import LLM, SamplingParams
from prefill_node.decode_gate import DiscoveryDecodeGate
from protos import node_pb2
from tests.pd_harness import DECODE_ADDRESS, FakeContext, PdPair, RpcError
from tests.tiny_models import make_tiny_model

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=96, max_num_seqs=8)
PROMPT = list(range(3, 20))                 # 17 tokens: 5 blocks of 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


@pytest.fixture(scope="module")
def want(folder) -> list[int]:
    """The single-node LLM's greedy tokens for PROMPT: what the victim must still get."""
    out = LLM(folder, **OPTS).generate([{"prompt_token_ids": PROMPT}], GREEDY)
    return out[0].outputs[0].token_ids


async def _wait_free(pair: PdPair, want_free: int) -> int:
    """Free decode blocks once the engine loop has applied every release (bounded wait;
    what is checked is the count, not how long it took)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while pair.decode.engine.load().free_blocks != want_free and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return pair.decode.engine.load().free_blocks


def _attack(folder, body, **pair_opts) -> None:
    async def main():
        pair = PdPair(folder, OPTS, OPTS, **pair_opts)
        pair.start()
        start = pair.free_blocks()
        try:
            await body(pair)
            assert await _wait_free(pair, start[1]) == start[1], "decode blocks leaked"
        finally:
            await pair.stop()
        assert pair.free_blocks() == start, "block pools must return to their starting counts"
        assert not pair.decode.receiver.reservations
    asyncio.run(main())


def _kv_snapshot(pair: PdPair) -> list[torch.Tensor]:
    kv = pair.decode.engine.kv_cache
    return [t.clone() for t in kv.k + kv.v]


def _poison(pair: PdPair, res, **header) -> list[node_pb2.KvPushMessage]:
    """A whole push of garbage KV for `res`'s blocks; header fields as given."""
    fp = pair.decode.fingerprint
    ids = list(res.block_ids)[res.num_cached_blocks:]
    shape = [len(ids), fp.block_size, fp.num_kv_heads, fp.head_dim]
    junk = torch.full(shape, 7.0).numpy().tobytes()
    msgs = [node_pb2.KvPushMessage(header=node_pb2.PushHeader(
        request_id=header.pop("request_id", "victim"), reservation_id=res.reservation_id,
        fingerprint=res.fingerprint, block_ids=ids, **header))]
    msgs += [node_pb2.KvPushMessage(chunk=node_pb2.KvChunk(
        layer=layer, kind=kind, block_ids=ids, shape=shape, dtype="float32", data=junk))
        for layer in range(fp.num_layers) for kind in (0, 1)]
    return msgs + [node_pb2.KvPushMessage(done=node_pb2.PushDone(first_token_id=5))]


async def _stream(msgs):
    for m in msgs:
        yield m


async def _reserve(pair: PdPair, rid: str):
    """A Decode call held open by the caller: (stream, Reservation)."""
    stream = pair.decode.service.Decode(node_pb2.ReserveRequest(
        request_id=rid, prompt_token_ids=[40, 41, 42, 43, 44]), FakeContext())
    return stream, (await anext(stream)).reservation


# ---- push tokens -------------------------------------------------------------------------
@pytest.mark.parametrize("forgery", ["no_token", "other_reservations_token", "wrong_token",
                                     "right_token_other_request"])
def test_forged_push_is_denied_and_leaves_the_reservation_alone(folder, want, forgery):
    async def body(pair: PdPair):
        other_stream, other = await _reserve(pair, "other")
        seen = {}

        async def attack(res):
            token = {"no_token": b"", "other_reservations_token": other.push_token,
                     "wrong_token": bytes(len(res.push_token)),
                     "right_token_other_request": res.push_token}[forgery]
            rid = "other" if forgery == "right_token_other_request" else "victim"
            before = _kv_snapshot(pair)
            with pytest.raises(PushFailed) as info:
                await pair.transport.push(DECODE_ADDRESS, _stream(
                    _poison(pair, res, push_token=token, request_id=rid)))
            seen["code"] = info.value.code
            held = pair.decode.receiver.reservations[res.reservation_id]
            seen["state"], seen["chunks"] = held.state, held.chunks_received
            seen["kv_untouched"] = all(torch.equal(a, b) for a, b in
                                       zip(before, _kv_snapshot(pair), strict=True))
        tokens, _, finish = await pair.generate("victim", PROMPT, GREEDY,
                                                before_prefill=attack)
        assert seen == {"code": grpc.StatusCode.PERMISSION_DENIED, "chunks": 0,
                        "state": ReservationState.RESERVED, "kv_untouched": True}
        assert (tokens, finish) == (want, "length"), "the victim's request was affected"
        assert pair.decode.receiver.reservations[other.reservation_id].open, \
            "the other reservation was affected"
        assert pair.decode.receiver.denied == 1
        await other_stream.aclose()
    _attack(folder, body)


def test_push_token_is_random_per_reservation_and_only_the_router_sees_it(folder):
    async def body(pair: PdPair):
        streams = [await _reserve(pair, f"r{i}") for i in range(3)]
        tokens = {res.push_token for _, res in streams}
        assert len(tokens) == 3 and all(len(t) == 32 for t in tokens)
        res = streams[0][1]
        held = pair.decode.receiver.reservations[res.reservation_id]
        assert res.push_token.hex() not in repr(held), "the token must not reach logs"
        for stream, _ in streams:
            await stream.aclose()
    _attack(folder, body)


# ---- notices -----------------------------------------------------------------------------
@pytest.mark.parametrize("forgery", ["no_token", "other_request_id", "other_reservations_token"])
def test_forged_abort_notice_is_denied(folder, want, forgery):
    async def body(pair: PdPair):
        other_stream, other = await _reserve(pair, "other")
        seen = {}

        async def attack(res):
            token = {"no_token": b"", "other_request_id": res.push_token,
                     "other_reservations_token": other.push_token}[forgery]
            rid = "other" if forgery == "other_request_id" else "victim"
            with pytest.raises(RpcError) as info:
                await pair.decode.service.AbortReservation(node_pb2.AbortRequest(
                    request_id=rid, reservation_id=res.reservation_id, reason="forged",
                    push_token=token), FakeContext())
            seen["code"] = info.value.code
            seen["open"] = pair.decode.receiver.reservations[res.reservation_id].open
        tokens, _, finish = await pair.generate("victim", PROMPT, GREEDY,
                                                before_prefill=attack)
        assert seen == {"code": grpc.StatusCode.PERMISSION_DENIED, "open": True}
        assert (tokens, finish) == (want, "length")
        assert pair.decode.receiver.reservations[other.reservation_id].open
        # the holder's own notice still works, and frees the blocks at once
        reply = await pair.decode.service.AbortReservation(node_pb2.AbortRequest(
            request_id="other", reservation_id=other.reservation_id, reason="mine",
            push_token=other.push_token), FakeContext())
        assert reply.found and other.reservation_id not in pair.decode.receiver.reservations
        with pytest.raises(RpcError) as info:
            await anext(other_stream)
        assert info.value.code == grpc.StatusCode.ABORTED and "mine" in info.value.details
    _attack(folder, body)


def test_abort_prefill_needs_the_requests_token(folder, want):
    async def body(pair: PdPair):
        gate, real_push = asyncio.Event(), pair.transport.push
        seen = {}

        async def held_push(address, messages):       # keeps the prefill in flight
            await gate.wait()
            return await real_push(address, messages)
        pair.transport.push = held_push

        async def attack_when_in_flight():
            while "victim" not in pair.prefill.service.inflight:
                await asyncio.sleep(0.01)
            for token in (b"", b"x" * 32):
                with pytest.raises(RpcError) as info:
                    await pair.prefill.service.AbortPrefill(node_pb2.AbortRequest(
                        request_id="victim", reason="forged", push_token=token),
                        FakeContext())
                seen.setdefault("codes", []).append(info.value.code)
            gate.set()
        attacker = asyncio.ensure_future(attack_when_in_flight())
        tokens, _, finish = await pair.generate("victim", PROMPT, GREEDY)
        await attacker
        assert seen["codes"] == [grpc.StatusCode.PERMISSION_DENIED] * 2
        assert (tokens, finish) == (want, "length")
    _attack(folder, body)


# ---- leases ------------------------------------------------------------------------------
def test_lease_beyond_the_cap_is_clamped_to_it(folder, want):
    forty_nine_days_ms = 49 * 24 * 3600 * 1000

    async def body(pair: PdPair):
        svc = pair.decode.service
        stream = svc.Decode(node_pb2.ReserveRequest(
            request_id="greedy", prompt_token_ids=[40, 41, 42, 43, 44],
            lease_ms=forty_nine_days_ms), FakeContext())
        res = (await anext(stream)).reservation
        assert res.lease_ms == 20_000, "the granted lease is the node's maximum"
        held = pair.decode.receiver.reservations[res.reservation_id]
        assert held.lease_s == 20.0
        # the lease really ends at the cap: past it, the reaper's check releases it
        assert pair.decode.receiver.expire(now=time.monotonic() + 20.5) == [held]
        with pytest.raises(RpcError) as info:
            await anext(stream)
        assert info.value.code == grpc.StatusCode.ABORTED and "lease" in info.value.details
        # a shorter ask is granted as asked, and a request within it is served
        seen = {}

        async def look(r):
            seen["lease_ms"] = r.lease_ms
        # (longer than the node's default of 10 s, within its cap of 20 s)
        tokens, _, _ = await pair.generate("ok", PROMPT, GREEDY, lease_ms=15_000,
                                           before_prefill=look)
        assert seen == {"lease_ms": 15_000} and tokens == want
    _attack(folder, body, lease_s=10.0, decode_options={"max_lease_s": 20.0})


# ---- where a prefill node may push -----------------------------------------------------
def test_prefill_refuses_an_unregistered_decode_address_before_dialing(folder, want):
    async def body(pair: PdPair):
        dialed = []
        real_push, real_abort = pair.transport.push, pair.transport.abort_reservation

        async def push(address, messages):
            dialed.append(address)
            return await real_push(address, messages)

        async def abort(address, request):
            dialed.append(address)
            return await real_abort(address, request)
        pair.transport.push, pair.transport.abort_reservation = push, abort
        evil = "203.0.113.9:6666"

        def aim_elsewhere(req):
            req.decode_address = evil
        with pytest.raises(RpcError) as info:
            await pair.generate("victim", PROMPT, GREEDY, prefill_tamper=aim_elsewhere)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert evil in info.value.details and "not a registered decode node" in info.value.details
        assert dialed == [], "nothing may be sent to an unregistered address"
        # the decode node's reservation for it went with its caller; a real request works
        tokens, _, _ = await pair.generate("next", PROMPT, GREEDY)
        assert tokens == want and dialed == [DECODE_ADDRESS]
    _attack(folder, body)


def test_discovery_gate_follows_the_registered_decode_nodes():
    async def main():
        store = MemoryStore()
        decode = MemoryRegistry("c", store)
        await decode.register(NodeRecord("d1", "decode", "10.0.0.5:7001", "inc-1"))
        await MemoryRegistry("c", store).register(NodeRecord("p1", "prefill", "10.0.0.6:7002",
                                                             "inc-2"))
        gate = DiscoveryDecodeGate(MemoryRegistry("c", store), grace_s=0.3)
        assert not gate.allows("10.0.0.5:7001"), "nothing is allowed before the snapshot"
        await gate.start()
        await gate.view.wait_for(lambda v: v.nodes("decode"), 5.0)
        seen = [gate.allows(a) for a in ("10.0.0.5:7001", "10.0.0.6:7002", "10.0.0.5:7009")]
        await decode.deregister()
        await gate.view.wait_for(lambda v: not v.nodes("decode"), 5.0)
        # a draining decode node left discovery first but still takes the pushes of the
        # reservations it granted; after the grace period it is no target any more
        draining = gate.allows("10.0.0.5:7001")
        await asyncio.sleep(0.4)
        gone = gate.allows("10.0.0.5:7001")
        await gate.close()
        return seen, draining, gone
    seen, draining, gone = asyncio.run(main())
    assert seen == [True, False, False], "only a registered decode node's address"
    assert draining is True, "a node that just left (draining) still takes its pushes"
    assert gone is False, "a node that left discovery for good is no longer a target"


# ---- the raw-TCP data plane --------------------------------------------------------------
LIMITS = TcpLimits(max_connections=8, header_timeout_s=1.0, idle_timeout_s=5.0)
OK, BUSY = 0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def _connect_all(address: tuple[str, int], n: int) -> list[socket.socket]:
    return [socket.create_connection(address, timeout=10) for _ in range(n)]


def _first_status_then_eof(sock: socket.socket) -> int:
    """The greeting's status; then read on until the node closes the connection."""
    sock.settimeout(15)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    sock.close()
    return REPLY.unpack(data[:REPLY.size])[0]


def _conn_threads() -> int:
    return sum(t.name.startswith("kv-tcp-conn") for t in threading.enumerate())


def test_idle_data_plane_connections_are_bounded_and_real_pushes_still_work(folder, want):
    async def body(pair: PdPair):
        server = pair.decode.kv_tcp
        socks = await asyncio.to_thread(_connect_all, (server.host, server.port), 500)
        assert server.peak <= LIMITS.max_connections
        assert _conn_threads() <= LIMITS.max_connections
        # while the flood holds every slot, a real request is served (its push goes over
        # gRPC when the data plane turns it away)
        tokens, _, _ = await pair.generate("during", PROMPT, GREEDY)
        assert tokens == want
        statuses = await asyncio.to_thread(lambda: [_first_status_then_eof(s) for s in socks])
        assert set(statuses) <= {OK, BUSY}, "every connection gets a greeting, then is closed"
        assert statuses.count(OK) >= LIMITS.max_connections and statuses.count(BUSY) > 0
        assert server.peak <= LIMITS.max_connections, "never more served than the cap"
        assert _conn_threads() <= LIMITS.max_connections, "no thread per connection"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while server.active and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert server.active == 0, "idle connections were not closed"
        # once the idle ones are gone, a push goes over the data plane itself
        pushes, fallbacks = server.pushes, pair.prefill.transport.fallbacks
        tokens, _, _ = await pair.generate("after", PROMPT, GREEDY)
        assert tokens == want
        assert (server.pushes, pair.prefill.transport.fallbacks) == (pushes + 1, fallbacks)
    _attack(folder, body, tcp=True, decode_options={"kv_tcp_limits": LIMITS})


def test_forged_push_on_the_data_plane_is_denied_before_any_chunk_is_read(folder, want):
    async def body(pair: PdPair):
        server = pair.decode.kv_tcp
        seen = {}

        def forge(res) -> int:
            msgs = _poison(pair, res, push_token=b"\0" * 32)
            sock = socket.create_connection((server.host, server.port), timeout=10)
            assert REPLY.unpack(sock.recv(REPLY.size)) == (OK, 0)
            for m in msgs[:2]:                      # the header, then a chunk with bytes
                data = b""
                if m.WhichOneof("msg") == "chunk":
                    data = m.chunk.data
                    m.chunk.ClearField("data")
                meta = m.SerializeToString()
                sock.sendall(FRAME.pack(len(meta), len(data)) + meta + data)
            return _first_status_then_eof(sock)

        async def attack(res):
            seen["status"] = await asyncio.to_thread(forge, res)
            held = pair.decode.receiver.reservations[res.reservation_id]
            seen["state"], seen["chunks"] = held.state, held.chunks_received
        tokens, _, _ = await pair.generate("victim", PROMPT, GREEDY, before_prefill=attack)
        assert seen == {"status": grpc.StatusCode.PERMISSION_DENIED.value[0], "chunks": 0,
                        "state": ReservationState.RESERVED}
        assert tokens == want
    _attack(folder, body, tcp=True, decode_options={"kv_tcp_limits": LIMITS})
