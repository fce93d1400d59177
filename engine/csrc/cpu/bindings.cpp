// The ops of the one CPU extension, declared with schemas: torch.ops.pdserve.<name> in
// Python (engine/layers/cpu_*.py). `(a!)` marks an argument the op writes in place.
// Each op has one catch-all kernel: the kernels run on CPU tensors and check it, and the
// capability queries take no tensor to pick a dispatch key by.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor kv_lens, int rows, float scale) -> Tensor",
      TORCH_FN(pdserve::paged_decode_attention));
  m.def("paged_bf16_d64_fast() -> bool", TORCH_FN(pdserve::paged_bf16_d64_fast));
  m.def(
      "paged_decode_attention_amx(Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor kv_lens, int rows, float scale) -> Tensor",
      TORCH_FN(pdserve::paged_decode_attention_amx));
  m.def("paged_amx_decode_available() -> bool", TORCH_FN(pdserve::paged_amx_decode_available));
  m.def(
      "latent_decode_attention(Tensor q_lat, Tensor q_pe, Tensor cache, Tensor block_tables, "
      "Tensor kv_lens, int rows, float scale) -> Tensor",
      TORCH_FN(pdserve::latent_decode_attention));
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor context, float scale) -> Tensor",
      TORCH_FN(pdserve::prefill_attention));
  m.def("prefill_attention_available() -> bool", TORCH_FN(pdserve::prefill_attention_available));
  m.def(
      "prefill_attention_brgemm(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor context, float scale) -> Tensor",
      TORCH_FN(pdserve::prefill_attention_brgemm));
  m.def("prefill_attention_brgemm_available() -> bool",
        TORCH_FN(pdserve::prefill_attention_brgemm_available));
  m.def(
      "rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, "
      "int head_dim) -> ()",
      TORCH_FN(pdserve::rope_));
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots) -> ()",
      TORCH_FN(pdserve::write_kv));
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]",
        TORCH_FN(pdserve::add_rms_norm));
  m.def("argmax_rows(Tensor x) -> Tensor", TORCH_FN(pdserve::argmax_rows));
  m.def(
      "top_k_top_p_cut(Tensor logits, Tensor lse, Tensor top_k, Tensor top_p, float slack) "
      "-> Tensor[]",
      TORCH_FN(pdserve::top_k_top_p_cut));
  m.def("bf16_gemm_supported() -> bool", TORCH_FN(pdserve::bf16_gemm_supported));
  m.def("bf16_gemm_pack(Tensor weight) -> Tensor", TORCH_FN(pdserve::bf16_gemm_pack));
  m.def("bf16_gemm_pack_silu_mul(Tensor weight) -> Tensor",
        TORCH_FN(pdserve::bf16_gemm_pack_silu_mul));
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor bias) -> Tensor", TORCH_FN(pdserve::bf16_gemm));
  m.def("bf16_gemm_silu_mul(Tensor x, Tensor packed) -> Tensor",
        TORCH_FN(pdserve::bf16_gemm_silu_mul));
  m.def("bf16_gemm_brgemm_available() -> bool", TORCH_FN(pdserve::bf16_gemm_brgemm_available));
  m.def("bf16_gemm_brgemm(Tensor x, Tensor packed, Tensor bias) -> Tensor",
        TORCH_FN(pdserve::bf16_gemm_brgemm));
  m.def("bf16_gemm_brgemm_silu_mul(Tensor x, Tensor packed) -> Tensor",
        TORCH_FN(pdserve::bf16_gemm_brgemm_silu_mul));
  m.def("fixed_order_linear(Tensor x, Tensor weight_t, Tensor bias) -> Tensor",
        TORCH_FN(pdserve::fixed_order_linear));
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor block_tables, Tensor kv_lens, int[] dims, float eps, float scale, "
      "int[] aux) -> Tensor[]",
      TORCH_FN(pdserve::decode_layers));
}
