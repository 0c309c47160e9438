// `kuai plan` on the command line: the memory table, the saved activations, the time split, the
// scaling projection and the RESULT line; a budget it does not fit names the factor and --fit
// prints ready `kuai train` lines; bad flags and keys are named.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "../support/run_kuai.h"

namespace kuai {
namespace {

std::pair<int, std::string> kuai(const std::string& args) { return test::run_kuai(args); }

const std::string kTiny =
    "--data.source=synthetic --model.n_layer=2 --model.d_model=64 --model.n_head=4 "
    "--model.seq_len=64 --train.batch_size=8 --model.vocab_size=500";

TEST(PlanCli, PrintsTheTablesAndAResultLine) {
  auto [rc, out] =
      kuai("plan " + kTiny + " --ranks 2 --ranks-per-host 2 --bandwidth 5GB/s --latency 20us");
  ASSERT_EQ(rc, 0) << out;
  for (const char* want : {"memory per rank at the step's peak", "parameters (fp32 master weights)",
                           "optimizer state (AdamW moments)", "activations saved for backward",
                           "attention output 1 (float32)", "communication", "scaling projection",
                           "link 5.00 GB/s", "beside 1 other rank running it"})
    EXPECT_NE(out.find(want), std::string::npos) << want << "\n" << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      out, m,
      std::regex(R"(RESULT peak_mib=([0-9.]+) step_ms=([0-9.]+) tokens_per_s=([0-9.]+) fits=yes)")))
      << out;
  EXPECT_GT(std::stod(m[1]), 0.0);
  for (const char* ranks : {"     1 ", "     2 ", "     8 ", "    64 ", "   512 "})
    EXPECT_NE(out.find(ranks), std::string::npos) << ranks;
}

TEST(PlanCli, OverBudgetSaysSoAndFitPrintsTrainCommands) {
  auto [rc, out] = kuai("plan " + kTiny + " --memory-per-rank 3MiB --fit --no-scaling");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("does not fit"), std::string::npos) << out;
  EXPECT_NE(out.find("fits=no"), std::string::npos) << out;
  EXPECT_NE(out.find("--fit: "), std::string::npos) << out;
  // Ready lines: the overrides the plan was given (the batch replaced by the change), then the
  // changes.
  EXPECT_NE(out.find("kuai train --data.source=synthetic --model.n_layer=2"), std::string::npos)
      << out;
  EXPECT_NE(out.find("--model.vocab_size=500 --train.batch_size="), std::string::npos) << out;
}

TEST(PlanCli, BadFlagsAndKeysAreNamed) {
  auto [rc1, o1] = kuai("plan " + kTiny + " --ranks 0");
  EXPECT_NE(rc1, 0);
  EXPECT_NE(o1.find("--ranks"), std::string::npos) << o1;
  auto [rc4, o4] = kuai("plan " + kTiny + " --ranks 2 --ranks-per-host 0");
  EXPECT_NE(rc4, 0);
  EXPECT_NE(o4.find("--ranks-per-host"), std::string::npos) << o4;
  auto [rc2, o2] = kuai("plan " + kTiny + " --memory-per-rank 4parsecs");
  EXPECT_NE(rc2, 0);
  EXPECT_NE(o2.find("--memory-per-rank"), std::string::npos) << o2;
  auto [rc3, o3] = kuai("plan " + kTiny + " --model.n_layers=3");
  EXPECT_NE(rc3, 0);
  EXPECT_NE(o3.find("model.n_layer"), std::string::npos) << o3;
}

}  // namespace
}  // namespace kuai
