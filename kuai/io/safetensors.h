// Reader and writer for the safetensors format, independent of kuai's Tensor type.
//
// Layout of a file: an 8-byte little-endian u64 header length N, N bytes of JSON header
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// padded with spaces, then the raw little-endian tensor bytes; offsets are relative to the
// start of that data section, and the tensors' byte ranges, sorted by offset, cover it exactly
// (in any order relative to the header; no overlap, gap or trailing bytes). The reader
// memory-maps the file (or takes ownership of bytes already in memory) and validates every
// field before exposing it; every failure throws std::runtime_error naming the file and the
// check.
// The writer writes `path + ".tmp"`, fsyncs it and renames it over `path`, so a good file is
// never replaced by a partial one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kuai::io {

// Headers larger than this are rejected before they are parsed.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull * 1024 * 1024;

// Bytes per element of a safetensors dtype name ("F32", "BF16", "I64", ...); 0 if unknown.
uint64_t safetensors_dtype_size(std::string_view dtype);

// One tensor described by a file's header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // as spelled in the format: "F32", "BF16", "F16", "I32", ...
  std::vector<int64_t> shape;  // empty for a scalar
  uint64_t begin = 0;          // byte offsets into the data section, begin <= end
  uint64_t end = 0;
};

// A validated, memory-mapped safetensors file. Copies share the mapping.
class SafetensorsFile {
 public:
  // Maps and validates `path`; throws std::runtime_error("<path>: <check that failed>").
  static SafetensorsFile open(const std::string& path);
  // The same validation over bytes already in memory (the whole file), which the result owns;
  // `name` stands for the path in errors and in path(). The fuzz target's entry point.
  static SafetensorsFile parse(std::vector<std::byte> bytes, const std::string& name);

  // Entries in the order of the header.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The entry called `name`, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const;
  // The raw bytes of an entry of this file (end - begin bytes, little-endian, no alignment
  // guarantee beyond what the writer chose: copy with memcpy before reinterpreting). Never a
  // null pointer, even for an empty tensor.
  std::span<const std::byte> data(const SafetensorsEntry& entry) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  struct Mapping;

  SafetensorsFile() = default;
  // Validates the whole file held by `mapping` (both entry points end here).
  static SafetensorsFile from_mapping(std::shared_ptr<const Mapping> mapping,
                                      const std::string& path);

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  const std::byte* data_begin_ = nullptr;  // start of the data section inside the mapping
  uint64_t data_size_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: borrowed bytes, `nbytes` must equal prod(shape) * dtype size.
struct SafetensorsView {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t nbytes = 0;
};

// Writes `tensors` (in the given order, packed back to back) and `metadata` to `path`
// atomically: a SafetensorsWriter (below) written whole, so the file's room is reserved before
// any byte is written. Throws std::runtime_error naming the file on an invalid view or an I/O
// error.
void write_safetensors(const std::string& path, const std::vector<SafetensorsView>& tensors,
                       const std::map<std::string, std::string>& metadata);

// A safetensors file written piece by piece, for tensors that never sit whole in memory (optimizer
// state offloaded to disk): the constructor reserves the file's room and writes the header (the
// views' data pointers are not read), write() puts bytes of a tensor at any offset, in any order,
// and finish() fsyncs the file and renames it into place. Every failure throws
// std::runtime_error naming the file and the operation (and errno's text); a writer destroyed or
// failed before finish() removes what it wrote.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsView> tensors,
                    const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // Bytes [offset, offset + n) of tensor `tensor` (an index into the constructor's views).
  void write(size_t tensor, uint64_t offset, const void* data, uint64_t n);
  // Rewrites the header with other metadata of the same serialized length (values known only
  // once the tensors are written, such as their checksums, given as placeholders of their width
  // to the constructor); a header of another length is an error naming the file.
  void set_metadata(const std::map<std::string, std::string>& metadata);
  void finish();

 private:
  [[noreturn]] void abandon(const std::string& what);
  std::string path_, tmp_path_;
  std::vector<SafetensorsView> tensors_;
  std::vector<uint64_t> offsets_;  // of each tensor in the data section
  uint64_t data_start_ = 0;
  int fd_ = -1;
};

}  // namespace kuai::io
