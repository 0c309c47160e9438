// Run-time ISA selection for hand-written CPU kernels. A hot, OpenMP-free inner function marked
// KUAI_CLONES is compiled three times (AVX-512, AVX2+FMA+F16C, portable x86-64) and the loader
// picks the best one the running CPU supports (GCC ifunc). Call cloned functions from inside
// parallel regions, on one chunk each; do not put OpenMP pragmas inside them.
#pragma once

// Sanitizer builds get the portable code only: the ifunc resolvers run before the sanitizer
// runtime is initialised (ASan and TSan both crash there).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define KUAI_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KUAI_CLONES
#endif

namespace kuai::cpu {
// Name of the widest vector ISA the running CPU offers ("avx512", "avx2", "baseline").
const char* isa_name();
}  // namespace kuai::cpu
