// The GEMM router's measured choice (router.h, tuning.h): the fastest candidate is chosen, the
// choice is recorded in the tuning cache file and used from then on without timing, C is left as
// it was found, and the defaults apply where nothing is measured.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/profiler.h"

namespace kuai::cpu {
namespace {

class RouterTest : public ::testing::Test {
 protected:
  void TearDown() override { set_calibration_timer({}); }
};

// A shape no other process has measured: the test's own pid in M.
GemmShape fresh_shape(int salt) {
  return GemmShape{"test", false, true, static_cast<int64_t>(getpid()) * 8 + salt, 512, 512};
}

TEST_F(RouterTest, TheFastestCandidateIsChosenRecordedAndThenUsedWithoutTiming) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  int timed = 0;
  set_calibration_timer([&](const GemmShape&, const char* name) {
    ++timed;
    return std::string(name) == "b" ? 1e-3 : 2e-3;  // "b" is the fast one
  });
  std::vector<std::string> ran;
  const GemmCandidate candidates[] = {{"a", [&] { ran.push_back("a"); }},
                                      {"b", [&] { ran.push_back("b"); }},
                                      {"c", [&] { ran.push_back("c"); }}};
  const GemmShape shape = fresh_shape(1);
  EXPECT_EQ(route(shape, candidates, 0), 1u);
  EXPECT_EQ(timed, 3);
  EXPECT_EQ(ran, (std::vector<std::string>{"a", "b", "c"}));  // each warmed up once
  // From now on the cache answers: no timing, nothing run by route().
  ran.clear();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(route(shape, candidates, 0), 1u);
  EXPECT_EQ(timed, 3);
  EXPECT_TRUE(ran.empty());
  // The file holds it, so the next process makes the same choice.
  std::ifstream in(cache.path());
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find(std::to_string(shape.m) + "x512x512"), std::string::npos)
      << cache.path();
  EXPECT_NE(text.str().find("\tb\t"), std::string::npos);
}

TEST_F(RouterTest, TiesKeepTheEarlierCandidateAndParallelRegionsTakeTheDefault) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  set_calibration_timer([](const GemmShape&, const char*) { return 1e-3; });
  const GemmCandidate candidates[] = {{"a", [] {}}, {"b", [] {}}};
  EXPECT_EQ(route(fresh_shape(2), candidates, 1), 0u);
  size_t inside = 99;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    inside = route(fresh_shape(3), candidates, 1);
  }
  EXPECT_EQ(inside, 1u);  // not measured inside a parallel region: the default
  EXPECT_EQ(route(fresh_shape(3), candidates, 1), 0u);  // measured at top level
}

// A race whose winner ran far below what the cache holds for a smaller product of the same kind
// (a neighbour held a core) is run again before anything is recorded, each candidate keeping its
// best time; a race that is not an outlier runs once. Shapes of an op of this test's own.
TEST_F(RouterTest, AnOutlierRaceIsRunAgainBeforeItIsRecorded) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  const int64_t m = static_cast<int64_t>(getpid()) * 8;
  const GemmShape small{"probe", false, true, m, 512, 512};
  const GemmShape large{"probe", false, true, m, 512, 1024};   // twice the FLOPs
  const GemmShape steady{"probe", false, true, m, 512, 2048};  // four times
  for (const GemmShape& s : {small, large, steady})
    if (cache.find(routing_key(s))) GTEST_SKIP() << "a process of this pid measured these";
  int large_calls = 0, steady_calls = 0;
  set_calibration_timer([&](const GemmShape& s, const char* name) {
    const bool a = std::string(name) == "a";
    if (s.k == 1024) {  // first race 40-50x slower than small's rate: an outlier; then b wins
      ++large_calls;
      return large_calls <= 2 ? (a ? 40e-3 : 50e-3) : (a ? 2e-3 : 1.5e-3);
    }
    if (s.k == 2048) ++steady_calls;
    return a ? 1e-3 : 2e-3;
  });
  const GemmCandidate candidates[] = {{"a", [] {}}, {"b", [] {}}};
  EXPECT_EQ(route(small, candidates, 0), 0u);
  EXPECT_EQ(route(large, candidates, 0), 1u);  // b: its best over the two races
  EXPECT_EQ(large_calls, 4);
  EXPECT_EQ(route(steady, candidates, 0), 0u);
  EXPECT_EQ(steady_calls, 2);
  for (const TuningEntry& e : cache.entries()) {
    if (e.key == routing_key(large)) {
      EXPECT_NE(e.measured.find(" races 2"), std::string::npos);
    }
    if (e.key == routing_key(steady)) {
      EXPECT_EQ(e.measured.find("races"), std::string::npos);
    }
  }
  const std::string report = gemm_routing_report();
  EXPECT_NE(report.find("best of 2 races, the first an outlier"), std::string::npos) << report;
}

