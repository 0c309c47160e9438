// Run-time ISA tiers for the CPU backend. x86 CPUs come in five tiers that matter to kuai:
// baseline (x86-64, SSE2), avx2 (AVX2 + FMA + F16C), avx512 (F, BW, DQ, VL, CD), avx512_bf16
// (adds native bf16 dot products) and amx (adds AMX tiles for bf16). isa() is the tier in force:
// the best the running CPU has, capped by the environment variable KUAI_MAX_ISA (read once, on
// first use). Everything that chooses code by ISA asks isa(): kuai's own kernels (below), the
// packed GEMM, the F16C conversions, the native-bf16 decision; the GEMM layer applies the same
// cap to oneDNN (its max ISA) and OpenBLAS (its kernel core), so one machine tests every tier
// at or below its own. PyTorch's ATEN_CPU_CAPABILITY is the model.
//
// Kernels that pay for wider vectors are written once and compiled per tier:
//
//   KUAI_KERNEL void scale_chunk_kernel(const float* x, float s, float* y, int64_t n) { ... }
//   KUAI_CLONE(scale_chunk, scale_chunk_kernel)
//
// KUAI_KERNEL marks the body always_inline; KUAI_CLONE defines scale_chunk(...), which calls a
// copy of the body compiled for AVX-512, one for AVX2 + FMA + F16C, or the portable one,
// according to isa(). (GCC's target_clones would pick by the loader's ifunc resolver, which
// nothing can cap.) Call clones from inside parallel regions, on one chunk each; put no OpenMP
// pragmas inside them.
//
// A body written with 32-byte GCC vectors (vector_size(32)) is one register at AVX2 and up, but
// at the baseline GCC 12 lowers their compares and selects (`a < b ? a : b`) one lane at a time,
// with branches; KUAI_CLONE_WIDTHS(name, body, baseline_body) gives the baseline copy a body of
// its own (the same arithmetic on 16-byte vectors, which SSE2 compares and selects natively).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace kuai::cpu {

enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

inline constexpr Isa kAllIsas[] = {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16,
                                   Isa::kAmx};

// "baseline", "avx2", "avx512", "avx512_bf16", "amx".
std::string_view isa_name(Isa isa);
// The tier a KUAI_MAX_ISA value names (case-insensitive), or nullopt.
std::optional<Isa> parse_isa(std::string_view name);

// The best tier the running CPU (and the OS, for the vector state) supports.
Isa cpu_isa();
// The tier in force: cpu_isa() capped by KUAI_MAX_ISA. Throws std::invalid_argument naming the
// variable and the allowed values when KUAI_MAX_ISA holds anything else.
Isa isa();
// Name of the widest vector ISA kuai's own kernels run ("avx512", "avx2", "baseline").
const char* isa_name();
// What KUAI_MAX_ISA asked for ("" when unset), for reports.
std::string max_isa_request();

// The running CPU as cpuid reports it (what OpenBLAS keys its core choice on, and what the GEMM
// tuning cache is keyed by).
struct CpuId {
  std::string vendor;                       // "GenuineIntel", "AuthenticAMD"
  std::string model_name;                   // the brand string: "Intel(R) Xeon(R) Platinum 8480+"
  int family = 0, model = 0, stepping = 0;  // display family and model (extended fields added)
};
const CpuId& cpu_id();
// The CPU's flags that decide a tier, each with whether the CPU has it ("avx2 +", "amx_tile -").
std::string cpu_flags_report();

// The copy of a KUAI_CLONE kernel that runs at the tier in force: kAvx512, kAvx2 or kBaseline.
inline Isa clone_variant() {
  const Isa t = isa();
  return t >= Isa::kAvx512 ? Isa::kAvx512 : t;
}

}  // namespace kuai::cpu

#if defined(__x86_64__) && defined(__GNUC__)
#define KUAI_TARGET_AVX512 \
  __attribute__((          \
      target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx2,fma,f16c,bmi,bmi2,popcnt")))
#define KUAI_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define KUAI_HAVE_ISA_CLONES 1
#else
#define KUAI_TARGET_AVX512
#define KUAI_TARGET_AVX2
#define KUAI_HAVE_ISA_CLONES 0
#endif

#define KUAI_KERNEL [[gnu::always_inline]] inline

#if KUAI_HAVE_ISA_CLONES
#define KUAI_CLONE_WIDTHS(name, body, baseline_body)                \
  template <class... Args>                                          \
  KUAI_TARGET_AVX512 decltype(auto) name##_avx512(Args&&... args) { \
    return body(std::forward<Args>(args)...);                       \
  }                                                                 \
  template <class... Args>                                          \
  KUAI_TARGET_AVX2 decltype(auto) name##_avx2(Args&&... args) {     \
    return body(std::forward<Args>(args)...);                       \
  }                                                                 \
  template <class... Args>                                          \
  decltype(auto) name##_baseline(Args&&... args) {                  \
    return baseline_body(std::forward<Args>(args)...);              \
  }                                                                 \
  template <class... Args>                                          \
  decltype(auto) name(Args&&... args) {                             \
    switch (::kuai::cpu::clone_variant()) {                         \
      case ::kuai::cpu::Isa::kAvx512:                               \
        return name##_avx512(std::forward<Args>(args)...);          \
      case ::kuai::cpu::Isa::kAvx2:                                 \
        return name##_avx2(std::forward<Args>(args)...);            \
      default:                                                      \
        return name##_baseline(std::forward<Args>(args)...);        \
    }                                                               \
  }
#else
#define KUAI_CLONE_WIDTHS(name, body, baseline_body)   \
  template <class... Args>                             \
  decltype(auto) name(Args&&... args) {                \
    return baseline_body(std::forward<Args>(args)...); \
  }
#endif
#define KUAI_CLONE(name, body) KUAI_CLONE_WIDTHS(name, body, body)
