// Safetensors reader (mmap + full validation of the header) and atomic writer.
//
// The reader trusts nothing in the file: sizes are checked before every read, the JSON header
// is parsed with duplicate keys rejected, every entry's dtype, shape, offsets and byte size are
// checked (shape products with overflow detection), and entries may not overlap.
#include "kuai/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace kuai::io {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr uint64_t kHeaderLengthBytes = 8;
constexpr uint64_t kHeaderAlignment = 8;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

std::string errno_text() { return std::strerror(errno); }

// prod(shape) * element_size, or false on overflow.
bool checked_byte_size(const std::vector<int64_t>& shape, uint64_t element_size, uint64_t* out) {
  uint64_t total = element_size;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(total, static_cast<uint64_t>(dim), &total)) return false;
  }
  *out = total;
  return true;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

// Parses the header, rejecting duplicate keys at any depth (nlohmann keeps the last silently).
OrderedJson parse_header(const std::string& path, const char* text, size_t size) {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  OrderedJson::parser_callback_t callback = [&](int, nlohmann::json::parse_event_t event,
                                                OrderedJson& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      open_objects.emplace_back();
    } else if (event == Event::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == Event::key && !open_objects.empty() && parsed.is_string()) {
      if (!open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  OrderedJson header;
  try {
    header = OrderedJson::parse(text, text + size, callback);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!duplicate.empty()) fail(path, "header has duplicate key \"" + duplicate + "\"");
  if (!header.is_object()) fail(path, "header is not a JSON object");
  return header;
}

std::map<std::string, std::string> parse_metadata(const std::string& path,
                                                  const OrderedJson& value) {
  if (!value.is_object()) fail(path, "__metadata__ is not a JSON object");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) fail(path, "__metadata__ value of \"" + key + "\" is not a string");
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

SafetensorsEntry parse_entry(const std::string& path, const std::string& name,
                             const OrderedJson& value, uint64_t data_size) {
  const std::string where = "tensor \"" + name + "\": ";
  if (name.empty()) fail(path, "tensor with an empty name");
  if (!value.is_object()) fail(path, where + "entry is not a JSON object");
  for (const auto& [key, item] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      fail(path, where + "unknown field \"" + key + "\"");
    }
  }
  SafetensorsEntry entry;
  entry.name = name;

  auto dtype = value.find("dtype");
  if (dtype == value.end()) fail(path, where + "missing dtype");
  if (!dtype->is_string()) fail(path, where + "dtype is not a string");
  entry.dtype = dtype->get<std::string>();
  const uint64_t element_size = safetensors_dtype_size(entry.dtype);
  if (element_size == 0) fail(path, where + "unknown dtype \"" + entry.dtype + "\"");

  auto shape = value.find("shape");
  if (shape == value.end()) fail(path, where + "missing shape");
  if (!shape->is_array()) fail(path, where + "shape is not an array");
  for (const auto& dim : *shape) {
    if (!dim.is_number_integer()) fail(path, where + "shape has a non-integer dimension");
    if (dim.is_number_unsigned()) {
      const uint64_t u = dim.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) fail(path, where + "shape dimension too large");
      entry.shape.push_back(static_cast<int64_t>(u));
    } else {
      const int64_t s = dim.get<int64_t>();
      if (s < 0) fail(path, where + "shape has a negative dimension " + std::to_string(s));
      entry.shape.push_back(s);
    }
  }

  auto offsets = value.find("data_offsets");
  if (offsets == value.end()) fail(path, where + "missing data_offsets");
  if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    fail(path, where + "data_offsets is not a pair of non-negative integers");
  }
  entry.begin = (*offsets)[0].get<uint64_t>();
  entry.end = (*offsets)[1].get<uint64_t>();
  if (entry.begin > entry.end) {
    fail(path, where + "data_offsets begin " + std::to_string(entry.begin) + " > end " +
                   std::to_string(entry.end));
  }
  if (entry.end > data_size) {
    fail(path, where + "data_offsets end " + std::to_string(entry.end) +
                   " out of bounds of data section of " + std::to_string(data_size) + " bytes");
  }

  uint64_t nbytes = 0;
  if (!checked_byte_size(entry.shape, element_size, &nbytes)) {
    fail(path, where + "byte size of shape " + shape_text(entry.shape) + " overflows");
  }
  if (nbytes != entry.end - entry.begin) {
    fail(path, where + "size mismatch: shape " + shape_text(entry.shape) + " of " + entry.dtype +
                   " needs " + std::to_string(nbytes) + " bytes but data_offsets span " +
                   std::to_string(entry.end - entry.begin));
  }
  return entry;
}

// Writes all of [data, data + size) to fd, retrying on short writes and EINTR.
bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

