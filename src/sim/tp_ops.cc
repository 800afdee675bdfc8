// Tensor parallelism's collectives as ops (tp_ops.h).
#include "tp_ops.h"

#include <vector>

#include "ops_util.h"

namespace trainmem::sim {

T tp_all_reduce_backward(Ctx& c, const T& x) {
  T out = c.e.view(x, x.shape(), x->strides);
  const Shape s = x.shape();
  c.e.record("_AllReduceBackwardBackward", {&x}, {&out}, {}, [s](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // grad_output.clone() (contiguous), all-reduced in place
    e.count_tp_collective(false, g[0].bytes().value);  // the backward's all-reduce
    // FLOPs: the clone, a copy
    detail::count_pointwise(e, FlopKind::kElementwise, s.numel().value, 0, 1, g[0].dtype());
    return Grads{detail::grad_empty(e, s, g[0].dtype(), Label{"tp all_reduce(grad) clone"})};
  });
  return out;
}

T tp_all_reduce_forward(Ctx& c, const T& x, const char* what) {
  T out = c.e.empty(x.shape(), x.dtype(), Category::kActivations, c.L(what));
  c.e.count_tp_collective(false, x.bytes().value);  // the forward's all-reduce
  c.e.record("_AllReduceForwardBackward", {&x}, {&out}, {}, [](Engine&, Node&, Grads& g) {
    return Grads{g[0]};  // identity backward
  });
  return out;
}

T tp_all_gather_last(Ctx& c, const T& x0, uint64_t tp, const char* what) {
  T x = contiguous(c, x0, "tp all_gather x.contiguous()");
  const Shape in = x.shape();
  const uint64_t n = in.back();
  std::vector<T> list;
  list.reserve(tp);
  for (uint64_t i = 0; i < tp; ++i) {
    list.push_back(c.e.empty(in, x.dtype(), Category::kTemporaries, c.L("tp all_gather empty_like(x)")));
  }
  list[0] = x;  // tensor_list[rank] = x: this rank's empty is dropped (rank 0; every rank allocates the same)
  T out = c.e.empty(detail::with_last(in, n * tp), x.dtype(), Category::kActivations, c.L(what));
  c.e.count_tp_collective(true, out.bytes().value);  // the forward's all-gather (its backward takes a local chunk)
  c.e.record("_AllGatherBackward", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: the chunk's copy
    detail::count_pointwise(e, FlopKind::kElementwise, in.numel().value, 0, 1, g[0].dtype());
    return Grads{detail::grad_empty(e, in, g[0].dtype(), Label{"tp all_gather grad chunk.contiguous()"})};
  });
  return out;  // `list` (the other ranks' shards) dies here
}

}  // namespace trainmem::sim
