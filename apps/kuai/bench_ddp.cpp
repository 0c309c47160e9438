// `kuai bench ddp`: what multi-process data parallelism buys on this machine (techniques 2, 7).
// It runs `kuai train` itself, one process per arm, arms alternating over rounds:
//   - 1 rank x 1 thread (the baseline),
//   - 2 ranks x 1 thread under mpirun with overlap on (the default), overlap off, fp16 and bf16
//     compression, ZeRO-1 (AdamW state sharded), ZeRO-2 (gradients too) and ZeRO-3 (parameters
//     too, gathered a unit ahead, and on demand): compare the peak live tensor memory and RSS
//     of a rank, and ZeRO-3's wait for its gathers (what prefetch does not hide),
// each with the same per-rank batch, so 2 ranks process twice the tokens per step. Scaling
// efficiency = tokens/s of 2 ranks / (2 x tokens/s of 1 rank). Reported: median step time and
// tokens/s over rounds with their spread (min-max), each 2-rank arm against the default 2-rank
// arm (overlap on, fp32) as a ratio, or "within noise" when their ranges of step times overlap;
// MiB handed to collectives per step and the overlap share (the trainer's counts), peak RSS.
// First it measures the link (`kuai bench link`: the all-reduce's latency and bandwidth, which
// `kuai plan` reads).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "command.h"

