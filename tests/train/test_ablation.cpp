// The ablation harness behind `kuai bench`: the arms of a row differ in the technique's keys
// alone; they run in ABBA order across rounds; each arm's spread is the min-max of its rounds'
// medians, and overlapping spreads are reported as "within noise", in the table and the chart
// (grey bar, whisker), which also shows the advice's claimed range and the machine in its title.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "kuai/train/ablation.h"

namespace kuai::train {
namespace {

TrainConfig tiny() {
  return load_config("", {"--model.n_layer=1", "--model.d_model=32", "--model.n_head=2",
                          "--model.seq_len=16", "--model.vocab_size=61", "--train.batch_size=4",
                          "--data.source=synthetic", "--data.workers=0"});
}

// The lines of the arm's config (as TOML) that are not in the other's.
std::set<std::string> lines_not_in(const TrainConfig& a, const TrainConfig& b) {
  std::set<std::string> la, lb, out;
  std::istringstream sa(to_toml(a)), sb(to_toml(b));
  for (std::string l; std::getline(sa, l);) la.insert(l);
  for (std::string l; std::getline(sb, l);) lb.insert(l);
  for (const std::string& l : la)
    if (!lb.count(l)) out.insert(l);
  return out;
}

TEST(Ablation, MetricsArmsDifferInThePerStepReadAloneAndRunInAbbaOrder) {
  AblationOptions o;
  o.steps = 3;
  o.warmup = 1;
  o.rounds = 3;
  std::ostringstream progress;
  const AblationRow row = run_ablation("metrics", tiny(), o, progress);
  // The technique's key and nothing else (log_every, the loader, ... are the same).
  EXPECT_EQ(lines_not_in(row.off.config, row.on.config),
            (std::set<std::string>{"sync_every_step = true"}));
  EXPECT_EQ(lines_not_in(row.on.config, row.off.config),
            (std::set<std::string>{"sync_every_step = false"}));
  // ABBA: off on | on off | off on.
  std::vector<std::string> order;
  std::istringstream in(progress.str());
  for (std::string l; std::getline(in, l);) {
    if (l.find(row.off.label) != std::string::npos) order.push_back("off");
    if (l.find(row.on.label) != std::string::npos) order.push_back("on");
  }
  EXPECT_EQ(order, (std::vector<std::string>{"off", "on", "on", "off", "off", "on"}));
  ASSERT_EQ(row.off.round_ms.size(), 3u);
  EXPECT_LE(row.off.step_ms_min, row.off.step_ms_median);
  EXPECT_GE(row.off.step_ms_max, row.off.step_ms_median);
  EXPECT_EQ(row.off.figure, 1.0);  // host reads per step, counted
  EXPECT_EQ(row.on.figure, 0.0);
}

TEST(Ablation, AccumulationArmsDifferInBatchAndMicroBatchesAlone) {
  AblationOptions o;
  o.steps = 3;
  o.warmup = 1;
  o.rounds = 1;
  std::ostringstream progress;
  const AblationRow row = run_ablation("accumulation", tiny(), o, progress);
  EXPECT_EQ(lines_not_in(row.off.config, row.on.config),
            (std::set<std::string>{"batch_size = 4", "accum_steps = 1"}));
}

// compile: the arms differ in train.compile alone; the compiled arm's memory is its steady state
// (steps 2..N: step 1 is the eager step that captures), measured, not zero.
TEST(Ablation, CompileArmsDifferInTrainCompileAlone) {
  AblationOptions o;
  o.steps = 4;
  o.warmup = 1;
  o.rounds = 1;
  std::ostringstream progress;
  const AblationRow row = run_ablation("compile", tiny(), o, progress);
  EXPECT_EQ(lines_not_in(row.off.config, row.on.config),
            (std::set<std::string>{"compile = false"}));
  EXPECT_GT(row.on.peak_alloc_mib, 0.0);
  EXPECT_GT(row.off.peak_alloc_mib, 0.0);
  EXPECT_NE(row.verdict.find("steps 2..N: allocator peak of live tensors"), std::string::npos)
      << row.verdict;
  EXPECT_GT(row.on.reserved_mib, 0.0);
  EXPECT_EQ(row.claim_speedup_lo, 1.10);
}

AblationRow with_rounds(std::vector<double> off, std::vector<double> on) {
  AblationRow r;
  r.technique = "metrics";
  r.off.round_ms = off;
  r.on.round_ms = on;
  r.off.step_ms_min = *std::min_element(off.begin(), off.end());
  r.off.step_ms_max = *std::max_element(off.begin(), off.end());
  r.on.step_ms_min = *std::min_element(on.begin(), on.end());
  r.on.step_ms_max = *std::max_element(on.begin(), on.end());
  r.off.step_ms_median = (r.off.step_ms_min + r.off.step_ms_max) / 2;
  r.on.step_ms_median = (r.on.step_ms_min + r.on.step_ms_max) / 2;
  r.claim_speedup_lo = 1.5;
  r.claim_speedup_hi = 2.0;
  return r;
}

// The case seen in a run: medians 872 and 1,105 ms whose rounds overlapped (999/842 against
// 820/1,274 ms) is "within noise", not a 0.789x loss; disjoint rounds give the ratio and spread.
TEST(Ablation, OverlappingRoundsAreWithinNoiseInTheTableAndTheChart) {
  const AblationRow noisy = with_rounds({999, 842}, {820, 1274});
  EXPECT_TRUE(noisy.within_noise());
  const AblationRow clear = with_rounds({200, 210}, {100, 105});
  EXPECT_FALSE(clear.within_noise());
  EXPECT_NEAR(clear.speedup_lo(), 200.0 / 105, 1e-12);
  EXPECT_NEAR(clear.speedup_hi(), 210.0 / 100, 1e-12);
  const std::string md = ablation_markdown({noisy, clear});
  EXPECT_NE(md.find("| within noise |"), std::string::npos) << md;
  EXPECT_NE(md.find(fmt::format("{:.3f}x ({:.2f}-{:.2f})", clear.speedup(), clear.speedup_lo(),
                                clear.speedup_hi())),
            std::string::npos)
      << md;
  const std::string svg = ablation_svg({noisy, clear}, "Test CPU (family 6 model 1), tier avx2");
  EXPECT_NE(svg.find("Test CPU (family 6 model 1), tier avx2"), std::string::npos);
  EXPECT_NE(svg.find("within noise"), std::string::npos);
  EXPECT_NE(svg.find("#a0a0a0"), std::string::npos);  // the noisy bar is grey
  EXPECT_NE(svg.find("#2a9d4b"), std::string::npos);  // the claimed range is drawn
  EXPECT_NE(svg.find("speedup 2.00x (1.90-2.10)"), std::string::npos) << svg;
}

}  // namespace
}  // namespace kuai::train
