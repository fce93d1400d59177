"""MTP verify batches replayed through the graph executor (k+1 query rows per sequence):
greedy tokens identical to plain decoding, verify graphs captured and replayed (no
verify_too_wide fallback), persistent buffers kept, graph vs eager hidden states, and the
decode attention with k+1 rows per sequence against a per-sequence causal reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.executor.graph import GraphExecutor, _tokens_per_seq
from engine.forward_input import AttentionMetadata
from engine.layers.kernel_options import KernelOptions
from engine.layers.sdpa_attention import SdpaAttention
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("specgraph")


def _model(root, name: str):
    folder, _ = make_tiny_model(name, root)
    return with_mtp(folder, root / f"{name}-mtp", "deepseek")


def _prompts(n: int, seed: int = 0):
    return [{"prompt_token_ids": p}
            for p in random_prompts(n, [3, 9, 17, 30, 5, 12], 320, seed)]


def _params(n: int):
    # different max_tokens: batch sizes shrink as sequences finish, and the last steps
    # of a sequence draft fewer than k tokens (ragged verify batches, eager)
    return [SamplingParams(max_tokens=10 + (i * 7) % 17, temperature=0.0, ignore_eos=True)
            for i in range(n)]


def _run(folder, prompts, params, **opts):
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=64,
              max_num_seqs=8, **opts)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


class VerifyRecorder:
    """Wraps the target's GraphExecutor.forward: for every batch that replays a verify
    graph (k+1 rows per sequence), copy the graph's hidden states and rerun the same input
    eagerly (it rewrites this step's K/V with the same values), to compare them."""

    def __init__(self, executor: GraphExecutor):
        self.ex, self.real = executor, executor.forward
        self.verify_batches, self.padded_batches = 0, 0
        executor.forward = self

    def __call__(self, fi):
        before = self.ex.graph_stats.replays + self.ex.graph_stats.captures
        hidden = self.real(fi)
        graphed = self.ex.graph_stats.replays + self.ex.graph_stats.captures > before
        if graphed and _tokens_per_seq(fi) > 1:
            self.verify_batches += 1
            # padding rows in front of shorter runs: fewer rows selected than computed
            self.padded_batches += fi.selected_token_idxes.numel() < fi.num_tokens
            got = hidden.clone()
            ref = self.ex.eager.forward(fi)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        return hidden


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-hd24"])
def test_graph_verify_tokens_equal_plain(root, name, k):
    folder = _model(root, name)
    prompts, params = _prompts(12), _params(12)
    plain, _ = _run(folder, prompts, params)
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
              speculative_method="mtp", num_speculative_tokens=k, enable_graph=True)
    ex = llm.engine.worker.executor
    assert isinstance(ex, GraphExecutor) and ex.options.max_tokens_per_seq == k + 1
    ptrs = {n: t.data_ptr() for n, t in ex.buffers.tensors().items()}
    recorder = VerifyRecorder(ex)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b == a, f"sequence {i} differs with MTP k={k} and graphs"
    st = llm.stats()
    assert st["spec_num_drafts"] > 0
    assert st["graph_replays"] > 0
    # only the prompts run eagerly: every verify batch, ragged ones too, replays
    assert set(st["graph_fallbacks"]) <= {"prefill"}, st["graph_fallbacks"]
    verify_keys = [key for key in ex.graphs if key.tokens_per_seq == k + 1]
    assert verify_keys, f"no verify graph captured: {list(ex.graphs)}"
    # verify batches were replayed (not only captured), and matched eager every time
    assert recorder.verify_batches > len(verify_keys)
    assert recorder.padded_batches > 0
    assert {n: t.data_ptr() for n, t in ex.buffers.tensors().items()} == ptrs


