"""A PD decode node's pushed prompt is a scheduler state (WAITING_FOR_KV): the sequence owns
its blocks, counts against max_num_seqs, is never scheduled, joins the running batch with
its first token on admission, gives its blocks back on release, and a waiting request that
needs its blocks stalls the engine (no busy loop) until a push lands or a release."""

from __future__ import annotations

import pytest

from engine.commands import (
    AbortRequest,
    AdmitPrefilled,
    CapacityError,
    ReleaseRequest,
    ReserveForKv,
)
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.tiny_models import make_tiny_model, random_prompts

BS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-tied-gqa", tmp_path_factory.mktemp("models"))[0]


def _engine(folder, **kw) -> LLMEngine:
    opts = dict(dtype="float32", block_size=BS, num_gpu_blocks=12, max_num_seqs=3) | kw
    return LLMEngine(EngineConfig(model=str(folder), **opts))


def _reserve(eng, rid, prompt):
    return eng.submit(ReserveForKv(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                               ignore_eos=True))).result()


def test_a_reserved_sequence_owns_its_blocks_and_is_never_scheduled(folder):
    eng = _engine(folder)
    free = eng.block_manager.num_free_blocks
    p = random_prompts(1, [9], 320, seed=1)[0]
    seq = _reserve(eng, "r", p)
    assert seq.status is SequenceStatus.WAITING_FOR_KV
    assert eng.scheduler.awaiting_kv == {seq.seq_id: seq}
    assert eng.block_manager.num_free_blocks == free - 3 and len(seq.block_table) == 3
    assert not eng.has_unfinished() and eng.step() == []       # nothing to compute
    eng.submit(AbortRequest("r")).result()                      # only its owner ends it
    assert seq.status is SequenceStatus.WAITING_FOR_KV
    eng.submit(AdmitPrefilled(seq, 7)).result()
    assert seq.status is SequenceStatus.RUNNING and seq.output_token_ids == [7]
    assert seq.num_cached_tokens == len(p) and not eng.scheduler.awaiting_kv
    while eng.has_unfinished():
        eng.step()
    assert seq.num_output_tokens == 3 and eng.block_manager.num_free_blocks == free


def test_release_gives_the_blocks_back_and_admission_then_fails(folder):
    eng = _engine(folder)
    free = eng.block_manager.num_free_blocks
    seq = _reserve(eng, "r", random_prompts(1, [6], 320, seed=2)[0])
    eng.submit(ReleaseRequest("r")).result()
    assert eng.block_manager.num_free_blocks == free and not eng.scheduler.awaiting_kv
    assert "r" not in eng.requests
    with pytest.raises(ValueError, match="no longer reserved"):
        eng.submit(AdmitPrefilled(seq, 7)).result()


def test_reservations_count_against_max_num_seqs_and_the_pool(folder):
    eng = _engine(folder)
    for i in range(3):
        _reserve(eng, f"r{i}", random_prompts(1, [3], 320, seed=10 + i)[0])
    with pytest.raises(CapacityError, match="3 awaiting their KV of max_num_seqs 3"):
        _reserve(eng, "r3", [5, 6])
    eng.submit(ReleaseRequest("r0")).result()
    with pytest.raises(CapacityError, match="free KV blocks"):
        _reserve(eng, "big", random_prompts(1, [40], 320, seed=3)[0])
    with pytest.raises(ValueError, match="already in use"):
        _reserve(eng, "r1", [5, 6])


def test_a_waiting_request_that_needs_reserved_blocks_stalls_until_a_release(folder):
    eng = _engine(folder, num_gpu_blocks=8, max_num_seqs=4)     # 7 usable blocks
    held = _reserve(eng, "held", random_prompts(1, [20], 320, seed=4)[0])     # 5 blocks
    local = eng.add_request("local", random_prompts(1, [12], 320, seed=5)[0],
                            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert eng.step() == []
    assert eng.scheduler.stalled_on_kv and not eng.has_work()   # the loop may sleep
    eng.submit(ReleaseRequest("held")).result()
    assert eng.has_work() and held.status is SequenceStatus.FINISHED
    while eng.has_unfinished():
        eng.step()
    assert local.num_output_tokens == 2
