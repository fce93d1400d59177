"""PD PUSH through the real node services, in one process: the fake in-process transport
carries the same messages the gRPC one does. Greedy tokens and logprobs equal the
single-node LLM's; failures end waits at once; block pools return to their start."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.kv_transfer.base import PushFailed
from cluster.proto_convert import fingerprint_to_proto
from engine import LLM, SamplingParams
from protos import node_pb2
from tests.pd_harness import DECODE_ADDRESS, FakeContext, PdPair, RpcError
from tests.tiny_models import make_tiny_model, random_prompts

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=96, max_num_seqs=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


def run(coro):
    return asyncio.run(coro)


async def _with_pair(folder, body, prefill_opts=None, decode_opts=None, lease_s=30.0,
                     tcp=False, kv_push="auto"):
    pair = PdPair(folder, prefill_opts or OPTS, decode_opts or OPTS, lease_s, tcp=tcp,
                  kv_push=kv_push)
    pair.start()
    start = pair.free_blocks()
    try:
        await body(pair)
    finally:
        await pair.stop()
    assert pair.free_blocks() == start, "block pools must return to their starting counts"
    assert not pair.decode.receiver.reservations


@pytest.mark.parametrize("tcp,kv_push", [(False, "step"), (True, "step"), (False, "layer"),
                                         (True, "layer")],
                         ids=["inproc", "tcp-data-plane", "inproc-per-layer",
                              "tcp-data-plane-per-layer"])
def test_pd_greedy_equals_single_node_llm(folder, tcp, kv_push):
    prompts = random_prompts(6, [1, 4, 5, 9, 17, 33], 320, seed=3)
    prompts.append(prompts[4][:12] + [7, 8, 9])       # shares a prefix: decode cache hit
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    ref = LLM(folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], params)

    async def body(pair):
        outs = await asyncio.gather(*[pair.generate(f"r{i}", p, params)
                                      for i, p in enumerate(prompts[:-1])])
        outs.append(await pair.generate("last", prompts[-1], params))
        for i, ((tokens, lps, finish), want) in enumerate(zip(outs, ref, strict=True)):
            w = want.outputs[0]
            assert tokens == w.token_ids, f"prompt {i}: PD {tokens} != LLM {w.token_ids}"
            assert finish == w.finish_reason
            assert [e.token_id for e in lps] == tokens
            assert [e.logprob for e in lps] == pytest.approx(
                [e.logprob for e in w.logprobs], abs=1e-6)
            assert [[t for t, _ in e.top] for e in lps] == [[t for t, _ in e.top]
                                                            for e in w.logprobs]
    run(_with_pair(folder, body, tcp=tcp, kv_push=kv_push))


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_model("qwen3-moe-e8k2", tmp_path_factory.mktemp("models"))[0]


@pytest.mark.parametrize("tcp", [False, True], ids=["inproc", "tcp-data-plane"])
def test_pd_on_a_moe_model_equals_single_node_llm(moe_folder, tcp):
    """Qwen3-MoE (engine/models/moe.py) through PD: the pushed KV is the attention's, the
    experts run on each node as on one."""
    prompts = random_prompts(5, [1, 5, 9, 17, 33], 320, seed=8)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
    ref = LLM(moe_folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], params)

    async def body(pair):
        outs = await asyncio.gather(*[pair.generate(f"m{i}", p, params)
                                      for i, p in enumerate(prompts)])
        for i, ((tokens, _, _), want) in enumerate(zip(outs, ref, strict=True)):
            assert tokens == want.outputs[0].token_ids, f"prompt {i}"
    run(_with_pair(moe_folder, body, tcp=tcp))


@pytest.fixture(scope="module")
def mla_folder(tmp_path_factory):
    return make_tiny_model("deepseek-v3-mla", tmp_path_factory.mktemp("models"))[0]


@pytest.mark.parametrize("tcp,kv_push,chunk", [(False, "step", 0), (True, "step", 8),
                                               (True, "layer", 0)],
                         ids=["inproc", "tcp-data-plane-chunked", "tcp-per-layer"])
def test_pd_on_a_latent_cache_equals_single_node_llm(mla_folder, tcp, kv_push, chunk):
    """DeepSeek-V3 (MLA, engine/models/mla.py) through PD: the push carries the latent rows
    (K alone, no V), in layer runs or per layer, over a chunked prefill too, and a decode
    node's prefix hit skips blocks as with any cache."""
    prompts = random_prompts(5, [1, 5, 9, 17, 33], 320, seed=9)
    prompts.append(prompts[4][:12] + [7, 8, 9])       # shares a prefix: decode cache hit
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
    ref = LLM(mla_folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], params)
    prefill = {**OPTS, "max_num_batched_tokens": chunk} if chunk else OPTS

    async def body(pair):
        outs = await asyncio.gather(*[pair.generate(f"m{i}", p, params)
                                      for i, p in enumerate(prompts[:-1])])
        outs.append(await pair.generate("last", prompts[-1], params))
        for i, ((tokens, _, _), want) in enumerate(zip(outs, ref, strict=True)):
            assert tokens == want.outputs[0].token_ids, f"prompt {i}"
    run(_with_pair(mla_folder, body, prefill_opts=prefill, tcp=tcp, kv_push=kv_push))


