// `kuai prepare`: tokenizes a text file into a kuai token file (token_file.h), at the narrowest
// token width the tokenizer's vocabulary fits: 1 byte up to 256 ids, 2 up to 65536, else 4.
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

// Reads all of text_path, encodes it with tok and writes out_path. Throws std::runtime_error
// naming the path when the text cannot be read or the token file cannot be written.
PrepareStats prepare_token_file(const std::string& text_path, const std::string& out_path,
                                const Tokenizer& tok);

}  // namespace kuai::data
