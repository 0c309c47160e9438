// Tests of the weights-only export: f32 round trips bit for bit, bf16 stores the RNE-rounded
// weights in half the bytes and reloads within bf16 precision, the metadata is complete, and a
// damaged or mismatched file (bit flip, truncation, header edit, other config, missing or extra
// tensor) is refused with an error naming the file and the check, leaving the model untouched.
#include "kuai/io/export.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/core/version.h"
#include "kuai/io/checksum.h"
#include "kuai/io/safetensors.h"

namespace kuai::io {
namespace {

namespace fs = std::filesystem;

nn::GPTConfig small_config() {
  nn::GPTConfig cfg;
  cfg.vocab_size = 256;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.d_model = 64;
  cfg.seq_len = 64;
  return cfg;
}

// Every parameter's bytes, by name.
std::map<std::string, std::vector<uint8_t>> param_bytes(const nn::GPT& model) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor c = p.contiguous();
    std::vector<uint8_t> bytes(static_cast<size_t>(c.nbytes()));
    std::memcpy(bytes.data(), c.raw_data(), bytes.size());
    out.emplace(name, std::move(bytes));
  }
  return out;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / "kuai_test_export" / info->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // Exports a fresh model (seed 1) to `name` and returns the path.
  std::string exported(const std::string& name, ExportOptions options = {}) {
    const std::string path = file(name);
    export_weights(path, source_, options);
    return path;
  }

  // Rewrites `src` to `dst` through the format-level API: metadata edited by `edit`, tensors
  // in `drop` left out, and (if `extra`) one more tensor appended.
  std::string rewrite(const std::string& src, const std::string& dst_name,
                      const std::function<void(std::map<std::string, std::string>&)>& edit,
                      const std::set<std::string>& drop = {}, bool extra = false) {
    const SafetensorsFile in = SafetensorsFile::open(src);
    std::map<std::string, std::string> metadata = in.metadata();
    if (edit) edit(metadata);
    std::vector<SafetensorsView> views;
    for (const SafetensorsEntry& e : in.entries()) {
      if (drop.count(e.name)) continue;
      const auto bytes = in.data(e);
      views.push_back({e.name, e.dtype, e.shape, bytes.data(), bytes.size()});
    }
    const float one = 1.0f;
    if (extra) views.push_back({"lm_head.weight", "F32", {}, &one, 4});
    const std::string dst = file(dst_name);
    write_safetensors(dst, views, metadata);
    return dst;
  }

  // Expects load_weights(path, target_) to throw naming `path` and containing `check`, and the
  // target's parameters to be unchanged.
  void expect_load_error(const std::string& path, const std::string& check) {
    const auto before = param_bytes(target_);
    try {
      load_weights(path, target_);
      ADD_FAILURE() << "expected load_weights(" << path << ") to throw with \"" << check << "\"";
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find(check), std::string::npos) << message;
    }
    EXPECT_EQ(param_bytes(target_), before) << "a failed load changed the model";
  }

  fs::path dir_;
  nn::GPT source_{small_config(), 1};
  nn::GPT target_{small_config(), 2};
};

TEST_F(ExportTest, F32RoundTripIsBitExact) {
  const std::string path = exported("w.safetensors", {DType::kF32, 1234, "gpt2"});
  ASSERT_NE(param_bytes(source_), param_bytes(target_));
  load_weights(path, target_);
  EXPECT_EQ(param_bytes(target_), param_bytes(source_));

  const WeightsInfo info = read_weights_info(path);
  EXPECT_EQ(info.step, 1234);
  EXPECT_EQ(info.tokenizer, "gpt2");
  EXPECT_EQ(info.dtype, DType::kF32);
  EXPECT_EQ(info.version, kKuaiVersion);
  EXPECT_EQ(info.model.vocab_size, 256);
  EXPECT_EQ(info.model.n_layer, 2);
  EXPECT_EQ(info.model.n_head, 2);
  EXPECT_EQ(info.model.d_model, 64);
  EXPECT_EQ(info.model.seq_len, 64);
}

TEST_F(ExportTest, MetadataFieldsArePresent) {
  const std::string path = exported("w.safetensors", {DType::kBF16, 77, "byte"});
  const SafetensorsFile st = SafetensorsFile::open(path);
  const auto& meta = st.metadata();
  EXPECT_EQ(meta.at("kuai.format"), "weights");
  EXPECT_EQ(meta.at("kuai.version"), kKuaiVersion);
  EXPECT_EQ(meta.at("kuai.step"), "77");
  EXPECT_EQ(meta.at("kuai.tokenizer"), "byte");
  EXPECT_EQ(meta.at("kuai.dtype"), "bf16");
  EXPECT_EQ(
      nlohmann::json::parse(meta.at("kuai.model")),
      nlohmann::json(
          {{"vocab_size", 256}, {"n_layer", 2}, {"n_head", 2}, {"d_model", 64}, {"seq_len", 64}}));
  const auto checksums = nlohmann::json::parse(meta.at("kuai.checksums"));
  const auto params = source_.named_parameters();
  ASSERT_EQ(st.entries().size(), params.size());
  EXPECT_EQ(checksums.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const SafetensorsEntry& e = st.entries()[i];
    EXPECT_EQ(e.name, params[i].first);  // GPT-2 names, in named_parameters() order
    EXPECT_EQ(e.shape, params[i].second.shape());
    const auto bytes = st.data(e);
    EXPECT_EQ(checksums.at(e.name), xxh3_hex(bytes.data(), bytes.size())) << e.name;
  }
  EXPECT_NE(st.find("wte.weight"), nullptr);
  EXPECT_NE(st.find("h.1.attn.c_attn.weight"), nullptr);
  EXPECT_NE(st.find("ln_f.bias"), nullptr);
}

