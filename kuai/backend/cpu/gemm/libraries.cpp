// Sets oneDNN and OpenBLAS to the ISA tier in force (see libraries.h).
#include "kuai/backend/cpu/gemm/libraries.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string_view>

#include "kuai/backend/cpu/isa.h"

extern "C" {
char* openblas_get_corename(void);
char* openblas_get_config(void);
}

namespace kuai::cpu {
namespace {

// The OPENBLAS_CORETYPE value of the fastest sgemm core for a tier that 0.3.21 has (it has no
// AMX core; Cooperlake adds bf16 to SkylakeX's kernels).
const char* core_for(Isa tier) {
  switch (tier) {
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
      return "COOPERLAKE";
    case Isa::kAvx512:
      return "SKYLAKEX";
    case Isa::kAvx2:
      return "HASWELL";
    default:
      return "PRESCOTT";
  }
}

dnnl::cpu_isa onednn_cap(Isa tier) {
  switch (tier) {
    case Isa::kAmx:
      return dnnl::cpu_isa::avx512_core_amx;
    case Isa::kAvx512Bf16:
      return dnnl::cpu_isa::avx512_core_bf16;
    case Isa::kAvx512:
      return dnnl::cpu_isa::avx512_core;
    case Isa::kAvx2:
      return dnnl::cpu_isa::avx2;
    default:
      return dnnl::cpu_isa::sse41;
  }
}

std::string onednn_isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "isa " + std::to_string(static_cast<unsigned>(isa));
  }
}

// Re-runs OpenBLAS's core selection with OPENBLAS_CORETYPE=core, then restores the environment.
// Only a DYNAMIC_ARCH build (Debian's) has the entry points; returns false without them.
bool select_openblas_core(const char* core) {
  using Fn = void (*)();
  auto quit = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit"));
  auto init = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init"));
  if (quit == nullptr || init == nullptr) return false;
  setenv("OPENBLAS_CORETYPE", core, 1);
  quit();
  init();
  unsetenv("OPENBLAS_CORETYPE");
  return true;
}

GemmLibraries configure() {
  GemmLibraries libs;
  const Isa tier = isa();
  if (tier < cpu_isa()) {
    try {
      dnnl::set_max_cpu_isa(onednn_cap(tier));  // before any other oneDNN call
    } catch (const dnnl::error&) {
      // oneDNN was used before kuai (by the embedding program): its ISA is already fixed.
    }
  }
  const dnnl_version_t* v = dnnl_version();
  libs.onednn_version =
      std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  libs.onednn_isa = onednn_isa_name(dnnl::get_effective_cpu_isa());

  libs.openblas_config = openblas_get_config();
  libs.openblas_loaded_core = openblas_get_corename();
  const char* user_core = std::getenv("OPENBLAS_CORETYPE");
  const Isa loaded = openblas_core_isa(libs.openblas_loaded_core);
  if (user_core != nullptr) {
    libs.openblas_note = std::string("OPENBLAS_CORETYPE=") + user_core + " set by the user";
  } else if (loaded != tier && !(tier == Isa::kAmx && loaded == Isa::kAvx512Bf16)) {
    // (Cooperlake is the best core an OpenBLAS without an AMX one has for the amx tier.)
    const char* want = core_for(tier);
    const std::string why =
        loaded < tier ? "a fallback below the tier in force " + std::string(isa_name(tier))
                      : "above the tier in force " + std::string(isa_name(tier));
    if (select_openblas_core(want)) {
      libs.openblas_note = "OpenBLAS chose " + libs.openblas_loaded_core + " (" + why +
                           "); kuai selected " + openblas_get_corename();
    } else {
      libs.openblas_note = "OpenBLAS chose " + libs.openblas_loaded_core + " (" + why +
                           ") and this build cannot switch cores (not DYNAMIC_ARCH)";
    }
  }
  libs.openblas_core = openblas_get_corename();
  return libs;
}

}  // namespace

// Cores not named run SSE-class (or AVX1) kernels: the baseline tier.
Isa openblas_core_isa(std::string_view core) {
  if (core == "SapphireRapids") return Isa::kAmx;
  if (core == "Cooperlake") return Isa::kAvx512Bf16;
  if (core == "SkylakeX") return Isa::kAvx512;
  if (core == "Haswell" || core == "Zen" || core == "Excavator") return Isa::kAvx2;
  return Isa::kBaseline;
}

const GemmLibraries& gemm_libraries() {
  static const GemmLibraries libs = configure();  // function-local: safe from static initializers
  return libs;
}

void configure_gemm_libraries() { gemm_libraries(); }

}  // namespace kuai::cpu
