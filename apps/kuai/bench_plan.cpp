// `kuai bench plan`: how right `kuai plan` is here. For each validation config it runs `kuai plan`
// (the prediction, as a user gets it) and at once `kuai train` (under mpirun for 2 ranks) on the
// same config (each round, row by row; --rounds=N gives medians of N), and compares the predicted
// peak of live tensors and step time with what the run measured (its RESULT line: peak_alloc_mib,
// step_ms_median). The planner's bars: peak within 5%, step time within 25%. Configs: the GPT-2 and
// LLaMA families, fp32, bf16 and fp16, accumulation, flash and naive attention, DDP, ZeRO-1 and
// ZeRO-2 on 2 ranks; more with
// --configs "OVERRIDES;OVERRIDES" (a `ranks=2` item runs it on 2 ranks).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "bench.h"
#include "command.h"
#include "kuai/plan/plan.h"

namespace kuai::app {
namespace {

// key=value from the last RESULT line of `out`; NaN when absent.
double result_value(const std::string& out, const std::string& key) {
  const size_t at = out.rfind("RESULT ");
  if (at == std::string::npos) return std::nan("");
  const size_t k = out.find(" " + key + "=", at);
  if (k == std::string::npos) return std::nan("");
  return std::stod(out.substr(k + key.size() + 2));
}

struct Case {
  std::string label;
  int ranks = 1;
  std::vector<std::string> overrides;
};

std::string quoted(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += " '" + x + "'";
  return s;
}

}  // namespace

int run_plan_bench(const std::vector<std::string>& args) {
  int64_t rounds = 1, steps = 10;
  std::string json = "runs/bench/plan.json";
  std::vector<Case> cases = {
      {"gpt2 fp32 naive", 1, {}},
      {"gpt2 bf16", 1, {"--train.precision=bf16"}},
      {"gpt2 fp32, 4 x 4 accumulation", 1, {"--train.batch_size=4", "--train.accum_steps=4"}},
      {"gpt2 fp32 flash, T 1024",
       1,
       {"--model.seq_len=1024", "--train.batch_size=2", "--model.attention=flash"}},
      {"llama fp32 GQA flash",
       1,
       {"--model.family=llama", "--model.n_kv_head=2", "--model.attention=flash"}},
      {"llama bf16, 2 x 4 accumulation",
       1,
       {"--model.family=llama", "--train.precision=bf16", "--train.batch_size=4",
        "--train.accum_steps=2"}},
      {"llama fp16 (loss scaler)", 1, {"--model.family=llama", "--train.precision=fp16"}},
      {"gpt2 fp32 compiled", 1, {"--train.compile=true"}},
      {"gpt2 DDP 2 ranks", 2, {}},
      {"gpt2 ZeRO-1 2 ranks", 2, {"--dist.zero=1"}},
      {"llama ZeRO-2 2 ranks", 2, {"--model.family=llama", "--dist.zero=2"}},
      {"gpt2 DDP bf16 compression 2 ranks", 2, {"--dist.compression=bf16"}},
  };
  std::vector<std::string> base = {"--data.source=synthetic", "--train.eval_every=0",
                                   "--log.progress=off",      "--log.jsonl=false",
                                   "--log.tensorboard=false", "--log.save_weights=false",
                                   "--run.name=bench_plan",   "--train.batch_size=8"};
  for (const std::string& a : args) {
    if (a == "plan") continue;
    if (a.rfind("--rounds=", 0) == 0) {
      rounds = std::max(1, std::stoi(a.substr(9)));
    } else if (a.rfind("--steps=", 0) == 0) {
      steps = std::max(3, std::stoi(a.substr(8)));
    } else if (a.rfind("--json=", 0) == 0) {
      json = a.substr(7);
    } else if (a.rfind("--configs=", 0) == 0) {
      cases.clear();
      std::stringstream all(a.substr(10));
      std::string one;
      while (std::getline(all, one, ';')) {
        Case c{one, 1, {}};
        std::stringstream words(one);
        std::string w;
        while (words >> w) {
          if (w.rfind("ranks=", 0) == 0)
            c.ranks = std::stoi(w.substr(6));
          else
            c.overrides.push_back(w);
        }
        cases.push_back(c);
      }
    } else if (a.rfind("--", 0) == 0) {
      base.push_back(a);  // --section.key=value for every config
    } else {
      throw std::invalid_argument("bench plan: unknown argument '" + a + "'");
    }
  }
  const std::string kuai = self_path();
  // The link: measured once if `kuai bench ddp` has not measured it yet.
  bool multi = false;
  for (const Case& c : cases) multi = multi || c.ranks > 1;
  if (multi && !plan::measured_link()) {
    int rc = 0;
    const std::string out =
        run_captured("mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 " +
                         kuai + " bench link",
                     &rc);
    if (rc != 0) throw std::runtime_error("bench plan: measuring the link failed:\n" + out);
    std::cerr << out;
  }
  struct Row {
    Case c;
    std::vector<double> pred_mib, pred_ms, mib, ms;
  };
  std::vector<Row> rows;
  for (const Case& c : cases) rows.push_back({c, {}, {}, {}, {}});
  // Each round runs, row by row, the prediction and then the run it predicts, side by side: the
  // machine's load changes over minutes, and both halves of a ratio should see the same.
  for (int64_t round = 0; round < rounds; ++round)
    for (Row& r : rows) {
      std::vector<std::string> o = base;
      o.insert(o.end(), r.c.overrides.begin(), r.c.overrides.end());
      if (r.c.ranks > 1) o.push_back("--train.threads=1");
      int rc = 0;
      const std::string pred =
          run_captured((r.c.ranks > 1 ? "OMP_NUM_THREADS=1 " : "") + kuai + " plan --no-scaling" +
                           quoted(o) + (r.c.ranks > 1 ? fmt::format(" --ranks {}", r.c.ranks) : ""),
                       &rc);
      const double pred_mib = result_value(pred, "peak_mib"),
                   pred_ms = result_value(pred, "step_ms");
      if (rc != 0 || std::isnan(pred_mib))
        throw std::runtime_error("bench plan: `kuai plan` failed for " + r.c.label + ":\n" + pred);
      o.push_back(fmt::format("--train.steps={}", steps));
      const std::string cmd =
          (r.c.ranks > 1
               ? fmt::format(
                     "mpirun --allow-run-as-root --oversubscribe -np {} -x OMP_NUM_THREADS=1 ",
                     r.c.ranks)
               : std::string()) +
          kuai + " train" + quoted(o);
      const std::string out = run_captured(cmd, &rc);
      const double mib = result_value(out, "peak_alloc_mib"),
                   ms = result_value(out, "step_ms_median");
      if (rc != 0 || std::isnan(mib))
        throw std::runtime_error("bench plan: `kuai train` failed for " + r.c.label + ":\n" +
                                 (out.size() > 2000 ? out.substr(out.size() - 2000) : out));
      r.pred_mib.push_back(pred_mib);
      r.pred_ms.push_back(pred_ms);
      r.mib.push_back(mib);
      r.ms.push_back(ms);
      std::cerr << fmt::format(
          "  {:<40} peak {:.1f} MiB (predicted {:.1f}), step {:.1f} ms "
          "(predicted {:.1f})\n",
          r.c.label, mib, pred_mib, ms, pred_ms);
    }
  std::cout << fmt::format(
      "\nkuai plan against kuai train, side by side ({} steps, median of {} round{}; batch 8 x 256 "
      "unless "
      "said):\n\n| config | ranks | peak MiB predicted | measured | ratio | step ms predicted | "
      "measured | ratio |\n|---|---|---|---|---|---|---|---|\n",
      steps, rounds, rounds == 1 ? "" : "s");
  std::ostringstream js;
  js << "{\n  \"rows\": [\n";
  int mem_ok = 0, time_ok = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double mib = median(r.mib), ms = median(r.ms);
    const double pred_mib = median(r.pred_mib), pred_ms = median(r.pred_ms);
    const double mr = pred_mib / mib, tr = pred_ms / ms;
    mem_ok += std::abs(mr - 1) <= 0.05;
    time_ok += std::abs(tr - 1) <= 0.25;
    std::cout << fmt::format("| {} | {} | {:.1f} | {:.1f} | {:.3f} | {:.1f} | {:.1f} | {:.3f} |\n",
                             r.c.label, r.c.ranks, pred_mib, mib, mr, pred_ms, ms, tr);
    js << fmt::format(
        "    {{\"config\": \"{}\", \"ranks\": {}, \"peak_mib_predicted\": {:.2f}, "
        "\"peak_mib_measured\": {:.2f}, \"step_ms_predicted\": {:.2f}, \"step_ms_measured\": "
        "{:.2f}}}{}\n",
        r.c.label, r.c.ranks, pred_mib, mib, pred_ms, ms, i + 1 < rows.size() ? "," : "");
  }
  js << "  ]\n}\n";
  std::cout << fmt::format("\npeak within 5%: {} of {}; step time within 25%: {} of {}\n", mem_ok,
                           rows.size(), time_ok, rows.size());
  std::cout << fmt::format("RESULT plan_peak_within_5pct={}/{} plan_step_within_25pct={}/{}\n",
                           mem_ok, rows.size(), time_ok, rows.size());
  const std::filesystem::path p(json);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream(p) << js.str();
  std::cout << "wrote " << json << "\n";
  return 0;
}

}  // namespace kuai::app
