// A per-primitive time profile, collected at the dispatch point when KUAI_PROFILE=1 is set in
// the environment (or enable() is called): calls, total and mean milliseconds per op name.
// Off, it costs one branch per op. Entries that carry FLOPs (the GEMM router's products, one row
// per shape and implementation) also show their achieved GFLOP/s; entries that carry bytes (every
// dispatched op: its Primitive::cost) their achieved GB/s and, given the machine's memory
// bandwidth, how far they are from the time their bytes take at it.
//
// A backend may add sections to the report (the CPU backend: each product of the step timed again
// alone, hot and cold): they run when the report is made, with the profiler off.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace kuai::profiler {

bool enabled();
void enable(bool on);
void record(std::string_view op, double ms, double flops = 0, double bytes = 0);
// A table sorted by total time, heaviest first, then every registered section. With
// `bandwidth_gbs` > 0 (the machine's measured memory bandwidth), each row with bytes also shows
// "at bw": the milliseconds its bytes take at that bandwidth, and its time as a multiple of that.
std::string report(double bandwidth_gbs = 0);
void reset();

// A section appended to report(); called with the profiler off, so that what it runs is not
// recorded. `on_reset` forgets what the section has gathered when reset() is called. A section
// registered twice under one name is kept once.
void add_section(std::string name, std::function<std::string()> section,
                 std::function<void()> on_reset);

}  // namespace kuai::profiler
