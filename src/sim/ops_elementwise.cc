// Casts and elementwise ops. What each saves for backward follows tools/autograd/derivatives.yaml (saved only
// when the formula that uses it is needed: mul saves `other` iff `self` requires grad), what its backward
// allocates follows the formula (one new tensor per computed gradient, plus the temporaries of composite
// formulas such as pow's `grad * (exp * self.pow(exp - 1))`).
#include <algorithm>

#include "ops_util.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace detail {

DType promote(const T& a, const T& b) {
  const DType x = a.dtype(), y = b.dtype();
  if (x == y) return x;
  const bool ad = a.shape().n > 0, bd = b.shape().n > 0;
  if (ad != bd && is_floating(x) == is_floating(y)) return ad ? x : y;  // 0-dim tensors do not widen
  if (!is_floating(x)) return y;
  if (!is_floating(y)) return x;
  return DType::kF32;  // float32 with anything, and float16 with bfloat16
}

Shape broadcast(const Shape& a, const Shape& b) {
  Shape r;
  r.n = std::max(a.n, b.n);
  for (int i = 0; i < r.n; ++i) {
    const int ia = i - (r.n - a.n), ib = i - (r.n - b.n);
    const uint64_t da = ia >= 0 ? a.d[ia] : 1, db = ib >= 0 ? b.d[ib] : 1;
    if (da != db && da != 1 && db != 1) throw Error("internal: shapes do not broadcast");
    r.d[i] = std::max(da, db);
  }
  return r;
}

Strides result_strides(const Shape& s, const T& a, const T& b) {
  auto same = [&](const T& t) { return t && t.shape().n == s.n && t.shape().numel() == s.numel(); };
  if (same(a)) return dense_strides_like(s, a->strides);
  if (same(b)) return dense_strides_like(s, b->strides);
  return contiguous_strides(s);
}

T grad_empty(Engine& e, const Shape& s, DType dt, Label l) { return e.empty(s, dt, Category::kBackward, l); }

T grad_like(Engine& e, const T& like, DType dt) {
  return e.empty_strided(like.shape(), dense_strides_like(like.shape(), like->strides), dt, Category::kBackward,
                         like->label);
}

Shape with_last(const Shape& s, uint64_t last) {
  Shape r = s;
  r.d[r.n - 1] = last;
  return r;
}

Elems rows_of(const Shape& s) {
  uint64_t n = 1;
  for (int i = 0; i + 1 < s.n; ++i) n = checked_mul(n, s.d[i], "rows of a tensor");
  return Elems(n);
}

}  // namespace detail

using detail::grad_like;

namespace {

// A new forward result shaped like `like` (an elementwise op's output).
T result_like(Ctx& c, const T& like, DType dt, const char* what) {
  return c.e.empty_strided(like.shape(), dense_strides_like(like.shape(), like->strides), dt,
                           Category::kActivations, c.L(what));
}

// An op with one differentiable input whose backward is one new tensor shaped like the incoming gradient,
// saving `saved` (nothing, the input, or the result).
enum class Save { kNothing, kInput, kResult };
T unary(Ctx& c, const char* node, const T& a, DType out_dt, Save save, const char* what) {
  T out = result_like(c, a, out_dt, what);
  Saved saved;
  if (save == Save::kInput) saved.push_back(a);
  if (save == Save::kResult) saved.push_back(out);
  // FLOPs: one per element (the elementwise convention of flops.h), reading a, writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, a.shape().numel().value, 1, 1, out_dt);
  const uint64_t reads = save == Save::kNothing ? 1 : 2;
  c.e.record(node, {&a}, {&out}, std::move(saved), [reads](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: grad times the derivative, one per element, reading grad (and what was saved), writing the result
    detail::count_pointwise(e, FlopKind::kElementwise, g[0].shape().numel().value, 1, reads, g[0].dtype());
    return Grads{grad_like(e, g[0], g[0].dtype())};
  });
  return out;
}

}  // namespace

T to(Ctx& c, const T& x, DType dt, const char* what) {
  if (x.dtype() == dt) return x;
  T out = c.e.empty_strided(x.shape(), dense_strides_like(x.shape(), x->strides), dt,
                            x->is_param ? Category::kWeightCopies : Category::kActivations,
                            x->is_param ? Label{x->label.what, c.layer, x->label.row} : c.L(what));
  const DType src = x.dtype();
  // FLOPs: a cast is a copy: no arithmetic, numel read in the source dtype and written in the new one
  const uint64_t cast_bytes = detail::sat_add(detail::nbytes(x.shape().numel().value, src),
                                          detail::nbytes(x.shape().numel().value, dt));
  c.e.count(FlopKind::kElementwise, 0, cast_bytes, dt);
  // ToCopyBackward0 saves only self.options(); its backward is grad.to(src).
  c.e.record("ToCopyBackward0", {&x}, {&out}, {}, [src, cast_bytes](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    e.count(FlopKind::kElementwise, 0, cast_bytes, src);  // FLOPs: grad.to(src), a copy
    return Grads{grad_like(e, g[0], src)};
  });
  return out;
}

