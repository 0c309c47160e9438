// Splits a 1-D range into fixed-size chunks and runs them on the OpenMP team. The chunk size is
// a property of the kernel (large enough that a chunk amortises the fork, small enough to balance
// two cores), never of the thread count, so chunk boundaries and any per-chunk partial results
// are the same whatever OMP_NUM_THREADS is. Ranges of one chunk run inline without a fork, and so
// does every range inside an active parallel region (a kernel called per item of an outer loop,
// as attention's per-head softmax is), where a nested team would have one thread anyway.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace kuai::cpu {

// Calls fn(begin, end) for consecutive [begin, end) pieces of [0, n) of at most `chunk` items.
// Static schedule: each thread gets one contiguous run of chunks (good for hardware prefetch).
template <class Fn>
void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  if (n <= 0) return;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  auto run = [&](int64_t c) {
    const int64_t begin = c * chunk;
    fn(begin, std::min(n, begin + chunk));
  };
  // A parallel construct whose `if` is false still forms a team of one (libgomp allocates and
  // starts it: microseconds), so the inline cases do not reach the pragma at all.
  if (nchunks == 1 || omp_in_parallel()) {
    for (int64_t c = 0; c < nchunks; ++c) run(c);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) run(c);
}

// Calls fn(t) for each task t in [0, ntasks), in parallel only when `parallel` (callers pass a
// size test so that small problems do not pay for the fork) and not already inside a parallel
// region.
template <class Fn>
void parallel_tasks(int64_t ntasks, bool parallel, Fn&& fn) {
  if (!parallel || ntasks <= 1 || omp_in_parallel()) {
    for (int64_t t = 0; t < ntasks; ++t) fn(t);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < ntasks; ++t) fn(t);
}

}  // namespace kuai::cpu
