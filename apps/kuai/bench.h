// `kuai bench`: machine ceilings and the measured rows (GEMM ceiling, memory bandwidth, the
// AdamW step against its bandwidth floor).
#pragma once

#include <string>
#include <vector>

namespace kuai::app {

int run_bench(const std::vector<std::string>& args);

// `kuai bench attention [options]` (bench_attention.cpp): flash vs naive attention over T, with
// the PyTorch peer in the same run.
int run_attention_bench(const std::vector<std::string>& args);

// `kuai bench ddp [--rounds=N] [--section.key=value ...]` (bench_ddp.cpp): 1 rank against 2 ranks
// under mpirun (scaling efficiency), overlap off/on, compression off/fp16/bf16.
int run_ddp_bench(const std::vector<std::string>& args);

}  // namespace kuai::app