T autocast_lowp(Ctx& c, const T& x) {
  if (!c.autocast || !x || !is_floating(x.dtype()) || x.dtype() == c.ac_dtype) return x;
  // cached_cast (autocast_mode.cpp): `arg.scalar_type() == at::kFloat && arg.requires_grad() && arg.is_leaf()
  // && !arg.is_view()` (trainable parameters) are cast once per autocast region, whatever the grad mode (a
  // checkpointed layer's no_grad forward caches too). A frozen parameter is cast again at every use, and so is
  // every weight under torch.inference_mode() from 2.11 (`&& !c10::InferenceMode::is_enabled()`, runtime.h).
  const bool cache = !c.inference_mode || c.rt().autocast_caches_in_inference_mode;
  if (cache && x->is_param && x->requires_grad && x.dtype() == DType::kF32) {
    const size_t row = static_cast<size_t>(x->label.row);
    if (row >= c.ac_cache.size()) c.ac_cache.resize(row + 1);
    if (!c.ac_cache[row]) c.ac_cache[row] = to(c, x, c.ac_dtype, "autocast weight copy");
    return c.ac_cache[row];
  }
  return to(c, x, c.ac_dtype, "autocast cast");
}

T autocast_fp32(Ctx& c, const T& x) {
  if (!c.autocast || !x || !is_floating(x.dtype()) || x.dtype() == DType::kF32) return x;
  return to(c, x, DType::kF32, "autocast fp32 cast");
}

namespace {

// add/sub: nothing saved; both gradients alias the incoming one (sub negates the second: a new tensor);
// broadcast and dtype differences are resolved by the engine's validate_outputs.
T add_like(Ctx& c, const char* node, const T& a, const T& b, bool negate_b, const char* what) {
  const Shape s = detail::broadcast(a.shape(), b.shape());
  T out = c.e.empty_strided(s, detail::result_strides(s, a, b), detail::promote(a, b), Category::kActivations,
                            c.L(what));
  // FLOPs: one add per output element, reading both operands (as broadcast to the output), writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, s.numel().value, 1, 2, out.dtype());
  c.e.record(node, {&a, &b}, {&out}, {}, [negate_b](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T(), T()};
    // FLOPs: sub's -grad, one per element
    if (negate_b) detail::count_pointwise(e, FlopKind::kElementwise, g[0].shape().numel().value, 1, 1, g[0].dtype());
    T gb = negate_b ? grad_like(e, g[0], g[0].dtype()) : g[0];
    return Grads{g[0], gb};
  });
  return out;
}

}  // namespace

T add(Ctx& c, const T& a, const T& b, const char* what) { return add_like(c, "AddBackward0", a, b, false, what); }
T sub(Ctx& c, const T& a, const T& b, const char* what) { return add_like(c, "SubBackward0", a, b, true, what); }

T mul(Ctx& c, const T& a, const T& b, const char* what) {
  const Shape s = detail::broadcast(a.shape(), b.shape());
  T out = c.e.empty_strided(s, detail::result_strides(s, a, b), detail::promote(a, b), Category::kActivations,
                            c.L(what));
  // "self: mul_tensor_backward(grad, other, self.scalar_type())": other is saved iff self needs grad.
  Saved saved;
  const bool ga = a->requires_grad, gb = b->requires_grad;
  if (ga) saved.push_back(b);
  if (gb) saved.push_back(a);
  // FLOPs: one multiply per output element, reading both operands, writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, s.numel().value, 1, 2, out.dtype());
  c.e.record("MulBackward0", {&a, &b}, {&out}, std::move(saved), [ga, gb, s](Engine& e, Node& n, Grads& g) {
    Grads r(2);
    if (!g[0]) return r;
    // FLOPs: grad * other and grad * self, one multiply per element each, reading two, writing one
    const uint64_t gn = g[0].shape().numel().value;
    if (ga) detail::count_pointwise(e, FlopKind::kElementwise, gn, 1, 2, g[0].dtype());
    if (gb) detail::count_pointwise(e, FlopKind::kElementwise, gn, 1, 2, g[0].dtype());
    // grad * self (other's) and grad * other (self's), each full-shape (validate_outputs reduces broadcast
    // operands), in the generated node's order: the sorted input names (load_derivatives.py), other before self.
    // The H100 trace of HF GPT-2's tanh GELU (`0.5 * x * (1.0 + tanh(...))`) frees other's first.
    if (gb) r[1] = grad_like(e, g[0], detail::promote(g[0], n.saved[ga ? 1 : 0]));
    if (ga) r[0] = grad_like(e, g[0], detail::promote(g[0], n.saved[0]));
    (void)s;
    return r;
  });
  return out;
}

