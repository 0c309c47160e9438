// Unicode character classes used by GPT-2's pre-tokeniser: \p{L} (letters), \p{N} (numbers) and
// \s (white space), looked up in range tables compiled into the library (no locale, no ICU).
#pragma once

namespace kuai::data {

// General_Category L* (Lu, Ll, Lt, Lm, Lo).
bool is_unicode_letter(char32_t c);
// General_Category N* (Nd, Nl, No).
bool is_unicode_number(char32_t c);
// The White_Space property: U+0009-000D, U+0020, U+0085, U+00A0, U+1680, U+2000-200A,
// U+2028, U+2029, U+202F, U+205F, U+3000.
bool is_unicode_space(char32_t c);

}  // namespace kuai::data
