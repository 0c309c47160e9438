// Collectives as primitives, so a dispatch mode sees them and a captured training step holds its
// communication (technique 4 over technique 2): DDP launches each bucket's all-reduce through
// AllReduceStart (ZeRO-2/3: its reduce-scatter through ReduceScatterStart) and waits for it
// through CollectiveWait, ZeRO's all-gathers go through AllGatherStart, all dispatched like any
// op. A replay
// runs the two nodes where the capture saw them: the start queues the collective on the process
// group's communication thread and returns at once, the following backward nodes run while it
// travels, and the wait blocks until it has completed. The two share a WorkSlot that carries the
// pending Work from one to the other (one training thread runs a step: no other thread touches
// it). Every tensor they name is written in place (the reduced bucket, and under compression its
// wire copy, written by the hooks on the communication thread), so a graph pass never moves a
// read of them across either node.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "kuai/core/backend.h"
#include "kuai/core/primitives.h"
#include "kuai/distributed/process_group.h"

namespace kuai::dist {

struct WorkSlot {
  std::shared_ptr<Work> work;
};

// The compression hook of one bucket, run on the communication thread around its all-reduce (or
// reduce-scatter): before, the bucket divided by the world size (plus the error feedback's
// residual, which keeps the new rounding error) rounded into its wire copy; after, the wire copy
// widened back into the bucket. Host loops over the bucket's memory, in chunks of kChunk elements
// through the backend's conversions. (The CPU device's memory is the host's; a device backend
// needs these two passes as kernels of its own.)
struct Compressor {
  static constexpr int64_t kChunk = 2048;
  float* grad;      // the bucket (fp32)
  uint16_t* wire;   // its bf16 / f16 copy
  float* residual;  // error feedback, or null
  int64_t n;
  DType wire_dtype;
  float inv_world;
  Backend* backend;

  void before() const;
  void after() const;
};

// (t!, more!...): t = op over ranks of t, launched asynchronously (ProcessGroup::all_reduce with
// its before / after hooks); `more` are the tensors the hooks write (the fp32 bucket around a
// compressed wire tensor), named so the graph knows they change.
class AllReduceStart final : public Primitive {
 public:
  AllReduceStart(std::shared_ptr<ProcessGroup> group, ReduceOp op, std::shared_ptr<WorkSlot> slot,
                 std::function<void()> before = {}, std::function<void()> after = {})
      : group_(std::move(group)),
        op_(op),
        slot_(std::move(slot)),
        before_(std::move(before)),
        after_(std::move(after)) {}
  KUAI_UPDATE_COMMON("all_reduce_start_")
  bool mutates_input(size_t) const override { return true; }
  bool host_side() const override { return true; }
  bool updates_in_place() const override { return true; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  ReduceOp op_;
  std::shared_ptr<WorkSlot> slot_;
  std::function<void()> before_, after_;
};

// (bucket!, shard![, wire_in!, wire_out![, residual!]]): shard = this rank's part of the average
// over ranks of bucket, launched asynchronously (ProcessGroup::reduce_scatter). With a wire dtype
// (gradient compression) the bucket is rounded into wire_in on the communication thread (the
// Compressor, with error feedback when a residual is given), reduce-scattered in the wire dtype
// into wire_out, and wire_out widened into the shard: the pointers are taken from the inputs when
// the primitive runs, so a replay's arena buffers are the ones used.
class ReduceScatterStart final : public Primitive {
 public:
  ReduceScatterStart(std::shared_ptr<ProcessGroup> group, std::shared_ptr<WorkSlot> slot,
                     DType wire = DType::kF32)
      : group_(std::move(group)), slot_(std::move(slot)), wire_(wire) {}
  KUAI_UPDATE_COMMON("reduce_scatter_start_")
  bool mutates_input(size_t) const override { return true; }
  bool host_side() const override { return true; }
  bool updates_in_place() const override { return true; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<WorkSlot> slot_;
  DType wire_;
};

// (in, out!): out = every rank's in, rank r's at [r * n, (r + 1) * n), launched asynchronously.
class AllGatherStart final : public Primitive {
 public:
  AllGatherStart(std::shared_ptr<ProcessGroup> group, std::shared_ptr<WorkSlot> slot)
      : group_(std::move(group)), slot_(std::move(slot)) {}
  KUAI_UPDATE_COMMON("all_gather_start_")
  bool mutates_input(size_t i) const override { return i == 1; }
  bool host_side() const override { return true; }
  bool updates_in_place() const override { return true; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<WorkSlot> slot_;
};

// (t!...): waits for the collective its slot holds (rethrowing its error) and clears the slot;
// `waited`, when given, receives the seconds the wait blocked (ZeRO-3's gather wait).
class CollectiveWait final : public Primitive {
 public:
  explicit CollectiveWait(std::shared_ptr<WorkSlot> slot,
                          std::function<void(double seconds)> waited = {})
      : slot_(std::move(slot)), waited_(std::move(waited)) {}
  KUAI_UPDATE_COMMON("wait_")
  bool mutates_input(size_t) const override { return true; }
  bool host_side() const override { return true; }
  bool updates_in_place() const override { return true; }

 private:
  std::shared_ptr<WorkSlot> slot_;
  std::function<void(double)> waited_;
};

// (t!): takes the bytes of t's storage back from the allocator (uninitialised; materialize), or
// gives them to it (release): ZeRO-3's unit buffers, whole only while their unit runs, as steps a
// captured graph repeats. t must span its whole storage.
class StorageResize final : public Primitive {
 public:
  explicit StorageResize(bool materialize) : materialize_(materialize) {}
  std::string_view name() const override { return materialize_ ? "materialize_" : "release_"; }
  OpClass op_class() const override { return OpClass::kOther; }
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  std::vector<TensorSpec> infer(std::span<const Tensor> in) const override;
  void eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;
  bool differentiable(size_t) const override { return false; }
  bool mutates_input(size_t) const override { return true; }
  bool host_side() const override { return true; }
  bool updates_in_place() const override { return true; }
  bool storage_op() const override { return true; }

 private:
  bool materialize_;
};

// The same, as calls: each dispatches its start and returns the slot to wait on; collective_wait
// dispatches the wait, naming the tensors the collective writes or reads (so no graph pass moves
// their reads or frees their memory before it). all_gather / all_reduce here wait at once.
std::shared_ptr<WorkSlot> reduce_scatter_start(const std::shared_ptr<ProcessGroup>& group,
                                               std::vector<Tensor> tensors,
                                               DType wire = DType::kF32);
std::shared_ptr<WorkSlot> all_gather_start(const std::shared_ptr<ProcessGroup>& group,
                                           const Tensor& in, const Tensor& out);
void collective_wait(const std::shared_ptr<WorkSlot>& slot, std::vector<Tensor> tensors,
                     std::function<void(double seconds)> waited = {});
void all_gather(const std::shared_ptr<ProcessGroup>& group, const Tensor& in, const Tensor& out);
void all_reduce(const std::shared_ptr<ProcessGroup>& group, const Tensor& t, ReduceOp op);

}  // namespace kuai::dist