namespace kuai::app {
namespace {

struct Arm {
  Arm(std::string l, int r, std::vector<std::string> e)
      : label(std::move(l)), ranks(r), extra(std::move(e)) {}
  std::string label;
  int ranks = 1;
  std::vector<std::string> extra;  // config overrides of the arm
  std::vector<double> tokens_per_s, step_ms, rss_mib, live_mib;
  double comm_mib = 0;
  double overlap = -1;  // the share of reduced bytes launched during backward (measured)
  std::vector<double> gather_wait_ms;  // ZeRO-3: the step's wait for its gathers (measured)
  double state_mib = -1;               // ZeRO: the AdamW moments this rank holds
  double unsharded_mib = -1;
};

// Runs one arm once; false (with the tail of its output in `err`) when it failed.
bool run_arm(Arm& a, const std::vector<std::string>& base, std::string* err) {
  std::string cmd;
  if (a.ranks > 1)
    cmd = fmt::format("mpirun --allow-run-as-root --oversubscribe -np {} -x OMP_NUM_THREADS=1 ",
                      a.ranks);
  else
    cmd = "OMP_NUM_THREADS=1 ";
  cmd += self_path() + " train";
  for (const std::string& s : base) cmd += " '" + s + "'";
  for (const std::string& s : a.extra) cmd += " '" + s + "'";
  int rc = 0;
  const std::string out = run_captured(cmd, &rc);
  const size_t at = out.rfind("RESULT tokens_per_s=");  // the summary line, the last one
  double tps = 0, ms = 0, rss = 0;
  if (rc != 0 || at == std::string::npos ||
      std::sscanf(out.c_str() + at, "RESULT tokens_per_s=%lf step_ms_median=%lf peak_rss_mib=%lf",
                  &tps, &ms, &rss) != 3) {
    *err = fmt::format("{}(exit status {})",
                       out.size() > 1500 ? out.substr(out.size() - 1500) : out, rc);
    return false;
  }
  a.tokens_per_s.push_back(tps);
  a.step_ms.push_back(ms);
  a.rss_mib.push_back(rss);
  const size_t live = out.find("memory: peak live tensors ");
  if (live != std::string::npos) a.live_mib.push_back(std::stod(out.substr(live + 26)));
  const size_t z = out.find("MiB of moments on this rank");
  if (z != std::string::npos) {
    const size_t start = out.rfind(", ", z) + 2;
    a.state_mib = std::stod(out.substr(start, z - start));
    const size_t u = out.find("(unsharded: ", z);
    if (u != std::string::npos) a.unsharded_mib = std::stod(out.substr(u + 12));
  }
  // The payload rank 0 handed to collectives per step, as the trainer counted it (all-reduce,
  // or ZeRO-2's reduce-scatter and all-gather): measured, not computed from the config.
  const size_t d = out.find(" comm_mib_per_step=", at);
  if (d != std::string::npos) a.comm_mib = std::stod(out.substr(d + 19));
  const size_t ov = out.find(" overlap=", at);
  if (ov != std::string::npos) a.overlap = std::stod(out.substr(ov + 9));
  const size_t gw = out.find(" gather_wait_ms_per_step=", at);
  if (gw != std::string::npos) a.gather_wait_ms.push_back(std::stod(out.substr(gw + 25)));
  return true;
}

}  // namespace

int run_ddp_bench(const std::vector<std::string>& args) {
  int64_t rounds = 2;
  std::string json = "runs/bench/ddp.json";
  std::vector<std::string> base = {"--train.steps=8",          "--train.threads=1",
                                   "--train.eval_every=0",     "--log.progress=off",
                                   "--log.jsonl=false",        "--log.tensorboard=false",
                                   "--log.save_weights=false", "--run.name=bench_ddp"};
  for (const std::string& a : args) {
    if (a == "ddp") continue;
    if (a.rfind("--rounds=", 0) == 0)
      rounds = std::max(1, std::stoi(a.substr(9)));
    else if (a.rfind("--json=", 0) == 0)
      json = a.substr(7);
    else if (a.rfind("--", 0) == 0)
      base.push_back(a);  // --config FILE is not supported here: use --section.key=value
    else
      throw std::invalid_argument("bench ddp: unknown argument '" + a + "'");
  }
  std::vector<Arm> arms = {
      {"1 rank x 1 thread", 1, {}},
      {"2 ranks x 1 thread, overlap on", 2, {"--dist.overlap=true"}},
      {"2 ranks x 1 thread, overlap off", 2, {"--dist.overlap=false"}},
      {"2 ranks, fp16 compression", 2, {"--dist.compression=fp16"}},
      {"2 ranks, bf16 compression", 2, {"--dist.compression=bf16"}},
      {"2 ranks, ZeRO-1 (all-reduce, all-gather)", 2, {"--dist.zero=1"}},
      {"2 ranks, ZeRO-2 (reduce-scatter, all-gather)", 2, {"--dist.zero=2"}},
      {"2 ranks, ZeRO-3 (gathers per unit, prefetch 1)", 2, {"--dist.zero=3"}},
      {"2 ranks, ZeRO-3, prefetch 0 (gathers on demand)",
       2,
       {"--dist.zero=3", "--dist.prefetch=0"}},
  };
  // The link's constants first (all-reduce latency and bandwidth over 2 ranks, bench_link.cpp),
  // saved for `kuai plan`'s communication model.
  {
    int rc = 0;
    const std::string out =
        run_captured("mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 " +
                         self_path() + " bench link",
                     &rc);
    if (rc != 0) throw std::runtime_error("bench ddp: measuring the link failed:\n" + out);
    std::cout << out << "\n";
  }
  std::cerr << fmt::format("bench ddp: {} rounds of {} arms; each run `kuai train", rounds,
                           arms.size());
  for (const std::string& s : base) std::cerr << " " << s;
  std::cerr << "`\n";
  for (int64_t r = 0; r < rounds; ++r) {
    // ABBA: the arms in order in even rounds, reversed in odd ones, so that no arm always runs
    // first (or last) on a machine that warms up or gets busier.
    for (size_t j = 0; j < arms.size(); ++j) {
      Arm& a = arms[r % 2 == 0 ? j : arms.size() - 1 - j];
      std::string err;
      if (!run_arm(a, base, &err))
        throw std::runtime_error("bench ddp: the run '" + a.label + "' failed:\n" + err);
      std::cerr << fmt::format("  round {} {:<34} {:8.1f} tok/s, step {:.1f} ms\n", r + 1, a.label,
                               a.tokens_per_s.back(), a.step_ms.back());
    }
  }
  const double one = median(arms[0].tokens_per_s);
  auto lo = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  auto hi = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  const Arm& ref = arms[1];  // 2 ranks, overlap on, fp32
  std::cout << "\n| arm | step ms (min-max) | tokens/s | scaling efficiency | step vs 2 ranks "
               "overlap on | MiB sent per step (measured) | overlap (measured) | peak live "
               "tensors MiB (rank 0) | peak RSS MiB (rank 0) | AdamW state MiB per rank | "
               "ZeRO-3 gather wait ms per step (measured) |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::ostringstream js;
  js << "{\n  \"rows\": [\n";
  for (size_t i = 0; i < arms.size(); ++i) {
    const Arm& a = arms[i];
    const double tps = median(a.tokens_per_s);
    const double eff = a.ranks > 1 ? tps / (a.ranks * one) : 1.0;
    const bool is_zero3 = !a.gather_wait_ms.empty() && std::find(a.extra.begin(), a.extra.end(),
                                                                 "--dist.zero=3") != a.extra.end();
    std::string vs = "—";
    if (a.ranks > 1 && i != 1) {
      const bool noise = lo(a.step_ms) <= hi(ref.step_ms) && lo(ref.step_ms) <= hi(a.step_ms);
      vs = noise ? "within noise" : fmt::format("x{:.3f}", median(a.step_ms) / median(ref.step_ms));
    }
    std::cout << fmt::format(
        "| {} | {:.1f} ({:.1f}-{:.1f}) | {:.0f} | {} | {} | {} | {} | {:.0f} | {:.0f} | {} | {} "
        "|\n",
        a.label, median(a.step_ms), lo(a.step_ms), hi(a.step_ms), tps,
        a.ranks > 1 ? fmt::format("{:.2f}", eff) : "—", vs,
        a.ranks > 1 ? fmt::format("{:.3f}", a.comm_mib) : "—",
        a.ranks > 1 && a.overlap >= 0 ? fmt::format("{:.3f}", a.overlap) : "—", median(a.live_mib),
        median(a.rss_mib),
        a.state_mib >= 0 ? fmt::format("{:.1f} (unsharded {:.1f})", a.state_mib, a.unsharded_mib)
                         : "all",
        is_zero3 ? fmt::format("{:.2f}", median(a.gather_wait_ms)) : "—");
    js << fmt::format(
        "    {{\"arm\": \"{}\", \"ranks\": {}, \"step_ms\": {:.2f}, \"step_ms_min\": {:.2f}, "
        "\"step_ms_max\": {:.2f}, \"tokens_per_s\": {:.1f}, \"scaling_efficiency\": {:.3f}, "
        "\"comm_mib_per_step\": {:.3f}, \"overlap\": {:.3f}, \"peak_live_mib\": {:.1f}, "
        "\"peak_rss_mib\": {:.1f}, \"state_mib\": {:.1f}, \"gather_wait_ms\": {:.3f}}}{}\n",
        a.label, a.ranks, median(a.step_ms), lo(a.step_ms), hi(a.step_ms), tps, eff, a.comm_mib,
        a.overlap, median(a.live_mib), median(a.rss_mib), a.state_mib,
        is_zero3 ? median(a.gather_wait_ms) : 0.0, i + 1 < arms.size() ? "," : "");
  }
  js << "  ]\n}\n";
  const std::filesystem::path p(json);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream(p) << js.str();
  std::cout << "\nwrote " << json << "\n";
  return 0;
}

}  // namespace kuai::app
