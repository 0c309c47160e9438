// attention = "auto" on the CPU: which kernel, naive or flash, runs a causal self-attention of a
// given shape faster on this machine, forward and backward together. Measured the first time a
// shape is asked for, as the GEMM router measures a product (router.h): both kernels run on
// random operands of the shape (a batch that gives every thread several heads), one warm-up
// each, then in turn, A B A B ..., each keeping its best time; the faster is recorded in the GEMM
// tuning cache (tuning.h: one file per CPU, tier, library and kuai version, entries never
// replaced), so every later run makes the same choice and gets the same bits. Where nothing may be
// measured (tuning off; one of several MPI ranks with no entry; inside a parallel region) the
// default applies (core/backend.h: flash from 2048 positions), as it does for attentions too small
// to time (under 2^24 multiply-adds in QK^T at the measured batch). A shape whose naive
// probabilities would take more than 1 GiB at the measured batch is not measured: flash, for its
// memory.
#pragma once

#include <functional>
#include <string>

#include "kuai/core/backend.h"

namespace kuai::cpu {

AttentionKernel choose_attention_kernel(const AttentionShape& s);

// The tuning cache's key: "attention H12 kv12 T1024 d64 float32 causal t2" (the batch is not in
// it: the kernels are timed on a batch of their own).
std::string attention_key(const AttentionShape& s);

// Testing hook: a timer returning the seconds a kernel "took" at a shape instead of measuring
// it (the kernels still run once each); an empty function restores the clock.
void set_attention_timer(std::function<double(const AttentionShape&, AttentionKernel)> timer);

}  // namespace kuai::cpu
