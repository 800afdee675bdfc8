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

}  // namespace trainmem::sim::detail
