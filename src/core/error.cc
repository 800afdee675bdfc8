#include "trainmem/error.h"

namespace trainmem {

namespace {

// The length of the valid UTF-8 sequence at s[i], or 0 (RFC 3629: no overlongs, no surrogates, <= U+10FFFF).
size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

std::string clean_message(std::string_view m) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(std::min(m.size(), kMaxMessageBytes) + 16);
  size_t i = 0;
  while (i < m.size() && out.size() < kMaxMessageBytes) {
    const size_t n = utf8_sequence(m, i);
    if (n == 0) {
      const auto c = static_cast<unsigned char>(m[i]);
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
      ++i;
    } else {
      out.append(m.substr(i, n));
      i += n;
    }
  }
  if (i < m.size()) out += " ... (" + std::to_string(m.size() - i) + " more bytes)";
  return out;
}

}  // namespace trainmem
