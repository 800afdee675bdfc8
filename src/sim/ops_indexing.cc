// Indexing, top-k and the in-place updates of the mixture-of-experts block (transformers 5.x MixtralExperts'
// eager forward and MixtralTopKRouter). What each backward saves and allocates follows
// tools/autograd/derivatives.yaml (PyTorch 2.x; the same formulas in 1.13, the CPU oracle's version).
// N=rows (tokens) n=rows picked by an index E=experts k=experts per token
#include "ops_util.h"
#include "trainmem/error.h"

namespace trainmem::sim {

using detail::grad_empty;
using detail::grad_like;

T zeros_like(Ctx& c, const T& x, const char* what) {
  return c.e.empty_strided(x.shape(), dense_strides_like(x.shape(), x->strides), x.dtype(), Category::kActivations,
                           c.L(what));
}

T select0(Ctx& c, const T& x) {
  const Shape& xs = x.shape();
  if (xs.n < 2) throw Error("internal: select0 of a tensor with fewer than 2 dims");
  Shape s;
  Strides st{};
  for (int i = 1; i < xs.n; ++i) {
    s.d[s.n] = xs.d[i];
    st[s.n] = x->strides[i];
    ++s.n;
  }
  T out = c.e.view(x, s, st);
  out->label = Label{x->label.what, c.layer, x->label.row};  // its gradients are named after this layer
  // "self: select_backward_symint(grad, self.sym_sizes(), dim, index)": at::zeros(input_sizes) with the
  // gradient copied into row `index` (FunctionsManual.cpp / TensorShape.cpp select_backward).
  c.e.record("SelectBackward0", {&x}, {&out}, {}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

T index_rows(Ctx& c, const T& x, const T& index, const char* what) {
  Shape s = x.shape();
  s.d[0] = index.shape()[0];
  T out = c.e.empty(s, x.dtype(), Category::kActivations, c.L(what));
  const Shape xs = x.shape();
  // "self: index_backward(grad.new_zeros_symint(self.sym_sizes(), grad.options()), indices, grad)": indices
  // saved, self only by its sizes
  c.e.record("IndexBackward0", {&x}, {&out}, {index}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

T index_pair_unsqueeze(Ctx& c, const T& x, const T& i0, const T& i1, const char* what) {
  if (x.shape().n != 2) throw Error("internal: index_pair_unsqueeze of a tensor that is not 2-D");
  const T xu = unsqueeze(c, x, 2);  // (N, k, 1)
  T out = c.e.empty(Shape{i0.shape()[0], 1}, x.dtype(), Category::kActivations, c.L(what));
  const Shape xs = xu.shape();
  c.e.record("IndexBackward0", {&xu}, {&out}, {i0, i1}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

T index_pair(Ctx& c, const T& x, const T& i0, const T& i1, const char* what) {
  if (x.shape().n != 3) throw Error("internal: index_pair of a tensor that is not 3-D");
  T out = c.e.empty(Shape{i0.shape()[0], x.shape()[2]}, x.dtype(), Category::kActivations, c.L(what));
  const Shape xs = x.shape();
  c.e.record("IndexBackward0", {&x}, {&out}, {i0, i1}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

void index_add_(Ctx& c, T& self, const T& index, const T& source) {
  T out = c.e.view(self, self.shape(), self->strides);  // in place: the same storage
  const bool gs = source->requires_grad;
  const Shape ss = source.shape();
  // "self: grad", "source: maybe_multiply(source.dim() > 0 ? grad.index_select(dim, index).expand_as(source)
  // : ..., alpha)": index and source are saved; self's gradient is the incoming one, source's a new
  // index_select result (expand_as is a view).
  c.e.record("IndexAddBackward0", {&self, &source}, {&out}, {index, source}, [gs, ss](Engine& e, Node&, Grads& g) {
    Grads r(2);
    if (!g[0]) return r;
    r[0] = g[0];
    if (gs) r[1] = grad_empty(e, ss, g[0].dtype(), g[0]->label);
    return r;
  });
  self = std::move(out);
}

TopK topk_last(Ctx& c, const T& x, uint64_t k, const char* what) {
  const Shape s = detail::with_last(x.shape(), k);
  TopK r;
  r.values = c.e.empty(s, x.dtype(), Category::kActivations, c.L(what));
  r.indices = c.e.empty(s, DType::kI64, Category::kActivations, c.L("topk indices"));
  const Shape xs = x.shape();
  // "self: value_selecting_reduction_backward_symint(grad, dim, indices, self.sym_sizes(), keepdim)": the
  // indices saved; at::zeros(self's sizes).scatter_(dim, indices, grad)
  c.e.record("TopkBackward0", {&x}, {&r.values}, {r.indices}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return r;
}

T sum_last_keepdim(Ctx& c, const T& x, const char* what) {
  T out = c.e.empty(detail::with_last(x.shape(), 1), x.dtype(), Category::kActivations, c.L(what));
  c.e.reduce_kernel_scratch(x, 1u << (x.shape().n - 1));  // sum_kernel_cuda: gpu_reduce_kernel
  const Shape xs = x.shape();
  // "self: sum_backward(grad, self.sym_sizes(), dim, keepdim)": grad.expand(sizes), a view
  c.e.record("SumBackward1", {&x}, {&out}, {}, [xs](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    Strides st = g[0]->strides;
    st[xs.n - 1] = 0;
    return Grads{e.view(g[0], xs, st)};
  });
  return out;
}

T sum_last(Ctx& c, const T& x, const char* what) {
  Shape s = x.shape();
  s.n -= 1;
  s.d[s.n] = 0;
  T out = c.e.empty(s, x.dtype(), Category::kActivations, c.L(what));
  c.e.reduce_kernel_scratch(x, 1u << (x.shape().n - 1));  // sum_kernel_cuda: gpu_reduce_kernel
  const Shape xs = x.shape();
  // "self: sum_backward(grad, self.sym_sizes(), dim, keepdim)": grad.unsqueeze(dim).expand(sizes), views
  c.e.record("SumBackward1", {&x}, {&out}, {}, [xs](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    Strides st{};
    for (int i = 0; i + 1 < xs.n; ++i) st[i] = g[0]->strides[i];
    st[xs.n - 1] = 0;
    return Grads{e.view(g[0], xs, st)};
  });
  return out;
}

T gather_last(Ctx& c, const T& x, const T& index, const char* what) {
  T out = c.e.empty(index.shape(), x.dtype(), Category::kActivations, c.L(what));
  const Shape xs = x.shape();
  c.e.record("GatherBackward0", {&x}, {&out}, {x, index}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

T grouped_mm(Ctx& c, const T& x, const T& w, const T& offs, const char* what) {
  T out = c.e.empty(Shape{x.shape()[0], w.shape()[2]}, x.dtype(), Category::kActivations, c.L(what));
  // FLOPs: each of the S routed rows goes through its own expert only: 2·S·in·out (only routed tokens count);
  // the kernel reads the rows, every expert's (in, out) weight, and writes (S, out)
  const uint64_t S = x.shape()[0], in = w.shape()[1], outf = w.shape()[2], E = w.shape()[0];
  const uint64_t wbytes = detail::nbytes(detail::sat_mul(E, detail::sat_mul(in, outf)), x.dtype());
  c.e.count(FlopKind::kMatmul, detail::product_flops(1, S, outf, in),
            detail::sat_add(
                detail::nbytes(detail::sat_add(detail::sat_mul(S, in), detail::sat_mul(S, outf)), x.dtype()), wbytes),
            x.dtype());
  const bool gx = x->requires_grad, gw = w->requires_grad;
  Saved saved;
  if (gw) saved.push_back(x);
  if (gx) saved.push_back(w);
  saved.push_back(offs);
  const Shape xs = x.shape(), ws = w.shape();
  const Strides wst = w->strides;
  // mat2's gradient first (as mm's: product_2d), then self's. FunctionsManual.cpp @002ca67
  // _grouped_mm_mat2_backward: for a column-major mat2 (a parameter's transpose(-2, -1)), "return grad as
  // column-order for efficiency": at::_grouped_mm(grad.transpose(-2, -1), mat1, offs).transpose(-2, -1), mat2's
  // layout, so the parameter's TransposeBackward0 hands AccumulateGrad a contiguous tensor it can keep;
  // _grouped_mm_mat1_backward for a row-major mat1: at::_grouped_mm(grad, mat2.transpose(-2, -1), offs).
  c.e.record("GroupedMmBackward0", {&x, &w}, {&out}, std::move(saved),
             [gx, gw, xs, ws, wst, S, in, outf, wbytes](Engine& e, Node&, Grads& g) {
               Grads r(2);
               if (!g[0]) return r;
               const DType gd = g[0].dtype();
               const uint64_t fl = detail::product_flops(1, S, outf, in);
               const uint64_t by = detail::sat_add(
                   detail::nbytes(detail::sat_add(detail::sat_mul(S, in), detail::sat_mul(S, outf)), gd), wbytes);
               if (gw) {
                 r[1] = e.empty_strided(ws, wst, g[0].dtype(), Category::kBackward, g[0]->label);
                 // FLOPs: per expert grad^T @ x over its rows: 2·S·in·out in all
                 e.count(FlopKind::kMatmul, fl, by, gd);
               }
               if (gx) {
                 r[0] = grad_empty(e, xs, g[0].dtype(), g[0]->label);
                 // FLOPs: per row grad @ W_e^T: 2·S·in·out in all
                 e.count(FlopKind::kMatmul, fl, by, gd);
               }
               return r;
             });
  return out;
}

void add_(Ctx& c, T& self, const T& other) {
  T out = c.e.view(self, self.shape(), self->strides);  // in place: the same storage
  // "self: handle_r_to_c(self.scalar_type(), grad)", "other: handle_r_to_c(other.scalar_type(), maybe_multiply(grad,
  // alpha.conj()))": both the incoming gradient (validate_outputs casts other's to its dtype)
  c.e.record("AddBackward0", {&self, &other}, {&out}, {}, [](Engine&, Node&, Grads& g) {
    if (!g[0]) return Grads{T(), T()};
    return Grads{g[0], g[0]};
  });
  self = std::move(out);
}

void div_(Ctx& c, T& self, const T& other, const char* what) {
  const bool go = other->requires_grad && c.e.grad_mode;
  Saved saved{other};
  if (go) {
    // VariableType's div__Tensor: `original_self = self.clone()` before the kernel when other's gradient is
    // needed (div_tensor_other_backward(grad, self, other) reads the input).
    saved.push_back(c.e.empty_strided(self.shape(), dense_strides_like(self.shape(), self->strides), self.dtype(),
                                      Category::kActivations, c.L(what)));
  }
  T out = c.e.view(self, self.shape(), self->strides);  // in place: the same storage
  c.e.record("DivBackward0", {&self, &other}, {&out}, std::move(saved), [go](Engine& e, Node&, Grads& g) {
    Grads r(2);
    if (!g[0]) return r;
    // the generated node's order, the sorted input names (load_derivatives.py): other's gradient, then self's
    if (go) {
      // div_tensor_other_backward: -grad * ((self / other) / other): two temporaries, then the result (reduced
      // to other's shape by validate_outputs)
      T t1 = grad_like(e, g[0], g[0].dtype());
      T t2 = grad_like(e, g[0], g[0].dtype());
      r[1] = grad_like(e, g[0], g[0].dtype());
    }
    r[0] = grad_like(e, g[0], g[0].dtype());  // div_tensor_self_backward: grad / other
    return r;
  });
  self = std::move(out);
}

T index_list1(Ctx& c, const T& x, int dim, const char* what) {
  if (dim < 0) dim += x.shape().n;
  // the list [i] as a (1,) int64 tensor on x's device; the IndexBackward0 node keeps it
  T index = c.e.empty(Shape{1}, DType::kI64, Category::kActivations, c.L("index list"));
  Shape s = x.shape();
  s.d[dim] = 1;
  T out = c.e.empty(s, x.dtype(), Category::kActivations, c.L(what));
  const Shape xs = x.shape();
  // "self: index_backward(grad.new_zeros_symint(self.sym_sizes(), grad.options()), indices, grad)"
  c.e.record("IndexBackward0", {&x}, {&out}, {index}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

void scale_(Ctx& c, T& self, const char* node) {
  T out = c.e.view(self, self.shape(), self->strides);  // in place: the same storage
  // "self: grad * other" / "self: grad / other" with a Scalar other: a new tensor; nothing saved
  c.e.record(node, {&self}, {&out}, {}, [](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_like(e, g[0], g[0].dtype()) : T()};
  });
  self = std::move(out);
}

}  // namespace trainmem::sim
