"""MTP speculative decoding on random-weight tiny models: greedy tokens identical to plain
decoding for every sequence (random draft: low acceptance; oracle draft: full acceptance),
both checkpoint layouts and a separate draft folder, penalties, mixed greedy/random,
max_tokens, exact block accounting, and the EmbeddingCache after accept and reject."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_model
from engine.speculative.mtp_worker import MTPWorker
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import draft_folder, with_mtp

MAX_NEW = 40


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp")


def _model(root, name: str, layout: str = "deepseek"):
    folder, _ = make_tiny_model(name, root)
    return with_mtp(folder, root / f"{name}-mtp-{layout}", layout)


def _prompts(n=6, seed=0):
    return [{"prompt_token_ids": p} for p in random_prompts(n, [3, 9, 17, 30], 320, seed)]


def _run(folder, prompts, params, **opts):
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=64, **opts)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-hd24", "deepseek-v3-mla"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_with_random_draft(root, name, k):
    folder = _model(root, name)
    prompts = _prompts()
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    plain, _ = _run(folder, prompts, sp)
    spec, llm = _run(folder, prompts, sp, speculative_method="mtp", num_speculative_tokens=k)
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b == a, f"sequence {i} differs with MTP k={k}"
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0
    assert len(stats["spec_acceptance_rate_per_position"]) == k
    assert stats["generated_tokens"] == len(prompts) * MAX_NEW


@pytest.mark.parametrize("layout", ["mimo", "separate"])
def test_other_layouts_load_and_stay_exact(root, layout):
    base, _ = make_tiny_model("llama-untied-hd32-llama3rope", root)
    prompts = _prompts(4, seed=3)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = _run(base, prompts, sp)
    if layout == "mimo":
        folder, opts = _model(root, "llama-untied-hd32-llama3rope", "mimo"), {}
    else:
        folder = base
        opts = {"speculative_model": str(draft_folder(base, root / "draft-only"))}
    spec, _ = _run(folder, prompts, sp, speculative_method="mtp", num_speculative_tokens=2,
                   **opts)
    assert spec == plain


def test_folder_without_mtp_is_a_clear_error(root):
    base, _ = make_tiny_model("qwen2-gqa4", root)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(base, dtype="float32", speculative_method="mtp")
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(base, dtype="float32", speculative_method="eagle9")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(base, dtype="float32", speculative_method="mtp", num_speculative_tokens=0)


def test_plain_loader_ignores_mtp_weights(root):
    folder = _model(root, "llama-tied-gqa")
    base, _ = make_tiny_model("llama-tied-gqa", root)
    a, _ = load_model(folder, torch.float32, torch.device("cpu"))
    b, _ = load_model(base, torch.float32, torch.device("cpu"))
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_penalties_and_mixed_greedy_random_batch(root):
    folder = _model(root, "qwen2-gqa4")
    prompts = _prompts(6, seed=7)
    greedy_pen = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                repetition_penalty=1.3, frequency_penalty=0.4)
    rand = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, ignore_eos=True, seed=11)
    params = [greedy_pen if i % 2 == 0 else rand for i in range(len(prompts))]
    plain, _ = _run(folder, prompts, params)
    spec, _ = _run(folder, prompts, params, speculative_method="mtp", num_speculative_tokens=3)
    for i in range(0, len(prompts), 2):
        assert spec[i] == plain[i], f"greedy+penalties sequence {i} differs"
    for i in range(1, len(prompts), 2):
        assert len(spec[i]) == 30 and all(0 <= t < 320 for t in spec[i])


def test_max_tokens_and_max_model_len_respected(root):
    folder = _model(root, "llama-tied-gqa")
    prompts = _prompts(4, seed=9)               # 3, 9, 17 and 30 tokens
    budgets, limit = (1, 2, 5, 7), 35
    sp = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in budgets]
    plain, _ = _run(folder, prompts, sp, max_model_len=limit)
    spec, _ = _run(folder, prompts, sp, max_model_len=limit, speculative_method="mtp",
                   num_speculative_tokens=3)
    assert spec == plain
    want = [min(m, limit - len(p["prompt_token_ids"]))
            for m, p in zip(budgets, prompts, strict=True)]
    assert want != list(budgets)        # the model's length, not max_tokens, ends the last
    assert [len(s) for s in spec] == want


# ---- oracle drafts: full and zero acceptance, controlled -----------------------------------
class ScriptedDraft:
    """Replace the MTP's proposals with given continuations (one-hot probabilities)."""

    def __init__(self, worker: MTPWorker, continuations: dict[int, list[int]], wrong: bool):
        self.worker, self.cont, self.wrong = worker, continuations, wrong
        self.real = worker.propose

    def __call__(self, seqs, num_drafts):
        self.real(seqs, num_drafts)     # keep the draft KV / cache path exercised
        drafts = []
        for s, k in zip(seqs, num_drafts, strict=True):
            nxt = self.cont[s.seq_id][s.num_output_tokens:s.num_output_tokens + k]
            drafts.append([(t + 1) % 320 if self.wrong else t for t in nxt])
        kmax = max(num_drafts)
        probs = torch.zeros(len(seqs), kmax, 320)
        for i, d in enumerate(drafts):
            for j, t in enumerate(d):
                probs[i, j, t] = 1.0
        return drafts, probs


