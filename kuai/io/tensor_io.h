// Tensors to and from safetensors files: the bridge between kuai::Tensor and the format-level
// reader/writer in safetensors.h.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kuai/core/tensor.h"
#include "kuai/io/safetensors.h"

namespace kuai::io {

std::string safetensors_dtype(DType t);  // "F32", "BF16", ...
DType dtype_from_safetensors(const std::string& path, const std::string& name,
                             const std::string& dtype);

// Every tensor of the file, copied into CPU tensors.
std::map<std::string, Tensor> load_safetensors(const std::string& path);
// One tensor of an open file (throws naming the file if absent).
Tensor read_tensor(const SafetensorsFile& file, const std::string& name);

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kuai::io
