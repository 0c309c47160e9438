// UTF-8, GPT-2's byte alphabet and the pre-tokenisation regexes (see text_split.h).
//
// GPT-2's regex (also the ByteLevel pre-tokenizer's of Hugging Face's tokenizers):
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// LLaMA-3's (a Split pre-tokenizer in its tokenizer.json; Qwen2's has \p{N} for \p{N}{1,3}):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// Both are tried alternative by alternative at each position, as a backtracking regex engine
// would, over UTF-8 code points with the classes of unicode_class.h (Unicode 17.0 tables). What
// differs from a regex engine: \s is the White_Space property (as in Rust's and Python's regex;
// JavaScript's \s also counts U+FEFF and not U+0085), and a byte that is not part of valid UTF-8
// is a code point of its own in the "other" class (a regex engine would refuse the text or see
// U+FFFD, also "other"), so any bytes round-trip.
#include "kuai/data/text_split.h"

#include <algorithm>
#include <iterator>

#include "kuai/data/unicode_class.h"

namespace kuai::data {
namespace {

struct ByteAlphabet {
  char32_t byte_to_char[256];
  int16_t char_to_byte[0x100 + 68];  // -1 where the code point is not in the alphabet

  ByteAlphabet() {
    std::fill(std::begin(char_to_byte), std::end(char_to_byte), int16_t{-1});
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool prints = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_char[b] = prints ? static_cast<char32_t>(b) : next++;
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

CharClass classify(char32_t c) {
  if (c < 0x80) {  // ASCII without the tables
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return CharClass::kLetter;
    if (c >= '0' && c <= '9') return CharClass::kNumber;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return CharClass::kSpace;
    return CharClass::kOther;
  }
  if (c == kInvalidByte) return CharClass::kOther;
  if (is_unicode_letter(c)) return CharClass::kLetter;
  if (is_unicode_number(c)) return CharClass::kNumber;
  if (is_unicode_space(c)) return CharClass::kSpace;
  return CharClass::kOther;
}

// One code point of the text being split: its value, class and byte length.
struct Unit {
  char32_t cp = 0;
  CharClass cls = CharClass::kOther;
  size_t len = 0;  // 0 past the end of the text
};

Unit unit_at(std::string_view s, size_t i) {
  Unit u;
  if (i >= s.size()) return u;
  u.len = decode_utf8(s, i, &u.cp);
  u.cls = classify(u.cp);
  return u;
}

// End (byte offset) of the run of class cls that starts at byte offset i.
size_t run_end(std::string_view s, size_t i, CharClass cls) {
  for (Unit u = unit_at(s, i); u.len && u.cls == cls; u = unit_at(s, i)) i += u.len;
  return i;
}

bool is_cr_or_lf(char32_t c) { return c == '\r' || c == '\n'; }

// "\s+(?!\S)|\s+" at a white-space code point u at i: the run, less its last code point when a
// non-space follows it and the run is longer than one; otherwise the whole run. With
// cr_lf_first, "\s*[\r\n]+" is tried before: the run up to and including its last CR or LF.
size_t space_end(std::string_view s, size_t i, Unit u, bool cr_lf_first) {
  size_t last = i, j = i, after_cr_lf = 0;
  for (Unit w = u; w.len && w.cls == CharClass::kSpace; w = unit_at(s, j)) {
    last = j;
    j += w.len;
    if (is_cr_or_lf(w.cp)) after_cr_lf = j;
  }
  if (cr_lf_first && after_cr_lf) return after_cr_lf;
  if (j < s.size() && last > i) return last;
  return j;
}

char ascii_lower(char32_t c) { return c < 0x80 ? static_cast<char>(c | 0x20) : '\0'; }

}  // namespace

size_t decode_utf8(std::string_view s, size_t i, char32_t* cp) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t len;
  char32_t c, min;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, c = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, c = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, c = b0 & 0x07, min = 0x10000;
  } else {
    *cp = kInvalidByte;
    return 1;
  }
  if (i + len > s.size()) {
    *cp = kInvalidByte;
    return 1;
  }
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) {
      *cp = kInvalidByte;
      return 1;
    }
    c = (c << 6) | (byte(i + k) & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
    *cp = kInvalidByte;
    return 1;
  }
  *cp = c;
  return len;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

char32_t byte_to_alphabet(unsigned char b) { return alphabet().byte_to_char[b]; }

int alphabet_to_byte(char32_t c) {
  return c < std::size(alphabet().char_to_byte) ? alphabet().char_to_byte[c] : -1;
}

size_t gpt2_piece_end(std::string_view s, size_t i) {
  const Unit u = unit_at(s, i);
  // 's 't 're 've 'm 'll 'd (lower case only, as in GPT-2).
  if (u.cp == '\'' && i + 1 < s.size()) {
    const char a = s[i + 1], b = i + 2 < s.size() ? s[i + 2] : '\0';
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional ' ' then a run of one class.
  if (u.cp == ' ') {
    const Unit v = unit_at(s, i + 1);
    if (v.len && v.cls != CharClass::kSpace) return run_end(s, i + 1, v.cls);
  }
  if (u.cls != CharClass::kSpace) return run_end(s, i, u.cls);
  return space_end(s, i, u, /*cr_lf_first=*/false);
}

size_t llama3_piece_end(std::string_view s, size_t i, int max_digits) {
  const Unit u = unit_at(s, i);
  // (?i:'s|'t|'re|'ve|'m|'ll|'d): any case; U+017F (long s) folds to s.
  if (u.cp == '\'') {
    const Unit a = unit_at(s, i + 1);
    const char la = a.cp == 0x17F ? 's' : ascii_lower(a.cp);
    if (la == 's' || la == 't' || la == 'm' || la == 'd') return i + 1 + a.len;
    if (la == 'r' || la == 'v' || la == 'l') {
      const Unit b = unit_at(s, i + 1 + a.len);
      if (ascii_lower(b.cp) == (la == 'l' ? 'l' : 'e')) return i + 1 + a.len + b.len;
    }
  }
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (u.cls == CharClass::kLetter) return run_end(s, i, CharClass::kLetter);
  if (u.cls != CharClass::kNumber && !is_cr_or_lf(u.cp)) {
    const Unit v = unit_at(s, i + u.len);
    if (v.len && v.cls == CharClass::kLetter) return run_end(s, i + u.len, CharClass::kLetter);
  }
  // \p{N}{1,3}
  if (u.cls == CharClass::kNumber) {
    size_t j = i;
    Unit w = u;
    for (int k = 0; k < max_digits && w.len && w.cls == CharClass::kNumber; ++k) {
      j += w.len;
      w = unit_at(s, j);
    }
    return j;
  }
  // " ?[^\s\p{L}\p{N}]+[\r\n]*"
  size_t start = std::string_view::npos;
  if (u.cls == CharClass::kOther) {
    start = i;
  } else if (u.cp == ' ') {
    const Unit v = unit_at(s, i + 1);
    if (v.len && v.cls == CharClass::kOther) start = i + 1;
  }
  if (start != std::string_view::npos) {
    size_t j = run_end(s, start, CharClass::kOther);
    while (j < s.size() && (s[j] == '\r' || s[j] == '\n')) ++j;
    return j;
  }
  // \s*[\r\n]+|\s+(?!\S)|\s+
  return space_end(s, i, u, /*cr_lf_first=*/true);
}

}  // namespace kuai::data
