// Tensor <-> safetensors (see tensor_io.h).
#include "kuai/io/tensor_io.h"

#include <fmt/format.h>

#include <cstring>
#include <stdexcept>

namespace kuai::io {

std::string safetensors_dtype(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

DType dtype_from_safetensors(const std::string& path, const std::string& name,
                             const std::string& dtype) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64, DType::kU8})
    if (safetensors_dtype(t) == dtype) return t;
  throw std::runtime_error(
      fmt::format("{}: tensor \"{}\" has dtype {} which kuai does not load", path, name, dtype));
}

Tensor read_tensor(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsEntry* e = file.find(name);
  if (e == nullptr)
    throw std::runtime_error(fmt::format("{}: no tensor named \"{}\"", file.path(), name));
  Tensor t = Tensor::empty(e->shape, dtype_from_safetensors(file.path(), name, e->dtype));
  const auto bytes = file.data(*e);
  if (static_cast<int64_t>(bytes.size()) != t.nbytes())
    throw std::runtime_error(fmt::format("{}: tensor \"{}\" has {} bytes, expected {}", file.path(),
                                         name, bytes.size(), t.nbytes()));
  if (!bytes.empty()) t.copy_from_host(bytes.data(), bytes.size());
  return t;
}

std::map<std::string, Tensor> load_safetensors(const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::map<std::string, Tensor> out;
  for (const SafetensorsEntry& e : file.entries()) out.emplace(e.name, read_tensor(file, e.name));
  return out;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> keep;  // contiguous copies live until the write is done
  std::vector<SafetensorsView> views;
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.to(kCPU).contiguous());  // host bytes for the writer
    const Tensor& c = keep.back();
    views.push_back({name, safetensors_dtype(c.dtype()), c.shape(), c.raw_data(),
                     static_cast<uint64_t>(c.nbytes())});
  }
  write_safetensors(path, views, metadata);
}

}  // namespace kuai::io
