// Which graph passes a compiled step runs (kuai/compile/passes.h has the passes themselves). Kept
// apart from the passes so the run config can check pass names without the graph code.
#pragma once

#include <string>
#include <vector>

namespace kuai::compiler {

struct PassOptions {
  bool dead_values = true;
  bool add_layer_norm = true;
  bool layer_norm_backward_add = true;
  bool gelu_backward_sum = true;
  bool cross_entropy = true;
  bool elementwise = true;
  bool recompute = true;
  // "dead_values,add_layer_norm": the passes named are switched off (unknown names throw).
  static PassOptions all_but(const std::string& disabled);
  static const std::vector<std::string>& names();
};

}  // namespace kuai::compiler
