// Pass names and switches (see pass_options.h).
#include "kuai/compile/pass_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>
#include <stdexcept>

namespace kuai::compiler {

const std::vector<std::string>& PassOptions::names() {
  static const std::vector<std::string> n = {
      "dead_values",       "add_layer_norm", "layer_norm_backward_add",
      "gelu_backward_sum", "cross_entropy",  "elementwise",
      "recompute"};
  return n;
}

PassOptions PassOptions::all_but(const std::string& disabled) {
  PassOptions o;
  std::stringstream in(disabled);
  for (std::string name; std::getline(in, name, ',');) {
    if (name.empty()) continue;
    bool* flag = name == "dead_values"               ? &o.dead_values
                 : name == "add_layer_norm"          ? &o.add_layer_norm
                 : name == "layer_norm_backward_add" ? &o.layer_norm_backward_add
                 : name == "gelu_backward_sum"       ? &o.gelu_backward_sum
                 : name == "cross_entropy"           ? &o.cross_entropy
                 : name == "elementwise"             ? &o.elementwise
                 : name == "recompute"               ? &o.recompute
                                                     : nullptr;
    if (flag == nullptr)
      throw std::invalid_argument(
          fmt::format("unknown compile pass '{}' (passes: {})", name, fmt::join(names(), ", ")));
    *flag = false;
  }
  return o;
}

}  // namespace kuai::compiler
