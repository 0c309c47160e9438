// kuai::compile (technique 4), the user's entry point: wraps a training step, a function from
// its input tensors (the batch) to its output tensors (the loss, metrics), so that the first call
// runs it as usual while capturing every primitive it dispatches (capture.h), the graph is
// planned into one arena (memory_plan.h) and later calls replay it (executable.h) with the new
// inputs bound: no autograd nodes, no allocation but the outputs.
//
// Guards, checked on every call against what the capture saw: each input's shape, strides and
// dtype; the autocast state and grad mode around the call; the module's training flag; the
// storage of every state tensor (the parameters, the optimizer's moments: a step that loaded new
// tensors into the model must not update the old ones). A call whose guards match no captured
// graph captures again (up to max_captures graphs are kept), after which the step runs eagerly;
// a step that read a device value on the host while captured (an item(), a branch on a loss)
// cannot be replayed (the read would be baked in) and runs eagerly. Each of these is said once
// through `log`. Per-step numbers must live in device tensors the host writes between calls
// (Optimizer::set_lr), never in constants the step computes on the host.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kuai/compile/executable.h"
#include "kuai/compile/passes.h"

namespace kuai {

namespace nn {
class Module;
}

struct CompileOptions {
  compiler::ExecutableOptions executable;
  compiler::PassOptions passes;  // run on each captured graph before its memory plan
  int max_captures = 4;
  const nn::Module* module = nullptr;           // guards its training flag and parameters
  std::function<std::vector<Tensor>()> state;   // more tensors whose storage must not change
  std::function<void(const std::string&)> log;  // re-capture and fallback notices (once each)
  // Capture on meta: a call that captures records the step without running it (its values are
  // meta tensors: no bytes), plans the arena, then runs the graph, so no call ever holds the
  // eager step's memory and the run's peak is the replay's. The caller makes every piece of state
  // the step updates before the first call (TrainStep: AdamW::ensure_state); state made inside
  // would be made on meta. A step that cannot be recorded so (it reads a device value on the
  // host, makes state, or writes a tensor the graph does not see being made) is captured while it
  // runs instead, as without this option.
  bool capture_on_meta = false;
};

class CompiledStep {
 public:
  using Step = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
  CompiledStep(Step step, CompileOptions options = {});
  ~CompiledStep();
  CompiledStep(CompiledStep&&) noexcept;
  CompiledStep& operator=(CompiledStep&&) noexcept;

  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs);

  // Every captured graph gives its arena back until its next replay (Executable::release).
  void release_memory();
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  bool eager() const { return eager_; }  // fell back for good (the reason was logged)
  // The graph replayed by the last call (null before the first replay or when eager).
  const compiler::Executable* executable() const { return last_; }
  // What the passes did to the latest captured graph.
  const compiler::PassReport& pass_report() const { return report_; }

 private:
  struct Entry;
  std::vector<Tensor> run_eager(const std::vector<Tensor>& inputs);
  // The step recorded on meta (CompileOptions::capture_on_meta); nullopt when it cannot be.
  std::optional<compiler::Graph> capture_on_meta(const std::vector<Tensor>& inputs);
  // The passes, the dump, the memory plan: a captured graph made replayable.
  std::unique_ptr<Entry> plan(compiler::Graph graph, const std::vector<Tensor>& inputs);
  void say(const std::string& message);

  Step step_;
  CompileOptions options_;
  std::vector<std::unique_ptr<Entry>> entries_;
  const compiler::Executable* last_ = nullptr;
  compiler::PassReport report_;
  int64_t captures_ = 0, replays_ = 0;
  bool eager_ = false;
};

CompiledStep compile(CompiledStep::Step step, CompileOptions options = {});

}  // namespace kuai
