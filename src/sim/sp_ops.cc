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

// MaskPartial._partition_value of integer indices `s` (placement_types.py MaskPartial._mask_tensor): mask =
// (tensor < local_offset_on_dim) | (tensor >= local_offset_on_dim + local_shard_size) (two bool temporaries,
// then the mask the MaskBuffer keeps); masked_tensor = tensor.clone() - local_offset_on_dim (the clone dies);
// masked_tensor[mask] = 0 in place. `kept`: the category of the mask and of the masked indices.
struct Masked {
  T mask, indices;
};
Masked mask_partial(Engine& e, const Shape& s, Category kept, int32_t layer) {
  Masked m;
  {
    T lt = e.empty(s, DType::kBool, Category::kTemporaries, Label{"MaskPartial indices < offset", layer, -1});
    T ge = e.empty(s, DType::kBool, Category::kTemporaries, Label{"MaskPartial indices >= offset + V/tp", layer, -1});
    m.mask = e.empty(s, DType::kBool, kept, Label{"MaskPartial mask_buffer", layer, -1});
  }
  T cl = e.empty(s, DType::kI64, Category::kTemporaries, Label{"MaskPartial indices.clone()", layer, -1});
  m.indices = e.empty(s, DType::kI64, kept, Label{"MaskPartial masked indices", layer, -1});
  return m;  // the clone dies here
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

T sp_reduce_scatter_seq(Ctx& c, const T& x, uint64_t tp, const char* what, T* pending) {
  T out = scatter_seq(c.e, x, tp, Category::kActivations, c.L("sp reduce_scatter torch.cat copy"), c.L(what), false, pending);
  const int32_t layer = c.layer;
  c.e.record("RedistributeBackward", {&x}, {&out}, {}, [tp, layer](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    return Grads{gather_seq(e, g[0], tp, Category::kTemporaries, Label{"sp all_gather(grad) buffer", layer, -1},
                            Label{"sp all_gather(grad) torch.cat", layer, -1}, true)};
  });
  return out;
}

T sp_vocab_embedding(Ctx& c, const T& weight, const T& ids, uint64_t tp, const char* what, T& pending) {
  // The DTensor embedding (_embedding_ops.py embedding_strategy, rowwise [MaskPartial, Shard(0), MaskPartial]):
  // the Replicate ids become MaskPartial inside the dispatch, the lookup runs on the masked local indices, which
  // die when the op returns; autograd sits above the dispatch, so EmbeddingBackward0 saves the ids themselves.
  // Its backward: embedding_dense_backward_strategy has no rowwise rule (all-replicate, colwise, batch, partial
  // only); the gradient arrives Replicate (the all-gather below) with Replicate ids, so the all-replicate
  // strategy, which needs no redistribution, is taken and every rank builds the whole (V, C) weight gradient: a
  // Replicate DTensor that AccumulateGrad keeps as the Shard(0) weight's .grad (their global shapes agree).
  auto [mask, masked] = mask_partial(c.e, ids.shape(), Category::kTemporaries, c.layer);
  T local = embedding_grad_rows(c, weight, ids, weight.shape()[0] * tp, what);
  masked.reset();
  // _reduce_shard_value: mask_buffer.apply_mask(tensor) (`tensor[mask, :] = 0.0`, in place), release_mask(), then
  // Shard(1)'s reduce-scatter. The two boolean-mask index_put_ calls' nonzero() index buffers (at most 16 bytes
  // per token, as many as the ids outside this rank's rows: data-dependent) are not simulated.
  mask.reset();
  T out = sp_reduce_scatter_seq(c, local, tp, "embed_tokens reduce_scatter (MaskPartial -> Shard(1))", &pending);
  local.reset();
  return out;
}

}  // namespace trainmem::sim