TEST_F(ExportTest, Bf16StoresRoundedWeightsAndReloadsWithinPrecision) {
  const std::string path = exported("w16.safetensors", {DType::kBF16, 0, "byte"});
  const SafetensorsFile st = SafetensorsFile::open(path);
  for (const auto& [name, p] : source_.named_parameters()) {
    const SafetensorsEntry* e = st.find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(e->dtype, "BF16");
    const auto values = p.to_vector<float>();
    std::vector<uint16_t> expected;
    for (float v : values) expected.push_back(float_to_bf16(v));
    std::vector<uint16_t> stored(values.size());
    const auto bytes = st.data(*e);
    ASSERT_EQ(bytes.size(), stored.size() * 2);
    std::memcpy(stored.data(), bytes.data(), bytes.size());
    EXPECT_EQ(stored, expected) << name;
  }

  load_weights(path, target_);
  const auto src = source_.named_parameters();
  const auto dst = target_.named_parameters();
  for (size_t i = 0; i < src.size(); ++i) {
    const auto a = src[i].second.to_vector<float>();
    const auto b = dst[i].second.to_vector<float>();
    ASSERT_EQ(a.size(), b.size());
    for (size_t j = 0; j < a.size(); ++j) {
      EXPECT_EQ(b[j], bf16_to_float(float_to_bf16(a[j])));
      // bf16 keeps 8 significant bits; RNE errs by at most half an ulp, 2^-8 relative.
      ASSERT_LE(std::fabs(b[j] - a[j]), std::ldexp(std::fabs(a[j]), -8)) << src[i].first;
    }
  }
  EXPECT_EQ(read_weights_info(path).dtype, DType::kBF16);
}

TEST_F(ExportTest, Bf16FileIsAboutHalfTheSize) {
  const auto f32 = fs::file_size(exported("w32.safetensors", {DType::kF32}));
  const auto bf16 = fs::file_size(exported("w16.safetensors", {DType::kBF16}));
  const double ratio = static_cast<double>(f32) / static_cast<double>(bf16);
  EXPECT_GT(ratio, 1.95);
  EXPECT_LE(ratio, 2.0);
}

TEST_F(ExportTest, RejectsABitFlipInTensorData) {
  const std::string path = exported("w.safetensors");
  const SafetensorsFile st = SafetensorsFile::open(path);
  const SafetensorsEntry* e = st.find("h.1.mlp.c_fc.weight");
  ASSERT_NE(e, nullptr);
  uint64_t header_length = 0;
  {
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(&header_length), 8);
  }
  const uint64_t at = 8 + header_length + e->begin + 101;
  {
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(at));
    const char byte = static_cast<char>(io.get());
    io.seekp(static_cast<std::streamoff>(at));
    io.put(static_cast<char>(byte ^ 0x10));
  }
  expect_load_error(path, "checksum mismatch for h.1.mlp.c_fc.weight");
}

TEST_F(ExportTest, RejectsATruncatedFile) {
  const std::string path = exported("w.safetensors");
  fs::resize_file(path, fs::file_size(path) - 100);
  expect_load_error(path, "out of bounds of data section");
  fs::resize_file(path, 6);
  expect_load_error(path, "truncated file");
  EXPECT_THROW(read_weights_info(path), std::runtime_error);
}

TEST_F(ExportTest, RejectsHeaderEdits) {
  const std::string path = exported("w.safetensors");
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto edited = [&](const std::string& name, const std::string& from, const std::string& to) {
    std::string copy = bytes;
    const size_t at = copy.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    copy.replace(at, from.size(), to);  // same length: offsets stay valid
    const std::string out = file(name);
    std::ofstream(out, std::ios::binary)
        .write(copy.data(), static_cast<std::streamsize>(copy.size()));
    return out;
  };
  expect_load_error(edited("format.safetensors", "\"weights\"", "\"weighta\""),
                    "not a kuai weights export");
  expect_load_error(edited("dtype.safetensors", "\"dtype\":\"F32\"", "\"dtype\":\"I32\""),
                    "tensor \"wte.weight\" is I32 but \"kuai.dtype\" says f32");
  expect_load_error(edited("shape.safetensors", "\"shape\":[256,64]", "\"shape\":[64,256]"),
                    "shape mismatch for \"wte.weight\": file has [64, 256], model [256, 64]");
  expect_load_error(edited("json.safetensors", "{\"__metadata__\"", "[\"__metadata__\""),
                    "header is not valid JSON");
  // A checksum edited in the header no longer matches the data.
  const SafetensorsFile st = SafetensorsFile::open(path);
  const auto checksums = nlohmann::json::parse(st.metadata().at("kuai.checksums"));
  std::string sum = checksums.at("h.0.attn.c_proj.weight");  // unique (LayerNorms repeat)
  std::string other = sum;
  other.back() = other.back() == '0' ? '1' : '0';
  expect_load_error(edited("sum.safetensors", sum, other),
                    "checksum mismatch for h.0.attn.c_proj.weight");
}

