// The tokenizer.json reader (kuai/data/hf_tokenizer.h) on small files written here: each
// component of the SentencePiece-style (LLaMA-1/2), regex + byte-level (LLaMA-3) and byte-level
// (GPT-2) pipelines, added and special tokens, the template's BOS/EOS, decoders, round trips of
// any bytes, and a clear refusal of what it does not implement. The real files against the
// JavaScript tokenizers: tests/data/hf_peers.sh.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "../support/sentencepiece_json.h"
#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/text_split.h"
#include "kuai/data/tokenizer.h"

namespace kuai::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;

const std::string kSourceDir = KUAI_SOURCE_DIR;
const std::string& kSp = test::kSpaceSign;

std::string temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("kuai_hf_tokenizer_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

using test::added_token;

// A small LLaMA-2-shaped file: <unk> <s> </s>, byte tokens for 0xE2 0x82 0xAC (the euro sign)
// and 0x0A, then characters and merges.
json llama_like() {
  json vocab = {{"<unk>", 0},  {"<s>", 1},       {"</s>", 2},   {"<0x0A>", 3},
                {"<0xE2>", 4}, {"<0x82>", 5},    {"<0xAC>", 6}, {kSp, 7},
                {"a", 8},      {"b", 9},         {"c", 10},     {kSp + "a", 11},
                {"ab", 12},    {kSp + "ab", 13}, {"é", 14},     {kSp + kSp, 15}};
  json merges = {kSp + " a", "a b", kSp + "a b", kSp + " " + kSp};
  return test::sentencepiece_tokenizer(vocab, merges);
}

std::unique_ptr<HfTokenizer> parse(const json& j, const std::string& name = "test.json") {
  return HfTokenizer::parse(j.dump(), name);
}

TEST(HfTokenizer, SentencePieceStylePipeline) {
  auto tok = parse(llama_like());
  EXPECT_EQ(tok->vocab_size(), 16);
  EXPECT_EQ(tok->name(), "tokenizer.json");
  // Prepend + Replace: " ab" is ▁▁ab; merges ▁a, ab, ▁a b (ranked in that order), ▁ ▁.
  EXPECT_EQ(tok->encode("ab"), (Ids{1, 13}));
  EXPECT_EQ(tok->encode("ab", false), (Ids{13}));
  EXPECT_EQ(tok->encode("ab ab"), (Ids{1, 13, 13}));
  EXPECT_EQ(tok->encode(" ab"), (Ids{1, 7, 13}));  // ▁▁ab: ▁a first (rank 0), so not ▁▁
  EXPECT_EQ(tok->encode("c"), (Ids{1, 7, 10}));
  // Byte fallback: the euro sign's three bytes; a character with neither a token nor byte
  // tokens for all its bytes is <unk>, and neighbouring unknowns fuse into one.
  EXPECT_EQ(tok->encode("\u20ac", false), (Ids{7, 4, 5, 6}));
  EXPECT_EQ(tok->encode("xyz", false), (Ids{7, 0}));
  EXPECT_EQ(tok->encode("a\nb", false), (Ids{11, 3, 9}));
  // The empty text: no normalizer prepends to it; the template's BOS remains.
  EXPECT_EQ(tok->encode(""), (Ids{1}));
  EXPECT_EQ(tok->encode("", false), Ids{});
  // Decode: ▁ -> space, bytes fused back into UTF-8, one leading space stripped; special tokens
  // skipped unless asked for.
  EXPECT_EQ(tok->decode(Ids{1, 13, 13}), "ab ab");
  EXPECT_EQ(tok->decode(Ids{1, 13, 13}, false), "<s> ab ab");
  EXPECT_EQ(tok->decode(tok->encode("a\u20ac\nab é")), "a\u20ac\nab é");
  EXPECT_EQ(tok->decode(tok->encode("  ab  ")), "  ab  ");
  EXPECT_THROW(tok->decode(Ids{16}), std::out_of_range);
  EXPECT_THROW(tok->decode(Ids{-1}), std::out_of_range);
  EXPECT_EQ(tok->token_to_id(kSp + "ab"), 13);
  EXPECT_EQ(tok->token_to_id("<s>"), 1);
  EXPECT_FALSE(tok->token_to_id("zz").has_value());
  EXPECT_TRUE(tok->is_special(1));
  EXPECT_FALSE(tok->is_special(13));
}

TEST(HfTokenizer, DecodingAPrefixOfTheIdsGivesAPrefixOfTheText) {
  // What streaming a sample relies on, including a character cut between its fallback bytes.
  auto tok = parse(llama_like());
  const Ids ids = tok->encode("ab \u20ac c\nab");
  const std::string all = tok->decode(ids);
  for (size_t k = 0; k <= ids.size(); ++k) {
    const std::string part = tok->decode(std::span<const int32_t>(ids.data(), k));
    EXPECT_EQ(all.compare(0, part.size(), part), 0) << k;
  }
}

TEST(HfTokenizer, AddedTokensAreCutOutBeforeNormalizing) {
  json j = llama_like();
  j["added_tokens"].push_back(added_token(16, "<|x|>"));
  json strip = added_token(17, "[S]", false);
  strip["lstrip"] = true;
  strip["rstrip"] = true;
  j["added_tokens"].push_back(strip);
  auto tok = parse(j);
  EXPECT_EQ(tok->vocab_size(), 18);
  // Each stretch between added tokens is normalized on its own (each gets its ▁).
  EXPECT_EQ(tok->encode("ab<|x|>ab", false), (Ids{13, 16, 13}));
  EXPECT_EQ(tok->encode("<s>ab</s>", false), (Ids{1, 13, 2}));
  // lstrip/rstrip take the white space around the token with it.
  EXPECT_EQ(tok->encode("ab  [S]  ab", false), (Ids{13, 17, 13}));
  EXPECT_EQ(tok->encode("ab<|x", false), (Ids{13, 0}));  // not a whole token: <unk> (fused)
  EXPECT_EQ(tok->decode(Ids{13, 16, 13}), "ab ab");      // special skipped
  EXPECT_EQ(tok->decode(Ids{13, 17, 13}), "ab[S] ab");   // not special: kept
}

TEST(HfTokenizer, TemplateAddsBosAndEos) {
  json j = llama_like();
  j["post_processor"]["single"].push_back({{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}});
  j["post_processor"]["special_tokens"]["</s>"] = {
      {"id", "</s>"}, {"ids", {2}}, {"tokens", {"</s>"}}};
  auto tok = parse(j);
  EXPECT_EQ(tok->encode("ab"), (Ids{1, 13, 2}));
  EXPECT_EQ(tok->encode("ab", false), (Ids{13}));
  j["post_processor"]["special_tokens"].erase("</s>");
  try {
    parse(j, "eos.json");
    ADD_FAILURE() << "a template naming an undefined special token was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("special_tokens[\"</s>\"]"), std::string::npos)
        << e.what();
  }
}

