// A small text file (a config, a tokenizer) written whole or not at all.
#pragma once

#include <string>

namespace kuai::io {

// Writes `text` to path through path + ".tmp", renamed over it. Throws std::runtime_error naming
// the file when it cannot be written or renamed; the old file, if any, is then untouched.
void write_text_atomically(const std::string& path, const std::string& text);

}  // namespace kuai::io
