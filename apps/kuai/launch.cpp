// `kuai launch`: a supervisor over mpirun, as torchrun's elastic agent is over its workers.
//
//   kuai launch [--hostfile F] --np N [--min-np M] [--max-restarts K] [--mpirun-args "..."]
//               -- train --config run.toml [--section.key=value ...]
//
// It holds the run directory's lock (run_lock.h, with a token its jobs inherit) for its whole
// life, starts the job under mpirun and relays what it prints. When the job fails it names the
// cause (kuai's line naming the ranks and hosts that never reached a collective, or mpirun's
// report), finds which hosts of the hostfile still answer (an mpirun of `true` on each, with a
// deadline), and starts the job again from the run's `latest` checkpoint on the ranks those hosts
// hold, down to --min-np. On another number of ranks ZeRO re-shards on load and the global batch
// is kept by accumulation (launch.h, keep_global_batch). Up to K restarts; a job that fails twice
// in a row before completing a step is not started again.
//
// No wait is unbounded: once the job's output names a failure, mpirun gets --grace seconds to end
// (it may wait on a daemon of a host that is gone), then its process group is ended (SIGTERM,
// then SIGKILL). A probe that does not answer within --probe-timeout is a host lost.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "command.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/config.h"
#include "kuai/train/launch.h"
#include "kuai/train/run_lock.h"

namespace kuai::app {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal.store(sig); }

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

std::string random_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[16] = {};
  in.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

// A child in a process group of its own (so that it and everything it starts can be ended at
// once), ended with SIGTERM if the launcher dies. stdout and stderr into `out_fd` (or /dev/null).
pid_t spawn(const std::vector<std::string>& argv, int out_fd) {
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    const int fd = out_fd >= 0 ? out_fd : open("/dev/null", O_WRONLY);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "kuai launch: cannot run %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also here: no race with the child's own call
  return pid;
}

// Ends a child's process group: SIGTERM, then SIGKILL if it is still there `patience_s` later.
int end_group(pid_t pid, double patience_s) {
  kill(-pid, SIGTERM);
  const auto t0 = Clock::now();
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (seconds_since(t0) > patience_s) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(-pid, SIGKILL);  // whatever of the group is left
  return status;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {}", WTERMSIG(status));
  return "unknown status";
}

struct Options {
  std::string hostfile, mpirun = "mpirun";
  std::vector<std::string> mpirun_args;
  int np = 0, min_np = 0, max_restarts = 0;
  double probe_timeout_s = 15, grace_s = 3;
  std::vector<std::string> job;  // "train" and its arguments
};

Options parse(const std::vector<std::string>& args) {
  Options o;
  size_t i = 0;
  auto integer = [](const std::string& name, const std::string& v) {
    try {
      size_t used = 0;
      const int n = std::stoi(v, &used);
      if (used == v.size() && n >= 0) return n;
    } catch (const std::exception&) {
    }
    throw std::invalid_argument(fmt::format("--{} = '{}' is not a count", name, v));
  };
  for (; i < args.size() && args[i] != "--"; ++i) {
    std::string v;
    if (take_option(args, i, "hostfile", v))
      o.hostfile = v;
    else if (take_option(args, i, "np", v))
      o.np = integer("np", v);
    else if (take_option(args, i, "min-np", v))
      o.min_np = integer("min-np", v);
    else if (take_option(args, i, "max-restarts", v))
      o.max_restarts = integer("max-restarts", v);
    else if (take_option(args, i, "mpirun", v))
      o.mpirun = v;
    else if (take_option(args, i, "mpirun-args", v))
      for (std::string& w : split_words(v)) o.mpirun_args.push_back(std::move(w));
    else if (take_option(args, i, "probe-timeout", v))
      o.probe_timeout_s = positive_number("probe-timeout", v);
    else if (take_option(args, i, "grace", v))
      o.grace_s = positive_number("grace", v);
    else
      throw std::invalid_argument(
          fmt::format("launch: unknown option '{}' (see kuai --help)", args[i]));
  }
  if (i < args.size()) o.job.assign(args.begin() + static_cast<long>(i) + 1, args.end());
  if (o.job.empty() || o.job[0] != "train")
    throw std::invalid_argument(
        "launch: the job follows `--` and is a training run: kuai launch --np N -- train "
        "--config run.toml");
  if (o.np < 1) throw std::invalid_argument("launch: --np N (the number of ranks) is required");
  if (o.min_np == 0) o.min_np = o.np;
  if (o.min_np > o.np)
    throw std::invalid_argument(
        fmt::format("launch: --min-np {} is more than --np {}", o.min_np, o.np));
  return o;
}

