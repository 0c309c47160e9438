// A per-primitive time profile, collected at the dispatch point when KUAI_PROFILE=1 is set in
// the environment (or enable() is called): calls, total and mean milliseconds per op name.
// Off, it costs one branch per op. Entries that carry FLOPs (the GEMM router's products, one row
// per shape and implementation) also show their achieved GFLOP/s.
#pragma once

#include <string>
#include <string_view>

namespace kuai::profiler {

bool enabled();
void enable(bool on);
void record(std::string_view op, double ms, double flops = 0);
std::string report();  // a table sorted by total time, heaviest first
void reset();

}  // namespace kuai::profiler
