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

}  // namespace kuai::io
