// One writer per run directory (kuai/train/run_lock.h): a second lock on a held directory is
// refused with the holder's pid and command; a SIGKILLed holder's lock is free at once; `kuai
// train` itself refuses a second trainer before touching any file, while the first lives, and
// every restart after a kill resumes; a reader without the lock never sees a half-pruned
// checkpoint.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "kuai/io/checksum.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/config.h"
#include "kuai/train/run_lock.h"
#include "kuai/train/trainer.h"

extern char** environ;

namespace kuai::train {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / (name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  return d;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(RunLock, ASecondLockIsRefusedWithTheHolderAndIsFreeOnceReleased) {
  const fs::path dir = fresh_dir("kuai_lock_basic");
  RunLock first = RunLock::acquire(dir.string());
  ASSERT_TRUE(first.held());
  try {
    RunLock::acquire(dir.string());
    FAIL() << "a second lock on a held directory was granted";
  } catch (const RunDirectoryInUse& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dir.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("pid " + std::to_string(getpid())), std::string::npos) << msg;
    EXPECT_NE(msg.find("kuai_tests"), std::string::npos) << msg;  // the holder's command
  }
  first.release();
  EXPECT_NO_THROW(RunLock::acquire(dir.string()));
}

TEST(RunLock, ASigkilledHoldersLockIsFreeAtOnce) {
  const fs::path dir = fresh_dir("kuai_lock_kill");
  fs::create_directories(dir);
  const std::string lock_path = (dir / "lock").string();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // system calls only after fork: lock, say so, wait to be killed
    const int fd = open(lock_path.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) _exit(2);
    const char c = 'x';
    if (write(ready[1], &c, 1) != 1) _exit(3);
    for (;;) pause();
  }
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  EXPECT_THROW(RunLock::acquire(dir.string()), RunDirectoryInUse);
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_NO_THROW(RunLock::acquire(dir.string()));  // no stale lock, no wait
}

TEST(RunLock, TheRunDirectoryOfAResumeArgument) {
  const fs::path dir = fresh_dir("kuai_lock_resolve");
  fs::create_directories(dir / "run" / "ckpt-12");
  std::ofstream(dir / "run" / "latest") << "ckpt-12\n";
  EXPECT_EQ(run_directory_of((dir / "run").string()), (dir / "run").string());
  EXPECT_EQ(run_directory_of((dir / "run" / "ckpt-12").string()), (dir / "run").string());
  EXPECT_EQ(run_directory_of((dir / "run" / "ckpt-12/").string()), (dir / "run").string());
}

// ---- a reader beside a trainer that saves and prunes ----------------------------------------

TEST(RunLock, AReaderWithoutTheLockNeverSeesAHalfPrunedCheckpoint) {
  const fs::path dir = fresh_dir("kuai_lock_reader");
  TrainConfig cfg = load_config_text(
      "[model]\nn_layer = 1\nd_model = 16\nn_head = 2\nseq_len = 8\nvocab_size = 256\n", "test");
  nn::GPT model(cfg.model, 1);
  optim::AdamW opt(param_groups(model, 0.1f), {});
  const Tensor marker = model.named_parameters().front().second;  // holds the step it was saved at
  std::atomic<bool> done{false}, stop_saving{false};
  std::atomic<int64_t> saved{0};
  // The reader's last read, in microseconds (0: none yet). The trainer saves about every two
  // reads' time: often enough that reads race the pruning all the time, never so often that a
  // reader slowed by a loaded machine or a sanitizer starves (its attempts all pruned under it).
  std::atomic<int64_t> read_us{0};
  std::thread trainer([&] {
    Checkpointer ckpt(dir.string(), /*keep_last=*/1, /*async=*/false);
    // Saves until the reader has read enough (a slow build reads slowly: the count of reads, not
    // a number of saves, ends the race), or 100000 saves.
    for (int64_t step = 1; step <= 100000; ++step) {
      std::fill(marker.data<float>(), marker.data<float>() + marker.numel(),
                static_cast<float>(step));
      TrainingState st;
      st.step = step;
      st.config_toml = to_toml(cfg);
      ckpt.save(model, opt, st);
      ckpt.wait();
      saved = step;
      // A trainer that saves every few milliseconds with keep_last = 1: each checkpoint is
      // pruned by the next save, so reads race the pruning all the time.
      const int64_t r = read_us.load();
      std::this_thread::sleep_for(
          r == 0 ? 20ms : std::chrono::microseconds(std::clamp<int64_t>(2 * r, 2000, 200000)));
      if (stop_saving.load()) break;
    }
    done = true;
  });
  struct Join {  // a failed ASSERT returns early: stop the saver and join it first
    std::thread& t;
    std::atomic<bool>& stop;
    ~Join() {
      stop = true;
      t.join();
    }
  } join{trainer, stop_saving};
  int reads = 0, later_steps = 0;
  while (saved.load() == 0) std::this_thread::sleep_for(1ms);
  while (!done.load() && (reads < 20 || later_steps < 10)) {
    CommittedModel m;
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_NO_THROW(m = read_latest_model(dir.string())) << "read " << reads;
    read_us =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    // One whole checkpoint: the weights are those of the step its state.json names.
    const Tensor got = m.model->named_parameters().front().second;
    ASSERT_EQ(got.data<float>()[0], static_cast<float>(m.step)) << m.path;
    ASSERT_EQ(got.data<float>()[got.numel() - 1], static_cast<float>(m.step)) << m.path;
    ++reads;
    if (m.step > 1) ++later_steps;
  }
  stop_saving = true;
  while (!done.load()) std::this_thread::sleep_for(1ms);  // the last save is whole
  EXPECT_GE(reads, 20);
  EXPECT_GE(later_steps, 10);
  for (const auto& e : fs::directory_iterator(dir))  // pruning left nothing half-removed
    EXPECT_FALSE(e.path().filename().string().ends_with(".old")) << e.path();
}

