// Views and copies. A view shares its base's storage; its backward is a view of the gradient unless the
// gradient's strides make that impossible, in which case reshape copies (ViewBackward0 calls
// grad.reshape(self.sizes())). Which ops copy is decided from real strides (engine.cc view_strides).
#include "ops_util.h"
#include "trainmem/error.h"

namespace trainmem::sim {

using detail::grad_like;

namespace {

// The gradient `g` reshaped to `s`: a view when the strides allow, otherwise a contiguous copy.
T grad_reshape(Engine& e, const T& g, const Shape& s) {
  if (auto st = view_strides(g.shape(), g->strides, s)) return e.view(g, s, *st);
  return detail::grad_empty(e, s, g.dtype(), g->label);
}

}  // namespace

T view(Ctx& c, const T& x, const Shape& s) {
  auto st = view_strides(x.shape(), x->strides, s);
  if (!st) throw Error("internal: view of a tensor whose strides do not allow it (use reshape)");
  T out = c.e.view(x, s, *st);
  const Shape in = x.shape();
  c.e.record("ViewBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_reshape(e, g[0], in) : T()};
  });
  return out;
}

T reshape(Ctx& c, const T& x, const Shape& s) {
  if (view_strides(x.shape(), x->strides, s)) return view(c, x, s);
  // _unsafe_view(clone(contiguous), shape): the copy is a new tensor; CloneBackward0 passes the gradient
  // through, UnsafeViewBackward0 reshapes it.
  T out = c.e.empty(s, x.dtype(), Category::kActivations, c.L("reshape copy"));
  const Shape in = x.shape();
  c.e.record("UnsafeViewBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? grad_reshape(e, g[0], in) : T()};
  });
  return out;
}

T transpose(Ctx& c, const T& x, int i, int j) {
  const int n = x.shape().n;
  if (i < 0) i += n;
  if (j < 0) j += n;
  Shape s = x.shape();
  Strides st = x->strides;
  std::swap(s.d[i], s.d[j]);
  std::swap(st[i], st[j]);
  T out = c.e.view(x, s, st);
  c.e.record("TransposeBackward0", {&x}, {&out}, {}, [i, j](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    Shape gs = g[0].shape();
    Strides gst = g[0]->strides;
    std::swap(gs.d[i], gs.d[j]);
    std::swap(gst[i], gst[j]);
    return Grads{e.view(g[0], gs, gst)};
  });
  return out;
}

T unsqueeze(Ctx& c, const T& x, int dim) {
  Shape s;
  Strides st{};
  const Shape& xs = x.shape();
  if (dim < 0) dim += xs.n + 1;
  for (int i = 0, k = 0; i <= xs.n; ++i) {
    if (i == dim) {
      s.d[s.n] = 1;
      st[s.n] = k < xs.n ? x->strides[k] * static_cast<int64_t>(xs.d[k]) : 1;
      ++s.n;
    }
    if (i < xs.n) {
      s.d[s.n] = xs.d[i];
      st[s.n] = x->strides[i];
      ++s.n;
      ++k;
    }
  }
  T out = c.e.view(x, s, st);
  const Shape in = xs;
  c.e.record("UnsqueezeBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? e.view(g[0], in, *view_strides(g[0].shape(), g[0]->strides, in)) : T()};
  });
  return out;
}

T expand(Ctx& c, const T& x, const Shape& s) {
  Strides st{};
  for (int i = 0; i < s.n; ++i) st[i] = (x.shape().d[i] == s.d[i]) ? x->strides[i] : 0;
  T out = c.e.view(x, s, st);
  const Shape in = x.shape();
  // ExpandBackward0: at::sum_to(grad, self.sizes()): a new, reduced tensor.
  c.e.record("ExpandBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    if (!g[0]) return Grads{T()};
    T r = detail::grad_empty(e, in, g[0].dtype(), g[0]->label);
    e.reduce_kernel_scratch(g[0], sum_to_dims(g[0].shape(), in));
    return Grads{r};
  });
  return out;
}

T contiguous(Ctx& c, const T& x, const char* what) {
  if (is_contiguous(x.shape(), x->strides)) return x;
  T out = c.e.empty(x.shape(), x.dtype(), Category::kActivations, c.L(what));
  c.e.record("CloneBackward0", {&x}, {&out}, {}, [](Engine&, Node&, Grads& g) {
    return Grads{g[0]};  // passthrough
  });
  return out;
}

std::vector<T> split_last(Ctx& c, const T& x, std::vector<uint64_t> sizes) {
  std::vector<T> outs;
  for (uint64_t sz : sizes) outs.push_back(c.e.view(x, detail::with_last(x.shape(), sz), x->strides));
  const Shape in = x.shape();
  const DType dt = x.dtype();
  std::array<uint64_t, kMaxEdges> sz{};
  for (size_t i = 0; i < sizes.size(); ++i) sz[i] = sizes[i];
  // SplitBackward0: split_backward cats the gradients (zeros for the missing ones) into a new tensor.
  auto fn = [in, dt, sz](Engine& e, Node&, Grads& g) {
    Grads zeros;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!g[i]) zeros.push_back(detail::grad_empty(e, detail::with_last(in, sz[i]), dt, Label{"zeros"}));
    }
    bool any = false;
    for (const T& t : g) any = any || static_cast<bool>(t);
    if (!any) return Grads{T()};
    return Grads{detail::grad_empty(e, in, dt, Label{"split grad"})};
  };
  switch (outs.size()) {
    case 2: c.e.record("SplitBackward0", {&x}, {&outs[0], &outs[1]}, {}, fn); break;
    case 3: c.e.record("SplitBackward0", {&x}, {&outs[0], &outs[1], &outs[2]}, {}, fn); break;
    default: throw Error("internal: split into an unsupported number of parts");
  }
  return outs;
}

