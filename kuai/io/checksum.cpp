// xxh3 checksums (see checksum.h).
#include "kuai/io/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

namespace kuai::io {

uint64_t xxh3_64(const void* data, size_t n) { return XXH3_64bits(data, n); }

std::string xxh3_hex(uint64_t h) { return fmt::format("xxh3:{:016x}", h); }

std::string xxh3_hex(const void* data, size_t n) { return xxh3_hex(xxh3_64(data, n)); }

}  // namespace kuai::io
