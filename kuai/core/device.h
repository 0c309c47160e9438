// Where a tensor's bytes live. kuai runs on the CPU; the CUDA backend plugs in behind kCUDA.
#pragma once

#include <cstdint>
#include <string>

namespace kuai {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device&) const = default;
  std::string str() const {
    return type == DeviceType::kCPU ? "cpu" : "cuda:" + std::to_string(index);
  }
};

inline constexpr Device kCPU{DeviceType::kCPU, 0};

}  // namespace kuai
