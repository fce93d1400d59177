"""PD PUSH with MTP on: the prefill node runs the draft over the prompt and pushes the
draft layer's KV and the last target hidden state (PushDone.mtp); the decode node installs
them, so its draft proposes from the first decode step, exactly as after a local prefill.
Greedy tokens equal the single-node plain LLM; the decode node's speculative counters
equal a single-node MTP LLM's; block pools return to their starting counts."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from tests.pd_harness import PdPair, RpcError
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp

OPTS = dict(dtype="float32", block_size=4, num_gpu_blocks=96, max_num_seqs=8)
MTP = dict(OPTS, speculative_method="mtp", num_speculative_tokens=2)
MAX_NEW = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base, _ = make_tiny_model("qwen3-qknorm-hd24", root)
    return with_mtp(base, root / "qwen3-mtp")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, [3, 6, 9, 17], 320, seed=5)


@pytest.fixture(scope="module")
def plain(folder, prompts):
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = LLM(folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].token_ids for o in outs]


def _params():
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def record_proposals(engine) -> dict[tuple[int, ...], torch.Tensor]:
    """Wrap the engine's MTP propose: {sequence tokens when drafting: draft probabilities
    [k, V]}. The probabilities depend on the draft's KV of the whole prompt and on the
    hidden state it starts from, so equal probabilities mean the same draft state."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    worker = engine.speculative
    real = worker.propose

    def propose(seqs, num_drafts):
        drafts, probs = real(seqs, num_drafts)
        for i, (seq, k) in enumerate(zip(seqs, num_drafts, strict=True)):
            if k:
                seen[tuple(seq.token_ids)] = probs[i, :k].clone()
        return drafts, probs
    worker.propose = propose
    return seen


def _single_node_mtp(folder, prompts) -> tuple[dict, dict]:
    """A single-node MTP engine, one request at a time (as the PD test sends them):
    (stats, proposals)."""
    llm = LLM(folder, **MTP)
    seen = record_proposals(llm.engine)
    for p in prompts:
        llm.generate([{"prompt_token_ids": p}], _params())
    return llm.stats(), seen


def _pd(folder, prompts, concurrent: bool, drop_payload: bool = False,
        decode_opts=MTP, prefill_opts=MTP, tcp: bool = False):
    """(tokens per prompt, decode node stats, decode node's draft proposals)."""
    async def main():
        pair = PdPair(folder, prefill_opts, decode_opts, tcp=tcp)
        if drop_payload:      # a prefill node that sends no MTP payload
            pair.prefill.engine.connector.mtp.take = lambda seq, src: None
        seen = record_proposals(pair.decode.engine) \
            if decode_opts.get("speculative_method") else {}
        pair.start()
        start = pair.free_blocks()
        try:
            if concurrent:
                outs = await asyncio.gather(*[pair.generate(f"r{i}", p, _params())
                                              for i, p in enumerate(prompts)])
            else:
                outs = [await pair.generate(f"r{i}", p, _params())
                        for i, p in enumerate(prompts)]
            stats = pair.decode.engine.stats()
        finally:
            await pair.stop()
        assert pair.free_blocks() == start, "block pools must return to their starting counts"
        assert not pair.decode.receiver.reservations
        return [o[0] for o in outs], stats, seen
    return asyncio.run(main())


def test_payload_lets_the_decode_draft_start_at_the_first_step(folder, prompts, plain):
    _same_drafts_as_one_node(folder, prompts, plain)


def test_a_head_reading_mid_layers_drafts_the_same_after_a_push(tmp_path_factory, prompts):
    """The payload's hidden state is the draft's input (final hidden + the projected aux
    layers' residual streams), so the decode node drafts as a single node does."""
    root = tmp_path_factory.mktemp("aux")
    base, _ = make_tiny_model("qwen3-qknorm-hd24", root)
    folder = with_mtp(base, root / "qwen3-aux", aux_layers=(0,))
    outs = LLM(folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], _params())
    _same_drafts_as_one_node(folder, prompts, [o.outputs[0].token_ids for o in outs])


