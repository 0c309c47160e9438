// The scratch each CPU kernel takes from the tracking allocator while it runs
// (Primitive::cpu_scratch), by the kernels' own formulas: each function names the allocation it
// states. tests/backend/cpu/test_scratch.cpp runs every kernel listed here and holds the
// allocator's peak during the run to these figures, byte for byte.
#include <omp.h>

#include <algorithm>

#include "kuai/backend/cpu/flash_attention.h"
#include "kuai/core/allocator.h"
#include "kuai/core/primitives.h"

namespace kuai {
namespace {

int64_t threads_for(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), items));
}

int64_t rounded(int64_t bytes) { return static_cast<int64_t>(Allocator::round_size(bytes)); }

// eval_attention.cpp grad_target: grouped-query attention's backward writes each query head's
// dk, dv to a (B, T, 2, H, d) buffer and sums them over the group after.
void kv_scratch(std::vector<int64_t>& s, const Tensor& q, const Tensor& k) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  if (k.size(1) != H)
    s.push_back(rounded(B * T * 2 * H * d * static_cast<int64_t>(dtype_size(q.dtype()))));
}

// eval_attention.cpp HeadScratch: per thread, T x T floats and d x T more (k^T or v^T for the
// small GEMM) in fp32, two T x T slots in low precision.
int64_t head_scratch(const Tensor& q) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  const bool f32 = q.dtype() == DType::kF32;
  // fp32: one T x T buffer and room for k^T or v^T (d x T); bf16/f16: two T x T buffers.
  const int64_t per_thread = f32 ? T * T + d * T : 2 * T * T;
  return rounded(4 * per_thread * threads_for(B * H));
}

// eval_nn.cpp for_widened_chunks: low-precision logits widened a chunk of rows per thread.
std::vector<int64_t> widened_chunks(const Tensor& logits) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (logits.dtype() == DType::kF32 || N <= 0) return {};
  constexpr int64_t kChunkElements = int64_t{1} << 16;
  const int64_t rows = std::min(N, std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, V)));
  const int64_t chunks = (N + rows - 1) / rows;
  return {rounded(4 * threads_for(chunks) * rows * V)};
}

}  // namespace

std::vector<int64_t> Attention::cpu_scratch(std::span<const Tensor> in,
                                            std::span<const Tensor>) const {
  return {head_scratch(in[0])};
}

std::vector<int64_t> AttentionBackward::cpu_scratch(std::span<const Tensor> in,
                                                    std::span<const Tensor>) const {
  std::vector<int64_t> s;
  kv_scratch(s, in[0], in[1]);
  s.push_back(head_scratch(in[0]));
  return s;
}

// flash_attention.cpp flash_attention_forward: `work`, per thread.
std::vector<int64_t> FlashAttention::cpu_scratch(std::span<const Tensor> in,
                                                 std::span<const Tensor>) const {
  const Tensor& q = in[0];
  const int64_t blocks = (q.size(2) + cpu::kFlashBlockQ - 1) / cpu::kFlashBlockQ;
  if (q.size(2) == 0) return {};
  return {rounded(4 * threads_for(q.size(0) * q.size(1) * blocks) *
                  cpu::flash_forward_work_floats(q.size(3)))};
}

// flash_attention.cpp flash_attention_backward: `work` per thread and `Ds` per head and row.
std::vector<int64_t> FlashAttentionBackward::cpu_scratch(std::span<const Tensor> in,
                                                         std::span<const Tensor>) const {
  const Tensor &q = in[0], &k = in[1];
  std::vector<int64_t> s;
  kv_scratch(s, q, k);
  const int64_t nh = q.size(0) * q.size(1), tq = q.size(2), tk = k.size(2), d = q.size(3);
  if (tk == 0) return s;
  const int64_t bq = cpu::kFlashBlockQBackward, bk = cpu::kFlashBlockKBackward;
  const int64_t qb = (tq + bq - 1) / bq, kb = (tk + bk - 1) / bk;
  const int64_t tmax = std::max(1, omp_get_max_threads());
  const bool per_head = nh % tmax == 0 || nh >= 4 * tmax;
  const int64_t n = threads_for(per_head ? nh : nh * std::max(qb, kb));
  const int64_t per_thread = cpu::flash_backward_work_floats(tq, d, per_head);
  s.push_back(rounded(4 * per_thread * n));
  s.push_back(rounded(4 * nh * tq));
  return s;
}

std::vector<int64_t> CrossEntropy::cpu_scratch(std::span<const Tensor> in,
                                               std::span<const Tensor>) const {
  return widened_chunks(in[0]);
}

std::vector<int64_t> CrossEntropyBackward::cpu_scratch(std::span<const Tensor> in,
                                                       std::span<const Tensor>) const {
  return widened_chunks(in[0]);
}

std::vector<int64_t> CrossEntropyWithGrad::cpu_scratch(std::span<const Tensor> in,
                                                       std::span<const Tensor>) const {
  return widened_chunks(in[0]);
}

// eval_reduce.cpp Sum::eval_cpu: a low-precision sum takes a block of rows widened, a row of
// partial sums and the fp32 accumulator; with rows shorter than 64 it is evaluated widened
// (widen.cpp: the input and the output in fp32).
std::vector<int64_t> Sum::cpu_scratch(std::span<const Tensor> in,
                                      std::span<const Tensor> out) const {
  const Tensor& x = in[0];
  if (x.dtype() == DType::kF32 && out[0].dtype() == DType::kF32) return {};
  const Shape& s = x.shape();
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim_; ++i) outer *= s[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(dim_) + 1; i < s.size(); ++i) inner *= s[i];
  if (inner < 64) return {rounded(4 * x.numel()), rounded(4 * out[0].numel())};
  const int64_t n = s[static_cast<size_t>(dim_)];
  const int64_t rows = std::clamp<int64_t>((int64_t{1} << 20) / inner, 1, n);
  return {rounded(4 * rows * inner), rounded(4 * inner), rounded(4 * outer * inner)};
}

}  // namespace kuai
