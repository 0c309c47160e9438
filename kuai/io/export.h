// Weights-only export (technique 9, the export half): a GPT's parameters as one safetensors file
// under their GPT-2 names, for inference and sharing. Not a way to resume training: optimizer
// state, loss scale, RNG and loader position are not in it (see train/checkpoint.h for that).
//
// The file's __metadata__ (all values are strings, as the format requires):
//   "kuai.format"    "weights"
//   "kuai.version"   kKuaiVersion of the writer
//   "kuai.model"     {"vocab_size":..,"n_layer":..,"n_head":..,"d_model":..,"seq_len":..} (JSON)
//   "kuai.step"      the training step the weights are from (decimal)
//   "kuai.tokenizer" "byte", "gpt2", or "tokenizer.json": the file of that name beside the weights
//   "kuai.dtype"     "f32" | "bf16": how every tensor is stored
//   "kuai.checksums" {"<tensor name>": "xxh3:<16 hex>", ...} (JSON) of each tensor's stored bytes
// Loading is strict: every check that fails throws std::runtime_error naming the file.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "kuai/core/dtype.h"
#include "kuai/nn/gpt.h"

namespace kuai::io {

// The fp32 values of the parameters kept as low-precision working copies with their masters
// elsewhere (TensorImpl::master_elsewhere; train.offload_master): calls its argument with
// (parameter, first element, count, values), covering every element of every such parameter once
// (export_weights checks it, and casts each piece into the stored bytes as it comes).
using MasterValues =
    std::function<void(const Tensor& param, int64_t begin, int64_t count, const float* values)>;
using MasterReader = std::function<void(const MasterValues&)>;

struct ExportOptions {
  DType dtype = DType::kF32;  // kF32, or kBF16 (round to nearest even; half the bytes)
  int64_t step = 0;
  std::string tokenizer = "byte";
  MasterReader masters{};  // needed when a parameter's master is elsewhere
  // ZeRO-3: the values of the parameters whose bytes are released (sharded across the ranks),
  // every element of each once, as masters gives the working copies'.
  MasterReader sharded{};
};

// What an export held in memory besides the model: the stored bytes of the tensors being
// assembled at once (a whole parameter's while it is cast and written, the pieces of the ones a
// reader is still giving), at most.
struct ExportStats {
  int64_t max_held_bytes = 0;
};

// Writes `path` atomically (a good file is never replaced by a partial one), streaming: each
// tensor is written as soon as its bytes are complete, so a ZeRO-3 export (the units gathered one
// at a time) never holds the whole model.
ExportStats export_weights(const std::string& path, const nn::GPT& model,
                           const ExportOptions& options);

// What an export's metadata says about it.
struct WeightsInfo {
  nn::GPTConfig model;
  int64_t step = 0;
  std::string tokenizer;
  DType dtype = DType::kF32;
  std::string version;  // kuai version of the writer
};

// Reads and checks the metadata only (format, version present, model JSON fields, step,
// tokenizer, dtype); tensors and checksums are not examined.
WeightsInfo read_weights_info(const std::string& path);

// Loads an export into `model`: the file's model config must equal model.config(), every
// parameter must be present (and nothing else), with the declared dtype and the parameter's
// shape, and every tensor's checksum must match. bf16 is widened to the parameter's f32.
// Everything is checked before the first parameter is written, so a failed load leaves the
// model as it was.
void load_weights(const std::string& path, nn::GPT& model);

// An export's parameters one at a time, with load_weights' checks (each tensor's before it is
// given), widened to fp32: fn(name, value) for each, without building the model (its shapes come
// from a model on meta). Returns the file's metadata. What `kuai export --hf` streams from.
WeightsInfo read_weights_stream(
    const std::string& path,
    const std::function<void(const std::string& name, const Tensor& value)>& fn);

}  // namespace kuai::io
