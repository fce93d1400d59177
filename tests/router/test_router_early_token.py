"""The router streams the prefill node's first token as soon as the Prefill stream carries
it (before the KV push ends and the decode node's stream starts), and drops the decode
node's repeat of it: no token is lost or doubled, and a repeat that differs fails the
decode node. Over real gRPC against scripted nodes (tests/router/pd_fakes.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.sampling_params import SamplingParams
from router.backend import NodeRequest
from router.errors import NoNodeAvailable
from tests.router.pd_fakes import PROMPT, Shared, _cluster, _expected, _run


@contextlib.asynccontextmanager
async def _pair(shared: Shared, prefill: dict):
    """One scripted prefill + decode pair behind a PdBackend, stopped even when the test
    fails (a server left running keeps pytest from exiting)."""
    pool, backend, servers = await _cluster(shared, [{}], [prefill])
    try:
        yield backend
    finally:
        for server in servers:
            await server.stop(None)
        await backend.close()


def test_the_first_token_reaches_the_client_before_the_push_ends_and_once():
    async def main():
        shared = Shared()
        shared.push_gate = asyncio.Event()        # the push ends only when opened below
        steps = []
        async with _pair(shared, {"early": True}) as backend:
            async for step in backend.generate(NodeRequest("r1", PROMPT,
                                                           SamplingParams(max_tokens=6))):
                if not steps:
                    # the decode node's stream cannot have started: the push is still held
                    assert not shared.event("r1").is_set()
                    shared.push_gate.set()
                steps.append(step)
        return steps

    steps = _run(main())
    assert steps[0].token_ids == _expected(PROMPT, 1)
    assert [t for s in steps for t in s.token_ids] == _expected(PROMPT, 6)
    assert steps[-1].finish_reason == "length"


def test_a_decode_stream_whose_first_token_is_not_the_streamed_one_fails_that_node():
    async def main():
        shared = Shared()
        # the decode stream starts once the early token is out (else its first event may
        # come first, and the router rightly ignores a late early token)
        shared.push_gate = asyncio.Event()
        tokens = []
        async with _pair(shared, {"early_token": 999}) as backend:
            backend.queue_timeout_s = 0.3     # the only decode node is dropped: give up soon
            with pytest.raises(NoNodeAvailable):
                async for step in backend.generate(NodeRequest(
                        "r1", PROMPT, SamplingParams(max_tokens=6))):
                    tokens.extend(step.token_ids)
                    shared.push_gate.set()
            failures = backend.metrics.node_failures.labels("decode")._value.get()
        return tokens, failures

    tokens, failures = _run(main())
    assert tokens == [999], "nothing of the mismatched stream may reach the client"
    assert failures == 1


def test_a_first_token_that_comes_after_the_decode_streams_is_not_sent_again():
    async def main():
        shared = Shared()
        tokens = []
        async with _pair(shared, {"early_late": True}) as backend:
            # 30 tokens, one per 10 ms: the late FirstToken (100 ms) comes mid-stream
            async for step in backend.generate(NodeRequest("r1", PROMPT,
                                                           SamplingParams(max_tokens=30))):
                tokens.extend(step.token_ids)
        return tokens

    assert _run(main()) == _expected(PROMPT, 30)
