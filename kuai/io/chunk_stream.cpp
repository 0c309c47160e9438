// Chunked streaming of files through io_uring (see chunk_stream.h).
#include "kuai/io/chunk_stream.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <unistd.h>
#include <xxhash.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "kuai/core/allocator.h"

namespace kuai::io {
namespace {

constexpr int64_t kAlign = 4096;  // O_DIRECT: buffers, offsets and lengths in whole blocks

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

std::string errno_text(int e) { return std::strerror(e); }

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A request's identity in its completion: chunk, file, write or read, injected failure.
uint64_t encode(int64_t chunk, int64_t f, bool write, bool fail) {
  return (static_cast<uint64_t>(chunk) << 20) | (static_cast<uint64_t>(f) << 2) |
         (write ? 2u : 0u) | (fail ? 1u : 0u);
}

}  // namespace

struct ChunkStream::Ring {
  io_uring ring{};
  bool ok = false;
  // Requests in flight per buffer slot: [slot][0 read, 1 write].
  std::array<std::array<int64_t, 2>, 3> inflight{};
  std::string error;  // the first failure seen, reported once nothing is in flight
  ~Ring() {
    if (ok) io_uring_queue_exit(&ring);
  }
};

ChunkStream::ChunkStream(std::vector<std::string> paths, int64_t bytes,
                         const StreamOptions& options)
    : paths_(std::move(paths)), bytes_(bytes), direct_(options.direct) {
  if (bytes < 0) throw std::invalid_argument("chunk stream: negative size");
  // A file smaller than a chunk needs buffers of its size only.
  chunk_ = std::min(round_up(std::max<int64_t>(options.chunk_bytes, 1), kAlign),
                    std::max<int64_t>(round_up(bytes, kAlign), kAlign));
  chunks_ = (bytes_ + chunk_ - 1) / chunk_;
  io_bytes_ = round_up(bytes_, kAlign);
  try {
    open_files();
  } catch (...) {
    release();  // a constructor that throws runs no destructor
    throw;
  }
  hashes_.assign(paths_.size(), std::vector<uint64_t>(static_cast<size_t>(chunks_), 0));
  written_.assign(static_cast<size_t>(chunks_), false);
}

void ChunkStream::open_files() {
  ring_ = std::make_unique<Ring>();
  for (const std::string& p : paths_) {
    int fd = -1;
    const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (direct_) {
      fd = ::open(p.c_str(), flags | O_DIRECT, 0644);
      if (fd < 0 && errno == EINVAL) direct_ = false;  // a file system without O_DIRECT
    }
    if (fd < 0 && !direct_) fd = ::open(p.c_str(), flags, 0644);
    if (fd < 0) throw IoError(fmt::format("offload: {}: cannot create: {}", p, errno_text(errno)));
    fds_.push_back(fd);
    if (io_bytes_ > 0)
      if (const int e = ::posix_fallocate(fd, 0, io_bytes_); e != 0)
        throw IoError(
            fmt::format("offload: {}: cannot reserve {} bytes: {}", p, io_bytes_, errno_text(e)));
  }
  if (const int e = io_uring_queue_init(static_cast<unsigned>(8 * std::max<size_t>(1, fds_.size())),
                                        &ring_->ring, 0);
      e < 0)
    throw IoError(fmt::format("offload: io_uring_queue_init: {}", errno_text(-e)));
  ring_->ok = true;
  {
    const MemoryUseScope use(MemoryUse::kOptimizer);
    for (size_t i = 0; i < 3 * paths_.size(); ++i) {
      // The tracking allocator aligns to 64 bytes: take one block more and align up.
      auto* raw = static_cast<std::byte*>(Allocator::get().allocate(chunk_ + kAlign));
      raw_.push_back(raw);
      const auto addr = reinterpret_cast<uintptr_t>(raw);
      buffers_.push_back(
          reinterpret_cast<std::byte*>(round_up(static_cast<int64_t>(addr), kAlign)));
    }
  }
}

void ChunkStream::release() {
  for (std::byte* raw : raw_) Allocator::get().deallocate(raw, chunk_ + kAlign);
  raw_.clear();
  buffers_.clear();
  for (int fd : fds_) ::close(fd);
  fds_.clear();
  ring_.reset();
}

ChunkStream::~ChunkStream() { release(); }

int64_t ChunkStream::chunk_length(int64_t i) const { return std::min(chunk_, bytes_ - i * chunk_); }

int64_t ChunkStream::buffer_bytes() const { return 3 * files() * chunk_; }

void ChunkStream::inject_failure(bool on_write, int64_t nth, int error) {
  (on_write ? fail_write_ : fail_read_) = nth;
  fail_errno_ = error;
}

void ChunkStream::pass(const ChunkFn& fn, bool write) { run(fn, /*read=*/true, write); }

void ChunkStream::fill(const ChunkFn& fn) { run(fn, /*read=*/false, /*write=*/true); }

void ChunkStream::run(const ChunkFn& fn, bool read, bool write) {
  Ring& r = *ring_;
  const int64_t F = files();
  auto slot_bufs = [&](int64_t chunk) {
    return std::span<std::byte* const>(&buffers_[static_cast<size_t>((chunk % 3) * F)],
                                       static_cast<size_t>(F));
  };
  auto io_len = [&](int64_t chunk) { return round_up(chunk_length(chunk), kAlign); };

  // Takes one completion, checks it, and counts it off its slot.
  auto reap_one = [&]() {
    io_uring_cqe* cqe = nullptr;
    int e;
    do e = io_uring_wait_cqe(&r.ring, &cqe);
    while (e == -EINTR);
    if (e < 0) throw IoError(fmt::format("offload: io_uring_wait_cqe: {}", errno_text(-e)));
    const uint64_t ud = io_uring_cqe_get_data64(cqe);
    int res = cqe->res;
    io_uring_cqe_seen(&r.ring, cqe);
    const bool is_write = ud & 2u, fail = ud & 1u;
    const auto f = static_cast<int64_t>((ud >> 2) & ((1u << 18) - 1));
    const auto chunk = static_cast<int64_t>(ud >> 20);
    if (fail) res = -fail_errno_;
    r.inflight[static_cast<size_t>(chunk % 3)][is_write ? 1 : 0]--;
    const int64_t want = io_len(chunk), offset = chunk * chunk_;
    if (res != want && r.error.empty()) {
      r.error = fmt::format(
          "offload: {} of {} at byte {} ({} bytes) failed: {}", is_write ? "write" : "read",
          path(f), offset, want,
          res < 0 ? errno_text(-res)
                  : fmt::format("short {} of {} bytes", is_write ? "write" : "read", res));
    }
    (is_write ? stats_.bytes_written : stats_.bytes_read) += std::max(res, 0);
  };
  auto sqe = [&]() {
    io_uring_sqe* s = io_uring_get_sqe(&r.ring);
    while (s == nullptr) {  // the submission queue is full: let some complete
      io_uring_submit(&r.ring);
      reap_one();
      s = io_uring_get_sqe(&r.ring);
    }
    return s;
  };
  auto wait_slot = [&](int64_t chunk, int kind) {
    const auto t0 = Clock::now();
    while (r.inflight[static_cast<size_t>(chunk % 3)][static_cast<size_t>(kind)] > 0) reap_one();
    stats_.wait_ms += ms_since(t0);
  };
  auto drain = [&]() {
    for (auto& s : r.inflight)
      for (int64_t& n : s)
        while (n > 0) reap_one();
  };
  auto submit_read = [&](int64_t chunk) {
    std::span<std::byte* const> bufs = slot_bufs(chunk);
    for (int64_t f = 0; f < F; ++f) {
      if (!read || !written_[static_cast<size_t>(chunk)]) {
        std::memset(bufs[static_cast<size_t>(f)], 0, static_cast<size_t>(io_len(chunk)));
        continue;
      }
      const bool fail = fail_read_ == 0;
      if (fail_read_ >= 0) --fail_read_;
      io_uring_sqe* s = sqe();
      io_uring_prep_read(s, fds_[static_cast<size_t>(f)], bufs[static_cast<size_t>(f)],
                         static_cast<unsigned>(io_len(chunk)),
                         static_cast<uint64_t>(chunk * chunk_));
      io_uring_sqe_set_data64(s, encode(chunk, f, false, fail));
      r.inflight[static_cast<size_t>(chunk % 3)][0]++;
    }
    io_uring_submit(&r.ring);
  };
  auto check_read = [&](int64_t chunk) {
    if (!read || !written_[static_cast<size_t>(chunk)]) return;
    const auto t0 = Clock::now();
    std::span<std::byte* const> bufs = slot_bufs(chunk);
    for (int64_t f = 0; f < F; ++f)
      if (XXH3_64bits(bufs[static_cast<size_t>(f)], static_cast<size_t>(chunk_length(chunk))) !=
          hashes_[static_cast<size_t>(f)][static_cast<size_t>(chunk)])
        r.error = fmt::format(
            "offload: read of {} at byte {} ({} bytes): the checksum does not match what was "
            "written (the file changed under the run)",
            path(f), chunk * chunk_, chunk_length(chunk));
    stats_.hash_ms += ms_since(t0);
  };
  auto submit_write = [&](int64_t chunk) {
    std::span<std::byte* const> bufs = slot_bufs(chunk);
    const auto t0 = Clock::now();
    for (int64_t f = 0; f < F; ++f)
      hashes_[static_cast<size_t>(f)][static_cast<size_t>(chunk)] =
          XXH3_64bits(bufs[static_cast<size_t>(f)], static_cast<size_t>(chunk_length(chunk)));
    stats_.hash_ms += ms_since(t0);
    for (int64_t f = 0; f < F; ++f) {
      const bool fail = fail_write_ == 0;
      if (fail_write_ >= 0) --fail_write_;
      io_uring_sqe* s = sqe();
      io_uring_prep_write(s, fds_[static_cast<size_t>(f)], bufs[static_cast<size_t>(f)],
                          static_cast<unsigned>(io_len(chunk)),
                          static_cast<uint64_t>(chunk * chunk_));
      io_uring_sqe_set_data64(s, encode(chunk, f, true, fail));
      r.inflight[static_cast<size_t>(chunk % 3)][1]++;
    }
    io_uring_submit(&r.ring);
    written_[static_cast<size_t>(chunk)] = true;
  };
  auto fail_if_error = [&]() {
    if (r.error.empty()) return;
    drain();
    std::string e = std::move(r.error);
    r.error.clear();
    throw IoError(e);
  };

  try {
    if (chunks_ > 0) submit_read(0);
    for (int64_t i = 0; i < chunks_; ++i) {
      if (i + 1 < chunks_) {
        wait_slot(i + 1, 1);  // the write of chunk i - 2 left the slot chunk i + 1 reads into
        fail_if_error();
        submit_read(i + 1);
      }
      wait_slot(i, 0);
      fail_if_error();
      check_read(i);
      fail_if_error();
      const auto t0 = Clock::now();
      fn(i, slot_bufs(i));
      stats_.busy_ms += ms_since(t0);
      if (write) submit_write(i);
    }
    const auto t0 = Clock::now();
    drain();
    stats_.wait_ms += ms_since(t0);
    fail_if_error();
  } catch (...) {
    drain();  // nothing may be left writing into (or reading from) the buffers
    r.error.clear();
    throw;
  }
}

}  // namespace kuai::io