TEST_F(ExportTest, RejectsAConfigMismatch) {
  const std::string path = exported("w.safetensors");
  nn::GPTConfig cfg = small_config();
  cfg.n_layer = 1;
  nn::GPT other(cfg, 3);
  try {
    load_weights(path, other);
    FAIL() << "expected a config mismatch";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("config mismatch: file has n_layer 2, model 1"), std::string::npos)
        << message;
  }
}

TEST_F(ExportTest, RejectsMissingAndExtraTensors) {
  const std::string path = exported("w.safetensors");
  expect_load_error(rewrite(path, "missing.safetensors", nullptr, {"ln_f.bias"}),
                    "missing tensor \"ln_f.bias\"");
  expect_load_error(rewrite(path, "extra.safetensors", nullptr, {}, true),
                    "unexpected tensor \"lm_head.weight\"");
}

TEST_F(ExportTest, ReadWeightsInfoIsStrict) {
  const std::string path = exported("w.safetensors");
  auto expect_info_error = [&](const std::string& name,
                               const std::function<void(std::map<std::string, std::string>&)>& edit,
                               const std::string& check) {
    const std::string bad = rewrite(path, name, edit);
    try {
      read_weights_info(bad);
      ADD_FAILURE() << "expected read_weights_info to throw with \"" << check << "\"";
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(bad), std::string::npos) << message;
      EXPECT_NE(message.find(check), std::string::npos) << message;
    }
    expect_load_error(bad, check);
  };
  expect_info_error(
      "noformat.safetensors", [](auto& m) { m.erase("kuai.format"); },
      "missing metadata \"kuai.format\"");
  expect_info_error(
      "full.safetensors", [](auto& m) { m["kuai.format"] = "full"; },
      "\"kuai.format\" is \"full\", expected \"weights\"");
  expect_info_error(
      "noversion.safetensors", [](auto& m) { m.erase("kuai.version"); },
      "missing metadata \"kuai.version\"");
  expect_info_error(
      "nomodel.safetensors", [](auto& m) { m.erase("kuai.model"); },
      "missing metadata \"kuai.model\"");
  expect_info_error(
      "modeljson.safetensors", [](auto& m) { m["kuai.model"] = "{\"n_layer\":"; },
      "metadata \"kuai.model\" is not valid JSON");
  expect_info_error(
      "modelfield.safetensors",
      [](auto& m) {
        m["kuai.model"] = R"({"vocab_size":256,"n_layer":2,"n_head":2,"d_model":64})";
      },
      "metadata \"kuai.model\" has no \"seq_len\"");
  expect_info_error(
      "modelneg.safetensors",
      [](auto& m) {
        m["kuai.model"] = R"({"vocab_size":256,"n_layer":-2,"n_head":2,"d_model":64,"seq_len":64})";
      },
      "\"n_layer\" is not a positive integer");
  expect_info_error(
      "modelextra.safetensors",
      [](auto& m) {
        m["kuai.model"] = R"({"vocab_size":256,"n_layer":2,"n_head":2,"d_model":64,"seq_len":64,)"
                          R"("n_embd":64})";
      },
      "has unknown field \"n_embd\"");
  expect_info_error(
      "step.safetensors", [](auto& m) { m["kuai.step"] = "12x"; },
      "\"kuai.step\" = \"12x\" is not a non-negative integer");
  expect_info_error(
      "dtype.safetensors", [](auto& m) { m["kuai.dtype"] = "f16"; },
      "\"kuai.dtype\" = \"f16\" is not one of");
  expect_info_error(
      "tokenizer.safetensors", [](auto& m) { m.erase("kuai.tokenizer"); },
      "missing metadata \"kuai.tokenizer\"");
  // Checksums are load_weights' business.
  const std::string nosums =
      rewrite(path, "nosums.safetensors", [](auto& m) { m.erase("kuai.checksums"); });
  EXPECT_NO_THROW(read_weights_info(nosums));
  expect_load_error(nosums, "missing metadata \"kuai.checksums\"");
}

TEST_F(ExportTest, RejectsAnUnsupportedExportDtype) {
  const std::string path = file("w.safetensors");
  EXPECT_THROW(export_weights(path, source_, {DType::kF16}), std::runtime_error);
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace kuai::io
