// `kuai launch`'s decisions (kuai/train/launch.h): hostfiles read as mpirun reads them, the global
// batch kept on another number of ranks (and the loader's rows the same rows), the line that
// names why a job failed, and the lock a launcher holds for its jobs.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>

#include "kuai/data/batch_source.h"
#include "kuai/data/token_file.h"
#include "kuai/train/launch.h"
#include "kuai/train/run_lock.h"

namespace kuai::train {
namespace {

TEST(Launch, ReadsHostfilesAsMpirunDoes) {
  const auto hosts = parse_hostfile(
      "# the cluster\nnode0 slots=2\n\n  node1   # one slot\nnode2 slots=4 max_slots=8\n", "h");
  ASSERT_EQ(hosts.size(), 3u);
  EXPECT_EQ(hosts[0].host, "node0");
  EXPECT_EQ(hosts[0].slots, 2);
  EXPECT_EQ(hosts[1].host, "node1");
  EXPECT_EQ(hosts[1].slots, 1);
  EXPECT_EQ(hosts[2].slots, 4);
  EXPECT_EQ(format_hostfile(hosts), "node0 slots=2\nnode1 slots=1\nnode2 slots=4\n");
  try {
    parse_hostfile("node0\nnode1 slots=two\n", "hosts.txt");
    FAIL() << "a bad slot count was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hosts.txt:2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_hostfile("# nothing\n", "h"), std::invalid_argument);
}

TEST(Launch, KeepsTheGlobalBatchByAccumulation) {
  // Same world: unchanged.
  auto s = keep_global_batch(4, 1, 3, 3);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->batch_size, 4);
  EXPECT_EQ(s->accum_steps, 1);
  // 3 x 4 rows on 2 ranks: 4 does not divide 6 rows per rank; 2 x 3 micro-batches (even).
  s = keep_global_batch(4, 1, 3, 2);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->batch_size, 2);
  EXPECT_EQ(s->accum_steps, 3);
  // On 1 rank: the batch stays, accumulation makes up the rest.
  s = keep_global_batch(4, 1, 3, 1);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->batch_size, 4);
  EXPECT_EQ(s->accum_steps, 3);
  // Never a larger per-rank batch than before, even where it would fit without accumulation.
  s = keep_global_batch(2, 2, 4, 2);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->batch_size, 2);
  EXPECT_EQ(s->accum_steps, 4);
  // An odd split only when no even one exists: 3 x 3 rows on 1 rank.
  s = keep_global_batch(3, 1, 3, 1);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->batch_size, 3);
  EXPECT_EQ(s->accum_steps, 3);
  // Every result keeps the product.
  for (int64_t b = 1; b <= 8; ++b)
    for (int64_t k = 1; k <= 3; ++k)
      for (int64_t w = 1; w <= 4; ++w)
        for (int64_t w2 = 1; w2 <= 4; ++w2) {
          const auto r = keep_global_batch(b, k, w, w2);
          if (!r) continue;
          EXPECT_EQ(r->batch_size * r->accum_steps * w2, b * k * w);
          EXPECT_LE(r->batch_size, b);
        }
  // 5 ranks x 1 row cannot be split over 2.
  EXPECT_FALSE(keep_global_batch(1, 1, 5, 2));
}

