// The one dispatch point every op goes through. It checks devices, makes inputs contiguous
// where the primitive needs it, allocates outputs through the tracking allocator, evaluates the
// primitive on the inputs' device (or creates its views), and records the autograd node when
// grad mode is on and an input requires grad. Autocast (mixed precision) and graph capture
// (compile) hook in here and nowhere else, as *modes*: objects the layers above push on a small
// per-thread stack (PyTorch's dispatcher modes are the model). The core knows them only through
// this interface and includes nothing from amp/ or compile/.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "kuai/core/primitive.h"

namespace kuai {

// A mode sees every op dispatched on its thread while it is on the stack, outermost first.
class DispatchMode {
 public:
  virtual ~DispatchMode() = default;
  // Before anything else: may replace inputs (autocast casts them, through ops that are
  // dispatched in turn and seen by every mode).
  virtual void transform_inputs(const Primitive& p, std::vector<Tensor>& in) {}
  // After the outputs exist (allocated, or made as views), before evaluation. Return true to
  // take over the evaluation (the op is then not run); capture records here and returns false.
  virtual bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
    return false;
  }
  // Whether the mode applies to the ops the autograd engine dispatches during backward
  // (autocast does not: vjps see the dtypes the forward saved; capture does).
  virtual bool applies_in_backward() const { return true; }
  // Whether ops run at all while the mode is on. A dry mode (compile's capture on meta) sees
  // every op, but nothing is evaluated: each op's outputs are made on the meta device (shape,
  // dtype, strides, no bytes), whatever device its inputs are on, so a step can be recorded
  // without the memory it would take, next to the real tensors it reads (the parameters).
  virtual bool dry() const { return false; }
  // Whether the mode records the ops for a later replay (compile's capture). Code whose eager
  // schedule depends on timing (DDP's ZeRO buckets, released as their collectives complete)
  // chooses a fixed schedule instead while recording, which a replay then repeats.
  virtual bool records() const { return false; }
};

// RAII: pushes `mode` on this thread's stack, pops it on destruction (strictly nested).
class ModeGuard {
 public:
  explicit ModeGuard(DispatchMode& mode);
  ~ModeGuard();
  ModeGuard(const ModeGuard&) = delete;
  ModeGuard& operator=(const ModeGuard&) = delete;

 private:
  DispatchMode* mode_;
};

// RAII: no mode is active on this thread while it lives (the stack is set aside and put back):
// for code that runs ops of its own in the middle of a step, such as a backend measuring which of
// two kernels is faster, whose ops must neither be recorded by a capture nor cast by autocast.
class NoModesGuard {
 public:
  NoModesGuard();
  ~NoModesGuard();
  NoModesGuard(const NoModesGuard&) = delete;
  NoModesGuard& operator=(const NoModesGuard&) = delete;

 private:
  std::vector<DispatchMode*> saved_;
};

// This thread's modes, outermost first.
std::span<DispatchMode* const> active_modes();
// Whether one of them records (DispatchMode::records).
bool recording();

std::vector<Tensor> dispatch(std::shared_ptr<const Primitive> p, std::vector<Tensor> in);

// Evaluate on the device of the inputs, into preallocated outputs (no autograd, no checks).
void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out);

}  // namespace kuai
