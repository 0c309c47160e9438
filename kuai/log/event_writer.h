// TensorBoard event files written by hand, with no protobuf library: each record is TFRecord
// framing (u64 little-endian length, masked CRC32C of those 8 bytes, the data, masked CRC32C of
// the data) around a serialized tensorflow.Event. Only the fields scalars need are encoded:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// A small reader beside the writer checks every CRC and decodes the scalars back, for the tests
// and for tools.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kuai::log {

inline constexpr char kEventFileVersion[] = "brain.Event:2";

// Appends events to `<dir>/events.out.tfevents.<unix seconds, 10 digits>.<hostname>`; the
// first record is the file-version event. If that name is already taken (two writers started in
// the same second), ".1", ".2", ... is appended rather than overwriting. Records are buffered in
// memory and reach the file whole: flush(), the destructor, or a full buffer write them out.
// Not thread-safe.
class EventWriter {
 public:
  // Creates `dir` if missing; throws std::runtime_error naming the path on failure.
  explicit EventWriter(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void add_scalar(const std::string& tag, float value, int64_t step, double wall_time_s);
  // One Event holding one Value per (tag, value); an empty list writes nothing.
  void add_scalars(int64_t step, double wall_time_s,
                   const std::vector<std::pair<std::string, float>>& tag_values);
  // Writes the buffered records to the file; throws std::runtime_error naming the file.
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  std::string path_;
  int fd_ = -1;
  std::string pending_;  // whole framed records not yet written
};

struct ScalarEvent {
  int64_t step;
  double wall_time;
  std::string tag;
  float value;
};

// The payloads of every record of a TFRecord file, in order. Checks both CRCs of every record;
// throws std::runtime_error naming the file, the record index and the failed check ("truncated
// record", "length crc mismatch" or "data crc mismatch").
std::vector<std::string> read_records(const std::string& path);

// Every Value with a simple_value, in file order, with its Event's step and wall_time. Unknown
// fields are skipped by wire type; values without simple_value (images, tensors, ...) are left
// out. Throws like read_records, or "malformed event" when a payload does not decode.
std::vector<ScalarEvent> read_scalar_events(const std::string& path);

// The file_version of the first record ("" if it has none); throws if the file has no records.
std::string read_file_version(const std::string& path);

}  // namespace kuai::log