// The job's own arguments split into the config file, the checkpoint it resumes and overrides.
struct JobArgs {
  std::string config, resume;
  std::vector<std::string> overrides;
};
JobArgs split_job(const std::vector<std::string>& job) {
  JobArgs j;
  for (size_t i = 1; i < job.size(); ++i) {
    std::string v;
    if (take_option(job, i, "config", v))
      j.config = v;
    else if (take_option(job, i, "resume", v))
      j.resume = v;
    else
      j.overrides.push_back(job[i]);
  }
  return j;
}

class Launcher {
 public:
  explicit Launcher(Options o) : o_(std::move(o)), job_(split_job(o_.job)) {
    const std::string config_path =
        job_.resume.empty() ? job_.config : train::resolve_checkpoint(job_.resume) + "/config.toml";
    const train::TrainConfig cfg = train::load_config(config_path, job_.overrides);
    run_dir_ = (fs::path(cfg.run_dir) / cfg.run_name).string();
    batch_ = cfg.batch_size;
    accum_ = cfg.accum_steps;
    if (!o_.hostfile.empty()) {
      std::ifstream in(o_.hostfile);
      if (!in)
        throw std::invalid_argument(fmt::format("{}: cannot read the hostfile", o_.hostfile));
      std::stringstream text;
      text << in.rdbuf();
      hosts_ = train::parse_hostfile(text.str(), o_.hostfile);
      int slots = 0;
      for (const auto& h : hosts_) slots += h.slots;
      if (slots < o_.np)
        throw std::invalid_argument(fmt::format("launch: {} offers {} slot{}, fewer than --np {}",
                                                o_.hostfile, slots, slots == 1 ? "" : "s", o_.np));
    }
    token_ = random_token();
    lock_ = train::RunLock::acquire(run_dir_, token_);
    status_file_ = run_dir_ + "/launch.status";
    hosts_file_ = run_dir_ + "/launch.hosts";
    log_.open(run_dir_ + "/launch.log", std::ios::app);
    setenv(train::kLaunchTokenEnv, token_.c_str(), 1);
    setenv("KUAI_LAUNCH_STATUS", status_file_.c_str(), 1);
  }

  int run() {
    std::vector<std::string> job = o_.job;
    int world = o_.np;
    std::vector<train::HostSlots> hosts = hosts_;
    int restarts = 0, failures_without_progress = 0;
    say(fmt::format("run {}, {} ranks{}, up to {} restart{}", run_dir_, world,
                    hosts.empty() ? "" : " on " + host_list(hosts), o_.max_restarts,
                    o_.max_restarts == 1 ? "" : "s"));
    for (;;) {
      const Attempt a = attempt(job, world, hosts);
      if (a.interrupted) {
        say(fmt::format("stopped by signal {}; the job was ended", a.interrupted));
        return 128 + a.interrupted;
      }
      if (WIFEXITED(a.status) && WEXITSTATUS(a.status) == 0) {
        say(fmt::format("the job finished{}", restarts == 0
                                                  ? ""
                                                  : fmt::format(" after {} restart{}", restarts,
                                                                restarts == 1 ? "" : "s")));
        return 0;
      }
      if (WIFEXITED(a.status) && WEXITSTATUS(a.status) == 130) {
        say("the job was interrupted (a stop request); not restarting");
        return 130;
      }
      const std::string cause =
          a.cause.empty() ? "mpirun ended with " + describe_status(a.status) : a.cause;
      failures_without_progress = a.progressed ? 0 : failures_without_progress + 1;
      say(fmt::format("the job failed ({}{}): {}", describe_status(a.status),
                      a.ended_by_launcher ? ", ended by the launcher after the failure" : "",
                      cause));
      if (restarts >= o_.max_restarts) {
        say(fmt::format("giving up: {} restart{} allowed (--max-restarts)", o_.max_restarts,
                        o_.max_restarts == 1 ? "" : "s"));
        return 1;
      }
      if (failures_without_progress >= 2) {
        say("giving up: the job failed twice in a row before completing a step");
        return 1;
      }
      // What is left: the hosts that answer, their slots, at most --np ranks.
      if (!hosts_.empty()) {
        hosts = reachable(hosts_);
        int slots = 0;
        for (const auto& h : hosts) slots += h.slots;
        world = std::min(o_.np, slots);
      }
      if (world < o_.min_np) {
        say(fmt::format("giving up: {} rank{} left ({}), fewer than --min-np {}", world,
                        world == 1 ? "" : "s", host_list(hosts), o_.min_np));
        return 1;
      }
      ++restarts;
      const int64_t step = train::latest_checkpoint_step(run_dir_);
      const train::BatchSplit split = batch_split(world);
      job = restart_job(step, split);
      const std::string batch_note =
          world == o_.np
              ? ""
              : fmt::format("; global batch {} kept as batch {} x {} ranks x accum {}",
                            batch_ * accum_ * o_.np, split.batch_size, world, split.accum_steps);
      say(fmt::format("restart {} of {} ({}): resuming {} on {} rank{}{}{}", restarts,
                      o_.max_restarts, train::short_cause(cause),
                      step >= 0 ? fmt::format("from step {}", step)
                                : std::string("from the start (no checkpoint yet)"),
                      world, world == 1 ? "" : "s",
                      hosts.empty() ? "" : " (" + host_list(hosts) + ")", batch_note));
    }
  }

