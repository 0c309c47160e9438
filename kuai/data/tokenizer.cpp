// Byte and GPT-2 BPE tokenizers (see tokenizer.h). GPT-2's pre-tokenisation and byte alphabet
// are in text_split.h.
#include "kuai/data/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "kuai/data/bpe.h"
#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/text_split.h"

namespace kuai::data {
namespace {

// Bounds the piece cache; it is emptied when full (a corpus has far fewer distinct pieces).
constexpr size_t kMaxCacheEntries = size_t{1} << 20;
constexpr std::string_view kEndOfText = "<|endoftext|>";

template <class F>
void for_each_piece(std::string_view text, F&& f) {
  for (size_t i = 0; i < text.size();) {
    const size_t j = gpt2_piece_end(text, i);
    f(text.substr(i, j - i));
    i = j;
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error(fmt::format("{}: read failed", path));
  return std::move(ss).str();
}

// Maps a token string (GPT-2 alphabet characters) back to the raw bytes it stands for.
std::string token_to_bytes(const std::string& token, const std::string& path) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    char32_t c;
    i += decode_utf8(token, i, &c);
    const int b = alphabet_to_byte(c);
    if (b < 0)
      throw std::runtime_error(
          fmt::format("{}: token \"{}\" has character U+{:04X}, outside GPT-2's byte alphabet",
                      path, token, static_cast<uint32_t>(c)));
    out += static_cast<char>(b);
  }
  return out;
}

}  // namespace

Tokenizer::~Tokenizer() = default;

// --- ByteTokenizer ---------------------------------------------------------------------------

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > 255)
      throw std::out_of_range(fmt::format("byte tokenizer: id {} outside 0..255", ids[i]));
    out[i] = static_cast<char>(ids[i]);
  }
  return out;
}

// --- Gpt2Tokenizer ---------------------------------------------------------------------------

std::unique_ptr<Gpt2Tokenizer> Gpt2Tokenizer::load(const std::string& encoder_json,
                                                   const std::string& vocab_bpe) {
  std::unique_ptr<Gpt2Tokenizer> tok(new Gpt2Tokenizer());

  // encoder.json: {"token": id, ...} with ids numbering the tokens 0..n-1.
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(encoder_json));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(fmt::format("{}: malformed JSON: {}", encoder_json, e.what()));
  }
  if (!j.is_object())
    throw std::runtime_error(
        fmt::format("{}: expected a JSON object mapping token strings to ids", encoder_json));
  const int64_t n = static_cast<int64_t>(j.size());
  std::unordered_map<std::string, int32_t> ids;
  ids.reserve(j.size());
  tok->token_bytes_.resize(j.size());
  std::vector<bool> seen(j.size(), false);
  for (const auto& [token, value] : j.items()) {
    if (!value.is_number_integer())
      throw std::runtime_error(fmt::format("{}: token \"{}\" has id {}, not an integer",
                                           encoder_json, token, value.dump()));
    const int64_t id = value.get<int64_t>();
    if (id < 0 || id >= n)
      throw std::runtime_error(fmt::format(
          "{}: token \"{}\" has id {}, outside 0..{} (ids must number the {} tokens densely)",
          encoder_json, token, id, n - 1, n));
    if (seen[id])
      throw std::runtime_error(fmt::format("{}: id {} is given to two tokens", encoder_json, id));
    seen[id] = true;
    tok->token_bytes_[id] = token_to_bytes(token, encoder_json);
    ids.emplace(token, static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    append_utf8(symbol, byte_to_alphabet(static_cast<unsigned char>(b)));
    const auto it = ids.find(symbol);
    if (it == ids.end())
      throw std::runtime_error(
          fmt::format("{}: no token for byte 0x{:02X} (symbol \"{}\")", encoder_json, b, symbol));
    tok->byte_token_[b] = it->second;
  }
  if (const auto it = ids.find(std::string(kEndOfText)); it != ids.end()) tok->eot_id_ = it->second;

  // vocab.bpe: an optional "#version" line, then one merge "left right" per line; rank = order.
  const std::string text = read_file(vocab_bpe);
  int32_t rank = 0;
  int64_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.front() == '#')) continue;
    const size_t sp = line.find(' ');
    if (sp == 0 || sp == std::string_view::npos || sp + 1 == line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos)
      throw std::runtime_error(fmt::format(
          "{}:{}: malformed merge line \"{}\" (expected two symbols separated by one space)",
          vocab_bpe, line_no, line));
    const std::string left(line.substr(0, sp)), right(line.substr(sp + 1));
    const std::string symbols[3] = {left, right, left + right};
    int32_t parts[3];
    for (int k = 0; k < 3; ++k) {
      const auto it = ids.find(symbols[k]);
      if (it == ids.end())
        throw std::runtime_error(fmt::format("{}:{}: merge \"{}\": \"{}\" is not a token in {}",
                                             vocab_bpe, line_no, line, symbols[k], encoder_json));
      parts[k] = it->second;
    }
    // A repeated pair keeps its last rank, as GPT-2's dict(zip(merges, range(...))) does.
    tok->merges_[bpe_pair_key(parts[0], parts[1])] = BpeMerge{rank++, parts[2]};
  }
  return tok;
}

std::vector<std::string_view> Gpt2Tokenizer::pre_tokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  for_each_piece(text, [&](std::string_view p) { pieces.push_back(p); });
  return pieces;
}

// GPT-2's own merge order (bpe.h): every occurrence of the best pair before the next rank.
std::vector<int32_t> Gpt2Tokenizer::bpe(std::string_view piece) const {
  std::vector<int32_t> sym(piece.size());
  for (size_t k = 0; k < piece.size(); ++k)
    sym[k] = byte_token_[static_cast<unsigned char>(piece[k])];
  bpe_merge(sym, merges_, MergeOrder::kRankByRank);
  return sym;
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for_each_piece(text, [&](std::string_view piece) {
    if (piece.size() == 1) {
      out.push_back(byte_token_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (const auto it = cache_.find(piece); it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = bpe(piece);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(std::string(piece), std::move(ids));
  });
  return out;
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (const int32_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(token_bytes_.size()))
      throw std::out_of_range(
          fmt::format("gpt2 tokenizer: id {} outside 0..{}", id, token_bytes_.size() - 1));
    out += token_bytes_[id];
  }
  return out;
}

// --- make_tokenizer --------------------------------------------------------------------------

std::string tokenizer_for_vocab(int64_t vocab_size) { return vocab_size <= 256 ? "byte" : "gpt2"; }

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& bpe_dir) {
  if (names_tokenizer_json(kind)) {
    const std::filesystem::path p(kind);
    return HfTokenizer::load(p.extension() == ".json" ? kind : (p / "tokenizer.json").string());
  }
  if (kind == "byte") return std::make_unique<ByteTokenizer>();
  if (kind == "gpt2") {
    const std::string encoder = (std::filesystem::path(bpe_dir) / "encoder.json").string();
    const std::string vocab = (std::filesystem::path(bpe_dir) / "vocab.bpe").string();
    for (const std::string& path : {encoder, vocab})
      if (!std::filesystem::exists(path))
        throw std::runtime_error(fmt::format(
            "{}: not found; run scripts/setup.sh --bpe to fetch the GPT-2 vocabulary", path));
    return Gpt2Tokenizer::load(encoder, vocab);
  }
  throw std::runtime_error(fmt::format(
      "unknown tokenizer \"{}\" (allowed: byte, gpt2, or the path of a tokenizer.json)", kind));
}

}  // namespace kuai::data