// What the even split buys: the loader's random windows of one step are the same rows whatever
// the split of the global batch over ranks and micro-batches (data/batch_source.h draws two rows
// per block), so a job restarted on fewer ranks trains on what it would have.
TEST(Launch, TheKeptGlobalBatchDrawsTheSameRows) {
  const auto file = std::make_shared<const data::TokenFile>(
      data::TokenFile::open(std::string(KUAI_SOURCE_DIR) + "/data/kjv.bin"));
  const int64_t T = 8;
  // The rows of step `step` for a split (batch b, world w, accumulation k), as a sorted list.
  auto rows = [&](int64_t b, int64_t w, int64_t k, int64_t step) {
    std::vector<std::vector<int32_t>> out;
    for (int r = 0; r < w; ++r) {
      data::RandomWindows src(file, 0, file->size(), b, T, 7, r, static_cast<int>(w));
      for (int64_t m = 0; m < k; ++m) {
        std::vector<int32_t> x(b * T), y(b * T);
        src.fill(step * k + m, x.data(), y.data());
        for (int64_t i = 0; i < b; ++i)
          out.emplace_back(x.begin() + i * T, x.begin() + (i + 1) * T);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  const auto split = keep_global_batch(4, 1, 3, 2);
  ASSERT_TRUE(split);
  for (int64_t step : {0, 5, 17})
    EXPECT_EQ(rows(4, 3, 1, step), rows(split->batch_size, 2, split->accum_steps, step))
        << "step " << step;
  // An odd split draws other rows (why keep_global_batch prefers even batches).
  EXPECT_NE(rows(4, 3, 1, 5), rows(1, 2, 6, 5));
}

TEST(Launch, NamesTheCauseOfAFailure) {
  const std::vector<std::string> out = {
      "step 40 loss 2.3",
      "--------------------------------------------------------------------------",
      "mpirun noticed that process rank 1 with PID 0 on node node1 exited on signal 9 (Killed).",
      "kuai: rank 0 of 3 (on node0): collective #12 (all_reduce of 8 float32) did not complete "
      "within 5 s; ranks that never reached it: 1 (on node1). Aborting the run.",
  };
  EXPECT_EQ(failure_cause(out), out[3]);               // kuai's line names the rank and its host
  EXPECT_EQ(failure_cause({out[0], out[2]}), out[2]);  // else mpirun's
  // A rank's error, not mpirun's banner around it nor another rank's line about being ended.
  EXPECT_EQ(failure_cause({"kuai: rank 1 of 2 (on vm): the launcher is ending the run (SIGTERM); "
                           "this rank had no collective in flight (the last was #0)",
                           "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD",
                           "with errorcode 1.",
                           "kuai train: error: /x.bin: cannot open token file: No such file"}),
            "kuai train: error: /x.bin: cannot open token file: No such file");
  EXPECT_EQ(failure_cause({"step 1", "step 2"}), "");
  // The lines after which the launcher gives mpirun its grace period, and only those.
  EXPECT_TRUE(names_a_failure(out[2]));
  EXPECT_TRUE(names_a_failure(out[3]));
  EXPECT_TRUE(names_a_failure("MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD"));
  EXPECT_FALSE(names_a_failure(out[0]));
  EXPECT_FALSE(names_a_failure("kuai train: error: /x.bin: cannot open token file"));
}

TEST(Launch, TheRestartLineSaysTheGistOfTheCause) {
  EXPECT_EQ(short_cause("kuai: rank 0 of 3 (on node0): collective #212 (all_reduce of 120576 "
                        "float32) did not complete within 5 s; ranks that never reached it: 1 (on "
                        "node1). Aborting the run."),
            "collective #212 (all_reduce of 120576 float32) timed out after 5 s; never reached "
            "it: rank 1 (on node1)");
  EXPECT_EQ(short_cause("kuai: rank 1 of 2 (on node2): collective #181 (all_reduce of 1 float32) "
                        "did not complete within 5 s; every rank reached it; ranks that do not "
                        "answer (host unreachable or process stopped): 0 (on node0). Aborting the "
                        "run."),
            "collective #181 (all_reduce of 1 float32) timed out after 5 s; no answer from rank "
            "0 (on node0)");
  EXPECT_EQ(short_cause("kuai: rank 0 of 2 (on node0): the launcher is ending the run (SIGTERM) "
                        "while this rank waits in collective #188 (all_reduce of 120576 float32); "
                        "rank 1 (on node2) never reached it: it exited or died"),
            "never reached it: rank 1 (on node2)");
  EXPECT_EQ(short_cause("kuai: rank 0 of 2 (on vm): the launcher is ending the run (SIGTERM) while "
                        "this rank waits in collective #311 (all_reduce of 120576 float32); every "
                        "rank reached it; rank 1 (on vm) no longer answers: it exited or died "
                        "inside it"),
            "rank 1 (on vm) died inside a collective");
  EXPECT_EQ(short_cause("mpirun noticed that process rank 0 with PID 0 on node node0 exited on "
                        "signal 9 (Killed)."),
            "rank 0 on node0 exited on signal 9 (Killed)");
  EXPECT_EQ(short_cause("kuai: error: something else"), "kuai: error: something else");
}

TEST(Launch, AJobRunsUnderItsLaunchersLock) {
  const std::string dir = ::testing::TempDir() + "/launch_lock";
  std::filesystem::remove_all(dir);
  RunLock launcher = RunLock::acquire(dir, "f00d");
  // A trainer without the token is refused; with the launcher's token it runs under its lock.
  unsetenv(kLaunchTokenEnv);
  EXPECT_THROW(RunLock::acquire(dir), RunDirectoryInUse);
  setenv(kLaunchTokenEnv, "beef", 1);
  EXPECT_THROW(RunLock::acquire(dir), RunDirectoryInUse);
  setenv(kLaunchTokenEnv, "f00d", 1);
  RunLock job = RunLock::acquire(dir);
  EXPECT_TRUE(job.held());
  EXPECT_TRUE(job.under_launcher());
  unsetenv(kLaunchTokenEnv);
  // The launcher gone, the token opens nothing: the lock is taken as a plain one.
  launcher.release();
  job.release();
  setenv(kLaunchTokenEnv, "f00d", 1);
  RunLock after = RunLock::acquire(dir);
  EXPECT_FALSE(after.under_launcher());
  EXPECT_TRUE(after.held());
  unsetenv(kLaunchTokenEnv);
}

TEST(Launch, ReadsTheLatestCheckpointsStep) {
  const std::string dir = ::testing::TempDir() + "/launch_latest";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/ckpt-40");
  EXPECT_EQ(latest_checkpoint_step(dir), -1);
  std::ofstream(dir + "/ckpt-40/state.json") << "{}";
  std::ofstream(dir + "/latest") << "ckpt-40\n";
  EXPECT_EQ(latest_checkpoint_step(dir), 40);
}

}  // namespace
}  // namespace kuai::train