 private:
  struct Attempt {
    int status = 0;
    int interrupted = 0;  // the launcher's own SIGINT/SIGTERM
    bool progressed = false;
    bool ended_by_launcher = false;
    std::string cause;
  };

  // The split of the global batch over `world` ranks (unchanged on --np ranks); throws when none
  // keeps it.
  train::BatchSplit batch_split(int world) const {
    const auto split = train::keep_global_batch(batch_, accum_, o_.np, world);
    if (!split)
      throw std::runtime_error(fmt::format(
          "launch: the global batch {} (batch {} x {} ranks x accum {}) cannot be split over {} "
          "ranks",
          batch_ * accum_ * o_.np, batch_, o_.np, accum_, world));
    return *split;
  }

  // The job's command for a restart: from `latest` when the run has a checkpoint (step >= 0),
  // else from the start as first given; the same overrides, the batch split given.
  std::vector<std::string> restart_job(int64_t step, const train::BatchSplit& split) const {
    std::vector<std::string> job = {"train"};
    if (step >= 0) {
      job.push_back("--resume");
      job.push_back(run_dir_);
    } else if (!job_.resume.empty()) {
      job.push_back("--resume");
      job.push_back(job_.resume);
    } else if (!job_.config.empty()) {
      job.push_back("--config");
      job.push_back(job_.config);
    }
    for (const std::string& a : job_.overrides) job.push_back(a);
    job.push_back(fmt::format("--train.batch_size={}", split.batch_size));
    job.push_back(fmt::format("--train.accum_steps={}", split.accum_steps));
    return job;
  }

  std::vector<std::string> mpirun_command(int world, const std::vector<train::HostSlots>& hosts,
                                          const std::vector<std::string>& job) {
    std::vector<std::string> cmd = {o_.mpirun};
    for (const auto& a : o_.mpirun_args) cmd.push_back(a);
    if (!hosts.empty()) {
      std::ofstream(hosts_file_, std::ios::trunc) << train::format_hostfile(hosts);
      cmd.push_back("--hostfile");
      cmd.push_back(hosts_file_);
    }
    for (const std::string& a : {std::string("-np"), std::to_string(world), std::string("-x"),
                                 std::string(train::kLaunchTokenEnv), std::string("-x"),
                                 std::string("KUAI_LAUNCH_STATUS"), self_path()})
      cmd.push_back(a);
    for (const auto& a : job) cmd.push_back(a);
    return cmd;
  }

