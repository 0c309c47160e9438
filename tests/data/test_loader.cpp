// The prefetching DataLoader and the batch sources: delivery in index order whatever the worker
// timing, the same bits for any worker count, bounded prefetch into reused buffers, exact resume,
// worker errors surfaced (never a hang), prompt shutdown, and the window arithmetic of each
// source.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <optional>
#include <set>
#include <thread>

#include "kuai/data/batch_source.h"
#include "kuai/data/loader.h"

namespace kuai::data {
namespace {

using Clock = std::chrono::steady_clock;

std::string tmp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / fmt::format("kuai_{}_{}", getpid(), name))
      .string();
}

// Writes tokens and opens them; the file is removed once mapped (the mapping stays valid).
std::shared_ptr<const TokenFile> token_file(const std::string& name,
                                            const std::vector<int32_t>& tokens, int token_bytes) {
  const std::string path = tmp(name);
  write_token_file(path, tokens.data(), static_cast<int64_t>(tokens.size()), token_bytes);
  auto file = std::make_shared<const TokenFile>(TokenFile::open(path));
  std::filesystem::remove(path);
  return file;
}

std::vector<int32_t> iota_tokens(int64_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  return t;
}

// Writes its index into x (and index + 1 into y) after a pseudo-random sleep of up to 1.5 ms, so
// workers finish out of order. Records how far ahead of the consumer each fill ran: the consumer
// bumps `calls` before every next().
class IndexSource final : public BatchSource {
 public:
  explicit IndexSource(int64_t throw_at = -1) : BatchSource(2, 3), throw_at_(throw_at) {}

  void fill(int64_t index, int32_t* x, int32_t* y) const override {
    const int64_t ahead = index + 1 - calls.load();  // batches requested-or-not-yet, incl. this
    int64_t seen = max_ahead.load();
    while (ahead > seen && !max_ahead.compare_exchange_weak(seen, ahead)) {
    }
    fills.fetch_add(1);
    const uint64_t h = (static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull) >> 54;  // [0, 1024)
    std::this_thread::sleep_for(std::chrono::microseconds(h * 1500 / 1024));
    if (index == throw_at_) throw std::runtime_error(fmt::format("boom at batch {}", index));
    for (int64_t k = 0; k < 6; ++k) {
      x[k] = static_cast<int32_t>(index);
      y[k] = static_cast<int32_t>(index + 1);
    }
  }

  mutable std::atomic<int64_t> calls{0}, max_ahead{0}, fills{0};

 private:
  int64_t throw_at_;
};

Batch take(DataLoader& loader, const IndexSource& src) {
  src.calls.fetch_add(1);
  return loader.next();
}

struct Copy {
  int64_t index;
  std::vector<int32_t> x, y;
  bool operator==(const Copy&) const = default;
};

Copy copy_of(const Batch& b) {
  return {b.index, b.x.to_vector<int32_t>(), b.y.to_vector<int32_t>()};
}

std::vector<Copy> run(std::shared_ptr<const BatchSource> src, LoaderOptions opts, int64_t n,
                      int64_t start = 0) {
  DataLoader loader(std::move(src), opts, start);
  std::vector<Copy> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(copy_of(loader.next()));
  return out;
}

// What the source itself says batch i is.
Copy direct(const BatchSource& src, int64_t i) {
  const size_t n = static_cast<size_t>(src.batch_size() * src.seq_len());
  Copy c{i, std::vector<int32_t>(n), std::vector<int32_t>(n)};
  src.fill(i, c.x.data(), c.y.data());
  return c;
}

std::shared_ptr<const RandomWindows> corpus_windows(uint64_t seed, int rank = 0, int world = 1) {
  std::vector<int32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>(((i * 2654435761u) >> 7) % 5000);
  static const auto file = token_file("corpus.bin", tokens, 2);
  return std::make_shared<const RandomWindows>(file, 1000, 19000, 4, 16, seed, rank, world);
}

// ---- DataLoader ----