T div(Ctx& c, const T& a, const T& b, const char* what) {
  const Shape s = detail::broadcast(a.shape(), b.shape());
  T out = c.e.empty_strided(s, detail::result_strides(s, a, b), detail::promote(a, b), Category::kActivations,
                            c.L(what));
  // "other" is used by both formulas and always saved; "self" only for other's gradient.
  const bool gb = b->requires_grad;
  Saved saved{b};
  if (gb) saved.push_back(a);
  // FLOPs: one divide per output element, reading both operands, writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, s.numel().value, 1, 2, out.dtype());
  c.e.record("DivBackward0", {&a, &b}, {&out}, std::move(saved), [gb](Engine& e, Node& n, Grads& g) {
    Grads r(2);
    if (!g[0]) return r;
    // FLOPs: grad / other (one kernel); other's -grad * self / (other * other) takes three more
    const uint64_t gn = g[0].shape().numel().value;
    for (int i = 0; i < (gb ? 4 : 1); ++i) detail::count_pointwise(e, FlopKind::kElementwise, gn, 1, 2, g[0].dtype());
    // the sorted input names' order (load_derivatives.py): other's gradient before self's
    if (gb) {
      // -grad * self / (other * other): two temporaries then the result
      T t1 = grad_like(e, g[0], g[0].dtype());
      T t2 = grad_like(e, g[0], g[0].dtype());
      r[1] = grad_like(e, g[0], g[0].dtype());
    }
    r[0] = grad_like(e, g[0], g[0].dtype());  // grad / other
    (void)n;
    return r;
  });
  return out;
}

T add_scalar(Ctx& c, const T& a, const char* what) {
  T out = result_like(c, a, a.dtype(), what);
  // FLOPs: one add per element, reading a, writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, a.shape().numel().value, 1, 1, a.dtype());
  c.e.record("AddBackward1", {&a}, {&out}, {}, [](Engine&, Node&, Grads& g) {
    return Grads{g[0]};  // passthrough
  });
  return out;
}

T mul_scalar(Ctx& c, const T& a, const char* what) { return unary(c, "MulBackward1", a, a.dtype(), Save::kNothing, what); }
T neg(Ctx& c, const T& a, const char* what) { return unary(c, "NegBackward0", a, a.dtype(), Save::kNothing, what); }
T tanh(Ctx& c, const T& a, const char* what) { return unary(c, "TanhBackward0", a, a.dtype(), Save::kResult, what); }
T sigmoid(Ctx& c, const T& a, const char* what) {
  return unary(c, "SigmoidBackward0", a, a.dtype(), Save::kResult, what);
}
T relu(Ctx& c, const T& a, const char* what) { return unary(c, "ReluBackward0", a, a.dtype(), Save::kResult, what); }
T gelu(Ctx& c, const T& a, const char* what) { return unary(c, "GeluBackward0", a, a.dtype(), Save::kInput, what); }
T silu(Ctx& c, const T& a, const char* what) { return unary(c, "SiluBackward0", a, a.dtype(), Save::kInput, what); }

T pow_scalar(Ctx& c, const T& a0, const char* what) {
  const T a = autocast_fp32(c, a0);  // pow is on autocast's fp32 list
  T out = result_like(c, a, a.dtype(), what);
  // FLOPs: one pow per element, reading a, writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, a.shape().numel().value, 1, 1, a.dtype());
  c.e.record("PowBackward0", {&a}, {&out}, {a}, [](Engine& e, Node& n, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: self.pow(exp - 1), exp * that, grad * that: three kernels of one per element
    for (int i = 0; i < 3; ++i) {
      detail::count_pointwise(e, FlopKind::kElementwise, g[0].shape().numel().value, 1, 2, g[0].dtype());
    }
    // pow_backward: grad * (exp * self.pow(exp - 1)): self.pow(exp-1) and exp*that are live until the end
    // of the expression.
    T t1 = grad_like(e, n.saved[0], n.saved[0].dtype());
    T t2 = grad_like(e, n.saved[0], n.saved[0].dtype());
    return Grads{grad_like(e, g[0], detail::promote(g[0], n.saved[0]))};
  });
  return out;
}

