#include "trainmem/units.h"

#include <fmt/format.h>

#include <limits>

#include "trainmem/error.h"

namespace trainmem {

void throw_add_overflow(uint64_t a, uint64_t b, std::string_view what) {
  throw Error(fmt::format("{} overflows 64 bits ({} + {})", what, a, b));
}

void throw_sub_underflow(uint64_t a, uint64_t b, std::string_view what) {
  throw Error(fmt::format("{} would go negative ({} - {})", what, a, b));
}

void throw_mul_overflow(uint64_t a, uint64_t b, std::string_view what) {
  throw Error(fmt::format("{} overflows 64 bits ({} x {})", what, a, b));
}

int64_t signed_difference(uint64_t a, uint64_t b, std::string_view what) {
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (a > kMax || b > kMax) throw Error(fmt::format("{} is beyond a signed 64-bit number ({} - {})", what, a, b));
  return static_cast<int64_t>(a) - static_cast<int64_t>(b);
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

uint64_t round_up(uint64_t a, uint64_t multiple) {
  return checked_mul(ceil_div(a, multiple), multiple, "rounded size");
}

Elems numel(std::initializer_list<uint64_t> shape) { return numel(std::span<const uint64_t>(shape.begin(), shape.size())); }

Elems numel(std::span<const uint64_t> shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = checked_mul(n, d, "element count of a tensor shape");
  return Elems(n);
}

double to_mib(Bytes b) { return static_cast<double>(b.value) / static_cast<double>(kMiB); }
double to_gib(Bytes b) { return static_cast<double>(b.value) / static_cast<double>(kGiB); }

std::string format_bytes(Bytes b) {
  const double v = static_cast<double>(b.value);
  if (b.value >= kGiB) return fmt::format("{:.2f} GiB", v / static_cast<double>(kGiB));
  if (b.value >= kMiB) return fmt::format("{:.1f} MiB", v / static_cast<double>(kMiB));
  if (b.value >= kKiB) return fmt::format("{:.1f} KiB", v / static_cast<double>(kKiB));
  return fmt::format("{} B", b.value);
}

std::string with_commas(uint64_t v) {
  std::string digits = std::to_string(v);
  std::string out;
  const size_t n = digits.size();
  for (size_t i = 0; i < n; ++i) {
    out += digits[i];
    if ((n - i - 1) % 3 == 0 && i + 1 < n) out += ',';
  }
  return out;
}

std::optional<uint64_t> parse_size(std::string_view s, bool* unit_given) {
  static constexpr std::pair<std::string_view, uint64_t> kUnits[] = {
      {"GiB", kGiB}, {"MiB", kMiB}, {"KiB", kKiB}, {"GB", 1'000'000'000}, {"B", 1}};
  uint64_t unit = 1;
  std::string_view num = s;
  for (const auto& [suffix, mult] : kUnits) {
    if (s.size() > suffix.size() && s.substr(s.size() - suffix.size()) == suffix) {
      unit = mult;
      num = s.substr(0, s.size() - suffix.size());
      break;
    }
  }
  if (unit_given) *unit_given = num.size() != s.size();
  if (num.empty() || num.size() > 20 || num.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  uint64_t v = 0;
  for (char ch : num) {
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, static_cast<uint64_t>(ch - '0'), &v)) {
      return std::nullopt;
    }
  }
  if (__builtin_mul_overflow(v, unit, &v)) return std::nullopt;
  return v;
}

}  // namespace trainmem
