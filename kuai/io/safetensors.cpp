// Safetensors reader (mmap + full validation of the header) and atomic writer.
//
// The reader trusts nothing in the file: sizes are checked before every read, the JSON header
// is parsed with duplicate keys rejected, every entry's dtype, shape, offsets and byte size are
// checked (shape products with overflow detection), and, sorted by offset, the entries must tile
// the data section exactly: no overlap, no gap, no trailing bytes (as the reference reader
// requires). open() (mmap) and parse() (bytes in memory) share all of it.
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

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;  // the writer keeps tensors in the given order

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr uint64_t kHeaderLengthBytes = 8;
constexpr uint64_t kHeaderAlignment = 8;
// A valid header nests 3 deep (header > entry > shape); deeper input is refused while parsing.
constexpr size_t kMaxHeaderDepth = 8;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

std::string errno_text() { return std::strerror(errno); }

[[noreturn]] void fail_truncated(const std::string& path, uint64_t file_size) {
  fail(path, "file size " + std::to_string(file_size) +
                 " is smaller than the 8-byte header length (truncated file)");
}

// prod(shape) * element_size, or false if that overflows. Zero dimensions count as 1 in the
// overflow check, so a shape is refused when any product of its dimensions (a stride, say)
// would not fit in int64, even if the tensor is empty.
bool checked_byte_size(const std::vector<int64_t>& shape, uint64_t element_size, uint64_t* out) {
  uint64_t nominal = element_size;
  bool empty = false;
  for (int64_t dim : shape) {
    if (dim < 0) return false;
    if (dim == 0) empty = true;
    const uint64_t factor = dim == 0 ? 1 : static_cast<uint64_t>(dim);
    if (__builtin_mul_overflow(nominal, factor, &nominal)) return false;
  }
  if (nominal > static_cast<uint64_t>(INT64_MAX)) return false;
  *out = empty ? 0 : nominal;
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

// A parsed header and its top-level keys in file order.
struct Header {
  Json json;
  std::vector<std::string> order;
};

// A first, allocation-light pass over the header text (nlohmann SAX): checks the syntax, rejects
// duplicate keys at any depth (nlohmann's DOM silently keeps the last) and nesting deeper than a
// valid header needs (which would only cost memory), and records the top-level key order. The
// DOM is then built without a callback: nlohmann's callback parser rescans the parent container
// at the end of every child (quadratic in a hostile header), and its ordered_json looks keys up
// linearly, so neither is used.
class HeaderScan : public nlohmann::json_sax<Json> {
 public:
  std::vector<std::string> order;
  std::string error;  // why the scan stopped; empty if it did not

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(true); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& name) override {
    if (levels_.empty() || !levels_.back().is_object) return true;
    if (!levels_.back().keys.insert(name).second) {
      error = "header has duplicate key \"" + name + "\"";
      return false;
    }
    if (levels_.size() == 1) order.push_back(name);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    error = std::string("header is not valid JSON (") + e.what() + ")";
    return false;
  }

 private:
  struct Level {
    bool is_object;
    std::set<std::string> keys;
  };
  bool open(bool is_object) {
    if (levels_.size() >= kMaxHeaderDepth) {
      error = "header nests deeper than " + std::to_string(kMaxHeaderDepth) + " levels";
      return false;
    }
    levels_.push_back({is_object, {}});
    return true;
  }
  bool close() {
    if (!levels_.empty()) levels_.pop_back();
    return true;
  }
  std::vector<Level> levels_;
};

