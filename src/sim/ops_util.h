// Internal helpers of the op library.
#pragma once

#include <string_view>

#include "ops.h"

namespace trainmem::sim::detail {

// torch type promotion for two tensor operands (0-dim tensors defer to dimensioned ones).
DType promote(const T& a, const T& b);
Shape broadcast(const Shape& a, const Shape& b);
// Strides of an elementwise result of shape `s` whose first full-shape operand is `like` (TensorIterator
// keeps a dense operand's memory order).
Strides result_strides(const Shape& s, const T& a, const T& b);
// A new gradient tensor in the backward pass.
T grad_empty(Engine& e, const Shape& s, DType dt, Label l);
T grad_like(Engine& e, const T& like, DType dt);
Shape with_last(const Shape& s, uint64_t last);
Elems rows_of(const Shape& s);  // product of all dims but the last

// ---- FLOP counting (trainmem/flops.h conventions), checked arithmetic ----
// Counts saturate at 2^64 - 1 instead of throwing: a step whose FLOPs pass 2^64 may still have exact memory
// figures (bytes overflow later than FLOPs); the engine marks the ledger as overflowed (FlopLedger::overflow)
// and nothing is derived from it.
inline uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
inline uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}
// One product of (m x k) by (k x n), `batch` times: 2mnk FLOPs each.
inline uint64_t product_flops(uint64_t batch, uint64_t m, uint64_t n, uint64_t k) {
  return sat_mul(sat_mul(sat_mul(2, batch), m), sat_mul(n, k));
}
// `elems` elements of `dt` in bytes.
inline uint64_t nbytes(uint64_t elems, DType dt) { return sat_mul(elems, itemsize(dt)); }
// The bytes a product reads (both operands) and writes (the result), `batch` times, in `dt`.
inline uint64_t product_bytes(uint64_t batch, uint64_t m, uint64_t n, uint64_t k, DType dt) {
  const uint64_t elems = sat_add(sat_add(sat_mul(m, k), sat_mul(k, n)), sat_mul(m, n));
  return nbytes(sat_mul(batch, elems), dt);
}
// A pointwise kernel: `per` FLOPs for each of `numel` outputs, reading `tensors_read` tensors of numel elements
// and writing one, all in `dt` (the elementwise convention of flops.h).
inline void count_pointwise(Engine& e, FlopKind k, uint64_t numel, uint64_t per, uint64_t tensors_read, DType dt) {
  e.count(k, sat_mul(numel, per), nbytes(sat_mul(numel, tensors_read + 1), dt), dt);
}

}  // namespace trainmem::sim::detail
