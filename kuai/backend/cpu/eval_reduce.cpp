// CPU evaluation of the reduction primitives.
#include <algorithm>
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/widen.h"

#include "kuai/backend/cpu/convert.h"
#include "kuai/core/allocator.h"
#include "kuai/core/primitives.h"

namespace kuai {

void Sum::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Shape& s = in[0].shape();
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim_; ++i) outer *= s[i];
  for (size_t i = dim_ + 1; i < s.size(); ++i) inner *= s[i];
  if (!cpu::all_f32(in, out)) {
    if (inner < 64) return cpu::eval_widened(*this, in, out);
    // Low precision (bias gradients under autocast): blocks of rows widened into one bounded fp32
    // buffer, partial sums added in a fixed order, one rounding at the end.
    const int64_t n = s[dim_], rows = std::clamp<int64_t>((1 << 20) / inner, 1, n);
    const DType t = in[0].dtype();
    ScratchFloats block(rows * inner), part(inner), acc(outer * inner);
    for (int64_t o = 0; o < outer; ++o) {
      float* a = acc.data() + o * inner;
      cpu::fill(a, 0.0f, inner);
      for (int64_t r0 = 0; r0 < n; r0 += rows) {
        const int64_t m = std::min(rows, n - r0);
        convert(static_cast<const char*>(in[0].device_ptr()) + (o * n + r0) * inner * dtype_size(t),
                t, block.data(), DType::kF32, m * inner);
        cpu::sum_axis(block.data(), part.data(), 1, m, inner);
        cpu::add(a, part.data(), a, inner);
      }
    }
    convert(acc.data(), DType::kF32, out[0].device_ptr(), out[0].dtype(), outer * inner);
    return;
  }
  cpu::sum_axis(in[0].device_data<float>(), out[0].device_data<float>(), outer, s[dim_], inner);
}

}  // namespace kuai
