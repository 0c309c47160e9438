// The ISA tier in force and what follows it: KUAI_MAX_ISA caps the tier, kuai's own kernels run
// the copy of the tier, and oneDNN and OpenBLAS are set to it. `make test` runs the whole suite
// again under every lower KUAI_MAX_ISA the CPU supports (tests/run_tier.sh), so each of these
// checks runs at every tier.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <oneapi/dnnl/dnnl.hpp>
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

TEST(Isa, TierInForceIsTheCpuCappedByKuaiMaxIsa) {
  const std::string request = max_isa_request();
  Isa want = cpu_isa();
  if (!request.empty()) {
    ASSERT_TRUE(parse_isa(request)) << "KUAI_MAX_ISA=" << request;
    want = std::min(want, *parse_isa(request));
  }
  EXPECT_EQ(isa(), want);
  std::cout << "cpu tier " << isa_name(cpu_isa()) << ", KUAI_MAX_ISA '" << request
            << "', tier in force " << isa_name(isa()) << ", kernels " << isa_name(clone_variant())
            << "\n";
  // The kernels' copy: AVX-512 from the avx512 tier up, else the tier itself.
  EXPECT_EQ(clone_variant(), isa() >= Isa::kAvx512 ? Isa::kAvx512 : isa());
}

TEST(Isa, OneDnnRunsAtMostTheTier) {
  const GemmLibraries& libs = gemm_libraries();
  const auto effective = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  // oneDNN's ISA values are nested bit masks: a cap admits exactly its own bits.
  const dnnl::cpu_isa cap = isa() >= Isa::kAmx          ? dnnl::cpu_isa::avx512_core_amx
                            : isa() == Isa::kAvx512Bf16 ? dnnl::cpu_isa::avx512_core_bf16
                            : isa() == Isa::kAvx512     ? dnnl::cpu_isa::avx512_core
                            : isa() == Isa::kAvx2       ? dnnl::cpu_isa::avx2_vnni
                                                        : dnnl::cpu_isa::sse41;
  if (isa() < cpu_isa()) {
    EXPECT_EQ(effective & ~static_cast<unsigned>(cap), 0u)
        << "oneDNN runs " << libs.onednn_isa << " above the tier " << isa_name(isa());
  }
  EXPECT_EQ(cpu_has_native_bf16(),
            isa() >= Isa::kAvx512Bf16 &&
                (effective & static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16)) ==
                    static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16));
  std::cout << "oneDNN " << libs.onednn_version << " at " << libs.onednn_isa << "\n";
}

// OpenBLAS runs the core of the tier in force: never a fallback below it (Debian's 0.3.21 picks
// Prescott on Sapphire/Emerald Rapids) nor a core above a cap. amx has no 0.3.21 core: Cooperlake.
TEST(Isa, OpenBlasRunsTheCoreOfTheTier) {
  const GemmLibraries& libs = gemm_libraries();
  std::cout << "OpenBLAS loaded " << libs.openblas_loaded_core << ", runs " << libs.openblas_core
            << (libs.openblas_note.empty() ? "" : " (" + libs.openblas_note + ")") << "\n";
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) GTEST_SKIP() << libs.openblas_note;
  const Isa want = std::min(isa(), Isa::kAvx512Bf16);
  EXPECT_EQ(openblas_core_isa(libs.openblas_core), want)
      << libs.openblas_core << ": " << libs.openblas_note;
}

}  // namespace
}  // namespace kuai::cpu
