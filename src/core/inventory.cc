#include "trainmem/inventory.h"

#include "../families/registry.h"
#include "../tensor_tables/table.h"
#include "trainmem/error.h"

namespace trainmem {

namespace models {

static Elems shape_elems(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = checked_mul(n, d, "element count of a tensor shape");
  return Elems(n);
}

void Table::param(std::string name, std::vector<uint64_t> shape) {
  TensorRow r;
  r.elems = shape_elems(shape);
  r.name = std::move(name);
  r.shape = std::move(shape);
  r.dtype = DType::kF32;  // nn.Module parameters are created in the default dtype, float32
  r.kind = RowKind::kParameter;
  inv_.parameters.push_back(std::move(r));
}

void Table::buffer(std::string name, std::vector<uint64_t> shape, DType dtype, bool persistent) {
  TensorRow r;
  r.elems = shape_elems(shape);
  r.name = std::move(name);
  r.shape = std::move(shape);
  r.dtype = dtype;
  r.kind = RowKind::kBuffer;
  r.persistent = persistent;
  r.load_after = inv_.parameters.size();
  inv_.buffers.push_back(std::move(r));
}

}  // namespace models

Inventory build_inventory(const ModelSpec& spec) {
  models::Table t;
  program_for(spec).tensors(spec, t);
  return t.take();
}

Elems parameter_count(const Inventory& inv) {
  Elems n;
  for (const auto& r : inv.parameters) n += r.elems;
  return n;
}

Elems trainable_count(const Inventory& inv) {
  Elems n;
  for (const auto& r : inv.parameters) {
    if (r.trainable) n += r.elems;
  }
  return n;
}

Bytes trainable_bytes(const Inventory& inv, DType dtype) { return bytes_of(trainable_count(inv), dtype); }

size_t trainable_rows(const Inventory& inv) {
  size_t n = 0;
  for (const auto& r : inv.parameters) n += r.trainable ? 1 : 0;
  return n;
}

Elems buffer_elems(const Inventory& inv) {
  Elems n;
  for (const auto& r : inv.buffers) n += r.elems;
  return n;
}

Bytes parameter_bytes(const Inventory& inv, DType dtype) { return bytes_of(parameter_count(inv), dtype); }

DType stored_dtype(const TensorRow& r, DType model_dtype) {
  if (r.kind == RowKind::kParameter) return model_dtype;
  // nn.Module.to(dtype) casts floating-point tensors only.
  return is_floating(r.dtype) ? model_dtype : r.dtype;
}

Bytes buffer_bytes(const Inventory& inv, DType model_dtype) {
  Bytes b;
  for (const auto& r : inv.buffers) b += bytes_of(r.elems, stored_dtype(r, model_dtype));
  return b;
}

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

}  // namespace trainmem