def test_deepseeks_own_mtp_layer_drafts_the_same_after_a_push(tmp_path_factory, prompts):
    """DeepSeek-V3 (MLA + DeepSeekMoE) with its own MTP layer: the payload carries the
    draft layer's latent rows (K alone) and the hidden state, so the decode node drafts
    as a single node does."""
    root = tmp_path_factory.mktemp("deepseek")
    base, _ = make_tiny_model("deepseek-v3-mla", root)
    folder = with_mtp(base, root / "deepseek-v3-mtp")
    outs = LLM(folder, **OPTS).generate([{"prompt_token_ids": p} for p in prompts], _params())
    _same_drafts_as_one_node(folder, prompts, [o.outputs[0].token_ids for o in outs])


def _same_drafts_as_one_node(folder, prompts, plain) -> None:
    """PD tokens equal plain greedy, and the decode node's drafts (counts and
    probabilities, from each request's first decode step) equal a single node's."""
    tokens, stats, seen = _pd(folder, prompts, concurrent=False)
    assert tokens == plain
    want, want_seen = _single_node_mtp(folder, prompts)
    # drafts proposed from the same steps, accepted the same way as single-node MTP ...
    for key in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert stats[key] == want[key], f"{key}: PD {stats[key]} != single node {want[key]}"
    # ... from the same draft state: the same draft probabilities at every step,
    # including each request's first decode step (prompt + first token)
    assert seen.keys() == want_seen.keys()
    for p, first in zip(prompts, plain, strict=True):
        assert tuple(p) + (first[0],) in seen, "the first decode step must draft"
    for ctx, probs in want_seen.items():
        torch.testing.assert_close(seen[ctx], probs, rtol=0, atol=1e-6,
                                   msg=lambda m, ctx=ctx: f"after {len(ctx)} tokens: {m}")


def test_without_payload_the_draft_starts_one_step_later(folder, prompts, plain):
    tokens, stats, seen = _pd(folder, prompts, concurrent=False, drop_payload=True)
    assert tokens == plain
    with_payload = _single_node_mtp(folder, prompts)[0]["spec_num_drafts"]
    assert not any(tuple(p) + (first[0],) in seen for p, first in zip(prompts, plain,
                                                                        strict=True))
    # the first decode step of each request cannot draft (no hidden state to draft from)
    assert stats["spec_num_drafts"] == with_payload - len(prompts)


@pytest.mark.parametrize("tcp", [False, True], ids=["inproc", "tcp-data-plane"])
def test_concurrent_pd_with_mtp_equals_plain_greedy(folder, prompts, plain, tcp):
    tokens, stats, seen = _pd(folder, prompts, concurrent=True, tcp=tcp)
    assert tokens == plain
    assert stats["spec_num_drafts"] > 0
    for p, first in zip(prompts, plain, strict=True):
        assert tuple(p) + (first[0],) in seen, "the first decode step must draft"


def test_mtp_config_is_part_of_the_fingerprint(folder, prompts):
    with pytest.raises(RpcError) as info:
        _pd(folder, prompts[:1], concurrent=False, prefill_opts=OPTS)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "mtp_enabled: True here, False there" in info.value.details or \
        "mtp_enabled: False here, True there" in info.value.details


def test_malformed_payload_is_refused_naming_what_is_wrong(folder):
    from cluster.kv_transfer.kv_receiver import PushRejected
    from cluster.kv_transfer.mtp_payload import handoff_from_proto, handoff_to_proto
    from engine.config import EngineConfig
    from engine.engine_core import LLMEngine
    from engine.pd_mtp import MtpHandoff, check_handoff

    eng = LLMEngine(EngineConfig(model=str(folder), **MTP))
    block = eng.speculative.draft_executor.kv_cache.block_shape
    h = eng.model_config.hidden_size
    good = MtpHandoff(torch.randn(1, h), torch.randn(2, *block), torch.randn(2, *block))
    msg = handoff_to_proto(good, [5, 6])
    back = handoff_from_proto(msg, [5, 6])
    assert torch.equal(back.hidden, good.hidden) and torch.equal(back.draft_v, good.draft_v)
    assert check_handoff(eng, back, 2) is None
    with pytest.raises(PushRejected, match=r"names blocks \[5, 6\], the push fills \[5, 7\]"):
        handoff_from_proto(msg, [5, 7])
    msg.last_hidden_state = msg.last_hidden_state[:-4]
    with pytest.raises(PushRejected, match="hidden state: .* bytes for shape"):
        handoff_from_proto(msg, [5, 6])
    assert f"expected [1, {h}]" in check_handoff(
        eng, MtpHandoff(torch.randn(1, h + 1), good.draft_k, good.draft_v), 2)
    assert "MTP draft K has shape" in check_handoff(eng, good, 3)