TEST(DataLoader, DeliversInIndexOrderWhateverWorkerTiming) {
  for (int workers : {0, 1, 2, 3, 4}) {
    for (int prefetch : {1, 2, 3}) {
      SCOPED_TRACE(fmt::format("workers {} prefetch {}", workers, prefetch));
      auto src = std::make_shared<IndexSource>();
      DataLoader loader(src, {workers, prefetch, 0});
      EXPECT_EQ(loader.num_slots(), workers == 0 ? 1 : workers * prefetch);
      for (int64_t i = 0; i < 40; ++i) {
        const Batch b = take(loader, *src);
        ASSERT_EQ(b.index, i);
        ASSERT_EQ(b.x.shape(), (Shape{2, 3}));
        ASSERT_EQ(b.x.dtype(), DType::kI32);
        EXPECT_EQ(b.x.to_vector<int32_t>(), std::vector<int32_t>(6, static_cast<int32_t>(i)));
        EXPECT_EQ(b.y.to_vector<int32_t>(), std::vector<int32_t>(6, static_cast<int32_t>(i + 1)));
        EXPECT_EQ(loader.state().next_index, i + 1);
      }
      // Never more batches filled ahead of the consumer than there are slots.
      EXPECT_LE(src->max_ahead.load(), loader.num_slots());
      EXPECT_LE(src->fills.load(), 40 + loader.num_slots());
    }
  }
}

TEST(DataLoader, SameBitsForAnyWorkerCount) {
  auto src = corpus_windows(1234);
  const auto sync = run(src, {0, 2, 0}, 40);
  for (int64_t i = 0; i < 40; ++i) ASSERT_EQ(sync[static_cast<size_t>(i)], direct(*src, i));
  EXPECT_EQ(run(src, {1, 2, 0}, 40), sync);
  EXPECT_EQ(run(src, {3, 2, 0}, 40), sync);
  EXPECT_EQ(run(src, {3, 1, 0}, 40), sync);
}

TEST(DataLoader, ReusesSlotBuffers) {
  auto src = corpus_windows(7);
  for (int workers : {0, 2}) {
    DataLoader loader(src, {workers, 2, 0});
    std::set<const void*> xs, ys;
    for (int i = 0; i < 50; ++i) {
      const Batch b = loader.next();
      xs.insert(b.x.raw_data());
      ys.insert(b.y.raw_data());
    }
    EXPECT_EQ(static_cast<int64_t>(xs.size()), loader.num_slots());
    EXPECT_EQ(static_cast<int64_t>(ys.size()), loader.num_slots());
  }
}

TEST(DataLoader, ResumesExactly) {
  auto src = corpus_windows(99);
  for (int workers : {0, 3}) {
    SCOPED_TRACE(fmt::format("workers {}", workers));
    const auto whole = run(src, {workers, 2, 0}, 30);
    DataLoader loader(src, {workers, 2, 0});
    for (int i = 0; i < 12; ++i) loader.next();
    const LoaderState saved = loader.state();
    EXPECT_EQ(saved.next_index, 12);
    for (int i = 0; i < 5; ++i) loader.next();  // prefetched and delivered work to discard
    loader.load_state(saved);
    EXPECT_EQ(loader.state().next_index, 12);
    for (size_t i = 12; i < 30; ++i) EXPECT_EQ(copy_of(loader.next()), whole[i]);
    // A fresh loader started at the saved position agrees too.
    const auto resumed = run(src, {workers, 2, 0}, 18, saved.next_index);
    EXPECT_TRUE(std::equal(resumed.begin(), resumed.end(), whole.begin() + 12));
  }
}

TEST(DataLoader, WorkerErrorNamesWorkerAndMessage) {
  auto src = std::make_shared<IndexSource>(/*throw_at=*/5);
  DataLoader loader(src, {3, 2, 0});
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(loader.next().index, i);
  for (int attempt = 0; attempt < 2; ++attempt) {  // the failure stays put; no hang
    try {
      loader.next();
      FAIL() << "expected the worker's error";
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("data worker 2"), std::string::npos) << msg;  // 5 % 3
      EXPECT_NE(msg.find("boom at batch 5"), std::string::npos) << msg;
    }
    EXPECT_EQ(loader.state().next_index, 5);
  }
  loader.load_state({6});  // skipping the bad batch restarts every worker
  EXPECT_EQ(loader.next().index, 6);
  EXPECT_EQ(loader.next().index, 7);

  // Without workers the source's own exception reaches the caller.
  DataLoader sync(std::make_shared<IndexSource>(0), {0, 2, 0});
  EXPECT_THROW(
      {
        try {
          sync.next();
        } catch (const std::runtime_error& e) {
          EXPECT_NE(std::string(e.what()).find("boom at batch 0"), std::string::npos);
          throw;
        }
      },
      std::runtime_error);
}

