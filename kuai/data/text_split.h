// The text-level pieces the tokenizers share: UTF-8 code points (a byte that is not part of valid
// UTF-8 is a code point of its own, so any bytes survive), GPT-2's printable byte alphabet, and the
// two pre-tokenisation regexes in use (GPT-2's, and LLaMA-3's with its Qwen2 variant), written by
// hand over the character classes of unicode_class.h. See text_split.cpp for the regexes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kuai::data {

// What decode_utf8 returns for a byte that does not start a valid, shortest-form sequence.
inline constexpr char32_t kInvalidByte = 0xFFFFFFFF;

// Decodes the code point starting at s[i] into *cp and returns its length in bytes (1 for an
// invalid byte, with *cp = kInvalidByte).
size_t decode_utf8(std::string_view s, size_t i, char32_t* cp);
void append_utf8(std::string& out, char32_t c);

// GPT-2's byte alphabet: bytes that print as themselves ('!'..'~', U+00A1..U+00AC,
// U+00AE..U+00FF) keep their value; the other 68 bytes get U+0100, U+0101, ... in byte order.
char32_t byte_to_alphabet(unsigned char b);
// The byte a code point of the alphabet stands for, or -1.
int alphabet_to_byte(char32_t c);

// Byte offset where the piece of GPT-2's pre-tokenisation that starts at byte offset i ends.
size_t gpt2_piece_end(std::string_view s, size_t i);
// The same for LLaMA-3's regex; max_digits 3 (LLaMA-3) or 1 (Qwen2's \p{N} alternative).
size_t llama3_piece_end(std::string_view s, size_t i, int max_digits);

}  // namespace kuai::data
