// Replay of a captured step (technique 4): the graph's primitives run again in order, on the
// tensors the capture saw for its external values (parameters, optimizer moments, the step count
// and learning rate tensors, the loss scale) except the step's inputs, which are bound anew each
// run (the batch). No autograd node is built and no mode is consulted: the gradients are values
// of the graph that its optimizer updates read. Scratch tensors (a zeroed flag, backward's seed)
// are fill nodes, made anew. Per-step numbers come from device tensors the host writes between
// runs (Optimizer::set_lr), never from constants of the capture.
//
// Memory: by default every intermediate lives in one arena laid out by the memory plan
// (memory_plan.h) and allocated once, with a tensor handle per value made once, so a run
// allocates only its named outputs (they outlive it) and the views it makes of its inputs. The
// separate mode allocates each intermediate on its own and frees it after its last use, as eager
// execution does, so a sanitizer sees each buffer's own bounds (the sanitizer builds run both).
// Under AddressSanitizer the arena mode keeps every byte poisoned outside the lifetime of the
// buffer that holds it. `poison` fills the whole arena with NaN bytes before each run and each
// buffer again after its last use: a node that read a buffer its producer had not yet written in
// this run, or one the plan had already handed to another value, would change the results (tested).
#pragma once

#include <memory>
#include <vector>

#include "kuai/compile/graph.h"
#include "kuai/compile/memory_plan.h"

namespace kuai::compiler {

struct ExecutableOptions {
  enum class Memory { kArena, kSeparate };
  Memory memory = Memory::kArena;
  bool in_place = true;  // arena: outputs may take over dying inputs' buffers
  bool poison = false;   // arena: NaN-fill each buffer after its last use
};

class Executable {
 public:
  // `inputs`: the tensors of the captured run that each later run replaces, in order (external
  // values of the graph; one the step never read is accepted and ignored).
  Executable(Graph graph, const std::vector<Tensor>& inputs, ExecutableOptions options = {});
  // Runs the graph with `inputs` in place of the captured ones; returns the named outputs' tensors
  // in the graph's order (Graph::outputs).
  std::vector<Tensor> run(const std::vector<Tensor>& inputs);
  const Graph& graph() const { return graph_; }
  const MemoryPlan& plan() const { return plan_; }
  const ExecutableOptions& options() const { return options_; }
  // The planned arena's size (held from construction, and from the first run after a release).
  int64_t arena_bytes() const {
    return options_.memory == ExecutableOptions::Memory::kArena ? plan_.arena_bytes : 0;
  }
  // Gives the arena back until the next run, which allocates and touches it again: for work
  // between steps that is not the step (evaluation), so the two never hold memory at once.
  void release();

 private:
  Graph graph_;
  ExecutableOptions options_;
  std::vector<int> input_ids_;  // per input: its value (-1: the step does not read it)
  std::vector<TensorSpec> input_specs_;
  std::vector<int> last_use_;  // per value: the last node reading it (-1: none)
  MemoryPlan plan_;
  std::shared_ptr<Storage> arena_;
  std::vector<Tensor> planned_;  // arena mode: per value, its handle into the arena (or empty)
  std::vector<std::vector<int>> born_at_;  // per node: the buffers made there
  void make_arena();
  bool host() const { return device_.type == DeviceType::kCPU; }
  Device device_;  // the inputs': where the arena and the outputs live
};

}  // namespace kuai::compiler
