// `kuai tokenize`: text lines in, token ids out (or back), with any tokenizer kuai has: what the
// tests compare against other implementations, and a quick way to see how a text tokenizes.
// --whole encodes the whole input as one text (newlines and all) onto one line of ids.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/tokenizer.h"

namespace kuai::app {
namespace {

std::vector<int32_t> parse_ids(const std::string& line, int64_t line_no) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    if (i == line.size()) break;
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(line.substr(i), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || v < INT32_MIN || v > INT32_MAX)
      throw std::invalid_argument(
          fmt::format("line {}: \"{}\" is not a list of token ids", line_no, line));
    ids.push_back(static_cast<int32_t>(v));
    i += used;
  }
  return ids;
}

}  // namespace

int run_tokenize(const std::vector<std::string>& args) {
  std::string kind = "byte", bpe_dir = data::kDefaultBpeDir, file;
  bool decode = false, special = true, whole = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_option(args, i, "tokenizer", v))
      kind = v;
    else if (take_option(args, i, "bpe_dir", v))
      bpe_dir = v;
    else if (take_option(args, i, "file", v))
      file = v;
    else if (args[i] == "--decode")
      decode = true;
    else if (args[i] == "--no-special")
      special = false;
    else if (args[i] == "--whole")
      whole = true;
    else
      throw std::invalid_argument("unknown option '" + args[i] + "' (see kuai --help)");
  }
  const auto tok = data::make_tokenizer(kind, bpe_dir);
  const auto* hf = dynamic_cast<const data::HfTokenizer*>(tok.get());
  std::ifstream in_file;
  if (!file.empty()) {
    in_file.open(file, std::ios::binary);
    if (!in_file) throw std::invalid_argument(file + ": cannot open");
  }
  std::istream& in = file.empty() ? std::cin : in_file;
  // One line of output: a text's ids, or the text of a line of ids.
  const auto emit = [&](const std::string& text, int64_t line_no) {
    std::string out;
    if (decode) {
      const std::vector<int32_t> ids = parse_ids(text, line_no);
      out = hf ? hf->decode(ids, !special) : tok->decode(ids);
    } else {
      const std::vector<int32_t> ids = hf ? hf->encode(text, special) : tok->encode(text);
      for (size_t k = 0; k < ids.size(); ++k)
        fmt::format_to(std::back_inserter(out), "{}{}", k ? " " : "", ids[k]);
    }
    out += '\n';
    std::fwrite(out.data(), 1, out.size(), stdout);
  };
  if (whole) {  // the whole input as one text
    std::ostringstream ss;
    ss << in.rdbuf();
    emit(std::move(ss).str(), 1);
    return 0;
  }
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) emit(line, line_no);
  return 0;
}

}  // namespace kuai::app