Header parse_header(const std::string& path, const char* text, size_t size) {
  HeaderScan scan;
  if (!Json::sax_parse(text, text + size, &scan)) {
    fail(path, scan.error.empty() ? "header is not valid JSON" : scan.error);
  }
  Header header;
  try {
    header.json = Json::parse(text, text + size);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.json.is_object()) fail(path, "header is not a JSON object");
  header.order = std::move(scan.order);
  return header;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const Json& value) {
  if (!value.is_object()) fail(path, "__metadata__ is not a JSON object");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) fail(path, "__metadata__ value of \"" + key + "\" is not a string");
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const Json& value,
                             uint64_t data_size) {
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

// The bytes of a whole file: a read-only mapping (unmapped when the last SafetensorsFile goes)
// or a buffer handed to parse().
struct SafetensorsFile::Mapping {
  const std::byte* bytes = nullptr;
  size_t size = 0;
  void* mapped = nullptr;  // from mmap, or null
  std::vector<std::byte> owned;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (mapped) ::munmap(mapped, size);
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
    fail_truncated(path, file_size);
  }
  auto mapping = std::make_shared<Mapping>();
  void* address = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string map_error = address == MAP_FAILED ? errno_text() : std::string();
  ::close(fd);
  if (address == MAP_FAILED) fail(path, "cannot mmap (" + map_error + ")");
  mapping->mapped = address;
  mapping->bytes = static_cast<const std::byte*>(address);
  mapping->size = file_size;
  return from_mapping(std::move(mapping), path);
}

SafetensorsFile SafetensorsFile::parse(std::vector<std::byte> bytes, const std::string& name) {
  auto mapping = std::make_shared<Mapping>();
  mapping->owned = std::move(bytes);
  mapping->bytes = mapping->owned.data();
  mapping->size = mapping->owned.size();
  return from_mapping(std::move(mapping), name);
}

SafetensorsFile SafetensorsFile::from_mapping(std::shared_ptr<const Mapping> mapping,
                                              const std::string& path) {
  const uint64_t file_size = mapping->size;
  if (file_size < kHeaderLengthBytes) {
    fail_truncated(path, file_size);
  }
  const std::byte* bytes = mapping->bytes;

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
  const Header header = parse_header(path, header_text, header_length);

  SafetensorsFile file;
  file.path_ = path;
  file.data_begin_ = bytes + kHeaderLengthBytes + header_length;
  file.data_size_ = file_size - kHeaderLengthBytes - header_length;
  for (const std::string& name : header.order) {
    const Json& value = header.json.at(name);
    if (name == kMetadataKey) {
      file.metadata_ = parse_metadata(path, value);
      continue;
    }
    file.index_.emplace(name, file.entries_.size());
    file.entries_.push_back(parse_entry(path, name, value, file.data_size_));
  }

  // Sorted by offset, the entries must cover the data section exactly once. Empty tensors sit
  // at a boundary between two others (or at either end).
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& entry : file.entries_) by_offset.push_back(&entry);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;                    // bytes [0, covered) belong to the tensors seen so far
  const SafetensorsEntry* last = nullptr;  // the tensor that ends at `covered`
  for (const SafetensorsEntry* entry : by_offset) {
    if (entry->begin < covered) {
      fail(path, "tensors \"" + last->name + "\" and \"" + entry->name +
                     "\" overlap in the data section");
    }
    if (entry->begin > covered) {
      fail(path, "gap of " + std::to_string(entry->begin - covered) +
                     " bytes in the data section before tensor \"" + entry->name + "\"");
    }
    if (entry->end > covered) {
      covered = entry->end;
      last = entry;
    }
  }
  if (covered != file.data_size_) {
    fail(path, "data section has " + std::to_string(file.data_size_ - covered) +
                   " trailing bytes not covered by any tensor");
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
  // An empty tensor's span still points into the file (never null): callers may memcpy it.
  return {data_begin_ + entry.begin, static_cast<size_t>(entry.end - entry.begin)};
}

namespace {

// The header of `tensors` packed back to back (validated; `need_data`: each view's bytes given),
// padded to the alignment, and each tensor's offset in the data section.
std::string header_of(const std::string& path, const std::vector<SafetensorsView>& tensors,
                      const std::map<std::string, std::string>& metadata, bool need_data,
                      std::vector<uint64_t>* offsets) {
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
    if (need_data && nbytes > 0 && view.data == nullptr) fail(path, where + "null data");
    header[view.name] = {
        {"dtype", view.dtype}, {"shape", view.shape}, {"data_offsets", {offset, offset + nbytes}}};
    if (offsets) offsets->push_back(offset);
    offset += nbytes;
  }
  std::string header_text = header.dump();
  header_text.append((kHeaderAlignment - header_text.size() % kHeaderAlignment) % kHeaderAlignment,
                     ' ');
  return header_text;
}

