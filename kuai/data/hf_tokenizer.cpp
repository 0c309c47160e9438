// tokenizer.json: the parser and the encode/decode pipeline (see hf_tokenizer.h).
#include "kuai/data/hf_tokenizer.h"

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
#include "kuai/data/text_split.h"
#include "kuai/data/unicode_class.h"

namespace kuai::data {
namespace {

using json = nlohmann::json;

// Pieces up to this many bytes have their ids cached; the cache is emptied when full.
constexpr size_t kMaxCachedPiece = 48;
constexpr size_t kMaxCacheEntries = size_t{1} << 18;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error(fmt::format("{}: read failed", path));
  return std::move(ss).str();
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  if (pos == 0) return;
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

bool is_space_at(std::string_view s, size_t i, size_t* len) {
  char32_t c;
  *len = decode_utf8(s, i, &c);
  return c != kInvalidByte && is_unicode_space(c);
}

// "<0xNN>" -> NN, else -1.
int byte_token_value(std::string_view t) {
  if (t.size() != 6 || !starts_with(t, "<0x") || t[5] != '>') return -1;
  int v = 0;
  for (size_t k = 3; k < 5; ++k) {
    const char c = t[k];
    v <<= 4;
    if (c >= '0' && c <= '9')
      v |= c - '0';
    else if (c >= 'A' && c <= 'F')
      v |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f')
      v |= c - 'a' + 10;
    else
      return -1;
  }
  return v;
}

// Typed access to the JSON with the path of every field in the error.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw std::runtime_error(fmt::format("{}: {}: {}", source_, path, what));
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& what) const {
    throw std::runtime_error(
        fmt::format("{}: {}: {} is not implemented by kuai's tokenizer (see kuai/data/"
                    "hf_tokenizer.h for what is)",
                    source_, path, what));
  }
  const json& object(const json& j, const std::string& path) const {
    if (!j.is_object()) fail(path, "expected an object, found " + std::string(j.type_name()));
    return j;
  }
  // A field that must be present (and not null).
  const json& at(const json& o, const std::string& path, const char* key) const {
    const auto it = o.find(key);
    if (it == o.end() || it->is_null()) fail(join(path, key), "missing");
    return *it;
  }
  std::string str(const json& o, const std::string& path, const char* key) const {
    const json& v = at(o, path, key);
    if (!v.is_string()) fail(join(path, key), "expected a string, found " + v.dump());
    return v.get<std::string>();
  }
  std::optional<std::string> opt_str(const json& o, const std::string& path,
                                     const char* key) const {
    const auto it = o.find(key);
    if (it == o.end() || it->is_null()) return std::nullopt;
    if (!it->is_string()) fail(join(path, key), "expected a string, found " + it->dump());
    return it->get<std::string>();
  }
  bool flag(const json& o, const std::string& path, const char* key, bool otherwise) const {
    const auto it = o.find(key);
    if (it == o.end() || it->is_null()) return otherwise;
    if (!it->is_boolean()) fail(join(path, key), "expected true or false, found " + it->dump());
    return it->get<bool>();
  }
  int64_t integer(const json& o, const std::string& path, const char* key) const {
    const json& v = at(o, path, key);
    if (!v.is_number_integer()) fail(join(path, key), "expected an integer, found " + v.dump());
    return v.get<int64_t>();
  }
  const json& array(const json& o, const std::string& path, const char* key) const {
    const json& v = at(o, path, key);
    if (!v.is_array()) fail(join(path, key), "expected an array");
    return v;
  }
  std::string type(const json& o, const std::string& path) const {
    object(o, path);
    return str(o, path, "type");
  }
  // A Replace's or Split's pattern: {"String": s} (or {"Regex": r} where regex is allowed).
  std::string string_pattern(const json& o, const std::string& path) const {
    const json& p = object(at(o, path, "pattern"), join(path, "pattern"));
    if (p.contains("Regex"))
      unsupported(join(path, "pattern"), "a Regex pattern here (only {\"String\": ...})");
    return str(p, join(path, "pattern"), "String");
  }
  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }
  static std::string index(const std::string& path, size_t i) {
    return fmt::format("{}[{}]", path, i);
  }
  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

// The pre-tokenisation regexes kuai knows, as Split patterns appear in tokenizer.json files.
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

enum class Regex { kGpt2, kLlama3, kQwen2 };

