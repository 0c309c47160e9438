// Automatic mixed precision: the autocast policy, applied at the dispatch point as a mode
// (core/dispatch.h: an enabling guard pushes it on the thread's mode stack), and the per-step
// cast cache. Inside an AutocastGuard(true, bf16|f16) every op's floating
// inputs are cast according to its Primitive::cast_policy():
//   kLowPrecision  matmul, linear, attention: inputs cast to the low dtype, outputs in it;
//   kFloat32       LayerNorm, softmax, reductions: low-precision inputs widened to fp32;
//   kAsIs          elementwise ops, views, casts, embedding, cross-entropy (which reads
//                  low-precision logits with fp32 arithmetic and keeps no fp32 copy).
// The casts are ordinary differentiable ops, so gradients flow back to the fp32 parameters
// (the master weights) through them. Casts of parameters (leaves that require grad) are cached
// until the outermost guard exits, so a weight is cast once per step however often it is used.
// Backward runs with autocast off (as in PyTorch): vjps see the dtypes the forward saved (the mode
// does not apply in backward).
// The table of which op runs in which dtype is in docs/mixed_precision.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "kuai/core/dispatch.h"
#include "kuai/core/primitive.h"

namespace kuai::amp {

bool autocast_enabled();
DType autocast_dtype();  // the low dtype (kBF16 or kF16) while enabled

// Enables (or disables) autocast for its scope. Guards nest; the cast cache is cleared when
// the outermost enabling guard exits.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled, DType dtype = DType::kBF16);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
  std::optional<ModeGuard> mode_;  // the autocast mode, pushed by a guard that turns it on
};

// What the mode does to each op: casts p's floating inputs per its policy (nothing when off).
void apply_autocast(const Primitive& p, std::vector<Tensor>& in);

void clear_autocast_cache();
// Casts of parameters performed since the counter was last reset (tests: once per step).
int64_t autocast_param_casts();
void reset_autocast_param_casts();

// "fp32" | "bf16" | "fp16" -> the compute dtype (kF32 for "fp32"); throws on anything else.
DType precision_dtype(std::string_view precision);

}  // namespace kuai::amp
