// Interoperability of kuai's safetensors reader/writer with an independent implementation
// (tests/io/fixtures/make_safetensors_fixture.py, plain Python json + struct): kuai reads the
// committed fixture exactly, and the script verifies a file kuai writes. Also the validation of
// SafetensorsFile::parse (the in-memory entry point the fuzzer drives, sharing open()'s checks):
// one test per class of malformed input, each asserting the error names the file and the check.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/core/dtype.h"
#include "kuai/io/safetensors.h"
#include "kuai/io/tensor_io.h"

namespace kuai::io {
namespace {

namespace fs = std::filesystem;

const std::string kFixtureDir = std::string(KUAI_SOURCE_DIR) + "/tests/io/fixtures";
const std::string kFixture = kFixtureDir + "/independent.safetensors";
const std::string kScript = kFixtureDir + "/make_safetensors_fixture.py";

std::vector<uint8_t> bytes_of(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsEntry* entry = file.find(name);
  if (entry == nullptr) return {};
  const auto span = file.data(*entry);
  std::vector<uint8_t> out(span.size());
  if (!span.empty()) std::memcpy(out.data(), span.data(), span.size());
  return out;
}

template <typename T>
std::vector<uint8_t> le_bytes(const std::vector<T>& values) {
  std::vector<uint8_t> out(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

TEST(SafetensorsInterop, ReadsTheIndependentFixtureExactly) {
  const SafetensorsFile file = SafetensorsFile::open(kFixture);

  // Entries come in header order, which differs from the order of the data section.
  struct Expected {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  const std::vector<Expected> expected = {
      {"weight",
       "F32",
       {2, 3},
       le_bytes<uint32_t>(
           {0x3f800000u, 0xc0200000u, 0x40500000u, 0x00000000u, 0x80000000u, 0x477fe000u})},
      {"scalar", "F32", {}, le_bytes<uint32_t>({0x3dcccccdu})},  // 0.1 rounded to float32
      {"ids", "I32", {4}, le_bytes<int32_t>({7, -8, INT32_MAX, INT32_MIN})},
      {"half.bf16", "BF16", {3}, le_bytes<uint16_t>({0x3f80, 0xc040, 0x7f80})},
      {"half.f16", "F16", {2, 2}, le_bytes<uint16_t>({0x3c00, 0xc000, 0x3800, 0x7bff})},
      {"bytes", "U8", {5}, {0, 1, 127, 128, 255}},
      {"empty", "F32", {0, 3}, {}},
  };
  ASSERT_EQ(file.entries().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const SafetensorsEntry& entry = file.entries()[i];
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(entry.name, expected[i].name);
    EXPECT_EQ(entry.dtype, expected[i].dtype);
    EXPECT_EQ(entry.shape, expected[i].shape);
    EXPECT_EQ(bytes_of(file, expected[i].name), expected[i].bytes);
  }
  EXPECT_EQ(file.find("bytes")->begin, 0u);  // data laid out by name, not header order
  EXPECT_EQ(file.find("empty")->begin, 5u);
  EXPECT_EQ(file.find("empty")->end, 5u);
  EXPECT_NE(file.data(*file.find("empty")).data(), nullptr);  // safe to memcpy from

  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"source", "make_safetensors_fixture.py"},
                                                       {"note", "caf\xc3\xa9 \"quoted\""}};
  EXPECT_EQ(file.metadata(), metadata);

  // Through the Tensor bridge, values decode as the script meant them (unaligned data included).
  EXPECT_EQ(read_tensor(file, "weight").to_vector<float>(),
            (std::vector<float>{1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 65504.0f}));
  EXPECT_EQ(read_tensor(file, "scalar").item(), 0.1f);
  const auto half = read_tensor(file, "half.f16").to_vector<uint16_t>();
  std::vector<float> widened;
  for (uint16_t h : half) widened.push_back(f16_to_float(h));
  EXPECT_EQ(widened, (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f}));
  const auto bf16 = read_tensor(file, "half.bf16").to_vector<uint16_t>();
  EXPECT_EQ(bf16_to_float(bf16[1]), -3.0f);
  EXPECT_EQ(read_tensor(file, "empty").shape(), (Shape{0, 3}));

  // parse() of the same bytes gives the same result.
  std::ifstream in(kFixture, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> owned(raw.size());
  std::memcpy(owned.data(), raw.data(), raw.size());
  const SafetensorsFile parsed = SafetensorsFile::parse(std::move(owned), "fixture-in-memory");
  EXPECT_EQ(parsed.path(), "fixture-in-memory");
  ASSERT_EQ(parsed.entries().size(), expected.size());
  for (const auto& e : expected) EXPECT_EQ(bytes_of(parsed, e.name), e.bytes) << e.name;
  EXPECT_EQ(parsed.metadata(), metadata);
}

bool python3_available() { return std::system("command -v python3 >/dev/null 2>&1") == 0; }

// Runs the script's --check on `path`; true when it exits 0. `quiet`: its report is dropped
// (for checks expected to fail).
bool python_check(const std::string& path, bool quiet = false) {
  const std::string command =
      "python3 '" + kScript + "' --check '" + path + "'" + (quiet ? " >/dev/null 2>&1" : "");
  const int status = std::system(command.c_str());
  return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

class SafetensorsInteropWrite : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / "kuai_test_safetensors_interop";
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SafetensorsInteropWrite, PythonVerifiesAFileKuaiWrites) {
  if (!python3_available()) GTEST_SKIP() << "python3 is not on PATH: interop check skipped";
  const std::vector<float> f32 = {1.5f, -2.0f, 0.1f, 3.4028235e38f, -1e-40f, 0.0f};
  const std::vector<uint16_t> bf16 = {float_to_bf16(1.0f), float_to_bf16(-0.1f), 0x7f80};
  const std::vector<uint16_t> f16 = {float_to_f16(0.5f), float_to_f16(-65504.0f)};
  const std::vector<int32_t> i32 = {0, -1, INT32_MAX, INT32_MIN};
  const std::vector<int64_t> i64 = {int64_t{1} << 53, -3};
  const std::vector<uint8_t> u8 = {255, 0, 7};
  const float scalar = 2.75f;
  const std::vector<SafetensorsView> views = {
      {"h.0.attn.c_attn.weight", "F32", {3, 2}, f32.data(), 24},
      {"scalar", "F32", {}, &scalar, 4},
      {"b", "BF16", {3}, bf16.data(), 6},
      {"f", "F16", {1, 2}, f16.data(), 4},
      {"empty", "F32", {0, 3}, nullptr, 0},
      {"i", "I32", {2, 2}, i32.data(), 16},
      {"l", "I64", {2}, i64.data(), 16},
      {"u", "U8", {3}, u8.data(), 3},
  };
  const std::map<std::string, std::string> metadata = {{"kuai.format", "weights"},
                                                       {"note", "caf\xc3\xa9"}};
  const std::string path = (dir_ / "kuai.safetensors").string();
  write_safetensors(path, views, metadata);

  nlohmann::json tensors = nlohmann::json::array();
  auto add = [&](const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                 nlohmann::json values) {
    tensors.push_back({{"name", name}, {"dtype", dtype}, {"shape", shape}, {"values", values}});
  };
  add("h.0.attn.c_attn.weight", "F32", {3, 2}, f32);  // floats widen to double exactly
  add("scalar", "F32", {}, {scalar});
  add("b", "BF16", {3}, bf16);
  add("f", "F16", {1, 2}, f16);
  add("empty", "F32", {0, 3}, nlohmann::json::array());
  add("i", "I32", {2, 2}, i32);
  add("l", "I64", {2}, i64);
  add("u", "U8", {3}, u8);
  const nlohmann::json expect = {{"tensors", tensors}, {"metadata", metadata}};
  {
    std::ofstream out(path + ".expect.json");
    out << expect.dump(2);
  }
  EXPECT_TRUE(python_check(path)) << "the independent checker rejected " << path;

  // The checker really checks: a wrong expected value, and a kuai file with a byte flipped.
  nlohmann::json wrong = expect;
  wrong["tensors"][0]["values"][2] = 0.2;
  {
    std::ofstream out(path + ".expect.json");
    out << wrong.dump(2);
  }
  EXPECT_FALSE(python_check(path, true));
  {
    std::ofstream out(path + ".expect.json");
    out << expect.dump(2);
  }
  {
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(-1, std::ios::end);  // the last U8 element
    io.put(static_cast<char>(8));
  }
  EXPECT_FALSE(python_check(path, true));
}

// ---- validation of parse(): one test per class of malformed input ----

// A file in memory: honest u64 length prefix, `header` verbatim, then `data`.
std::vector<std::byte> make_file(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<std::byte> bytes(8 + header.size() + data.size());
  const uint64_t length = header.size();
  std::memcpy(bytes.data(), &length, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(bytes.data() + 8 + header.size(), data.data(), data.size());
  return bytes;
}

// Expects parse() to throw naming "mem.safetensors" and containing `check`.
void expect_parse_error(std::vector<std::byte> bytes, const std::string& check) {
  const std::string name = "mem.safetensors";
  try {
    SafetensorsFile::parse(std::move(bytes), name);
    ADD_FAILURE() << "expected parse to throw with \"" << check << "\"";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(name + ": ", 0), 0u) << message;
    EXPECT_NE(message.find(check), std::string::npos) << message;
  }
}

// "{a,b,...}" of header fields.
std::string object(std::initializer_list<std::string> fields) {
  std::string text = "{";
  for (const std::string& field : fields) text.append(text.size() > 1 ? "," : "").append(field);
  return text.append("}");
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t begin, uint64_t end) {
  return std::string("\"")
      .append(name)
      .append("\":{\"dtype\":\"")
      .append(dtype)
      .append("\",\"shape\":")
      .append(shape)
      .append(",\"data_offsets\":[")
      .append(std::to_string(begin))
      .append(",")
      .append(std::to_string(end))
      .append("]}");
}

TEST(SafetensorsParse, AcceptsOutOfOrderOffsetsThatTileTheData) {
  const auto file = SafetensorsFile::parse(
      make_file(object({entry("a", "U8", "[2]", 2, 4), entry("e", "F32", "[0]", 2, 2),
                        entry("b", "U8", "[2]", 0, 2), entry("z", "I32", "[3,0]", 4, 4)}),
                {1, 2, 3, 4}),
      "ok");
  ASSERT_EQ(file.entries().size(), 4u);
  EXPECT_EQ(bytes_of(file, "a"), (std::vector<uint8_t>{3, 4}));
  EXPECT_EQ(bytes_of(file, "b"), (std::vector<uint8_t>{1, 2}));
  EXPECT_TRUE(bytes_of(file, "e").empty());
}

TEST(SafetensorsParse, RejectsTruncatedInput) {
  expect_parse_error({}, "smaller than the 8-byte header length (truncated file)");
  expect_parse_error(std::vector<std::byte>(7), "truncated file");
}

TEST(SafetensorsParse, RejectsHeaderLengthBeyondFile) {
  auto bytes = make_file("{}", {});
  const uint64_t length = 11;  // the file is 10 bytes: the prefix and "{}"
  std::memcpy(bytes.data(), &length, 8);
  expect_parse_error(bytes, "header length 11 exceeds file size 10");
  const uint64_t huge = ~uint64_t{0};
  std::memcpy(bytes.data(), &huge, 8);
  expect_parse_error(bytes, "header length 18446744073709551615 exceeds file size 10");
}

TEST(SafetensorsParse, RejectsNonObjectHeaders) {
  expect_parse_error(make_file("[]", {}), "header is not valid JSON");
  expect_parse_error(make_file("", {}), "header is not valid JSON");
  expect_parse_error(make_file("{\"a\":", {}), "header is not valid JSON");
  expect_parse_error(make_file("{\"a\":[1,2]}", {}), "tensor \"a\": entry is not a JSON object");
  expect_parse_error(make_file("{\"__metadata__\":[]}", {}), "__metadata__ is not a JSON object");
  expect_parse_error(make_file("{\"\":{}}", {}), "tensor with an empty name");
}

TEST(SafetensorsParse, RejectsDuplicateNames) {
  expect_parse_error(
      make_file(object({entry("x", "U8", "[1]", 0, 1), entry("x", "U8", "[1]", 1, 2)}), {1, 2}),
      "header has duplicate key \"x\"");
  expect_parse_error(make_file("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", {}),
                     "duplicate key \"k\"");
}

TEST(SafetensorsParse, RejectsOverlappingOffsets) {
  expect_parse_error(
      make_file(object({entry("x", "U8", "[3]", 0, 3), entry("y", "U8", "[2]", 2, 4)}),
                {1, 2, 3, 4}),
      "tensors \"x\" and \"y\" overlap in the data section");
  expect_parse_error(
      make_file(object({entry("y", "U8", "[2]", 0, 2), entry("x", "U8", "[2]", 0, 2)}), {1, 2}),
      "overlap in the data section");
  // An empty tensor may not sit inside another's bytes.
  expect_parse_error(
      make_file(object({entry("x", "U8", "[4]", 0, 4), entry("e", "U8", "[0]", 2, 2)}),
                {1, 2, 3, 4}),
      "tensors \"x\" and \"e\" overlap");
}

TEST(SafetensorsParse, RejectsGapsAndTrailingBytes) {
  expect_parse_error(
      make_file(object({entry("x", "U8", "[1]", 0, 1), entry("y", "U8", "[2]", 2, 4)}),
                {1, 2, 3, 4}),
      "gap of 1 bytes in the data section before tensor \"y\"");
  expect_parse_error(make_file(object({entry("x", "U8", "[2]", 0, 2)}), {1, 2, 3}),
                     "data section has 1 trailing bytes not covered by any tensor");
  expect_parse_error(make_file("{}", {9}), "data section has 1 trailing bytes");
}

TEST(SafetensorsParse, RejectsOffsetsBeyondTheFile) {
  expect_parse_error(make_file(object({entry("x", "F32", "[2]", 0, 8)}), {0, 0, 0, 0}),
                     "tensor \"x\": data_offsets end 8 out of bounds of data section of 4 bytes");
  expect_parse_error(make_file(object({entry("x", "U8", "[0]", 5, 5)}), {1, 2, 3, 4}),
                     "data_offsets end 5 out of bounds");
  expect_parse_error(
      make_file(
          "{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,18446744073709551616]}}",
          {1}),
      "data_offsets is not a pair of non-negative integers");
  expect_parse_error(
      make_file("{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", {1}),
      "data_offsets is not a pair");
  expect_parse_error(make_file(object({entry("x", "U8", "[0]", 3, 2)}), {1, 2, 3}),
                     "data_offsets begin 3 > end 2");
}

TEST(SafetensorsParse, RejectsSizeMismatch) {
  expect_parse_error(make_file(object({entry("x", "F32", "[3]", 0, 8)}), std::vector<uint8_t>(8)),
                     "size mismatch: shape [3] of F32 needs 12 bytes but data_offsets span 8");
  expect_parse_error(make_file(object({entry("x", "BF16", "[2,2]", 0, 4)}), {1, 2, 3, 4}),
                     "needs 8 bytes but data_offsets span 4");
  expect_parse_error(make_file(object({entry("x", "U8", "[]", 0, 0)}), {}),
                     "needs 1 bytes but data_offsets span 0");
}

TEST(SafetensorsParse, RejectsNegativeAndHugeDimensions) {
  expect_parse_error(make_file(object({entry("x", "F32", "[2,-1]", 0, 0)}), {}),
                     "tensor \"x\": shape has a negative dimension -1");
  expect_parse_error(make_file(object({entry("x", "F32", "[9223372036854775808]", 0, 0)}), {}),
                     "shape dimension too large");
  expect_parse_error(make_file(object({entry("x", "F32", "[1e3]", 0, 0)}), {}),
                     "non-integer dimension");
  expect_parse_error(make_file(object({entry("x", "U8", "[4294967296,4294967296]", 0, 0)}), {}),
                     "byte size of shape [4294967296, 4294967296] overflows");
  // Empty, but a stride would not fit in int64: refused too.
  expect_parse_error(make_file(object({entry("x", "F32", "[0,4611686018427387904,4]", 0, 0)}), {}),
                     "overflows");
  expect_parse_error(make_file(object({entry("x", "F32", "[2305843009213693952]", 0, 0)}), {}),
                     "overflows");
}

TEST(SafetensorsParse, RejectsDeepNesting) {
  const std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  expect_parse_error(make_file(deep, {}), "header nests deeper than 8 levels");
  expect_parse_error(
      make_file("{\"__metadata__\":{\"k\":{\"k\":{\"k\":{\"k\":{\"k\":{\"k\":{\"k\":{"
                "\"k\":{}}}}}}}}}}",
                {}),
      "header nests deeper than 8 levels");
}

// A header with very many keys is parsed in O(n log n): with nlohmann's ordered_json (linear key
// lookup) this one took minutes. Not a timing test: a regression shows up as a hang.
TEST(SafetensorsParse, ParsesAHeaderWithManyKeys) {
  std::string header = "{\"__metadata__\":{";
  for (int i = 0; i < 100000; ++i) {
    header.append(i ? ",\"k" : "\"k").append(std::to_string(i)).append("\":\"v\"");
  }
  header += "}";
  for (int i = 0; i < 20000; ++i) {
    header.append(",").append(entry(std::string("t").append(std::to_string(i)), "U8", "[0]", 0, 0));
  }
  header += "}";
  const auto file = SafetensorsFile::parse(make_file(header, {}), "wide");
  EXPECT_EQ(file.metadata().size(), 100000u);
  ASSERT_EQ(file.entries().size(), 20000u);
  EXPECT_EQ(file.entries()[0].name, "t0");  // header order, not sorted ("t1", "t10", ...)
  EXPECT_EQ(file.entries()[2].name, "t2");
  EXPECT_EQ(file.entries().back().name, "t19999");
}

TEST(SafetensorsParse, RejectsBadEntryFields) {
  expect_parse_error(make_file("{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],"
                               "\"extra\":1}}",
                               {1}),
                     "tensor \"x\": unknown field \"extra\"");
  expect_parse_error(make_file("{\"x\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", {1}),
                     "dtype is not a string");
  expect_parse_error(make_file("{\"x\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", {1}),
                     "missing shape");
  expect_parse_error(make_file("{\"x\":{\"dtype\":\"U8\",\"shape\":[1]}}", {1}),
                     "missing data_offsets");
  expect_parse_error(make_file("{\"__metadata__\":{\"k\":{}}}", {}),
                     "__metadata__ value of \"k\" is not a string");
}

}  // namespace
}  // namespace kuai::io
