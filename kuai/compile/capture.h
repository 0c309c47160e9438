// Capture (technique 4): record every primitive a piece of code dispatches, on this thread, into
// a Graph (graph.h), while the code runs as usual: a captured training step is an ordinary step
// that leaves its graph behind. The recorder is a dispatch mode (kuai/core/dispatch.h) that
// applies in backward, so the graph holds the forward, the backward the autograd engine emits
// (gradient accumulation included), the casts autocast inserts, clipping, the loss scaler and the
// optimizer's updates, in the order they ran.
//
// Values are told apart by the memory they name: storage, offset, shape, strides and dtype (the
// autograd engine hands a vjp detached handles of the tensors the forward saved, so handle
// identity would not do). A region seen for the first time as an input is external (held by the
// graph); an op's outputs are new values, and an output written into a dead input's buffer takes
// that region over. A region not seen before inside the storage of a known value is a view code
// made directly (Tensor::view_of, as a vjp returning parts of one buffer does): it is recorded as
// an as_strided node of that value, so a replay makes the same view of the new buffer. A storage
// that dies and whose address is reused is new (checked through a weak reference).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <tuple>

#include "kuai/compile/graph.h"
#include "kuai/core/dispatch.h"

namespace kuai::compiler {

class CaptureMode final : public DispatchMode {
 public:
  // on_meta: the step is recorded without running (DispatchMode::dry): every value it makes is a
  // meta tensor, the real tensors it reads (parameters, optimizer state, the batch) are the
  // graph's externals, and each node's scratch is its kernel's own formula
  // (Primitive::cpu_scratch; a product's, which the formula does not state, is then taken from
  // the allocator when the graph runs).
  explicit CaptureMode(bool on_meta = false) : on_meta_(on_meta) {}
  bool dry() const override { return on_meta_; }
  bool records() const override { return true; }
  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override;
  // Names a value of the graph (the loss, a parameter's gradient); the tensor must be known.
  void mark_output(const std::string& name, const Tensor& t);
  // The graph; the last node's scratch is measured now.
  Graph take();
  // Values the captured code made that are still alive now, other than the named outputs and
  // what shares their memory: state created inside the step (an optimizer's moments made on its
  // first step), which a replay would make anew instead of updating. Call before take().
  std::vector<int> escaped() const;
  const Graph& graph() const { return graph_; }

 private:
  int value_of(const Tensor& t);  // existing id, or a new external
  int new_value(const Tensor& t, int producer, bool view);
  using Key = std::tuple<const Storage*, int64_t, Shape, Shape, DType>;
  static Key key_of(const Tensor& t);
  struct Known {
    std::weak_ptr<Storage> storage;
    int id;
    int64_t offset = 0;  // the value's offset in the storage (elements)
  };
  std::map<Key, Known> ids_;
  std::map<const Storage*, Known> owners_;  // a storage -> the first value seen in it
  Graph graph_;
  int pending_ = -1;  // the node whose evaluation's scratch is being measured
  std::vector<std::weak_ptr<Storage>> storage_of_;  // per value
  bool on_meta_ = false;
};

// Runs `step` under a CaptureMode and returns what it recorded; `outputs` (called after the step,
// still under the mode) may mark named outputs. `escaped`, when given, receives
// CaptureMode::escaped(). `on_meta`: recorded without running (see CaptureMode).
Graph capture(const std::function<void()>& step,
              const std::function<void(CaptureMode&)>& outputs = {},
              std::vector<int>* escaped = nullptr, bool on_meta = false);

}  // namespace kuai::compiler
