#include "key_reader.h"

#include <fmt/format.h>

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

std::string show(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace

const nlohmann::json* KeyReader::find(std::initializer_list<std::string_view> keys, std::string* found) const {
  for (auto k : keys) {
    auto it = obj_.find(std::string(k));
    if (it != obj_.end() && !it->is_null()) {
      if (found) *found = std::string(k);
      return &*it;
    }
  }
  return nullptr;
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