def _engine_run(folder, prompts, k, script=None, wrong=False, steps_check=None, blocks=256):
    llm = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks=blocks,
              speculative_method="mtp" if k else None, num_speculative_tokens=max(k, 1))
    eng = llm.engine
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    if script is not None:
        cont = {s.seq_id: script[i] for i, s in enumerate(seqs)}
        eng.speculative.propose = ScriptedDraft(eng.speculative, cont, wrong)
    while eng.has_unfinished():
        eng.step()
        if steps_check is not None:
            steps_check(eng)
    return [s.output_token_ids for s in seqs], eng


def _check_blocks(eng):
    bm = eng.block_manager
    refs = [0] * bm.num_blocks
    for s in (s for s in eng.requests.values() if not s.is_finished):  # waiting: no blocks
        assert len(s.block_table) == bm.blocks_needed(s.num_cached_tokens), s
        for b in s.block_table:
            refs[b] += 1
    for b in range(1, bm.num_blocks):
        assert bm.blocks[b].ref_count == refs[b], f"block {b}"
        assert (bm.blocks[b].ref_count == 0) == (b in bm.free_queue)


@pytest.mark.parametrize("wrong", [False, True])
@pytest.mark.parametrize("blocks", [256, 40])
def test_block_accounting_equals_plain_run(root, wrong, blocks):
    folder = _model(root, "llama-tied-gqa")
    prompts = [p["prompt_token_ids"] for p in _prompts(5, seed=4)]
    plain, eng0 = _engine_run(folder, prompts, 0, blocks=blocks)
    spec, eng1 = _engine_run(folder, prompts, 3, script=plain, wrong=wrong,
                             steps_check=_check_blocks, blocks=blocks)
    assert spec == plain
    stats = eng1.speculative.stats()
    if wrong:
        assert stats["spec_num_accepted_tokens"] == 0
    else:
        assert stats["spec_acceptance_length"] > 3.0      # all accepted but the last ones
    bm0, bm1 = eng0.block_manager, eng1.block_manager
    assert bm1.num_free_blocks == bm0.num_free_blocks == bm0.num_blocks - 1
    assert [b.ref_count for b in bm1.blocks] == [b.ref_count for b in bm0.blocks]
    assert len(eng1.speculative.embedding_cache) == 0
    if blocks == 40:        # a tight pool: both runs preempt, lookahead may evict more
        assert eng0.scheduler.num_preemptions > 0
    else:
        assert set(bm1.hash_to_block) == set(bm0.hash_to_block)


@pytest.mark.parametrize("wrong", [False, True])
def test_embedding_cache_after_accept_and_reject(root, wrong):
    folder = _model(root, "qwen3-qknorm-hd24")
    prompt = random_prompts(1, [11], 320, seed=2)[0]
    plain, _ = _engine_run(folder, [prompt], 0)
    llm = LLM(folder, dtype="float32", block_size=4, speculative_method="mtp",
              num_speculative_tokens=3)
    eng = llm.engine
    seq = eng.add_request("r", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                      ignore_eos=True))
    eng.speculative.propose = ScriptedDraft(eng.speculative, {seq.seq_id: plain[0]}, wrong)
    cache = eng.speculative.embedding_cache
    ref_model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    reference = LLM(folder, dtype="float32", block_size=4).engine

    def target_hidden(tokens: list[int]) -> torch.Tensor:
        return _full_hidden(reference, ref_model, tokens)

    eng.step()                                        # prefill
    entry = cache.get(seq.seq_id)
    assert entry.start == len(prompt) - 1 and entry.num_rows == 1
    torch.testing.assert_close(entry.hidden, target_hidden(prompt)[-1:], rtol=1e-4,
                               atol=1e-4)
    for _ in range(3):                                # decode steps
        before = len(seq)
        eng.step()
        entry = cache.get(seq.seq_id)
        accepted = len(seq) - before - 1
        assert accepted == (0 if wrong else 3)
        assert entry.start == before - 1 and entry.num_rows == accepted + 1
        full = target_hidden(seq.token_ids[:-1])
        torch.testing.assert_close(entry.hidden, full[before - 1:], rtol=1e-4, atol=1e-4)
    assert seq.output_token_ids == plain[0][:seq.num_output_tokens]