size_t regex_piece_end(Regex r, std::string_view s, size_t i) {
  switch (r) {
    case Regex::kGpt2:
      return gpt2_piece_end(s, i);
    case Regex::kLlama3:
      return llama3_piece_end(s, i, 3);
    case Regex::kQwen2:
      return llama3_piece_end(s, i, 1);
  }
  return s.size();
}

}  // namespace

struct HfTokenizer::Impl {
  struct Normalizer {
    bool prepend = false;  // Prepend(to) when true, else Replace(from -> to)
    std::string from, to;
  };
  enum class Prepend { kAlways, kFirst, kNever };
  struct PreTokenizer {
    enum class Kind { kSplit, kByteLevel, kMetaspace } kind = Kind::kSplit;
    Regex regex = Regex::kGpt2;  // Split; ByteLevel with use_regex
    bool use_regex = false;      // ByteLevel
    bool add_prefix_space = false;
    std::string replacement;  // Metaspace
    Prepend prepend = Prepend::kNever;
    bool split = false;
  };
  struct Decoder {
    enum class Kind {
      kReplace,
      kByteFallback,
      kFuse,
      kStrip,
      kByteLevel,
      kMetaspace
    } kind = Kind::kReplace;
    std::string from, to;  // Replace; Metaspace: replacement -> " "
    std::string content;   // Strip
    int64_t start = 0, stop = 0;
    bool strip_first = false;  // Metaspace: prepend_scheme is not "never"
  };
  struct AddedToken {
    int32_t id;
    std::string content;
    bool special, normalized, lstrip, rstrip;
  };

  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  bool byte_level = false;  // a ByteLevel pre-tokenizer: pieces are bytes, in GPT-2's alphabet

  StringMap<int32_t> vocab;      // token text as in the file -> id
  StringMap<int32_t> raw_vocab;  // byte-level with ignore_merges: the bytes a token stands for
  std::unordered_map<char32_t, int32_t> char_id;  // tokens of one code point
  int32_t ascii_id[128];
  int32_t byte_id[256];  // byte-level: the byte's alphabet token; byte_fallback: "<0xNN>"
  bool byte_fallback = false, ignore_merges = false, fuse_unk = false;
  int32_t unk_id = -1;
  BpeMerges merges;

  std::vector<AddedToken> added;       // longest content first
  bool added_first_byte[2][256] = {};  // [normalized] -> a token of that kind starts with it
  std::vector<int32_t> before, after;  // the post-processor's ids around the sequence
  std::vector<Decoder> decoders;
  bool has_decoder = false;
  std::vector<bool> special;

  mutable std::mutex cache_mutex;
  mutable StringMap<std::vector<int32_t>> cache;

  // --- encoding -----------------------------------------------------------------------------

