// TensorBoard event files: CRC32C against the RFC 3720 vectors and a bitwise reference on both
// code paths, exact round trips through the reader, the byte layout of one record checked by
// hand, and a clear error for a truncated or corrupted file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "kuai/backend/cpu/isa.h"
#include "kuai/log/crc32c.h"
#include "kuai/log/event_writer.h"

namespace kuai::log {
namespace {

namespace fs = std::filesystem;

// Bit-at-a-time CRC32C, the plain reference both fast paths are checked against.
uint32_t crc_bitwise(const void* data, size_t n, uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int b = 0; b < 8; ++b) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

uint32_t masked_bitwise(const std::string& s) {
  const uint32_t c = crc_bitwise(s.data(), s.size());
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

using CrcFn = uint32_t (*)(const void*, size_t, uint32_t);
const std::vector<std::pair<const char*, CrcFn>> kImpls = {
    {"crc32c", crc32c}, {"table", crc32c_table}, {"sse42", crc32c_sse42}};

std::string fresh_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("kuai_events_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

uint64_t le(const std::string& s, size_t off, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<unsigned char>(s[off + i])) << (8 * i);
  return v;
}

std::string le_bytes(uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}

// TFRecord framing done here, independently of the writer.
std::string frame(const std::string& data) {
  const std::string len = le_bytes(data.size(), 8);
  return len + le_bytes(masked_bitwise(len), 4) + data + le_bytes(masked_bitwise(data), 4);
}

// Minimal protobuf pieces for hand-built payloads.
std::string varint(uint64_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s.push_back(static_cast<char>((v & 0x7f) | 0x80));
  s.push_back(static_cast<char>(v));
  return s;
}
std::string key(int field, int wire_type) { return varint(uint64_t(field) << 3 | wire_type); }
std::string len_field(int field, const std::string& s) {
  return key(field, 2) + varint(s.size()) + s;
}
std::string double_field(int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  return key(field, 1) + le_bytes(bits, 8);
}
std::string float_field(int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return key(field, 5) + le_bytes(bits, 4);
}

uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

void expect_error(const std::string& path, const std::vector<std::string>& needles) {
  try {
    read_scalar_events(path);
    FAIL() << "expected an error containing: " << needles.front();
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << what;
  }
}

TEST(Crc32c, KnownVectors) {
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xff), up(32), down(32);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<unsigned char>(i);
  for (int i = 0; i < 32; ++i) down[i] = static_cast<unsigned char>(31 - i);
  for (const auto& [name, fn] : kImpls) {
    SCOPED_TRACE(name);
    EXPECT_EQ(fn(zeros.data(), 32, 0), 0x8A9136AAu);
    EXPECT_EQ(fn(ones.data(), 32, 0), 0x62A8AB43u);
    EXPECT_EQ(fn(up.data(), 32, 0), 0x46DD794Eu);
    EXPECT_EQ(fn(down.data(), 32, 0), 0x113FDB5Cu);
    EXPECT_EQ(fn("123456789", 9, 0), 0xE3069283u);
    EXPECT_EQ(fn("", 0, 0), 0u);
  }
  EXPECT_EQ(crc_bitwise("123456789", 9), 0xE3069283u);  // the reference itself is right
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);       // default crc argument
}

TEST(Crc32c, IncrementalEqualsOneShot) {
  std::mt19937 rng(7);
  std::vector<unsigned char> buf(1031);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const uint32_t whole = crc_bitwise(buf.data(), buf.size());
  for (const auto& [name, fn] : kImpls) {
    SCOPED_TRACE(name);
    EXPECT_EQ(fn(buf.data(), buf.size(), 0), whole);
    for (size_t split = 0; split <= buf.size(); split += 13) {
      const uint32_t a = fn(buf.data(), split, 0);
      EXPECT_EQ(fn(buf.data() + split, buf.size() - split, a), whole) << "split " << split;
    }
    uint32_t c = 0;  // byte by byte
    for (unsigned char b : buf) c = fn(&b, 1, c);
    EXPECT_EQ(c, whole);
  }
}

// The instruction path follows the ISA tier (KUAI_MAX_ISA caps it; tests/run_tier.sh runs this at
// every tier): baseline (x86-64 with SSE2) runs the table; every tier from avx2 up has SSE4.2.
TEST(Crc32c, TheInstructionPathFollowsTheTier) {
#if defined(__x86_64__)
  const bool expected = cpu::isa() != cpu::Isa::kBaseline;
  EXPECT_EQ(crc32c_has_sse42(), expected) << "tier " << cpu::isa_name(cpu::isa());
#else
  EXPECT_FALSE(crc32c_has_sse42());
#endif
}

TEST(Crc32c, HardwareMatchesTable) {
  if (!crc32c_has_sse42()) GTEST_SKIP() << "CPU without SSE4.2: only the table path runs";
  std::mt19937 rng(11);
  std::vector<unsigned char> buf(5000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t n = 1; n < 4200; n += 2 + 2 * (n / 64)) {  // odd lengths, every offset mod 8
    for (size_t off = 0; off < 8; ++off) {
      const uint32_t seed = static_cast<uint32_t>(rng());
      const uint32_t hw = crc32c_sse42(buf.data() + off, n, seed);
      ASSERT_EQ(hw, crc32c_table(buf.data() + off, n, seed)) << "n " << n << " off " << off;
      if (n < 300) {
        ASSERT_EQ(hw, crc_bitwise(buf.data() + off, n, seed)) << "n " << n;
      }
    }
  }
}

TEST(Crc32c, Masked) {
  // Rotate 0xE3069283 right by 15 -> 0x25071C0D, plus 0xa282ead8 -> 0xC78AB0E5.
  EXPECT_EQ(masked_crc32c("123456789", 9), 0xC78AB0E5u);
  EXPECT_EQ(mask_crc32c(0), 0xa282ead8u);
  EXPECT_EQ(mask_crc32c(0x00008000u), 0xa282ead9u);  // bit 15 rotates to bit 0
  const std::string len26 = le_bytes(26, 8);
  EXPECT_EQ(masked_crc32c(len26.data(), 8), 0x2DD89B12u);
}

TEST(EventWriter, FileNameAndDirectory) {
  const std::string root = fresh_dir("name");
  const std::string dir = root + "/nested/run";
  const auto before = std::chrono::system_clock::now();
  std::string path;
  {
    EventWriter w(dir);
    path = w.path();
  }
  const auto after = std::chrono::system_clock::now();
  ASSERT_TRUE(fs::is_directory(dir));
  ASSERT_TRUE(fs::is_regular_file(path));
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(dir));
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  const std::string name = fs::path(path).filename().string();
  // events.out.tfevents.<10 digits>.<hostname>
  const std::string prefix = "events.out.tfevents.";
  ASSERT_EQ(name.substr(0, prefix.size()), prefix) << name;
  const std::string digits = name.substr(prefix.size(), 10);
  ASSERT_EQ(digits.size(), 10u) << name;
  for (char c : digits) ASSERT_TRUE(c >= '0' && c <= '9') << name;
  EXPECT_EQ(name.substr(prefix.size() + 10), std::string(".") + host);
  const int64_t secs = std::stoll(digits);
  using std::chrono::duration_cast;
  using std::chrono::seconds;
  EXPECT_GE(secs, duration_cast<seconds>(before.time_since_epoch()).count());
  EXPECT_LE(secs, duration_cast<seconds>(after.time_since_epoch()).count());
  fs::remove_all(root);
}

