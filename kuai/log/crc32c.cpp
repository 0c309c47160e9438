// CRC32C: a slicing-by-8 table (portable reference) and the SSE4.2 crc32 instruction, chosen at
// run time (see crc32c.h).
#include "kuai/log/crc32c.h"

#include "kuai/backend/cpu/isa.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define KUAI_CRC32C_X86 1
#endif

namespace kuai::log {
namespace {

using Tables = std::array<std::array<uint32_t, 256>, 8>;

// tables[0][b] is the CRC of byte b; tables[k][b] is the CRC of b followed by k zero bytes.
constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ (kCrc32cPoly & (0u - (c & 1u)));
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
  return t;
}

constexpr Tables kTables = make_tables();

inline uint32_t load_le32(const unsigned char* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

#if KUAI_CRC32C_X86
__attribute__((target("sse4.2"))) uint32_t sse42_update(uint32_t state, const unsigned char* p,
                                                        size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    state = _mm_crc32_u8(state, *p++);
    --n;
  }
#if defined(__x86_64__)
  uint64_t s64 = state;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    s64 = _mm_crc32_u64(s64, v);
  }
  state = static_cast<uint32_t>(s64);
#endif
  for (; n >= 4; n -= 4, p += 4) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    state = _mm_crc32_u32(state, v);
  }
  while (n-- > 0) state = _mm_crc32_u8(state, *p++);
  return state;
}
#endif

}  // namespace

uint32_t crc32c_table(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto& t = kTables;
  uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = c ^ load_le32(p);
    const uint32_t hi = load_le32(p + 4);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

// SSE4.2 is above the baseline tier (x86-64 with SSE2): KUAI_MAX_ISA=baseline runs the table.
bool crc32c_has_sse42() {
#if KUAI_CRC32C_X86
  static const bool has = __builtin_cpu_supports("sse4.2") && cpu::isa() > cpu::Isa::kBaseline;
  return has;
#else
  return false;
#endif
}

uint32_t crc32c_sse42(const void* data, size_t n, uint32_t crc) {
#if KUAI_CRC32C_X86
  if (crc32c_has_sse42()) return ~sse42_update(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return crc32c_table(data, n, crc);
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  return crc32c_has_sse42() ? crc32c_sse42(data, n, crc) : crc32c_table(data, n, crc);
}

uint32_t masked_crc32c(const void* data, size_t n) { return mask_crc32c(crc32c(data, n)); }

}  // namespace kuai::log