  template <class F>
  void split_added(std::string_view text, bool normalized, F&& f) const {
    size_t seg = 0;
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      if (added_first_byte[normalized][static_cast<unsigned char>(text[i])])
        for (const AddedToken& t : added)
          if (t.normalized == normalized && text.compare(i, t.content.size(), t.content) == 0) {
            hit = &t;  // the longest (added is sorted longest first): leftmost-longest
            break;
          }
      if (!hit) {
        ++i;
        continue;
      }
      size_t start = i, end = i + hit->content.size(), len;
      if (hit->lstrip)
        while (start > seg) {
          size_t k = start - 1;
          while (k > seg && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
          if (!is_space_at(text, k, &len) || k + len != start) break;
          start = k;
        }
      if (hit->rstrip)
        while (end < text.size() && is_space_at(text, end, &len)) end += len;
      if (start > seg) f(text.substr(seg, start - seg), seg, -1);
      f(std::string_view{}, start, hit->id);
      seg = i = end;
    }
    if (seg < text.size()) f(text.substr(seg), seg, -1);
  }

  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (const Normalizer& n : normalizers) {
      if (n.prepend) {
        if (!s.empty()) s.insert(0, n.to);
      } else {
        replace_all(s, n.from, n.to);
      }
    }
    return s;
  }

  // Pieces of one normalized stretch; at_start: it begins the text (Metaspace's "first").
  void pre_tokenize(std::string s, bool at_start, std::vector<std::string>& pieces) const {
    pieces.clear();
    pieces.push_back(std::move(s));
    std::vector<std::string> next;
    for (const PreTokenizer& p : pre_tokenizers) {
      next.clear();
      for (size_t k = 0; k < pieces.size(); ++k) {
        std::string& piece = pieces[k];
        switch (p.kind) {
          case PreTokenizer::Kind::kSplit:
            for (size_t i = 0; i < piece.size();) {
              const size_t j = regex_piece_end(p.regex, piece, i);
              next.emplace_back(piece, i, j - i);
              i = j;
            }
            break;
          case PreTokenizer::Kind::kByteLevel:
            if (p.add_prefix_space && !starts_with(piece, " ")) piece.insert(piece.begin(), ' ');
            if (!p.use_regex) {
              next.push_back(std::move(piece));
              break;
            }
            for (size_t i = 0; i < piece.size();) {
              const size_t j = gpt2_piece_end(piece, i);
              next.emplace_back(piece, i, j - i);
              i = j;
            }
            break;
          case PreTokenizer::Kind::kMetaspace: {
            replace_all(piece, " ", p.replacement);
            const bool first = at_start && k == 0;
            if ((p.prepend == Prepend::kAlways || (p.prepend == Prepend::kFirst && first)) &&
                !starts_with(piece, p.replacement))
              piece.insert(0, p.replacement);
            if (!p.split) {
              next.push_back(std::move(piece));
              break;
            }
            // Split on the replacement, which stays with the text after it.
            size_t from = 0;
            for (size_t hit = piece.find(p.replacement, 1); hit != std::string::npos;
                 hit = piece.find(p.replacement, hit + p.replacement.size())) {
              if (hit > from) next.emplace_back(piece, from, hit - from);
              from = hit;
            }
            if (from < piece.size()) next.emplace_back(piece, from, std::string::npos);
            break;
          }
        }
      }
      pieces.swap(next);
    }
    // Empty pieces produce no tokens.
    std::erase_if(pieces, [](const std::string& x) { return x.empty(); });
  }

  // The model's symbols for one piece, before merges.
  void initial_symbols(std::string_view piece, std::vector<int32_t>& sym) const {
    sym.clear();
    if (byte_level) {
      for (const char c : piece) {
        const int32_t id = byte_id[static_cast<unsigned char>(c)];
        if (id >= 0)
          sym.push_back(id);
        else
          push_unk(sym);
      }
      return;
    }
    for (size_t i = 0; i < piece.size();) {
      char32_t c;
      const size_t len = decode_utf8(piece, i, &c);
      int32_t id = -1;
      if (c < 128) {
        id = ascii_id[c];
      } else if (c != kInvalidByte) {
        const auto it = char_id.find(c);
        if (it != char_id.end()) id = it->second;
      }
      if (id >= 0) {
        sym.push_back(id);
      } else if (byte_fallback &&
                 std::all_of(piece.begin() + i, piece.begin() + i + len,
                             [&](char b) { return byte_id[static_cast<unsigned char>(b)] >= 0; })) {
        for (size_t k = i; k < i + len; ++k)
          sym.push_back(byte_id[static_cast<unsigned char>(piece[k])]);
      } else {
        push_unk(sym);
      }
      i += len;
    }
  }

  void push_unk(std::vector<int32_t>& sym) const {
    if (unk_id < 0) return;  // no unk token: the library drops the character
    if (fuse_unk && !sym.empty() && sym.back() == unk_id) return;
    sym.push_back(unk_id);
  }

  void model(std::string_view piece, std::vector<int32_t>& out,
             std::vector<int32_t>& scratch) const {
    if (ignore_merges) {
      const StringMap<int32_t>& whole = byte_level ? raw_vocab : vocab;
      if (const auto it = whole.find(piece); it != whole.end()) {
        out.push_back(it->second);
        return;
      }
    }
    const bool cached = piece.size() <= kMaxCachedPiece;
    if (cached) {
      std::lock_guard<std::mutex> lock(cache_mutex);
      if (const auto it = cache.find(piece); it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    initial_symbols(piece, scratch);
    bpe_merge(scratch, merges, MergeOrder::kBestFirst);  // the library's order
    out.insert(out.end(), scratch.begin(), scratch.end());
    if (cached) {
      std::lock_guard<std::mutex> lock(cache_mutex);
      if (cache.size() >= kMaxCacheEntries) cache.clear();
      cache.emplace(std::string(piece), scratch);
    }
  }

  void encode_stretch(std::string_view raw, bool at_start, std::vector<int32_t>& out) const {
    const std::string normalized = normalize(raw);
    std::vector<std::string> pieces;
    std::vector<int32_t> scratch;
    split_added(normalized, /*normalized=*/true,
                [&](std::string_view text, size_t offset, int32_t token) {
                  if (token >= 0) {
                    out.push_back(token);
                    return;
                  }
                  pre_tokenize(std::string(text), at_start && offset == 0, pieces);
                  for (const std::string& p : pieces) model(p, out, scratch);
                });
  }

  // --- decoding -----------------------------------------------------------------------------

  static std::string to_bytes_of_alphabet(const std::string& token) {
    std::string out;
    for (size_t i = 0; i < token.size();) {
      char32_t c;
      i += decode_utf8(token, i, &c);
      const int b = alphabet_to_byte(c);
      if (b < 0) return token;  // not of the alphabet: the token's own bytes (as the library)
      out += static_cast<char>(b);
    }
    return out;
  }

  std::string run_decoders(std::vector<std::string> tokens) const {
    if (!has_decoder) {  // the library joins the tokens with spaces
      std::string out;
      for (size_t k = 0; k < tokens.size(); ++k) out += (k ? " " : "") + tokens[k];
      return out;
    }
    for (const Decoder& d : decoders) {
      switch (d.kind) {
        case Decoder::Kind::kReplace:
          for (std::string& t : tokens) replace_all(t, d.from, d.to);
          break;
        case Decoder::Kind::kByteFallback: {
          std::vector<std::string> out;
          std::string bytes;
          bool in_bytes = false;
          for (std::string& t : tokens) {
            const int b = byte_token_value(t);
            if (b >= 0) {
              bytes += static_cast<char>(b);
              in_bytes = true;
              continue;
            }
            if (in_bytes) out.push_back(std::move(bytes)), bytes.clear(), in_bytes = false;
            out.push_back(std::move(t));
          }
          if (in_bytes) out.push_back(std::move(bytes));
          tokens.swap(out);
          break;
        }
        case Decoder::Kind::kFuse: {
          std::string all;
          for (const std::string& t : tokens) all += t;
          tokens.assign(1, std::move(all));
          break;
        }
        case Decoder::Kind::kStrip:
          for (std::string& t : tokens) {
            const std::string& c = d.content;
            int64_t k = 0;
            size_t from = 0, to = t.size();
            for (; k < d.start && starts_with(std::string_view(t).substr(from), c); ++k)
              from += c.size();
            for (k = 0; k < d.stop && to >= from + c.size() &&
                        std::string_view(t).substr(to - c.size(), c.size()) == c;
                 ++k)
              to -= c.size();
            t = t.substr(from, to - from);
          }
          break;
        case Decoder::Kind::kByteLevel: {
          std::string all;
          for (const std::string& t : tokens) all += to_bytes_of_alphabet(t);
          tokens.assign(1, std::move(all));
          break;
        }
        case Decoder::Kind::kMetaspace:
          // The library drops every replacement of the first token (its leading space), and
          // turns the others into spaces.
          for (size_t k = 0; k < tokens.size(); ++k)
            replace_all(tokens[k], d.from, k == 0 && d.strip_first ? "" : " ");
          break;
      }
    }
    std::string out;
    for (const std::string& t : tokens) out += t;
    return out;
  }
};

// --- loading ---------------------------------------------------------------------------------

namespace {

using Impl = HfTokenizer::Impl;

void parse_normalizer(const Reader& r, const json& j, const std::string& path, Impl& impl) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  if (type == "Sequence") {
    const json& list = r.array(j, path, "normalizers");
    for (size_t k = 0; k < list.size(); ++k)
      parse_normalizer(r, list[k], Reader::index(Reader::join(path, "normalizers"), k), impl);
  } else if (type == "Prepend") {
    impl.normalizers.push_back({true, "", r.str(j, path, "prepend")});
  } else if (type == "Replace") {
    impl.normalizers.push_back({false, r.string_pattern(j, path), r.str(j, path, "content")});
  } else {
    r.unsupported(path, fmt::format("the normalizer \"{}\"", type));
  }
}

Regex known_regex(const Reader& r, const std::string& path, const std::string& pattern) {
  if (pattern == kGpt2Regex) return Regex::kGpt2;
  if (pattern == kLlama3Regex) return Regex::kLlama3;
  if (pattern == kQwen2Regex) return Regex::kQwen2;
  r.unsupported(path, fmt::format("a Split on the regex \"{}\" (kuai knows GPT-2's, LLaMA-3's "
                                  "and Qwen2's)",
                                  pattern));
}

void parse_pre_tokenizer(const Reader& r, const json& j, const std::string& path, Impl& impl) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  using Kind = Impl::PreTokenizer::Kind;
  if (impl.byte_level) r.unsupported(path, "a pre-tokenizer after ByteLevel (it must come last)");
  if (type == "Sequence") {
    const json& list = r.array(j, path, "pretokenizers");
    for (size_t k = 0; k < list.size(); ++k)
      parse_pre_tokenizer(r, list[k], Reader::index(Reader::join(path, "pretokenizers"), k), impl);
  } else if (type == "ByteLevel") {
    Impl::PreTokenizer p;
    p.kind = Kind::kByteLevel;
    p.add_prefix_space = r.flag(j, path, "add_prefix_space", true);
    p.use_regex = r.flag(j, path, "use_regex", true);
    impl.pre_tokenizers.push_back(p);
    impl.byte_level = true;
  } else if (type == "Metaspace") {
    Impl::PreTokenizer p;
    p.kind = Kind::kMetaspace;
    p.replacement = r.str(j, path, "replacement");
    if (p.replacement.empty()) r.fail(Reader::join(path, "replacement"), "empty");
    if (const auto scheme = r.opt_str(j, path, "prepend_scheme")) {
      if (*scheme == "always")
        p.prepend = Impl::Prepend::kAlways;
      else if (*scheme == "first")
        p.prepend = Impl::Prepend::kFirst;
      else if (*scheme == "never")
        p.prepend = Impl::Prepend::kNever;
      else
        r.fail(Reader::join(path, "prepend_scheme"),
               fmt::format("\"{}\" is not one of always, first, never", *scheme));
    } else {  // files older than prepend_scheme: add_prefix_space
      p.prepend = r.flag(j, path, "add_prefix_space", true) ? Impl::Prepend::kAlways
                                                            : Impl::Prepend::kNever;
    }
    p.split = r.flag(j, path, "split", true);
    impl.pre_tokenizers.push_back(p);
  } else if (type == "Split") {
    const json& pat = r.object(r.at(j, path, "pattern"), Reader::join(path, "pattern"));
    if (!pat.contains("Regex"))
      r.unsupported(Reader::join(path, "pattern"), "a Split on a String pattern");
    Impl::PreTokenizer p;
    p.kind = Kind::kSplit;
    p.regex = known_regex(r, Reader::join(path, "pattern"),
                          r.str(pat, Reader::join(path, "pattern"), "Regex"));
    const std::string behavior = r.str(j, path, "behavior");
    if (behavior != "Isolated")
      r.unsupported(Reader::join(path, "behavior"),
                    fmt::format("the Split behavior \"{}\" (only Isolated)", behavior));
    if (r.flag(j, path, "invert", false)) r.unsupported(Reader::join(path, "invert"), "invert");
    impl.pre_tokenizers.push_back(p);
  } else {
    r.unsupported(path, fmt::format("the pre-tokenizer \"{}\"", type));
  }
}

