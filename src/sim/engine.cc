#include "engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "trainmem/error.h"

namespace trainmem::sim {

Shape::Shape(std::initializer_list<uint64_t> dims) {
  for (uint64_t x : dims) d[n++] = x;
}

Shape Shape::of(const std::vector<uint64_t>& dims) {
  Shape s;
  for (uint64_t d : dims) s.d[s.n++] = d;
  return s;
}

Strides contiguous_strides(const Shape& s) {
  // PyTorch's strides are int64_t: a tensor of 2^63 elements or more has none (checked before it can wrap).
  Strides st{};
  int64_t acc = 1;
  for (int i = s.n - 1; i >= 0; --i) {
    st[i] = acc;
    const uint64_t d = std::max<uint64_t>(s.d[i], 1);
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(acc, static_cast<int64_t>(d), &acc)) {
      throw Error("a tensor of 2^63 elements or more: its strides do not fit PyTorch's int64_t (the sizes are far "
                  "beyond any device)");
    }
  }
  return st;
}

bool is_contiguous(const Shape& s, const Strides& st) {
  int64_t expected = 1;
  for (int i = s.n - 1; i >= 0; --i) {
    if (s.d[i] == 1) continue;  // size-1 dims may have any stride
    if (st[i] != expected) return false;
    expected *= static_cast<int64_t>(s.d[i]);
  }
  return true;
}

namespace {

// The dims of `s` ordered from the largest stride to the smallest (ties: the later dim is inner).
std::array<int, 5> stride_order(const Shape& s, const Strides& st) {
  std::array<int, 5> order{0, 1, 2, 3, 4};
  // insertion sort (stable) on at most 5 dims
  for (int i = 1; i < s.n; ++i) {
    const int x = order[i];
    int j = i - 1;
    while (j >= 0 && st[order[j]] < st[x]) {
      order[j + 1] = order[j];
      --j;
    }
    order[j + 1] = x;
  }
  return order;
}

}  // namespace

bool is_dense(const Shape& s, const Strides& st) {
  const auto order = stride_order(s, st);
  int64_t expected = 1;
  for (int k = s.n - 1; k >= 0; --k) {
    const int i = order[k];
    if (s.d[i] == 1) continue;
    if (st[i] != expected) return false;
    expected *= static_cast<int64_t>(s.d[i]);
  }
  return true;
}

Strides dense_strides_like(const Shape& s, const Strides& st) {
  if (is_dense(s, st)) return st;
  const auto order = stride_order(s, st);
  Strides out{};
  int64_t acc = 1;
  for (int k = s.n - 1; k >= 0; --k) {
    out[order[k]] = acc;
    acc *= static_cast<int64_t>(std::max<uint64_t>(s.d[order[k]], 1));
  }
  return out;
}

