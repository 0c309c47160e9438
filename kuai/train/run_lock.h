// One writer per run directory. `kuai train` holds an exclusive advisory lock (flock) on
// `<run>/lock` for its whole life, taken before it reads or writes anything else there; the
// kernel releases it when the process ends however it ends, so a SIGKILL never leaves it stale.
// A second trainer on the same directory is refused at once with the holder's pid and command
// line (written into the lock file by the holder). Under mpirun rank 0 takes the lock for the job
// (the other ranks write only the shards rank 0 waits for), so the ranks of one job share the
// directory and a second job is refused the same way.
//
// `kuai launch` holds the lock across the restarts of its job: it takes it with a token written
// into the lock file, and hands the token to the job it starts (KUAI_LAUNCH_TOKEN in the
// environment, exported by mpirun to every rank). A trainer refused the lock runs under it when its
// environment carries the holder's token; any other trainer is refused as before.
//
// Readers (`kuai sample --run`) take no lock, so that they never stop a trainer from starting:
// they read only committed files — an export renamed into place, or the checkpoint `latest`
// names, read again when a trainer prunes it under them (checkpoint.h, load_latest_weights).
#pragma once

#include <stdexcept>
#include <string>

namespace kuai::train {

// Thrown when another process holds the run directory.
class RunDirectoryInUse : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RunLock {
 public:
  RunLock() = default;  // holds nothing
  // Creates `dir` if it does not exist and locks it, or throws RunDirectoryInUse naming the
  // directory and the holder ("runs/kjv: in use by pid 4242 (kuai train --resume runs/kjv)").
  // Other failures (a directory that cannot be created, a file system without flock) throw
  // std::runtime_error naming the path.
  // With a token (the launcher), the token is written into the lock file beside the pid.
  static RunLock acquire(const std::string& dir, const std::string& token = {});
  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&& other) noexcept;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock();

  // Held by this process, or by the launcher this process runs under.
  bool held() const { return fd_ >= 0 || under_launcher_; }
  bool under_launcher() const { return under_launcher_; }
  const std::string& dir() const { return dir_; }
  void release();

 private:
  int fd_ = -1;
  bool under_launcher_ = false;
  std::string dir_;
};

// The run directory a `--resume PATH` argument refers to: PATH itself when it holds `latest`
// (or is not a checkpoint), the parent when PATH is a ckpt-<step> directory.
std::string run_directory_of(const std::string& resume_path);

// The environment variable that carries a launcher's token to its job.
inline constexpr char kLaunchTokenEnv[] = "KUAI_LAUNCH_TOKEN";

}  // namespace kuai::train