void parse_model(const Reader& r, const json& j, Impl& impl, std::vector<std::string>& tokens) {
  const std::string path = "model";
  r.object(j, path);
  const std::string type = j.contains("type") ? r.str(j, path, "type") : "BPE";
  if (type != "BPE") r.unsupported(path, fmt::format("the model \"{}\" (only BPE)", type));
  if (j.contains("dropout") && !j["dropout"].is_null())
    r.unsupported(Reader::join(path, "dropout"), "BPE dropout");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const auto v = r.opt_str(j, path, key); v && !v->empty())
      r.unsupported(Reader::join(path, key), fmt::format("a non-empty {}", key));
  impl.byte_fallback = r.flag(j, path, "byte_fallback", false);
  impl.ignore_merges = r.flag(j, path, "ignore_merges", false);
  impl.fuse_unk = r.flag(j, path, "fuse_unk", false);

  const json& vocab = r.object(r.at(j, path, "vocab"), "model.vocab");
  impl.vocab.reserve(vocab.size());
  for (const auto& [token, value] : vocab.items()) {
    const std::string where = fmt::format("model.vocab[\"{}\"]", token);
    if (!value.is_number_integer()) r.fail(where, "expected an integer id, found " + value.dump());
    const int64_t id = value.get<int64_t>();
    if (id < 0 || id > INT32_MAX) r.fail(where, fmt::format("id {} is out of range", id));
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(id + 1);
    if (!tokens[id].empty()) r.fail(where, fmt::format("id {} is given to two tokens", id));
    tokens[id] = token;
    impl.vocab.emplace(token, static_cast<int32_t>(id));
  }
  if (const auto unk = r.opt_str(j, path, "unk_token")) {
    const auto it = impl.vocab.find(*unk);
    if (it == impl.vocab.end())
      r.fail("model.unk_token", fmt::format("\"{}\" is not in the vocabulary", *unk));
    impl.unk_id = it->second;
  }

  std::fill(std::begin(impl.ascii_id), std::end(impl.ascii_id), -1);
  std::fill(std::begin(impl.byte_id), std::end(impl.byte_id), -1);
  for (const auto& [token, id] : impl.vocab) {
    char32_t c;
    if (!token.empty() && decode_utf8(token, 0, &c) == token.size() && c != kInvalidByte) {
      if (c < 128)
        impl.ascii_id[c] = id;
      else
        impl.char_id.emplace(c, id);
    }
    if (impl.byte_fallback)
      if (const int b = byte_token_value(token); b >= 0) impl.byte_id[b] = id;
  }

  const json& merges = r.array(j, path, "merges");
  impl.merges.reserve(merges.size());
  std::string pair[2];
  for (size_t k = 0; k < merges.size(); ++k) {
    const json& m = merges[k];
    const std::string where = Reader::index("model.merges", k);
    if (m.is_string()) {  // "left right"
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        r.fail(where, fmt::format("\"{}\" is not two tokens separated by one space", s));
      pair[0] = s.substr(0, sp), pair[1] = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      pair[0] = m[0].get<std::string>(), pair[1] = m[1].get<std::string>();
    } else {
      r.fail(where, "expected \"left right\" or [\"left\", \"right\"], found " + m.dump());
    }
    int32_t ids[3];
    const std::string parts[3] = {pair[0], pair[1], pair[0] + pair[1]};
    for (int p = 0; p < 3; ++p) {
      const auto it = impl.vocab.find(parts[p]);
      if (it == impl.vocab.end())
        r.fail(where, fmt::format("\"{}\" is not in the vocabulary", parts[p]));
      ids[p] = it->second;
    }
    // A repeated pair keeps its last rank, as the library's map (collected in order) does.
    impl.merges.insert_or_assign(bpe_pair_key(ids[0], ids[1]),
                                 BpeMerge{static_cast<int32_t>(k), ids[2]});
  }
}

