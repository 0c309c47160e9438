// CPU evaluation of the reduction primitives.
#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/primitives.h"

namespace kuai {

void Sum::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Shape& s = in[0].shape();
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim_; ++i) outer *= s[i];
  for (size_t i = dim_ + 1; i < s.size(); ++i) inner *= s[i];
  cpu::sum_axis(in[0].data<float>(), out[0].data<float>(), outer, s[dim_], inner);
}

}  // namespace kuai
