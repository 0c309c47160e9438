// This machine's measured costs, for the planner: every distinct op of a traced step
// (plan/trace.h) run here through the CPU backend on tensors laid out as the step's, with its
// time and the scratch it took from the allocator. Products run through the GEMM router, which
// takes the implementation its tuning cache records for the shape (and calibrates a new shape
// first, as a training run would). The ops run as a step runs them: one after another in the
// step's order, each evaluation timed on its own over several passes, on copies of their data
// that exceed the last-level cache (a step's operands come from memory), beside the other ranks
// of the run on this host. An op too large to run quickly is run on a slice of its batch and
// scaled (its time is linear in the batch); one that cannot be sliced is priced at the measured
// bandwidth. Every figure says where it came from.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kuai/plan/disk.h"
#include "kuai/plan/trace.h"

namespace kuai::plan {

struct OpCost {
  double seconds = 0;   // one evaluation at the step's shape
  int64_t scratch = 0;  // bytes the kernel took from the allocator besides its outputs
  std::string source;   // "measured", "measured on 1/8 of the batch, scaled", "estimated"
};

// Bandwidth (GB/s) of a triad over arrays of a given total size.
struct BandwidthCurve {
  std::vector<std::pair<double, double>> points;  // (bytes, GB/s), increasing bytes
  double at(double bytes) const;                  // interpolated in log(bytes)
  double dram() const { return points.empty() ? 0.0 : points.back().second; }
};

struct MachineCosts {
  // Other ranks of the run on this host: each measurement runs beside that many copies of the op
  // (each on memory of its own, with as many threads as the measured one), as the ranks of a run
  // on one host share its last-level cache, memory bandwidth and, oversubscribed, its cores. Set
  // before the first measurement; at most 7.
  int neighbours = 0;
  std::map<std::string, OpCost> ops;  // by OpRecord::key
  BandwidthCurve bandwidth;
  double op_overhead_s = 0;  // dispatching one op (its output allocated from the cache)
  double gflops = 0;         // the best rate measured (prices ops too large to run here)
  int threads = 1;
  std::string cpu;  // the CPU backend's description
  // The disk offloaded optimizer state streams through (kuai bench disk; else an assumption
  // said as such): an op that moves disk bytes (Cost::disk_read / disk_written) is priced at it.
  Disk disk;
};

int64_t last_level_cache_bytes();  // sysconf's L3 (else L2), at most 256 MiB

// Runs `op` here alone (back to back with itself: measure_costs times a step's ops in its
// order) and times it (the median of a few runs after a warm-up), beside `neighbours` copies of
// it running on threads of their own (MachineCosts::neighbours). Ops over
// `budget_flops` or `budget_bytes` of activations run on a slice of their batch; one that would
// still allocate more than 4 x `budget_bytes` is "estimated" (priced from its bytes and FLOPs).
// An op over this many FLOPs runs on a slice of its batch. A product cut small runs well below its
// whole rate (a 512 x 4096 x 32000 weight gradient cut 33 ways ran at 81 GFLOP/s against 176 in
// the step), so the budget is a fraction of a second of products, not of planning time.
inline constexpr double kSliceFlops = 64e9;

OpCost measure_op(const OpRecord& op, int neighbours = 0, double budget_flops = kSliceFlops,
                  double budget_bytes = double(int64_t{256} << 20));
BandwidthCurve measure_bandwidth();
double measure_op_overhead();

// Tests: each figure from one run (the scratch is exact, the times rough).
void set_quick_measurements(bool on);

// Measures each op of `trace` that `costs` does not hold yet (and the machine's bandwidth,
// dispatch cost and description the first time).
void measure_costs(const StepTrace& trace, MachineCosts& costs);

// The kernel time of one op (0 for views and host-side ops: their cost is the dispatch).
double op_seconds(const OpRecord& op, const MachineCosts& costs);

}  // namespace kuai::plan