// Byte-level models: each byte's token (its alphabet character), and with ignore_merges the bytes
// every token stands for.
void finish_byte_level(Impl& impl) {
  if (!impl.byte_level) return;
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    append_utf8(symbol, byte_to_alphabet(static_cast<unsigned char>(b)));
    const auto it = impl.vocab.find(symbol);
    impl.byte_id[b] = it == impl.vocab.end() ? -1 : it->second;
  }
  if (!impl.ignore_merges) return;
  for (const auto& [token, id] : impl.vocab) {
    std::string raw;
    bool ok = true;
    for (size_t i = 0; i < token.size() && ok;) {
      char32_t c;
      i += decode_utf8(token, i, &c);
      const int b = alphabet_to_byte(c);
      ok = b >= 0;
      raw += static_cast<char>(b);
    }
    if (ok) impl.raw_vocab.emplace(std::move(raw), id);
  }
}

void parse_added(const Reader& r, const json& j, Impl& impl, std::vector<std::string>& tokens) {
  if (j.is_null()) return;
  if (!j.is_array()) r.fail("added_tokens", "expected an array");
  for (size_t k = 0; k < j.size(); ++k) {
    const std::string path = Reader::index("added_tokens", k);
    const json& t = r.object(j[k], path);
    const int64_t id = r.integer(t, path, "id");
    if (id < 0 || id > INT32_MAX) r.fail(path + ".id", fmt::format("{} is out of range", id));
    Impl::AddedToken a{static_cast<int32_t>(id),          r.str(t, path, "content"),
                       r.flag(t, path, "special", false), r.flag(t, path, "normalized", true),
                       r.flag(t, path, "lstrip", false),  r.flag(t, path, "rstrip", false)};
    if (a.content.empty()) r.fail(path + ".content", "empty");
    if (r.flag(t, path, "single_word", false))
      r.unsupported(path + ".single_word", "an added token with single_word");
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(id + 1);
    if (!tokens[id].empty() && tokens[id] != a.content)
      r.fail(path, fmt::format("id {} is \"{}\" in the vocabulary and \"{}\" here", id, tokens[id],
                               a.content));
    tokens[id] = a.content;
    impl.added_first_byte[a.normalized][static_cast<unsigned char>(a.content[0])] = true;
    impl.added.push_back(std::move(a));
  }
  std::stable_sort(impl.added.begin(), impl.added.end(), [](const auto& x, const auto& y) {
    return x.content.size() > y.content.size();
  });
}

