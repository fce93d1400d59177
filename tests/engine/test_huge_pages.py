"""Host memory on transparent huge pages (engine/huge_pages.py): the KV cache's mapping and
the arena the loader moves the streamed weights into are private and advised, so Linux
backs them with 2 MB pages where its mode allows; the tensors in them are the same."""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import huge_pages
from engine.huge_pages import ALIGN, HugePageArena, anonymous_mapping
from engine.kv_cache import KVCache
from engine.layers import cpu_bf16_gemm
from engine.layers.kernel_options import KernelOptions
from engine.models.loader import LARGE_BYTES, STREAMED_COPIES, load_model
from tests.smaps import mapping_of, mapping_start
from tests.tiny_models import KERNEL_SHAPES, _config


def _eligible(address: int) -> bool:
    return mapping_of(address)[1]["THPeligible"] == 1


def _expected(advised: bool) -> bool:
    """Whether the OS makes memory so advised (or not) eligible for huge pages."""
    return huge_pages.mode() == "always" or (advised and huge_pages.mode() == "madvise")


def test_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_pages.mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_pages.mode(f) == "always"
    assert huge_pages.mode(tmp_path / "missing") == "none"


@pytest.mark.parametrize("advise", [True, False])
def test_mapping_is_private_and_advised_as_asked(advise):
    buf = anonymous_mapping(8 << 20, huge_pages=advise)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t[:: 4096] = 1                                   # written: private, not shmem
    assert _eligible(t.data_ptr()) == _expected(advise)
    assert int(t.sum()) == (8 << 20) // 4096


def test_kv_cache_on_huge_pages_is_zero_and_eligible():
    cache = KVCache(2, 512, 16, 2, 64, torch.bfloat16, torch.device("cpu"), huge_pages=True)
    k, v = cache.layer(1)
    assert not k.any() and not v.any()
    k[:, 3].fill_(1.5)
    assert k[:, 3].eq(1.5).all() and not v.any() and not cache.layer(0)[0].any()
    assert _eligible(k.data_ptr()) == _expected(True)
    plain = KVCache(1, 512, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    assert _eligible(plain.layer(0)[0].data_ptr()) == _expected(False)


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.uint8])
SHAPES = st.lists(st.integers(0, 70), min_size=0, max_size=3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=6))
def test_arena_copies_are_equal_aligned_and_apart(specs):
    originals = [torch.randint(0, 100, tuple(s)).to(d) for s, d in specs]
    arena = HugePageArena(sum(HugePageArena.footprint(t.numel() * t.element_size())
                              for t in originals))
    copies = [arena.copy(t) for t in originals]
    spans = []
    for t, c in zip(originals, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % ALIGN == 0
        if c.numel():
            spans.append((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))   # apart
    kept = [c.clone() for c in copies]
    for t in originals:                 # copies, not views: the originals can go
        t.fill_(7)
    assert all(torch.equal(c, k) for c, k in zip(copies, kept, strict=True))


def test_arena_refuses_what_it_cannot_hold():
    arena = HugePageArena(ALIGN)
    arena.copy(torch.zeros(ALIGN, dtype=torch.uint8))
    with pytest.raises(ValueError, match="full"):
        arena.copy(torch.zeros(1))
    with pytest.raises(ValueError, match="contiguous"):
        HugePageArena(1 << 20).copy(torch.zeros(8, 8).t())


def _large_vocab_model(root):
    """SmolLM2's attention shape with a vocabulary whose bf16 embedding is over 2 MB."""
    arch, overrides = KERNEL_SHAPES["llama-hd64-gqa3"]
    cfg = _config(arch, {**overrides, "vocab_size": 12288})
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(root / "large-vocab")
    return root / "large-vocab"


def test_loader_moves_the_streamed_weights_and_keeps_the_tokens(tmp_path):
    folder = _large_vocab_model(tmp_path)
    # the streaming copies kept wherever they fit (not by this machine's timing)
    kernels = replace(KernelOptions.from_env(), cpu_bf16_gemm_measure=False)
    cpu = torch.device("cpu")
    plain, _ = load_model(folder, torch.bfloat16, cpu, kernels=kernels)
    moved, _ = load_model(folder, torch.bfloat16, cpu, kernels=kernels, huge_pages=True)
    embed = moved.embed_tokens.weight
    assert embed.numel() * embed.element_size() >= LARGE_BYTES
    assert moved.lm_head.weight is embed                  # still tied
    assert _eligible(embed.data_ptr()) == _expected(True)
    # not moved: it lies where torch puts any tensor of its size, which the allocator and
    # the OS decide (a heap that glibc or the kernel makes eligible on some machines)
    ordinary = torch.empty_like(plain.embed_tokens.weight)
    assert mapping_start(plain.embed_tokens.weight.data_ptr()) != mapping_start(embed.data_ptr())
    assert _eligible(plain.embed_tokens.weight.data_ptr()) == _eligible(ordinary.data_ptr())
    copies = [getattr(m, a) for m in moved.modules() for a in STREAMED_COPIES
              if isinstance(getattr(m, a, None), torch.Tensor)]
    if cpu_bf16_gemm.available():
        assert copies, "no streaming copy to move on a CPU that has the kernel"
    for c in copies:
        assert _eligible(c.data_ptr()) == _expected(True)


def test_greedy_tokens_are_the_same_on_huge_pages(tmp_path):
    """The whole engine, cache and weights moved or not: the same bf16 tokens."""
    from engine import LLM, SamplingParams
    folder = _large_vocab_model(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 12288, (n,), generator=gen).tolist()}
               for n in (5, 40, 90)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        llm = LLM(str(folder), dtype="bfloat16", num_gpu_blocks=256, huge_pages=on)
        assert llm.config.huge_pages is on
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert all(len(t) == 12 for t in tokens[True])
    assert tokens[True] == tokens[False]
