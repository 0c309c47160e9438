// Where a step's products lose time: with the profiler on (KUAI_PROFILE=1), every fp32 product
// the router runs at top level is noted with its shape, implementation and time in the step; when
// the profile is reported, each is run again here, alone, on fresh operands, with the same
// implementation: "hot" right after a run of itself (its operands in the caches, as the GEMM
// ceiling is measured) and "cold" after a sweep that evicts the last-level cache (its operands
// from memory, as in a step whose other ops have pushed them out). The section compares the
// three rates per product and sums what the step's products would take at each.
#pragma once

#include <string>

#include "kuai/backend/cpu/gemm/router.h"

namespace kuai::cpu {

// Called by run_profiled for each product run at top level with the profiler on; `row` is the
// profile's name of the product ("gemm NT 1024x2304x768 onednn").
void note_profiled_product(const std::string& row, const GemmShape& shape, const char* impl,
                           double ms);

// The section's text: products by total time in the step, heaviest first. Runs every fp32
// product again (a few seconds for a GPT-2-sized step); low-precision rows are listed without.
std::string products_alone_report();

}  // namespace kuai::cpu
