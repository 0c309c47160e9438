// This machine's measured costs, for the planner: each product of a step run through kuai's own
// op (so the GEMM router takes the implementation its tuning cache records for the shape, and
// calibrates the shape first when it has none, as a training run would), its time and the scratch
// it takes; attention's kernels forward and backward; the memory bandwidth at the working-set
// sizes a step's passes have; the cost of dispatching one op. Products too large to time quickly
// are timed on a proxy of the same proportions (their rate is within a few percent of a
// saturated GEMM's); every figure says where it came from.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kuai/plan/step_model.h"

namespace kuai::plan {

struct ProductCost {
  double seconds = 0;  // one product of the step's shape
  double gflops = 0;
  int64_t scratch = 0;  // bytes the product took from the allocator besides its output
  std::string source;   // "measured", "proxy 1024x1024x1024"
  // The tuning cache's entry for the shape: "onednn (onednn 161.2 openblas 150.3 GFLOP/s)";
  // empty where the router took its default (tuning off, under mpirun, a product too small).
  std::string routed;
};

// A memory-bound kernel of the step, forward and backward, measured at its shape.
struct KernelCost {
  double fwd_s = 0, bwd_s = 0;
};

struct AttentionCost {
  double fwd_s = 0, bwd_s = 0;  // one call of the step's shape
  std::string source;
};

// Bandwidth (GB/s) of a triad over arrays of a given total size: `sizes` bytes -> GB/s.
struct BandwidthCurve {
  std::vector<std::pair<double, double>> points;  // (bytes, GB/s), increasing bytes
  double at(double bytes) const;                  // interpolated in log(bytes)
  double dram() const { return points.empty() ? 0.0 : points.back().second; }
};

struct MachineCosts {
  std::map<std::string, ProductCost> products;  // by product_key
  std::map<std::string, AttentionCost> attention;
  std::map<std::string, KernelCost> kernels;  // by kernel_key
  BandwidthCurve bandwidth;
  double op_overhead_s = 0;  // one dispatched op, its output allocated from the cache
  int threads = 1;
  std::string cpu;  // model name, tier
};

std::string product_key(const Product& p);
int64_t last_level_cache_bytes();  // sysconf's L3 (else L2), at most 256 MiB
std::string attention_key(const AttentionWork& a);
std::string kernel_key(const Pass& p);  // the kernel and shape, either direction
// The seconds of one pass: its kernel measured (forward or backward), or for a pass without a
// kernel (the optimizer's) its bytes at the bandwidth of its size.
double pass_seconds(const Pass& p, const MachineCosts& costs);

// Times (and measures the scratch of) `p`: the fastest of a few runs after a warm-up. Products
// over `budget_flops` are timed on a proxy with the dimensions scaled down alike.
ProductCost measure_product(const Product& p, double budget_flops = 4e9);
AttentionCost measure_attention(const AttentionWork& a, double budget_flops = 4e9);
KernelCost measure_kernel(const Pass& p);
BandwidthCurve measure_bandwidth();
double measure_op_overhead();

// Tests: each figure from one run (the scratch is exact, the times rough).
void set_quick_measurements(bool on);

// Measures what `step` needs that `costs` does not hold yet, each distinct shape once (and the
// machine's bandwidth, dispatch cost and description the first time).
void measure_costs(const StepModel& step, MachineCosts& costs);

}  // namespace kuai::plan