def test_the_first_token_streams_alone_as_soon_as_the_push_is_admitted(folder):
    """The decode node's engine loop hands out what an admission made before it runs the
    next step: the pushed first token is not held back for the decode step that makes the
    second (a whole step of time to first token)."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def body(pair):
        tokens, _, _ = await pair.generate("r", list(range(3, 14)), params)
        events = pair.token_events["r"]
        assert [t for ev in events for t in ev] == tokens and len(tokens) == 5
        assert events[0] == tokens[:1], events
    run(_with_pair(folder, body))


def test_fingerprint_mismatch_is_refused_naming_the_field(folder):
    async def body(pair):
        with pytest.raises(RpcError) as info:
            await pair.generate("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size: 4 here, 8 there" in info.value.details
        assert pair.transport.aborts, "the decode node is told, its reservation released"
    run(_with_pair(folder, body, decode_opts={**OPTS, "block_size": 8}))


def test_push_header_with_wrong_fingerprint_writes_nothing(folder):
    async def body(pair):
        svc = pair.decode.service
        res = await asyncio.wrap_future(pair.decode.receiver.reserve("r", [5, 6, 7, 8, 9],
                                                                     SamplingParams()))
        fp = fingerprint_to_proto(pair.decode.fingerprint)
        fp.dtype = "bfloat16"

        async def messages():
            yield node_pb2.KvPushMessage(header=node_pb2.PushHeader(
                request_id="r", reservation_id=res.reservation_id, fingerprint=fp,
                block_ids=res.push_block_ids, push_token=res.token))
        with pytest.raises(PushFailed) as info:
            await svc.push_handler.handle(messages())
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype: 'float32' here, 'bfloat16' there" in info.value.message
        assert res.chunks_received == 0 and not pair.decode.receiver.reservations
    run(_with_pair(folder, body))


def test_decode_full_is_resource_exhausted(folder):
    async def body(pair):
        hold = pair.decode.service.Decode(node_pb2.ReserveRequest(
            request_id="hold", prompt_token_ids=[5, 6, 7]), FakeContext())
        await anext(hold)                                   # holds the only seat
        with pytest.raises(RpcError) as info:
            await pair.generate("r", [5, 6, 7], SamplingParams(temperature=0.0))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        await hold.aclose()                                 # the caller goes away
    run(_with_pair(folder, body, decode_opts={**OPTS, "max_num_seqs": 1}))


def test_failed_prefill_releases_the_reservation_at_once(folder):
    def tamper(req):
        del req.block_ids[-1]                               # wrong block count

    async def body(pair):
        with pytest.raises(RpcError) as info:
            await asyncio.wait_for(pair.generate("r", list(range(3, 20)),
                                                 SamplingParams(temperature=0.0),
                                                 prefill_tamper=tamper), 10)
        # the decode stream ended with ABORTED naming the prefill's error, long before
        # any lease (30 s) could have
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "destination block ids" in info.value.details
    run(_with_pair(folder, body))


def test_broken_push_is_ended_by_the_lease(folder):
    async def body(pair):
        svc = pair.decode.service
        stream = svc.Decode(node_pb2.ReserveRequest(
            request_id="r", prompt_token_ids=list(range(3, 20)), lease_ms=300), FakeContext())
        res = (await anext(stream)).reservation
        stalled = asyncio.Event()

        async def messages():                               # a prefill that dies mid-push
            yield node_pb2.KvPushMessage(header=node_pb2.PushHeader(
                request_id="r", reservation_id=res.reservation_id,
                fingerprint=res.fingerprint, block_ids=res.block_ids,
                push_token=res.push_token))
            stalled.set()
            await asyncio.Event().wait()
        push = asyncio.ensure_future(pair.transport.push(DECODE_ADDRESS, messages()))
        await stalled.wait()
        # (no free-block check here: on a loaded machine the 300 ms lease may be over by now)
        assert len(res.block_ids) > 0
        with pytest.raises(RpcError) as info:
            await asyncio.wait_for(anext(stream), 5)
        assert info.value.code == grpc.StatusCode.ABORTED and "lease expired" in info.value.details
        push.cancel()
        await asyncio.gather(push, return_exceptions=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while pair.decode.engine.load().free_blocks != 95 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert pair.decode.engine.load().free_blocks == 95, "the expired lease kept its blocks"
    run(_with_pair(folder, body))


def test_unknown_reservation_push_is_not_found(folder):
    async def body(pair):
        async def messages():
            yield node_pb2.KvPushMessage(header=node_pb2.PushHeader(
                request_id="r", reservation_id="nope",
                fingerprint=fingerprint_to_proto(pair.decode.fingerprint)))
        with pytest.raises(PushFailed) as info:
            await pair.transport.push(DECODE_ADDRESS, messages())
        assert info.value.code == grpc.StatusCode.NOT_FOUND and "nope" in info.value.message
    run(_with_pair(folder, body))


def test_tcp_data_plane_refusal_carries_the_status(folder):
    """A refusal on the raw-TCP data plane reaches the prefill caller with the decode
    node's status and message, and the reservation is released."""
    def tamper(req):
        req.block_ids[-1] = 95                      # a block not reserved for this push

    async def body(pair):
        with pytest.raises(RpcError) as info:
            await asyncio.wait_for(pair.generate("r", list(range(3, 20)),
                                                 SamplingParams(temperature=0.0),
                                                 prefill_tamper=tamper), 10)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "[95] are not reserved for this push" in info.value.details
    run(_with_pair(folder, body, tcp=True))