TEST_F(RouterTest, CalibrationLeavesCAsItFoundIt) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  set_calibration_timer([](const GemmShape&, const char*) { return 1e-3; });
  std::vector<float> c = {1, 2, 3, 4, 5, 6};  // 2 x 2 inside a leading dimension of 3
  const std::vector<float> before = c;
  MatrixSnapshot snapshot(c.data(), 2, 2, 3, sizeof(float));
  const GemmCandidate candidates[] = {{"a",
                                       [&] {
                                         c[0] += 10;
                                         c[4] += 10;
                                       }},
                                      {"b", [&] { c[1] *= 3; }}};
  route(fresh_shape(4), candidates, 0, snapshot.save_fn(), snapshot.restore_fn());
  EXPECT_EQ(c, before);
}

// KUAI_PROFILE's GEMM rows: a product run at top level is one row named by its shape and the
// implementation that ran it, with its GFLOP/s; products inside a parallel region are not timed.
TEST(GemmProfile, ProductsAreRowsWithShapeImplementationAndRate) {
  const bool was_on = profiler::enabled();
  profiler::reset();
  profiler::enable(true);
  const int64_t n = 96;
  std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n, 0.0f);
  gemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
#pragma omp parallel num_threads(2)
  {
    std::vector<float> local(n * n, 0.0f);
    gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, local.data(), n);
  }
  profiler::enable(was_on);
  const std::string report = profiler::report();
  profiler::reset();
  EXPECT_FLOAT_EQ(c[0], 0.5f * n);
  // The profile's table, then the "products alone" section: the same product, run again.
  const size_t alone = report.find("\nproducts alone");
  ASSERT_NE(alone, std::string::npos) << report;
  auto gemm_rows = [](const std::string& text) {
    std::vector<std::vector<std::string>> rows;
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.rfind("gemm ", 0) != 0) continue;
      std::istringstream in(line);
      std::vector<std::string> fields;
      for (std::string f; in >> f;) fields.push_back(f);
      rows.push_back(fields);
    }
    return rows;
  };
  // gemm NT 96x96x96 onednn | calls total-ms mean-ms share GFLOP/s
  const auto table = gemm_rows(report.substr(0, alone));
  ASSERT_EQ(table.size(), 1u) << report;
  EXPECT_EQ(table[0][1] + " " + table[0][2], "NT 96x96x96") << report;  // never the threads' NN
  EXPECT_TRUE(table[0][3] == "onednn" || table[0][3] == "openblas") << report;
  ASSERT_GE(table[0].size(), 9u) << report;
  EXPECT_EQ(table[0][4], "1");
  EXPECT_GT(std::stod(table[0][8]), 0.0) << report;  // GFLOP/s
  // gemm NT 96x96x96 impl | calls step-ms in-step hot cold step/hot step/cold
  const auto rerun = gemm_rows(report.substr(alone));
  ASSERT_EQ(rerun.size(), 1u) << report;
  ASSERT_EQ(rerun[0].size(), 11u) << report;
  EXPECT_EQ(rerun[0][3], table[0][3]);
  EXPECT_DOUBLE_EQ(std::stod(rerun[0][6]), std::stod(table[0][8])) << report;
  EXPECT_GT(std::stod(rerun[0][7]), 0.0) << report;  // hot
  EXPECT_GT(std::stod(rerun[0][8]), 0.0) << report;  // cold
}

}  // namespace
}  // namespace kuai::cpu
