// EventWriter and the event-file reader (see event_writer.h): hand-rolled protobuf encoding and
// decoding of the few tensorflow.Event fields scalars use, inside TFRecord framing.
#include "kuai/log/event_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string_view>

#include "kuai/log/crc32c.h"

namespace kuai::log {
namespace {

constexpr size_t kFlushBytes = size_t{1} << 16;  // buffered bytes that trigger a write

// Protobuf wire types.
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kStartGroup = 3;
constexpr int kEndGroup = 4;
constexpr int kFixed32 = 5;

// ---- encoding ----

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type));
}

void put_bytes(std::string& out, int field, std::string_view s) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, s.size());
  out.append(s);
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

std::string encode_scalar_event(int64_t step, double wall_time,
                                const std::vector<std::pair<std::string, float>>& tag_values) {
  std::string summary;
  for (const auto& [tag, value] : tag_values) {
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, value);
    put_bytes(summary, 1, v);
  }
  std::string event;
  put_double(event, 1, wall_time);
  put_key(event, 2, kVarint);
  put_varint(event, static_cast<uint64_t>(step));
  put_bytes(event, 5, summary);
  return event;
}

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)
    if (c == '/') c = '_';
  return h;
}

// ---- decoding ----

uint64_t get_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// A cursor over one protobuf message; throws std::runtime_error on malformed input (the caller
// adds the file and record).
class ProtoReader {
 public:
  explicit ProtoReader(std::string_view s)
      : p_(reinterpret_cast<const unsigned char*>(s.data())), end_(p_ + s.size()) {}

  bool done() const { return p_ == end_; }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) throw std::runtime_error("varint runs past the end");
      const unsigned char b = *p_++;
      v |= uint64_t(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    throw std::runtime_error("varint longer than 10 bytes");
  }

  // Reads a key; returns the field number and sets wire_type.
  uint32_t key(int& wire_type) {
    const uint64_t k = varint();
    wire_type = static_cast<int>(k & 7);
    const uint64_t field = k >> 3;
    if (field == 0 || field > 0x1fffffff) throw std::runtime_error("bad field number");
    return static_cast<uint32_t>(field);
  }

  const unsigned char* take(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n)
      throw std::runtime_error(fmt::format("field of {} bytes runs past the end", n));
    const unsigned char* at = p_;
    p_ += n;
    return at;
  }

  uint64_t fixed(int bytes) { return get_le(take(bytes), bytes); }

  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > static_cast<uint64_t>(end_ - p_))
      throw std::runtime_error(fmt::format("field of {} bytes runs past the end", n));
    return {reinterpret_cast<const char*>(take(n)), static_cast<size_t>(n)};
  }

  // Skips the value of a field whose key has just been read.
  void skip(uint32_t field, int wire_type, int depth = 0) {
    switch (wire_type) {
      case kVarint:
        varint();
        return;
      case kFixed64:
        take(8);
        return;
      case kLengthDelimited:
        bytes();
        return;
      case kFixed32:
        take(4);
        return;
      case kStartGroup: {
        if (depth > 64) throw std::runtime_error("groups nested too deeply");
        for (;;) {
          int wt = 0;
          const uint32_t f = key(wt);
          if (wt == kEndGroup) {
            if (f != field) throw std::runtime_error("mismatched end group");
            return;
          }
          skip(f, wt, depth + 1);
        }
      }
      case kEndGroup:
        throw std::runtime_error("unexpected end group");
      default:
        throw std::runtime_error(fmt::format("invalid wire type {}", wire_type));
    }
  }

 private:
  const unsigned char* p_;
  const unsigned char* end_;
};

struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;  // Values with a simple_value
};

void decode_value(std::string_view s, DecodedEvent& ev) {
  ProtoReader r(s);
  std::string tag;
  float value = 0;
  bool has_value = false;
  while (!r.done()) {
    int wt = 0;
    const uint32_t f = r.key(wt);
    if (f == 1 && wt == kLengthDelimited) {
      tag = std::string(r.bytes());
    } else if (f == 2 && wt == kFixed32) {
      const uint32_t bits = static_cast<uint32_t>(r.fixed(4));
      std::memcpy(&value, &bits, 4);
      has_value = true;
    } else {
      r.skip(f, wt);
    }
  }
  if (has_value) ev.values.emplace_back(std::move(tag), value);
}

void decode_summary(std::string_view s, DecodedEvent& ev) {
  ProtoReader r(s);
  while (!r.done()) {
    int wt = 0;
    const uint32_t f = r.key(wt);
    if (f == 1 && wt == kLengthDelimited)
      decode_value(r.bytes(), ev);
    else
      r.skip(f, wt);
  }
}