def test_keepalives_hold_the_lease_while_the_prefill_waits(folder):
    """A push whose header came but whose prefill is still queued sends keepalives; they
    renew the lease (300 ms here) for as long as they come, and silence still ends it."""
    async def body(pair):
        svc = pair.decode.service
        stream = svc.Decode(node_pb2.ReserveRequest(
            request_id="r", prompt_token_ids=list(range(3, 20)), lease_ms=300), FakeContext())
        res = (await anext(stream)).reservation
        receiver = pair.decode.receiver
        quiet = asyncio.Event()

        async def messages():                    # a prefill queued for 1.5 s, then silent
            yield node_pb2.KvPushMessage(header=node_pb2.PushHeader(
                request_id="r", reservation_id=res.reservation_id,
                fingerprint=res.fingerprint, block_ids=res.block_ids,
                push_token=res.push_token))
            for _ in range(15):
                await asyncio.sleep(0.1)
                yield node_pb2.KvPushMessage(keepalive=node_pb2.PushKeepalive())
            # still held after 5 leases' worth of waiting
            assert res.reservation_id in receiver.reservations
            quiet.set()
            await asyncio.Event().wait()
        push = asyncio.ensure_future(pair.transport.push(DECODE_ADDRESS, messages()))
        await quiet.wait()
        with pytest.raises(RpcError) as info:
            await asyncio.wait_for(anext(stream), 5)
        assert info.value.code == grpc.StatusCode.ABORTED and "lease expired" in info.value.details
        push.cancel()
        await asyncio.gather(push, return_exceptions=True)
        assert receiver.transitions[("released", "lease expired")] == 1
    run(_with_pair(folder, body))


def test_an_idle_sender_sends_keepalives():
    from cluster.kv_transfer.sender import PushSender

    async def body():
        sender = PushSender(asyncio.get_running_loop(), node_pb2.PushHeader(request_id="r"),
                            "float32")
        sender.keepalive_s = 0.01
        msgs = sender.messages()
        kinds = [(await anext(msgs)).WhichOneof("msg") for _ in range(4)]
        await msgs.aclose()
        return kinds
    assert run(body()) == ["header", "keepalive", "keepalive", "keepalive"]


def test_keepalives_fit_the_granted_lease():
    """The router passes the lease the decode node granted (which may be capped far below
    what it asked); the sender keeps it alive four times per lease, at most every 2 s."""
    from cluster.kv_transfer.sender import KEEPALIVE_S, PushSender, keepalive_interval

    assert keepalive_interval(0) == KEEPALIVE_S           # an older router: not told
    assert keepalive_interval(30_000) == KEEPALIVE_S
    assert keepalive_interval(1_000) == pytest.approx(0.25)
    assert keepalive_interval(1) == pytest.approx(0.05)   # floor: no busy loop

    async def made():
        return PushSender(asyncio.get_running_loop(), node_pb2.PushHeader(request_id="r"),
                          "float32", lease_ms=400).keepalive_s
    assert run(made()) == pytest.approx(0.1)
