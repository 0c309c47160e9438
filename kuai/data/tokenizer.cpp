// Byte and GPT-2 BPE tokenizers (see tokenizer.h).
//
// GPT-2's pre-tokenisation is the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// tried alternative by alternative at each position. It is implemented here by hand over UTF-8
// code points with the classes of unicode_class.h (Unicode 17.0 tables). What differs from a
// regex engine: \s is the White_Space property (as in Python's `regex`, which GPT-2 used;
// JavaScript's \s, used by the npm reference, also counts U+FEFF and not U+0085), and a byte that
// is not part of valid UTF-8 is a code point of its own in the "other" class (Python would refuse
// the text, JavaScript would have replaced it by U+FFFD, also "other"), so any bytes round-trip.
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

#include "kuai/data/unicode_class.h"

namespace kuai::data {
namespace {

// Bounds the piece cache; it is emptied when full (a corpus has far fewer distinct pieces).
constexpr size_t kMaxCacheEntries = size_t{1} << 20;
constexpr char32_t kInvalidByte = 0xFFFFFFFF;
constexpr std::string_view kEndOfText = "<|endoftext|>";

// GPT-2's byte alphabet: bytes that print as themselves ('!'..'~', U+00A1..U+00AC,
// U+00AE..U+00FF) keep their value; the other 68 bytes get U+0100, U+0101, ... in byte order.
struct ByteAlphabet {
  char32_t byte_to_char[256];
  int16_t char_to_byte[0x100 + 68];  // -1 where the code point is not in the alphabet

