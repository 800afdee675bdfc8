// Units: element counts and byte counts are different types, and every operation on them is checked.
//   Elems: a number of tensor elements.  Bytes: a number of bytes.
// Only bytes_of(Elems, DType) (dtype.h) turns one into the other. double appears only in display helpers.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <optional>
#include <span>
#include <string_view>

namespace trainmem {

// Binary units (IEC): what nvidia-smi and torch print as MiB/GiB.
inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;

// Checked arithmetic on uint64_t. On overflow they throw trainmem::Error naming `what`. Inline: the
// simulator does this millions of times per search; the throwing path is out of line.
[[noreturn]] void throw_add_overflow(uint64_t a, uint64_t b, std::string_view what);
[[noreturn]] void throw_sub_underflow(uint64_t a, uint64_t b, std::string_view what);
[[noreturn]] void throw_mul_overflow(uint64_t a, uint64_t b, std::string_view what);
inline uint64_t checked_add(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]] throw_add_overflow(a, b, what);
  return r;
}
inline uint64_t checked_sub(uint64_t a, uint64_t b, std::string_view what) {
  if (b > a) [[unlikely]] throw_sub_underflow(a, b, what);
  return a - b;
}
inline uint64_t checked_mul(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]] throw_mul_overflow(a, b, what);
  return r;
}
// a - b as a signed number (a headroom, a saving); throws trainmem::Error naming `what` when either is beyond
// int64_t, where the conversion would be wrong rather than merely large.
int64_t signed_difference(uint64_t a, uint64_t b, std::string_view what);
uint64_t ceil_div(uint64_t a, uint64_t b);          // b > 0
uint64_t round_up(uint64_t a, uint64_t multiple);   // checked; multiple > 0

// A strongly typed count. Adding two of the same kind is checked; mixing kinds does not compile.
template <typename Tag>
struct Count {
  uint64_t value = 0;

  constexpr Count() = default;
  constexpr explicit Count(uint64_t v) : value(v) {}

  friend Count operator+(Count a, Count b) { return Count(checked_add(a.value, b.value, Tag::kName)); }
  friend Count operator-(Count a, Count b) { return Count(checked_sub(a.value, b.value, Tag::kName)); }
  Count& operator+=(Count b) { return *this = *this + b; }
  Count& operator-=(Count b) { return *this = *this - b; }
  // Scaling by a plain factor (a number of layers, of copies, ...).
  friend Count operator*(Count a, uint64_t k) { return Count(checked_mul(a.value, k, Tag::kName)); }
  friend Count operator*(uint64_t k, Count a) { return a * k; }
  friend auto operator<=>(Count, Count) = default;
};

struct ElemsTag { static constexpr const char* kName = "element count"; };
struct BytesTag { static constexpr const char* kName = "byte count"; };
using Elems = Count<ElemsTag>;
using Bytes = Count<BytesTag>;

// The element count of a shape; overflow names the shape.
Elems numel(std::initializer_list<uint64_t> shape);
Elems numel(std::span<const uint64_t> shape);

// A size written as digits with an optional unit: "4096", "512B", "64KiB", "1MiB", "2GiB", "80GB" (GB is 10^9
// bytes, as card vendors count). nullopt for anything else, or a size beyond 64 bits. `unit_given` receives
// whether a unit was written.
std::optional<uint64_t> parse_size(std::string_view s, bool* unit_given = nullptr);

// Display only.
double to_mib(Bytes b);
double to_gib(Bytes b);
// "1.23 GiB", "512.0 MiB", "17.0 KiB", "512 B": the largest binary unit that keeps the value >= 1.
std::string format_bytes(Bytes b);
// 1234567 -> "1,234,567"
std::string with_commas(uint64_t v);

}  // namespace trainmem
