// The capture mode (see capture.h).
#include "kuai/compile/capture.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/primitives.h"

namespace kuai::compiler {

CaptureMode::Key CaptureMode::key_of(const Tensor& t) {
  return {t.storage().get(), t.offset(), t.shape(), t.strides(), t.dtype()};
}

int CaptureMode::new_value(const Tensor& t, int producer, bool view) {
  Value v;
  v.shape = t.shape();
  v.dtype = t.dtype();
  v.producer = producer;
  v.view = view;
  if (producer < 0) v.external = t;
  const int id = static_cast<int>(graph_.values.size());
  graph_.values.push_back(std::move(v));
  storage_of_.push_back(t.storage());
  ids_[key_of(t)] = Known{t.storage(), id, t.offset()};
  auto owner = owners_.find(t.storage().get());
  if (owner == owners_.end() || owner->second.storage.lock().get() != t.storage().get())
    owners_[t.storage().get()] = Known{t.storage(), id, t.offset()};
  return id;
}

int CaptureMode::value_of(const Tensor& t) {
  if (!t.has_storage())
    throw std::logic_error("capture: an op read a tensor without storage: " + t.str());
  auto it = ids_.find(key_of(t));
  if (it != ids_.end() && it->second.storage.lock().get() == t.storage().get())
    return it->second.id;
  auto owner = owners_.find(t.storage().get());
  if (owner != owners_.end() && owner->second.storage.lock().get() == t.storage().get()) {
    // A view made outside the view ops, of memory the graph already knows.
    // The view's offset is taken from its base's, so it holds wherever a replay puts the base.
    const int base = owner->second.id;
    Node node;
    node.primitive =
        std::make_shared<AsStrided>(t.shape(), t.strides(), t.offset() - owner->second.offset);
    node.backward = autograd::backward_in_progress();
    node.inputs = {base};
    const int index = static_cast<int>(graph_.nodes.size());
    node.outputs = {new_value(t, index, /*view=*/true)};
    graph_.nodes.push_back(std::move(node));
    return graph_.nodes.back().outputs[0];
  }
  return new_value(t, -1, false);
}

bool CaptureMode::intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
  // The previous node has run: the most scratch its kernels held at once (this thread's).
  if (pending_ >= 0)
    graph_.nodes[static_cast<size_t>(pending_)].scratch_bytes = ScratchRegion::peak();
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
  if (on_meta_) {
    // Nothing runs: the kernel's own formula, each allocation rounded as ScratchBytes rounds it.
    if (!p.is_view() && !p.host_side())
      for (int64_t bytes : p.cpu_scratch(in, std::span<const Tensor>(out.data(), out.size())))
        if (bytes > 0) node.scratch_bytes += (bytes + 63) / 64 * 64;
    graph_.nodes.push_back(std::move(node));
    return false;
  }
  graph_.nodes.push_back(std::move(node));
  pending_ = index;
  ScratchRegion::reset_peak();
  return false;  // the op runs as usual
}

Graph CaptureMode::take() {
  if (pending_ >= 0)
    graph_.nodes[static_cast<size_t>(pending_)].scratch_bytes = ScratchRegion::peak();
  pending_ = -1;
  return std::move(graph_);
}

void CaptureMode::mark_output(const std::string& name, const Tensor& t) {
  auto it = t.has_storage() ? ids_.find(key_of(t)) : ids_.end();
  if (it == ids_.end() || it->second.storage.lock().get() != t.storage().get())
    throw std::invalid_argument(
        fmt::format("capture: output '{}' ({}) was not made by the captured code", name, t.str()));
  graph_.outputs.emplace_back(name, it->second.id);
}

std::vector<int> CaptureMode::escaped() const {
  // The outputs' storages, and the externals' (a view of the batch or of a parameter shares it).
  std::vector<const Storage*> kept;
  for (const auto& [name, id] : graph_.outputs)
    if (auto s = storage_of_[static_cast<size_t>(id)].lock()) kept.push_back(s.get());
  for (const Value& v : graph_.values)
    if (v.producer < 0 && v.external.has_storage()) kept.push_back(v.external.storage().get());
  std::vector<int> out;
  for (size_t v = 0; v < graph_.values.size(); ++v) {
    if (graph_.values[v].producer < 0) continue;
    const std::shared_ptr<Storage> s = storage_of_[v].lock();
    if (s && std::find(kept.begin(), kept.end(), s.get()) == kept.end())
      out.push_back(static_cast<int>(v));
  }
  return out;
}

Graph capture(const std::function<void()>& step, const std::function<void(CaptureMode&)>& outputs,
              std::vector<int>* escaped, bool on_meta) {
  CaptureMode mode(on_meta);
  {
    ModeGuard guard(mode);
    step();
    if (outputs) outputs(mode);
  }
  if (escaped) *escaped = mode.escaped();
  return mode.take();
}

}  // namespace kuai::compiler
