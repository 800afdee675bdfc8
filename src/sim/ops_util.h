// Internal helpers of the op library.
#pragma once

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
// One product of (m x k) by (k x n), `batch` times: 2mnk FLOPs each.
inline uint64_t product_flops(uint64_t batch, uint64_t m, uint64_t n, uint64_t k) {
  return checked_mul(checked_mul(checked_mul(2, batch, "FLOPs"), m, "FLOPs"), checked_mul(n, k, "FLOPs"), "FLOPs");
}
// `elems` elements of `dt` in bytes.
inline uint64_t nbytes(uint64_t elems, DType dt) { return checked_mul(elems, itemsize(dt), "bytes moved"); }
// The bytes a product reads (both operands) and writes (the result), `batch` times, in `dt`.
inline uint64_t product_bytes(uint64_t batch, uint64_t m, uint64_t n, uint64_t k, DType dt) {
  const uint64_t elems = checked_add(checked_add(checked_mul(m, k, "bytes moved"), checked_mul(k, n, "bytes moved"),
                                                 "bytes moved"),
                                     checked_mul(m, n, "bytes moved"), "bytes moved");
  return nbytes(checked_mul(batch, elems, "bytes moved"), dt);
}
// A pointwise kernel: `per` FLOPs for each of `numel` outputs, reading `tensors_read` tensors of numel elements
// and writing one, all in `dt` (the elementwise convention of flops.h).
inline void count_pointwise(Engine& e, FlopKind k, uint64_t numel, uint64_t per, uint64_t tensors_read, DType dt) {
  e.count(k, checked_mul(numel, per, "FLOPs"), nbytes(checked_mul(numel, tensors_read + 1, "bytes moved"), dt), dt);
}

}  // namespace trainmem::sim::detail
