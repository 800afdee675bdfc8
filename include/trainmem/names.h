// One name table per enum: the spelling that the CLI, JSON and error messages use, and a line of help. Every
// front end parses and prints an enum through these tables, so a value has one spelling everywhere.
//   name_of(Precision::kBf16)        -> "bf16"
//   parse_name<Precision>("bf16")    -> Precision::kBf16
//   names_list<Precision>()          -> "fp32, fp16-amp, bf16-amp, fp16 or bf16"
// An enum takes part by declaring `std::span<const NameRow<E>> name_table(E)` next to it.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace trainmem {

template <typename E>
struct NameRow {
  E value;
  std::string_view name;
  std::string_view help;
};

template <typename E>
std::string_view name_of(E v) {
  for (const NameRow<E>& r : name_table(E{})) {
    if (r.value == v) return r.name;
  }
  return "?";
}

template <typename E>
std::optional<E> parse_name(std::string_view s) {
  for (const NameRow<E>& r : name_table(E{})) {
    if (r.name == s) return r.value;
  }
  return std::nullopt;
}

// "a, b or c" (`joiner` " | " gives "a | b | c", as the CLI's help writes alternatives).
template <typename E>
std::string names_list(std::string_view joiner = "") {
  const auto rows = name_table(E{});
  std::string s;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i > 0) s += joiner.empty() ? (i + 1 == rows.size() ? " or " : ", ") : std::string(joiner);
    s += rows[i].name;
  }
  return s;
}

}  // namespace trainmem
