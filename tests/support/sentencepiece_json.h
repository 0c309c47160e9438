// tokenizer.json files of LLaMA-2's SentencePiece-style layout, small, for the tests and the
// tokenizer fuzzer: the layout around a vocabulary, and a vocabulary with byte fallback.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kuai::test {

inline const std::string kSpaceSign = "\u2581";  // SentencePiece's space

// An added token as tokenizer.json lists it.
inline nlohmann::json added_token(int id, const std::string& content, bool special = true) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", special}};
}

// LLaMA-2's layout around `vocab` (which has <unk> <s> </s> as ids 0, 1, 2) and `merges`: those
// three as special added tokens, a Prepend + Replace normalizer, <s> added by the template, the
// Replace/ByteFallback/Fuse/Strip decoder, BPE with unk, fuse_unk and byte fallback.
inline nlohmann::json sentencepiece_tokenizer(nlohmann::json vocab, nlohmann::json merges) {
  const std::string& sp = kSpaceSign;
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {added_token(0, "<unk>"), added_token(1, "<s>"), added_token(2, "</s>")}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", sp}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", sp}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", std::move(vocab)},
        {"merges", std::move(merges)}}}};
}

// The layout above over <unk> <s> </s>, the 256 byte tokens, ▁ and printable ASCII, with the
// merges that build "▁" + each of `words` one character at a time.
inline nlohmann::json byte_fallback_tokenizer(const std::vector<std::string>& words) {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  int id = 3;
  char name[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = id++;
  }
  vocab[kSpaceSign] = id++;
  for (char c = '!'; c <= '~'; ++c) vocab[std::string(1, c)] = id++;
  nlohmann::json merges = nlohmann::json::array();
  for (const std::string& word : words) {
    std::string left = kSpaceSign;
    for (const char c : word) {
      merges.push_back(left + " " + std::string(1, c));
      left += c;
      if (!vocab.contains(left)) vocab[left] = id++;
    }
  }
  return sentencepiece_tokenizer(std::move(vocab), std::move(merges));
}

}  // namespace kuai::test
