// Replay of a captured graph (see executable.h).
#include "kuai/compile/executable.h"

#include <fmt/format.h>

#include <stdexcept>

#include "kuai/core/dispatch.h"

namespace kuai::compile {

Executable::Executable(Graph graph, const std::vector<Tensor>& inputs) : graph_(std::move(graph)) {
  for (size_t k = 0; k < inputs.size(); ++k) {
    int id = -1;
    for (size_t v = 0; v < graph_.values.size(); ++v)
      if (const Value& x = graph_.values[v];
          x.producer < 0 && x.external.defined() && x.external.storage() == inputs[k].storage() &&
          x.external.offset() == inputs[k].offset() && x.shape == inputs[k].shape())
        id = static_cast<int>(v);
    if (id < 0)
      throw std::invalid_argument(fmt::format(
          "compile: input {} ({}) is not an input of the captured step", k, inputs[k].str()));
    input_ids_.push_back(id);
    graph_.values[static_cast<size_t>(id)].external = Tensor();  // bound at each run
  }
  last_use_.assign(graph_.values.size(), -1);
  for (size_t i = 0; i < graph_.nodes.size(); ++i)
    for (int id : graph_.nodes[i].inputs) last_use_[static_cast<size_t>(id)] = static_cast<int>(i);
  for (const auto& [name, id] : graph_.outputs)
    last_use_[static_cast<size_t>(id)] = static_cast<int>(graph_.nodes.size());  // kept
}

std::vector<Tensor> Executable::run(const std::vector<Tensor>& inputs) {
  if (inputs.size() != input_ids_.size())
    throw std::invalid_argument(
        fmt::format("compile: the step takes {} inputs, got {}", input_ids_.size(), inputs.size()));
  std::vector<Tensor> live(graph_.values.size());
  for (size_t v = 0; v < graph_.values.size(); ++v)
    if (graph_.values[v].producer < 0) live[v] = graph_.values[v].external;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Value& want = graph_.values[static_cast<size_t>(input_ids_[k])];
    if (inputs[k].shape() != want.shape || inputs[k].dtype() != want.dtype)
      throw std::invalid_argument(
          fmt::format("compile: input {} is {}, the step was captured with {} {}", k,
                      inputs[k].str(), dtype_name(want.dtype), shape_str(want.shape)));
    live[static_cast<size_t>(input_ids_[k])] = inputs[k];
  }
  std::vector<Tensor> in, out;
  for (size_t i = 0; i < graph_.nodes.size(); ++i) {
    const Node& node = graph_.nodes[i];
    const Primitive& p = *node.primitive;
    in.clear();
    for (int id : node.inputs) in.push_back(live[static_cast<size_t>(id)]);
    if (p.is_view()) {
      out = p.make_views(in);
    } else {
      out.clear();
      for (const TensorSpec& s : p.infer(in)) out.push_back(Tensor::empty(s.shape, s.dtype));
      evaluate(p, in, out);
    }
    for (size_t j = 0; j < node.outputs.size(); ++j)
      live[static_cast<size_t>(node.outputs[j])] = std::move(out[j]);
    // Release what no later node reads (externals stay: the graph holds them).
    for (int id : node.inputs)
      if (last_use_[static_cast<size_t>(id)] == static_cast<int>(i) &&
          graph_.values[static_cast<size_t>(id)].producer >= 0)
        live[static_cast<size_t>(id)] = Tensor();
    for (int id : node.outputs)
      if (last_use_[static_cast<size_t>(id)] < 0) live[static_cast<size_t>(id)] = Tensor();
  }
  std::vector<Tensor> result;
  for (const auto& [name, id] : graph_.outputs) result.push_back(live[static_cast<size_t>(id)]);
  return result;
}

}  // namespace kuai::compile
