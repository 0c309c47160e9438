// The autograd engine (see autograd.h).
#include "kuai/core/autograd.h"

#include "kuai/core/allocator.h"

#include <fmt/format.h>

#include <atomic>
#include <queue>
#include <stdexcept>
#include <unordered_map>

#include "kuai/core/ops.h"

namespace kuai::autograd {
namespace {

thread_local bool g_grad_enabled = true;
thread_local SavedTensorHooks* t_saved_hooks = nullptr;
std::atomic<uint64_t> g_sequence{0};

using Packed = std::vector<std::shared_ptr<SavedTensor>>;  // one per saved slot; null: plain

class PrimitiveNode final : public Node {
 public:
  PrimitiveNode(std::shared_ptr<const Primitive> p, std::vector<Tensor> in, std::vector<Tensor> out,
                std::vector<bool> needs_grad, Packed packed_in, Packed packed_out)
      : prim_(std::move(p)),
        in_(std::move(in)),
        out_(std::move(out)),
        needs_grad_(std::move(needs_grad)),
        packed_in_(std::move(packed_in)),
        packed_out_(std::move(packed_out)) {}

  std::string_view name() const override { return prim_->name(); }

  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    if (released_)
      throw std::runtime_error(
          fmt::format("backward through {} a second time: its saved tensors were already freed",
                      prim_->name()));
    unpack(packed_in_, in_);
    unpack(packed_out_, out_);
    std::vector<Tensor> g = prim_->vjp(in_, out_, grads, needs_grad_);
    if (g.size() != in_.size())
      throw std::logic_error(fmt::format("{}: vjp returned {} gradients for {} inputs",
                                         prim_->name(), g.size(), in_.size()));
    for (size_t i = 0; i < g.size(); ++i) {
      if (!g[i].defined() || !needs_grad_[i]) {
        g[i] = Tensor();
        continue;
      }
      if (g[i].shape() != in_[i].shape())
        throw std::logic_error(fmt::format("{}: gradient {} has shape {}, input has {}",
                                           prim_->name(), i, shape_str(g[i].shape()),
                                           shape_str(in_[i].shape())));
      // A gradient has its input's dtype (an fp32 residual feeding a bf16 branch, ...).
      if (g[i].dtype() != in_[i].dtype()) g[i] = cast(g[i], in_[i].dtype());
    }
    return g;
  }

  // Drops the saved tensors, keeping their shapes and dtypes. A node that saved nothing (a cast,
  // a view) can run again: a cached weight cast (autocast keeps one per step) is shared by the
  // graphs of every micro-batch of a step.
  void release() override {
    for (Packed* p : {&packed_in_, &packed_out_})
      for (std::shared_ptr<SavedTensor>& s : *p)
        if (s) {
          s.reset();
          released_ = true;
        }
    for (std::vector<Tensor>* v : {&in_, &out_})
      for (Tensor& t : *v)
        if (t.defined() && t.has_storage()) {
          t = Tensor::meta(t.shape(), t.dtype(), t.device());
          released_ = true;
        }
  }

 private:
  // Packed slots take their tensors back (made again if they were dropped).
  static void unpack(Packed& packed, std::vector<Tensor>& saved) {
    for (size_t i = 0; i < packed.size(); ++i)
      if (packed[i]) {
        saved[i] = packed[i]->unpack();
        packed[i].reset();
      }
  }

  std::shared_ptr<const Primitive> prim_;
  std::vector<Tensor> in_, out_;
  std::vector<bool> needs_grad_;
  Packed packed_in_, packed_out_;  // empty unless saved-tensor hooks packed a slot
  bool released_ = false;
};

class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf) : leaf_(leaf) {}
  std::string_view name() const override { return "AccumulateGrad"; }

  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    std::shared_ptr<TensorImpl> leaf = leaf_.lock();
    if (!leaf || grads.empty() || !grads[0].defined()) return {};
    Tensor g = std::move(grads[0]);
    grads.clear();
    // The fp32 gradient of a low-precision copy (its master elsewhere): widened by the cast
    // autocast's own weight cast would have differentiated through, so the bits are the same.
    if (leaf->master_elsewhere && g.dtype() != DType::kF32) g = cast(g, DType::kF32);
    if (!leaf->grad) {
      // Adopt the buffer when nobody else can see it; otherwise copy.
      const bool exclusive = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 &&
                             g.is_contiguous() && g.offset() == 0;
      leaf->grad = exclusive ? g.impl_ptr() : clone(g).impl_ptr();
      const Tensor adopted(leaf->grad);
      mark_memory_use(adopted.storage()->data, adopted.device(), MemoryUse::kGradients);
    } else {
      add_(Tensor(leaf->grad), g);
    }
    Tensor final_grad(leaf->grad);
    for (const GradHook& hook : leaf->hooks) hook(final_grad);
    return {};
  }

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

