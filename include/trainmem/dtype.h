// Element types of tensors and their sizes, as torch.dtype.itemsize reports them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "trainmem/units.h"

namespace trainmem {

enum class DType { kF32, kF16, kBF16, kI64, kI32, kBool, kU8 };

uint64_t itemsize(DType t);            // bytes per element
std::string_view dtype_name(DType t);  // torch spelling: "float32", "bfloat16", "int64", "bool", ...
std::optional<DType> parse_dtype(std::string_view s);  // accepts torch names and fp32/fp16/bf16
bool is_floating(DType t);

inline Bytes bytes_of(Elems n, DType t) {
  return Bytes(checked_mul(n.value, itemsize(t), "byte count"));
}

}  // namespace trainmem
