// `kuai prepare`: tokenizes a text file into a kuai token file (token_file.h), at the narrowest
// token width the tokenizer's vocabulary fits: 1 byte up to 256 ids, 2 up to 65536, else 4. A
// tokenizer read from a tokenizer.json is written beside the token file (tokenizer_file_of), so
// that a run trained on it, and its exports, carry the tokenizer that made its ids.
#pragma once

#include <cstdint>
#include <string>

#include "kuai/data/tokenizer.h"

namespace kuai::data {

struct PrepareStats {
  int64_t bytes_in = 0;  // size of the text file
  int64_t tokens = 0;    // tokens written
  int token_bytes = 0;   // bytes per token in the file: 1, 2 or 4
};

// Bytes per token for a vocabulary of vocab_size ids.
int token_bytes_for_vocab(int64_t vocab_size);

// The tokenizer.json that goes with a token file: "data/x.bin" -> "data/x.tokenizer.json".
std::string tokenizer_file_of(const std::string& token_file);

// Reads all of text_path, encodes it with tok and writes out_path, and, for a tokenizer.json
// tokenizer, its file as tokenizer_file_of(out_path) (for another tokenizer an old one there is
// removed). Throws std::runtime_error naming the path when the text cannot be read or a file
// cannot be written.
PrepareStats prepare_token_file(const std::string& text_path, const std::string& out_path,
                                const Tokenizer& tok);

}  // namespace kuai::data
