// A memory-mapped token file: a 24-byte header (magic "KUAITOKS", u32 version = 1, u32 bytes
// per token = 1, 2 or 4, u64 token count, all little-endian) followed by the tokens. Opening
// checks every header field against the file size and names the file and the check on failure.
#pragma once

#include <cstdint>
#include <string>

#include "kuai/core/rng.h"

namespace kuai::data {

inline constexpr char kTokenMagic[8] = {'K', 'U', 'A', 'I', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kTokenVersion = 1;
inline constexpr int64_t kTokenHeaderBytes = 24;

class TokenFile {
 public:
  static TokenFile open(const std::string& path);
  TokenFile(TokenFile&& o) noexcept;
  TokenFile& operator=(TokenFile&&) = delete;
  TokenFile(const TokenFile&) = delete;
  ~TokenFile();

  int64_t size() const { return count_; }
  int token_bytes() const { return token_bytes_; }
  int32_t operator[](int64_t i) const;
  // Largest token id + 1 (scans the file once, on first call).
  int64_t vocab_bound() const;
  // Copy tokens [start, start + n) into out.
  void read(int64_t start, int64_t n, int32_t* out) const;
  const std::string& path() const { return path_; }

 private:
  TokenFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  int64_t count_ = 0;
  int token_bytes_ = 1;
  mutable int64_t vocab_bound_ = -1;
};

// Writes a token file (used by `kuai prepare` and the tests).
void write_token_file(const std::string& path, const int32_t* tokens, int64_t n, int token_bytes);

}  // namespace kuai::data
