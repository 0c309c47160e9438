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

// The device creation ops (zeros, full, arange, from_vector, a Generator's draws) use when the
// caller names none: kCPU, unless a DeviceGuard on this thread says otherwise. PyTorch's
// `with torch.device("meta"): model = GPT(cfg)`: a model built under DeviceGuard(kMeta) has its
// parameters there, and an optimizer built there its state.
Device default_device();
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  Device previous_;
};

}  // namespace kuai
