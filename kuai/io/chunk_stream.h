// Files streamed through memory in chunks: what optimizer state offloaded to disk needs
// (technique 8's offload). One io_uring per stream (Debian's liburing), O_DIRECT with 4096-aligned
// buffers, so the page cache holds nothing of the files and what is resident is the chunk buffers.
// A pass is a three-stage pipeline: chunk i+1 is read while chunk i is handed to the caller and
// chunk i-1 is written, three buffers per file in all.
//
// Every chunk written carries an xxh3 checksum kept in memory and checked when the chunk is read
// back, so a file changed under the run (truncated, overwritten, corrupted) is caught on its next
// read. A chunk never written reads as zeros without touching the disk (new optimizer moments).
// Every failure (no space to reserve the files, a failed or short read or write, a checksum that
// does not match) throws IoError with one line naming the file, the operation and the bytes, after
// the stream has waited for every request it had in flight: nothing is left pending, nothing hangs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace kuai::io {

class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct StreamOptions {
  int64_t chunk_bytes = int64_t{64} << 20;  // per file; rounded up to a multiple of 4096
  // O_DIRECT. A file system that refuses it (EINVAL at open) is used through the page cache, and
  // ChunkStream::direct() says so.
  bool direct = true;
};

// What a stream did (its passes so far).
struct StreamStats {
  int64_t bytes_read = 0, bytes_written = 0;
  double wait_ms = 0;  // time the caller's thread waited for the disk
  double busy_ms = 0;  // time spent in the callbacks (the update itself)
  double hash_ms = 0;  // checksums of what was read and written
};

class ChunkStream {
 public:
  // Creates (or truncates) each of `paths` with room for `bytes`, reserved now (posix_fallocate):
  // a disk without the room fails here, naming the file.
  ChunkStream(std::vector<std::string> paths, int64_t bytes, const StreamOptions& options = {});
  ~ChunkStream();
  ChunkStream(const ChunkStream&) = delete;
  ChunkStream& operator=(const ChunkStream&) = delete;

  int64_t bytes() const { return bytes_; }  // per file
  int64_t chunks() const { return chunks_; }
  int64_t chunk_bytes() const { return chunk_; }
  int64_t chunk_length(int64_t i) const;  // bytes of chunk i: chunk_bytes(), the last one less
  int64_t files() const { return static_cast<int64_t>(paths_.size()); }
  const std::string& path(int64_t f) const { return paths_[static_cast<size_t>(f)]; }
  bool direct() const { return direct_; }
  // The chunk buffers: three per file, what a stream keeps resident.
  int64_t buffer_bytes() const;

  // bufs[f] holds chunk i of file f (chunk_length(i) bytes, 4096-aligned).
  using ChunkFn = std::function<void(int64_t chunk, std::span<std::byte* const> bufs)>;
  // One pass over every chunk in order: each is read (or zero if never written), given to fn,
  // and written back when `write` (else left as it was: a read-only pass, a checkpoint's copy).
  void pass(const ChunkFn& fn, bool write = true);
  // A write-only pass: fn fills each chunk (zeroed first), which is written (a restore).
  void fill(const ChunkFn& fn);

  const StreamStats& stats() const { return stats_; }

  // Fault injection for tests: the n-th (0-based) write or read request from now fails with
  // `error` (an errno) as if the kernel had returned it.
  void inject_failure(bool on_write, int64_t nth, int error);

 private:
  struct Ring;
  void open_files();  // the files, their room, the ring and the buffers
  void release();
  void run(const ChunkFn& fn, bool read, bool write);

  std::vector<std::string> paths_;
  std::vector<int> fds_;
  int64_t bytes_ = 0, chunk_ = 0, chunks_ = 0, io_bytes_ = 0;
  bool direct_ = true;
  std::unique_ptr<Ring> ring_;
  std::vector<std::byte*> raw_;                // from the tracking allocator (optimizer memory)
  std::vector<std::byte*> buffers_;            // 3 per file, slot-major: [slot * files + f]
  std::vector<std::vector<uint64_t>> hashes_;  // per file, per chunk
  std::vector<bool> written_;                  // per chunk
  StreamStats stats_;
  int64_t fail_write_ = -1, fail_read_ = -1;
  int fail_errno_ = 0;
};

}  // namespace kuai::io
