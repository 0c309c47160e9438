// Reverse-mode automatic differentiation. Every op dispatched with grad mode on and an input
// that requires grad records a PrimitiveNode holding what its vjp needs (nothing more). Leaves
// get one AccumulateGrad node, shared by all their uses. backward() walks the graph in reverse
// topological order driven by dependency counts (most recent node first among the ready ones),
// sums gradients per node, frees each node's saved tensors as soon as it has run, accumulates
// into leaves' .grad and fires their grad-ready hooks exactly once, when the gradient is final.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "kuai/core/primitive.h"

namespace kuai::autograd {

class GradMode {
 public:
  static bool enabled();
  static void set_enabled(bool on);
};

// Disables graph recording in its scope (inference, optimizer steps, inside backward).
class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

class Node;
struct Edge {
  std::shared_ptr<Node> node;  // null: this input needs no gradient
  int input_nr = 0;            // which of node's gradient slots it feeds
};

class Node {
 public:
  virtual ~Node() = default;
  virtual std::string_view name() const = 0;
  // grads has one entry per output of the forward op (undefined = zero).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grads) = 0;
  virtual void release() {}  // drop saved tensors

  std::vector<Edge> next;  // one per input of the forward op
  int num_outputs = 1;
  uint64_t sequence = 0;  // creation order; later nodes run first among ready ones
};

// Record p's node for outputs `out` (called by dispatch). graph_in are the caller's inputs (the
// graph edges), eval_in the tensors the kernel saw (what is saved).
void record(const std::shared_ptr<const Primitive>& p, const std::vector<Tensor>& graph_in,
            const std::vector<Tensor>& eval_in, std::vector<Tensor>& out);

void backward(const Tensor& root, const Tensor& grad_output);

// A tensor a node saved for its backward whose bytes may be dropped after the forward and made
// again when the node runs (activation recomputation, nn/checkpoint.h).
class SavedTensor {
 public:
  virtual ~SavedTensor() = default;
  // The tensor the node saved, the same bits: made again if it was dropped. Called once, by the
  // node, when it runs; the node holds the result until it has run.
  virtual Tensor unpack() = 0;
};

// Saved-tensor hooks (PyTorch's torch.autograd.graph.saved_tensors_hooks): while one is pushed
// on this thread, every tensor a recorded node saves (an input or output the kernel saw) is
// offered to pack(). A non-null result is what the node keeps in its place, and it is unpacked
// when the node runs; null: the node saves the tensor as usual.
class SavedTensorHooks {
 public:
  virtual ~SavedTensorHooks() = default;
  virtual std::shared_ptr<SavedTensor> pack(const Tensor& saved) = 0;
};

// RAII: `hooks` packs what nodes recorded on this thread save while the guard lives (the
// innermost guard only).
class SavedTensorHooksGuard {
 public:
  explicit SavedTensorHooksGuard(SavedTensorHooks& hooks);
  ~SavedTensorHooksGuard();
  SavedTensorHooksGuard(const SavedTensorHooksGuard&) = delete;
  SavedTensorHooksGuard& operator=(const SavedTensorHooksGuard&) = delete;

 private:
  SavedTensorHooks* prev_;
};
SavedTensorHooks* saved_tensor_hooks();  // this thread's innermost, or null

// A fresh sequence number (later than every node recorded so far). Autocast gives one to a cached
// weight cast's node each time it hands the cast out again, so that in a later micro-batch the
// cast runs right after its consumers, as it did in the first one, instead of last (holding every
// low-precision weight gradient of the backward until its end).
uint64_t next_sequence();

// Runs fn once, on this thread, when the next outermost backward() this thread runs (or the one
// it is in) has finished every node and hook: PyTorch's Variable._execution_engine.queue_callback.
// The Python front end's DDP waits for its gradient buckets there, so `loss.backward()` returns
// with the gradients averaged. Callbacks run in the order queued; one that throws ends backward()
// with its exception (the others are dropped), and a backward that fails drops them all.
void queue_callback(std::function<void()> fn);
size_t queued_callbacks();  // on this thread, not yet run

// Whether this thread is inside backward() (its grad-ready hooks run there): what the process
// group reads to count the communication launched while backward still runs (DDP's overlap).
bool backward_in_progress();
// Whether any thread of the process is inside backward now: what the communication thread reads
// to measure the share of its collectives' time that ran while backward still ran.
bool backward_running();
// Marks this thread as inside backward while it lives: backward() itself, and a compiled step's
// replay around the nodes it captured in backward (so communication they launch counts as
// overlapped, as it did when captured).
class BackwardScope {
 public:
  BackwardScope();
  ~BackwardScope();
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;
};

}  // namespace kuai::autograd
