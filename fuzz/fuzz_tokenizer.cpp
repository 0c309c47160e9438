// libFuzzer target for the tokenizer.json reader (kuai/data/hf_tokenizer.h). The first byte picks
// what the rest is:
//   even: a tokenizer.json. Rejections (std::runtime_error naming the file) are fine; a file that
//         loads must encode any text to ids inside its vocabulary, and decode them again.
//   odd:  text, for two fixed tokenizers: the byte-level one (decode(encode(x)) == x exactly, for
//         any bytes) and a SentencePiece-style one with byte fallback, merges and special tokens
//         (ids inside the vocabulary; the decode of every prefix of the ids is a prefix of the
//         decode of all of them, what `kuai sample` streams by).
// Crashes, sanitizer reports, leaks and hangs are failures.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "kuai/data/hf_tokenizer.h"
#include "tests/support/sentencepiece_json.h"

namespace {

using kuai::data::HfTokenizer;

[[noreturn]] void fail(const char* what, std::string_view text) {
  std::fprintf(stderr, "fuzz_tokenizer: %s\ninput: %.*s\n", what, static_cast<int>(text.size()),
               text.data());
  std::abort();
}

void check_ids(const HfTokenizer& tok, const std::vector<int32_t>& ids, std::string_view text) {
  for (const int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size()) fail("an id outside the vocabulary", text);
}

// With "▁ ▁" too, so that runs of spaces merge.
std::string sentencepiece_json() {
  nlohmann::json j = kuai::test::byte_fallback_tokenizer({"the", "and", "<s"});
  const std::string sp = kuai::test::kSpaceSign;
  j["model"]["merges"].push_back(sp + " " + sp);
  j["model"]["vocab"][sp + sp] = static_cast<int>(j["model"]["vocab"].size());
  return j.dump();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    std::unique_ptr<HfTokenizer> tok;
    try {
      tok = HfTokenizer::parse(std::string(rest), "fuzz.json");
    } catch (const std::runtime_error&) {
      return 0;
    }
    for (const std::string_view text : {std::string_view("Hello, world!  x\n"), rest}) {
      const std::vector<int32_t> ids = tok->encode(text);
      check_ids(*tok, ids, text);
      (void)tok->decode(ids, false);
      (void)tok->decode(ids, true);
    }
    return 0;
  }
  static const auto bytes = HfTokenizer::parse(kuai::data::byte_tokenizer_json(), "byte");
  static const auto sp = HfTokenizer::parse(sentencepiece_json(), "sentencepiece");
  const std::vector<int32_t> b = bytes->encode(rest);
  check_ids(*bytes, b, rest);
  if (bytes->decode(b) != rest) fail("byte-level: decode(encode(x)) != x", rest);
  for (const bool special : {true, false}) {
    const std::vector<int32_t> ids = sp->encode(rest, special);
    check_ids(*sp, ids, rest);
    const std::string all = sp->decode(ids, false);
    // Every prefix of a short input; of a long one the first 64 and then every 64th (each decode
    // is linear, all of them would be quadratic).
    for (size_t k = 0; k < ids.size(); k += k < 64 ? 1 : 64) {
      const std::string part = sp->decode(std::span<const int32_t>(ids.data(), k), false);
      if (all.compare(0, part.size(), part) != 0) fail("a prefix's decode is no prefix", rest);
    }
  }
  return 0;
}
