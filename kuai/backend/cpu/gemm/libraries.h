// The two GEMM libraries kuai routes products to, set to the ISA tier in force (isa.h) before
// either is first used: oneDNN's max ISA (dnnl::set_max_cpu_isa, the API form of
// ONEDNN_MAX_CPU_ISA) and OpenBLAS's kernel core. OpenBLAS picks its core from the CPU's family
// and model when it is loaded, and a release older than the CPU falls back to a generic core:
// Debian's 0.3.21 runs Prescott (SSE3) kernels on Sapphire/Emerald Rapids (family 6, model 143
// and 207) at a tenth of the machine's fp32 rate. configure_gemm_libraries() asks OpenBLAS which
// core it chose and, when that core's tier is not the tier in force (a fallback below it, or a
// core above a KUAI_MAX_ISA cap), re-runs OpenBLAS's own core selection with OPENBLAS_CORETYPE
// naming the core of the tier (Cooperlake, SkylakeX, Haswell, Prescott). A user's own
// OPENBLAS_CORETYPE is left alone.
#pragma once

#include <string>
#include <string_view>

#include "kuai/backend/cpu/isa.h"

namespace kuai::cpu {

// Idempotent and thread-safe; every entry into oneDNN or OpenBLAS calls it first.
void configure_gemm_libraries();

struct GemmLibraries {
  std::string onednn_version;        // "2.6.0"
  std::string onednn_isa;            // oneDNN's effective max ISA: "avx512_core_bf16", ...
  std::string openblas_config;       // openblas_get_config()
  std::string openblas_loaded_core;  // the core OpenBLAS chose when it was loaded
  std::string openblas_core;         // the core in use now
  std::string openblas_note;         // why the two differ, or why a wanted change was not made
};
const GemmLibraries& gemm_libraries();  // configures first

// The tier an OpenBLAS x86-64 kernel core needs ("Haswell" -> avx2, "Prescott" -> baseline).
Isa openblas_core_isa(std::string_view core);

}  // namespace kuai::cpu
