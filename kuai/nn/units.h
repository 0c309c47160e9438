// A model's sharding units (ZeRO-3, after FSDP's wrapped modules): the pieces whose parameters
// are gathered whole together, and the hooks a model calls around each unit's forward. A GPT's
// units are its embedding, each decoder block, and its head (the final norm, and the output
// projection when it is not tied); the head of a tied model also reads the embedding unit's
// token embedding, which it names in `uses`.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::nn {

struct ModelUnit {
  std::string name;            // "embed", "h.0", ..., "head"
  std::vector<Tensor> params;  // its own parameters, each in exactly one unit
  std::vector<size_t> uses;    // other units whose parameters its forward reads (tied weights)
};

// Called by a model around the forward of each unit, in forward order (FSDP's pre- and
// post-forward hooks). after() runs also when the unit's forward throws.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before(size_t unit) = 0;
  virtual void after(size_t unit) = 0;
};

// RAII around one unit's forward; no hooks: nothing.
class UnitScope {
 public:
  UnitScope(UnitHooks* hooks, size_t unit) : hooks_(hooks), unit_(unit) {
    if (hooks_) hooks_->before(unit_);
  }
  ~UnitScope() {
    if (hooks_) hooks_->after(unit_);
  }
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

 private:
  UnitHooks* hooks_;
  size_t unit_;
};

}  // namespace kuai::nn
