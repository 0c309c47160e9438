// kuai::compile: guards, capture on a miss, replay on a hit (see compile.h).
#include "kuai/compile/compile.h"

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "kuai/amp/autocast.h"
#include "kuai/compile/capture.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/host_reads.h"
#include "kuai/nn/module.h"

namespace kuai {

namespace {

struct TensorGuard {
  Shape shape, strides;
  DType dtype = DType::kF32;
  const Storage* storage = nullptr;  // state tensors only
  int64_t offset = 0;
  bool operator==(const TensorGuard&) const = default;
};

// What a graph was captured under; a call replays a graph whose guard equals its own.
struct Guard {
  std::vector<TensorGuard> inputs, state;
  bool autocast = false;
  DType autocast_dtype = DType::kF32;
  bool grad_mode = true;
  bool training = true;
  bool operator==(const Guard&) const = default;
};

TensorGuard guard_of(const Tensor& t, bool storage) {
  TensorGuard g{t.shape(), t.strides(), t.dtype()};
  if (storage && t.has_storage()) {
    g.storage = t.storage().get();
    g.offset = t.offset();
  }
  return g;
}

// The first field where two guards differ, for the re-capture notice.
std::string difference(const Guard& was, const Guard& now) {
  for (size_t i = 0; i < std::min(was.inputs.size(), now.inputs.size()); ++i) {
    const TensorGuard &a = was.inputs[i], &b = now.inputs[i];
    if (a.shape != b.shape || a.dtype != b.dtype)
      return fmt::format("input {} is {} {}, was {} {}", i, dtype_name(b.dtype), shape_str(b.shape),
                         dtype_name(a.dtype), shape_str(a.shape));
    if (a.strides != b.strides)
      return fmt::format("input {} has strides {}, was {}", i, shape_str(b.strides),
                         shape_str(a.strides));
  }
  if (was.inputs.size() != now.inputs.size())
    return fmt::format("{} inputs, was {}", now.inputs.size(), was.inputs.size());
  if (was.autocast != now.autocast || was.autocast_dtype != now.autocast_dtype)
    return "the autocast state changed";
  if (was.grad_mode != now.grad_mode) return "grad mode changed";
  if (was.training != now.training) return "the module's training flag changed";
  return "a parameter or state tensor was replaced";
}

// How many parts of two guards agree: the notice names what differs from the closest graph.
int agreement(const Guard& a, const Guard& b) {
  return (a.inputs == b.inputs) + (a.state == b.state) +
         (a.autocast == b.autocast && a.autocast_dtype == b.autocast_dtype) +
         (a.grad_mode == b.grad_mode) + (a.training == b.training);
}

}  // namespace

struct CompiledStep::Entry {
  Guard guard;
  compiler::Executable exe;
};

CompiledStep::CompiledStep(Step step, CompileOptions options)
    : step_(std::move(step)), options_(std::move(options)) {}
CompiledStep::~CompiledStep() = default;
CompiledStep::CompiledStep(CompiledStep&&) noexcept = default;
CompiledStep& CompiledStep::operator=(CompiledStep&&) noexcept = default;

void CompiledStep::say(const std::string& message) {
  if (options_.log) options_.log("compile: " + message);
}

std::vector<Tensor> CompiledStep::run_eager(const std::vector<Tensor>& inputs) {
  last_ = nullptr;
  return step_(inputs);
}

std::vector<Tensor> CompiledStep::operator()(const std::vector<Tensor>& inputs) {
  if (eager_) return run_eager(inputs);
  Guard guard;
  for (const Tensor& t : inputs) guard.inputs.push_back(guard_of(t, false));
  std::vector<Tensor> state;
  if (options_.module) state = options_.module->parameters();
  if (options_.state)
    for (Tensor& t : options_.state()) state.push_back(std::move(t));
  for (const Tensor& t : state) guard.state.push_back(guard_of(t, true));
  guard.autocast = amp::autocast_enabled();
  guard.autocast_dtype = guard.autocast ? amp::autocast_dtype() : DType::kF32;
  guard.grad_mode = autograd::GradMode::enabled();
  guard.training = options_.module ? options_.module->is_training() : true;

  for (const auto& e : entries_)
    if (e->guard == guard) {
      ++replays_;
      last_ = &e->exe;
      return e->exe.run(inputs);
    }
  const Guard* closest = nullptr;
  for (const auto& e : entries_)
    if (!closest || agreement(e->guard, guard) > agreement(*closest, guard)) closest = &e->guard;
  if (static_cast<int>(entries_.size()) >= options_.max_captures) {
    eager_ = true;
    say(
        fmt::format("{} graphs captured and the guards changed again ({}); the step runs "
                    "eagerly from now on",
                    entries_.size(), difference(*closest, guard)));
    return run_eager(inputs);
  }
  if (!entries_.empty()) say(fmt::format("capturing again: {}", difference(*closest, guard)));

  if (options_.capture_on_meta)
    if (std::optional<compiler::Graph> graph = capture_on_meta(inputs)) {
      // Recorded without running: the step runs now, as the graph's first replay.
      ++captures_;
      std::unique_ptr<Entry> entry = plan(std::move(*graph), inputs);
      entry->guard = std::move(guard);
      entries_.push_back(std::move(entry));
      last_ = &entries_.back()->exe;
      return entries_.back()->exe.run(inputs);
    }

  // Capture: the step runs as usual under the recorder.
  std::vector<Tensor> outputs;
  std::vector<int> escaped;
  // A step: reads of tensor bytes on the host (to_vector(), data<T>(), item()) are counted.
  StepScope in_step;
  const int64_t reads = host_reads_this_thread();
  compiler::Graph graph =
      compiler::capture([&] { outputs = step_(inputs); },
                        [&](compiler::CaptureMode& mode) {
                          for (size_t j = 0; j < outputs.size(); ++j)
                            mode.mark_output(fmt::format("output{}", j), outputs[j]);
                        },
                        &escaped);
  ++captures_;
  if (const int64_t n = host_reads_this_thread() - reads; n > 0) {
    eager_ = true;
    entries_.clear();
    say(
        fmt::format("the step read {} device value{} on the host while it was captured; a "
                    "replay could not repeat {}, so the step runs eagerly",
                    n, n == 1 ? "" : "s", n == 1 ? "it" : "them"));
    return outputs;
  }
  if (!escaped.empty()) {
    // State made inside the step (its first call): this call was an ordinary step, and the next
    // one captures again, with the state in place.
    const compiler::Value& v = graph.values[static_cast<size_t>(escaped[0])];
    say(
        fmt::format("the step made {} tensor{} that outlive{} it (e.g. {} {}: state created on "
                    "the first call, such as an optimizer's moments); a replay would not update "
                    "them, so the next call captures again",
                    escaped.size(), escaped.size() == 1 ? "" : "s", escaped.size() == 1 ? "s" : "",
                    dtype_name(v.dtype), shape_str(v.shape)));
    return outputs;
  }
  std::unique_ptr<Entry> entry = plan(std::move(graph), inputs);
  entry->guard = std::move(guard);
  entries_.push_back(std::move(entry));
  last_ = nullptr;
  return outputs;
}

std::unique_ptr<CompiledStep::Entry> CompiledStep::plan(compiler::Graph graph,
                                                        const std::vector<Tensor>& inputs) {
  report_ = compiler::run_passes(graph, options_.passes);
  // KUAI_COMPILE_DUMP=FILE writes each graph as replayed (after its passes), a node a line.
  if (const char* path = std::getenv("KUAI_COMPILE_DUMP"); path != nullptr && *path != '\0') {
    std::ofstream f(path, std::ios::app);
    f << fmt::format("# graph {}: {} nodes before the passes, {} after\n", captures_,
                     report_.nodes_before, report_.nodes_after)
      << graph.dump();
    if (!f) say(fmt::format("KUAI_COMPILE_DUMP: cannot write {}", path));
  }
  // An eager step's freed blocks go back to the system before the arena is allocated: replays
  // never ask for them, and holding both would double the step's memory.
  Allocator::get().empty_cache();
  return std::make_unique<Entry>(
      Entry{Guard{}, compiler::Executable(std::move(graph), inputs, options_.executable)});
}

std::optional<compiler::Graph> CompiledStep::capture_on_meta(const std::vector<Tensor>& inputs) {
  // Gradients the recorded backward left on the parameters are meta tensors: a step that cannot
  // be recorded so must not leave them behind for the capture that runs.
  auto drop_meta_gradients = [&] {
    if (options_.module)
      for (Tensor& p : options_.module->parameters())
        if (p.grad().defined() && p.grad().device() == kMeta) p.set_grad(Tensor());
  };
  std::vector<Tensor> outputs;
  std::vector<int> escaped;
  StepScope in_step;
  const int64_t reads = host_reads_this_thread();
  compiler::Graph graph;
  try {
    graph = compiler::capture([&] { outputs = step_(inputs); },
                              [&](compiler::CaptureMode& mode) {
                                for (size_t j = 0; j < outputs.size(); ++j)
                                  mode.mark_output(fmt::format("output{}", j), outputs[j]);
                              },
                              &escaped, /*on_meta=*/true);
  } catch (const std::exception&) {  // e.g. a host read of a meta tensor: it has no bytes
    drop_meta_gradients();
    return std::nullopt;
  }
  outputs.clear();
  bool usable = host_reads_this_thread() == reads && escaped.empty();
  // Every tensor a replay reads but does not make must be real: a meta tensor the recorder did not
  // see being made (one written through a pointer, outside the ops) would be read as it is. (A
  // step whose inputs are on meta, as `kuai plan` runs one, reads nothing but meta tensors.)
  const bool on_meta = !inputs.empty() && inputs[0].device() == kMeta;
  for (const compiler::Value& v : graph.values)
    if (v.producer < 0 && v.external.defined() && v.external.device() == kMeta && !on_meta)
      usable = false;
  drop_meta_gradients();
  if (!usable) return std::nullopt;
  return graph;
}

void CompiledStep::release_memory() {
  for (auto& e : entries_) e->exe.release();
}

CompiledStep compile(CompiledStep::Step step, CompileOptions options) {
  return CompiledStep(std::move(step), std::move(options));
}

}  // namespace kuai
