#include "runtime/utf8.h"

#include <cstdint>

namespace strata {
namespace {

// The length of the valid UTF-8 sequence at s[i], or 0 when s[i] starts none.
size_t SequenceAt(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 1, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 2, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 3, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n >= s.size()) return 0;  // truncated
  for (size_t k = 1; k <= n; ++k) {
    const auto d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (d & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n + 1;
}

}  // namespace

size_t Utf8ErrorAt(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = SequenceAt(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string EscapeNonUtf8(std::string_view s) {
  size_t i = Utf8ErrorAt(s);
  if (i == std::string_view::npos) return std::string(s);
  std::string out(s.substr(0, i));
  static constexpr char kHex[] = "0123456789abcdef";
  while (i < s.size()) {
    if (const size_t n = SequenceAt(s, i); n > 0) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    const auto c = static_cast<unsigned char>(s[i++]);
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 0xF];
  }
  return out;
}

}  // namespace strata
