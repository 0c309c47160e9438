// Token file reading (mmap) and writing (see token_file.h).
#include "kuai/data/token_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <stdexcept>

namespace kuai::data {

TokenFile TokenFile::open(const std::string& path) {
  TokenFile f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    throw std::runtime_error(
        fmt::format("{}: cannot open token file: {}", path, std::strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    throw std::runtime_error(fmt::format("{}: cannot stat: {}", path, std::strerror(errno)));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes < static_cast<size_t>(kTokenHeaderBytes)) {
    ::close(fd);
    throw std::runtime_error(
        fmt::format("{}: truncated: {} bytes, shorter than the 24-byte header", path, bytes));
  }
  void* m = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED)
    throw std::runtime_error(fmt::format("{}: mmap failed: {}", path, std::strerror(errno)));
  f.map_ = m;
  f.map_bytes_ = bytes;
  const unsigned char* p = static_cast<const unsigned char*>(m);
  if (std::memcmp(p, kTokenMagic, 8) != 0)
    throw std::runtime_error(fmt::format("{}: bad magic (not a kuai token file)", path));
  uint32_t version = 0, token_bytes = 0;
  uint64_t count = 0;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&token_bytes, p + 12, 4);
  std::memcpy(&count, p + 16, 8);
  if (version != kTokenVersion)
    throw std::runtime_error(
        fmt::format("{}: unsupported version {} (expected {})", path, version, kTokenVersion));
  if (token_bytes != 1 && token_bytes != 2 && token_bytes != 4)
    throw std::runtime_error(
        fmt::format("{}: bytes per token {} is not 1, 2 or 4", path, token_bytes));
  const size_t payload = bytes - static_cast<size_t>(kTokenHeaderBytes);
  if (count > payload / token_bytes || count * token_bytes != payload)
    throw std::runtime_error(
        fmt::format("{}: header says {} tokens of {} bytes but {} bytes follow", path, count,
                    token_bytes, payload));
  f.tokens_ = p + kTokenHeaderBytes;
  f.count_ = static_cast<int64_t>(count);
  f.token_bytes_ = static_cast<int>(token_bytes);
  return f;
}

TokenFile::TokenFile(TokenFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(o.map_),
      map_bytes_(o.map_bytes_),
      tokens_(o.tokens_),
      count_(o.count_),
      token_bytes_(o.token_bytes_),
      vocab_bound_(o.vocab_bound_) {
  o.map_ = nullptr;
}

TokenFile::~TokenFile() {
  if (map_) munmap(map_, map_bytes_);
}

int32_t TokenFile::operator[](int64_t i) const {
  switch (token_bytes_) {
    case 1:
      return tokens_[i];
    case 2: {
      uint16_t v;
      std::memcpy(&v, tokens_ + 2 * i, 2);
      return v;
    }
    default: {
      int32_t v;
      std::memcpy(&v, tokens_ + 4 * i, 4);
      return v;
    }
  }
}

void TokenFile::read(int64_t start, int64_t n, int32_t* out) const {
  if (start < 0 || n < 0 || start + n > count_)
    throw std::out_of_range(
        fmt::format("{}: read [{}, {}) outside {} tokens", path_, start, start + n, count_));
  if (token_bytes_ == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = tokens_[start + i];
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = (*this)[start + i];
}

int64_t TokenFile::vocab_bound() const {
  if (vocab_bound_ < 0) {
    int32_t mx = -1;
    for (int64_t i = 0; i < count_; ++i) mx = std::max(mx, (*this)[i]);
    vocab_bound_ = static_cast<int64_t>(mx) + 1;
  }
  return vocab_bound_;
}

void write_token_file(const std::string& path, const int32_t* tokens, int64_t n, int token_bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error(fmt::format("{}: cannot write", tmp));
    const uint32_t version = kTokenVersion, tb = static_cast<uint32_t>(token_bytes);
    const uint64_t count = static_cast<uint64_t>(n);
    out.write(kTokenMagic, 8);
    out.write(reinterpret_cast<const char*>(&version), 4);
    out.write(reinterpret_cast<const char*>(&tb), 4);
    out.write(reinterpret_cast<const char*>(&count), 8);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t v = static_cast<uint32_t>(tokens[i]);
      out.write(reinterpret_cast<const char*>(&v), token_bytes);  // little-endian host
    }
    if (!out) throw std::runtime_error(fmt::format("{}: write failed", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error(fmt::format("{}: rename failed: {}", path, std::strerror(errno)));
}

}  // namespace kuai::data
