// `kuai tune`: forgets this machine's GEMM tuning cache and measures the products of one
// training step (forward and backward of the config's model, at its precision) so that the
// router (kuai/backend/cpu/gemm/router.h) records the fastest implementation of each; prints
// what it chose. `kuai train` measures new shapes on first use anyway; tune redoes it on purpose
// (after a library upgrade, on a quieter machine).
#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <iostream>
#include <stdexcept>

#include "bench.h"
#include "kuai/amp/autocast.h"
#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/rng.h"
#include "kuai/nn/gpt.h"
#include "kuai/nn/optimize.h"

namespace kuai::app {

int run_tune(const train::TrainConfig& cfg) {
  if (cfg.threads > 0) omp_set_num_threads(static_cast<int>(cfg.threads));
  cpu::TuningCache& cache = cpu::TuningCache::get();
  if (!cache.enabled())
    throw std::invalid_argument("GEMM tuning is off (KUAI_GEMM_TUNING=off): nothing to measure");
  if (!cache.may_calibrate())
    throw std::invalid_argument("run `kuai tune` as one process, not under mpirun");
  cache.clear();
  nn::GPT model(cfg.model, static_cast<uint64_t>(cfg.seed));
  optimize(model, nn::parse_attention_impl(cfg.attention));
  Generator gen(static_cast<uint64_t>(cfg.seed), 0);
  const Tensor x = gen.randint({cfg.batch_size, cfg.model.seq_len}, 0,
                               static_cast<int32_t>(cfg.model.vocab_size));
  const Tensor y = gen.randint({cfg.batch_size, cfg.model.seq_len}, 0,
                               static_cast<int32_t>(cfg.model.vocab_size));
  const DType compute = amp::precision_dtype(cfg.precision);
  const auto t0 = std::chrono::steady_clock::now();
  {
    Tensor loss;
    {
      amp::AutocastGuard amp(compute != DType::kF32, compute);
      loss = model.loss(x, y);
    }
    loss.backward();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << fmt::format(
      "kuai tune: one {} step of batch {} x {} on {} threads measured {} product shapes in "
      "{:.1f} s\n",
      cfg.precision, cfg.batch_size, cfg.model.seq_len, omp_get_max_threads(),
      cache.entries().size(), s);
  std::cout << cpu::gemm_routing_report();
  return 0;
}

}  // namespace kuai::app