TEST(EventWriter, TwoWritersInOneDirectoryDoNotClobber) {
  const std::string dir = fresh_dir("two");
  EventWriter a(dir), b(dir);
  EXPECT_NE(a.path(), b.path());
  a.add_scalar("a", 1.0f, 1, 1.0);
  b.add_scalar("b", 2.0f, 2, 2.0);
  a.flush();
  b.flush();
  ASSERT_EQ(read_scalar_events(a.path()).size(), 1u);
  EXPECT_EQ(read_scalar_events(a.path())[0].tag, "a");
  EXPECT_EQ(read_scalar_events(b.path())[0].tag, "b");
  fs::remove_all(dir);
}

TEST(EventWriter, UncreatableDirectoryNamesPath) {
  const std::string root = fresh_dir("bad");
  fs::create_directories(root);
  write_bytes(root + "/file", "x");
  const std::string dir = root + "/file/sub";
  try {
    EventWriter w(dir);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

TEST(EventWriter, FirstRecordIsFileVersion) {
  const std::string dir = fresh_dir("version");
  const double before =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  EventWriter w(dir);
  const double after =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Written at construction: readable before any flush.
  EXPECT_EQ(read_file_version(w.path()), "brain.Event:2");
  const std::vector<std::string> recs = read_records(w.path());
  ASSERT_EQ(recs.size(), 1u);
  const std::string& r = recs[0];
  ASSERT_EQ(r.size(), 9u + 2u + 13u);
  EXPECT_EQ(static_cast<unsigned char>(r[0]), 0x09);  // field 1, fixed64
  double wall;
  const uint64_t bits = le(r, 1, 8);
  std::memcpy(&wall, &bits, 8);
  EXPECT_GE(wall, std::floor(before));
  EXPECT_LE(wall, after);
  EXPECT_EQ(r.substr(9), std::string("\x1a\x0d") + "brain.Event:2");  // field 3, length 13
  EXPECT_TRUE(read_scalar_events(w.path()).empty());
  fs::remove_all(dir);
}

TEST(EventWriter, RecordByteLayout) {
  const std::string dir = fresh_dir("layout");
  std::string path;
  {
    EventWriter w(dir);
    path = w.path();
    w.add_scalar("loss", 1.5f, 7, 2.0);
  }
  const std::string f = read_bytes(path);
  ASSERT_GE(f.size(), 16u);
  const size_t first = 16 + le(f, 0, 8);  // skip the file-version record
  ASSERT_EQ(f.size(), first + 16 + 26) << "expected exactly one 26-byte record after the first";
  const std::string len_bytes = f.substr(first, 8);
  EXPECT_EQ(le(f, first, 8), 26u);
  EXPECT_EQ(le(f, first + 8, 4), masked_bitwise(len_bytes));
  EXPECT_EQ(le(f, first + 8, 4), 0x2DD89B12u);
  const std::string data = f.substr(first + 12, 26);
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\x00\x40", 9)  // 2.0
                               + std::string("\x10\x07", 2)                            // step 7
                               + std::string("\x2a\x0d", 2)               // summary, 13 bytes
                               + std::string("\x0a\x0b", 2)               // value, 11 bytes
                               + std::string("\x0a\x04loss", 6)           // tag
                               + std::string("\x15\x00\x00\xc0\x3f", 5);  // simple_value 1.5f
  EXPECT_EQ(data, expected);
  EXPECT_EQ(le(f, first + 12 + 26, 4), masked_bitwise(data));
  // The first record is framed the same way.
  EXPECT_EQ(le(f, 8, 4), masked_bitwise(f.substr(0, 8)));
  EXPECT_EQ(le(f, first - 4, 4), masked_bitwise(f.substr(12, first - 16)));
  fs::remove_all(dir);
}

TEST(EventWriter, RoundTripExact) {
  const std::string dir = fresh_dir("roundtrip");
  const std::string long_tag = "train/" + std::string(200, 'x');  // two-byte length varint
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<ScalarEvent> want = {
      {0, 1700000000.123456, "loss", 2.5f},
      {1, 1700000000.5, "loss", -3.25e-5f},
      {127, 1700000001.0, "lr", 6e-4f},
      {128, 1700000002.0, "lr", std::numeric_limits<float>::denorm_min()},
      {300, 1700000003.0, long_tag, std::numeric_limits<float>::max()},
      {-1, 0.0, "neg_step", -0.0f},
      {std::numeric_limits<int64_t>::min(), -1.5, "min_step", std::numeric_limits<float>::lowest()},
      {std::numeric_limits<int64_t>::max(), 1e300, "max_step", std::numeric_limits<float>::min()},
      {int64_t{1} << 40, 123.0, "\xe6\x8d\x9f\xe5\xa4\xb1/utf8", 1e30f},
      {5, 5.0, "inf", std::numeric_limits<float>::infinity()},
      {6, 6.0, "nan", nan},
      {7, 7.5, "a", 1.0f},  // three values in one event
      {7, 7.5, "b", -2.0f},
      {7, 7.5, "", 3.0f},
  };
  std::string path;
  {
    EventWriter w(dir);
    path = w.path();
    for (size_t i = 0; i + 3 < want.size(); ++i)
      w.add_scalar(want[i].tag, want[i].value, want[i].step, want[i].wall_time);
    w.add_scalars(7, 7.5, {{"a", 1.0f}, {"b", -2.0f}, {"", 3.0f}});
    w.add_scalars(8, 8.0, {});  // writes nothing
  }
  EXPECT_EQ(read_records(path).size(), 1 + (want.size() - 3) + 1);
  const std::vector<ScalarEvent> got = read_scalar_events(path);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].step, want[i].step);
    EXPECT_EQ(got[i].tag, want[i].tag);
    double g = got[i].wall_time, e = want[i].wall_time;
    EXPECT_EQ(std::memcmp(&g, &e, 8), 0) << g << " vs " << e;
    EXPECT_EQ(float_bits(got[i].value), float_bits(want[i].value))
        << got[i].value << " vs " << want[i].value;
  }
  fs::remove_all(dir);
}

