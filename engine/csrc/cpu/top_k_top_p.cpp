// Top-k / top-p masking of float32 sampling logits from each row's likely tokens only. Used
// by engine/top_k_top_p.py (apply_top_k_top_p) on a CPU.
//
// Why: the definition (top_k_top_p.py top_k_top_p_sorted) sorts every row; from torch's
// topk of 1,024 candidates it still costs ~10 ms a batch-64 step of a 49,152-token
// vocabulary plus a dozen passes over [rows, vocab] to build the mask, most of a decode
// step. A nucleus lives among the tokens of non-negligible probability, so a row here is
// one pass to collect the tokens with probability >= EPS_PROBS[i] (at most 1 / EPS of
// them), a partial sort of those as far as the cut, and one pass to write the mask.
//
// Same result as the definition: a stable descending sort (ties toward the lower token
// id) of which the first k survive top-k, then the smallest prefix of the survivors whose
// mass (normalised over the survivors) reaches p, within TOP_P_EPS; the kept logits are
// copied, the others are -inf. The tokens collected are the first ones of that sorted
// order, so the cut is decided among them when
// - top-k only: at least k tokens were collected;
// - top-p over top-k (k < V): at least k (the survivors' mass is then known exactly);
// - top-p over the whole row: the collected mass reaches p.
// Otherwise the row is collected again at the next threshold, and a row no threshold
// decides (a nearly flat distribution with p near 1, a NaN or an infinity) is reported
// undecided for the caller's general path.

#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace pdserve {

namespace {

constexpr double EPS_PROBS[] = {1e-4, 1e-9};

struct Cand {
  float x;
  int64_t id;
};

bool before_in_order(const Cand& a, const Cand& b) {  // the stable descending sort's order
  return a.x > b.x || (a.x == b.x && a.id < b.id);
}

// The row's kept count, or -1 when the candidates at this threshold do not decide it. The
// first `kept` entries of `cand` are then the kept tokens (in no particular order past the
// sorted prefix). Only as much of the order as the cut needs is sorted: the first 64, then
// 4x more each round (a peaked row's nucleus is a few dozen tokens of thousands).
int64_t cut(std::vector<Cand>& cand, int64_t k, int64_t V, double p, double lse, double slack) {
  const int64_t n = static_cast<int64_t>(cand.size());
  if (k < V && n < k) return -1;  // the top-k reaches below the collected tokens
  const int64_t kk = std::min(k, n);
  const auto first = cand.begin();
  if (kk < n) std::nth_element(first, first + kk - 1, cand.end(), before_in_order);
  if (!(p < 1.0)) return kk;  // top-k only: the survivors' set is the answer
  double norm = lse;          // top-p over the whole row: its log-sum-exp
  if (k < V) {                // over the top-k survivors: theirs
    float top = cand[0].x;
    for (int64_t i = 1; i < kk; ++i) top = std::max(top, cand[i].x);
    double s = 0.0;
    for (int64_t i = 0; i < kk; ++i) s += std::exp(static_cast<double>(cand[i].x) - top);
    norm = top + std::log(s);
  }
  double before = 0.0;  // mass strictly before token i
  for (int64_t done = 0, m = std::min<int64_t>(kk, 64);; done = m, m = std::min(kk, 4 * m)) {
    if (m < kk) std::nth_element(first + done, first + m - 1, first + kk, before_in_order);
    std::sort(first + done, first + m, before_in_order);
    for (int64_t i = done; i < m; ++i) {
      if (i > 0 && before >= p - slack) return i;
      before += std::exp(static_cast<double>(cand[i].x) - norm);
    }
    if (m == kk) break;
  }
  return k < V ? kk : -1;  // every survivor kept, or the nucleus reaches past the tokens
}

}  // namespace

std::vector<at::Tensor> top_k_top_p_cut(at::Tensor logits, at::Tensor lse, at::Tensor top_k,
                                        at::Tensor top_p, double slack) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "top_k_top_p_cut: logits must be a contiguous CPU float32 [rows, vocab] tensor");
  const int64_t N = logits.size(0), V = logits.size(1);
  const bool has_k = top_k.numel() > 0, has_p = top_p.numel() > 0;
  TORCH_CHECK(!has_k || (top_k.numel() == N && top_k.scalar_type() == at::kLong),
              "top_k_top_p_cut: top_k must be int64 [rows] or empty");
  TORCH_CHECK(!has_p || (top_p.numel() == N && top_p.scalar_type() == at::kFloat),
              "top_k_top_p_cut: top_p must be float32 [rows] or empty");
  TORCH_CHECK(!has_p || (lse.numel() == N && lse.scalar_type() == at::kFloat),
              "top_k_top_p_cut: lse must be the rows' float32 log-sum-exp with top_p");
  const at::Tensor tk = has_k ? top_k.contiguous() : top_k;
  const at::Tensor tp = has_p ? top_p.contiguous() : top_p;
  const at::Tensor ls = has_p ? lse.contiguous() : lse;
  auto out = at::empty_like(logits);
  auto decided = at::zeros({N}, logits.options().dtype(at::kBool));
  const float* xp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  bool* dp = decided.data_ptr<bool>();
  const int64_t* kp = has_k ? tk.data_ptr<int64_t>() : nullptr;
  const float* pp = has_p ? tp.data_ptr<float>() : nullptr;
  const float* lp = has_p ? ls.data_ptr<float>() : nullptr;
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Cand> cand;
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = xp + r * V;
      float* o = op + r * V;
      const int64_t k = kp && kp[r] > 0 ? std::min(kp[r], V) : V;
      const double p = pp ? pp[r] : 1.0;
      if (k >= V && !(p < 1.0)) {  // keeps everything
        std::copy(x, x + V, o);
        dp[r] = true;
        continue;
      }
      // top-k only needs no normaliser: collect from the row's maximum instead
      float top = NEG_INF;
      bool finite = true;
      for (int64_t j = 0; j < V; ++j) {
        top = std::max(top, x[j]);
        finite &= std::isfinite(x[j]);
      }
      const double base = lp ? static_cast<double>(lp[r]) : static_cast<double>(top);
      if (!finite || !std::isfinite(base)) continue;  // the general path decides
      int64_t kept = -1;
      for (const double eps : EPS_PROBS) {
        const float thr = static_cast<float>(base + std::log(eps));
        cand.clear();
        for (int64_t j = 0; j < V; ++j)
          if (x[j] >= thr) cand.push_back({x[j], j});
        kept = cut(cand, k, V, p, base, slack);
        if (kept >= 0) break;
      }
      if (kept < 0) continue;
      std::fill(o, o + V, NEG_INF);
      for (int64_t i = 0; i < kept; ++i) o[cand[i].id] = cand[i].x;
      dp[r] = true;
    }
  });
  return {out, decided};
}

}  // namespace pdserve
