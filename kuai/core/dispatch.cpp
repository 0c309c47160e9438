// The single dispatch point (see dispatch.h).
#include "kuai/core/dispatch.h"

#include <fmt/format.h>

#include <chrono>
#include <optional>
#include <stdexcept>

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/ops.h"
#include "kuai/core/profiler.h"

namespace kuai {

void Primitive::eval_cuda(std::span<const Tensor>, std::span<Tensor>) const {
  throw std::runtime_error(fmt::format("{} has no CUDA implementation in this build", name()));
}

void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
  // Bytes given back (a ZeRO-3 parameter outside its unit's forward and backward): an error
  // naming the op, not a read of freed memory.
  auto check = [&p](const Tensor& t, const char* role, size_t i) {
    if (t.defined() && t.has_storage() && t.storage()->released)
      throw std::runtime_error(fmt::format(
          "{}: {} {} ({}) is over bytes that were released (a ZeRO-3 parameter is whole only "
          "while its unit runs forward or backward)",
          p.name(), role, i, t.str()));
  };
  for (size_t i = 0; i < in.size() && !p.storage_op(); ++i) check(in[i], "input", i);
  for (size_t j = 0; j < out.size(); ++j) check(out[j], "output", j);
  const Device d =
      in.empty() ? (out.empty() ? p.output_device() : out[0].device()) : in[0].device();
  const bool profile = profiler::enabled();
  // The bytes are taken before evaluation: an output may take over an input's buffer.
  Cost cost;
  if (profile) cost = p.cost(in, {out.data(), out.size()});
  const auto t0 =
      profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  backend_for(d).evaluate(p, in, out);
  if (profile)
    profiler::record(
        p.name(),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
        0.0, static_cast<double>(cost.bytes_read + cost.bytes_written));
}

namespace {

std::vector<DispatchMode*>& mode_stack() {
  thread_local std::vector<DispatchMode*> stack;
  return stack;
}

}  // namespace

ModeGuard::ModeGuard(DispatchMode& mode) : mode_(&mode) { mode_stack().push_back(mode_); }

ModeGuard::~ModeGuard() {
  std::vector<DispatchMode*>& s = mode_stack();
  if (s.empty() || s.back() != mode_) std::terminate();  // guards must nest
  s.pop_back();
}

NoModesGuard::NoModesGuard() { saved_.swap(mode_stack()); }

NoModesGuard::~NoModesGuard() {
  if (!mode_stack().empty()) std::terminate();  // guards must nest
  saved_.swap(mode_stack());
}

std::span<DispatchMode* const> active_modes() { return mode_stack(); }

bool recording() {
  for (const DispatchMode* m : mode_stack())
    if (m->records()) return true;
  return false;
}

namespace {

// An input's buffer can take an output when one tensor object alone holds the storage (the op's
// own saved copy), it covers the whole storage, and shape and dtype match.
bool can_reuse(const Tensor& t, const Tensor& original, const TensorSpec& spec) {
  return !original.requires_grad() && t.storage().use_count() == 1 && t.offset() == 0 &&
         t.is_contiguous() && t.dtype() == spec.dtype && t.shape() == spec.shape &&
         static_cast<int64_t>(t.storage()->nbytes) == t.nbytes();
}

}  // namespace

std::vector<Tensor> dispatch(std::shared_ptr<const Primitive> p, std::vector<Tensor> in) {
  // The modes, outermost first (a copy: a mode may dispatch ops of its own, which see the
  // whole stack again). Empty, and free, when no mode is on.
  std::vector<DispatchMode*> modes;
  bool dry = false;  // a dry mode: outputs on meta, nothing evaluated (DispatchMode::dry)
  if (const std::span<DispatchMode* const> live = active_modes(); !live.empty()) {
    const bool in_backward = autograd::backward_in_progress();
    for (DispatchMode* m : live)
      if (!in_backward || m->applies_in_backward()) {
        modes.push_back(m);
        dry = dry || m->dry();
      }
  }
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].defined())
      throw std::invalid_argument(fmt::format("{}: input {} is undefined", p->name(), i));
    if (in[i].device() != in[0].device() && !dry)
      throw std::invalid_argument(fmt::format("{}: inputs on different devices ({} and {})",
                                              p->name(), in[0].device().str(),
                                              in[i].device().str()));
  }
  for (DispatchMode* m : modes) m->transform_inputs(*p, in);
  // The graph edges follow the caller's tensors; the kernels see contiguous copies if needed.
  // An input the primitive writes is used as it is: it must be contiguous.
  std::vector<Tensor> graph_in = in;
  for (size_t i = 0; i < in.size(); ++i) {
    if (p->is_view() || p->accepts_strided(i) || in[i].is_contiguous()) continue;
    if (p->mutates_input(i))
      throw std::invalid_argument(
          fmt::format("{}: input {} is written in place and must be contiguous, got {}", p->name(),
                      i, in[i].str()));
    in[i] = contiguous(in[i].detach());
  }

  std::vector<Tensor> out;
  if (p->is_view()) {
    out = p->make_views(in);
    for (DispatchMode* m : modes) m->intercept(*p, in, out);  // recorded; nothing to evaluate
  } else {
    std::vector<TensorSpec> specs = p->infer(in);
    const Device device = dry ? kMeta : in.empty() ? p->output_device() : in[0].device();
    std::optional<MemoryUseScope> captured;  // a dry op's outputs hold no memory of the step
    if (dry) captured.emplace(MemoryUse::kCaptured);
    out.reserve(specs.size());
    for (size_t j = 0; j < specs.size(); ++j) {
      const TensorSpec& s = specs[j];
      const int r = p->reusable_input(j);
      if (r >= 0 && can_reuse(in[r], graph_in[r], s)) {
        out.push_back(Tensor::view_of(in[r], s.shape, contiguous_strides(s.shape), 0));
        continue;
      }
      out.push_back(Tensor::empty(s.shape, s.dtype, device));
    }
    captured.reset();
    bool handled = false;
    for (DispatchMode* m : modes) handled = m->intercept(*p, in, out) || handled;
    if (!handled && !dry) evaluate(*p, in, out);
  }

  // An in-place update (optimizer, scaler) is outside autograd.
  if (autograd::GradMode::enabled() && !p->updates_in_place())
    autograd::record(p, graph_in, in, out);
  return out;
}

}  // namespace kuai
