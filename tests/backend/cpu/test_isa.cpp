// The ISA tier in force and what follows it: KUAI_MAX_ISA caps the tier, kuai's own kernels run
// the copy of the tier, and oneDNN and OpenBLAS are set to it. `make test` runs the whole suite
// again under every lower KUAI_MAX_ISA the CPU supports (tests/run_tier.sh), so each of these
// checks runs at every tier.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string>

#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/backend/cpu/gemm/libraries.h"
#include "kuai/backend/cpu/isa.h"

namespace kuai::cpu {
namespace {

TEST(Isa, NamesRoundTripAndOthersAreRejected) {
  for (Isa t : kAllIsas) EXPECT_EQ(parse_isa(isa_name(t)), t) << isa_name(t);
  EXPECT_EQ(parse_isa("AVX512_BF16"), Isa::kAvx512Bf16);
  EXPECT_FALSE(parse_isa("avx512bf16"));
  EXPECT_FALSE(parse_isa("sse4"));
  EXPECT_FALSE(parse_isa(""));
}

// What each tier in force runs, written out (not re-derived from the code's own rules).
struct TierRow {
  Isa tier;
  Isa kernels;                // the KUAI_CLONE copy
  dnnl::cpu_isa onednn_cap;   // oneDNN's max ISA
  Isa openblas;               // the OpenBLAS core's tier (0.3.21 has none for amx)
  LowpGemmPath lowp_default;  // attention's per-thread bf16 products
  bool native_bf16;           // on a CPU that has AVX512-BF16
};
const TierRow kTiers[] = {
    {Isa::kBaseline, Isa::kBaseline, dnnl::cpu_isa::sse41, Isa::kBaseline,
     LowpGemmPath::kConvertFp32, false},
    {Isa::kAvx2, Isa::kAvx2, dnnl::cpu_isa::avx2_vnni, Isa::kAvx2, LowpGemmPath::kPacked, false},
    {Isa::kAvx512, Isa::kAvx512, dnnl::cpu_isa::avx512_core, Isa::kAvx512, LowpGemmPath::kPacked,
     false},
    {Isa::kAvx512Bf16, Isa::kAvx512, dnnl::cpu_isa::avx512_core_bf16, Isa::kAvx512Bf16,
     LowpGemmPath::kPacked, true},
    {Isa::kAmx, Isa::kAvx512, dnnl::cpu_isa::avx512_core_amx, Isa::kAvx512Bf16,
     LowpGemmPath::kOneDNN, true},
};
const TierRow& row_of(Isa t) {
  for (const TierRow& r : kTiers)
    if (r.tier == t) return r;
  throw std::logic_error("no row");
}

// The tier in force for (the CPU's tier, KUAI_MAX_ISA), as a table: rows the CPU, columns the
// request (baseline .. amx, then unset).
constexpr Isa B = Isa::kBaseline, A2 = Isa::kAvx2, A5 = Isa::kAvx512, BF = Isa::kAvx512Bf16,
              AM = Isa::kAmx;
constexpr Isa kInForce[5][6] = {
    /* cpu baseline    */ {B, B, B, B, B, B},
    /* cpu avx2        */ {B, A2, A2, A2, A2, A2},
    /* cpu avx512      */ {B, A2, A5, A5, A5, A5},
    /* cpu avx512_bf16 */ {B, A2, A5, BF, BF, BF},
    /* cpu amx         */ {B, A2, A5, BF, AM, AM},
};

TEST(Isa, TierInForceIsTheCpuCappedByKuaiMaxIsa) {
  const std::string request = max_isa_request();
  int column = 5;
  if (!request.empty()) {
    ASSERT_TRUE(parse_isa(request)) << "KUAI_MAX_ISA=" << request;
    column = static_cast<int>(*parse_isa(request));
  }
  EXPECT_EQ(isa(), kInForce[static_cast<int>(cpu_isa())][column]);
  std::cout << "cpu tier " << isa_name(cpu_isa()) << ", KUAI_MAX_ISA '" << request
            << "', tier in force " << isa_name(isa()) << ", kernels " << isa_name(clone_variant())
            << "\n";
  EXPECT_EQ(clone_variant(), row_of(isa()).kernels);
}

TEST(Isa, OneDnnRunsAtMostTheTier) {
  const GemmLibraries& libs = gemm_libraries();
  const auto effective = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const TierRow& row = row_of(isa());
  // oneDNN's ISA values are nested bit masks: a cap admits exactly its own bits.
  if (isa() < cpu_isa()) {
    EXPECT_EQ(effective & ~static_cast<unsigned>(row.onednn_cap), 0u)
        << "oneDNN runs " << libs.onednn_isa << " above the tier " << isa_name(isa());
  }
  const bool cpu_bf16 = cpu_isa() >= Isa::kAvx512Bf16;
  EXPECT_EQ(cpu_has_native_bf16(), row.native_bf16 && cpu_bf16);
  std::cout << "oneDNN " << libs.onednn_version << " at " << libs.onednn_isa << "\n";
}

// Which path attention's per-thread low-precision products take by default at the tier.
TEST(Isa, LowPrecisionProductsTakeTheTiersPath) {
  EXPECT_EQ(lowp_gemm_auto_path(), row_of(isa()).lowp_default) << isa_name(isa());
}

// OpenBLAS runs the core of the tier in force: never a fallback below it (Debian's 0.3.21 picks
// Prescott on Sapphire/Emerald Rapids) nor a core above a cap. amx has no 0.3.21 core: Cooperlake.
TEST(Isa, OpenBlasRunsTheCoreOfTheTier) {
  const GemmLibraries& libs = gemm_libraries();
  std::cout << "OpenBLAS loaded " << libs.openblas_loaded_core << ", runs " << libs.openblas_core
            << (libs.openblas_note.empty() ? "" : " (" + libs.openblas_note + ")") << "\n";
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) GTEST_SKIP() << libs.openblas_note;
  EXPECT_EQ(openblas_core_isa(libs.openblas_core), row_of(isa()).openblas)
      << libs.openblas_core << ": " << libs.openblas_note;
}

}  // namespace
}  // namespace kuai::cpu
