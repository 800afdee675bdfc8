// Matrix products and embeddings. Under autocast these are lower_precision_fp ops; the wrapper casts its
// arguments with cached_cast in the order GCC evaluates call arguments, right to left (seed 000's trace: the
// weight copy is allocated before the input copy). A generated backward node computes its inputs' gradients in
// the sorted order of their argument names (tools/autograd/load_derivatives.py: `for raw_names in
// sorted(defn.keys())`): mm and bmm (mat2, self) the second operand's first (seed 000's trace: the weight gradient
// before the input gradient), addmm (mat1, mat2, self) the first operand's (the H100 traces of HF GPT-2's Conv1D:
// the (M, in) gradient, then the weight's, then the bias's sum).
// B=micro-batch T=seq M=rows (B*T) V=vocab C=hidden
#include "ops_util.h"
#include "sp_ops.h"
#include "trainmem/error.h"

namespace trainmem::sim {

using detail::grad_empty;

namespace {

// The incoming gradient of a product, viewable as a matrix: when it is not, the backward reshapes it into a
// contiguous copy that lives until the node is done.
T grad_as(Engine& e, const T& g, const Shape& s) {
  if (view_strides(g.shape(), g->strides, s)) return g;
  return grad_empty(e, s, g.dtype(), g->label);
}

// The 2-D (or 3-D batched) operand a product saves: `x` itself when it can be viewed with the merged shape,
// otherwise the copy that reshape makes.
T as_operand(Ctx& c, const T& x, const Shape& merged) {
  if (view_strides(x.shape(), x->strides, merged)) return x;
  return c.e.empty(x.shape(), x.dtype(), Category::kActivations, c.L("matmul operand copy"));
}

// mm-like node: y = x @ W (+ b) with x (..., in) and `out_f` output features; W is an nn.Linear weight
// (out, in) used as weight.t(), or a Conv1D weight (in, out). Its gradient has the weight's own layout.
// `weight_t`: W is an nn.Linear weight, used as weight.t() (column-major): mm_mat2_backward then returns
// grad.t().mm(mat1).t() and TBackward0 transposes it back, so the weight's gradient is a view whose base (the
// product) stays alive with it (FunctionsManual.cpp mm_mat2_backward; TensorImpl::is_view). A Conv1D weight
// (in, out) is row-major: mat1.t().mm(grad), a tensor of its own.
T product_2d(Ctx& c, const T& x, const T& w, const T* b, uint64_t out_f, bool lt, bool weight_t, const char* what) {
  const uint64_t in = x.shape().back();
  const Shape m2{detail::rows_of(x.shape()).value, in};
  T x2 = as_operand(c, x, m2);
  const bool has_b = b && *b;
  T out;
  // aten.addmm when the bias is fused (lt: Linear.cpp's addmm path, Conv1D's torch.addmm), aten.mm otherwise
  c.e.sac_op(has_b && lt ? SacOp::kAddmm : SacOp::kMm, {&out}, [&] {
    out = c.e.empty(detail::with_last(x.shape(), out_f), x.dtype(), Category::kActivations, c.L(what));
    c.e.gemm(lt);  // the output is allocated first, then cuBLAS takes the thread's handle (and workspace)
    // FLOPs: x (M, in) @ W^T (in, out): 2·M·out·in; a fused bias is cuBLASLt's epilogue, not a kernel of its own
    c.e.count(FlopKind::kMatmul, detail::product_flops(1, m2[0], out_f, in),
              detail::product_bytes(1, m2[0], out_f, in, x.dtype()), x.dtype());
  });
  Saved saved;
  const bool gx = x->requires_grad, gw = w->requires_grad;
  // released in the order the generated node declares them: AddmmBackward0's mat1_, mat2_; MmBackward0's self_,
  // mat2_ in torch 2.0, mat2_, self_ after it (RuntimeFacts::saved_variables_sorted)
  const bool mat2_first = !has_b && c.rt().saved_variables_sorted;
  if (gx && mat2_first) saved.push_back(w);
  if (gw) saved.push_back(x2);  // mat1 (mm's self), needed for mat2's gradient
  if (gx && !mat2_first) saved.push_back(w);  // mat2 (the weight, or its autocast copy)
  const Shape xs = x.shape(), ws = w.shape();
  const Shape g2{m2[0], out_f};
  // The node's next edges in addmm's argument order, (self = bias, mat1, mat2), or (self, mat2) for mm: the
  // engine delivers (and queues the bias's AccumulateGrad, which runs first: DDP's gradient-ready order,
  // validate/cpu/ddp.py) in that order.
  const size_t ix = has_b ? 1 : 0, iw = ix + 1;
  const uint64_t in_f = in;
  auto fn = [gx, gw, xs, ws, g2, has_b, ix, iw, in_f, weight_t](Engine& e, Node&, Grads& g) {
    Grads r(3);
    if (!g[0]) return r;
    T gm = grad_as(e, g[0], g2);
    const DType gd = g[0].dtype();
    const auto weight_grad = [&] {
      r[iw] = grad_empty(e, ws, g[0].dtype(), g[0]->label);  // mm_mat2_backward: (out, in) like the weight
      r[iw]->is_view = weight_t;
      e.gemm(false);
      // FLOPs: grad^T (out, M) @ x (M, in): 2·M·out·in
      e.count(FlopKind::kMatmul, detail::product_flops(1, g2[1], in_f, g2[0]),
              detail::product_bytes(1, g2[1], in_f, g2[0], gd), gd);
    };
    const auto input_grad = [&] {
      r[ix] = grad_empty(e, xs, g[0].dtype(), g[0]->label);  // mm_mat1_backward
      e.gemm(false);
      // FLOPs: grad (M, out) @ W (out, in): 2·M·out·in
      e.count(FlopKind::kMatmul, detail::product_flops(1, g2[0], in_f, g2[1]),
              detail::product_bytes(1, g2[0], in_f, g2[1], gd), gd);
    };
    if (has_b) {  // addmm: (mat1, mat2, self)
      if (gx) input_grad();
      if (gw) weight_grad();
    } else {  // mm: (mat2, self)
      if (gw) weight_grad();
      if (gx) input_grad();
    }
    if (has_b) {
      r[0] = g[0];  // maybe_multiply(grad, beta) is grad itself; validate_outputs reduces it
      // FLOPs: validate_outputs' sum_to over the M rows: one add per gradient element
      detail::count_pointwise(e, FlopKind::kElementwise, detail::sat_mul(g2[0], g2[1]), 1, 0, gd);
    }
    return r;
  };
  if (has_b) {
    c.e.record("AddmmBackward0", {b, &x, &w}, {&out}, std::move(saved), fn);
  } else {
    c.e.record("MmBackward0", {&x, &w}, {&out}, std::move(saved), fn);
  }
  return out;
}

}  // namespace

namespace {

// The inventory row of the parameter `w`, or -1 (FSDP2's unsharded parameter is labelled apart from its row:
// param_index).
int32_t param_row(const T& w) { return !w->is_param ? -1 : w->label.row >= 0 ? w->label.row : w->param_index; }

// The adapters of the Linear (or Conv1D) whose weight is `w`, or nullptr.
const std::pair<T, T>* adapters_of(const Ctx& c, const T& w) {
  const int32_t row = param_row(w);
  if (row < 0 || static_cast<size_t>(row) >= c.lora.by_base_row.size()) return nullptr;
  const auto& ab = c.lora.by_base_row[static_cast<size_t>(row)];
  return ab.first ? &ab : nullptr;
}

// PEFT's lora.Linear.forward (peft >= 0.9, tuners/lora/layer.py) after `result = self.base_layer(x)`:
//   torch_result_dtype = result.dtype
//   x = self._cast_input_dtype(x, lora_A.weight.dtype)     # x.to(dtype) only when the dtypes differ
//   result = result + lora_B(lora_A(dropout(x))) * scaling
//   result = result.to(torch_result_dtype)
T lora_forward(Ctx& c, const T& x0, const std::pair<T, T>& ab, T result) {
  const DType result_dtype = result.dtype();
  // the local `x` is rebound to the cast copy (one per adapted module), which lives until forward returns
  const T x = to(c, x0, ab.first.dtype(), "lora input cast");
  T bs;
  {
    T b = linear(c, linear(c, dropout(c, x, c.lora.dropout, "lora_dropout"), ab.first, nullptr, "lora_A"),
                 ab.second, nullptr, "lora_B");
    bs = mul_scalar(c, b, "lora_B(...) * scaling");
  }  // lora_B's output goes once scaled
  result = add(c, result, bs, "result + lora");  // promotes to the adapters' dtype when they are wider
  bs.reset();
  return to(c, result, result_dtype, "lora result.to()");
}

// x.clone(): a new tensor; CloneBackward0 saves nothing and passes the gradient on.
T clone(Ctx& c, const T& x, const char* what) {
  T out = c.e.empty_strided(x.shape(), dense_strides_like(x.shape(), x->strides), x.dtype(), Category::kActivations,
                            c.L(what));
  c.e.record("CloneBackward0", {&x}, {&out}, {}, [](Engine&, Node&, Grads& g) { return Grads{g[0]}; });
  return out;
}

// PEFT's bnb Linear4bit.forward adapter path (tuners/lora/bnb.py): without autocast the input is cast to the
// adapters' dtype and the adapter output back to the result's before the scaling and the sum.
T lora_forward_bnb(Ctx& c, const T& x0, const std::pair<T, T>& ab, T result) {
  const bool convert = !c.autocast;  // requires_conversion = not torch.is_autocast_enabled()
  const DType expected = result.dtype();
  const T x = convert ? to(c, x0, ab.first.dtype(), "lora input cast") : x0;
  T output = linear(c, linear(c, dropout(c, x, c.lora.dropout, "lora_dropout"), ab.first, nullptr, "lora_A"),
                    ab.second, nullptr, "lora_B");
  if (convert) output = to(c, output, expected, "lora output .to(expected_dtype)");
  output = mul_scalar(c, output, "lora output * scaling");
  result = add(c, result, output, "result + lora");
  return result;
}

}  // namespace

// Linear4bit.forward: x.to(compute_dtype), MatMul4Bit (the weight dequantized for the matmul and freed after
// it, nothing saved but the packed weight itself; its backward dequantizes again), .to(inp_dtype).
T linear_4bit(Ctx& c, const T& x0, const T& packed, const T* b0, uint64_t out_f, uint64_t in_f, const char* what) {
  const Quant4bitPolicy& q = c.quant;
  const DType inp_dtype = x0.dtype();
  const T x = to(c, x0, q.compute, "Linear4bit x.to(compute_dtype)");
  const T bias = b0 ? to(c, *b0, q.compute, "Linear4bit bias.to(compute_dtype)") : T();
  T out;
  {
    // MatMul4Bit.forward: F.dequantize_4bit(B, quant_state).to(A.dtype), then F.linear(A, W.t(), bias); an
    // autograd.Function's forward records nothing itself
    T wdq;
    {
      T absmax;
      if (q.double_quant) {
        absmax = c.e.empty(Shape{ceil_div(out_f * in_f, 64)}, DType::kF32, Category::kTemporaries,
                           c.L("dequantized absmax"));
      }
      wdq = c.e.empty(Shape{out_f, in_f}, q.quantized, Category::kTemporaries, c.L("dequantized 4-bit weight"));
    }
    if (wdq.dtype() != x.dtype()) {
      wdq = c.e.empty(Shape{out_f, in_f}, x.dtype(), Category::kTemporaries, c.L("dequantized weight .to(A.dtype)"));
    }
    const bool grad = c.e.grad_mode;
    c.e.grad_mode = false;
    out = linear(c, x, wdq, bias ? &bias : nullptr, what);
    c.e.grad_mode = grad;
  }
  const Shape xs = x.shape();
  const DType qd = q.quantized;
  // ctx.tensors = (None, B): the packed weight (no new bytes); the input is not saved
  c.e.record("MatMul4BitBackward", {&x}, {&out}, {}, [xs, qd, out_f, in_f](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // grad_A = grad_output @ F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t()
    T wdq = e.empty(Shape{out_f, in_f}, qd, Category::kTemporaries,
                    Label{"backward: dequantized 4-bit weight", -1, kRowNamedInBackward});
    if (qd != g[0].dtype()) {
      wdq = e.empty(Shape{out_f, in_f}, g[0].dtype(), Category::kTemporaries,
                    Label{"backward: dequantized weight .to()", -1, kRowNamedInBackward});
    }
    T ga = grad_empty(e, xs, g[0].dtype(), g[0]->label);
    e.gemm(false);
    return Grads{ga};
  });
  return to(c, out, inp_dtype, "Linear4bit output .to(inp_dtype)");
}

T linear(Ctx& c, const T& x0, const T& w0, const T* b0, const char* what) {
  // (a 4-bit weight: whole, or FSDP2's unsharded one when a floating quant_storage lets fully_shard shard it)
  if (const int32_t row = param_row(w0); row >= 0 && static_cast<size_t>(row) < c.quant.dims_by_row.size()) {
    const auto [out_f, in_f] = c.quant.dims_by_row[static_cast<size_t>(row)];
    if (out_f != 0) {
      // PEFT's bnb Linear4bit.forward: result = base_layer(x); result = result.clone() ("defensively clone"),
      // then the adapter path
      T result = linear_4bit(c, x0, w0, b0, out_f, in_f, what);
      if (const auto* ab = adapters_of(c, w0)) {
        result = clone(c, result, "Linear4bit result.clone()");
        return lora_forward_bnb(c, x0, *ab, std::move(result));
      }
      return result;
    }
  }
  T result;
  {
    const T b = b0 ? autocast_lowp(c, *b0) : T();
    const T w = autocast_lowp(c, w0);
    const T x = autocast_lowp(c, x0);
    // Linear.cpp: a bias with a 2-D (or contiguous N-D) input takes addmm, which goes through cuBLASLt's
    // gemm_and_bias; otherwise matmul (cuBLAS) and an in-place bias add.
    const bool addmm = b && (x.shape().n == 2 || is_contiguous(x.shape(), x->strides));
    result = product_2d(c, x, w, b ? &b : nullptr, w.shape()[0], addmm, /*weight_t=*/true, what);
  }
  // A PEFT-wrapped Linear: the base layer's result, then the adapter path.
  if (const auto* ab = adapters_of(c, w0)) return lora_forward(c, x0, *ab, std::move(result));
  return result;
}

T conv1d(Ctx& c, const T& x0, const T& w0, const T& b0, const char* what) {
  const uint64_t nx = x0.shape().back(), nf = w0.shape()[1];
  const T xv = view(c, x0, Shape{detail::rows_of(x0.shape()).value, nx});  // x.view(-1, x.size(-1))
  // torch.addmm(bias, x, weight) under autocast: its wrapper casts (self, mat1, mat2) right to left (see the top
  // of this file): the weight, then the input, then the bias, whose cast node is thus the newest (it runs first
  // in backward, and the bias's AccumulateGrad before the weight's: validate/cpu/ddp.py)
  const T w = autocast_lowp(c, w0);
  const T x = autocast_lowp(c, xv);
  const T b = autocast_lowp(c, b0);
  T y = product_2d(c, x, w, &b, nf, /*lt=*/true, /*weight_t=*/false, what);
  T out = view(c, y, detail::with_last(x0.shape(), nf));  // x.view(size_out)
  y.reset();
  // A PEFT-wrapped Conv1D (fan_in_fan_out): the same adapter path as a Linear.
  if (const auto* ab = adapters_of(c, w0)) return lora_forward(c, x0, *ab, std::move(out));
  return out;
}

T matmul(Ctx& c, const T& a0, const T& b0, const char* what) {
  const T b = autocast_lowp(c, b0);
  const T a = autocast_lowp(c, a0);
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  uint64_t batch = 1;
  for (int i = 0; i + 2 < as.n; ++i) batch = checked_mul(batch, as.d[i], "batch of a matmul");
  const uint64_t m = as.d[as.n - 2], k = as.back(), n = bs.back();
  // _matmul_impl: tensor.expand(...).reshape({batch, rows, cols}) then bmm; reshape copies when the batch
  // dims cannot be merged (e.g. q = x.view(B,T,H,D).transpose(1,2)).
  const T a3 = as_operand(c, a, Shape{batch, m, k});
  const T b3 = as_operand(c, b, Shape{batch, k, n});
  T out3;
  c.e.sac_op(SacOp::kBmm, {&out3}, [&] {
    out3 = c.e.empty(Shape{batch, m, n}, a.dtype(), Category::kActivations, c.L(what));
    c.e.gemm(false);
    // FLOPs: batch products of (m, k) @ (k, n): eager attention's QK^T and AV count here
    c.e.count(FlopKind::kMatmul, detail::product_flops(batch, m, n, k),
              detail::product_bytes(batch, m, n, k, a.dtype()), a.dtype());
  });
  Saved saved;
  const bool ga = a->requires_grad, gb = b->requires_grad;
  // release_variables() drops them in the order the generated node declares them (RuntimeFacts::
  // saved_variables_sorted): self_ then mat2_ in torch 2.0, mat2_ then self_ later
  const bool mat2_first = c.rt().saved_variables_sorted;
  if (ga && mat2_first) saved.push_back(b3);
  if (gb) saved.push_back(a3);
  if (ga && !mat2_first) saved.push_back(b3);
  c.e.record("BmmBackward0", {&a, &b}, {&out3}, std::move(saved),
             [ga, gb, as, bs, batch, m, k, n](Engine& e, Node&, Grads& g) {
               Grads r(2);
               if (!g[0]) return r;
               const DType gd = g[0].dtype();
               if (gb) {
                 r[1] = grad_empty(e, bs, g[0].dtype(), g[0]->label);
                 e.gemm(false);
                 // FLOPs: a^T (k, m) @ grad (m, n), batch times
                 e.count(FlopKind::kMatmul, detail::product_flops(batch, k, n, m),
                         detail::product_bytes(batch, k, n, m, gd), gd);
               }
               if (ga) {
                 r[0] = grad_empty(e, as, g[0].dtype(), g[0]->label);
                 e.gemm(false);
                 // FLOPs: grad (m, n) @ b^T (n, k), batch times
                 e.count(FlopKind::kMatmul, detail::product_flops(batch, m, k, n),
                         detail::product_bytes(batch, m, k, n, gd), gd);
               }
               return r;
             });
  // at::_unsafe_view(bmm result, output_shape): its backward reshapes the incoming gradient back to the bmm
  // shape, copying it when its strides do not allow a view (and dropping the original when the node ends).
  Shape os = as;
  os.d[os.n - 1] = n;
  return view(c, out3, os);
}

T embedding(Ctx& c, const T& weight, const T& ids, const char* what) {
  return embedding_grad_rows(c, weight, ids, weight.shape()[0], what);
}

T embedding_grad_rows(Ctx& c, const T& weight, const T& ids, uint64_t grad_rows, const char* what) {
  const uint64_t V = grad_rows, C = weight.shape()[1];
  Shape os = ids.shape();
  os.d[os.n++] = C;
  T out = c.e.empty(os, weight.dtype(), Category::kActivations, c.L(what));
  const uint64_t N = ids.shape().numel().value;
  // FLOPs: a gather, no arithmetic; it reads N rows of C and the ids, writes N rows
  c.e.count(FlopKind::kElementwise, 0,
            detail::sat_add(detail::nbytes(detail::sat_mul(detail::sat_mul(N, C), 2), weight.dtype()),
                        detail::nbytes(N, DType::kI64)),
            weight.dtype());
  const Shape ws{V, C};
  // EmbeddingBackward0 saves the indices; embedding_dense_backward (Embedding.cu,
  // EmbeddingBackwardKernel.cu) builds the (V, C) gradient, sorting the indices first when there are more
  // than 3072 of them.
  Node* node = c.e.record("EmbeddingBackward0", {&weight}, {&out}, {ids}, [N, V, C, ws](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: embedding_dense_backward zero-fills the (V, C) gradient and accumulates N rows of C into it
    e.count(FlopKind::kElementwise, detail::sat_mul(N, C),
            detail::sat_add(detail::nbytes(detail::sat_mul(V, C), g[0].dtype()),
                        detail::nbytes(detail::sat_mul(detail::sat_mul(N, C), 2), g[0].dtype())),
            g[0].dtype());
    constexpr uint64_t kSortThreshold = 3072;  // "num_indices <= 3072 && !scale_grad_by_freq"
    constexpr uint64_t kRowsPerThread = 10;    // NROWS_PER_THREAD
    const DType gd = g[0].dtype();
    if (N <= kSortThreshold) return Grads{grad_empty(e, ws, gd, g[0]->label)};
    auto idx = [&](uint64_t n, const char* w) { return e.empty(Shape{n}, DType::kI64, Category::kTemporaries, Label{w}); };
    T sorted = idx(N, "embedding bwd sorted_indices");
    T orig = idx(N, "embedding bwd orig_indices");
    { T range = idx(N, "embedding bwd arange"); }
    T grad_weight = grad_empty(e, ws, gd, g[0]->label);
    const uint64_t max_segments = std::min(N, V);
    const uint64_t max_partial = N / kRowsPerThread + max_segments;
    T seg = idx(N, "embedding bwd segment_offsets");
    T nseg = e.empty(Shape{}, DType::kI64, Category::kTemporaries, Label{"embedding bwd num_of_segments"});
    { T dummy = idx(N, "embedding bwd unique_by_key output"); }
    T pps = idx(max_segments, "embedding bwd partials_per_segment");
    T ppso = idx(max_segments, "embedding bwd partials_per_segment_offset");
    T npart = e.empty(Shape{}, DType::kI64, Category::kTemporaries, Label{"embedding bwd num_of_partial_segments"});
    T pso = idx(max_partial, "embedding bwd partial_segment_offset");
    // grad_weight_per_segment accumulates in float32 for half and bfloat16 gradients.
    const DType acc = (gd == DType::kF16 || gd == DType::kBF16) ? DType::kF32 : gd;
    { T per_segment = e.empty(Shape{max_partial, C}, acc, Category::kTemporaries, Label{"embedding bwd grad_weight_per_segment"}); }
    return Grads{grad_weight};
  });
  // a DTensor weight's input metadata is its global shape: the (grad_rows, C) gradient passes validate_outputs
  // as it is (sp_ops.h)
  if (node && grad_rows != weight.shape()[0]) node->in_meta[0].shape = ws;
  // enable_input_require_grads: a forward hook on the input embeddings does output.requires_grad_(True), so
  // that layer 0 records a graph even when the embedding is frozen (PEFT, gradient checkpointing)
  // (FSDP2's unsharded weight is labelled apart from its row: param_index)
  if (c.input_embedding_row >= 0 && (weight->label.row >= 0 ? weight->label.row : weight->param_index) == c.input_embedding_row &&
      !out->requires_grad &&
      c.e.grad_mode) {
    out = c.e.requires_grad_leaf(out, /*held_by_graph=*/true);
  }
  return out;
}

}  // namespace trainmem::sim
