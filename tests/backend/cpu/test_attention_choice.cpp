// The CPU's choice between naive and flash attention (attention_choice.h): measured on this
// machine, recorded in the tuning cache with both times, and the recorded choice is the faster
// of the two measured (swapping the comparison fails this); attentions too small to time, or
// asked for inside a parallel region, take the default without an entry.
#include "kuai/backend/cpu/attention_choice.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstdio>
#include <string>

#include "kuai/backend/cpu/gemm/tuning.h"

namespace kuai::cpu {
namespace {

AttentionShape shape(int64_t T, int64_t heads, int64_t kv_heads, int64_t d) {
  AttentionShape s;
  s.batch = 1;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.seq = T;
  s.head_dim = d;
  return s;
}

TEST(AttentionChoice, RecordsTheFasterOfTheTwoMeasuredKernels) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  // Two shapes on either side of where the kernels usually cross, GQA in one.
  for (const AttentionShape& s : {shape(512, 4, 4, 32), shape(640, 4, 2, 64)}) {
    const AttentionKernel k = choose_attention_kernel(s);
    const std::optional<std::string> recorded = cache.find(attention_key(s));
    ASSERT_TRUE(recorded.has_value()) << attention_key(s);
    EXPECT_EQ(*recorded, k == AttentionKernel::kFlash ? "flash" : "naive");
    std::string measured;
    for (const TuningEntry& e : cache.entries())
      if (e.key == attention_key(s)) measured = e.measured;
    double naive_ms = 0, flash_ms = 0;
    ASSERT_EQ(std::sscanf(measured.c_str(), "naive %lf flash %lf ms", &naive_ms, &flash_ms), 2)
        << measured;
    EXPECT_GT(naive_ms, 0.0);
    EXPECT_GT(flash_ms, 0.0);
    EXPECT_EQ(k, flash_ms < naive_ms ? AttentionKernel::kFlash : AttentionKernel::kNaive)
        << measured;
    EXPECT_EQ(choose_attention_kernel(s), k);  // asked again: the entry stands
  }
}

TEST(AttentionChoice, SmallOrParallelTakeTheDefaultWithoutAnEntry) {
  TuningCache& cache = TuningCache::get();
  const AttentionShape tiny = shape(33, 2, 2, 8);
  EXPECT_EQ(choose_attention_kernel(tiny), AttentionKernel::kNaive);
  EXPECT_FALSE(cache.find(attention_key(tiny)).has_value());
  const AttentionShape wide = shape(2100, 1, 1, 8);  // a default of flash, from 2048 positions
  AttentionKernel inside = AttentionKernel::kNaive;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    inside = choose_attention_kernel(wide);
  }
  EXPECT_EQ(inside, AttentionKernel::kFlash);
  EXPECT_FALSE(cache.find(attention_key(wide)).has_value());
}

}  // namespace
}  // namespace kuai::cpu
