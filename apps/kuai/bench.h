// `kuai bench`: machine ceilings and the measured rows (GEMM ceiling, memory bandwidth, the
// AdamW step against its bandwidth floor).
#pragma once

#include <string>
#include <vector>

#include "kuai/train/config.h"

namespace kuai::app {

int run_bench(const std::vector<std::string>& args);

// `kuai bench attention [options]` (bench_attention.cpp): flash vs naive attention over T, with
// the PyTorch peer in the same run.
int run_attention_bench(const std::vector<std::string>& args);

// `kuai bench ddp [--rounds=N] [--section.key=value ...]` (bench_ddp.cpp): 1 rank against 2 ranks
// under mpirun (scaling efficiency), overlap off/on, compression off/fp16/bf16.
int run_ddp_bench(const std::vector<std::string>& args);

// `mpirun -np N kuai bench link [--no-save]` (bench_link.cpp): the all-reduce's latency and
// bandwidth over the ranks, saved for `kuai plan`.
int run_link_bench(const std::vector<std::string>& args);

// `kuai bench tokenizer [--text FILE] [--rounds N] [--tokenizers=llama2,llama3,gpt2]
// [--tokenizer PATH] [--no-peer]` (bench_tokenizer.cpp): tokenizer.json encoding MB/s against the
// JavaScript tokenizers, side by side.
int run_tokenizer_bench(const std::vector<std::string>& args);

// `kuai bench plan [--rounds=N]` (bench_plan.cpp): predicted against measured peak memory and
// step time on the validation configs.
int run_plan_bench(const std::vector<std::string>& args);

// `kuai info [--cpu-tier | --tier]` (info.cpp): the CPU, the ISA tier in force, which
// implementation runs each op family.
int run_info(const std::vector<std::string>& args);

// `kuai tune [--config FILE] [--section.key=value ...]` (tune.cpp): forgets this machine's GEMM
// tuning cache, measures the products of one training step of the config and prints the choices.
int run_tune(const train::TrainConfig& cfg);

// `kuai plan --config FILE [--section.key=value ...] [--ranks N] [--memory-per-rank 64GiB]
// [--bandwidth 25GB/s] [--latency 20us] [--fit] [--no-scaling]` (plan.cpp): the predicted memory
// per rank, step time and scaling of a config (kuai/plan/plan.h), ending with a RESULT line.
int run_plan(const std::vector<std::string>& args);

}  // namespace kuai::app
