// `kuai bench`: machine ceilings and the measured rows (GEMM ceiling, memory bandwidth, the
// AdamW step against its bandwidth floor).
#pragma once

#include <string>
#include <vector>

namespace kuai::app {

int run_bench(const std::vector<std::string>& args);

}  // namespace kuai::app