  Attempt attempt(const std::vector<std::string>& job, int world,
                  const std::vector<train::HostSlots>& hosts) {
    std::error_code ec;
    fs::remove(status_file_, ec);
    const std::vector<std::string> cmd = mpirun_command(world, hosts, job);
    std::string line_of_cmd;
    for (const auto& a : cmd) line_of_cmd += (line_of_cmd.empty() ? "" : " ") + a;
    say("starting: " + line_of_cmd);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
      throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
    const pid_t pid = spawn(cmd, fds[1]);
    close(fds[1]);
    Attempt a;
    std::deque<std::string> tail;  // the job's last lines: where its cause is read
    std::vector<std::string> failures;
    std::string partial;
    bool open_pipe = true;
    Clock::time_point failed_at{};
    bool failure_seen = false;
    int status = 0;
    for (;;) {
      if (open_pipe) {
        pollfd p{fds[0], POLLIN, 0};
        if (poll(&p, 1, 100) > 0) {
          char buf[8192];
          const ssize_t n = read(fds[0], buf, sizeof buf);
          if (n <= 0) {
            open_pipe = false;
          } else {
            std::cout.write(buf, n);
            std::cout.flush();
            partial.append(buf, static_cast<size_t>(n));
            size_t nl;
            while ((nl = partial.find('\n')) != std::string::npos) {
              std::string line = partial.substr(0, nl);
              partial.erase(0, nl + 1);
              if (train::names_a_failure(line)) {
                failures.push_back(line);
                if (!failure_seen) failed_at = Clock::now();
                failure_seen = true;
              }
              tail.push_back(std::move(line));
              if (tail.size() > 400) tail.pop_front();
            }
          }
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (waitpid(pid, &status, WNOHANG) == pid) break;
      if (const int sig = g_signal.load()) {
        status = end_group(pid, 5.0);
        a.interrupted = sig;
        break;
      }
      // mpirun may wait long for a daemon on a host that is gone; the failure is known.
      if (failure_seen && seconds_since(failed_at) > o_.grace_s) {
        status = end_group(pid, 3.0);
        a.ended_by_launcher = true;
        break;
      }
    }
    // What is still in the pipe (the job's last words), without waiting for processes that
    // inherited it elsewhere.
    for (;;) {
      pollfd p{fds[0], POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) break;
      char buf[8192];
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n <= 0) break;
      std::cout.write(buf, n);
      partial.append(buf, static_cast<size_t>(n));
    }
    std::cout.flush();
    close(fds[0]);
    for (std::string line; !partial.empty();) {
      const size_t nl = partial.find('\n');
      line = partial.substr(0, nl);
      partial.erase(0, nl == std::string::npos ? partial.size() : nl + 1);
      if (train::names_a_failure(line)) failures.push_back(line);
      tail.push_back(line);
    }
    a.status = status;
    a.progressed = fs::exists(status_file_, ec);
    a.cause = train::failure_cause(failures);
    if (a.cause.empty()) a.cause = train::failure_cause({tail.begin(), tail.end()});
    return a;
  }

  // The hosts that answer an mpirun of `true` within the probe deadline, probed at once.
  std::vector<train::HostSlots> reachable(const std::vector<train::HostSlots>& hosts) {
    std::vector<pid_t> pids;
    for (const auto& h : hosts) {
      std::vector<std::string> cmd = {o_.mpirun};
      for (const auto& a : o_.mpirun_args) cmd.push_back(a);
      for (const std::string& a : {std::string("--host"), h.host, std::string("-np"),
                                   std::string("1"), std::string("true")})
        cmd.push_back(a);
      pids.push_back(spawn(cmd, -1));
    }
    std::vector<int> ok(hosts.size(), -1);  // -1 running, 0 failed, 1 answered
    const auto t0 = Clock::now();
    while (seconds_since(t0) < o_.probe_timeout_s) {
      bool running = false;
      for (size_t i = 0; i < pids.size(); ++i) {
        if (ok[i] >= 0) continue;
        int status = 0;
        if (waitpid(pids[i], &status, WNOHANG) == pids[i])
          ok[i] = WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 1 : 0;
        else
          running = true;
      }
      if (!running) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::vector<train::HostSlots> left;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (ok[i] < 0) {
        end_group(pids[i], 2.0);
        ok[i] = 0;
      }
      if (ok[i] == 1)
        left.push_back(hosts[i]);
      else
        say(fmt::format("host {} does not answer (an mpirun of `true` there {})", hosts[i].host,
                        seconds_since(t0) >= o_.probe_timeout_s
                            ? fmt::format("took over {:.0f} s", o_.probe_timeout_s)
                            : std::string("failed")));
    }
    return left;
  }

  static std::string host_list(const std::vector<train::HostSlots>& hosts) {
    std::string s;
    for (const auto& h : hosts) s += (s.empty() ? "" : ", ") + h.host;
    return s.empty() ? "no host" : s;
  }

  void say(const std::string& what) {
    const std::string line = "kuai launch: " + what + "\n";
    std::cout << line << std::flush;
    if (log_) log_ << line << std::flush;
  }

  Options o_;
  JobArgs job_;  // the job as first given: its config, the checkpoint it resumes, its overrides
  std::vector<train::HostSlots> hosts_;
  std::string run_dir_, token_, status_file_, hosts_file_;
  int64_t batch_ = 1, accum_ = 1;
  train::RunLock lock_;
  std::ofstream log_;
};

}  // namespace

int run_launch(const std::vector<std::string>& args) {
  Launcher launcher(parse(args));
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  return launcher.run();
}

}  // namespace kuai::app
