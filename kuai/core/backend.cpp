// The backend registry (see backend.h): one slot per device type, filled before main by the
// backends' registrars and only read afterwards.
#include "kuai/core/backend.h"

#include <array>
#include <stdexcept>

namespace kuai {
namespace {

std::array<Backend*, kDeviceTypes>& slots() {
  static std::array<Backend*, kDeviceTypes> s{};
  return s;
}

}  // namespace

void register_backend(DeviceType type, Backend* backend) {
  slots()[static_cast<size_t>(type)] = backend;
}

Backend& backend_for(Device device) {
  Backend* b = slots()[static_cast<size_t>(device.type)];
  if (b == nullptr)
    throw std::runtime_error("device " + device.str() + " has no backend in this build");
  return *b;
}

bool backend_available(DeviceType type) { return slots()[static_cast<size_t>(type)] != nullptr; }

AttentionKernel default_attention_kernel(const AttentionShape& s) {
  return s.seq >= kFlashDefaultMinT ? AttentionKernel::kFlash : AttentionKernel::kNaive;
}

namespace {
thread_local Device t_default_device = kCPU;
}  // namespace

Device default_device() { return t_default_device; }
DeviceGuard::DeviceGuard(Device device) : previous_(t_default_device) { t_default_device = device; }
DeviceGuard::~DeviceGuard() { t_default_device = previous_; }

}  // namespace kuai
