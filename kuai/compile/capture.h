// Capture (technique 4): record every primitive a piece of code dispatches, on this thread, into
// a Graph (graph.h), while the code runs as usual: a captured training step is an ordinary step
// that leaves its graph behind. The recorder is a dispatch mode (kuai/core/dispatch.h) that
// applies in backward, so the graph holds the forward, the backward the autograd engine emits
// (gradient accumulation included), the casts autocast inserts, clipping, the loss scaler and the
// optimizer's updates, in the order they ran.
//
// Values are told apart by tensor identity: a tensor seen for the first time as an input is
// external (held by the graph); an op's outputs are new values. A tensor object that dies and
// whose address is reused is a new value (identity is checked through a weak reference).
#pragma once

#include <functional>
#include <string>
#include <unordered_map>

#include "kuai/compile/graph.h"
#include "kuai/core/dispatch.h"

namespace kuai::compile {

class CaptureMode final : public DispatchMode {
 public:
  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override;
  // Names a value of the graph (the loss, a parameter's gradient); the tensor must be known.
  void mark_output(const std::string& name, const Tensor& t);
  Graph take() { return std::move(graph_); }
  const Graph& graph() const { return graph_; }

 private:
  int value_of(const Tensor& t);  // existing id, or a new external
  int new_value(const Tensor& t, int producer, bool view);
  struct Known {
    std::weak_ptr<TensorImpl> impl;
    int id;
  };
  std::unordered_map<const TensorImpl*, Known> ids_;
  Graph graph_;
};

// Runs `step` under a CaptureMode and returns what it recorded; `outputs` (called after the step,
// still under the mode) may mark named outputs.
Graph capture(const std::function<void()>& step,
              const std::function<void(CaptureMode&)>& outputs = {});

}  // namespace kuai::compile