// The ids a template's special token stands for (usually one: <s>).
void append_special_ids(const Reader& r, const json& specials, const std::string& path,
                        const std::string& name, std::vector<int32_t>& out) {
  const std::string where = fmt::format("{}.special_tokens[\"{}\"]", path, name);
  const auto it = specials.find(name);
  if (it == specials.end()) r.fail(where, "missing (named by the template)");
  const json& ids = r.array(*it, where, "ids");
  for (const json& id : ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      r.fail(where + ".ids", "expected token ids, found " + ids.dump());
    out.push_back(id.get<int32_t>());
  }
}

void parse_post_processor(const Reader& r, const json& j, const std::string& path, Impl& impl) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  if (type == "Sequence") {
    const json& list = r.array(j, path, "processors");
    for (size_t k = 0; k < list.size(); ++k)
      parse_post_processor(r, list[k], Reader::index(Reader::join(path, "processors"), k), impl);
  } else if (type == "ByteLevel") {
    // Offsets only: the ids are unchanged.
  } else if (type == "TemplateProcessing") {
    if (!impl.before.empty() || !impl.after.empty())
      r.unsupported(path, "a second TemplateProcessing");
    const json& single = r.array(j, path, "single");
    const json& specials = r.object(r.at(j, path, "special_tokens"), path + ".special_tokens");
    bool seen_sequence = false;
    for (size_t k = 0; k < single.size(); ++k) {
      const std::string where = Reader::index(path + ".single", k);
      const json& item = r.object(single[k], where);
      if (item.contains("Sequence")) {
        const std::string id =
            r.str(r.object(item["Sequence"], where + ".Sequence"), where + ".Sequence", "id");
        if (id != "A" || seen_sequence) r.fail(where, "a single template has one sequence, A");
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = r.str(r.object(item["SpecialToken"], where + ".SpecialToken"),
                                       where + ".SpecialToken", "id");
        append_special_ids(r, specials, path, name, seen_sequence ? impl.after : impl.before);
      } else {
        r.fail(where, "expected a Sequence or a SpecialToken");
      }
    }
    if (!seen_sequence) r.fail(path + ".single", "has no Sequence");
  } else {
    r.unsupported(path, fmt::format("the post-processor \"{}\"", type));
  }
}