TEST(EventWriter, OnlyWholeRecordsReachTheFile) {
  const std::string dir = fresh_dir("flush");
  EventWriter w(dir);
  const auto size0 = fs::file_size(w.path());
  w.add_scalar("x", 1.0f, 1, 1.0);
  EXPECT_EQ(fs::file_size(w.path()), size0);  // buffered until flush
  w.flush();
  ASSERT_EQ(read_scalar_events(w.path()).size(), 1u);
  // Past the buffer limit records are written while the writer is open; the file must always
  // hold whole records.
  for (int i = 0; i < 20000; ++i) {
    w.add_scalar("step/" + std::to_string(i % 7), static_cast<float>(i), i, i);
    if (i % 2500 == 0) {
      ASSERT_NO_THROW(read_records(w.path())) << i;
    }
  }
  EXPECT_GT(read_scalar_events(w.path()).size(), 1u);
  w.flush();
  const auto got = read_scalar_events(w.path());
  ASSERT_EQ(got.size(), 20001u);
  EXPECT_EQ(got.back().step, 19999);
  EXPECT_EQ(got.back().value, 19999.0f);
  fs::remove_all(dir);
}

TEST(EventReader, TruncatedFile) {
  const std::string dir = fresh_dir("trunc");
  std::string path;
  {
    EventWriter w(dir);
    path = w.path();
    w.add_scalar("a", 1.0f, 1, 1.0);
    w.add_scalar("b", 2.0f, 2, 2.0);
  }
  const std::string f = read_bytes(path);
  write_bytes(path, f.substr(0, f.size() - 3));  // inside the last data crc
  expect_error(path, {"record 2", "truncated record"});
  const size_t first = 16 + le(f, 0, 8);
  write_bytes(path, f.substr(0, first + 5));  // inside the second record's length
  expect_error(path, {"record 1", "truncated record"});
  write_bytes(path, f.substr(0, first + 14));  // header whole, data cut
  expect_error(path, {"record 1", "truncated record"});
  fs::remove_all(dir);
}

