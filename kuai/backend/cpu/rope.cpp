// Rotary position embedding (RoPE; Su et al., 2021) in the Hugging Face layout ("rotate half"):
// dimension i < d/2 of a head is paired with i + d/2 and the pair is rotated by the angle
// p theta^(-2i/d) at position p:
//   y[i]       = x[i] cos - x[i + d/2] sin
//   y[i + d/2] = x[i + d/2] cos + x[i] sin
// The inverse rotation (the backward: a rotation's transpose is its inverse) flips the sign of
// sin. The angles are the fp32 ones of the reference implementations (below); their cosines and
// sines are computed in double and rounded once, per (theta, d) in a table shared by all calls
// and grown when a longer sequence comes. Storage is
// fp32, bf16 or f16; the arithmetic is fp32 and each output is rounded once.
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

struct Table {
  int64_t positions = 0;
  std::vector<float> cos, sin;  // (positions, d/2)
};

std::shared_ptr<const Table> rope_table(double theta, int64_t d, int64_t positions) {
  static std::mutex mu;
  static std::map<std::pair<double, int64_t>, std::shared_ptr<const Table>> tables;
  const std::lock_guard<std::mutex> lock(mu);
  auto& slot = tables[{theta, d}];
  if (slot && slot->positions >= positions) return slot;
  auto t = std::make_shared<Table>();
  // Grown to the next power of two, so a run that lengthens its sequences rebuilds it rarely.
  t->positions = 64;
  while (t->positions < positions) t->positions *= 2;
  const int64_t half = d / 2;
  t->cos.resize(static_cast<size_t>(t->positions * half));
  t->sin.resize(t->cos.size());
  for (int64_t i = 0; i < half; ++i) {
    // The reference implementations' fp32 angles (Meta's and Hugging Face's: inv_freq = 1 /
    // theta^(2i/d) and p * inv_freq each rounded to float), so that a checkpoint trained with
    // them sees its own positions here; their cosines and sines are then rounded once.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(d);
    const float power = static_cast<float>(
        std::pow(static_cast<double>(static_cast<float>(theta)), static_cast<double>(exponent)));
    const float inv_freq = 1.0f / power;
    for (int64_t p = 0; p < t->positions; ++p) {
      const double a = static_cast<double>(static_cast<float>(p) * inv_freq);
      t->cos[p * half + i] = static_cast<float>(std::cos(a));
      t->sin[p * half + i] = static_cast<float>(std::sin(a));
    }
  }
  slot = t;  // callers holding the old table keep it alive
  return slot;
}

// One head vector of d = 2 half elements (fp32), rotated into y. s is +sin or -sin.
KUAI_KERNEL void rotate_kernel(const float* x, float* y, const float* c, const float* s,
                               int64_t half, float sign) {
#pragma GCC ivdep
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half], si = sign * s[i];
    y[i] = x1 * c[i] - x2 * si;
    y[i + half] = x2 * c[i] + x1 * si;
  }
}
KUAI_CLONE(rotate, rotate_kernel)

}  // namespace

void rope(const RopeArgs& a) {
  const int64_t B = a.B, T = a.T, NH = a.heads, d = a.d, half = d / 2;
  if (B <= 0 || T <= 0 || NH <= 0 || d <= 0) return;
  const std::shared_ptr<const Table> table = rope_table(a.theta, d, a.pos0 + T);
  const float* cos = table->cos.data() + a.pos0 * half;
  const float* sin = table->sin.data() + a.pos0 * half;
  const float sign = a.inverse ? -1.0f : 1.0f;
  const size_t es = dtype_size(a.dtype);
  // Rows (b, t) in parallel: each is NH heads of d elements, written contiguously.
  const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 13) / (NH * d));
  parallel_chunks(B * T, rows_per_task, [&](int64_t r0, int64_t r1) {
    std::vector<float> xin, yout;  // bf16 / f16 heads widened here
    if (a.dtype != DType::kF32) {
      xin.resize(static_cast<size_t>(d));
      yout.resize(static_cast<size_t>(d));
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      for (int64_t h = 0; h < NH; ++h) {
        const char* src =
            static_cast<const char*>(a.x) +
            static_cast<size_t>(b * a.stride_b + t * a.stride_t + h * a.stride_h) * es;
        char* dst = static_cast<char*>(a.y) + static_cast<size_t>((r * NH + h) * d) * es;
        if (h >= a.rotated_heads) {  // carried over unrotated (v beside q and k)
          if (src != dst) std::memcpy(dst, src, d * es);  // in place: already there
          continue;
        }
        if (a.dtype == DType::kF32) {
          rotate(reinterpret_cast<const float*>(src), reinterpret_cast<float*>(dst), cos + t * half,
                 sin + t * half, half, sign);
          continue;
        }
        convert_serial(src, a.dtype, xin.data(), DType::kF32, d);
        rotate(xin.data(), yout.data(), cos + t * half, sin + t * half, half, sign);
        convert_serial(yout.data(), DType::kF32, dst, a.dtype, d);
      }
    }
  });
}

}  // namespace kuai::cpu
