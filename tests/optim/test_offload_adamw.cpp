// AdamW with its moments offloaded to disk (kuai/optim/offload_adamw.h) against in-memory AdamW:
// parameters and moments equal bit for bit over steps with clipping factors, a skipped step and a
// parameter without a gradient, with chunk boundaries falling inside parameters; what stays
// resident is the chunk buffers; the state streams out and back in.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/offload_adamw.h"

namespace kuai::optim {
namespace {

namespace fs = std::filesystem;

std::vector<uint32_t> bits(const Tensor& t) {
  const std::vector<float> v = t.to_vector<float>();
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * 4);
  return b;
}

struct Params {
  explicit Params(uint64_t seed) {
    Generator g(seed, 0);
    for (const Shape& s : {Shape{1000}, Shape{37, 53}, Shape{5}, Shape{3, 700}})
      t.push_back(g.normal(s, 0.0f, 0.5f).requires_grad_());
  }
  std::vector<ParamGroup> groups() const { return {{{t[0], t[1]}, 0.1f}, {{t[2], t[3]}, 0.0f}}; }
  std::vector<Tensor> t;
};

void set_grads(Params& p, int step) {
  Generator g(100 + static_cast<uint64_t>(step), 0);
  for (size_t i = 0; i < p.t.size(); ++i)
    p.t[i].set_grad(i == 2 && step == 1 ? Tensor() : g.normal(p.t[i].shape(), 0.0f, 1.0f));
}

TEST(OffloadedAdamW, EqualsInMemoryAdamWBitForBit) {
  const fs::path dir = fs::temp_directory_path() / ("kuai_offload_" + std::to_string(::getpid()));
  Params a(7), b(7);
  AdamWOptions o;
  o.lr = 0.01f;
  o.beta2 = 0.95f;
  AdamW plain(a.groups(), o);
  OffloadOptions off;
  off.dir = dir.string();
  off.chunk_bytes = 4096;  // 1024 floats: chunk boundaries inside every large parameter
  const int64_t before = Allocator::get().stats().current;
  {
    OffloadedAdamW offloaded(b.groups(), o, off);
    // Resident: the six chunk buffers (and their alignment slack) and the one-element learning
    // rate and step count, nothing per parameter.
    EXPECT_LE(Allocator::get().stats().current - before, 6 * (4096 + 4096) + 2 * 64);
    EXPECT_EQ(offloaded.stream().chunks(), (offloaded.state_elements() * 4 + 4095) / 4096);
    EXPECT_EQ(offloaded.layout()[1].first, 1008);  // 1000 rounded up to 16 floats
    for (int step = 0; step < 5; ++step) {
      set_grads(a, step);
      set_grads(b, step);
      const Tensor scale = full({1}, step == 2 ? 0.5f : 1.0f);
      const Tensor skip = full({1}, step == 3 ? 1.0f : 0.0f);  // an fp16 overflow's skip
      plain.step(scale, skip);
      offloaded.step(scale, skip);
      for (size_t i = 0; i < a.t.size(); ++i)
        ASSERT_EQ(bits(a.t[i]), bits(b.t[i])) << "step " << step << " parameter " << i;
    }
    EXPECT_EQ(offloaded.step_count(), plain.step_count());
    // The moments, streamed out, are AdamW's; the padding between parameters stays zero.
    std::vector<float> m(static_cast<size_t>(offloaded.state_elements())), v(m.size());
    offloaded.read_state([&](int64_t first, int64_t n, const float* cm, const float* cv) {
      std::memcpy(&m[static_cast<size_t>(first)], cm, static_cast<size_t>(n) * 4);
      std::memcpy(&v[static_cast<size_t>(first)], cv, static_cast<size_t>(n) * 4);
    });
    for (const OffloadedAdamW::Slot& s : offloaded.layout()) {
      const Tensor& pm = plain.exp_avg()[s.group][s.index];
      const Tensor& pv = plain.exp_avg_sq()[s.group][s.index];
      EXPECT_EQ(0, std::memcmp(pm.to_vector<float>().data(), &m[static_cast<size_t>(s.first)],
                               static_cast<size_t>(s.numel) * 4));
      EXPECT_EQ(0, std::memcmp(pv.to_vector<float>().data(), &v[static_cast<size_t>(s.first)],
                               static_cast<size_t>(s.numel) * 4));
    }
    EXPECT_EQ(m[1000], 0.0f);
    // Written back in (a resume), the next steps go on equal.
    offloaded.write_state([&](int64_t first, int64_t n, float* cm, float* cv) {
      std::memcpy(cm, &m[static_cast<size_t>(first)], static_cast<size_t>(n) * 4);
      std::memcpy(cv, &v[static_cast<size_t>(first)], static_cast<size_t>(n) * 4);
    });
    set_grads(a, 9);
    set_grads(b, 9);
    plain.step(1.0f);
    offloaded.step(1.0f);
    for (size_t i = 0; i < a.t.size(); ++i) EXPECT_EQ(bits(a.t[i]), bits(b.t[i])) << i;
  }
  EXPECT_FALSE(fs::exists(dir / "exp_avg.bin"));  // scratch, removed with the optimizer
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kuai::optim
