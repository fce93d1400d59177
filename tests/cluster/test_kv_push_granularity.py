"""When a prefill's KV leaves the engine: per layer, or a step's layers together.

The connector hands each layer to the sink as the forward writes it and then tells it the
step is over (`on_step_end`); a PushSender made with `per_layer=False` holds the layers
until then, so the event loop and the sending threads wake once per step instead of once
per layer (prefill_node/node.py says why that matters on a CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.kv_transfer.sender import PushSender
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.pd_prefill import KvPushConnector, push_request
from engine.sampling_params import SamplingParams
from protos import node_pb2
from tests.tiny_models import make_tiny_model


class RecordingSink:
    def __init__(self):
        self.events: list[tuple] = []

    def on_layer(self, layer, dst_block_ids, k, v, ready):
        self.events.append(("layer", layer, tuple(dst_block_ids)))

    def on_step_end(self):
        self.events.append(("end",))

    def on_first_token(self, token_id, logprob, mtp=None):
        self.events.append(("token",))

    def on_error(self, exc):
        self.events.append(("error", str(exc)))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("qwen3-qknorm-hd24", tmp_path_factory.mktemp("models"))[0]


def test_each_step_ends_after_its_layers_and_before_the_token(folder):
    # a 13-token prompt in 8-token chunks: two steps, blocks of 4 -> 2 blocks complete in
    # the first step, the other 2 (the last one partial) in the second
    cfg = EngineConfig(model=str(folder), dtype="float32", block_size=4, num_gpu_blocks=32,
                       max_num_batched_tokens=8, max_num_seqs=4)
    eng = LLMEngine(cfg, connector=KvPushConnector)
    sink = RecordingSink()
    prompt = list(range(5, 18))
    eng.submit(push_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0),
                            [40, 41, 42, 43], 0, sink, cfg.block_size))
    while eng.has_work():
        eng.run_once()
    layers = len(eng.model.layers)
    step1 = [("layer", i, (40, 41)) for i in range(layers)]
    step2 = [("layer", i, (42, 43)) for i in range(layers)]
    assert sink.events == [*step1, ("end",), *step2, ("end",), ("token",)]


def _layer(sender: PushSender, i: int) -> None:
    k = torch.full((1, 4, 2, 8), float(i))
    sender.on_layer(i, [10 + i], k, k.clone(), None)


async def _next(msgs) -> str:
    return (await asyncio.wait_for(anext(msgs), 5)).WhichOneof("msg")


@pytest.mark.parametrize("per_layer", [False, True])
def test_a_step_sender_holds_layers_until_the_step_ends(per_layer):
    async def body():
        sender = PushSender(asyncio.get_running_loop(), node_pb2.PushHeader(request_id="r"),
                            "float32", per_layer=per_layer)
        sender.keepalive_s = 0.05
        msgs = sender.messages()
        assert await _next(msgs) == "header"
        for i in range(3):
            _layer(sender, i)
        seen = [await _next(msgs)]            # before the step ends
        sender.on_step_end()
        while len([m for m in seen if m == "chunk"]) < 6:   # K and V of 3 layers
            seen.append(await _next(msgs))
        await msgs.aclose()
        return seen, sender.blocks_pushed
    seen, pushed = asyncio.run(body())
    if per_layer:
        assert seen[0] == "chunk"             # the first layer left at once
    else:
        assert seen[0] == "keepalive"         # nothing left before the step's end
    assert pushed == {10, 11, 12}
