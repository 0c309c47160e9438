// The capture mode (see capture.h).
#include "kuai/compile/capture.h"

#include <fmt/format.h>

#include <stdexcept>

#include "kuai/core/autograd.h"

namespace kuai::compile {

int CaptureMode::new_value(const Tensor& t, int producer, bool view) {
  Value v;
  v.shape = t.shape();
  v.dtype = t.dtype();
  v.producer = producer;
  v.view = view;
  if (producer < 0) v.external = t;
  const int id = static_cast<int>(graph_.values.size());
  graph_.values.push_back(std::move(v));
  ids_[t.impl()] = Known{t.impl_ptr(), id};
  return id;
}

int CaptureMode::value_of(const Tensor& t) {
  auto it = ids_.find(t.impl());
  if (it != ids_.end() && it->second.impl.lock().get() == t.impl()) return it->second.id;
  return new_value(t, -1, false);
}

bool CaptureMode::intercept(const Primitive& p, std::span<const Tensor> in,
                            std::span<Tensor> out) {
  Node node;
  node.primitive = p.shared_from_this();  // primitives are immutable and shared
  node.backward = autograd::backward_in_progress();
  for (size_t i = 0; i < in.size(); ++i) {
    const int id = value_of(in[i]);
    node.inputs.push_back(id);
    if (p.mutates_input(i)) graph_.values[static_cast<size_t>(id)].written = true;
  }
  const int index = static_cast<int>(graph_.nodes.size());
  for (const Tensor& o : out) node.outputs.push_back(new_value(o, index, p.is_view()));
  graph_.nodes.push_back(std::move(node));
  return false;  // the op runs as usual
}

void CaptureMode::mark_output(const std::string& name, const Tensor& t) {
  auto it = ids_.find(t.impl());
  if (it == ids_.end() || it->second.impl.lock().get() != t.impl())
    throw std::invalid_argument(
        fmt::format("capture: output '{}' ({}) was not made by the captured code", name, t.str()));
  graph_.outputs.emplace_back(name, it->second.id);
}

Graph capture(const std::function<void()>& step, const std::function<void(CaptureMode&)>& outputs) {
  CaptureMode mode;
  {
    ModeGuard guard(mode);
    step();
    if (outputs) outputs(mode);
  }
  return mode.take();
}

}  // namespace kuai::compile