TEST(HfTokenizer, MetaspacePreTokenizerAndDecoder) {
  json j = llama_like();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}, {"split", false}};
  j["decoder"] = {
      {"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}, {"split", false}};
  j["added_tokens"].push_back(added_token(16, "<|x|>"));
  auto tok = parse(j);
  // "first": only the stretch at the start of the text gets the ▁.
  EXPECT_EQ(tok->encode("ab<|x|>ab", false), (Ids{13, 16, 12}));
  EXPECT_EQ(tok->encode("ab ab", false), (Ids{13, 13}));
  EXPECT_EQ(tok->decode(Ids{13, 13}), "ab ab");
  j["pre_tokenizer"]["prepend_scheme"] = "always";
  EXPECT_EQ(parse(j)->encode("ab<|x|>ab", false), (Ids{13, 16, 13}));
  j["pre_tokenizer"]["prepend_scheme"] = "never";
  EXPECT_EQ(parse(j)->encode("ab", false), (Ids{12}));
  // split: pieces start at each ▁, so "▁▁" cannot merge across them.
  j["pre_tokenizer"]["prepend_scheme"] = "always";
  j["pre_tokenizer"]["split"] = true;
  EXPECT_EQ(parse(j)->encode("c  c", false), (Ids{7, 10, 7, 7, 10}));
  j["pre_tokenizer"]["split"] = false;
  EXPECT_EQ(parse(j)->encode("c  c", false), (Ids{7, 10, 15, 10}));
  j["pre_tokenizer"]["prepend_scheme"] = "sometimes";
  EXPECT_THROW(parse(j), std::runtime_error);
}

// The byte tokenizer written as a tokenizer.json: ids equal ByteTokenizer's for any bytes.
TEST(HfTokenizer, ByteTokenizerAsTokenizerJsonEqualsByteTokenizer) {
  auto tok = HfTokenizer::parse(byte_tokenizer_json(), "byte");
  ByteTokenizer bytes;
  EXPECT_EQ(tok->vocab_size(), 256);
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  for (const std::string& text :
       {std::string(), all, std::string("invalid \xff\xfe \xc3 utf-8 \xe2\x82"),
        std::string("Hello, world!\n  \t\r\n"), std::string("日本語 🎉 e\u0301")}) {
    EXPECT_EQ(tok->encode(text), bytes.encode(text));
    EXPECT_EQ(tok->decode(tok->encode(text)), text);
  }
}

// GPT-2's files written as a tokenizer.json: the same ids as Gpt2Tokenizer, on a small
// vocabulary whose merge ranks follow the order tokens are made (as every trained one's do).
TEST(HfTokenizer, Gpt2TokenizerJsonEqualsGpt2Tokenizer) {
  const std::string dir = temp_dir("gpt2");
  json enc = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, byte_to_alphabet(static_cast<unsigned char>(b)));
    enc[s] = b;
  }
  const std::vector<std::string> merges = {"\u0120 t", "h e",  "\u0120t he", "i n", "\u0120 \u0120",
                                           "a b",      "ab c", "1 2",        "12 3"};
  int id = 256;
  for (const std::string& m : merges) {
    std::string merged = m;
    merged.erase(merged.find(' '), 1);
    enc[merged] = id++;
  }
  enc["<|endoftext|>"] = id;
  write_text(dir + "/encoder.json", enc.dump());
  std::string bpe = "#version: 0.2\n";
  for (const std::string& m : merges) bpe += m + "\n";
  write_text(dir + "/vocab.bpe", bpe);
  auto gpt2 = Gpt2Tokenizer::load(dir + "/encoder.json", dir + "/vocab.bpe");
  auto hf = HfTokenizer::parse(gpt2_tokenizer_json(dir + "/encoder.json", dir + "/vocab.bpe"), "g");
  EXPECT_EQ(hf->vocab_size(), gpt2->vocab_size());
  for (const std::string& text :
       {std::string("the thin abc in the inn 123 1234"), std::string("  spaced   out\n\n\tx"),
        std::string("I'm sure they'll say it's fine; we've done it"),
        std::string("bytes \xff\xfe \xc3 end"), std::string("日本語 🎉 ½ ١٢٣")}) {
    EXPECT_EQ(hf->encode(text), gpt2->encode(text)) << text;
    EXPECT_EQ(hf->decode(hf->encode(text)), text);
  }
  // <|endoftext|> in the text is the special token (the library's behaviour; kuai's own GPT-2
  // tokenizer treats text as text).
  EXPECT_EQ(hf->encode("a<|endoftext|>"), (Ids{'a' - 0, id}));
}

