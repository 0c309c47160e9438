// Helpers the `kuai` subcommands share (see command.h).
#include "command.h"

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

namespace kuai::app {

bool take_option(const std::vector<std::string>& args, size_t& i, const std::string& name,
                 std::string& value) {
  const std::string& a = args[i];
  if (a == "--" + name) {
    if (i + 1 >= args.size()) throw std::invalid_argument("--" + name + " needs a value");
    value = args[++i];
    return true;
  }
  if (a.rfind("--" + name + "=", 0) == 0) {
    value = a.substr(name.size() + 3);
    return true;
  }
  return false;
}

double positive_number(const std::string& name, const std::string& value) {
  try {
    size_t used = 0;
    const double x = std::stod(value, &used);
    if (used == value.size() && x > 0) return x;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument("--" + name + " = '" + value + "' is not a positive number");
}

std::string self_path() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("build/kuai") : p.string();
}

std::string run_captured(const std::string& cmd, int* exit_status) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (f == nullptr) {
    *exit_status = -1;
    return "cannot start: " + cmd;
  }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
  const int status = pclose(f);
  *exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace kuai::app