TEST(EventReader, CorruptedBytes) {
  const std::string dir = fresh_dir("flip");
  std::string path;
  {
    EventWriter w(dir);
    path = w.path();
    w.add_scalar("loss", 1.0f, 1, 1.0);
    w.add_scalar("loss", 2.0f, 2, 2.0);
  }
  const std::string f = read_bytes(path);
  const size_t first = 16 + le(f, 0, 8);
  const size_t second = first + 16 + le(f, first, 8);
  ASSERT_EQ(read_scalar_events(path).size(), 2u);
  std::string g = f;
  g[second + 12 + 20] ^= 0x01;  // a byte of the third record's data
  write_bytes(path, g);
  expect_error(path, {"record 2", "data crc mismatch"});
  g = f;
  g[first + 3] ^= 0x40;  // a length byte of the second record
  write_bytes(path, g);
  expect_error(path, {"record 1", "length crc mismatch"});
  g = f;
  g[first - 1] ^= 0x80;  // the stored data crc of the first record
  write_bytes(path, g);
  expect_error(path, {"record 0", "data crc mismatch"});
  fs::remove_all(dir);
}

TEST(EventReader, SkipsUnknownFieldsByWireType) {
  const std::string dir = fresh_dir("unknown");
  fs::create_directories(dir);
  const std::string path = dir + "/events.out.tfevents.0000000000.test";
  // A Value without simple_value (a TF2-style tensor summary) is left out; the other carries
  // unknown fields around the known ones.
  const std::string tensor_value = len_field(1, "tensor_tag") + len_field(8, "\x08\x01");
  const std::string value = len_field(7, "node") + len_field(1, "wanted") +
                            len_field(9, len_field(1, "meta")) + float_field(2, -7.75f) +
                            key(20, 0) + varint(300);
  const std::string summary =
      len_field(1, tensor_value) + len_field(1, value) + key(2, 5) + le_bytes(0xdeadbeef, 4);
  // A group holding a nested group and fields that would look like Event fields if not skipped.
  const std::string group = key(44, 3) + key(2, 0) + varint(999) + key(45, 3) +
                            double_field(1, 99.0) + key(45, 4) + len_field(5, "junk") + key(44, 4);
  const std::string event =
      key(40, 0) + varint(uint64_t{1} << 62) +                                     // varint
      key(41, 1) + le_bytes(0x0102030405060708, 8) +                               // fixed64
      len_field(42, len_field(1, len_field(1, "bogus") + float_field(2, 1.0f))) +  // bytes
      key(43, 5) + le_bytes(0x11223344, 4) +                                       // fixed32
      group + len_field(5, summary) + key(2, 2) + varint(1) +
      "x" +  // known number, wrong wire type: skipped like protobuf
      double_field(1, 42.5) + key(2, 0) + varint(12345);  // after the summary
  write_bytes(path, frame(len_field(3, "brain.Event:2")) + frame(event));
  EXPECT_EQ(read_file_version(path), "brain.Event:2");
  const auto got = read_scalar_events(path);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tag, "wanted");
  EXPECT_EQ(got[0].value, -7.75f);
  EXPECT_EQ(got[0].step, 12345);
  EXPECT_EQ(got[0].wall_time, 42.5);
  fs::remove_all(dir);
}

TEST(EventReader, MalformedPayloadNamesRecord) {
  const std::string dir = fresh_dir("malformed");
  fs::create_directories(dir);
  const std::string path = dir + "/events.out.tfevents.0000000000.test";
  const std::string good = double_field(1, 1.0) + len_field(3, "brain.Event:2");
  write_bytes(path, frame(good) + frame(key(5, 2) + varint(50) + "short"));
  expect_error(path, {"record 1", "malformed event"});
  write_bytes(path, frame(good) + frame(key(44, 3) + key(2, 0) + varint(1)));  // unclosed group
  expect_error(path, {"record 1", "malformed event"});
  write_bytes(path, frame(good) + frame(key(44, 3) + key(45, 4)));  // mismatched end group
  expect_error(path, {"record 1", "malformed event"});
  write_bytes(path, frame(good) + frame(key(6, 7)));  // invalid wire type
  expect_error(path, {"record 1", "malformed event"});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kuai::log