def _full_hidden(engine, model, tokens: list[int]) -> torch.Tensor:
    """The target's hidden states over `tokens` via one plain prefill."""
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence
    s = Sequence(tokens, SamplingParams(max_tokens=1))
    assert engine.block_manager.allocate(s)
    fi = engine.builder.build_forward_input(SchedulerOutput([s], [len(tokens)]))
    with torch.inference_mode():
        h = engine.worker.executor.forward(fi)
    engine.block_manager.free(s)
    return h


# ---- the scheduler side, with hand-made step results -------------------------------------
def _decode_step(sch, seq, tokens, accepted):
    from engine.speculative.postprocess import SeqStepResult, postprocess_speculative
    out = sch.schedule()
    assert out.seqs == [seq]
    postprocess_speculative(sch, out, {seq.seq_id: SeqStepResult(tokens, accepted)},
                            frozenset([2]))
    return out


def test_rollback_and_stops_inside_an_accepted_run():
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, 4, 64, 100)
    sch.num_lookahead_tokens = 3
    seq = Sequence(list(range(3, 9)), SamplingParams(max_tokens=20, stop_token_ids=[77],
                                                     temperature=0.0))
    sch.add(seq)
    _decode_step(sch, seq, [50], 0)                        # the prefill: 6 tokens
    assert (seq.num_cached_tokens, len(seq.block_table)) == (6, 2)
    out = sch.schedule()                                   # decode covers 7 + 3 lookahead
    assert len(seq.block_table) == 3 and out.num_new_tokens == [1]
    from engine.speculative.postprocess import SeqStepResult, postprocess_speculative
    postprocess_speculative(sch, out, {seq.seq_id: SeqStepResult([60, 61], 1)}, frozenset())
    # current token + 1 accepted draft computed; the third block (rejected slots) returned
    assert (len(seq), seq.num_cached_tokens, len(seq.block_table)) == (9, 8, 2)
    assert bm.num_free_blocks == 31 - 2
    _decode_step(sch, seq, [70, 77, 78, 79], 3)            # a stop token inside the run
    assert seq.output_token_ids == [50, 60, 61, 70, 77]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 77)
    assert bm.num_free_blocks == 31 and seq.block_table == []


def test_max_tokens_and_eos_cut_an_accepted_run():
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, 4, 64, 100)
    sch.num_lookahead_tokens = 3
    a = Sequence([3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    sch.add(a)
    _decode_step(sch, a, [10], 0)
    _decode_step(sch, a, [11, 12, 13, 14], 3)
    assert a.output_token_ids == [10, 11, 12] and a.finish_reason == "length"
    b = Sequence([3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0))
    sch.add(b)
    _decode_step(sch, b, [10], 0)
    _decode_step(sch, b, [11, 2, 13], 2)                   # eos (2) mid-run
    assert b.output_token_ids == [10, 11, 2] and b.finish_reason == "stop"
    assert bm.num_free_blocks == 31


def test_draft_vocabulary_subset_stays_exact_and_proposes_only_inside(root):
    folder = _model(root, "llama-tied-gqa")
    prompts = _prompts(4, seed=12)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = _run(folder, prompts, sp)
    llm = LLM(folder, dtype="float32", block_size=4, speculative_method="mtp",
              num_speculative_tokens=2)
    draft = llm.engine.speculative.draft
    draft.set_draft_vocab(torch.arange(0, 320, 2))
    logits = draft.logits(torch.randn(3, 64))
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == plain
    rand = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=3)
    outs = llm.generate(prompts, rand)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
