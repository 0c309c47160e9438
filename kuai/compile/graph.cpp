// The captured graph (see graph.h).
#include "kuai/compile/graph.h"

#include <fmt/format.h>

#include "kuai/core/tensor.h"

namespace kuai::compiler {

int64_t Graph::count(std::string_view primitive_name) const {
  int64_t n = 0;
  for (const Node& node : nodes) n += node.primitive->name() == primitive_name;
  return n;
}

int64_t Graph::num_externals() const {
  int64_t n = 0;
  for (const Value& v : values) n += v.producer < 0;
  return n;
}

int Graph::output(std::string_view name) const {
  for (const auto& [n, id] : outputs)
    if (n == name) return id;
  return -1;
}

std::string Graph::dump() const {
  auto value = [&](int id) {
    const Value& v = values[static_cast<size_t>(id)];
    return fmt::format("v{} {}{}{}", id, dtype_name(v.dtype), shape_str(v.shape),
                       v.producer < 0 ? " (external)" : "");
  };
  std::string s;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    std::string in, out;
    for (int id : n.inputs) in += (in.empty() ? "" : ", ") + value(id);
    for (int id : n.outputs) out += (out.empty() ? "" : ", ") + value(id);
    s += fmt::format("#{} {}{} ({}){}\n", i, n.primitive->name(), n.backward ? " [backward]" : "",
                     in, out.empty() ? " in place" : " -> " + out);
  }
  return s;
}

}  // namespace kuai::compiler