TEST(HfTokenizer, IgnoreMergesTakesAWholeWordThatIsAToken) {
  json j = llama_like();
  j["model"]["vocab"]["abc"] = 16;  // reachable by no merge
  j["normalizer"] = nullptr;
  EXPECT_EQ(parse(j)->encode("abc", false), (Ids{12, 10}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(parse(j)->encode("abc", false), (Ids{16}));
}

// A merge made available by an earlier merge of better rank is taken at once (the library's
// heap), where GPT-2's own loop would first finish every occurrence of the current pair.
TEST(HfTokenizer, MergesFollowTheLibrarysOrder) {
  json j = llama_like();
  j["normalizer"] = nullptr;
  j["model"]["vocab"]["ca"] = 16;
  j["model"]["vocab"]["cab"] = 17;
  j["model"]["merges"] = {"ca b", "c a"};  // "ca b" outranks the merge that makes "ca"
  EXPECT_EQ(parse(j)->encode("cacab", false), (Ids{16, 17}));
  // A pair listed twice keeps its last rank (the library collects the list into a map).
  j["model"]["merges"] = {"a b", kSp + " a", "a b"};
  EXPECT_EQ(parse(j)->encode(kSp + "ab", false), (Ids{11, 9}));
}

TEST(HfTokenizer, Llama3RegexPieces) {
  const auto pieces = [](std::string_view s) {
    std::vector<std::string> out;
    for (size_t i = 0; i < s.size();) {
      const size_t j = llama3_piece_end(s, i, 3);
      out.emplace_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("I'M here, they'Ll go"), (V{"I", "'M", " here", ",", " they", "'Ll", " go"}));
  EXPECT_EQ(pieces("1234567 x"), (V{"123", "456", "7", " x"}));
  EXPECT_EQ(pieces("a  \n\n  b"), (V{"a", "  \n\n", " ", " b"}));
  EXPECT_EQ(pieces("end!!\r\n\nnext"), (V{"end", "!!\r\n\n", "next"}));
  EXPECT_EQ(pieces("   "), (V{"   "}));
  EXPECT_EQ(pieces("x   "), (V{"x", "   "}));
  EXPECT_EQ(pieces("\"quoted\" (a)"), (V{"\"quoted", "\"", " (", "a", ")"}));
  EXPECT_EQ(pieces("it'\u017f"), (V{"it", "'\u017f"}));
}

void expect_refused(const json& j, const std::vector<std::string>& needles) {
  try {
    HfTokenizer::parse(j.dump(), "bad/tokenizer.json");
    ADD_FAILURE() << "accepted; expected an error with " << needles[0];
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("bad/tokenizer.json"), std::string::npos) << what;
    for (const std::string& n : needles)
      EXPECT_NE(what.find(n), std::string::npos) << what << "\n  lacks: " << n;
  }
}

TEST(HfTokenizer, WhatIsNotImplementedIsRefusedByName) {
  const json base = llama_like();
  json j = base;
  j["normalizer"] = {{"type", "NFKC"}};
  expect_refused(j, {"normalizer", "the normalizer \"NFKC\"", "not implemented"});
  j = base;
  j["normalizer"]["normalizers"][1] = {{"type", "Lowercase"}};
  expect_refused(j, {"normalizer.normalizers[1]", "\"Lowercase\""});
  j = base;
  j["normalizer"]["normalizers"][1]["pattern"] = {{"Regex", " +"}};
  expect_refused(j, {"a Regex pattern"});
  j = base;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_refused(j, {"pre_tokenizer", "the pre-tokenizer \"Whitespace\""});
  j = base;
  j["pre_tokenizer"] = {{"type", "Split"},
                        {"pattern", {{"Regex", "\\w+"}}},
                        {"behavior", "Isolated"},
                        {"invert", false}};
  expect_refused(j, {"pre_tokenizer.pattern", "the regex \"\\w+\""});
  j["pre_tokenizer"]["pattern"]["Regex"] =
      "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
  j["pre_tokenizer"]["behavior"] = "MergedWithPrevious";
  expect_refused(j, {"the Split behavior \"MergedWithPrevious\""});
  j = base;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", {{{"type", "ByteLevel"}}, {{"type", "Metaspace"}, {"replacement", kSp}}}}};
  expect_refused(j, {"pre_tokenizer.pretokenizers[1]", "after ByteLevel"});
  j = base;
  j["model"]["type"] = "WordPiece";
  expect_refused(j, {"model", "the model \"WordPiece\""});
  j = base;
  j["model"]["dropout"] = 0.1;
  expect_refused(j, {"model.dropout", "dropout"});
  j = base;
  j["model"]["continuing_subword_prefix"] = "##";
  expect_refused(j, {"model.continuing_subword_prefix"});
  j = base;
  j["post_processor"] = {{"type", "RobertaProcessing"}};
  expect_refused(j, {"post_processor", "the post-processor \"RobertaProcessing\""});
  j = base;
  j["decoder"]["decoders"][2] = {{"type", "WordPiece"}};
  expect_refused(j, {"decoder.decoders[2]", "the decoder \"WordPiece\""});
  j = base;
  j["truncation"] = {{"max_length", 512}};
  expect_refused(j, {"truncation"});
  j = base;
  j["added_tokens"][1]["single_word"] = true;
  expect_refused(j, {"added_tokens[1].single_word"});
}

TEST(HfTokenizer, MalformedFilesNameTheFieldAndTheProblem) {
  const json base = llama_like();
  json j = base;
  j["model"]["merges"][1] = "a x";
  expect_refused(j, {"model.merges[1]", "\"x\" is not in the vocabulary"});
  j["model"]["merges"][1] = "a b c";
  expect_refused(j, {"model.merges[1]", "two tokens"});
  j["model"]["merges"][1] = {"a", "b"};  // the newer pair form is fine
  EXPECT_EQ(parse(j)->encode("ab", false), (Ids{13}));
  j = base;
  j["model"].erase("vocab");
  expect_refused(j, {"model.vocab", "missing"});
  j = base;
  j["model"]["vocab"]["zz"] = 3;
  expect_refused(j, {"model.vocab[\"", "id 3 is given to two tokens"});
  j = base;
  j["model"]["vocab"]["zz"] = "seven";
  expect_refused(j, {"model.vocab[\"zz\"]", "integer"});
  j = base;
  j["model"]["unk_token"] = "<nope>";
  expect_refused(j, {"model.unk_token", "<nope>"});
  j = base;
  j["added_tokens"][0]["id"] = 5;
  expect_refused(j, {"added_tokens[0]", "id 5"});
  j = base;
  j["decoder"]["decoders"][3].erase("start");
  expect_refused(j, {"decoder.decoders[3].start", "missing"});
  try {
    HfTokenizer::parse("{\"model\": ", "cut.json");
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cut.json: malformed JSON"), std::string::npos);
  }
  EXPECT_THROW(HfTokenizer::load("/nonexistent/tokenizer.json"), std::runtime_error);
}

// encode is const and may run on several threads at once (its piece cache takes a lock); run
// under ThreadSanitizer too (the Makefile's TSAN_TESTS).
TEST(HfTokenizer, EncodesOnSeveralThreadsAtOnce) {
  auto tok = HfTokenizer::parse(byte_tokenizer_json(), "byte");
  json j = llama_like();
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kSp}, {"split", true}};
  j["normalizer"] = nullptr;
  auto sp = parse(j);  // short pieces: the cache is used
  std::vector<std::string> texts;
  for (int k = 0; k < 64; ++k)
    texts.push_back("ab c abab " + std::to_string(k) + " ab\xe2\x82\xac");
  std::vector<Ids> expected;
  for (const std::string& t : texts) expected.push_back(sp->encode(t));
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int round = 0; round < 20; ++round)
        for (size_t k = (w + round) % texts.size(), n = 0; n < texts.size();
             ++n, k = (k + 1) % texts.size()) {
          if (sp->encode(texts[k]) != expected[k]) ++wrong;
          if (tok->decode(tok->encode(texts[k])) != texts[k]) ++wrong;
        }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(HfTokenizer, MakeTokenizerTakesAFileOrItsDirectory) {
  const std::string dir = temp_dir("make");
  write_text(dir + "/tokenizer.json", llama_like().dump());
  for (const std::string& kind : {dir, dir + "/tokenizer.json"}) {
    auto tok = make_tokenizer(kind, "");
    EXPECT_EQ(tok->name(), "tokenizer.json");
    EXPECT_EQ(tok->encode("ab"), (Ids{1, 13}));
  }
  EXPECT_THROW(make_tokenizer(dir + "/other.json", ""), std::runtime_error);
}

}  // namespace
}  // namespace kuai::data
