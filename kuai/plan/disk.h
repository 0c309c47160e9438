// This machine's disk as offloaded optimizer state sees it (technique 8's offload): sequential
// read and write bandwidth through io/chunk_stream.h at the chunk size, measured by `kuai bench
// disk` and saved for `kuai plan`, which prices an offloaded update's I/O with it (as `kuai bench
// ddp` / `link` measure the link for the collectives).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace kuai::plan {

struct Disk {
  double read_gbs = 0;    // a read-only pass (GB/s, 1e9 bytes)
  double write_gbs = 0;   // a write-only pass
  double update_gbs = 0;  // a pass that reads and writes every chunk: bytes moved (both ways) / s
  // The same pass done one request at a time (pread, pread, pwrite, pwrite per chunk, O_DIRECT):
  // what the three-stage pipeline of io/chunk_stream.h is measured against (not saved).
  double serial_update_gbs = 0;
  int64_t chunk_bytes = 0;
  std::string dir;     // where it was measured
  std::string source;  // "measured by kuai bench disk (file)", "assumed"
  // Seconds to read `read` bytes and write `written` bytes in one streamed pass.
  double seconds(double read, double written) const;
};

struct DiskBenchOptions {
  std::string dir;                   // a folder on the disk to measure (files made there)
  int64_t bytes = int64_t{1} << 30;  // per file
  int64_t files = 2;                 // AdamW's two moments
  int64_t chunk_bytes = int64_t{64} << 20;
  int64_t rounds = 3;  // the median of each figure
};
Disk measure_disk(const DiskBenchOptions& o);

std::string disk_file();  // ${XDG_CACHE_HOME:-$HOME/.cache}/kuai/disk.json
std::optional<Disk> measured_disk();
void save_disk(const Disk& d);

}  // namespace kuai::plan
