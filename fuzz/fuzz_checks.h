// What the harnesses check of a refusal: trainmem::Error's message is meant for the user as is (error.h), so
// it must be valid UTF-8 (a byte that is not is echoed as text) and bounded (error.h: kMaxMessageBytes, 2 KiB;
// checked here against 4 KiB, which a message cut short with its "... (N more bytes)" never reaches).
// A violation aborts with the message, which libFuzzer reports as a crash with its input.
//
// TRAINMEM_FUZZ_MESSAGES=0 in the environment turns these checks off (to fuzz past a known finding).
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "trainmem/error.h"

namespace trainmem_fuzz {

inline constexpr size_t kMaxMessageBytes = 4096;

// Whether `s` is well-formed UTF-8 (no overlongs, no surrogates, nothing beyond U+10FFFF).
inline bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned char c = *p;
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) {
      ++p;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (static_cast<size_t>(end - p) <= n) return false;
    if (p[1] < lo || p[1] > hi) return false;
    for (size_t i = 2; i <= n; ++i) {
      if (p[i] < 0x80 || p[i] > 0xBF) return false;
    }
    p += n + 1;
  }
  return true;
}

inline bool message_checks_on() {
  static const bool on = [] {
    const char* v = std::getenv("TRAINMEM_FUZZ_MESSAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

inline void check_message(const trainmem::Error& e, const char* harness) {
  if (!message_checks_on()) return;
  const std::string_view m = e.what();
  const char* problem = m.empty()                      ? "an empty error message"
                        : m.size() > kMaxMessageBytes ? "an error message longer than 4096 bytes"
                        : !valid_utf8(m)              ? "an error message that is not valid UTF-8"
                                                      : nullptr;
  if (problem == nullptr) return;
  std::fprintf(stderr, "%s: %s (%zu bytes): %.*s\n", harness, problem, m.size(),
               static_cast<int>(m.size() > 600 ? 600 : m.size()), m.data());
  std::abort();
}

// Runs f(): it may succeed or refuse its input with a trainmem::Error, whose message is then checked.
template <typename F>
void refused_or_ok(const char* harness, F&& f) {
  try {
    f();
  } catch (const trainmem::Error& e) {
    check_message(e, harness);
  }
}

}  // namespace trainmem_fuzz