def test_ragged_verify_is_padded_in_front(root):
    """Drafts of 3, 1 and 0 tokens: 4 rows per sequence, the real rows last, padding rows
    at the padding slot and never selected; all rows decode-like."""
    from engine.block_manager import PADDING_BLOCK_ID
    from engine.sequence import Sequence
    from engine.speculative.spec_input import build_runs, fill_placeholders, verify_runs

    bs = 4
    seqs = []
    for n, first_block in ((5, 10), (9, 20), (2, 30)):
        seq = Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=8), f"r{n}")
        seq.block_table = list(range(first_block, first_block + 4))
        seqs.append(seq)
    fi, layout = build_runs(verify_runs(seqs, [3, 1, 0]), bs)
    fill_placeholders(fi, layout, [[7, 8, 9], [6], []])
    a = fi.attn
    assert (a.num_decodes, a.num_decode_tokens, a.num_prefills) == (3, 12, 0)
    assert layout.row_start == [0, 6, 11]
    assert fi.token_ids.tolist() == [5, 7, 8, 9, 0, 0, 9, 6, 0, 0, 0, 2]
    assert fi.positions.tolist() == [4, 5, 6, 7, 8, 8, 8, 9, 1, 1, 1, 1]
    pad = PADDING_BLOCK_ID * bs
    assert fi.attn.slot_mapping.tolist() == [
        44, 45, 46, 47, pad, pad, 88, 89, pad, pad, pad, 121]
    assert a.seq_lens.tolist() == [8, 10, 2]
    assert fi.selected_token_idxes.tolist() == [0, 1, 2, 3, 6, 7, 11]
    assert a.query_start_loc.tolist() == [0, 4, 8, 12]


def test_speculative_sizes_graph_buffers(root):
    folder = _model(root, "llama-tied-gqa")
    plain = LLM(folder, dtype="float32", block_size=4, enable_graph=True)
    assert plain.engine.worker.executor.options.max_tokens_per_seq == 1
    spec = LLM(folder, dtype="float32", block_size=4, enable_graph=True, max_num_seqs=4,
               speculative_method="mtp", num_speculative_tokens=2)
    ex = spec.engine.worker.executor
    assert ex.options.max_tokens_per_seq == 3
    assert ex.buffers.token_ids.shape[0] == ex.buckets.largest * 3


