// Runs the kuai binary built beside the tests (KUAI_APP_PATH, one OpenMP thread) with `args` and
// returns (exit status, stdout + stderr): the command-line tests' one way of calling it.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>
#include <utility>

namespace kuai::test {

inline std::pair<int, std::string> run_kuai(const std::string& args) {
  const std::string cmd = std::string("OMP_NUM_THREADS=1 ") + KUAI_APP_PATH + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace kuai::test