namespace trainmem::sim {

T sp_loss_parallel_cross_entropy(Ctx& c, const T& logits, const T& labels, uint64_t tp) {
  const uint64_t N = logits.shape()[0] * logits.shape()[1], Vl = logits.shape()[2];
  const Shape nv{N, Vl}, n1{N, 1}, n{N};
  auto tmp = [&](const Shape& s, DType dt, const char* what) { return c.e.empty(s, dt, Category::kTemporaries, c.L(what)); };
  auto act = [&](const Shape& s, DType dt, const char* what) { return c.e.empty(s, dt, Category::kActivations, c.L(what)); };
  // pred.flatten(0, 1).float(): a float32 copy (ToCopyBackward0 casts its gradient back)
  const T x = to(c, view(c, logits, nv), DType::kF32, "pred.flatten(0, 1).float()");
  const T target = view(c, labels, n);  // labels.flatten(0, 1)
  // _log_softmax: x.to(float32, contiguous_format) is x itself
  T result;
  {
    // the function's locals (x_max, shifted, shifted_sumexp, shifted_logsumexp) die when it returns; each
    // rebinding drops the tensor it replaced
    T x_max;
    {
      T amax = tmp(n1, DType::kF32, "loss_parallel amax");
      x_max = tmp(n1, DType::kF32, "loss_parallel all_reduce(MAX)");  // funcol.all_reduce: a clone, reduced
    }
    T shifted = tmp(nv, DType::kF32, "loss_parallel shifted = x - x_max");
    T sumexp;
    {
      T e = tmp(nv, DType::kF32, "loss_parallel torch.exp(shifted)");
      T s = tmp(n1, DType::kF32, "loss_parallel sum(exp)");
      sumexp = tmp(n1, DType::kF32, "loss_parallel all_reduce(SUM)");
    }
    T lse = tmp(n1, DType::kF32, "loss_parallel log(sumexp)");
    result = act(nv, DType::kF32, "log_softmax (loss_parallel)");
    // FLOPs: amax, subtract, exp, sum, subtract: five passes over the (N, V/tp) logits
    detail::count_pointwise(c.e, FlopKind::kElementwise, nv.numel().value, 5, 1, DType::kF32);
  }
  c.e.count_tp_collective(false, 2 * N * 4);  // the two (N, 1) float32 all-reduces
  T log_probs = result;
  c.e.record("LogSoftmaxBackward0", {&x}, {&log_probs}, {result}, [](Engine&, Node&, Grads& g) {
    return Grads{g[0]};  // _log_softmax_backward_handler: grad_output.to(input_dtype), the same tensor
  });
  result.reset();
  // _nll_loss_forward: safe_target = torch.where(target != ignore_index, target, 0); the MaskPartial's mask and
  // masked target; torch.gather (N, 1); apply_mask in place; all_reduce (a clone); -squeeze; torch.where; sum
  T loss_sum, total_weight;
  {
    // locals until the function returns: safe_target, the masked target, the gathered and reduced values;
    // `result` is rebound (-squeeze, where, sum), each rebinding dropping the tensor it replaced
    T safe;
    {
      T ne = tmp(n, DType::kBool, "target != ignore_index");
      safe = tmp(n, DType::kI64, "safe_target");
    }
    auto [mask, masked] = mask_partial(c.e, n1, Category::kTemporaries, c.layer);
    T gathered = tmp(n1, DType::kF32, "loss_parallel gather");
    mask.reset();  // _reduce_value: apply_mask in place, release_mask(), then the all-reduce
    T reduced = tmp(n1, DType::kF32, "loss_parallel all_reduce(SUM) of the gathered");
    T negated = tmp(n, DType::kF32, "-result_reduced");
    T where;
    {
      T ne2 = tmp(n, DType::kBool, "target != ignore_index");
      where = tmp(n, DType::kF32, "torch.where(target != ignore_index, result, 0)");
    }
    negated.reset();
    {
      T ne3 = tmp(n, DType::kBool, "target != ignore_index");
      T sum = tmp(Shape{}, DType::kI64, "(target != ignore_index).sum()");
      total_weight = act(Shape{}, DType::kF32, "nll total_weight");
    }
    loss_sum = act(Shape{}, DType::kF32, "loss_sum");
  }
  c.e.count_tp_collective(false, N * 4);  // the gathered log-probabilities' all-reduce
  c.e.record("NllLossBackward0", {&log_probs}, {&loss_sum}, {log_probs, target, total_weight},
             [nv, n, n1, Vl](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    auto t = [&](const Shape& s, DType dt, const char* what) { return e.empty(s, dt, Category::kTemporaries, Label{what}); };
    // _nll_loss_and_log_softmax_backward: grad_input = torch.zeros_like(x); the MaskPartial of the flattened
    // safe target; grad_update = mask.to(float32) - 1.0; torch.arange(N); grad_input[arange, masked] =
    // grad_update; grad_output = torch.where(target != ignore_index, grad_output, 0) (N, 1);
    // (grad_input + torch.exp(x)) * grad_output
    T safe;
    {
      T ne = t(n1, DType::kBool, "target != ignore_index");
      safe = t(n1, DType::kI64, "safe_target");
    }
    T grad_input = t(nv, DType::kF32, "loss_parallel zeros_like(x)");
    Masked mp = mask_partial(e, n, Category::kTemporaries, -1);
    T update, arange;
    {
      T f = t(n, DType::kF32, "mask.to(float32)");
      update = t(n, DType::kF32, "grad_update");
    }
    arange = t(n, DType::kI64, "torch.arange(N)");
    T w;
    {
      T ne = t(n1, DType::kBool, "target != ignore_index");
      w = t(n1, DType::kF32, "torch.where(target != ignore_index, grad_output, 0)");
    }
    T sum;
    {
      T ex = t(nv, DType::kF32, "loss_parallel torch.exp(x)");
      sum = t(nv, DType::kF32, "loss_parallel grad_input + exp(x)");
    }
    T out = detail::grad_empty(e, nv, DType::kF32, Label{"loss_parallel (grad_input + exp(x)) * grad_output"});
    // FLOPs: the zero fill, exp, add, multiply over (N, V/tp)
    detail::count_pointwise(e, FlopKind::kElementwise, nv.numel().value, 3, 1, DType::kF32);
    (void)Vl;
    return Grads{out};  // the locals (grad_input, the sum, the masks) die here
  });
  // trainer.py: loss = loss_sum / global_valid_tokens (a float32 0-dim tensor: (labels != IGNORE_INDEX).sum()
  // .float(), made before the forward in the trainer; allocated here)
  T gvt = act(Shape{}, DType::kF32, "global_valid_tokens");
  (void)tp;
  return div(c, loss_sum, gvt, "loss = loss_sum / global_valid_tokens");
}

}  // namespace trainmem::sim
