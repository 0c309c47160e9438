// The single dispatch point (see dispatch.h).
#include "kuai/core/dispatch.h"

#include <fmt/format.h>

#include <chrono>
#include <stdexcept>

#include "kuai/amp/autocast.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/profiler.h"

namespace kuai {

void Primitive::eval_cuda(std::span<const Tensor>, std::span<Tensor>) const {
  throw std::runtime_error(fmt::format("{} has no CUDA implementation in this build", name()));
}

void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
  const Device d = in.empty() ? (out.empty() ? kCPU : out[0].device()) : in[0].device();
  const bool profile = profiler::enabled();
  const auto t0 =
      profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  if (d.type == DeviceType::kCPU)
    p.eval_cpu(in, out);
  else
    p.eval_cuda(in, out);
  if (profile)
    profiler::record(
        p.name(),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
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
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].defined())
      throw std::invalid_argument(fmt::format("{}: input {} is undefined", p->name(), i));
    if (in[i].device() != in[0].device())
      throw std::invalid_argument(fmt::format("{}: inputs on different devices ({} and {})",
                                              p->name(), in[0].device().str(),
                                              in[i].device().str()));
  }
  amp::apply_autocast(*p, in);  // identity unless autocast is on
  // The graph edges follow the caller's tensors; the kernels see contiguous copies if needed.
  std::vector<Tensor> graph_in = in;
  for (size_t i = 0; i < in.size(); ++i)
    if (!p->is_view() && !p->accepts_strided(i) && !in[i].is_contiguous())
      in[i] = contiguous(in[i].detach());

  std::vector<Tensor> out;
  if (p->is_view()) {
    out = p->make_views(in);
  } else {
    std::vector<TensorSpec> specs = p->infer(in);
    const Device device = in.empty() ? kCPU : in[0].device();
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
    evaluate(*p, in, out);
  }

  if (autograd::GradMode::enabled()) autograd::record(p, graph_in, in, out);
  return out;
}

}  // namespace kuai
