// Autocast state, policy application and the parameter cast cache (see autocast.h).
#include "kuai/amp/autocast.h"

#include "kuai/core/allocator.h"

#include <fmt/format.h>

#include <stdexcept>
#include <unordered_map>

#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"

namespace kuai::amp {
namespace {

struct CacheEntry {
  std::weak_ptr<TensorImpl> source;  // guards against a freed parameter's address being reused
  Tensor cast;
};

struct State {
  bool enabled = false;
  DType dtype = DType::kBF16;
  int depth = 0;  // enabling guards alive
  std::unordered_map<const TensorImpl*, CacheEntry> cache;
  int64_t param_casts = 0;
};

State& state() {
  thread_local State s;
  return s;
}

bool is_low(DType t) { return t == DType::kBF16 || t == DType::kF16; }

Tensor cast_input(const Tensor& t, DType to) {
  State& s = state();
  // Parameters: leaves that require grad. Their casts are reused until the step ends.
  if (t.is_leaf() && t.requires_grad()) {
    auto it = s.cache.find(t.impl());
    if (it != s.cache.end() && it->second.cast.dtype() == to && !it->second.source.expired() &&
        it->second.source.lock().get() == t.impl()) {
      // Reused (a later micro-batch, or a second use): its node and the parameter's
      // AccumulateGrad run right after this use's consumer in backward, not after everything
      // else, holding each weight's gradient until the end (autograd.h, next_sequence).
      if (const auto& fn = it->second.cast.grad_fn(); fn && autograd::GradMode::enabled()) {
        fn->sequence = autograd::next_sequence();
        for (const autograd::Edge& e : fn->next)  // the parameter's AccumulateGrad, after it
          if (e.node) e.node->sequence = autograd::next_sequence();
      }
      return it->second.cast;
    }
    Tensor c;
    {
      const MemoryUseScope kept(MemoryUse::kWeightCasts);
      c = cast(t, to);
    }
    ++s.param_casts;
    s.cache[t.impl()] = CacheEntry{t.impl_ptr(), c};
    return c;
  }
  return cast(t, to);
}

// The mode on the dispatch stack; the policy state it reads is per thread.
class AutocastMode final : public DispatchMode {
 public:
  void transform_inputs(const Primitive& p, std::vector<Tensor>& in) override {
    apply_autocast(p, in);
  }
  bool applies_in_backward() const override { return false; }
};

AutocastMode g_mode;

}  // namespace

// Off inside backward, where the mode does not apply.
bool autocast_enabled() { return state().enabled && !autograd::backward_in_progress(); }
DType autocast_dtype() { return state().dtype; }

AutocastGuard::AutocastGuard(bool enabled, DType dtype)
    : prev_enabled_(state().enabled), prev_dtype_(state().dtype) {
  if (enabled && !is_low(dtype))
    throw std::invalid_argument(
        fmt::format("autocast: dtype must be bfloat16 or float16, got {}", dtype_name(dtype)));
  State& s = state();
  if (enabled && !s.enabled) mode_.emplace(g_mode);
  s.enabled = enabled;
  if (enabled) {
    s.dtype = dtype;
    ++s.depth;
  }
}

AutocastGuard::~AutocastGuard() {
  State& s = state();
  if (s.enabled && --s.depth == 0) s.cache.clear();
  s.enabled = prev_enabled_;
  s.dtype = prev_dtype_;
}

// A parameter kept in the compute dtype with its fp32 master elsewhere (train.offload_master)
// stands in for the cast autocast would make of it: exact for products, which cast it anyway, and
// wrong for anything else, which would have read the fp32 master. Views are let through (the
// models take none of such a parameter; a view's consumer is not traced back to it).
static void check_master_elsewhere(const Primitive& p, const std::vector<Tensor>& in) {
  if (p.cast_policy() == CastPolicy::kLowPrecision || p.is_view()) return;
  for (const Tensor& t : in)
    if (t.defined() && t.impl()->master_elsewhere)
      throw std::invalid_argument(fmt::format(
          "{}: reads the parameter {} whose fp32 master weights are offloaded "
          "(train.offload_master); only products (linear, matmul) may use such a parameter",
          p.name(), t.str()));
}

void apply_autocast(const Primitive& p, std::vector<Tensor>& in) {
  State& s = state();
  if (!s.enabled) return;
  check_master_elsewhere(p, in);
  switch (p.cast_policy()) {
    case CastPolicy::kAsIs:
      return;
    case CastPolicy::kLowPrecision:
      for (Tensor& t : in)
        if (is_floating(t.dtype()) && t.dtype() != s.dtype) t = cast_input(t, s.dtype);
      return;
    case CastPolicy::kFloat32:
      for (Tensor& t : in)
        if (is_low(t.dtype())) t = cast(t, DType::kF32);
      return;
  }
}

void clear_autocast_cache() { state().cache.clear(); }
int64_t autocast_param_casts() { return state().param_casts; }
void reset_autocast_param_casts() { state().param_casts = 0; }

DType precision_dtype(std::string_view precision) {
  if (precision == "fp32") return DType::kF32;
  if (precision == "bf16") return DType::kBF16;
  if (precision == "fp16") return DType::kF16;
  throw std::invalid_argument(
      fmt::format("precision must be \"fp32\", \"bf16\" or \"fp16\", got \"{}\"", precision));
}

}  // namespace kuai::amp
