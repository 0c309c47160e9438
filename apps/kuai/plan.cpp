// `kuai plan`: will this config fit, how fast will it train, how far will it scale (kuai/plan/).
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>

#include "bench.h"
#include "command.h"
#include "kuai/plan/plan.h"

namespace kuai::app {
namespace {

// `v` as a positive integer written plainly ("2", not "02" or "2x"), else an error naming `flag`.
int64_t positive_integer(const std::string& v, const std::string& flag) {
  int64_t n = 0;
  try {
    n = std::stoll(v);
  } catch (const std::exception&) {
    n = 0;
  }
  if (n < 1 || std::to_string(n) != v)
    throw std::invalid_argument(flag + " = '" + v + "' is not a positive integer");
  return n;
}

}  // namespace

int run_plan(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  int64_t ranks = 1, ranks_per_host = 0;
  int64_t budget = 0;
  std::optional<double> bandwidth, latency;
  bool do_fit = false, do_scaling = true;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "config", v)) {
      config_path = v;
    } else if (take_option(args, i, "ranks", v)) {
      ranks = positive_integer(v, "--ranks");
    } else if (take_option(args, i, "ranks-per-host", v)) {
      ranks_per_host = positive_integer(v, "--ranks-per-host");
    } else if (take_option(args, i, "memory-per-rank", v)) {
      budget = plan::parse_bytes(v, "--memory-per-rank");
      if (budget <= 0) throw std::invalid_argument("--memory-per-rank must be positive");
    } else if (take_option(args, i, "bandwidth", v)) {
      bandwidth = plan::parse_gbs(v, "--bandwidth");
      if (!(*bandwidth > 0)) throw std::invalid_argument("--bandwidth must be positive");
    } else if (take_option(args, i, "latency", v)) {
      latency = plan::parse_us(v, "--latency");
    } else if (args[i] == "--fit") {
      do_fit = true;
    } else if (args[i] == "--no-scaling") {
      do_scaling = false;
    } else {
      overrides.push_back(args[i]);  // --section.key=value, as kuai train takes them
    }
  }
  const train::TrainConfig cfg = train::load_config(config_path, overrides);
  if (cfg.threads > 0) omp_set_num_threads(static_cast<int>(cfg.threads));
  if (budget == 0) budget = plan::machine_memory_bytes();

  // The link: given, else measured by `kuai bench ddp`, else an assumption said as such.
  plan::Link link = plan::measured_or_assumed_link();
  if (link.source.starts_with("assumed")) link.source += ", or give --bandwidth / --latency";
  if (bandwidth || latency) {
    if (bandwidth) link.bandwidth_gbs = *bandwidth;
    if (latency) link.latency_us = *latency;
    link.source = "given";
  }

  plan::MachineCosts costs;
  // The disk offloaded optimizer state streams through: measured by `kuai bench disk`, else an
  // assumption said as such.
  if (const auto d = plan::measured_disk()) {
    costs.disk = *d;
  } else {
    costs.disk.read_gbs = costs.disk.write_gbs = costs.disk.update_gbs = 0.5;
    costs.disk.source = "assumed: run `kuai bench disk` to measure it";
  }
  // Ranks that share a host run beside each other. Unless told, the hosts are taken to be like
  // this one and filled: as many ranks as its cores hold at the rank's thread count (all N when
  // they fit here, as `mpirun -np N` here would run them).
  const int64_t per_host =
      ranks_per_host > 0
          ? ranks_per_host
          : std::max<int64_t>(1, omp_get_num_procs() / std::max(1, omp_get_max_threads()));
  costs.neighbours = static_cast<int>(std::min<int64_t>({per_host, ranks, 8}) - 1);
  const plan::Prediction p = plan::predict(cfg, ranks, budget, link, costs);
  std::vector<plan::ScalingRow> scale;
  if (do_scaling) scale = plan::scaling(cfg, link, costs, {1, 2, 8, 64, 512});
  std::cout << plan::report(p, costs, link, scale, cfg.save_every, cfg.compile);
  if (do_fit) {
    if (p.fits()) {
      std::cout << "\n--fit: the config fits as it is\n";
    } else {
      const std::vector<plan::FitOption> options = plan::fit(cfg, ranks, budget, link, costs);
      if (options.empty()) {
        std::cout << "\n--fit: no combination of fewer micro-batch rows (more accumulation), "
                     "bf16, flash attention, ZeRO-1/2/3, activation recomputation, optimizer "
                     "state offloaded to disk and up to 64x the ranks (the same global batch) "
                     "fits. What is left per rank is its shard of the parameters and their "
                     "gradients, the units whole at once and one row's activations: a shorter "
                     "sequence, a smaller model or more memory per rank\n";
      } else {
        std::cout << fmt::format(
            "\n--fit: {} change set{} within {} (5% spare); on {} rank{} first, then more ranks "
            "(the same global batch); fastest first, at most 4 per rank count, then the fastest "
            "of each other ZeRO stage:\n",
            options.size(), options.size() == 1 ? "" : "s",
            fmt::format("{:.1f} MiB", double(budget) / (1 << 20)), ranks, ranks == 1 ? "" : "s");
        // The ZeRO stage an option runs (its override, else the config's).
        auto stage_of = [&](const plan::FitOption& f) {
          for (const std::string& x : f.overrides)
            if (x.rfind("--dist.zero=", 0) == 0) return std::stoll(x.substr(12));
          return static_cast<long long>(cfg.zero);
        };
        std::map<int64_t, int> shown;
        std::set<std::pair<int64_t, long long>> stage_shown;  // (ranks, stage)
        for (const plan::FitOption& f : options) {
          const bool top = shown[f.ranks]++ < 4;
          if (!stage_shown.insert({f.ranks, stage_of(f)}).second && !top) continue;
          std::string o;
          for (const std::string& x : f.overrides) o += (o.empty() ? "" : " ") + x;
          std::cout << fmt::format("  {:>9.1f} MiB {:>9.2f} ms/step {:>10.0f} tok/s  {}\n",
                                   double(f.peak_bytes) / (1 << 20), f.step_s * 1e3, f.tokens_per_s,
                                   f.command(config_path, overrides));
        }
      }
    }
  }
  std::cout << plan::result_line(p) << std::endl;
  return 0;
}

}  // namespace kuai::app