uint64_t safetensors_dtype_size(std::string_view dtype) {
  static const std::map<std::string_view, uint64_t> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

// An open read-only mapping of a whole file, unmapped when the last SafetensorsFile goes.
struct SafetensorsFile::Mapping {
  void* address = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (address) ::munmap(address, size);
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open (" + errno_text() + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string reason = errno_text();
    ::close(fd);
    fail(path, "cannot stat (" + reason + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < kHeaderLengthBytes) {
    ::close(fd);
    fail(path, "file size " + std::to_string(file_size) +
                   " is smaller than the 8-byte header length (truncated file)");
  }
  auto mapping = std::make_shared<Mapping>();
  void* address = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string map_error = address == MAP_FAILED ? errno_text() : std::string();
  ::close(fd);
  if (address == MAP_FAILED) fail(path, "cannot mmap (" + map_error + ")");
  mapping->address = address;
  mapping->size = file_size;
  const auto* bytes = static_cast<const std::byte*>(address);

  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes, sizeof header_length);
  if (header_length > file_size - kHeaderLengthBytes) {
    fail(path, "header length " + std::to_string(header_length) + " exceeds file size " +
                   std::to_string(file_size));
  }
  if (header_length > kMaxSafetensorsHeaderBytes) {
    fail(path, "header length " + std::to_string(header_length) + " exceeds the limit of " +
                   std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  const char* header_text = reinterpret_cast<const char*>(bytes + kHeaderLengthBytes);
  if (header_length == 0 || header_text[0] != '{') {
    fail(path, "header is not valid JSON (does not start with '{')");
  }
  const OrderedJson header = parse_header(path, header_text, header_length);

  SafetensorsFile file;
  file.path_ = path;
  file.data_begin_ = bytes + kHeaderLengthBytes + header_length;
  file.data_size_ = file_size - kHeaderLengthBytes - header_length;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      file.metadata_ = parse_metadata(path, value);
      continue;
    }
    file.index_.emplace(name, file.entries_.size());
    file.entries_.push_back(parse_entry(path, name, value, file.data_size_));
  }

  // No two non-empty byte ranges may overlap.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& entry : file.entries_) {
    if (entry.end > entry.begin) by_offset.push_back(&entry);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      fail(path, "tensors \"" + by_offset[i - 1]->name + "\" and \"" + by_offset[i]->name +
                     "\" overlap in the data section");
    }
  }
  file.mapping_ = std::move(mapping);
  return file;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

std::span<const std::byte> SafetensorsFile::data(const SafetensorsEntry& entry) const {
  if (entry.begin > entry.end || entry.end > data_size_) {
    fail(path_, "tensor \"" + entry.name + "\": data_offsets out of bounds of this file");
  }
  if (entry.end == entry.begin) return {};
  return {data_begin_ + entry.begin, static_cast<size_t>(entry.end - entry.begin)};
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson meta = OrderedJson::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const auto& view : tensors) {
    const std::string where = "tensor \"" + view.name + "\": ";
    if (view.name.empty()) fail(path, "cannot write a tensor with an empty name");
    if (view.name == kMetadataKey) fail(path, "cannot write a tensor named __metadata__");
    if (header.contains(view.name)) fail(path, where + "duplicate tensor name");
    const uint64_t element_size = safetensors_dtype_size(view.dtype);
    if (element_size == 0) fail(path, where + "unknown dtype \"" + view.dtype + "\"");
    for (int64_t dim : view.shape) {
      if (dim < 0) fail(path, where + "negative dimension in shape " + shape_text(view.shape));
    }
    uint64_t nbytes = 0;
    if (!checked_byte_size(view.shape, element_size, &nbytes) || nbytes != view.nbytes) {
      fail(path, where + "size mismatch: shape " + shape_text(view.shape) + " of " + view.dtype +
                     " does not match " + std::to_string(view.nbytes) + " bytes");
    }
    if (nbytes > 0 && view.data == nullptr) fail(path, where + "null data");
    header[view.name] = {
        {"dtype", view.dtype}, {"shape", view.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_text = header.dump();
  header_text.append((kHeaderAlignment - header_text.size() % kHeaderAlignment) % kHeaderAlignment,
                     ' ');
  const uint64_t header_length = header_text.size();

  const std::string tmp_path = path + ".tmp";
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, "cannot create " + tmp_path + " (" + errno_text() + ")");
  auto abandon = [&](const std::string& what) {
    const std::string reason = errno_text();
    ::close(fd);
    ::unlink(tmp_path.c_str());
    fail(path, what + " (" + reason + ")");
  };
  if (!write_all(fd, &header_length, sizeof header_length) ||
      !write_all(fd, header_text.data(), header_text.size())) {
    abandon("cannot write header to " + tmp_path);
  }
  for (const auto& view : tensors) {
    if (view.nbytes > 0 && !write_all(fd, view.data, view.nbytes)) {
      abandon("cannot write tensor \"" + view.name + "\" to " + tmp_path);
    }
  }
  if (::fsync(fd) != 0) abandon("cannot fsync " + tmp_path);
  if (::close(fd) != 0) {
    const std::string reason = errno_text();
    ::unlink(tmp_path.c_str());
    fail(path, "cannot close " + tmp_path + " (" + reason + ")");
  }
  if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const std::string reason = errno_text();
    ::unlink(tmp_path.c_str());
    fail(path, "cannot rename " + tmp_path + " into place (" + reason + ")");
  }
  // Make the rename itself durable.
  std::filesystem::path directory = std::filesystem::path(path).parent_path();
  if (directory.empty()) directory = ".";
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace kuai::io
