// The CPU kernels' entry points, one declaration each: the ops registered in
// bindings.cpp (torch.ops.pdserve.*) and the functions decode_layers.cpp calls directly.
// One extension holds them all (engine/layers/cpu_extension.py builds it), so a kernel
// calls another as a declared C++ function, checked by the compiler.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace pdserve {

// paged_attention.cpp: decode rows (or `rows` verify rows a sequence) against the paged
// KV cache; whether bf16 / head_dim 64 / 1-4 query heads a KV head has the AVX512 path
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                                  at::Tensor kvlen, int64_t rows, double scale);
bool paged_bf16_d64_fast();
// paged_attention_f32.cpp: float32, head_dim 64, 1-4 query heads a KV head, on AVX2 + FMA;
// false (and `out` untouched) where it does not apply, so the caller takes its generic loop
bool paged_decode_f32_d64(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                          const at::Tensor& bt, const at::Tensor& kvlen, at::Tensor& out,
                          int64_t rows, double scale);

// paged_attention_amx.cpp: the same for bf16 / head_dim 64 / 1-4 query heads a KV head /
// blocks of 16k keys, scored on the AMX tiles; whether the CPU, the build and the OS allow
at::Tensor paged_decode_attention_amx(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                                      at::Tensor kvlen, int64_t rows, double scale);
bool paged_amx_decode_available();

// latent_attention.cpp: MLA's absorbed decode over the latent cache (one row of R + P a
// token, shared by every head): the attended latents [N, H, R]
at::Tensor latent_decode_attention(at::Tensor q_lat, at::Tensor q_pe, at::Tensor cache,
                                   at::Tensor bt, at::Tensor kvlen, int64_t rows, double scale);

// prefill_attention.cpp: tiled bf16 prefill rows (head_dim 64, AVX512-BF16)
at::Tensor prefill_attention(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                             at::Tensor qstart, at::Tensor context, double scale);
bool prefill_attention_available();

// prefill_attention_brgemm.cpp: the same rows on oneDNN's bf16 brgemm micro-kernel (AMX
// tiles where present); whether the micro-kernel passed its self-test here
at::Tensor prefill_attention_brgemm(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                                    at::Tensor qstart, at::Tensor context, double scale);
bool prefill_attention_brgemm_available();

// fused_ops.cpp: rotary in place, K/V cache writes, residual add + RMSNorm, argmax rows
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads,
           int64_t D);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor kc, at::Tensor vc, at::Tensor slots);
std::vector<at::Tensor> add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps);
at::Tensor argmax_rows(at::Tensor x);

// top_k_top_p.cpp: sampling logits masked to top-k / top-p from each row's likely tokens;
// {masked logits, rows decided} (an undecided row is left for the caller's general path)
std::vector<at::Tensor> top_k_top_p_cut(at::Tensor logits, at::Tensor lse, at::Tensor top_k,
                                        at::Tensor top_p, double slack);

// bf16_gemm.cpp: the weight-streaming bf16 GEMM (AVX512-BF16) and its packed layouts
bool bf16_gemm_supported();
at::Tensor bf16_gemm_pack(at::Tensor w);
at::Tensor bf16_gemm_pack_silu_mul(at::Tensor w);
at::Tensor bf16_gemm(at::Tensor x, at::Tensor wp, at::Tensor bias);
at::Tensor bf16_gemm_silu_mul(at::Tensor x, at::Tensor wp);

// bf16_gemm_brgemm.cpp: the same packed weights on oneDNN's brgemm micro-kernel (AMX tiles
// where present); whether it passed its self-test here
bool bf16_gemm_brgemm_available();
at::Tensor bf16_gemm_brgemm(at::Tensor x, at::Tensor wp, at::Tensor bias);
at::Tensor bf16_gemm_brgemm_silu_mul(at::Tensor x, at::Tensor wp);

// fixed_order_linear.cpp: batch-invariant linear for any CPU
at::Tensor fixed_order_linear(at::Tensor x, at::Tensor wt, at::Tensor bias);

// decode_layers.cpp: every decoder layer of a decode step in one call
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                                      std::vector<at::Tensor> k_caches,
                                      std::vector<at::Tensor> v_caches, at::Tensor positions,
                                      at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                      at::Tensor block_tables, at::Tensor kv_lens,
                                      std::vector<int64_t> dims, double eps, double scale,
                                      std::vector<int64_t> aux);

}  // namespace pdserve
