// fp32 evaluation of primitives over low-precision operands (see widen.h).
#include "kuai/backend/cpu/widen.h"

#include <memory>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/strided.h"
#include "kuai/core/allocator.h"
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

// The fp32 copies are kernel scratch (ScratchBytes): no op is dispatched from inside the eval, and
// a compiled step lends the bytes from its arena.
void eval_widened(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
  std::vector<std::unique_ptr<ScratchBytes>> held;
  auto fp32_scratch = [&](const Tensor& like) {
    held.push_back(std::make_unique<ScratchBytes>(static_cast<size_t>(like.numel()) * 4));
    return Tensor::borrow(held.back()->data(), like.shape(), DType::kF32, like.device());
  };
  std::vector<Tensor> in32(in.begin(), in.end());
  for (Tensor& t : in32) {
    if (!is_low(t.dtype())) continue;
    Tensor w = fp32_scratch(t);
    if (t.is_contiguous()) {
      convert(t.device_ptr(), t.dtype(), w.device_ptr(), DType::kF32, t.numel());
    } else {  // gathered into a contiguous low-precision buffer first
      const int64_t es = dtype_size(t.dtype());
      ScratchBytes packed(static_cast<size_t>(t.numel() * es));
      copy_strided(t.device_ptr(), t.strides(), packed.data(), contiguous_strides(t.shape()),
                   t.shape(), es);
      convert(packed.data(), t.dtype(), w.device_ptr(), DType::kF32, t.numel());
    }
    t = w;
  }
  std::vector<Tensor> out32(out.begin(), out.end());
  for (Tensor& t : out32)
    if (is_low(t.dtype())) t = fp32_scratch(t);
  p.eval_cpu(in32, out32);
  for (size_t j = 0; j < out.size(); ++j)
    if (is_low(out[j].dtype()))
      convert(out32[j].device_ptr(), DType::kF32, out[j].device_ptr(), out[j].dtype(),
              out[j].numel());
}

}  // namespace kuai::cpu