  ByteAlphabet() {
    std::fill(std::begin(char_to_byte), std::end(char_to_byte), int16_t{-1});
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool prints = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_char[b] = prints ? static_cast<char32_t>(b) : next++;
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// Decodes the code point starting at s[i] into *cp and returns its length in bytes. A byte that
// does not start a valid, shortest-form sequence is returned alone as kInvalidByte.
size_t decode_utf8(std::string_view s, size_t i, char32_t* cp) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t len;
  char32_t c, min;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, c = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, c = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, c = b0 & 0x07, min = 0x10000;
  } else {
    *cp = kInvalidByte;
    return 1;
  }
  if (i + len > s.size()) {
    *cp = kInvalidByte;
    return 1;
  }
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) {
      *cp = kInvalidByte;
      return 1;
    }
    c = (c << 6) | (byte(i + k) & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
    *cp = kInvalidByte;
    return 1;
  }
  *cp = c;
  return len;
}

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

CharClass classify(char32_t c) {
  if (c == kInvalidByte) return CharClass::kOther;
  if (is_unicode_letter(c)) return CharClass::kLetter;
  if (is_unicode_number(c)) return CharClass::kNumber;
  if (is_unicode_space(c)) return CharClass::kSpace;
  return CharClass::kOther;
}

// One code point of the text being split: its value, class and byte length.
struct Unit {
  char32_t cp = 0;
  CharClass cls = CharClass::kOther;
  size_t len = 0;  // 0 past the end of the text
};

Unit unit_at(std::string_view s, size_t i) {
  Unit u;
  if (i >= s.size()) return u;
  u.len = decode_utf8(s, i, &u.cp);
  u.cls = classify(u.cp);
  return u;
}

// End (byte offset) of the run of class cls that starts at byte offset i.
size_t run_end(std::string_view s, size_t i, CharClass cls) {
  for (Unit u = unit_at(s, i); u.len && u.cls == cls; u = unit_at(s, i)) i += u.len;
  return i;
}

// Byte offset where the pre-tokenisation piece starting at byte offset i ends (see the top of
// the file for the regex; the alternatives are tried in its order).
size_t piece_end(std::string_view s, size_t i) {
  const Unit u = unit_at(s, i);
  // 's 't 're 've 'm 'll 'd (lower case only, as in GPT-2).
  if (u.cp == '\'' && i + 1 < s.size()) {
    const char a = s[i + 1], b = i + 2 < s.size() ? s[i + 2] : '\0';
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional ' ' then a run of one class.
  if (u.cp == ' ') {
    const Unit v = unit_at(s, i + 1);
    if (v.len && v.cls != CharClass::kSpace) return run_end(s, i + 1, v.cls);
  }
  if (u.cls != CharClass::kSpace) return run_end(s, i, u.cls);
  // "\s+(?!\S)": the white-space run, less its last code point when a non-space follows it (and
  // the run is longer than one); otherwise "\s+": the whole run.
  size_t last = i, j = i;
  for (Unit w = u; w.len && w.cls == CharClass::kSpace; w = unit_at(s, j)) last = j, j += w.len;
  if (j < s.size() && last > i) return last;
  return j;
}

template <class F>
void for_each_piece(std::string_view text, F&& f) {
  for (size_t i = 0; i < text.size();) {
    const size_t j = piece_end(text, i);
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

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Maps a token string (GPT-2 alphabet characters) back to the raw bytes it stands for.
std::string token_to_bytes(const std::string& token, const std::string& path) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    char32_t c;
    i += decode_utf8(token, i, &c);
    const int b = c < std::size(alphabet().char_to_byte) ? alphabet().char_to_byte[c] : -1;
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
    append_utf8(symbol, alphabet().byte_to_char[b]);
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
    tok->merges_[pair_key(parts[0], parts[1])] = Merge{rank++, parts[2]};
  }
  return tok;
}

std::vector<std::string_view> Gpt2Tokenizer::pre_tokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  for_each_piece(text, [&](std::string_view p) { pieces.push_back(p); });
  return pieces;
}

// Merges adjacent symbols, lowest rank first, every occurrence of that pair left to right
// before the next rank (GPT-2's loop), in O(n log n): the symbols are a linked list over the
// byte positions, the candidate pairs a min-heap on (rank, position) with stale entries skipped.
std::vector<int32_t> Gpt2Tokenizer::bpe(std::string_view piece) const {
  const int32_t n = static_cast<int32_t>(piece.size());
  std::vector<int32_t> sym(n), prev(n), next(n);
  for (int32_t k = 0; k < n; ++k) {
    sym[k] = byte_token_[static_cast<unsigned char>(piece[k])];
    prev[k] = k - 1;
    next[k] = k + 1 < n ? k + 1 : -1;
  }
  struct Candidate {
    int32_t rank, pos, left, right, result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Candidate> heap;
  const auto push = [&](int32_t pos) {  // the pair starting at node pos, if it has a rank
    if (pos < 0 || next[pos] < 0) return;
    const auto it = merges_.find(pair_key(sym[pos], sym[next[pos]]));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, pos, sym[pos], sym[next[pos]], it->second.result});
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  for (int32_t k = 0; k + 1 < n; ++k) push(k);

  std::vector<int32_t> merged_at;
  while (!heap.empty()) {
    const int32_t rank = heap.front().rank;
    merged_at.clear();
    while (!heap.empty() && heap.front().rank == rank) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
      const Candidate c = heap.back();
      heap.pop_back();
      const int32_t r = next[c.pos];
      if (sym[c.pos] != c.left || r < 0 || sym[r] != c.right) continue;  // stale
      sym[c.pos] = c.result;
      sym[r] = -1;
      next[c.pos] = next[r];
      if (next[r] >= 0) prev[next[r]] = c.pos;
      merged_at.push_back(c.pos);
    }
    // New pairs have other ranks, so they join only after this rank is done.
    for (const int32_t pos : merged_at) {
      push(prev[pos]);
      push(pos);
    }
  }
  std::vector<int32_t> out;
  for (int32_t k = 0; k >= 0; k = next[k]) out.push_back(sym[k]);
  return out;
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

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& bpe_dir) {
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
  throw std::runtime_error(fmt::format("unknown tokenizer \"{}\" (allowed: byte, gpt2)", kind));
}

}  // namespace kuai::data