T slice_last(Ctx& c, const T& x, uint64_t begin, uint64_t end) {
  T out = c.e.view(x, detail::with_last(x.shape(), end - begin), x->strides);
  const Shape in = x.shape();
  // SliceBackward0: slice_backward allocates zeros of the input's size and copies the gradient in.
  c.e.record("SliceBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? detail::grad_empty(e, in, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

namespace {
Shape with_dim1(const Shape& s, uint64_t n) {
  Shape out = s;
  out.d[1] = n;
  return out;
}
}  // namespace

T slice_dim1(Ctx& c, const T& x, uint64_t begin, uint64_t end) {
  T out = c.e.view(x, with_dim1(x.shape(), end - begin), x->strides);
  (void)begin;  // a view at an offset: the storage is the same
  const Shape in = x.shape();
  // SliceBackward0: slice_backward allocates zeros of the input's size and copies the gradient in.
  c.e.record("SliceBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? detail::grad_empty(e, in, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

std::vector<T> chunk_dim1(Ctx& c, const T& x, uint64_t n) {
  // torch.chunk -> split(ceil(size / n), dim): n views, one SplitBackward0 node with an output per chunk.
  const uint64_t part = x.shape()[1] / n;
  std::vector<T> outs;
  for (uint64_t i = 0; i < n; ++i) outs.push_back(c.e.view(x, with_dim1(x.shape(), part), x->strides));
  std::vector<T*> ptrs;
  for (T& o : outs) ptrs.push_back(&o);
  const Shape in = x.shape();
  const DType dt = x.dtype();
  // split_backward: the chunks' gradients (zeros for the missing ones) are cat into a new tensor of the input's
  // size; the engine runs the node once every chunk's gradient has arrived.
  c.e.record_n("SplitBackward0", {&x}, ptrs, {}, [in, dt, part](Engine& e, Node&, Grads& g) {
    Grads zeros;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!g[i]) zeros.push_back(detail::grad_empty(e, with_dim1(in, part), dt, Label{"zeros"}));
    }
    bool any = false;
    for (const T& t : g) any = any || static_cast<bool>(t);
    if (!any) return Grads{T()};
    return Grads{detail::grad_empty(e, in, dt, Label{"split grad"})};
  });
  return outs;
}

T cat_last(Ctx& c, std::vector<T> xs, const char* what) {
  Shape s = xs[0].shape();
  uint64_t last = 0;
  for (const T& x : xs) last += x.shape().back();
  s.d[s.n - 1] = last;
  DType dt = xs[0].dtype();
  for (const T& x : xs) dt = detail::promote(xs[0], x);
  T out = c.e.empty(s, dt, Category::kActivations, c.L(what));
  std::array<uint64_t, kMaxEdges> sizes{};
  for (size_t i = 0; i < xs.size(); ++i) sizes[i] = xs[i].shape().back();
  const size_t n = xs.size();
  // CatBackward0 saves nothing; each input's gradient is a narrow view of the incoming one.
  auto fn = [sizes, n](Engine& e, Node&, Grads& g) {
    Grads r(n);
    if (!g[0]) return r;
    for (size_t i = 0; i < n; ++i) r[i] = e.view(g[0], detail::with_last(g[0].shape(), sizes[i]), g[0]->strides);
    return r;
  };
  if (xs.size() == 2) {
    c.e.record("CatBackward0", {&xs[0], &xs[1]}, {&out}, {}, fn);
  } else {
    throw Error("internal: cat of an unsupported number of tensors");
  }
  return out;
}

T slice_dim(Ctx& c, const T& x, int dim, uint64_t begin, uint64_t end) {
  if (dim < 0) dim += x.shape().n;
  Shape s = x.shape();
  s.d[dim] = end - begin;
  T out = c.e.view(x, s, x->strides);
  const Shape in = x.shape();
  // SliceBackward0: slice_backward allocates zeros of the input's size and copies the gradient in.
  c.e.record("SliceBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? detail::grad_empty(e, in, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

T select_dim(Ctx& c, const T& x, int dim) {
  const Shape& xs = x.shape();
  if (dim < 0) dim += xs.n;
  Shape s;
  Strides st{};
  for (int i = 0; i < xs.n; ++i) {
    if (i == dim) continue;
    s.d[s.n] = xs.d[i];
    st[s.n] = x->strides[i];
    ++s.n;
  }
  T out = c.e.view(x, s, st);
  // SelectBackward0: select_backward allocates zeros of the input's size and copies the gradient in.
  c.e.record("SelectBackward0", {&x}, {&out}, {}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? detail::grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

}  // namespace trainmem::sim
