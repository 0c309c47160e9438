// The run-directory lock (see run_lock.h): flock(LOCK_EX | LOCK_NB) on `<run>/lock`, the holder's
// pid and command line written into the file for the message a refused process prints.
#include "kuai/train/run_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace kuai::train {
namespace {

namespace fs = std::filesystem;
constexpr char kLockFile[] = "lock";

// This process's command line, arguments separated by spaces.
std::string own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!raw.empty() && raw.back() == '\0') raw.pop_back();
  for (char& c : raw)
    if (c == '\0') c = ' ';
  return raw;
}

// The value of the holder's line "<key> value" in the lock file ("" when it has none).
std::string holder_line(int fd, const std::string& key) {
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + " ", 0) == 0) return line.substr(key.size() + 1);
  return {};
}

// "pid N (command)" from what the holder wrote, or a note that it has not written it yet.
std::string holder_of(int fd) {
  const std::string pid = holder_line(fd, "pid"), command = holder_line(fd, "command");
  if (pid.empty()) return "another process (it has not written its pid yet)";
  return command.empty() ? fmt::format("pid {}", pid) : fmt::format("pid {} ({})", pid, command);
}

}  // namespace

RunLock RunLock::acquire(const std::string& dir, const std::string& token) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(fmt::format("{}: cannot create run directory: {}", dir, ec.message()));
  const std::string path = (fs::path(dir) / kLockFile).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      // Held by the launcher this process runs under: the job is the launcher's.
      const char* ours = std::getenv(kLaunchTokenEnv);
      const std::string theirs = holder_line(fd, "token");
      if (ours != nullptr && *ours != '\0' && theirs == ours) {
        ::close(fd);
        RunLock lock;
        lock.under_launcher_ = true;
        lock.dir_ = dir;
        return lock;
      }
      const std::string holder = holder_of(fd);
      ::close(fd);
      throw RunDirectoryInUse(fmt::format(
          "{}: in use by {}; one trainer per run directory (wait for it, stop it, or train "
          "under another --run.name)",
          dir, holder));
    }
    ::close(fd);
    throw std::runtime_error(fmt::format("{}: cannot lock: {}", path, std::strerror(err)));
  }
  std::string who = fmt::format("pid {}\ncommand {}\n", ::getpid(), own_command_line());
  if (!token.empty()) who += fmt::format("token {}\n", token);
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) {
    // The lock is held all the same; only the message a refused process prints is poorer.
  }
  RunLock lock;
  lock.fd_ = fd;
  lock.dir_ = dir;
  return lock;
}

RunLock::RunLock(RunLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      under_launcher_(std::exchange(other.under_launcher_, false)),
      dir_(std::move(other.dir_)) {}

RunLock& RunLock::operator=(RunLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    under_launcher_ = std::exchange(other.under_launcher_, false);
    dir_ = std::move(other.dir_);
  }
  return *this;
}

RunLock::~RunLock() { release(); }

void RunLock::release() {
  under_launcher_ = false;
  if (fd_ < 0) return;
  ::close(fd_);  // closing the only descriptor of the open file drops the flock
  fd_ = -1;
}

std::string run_directory_of(const std::string& resume_path) {
  const fs::path p = fs::path(resume_path).lexically_normal();
  const fs::path name = p.has_filename() ? p.filename() : p.parent_path().filename();
  if (name.string().rfind("ckpt-", 0) == 0 && !fs::exists(p / "latest")) {
    const fs::path parent = (p.has_filename() ? p : p.parent_path()).parent_path();
    return parent.empty() ? std::string(".") : parent.string();
  }
  return resume_path;
}

}  // namespace kuai::train
