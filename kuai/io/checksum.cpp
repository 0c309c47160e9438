// xxh3 checksums (see checksum.h).
#include "kuai/io/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

namespace kuai::io {

uint64_t xxh3_64(const void* data, size_t n) { return XXH3_64bits(data, n); }

std::string xxh3_hex(uint64_t h) { return fmt::format("xxh3:{:016x}", h); }

std::string xxh3_hex(const void* data, size_t n) { return xxh3_hex(xxh3_64(data, n)); }

FileDigest file_xxh3(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> st(XXH3_createState(),
                                                                     &XXH3_freeState);
  XXH3_64bits_reset(st.get());
  std::vector<char> block(size_t{8} << 20);
  FileDigest d;
  for (;;) {
    const size_t n = std::fread(block.data(), 1, block.size(), f.get());
    XXH3_64bits_update(st.get(), block.data(), n);
    d.bytes += n;
    if (n < block.size()) {
      if (std::ferror(f.get()))
        throw std::runtime_error(fmt::format("{}: read failed after {} bytes", path, d.bytes));
      break;
    }
  }
  d.xxh3 = XXH3_64bits_digest(st.get());
  return d;
}

}  // namespace kuai::io
