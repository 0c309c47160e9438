// The kernels' scratch formulas (see scratch_model.h).
#include "kuai/plan/scratch_model.h"

#include <algorithm>

#include "kuai/backend/cpu/flash_attention.h"

namespace kuai::plan {
namespace {

int64_t clamp_threads(int threads, int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>(threads, items));
}

// Grouped-query attention's backward writes each query head's dk, dv to a (B, T, 2, H, d)
// buffer and sums them over the group after.
void kv_scratch(Scratch& s, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t d, DType t) {
  if (Hkv != H) s.push_back(B * T * 2 * H * d * static_cast<int64_t>(dtype_size(t)));
}

}  // namespace

Scratch attention_forward_scratch(bool flash, int64_t B, int64_t H, int64_t Hkv, int64_t T,
                                  int64_t d, DType dtype, int threads) {
  if (flash) {
    const int64_t blocks = (T + cpu::kFlashBlockQ - 1) / cpu::kFlashBlockQ;
    const int64_t n = clamp_threads(threads, B * H * blocks);
    return {4 * n * cpu::flash_forward_work_floats(d)};
  }
  const int64_t slots = dtype == DType::kF32 ? 1 : 2;
  return {4 * T * T * slots * clamp_threads(threads, B * H)};
}

Scratch attention_backward_scratch(bool flash, int64_t B, int64_t H, int64_t Hkv, int64_t T,
                                   int64_t d, DType dtype, int threads) {
  Scratch s;
  kv_scratch(s, B, H, Hkv, T, d, dtype);
  if (flash) {
    const int64_t nh = B * H, bq = cpu::kFlashBlockQBackward, bk = cpu::kFlashBlockKBackward;
    const int64_t qb = (T + bq - 1) / bq, kb = (T + bk - 1) / bk;
    const int64_t tmax = std::max(1, threads);
    const bool per_head = nh % tmax == 0 || nh >= 4 * tmax;
    const int64_t n = clamp_threads(threads, per_head ? nh : nh * std::max(qb, kb));
    const int64_t per_thread = 2 * bq * bk + 2 * bk * d + (per_head ? T * d : bq * d) + 2 * d;
    s.push_back(4 * per_thread * n);
    s.push_back(4 * nh * T);
    return s;
  }
  const int64_t slots = dtype == DType::kF32 ? 1 : 2;
  s.push_back(4 * T * T * slots * clamp_threads(threads, B * H));
  return s;
}

Scratch cross_entropy_scratch(int64_t rows, int64_t V, DType dtype, int threads) {
  if (dtype == DType::kF32 || rows <= 0) return {};
  constexpr int64_t kChunkElements = int64_t{1} << 16;
  const int64_t chunk =
      std::min(rows, std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, V)));
  const int64_t chunks = (rows + chunk - 1) / chunk;
  return {4 * clamp_threads(threads, chunks) * chunk * V};
}

Scratch sum_rows_scratch(int64_t rows, int64_t inner, DType dtype) {
  if (dtype == DType::kF32 || rows <= 0) return {};
  if (inner < 64) return {4 * rows * inner, 4 * inner};  // widened input and output
  const int64_t block = std::clamp<int64_t>((int64_t{1} << 20) / inner, 1, rows);
  return {4 * block * inner, 4 * inner, 4 * inner};
}

}  // namespace kuai::plan