// Each destruction within 2 s (a generous bound for a sanitizer build on a busy machine; the
// slow case would take its 60 s delay if shutdown did not interrupt it).
TEST(DataLoader, DestroysPromptlyWhateverTheConsumerDid) {
  auto src = std::make_shared<IndexSource>();
  auto seconds_to_destroy = [](std::optional<DataLoader>& loader) {
    const auto t0 = Clock::now();
    loader.reset();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  constexpr double kBound = 2.0;
  {
    std::optional<DataLoader> never_started(std::in_place, src, LoaderOptions{4, 2, 0});
    EXPECT_LT(seconds_to_destroy(never_started), kBound);
  }
  {
    // Workers fill every slot, then wait for a free one.
    std::optional<DataLoader> blocked(std::in_place, src, LoaderOptions{4, 2, 0});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_LT(seconds_to_destroy(blocked), kBound);
  }
  {
    std::optional<DataLoader> mid_stream(std::in_place, src, LoaderOptions{2, 2, 0});
    for (int i = 0; i < 3; ++i) mid_stream->next();
    EXPECT_LT(seconds_to_destroy(mid_stream), kBound);
  }
  {
    // Workers sit in a long artificial delay; shutdown interrupts it.
    std::optional<DataLoader> slow(std::in_place, src, LoaderOptions{2, 1, 60000});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_LT(seconds_to_destroy(slow), kBound);
  }
}

TEST(DataLoader, RejectsBadOptions) {
  auto src = std::make_shared<IndexSource>();
  EXPECT_THROW(DataLoader(src, {-1, 2, 0}), std::invalid_argument);
  EXPECT_THROW(DataLoader(src, {1, 0, 0}), std::invalid_argument);
  EXPECT_THROW(DataLoader(src, {1, 2, -1}), std::invalid_argument);
  EXPECT_THROW(DataLoader(src, {1, 2, 0}, -3), std::invalid_argument);
  EXPECT_THROW(DataLoader(nullptr, {1, 2, 0}), std::invalid_argument);
}

TEST(DataLoader, DelayAppliesWithoutWorkers) {
  auto src = std::make_shared<IndexSource>();
  DataLoader loader(src, {0, 2, 20});
  const auto t0 = Clock::now();
  loader.next();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_GE(ms, 20.0);
  EXPECT_GE(loader.last_wait_ms(), 20.0);
}

TEST(DataLoader, PrefetchHidesASlowLoader) {
  // Two workers each need 20 ms a batch (10 ms a batch together); the consumer spends 30 ms on
  // each. After warm-up next() should find its batch ready: a loader without prefetch would
  // block >= 20 ms every time. The median and the 10 ms bound leave room for a busy machine.
  auto src = std::make_shared<IndexSource>();
  DataLoader loader(src, {2, 2, 20});
  std::vector<double> waits;
  for (int i = 0; i < 13; ++i) {
    loader.next();
    if (i >= 3) waits.push_back(loader.last_wait_ms());
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  std::nth_element(waits.begin(), waits.begin() + waits.size() / 2, waits.end());
  EXPECT_LT(waits[waits.size() / 2], 10.0);
}

// ---- batch sources ----

TEST(RandomWindows, WindowsInsideRangeAndTargetsShiftedByOne) {
  const auto file = token_file("iota4.bin", iota_tokens(5000), 4);  // token k has id k
  const int64_t begin = 100, end = 400, B = 8, T = 16;
  const RandomWindows src(file, begin, end, B, T, 42);
  std::vector<int32_t> x(B * T), y(B * T);
  int64_t lo = end, hi = -1;
  for (int64_t i = 0; i < 200; ++i) {
    src.fill(i, x.data(), y.data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t start = x[b * T];
      lo = std::min(lo, start);
      hi = std::max(hi, start);
      ASSERT_GE(start, begin);
      ASSERT_LE(start + T, end - 1);  // the last target is inside the range
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(x[b * T + t], start + t);
        ASSERT_EQ(y[b * T + t], start + t + 1);
      }
    }
  }
  // 1600 draws over 284 starts reach both ends of the range.
  EXPECT_LE(lo, begin + 10);
  EXPECT_GE(hi, end - T - 1 - 10);
}

TEST(RandomWindows, ShortRangeIsAnErrorNamingTheFile) {
  const auto file = token_file("short.bin", iota_tokens(1000), 2);
  try {
    RandomWindows(file, 100, 100 + 17, 2, 16, 1);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(file->path()), std::string::npos) << e.what();
  }
  // T + 2 tokens is the shortest range: two possible starts, both drawn.
  const RandomWindows tight(file, 100, 100 + 18, 2, 16, 1);
  std::vector<int32_t> x(32), y(32);
  std::set<int32_t> starts;
  for (int64_t i = 0; i < 20; ++i) {
    tight.fill(i, x.data(), y.data());
    starts.insert(x[0]);
    starts.insert(x[16]);
    EXPECT_LE(y[15], 117);
  }
  EXPECT_EQ(starts, (std::set<int32_t>{100, 101}));
  EXPECT_THROW(RandomWindows(file, 0, 1001, 2, 16, 1), std::out_of_range);
}

