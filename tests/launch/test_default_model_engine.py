"""SmolLM2-135M through our engine: greedy identical to HF transformers in fp32, our
tokenizer and chat template equal HF's, and the stop conditions on real text."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, dtype="float32", max_num_seqs=8)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model_dir)


def test_greedy_identical_to_hf_fp32(llm, hf):
    model, tok = hf
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                logprobs=0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist(), "tokenizer differs from HF's"
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW, output_logits=True,
                             return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        assert got == ref_tokens, f"{prompt!r}: {got} != {ref_tokens}"
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)
        ref_lp = [torch.log_softmax(lg[0], -1)[t].item()
                  for lg, t in zip(ref.logits, ref_tokens, strict=True)]
        assert [e.token_id for e in out.outputs[0].logprobs] == got
        assert all(e.top == () for e in out.outputs[0].logprobs), "logprobs=0 asks no top"
        got_lp = [e.logprob for e in out.outputs[0].logprobs]
        assert got_lp == pytest.approx(ref_lp, abs=1e-3)


def test_chat_template_equals_hf(llm, hf):
    _, tok = hf
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    ours = llm.tokenizer.apply_chat_template(messages)
    assert ours == tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=True)
    out = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.prompt_token_ids == tok(ours, add_special_tokens=False).input_ids
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_stop_conditions(llm):
    greedy = dict(temperature=0.0, max_tokens=MAX_NEW)
    base = llm.generate(PROMPTS[2], SamplingParams(**greedy))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == MAX_NEW
    # a stop string from the middle of the text: cut before it, tokens stop there
    word = base.text.split()[3]
    cut = base.text.index(word)
    stopped = llm.generate(PROMPTS[2], SamplingParams(stop=[word], **greedy))[0].outputs[0]
    assert stopped.text == base.text[:cut]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", word)
    assert stopped.token_ids == base.token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < MAX_NEW
    # stop_token_ids: the output ends with that token
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    by_id = llm.generate(PROMPTS[2], SamplingParams(stop_token_ids=[stop_id],
                                                    **greedy))[0].outputs[0]
    assert by_id.token_ids == base.token_ids[:first + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    # eos ends a chat answer unless ignore_eos
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    eos_out = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert eos_out.finish_reason == "stop" and eos_out.token_ids[-1] == 2
    ignored = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=40,
                                            ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"


def test_max_model_len_stops_generation(default_model_dir):
    small = LLM(default_model_dir, dtype="float32", max_model_len=12)
    out = small.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100,
                                                    ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_reproducible(llm):
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12)
    a = llm.generate(PROMPTS[:2], sp)
    b = llm.generate([PROMPTS[3], PROMPTS[1], PROMPTS[0]], sp)
    assert a[1].outputs[0].token_ids == b[1].outputs[0].token_ids
    assert a[0].outputs[0].token_ids == b[2].outputs[0].token_ids
