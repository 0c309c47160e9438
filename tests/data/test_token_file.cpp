// Token files: round trip at every token width, and a clear error for each header defect.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kuai/data/token_file.h"

namespace kuai::data {
namespace {

std::string tmp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / name).string();
}

TEST(TokenFile, RoundTripAllWidths) {
  const std::vector<int32_t> tokens = {0, 1, 255, 7, 42};
  for (int w : {1, 2, 4}) {
    const std::string path = tmp("kuai_tok_" + std::to_string(w) + ".bin");
    write_token_file(path, tokens.data(), 5, w);
    TokenFile f = TokenFile::open(path);
    EXPECT_EQ(f.size(), 5);
    EXPECT_EQ(f.token_bytes(), w);
    std::vector<int32_t> back(5);
    f.read(0, 5, back.data());
    EXPECT_EQ(back, tokens);
    EXPECT_EQ(f.vocab_bound(), 256);
    EXPECT_THROW(f.read(3, 3, back.data()), std::out_of_range);
  }
}

TEST(TokenFile, HeaderDefectsNameFileAndCheck) {
  const std::vector<int32_t> tokens(100, 3);
  const std::string path = tmp("kuai_tok_bad.bin");
  auto expect_error = [&](const std::string& needle) {
    try {
      TokenFile::open(path);
      FAIL() << "expected: " << needle;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  write_token_file(path, tokens.data(), 100, 1);
  std::filesystem::resize_file(path, 90);
  expect_error("header says 100 tokens");
  std::filesystem::resize_file(path, 10);
  expect_error("shorter than the 24-byte header");
  std::ofstream(path, std::ios::binary) << "NOTKUAI!................";
  expect_error("bad magic");
}

}  // namespace
}  // namespace kuai::data
