// Tokenizers: text in, token ids out. ByteTokenizer maps each byte to its own id (vocab 256);
// Gpt2Tokenizer is GPT-2's byte-level BPE, loaded from the encoder.json and vocab.bpe that
// `scripts/setup.sh --bpe` puts in data/gpt2/; HfTokenizer (hf_tokenizer.h) reads a Hugging Face
// tokenizer.json.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kuai/data/bpe.h"

namespace kuai::data {

// Where `scripts/setup.sh --bpe` puts encoder.json and vocab.bpe (relative to the repository).
inline constexpr char kDefaultBpeDir[] = "data/gpt2";

class Tokenizer {
 public:
  virtual ~Tokenizer();
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws std::out_of_range for an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual std::string name() const = 0;
};

// One id per byte; decode(encode(x)) == x for any bytes.
class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return 256; }
  std::string name() const override { return "byte"; }
};

// GPT-2's byte-level BPE: the text is split into pieces by GPT-2's pre-tokenisation regex, each
// piece's bytes are mapped to GPT-2's printable byte alphabet, and adjacent symbols are merged,
// lowest merge rank first, until no ranked pair is left. decode(encode(x)) == x for any bytes
// (invalid UTF-8 included). encode is thread-safe (the piece cache takes a lock).
class Gpt2Tokenizer : public Tokenizer {
 public:
  // Throws std::runtime_error naming the file and the problem: missing or unreadable file,
  // malformed JSON, an id that is not a dense 0..n-1 numbering, a byte of the alphabet without
  // a token, a malformed merge line, or a merge whose symbols are not tokens.
  static std::unique_ptr<Gpt2Tokenizer> load(const std::string& encoder_json,
                                             const std::string& vocab_bpe);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  std::string name() const override { return "gpt2"; }
  // Id of "<|endoftext|>" (50256 for GPT-2), or -1 when the vocabulary has none.
  int32_t eot_id() const { return eot_id_; }

  // GPT-2's pre-tokenisation of text into consecutive pieces (views into text) whose
  // concatenation is text; see tokenizer.cpp for the rules.
  static std::vector<std::string_view> pre_tokenize(std::string_view text);

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  Gpt2Tokenizer() = default;
  // BPE of one piece (raw bytes) into token ids.
  std::vector<int32_t> bpe(std::string_view piece) const;

  std::vector<std::string> token_bytes_;  // id -> the raw bytes it stands for
  int32_t byte_token_[256] = {};          // byte -> id of its single-symbol token
  BpeMerges merges_;
  int32_t eot_id_ = -1;

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

// kuai's tokenizer for a model of vocab_size ids that names none: "byte" up to 256, else "gpt2".
std::string tokenizer_for_vocab(int64_t vocab_size);

// kind "byte", "gpt2" (bpe_dir holds encoder.json and vocab.bpe, e.g. kDefaultBpeDir), or the path
// of a Hugging Face tokenizer.json (or of a directory holding one; hf_tokenizer.h). Throws
// std::runtime_error for an unknown kind (naming the allowed ones), a missing vocabulary file
// (saying to run scripts/setup.sh --bpe), or a tokenizer.json that cannot be used.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& bpe_dir);

}  // namespace kuai::data
