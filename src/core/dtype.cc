#include "trainmem/dtype.h"

namespace trainmem {

uint64_t itemsize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI64: return 8;
    case DType::kI32: return 4;
    case DType::kBool: return 1;
    case DType::kU8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kI64: return "int64";
    case DType::kI32: return "int32";
    case DType::kBool: return "bool";
    case DType::kU8: return "uint8";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "float32" || s == "fp32" || s == "float") return DType::kF32;
  if (s == "float16" || s == "fp16" || s == "half") return DType::kF16;
  if (s == "bfloat16" || s == "bf16") return DType::kBF16;
  if (s == "int64") return DType::kI64;
  if (s == "int32") return DType::kI32;
  if (s == "bool") return DType::kBool;
  if (s == "uint8") return DType::kU8;
  return std::nullopt;
}

bool is_floating(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

}  // namespace trainmem