T rsqrt(Ctx& c, const T& a0, const char* what) {
  const T a = autocast_fp32(c, a0);  // rsqrt is on autocast's fp32 list
  T out = result_like(c, a, a.dtype(), what);
  // FLOPs: one rsqrt per element, reading a, writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, a.shape().numel().value, 1, 1, a.dtype());
  c.e.record("RsqrtBackward0", {&a}, {&out}, {out}, [](Engine& e, Node& n, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: -0.5 * grad, result.pow(3), their product: three kernels of one per element
    for (int i = 0; i < 3; ++i) {
      detail::count_pointwise(e, FlopKind::kElementwise, g[0].shape().numel().value, 1, 2, g[0].dtype());
    }
    // -0.5 * grad * result.pow(3): (-0.5 * grad) and result.pow(3) live until the product is made.
    T t1 = grad_like(e, g[0], g[0].dtype());
    T t2 = grad_like(e, n.saved[0], n.saved[0].dtype());
    return Grads{grad_like(e, g[0], g[0].dtype())};
  });
  return out;
}

T mean_last(Ctx& c, const T& a, const char* what) {
  const Shape s = detail::with_last(a.shape(), 1);
  T out = c.e.empty(s, a.dtype(), Category::kActivations, c.L(what));
  c.e.reduce_kernel_scratch(a, 1u << (a.shape().n - 1));  // mean_kernel_cuda: gpu_reduce_kernel
  const Shape in = a.shape();
  // FLOPs: one add per input element (the reduction), reading a
  c.e.count(FlopKind::kElementwise, in.numel().value, detail::nbytes(in.numel().value, a.dtype()), a.dtype());
  // mean_backward: grad.expand(sizes) / numel: a new full-size tensor.
  c.e.record("MeanBackward1", {&a}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: one divide per element of the full-size result, written
    e.count(FlopKind::kElementwise, in.numel().value, detail::nbytes(in.numel().value, g[0].dtype()), g[0].dtype());
    return Grads{detail::grad_empty(e, in, g[0].dtype(), g[0]->label)};
  });
  return out;
}

T dropout(Ctx& c, const T& a, double p, const char* what) {
  // F.dropout with p == 0 or in eval mode returns its input.
  if (p <= 0.0 || !c.training) return a;
  // CUDA native_dropout (aten/src/ATen/native/cuda/Dropout.cu, dropout_cuda): the bool mask
  // (at::empty_like(self, kBool)) first, then the output (at::empty_like(self)); the mask is saved, the
  // backward is one new tensor. The order shows in the H100 traces of validate/measured/ (GPT-2's dropouts).
  T mask = c.e.empty_strided(a.shape(), dense_strides_like(a.shape(), a->strides), DType::kBool,
                             Category::kActivations, c.L("dropout mask"));
  T out = result_like(c, a, a.dtype(), what);
  // FLOPs: a random draw, a compare and a scaled multiply per element (3), reading a, writing out and the mask
  const uint64_t dn = a.shape().numel().value;
  c.e.count(FlopKind::kElementwise, detail::sat_mul(dn, 3),
            detail::sat_add(detail::nbytes(detail::sat_mul(dn, 2), a.dtype()), detail::nbytes(dn, DType::kBool)),
            a.dtype());
  c.e.record("NativeDropoutBackward0", {&a}, {&out}, {mask}, [](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: grad * mask * scale, two per element, reading grad and the mask, writing the result
    const uint64_t n = g[0].shape().numel().value;
    e.count(FlopKind::kElementwise, detail::sat_mul(n, 2),
            detail::sat_add(detail::nbytes(detail::sat_mul(n, 2), g[0].dtype()), detail::nbytes(n, DType::kBool)),
            g[0].dtype());
    return Grads{grad_like(e, g[0], g[0].dtype())};
  });
  return out;
}

T masked_fill(Ctx& c, const T& a, const T& mask, const char* what) {
  T out = result_like(c, a, a.dtype(), what);
  // FLOPs: one select per element, reading a (and the mask, counted as a tensor of a's dtype), writing out
  detail::count_pointwise(c.e, FlopKind::kElementwise, a.shape().numel().value, 1, 2, a.dtype());
  // MaskedFillBackward0 saves the mask; backward grad.masked_fill(mask, 0) is one new tensor.
  c.e.record("MaskedFillBackward0", {&a}, {&out}, {mask}, [](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    // FLOPs: as forward
    detail::count_pointwise(e, FlopKind::kElementwise, g[0].shape().numel().value, 1, 2, g[0].dtype());
    return Grads{grad_like(e, g[0], g[0].dtype())};
  });
  return out;
}

T full_scalar(Ctx& c, DType dt, const char* what) { return c.e.empty(Shape{}, dt, Category::kActivations, c.L(what)); }

}  // namespace trainmem::sim
