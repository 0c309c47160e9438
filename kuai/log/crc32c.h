// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord framing uses for
// TensorBoard event files. crc32c() picks the SSE4.2 crc32 instruction when the CPU has it and a
// portable slicing-by-8 table otherwise; both paths are exposed so the tests can check they agree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kuai::log {

inline constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
inline constexpr uint32_t kCrc32cMaskDelta = 0xa282ead8u;

// CRC32C of data[0, n). `crc` is the CRC of the bytes before these (0 for none), so
// crc32c(b, nb, crc32c(a, na)) == crc32c(a followed by b).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// TFRecord masking of a CRC: rotate right by 15, then add kCrc32cMaskDelta.
inline constexpr uint32_t mask_crc32c(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + kCrc32cMaskDelta;
}
uint32_t masked_crc32c(const void* data, size_t n);

// The two implementations behind crc32c(), same contract. crc32c_sse42() falls back to the
// table where crc32c_has_sse42() is false (a non-x86 build, an old CPU, or the tier capped at
// baseline by KUAI_MAX_ISA: kuai/backend/cpu/isa.h).
uint32_t crc32c_table(const void* data, size_t n, uint32_t crc = 0);
uint32_t crc32c_sse42(const void* data, size_t n, uint32_t crc = 0);
bool crc32c_has_sse42();

}  // namespace kuai::log
