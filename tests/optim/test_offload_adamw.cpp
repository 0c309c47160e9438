// AdamW with its moments offloaded to disk (kuai/optim/offload_adamw.h) against in-memory AdamW:
// parameters and moments equal bit for bit over steps with clipping factors, a skipped step and a
// parameter without a gradient, with chunk boundaries falling inside parameters; what stays
// resident is the chunk buffers; the state streams out and back in.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
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
  // No cached blocks: each buffer is served from its own size class, whatever ran before.
  Allocator::get().empty_cache();
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
    offloaded.moments().read([&](const StateChunk& c) {
      std::memcpy(&m[static_cast<size_t>(c.first)], c.exp_avg, static_cast<size_t>(c.count) * 4);
      std::memcpy(&v[static_cast<size_t>(c.first)], c.exp_avg_sq, static_cast<size_t>(c.count) * 4);
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
    offloaded.moments().write([&](const StateChunk& c) {
      std::memcpy(c.exp_avg, &m[static_cast<size_t>(c.first)], static_cast<size_t>(c.count) * 4);
      std::memcpy(c.exp_avg_sq, &v[static_cast<size_t>(c.first)], static_cast<size_t>(c.count) * 4);
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

// Masters offloaded too (train.offload_master): two of the parameters become bf16 working copies
// with fp32 gradients; their masters, streamed out, are in-memory AdamW's parameters bit for bit
// and the working copies are those parameters cast (autocast's cast), over steps with a clipping
// factor and a skipped step; the resident bytes of a working copy are 2 per element.
TEST(OffloadedAdamW, OffloadedMastersAreInMemoryAdamWsParametersBitForBit) {
  const fs::path dir =
      fs::temp_directory_path() / ("kuai_offload_masters_" + std::to_string(::getpid()));
  Params a(7), b(7);
  AdamWOptions o;
  o.lr = 0.01f;
  AdamW plain(a.groups(), o);
  OffloadOptions off;
  off.dir = dir.string();
  off.chunk_bytes = 4096;
  off.master_params = {b.t[1], b.t[3]};
  off.master_dtype = DType::kBF16;
  {
    Allocator::get().empty_cache();
    const int64_t before = Allocator::get().stats().current;
    OffloadedAdamW offloaded(b.groups(), o, off);
    EXPECT_TRUE(offloaded.has_masters());
    EXPECT_TRUE(fs::exists(dir / "master.bin"));
    EXPECT_EQ(b.t[1].dtype(), DType::kBF16);
    EXPECT_TRUE(b.t[1].impl()->master_elsewhere);
    EXPECT_EQ(b.t[0].dtype(), DType::kF32);  // not named: stays fp32
    // Nine chunk buffers (three files) with their alignment slack; 37 x 53 + 3 x 700 fp32
    // elements released and as many bf16 ones kept, 2 bytes each less; 1 KiB for the step count,
    // the learning rate and the allocator's rounding.
    EXPECT_LE(Allocator::get().stats().current - before,
              9 * (4096 + 4096) - 2 * (37 * 53 + 3 * 700) + 1024);
    for (int step = 0; step < 4; ++step) {
      set_grads(a, step);
      set_grads(b, step);
      const Tensor scale = full({1}, step == 2 ? 0.5f : 1.0f);
      const Tensor skip = full({1}, step == 3 ? 1.0f : 0.0f);
      plain.step(scale, skip);
      offloaded.step(scale, skip);
      for (size_t i : {size_t{0}, size_t{2}}) ASSERT_EQ(bits(a.t[i]), bits(b.t[i])) << i;
      for (size_t i : {size_t{1}, size_t{3}}) {
        const std::vector<uint16_t> want = cast(a.t[i], DType::kBF16).to_vector<uint16_t>();
        ASSERT_EQ(want, b.t[i].to_vector<uint16_t>()) << "step " << step << " parameter " << i;
      }
    }
    std::map<const TensorImpl*, std::vector<float>> masters;
    offloaded.read_masters([&](const Tensor& p, int64_t begin, int64_t n, const float* v) {
      auto& m = masters[p.impl()];
      m.resize(static_cast<size_t>(p.numel()));
      std::memcpy(&m[static_cast<size_t>(begin)], v, static_cast<size_t>(n) * 4);
    });
    ASSERT_EQ(masters.size(), 2u);
    for (size_t i : {size_t{1}, size_t{3}}) {
      const std::vector<float> want = a.t[i].to_vector<float>();
      EXPECT_EQ(0, std::memcmp(want.data(), masters[b.t[i].impl()].data(), want.size() * 4)) << i;
    }
  }
  EXPECT_FALSE(fs::exists(dir / "master.bin"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kuai::optim