void parse_decoder(const Reader& r, const json& j, const std::string& path, Impl& impl) {
  if (j.is_null()) return;
  impl.has_decoder = true;
  const std::string type = r.type(j, path);
  using Kind = Impl::Decoder::Kind;
  if (type == "Sequence") {
    const json& list = r.array(j, path, "decoders");
    for (size_t k = 0; k < list.size(); ++k)
      parse_decoder(r, list[k], Reader::index(Reader::join(path, "decoders"), k), impl);
  } else if (type == "Replace") {
    Impl::Decoder d;
    d.kind = Kind::kReplace;
    d.from = r.string_pattern(j, path);
    d.to = r.str(j, path, "content");
    impl.decoders.push_back(d);
  } else if (type == "ByteFallback") {
    impl.decoders.emplace_back().kind = Kind::kByteFallback;
  } else if (type == "Fuse") {
    impl.decoders.emplace_back().kind = Kind::kFuse;
  } else if (type == "Strip") {
    Impl::Decoder d;
    d.kind = Kind::kStrip;
    d.content = r.str(j, path, "content");
    if (d.content.empty()) r.fail(Reader::join(path, "content"), "empty");
    d.start = r.integer(j, path, "start");
    d.stop = r.integer(j, path, "stop");
    impl.decoders.push_back(d);
  } else if (type == "ByteLevel") {
    impl.decoders.emplace_back().kind = Kind::kByteLevel;
  } else if (type == "Metaspace") {
    Impl::Decoder d;
    d.kind = Kind::kMetaspace;
    d.from = r.str(j, path, "replacement");
    if (const auto scheme = r.opt_str(j, path, "prepend_scheme"))
      d.strip_first = *scheme != "never";
    else
      d.strip_first = r.flag(j, path, "add_prefix_space", true);
    impl.decoders.push_back(d);
  } else {
    r.unsupported(path, fmt::format("the decoder \"{}\"", type));
  }
}

}  // namespace

HfTokenizer::HfTokenizer() : impl_(std::make_unique<Impl>()) {}
HfTokenizer::~HfTokenizer() = default;

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& path) {
  return parse(read_text_file(path), path);
}

