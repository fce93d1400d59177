"""The trained MTP head of the default model: `prepare` installs it (also into a folder
prepared before it existed), LLM(folder) ignores it, and with it greedy decoding gives the
plain tokens for every sequence at high acceptance."""

from __future__ import annotations

import json
import shutil

from engine import LLM, SamplingParams
from launch.default_mtp import ASSET, MTP_FILE, install_mtp_head
from tests.tiny_models import make_tiny_model
from tests.tiny_mtp import draft_folder

PROMPTS = [
    "Tell me about the history of tea.",
    "Write a short poem about autumn leaves.",
    "Explain how a refrigerator works.",
    "What are three tips for learning a new language?",
    "The quick brown fox",
    "def add(a, b):",
]


def test_install_adds_head_and_config_and_is_idempotent(tmp_path):
    base, _ = make_tiny_model("llama-tied-gqa", tmp_path)
    asset = draft_folder(base, tmp_path / "draft") / "model.safetensors"
    folder = tmp_path / "prepared"
    shutil.copytree(base, folder)
    assert install_mtp_head(folder, asset) is True
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert (folder / MTP_FILE).read_bytes() == asset.read_bytes()
    assert install_mtp_head(folder, asset) is False          # nothing left to do
    (folder / MTP_FILE).write_bytes(b"older head")           # an outdated head is replaced
    assert install_mtp_head(folder, asset) is True
    assert (folder / MTP_FILE).read_bytes() == asset.read_bytes()
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    plain = LLM(folder, dtype="float32").generate(ids, sp)[0].outputs[0].token_ids
    spec = LLM(folder, dtype="float32", speculative_method="mtp").generate(ids, sp)
    assert spec[0].outputs[0].token_ids == plain


def test_asset_is_shipped():
    assert ASSET.is_file(), "launch/assets/smollm2_mtp.safetensors is missing"


def test_prepared_folder_holds_the_head(default_model_dir):
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert (default_model_dir / MTP_FILE).read_bytes() == ASSET.read_bytes()


def test_trained_head_greedy_identical_and_accepts(default_model_dir):
    """Chat requests (what the head was trained on), fp32: every sequence's greedy tokens
    equal plain decoding's, and the head's drafts are accepted far above chance (a random
    draft's acceptance over a 49k vocabulary is ~0)."""
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    plain_llm = LLM(default_model_dir, dtype="float32", max_num_seqs=8)
    assert plain_llm.engine.speculative is None
    plain = [o.outputs[0].token_ids for o in plain_llm.chat(chats, sp)]
    spec_llm = LLM(default_model_dir, dtype="float32", max_num_seqs=8,
                   speculative_method="mtp", num_speculative_tokens=2)
    assert spec_llm.engine.speculative.draft.draft_vocab is not None
    spec = [o.outputs[0].token_ids for o in spec_llm.chat(chats, sp)]
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b == a, f"prompt {i} ({PROMPTS[i]!r}) differs with MTP"
    stats = spec_llm.stats()
    assert stats["spec_acceptance_length"] > 1.2, stats
    assert stats["spec_acceptance_rate_per_position"][0] > 0.2, stats


def test_stop_string_inside_an_accepted_run(default_model_dir):
    greedy = dict(max_tokens=48, temperature=0.0)
    plain_llm = LLM(default_model_dir, dtype="float32")
    spec_llm = LLM(default_model_dir, dtype="float32", speculative_method="mtp",
                   num_speculative_tokens=3)
    base = plain_llm.generate(PROMPTS[1], SamplingParams(**greedy))[0].outputs[0]
    words = base.text.split()
    for word in words[3:9]:
        sp = SamplingParams(stop=[word], **greedy)
        a = plain_llm.generate(PROMPTS[1], sp)[0].outputs[0]
        b = spec_llm.generate(PROMPTS[1], sp)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
            (a.text, a.token_ids, a.finish_reason, a.stop_reason), word
    tok = base.token_ids[len(base.token_ids) // 2]
    sp = SamplingParams(stop_token_ids=[tok], **greedy)
    a = plain_llm.generate(PROMPTS[1], sp)[0].outputs[0]
    b = spec_llm.generate(PROMPTS[1], sp)[0].outputs[0]
    assert b.token_ids == a.token_ids and b.token_ids[-1] == tok
