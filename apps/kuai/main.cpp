// The `kuai` command: `kuai train [--config FILE] [--section.key=value ...]` trains a GPT;
// `kuai bench [...]` measures this machine. Errors print one line and exit non-zero.
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <vector>

#include "bench.h"
#include "kuai/train/config.h"
#include "kuai/train/trainer.h"

namespace {

constexpr const char* kUsage =
    "usage: kuai <command> [options]\n"
    "  train [--config FILE] [--section.key=value ...]   train a GPT (see configs/)\n"
    "  bench [all|gemm|bandwidth|adamw] [--threads=N]    measure this machine\n";

int train_command(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) throw kuai::train::ConfigError("--config needs a file name");
      config_path = args[++i];
    } else if (args[i].rfind("--config=", 0) == 0) {
      config_path = args[i].substr(9);
    } else {
      overrides.push_back(args[i]);
    }
  }
  const kuai::train::TrainConfig cfg = kuai::train::load_config(config_path, overrides);
  const kuai::train::TrainResult r = kuai::train::run_training(cfg, std::cout);
  std::cout << kuai::train::result_line(r) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "train") return train_command(args);
    if (command == "bench") return kuai::app::run_bench(args);
    std::cerr << "kuai: unknown command '" << command << "'\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "kuai " << command << ": " << e.what() << "\n";
    return 1;
  }
}
