// ChunkStream (kuai/io/chunk_stream.h): files streamed through three buffers per file with
// io_uring. What is written is read back in later passes (never-written chunks as zeros), a file
// changed or cut under the stream is caught by name, an injected read or write error and a disk
// without room end in one IoError naming the file and the operation, and nothing is left in
// flight.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/io/chunk_stream.h"

namespace kuai::io {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  TempDir()
      : path(fs::temp_directory_path() / ("kuai_chunk_stream_" + std::to_string(::getpid()))) {
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
  fs::path path;
};

// Element e of file f after pass p: a value that changes with all three.
uint32_t value(int f, int64_t e, int p) {
  return static_cast<uint32_t>(e * 2654435761u) ^ static_cast<uint32_t>(f * 40503 + p * 977);
}

TEST(ChunkStream, PassesReadBackWhatTheLastOneWrote) {
  TempDir d;
  const int64_t n = 10'001;  // elements per file: 40004 bytes, chunks of 8192 (the last short)
  StreamOptions o;
  o.chunk_bytes = 8000;  // rounded up to 8192
  ChunkStream s({d.file("a"), d.file("b")}, n * 4, o);
  EXPECT_EQ(s.chunk_bytes(), 8192);
  EXPECT_EQ(s.chunks(), 5);
  EXPECT_EQ(s.chunk_length(4), n * 4 - 4 * 8192);
  EXPECT_EQ(s.buffer_bytes(), 3 * 2 * 8192);
  for (int pass = 0; pass < 3; ++pass) {
    int64_t seen = 0;
    s.pass([&](int64_t chunk, std::span<std::byte* const> bufs) {
      const int64_t first = chunk * 8192 / 4, count = s.chunk_length(chunk) / 4;
      for (int f = 0; f < 2; ++f) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(bufs[f]) % 4096, 0u);
        auto* v = reinterpret_cast<uint32_t*>(bufs[f]);
        for (int64_t e = 0; e < count; ++e) {
          const uint32_t want = pass == 0 ? 0u : value(f, first + e, pass - 1);
          if (v[e] != want) {
            ADD_FAILURE() << "pass " << pass << " file " << f << " element " << first + e;
            return;
          }
          v[e] = value(f, first + e, pass);
        }
      }
      seen += count;
    });
    EXPECT_EQ(seen, n);
  }
  // A read-only pass leaves the files as they were; a fill pass writes without reading.
  s.pass([](int64_t, std::span<std::byte* const> bufs) { std::memset(bufs[0], 0xff, 16); },
         /*write=*/false);
  s.pass(
      [&](int64_t chunk, std::span<std::byte* const> bufs) {
        EXPECT_EQ(reinterpret_cast<uint32_t*>(bufs[0])[0], value(0, chunk * 2048, 2));
      },
      false);
  s.fill([](int64_t chunk, std::span<std::byte* const> bufs) {
    EXPECT_EQ(reinterpret_cast<uint32_t*>(bufs[1])[0], 0u);  // zeroed, not read
    reinterpret_cast<uint32_t*>(bufs[1])[0] = static_cast<uint32_t>(chunk + 7);
  });
  s.pass(
      [](int64_t chunk, std::span<std::byte* const> bufs) {
        EXPECT_EQ(reinterpret_cast<uint32_t*>(bufs[1])[0], static_cast<uint32_t>(chunk + 7));
      },
      false);
  EXPECT_GT(s.stats().bytes_read, 0);
  EXPECT_GT(s.stats().bytes_written, 0);
}

TEST(ChunkStream, TheBuffersAreTheTrackedMemory) {
  TempDir d;
  // Fresh blocks: a block cached by an earlier test in this process may serve a buffer at up to
  // 1.25x its size, and `current` counts the capacity (the suite run as one process saw +25 KB).
  Allocator::get().empty_cache();
  const int64_t before = Allocator::get().stats().current;
  {
    StreamOptions o;
    o.chunk_bytes = 1 << 16;
    ChunkStream s({d.file("a"), d.file("b"), d.file("c")}, 1 << 20, o);
    EXPECT_GE(Allocator::get().stats().current - before, s.buffer_bytes());
    EXPECT_LE(Allocator::get().stats().current - before, s.buffer_bytes() + 9 * 2 * 4096);
  }
  EXPECT_EQ(Allocator::get().stats().current, before);
}

void write_all(ChunkStream& s, int p) {
  s.pass([&](int64_t, std::span<std::byte* const> bufs) {
    for (std::byte* b : bufs) std::memset(b, p, 4096);
  });
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

TEST(ChunkStream, AFileChangedOrCutUnderTheStreamIsNamed) {
  TempDir d;
  StreamOptions o;
  o.chunk_bytes = 4096;
  ChunkStream s({d.file("m"), d.file("v")}, 4 * 4096, o);
  write_all(s, 1);
  {
    const int fd = ::open(d.file("v").c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char junk[8] = "changed";
    ASSERT_EQ(::pwrite(fd, junk, sizeof junk, 2 * 4096 + 100), 8);
    ::close(fd);
  }
  std::string e = error_of([&] { s.pass([](int64_t, std::span<std::byte* const>) {}); });
  EXPECT_NE(e.find("read of " + d.file("v") + " at byte 8192"), std::string::npos) << e;
  EXPECT_NE(e.find("changed under the run"), std::string::npos) << e;
  s.fill([](int64_t, std::span<std::byte* const>) {});  // every chunk written anew
  ASSERT_EQ(::truncate(d.file("m").c_str(), 4096), 0);
  e = error_of([&] { s.pass([](int64_t, std::span<std::byte* const>) {}); });
  EXPECT_NE(e.find("read of " + d.file("m") + " at byte 4096 (4096 bytes) failed: short read of 0"),
            std::string::npos)
      << e;
}

TEST(ChunkStream, AnInjectedReadOrWriteErrorEndsThePassByName) {
  TempDir d;
  StreamOptions o;
  o.chunk_bytes = 4096;
  ChunkStream s({d.file("m"), d.file("v")}, 6 * 4096, o);
  s.inject_failure(/*on_write=*/true, 5, EIO);  // chunk 2 of v
  int64_t calls = 0;
  std::string e = error_of([&] { s.pass([&](int64_t, std::span<std::byte* const>) { ++calls; }); });
  EXPECT_EQ(e, "offload: write of " + d.file("v") +
                   " at byte 8192 (4096 bytes) failed: " + std::strerror(EIO));
  EXPECT_LT(calls, 6);  // stopped early
  write_all(s, 3);
  s.inject_failure(/*on_write=*/false, 0, EIO);
  e = error_of([&] { s.pass([](int64_t, std::span<std::byte* const>) {}); });
  EXPECT_EQ(e, "offload: read of " + d.file("m") +
                   " at byte 0 (4096 bytes) failed: " + std::strerror(EIO));
}

TEST(ChunkStream, ADiskWithoutRoomFailsAtCreationByName) {
  const fs::path mnt = fs::temp_directory_path() / ("kuai_small_fs_" + std::to_string(::getpid()));
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1m") != 0) {
    fs::remove(mnt);
    GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  }
  const std::string f = (mnt / "exp_avg").string();
  const std::string e = error_of([&] { ChunkStream s({f}, 4 << 20); });
  EXPECT_EQ(e, "offload: " + f + ": cannot reserve 4194304 bytes: " + std::strerror(ENOSPC));
  ::umount(mnt.c_str());
  fs::remove(mnt);
}

}  // namespace
}  // namespace kuai::io
