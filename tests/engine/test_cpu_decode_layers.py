"""The one-call C++ decode layers (engine/layers/cpu_decode_layers.py): every decode-only
forward an engine runs gives the same bits as the Python layers' loop on the same inputs
(plain decode at batch sizes on both sides of the MLP's epilogue threshold, with and
without cpu_bf16_gemm, a qkv bias, aux-layer streams, MTP verify rows), and models
it cannot serve keep the Python layers."""

from __future__ import annotations

import types

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers import cpu_bf16_gemm
from engine.layers.kernel_options import BF16_GEMM_ENV, DECODE_ATTENTION_ENV, DECODE_LAYERS_ENV
from engine.layers.linear import FUSED_SILU_MUL_ROWS, Linear, can_pack
from tests.cpu_features import requires_amx_bf16
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp

# the one-call layers take oneDNN's prepacked bf16 linears, which need a CPU with native bf16
# (AVX512-BF16 or AMX); elsewhere bf16 runs the Python layers, as the last test checks
needs_packed_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no native bf16 (AVX2 only): no packed linears, no C++ layers")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("decode-layers")


def _both_paths(model) -> list[tuple[int, int]]:
    """Make every forward of `model` that the runner serves run the Python layers too, on
    the same inputs, and assert the outputs are equal bit for bit (the second run writes
    the same K/V into the same slots). Returns (rows, rows per sequence) of each."""
    runner = model.decode_layers()
    assert runner is not None
    served = []
    forward = type(model).forward

    def checked(self, token_ids, positions, kv_cache, meta):
        plan = self.attention.prepare(meta, kv_cache.k[0])
        x = self.embed_tokens(token_ids)
        if not runner.serves(x, plan):
            return forward(self, token_ids, positions, kv_cache, meta)
        fast = forward(self, token_ids, positions, kv_cache, meta)
        self._decode_layers = False             # decode_layers() -> None: the Python loop
        try:
            slow = forward(self, token_ids, positions, kv_cache, meta)
        finally:
            self._decode_layers = runner
        assert fast.dtype == torch.bfloat16 and torch.equal(fast, slow), \
            f"decode forward over {x.shape[0]} rows differs from the Python layers"
        served.append((x.shape[0], plan.rows))
        return fast

    model.forward = types.MethodType(checked, model)
    return served


def _generate(llm, n: int, seed: int = 0):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(n, [3, 9, 17, 30], 320, seed)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(n)]
    return llm.generate(prompts, params, use_tqdm=False)


# "always": the streaming copies wherever they fit (the path the C++ call takes with them,
# whatever this CPU's measured choice); "brgemm": the same copies on their brgemm kernel;
# "1": the measured choice; "0": oneDNN only
@pytest.mark.parametrize("name,aux,gemm", [("llama-tied-gqa", (), "always"),
                                            ("qwen2-gqa4", (), "always"),
                                            ("llama-tied-gqa", (), "brgemm"),
                                            ("qwen2-gqa4", (0,), "brgemm"),
                                            ("llama-tied-gqa", (0,), "always"),
                                            ("qwen2-gqa4", (), "1"),
                                            ("llama-tied-gqa", (), "0"),
                                            ("qwen2-gqa4", (), "0")])