# ---- the attention: k+1 rows per sequence ------------------------------------------------
def _paged_case(seed: int, seq_lens: list[int], rows: int, hq=4, hk=2, d=8, bs=4, width=6):
    """Random caches holding each sequence's KV (its last `rows` tokens are this step's),
    block tables over disjoint blocks (block 0 is padding) and the step's q/k/v."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    nblocks = 1 + b * width
    # the engine's head-major layout [Hk, blocks, bs, D]
    k_cache = torch.randn(nblocks, bs, hk, d, generator=g).permute(2, 0, 1, 3).contiguous()
    v_cache = torch.randn(nblocks, bs, hk, d, generator=g).permute(2, 0, 1, 3).contiguous()
    tables = torch.zeros(b, width, dtype=torch.int32)
    slots = []
    for i, n in enumerate(seq_lens):
        used = -(-n // bs)
        tables[i, :used] = torch.arange(1 + i * width, 1 + i * width + used)
        for p in range(n - rows, n):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
    q = torch.randn(b * rows, hq, d, generator=g)
    k = torch.randn(b * rows, hk, d, generator=g)
    v = torch.randn(b * rows, hk, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32) * rows, block_tables=tables,
        paged_kv_indptr=torch.zeros(b + 1, dtype=torch.int32),
        paged_kv_indices=torch.zeros(0, dtype=torch.int32),
        paged_kv_last_page_len=torch.ones(b, dtype=torch.int32),
        num_decodes=b, num_decode_tokens=b * rows, seq_lens_host=list(seq_lens))
    return q, k, v, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta, rows, scale):
    """Per sequence: its KV gathered position by position, an explicit causal mask."""
    hk, bs = k_cache.shape[0], k_cache.shape[2]
    hq = q.shape[1]
    outs = []
    for i, n in enumerate(meta.seq_lens.tolist()):
        blocks = meta.block_tables[i]
        keys = torch.stack([k_cache[:, blocks[p // bs], p % bs] for p in range(n)])  # [n,Hk,D]
        vals = torch.stack([v_cache[:, blocks[p // bs], p % bs] for p in range(n)])
        keys = keys.repeat_interleave(hq // hk, dim=1).transpose(0, 1)           # [Hq,n,D]
        vals = vals.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
        qi = q[i * rows:(i + 1) * rows].transpose(0, 1)                           # [Hq,R,D]
        pos = torch.arange(n - rows, n)[:, None]
        mask = torch.arange(n)[None, :] <= pos                                    # causal
        scores = (qi @ keys.transpose(1, 2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vals).transpose(0, 1))
    return torch.cat(outs)


# the CPU paths: C++ paged kernel, grouped matmuls, the SDPA kernel (as on CUDA/NPU)
MODES = {"kernel": KernelOptions(),
         "grouped": KernelOptions(cpu_attention_kernel=False),
         "sdpa": KernelOptions(cpu_attention_kernel=False, cpu_grouped_decode=False)}


def _attention(scale: float, mode: str) -> SdpaAttention:
    return SdpaAttention(scale, MODES[mode])


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_decode_attention_rows_per_sequence(rows, mode):
    scale = 8 ** -0.5
    q, k, v, kc, vc, meta = _paged_case(rows, [rows + 1, 7, 13, 24], rows)
    attn = _attention(scale, mode)
    out = attn(q, k, v, kc, vc, meta)
    # the step's K/V were written into the cache first, then attended
    torch.testing.assert_close(kc.view(2, -1, 8)[:, meta.slot_mapping].transpose(0, 1), k)
    ref = _reference(q, kc, vc, meta, rows, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # and it can fail: the same rows without the causal offset differ
    if rows > 1:
        flat = F.scaled_dot_product_attention(
            q[:rows].transpose(0, 1)[None],
            kc[:, meta.block_tables[0]].reshape(2, -1, 8)[None, :, :rows + 1],
            vc[:, meta.block_tables[0]].reshape(2, -1, 8)[None, :, :rows + 1],
            scale=scale, enable_gqa=True)[0]
        assert not torch.allclose(flat.transpose(0, 1), ref[:rows], atol=1e-3)


def test_padding_sequences_stay_finite():
    """A padding sequence (seq_len 1) with k+1 rows reads at least one key per row."""
    q, k, v, kc, vc, meta = _paged_case(5, [3, 9], 3)
    meta.seq_lens[1] = 1
    for mode in MODES:
        assert torch.isfinite(_attention(0.3, mode)(q, k, v, kc, vc, meta)).all()


def test_verify_forward_has_no_data_dependent_ops():
    """The verify graph's forward (4 rows per sequence over the persistent buffers) and the
    grouped CPU attention run on the meta device, where a host sync or a value-dependent
    shape raises: fixed shapes, the mask from the seq_lens tensor."""
    from engine.executor.graph_buckets import GraphKey
    from engine.executor.graph_buffers import GraphBuffers
    from engine.kv_cache import KVCache
    from engine.layers.sdpa_attention import verify_kv_lens
    from engine.models.decoder import DecoderForCausalLM
    from engine.models.model_config import ModelConfig

    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128})
    meta = torch.device("meta")
    with meta:
        model = DecoderForCausalLM(cfg)
    kv = KVCache(2, 40, 16, 2, 8, torch.float32, meta)
    buf = GraphBuffers(8, 4, 8, 16, cfg.hidden_size, torch.float32, meta)
    key = GraphKey(32, 4)
    with torch.inference_mode():
        hidden = model(buf.token_ids[:32], buf.positions[:32], kv, buf.metadata(key))
        assert hidden.shape == (32, cfg.hidden_size) and hidden.device.type == "meta"
        b, hk, g, rows, d, span = 8, 2, 2, 4, 8, 128
        q = torch.empty(b * rows, hk * g, d, device=meta)
        keys = torch.empty(hk, b, span, d, device=meta)
        lens = verify_kv_lens(buf.seq_lens[:b], rows)
        mask = torch.arange(span, device=meta)[None, None, :] < lens[:, :, None]
        out = SdpaAttention(0.3)._decode_grouped(q, keys, keys, ~mask, rows)
        assert out.shape == (b * rows, hk * g, d)


def test_cpu_kernel_is_built_and_used(monkeypatch):
    """The C++ kernel builds on this machine (g++ and ninja come with the dev setup) and
    the decode path goes through it: a kernel that returned zeros would be noticed."""
    from engine.layers import cpu_paged_attention

    assert cpu_paged_attention.kernel() is not None, cpu_paged_attention.EXTENSION.failed
    q, k, v, kc, vc, meta = _paged_case(3, [5, 12], 1)
    calls = []
    real = cpu_paged_attention.paged_decode_attention
    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention",
                        lambda *a: calls.append(1) or real(*a))
    out = _attention(8 ** -0.5, "kernel")(q, k, v, kc, vc, meta)
    assert calls == [1]
    torch.testing.assert_close(out, _reference(q, kc, vc, meta, 1, 8 ** -0.5),
                               rtol=1e-5, atol=1e-5)
    for dtype in (torch.bfloat16,):      # and in bf16, within bf16 rounding
        qb, kb, vb = q.to(dtype), kc.to(dtype), vc.to(dtype)
        ref = _reference(qb.float(), kb.float(), vb.float(), meta, 1, 8 ** -0.5)
        got = real(qb, kb, vb, meta.block_tables, meta.seq_lens, 1, 8 ** -0.5)
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_cpu_kernel_off_falls_back_to_torch(monkeypatch):
    """PDSERVE_CPU_ATTENTION_KERNEL=0 (read into the options) or a failed build: the
    torch path answers, same result, and a failed build keeps its reason for the warning."""
    from engine.layers import cpu_paged_attention
    from engine.layers.cpu_extension import CpuKernels, KernelFamily

    real = cpu_paged_attention.paged_decode_attention
    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention",
                        lambda *a: pytest.fail("the C++ kernel ran"))
    switched_off = KernelOptions.from_env({"PDSERVE_CPU_ATTENTION_KERNEL": "0"})
    assert not switched_off.cpu_attention_kernel
    ext = cpu_paged_attention.EXTENSION
    broken = KernelFamily(ext.what, CpuKernels())
    broken.kernels.failed = "RuntimeError: no compiler (simulated)"
    for options, extension in ((switched_off, ext), (KernelOptions(), broken)):
        monkeypatch.setattr(cpu_paged_attention, "EXTENSION", extension)
        attn = SdpaAttention(8 ** -0.5, options)
        assert not attn.use_cpu_kernel
        q, k, v, kc, vc, meta = _paged_case(4, [6, 11, 3], 2)
        out = attn(q, k, v, kc, vc, meta)
        torch.testing.assert_close(out, _reference(q, kc, vc, meta, 2, 8 ** -0.5),
                                   rtol=1e-5, atol=1e-5)
    assert cpu_paged_attention.kernel() is None
    with pytest.raises(RuntimeError, match="unavailable.*no compiler"):
        real(*[None] * 5, 1, 1.0)


def test_float16_decode_takes_the_torch_path():
    """The C++ kernel is built for float32 and bfloat16 only; float16 never reaches it."""
    q, k, v, kc, vc, meta = _paged_case(6, [5, 9], 1)
    h = [t.half() for t in (q, k, v, kc, vc)]
    out = _attention(8 ** -0.5, "kernel")(*h, meta)
    assert out.dtype == torch.float16
    ref = _reference(h[0].float(), h[3].float(), h[4].float(), meta, 1, 8 ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_fused_kv_write_follows_the_options(monkeypatch):
    """The backend writes K/V through the fused kernel when its options say so, and the
    caches come out the same either way."""
    from engine.layers import cpu_fused_ops

    calls, real = [], cpu_fused_ops.write_kv
    monkeypatch.setattr(cpu_fused_ops, "write_kv", lambda *a: calls.append(1) or real(*a))
    got = []
    for fused in (True, False):
        q, k, v, kc, vc, meta = _paged_case(7, [5, 9], 1)
        with torch.inference_mode():
            out = SdpaAttention(8 ** -0.5, KernelOptions(cpu_fused_ops=fused))(
                q, k, v, kc, vc, meta)
        got.append((out, kc, vc))
    assert calls == [1]
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
