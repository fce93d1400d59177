"""A prefill node on shared cores keeps its turn until its step's pushes delivered their KV
(cluster/kv_transfer/handoff.py), and a step's layers leave as a few layer-run chunks
(codec.step_chunk_parts) instead of two chunks per layer."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core_share import CoreShare
from cluster.engine_loop import EngineLoop
from cluster.kv_transfer.codec import step_chunk_parts
from cluster.kv_transfer.handoff import TurnHandoffs
from cluster.kv_transfer.sender import PushSender
from protos import node_pb2

WAIT_S = 30.0


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


async def _until_async(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.001)


# ---- TurnHandoffs ---------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40))
def test_open_count_is_what_was_opened_and_not_yet_closed(ops):
    """Any interleaving of opens and (repeated) closes: each closer counts once."""
    h = TurnHandoffs()
    closers, closed = [], set()
    for is_open, pick in ops:
        if is_open or not closers:
            closers.append(h.open())
        else:
            i = pick % len(closers)
            closers[i]()
            closed.add(i)
        assert h.open_count == len(closers) - len(closed)
    assert h.wait(0) is (len(closers) == len(closed))


def test_wait_returns_when_the_last_delivery_closes_and_gives_up_after_the_timeout():
    h = TurnHandoffs()
    close = h.open()
    assert h.wait(0.01) is False and h.timeouts == 1     # nobody closes it: bounded wait
    threading.Timer(0.05, close).start()
    assert h.wait(WAIT_S) is True and h.timeouts == 1


# ---- the sender opens and closes them -------------------------------------------------

def _step(sender: PushSender, layers: int, blocks: list[int]) -> None:
    for i in range(layers):
        k = torch.full((len(blocks), 4, 2, 8), float(i))
        sender.on_layer(i, blocks, k, -k, None)
    sender.on_step_end()


def test_a_step_is_outstanding_until_taken_and_the_last_until_the_push_ends():
    async def body():
        h = TurnHandoffs()
        sender = PushSender(asyncio.get_running_loop(), node_pb2.PushHeader(request_id="r"),
                            "float32", per_layer=False, handoffs=h)
        sender.keepalive_s = 0.05
        msgs = sender.messages()
        assert (await anext(msgs)).WhichOneof("msg") == "header"
        _step(sender, 3, [7, 8])                 # a chunked prefill's first step
        assert h.open_count == 1
        chunk = await anext(msgs)
        # three small layers of the same blocks: one K-and-V run, not six chunks
        assert chunk.chunk.kind == node_pb2.KV_KIND_KEY_VALUE and chunk.chunk.num_layers == 3
        assert h.open_count == 1                 # the transport has not asked past it yet
        nxt = asyncio.ensure_future(anext(msgs))
        await _until_async(lambda: h.open_count == 0, "the step counts as taken")
        _step(sender, 3, [9])                    # the prompt's last step, then its token
        sender.on_first_token(5, None)
        assert h.open_count == 2
        assert (await nxt).WhichOneof("msg") == "chunk"
        assert (await anext(msgs)).WhichOneof("msg") == "done"
        nxt = asyncio.ensure_future(anext(msgs, None))   # the transport asks past `done`
        await _until_async(lambda: h.open_count == 1, "the last step counts as taken")
        assert await nxt is None                 # the stream ended
        sender.end()                             # the decode node answered
        assert h.open_count == 0 and h.wait(0)
    asyncio.run(body())


def test_a_per_layer_sender_leaves_the_turn_alone():
    async def body():
        h = TurnHandoffs()
        sender = PushSender(asyncio.get_running_loop(), node_pb2.PushHeader(request_id="r"),
                            "float32", per_layer=True, handoffs=h)
        _step(sender, 2, [1])
        sender.on_first_token(5, None)
        return h.open_count
    assert asyncio.run(body()) == 0


# ---- layer runs -----------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 6), blocks=st.integers(1, 4),
       budget_blocks=st.integers(1, 30))
def test_layer_runs_carry_each_layer_k_and_v_exactly_once(layers, blocks, budget_blocks):
    """Whatever the chunk budget: every (layer, K/V, block) is in exactly one chunk, with
    its own values, and no chunk is over the budget unless one block of one kind is."""
    block = (4, 2, 3)
    per_block = 4 * 2 * 3 * 4                            # float32 bytes of one block
    max_bytes = budget_blocks * per_block
    ids = list(range(100, 100 + blocks))
    kv = [(i, torch.randn(blocks, *block), torch.randn(blocks, *block)) for i in range(layers)]
    seen: dict[tuple[int, int, int], torch.Tensor] = {}
    for meta, tensors in step_chunk_parts(kv, ids, "float32", max_bytes):
        data = torch.cat([t.reshape(-1) for t in tensors])
        nbytes = data.numel() * 4
        assert nbytes <= max(max_bytes, per_block)
        shape = list(meta.shape)
        if meta.kind == node_pb2.KV_KIND_KEY_VALUE:
            run = data.view(shape)                        # [num_layers, 2, n, *block]
            assert shape[:3] == [meta.num_layers, 2, len(meta.block_ids)]
            for j in range(meta.num_layers):
                for kind in (0, 1):
                    for b, bid in enumerate(meta.block_ids):
                        key = (meta.layer + j, kind, bid)
                        assert key not in seen
                        seen[key] = run[j, kind, b]
        else:
            part = data.view(shape)                       # [n, *block]
            for b, bid in enumerate(meta.block_ids):
                key = (meta.layer, int(meta.kind), bid)
                assert key not in seen
                seen[key] = part[b]
    assert len(seen) == layers * 2 * blocks
    for i, k, v in kv:
        for b, bid in enumerate(ids):
            assert torch.equal(seen[(i, 0, bid)], k[b])
            assert torch.equal(seen[(i, 1, bid)], v[b])


# ---- the engine loop keeps the turn for them ------------------------------------------

class _Inbox:
    def attach(self, wake):
        self.wake = wake


class _Engine:
    def __init__(self, steps: int):
        self.inbox, self.left = _Inbox(), steps

    def run_once(self):
        if self.left:
            self.left -= 1
            return ["token"]
        return []

    def has_work(self) -> bool:
        return self.left > 0

    def settle(self):
        return []


def test_the_loop_releases_its_turn_only_after_the_step_was_delivered(tmp_path):
    lock = tmp_path / "cores.lock"
    handoffs = TurnHandoffs()
    delivered = threading.Event()
    order: list[str] = []

    def before_release():
        close = handoffs.open()                          # what the step handed its pushes
        threading.Timer(0.05, lambda: (order.append("delivered"), close())).start()
        handoffs.wait(WAIT_S)
        order.append("released")
        delivered.set()

    gate = CoreShare(lock, handoff_max_s=WAIT_S)
    loop = EngineLoop(_Engine(steps=1), step_gate=gate, before_release=before_release).start()
    other = CoreShare(lock, handoff_max_s=WAIT_S)
    try:
        _until(delivered.is_set, "the step's pushes were delivered")
        other.request(lambda: None)
        _until(lambda: other.held, "the other node gets the turn")
        assert order == ["delivered", "released"]
    finally:
        loop.stop()
        other.close()


def test_a_failing_epilogue_neither_keeps_the_turn_nor_stops_the_loop(tmp_path):
    lock = tmp_path / "cores.lock"
    calls = []

    def before_release():
        calls.append(1)
        raise RuntimeError("boom")

    engine = _Engine(steps=2)
    gate = CoreShare(lock, handoff_max_s=WAIT_S)
    loop = EngineLoop(engine, step_gate=gate, before_release=before_release).start()
    other = CoreShare(lock, handoff_max_s=WAIT_S)
    try:
        _until(lambda: engine.left == 0 and len(calls) == 2, "both steps ran")
        assert loop.alive
        other.request(lambda: None)
        _until(lambda: other.held, "the turn was given back")
    finally:
        loop.stop()
        other.close()
