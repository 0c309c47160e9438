// The GEMM router: which implementation runs each product, and why. Every fp32 product (gemm,
// gemm_bias, gemm_batched in gemm.h) and every mixed-precision one (gemm_lowp.h) in automatic
// mode asks route() with its shape; the candidates are the implementations that can run it here
// (oneDNN, OpenBLAS; for low-precision operands oneDNN's bf16/f16 matmul, the packed kernel and
// the widening path), each tested on its own. The choice is measured on this machine, not taken
// from a table measured on another: the first time a product shape is seen outside a parallel
// region, each candidate runs it (one warm-up, then the best of a few timed runs) and the fastest
// is recorded in the tuning cache (tuning.h), a file per CPU model, tier and library versions
// that later runs read, so a run with a given cache makes the same choices and gets the same
// bits. The default applies inside parallel constructs (per-thread products: attention's heads,
// flash attention's blocks), to products too small to time (under 2^20 multiply-adds), and where
// nothing is cached and nothing may be measured (tuning off; under mpirun, where ranks must
// agree): oneDNN for fp32 and, for low precision, oneDNN on AMX, else the packed kernel (AVX2),
// else widening (gemm_lowp.cpp says why).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {

// One way to run a product: its name in the cache and reports, and the call.
struct GemmCandidate {
  const char* name;
  std::function<void()> run;
};

// The shape of a product as the router keys it.
struct GemmShape {
  const char* op;  // "gemm", "bias", "batched", "lowp", "lowp_bias"
  bool trans_a, trans_b;
  int64_t m, n, k;
  int64_t batch = 1;
  DType a = DType::kF32, b = DType::kF32, c = DType::kF32;
  double flops() const { return 2.0 * static_cast<double>(m) * n * k * batch; }
};

// The tuning cache's key of `shape` at this thread's OpenMP thread count: "gemm NT 4096x768x256
// b1 t2 float32.float32.float32".
std::string routing_key(const GemmShape& shape);

// The index of the candidate that runs `shape`: the cached choice, else (when calibration is
// allowed here) the measured fastest, else `fallback`. `candidates` must not be empty and be
// listed in the same order every time. Calibration runs the candidates on the caller's operands
// and output; when C is read (beta != 0) `save_c` and `restore_c` keep its initial contents, so
// route() returns with C as it found it. The caller then runs the chosen candidate, always.
size_t route(const GemmShape& shape, std::span<const GemmCandidate> candidates, size_t fallback,
             const std::function<void()>& save_c = {}, const std::function<void()>& restore_c = {});

// A copy of C's (rows, cols) elements of `elem` bytes with leading dimension `ld`, from the
// tracking allocator, for route()'s save_c / restore_c; null `c`: nothing to keep (empty
// functions). The copy is allocated lazily, so a product that is not calibrated costs nothing.
class MatrixSnapshot {
 public:
  MatrixSnapshot(void* c, int64_t rows, int64_t cols, int64_t ld, size_t elem);
  std::function<void()> save_fn();
  std::function<void()> restore_fn();

 private:
  char* c_;
  int64_t rows_;
  size_t row_bytes_, ld_bytes_;
  std::optional<ScratchBytes> copy_;
};

// How long a race of candidates runs (route() measures with one, attention_choice.h with another):
// after a warm-up of each, rounds of every candidate in turn, A B A B ..., at least min_rounds,
// more until min_seconds have passed, at most max_rounds.
struct RaceLimits {
  int min_rounds, max_rounds;
  double min_seconds;
};
// The best time (seconds) of each of `runs` over such a race; `before` runs, untimed, before
// every run, the warm-ups included. With `fake` (tests), only the warm-ups run and fake(i) stands
// for the time of runs[i].
std::vector<double> race(std::span<const std::function<void()>> runs, const RaceLimits& limits,
                         const std::function<void()>& before = {},
                         const std::function<double(size_t)>& fake = {});

// True inside a parallel construct (active or not: a team of one still runs its products
// single-threaded). There every product takes the router's default without measuring or looking
// anything up (a measured choice made for the threaded product of that shape does not apply, and
// kernels such as flash attention promise the same bits whatever the team size), and nothing is
// profiled.
bool routes_to_default_here();

// Runs `fn`, the implementation `impl` of a product of `shape`. With the profiler on
// (KUAI_PROFILE=1) and outside parallel regions, its time and FLOPs are recorded under the shape
// and implementation ("gemm NN 1024x768x50257 openblas"), so the profile shows the GFLOP/s each
// product achieves inside a training step. Off, it costs one branch.
void run_profiled(const GemmShape& shape, const char* impl, const std::function<void()>& fn);

// A readable report of the routing: the tuning cache in use and its entries, one line each.
std::string gemm_routing_report();

// Testing hook: a timer that returns the seconds a candidate "took" instead of measuring it
// (deterministic calibration in tests); an empty function restores the clock.
void set_calibration_timer(std::function<double(const GemmShape&, const char* candidate)> timer);

}  // namespace kuai::cpu
