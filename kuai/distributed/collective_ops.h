// Collectives as primitives, so a dispatch mode sees them and a captured training step holds its
// communication (technique 4 over technique 2): DDP launches each bucket's all-reduce through
// AllReduceStart and waits for it through CollectiveWait, both dispatched like any op. A replay
// runs the two nodes where the capture saw them: the start queues the collective on the process
// group's communication thread and returns at once, the following backward nodes run while it
// travels, and the wait blocks until it has completed. The two share a WorkSlot that carries the
// pending Work from one to the other (one training thread runs a step: no other thread touches
// it). Every tensor they name is written in place (the reduced bucket, and under compression its
// wire copy, written by the hooks on the communication thread), so a graph pass never moves a
// read of them across either node.
#pragma once

#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "kuai/core/primitives.h"
#include "kuai/distributed/process_group.h"

namespace kuai::dist {

struct WorkSlot {
  std::shared_ptr<Work> work;
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

// (t!...): waits for the collective its slot holds (rethrowing its error) and clears the slot.
class CollectiveWait final : public Primitive {
 public:
  explicit CollectiveWait(std::shared_ptr<WorkSlot> slot) : slot_(std::move(slot)) {}
  KUAI_UPDATE_COMMON("wait_")
  bool mutates_input(size_t) const override { return true; }
  bool host_side() const override { return true; }
  bool updates_in_place() const override { return true; }

 private:
  std::shared_ptr<WorkSlot> slot_;
};

}  // namespace kuai::dist
