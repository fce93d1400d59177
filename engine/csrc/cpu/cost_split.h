// Splitting tasks of unequal cost over the OpenMP threads: each thread takes the tasks whose
// cost midpoint falls in its equal share of the total, a contiguous range. at::parallel_for
// splits by count, which gave one thread 54% of a decode batch's keys (lengths 32-712).
// Used by the prefill attention kernels (through prefill_common.h) and paged decode
// attention. Internal linkage, as vec.h: each kernel file compiles its copy under its flags.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdserve {
namespace {

// the first task of thread th (of nt) when task i costs cost[i + 1] - cost[i]; thread th
// takes [first_task_of(th), first_task_of(th + 1)); first_task_of(nt) is the task count
inline int64_t first_task_of(const std::vector<int64_t>& cost, int64_t nt, int64_t th) {
  const int64_t n = static_cast<int64_t>(cost.size()) - 1;
  if (th >= nt) return n;
  const double total = static_cast<double>(std::max<int64_t>(cost.back(), 1));
  int64_t i = 0;  // owner(i) = min(nt - 1, floor(mid_i * nt / total)) never decreases
  while (i < n && std::min<int64_t>(nt - 1, static_cast<int64_t>(0.5 * (cost[i] + cost[i + 1]) *
                                                                 nt / total)) < th)
    ++i;
  return i;
}

// range(begin, end) once a thread, with that thread's tasks
template <typename Range>
void run_ranges_by_cost(const std::vector<int64_t>& cost, Range range) {
  const int64_t n = static_cast<int64_t>(cost.size()) - 1;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t th = b; th < e; ++th) {
      const int64_t lo = first_task_of(cost, nt, th), hi = first_task_of(cost, nt, th + 1);
      if (lo < hi) range(lo, hi);
    }
  });
}

// make() gives each thread its worker, called as worker(i) for each of its tasks
template <typename MakeWorker>
void run_by_cost(const std::vector<int64_t>& cost, MakeWorker make) {
  run_ranges_by_cost(cost, [&](int64_t lo, int64_t hi) {
    auto worker = make();
    for (int64_t i = lo; i < hi; ++i) worker(i);
  });
}

}  // namespace
}  // namespace pdserve