TEST(RandomWindows, RanksDifferAndEachRankIsReproducible) {
  const auto r0 = corpus_windows(5, 0, 2), r1 = corpus_windows(5, 1, 2);
  const auto r0_again = corpus_windows(5, 0, 2);
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(direct(*r0, i), direct(*r0_again, i));
    EXPECT_NE(direct(*r0, i).x, direct(*r1, i).x);
    EXPECT_NE(direct(*r0, i).x, direct(*r0, i + 1).x);
  }
  EXPECT_NE(direct(*corpus_windows(5), 0).x, direct(*corpus_windows(6), 0).x);  // seeds differ
}

TEST(SequentialWindows, CoversTheRangeInOrder) {
  const auto file = token_file("iota_seq.bin", iota_tokens(1000), 2);
  const int64_t begin = 10, end = 10 + 8 * 7 + 3, B = 3, T = 8;  // 7 whole windows
  const SequentialWindows one(file, begin, end, B, T);
  EXPECT_EQ(one.num_windows(), 7);
  std::vector<int32_t> x(B * T), y(B * T);
  for (int64_t i = 0; i < 6; ++i) {
    one.fill(i, x.data(), y.data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t start = begin + ((i * B + b) % 7) * T;
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(x[b * T + t], start + t);
        ASSERT_EQ(y[b * T + t], start + t + 1);
      }
    }
  }
  // Two ranks interleave the same sequence: rank r's batch i is global batch 2 * i + r.
  for (int rank : {0, 1}) {
    const SequentialWindows part(file, begin, end, B, T, rank, 2);
    for (int64_t i = 0; i < 4; ++i)
      EXPECT_EQ(direct(part, i),
                (Copy{i, direct(one, 2 * i + rank).x, direct(one, 2 * i + rank).y}));
  }
  EXPECT_THROW(SequentialWindows(file, 10, 10 + T, B, T), std::invalid_argument);
}

TEST(SyntheticTokens, InRangeAndReproduciblePerRank) {
  const SyntheticTokens a(50, 4, 8, 3), a_again(50, 4, 8, 3), other_rank(50, 4, 8, 3, 1, 2);
  for (int64_t i = 0; i < 4; ++i) {
    const Copy c = direct(a, i);
    EXPECT_EQ(c, direct(a_again, i));
    EXPECT_NE(c.x, c.y);
    EXPECT_NE(c.x, direct(other_rank, i).x);
    for (int32_t v : c.x) ASSERT_TRUE(v >= 0 && v < 50);
    for (int32_t v : c.y) ASSERT_TRUE(v >= 0 && v < 50);
  }
  // A batch larger than one draw chunk: same bits through the loader's workers.
  auto big = std::make_shared<const SyntheticTokens>(50257, 8, 10000, 11);
  EXPECT_EQ(run(big, {2, 1, 0}, 3), run(big, {0, 1, 0}, 3));
  EXPECT_THROW(SyntheticTokens(0, 4, 8, 3), std::invalid_argument);
}

}  // namespace
}  // namespace kuai::data