// ATen's computeStride (TensorUtils.cpp): walks the old dims in chunks that are contiguous with each other
// and matches them against the new dims.
std::optional<Strides> view_strides(const Shape& from, const Strides& st, const Shape& to) {
  Strides out{};
  if (from.numel().value == 0) return contiguous_strides(to);
  int64_t view_d = static_cast<int64_t>(to.n) - 1;
  int64_t chunk_base_stride = st[from.n - 1];
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(from.n) - 1; tensor_d >= 0; tensor_d--) {
    tensor_numel *= static_cast<int64_t>(from.d[tensor_d]);
    if (tensor_d == 0 || (from.d[tensor_d - 1] != 1 &&
                          st[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || to.d[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= static_cast<int64_t>(to.d[view_d]);
        view_d--;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = st[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

// ---- T: a counted reference --------------------------------------------------------------------------

void T::release_impl(TensorImpl* p) {
  Engine* e = p->eng;
  e->release(p->storage);
  e->delete_impl(p);
}

// ---- storages ----------------------------------------------------------------------------------------

Engine::~Engine() {
  // Drop every reference before the storages go: nodes (saved tensors), grads, parameters.
  // A simulation abandoned mid-step (memo.h rule 4's MemoMismatch) leaves live nodes whose checkpoint frames hold
  // tensors: they go here too, or the pool's cached chunk would drop them into a later engine (Pool: objects keep
  // stale fields).
  packing_.reset();
  filling_ = nullptr;
  for (const LiveNode& l : nodes_) {
    l.node->saved.clear();
    l.node->inbuf.clear();
    l.node->fn.reset();
    l.node->frame.reset();
  }
  for (Node* n : acc_nodes_) {
    if (n) n->inbuf.clear();
  }
  grads_.clear();
  for (T& w : cublas_ws_) w.reset();
  for (T& w : cublaslt_ws_) w.reset();
  params_.clear();
}

TensorImpl* Engine::new_impl() {
  TensorImpl* p = impls_.get();
  *p = TensorImpl{};
  p->eng = this;
  return p;
}

void Engine::delete_impl(TensorImpl* p) { impls_.put(p); }

uint64_t Engine::alloc_storage(Bytes b, Category c, Label l) {
  if (recomputing_depth_ > 0 && l.row < 0) {
    l.what = prefixed("recompute: ", l.what);  // checkpointing's forward, run again in backward
  } else if (running_ && l.row == kRowNamedInBackward) {
    l = Label{l.what, running_->label.layer, -1};  // a backward allocation with a name of its own
  } else if (running_ && (c == Category::kBackward || c == Category::kTemporaries)) {
    l = Label{running_->label.what, running_->label.layer, kRowBackwardOf};
  }
  const uint64_t id = storages_.size();
  // the table's memory ahead, as the timeline's (emit); only inside the capacity (a pointer past it, or an offset
  // from an empty vector's null data(), is undefined behaviour)
  if (id + 8 < storages_.capacity()) __builtin_prefetch(storages_.data() + id + 8, 1);
  storages_.push_back(StorageInfo{b, l, 0, c, false, stream});
  emit_alloc(id);
  return id;
}

void Engine::check_event_room() const {
  if (tl_->events.size() >= kMaxEvents) {
    throw Error(fmt::format("the simulation passes {} events (the bound on one simulated run): fewer layers, "
                            "steps or micro-batches", with_commas(kMaxEvents)));
  }
}

// The allocation event of storage `id` (new, or resized back), and the peak it may raise.
void Engine::emit_alloc(uint64_t id) {
  const StorageInfo& s = storages_[id];
  check_event_room();
  uint64_t total = 0;
  if (__builtin_add_overflow(live_.total.value, s.bytes.value, &total)) {
    throw Error(fmt::format("the step's live tensors pass 2^64 bytes when {}{} ({} B, {}) is allocated in {}: the "
                            "sizes are far beyond any device", s.label.what,
                            s.label.layer >= 0 ? fmt::format(" of layer {}", s.label.layer) : "",
                            with_commas(s.bytes.value), category_name(s.category), moment_name(phase, step)));
  }
  emit(Event::kAlloc, s.category, s.category, id, s.bytes, s.label, s.stream);
  if (live_.total > peak_live_.total) {
    peak_live_ = live_;
    peak_event_ = tl_->events.size() - 1;
  }
}

void Engine::resize_storage(uint64_t id, bool allocated) {
  StorageInfo& s = storages_[id];
  if (s.resized_out != allocated) return;  // already so
  if (allocated) {
    s.resized_out = false;
    s.stream = stream;  // resize_ allocates on the stream current then
    emit_alloc(id);
  } else {
    free_storage(id);
    s.resized_out = true;
  }
}

void Engine::free_storage(uint64_t id) noexcept {
  if (!recording_) return;
  const StorageInfo& s = storages_[id];
  if (s.resized_out) return;  // its bytes went with resize_(0)
  try {
    emit(Event::kFree, s.category, s.category, id, s.bytes, s.label, s.stream);
  } catch (...) {  // std::bad_alloc growing the timeline: a release path never throws
    recording_ = false;
    lost_events_ = true;
  }
}

const char* Engine::prefixed(const char* prefix, const char* what) {
  const char*& name = prefixed_[PrefixedKey{prefix, what}];
  if (!name) name = intern_name(std::string(prefix) + what);
  return name;
}

void Engine::emit(Event::Kind kind, Category c, Category from, uint64_t id, Bytes b, Label l, Stream s) {
  // The timeline's memory a few events ahead is asked for now: it is written once, long after it was last used.
  // (only inside the capacity: an offset from an empty vector's null data() is undefined behaviour)
  if (tl_->events.size() + 8 < tl_->events.capacity()) __builtin_prefetch(tl_->events.data() + tl_->events.size() + 8, 1);
  tl_->events.push_back(Event{kind, c, from, phase, step, micro, static_cast<uint32_t>(id), b, l, s});
  apply(live_, tl_->events.back());
}

void Engine::empty_cache() {
  emit(Event::kEmptyCache, Category::kTemporaries, Category::kTemporaries, 0, Bytes{}, Label{"torch.cuda.empty_cache()"},
       Stream::kDefault);
}

void Engine::retain(uint64_t id) { ++storages_[id].refs; }

void Engine::release(uint64_t id) {
  if (--storages_[id].refs == 0) free_storage(id);
}

void Engine::recategorize(uint64_t id, Category c) {
  StorageInfo& s = storages_[id];
  if (s.category == c) return;
  emit(Event::kRecategorize, c, s.category, id, s.bytes, s.label, s.stream);
  s.category = c;
}

// ---- tensors -----------------------------------------------------------------------------------------

T Engine::empty(const Shape& s, DType dt, Category c, Label l) {
  return empty_strided(s, contiguous_strides(s), dt, c, l);
}

T Engine::empty_strided(const Shape& s, const Strides& st, DType dt, Category c, Label l) {
  // Overflow names the tensor rather than the arithmetic (Shape::numel and bytes_of would say "a tensor").
  uint64_t elems = 1, bytes = 0;
  bool over = false;
  for (uint8_t i = 0; i < s.n; ++i) over = over || __builtin_mul_overflow(elems, s.d[i], &elems);
  over = over || __builtin_mul_overflow(elems, itemsize(dt), &bytes);
  if (over) {
    std::string shape;
    for (uint8_t i = 0; i < s.n; ++i) shape += (i ? ", " : "") + with_commas(s.d[i]);
    throw Error(fmt::format("the bytes of {}{} (shape ({}), {}) pass 2^64 in {}: the sizes are far beyond any "
                            "device", l.what, l.layer >= 0 ? fmt::format(" of layer {}", l.layer) : "", shape,
                            dtype_name(dt), moment_name(phase, step)));
  }
  TensorImpl* p = new_impl();
  p->shape = s;
  p->dtype = dt;
  p->strides = st;
  p->label = l;
  p->storage = alloc_storage(bytes_of(s.numel(), dt), c, l);
  retain(p->storage);
  return T(p);
}

T Engine::view(const T& base, const Shape& s, const Strides& st) {
  TensorImpl* p = new_impl();
  p->shape = s;
  p->dtype = base->dtype;
  p->strides = st;
  p->label = base->label;
  p->storage = base->storage;
  p->requires_grad = base->requires_grad;
  p->grad_fn = base->grad_fn;
  p->is_view = true;
  retain(p->storage);
  return T(p);
}

T Engine::adopt(uint64_t id, const TensorImpl& like) {
  TensorImpl* p = new_impl();
  p->shape = like.shape;
  p->dtype = like.dtype;
  p->strides = like.strides;
  p->label = like.label;
  p->storage = id;
  retain(id);
  return T(p);
}

T Engine::parameter(const Shape& s, DType dt, int32_t index, Label l, bool requires_grad) {
  return make_parameter(empty(s, dt, Category::kWeights, l), index, requires_grad);
}

T Engine::parameter_unallocated(const Shape& s, DType dt, int32_t index, Bytes storage, Category c, Label l,
                                 bool requires_grad) {
  return make_parameter(empty_unallocated(s, dt, storage, c, l), index, requires_grad);
}

T Engine::empty_unallocated(const Shape& s, DType dt, Bytes storage, Category c, Label l) {
  TensorImpl* p = new_impl();
  p->shape = s;
  p->dtype = dt;
  p->strides = contiguous_strides(s);
  p->label = l;
  p->storage = storages_.size();
  storages_.push_back(StorageInfo{storage, l, 0, c, true, stream});
  retain(p->storage);
  return T(p);
}

T Engine::parameter_view(const T& base, const Shape& s, int32_t index, Label l) {
  TensorImpl* p = new_impl();
  p->shape = s;
  p->dtype = base->dtype;
  p->strides = contiguous_strides(s);
  p->label = l;
  p->storage = base->storage;
  retain(p->storage);
  return make_parameter(T(p), index, true);
}

T Engine::make_parameter(T t, int32_t index, bool requires_grad) {
  t->is_param = true;
  t->param_index = index;
  if (static_cast<size_t>(index) >= params_.size()) {
    params_.resize(index + 1);
    grads_.resize(index + 1);
    acc_nodes_.resize(index + 1);
  }
  params_[index] = t;
  if (!requires_grad) return t;
  t->requires_grad = true;
  Node* acc = new_accumulate_node();
  acc->param = index;
  t->grad_fn = {acc, 0};
  acc_nodes_[index] = acc;
  return t;
}

Node* Engine::new_accumulate_node() {
  Node* acc = node_pool_.get();  // fresh or recycled (recycled nodes have no saved tensors or closure)
  acc->name = "AccumulateGrad";
  acc->n_next = 0;
  acc->deps = 0;
  acc->seq = std::numeric_limits<uint64_t>::max();  // "always called ASAP during backwards"
  acc->is_accumulate = true;
  acc->param = -1;
  acc->leaf = -1;
  acc->inbuf = Grads(1);
  return acc;
}

T Engine::requires_grad_leaf(const T& x, bool held_by_graph, T* grad_sink) {
  T t = view(x, x.shape(), x->strides);  // detach(): the same storage, no autograd history
  t->requires_grad = true;
  Node* acc = new_accumulate_node();
  acc->leaf = static_cast<int32_t>(leaf_grads_.size());
  leaf_grads_.emplace_back();
  leaf_sinks_.push_back(grad_sink);
  t->grad_fn = {acc, 0};
  // AccumulateGrad keeps its `variable` (a strong reference, never released by release_variables): the leaf's
  // storage lives until the graph is freed, even when nothing else holds it (found by the CPU oracle's live
  // timeline). Not a saved tensor: saved_bytes() skips AccumulateGrad nodes.
  if (held_by_graph) acc->saved.push_back(t);
  acc->graph = graph;
  nodes_.push_back({acc, graph});  // freed with the graph that reaches it
  return t;
}

// A leaf's .grad, taken from the list AccumulateGrad filled. When the backward that filled it freed the last live
// graph, the list is already cleared (recycle_nodes / the per-graph free) and the gradient freed with it: nothing
// to take (a leaf whose .grad must outlive its graph has a sink instead: requires_grad_leaf).
T Engine::take_leaf_grad(const T& leaf) {
  const Node* n = leaf->grad_fn.node;
  if (!n || n->leaf < 0 || static_cast<size_t>(n->leaf) >= leaf_grads_.size()) return T();
  return std::move(leaf_grads_[static_cast<size_t>(n->leaf)]);
}

T Engine::leaf(const Shape& s, DType dt, Category c, Label l) { return empty(s, dt, c, l); }

T& Engine::grad(int32_t index) { return grads_[index]; }

namespace {
// The storages node `n` keeps for backward, as saved_bytes() counts them: into `kept`, a non-reentrant checkpoint's
// inputs (save_inputs) and the op outputs selective checkpointing keeps for the recompute; into `saved`, its saved
// tensors (which saved_bytes() filters by category; a leaf's AccumulateGrad holds its variable, not saved).
void kept_storages(const Node* n, std::vector<uint64_t>& kept, std::vector<uint64_t>& saved) {
  if (n->frame) {
    for (const T& t : n->frame->inputs) {
      if (t) kept.push_back(t->storage);
    }
    for (const auto& by_op : n->frame->sac_storage) {
      for (const auto& outs : by_op) {
        for (const T& t : outs) {
          if (t) kept.push_back(t->storage);
        }
      }
    }
  }
  if (n->is_accumulate) return;
  for (const T& t : n->saved) {
    if (t) saved.push_back(t->storage);
  }
}
}  // namespace

Bytes Engine::saved_bytes() const {
  std::vector<uint64_t> ids, saved;
  auto add_saved = [&] {
    for (uint64_t id : saved) {
      const Category c = storages_[id].category;
      // parameters are not activations: the module's own, and FSDP's unsharded ones (all-gathered, category
      // kFsdpBuffers, counted with FSDP's buffers) that the linears save
      if (c == Category::kWeights || c == Category::kBuffers || c == Category::kFsdpBuffers) continue;
      ids.push_back(id);
    }
    saved.clear();
  };
  for (const LiveNode& l : nodes_) {
    kept_storages(l.node, ids, saved);
    add_saved();
  }
  // graphs a memoized forward stands for (memo.h): the storages their nodes would keep, by the same rules
  for (const PhantomGraph& g : phantoms) {
    ids.insert(ids.end(), g.kept.begin(), g.kept.end());
    saved = g.saved;
    add_saved();
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  Bytes b;
  for (uint64_t id : ids) {
    // a storage resized to 0 holds no bytes while it is so: FSDP's unsharded parameters after reshard (free_storage
    // resizes the all-gather output's storage to 0, FSDPParam.to_sharded) stay saved by the linears that used them,
    // and come back at the pre-backward all-gather (Engine::resize_storage)
    if (storages_[id].resized_out) continue;
    b += storages_[id].bytes;
  }
  return b;
}

void Engine::kept_ids(uint32_t g, std::vector<uint64_t>& kept, std::vector<uint64_t>& saved) const {
  for (const LiveNode& l : nodes_) {
    if (l.graph == g) kept_storages(l.node, kept, saved);
  }
  for (std::vector<uint64_t>* v : {&kept, &saved}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
}

bool Engine::replay_event(const Event& ev) {
  check_event_room();
  if (ev.kind == Event::kAlloc) {
    uint64_t total = 0;
    if (__builtin_add_overflow(live_.total.value, ev.bytes.value, &total)) return false;
  }
  if (tl_->events.size() + 8 < tl_->events.capacity()) __builtin_prefetch(tl_->events.data() + tl_->events.size() + 8, 1);
  tl_->events.push_back(ev);
  apply(live_, tl_->events.back());
  if (ev.kind == Event::kAlloc && live_.total > peak_live_.total) {  // emit_alloc's peak
    peak_live_ = live_;
    peak_event_ = tl_->events.size() - 1;
  }
  return true;
}

void Engine::persistent_ids(std::vector<uint64_t>& out) const {
  auto id = [](const T& t) { return t ? t->storage : UINT64_MAX; };
  for (const T& t : cublas_ws_) out.push_back(id(t));
  for (const T& t : cublaslt_ws_) out.push_back(id(t));
  for (const T& t : grads_) out.push_back(id(t));
  // a leaf's .grad that exists (the list's length only numbers leaves: no output depends on it)
  for (size_t i = 0; i < leaf_grads_.size(); ++i) {
    if (leaf_grads_[i]) {
      out.push_back(i);
      out.push_back(leaf_grads_[i]->storage);
    }
  }
}

void Engine::gemm(bool lt) {
  const size_t thread = phase == Phase::kBackward ? 1 : 0;
  if (rt_.cublas_workspace.value > 0 && !cublas_ws_[thread]) {
    // CublasHandlePool.cpp getNewWorkspace(): CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())
    cublas_ws_[thread] = empty(Shape{rt_.cublas_workspace.value}, DType::kU8, Category::kWorkspace,
                               Label{thread ? "cuBLAS workspace (autograd thread)" : "cuBLAS workspace"});
  }
  if (!lt) return;
  if (rt_.lt_mode == LtWorkspace::kPerCall) {
    T w = empty(Shape{rt_.cublaslt_workspace.value}, DType::kU8, Category::kTemporaries,
                Label{"cuBLASLt workspace"});  // freed when the gemm returns
  } else if (rt_.lt_mode == LtWorkspace::kPersistent && !cublaslt_ws_[thread]) {
    cublaslt_ws_[thread] = empty(Shape{rt_.cublaslt_workspace.value}, DType::kU8, Category::kWorkspace,
                                 Label{thread ? "cuBLASLt workspace (autograd thread)" : "cuBLASLt workspace"});
  }
}

std::optional<WorkPhase> Engine::work_phase() const {
  if (!recording_ || (count_step >= 0 && step != static_cast<uint64_t>(count_step))) return std::nullopt;
  return unfiltered_work_phase();
}

std::optional<WorkPhase> Engine::unfiltered_work_phase() const {
  if (recomputing_depth_ > 0) return WorkPhase::kRecompute;
  switch (phase) {
    case Phase::kForward:
    case Phase::kLoss: return WorkPhase::kForward;
    case Phase::kBackward: return WorkPhase::kBackward;
    case Phase::kGradClip:
    case Phase::kOptimizer: return WorkPhase::kOptimizer;
    default: return std::nullopt;  // the model load and zero_grad are not the step's work
  }
}

// One collective of `bytes` in phase `pi`, counted `weight` times into `n` (how many) and `b` (bytes); a sum past
// 2^64 - 1 saturates and marks the ledger.
static void count_collective(FlopLedger& l, std::array<uint64_t, kWorkPhases>& n, std::array<uint64_t, kWorkPhases>& b,
                             size_t pi, uint64_t bytes, uint64_t weight) {
  uint64_t w_bytes = 0;
  if (__builtin_add_overflow(n[pi], weight, &n[pi]) || __builtin_mul_overflow(bytes, weight, &w_bytes) ||
      __builtin_add_overflow(b[pi], w_bytes, &b[pi])) {
    b[pi] = UINT64_MAX;
    l.overflow = true;
  }
}

void Engine::count_tp_collective(bool all_gather, uint64_t bytes) {
  if (count_tape && recording_) {
    if (const std::optional<WorkPhase> up = unfiltered_work_phase()) {
      count_tape->push_back(CountCall{CountCall::kTp, all_gather, FlopKind::kElementwise, DType::kF32, *up, 0, bytes, count_weight});
    }
  }
  const std::optional<WorkPhase> wp = work_phase();
  if (!wp) return;
  count_collective_in(*wp, true, all_gather, bytes, count_weight);
}

void Engine::count_dp_collective(bool all_gather, uint64_t bytes) {
  if (count_tape && recording_) {
    if (const std::optional<WorkPhase> up = unfiltered_work_phase()) {
      count_tape->push_back(CountCall{CountCall::kDp, all_gather, FlopKind::kElementwise, DType::kF32, *up, 0, bytes, count_weight});
    }
  }
  const std::optional<WorkPhase> wp = work_phase();
  if (!wp) return;
  count_collective_in(*wp, false, all_gather, bytes, count_weight);
}

void Engine::count_collective_in(WorkPhase p, bool tp, bool all_gather, uint64_t bytes, uint64_t weight) {
  const auto pi = static_cast<size_t>(p);
  if (tp) {
    count_collective(flops_, all_gather ? flops_.tp_all_gathers : flops_.tp_all_reduces,
                     all_gather ? flops_.tp_all_gather_bytes : flops_.tp_all_reduce_bytes, pi, bytes, weight);
    return;
  }
  // count_weight times, as count_tp_collective (a persistent parameter's gather, made by the first micro-batch
  // only, is counted for each micro-batch it stands for: elements under stage3_param_persistence_threshold)
  count_collective(flops_, all_gather ? flops_.dp_all_gathers : flops_.dp_reduce_scatters,
                   all_gather ? flops_.dp_all_gather_bytes : flops_.dp_reduce_scatter_bytes, pi, bytes, weight);
  if (all_gather) flops_.dp_largest_gather_bytes[pi] = std::max(flops_.dp_largest_gather_bytes[pi], bytes);
}

void Engine::replay_count(const CountCall& c) {
  // the count_step filter of the step the call is replayed in (work_phase): the recorded phase is unfiltered
  if (!recording_ || (count_step >= 0 && step != static_cast<uint64_t>(count_step))) return;
  if (c.kind == CountCall::kKernel) {
    count_in(c.p, c.k, c.flops, c.bytes, c.dt, c.weight);
  } else {
    count_collective_in(c.p, c.kind == CountCall::kTp, c.all_gather, c.bytes, c.weight);
  }
}

void Engine::count(FlopKind k, uint64_t flops, uint64_t bytes, DType dt) {
  if (count_tape && recording_) {
    if (const std::optional<WorkPhase> up = unfiltered_work_phase()) {
      count_tape->push_back(CountCall{CountCall::kKernel, false, k, dt, *up, flops, bytes, count_weight});
    }
  }
  const std::optional<WorkPhase> wp = work_phase();
  if (!wp) return;
  count_in(*wp, k, flops, bytes, dt, count_weight);
}

void Engine::count_in(WorkPhase p, FlopKind k, uint64_t flops, uint64_t bytes, DType dt, uint64_t weight) {
  const auto pi = static_cast<size_t>(p), ki = static_cast<size_t>(k);
  // checked: a sum past 2^64 - 1 saturates and marks the ledger (ops_util.h sat_mul/sat_add saturate likewise)
  auto add = [this](uint64_t& into, uint64_t x) {
    if (x == UINT64_MAX || __builtin_add_overflow(into, x, &into)) {
      into = UINT64_MAX;
      flops_.overflow = true;
    }
  };
  // each kernel counted count_weight times (the micro-batches it stands for)
  auto times = [weight](uint64_t x) {
    uint64_t out = 0;
    return x == UINT64_MAX || __builtin_mul_overflow(x, weight, &out) ? UINT64_MAX : out;
  };
  add(flops_.flops[pi][ki], times(flops));
  add(flops_.bytes[pi][ki], times(bytes));
  add(flops_.kernels, weight);
  const FlopKey key{flops, bytes, (static_cast<uint32_t>(k) << 16) | (static_cast<uint32_t>(p) << 8) |
                                      static_cast<uint32_t>(dt)};
  auto [it, fresh] = flop_index_.try_emplace(key, static_cast<uint32_t>(flops_.rows.size()));
  if (fresh) flops_.rows.push_back(KernelRow{k, p, dt, flops, bytes, 0});
  add(flops_.rows[it->second].count, weight);
}

// ---- autograd ----------------------------------------------------------------------------------------

Node* Engine::new_node(const char* name, std::initializer_list<const T*> inputs, std::span<T* const> outputs,
                       Saved saved) {
  if (!grad_mode) return nullptr;
  if (outputs.size() > kMaxEdges) throw Error("internal: an op with more outputs than kMaxEdges");
  if (inputs.size() > kMaxInputs) throw Error("internal: an op with more differentiable inputs than kMaxInputs");
  bool any = false;
  for (const T* in : inputs) any = any || (in && *in && (*in)->requires_grad);
  if (!any) return nullptr;
  Node* node = node_pool_.get();
  node->name = name;
  node->seq = ++seq_;
  node->is_accumulate = false;
  node->param = -1;
  node->leaf = -1;
  node->saved = std::move(saved);
  node->n_next = 0;
  node->deps = 0;
  for (const T* in : inputs) {
    const bool diff = in && *in && (*in)->requires_grad;
    node->next[node->n_next] = diff ? (*in)->grad_fn : GradEdge{};
    node->in_meta[node->n_next] = in && *in ? InputMeta{(*in)->shape, (*in)->dtype} : InputMeta{};
    ++node->n_next;
  }
  // Grads(outputs.size()): a node's inbuf is empty beyond its count (a recycled node's was cleared)
  node->inbuf.clear();
  node->inbuf.n = static_cast<uint8_t>(outputs.size());
  node->label = Label{name, -1, -1};
  for (T* out : outputs) {
    if (out && *out) {
      node->label = (*out)->label;
      break;
    }
  }
  uint32_t slot = 0;
  for (T* out : outputs) {
    if (out && *out) {
      (*out)->requires_grad = true;
      (*out)->grad_fn = {node, slot};
    }
    ++slot;
  }
  node->frame.reset();
  node->holder_slots = 0;
  node->graph = graph;
  nodes_.push_back({node, graph});
  if (filling_) {
    // _recomputation_hook's pack: the recomputed tensor goes to the frame, in the order the forward saved;
    // this node itself is never run.
    for (T& t : node->saved) {
      if (t && filling_->filled < filling_->holders) filling_->recomputed[filling_->filled++] = std::move(t);
    }
    node->saved.clear();
    if (filling_->early_stop && filling_->filled == filling_->holders) throw StopRecomputation{};
  } else if (packing_) {
    // _checkpoint_hook's pack: a holder instead of the tensor, which is released unless something else holds it
    node->holder = packing_->holders;
    for (size_t i = 0; i < node->saved.size(); ++i) {
      if (node->saved[i]) {
        node->holder_slots = static_cast<uint8_t>(node->holder_slots | (1u << i));
        ++packing_->holders;
      }
    }
    if (node->holder_slots) node->frame = packing_;
    node->saved.clear();
  }
  return node;
}

void Engine::unpack(Node& n) {
  CheckpointFrame& f = *n.frame;
  if (!f.recomputed_once) {
    // the first unpack of the region: run its forward again, with grad, filling the holders
    f.recomputed_once = true;
    f.recomputed.assign(f.holders, T());
    CheckpointFrame* const outer = filling_;
    const bool grad = grad_mode;
    Node* const running = running_;
    filling_ = &f;
    grad_mode = true;
    running_ = nullptr;  // the recompute's allocations are forward tensors, not this node's backward
    ++recomputing_depth_;
    try {
      f.recompute(*this);
    } catch (const StopRecomputation&) {
    }
    --recomputing_depth_;
    running_ = running;
    grad_mode = grad;
    filling_ = outer;
  }
  // unpack_hook: the node takes the recomputed tensor; the holder lets go of it ("cleared on unpack")
  uint32_t h = n.holder;
  for (size_t i = 0; i < 8; ++i) {
    if (!(n.holder_slots & (1u << i))) continue;
    while (n.saved.size() <= i) n.saved.push_back(T());
    if (h < f.recomputed.size()) n.saved[i] = std::move(f.recomputed[h]);
    ++h;
    ++f.unpacked;
  }
  if (f.unpacked >= f.holders) {  // the region's backward is done with it: inputs and arguments go
    f.inputs.clear();
    f.recompute = nullptr;
    for (auto& kept : f.sac_storage) kept.clear();  // what an early-stopped recompute did not pop
  }
}

// torchtitan's SelectiveAC policy (torchtitan/distributed/activation_checkpoint.py, SelectiveAC._wrap_block
// wrapped_policy, torchtitan b5bcd76): an op in the save set is MUST_SAVE, everything else PREFER_RECOMPUTE;
// the save set is torch._functorch.partitioners.get_default_op_list().compute_intensive_ops (mm, bmm, addmm,
// the flash and memory-efficient sdpa ops, ...) plus aten.linear, max, topk and others trainmem's programs do
// not run. Of the mm ops (aten.mm, aten.linear) every second one is recomputed: the policy counts them, in
// forward and in recompute separately, and saves the ones whose count is odd. The counter lives in the
// policy's closure, made afresh for each checkpoint call (context_fn), so per layer. aten.addmm is in the
// save set but not an mm op: always saved. force_recompute_mm_shapes_by_fqns defaults to the MoE router
// gate, which the dense models here do not have.
bool Engine::sac_saves(SacOp op) {
  CheckpointFrame* const f = filling_ ? filling_ : packing_.get();
  if (!f || !f->selective) return false;
  if (op != SacOp::kMm) return true;
  uint32_t& count = f->mm_count[filling_ ? 1 : 0];
  ++count;
  return count % 2 == 1;
}

void Engine::sac_push(SacOp op, std::initializer_list<T*> outs) {
  std::vector<T> kept;
  kept.reserve(outs.size());
  for (T* o : outs) {
    if (*o) {
      // named in the timeline (its free, in the layer's backward) as what the selective checkpoint kept
      Label& l = storages_[(*o)->storage].label;
      l.what = prefixed("kept for recompute: ", l.what);
    }
    kept.push_back(*o);  // an output the op did not make keeps its empty slot
  }
  packing_->sac_storage[static_cast<size_t>(op)].push_back(std::move(kept));
}

void Engine::sac_pop(SacOp op, std::initializer_list<T*> outs) {
  auto& q = filling_->sac_storage[static_cast<size_t>(op)];
  if (q.empty()) throw std::logic_error("selective checkpointing: the recompute ran an op the forward did not cache");
  std::vector<T> kept = std::move(q.front());
  q.pop_front();
  size_t i = 0;
  for (T* o : outs) *o = std::move(kept[i++]);
}

namespace {

struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const { return a->seq < b->seq; }
};

// Dense, uniquely referenced: the engine may add into it in place (InputBuffer::accumulate,
// can_accumulate_inplace) or steal it as .grad (AccumulateGrad).
bool uniquely_owned(const Engine& e, const T& t) {
  return t->refs == 1 && e.storage(t->storage).refs == 1 && is_dense(t->shape, t->strides);
}

}  // namespace

// at::sum_to (ExpandUtils.h) reduces `from` to `to`: the dims `to` lacks in front, and each dim where `to` has 1
// and `from` does not. As a mask of `from`'s dims.
uint32_t sum_to_dims(const Shape& from, const Shape& to) {
  const int lead = from.n - to.n;
  uint32_t mask = 0;
  for (int i = 0; i < from.n; ++i) {
    if (i < lead || (to.d[i - lead] == 1 && from.d[i] != 1)) mask |= 1u << i;
  }
  return mask;
}

void Engine::reduce_kernel_scratch(const T& in, uint32_t reduced) {
  ReduceShape r;
  r.ndim = in.shape().n;
  for (int i = 0; i < r.ndim; ++i) {
    r.sizes[i] = in.shape().d[i];
    r.strides[i] = in->strides[i];
  }
  r.reduced = reduced;
  r.in_bytes = r.out_bytes = static_cast<uint32_t>(itemsize(in.dtype()));
  r.acc_bytes = 4;  // opmath: float for float, half and bfloat16 (double is never simulated)
  const ReduceScratch s = reduce_scratch(r, rt_.device);
  // named in backward too (kRowNamedInBackward): the buffers keep their own names under the running node's layer
  const auto scratch = [this](uint64_t bytes, const char* what) {
    return empty(Shape{bytes}, DType::kU8, Category::kTemporaries, Label{what, -1, kRowNamedInBackward});
  };
  T acc;
  if (s.accumulation) acc = scratch(s.accumulation, "reduce kernel accumulation buffer");
  for (const ReduceLaunch& l : s.launches) {
    if (!l.staging) continue;
    T staging = scratch(l.staging, "reduce kernel staging buffer");
    T semaphores = scratch(l.semaphores, "reduce kernel semaphores");
    semaphores.reset();  // gpu_reduce_kernel's DataPtrs die in reverse order: the semaphores first
  }
}

// engine.cpp validate_outputs: a gradient whose shape differs from its input's (broadcast) is reduced with
// sum_to, one whose dtype differs is cast with .to(): each a new tensor replacing the old.
void Engine::validate_outputs(Node& n, Grads& grads) {
  for (size_t i = 0; i < grads.size() && i < n.n_next; ++i) {
    T& g = grads[i];
    if (!g || !n.next[i]) continue;
    const InputMeta& m = n.in_meta[i];
    if (g.shape().numel() != m.shape.numel()) {
      // at::sum_to: tensor.sum(reduce_dims, keepdim=true) over the leading dims and the dims the input has as 1
      T r = empty(m.shape, g.dtype(), Category::kBackward, g->label);
      reduce_kernel_scratch(g, sum_to_dims(g.shape(), m.shape));
      g = std::move(r);
    }
    if (g.dtype() != m.dtype) {
      T c = empty_strided(g.shape(), dense_strides_like(g.shape(), g->strides), m.dtype, Category::kBackward,
                          g->label);
      g = std::move(c);
    }
  }
}

void Engine::deliver(T g, GradEdge e, std::vector<Node*>& ready) {
  Node* n = e.node;
  T& slot = n->inbuf[e.slot];
  if (g) {
    if (!slot) {
      slot = std::move(g);
    } else if (uniquely_owned(*this, slot) && !slot->is_view) {
      // can_accumulate_inplace: the last reference to the tensor and to its storage (a view's base is another:
      // `storage().use_count() == 1` fails, and old + new is a new tensor)
      g.reset();  // old.add_(new): in place
    } else {
      T sum = empty_strided(slot.shape(), dense_strides_like(slot.shape(), slot->strides), slot.dtype(),
                          Category::kBackward, slot->label);  // old + new
      slot = std::move(sum);
      g.reset();
    }
  }
  if (--n->deps == 0) {
    ready.push_back(n);
    std::push_heap(ready.begin(), ready.end(), ReadyOrder());
  }
}

void Engine::accumulate_param(Node& n, T g) {
  if (!g) return;
  accumulate_into_grad(n, std::move(g));
  if (post_accumulate_grad) post_accumulate_grad(n.param);
}

void Engine::accumulate_into_grad(Node& n, T g) {
  T& grad = grads_[n.param];
  const T& p = params_[n.param];
  if (grad) {
    g.reset();  // variable_grad += new_grad, in place
    return;
  }
  // obeys_layout_contract: a dense parameter needs a grad with the same strides.
  if (uniquely_owned(*this, g) && g->strides == p->strides && g->dtype == p->dtype) {
    storages_[g->storage].label = p->label;          // from now on it is that parameter's .grad
    recategorize(g->storage, Category::kGradients);  // stolen: the engine's tensor becomes .grad
    grad = std::move(g);
  } else {
    grad = empty(p.shape(), p.dtype(), Category::kGradients, p->label);  // clone_obey_contract
    g.reset();
  }
}

void Engine::backward(const T& loss) {
  if (!loss->requires_grad || !loss->grad_fn) throw Error("internal: backward() of a tensor without grad_fn");
  // torch.autograd.backward seeds the root with ones_like(loss) (_make_grads); the seed lives until backward
  // returns.
  T seed = empty(loss.shape(), loss.dtype(), Category::kBackward, Label{"grad of the loss"});
  backward(loss, std::move(seed));
}

void Engine::backward(const T& loss, T seed) {
  if (!loss->requires_grad || !loss->grad_fn) throw Error("internal: backward() of a tensor without grad_fn");
  ++depth_;
  Node* const outer = running_;  // a reentrant call runs inside that node's backward
  // Dependencies: count the edges into each node reachable from the root. Counts belong to one backward
  // call (PyTorch keeps them per GraphTask): a node an outer backward has counted (a parameter's
  // AccumulateGrad) gets its outer count back when this call ends.
  std::vector<Node*> stack{loss->grad_fn.node};
  std::vector<Node*> seen{loss->grad_fn.node};
  std::vector<uint32_t> outer_deps{loss->grad_fn.node->deps};
  // Mark visited with a high bit in deps during the walk, then clear it.
  constexpr uint32_t kSeen = 1u << 31;
  loss->grad_fn.node->deps = kSeen;
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (uint8_t k = 0; k < n->n_next; ++k) {
      const GradEdge& e = n->next[k];
      if (!e) continue;
      Node* m = e.node;
      if (!(m->deps & kSeen)) {
        outer_deps.push_back(m->deps);
        m->deps = kSeen;
        seen.push_back(m);
        stack.push_back(m);
      }
      ++m->deps;
    }
  }
  for (Node* n : seen) n->deps &= ~kSeen;

  std::vector<Node*> ready;
  {
    Node* root = loss->grad_fn.node;
    root->inbuf[loss->grad_fn.slot] = seed;
    ready.push_back(root);
  }
  while (!ready.empty()) {
    std::pop_heap(ready.begin(), ready.end(), ReadyOrder());
    Node* n = ready.back();
    ready.pop_back();
    // the incoming gradients, taken: the node's inbuf is left empty with its count (Grads(in.size()))
    Grads in(n->inbuf.size());
    for (size_t i = 0; i < in.size(); ++i) in[i] = std::move(n->inbuf[i]);
    if (n->is_accumulate) {
      if (n->leaf >= 0) {
        accumulate_leaf(*n, std::move(in[0]));
      } else {
        accumulate_param(*n, std::move(in[0]));
      }
      continue;
    }
    if (n->frame) unpack(*n);
    if (pre_node) pre_node(*n);
    running_ = n;
    Grads out = n->fn(*this, *n, in);
    validate_outputs(*n, out);
    in.clear();         // call_function returns: the incoming gradients are dropped
    n->saved.clear();   // release_variables()
    for (uint8_t i = 0; i < n->n_next; ++i) {
      if (n->next[i]) deliver(i < out.size() ? std::move(out[i]) : T(), n->next[i], ready);
    }
    running_ = outer;
  }
  for (size_t i = 0; i < seen.size(); ++i) seen[i]->deps = outer_deps[i];
  // The graph is freed once backward is done (retain_graph=False): the whole graph after the outermost
  // backward; after a reentrant one, only the nodes it reached (the outer graph is still running).
  if (depth_ == 1 && loss->grad_fn.node->graph != 0) {
    // one of several live graphs (Engine::graph): its nodes go, the others stay
    const uint32_t g = loss->grad_fn.node->graph;
    recycle_where([g](const LiveNode& l) { return l.graph == g; });
    if (nodes_.empty() && phantoms.empty()) clear_leaf_grads();
  } else if (depth_ == 1) {
    recycle_nodes();
  } else {
    for (Node* n : seen) {
      if (n->param < 0) n->deps = kRecycled;  // AccumulateGrad of a parameter is persistent
    }
    recycle_where([](const LiveNode& l) { return l.node->deps == kRecycled; });
  }
  --depth_;
}  // the seed is released here, after the graph (torch.autograd.backward's grad_tensors list)

template <typename Pred>
void Engine::recycle_where(Pred pred) {
  size_t kept = 0;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (pred(nodes_[i])) {
      recycle(nodes_[i].node);
    } else {
      nodes_[kept++] = nodes_[i];
    }
  }
  nodes_.resize(kept);
}

void Engine::recycle(Node* n) {
  n->frame.reset();
  n->saved.clear();
  n->inbuf.clear();
  n->fn.reset();
  n->deps = 0;
  node_pool_.put(n);
}

void Engine::recycle_nodes() {
  for (const LiveNode& l : nodes_) recycle(l.node);
  nodes_.clear();
  clear_leaf_grads();
}

// The .grad of the leaves the freed graphs held (an embedding output made to require grad, a checkpoint's
// detached inputs); a sink's gradient is its owner's and stays.
void Engine::clear_leaf_grads() {
  leaf_grads_.clear();
  leaf_sinks_.clear();
}

void Engine::accumulate_leaf(Node& n, T g) {
  // AccumulateGrad of a leaf that is not a parameter: the first gradient becomes .grad as it is (it is
  // still a gradient in flight for whoever reads it), later ones are added in place.
  if (!g) return;
  T* sink = leaf_sinks_[static_cast<size_t>(n.leaf)];
  T& grad = sink ? *sink : leaf_grads_[static_cast<size_t>(n.leaf)];
  if (grad) {
    g.reset();
    return;
  }
  grad = std::move(g);
}

}  // namespace trainmem::sim

namespace trainmem {

const char* intern_name(std::string_view name) {
  static std::mutex mu;
  static std::unordered_set<std::string> names;  // nodes never move: c_str() stays valid
  std::lock_guard<std::mutex> lock(mu);
  return names.emplace(name).first->c_str();
}

std::string_view category_name(Category c) {
  switch (c) {
    case Category::kWeights: return "weights";
    case Category::kBuffers: return "buffers";
    case Category::kGradients: return "gradients";
    case Category::kOptimizer: return "optimizer state";
    case Category::kInputs: return "inputs";
    case Category::kActivations: return "activations";
    case Category::kWeightCopies: return "autocast weight copies";
    case Category::kBackward: return "backward gradients";
    case Category::kTemporaries: return "temporaries";
    case Category::kWorkspace: return "workspaces";
    case Category::kKvCache: return "kv cache";
    case Category::kDdpBuckets: return "ddp buckets";
    case Category::kZeroBuckets: return "zero buckets";
    case Category::kFsdpBuffers: return "fsdp buffers";
  }
  return "?";
}

std::string moment_name(Phase p, uint32_t step, uint32_t micro) {
  if (p == Phase::kSetup) return "the model load (setup)";
  std::string s = "the " + std::string(phase_name(p)) + " of step " + std::to_string(step);
  if (micro > 0) s += ", micro-batch " + std::to_string(micro);
  return s;
}

std::string_view phase_name(Phase p) {
  switch (p) {
    case Phase::kSetup: return "setup";
    case Phase::kForward: return "forward";
    case Phase::kLoss: return "loss";
    case Phase::kBackward: return "backward";
    case Phase::kGradClip: return "clip_grad_norm_";
    case Phase::kOptimizer: return "optimizer step";
    case Phase::kZeroGrad: return "zero_grad";
  }
  return "?";
}

}  // namespace trainmem
