// Tests of the safetensors reader/writer: round trips of several dtypes and shapes (scalar and
// zero-size included), metadata, and one test per class of corrupt file, each checking that
// the error names the file and the check that failed.
#include "kuai/io/safetensors.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace kuai::io {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the system temp directory, removed at the end of each test.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / "kuai_test_safetensors" / info->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // Writes `header` (unpadded JSON) with an honest length prefix, followed by `data`.
  std::string write_raw(const std::string& name, const std::string& header,
                        const std::vector<uint8_t>& data) const {
    const uint64_t length = header.size();
    std::string bytes(sizeof length, '\0');
    std::memcpy(bytes.data(), &length, sizeof length);
    bytes += header;
    bytes.append(reinterpret_cast<const char*>(data.data()), data.size());
    return write_bytes(name, bytes);
  }

  std::string write_bytes(const std::string& name, const std::string& bytes) const {
    const std::string path = file(name);
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }

  fs::path dir_;
};

// Expects opening `path` to throw with a message naming the file and containing `check`.
void expect_open_error(const std::string& path, const std::string& check) {
  try {
    SafetensorsFile::open(path);
    FAIL() << "expected open(" << path << ") to throw";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(check), std::string::npos) << message;
  }
}

template <typename T>
std::vector<T> read_as(const SafetensorsFile& file, const SafetensorsEntry& entry) {
  const auto bytes = file.data(entry);
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

TEST_F(SafetensorsTest, RoundTripsSeveralDtypesAndShapes) {
  const std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7f80};
  const std::vector<int32_t> i32 = {7, -8, 2147483647, -2147483647 - 1};
  const std::vector<int64_t> i64 = {int64_t{1} << 40};
  const std::vector<uint8_t> u8 = {0, 1, 254, 255, 9};
  const float scalar = 42.0f;
  const std::vector<SafetensorsView> views = {
      {"a.f32", "F32", {2, 3}, f32.data(), f32.size() * 4},
      {"b.bf16", "BF16", {3}, bf16.data(), bf16.size() * 2},
      {"c.i32", "I32", {2, 1, 2}, i32.data(), i32.size() * 4},
      {"d.scalar", "F32", {}, &scalar, 4},
      {"e.empty", "F16", {4, 0, 3}, nullptr, 0},
      {"f.i64", "I64", {1}, i64.data(), 8},
      {"g.u8", "U8", {5}, u8.data(), u8.size()},
  };
  const std::string path = file("round.safetensors");
  write_safetensors(path, views, {});
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  const auto st = SafetensorsFile::open(path);
  EXPECT_EQ(st.path(), path);
  ASSERT_EQ(st.entries().size(), views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const auto& entry = st.entries()[i];
    EXPECT_EQ(entry.name, views[i].name);  // header order is the write order
    EXPECT_EQ(entry.dtype, views[i].dtype);
    EXPECT_EQ(entry.shape, views[i].shape);
    EXPECT_EQ(entry.end - entry.begin, views[i].nbytes);
    EXPECT_EQ(st.find(views[i].name), &entry);
  }
  EXPECT_EQ(st.find("missing"), nullptr);
  EXPECT_EQ(read_as<float>(st, *st.find("a.f32")), f32);
  EXPECT_EQ(read_as<uint16_t>(st, *st.find("b.bf16")), bf16);
  EXPECT_EQ(read_as<int32_t>(st, *st.find("c.i32")), i32);
  EXPECT_EQ(read_as<float>(st, *st.find("d.scalar")), std::vector<float>{scalar});
  EXPECT_TRUE(st.data(*st.find("e.empty")).empty());
  EXPECT_EQ(read_as<int64_t>(st, *st.find("f.i64")), i64);
  EXPECT_EQ(read_as<uint8_t>(st, *st.find("g.u8")), u8);
  EXPECT_TRUE(st.metadata().empty());

  // The header is padded so the data section starts 8-byte aligned.
  uint64_t header_length = 0;
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(&header_length), sizeof header_length);
  EXPECT_EQ(header_length % 8, 0u);
}

TEST_F(SafetensorsTest, RoundTripsMetadataAndOverwritesAtomically) {
  const std::vector<float> values = {1, 2, 3};
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"n_layer", "2"}, {"note", "quotes \" and unicode \xc3\xa9"}};
  const std::string path = file("meta.safetensors");
  write_safetensors(path, {{"w", "F32", {3}, values.data(), 12}}, {{"old", "1"}});
  write_safetensors(path, {{"w", "F32", {3}, values.data(), 12}}, metadata);
  const auto st = SafetensorsFile::open(path);
  EXPECT_EQ(st.metadata(), metadata);
  EXPECT_EQ(read_as<float>(st, st.entries().at(0)), values);
}

TEST_F(SafetensorsTest, CopiesShareTheMapping) {
  const std::vector<int32_t> values = {5, 6};
  const std::string path = file("copy.safetensors");
  write_safetensors(path, {{"x", "I32", {2}, values.data(), 8}}, {});
  std::vector<SafetensorsFile> files;
  files.push_back(SafetensorsFile::open(path));
  const SafetensorsFile copy = files.front();
  files.clear();
  EXPECT_EQ(read_as<int32_t>(copy, *copy.find("x")), values);
}

