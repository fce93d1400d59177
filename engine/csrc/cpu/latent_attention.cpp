// Paged decode attention over MLA's latent cache (DeepSeek-V3, engine/models/mla.py), in
// the absorbed form: each query head arrives as q_lat (q_nope @ W_UK, R values) and q_pe
// (P rotary values); a cached token is one row of R + P values [c | k_pe] shared by every
// head. score = [q_lat | q_pe] . [c | k_pe] * scale; out = softmax(score) @ c, R values a
// head (the caller applies W_UV). Used by engine/layers/cpu_latent_attention.py.
//
// The work is GEMM-shaped: every head of a sequence scores against the same rows, so for
// one sequence the scores are [rows x H, R + P] @ [L, R + P]^T. So, per sequence: gather
// its L real latent rows through its block table (no padding to the batch's widest table,
// which the torch path pays), two library GEMMs (oneDNN / MKL: AMX on CPUs that have it),
// the softmax in float32 over each row's own length. A scalar kernel that read each row once
// for all heads was 4-22x slower than the GEMMs (docs/perf/HISTORY.md).

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace pdserve {

at::Tensor latent_decode_attention(at::Tensor q_lat, at::Tensor q_pe, at::Tensor cache,
                                   at::Tensor bt, at::Tensor kvlen, int64_t rows, double scale) {
  TORCH_CHECK(q_lat.dim() == 3 && q_pe.dim() == 3 && cache.dim() == 4,
              "latent_decode_attention: q_lat [N, H, R], q_pe [N, H, P], cache [1, B, S, R+P]");
  const int64_t N = q_lat.size(0), H = q_lat.size(1), R = q_lat.size(2);
  const int64_t RP = R + q_pe.size(2);
  TORCH_CHECK(cache.size(0) == 1 && cache.size(3) == RP && cache.is_contiguous(),
              "latent_decode_attention: a contiguous cache of rows R + P wide");
  TORCH_CHECK(
      q_lat.scalar_type() == cache.scalar_type() && q_pe.scalar_type() == cache.scalar_type(),
      "latent_decode_attention: q and cache dtypes differ");
  TORCH_CHECK(bt.scalar_type() == at::kInt && kvlen.scalar_type() == at::kInt,
              "latent_decode_attention: block tables and lengths are int32");
  TORCH_CHECK(rows >= 1 && kvlen.size(0) == N && N % rows == 0 && bt.size(0) * rows >= N,
              "latent_decode_attention: one KV length a row, `rows` rows a sequence");
  const int64_t B = N / rows, BS = cache.size(2), W = bt.size(1);
  const at::Tensor flat = cache.view({-1, RP});
  const at::Tensor q = at::cat({q_lat, q_pe}, -1);  // [N, H, R + P]
  const at::Tensor tables = bt.contiguous(), lens = kvlen.contiguous();
  const int* btp = tables.data_ptr<int>();
  const int* lp = lens.data_ptr<int>();
  at::Tensor out = at::empty({N, H, R}, q_lat.options());
  const at::Tensor in_block = at::arange(BS, tables.options().dtype(at::kLong));
  for (int64_t b = 0; b < B; ++b) {
    // the run's last row sees the most: its length bounds the rows gathered
    int64_t L = 0;
    for (int64_t j = 0; j < rows; ++j) L = std::max<int64_t>(L, lp[b * rows + j]);
    L = std::min(L, W * BS);  // never read past the table
    const int64_t nblk = (L + BS - 1) / BS;
    at::Tensor blocks = at::empty({nblk}, in_block.options());
    int64_t* bp = blocks.data_ptr<int64_t>();
    for (int64_t j = 0; j < nblk; ++j) bp[j] = static_cast<int64_t>(btp[b * W + j]) * BS;
    const at::Tensor slots = (blocks.unsqueeze(1) + in_block.unsqueeze(0)).view(-1).narrow(0, 0, L);
    const at::Tensor lat = flat.index_select(0, slots);  // [L, R + P]
    const at::Tensor qb = q.narrow(0, b * rows, rows).reshape({rows * H, RP});
    at::Tensor s = at::mm(qb, lat.t()).to(at::kFloat).mul_(scale);  // [rows x H, L]
    for (int64_t j = 0; j < rows; ++j) {  // row j sees its own length only
      const int64_t lj = std::min<int64_t>(lp[b * rows + j], L);
      if (lj < L)
        s.narrow(0, j * H, H).narrow(1, lj, L - lj).fill_(-std::numeric_limits<float>::infinity());
    }
    const at::Tensor p = at::softmax(s, -1).to(cache.scalar_type());
    out.narrow(0, b * rows, rows).copy_(at::mm(p, lat.narrow(1, 0, R)).view({rows, H, R}));
  }
  return out;
}

}  // namespace pdserve
