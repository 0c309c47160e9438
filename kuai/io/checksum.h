// Checksums for files kuai writes: xxh3-64 (libxxhash) over raw bytes, and its text form
// ("xxh3:" + 16 lowercase hex digits) as stored in safetensors metadata and checkpoint manifests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kuai::io {

uint64_t xxh3_64(const void* data, size_t n);
std::string xxh3_hex(uint64_t h);  // "xxh3:0123456789abcdef"
std::string xxh3_hex(const void* data, size_t n);

// The size and xxh3-64 of a whole file, read in blocks (a file larger than memory is fine).
// Throws std::runtime_error naming the file when it cannot be opened or read.
struct FileDigest {
  uint64_t bytes = 0, xxh3 = 0;
};
FileDigest file_xxh3(const std::string& path);

}  // namespace kuai::io