std::shared_ptr<Node> accumulator_for(const Tensor& leaf) {
  TensorImpl* impl = leaf.impl();
  if (auto acc = impl->grad_accumulator.lock()) return acc;
  auto acc = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  acc->num_outputs = 1;
  acc->sequence = g_sequence++;
  impl->grad_accumulator = acc;
  return acc;
}

Edge edge_for(const Tensor& t) {
  if (t.grad_fn()) return Edge{t.grad_fn(), t.output_nr()};
  if (t.requires_grad()) return Edge{accumulator_for(t), 0};
  return Edge{};
}

void accumulate_into(Tensor& slot, Tensor g) {
  if (!slot.defined()) {
    slot = std::move(g);
    return;
  }
  const bool exclusive =
      slot.impl_ptr().use_count() == 1 && slot.storage().use_count() == 1 && slot.is_contiguous();
  if (exclusive)
    add_(slot, g);
  else
    slot = add(slot, g);
}

}  // namespace

uint64_t next_sequence() { return g_sequence++; }

SavedTensorHooksGuard::SavedTensorHooksGuard(SavedTensorHooks& hooks) : prev_(t_saved_hooks) {
  t_saved_hooks = &hooks;
}
SavedTensorHooksGuard::~SavedTensorHooksGuard() { t_saved_hooks = prev_; }
SavedTensorHooks* saved_tensor_hooks() { return t_saved_hooks; }

bool GradMode::enabled() { return g_grad_enabled; }
void GradMode::set_enabled(bool on) { g_grad_enabled = on; }

void record(const std::shared_ptr<const Primitive>& p, const std::vector<Tensor>& graph_in,
            const std::vector<Tensor>& eval_in, std::vector<Tensor>& out) {
  std::vector<bool> needs(graph_in.size(), false);
  bool any = false;
  for (size_t i = 0; i < graph_in.size(); ++i) {
    needs[i] = graph_in[i].requires_grad() && p->differentiable(i);
    any = any || needs[i];
  }
  if (!any) return;
  std::vector<Tensor> saved_in, saved_out;
  Packed packed_in, packed_out;
  // A saved slot: the tensor itself, or (under saved-tensor hooks) what pack() made of it, the
  // slot then holding only shape and dtype until the node runs.
  auto save = [](const Tensor& t, bool saves, std::vector<Tensor>& saved, Packed& packed,
                 size_t n) {
    std::shared_ptr<SavedTensor> box = saves && t_saved_hooks ? t_saved_hooks->pack(t) : nullptr;
    const bool plain = saves && !box;
    if (box) {
      if (packed.empty()) packed.resize(n);
      packed[saved.size()] = std::move(box);
    }
    saved.push_back(plain ? t.detach() : Tensor::meta(t.shape(), t.dtype(), t.device()));
  };
  saved_in.reserve(eval_in.size());
  for (size_t i = 0; i < eval_in.size(); ++i)
    save(eval_in[i], p->saves_input(i), saved_in, packed_in, eval_in.size());
  for (size_t j = 0; j < out.size(); ++j)
    save(out[j], p->saves_output(j), saved_out, packed_out, out.size());
  auto node = std::make_shared<PrimitiveNode>(p, std::move(saved_in), std::move(saved_out), needs,
                                              std::move(packed_in), std::move(packed_out));
  node->num_outputs = static_cast<int>(out.size());
  node->sequence = g_sequence++;
  node->next.resize(graph_in.size());
  for (size_t i = 0; i < graph_in.size(); ++i)
    if (needs[i]) node->next[i] = edge_for(graph_in[i]);
  for (size_t j = 0; j < out.size(); ++j) {
    TensorImpl* o = out[j].impl();
    if (!is_floating(o->dtype)) continue;
    o->grad_fn = node;
    o->output_nr = static_cast<int>(j);
    o->requires_grad = true;
  }
}