// Makes the rename of a file in `path`'s folder durable.
void fsync_parent(const std::string& path) {
  std::filesystem::path directory = std::filesystem::path(path).parent_path();
  if (directory.empty()) directory = ".";
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  (void)header_of(path, tensors, metadata, true, nullptr);  // every view has its bytes
  SafetensorsWriter file(path, tensors, metadata);          // room reserved, header written
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].nbytes > 0) file.write(i, 0, tensors[i].data, tensors[i].nbytes);
  file.finish();  // fsync, rename into place, fsync the folder
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsView> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), tensors_(std::move(tensors)) {
  const std::string header_text = header_of(path_, tensors_, metadata, false, &offsets_);
  const uint64_t header_length = header_text.size();
  data_start_ = sizeof header_length + header_length;
  uint64_t size = data_start_;
  for (const auto& view : tensors_) size += view.nbytes;
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_, "cannot create " + tmp_path_ + " (" + errno_text() + ")");
  // The room for every byte now: a disk without it fails here, before anything is streamed.
  if (const int e = ::posix_fallocate(fd_, 0, static_cast<off_t>(size)); e != 0) {
    errno = e;
    abandon("cannot reserve " + std::to_string(size) + " bytes for " + tmp_path_);
  }
  if (!write_all(fd_, &header_length, sizeof header_length) ||
      !write_all(fd_, header_text.data(), header_text.size())) {
    abandon("cannot write header to " + tmp_path_);
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
  }
}

void SafetensorsWriter::abandon(const std::string& what) {
  const std::string reason = errno_text();
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_path_.c_str());
  fail(path_, what + " (" + reason + ")");
}

void SafetensorsWriter::write(size_t tensor, uint64_t offset, const void* data, uint64_t n) {
  if (fd_ < 0) fail(path_, "write after the file was finished or abandoned");
  if (tensor >= tensors_.size() || offset + n > tensors_[tensor].nbytes)
    fail(path_, "write of " + std::to_string(n) + " bytes at " + std::to_string(offset) +
                    " is outside tensor " + std::to_string(tensor));
  const char* p = static_cast<const char*>(data);
  uint64_t at = data_start_ + offsets_[tensor] + offset;
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(at));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      abandon("cannot write tensor \"" + tensors_[tensor].name + "\" to " + tmp_path_);
    }
    p += w;
    at += static_cast<uint64_t>(w);
    n -= static_cast<uint64_t>(w);
  }
}

void SafetensorsWriter::set_metadata(const std::map<std::string, std::string>& metadata) {
  if (fd_ < 0) fail(path_, "metadata set after the file was finished or abandoned");
  const std::string header_text = header_of(path_, tensors_, metadata, false, nullptr);
  const uint64_t header_length = header_text.size();
  if (sizeof header_length + header_length != data_start_)
    fail(path_, "new metadata makes a header of " + std::to_string(header_length) +
                    " bytes where " + std::to_string(data_start_ - sizeof header_length) +
                    " were written");
  const char* p = header_text.data();
  uint64_t n = header_length, at = sizeof header_length;
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(at));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      abandon("cannot rewrite the header of " + tmp_path_);
    }
    p += w;
    at += static_cast<uint64_t>(w);
    n -= static_cast<uint64_t>(w);
  }
}

void SafetensorsWriter::finish() {
  if (fd_ < 0) fail(path_, "finish after the file was finished or abandoned");
  if (::fsync(fd_) != 0) abandon("cannot fsync " + tmp_path_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const std::string reason = errno_text();
    ::unlink(tmp_path_.c_str());
    fail(path_, "cannot close " + tmp_path_ + " (" + reason + ")");
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const std::string reason = errno_text();
    ::unlink(tmp_path_.c_str());
    fail(path_, "cannot rename " + tmp_path_ + " into place (" + reason + ")");
  }
  fsync_parent(path_);
}

}  // namespace kuai::io