TEST_F(SafetensorsTest, WriterRejectsInvalidViews) {
  const std::vector<float> values = {1, 2};
  const std::string path = file("bad_write.safetensors");
  EXPECT_THROW(write_safetensors(path, {{"x", "F32", {3}, values.data(), 8}}, {}),
               std::runtime_error);
  EXPECT_THROW(write_safetensors(path, {{"x", "Q4", {2}, values.data(), 8}}, {}),
               std::runtime_error);
  EXPECT_THROW(
      write_safetensors(
          path, {{"x", "F32", {2}, values.data(), 8}, {"x", "F32", {2}, values.data(), 8}}, {}),
      std::runtime_error);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST_F(SafetensorsTest, RejectsTruncatedFile) {
  expect_open_error(write_bytes("empty.safetensors", ""), "truncated");
  expect_open_error(write_bytes("short.safetensors", std::string(5, '\0')), "truncated");
}

TEST_F(SafetensorsTest, RejectsTruncatedData) {
  std::vector<float> values(4, 1.0f);
  const std::string path = file("cut.safetensors");
  write_safetensors(path, {{"x", "F32", {4}, values.data(), 16}}, {});
  fs::resize_file(path, fs::file_size(path) - 4);
  expect_open_error(path, "out of bounds");
}

TEST_F(SafetensorsTest, RejectsHeaderLengthBeyondFile) {
  std::string bytes(8, '\0');
  const uint64_t length = 1234567;
  std::memcpy(bytes.data(), &length, 8);
  bytes += std::string(392, ' ');
  const std::string path = write_bytes("tiny.safetensors", bytes);
  expect_open_error(path, "header length 1234567 exceeds file size 400");
}

TEST_F(SafetensorsTest, RejectsHeaderLengthBeyondLimit) {
  // A sparse file big enough to hold the claimed header, so only the 100 MB limit trips.
  std::string bytes(8, '\0');
  const uint64_t length = kMaxSafetensorsHeaderBytes + 8;
  std::memcpy(bytes.data(), &length, 8);
  const std::string path = write_bytes("huge.safetensors", bytes);
  fs::resize_file(path, 8 + length);
  expect_open_error(path, "exceeds the limit of 104857600 bytes");
}

TEST_F(SafetensorsTest, RejectsInvalidJson) {
  expect_open_error(write_raw("json1.safetensors", "{\"x\": {\"dtype\": \"F32\",", {}),
                    "not valid JSON");
  expect_open_error(write_raw("json2.safetensors", "[1, 2]", {}), "not valid JSON");
  expect_open_error(write_raw("json3.safetensors", "\"str\"", {}), "not valid JSON");
  expect_open_error(write_raw("json4.safetensors", "{} trailing", {}), "not valid JSON");
  expect_open_error(write_raw("dup.safetensors",
                              R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                              R"("x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                              {1}),
                    "duplicate key");
  expect_open_error(write_raw("meta.safetensors", R"({"__metadata__":{"a":1}})", {}),
                    "__metadata__");
}

TEST_F(SafetensorsTest, RejectsDataOffsetsOutOfBounds) {
  expect_open_error(
      write_raw("oob.safetensors", R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                {0, 0, 0, 0}),
      "out of bounds");
  expect_open_error(
      write_raw("rev.safetensors", R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})",
                {0, 0, 0, 0}),
      "data_offsets begin 4 > end 0");
  expect_open_error(
      write_raw("neg.safetensors", R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})",
                {0, 0, 0, 0}),
      "data_offsets");
  expect_open_error(write_raw("overlap.safetensors",
                              R"({"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                              R"("y":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                              {1, 2, 3, 4}),
                    "overlap");
}

TEST_F(SafetensorsTest, RejectsSizeShapeMismatch) {
  expect_open_error(
      write_raw("size.safetensors", R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                std::vector<uint8_t>(8)),
      "size mismatch");
  expect_open_error(
      write_raw("overflow.safetensors",
                R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
                {}),
      "overflows");
  expect_open_error(write_raw("negdim.safetensors",
                              R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", {}),
                    "negative dimension");
  expect_open_error(write_raw("fdim.safetensors",
                              R"({"x":{"dtype":"F32","shape":[1.5],"data_offsets":[0,0]}})", {}),
                    "non-integer dimension");
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  expect_open_error(
      write_raw("dtype.safetensors", R"({"x":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})",
                std::vector<uint8_t>(4)),
      "unknown dtype \"F33\"");
  expect_open_error(write_raw("nodtype.safetensors", R"({"x":{"shape":[1],"data_offsets":[0,4]}})",
                              std::vector<uint8_t>(4)),
                    "missing dtype");
}

TEST_F(SafetensorsTest, RejectsMissingFile) {
  expect_open_error(file("does_not_exist.safetensors"), "cannot open");
}

}  // namespace
}  // namespace kuai::io