namespace {
thread_local int t_backward_depth = 0;
std::atomic<int> g_threads_in_backward{0};
}  // namespace

BackwardScope::BackwardScope() {
  if (t_backward_depth++ == 0) g_threads_in_backward.fetch_add(1, std::memory_order_relaxed);
}
BackwardScope::~BackwardScope() {
  if (--t_backward_depth == 0) g_threads_in_backward.fetch_sub(1, std::memory_order_relaxed);
}

bool backward_in_progress() { return t_backward_depth > 0; }
bool backward_running() { return g_threads_in_backward.load(std::memory_order_relaxed) > 0; }

namespace {
thread_local std::vector<std::function<void()>> t_callbacks;
}  // namespace

void queue_callback(std::function<void()> fn) { t_callbacks.push_back(std::move(fn)); }
size_t queued_callbacks() { return t_callbacks.size(); }

namespace {

// backward() without the queued callbacks.
void run_backward(const Tensor& root, const Tensor& grad_output) {
  BackwardScope in_backward;
  if (!root.requires_grad())
    throw std::invalid_argument("backward: tensor does not require grad: " + root.str());
  Tensor grad = grad_output;
  if (!grad.defined()) {
    if (root.numel() != 1)
      throw std::invalid_argument("backward: grad_output is required for non-scalar " + root.str());
    grad = full(root.shape(), 1.0f, root.dtype(), root.device());
  } else if (grad.shape() != root.shape()) {
    throw std::invalid_argument(fmt::format("backward: grad_output {} does not match {}",
                                            shape_str(grad.shape()), shape_str(root.shape())));
  }
  NoGradGuard no_grad;  // modes that must not see backward (autocast) say so themselves
  Edge root_edge = edge_for(root);

  // Count, for every node reachable from the root, how many edges point at it.
  std::unordered_map<Node*, int> deps;
  {
    std::vector<Node*> stack{root_edge.node.get()};
    std::unordered_map<Node*, bool> seen{{root_edge.node.get(), true}};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next) {
        if (!e.node) continue;
        deps[e.node.get()]++;
        if (!seen[e.node.get()]) {
          seen[e.node.get()] = true;
          stack.push_back(e.node.get());
        }
      }
    }
  }

  auto later_first = [](const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) {
    return a->sequence < b->sequence;
  };
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>,
                      decltype(later_first)>
      ready(later_first);
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  buffers[root_edge.node.get()].resize(root_edge.node->num_outputs);
  buffers[root_edge.node.get()][root_edge.input_nr] = grad;
  ready.push(root_edge.node);

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(buffers[node.get()]);
    buffers.erase(node.get());
    bool any = false;
    for (const Tensor& g : grads) any = any || g.defined();
    std::vector<Tensor> out;
    if (any) out = node->apply(std::move(grads));
    node->release();
    for (size_t i = 0; i < node->next.size(); ++i) {
      const Edge& e = node->next[i];
      if (!e.node) continue;
      if (i < out.size() && out[i].defined()) {
        std::vector<Tensor>& buf = buffers[e.node.get()];
        if (buf.empty()) buf.resize(e.node->num_outputs);
        accumulate_into(buf[e.input_nr], std::move(out[i]));
      }
      if (--deps[e.node.get()] == 0) ready.push(e.node);
    }
  }
}

}  // namespace

void backward(const Tensor& root, const Tensor& grad_output) {
  const bool outermost = t_backward_depth == 0;
  try {
    run_backward(root, grad_output);
  } catch (...) {
    if (outermost) t_callbacks.clear();  // a failed backward runs none of them
    throw;
  }
  if (!outermost) return;  // a backward inside a backward: the outer one runs them
  std::vector<std::function<void()>> callbacks;
  callbacks.swap(t_callbacks);
  for (auto& fn : callbacks) fn();
}

}  // namespace kuai::autograd
