// fp32 evaluation of primitives over low-precision operands (see widen.h).
#include "kuai/backend/cpu/widen.h"

#include <vector>

#include "kuai/core/ops.h"

namespace kuai::cpu {
namespace {

bool is_low(DType t) { return t == DType::kBF16 || t == DType::kF16; }

}  // namespace

bool all_f32(std::span<const Tensor> in, std::span<const Tensor> out) {
  for (const Tensor& t : in)
    if (is_low(t.dtype())) return false;
  for (const Tensor& t : out)
    if (is_low(t.dtype())) return false;
  return true;
}

void eval_widened(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
  std::vector<Tensor> in32(in.begin(), in.end());
  for (Tensor& t : in32)
    if (is_low(t.dtype())) t = cast(t.detach(), DType::kF32);  // contiguous fp32 copy
  std::vector<Tensor> out32(out.begin(), out.end());
  for (Tensor& t : out32)
    if (is_low(t.dtype())) t = Tensor::empty(t.shape(), DType::kF32, t.device());
  p.eval_cpu(in32, out32);
  for (size_t j = 0; j < out.size(); ++j)
    if (is_low(out[j].dtype()))
      convert(out32[j].raw_data(), DType::kF32, out[j].raw_data(), out[j].dtype(), out[j].numel());
}

}  // namespace kuai::cpu
