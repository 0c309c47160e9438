// libFuzzer target for the safetensors reader: SafetensorsFile::parse on arbitrary bytes. Every
// input must either be rejected with a std::runtime_error that names the file, or be accepted
// with the invariants the reader promises: each entry's span lies inside the input, has
// prod(shape) * dtype size bytes (never at a null pointer), is found by name, and the spans tile
// the data section. Every data byte and metadata string is read so ASan sees any out-of-bounds
// view.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kuai/io/safetensors.h"

namespace {

constexpr char kName[] = "fuzz.safetensors";

[[noreturn]] void violated(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors: invariant violated: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(size);
  if (size > 0) std::memcpy(bytes.data(), data, size);
  try {
    const auto file = kuai::io::SafetensorsFile::parse(std::move(bytes), kName);
    uint64_t checksum = 0, covered = 0;
    for (const auto& entry : file.entries()) {
      if (file.find(entry.name) != &entry) violated("find() does not return the entry");
      const auto span = file.data(entry);
      if (span.size() != entry.end - entry.begin) violated("span size != end - begin");
      if (span.data() == nullptr) violated("null span");
      uint64_t expected = kuai::io::safetensors_dtype_size(entry.dtype);
      if (expected == 0) violated("accepted an unknown dtype");
      for (int64_t dim : entry.shape) {
        if (dim < 0) violated("accepted a negative dimension");
        expected *= static_cast<uint64_t>(dim);  // cannot overflow: the reader checked
      }
      if (expected != span.size()) violated("byte size != prod(shape) * dtype size");
      for (std::byte b : span) checksum += static_cast<uint8_t>(b);
      covered += span.size();
      if (entry.name.empty()) violated("accepted an empty name");
    }
    for (const auto& [key, value] : file.metadata()) {
      for (char c : key) checksum += static_cast<unsigned char>(c);
      for (char c : value) checksum += static_cast<unsigned char>(c);
    }
    // The spans tile the data section, which is the rest of the input after the header.
    uint64_t header_length = 0;
    std::memcpy(&header_length, data, sizeof header_length);
    if (covered != size - sizeof header_length - header_length) {
      violated("tensors do not cover the data section exactly");
    }
    if (checksum == 0x5eed) std::fputc(0, stderr);  // keep the reads observable
  } catch (const std::runtime_error& e) {
    if (std::string_view(e.what()).rfind(std::string(kName) + ": ", 0) != 0) {
      violated("error message does not start with the file name");
    }
  }
  return 0;
}
