// `kuai info`: the CPU, its flags that matter, the ISA tier in force and which implementation runs
// each op family here. `kuai info --cpu-tier` prints only the best tier the CPU has (for scripts:
// tests/run_tier.sh).
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <vector>

#include "bench.h"
#include "kuai/backend/cpu/gemm/libraries.h"
#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/isa.h"

namespace kuai::app {

int run_info(const std::vector<std::string>& args) {
  using namespace kuai::cpu;
  for (const std::string& a : args) {
    if (a == "--cpu-tier") {
      std::cout << isa_name(cpu_isa()) << "\n";
      return 0;
    }
    if (a == "--tier") {
      std::cout << isa_name(isa()) << "\n";
      return 0;
    }
    throw std::invalid_argument("unknown option '" + a + "' (allowed: --cpu-tier, --tier)");
  }
  const CpuId& id = cpu_id();
  std::cout << fmt::format("cpu       {} ({}, family {} model {} stepping {})\n", id.model_name,
                           id.vendor, id.family, id.model, id.stepping);
  std::cout << fmt::format("flags     {}\n", cpu_flags_report());
  const std::string request = max_isa_request();
  std::cout << fmt::format("tier      {} (cpu {}{}); kuai's kernels: the {} copy\n",
                           isa_name(isa()), isa_name(cpu_isa()),
                           request.empty() ? ", KUAI_MAX_ISA unset" : ", KUAI_MAX_ISA=" + request,
                           isa_name(clone_variant()));
  const GemmLibraries& libs = gemm_libraries();
  std::cout << fmt::format("oneDNN    {} at {}\n", libs.onednn_version, libs.onednn_isa);
  std::cout << fmt::format(
      "OpenBLAS  {} core {}{}\n", libs.openblas_config.substr(0, libs.openblas_config.find(' ', 9)),
      libs.openblas_core, libs.openblas_note.empty() ? "" : " (" + libs.openblas_note + ")");
  std::cout << gemm_routing_report();
  return 0;
}

}  // namespace kuai::app
