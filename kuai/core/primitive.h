// One class per op. A primitive knows its name and class (read by autocast and fusion), infers
// its outputs' shapes and dtypes, evaluates itself per backend (eval_cpu lives in
// backend/cpu/eval_<family>.cpp; the meta backend needs nothing from it: shapes are infer()'s),
// and says how to differentiate itself by composing other ops (vjp). Backward of a fused op is a
// primitive of its own (LayerNormBackward, ...).
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai {

enum class OpClass { kMatmul, kElementwise, kReduction, kNormalization, kAttention, kView, kOther };

// What autocast (kuai/amp/autocast.h) does to an op's floating inputs: cast them to the low
// dtype, widen low-precision ones to fp32, or leave them as they are.
enum class CastPolicy { kLowPrecision, kFloat32, kAsIs };

struct TensorSpec {
  Shape shape;
  DType dtype = DType::kF32;
};

// What one evaluation costs, from shapes alone (so the meta backend can report it for a step it
// never runs): the floating-point operations of its products (2 per multiply-add; elementwise
// arithmetic is counted as memory traffic, not FLOPs), the bytes it reads and writes, and the
// bytes it moves to and from disk (an update over optimizer state offloaded to files: priced by
// `kuai plan` at the machine's measured disk bandwidth, kuai bench disk).
struct Cost {
  double flops = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t disk_read = 0;
  int64_t disk_written = 0;
};

// Primitives are made with std::make_shared (ops.cpp) and shared by autograd nodes and captured
// graphs: a mode that keeps one takes shared_from_this().
class Primitive : public std::enable_shared_from_this<Primitive> {
 public:
  virtual ~Primitive() = default;
  virtual std::string_view name() const = 0;
  virtual OpClass op_class() const = 0;
  // Default from the class: matmul and attention run in the low dtype; normalisation and
  // reductions in fp32; everything else as its inputs come.
  virtual CastPolicy cast_policy() const {
    switch (op_class()) {
      case OpClass::kMatmul:
      case OpClass::kAttention:
        return CastPolicy::kLowPrecision;
      case OpClass::kNormalization:
      case OpClass::kReduction:
        return CastPolicy::kFloat32;
      default:
        return CastPolicy::kAsIs;
    }
  }
  // Output shapes and dtypes; throws with the op's name and the offending shapes on mismatch.
  virtual std::vector<TensorSpec> infer(std::span<const Tensor> in) const = 0;
  virtual void eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const = 0;
  virtual void eval_cuda(std::span<const Tensor> in, std::span<Tensor> out) const;
  // Its cost at these inputs and outputs. Default: a memory-bound pass reading every input and
  // writing every output (views: nothing). Products and attention count their FLOPs.
  virtual Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const;
  // The scratch its CPU kernel takes from the allocator while it runs (each entry one allocation,
  // all held together), from the shapes and the thread count: the kernel's own formula, defined
  // beside its eval_cpu. The meta backend takes the same bytes, so a step run on meta tensors
  // peaks where the CPU step would. A product's scratch depends on the implementation the GEMM
  // router picks and is not stated here (empty; the planner measures it).
  virtual std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                           std::span<const Tensor> out) const {
    return {};
  }
  // Host logic that runs alike on every device (a collective's launch and wait, which talk to a
  // process group): the meta backend runs its eval_cpu.
  virtual bool host_side() const { return false; }
  // Gives its input's bytes to the allocator or takes them back (ZeRO-3's unit buffers,
  // Storage::release and materialize): its input may be over released bytes, which every other
  // primitive refuses.
  virtual bool storage_op() const { return false; }
  // Where the outputs of a primitive without inputs live (a creation op carries its device, as
  // MLX's carry a stream); every other primitive runs on, and outputs to, its inputs' device.
  virtual Device output_device() const { return kCPU; }
  // Gradients of the inputs given the outputs' gradients (an undefined grad_out means zero).
  // needs_grad[i] says whether input i's gradient is wanted; return undefined where not.
  // Inputs and outputs not listed by saves_input / saves_output arrive as meta tensors.
  virtual std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                                  std::span<const Tensor> grad_out,
                                  const std::vector<bool>& needs_grad) const = 0;
  virtual bool saves_input(size_t i) const { return true; }
  virtual bool saves_output(size_t i) const { return false; }
  // Whether selective activation recomputation (nn/checkpoint.h) keeps output j of this op
  // through backward rather than making it again: the products' outputs and attention's, whose
  // FLOPs are the step's. Everything else (norms, activations, casts, copies, a materialised
  // attention's probabilities) is cheap to make again from them.
  virtual bool kept_by_selective_recompute(size_t out) const {
    return op_class() == OpClass::kMatmul || op_class() == OpClass::kAttention;
  }
  // Whether input i may arrive as a strided view; otherwise dispatch makes it contiguous.
  virtual bool accepts_strided(size_t i) const { return false; }
  // View primitives return their outputs as views of the inputs instead of being evaluated.
  virtual bool is_view() const { return false; }
  virtual std::vector<Tensor> make_views(std::span<const Tensor> in) const { return {}; }
  // Output j may be written into the buffer of the input this returns (same shape and dtype),
  // when nothing but this op holds that buffer: a backward op reusing a dead activation.
  virtual int reusable_input(size_t out) const { return -1; }
  // Output j may be computed over the buffer of the input this returns (same shape and dtype)
  // when that input is dead after this op: an index-wise kernel (y[i] from x[i]), or a row-wise
  // one that reads a row before it writes it. Read by the compiled step's memory plan, which
  // knows every value's last use; eager execution does not know it and never writes over an
  // input the caller may still hold.
  virtual int in_place_input(size_t out) const { return reusable_input(out); }
  // Integer inputs (indices, targets) never receive gradients.
  virtual bool differentiable(size_t input) const { return true; }
  // In-place updates (the optimizers, the loss scaler, in-place gradient scaling) write some of
  // their inputs: those must arrive contiguous, and the op is never recorded by autograd. Capture
  // sees them like any other op, so a captured step contains its optimizer.
  virtual bool mutates_input(size_t input) const { return false; }
  virtual bool updates_in_place() const { return false; }
};

}  // namespace kuai
