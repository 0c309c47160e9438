// kuai::optimize(model): the automatic replacement of a model's attention by FlashAttention. It
// walks the module tree and switches every attention module that can run the flash kernel
// (nn::AttentionModule: GPT-2's and LLaMA's) to it, or to "auto" (flash from a measured sequence
// length on), and returns what it replaced. Parameters are untouched, so state dicts, checkpoints
// and optimizer state are the same before and after; the results are the same up to fp32 rounding
// (flash is exact attention, summed in a different order). The trainer applies it for
// `model.attention = "flash" | "auto"`.
#pragma once

#include <string>
#include <vector>

#include "kuai/nn/gpt.h"
#include "kuai/nn/module.h"

namespace kuai {

struct Replaced {
  std::string module;  // dotted name in the tree ("h.0.attn")
  std::string from;    // "naive"
  std::string to;      // "flash" | "auto"
};

// `to` is kFlash or kAuto (kNaive undoes it). Modules already running `to` are left out of the
// returned list.
std::vector<Replaced> optimize(nn::Module& model, nn::AttentionImpl to = nn::AttentionImpl::kFlash);

}  // namespace kuai
