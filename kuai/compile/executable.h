// Replay of a captured step (technique 4): the graph's primitives run again in order, on the
// tensors the capture saw for its external values (parameters, optimizer moments, the step count
// and learning rate tensors, the loss scale) except the step's inputs, which are bound anew each
// run (the batch). No autograd node is built and no mode is consulted: the gradients are values
// of the graph that its optimizer updates read. Scratch tensors (a zeroed flag, backward's seed)
// are fill nodes, made anew. Each intermediate is released after its last use, as eager
// execution releases activations during backward. Per-step numbers come from device tensors the
// host writes between runs (Optimizer::set_lr), never from constants of the capture.
//
// Not yet: guards (a run checks only that each bound input has the captured shape and dtype),
// fusion passes and the one-arena memory plan, DDP's bucket hooks and collectives.
#pragma once

#include <vector>

#include "kuai/compile/graph.h"

namespace kuai::compile {

class Executable {
 public:
  // `inputs`: the tensors of the captured run that each later run replaces, in order (they must
  // be external values of the graph).
  Executable(Graph graph, const std::vector<Tensor>& inputs);
  // Runs the graph with `inputs` in place of the captured ones; returns the named outputs' tensors
  // in the graph's order (Graph::outputs).
  std::vector<Tensor> run(const std::vector<Tensor>& inputs);
  const Graph& graph() const { return graph_; }

 private:
  Graph graph_;
  std::vector<int> input_ids_;
  std::vector<int> last_use_;  // per value: the last node reading it (-1: none)
};

}  // namespace kuai::compile
