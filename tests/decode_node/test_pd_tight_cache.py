"""A decode node whose KV cache holds a small part of the offered load: requests it
reserved blocks for wait while others decode, the scheduler preempts and recomputes, and
every request still gets all its tokens, equal to the single-node run's.

Found through the router (tests/fault/test_queue_500.py): the engine finished a preempted
request with "length" when reservations, not running requests, held the blocks it needed
to resume, so its stream ended short. Blocks held outside the scheduler come back; only a
request larger than the whole pool may be finished that way."""

from __future__ import annotations

import asyncio

import grpc

from engine import LLM, SamplingParams
from tests.pd_harness import PdPair, RpcError
from tests.tiny_models import make_tiny_model, random_prompts

N = 160
DECODE = dict(dtype="float32", block_size=4, num_gpu_blocks=48)
PREFILL = dict(DECODE, num_gpu_blocks=512)


def test_tight_decode_cache_loses_no_token(tmp_path):
    folder = make_tiny_model("qwen2-gqa4", tmp_path)[0]
    prompts = random_prompts(N, [5, 9, 14], 320, seed=5)
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0.0) for i in range(N)]
    want = [o.outputs[0].token_ids for o in LLM(folder, **PREFILL).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]

    async def main():
        pair = PdPair(folder, PREFILL, DECODE)
        pair.start()

        async def one(i: int):
            while True:          # the router's admission queue, in short
                try:
                    return await pair.generate(f"r{i}", prompts[i], params[i])
                except RpcError as exc:
                    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    await asyncio.sleep(0.02)
        try:
            return await asyncio.gather(*[one(i) for i in range(N)]), \
                pair.decode.engine.stats()["preemptions"]
        finally:
            await pair.stop()

    outs, preemptions = asyncio.run(main())
    short = [(i, out[0], out[2], want[i]) for i, out in enumerate(outs) if out[0] != want[i]]
    assert not short, f"{len(short)} of {N} differ, e.g. {short[:3]}"
    assert preemptions > 0, "the cache was not tight: nothing was preempted"
