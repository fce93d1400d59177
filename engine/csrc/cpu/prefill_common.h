// What the two prefill attention kernels (prefill_attention.cpp, prefill_attention_brgemm.cpp)
// share: the checks of their common arguments (their split of tasks over threads by cost is
// cost_split.h's).
// Internal linkage, as vec.h: each kernel file compiles its copy under its own flags.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cost_split.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdserve {
namespace {

// q [T, Hq, 64] bf16 (heads contiguous), caches [Hkv, blocks, block_size, 64], int32 block
// tables [S, W] and context [S], int64 query_start [S + 1]; `what` names the kernel
inline void check_prefill_args(const char* what, const at::Tensor& q, const at::Tensor& kc,
                               const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& qstart,
                               const at::Tensor& context) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kc.scalar_type() == at::kBFloat16 &&
                  vc.scalar_type() == at::kBFloat16,
              what, ": bfloat16 only");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 64 && q.stride(2) == 1 && q.stride(1) == 64 &&
                  kc.is_contiguous() && vc.is_contiguous() && kc.size(3) == 64,
              what, ": head_dim 64, q's heads and the caches contiguous");
  const int64_t Hq = q.size(1), Hk = kc.size(0), G = Hq / Hk;
  TORCH_CHECK(Hq % Hk == 0 && G >= 1 && G <= 4, what, ": 1-4 query heads a KV head");
  TORCH_CHECK(bt.scalar_type() == at::kInt && context.scalar_type() == at::kInt &&
                  qstart.scalar_type() == at::kLong && bt.is_contiguous() &&
                  context.is_contiguous() && qstart.is_contiguous(),
              what, ": int32 tables and context, int64 query_start");
  const int64_t S = bt.size(0);
  TORCH_CHECK(qstart.size(0) == S + 1 && context.size(0) == S, what,
              ": one query_start per sequence plus one, one context each");
}

// What both kernels' tasks read of the call: q's rows (row stride qs), the head counts,
// each sequence's query start and cached context, the scale and the output rows.
// Each kernel's Ctx adds its packed K/V on top.
struct PrefillRows {
  const uint16_t* q;
  int64_t qs, Hq, Hk, G;
  const int64_t* qstart;
  const int* ctx;
  float scale;
  uint16_t* out;
};

inline PrefillRows prefill_rows(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& qstart,
                                const at::Tensor& context, double scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), Hk = kc.size(0);
  return {reinterpret_cast<const uint16_t*>(q.data_ptr()),
          q.stride(0),
          Hq,
          Hk,
          Hq / Hk,
          qstart.data_ptr<int64_t>(),
          context.data_ptr<int>(),
          static_cast<float>(scale),
          reinterpret_cast<uint16_t*>(out.data_ptr())};
}

}  // namespace
}  // namespace pdserve
