"""An MTP head that reads mid-layer target features (EAGLE-3 style, engine/models/mtp.py
`aux_layers`): the target returns the residual streams after those layers (equal to HF
transformers' hidden_states), the draft starts from h + aux_proj(rms(a)), greedy output
stays identical to plain decoding (eager and graph-replayed verify), and a head and a
target that disagree on the layers are a clear error."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_model
from engine.models.mtp import MTPModule, head_aux_layers, load_mtp
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp

OPTS = dict(dtype="float32", block_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-aux")
    base, _ = make_tiny_model("llama-tied-gqa", root)
    return base, with_mtp(base, root / "aux", aux_layers=(0, 1))


def _greedy(n=24):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_target_rows_hold_the_residual_streams_hf_reports(folders):
    """Through the engine's own prefill forward: the final hidden state, then for each
    aux layer l the residual stream after it, which is HF's hidden_states[l + 1] (the
    last layer's is before the final norm, as HF reports it only normed: compare it
    through the model's final norm)."""
    from transformers import AutoModelForCausalLM
    base, folder = folders
    llm = LLM(folder, speculative_method="mtp", num_speculative_tokens=1, **OPTS)
    eng = llm.engine
    assert eng.model.aux_layers == (0, 1) and eng.model.output_width == 3 * 64
    seen = []
    real = eng.worker.executor.forward
    eng.worker.executor.forward = lambda fi: seen.append(real(fi).clone()) or seen[-1]
    prompt = random_prompts(1, [11], 320, seed=2)[0]
    llm.generate([{"prompt_token_ids": prompt}], _greedy(1))
    rows = seen[0]
    assert rows.shape == (len(prompt), 3 * 64)
    hf = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]
    torch.testing.assert_close(rows[:, :64], hs[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[:, 64:128], hs[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf.model.norm(rows[:, 128:]), hs[-1], rtol=1e-4, atol=1e-4)


def test_draft_input_is_final_plus_projected_normed_aux_layers(folders):
    _, folder = folders
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    plain = MTPModule(cfg, model.embed_tokens, model.lm_head)
    aux = MTPModule(cfg, model.embed_tokens, model.lm_head, aux_layers=(0, 1))
    with torch.no_grad():
        aux.aux_proj.weight.copy_(torch.randn(64, 128))
    rows = torch.randn(5, 3 * 64) * torch.tensor([1.0, 30.0, 0.2]).repeat_interleave(64)
    torch.testing.assert_close(plain.draft_input(rows[:, :64]), rows[:, :64])
    a = rows[:, 64:].view(5, 2, 64)
    normed = a / a.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt()
    want = rows[:, :64] + normed.reshape(5, 128) @ aux.aux_proj.weight.t()
    torch.testing.assert_close(aux.draft_input(rows), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="width 64, expected 192"):
        aux.draft_input(rows[:, :64])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_greedy_identical_to_plain_with_an_aux_head(folders, k, graph):
    base, folder = folders
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [3, 9, 17, 30], 320, 4)]
    plain = [o.outputs[0].token_ids for o in LLM(base, **OPTS).generate(prompts, _greedy())]
    opts = {"enable_graph": True, "graph_max_seq_len": 64} if graph else {}
    llm = LLM(folder, speculative_method="mtp", num_speculative_tokens=k, **opts, **OPTS)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    assert spec == plain
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0
    if graph:
        assert stats["graph_replays"] > 0


def test_the_embedding_cache_holds_the_draft_input_of_the_last_prompt_row(folders):
    """After a prefill the pending row (and so a PD handoff) is draft_input of the
    target's row, not the bare final hidden state."""
    _, folder = folders
    llm = LLM(folder, speculative_method="mtp", num_speculative_tokens=1, **OPTS)
    eng = llm.engine
    seen = []
    real = eng.worker.executor.forward
    eng.worker.executor.forward = lambda fi: seen.append(real(fi).clone()) or seen[-1]
    prompt = random_prompts(1, [9], 320, seed=5)[0]
    eng.add_request("a", prompt, _greedy(4))
    eng.step()                                          # the prefill
    entry = eng.speculative.embedding_cache.get(eng.requests["a"].seq_id)
    with torch.inference_mode():            # as the engine calls it
        want = eng.speculative.draft.draft_input(seen[0][-1:])
    torch.testing.assert_close(entry.hidden, want)
    assert not torch.allclose(entry.hidden, seen[0][-1:, :64])


def test_head_and_target_must_agree_on_the_layers(folders):
    base, folder = folders
    assert head_aux_layers(folder, 2) == (0, 1)
    assert head_aux_layers(with_mtp(base, folder.parent / "plain"), 2) == ()
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"reads target layers \[0, 1\], but the target "
                                         r"returns \[\]"):
        load_mtp(folder, model, torch.float32, torch.device("cpu"))
    model.set_aux_layers((0, 1))
    assert load_mtp(folder, model, torch.float32, torch.device("cpu")).aux_layers == (0, 1)
    for bad in ((1, 0), (0, 0), (2,), (-1,)):
        with pytest.raises(ValueError, match="must be ascending, distinct and in 0..1"):
            model.set_aux_layers(bad)
