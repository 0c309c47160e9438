// Pass names and switches (see pass_options.h).
#include "kuai/compile/pass_options.h"

#include <fmt/format.h>

#include <sstream>
#include <stdexcept>

namespace kuai::compiler {

const std::vector<std::string>& PassOptions::names() {
  static const std::vector<std::string> n = {"dead_values", "add_layer_norm"};
  return n;
}

PassOptions PassOptions::all_but(const std::string& disabled) {
  PassOptions o;
  std::stringstream in(disabled);
  for (std::string name; std::getline(in, name, ',');) {
    if (name.empty()) continue;
    if (name == "dead_values")
      o.dead_values = false;
    else if (name == "add_layer_norm")
      o.add_layer_norm = false;
    else
      throw std::invalid_argument(
          fmt::format("unknown compile pass '{}' (passes: dead_values, add_layer_norm)", name));
  }
  return o;
}

}  // namespace kuai::compiler
