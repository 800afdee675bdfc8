// Sequence parallelism's collectives as ops (sp_ops.h).
//
// Step time: a ring reduce-scatter moves (tp - 1) / tp of its (whole) input, as a ring all-gather of its
// (whole) output does, so each reduce-scatter is counted with the all-gathers (Engine::count_tp_collective,
// all_gather=true) at the size of its whole, unscattered tensor; step_time.cc times both alike.
#include "sp_ops.h"

#include "ops_util.h"

namespace trainmem::sim {

namespace {

// (B, T, ...) with T divided (or multiplied) by tp, and the (tp*B, T/tp, ...) layout of the collectives' buffers
Shape seq_scaled(const Shape& s, uint64_t num, uint64_t den) {
  Shape r = s;
  r.d[1] = s[1] * num / den;
  return r;
}
Shape stacked(const Shape& local, uint64_t tp) {
  Shape r = local;
  r.d[0] = local[0] * tp;
  return r;
}

// Shard(1) -> Replicate of a (B, T/tp, C) tensor (the forward of sp_all_gather_seq, the backward of
// sp_reduce_scatter_seq): all_gather_into_tensor's (tp*B, T/tp, C) buffer, then torch.cat's (B, T, C)
T gather_seq(Engine& e, const T& local, uint64_t tp, Category cat, const Label& buf, const Label& out, bool grad) {
  const Shape ls = local.shape();
  T b = e.empty(stacked(ls, tp), local.dtype(), Category::kTemporaries, buf);
  T r = grad ? detail::grad_empty(e, seq_scaled(ls, tp, 1), local.dtype(), out)
             : e.empty(seq_scaled(ls, tp, 1), local.dtype(), cat, out);
  e.count_tp_collective(true, r.bytes().value);
  // FLOPs: torch.cat's copy
  detail::count_pointwise(e, FlopKind::kElementwise, r.shape().numel().value, 0, 1, r.dtype());
  return r;  // the buffer dies here
}

// Partial -> Shard(1) of a (B, T, C) tensor: torch.cat(torch.chunk(x, tp, dim=1)) (a whole copy), then
// reduce_scatter_tensor's (B, T/tp, C). The collective's work keeps its input (the copy) until wait_tensor, at
// the output's first use (an AsyncCollectiveTensor: RowwiseParallel redistributes with async_op=True): dropped
// here at once, which is exact where nothing is allocated before that use (the residual add after o_proj and
// down_proj; the next backward node); `pending`, when given, receives the copy for the caller to drop at the use.
T scatter_seq(Engine& e, const T& whole, uint64_t tp, Category cat, const Label& copy, const Label& out, bool grad,
              T* pending = nullptr) {
  const Shape ws = whole.shape();
  T b = e.empty(stacked(seq_scaled(ws, 1, tp), tp), whole.dtype(), Category::kTemporaries, copy);
  detail::count_pointwise(e, FlopKind::kElementwise, ws.numel().value, 0, 1, whole.dtype());
  T r = grad ? detail::grad_empty(e, seq_scaled(ws, 1, tp), whole.dtype(), out)
             : e.empty(seq_scaled(ws, 1, tp), whole.dtype(), cat, out);
  e.count_tp_collective(true, whole.bytes().value);  // a ring reduce-scatter of the whole tensor (see above)
  if (pending) *pending = std::move(b);
  return r;
}

}  // namespace

T sp_all_gather_seq(Ctx& c, const T& x0, uint64_t tp, const char* what) {
  // _functional_collectives.all_gather_tensor: `assert self.is_contiguous()` (the norm's output is)
  T x = contiguous(c, x0, "sp all_gather x.contiguous()");
  T out = gather_seq(c.e, x, tp, Category::kActivations, c.L("sp all_gather_into_tensor buffer"), c.L(what), false);
  const int32_t layer = c.layer;
  c.e.record("RedistributeBackward", {&x}, {&out}, {}, [tp, layer](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    return Grads{scatter_seq(e, g[0], tp, Category::kTemporaries, Label{"sp reduce_scatter(grad) torch.cat copy", layer, -1},
                             Label{"sp reduce_scatter(grad)", layer, -1}, true)};
  });
  return out;
}

T sp_reduce_scatter_seq(Ctx& c, const T& x, uint64_t tp, const char* what) {
  T out = scatter_seq(c.e, x, tp, Category::kActivations, c.L("sp reduce_scatter torch.cat copy"), c.L(what), false);
  const int32_t layer = c.layer;
  c.e.record("RedistributeBackward", {&x}, {&out}, {}, [tp, layer](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    return Grads{gather_seq(e, g[0], tp, Category::kTemporaries, Label{"sp all_gather(grad) buffer", layer, -1},
                            Label{"sp all_gather(grad) torch.cat", layer, -1}, true)};
  });
  return out;
}

T sp_all_gather_last(Ctx& c, const T& x, uint64_t tp, const char* what) {
  const Shape ls = x.shape();
  const uint64_t n = ls.back();
  T out;
  {
    T b = c.e.empty(stacked(ls, tp), x.dtype(), Category::kTemporaries, c.L("sp all_gather_into_tensor buffer"));
    out = c.e.empty(detail::with_last(ls, n * tp), x.dtype(), Category::kActivations, c.L(what));
    detail::count_pointwise(c.e, FlopKind::kElementwise, out.shape().numel().value, 0, 1, out.dtype());
  }
  c.e.count_tp_collective(true, out.bytes().value);
  c.e.record("RedistributeBackward", {&x}, {&out}, {}, [ls](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // Replicate -> Shard(-1): shards[rank].clone() of a torch.chunk view, no communication
    detail::count_pointwise(e, FlopKind::kElementwise, ls.numel().value, 0, 1, g[0].dtype());
    return Grads{detail::grad_empty(e, ls, g[0].dtype(), Label{"sp Replicate->Shard(-1) grad chunk.clone()"})};
  });
  return out;
}

T sp_vocab_embedding(Ctx& c, const T& weight, const T& ids, uint64_t tp, const char* what, T& pending) {
  const Shape is = ids.shape();
  T mask, masked;
  {
    // mask = (tensor < local_offset_on_dim) | (tensor >= local_offset_on_dim + local_shard_size)
    T lt = c.e.empty(is, DType::kBool, Category::kTemporaries, c.L("MaskPartial ids < offset"));
    T ge = c.e.empty(is, DType::kBool, Category::kTemporaries, c.L("MaskPartial ids >= offset + V/tp"));
    mask = c.e.empty(is, DType::kBool, Category::kActivations, c.L("MaskPartial mask_buffer"));
  }
  {
    // masked_tensor = tensor.clone() - local_offset_on_dim; masked_tensor[mask] = 0
    T cl = c.e.empty(is, DType::kI64, Category::kTemporaries, c.L("MaskPartial ids.clone()"));
    masked = c.e.empty(is, DType::kI64, Category::kActivations, c.L("MaskPartial masked ids"));
  }
  T local = embedding(c, weight, masked, what);  // EmbeddingBackward0 saves `masked`
  masked.reset();
  // _reduce_shard_value: mask_buffer.apply_mask(tensor) (`tensor[mask, :] = 0.0`, in place), release_mask(), then
  // Shard(1)'s reduce-scatter. The two boolean-mask index_put_ calls' nonzero() index buffers (at most 16 bytes
  // per token, as many as the ids outside this rank's rows: data-dependent) are not simulated.
  mask.reset();
  T out = scatter_seq(c.e, local, tp, Category::kActivations, c.L("embed_tokens reduce_scatter torch.cat copy"),
                      c.L("embed_tokens reduce_scatter (MaskPartial -> Shard(1))"), false, &pending);
  c.e.record("RedistributeBackward", {&local}, {&out}, {}, [tp](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    return Grads{gather_seq(e, g[0], tp, Category::kTemporaries, Label{"sp all_gather(grad) buffer"},
                            Label{"sp all_gather(grad) torch.cat"}, true)};
  });
  local.reset();
  return out;
}

}  // namespace trainmem::sim