DecodedEvent decode_event(std::string_view s) {
  DecodedEvent ev;
  ProtoReader r(s);
  while (!r.done()) {
    int wt = 0;
    const uint32_t f = r.key(wt);
    if (f == 1 && wt == kFixed64) {
      const uint64_t bits = r.fixed(8);
      std::memcpy(&ev.wall_time, &bits, 8);
    } else if (f == 2 && wt == kVarint) {
      ev.step = static_cast<int64_t>(r.varint());
    } else if (f == 3 && wt == kLengthDelimited) {
      ev.file_version = std::string(r.bytes());
    } else if (f == 5 && wt == kLengthDelimited) {
      decode_summary(r.bytes(), ev);  // repeated occurrences merge: their values concatenate
    } else {
      r.skip(f, wt);
    }
  }
  return ev;
}

DecodedEvent decode_record(const std::string& path, size_t index, const std::string& payload) {
  try {
    return decode_event(payload);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(
        fmt::format("{}: record {}: malformed event: {}", path, index, e.what()));
  }
}

}  // namespace

EventWriter::EventWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(
        fmt::format("{}: cannot create event directory: {}", dir, ec.message()));
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string base =
      (std::filesystem::path(dir) /
       fmt::format("events.out.tfevents.{:010d}.{}", static_cast<int64_t>(now), hostname()))
          .string();
  for (int attempt = 0;; ++attempt) {
    path_ = attempt == 0 ? base : fmt::format("{}.{}", base, attempt);
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ >= 0) break;
    if (errno != EEXIST || attempt >= 1000)
      throw std::runtime_error(
          fmt::format("{}: cannot create event file: {}", path_, std::strerror(errno)));
  }
  std::string event;
  put_double(event, 1, now);
  put_bytes(event, 3, kEventFileVersion);
  try {
    write_record(event);
    flush();
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

EventWriter::~EventWriter() {
  try {
    flush();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kuai: %s\n", e.what());
  }
  ::close(fd_);
}

void EventWriter::add_scalar(const std::string& tag, float value, int64_t step,
                             double wall_time_s) {
  add_scalars(step, wall_time_s, {{tag, value}});
}

void EventWriter::add_scalars(int64_t step, double wall_time_s,
                              const std::vector<std::pair<std::string, float>>& tag_values) {
  if (tag_values.empty()) return;
  write_record(encode_scalar_event(step, wall_time_s, tag_values));
}

void EventWriter::write_record(const std::string& data) {
  std::string header;
  put_le(header, data.size(), 8);
  const size_t start = pending_.size();
  pending_.append(header);
  put_le(pending_, masked_crc32c(pending_.data() + start, 8), 4);
  pending_.append(data);
  put_le(pending_, masked_crc32c(data.data(), data.size()), 4);
  if (pending_.size() >= kFlushBytes) flush();
}

void EventWriter::flush() {
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      pending_.erase(0, done);  // keep what was not written; the file now ends mid-record
      throw std::runtime_error(
          fmt::format("{}: cannot write event file: {}", path_, std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  pending_.clear();
}

std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error(
        fmt::format("{}: cannot open event file: {}", path, std::strerror(errno)));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error(fmt::format("{}: read error", path));
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::vector<std::string> records;
  size_t off = 0;
  while (off < bytes.size()) {
    const size_t index = records.size();
    const size_t left = bytes.size() - off;
    auto fail = [&](const std::string& what) {
      return std::runtime_error(
          fmt::format("{}: record {} (offset {}): {}", path, index, off, what));
    };
    if (left < 12)
      throw fail(
          fmt::format("truncated record: {} bytes left, shorter than the 12-byte header", left));
    const uint64_t len = get_le(p + off, 8);
    const uint32_t len_crc = static_cast<uint32_t>(get_le(p + off + 8, 4));
    if (len_crc != masked_crc32c(p + off, 8))
      throw fail(fmt::format("length crc mismatch (stored {:#010x}, computed {:#010x})", len_crc,
                             masked_crc32c(p + off, 8)));
    if (left < 16 || len > left - 16)
      throw fail(fmt::format("truncated record: length {} but only {} bytes left", len, left));
    const unsigned char* data = p + off + 12;
    const uint32_t data_crc = static_cast<uint32_t>(get_le(data + len, 4));
    const uint32_t computed = masked_crc32c(data, len);
    if (data_crc != computed)
      throw fail(fmt::format("data crc mismatch (stored {:#010x}, computed {:#010x})", data_crc,
                             computed));
    records.emplace_back(reinterpret_cast<const char*>(data), len);
    off += 16 + len;
  }
  return records;
}

std::vector<ScalarEvent> read_scalar_events(const std::string& path) {
  const std::vector<std::string> records = read_records(path);
  std::vector<ScalarEvent> out;
  for (size_t i = 0; i < records.size(); ++i) {
    DecodedEvent ev = decode_record(path, i, records[i]);
    for (auto& [tag, value] : ev.values)
      out.push_back({ev.step, ev.wall_time, std::move(tag), value});
  }
  return out;
}

std::string read_file_version(const std::string& path) {
  const std::vector<std::string> records = read_records(path);
  if (records.empty()) throw std::runtime_error(fmt::format("{}: no records", path));
  return decode_record(path, 0, records[0]).file_version;
}

}  // namespace kuai::log
