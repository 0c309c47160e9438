// Text file -> token file (see prepare.h).
#include "kuai/data/prepare.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/token_file.h"
#include "kuai/io/text_file.h"

namespace kuai::data {

int token_bytes_for_vocab(int64_t vocab_size) {
  if (vocab_size <= 256) return 1;
  if (vocab_size <= 65536) return 2;
  return 4;
}

std::string tokenizer_file_of(const std::string& token_file) {
  std::filesystem::path p(token_file);
  return p.replace_extension(".tokenizer.json").string();
}

PrepareStats prepare_token_file(const std::string& text_path, const std::string& out_path,
                                const Tokenizer& tok) {
  std::ifstream in(text_path, std::ios::binary);
  if (!in)
    throw std::runtime_error(
        fmt::format("{}: cannot open text file: {}", text_path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error(fmt::format("{}: read failed", text_path));
  const std::string text = std::move(ss).str();

  const std::vector<int32_t> ids = tok.encode(text);
  PrepareStats stats;
  stats.bytes_in = static_cast<int64_t>(text.size());
  stats.tokens = static_cast<int64_t>(ids.size());
  stats.token_bytes = token_bytes_for_vocab(tok.vocab_size());
  try {
    write_token_file(out_path, ids.data(), stats.tokens, stats.token_bytes);
  } catch (const std::exception& e) {
    // write_token_file names its temporary file; say which output it was for.
    throw std::runtime_error(fmt::format("{}: cannot write token file: {}", out_path, e.what()));
  }
  const std::string side = tokenizer_file_of(out_path);
  if (const auto* hf = dynamic_cast<const HfTokenizer*>(&tok)) {
    io::write_text_atomically(side, hf->json_text());
  } else {
    std::filesystem::remove(side);  // an earlier prepare's, with another tokenizer
  }
  return stats;
}

}  // namespace kuai::data
