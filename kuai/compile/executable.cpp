// Replay of a captured graph (see executable.h).
#include "kuai/compile/executable.h"

#include <fmt/format.h>

#include <cstring>
#include <optional>
#include <stdexcept>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KUAI_ASAN_ARENA 1
#else
#define KUAI_ASAN_ARENA 0
#endif

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/dispatch.h"

namespace kuai::compiler {

namespace {

// Under AddressSanitizer the arena is poisoned except for the buffers alive at the node that runs,
// so a kernel reading past its buffer into a neighbour's dead bytes, or a plan handing out bytes
// before their value is made, is reported where it happens.
void asan_poison(void* p, size_t n) {
#if KUAI_ASAN_ARENA
  ASAN_POISON_MEMORY_REGION(p, n);
#else
  (void)p;
  (void)n;
#endif
}
void asan_unpoison(void* p, size_t n) {
#if KUAI_ASAN_ARENA
  ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
  (void)p;
  (void)n;
#endif
}

}  // namespace

Executable::Executable(Graph graph, const std::vector<Tensor>& inputs, ExecutableOptions options)
    : graph_(std::move(graph)),
      options_(options),
      device_(inputs.empty() ? default_device() : inputs[0].device()) {
  for (size_t k = 0; k < inputs.size(); ++k) {
    int id = -1;
    for (size_t v = 0; v < graph_.values.size(); ++v)
      if (const Value& x = graph_.values[v];
          x.producer < 0 && x.external.defined() && x.external.storage() == inputs[k].storage() &&
          x.external.offset() == inputs[k].offset() && x.shape == inputs[k].shape())
        id = static_cast<int>(v);
    input_ids_.push_back(id);  // -1: the step does not read it
    input_specs_.push_back({inputs[k].shape(), inputs[k].dtype()});
    if (id >= 0) graph_.values[static_cast<size_t>(id)].external = Tensor();  // bound at each run
  }
  last_use_ = last_uses(graph_);
  if (options_.memory == ExecutableOptions::Memory::kArena) {
    plan_ = plan_memory(graph_, options_.in_place);
    born_at_.resize(graph_.nodes.size());
    for (size_t b = 0; b < plan_.buffers.size(); ++b)
      born_at_[static_cast<size_t>(plan_.buffers[b].first)].push_back(static_cast<int>(b));
    make_arena();
  }
}

void Executable::make_arena() {
  // The arena's bytes are whole again when it dies (the allocator may hand them out anew).
  const bool on_host = host();
  const MemoryUseScope use(MemoryUse::kArena);
  arena_ = std::shared_ptr<Storage>(new Storage(static_cast<size_t>(plan_.arena_bytes), device_),
                                    [on_host](Storage* s) {
                                      if (on_host) asan_unpoison(s->data, s->nbytes);
                                      delete s;
                                    });
  // Touched once now, so no replay takes the arena's first-touch page faults.
  if (on_host) std::memset(arena_->data, 0, arena_->nbytes);
  planned_.assign(graph_.values.size(), Tensor());
  for (size_t v = 0; v < graph_.values.size(); ++v)
    if (plan_.offset[v] >= 0) {
      const Value& x = graph_.values[v];
      planned_[v] =
          Tensor::in_storage(arena_, x.shape, x.dtype, plan_.offset[v] / dtype_size(x.dtype));
    }
}

void Executable::release() {
  planned_.clear();
  arena_.reset();
}

std::vector<Tensor> Executable::run(const std::vector<Tensor>& inputs) {
  if (inputs.size() != input_ids_.size())
    throw std::invalid_argument(
        fmt::format("compile: the step takes {} inputs, got {}", input_ids_.size(), inputs.size()));
  const bool arena = options_.memory == ExecutableOptions::Memory::kArena;
  if (arena && !arena_) make_arena();  // given back by release()
  // The arena's bytes are poisoned and NaN-filled on the host only (meta: there are none).
  const bool host_arena = arena && host();
  std::vector<Tensor> live(graph_.values.size());
  for (size_t v = 0; v < graph_.values.size(); ++v)
    if (graph_.values[v].producer < 0) live[v] = graph_.values[v].external;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const TensorSpec& want = input_specs_[k];
    if (inputs[k].shape() != want.shape || inputs[k].dtype() != want.dtype)
      throw std::invalid_argument(
          fmt::format("compile: input {} is {}, the step was captured with {} {}", k,
                      inputs[k].str(), dtype_name(want.dtype), shape_str(want.shape)));
    if (input_ids_[k] >= 0) live[static_cast<size_t>(input_ids_[k])] = inputs[k];
  }
  std::vector<Tensor> in, out;
  // Poisoning: what a node reads must have been written in this run, by the node the plan says.
  if (host_arena) asan_unpoison(arena_->data, arena_->nbytes);  // poisoned since the last run
  if (host_arena && options_.poison) std::memset(arena_->data, 0xFF, arena_->nbytes);
  if (host_arena) asan_poison(arena_->data, arena_->nbytes);
  for (size_t i = 0; i < graph_.nodes.size(); ++i) {
    const Node& node = graph_.nodes[i];
    const Primitive& p = *node.primitive;
    in.clear();
    for (int id : node.inputs) in.push_back(live[static_cast<size_t>(id)]);
    if (host_arena)
      for (int b : born_at_[i]) {
        const MemoryPlan::Buffer& buf = plan_.buffers[static_cast<size_t>(b)];
        asan_unpoison(static_cast<char*>(arena_->data) + buf.offset,
                      static_cast<size_t>(buf.bytes));
      }
    // Nodes captured in backward run as if in backward (what the process group reads to count
    // communication overlapped with it).
    std::optional<autograd::BackwardScope> in_backward;
    if (node.backward) in_backward.emplace();
    if (p.is_view()) {
      out = p.make_views(in);
    } else {
      out.clear();
      const std::vector<TensorSpec> specs = p.infer(in);
      for (size_t j = 0; j < specs.size(); ++j) {
        const auto v = static_cast<size_t>(node.outputs[j]);
        out.push_back(arena && planned_[v].defined()
                          ? planned_[v]
                          : Tensor::empty(specs[j].shape, specs[j].dtype, device_));
      }
      if (arena && plan_.scratch_of[i] >= 0) {
        const MemoryPlan::Buffer& s = plan_.buffers[static_cast<size_t>(plan_.scratch_of[i])];
        ScratchRegion lend(static_cast<char*>(arena_->data) + s.offset,
                           static_cast<size_t>(s.bytes));
        evaluate(p, in, out);
      } else {
        evaluate(p, in, out);
      }
    }
    for (size_t j = 0; j < node.outputs.size(); ++j)
      live[static_cast<size_t>(node.outputs[j])] = std::move(out[j]);
    // Release what no later node reads (externals stay: the graph holds them).
    for (int id : node.inputs)
      if (last_use_[static_cast<size_t>(id)] == static_cast<int>(i) &&
          graph_.values[static_cast<size_t>(id)].producer >= 0)
        live[static_cast<size_t>(id)] = Tensor();
    for (int id : node.outputs)
      if (last_use_[static_cast<size_t>(id)] < 0) live[static_cast<size_t>(id)] = Tensor();
    if (host_arena)
      for (int b : plan_.dies_after[i]) {
        const MemoryPlan::Buffer& buf = plan_.buffers[static_cast<size_t>(b)];
        char* p0 = static_cast<char*>(arena_->data) + buf.offset;
        if (options_.poison)
          std::memset(p0, 0xFF, static_cast<size_t>(buf.bytes));  // NaN in f32, bf16 and f16
        asan_poison(p0, static_cast<size_t>(buf.bytes));
      }
  }
  std::vector<Tensor> result;
  for (const auto& [name, id] : graph_.outputs) result.push_back(live[static_cast<size_t>(id)]);
  return result;
}

}  // namespace kuai::compiler