// ---- `kuai train` ------------------------------------------------------------------------------

std::string fmt_name(const char* what, int round) {
  return std::string(what) + "." + std::to_string(round) + ".log";
}

struct Child {
  pid_t pid = -1;
  fs::path out;
};

Child spawn_kuai(const std::vector<std::string>& args, const fs::path& out) {
  std::vector<std::string> argv_s = {KUAI_APP_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) env_s.emplace_back(*e);
  env_s.push_back("OMP_NUM_THREADS=1");
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  Child c;
  c.out = out;
  if (posix_spawn(&c.pid, argv_s[0].c_str(), &fa, nullptr, argv.data(), envp.data()) != 0)
    c.pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return c;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Every file under `dir` with its xxh3: what a refused trainer must leave as it was.
std::map<std::string, std::string> hashes(const fs::path& dir) {
  std::map<std::string, std::string> h;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) {
      const std::string text = read_text(e.path());
      h[fs::relative(e.path(), dir).string()] = io::xxh3_hex(text.data(), text.size());
    }
  return h;
}

TEST(RunLock, ASecondTrainerIsRefusedEveryTimeAndEveryRestartAfterAKillResumes) {
  const fs::path root = fresh_dir("kuai_lock_cli");
  fs::create_directories(root);
  const fs::path run = root / "runs" / "r";
  const std::vector<std::string> config = {"train",
                                           "--data.source=synthetic",
                                           "--model.n_layer=1",
                                           "--model.d_model=32",
                                           "--model.n_head=2",
                                           "--model.seq_len=16",
                                           "--model.vocab_size=64",
                                           "--train.batch_size=2",
                                           "--train.steps=1000000",
                                           "--train.eval_every=0",
                                           "--train.threads=1",
                                           "--data.workers=1",
                                           "--checkpoint.save_every=3",
                                           "--checkpoint.keep_last=2",
                                           "--run.dir=" + (root / "runs").string(),
                                           "--run.name=r"};
  std::mt19937 rng(2026);
  for (int round = 0; round < 5; ++round) {
    const bool resume = round > 0;
    const std::vector<std::string> args =
        resume ? std::vector<std::string>{"train", "--resume", run.string()} : config;
    Child first = spawn_kuai(args, root / fmt_name("first", round));
    ASSERT_GT(first.pid, 0);
    struct Reap {  // a failed ASSERT returns early: never leave the trainer running
      pid_t& pid;
      ~Reap() {
        if (pid > 0 && kill(pid, SIGKILL) == 0) waitpid(pid, nullptr, 0);
      }
    } reap{first.pid};
    // It holds the lock (its pid in the lock file) and has saved at least once; a resumed one
    // has said so (`latest` is there from the round before, so it alone proves nothing).
    const std::string pid_line = "pid " + std::to_string(first.pid) + "\n";
    bool ready = false;
    for (int i = 0; i < 600 && !ready; ++i) {
      std::this_thread::sleep_for(20ms);
      ready = read_text(run / "lock").rfind(pid_line, 0) == 0 && fs::exists(run / "latest") &&
              (!resume || read_text(first.out).find("resumed from") != std::string::npos);
    }
    ASSERT_TRUE(ready) << read_text(first.out);
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 300));
    // Frozen, so that the files stay still while the second one tries.
    kill(first.pid, SIGSTOP);
    int stopped = 0;
    ASSERT_EQ(waitpid(first.pid, &stopped, WUNTRACED), first.pid);
    ASSERT_TRUE(WIFSTOPPED(stopped));
    const auto before = hashes(run);
    for (const auto& second_args :
         {config, std::vector<std::string>{"train", "--resume", run.string()}}) {
      Child second = spawn_kuai(second_args, root / fmt_name("second", round));
      ASSERT_GT(second.pid, 0);
      EXPECT_EQ(wait_exit(second.pid), 1);
      const std::string said = read_text(second.out);
      EXPECT_NE(said.find("in use by pid " + std::to_string(first.pid)), std::string::npos) << said;
      EXPECT_EQ(std::count(said.begin(), said.end(), '\n'), 1) << said;  // one line
    }
    EXPECT_EQ(hashes(run), before) << "a refused trainer changed the run directory";
    kill(first.pid, SIGKILL);
    EXPECT_EQ(wait_exit(first.pid), 128 + SIGKILL);
    const pid_t killed = std::exchange(first.pid, -1);
    if (resume) {
      const std::string said = read_text(first.out);
      EXPECT_NE(said.find("resumed from"), std::string::npos) << killed << ": " << said;
    }
  }
}

}  // namespace
}  // namespace kuai::train