@needs_packed_bf16
def test_decode_forwards_equal_the_python_layers(root, monkeypatch, name, aux, gemm):
    monkeypatch.setenv(BF16_GEMM_ENV, gemm)
    folder, _ = make_tiny_model(name, root)
    llm = LLM(folder, dtype="bfloat16", block_size=4, max_num_seqs=24)
    model = llm.engine.worker.model
    model.set_aux_layers(aux)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    # always (on a CPU that runs it: tests/engine/test_cpu_features.py): every layer linear
    # has cpu_bf16_gemm's copy, and both paths take it; measured: a layer keeps its copy
    # exactly where the choice took it for a bucket; off: none
    for m in linears:
        has = m.gemm_packed is not None or m.gemm_silu_mul_packed is not None
        want = {"always": cpu_bf16_gemm.available(), "0": False,
                "brgemm": cpu_bf16_gemm.available(),
                "1": cpu_bf16_gemm.available() and bool(m.gemm_small or m.gemm_large)}[gemm]
        assert has == want, (gemm, m)
        if has and gemm in ("always", "brgemm"):
            kernel = ("brgemm" if gemm == "brgemm" and cpu_bf16_gemm.brgemm_available()
                      else "bf16_gemm")
            assert (m.gemm_small, m.gemm_large) == (kernel, kernel)
    served = _both_paths(model)
    outs = _generate(llm, 20)
    assert all(len(o.outputs[0].token_ids) == 4 + 3 * i for i, o in enumerate(outs))
    sizes = {n for n, _ in served}
    # both sides of the MLP's epilogue threshold: (cpu_bf16_gemm off) the epilogue GEMMs
    # from FUSED_SILU_MUL_ROWS rows, one GEMM below; (on) its silu(gate) * up on both
    assert max(sizes) >= FUSED_SILU_MUL_ROWS and min(sizes) < FUSED_SILU_MUL_ROWS, sizes


@needs_packed_bf16
def test_mtp_verify_rows_equal_the_python_layers(root, monkeypatch):
    monkeypatch.setenv(BF16_GEMM_ENV, "always")
    base, _ = make_tiny_model("llama-tied-gqa", root)
    folder = with_mtp(base, root / "llama-mtp")
    llm = LLM(folder, dtype="bfloat16", block_size=4, speculative_method="mtp",
              num_speculative_tokens=2)
    # the draft's linears have cpu_bf16_gemm's copies, as the target's do
    draft = llm.engine.speculative.draft
    assert any(isinstance(m, Linear) and m.gemm_silu_mul_packed is not None
               for m in draft.modules()) == cpu_bf16_gemm.available()
    served = _both_paths(llm.engine.worker.model)
    _generate(llm, 6, seed=1)
    assert any(rows == 3 for _, rows in served), served


@requires_amx_bf16
@needs_packed_bf16
def test_decode_forwards_on_the_tile_path_equal_the_python_layers(root, monkeypatch):
    """SmolLM2's head shape with the paged kernel's AMX path forced: the backend takes it,
    and the one C++ call (the path's code in its dims) gives the Python layers' bits. The
    two paths agree bit for bit on most rows, so this checks that the call runs the path
    and agrees, not which one ran: tests/engine/test_paged_decode_rows.py checks the paths."""
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "amx")
    folder, _ = make_tiny_model("llama-hd64-gqa3", root)
    llm = LLM(folder, dtype="bfloat16", block_size=16, max_num_seqs=24)
    model = llm.engine.worker.model
    assert model.attention.decode_path == "amx"
    served = _both_paths(model)
    outs = _generate(llm, 12)
    assert all(len(o.outputs[0].token_ids) == 4 + 3 * i for i, o in enumerate(outs))
    assert served


@pytest.mark.parametrize("name,dtype,env", [
    ("qwen3-qknorm-hd24", "bfloat16", "1"),             # q/k norm: not in the C++ layer
    ("llama-untied-hd32-llama3rope", "bfloat16", "1"),  # o_proj and MLP biases
    ("llama-tied-gqa", "float32", "1"),                 # no packed linears in float32
    ("llama-tied-gqa", "bfloat16", "0"),                # switched off
])
def test_models_it_cannot_serve_keep_the_python_layers(root, monkeypatch, name, dtype, env):
    monkeypatch.setenv(DECODE_LAYERS_ENV, env)
    folder, _ = make_tiny_model(name, root)
    llm = LLM(folder, dtype=dtype, block_size=4)
    assert llm.engine.worker.model.decode_layers() is None
    outs = _generate(llm, 3)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 7, 10]
