// The memory plan of a captured step (kuai/compile/memory_plan.h): buffers that are alive at the
// same node never share a byte, every offset is aligned, the arena lies between the most bytes
// ever live at once (what no placement beats) and the sum of all buffers (what separate
// allocation would hold over a step); outputs take over dying inputs' buffers; and a replay
// allocates nothing but its named outputs: kernel scratch comes from the arena too. The peaks of
// eager and compiled steps are printed here and compared by `kuai bench compile`.
#include <gtest/gtest.h>

#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/compile/capture.h"
#include "kuai/compile/executable.h"
#include "kuai/compile/memory_plan.h"
#include "kuai/core/allocator.h"
#include "tests/compile/training_step.h"

namespace kuai::compiler {
namespace {

using test::batch_of;
using test::Trainer;

Graph capture_step(Trainer& t, const std::vector<Tensor>& batch) {
  std::vector<Tensor> losses;
  return capture([&] { losses = t.step(batch); },
                 [&](CaptureMode& mode) {
                   for (size_t m = 0; m < losses.size(); ++m)
                     mode.mark_output("loss" + std::to_string(m), losses[m]);
                 });
}

class Plan : public ::testing::TestWithParam<DType> {};

TEST_P(Plan, BuffersAliveTogetherNeverShareAByte) {
  Trainer t(GetParam());
  const Graph g = capture_step(t, batch_of(0, 2));
  for (bool in_place : {false, true}) {
    const MemoryPlan plan = plan_memory(g, in_place);
    ASSERT_FALSE(plan.buffers.empty());
    for (size_t a = 0; a < plan.buffers.size(); ++a) {
      const MemoryPlan::Buffer& x = plan.buffers[a];
      EXPECT_EQ(x.offset % MemoryPlan::kAlignment, 0);
      EXPECT_LE(x.offset + x.bytes, plan.arena_bytes);
      for (size_t b = a + 1; b < plan.buffers.size(); ++b) {
        const MemoryPlan::Buffer& y = plan.buffers[b];
        if (x.first <= y.last && y.first <= x.last) {
          EXPECT_TRUE(x.offset + x.bytes <= y.offset || y.offset + y.bytes <= x.offset)
              << "buffers " << a << " and " << b << " are alive together and overlap";
        }
      }
    }
    // Each planned value: its buffer covers it and lives from its node to its last use.
    const std::vector<int> last = last_uses(g);
    for (size_t v = 0; v < g.values.size(); ++v) {
      if (plan.buffer_of[v] < 0) continue;
      const MemoryPlan::Buffer& buf = plan.buffers[static_cast<size_t>(plan.buffer_of[v])];
      EXPECT_LE(buf.first, g.values[v].producer);
      EXPECT_GE(buf.last, last[v]);
      EXPECT_GE(buf.bytes, shape_numel(g.values[v].shape) * dtype_size(g.values[v].dtype));
    }
    EXPECT_GE(plan.arena_bytes, plan.lower_bound);
    EXPECT_LT(plan.arena_bytes, plan.planned_bytes);
    if (in_place) {
      EXPECT_GT(plan.inplace_reuses, 0);
    } else {
      EXPECT_EQ(plan.inplace_reuses, 0);
    }
    std::cout << "[ plan     ] " << dtype_name(GetParam()) << (in_place ? " in place" : "")
              << ": arena " << plan.arena_bytes << " B, lower bound " << plan.lower_bound
              << " B, separate " << plan.planned_bytes << " B, " << plan.buffers.size()
              << " buffers, " << plan.inplace_reuses << " in-place\n";
  }
}

TEST_P(Plan, AReplayAllocatesOnlyItsOutputs) {
  const DType dtype = GetParam();
  Trainer eager(dtype), compiled(dtype);
  // Eager: the allocator's peak over one step, above what lives between steps.
  eager.step(batch_of(0, 2));
  const int64_t eager_base = Allocator::get().stats().current;
  Allocator::get().reset_peak();
  eager.step(batch_of(1, 2));
  const int64_t eager_peak = Allocator::get().stats().peak - eager_base;

  const std::vector<Tensor> batch = batch_of(0, 2);
  Executable exe(capture_step(compiled, batch), batch);
  exe.run(batch_of(1, 2));
  const std::vector<Tensor> next = batch_of(2, 2);
  const MemoryStats before = Allocator::get().stats();
  const int64_t mine_before = Allocator::allocations_this_thread();
  Allocator::get().reset_peak();
  const std::vector<Tensor> out = exe.run(next);
  const MemoryStats after = Allocator::get().stats();
  const int64_t mine = Allocator::allocations_this_thread() - mine_before;
  const int64_t workers = after.num_allocs - before.num_allocs - mine;
  const int64_t compiled_peak = after.peak - before.current + exe.arena_bytes();
  std::cout << "[ memory   ] " << dtype_name(dtype) << ": eager step peak " << eager_peak
            << " B, compiled " << compiled_peak << " B (arena " << exe.arena_bytes()
            << "), allocations in a replay " << mine << " (+" << workers << " on worker threads)\n";
  // The replaying thread allocates its outputs and nothing else: everything else is the arena.
  EXPECT_EQ(mine, static_cast<int64_t>(out.size()));
  // Kernels' worker threads are not lent the node's scratch (allocator.h: ScratchRegion). At the
  // amx tier attention's per-head bf16 products run on oneDNN (gemm_lowp.h), whose scratchpad
  // is then taken per call on the worker threads: from cached blocks, so a replay still asks the
  // system for no memory. At every other tier those products take no scratch.
  if (dtype == DType::kBF16 && cpu::lowp_gemm_auto_path() == cpu::LowpGemmPath::kOneDNN) {
    EXPECT_EQ(after.reserved, before.reserved) << "worker-thread scratch from cached blocks";
  } else {
    EXPECT_EQ(workers, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, Plan,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16));

}  // namespace
}  // namespace kuai::compiler
