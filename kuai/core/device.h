// Where a tensor's bytes live: the CPU; a meta device, where tensors have shapes, dtypes and
// strides but no bytes (what `kuai plan` runs a real step on); CUDA once a backend for it exists.
// Each device type is served by one Backend (core/backend.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kuai {

enum class DeviceType : uint8_t { kCPU, kMeta, kCUDA };
inline constexpr size_t kDeviceTypes = 3;

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device&) const = default;
  std::string str() const {
    switch (type) {
      case DeviceType::kCPU:
        return "cpu";
      case DeviceType::kMeta:
        return "meta";
      case DeviceType::kCUDA:
        break;
    }
    return "cuda:" + std::to_string(index);
  }
};

inline constexpr Device kCPU{DeviceType::kCPU, 0};
inline constexpr Device kMeta{DeviceType::kMeta, 0};

}  // namespace kuai
