// The captured graph (technique 4, first part): a flat list of the primitives one training step
// dispatched, in order, over numbered values. A value is either external (a tensor that existed
// before it was first used: a parameter, an optimizer moment, the batch, a constant) or the
// output of one node. In-place updates (the optimizer, gradient accumulation, the loss scaler)
// appear as nodes that write some of their inputs; their order in the list is their order in the
// step. Graph::dump() prints one line per node; counts and the value table are what the tests
// and the later passes (fusion, the memory plan) read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kuai/core/primitive.h"

namespace kuai::compiler {

struct Value {
  Shape shape;
  DType dtype = DType::kF32;
  int producer = -1;     // the node that made it; -1: external
  Tensor external;       // externals: the tensor itself (parameters, moments, the batch, ...)
  bool written = false;  // an in-place update writes it
  bool view = false;     // made by a view node (aliases its input's storage)
};

struct Node {
  std::shared_ptr<const Primitive> primitive;
  std::vector<int> inputs, outputs;  // value ids
  bool backward = false;             // dispatched by the autograd engine during backward
  int64_t scratch_bytes = 0;         // kernel scratch its evaluation took (measured at capture)
};

struct Graph {
  std::vector<Value> values;
  std::vector<Node> nodes;
  // Named values marked at the end of a capture (the loss, each parameter's gradient).
  std::vector<std::pair<std::string, int>> outputs;

  int64_t count(std::string_view primitive_name) const;
  int64_t num_externals() const;
  // The value a named output refers to, or -1.
  int output(std::string_view name) const;
  // One line per node: "#12 linear (v3 float32(4, 16, 32), v7 float32(96, 32) (external)) -> v13
  // float32(4, 16, 96)"; an update that writes in place ends "in place".
  std::string dump() const;
};

}  // namespace kuai::compiler
