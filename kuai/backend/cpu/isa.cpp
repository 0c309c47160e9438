// Reports which vector ISA the kernels' run-time dispatch will pick on this CPU.
#include "kuai/backend/cpu/isa.h"

namespace kuai::cpu {

const char* isa_name() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "baseline";
}

}  // namespace kuai::cpu