std::unique_ptr<HfTokenizer> HfTokenizer::parse(std::string json_text, const std::string& source) {
  const Reader r(source);
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: malformed JSON: {}", source, e.what()));
  }
  r.object(j, "(top level)");
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  Impl& impl = *tok->impl_;
  if (j.contains("truncation") && !j["truncation"].is_null())
    r.unsupported("truncation", "truncation (kuai encodes whole texts)");
  parse_model(r, r.at(j, "", "model"), impl, tok->id_to_token_);
  parse_added(r, j.value("added_tokens", json()), impl, tok->id_to_token_);
  parse_normalizer(r, j.value("normalizer", json()), "normalizer", impl);
  parse_pre_tokenizer(r, j.value("pre_tokenizer", json()), "pre_tokenizer", impl);
  finish_byte_level(impl);
  parse_post_processor(r, j.value("post_processor", json()), "post_processor", impl);
  parse_decoder(r, j.value("decoder", json()), "decoder", impl);
  impl.special.assign(tok->id_to_token_.size(), false);
  for (const auto& a : impl.added) impl.special[a.id] = a.special;
  for (const int32_t id : impl.before)
    if (id < 0 || id >= tok->vocab_size())
      r.fail("post_processor", fmt::format("id {} names no token", id));
  for (const int32_t id : impl.after)
    if (id < 0 || id >= tok->vocab_size())
      r.fail("post_processor", fmt::format("id {} names no token", id));
  tok->json_ = std::move(json_text);
  return tok;
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const { return encode(text, true); }

std::vector<int32_t> HfTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens) out = impl_->before;
  impl_->split_added(text, /*normalized=*/false,
                     [&](std::string_view stretch, size_t offset, int32_t token) {
                       if (token >= 0)
                         out.push_back(token);
                       else
                         impl_->encode_stretch(stretch, offset == 0, out);
                     });
  if (add_special_tokens) out.insert(out.end(), impl_->after.begin(), impl_->after.end());
  return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const { return decode(ids, true); }

std::string HfTokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const std::string& t = id_to_token(id);
    if (skip_special_tokens && impl_->special[id]) continue;
    tokens.push_back(t);
  }
  return impl_->run_decoders(std::move(tokens));
}

std::optional<int32_t> HfTokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  const auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

const std::string& HfTokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size() || id_to_token_[id].empty())
    throw std::out_of_range(
        fmt::format("tokenizer.json: id {} names no token (vocabulary of {})", id, vocab_size()));
  return id_to_token_[id];
}

bool HfTokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->special[id];
}

// --- tokenizer.json for kuai's own tokenizers --------------------------------------------------

namespace {

json byte_level_skeleton() {
  json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = json::array();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", false},
                        {"trim_offsets", true},
                        {"use_regex", true}};
  j["post_processor"] = {{"type", "ByteLevel"},
                         {"add_prefix_space", true},
                         {"trim_offsets", false},
                         {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"},
                  {"add_prefix_space", true},
                  {"trim_offsets", true},
                  {"use_regex", true}};
  return j;
}

json bpe_model(json vocab, json merges) {
  return {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", nullptr},
          {"continuing_subword_prefix", ""},
          {"end_of_word_suffix", ""},
          {"fuse_unk", false},
          {"byte_fallback", false},
          {"vocab", std::move(vocab)},
          {"merges", std::move(merges)}};
}

}  // namespace

std::string byte_tokenizer_json() {
  // Every byte its own id; no pre-tokenizer regex is needed, no merge ever applies.
  json j = byte_level_skeleton();
  j["pre_tokenizer"]["use_regex"] = false;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    append_utf8(symbol, byte_to_alphabet(static_cast<unsigned char>(b)));
    vocab[symbol] = b;
  }
  j["model"] = bpe_model(std::move(vocab), json::array());
  return j.dump(2);
}

std::string gpt2_tokenizer_json(const std::string& encoder_json, const std::string& vocab_bpe) {
  json vocab;
  try {
    vocab = json::parse(read_text_file(encoder_json));
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: malformed JSON: {}", encoder_json, e.what()));
  }
  json merges = json::array();
  const std::string text = read_text_file(vocab_bpe);
  int64_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.front() == '#')) continue;
    merges.push_back(std::move(line));
  }
  json j = byte_level_skeleton();
  if (const auto it = vocab.find("<|endoftext|>"); it != vocab.end())
    j["added_tokens"].push_back({{"id", *it},
                                 {"content", "<|endoftext|>"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  j["model"] = bpe_model(std::move(vocab), std::move(merges));
  return j.dump(2);
}

bool names_tokenizer_json(const std::string& kind) {
  const std::filesystem::path p(kind);
  return p.extension() == ".json" || std::filesystem::is_regular_file(p / "tokenizer.json");
}

}  // namespace kuai::data
