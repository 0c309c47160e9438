// A tokenizer read from Hugging Face's tokenizer.json (the `tokenizers` library's format), the
// file every model in the Hugging Face layout ships. What it implements is what the LLaMA-1/2
// (SentencePiece-style), LLaMA-3 and GPT-2 families use:
//   normalizer      Sequence, Prepend, Replace (a String pattern)
//   pre_tokenizer   Sequence, ByteLevel, Metaspace, Split (the GPT-2, LLaMA-3 and Qwen2 regexes;
//                   Isolated or Removed)
//   model           BPE: vocab, merges ("a b" or ["a", "b"]), byte_fallback, ignore_merges,
//                   unk_token, fuse_unk
//   post_processor  TemplateProcessing (single sequences), ByteLevel, Sequence
//   decoder         Sequence, Replace, ByteFallback, Fuse, Strip, ByteLevel, Metaspace
//   added_tokens    special or not, normalized or not, lstrip, rstrip
// A component or option it does not implement is refused by name when the file is loaded, never
// ignored. Encoding follows the library step by step: the added tokens are cut out of the text,
// each stretch between them is normalized, pre-tokenized and run through the model, then the
// post-processor adds the special tokens (BOS/EOS) its template names.
//
// One deliberate difference: decode returns bytes. Where the library writes U+FFFD for a byte
// sequence that is not valid UTF-8 (a byte-fallback or byte-level token cut off mid-character),
// kuai returns the bytes themselves, so a byte-level tokenizer gives decode(encode(x)) == x for
// any bytes, and a decode of a prefix of the ids is a prefix of the decode of all (what streaming
// needs).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kuai/data/tokenizer.h"

namespace kuai::data {

class HfTokenizer : public Tokenizer {
 public:
  // Throws std::runtime_error naming the file and what failed: unreadable, malformed JSON, a
  // missing or mistyped field (by its path, e.g. model.merges[12]), a merge or a special token
  // that is not in the vocabulary, or a component kuai does not implement (by its type).
  static std::unique_ptr<HfTokenizer> load(const std::string& path);
  // The same from the file's text; `source` names it in errors.
  static std::unique_ptr<HfTokenizer> parse(std::string json_text, const std::string& source);

  // With the post-processor's special tokens (BOS for LLaMA-2), as the library's encode does.
  std::vector<int32_t> encode(std::string_view text) const override;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // Special tokens are skipped (the library's default); throws std::out_of_range for an id that
  // names no token.
  std::string decode(std::span<const int32_t> ids) const override;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  // One past the largest id of the vocabulary and the added tokens.
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::string name() const override { return "tokenizer.json"; }

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Throws std::out_of_range for an id that names no token.
  const std::string& id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // The file as read: what `kuai export --hf` copies beside a model.
  const std::string& json_text() const { return json_; }

  struct Impl;  // the parsed pipeline (hf_tokenizer.cpp)
  ~HfTokenizer() override;

 private:
  HfTokenizer();
  std::unique_ptr<Impl> impl_;
  std::string json_;
  std::vector<std::string> id_to_token_;  // "" for an id no token has
};

// tokenizer.json text for kuai's byte tokenizer (ids 0..255 are the bytes: a BPE without merges
// over the byte-level alphabet) and for GPT-2's, from its encoder.json and vocab.bpe. Loaded by
// HfTokenizer (or by the `tokenizers` library) they give the same ids as ByteTokenizer and
// Gpt2Tokenizer.
std::string byte_tokenizer_json();
std::string gpt2_tokenizer_json(const std::string& encoder_json, const std::string& vocab_bpe);

// Whether `kind` (of --tokenizer) names a tokenizer.json: a path ending in ".json", or a
// directory holding one.
bool names_tokenizer_json(const std::string& kind);

}  // namespace kuai::data
