#include "trainmem/units.h"

#include <gtest/gtest.h>

#include <limits>

#include "test_util.h"
#include "trainmem/dtype.h"

namespace trainmem {
namespace {

using testing::error_of;

TEST(CheckedArithmetic, AddAndMultiplyReturnExactResults) {
  EXPECT_EQ(checked_add(1, 2, "x"), 3u);
  EXPECT_EQ(checked_mul(124'373'760, 4, "x"), 497'495'040u);
}

TEST(CheckedArithmetic, OverflowThrowsNamingTheQuantity) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(error_of([&] { checked_add(max, 1, "byte count"); }),
            "byte count overflows 64 bits (18446744073709551615 + 1)");
  EXPECT_EQ(error_of([&] { checked_mul(1ull << 40, 1ull << 40, "element count"); }),
            "element count overflows 64 bits (1099511627776 x 1099511627776)");
  EXPECT_NE(error_of([&] { checked_sub(1, 2, "bytes"); }), "");
}

TEST(StrongTypes, BytesAndElemsAddCheckedAndConvertOnlyThroughDtype) {
  Bytes a(10), b(20);
  EXPECT_EQ((a + b).value, 30u);
  EXPECT_EQ((Bytes(3) * 4).value, 12u);
  EXPECT_EQ(bytes_of(Elems(768), DType::kF32).value, 3072u);
  EXPECT_EQ(bytes_of(Elems(768), DType::kBF16).value, 1536u);
  EXPECT_EQ(bytes_of(Elems(1024), DType::kBool).value, 1024u);
  EXPECT_NE(error_of([] { (void)(Bytes(std::numeric_limits<uint64_t>::max()) + Bytes(1)); }), "");
  EXPECT_NE(error_of([] { (void)bytes_of(Elems(1ull << 62), DType::kI64); }), "");
}

TEST(Rounding, CeilDivAndRoundUp) {
  EXPECT_EQ(ceil_div(1000, 512), 2u);
  EXPECT_EQ(round_up(1000, 512), 1024u);
  EXPECT_EQ(round_up(1024, 512), 1024u);
  EXPECT_EQ(round_up(0, 512), 0u);
}

TEST(Display, BinaryUnitsAndThousandsSeparators) {
  EXPECT_EQ(format_bytes(Bytes(512)), "512 B");
  EXPECT_EQ(format_bytes(Bytes(8'519'680)), "8.1 MiB");
  EXPECT_EQ(format_bytes(Bytes(2'064'403'456)), "1.92 GiB");
  EXPECT_EQ(with_commas(0), "0");
  EXPECT_EQ(with_commas(999), "999");
  EXPECT_EQ(with_commas(124'373'760), "124,373,760");
}

TEST(DTypes, ItemsizesMatchTorch) {
  EXPECT_EQ(itemsize(DType::kF32), 4u);
  EXPECT_EQ(itemsize(DType::kF16), 2u);
  EXPECT_EQ(itemsize(DType::kBF16), 2u);
  EXPECT_EQ(itemsize(DType::kI64), 8u);
  EXPECT_EQ(itemsize(DType::kBool), 1u);
  EXPECT_EQ(parse_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("float8"), std::nullopt);
}

}  // namespace
}  // namespace trainmem
