#include "key_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "trainmem/error.h"

namespace trainmem::config {

namespace {

std::string join_keys(std::initializer_list<std::string_view> keys) {
  std::string s;
  for (auto k : keys) {
    if (!s.empty()) s += "\" or \"";
    s += k;
  }
  return "\"" + s + "\"";
}

// Compact JSON as dump() writes it, with invalid UTF-8 (a --set value is raw command-line bytes) replaced
// rather than thrown on. Arrays and objects below `depth` levels print as [...] / {...}, and writing stops
// once `out` is past `limit`: the message keeps 60 characters anyway, and dump() recurses once per level, so
// a 100,000-deep array in a config file would overflow the stack.
void show_into(const nlohmann::json& v, int depth, size_t limit, std::string& out) {
  constexpr auto kReplace = nlohmann::json::error_handler_t::replace;
  if (!v.is_structured()) {
    out += v.dump(-1, ' ', false, kReplace);
    return;
  }
  const bool array = v.is_array();
  if (v.empty()) {
    out += array ? "[]" : "{}";
    return;
  }
  if (depth == 0) {
    out += array ? "[...]" : "{...}";
    return;
  }
  out += array ? '[' : '{';
  for (auto it = v.begin(); it != v.end() && out.size() <= limit; ++it) {
    if (it != v.begin()) out += ',';
    if (!array) out += nlohmann::json(it.key()).dump(-1, ' ', false, kReplace) + ':';
    show_into(*it, depth - 1, limit, out);
  }
  out += array ? ']' : '}';
}

std::string show(const nlohmann::json& v) {
  constexpr size_t kShown = 60;
  std::string s;
  show_into(v, 2, kShown, s);
  if (s.size() > kShown) {
    size_t cut = kShown - 3;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 char
    s = s.substr(0, cut) + "...";
  }
  return s;
}

}  // namespace

const nlohmann::json* KeyReader::find(std::initializer_list<std::string_view> keys, std::string* found) const {
  for (auto k : keys) asked_.emplace(k);
  // The alias set last by --set decides, present or null (null: absent, take the default).
  for (auto o = overridden_.rbegin(); o != overridden_.rend(); ++o) {
    if (std::find(keys.begin(), keys.end(), *o) == keys.end()) continue;
    auto it = obj_.find(*o);
    if (it == obj_.end() || it->is_null()) return nullptr;
    if (found) *found = *o;
    return &*it;
  }
  for (auto k : keys) {
    auto it = obj_.find(std::string(k));
    if (it != obj_.end() && !it->is_null()) {
      if (found) *found = std::string(k);
      return &*it;
    }
  }
  return nullptr;
}

bool KeyReader::given_null(std::string_view key) const {
  asked_.emplace(key);
  for (auto o = overridden_.rbegin(); o != overridden_.rend(); ++o) {
    if (*o == key) {
      auto it = obj_.find(*o);
      return it != obj_.end() && it->is_null();
    }
  }
  auto it = obj_.find(std::string(key));
  return it != obj_.end() && it->is_null();
}

void KeyReader::fail(std::string_view key, const nlohmann::json& value, std::string_view expected) const {
  throw Error(fmt::format("{}: key \"{}\" = {}: expected {}", origin_, key, show(value), expected));
}

void KeyReader::fail_missing(std::initializer_list<std::string_view> keys, std::string_view expected) const {
  throw Error(fmt::format("{}: missing required key {} (expected {})", origin_, join_keys(keys), expected));
}

uint64_t KeyReader::integer(std::initializer_list<std::string_view> keys, std::optional<uint64_t> def,
                            uint64_t lo, uint64_t hi) const {
  if (auto v = optional_integer(keys, lo, hi)) return *v;
  if (!def) fail_missing(keys, fmt::format("an integer in [{}, {}]", lo, hi));
  return *def;
}

uint64_t KeyReader::shape(std::initializer_list<std::string_view> keys, uint64_t def, uint64_t lo, uint64_t hi,
                          std::string_view defaults_of) const {
  if (auto v = optional_integer(keys, lo, hi)) return *v;
  if (warnings_) {
    warnings_->push_back(
        fmt::format("{}: key \"{}\" is missing; using {} default {}", origin_, *keys.begin(), defaults_of, def));
  }
  return def;
}

std::optional<uint64_t> KeyReader::optional_integer(std::initializer_list<std::string_view> keys, uint64_t lo,
                                                    uint64_t hi) const {
  std::string key;
  const nlohmann::json* v = find(keys, &key);
  if (!v) return std::nullopt;
  const std::string expected = fmt::format("an integer in [{}, {}]", lo, hi);
  if (v->is_number_unsigned()) {
    const uint64_t x = v->get<uint64_t>();
    if (x < lo || x > hi) fail(key, *v, expected);
    return x;
  }
  if (v->is_number_integer()) fail(key, *v, expected);  // negative
  if (v->is_number_float()) fail(key, *v, expected + " (not a fractional or exponent-form number)");
  fail(key, *v, expected + fmt::format(", not a {}", v->type_name()));
}

bool KeyReader::boolean(std::initializer_list<std::string_view> keys, std::optional<bool> def) const {
  std::string key;
  const nlohmann::json* v = find(keys, &key);
  if (!v) {
    if (!def) fail_missing(keys, "true or false");
    return *def;
  }
  if (!v->is_boolean()) fail(key, *v, "true or false");
  return v->get<bool>();
}

double KeyReader::number(std::initializer_list<std::string_view> keys, std::optional<double> def, double lo,
                         double hi) const {
  std::string key;
  const nlohmann::json* v = find(keys, &key);
  if (!v) {
    if (!def) fail_missing(keys, fmt::format("a number in [{}, {}]", lo, hi));
    return *def;
  }
  const std::string expected = fmt::format("a number in [{}, {}]", lo, hi);
  if (!v->is_number()) fail(key, *v, expected);
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) fail(key, *v, expected);
  return x;
}

std::string KeyReader::text(std::initializer_list<std::string_view> keys, std::optional<std::string> def) const {
  std::string key;
  const nlohmann::json* v = find(keys, &key);
  if (!v) {
    if (!def) fail_missing(keys, "a string");
    return *def;
  }
  if (!v->is_string()) fail(key, *v, "a string");
  return v->get<std::string>();
}

}  // namespace trainmem::config
