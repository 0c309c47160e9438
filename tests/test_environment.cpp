// The test binary's own environment: its GEMM tuning cache (kuai/backend/cpu/gemm/tuning.h) is a
// file in the build folder, one per ISA tier, rather than the user's ~/.cache/kuai, unless
// KUAI_GEMM_TUNING is already set.
#include <cstdlib>
#include <string>

namespace {

const bool kTuningFileSet = [] {
  const char* tier = std::getenv("KUAI_MAX_ISA");
  const std::string file = std::string(KUAI_BINARY_DIR) + "/gemm-tuning-" +
                           (tier != nullptr && *tier != '\0' ? tier : "native") + ".tsv";
  setenv("KUAI_GEMM_TUNING", file.c_str(), /*overwrite=*/0);
  return true;
}();

}  // namespace
