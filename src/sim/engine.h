// The simulated PyTorch runtime: storages with reference counts, tensor handles whose lifetimes mirror Python
// references, autograd nodes with saved tensors, and the backward engine. Model forward programs
// (src/sim/models/*.cc) are transliterations of the Python code they model, written with these handles, so
// that a tensor is freed exactly when the Python program would drop its last reference.
#pragma once

#include <array>
#include <cstddef>
#include <new>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "trainmem/dtype.h"
#include "trainmem/flops.h"
#include "trainmem/runtime.h"
#include "trainmem/timeline.h"
#include "trainmem/units.h"

namespace trainmem::sim {

// A tensor shape of up to 5 dims.
struct Shape {
  std::array<uint64_t, 5> d{};
  uint8_t n = 0;
  Shape() = default;
  Shape(std::initializer_list<uint64_t> dims);
  static Shape of(const std::vector<uint64_t>& dims);  // an inventory row's or a state tensor's dims
  uint64_t operator[](size_t i) const { return d[i]; }
  uint64_t back() const { return d[n - 1]; }
  Elems numel() const {  // inline: the simulator asks for it at nearly every op
    uint64_t e = 1;
    for (uint8_t i = 0; i < n; ++i) e = checked_mul(e, d[i], "element count of a tensor");
    return Elems(e);
  }
};

// Element strides of a tensor, as PyTorch keeps them: whether an op must copy (reshape, contiguous, bmm,
// a view in backward) depends on them, so they are tracked exactly rather than approximated.
using Strides = std::array<int64_t, 5>;
Strides contiguous_strides(const Shape& s);
bool is_contiguous(const Shape& s, const Strides& st);
// Non-overlapping and dense: some permutation of the dims is contiguous (what empty_like preserves).
bool is_dense(const Shape& s, const Strides& st);
// The strides of a view of (shape, strides) as `to`, or nullopt when no view exists and reshape must copy
// (ATen's computeStride).
std::optional<Strides> view_strides(const Shape& from, const Strides& st, const Shape& to);
// Dense strides with the dims ordered as `st` orders them: empty_like(preserve_format), and the layout
// TensorIterator gives an elementwise result (ATen's infer_dense_strides).
Strides dense_strides_like(const Shape& s, const Strides& st);
// The dims at::sum_to(from, to) reduces, as a mask of `from`'s dims (Engine::reduce_kernel_scratch).
uint32_t sum_to_dims(const Shape& from, const Shape& to);


class Engine;
struct Node;

// The autograd identity of a tensor: its grad_fn and output slot, or the parameter it is (leaf).
struct GradEdge {
  Node* node = nullptr;
  uint32_t slot = 0;
  explicit operator bool() const { return node != nullptr; }
};

struct TensorImpl {
  Engine* eng = nullptr;
  uint64_t storage = 0;  // storage id
  Shape shape;
  DType dtype = DType::kF32;
  Strides strides{};
  bool requires_grad = false;
  GradEdge grad_fn;      // for a parameter: its AccumulateGrad node
  uint32_t refs = 0;
  bool is_param = false;
  // Made by a view op. A view keeps its base alive (DifferentiableViewMeta's ViewInfo holds the base tensor, in
  // every grad mode), so its storage has two owners: InputBuffer::accumulate never adds into it in place.
  bool is_view = false;
  Label label;
  int32_t param_index = -1;  // a parameter's inventory row (make_parameter), its label's row aside
};

// A reference to a tensor, like a Python variable: copying adds a reference, destruction drops one.
class T {
 public:
  T() = default;
  explicit T(TensorImpl* p) : p_(p) {
    if (p_) ++p_->refs;
  }
  T(const T& o) : p_(o.p_) {
    if (p_) ++p_->refs;
  }
  T(T&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  T& operator=(const T& o) {
    if (o.p_) ++o.p_->refs;  // before dropping ours: o may be the last reference to the same tensor
    TensorImpl* old = p_;
    p_ = o.p_;
    if (old) drop(old);
    return *this;
  }
  T& operator=(T&& o) noexcept {
    if (this != &o) {
      TensorImpl* old = p_;
      p_ = o.p_;
      o.p_ = nullptr;
      if (old) drop(old);
    }
    return *this;
  }
  ~T() {
    if (p_) drop(p_);
  }
  void reset() {
    if (!p_) return;
    TensorImpl* old = p_;
    p_ = nullptr;
    drop(old);
  }
  explicit operator bool() const { return p_ != nullptr; }
  TensorImpl* operator->() const { return p_; }
  TensorImpl* get() const { return p_; }
  const Shape& shape() const { return p_->shape; }
  DType dtype() const { return p_->dtype; }
  Bytes bytes() const { return bytes_of(p_->shape.numel(), p_->dtype); }

 private:
  // One reference fewer; the last frees the impl and, with its last impl, the storage.
  static void drop(TensorImpl* p) {
    if (--p->refs == 0) release_impl(p);
  }
  static void release_impl(TensorImpl* p);
  TensorImpl* p_ = nullptr;
};

// A small fixed-capacity list of tensors: the gradients flowing into or out of a node, or what a node saves.
// Nodes are created by the thousand per step; inline storage keeps the simulator free of heap traffic.
template <size_t N>
struct TensorList {
  std::array<T, N> v{};
  uint8_t n = 0;
  TensorList() = default;
  explicit TensorList(size_t count) : n(static_cast<uint8_t>(count)) {}
  TensorList(std::initializer_list<T> xs) {
    for (const T& x : xs) v[n++] = x;
  }
  T& operator[](size_t i) { return v[i]; }
  const T& operator[](size_t i) const { return v[i]; }
  size_t size() const { return n; }
  void push_back(T t) { v[n++] = std::move(t); }
  void clear() {
    for (uint8_t i = 0; i < n; ++i) v[i].reset();
    n = 0;
  }
  T* begin() { return v.data(); }
  T* end() { return v.data() + n; }
  const T* begin() const { return v.data(); }
  const T* end() const { return v.data() + n; }
};
// Forward outputs of one op (the gradients into its node): 16 for torch.chunk's SplitBackward0, which has one
// output per chunk (torchtune's chunked output head splits the hidden states into up to 16 chunks here).
inline constexpr size_t kMaxEdges = 16;
using Grads = TensorList<kMaxEdges>;
using Saved = TensorList<8>;

// A move-only callable with inline storage (no allocation): a node's backward.
class BackwardFn {
 public:
  static constexpr size_t kCapacity = 320;
  BackwardFn() = default;
  template <typename F>
  BackwardFn(F f) {  // NOLINT: implicit from lambdas
    static_assert(sizeof(F) <= kCapacity, "backward closure too large for BackwardFn");
    new (buf_) F(std::move(f));
    call_ = [](void* p, Engine& e, Node& n, Grads& g) { return (*static_cast<F*>(p))(e, n, g); };
    destroy_ = [](void* p) { static_cast<F*>(p)->~F(); };
  }
  BackwardFn(BackwardFn&&) = delete;
  BackwardFn& operator=(BackwardFn&& o) = delete;
  ~BackwardFn() { reset(); }
  template <typename F>
  void assign(F f) {
    reset();
    new (this) BackwardFn(std::move(f));
  }
  void reset() {
    if (destroy_) destroy_(buf_);
    destroy_ = nullptr;
    call_ = nullptr;
  }
  Grads operator()(Engine& e, Node& n, Grads& g) { return call_(buf_, e, n, g); }

 private:
  alignas(std::max_align_t) unsigned char buf_[kCapacity];
  Grads (*call_)(void*, Engine&, Node&, Grads&) = nullptr;
  void (*destroy_)(void*) = nullptr;
};

// What validate_outputs checks a gradient against: the input's shape and dtype.
struct InputMeta {
  Shape shape;
  DType dtype = DType::kF32;
};

// One region of non-reentrant checkpointing (torch/utils/checkpoint.py, _CheckpointFrame): the tensors its
// forward would have saved are replaced by holders, and recomputed in backward.
struct CheckpointFrame {
  std::vector<T> inputs;          // save_inputs(*args): kept until the region's backward is done
  uint32_t holders = 0;           // tensors the forward would have saved
  std::vector<T> recomputed;      // by holder index, filled by the recompute
  uint32_t filled = 0, unpacked = 0;
  bool recomputed_once = false;
  std::function<void(Engine&)> recompute;  // runs the region's forward again (holds its arguments)
  // checkpoint(..., early_stop=...): the recompute stops once every holder is filled (transformers: the
  // default True); torchtitan's SelectiveAC passes early_stop=False and runs the whole region again.
  bool early_stop = true;
  // Selective checkpointing (create_selective_checkpoint_contexts): the op outputs the policy saves, per op,
  // in forward order, from the forward until the recompute pops them (Engine::sac_op).
  bool selective = false;
  std::array<std::deque<std::vector<T>>, 4> sac_storage;  // by SacOp
  std::array<uint32_t, 2> mm_count{};                      // torchtitan's forward_mm_count, recompute_mm_count
};

// The aten ops that torchtitan's selective activation checkpointing policy saves and that trainmem's
// programs run inside a decoder layer (see Engine::sac_saves).
enum class SacOp : uint8_t {
  kMm,     // aten.mm.default: nn.Linear without bias (linear -> matmul -> mm on the flattened input)
  kAddmm,  // aten.addmm.default: nn.Linear with bias on a contiguous input (Linear.cpp), GPT-2's Conv1D
  kBmm,    // aten.bmm.default: torch.matmul of batched operands (eager attention, sdpa's math path)
  kSdpa,   // aten._scaled_dot_product_flash_attention / _efficient_attention: every tensor output
};

// Thrown inside a recompute once every holder is filled (_StopRecomputationError, early_stop=True).
struct StopRecomputation {};

// The differentiable inputs of one op: at most 3 in every op simulated (addmm's bias, input and weight; layer
// norm's input, weight and bias; sdpa's q, k and v), so a node holds 4 inline (Engine::new_node checks).
inline constexpr size_t kMaxInputs = 4;

// Fields in the order the engine touches them: the backward's dependency walk reads deps, n_next and next, so
// they share the node's first cache line; the rest is read when the node is recorded and when it runs. Nodes are
// created by the thousand per step and a pipeline rank keeps several micro-batches' graphs alive: a compact
// node keeps them in cache.
struct Node {
  uint32_t deps = 0;      // incoming edges not yet delivered during the current backward
  uint8_t n_next = 0;
  bool is_accumulate = false;
  uint8_t holder_slots = 0;  // which `saved` slots they fill (bit i: slot i)
  uint32_t graph = 0;     // the graph it belongs to (Engine::graph when recorded)
  int32_t param = -1;     // AccumulateGrad: the parameter index
  int32_t leaf = -1;      // AccumulateGrad of a leaf that is not a parameter (requires_grad_leaf)
  uint32_t holder = 0;    // the frame's index of the first of them
  uint64_t seq = 0;       // creation order; the engine runs the highest ready sequence number first
  std::array<GradEdge, kMaxInputs> next{};     // one per differentiable input
  const char* name = "";  // e.g. "AddmmBackward0"
  Label label;            // the forward op's (first) output: names what this node's backward allocates
  std::shared_ptr<CheckpointFrame> frame;  // recorded inside a non-reentrant checkpoint: saved tensors are holders
  std::array<InputMeta, kMaxInputs> in_meta{};  // one per differentiable input
  Saved saved;            // tensors saved for backward (released after the node runs)
  Grads inbuf;            // incoming gradients, one slot per forward output
  BackwardFn fn;
};

// Objects allocated in chunks and recycled through a free list: the simulator creates tens of thousands of
// tensor impls and graph nodes per step, and one allocation per object would dominate its run time. A pool
// hands its chunks to a per-thread cache when it goes, so that a search that simulates setup after setup
// reuses warm memory instead of faulting in fresh pages for every simulation.
template <typename X>
class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    auto& cache = chunk_cache();
    for (auto& c : chunks_) {
      if (cache.size() >= kCachedChunks) break;
      cache.push_back(std::move(c));  // objects keep stale fields: whoever gets one initialises it
    }
  }
  X* get() {
    if (!free_.empty()) {
      X* x = free_.back();
      free_.pop_back();
      return x;
    }
    if (used_ == kChunk || chunks_.empty()) {
      auto& cache = chunk_cache();
      if (!cache.empty()) {
        chunks_.push_back(std::move(cache.back()));
        cache.pop_back();
      } else {
        chunks_.push_back(std::make_unique<X[]>(kChunk));
      }
      used_ = 0;
    }
    return &chunks_.back()[used_++];
  }
  // Called from destructors: never throws (an object that cannot be listed for reuse stays in its chunk).
  void put(X* x) noexcept {
    try {
      free_.push_back(x);
    } catch (...) {
    }
  }

 private:
  static constexpr size_t kChunk = 256;
  static constexpr size_t kCachedChunks = 512;
  using Chunks = std::vector<std::unique_ptr<X[]>>;
  static Chunks& chunk_cache() {
    thread_local Chunks cache;
    return cache;
  }
  Chunks chunks_;
  size_t used_ = 0;
  std::vector<X*> free_;
};

struct StorageInfo {  // (fields ordered to keep it at 32 bytes: a simulation makes one per allocation)
  Bytes bytes;
  Label label;
  uint32_t refs = 0;  // tensor impls referring to it
  Category category = Category::kActivations;
  bool resized_out = false;  // untyped_storage().resize_(0): no bytes until resized back (Engine::resize_storage)
  Stream stream = Stream::kDefault;  // the stream current when it was allocated
};

// The most events one simulation may record: 1,024 layers (the bound on layers) for 16 steps of two
// micro-batches is about 2 million; a timeline event and its allocator figures take ~110 bytes, so this
// keeps a simulation under ~500 MB. Beyond it the simulation stops with an error naming the bound.
inline constexpr size_t kMaxEvents = size_t{1} << 22;  // 4,194,304
// Event::storage is 32 bits: a simulation's storages are its allocations (each an event) and a few unallocated
// ones per parameter, far below 2^32.
static_assert(kMaxEvents < (size_t{1} << 31));

class Engine;

// `with torch.cuda.stream(s):` for the block's lifetime: storages allocated meanwhile come from `s`'s pool; the
// previous stream comes back on leaving, also when an allocation throws.
class StreamScope {
 public:
  StreamScope(Engine& e, Stream s);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Engine& e_;
  Stream caller_;
};

class Engine {
 public:
  // About one storage for every two events: the timeline's capacity, reserved by the caller, sizes the storage
  // table (only a capacity hint; growing by doubling copies and touches twice the memory)
  explicit Engine(Timeline* tl) : tl_(tl) { storages_.reserve(tl->events.capacity() / 2 + 16); }
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Where subsequent events are attributed.
  Phase phase = Phase::kSetup;
  uint32_t step = 0, micro = 0;
  bool grad_mode = true;  // torch.no_grad() when false: no nodes are recorded
  // torch.cuda.stream(s): the stream new storages are allocated on (the allocator's pool they come from)
  Stream stream = Stream::kDefault;
  // The graph new nodes belong to. 0: one graph at a time (every backward frees every node). Pipeline
  // parallelism (pp.h) keeps several micro-batches' graphs alive at once, each under its own nonzero tag: the
  // backward of a tagged root frees only the nodes of its tag, as torch frees one graph and keeps the others.
  uint32_t graph = 0;

  // A new storage and a tensor over it.
  T empty(const Shape& s, DType dt, Category c, Label l);
  // A new storage with the given strides (empty_like of a permuted tensor).
  T empty_strided(const Shape& s, const Strides& st, DType dt, Category c, Label l);
  // A view sharing `base`'s storage (no allocation), with its autograd identity.
  T view(const T& base, const Shape& s, const Strides& st);
  // The scratch of a CUDA reduction of `in` over the dims set in `reduced` (bit i: dim i), once its output is
  // allocated (gpu_reduce_kernel, trainmem/cuda_reduce.h): each launch's global staging buffer and semaphores,
  // freed when the launch is queued, inside a multi-launch 16-bit sum's accumulation buffer. Nothing when the
  // reduction fits in one block per output.
  void reduce_kernel_scratch(const T& in, uint32_t reduced);
  // A parameter with its AccumulateGrad node; `index` is its inventory row. A frozen parameter
  // (requires_grad=False) is a plain leaf: no node, no .grad, and ops record no graph through it alone.
  T parameter(const Shape& s, DType dt, int32_t index, Label l, bool requires_grad = true);
  // FSDP2's unsharded parameter (fsdp.h): a parameter over a storage of `storage` bytes (its padded
  // all-gather output) that starts resized to 0 (no event), allocated and freed under it by resize_storage.
  // `requires_grad` false: a frozen row's (FSDP2 keeps the sharded parameter's requires_grad on the unsharded one).
  T parameter_unallocated(const Shape& s, DType dt, int32_t index, Bytes storage, Category c, Label l,
                          bool requires_grad = true);
  // untyped_storage().resize_(0) (allocated false) and resize_(size) (true), as FSDP2's free_storage and
  // alloc_storage (torch/distributed/fsdp/_fully_shard/_fsdp_common.py) do to an unsharded parameter: the views
  // and the references autograd saved keep the storage, not its bytes. A no-op when already so.
  void resize_storage(uint64_t id, bool allocated);
  // FSDP1's padded unsharded flat parameter (fsdp1.h): a storage of `storage` bytes that starts resized to 0 (no
  // event), allocated and freed by resize_storage (_alloc_storage / _free_storage in torch/distributed/utils.py).
  T empty_unallocated(const Shape& s, DType dt, Bytes storage, Category c, Label l);
  // A parameter (inventory row `index`, with its AccumulateGrad) viewing `base`'s storage: FSDP1's original
  // parameters as views into the unsharded flat parameter (use_orig_params=True, _use_unsharded_views).
  T parameter_view(const T& base, const Shape& s, int32_t index, Label l);
  // A buffer or an input (leaf without grad).
  T leaf(const Shape& s, DType dt, Category c, Label l);

  // Records an autograd node for an op whose differentiable inputs are `inputs` and whose outputs are
  // `outputs` (which get grad_fn and requires_grad when any input requires grad). Returns nullptr when no
  // input requires grad (or grad mode is off): nothing is saved then.
  template <typename F>
  Node* record(const char* name, std::initializer_list<const T*> inputs, std::initializer_list<T*> outputs,
               Saved saved, F fn) {
    Node* n = new_node(name, inputs, std::span<T* const>(outputs.begin(), outputs.size()), std::move(saved));
    if (n) n->fn.assign(std::move(fn));
    return n;
  }
  // The same with a run-time number of outputs (torch.chunk's views), at most kMaxEdges.
  template <typename F>
  Node* record_n(const char* name, std::initializer_list<const T*> inputs, std::span<T* const> outputs, Saved saved,
                 F fn) {
    Node* n = new_node(name, inputs, outputs, std::move(saved));
    if (n) n->fn.assign(std::move(fn));
    return n;
  }
  Node* new_node(const char* name, std::initializer_list<const T*> inputs, std::span<T* const> outputs,
                 Saved saved);

  // Runs loss.backward(): seeds the gradient with ones_like(loss) and executes every reachable node.
  void backward(const T& loss);
  // torch.autograd.backward(out, grad): runs the graph behind `out` with `grad` as its gradient. Reentrant: a
  // node's backward may call it (reentrant checkpointing's CheckpointFunction.backward does) on a graph it has
  // just recorded by running forward code again; that inner backward runs and frees only its own graph, and
  // the outer backward goes on where it was.
  void backward(const T& out, T grad);
  // x.detach().requires_grad_(): an alias of x's storage that is a leaf requiring grad, whose gradient a
  // backward accumulates into leaf_grad() (what checkpoint's recomputation starts from).
  // held_by_graph: the leaf's AccumulateGrad node keeps it (its `variable`) until the graph is freed, as for a
  // leaf of the training graph; a checkpoint's recomputation leaves are freed with their own graph instead.
  // grad_sink: a leaf whose tensor outlives its graph (the pipeline's receive buffer, which the stage holds):
  // `.grad` is an attribute of that tensor, so the gradient goes to *grad_sink, which the caller owns, and stays
  // when the graph is freed (without a sink, the leaf dies with its graph and its .grad with it).
  T requires_grad_leaf(const T& x, bool held_by_graph = false, T* grad_sink = nullptr);
  // The .grad of a requires_grad_leaf (empty when none arrived), handed over: the engine keeps no reference,
  // as the detached input dies when CheckpointFunction.backward returns its grads.
  T take_leaf_grad(const T& leaf);
  // Backward calls in progress (1 inside loss.backward(), 2 inside a reentrant backward).
  int backward_depth() const { return depth_; }

  // Non-reentrant checkpointing: while a frame is packing, the tensors new nodes save become its holders;
  // while it is recomputing, they fill it (and the recompute stops once it is full).
  void begin_packing(std::shared_ptr<CheckpointFrame> f) { packing_ = std::move(f); }
  void end_packing() { packing_.reset(); }
  // One aten op that selective checkpointing may cache: `run` computes its outputs into `outs`. Outside a
  // selective frame, or when the policy recomputes the op, `run` runs. When the policy saves it, the forward
  // runs it and the frame keeps the outputs (_CachingTorchDispatchMode: storage[func].append(x.detach()), an
  // alias of the same storage, so no copy); the recompute does not run it and takes the kept outputs instead
  // (_CachedTorchDispatchMode: storage[func].pop(0)). torch/utils/checkpoint.py, PyTorch >= 2.4.
  template <typename Run>
  void sac_op(SacOp op, std::initializer_list<T*> outs, Run&& run) {
    if (!sac_saves(op)) {
      run();
      return;
    }
    if (filling_) {
      sac_pop(op, outs);
      return;
    }
    run();
    sac_push(op, outs);
  }
  // Allocations while recomputing are labelled "recompute: <op>" (reentrant or not).
  void begin_recompute() { ++recomputing_depth_; }
  void end_recompute() { --recomputing_depth_; }
  // The .grad of parameter `index` (empty handle when None).
  T& grad(int32_t index);
  std::vector<T>& grads() { return grads_; }
  // Tensor.register_post_accumulate_grad_hook (torch >= 2.1): called with the parameter index each time
  // AccumulateGrad has accumulated into that parameter's .grad (torch/csrc/autograd/functions/
  // accumulate_grad.h AccumulateGrad::apply runs the tensor's post-accumulate-grad hooks after accumulateGrad).
  std::function<void(int32_t)> post_accumulate_grad;
  // Called before a node's backward runs (after a checkpoint frame's unpack): DeepSpeed ZeRO-3's pre-backward
  // module hook gathers the parameters the node saved (Loop::z3_pre_node).
  std::function<void(Node&)> pre_node;
  // torch.cuda.empty_cache(): an event that has the allocator replay return its cached, entirely free segments
  // (alloc/caching_allocator.cc); no tensor changes.
  void empty_cache();
  // Parameter metadata for AccumulateGrad.
  size_t parameter_count() const { return params_.size(); }

  // Storage bookkeeping (used by T).
  void retain(uint64_t id);
  void release(uint64_t id);
  void recategorize(uint64_t id, Category c);
  const StorageInfo& storage(uint64_t id) const { return storages_[id]; }
  TensorImpl* new_impl();
  void delete_impl(TensorImpl* p);
  uint64_t alloc_storage(Bytes b, Category c, Label l);
  void free_storage(uint64_t id) noexcept;

  // Stops adding events to the timeline: the simulated program has ended, and tearing down the simulator's
  // own objects is not part of it.
  void stop_recording() { recording_ = false; }
  // A free that could not be recorded (the host ran out of memory): frees run in destructors and must not
  // throw, so they stop the recording instead, and the simulator reports it afterwards.
  bool lost_events() const { return lost_events_; }
  const LiveBytes& live() const { return live_; }
  // The first event at which live bytes were highest, and the live bytes then.
  size_t peak_event() const { return peak_event_; }
  const LiveBytes& peak_live() const { return peak_live_; }
  size_t event_count() const { return tl_->events.size(); }
  // Bytes of the distinct storages that autograd nodes hold (saved tensors), excluding parameters (FSDP's
  // unsharded ones too) and buffers, and storages resized to 0: what the forward pass leaves for backward.
  Bytes saved_bytes() const;

  // cuBLAS: the first gemm of a thread allocates that thread's workspace (forward ops run on the Python
  // thread, backward ops on the autograd engine's device thread). `lt`: the gemm goes through cuBLASLt.
  void set_runtime(const RuntimeFacts& rt) { rt_ = rt; }
  const RuntimeFacts& runtime() const { return rt_; }
  void gemm(bool lt);

  // The FLOPs and bytes of one kernel an op launches (trainmem/flops.h has the conventions), attributed to the
  // phase: forward (and the loss), backward, a checkpoint's recomputation, or the optimizer step (and gradient
  // clipping). Only the step `count_step` is counted (-1: every step, as for generate()); the model load and
  // zero_grad are not. `flops` and `bytes` come from checked arithmetic at the call.
  void count(FlopKind k, uint64_t flops, uint64_t bytes, DType dt);
  std::optional<WorkPhase> work_phase() const;  // where count() attributes work now; nullopt: not counted
  int64_t count_step = -1;
  // How many launches each counted kernel stands for: the training loop simulates at most two micro-batches of a
  // step, and the first stands for every micro-batch before the last (loop.cc train), so its kernels count
  // grad_accum - 1 times and the ledger is the whole step's.
  uint64_t count_weight = 1;
  // A tensor-parallel collective over `bytes` (the all-reduced tensor, or an all-gather's output), counted like
  // a kernel (flops.h FlopLedger::tp_all_reduces).
  void count_tp_collective(bool all_gather, uint64_t bytes);
  // A data-parallel collective over `bytes` (an all-gather's output, a reduce-scatter's input), counted the same
  // way (FlopLedger::dp_all_gathers).
  void count_dp_collective(bool all_gather, uint64_t bytes);
  const FlopLedger& flops() const { return flops_; }

  // --- Memoized pipeline actions (memo.h): what ActionMemo reads, records and replays -------------------------
  // One count()/count_tp_collective()/count_dp_collective() call as it would count: its work phase without the
  // count_step filter (replay_count applies the filter of the step it is replayed in) and its weight.
  struct CountCall {
    enum Kind : uint8_t { kKernel, kTp, kDp } kind = kKernel;
    bool all_gather = false;
    FlopKind k = FlopKind::kElementwise;
    DType dt = DType::kF32;
    WorkPhase p = WorkPhase::kForward;
    uint64_t flops = 0, bytes = 0, weight = 1;
  };
  std::vector<CountCall>* count_tape = nullptr;  // while set, every counted call is appended to it
  void replay_count(const CountCall& c);
  // Appends a recorded event (its storage id, step and micro-batch already the replay's) as emit() does, with
  // emit_alloc's peak; false (nothing appended) when its bytes would pass 2^64 (the caller falls back).
  bool replay_event(const Event& ev);
  size_t storage_count() const { return storages_.size(); }
  const Event& event_at(size_t i) const { return tl_->events[i]; }
  StorageInfo& storage_at(uint64_t id) { return storages_[id]; }
  void push_storage(const StorageInfo& s) { storages_.push_back(s); }
  uint64_t node_seq() const { return seq_; }
  void advance_node_seq(uint64_t n) { seq_ += n; }
  // Between two actions: no backward running, no checkpoint frame packing or filling, no recompute, recording.
  bool at_rest() const {
    return depth_ == 0 && !packing_ && !filling_ && recomputing_depth_ == 0 && !running_ && recording_ && !lost_events_;
  }
  // The storages the nodes of graph `g` keep for backward as saved_bytes() counts them, each sorted and once:
  // checkpoint frames' inputs and kept outputs (`kept`), saved tensors (`saved`, before saved_bytes()'s category
  // filter).
  void kept_ids(uint32_t g, std::vector<uint64_t>& kept, std::vector<uint64_t>& saved) const;
  // Graphs whose forward was replayed and whose backward is still to come (memo.h): their storages count in
  // saved_bytes() as the real graph's would, and a graph freed while one is pending is not the last live graph.
  struct PhantomGraph {
    uint32_t graph = 0;
    std::vector<uint64_t> kept, saved;  // kept_ids of the graph it stands for
  };
  std::vector<PhantomGraph> phantoms;
  // Which of the four cuBLAS/cuBLASLt workspaces exist (bit i: python thread, autograd thread, then Lt's)
  uint64_t workspace_bits() const {
    return (cublas_ws_[0] ? 1 : 0) | (cublas_ws_[1] ? 2 : 0) | (cublaslt_ws_[0] ? 4 : 0) | (cublaslt_ws_[1] ? 8 : 0);
  }
  // A handle on storage `id` shaped as `like` (no autograd history): a tensor a replayed action hands to the loop
  // (memo.h rule 3's escapes), as the simulated action's handle would be after its graph is freed.
  T adopt(uint64_t id, const TensorImpl& like);
  // The storage ids of the persistent handles the engine keeps (UINT64_MAX: none): the four workspaces, then every
  // parameter's .grad, then (index, id) of every leaf .grad that exists, appended to `out`.
  void persistent_ids(std::vector<uint64_t>& out) const;

 private:
  // Appends an event (at the current phase, step and micro-batch) to the timeline and applies it to the live
  // bytes.
  void emit(Event::Kind kind, Category c, Category from, uint64_t id, Bytes b, Label l, Stream s);
  void deliver(T g, GradEdge e, std::vector<Node*>& ready);
  void validate_outputs(Node& n, Grads& grads);
  void recycle_nodes();
  void clear_leaf_grads();
  void recycle(Node* n);
  template <typename Pred>
  void recycle_where(Pred pred);  // recycles the live nodes for which pred holds, keeps the others in order
  static constexpr uint32_t kRecycled = 0xFFFFFFFFu;  // deps of a node a reentrant backward is done with
  void accumulate_param(Node& n, T g);
  void accumulate_into_grad(Node& n, T g);
  void accumulate_leaf(Node& n, T g);
  Node* new_accumulate_node();
  T make_parameter(T t, int32_t index, bool requires_grad);
  void check_event_room() const;
  void emit_alloc(uint64_t id);
  void count_in(WorkPhase p, FlopKind k, uint64_t flops, uint64_t bytes, DType dt, uint64_t weight);
  void count_collective_in(WorkPhase p, bool tp, bool all_gather, uint64_t bytes, uint64_t weight);
  std::optional<WorkPhase> unfiltered_work_phase() const;  // work_phase() without the count_step filter

  // Declared first so that they are destroyed last, after everything that refers to their objects.
  Pool<TensorImpl> impls_;
  Pool<Node> node_pool_;
  Timeline* tl_;
  ReuseVector<StorageInfo> storages_;
  // live graph nodes of the current forward/backward, in creation order, each with its graph (Node::graph), so
  // that freeing one graph of several (a pipeline's micro-batches) picks its nodes without reading the others
  struct LiveNode {
    Node* node;
    uint32_t graph;
  };
  std::vector<LiveNode> nodes_;
  std::vector<Node*> acc_nodes_;  // one AccumulateGrad per parameter (persistent)
  std::vector<T> params_;   // the parameters themselves (weak in spirit: the model holds them)
  std::vector<T> grads_;    // .grad per parameter
  std::vector<T> leaf_grads_;  // .grad per requires_grad_leaf
  std::vector<T*> leaf_sinks_;  // per requires_grad_leaf: where its .grad goes instead (nullptr: leaf_grads_)
  int depth_ = 0;           // backward calls in progress
  std::shared_ptr<CheckpointFrame> packing_;
  CheckpointFrame* filling_ = nullptr;
  int recomputing_depth_ = 0;
  void unpack(Node& n);
  bool sac_saves(SacOp op);
  void sac_push(SacOp op, std::initializer_list<T*> outs);
  void sac_pop(SacOp op, std::initializer_list<T*> outs);
  uint64_t seq_ = 0;
  Node* running_ = nullptr;
  bool recording_ = true;  // the node whose backward is running: its allocations are labelled after it
  bool lost_events_ = false;
  LiveBytes live_;
  LiveBytes peak_live_;
  size_t peak_event_ = 0;
  RuntimeFacts rt_;
  std::array<T, 2> cublas_ws_;    // per thread: 0 = Python thread, 1 = autograd thread
  std::array<T, 2> cublaslt_ws_;
  FlopLedger flops_;
  struct FlopKey {
    uint64_t flops, bytes;
    uint32_t tag;  // kind, phase, dtype
    bool operator==(const FlopKey&) const = default;
  };
  struct FlopKeyHash {
    size_t operator()(const FlopKey& k) const noexcept {
      return std::hash<uint64_t>()(k.flops * 0x9E3779B97F4A7C15ull ^ (k.bytes + 0x632BE59BD9B4E019ull * k.tag));
    }
  };
  std::unordered_map<FlopKey, uint32_t, FlopKeyHash> flop_index_;  // row of each distinct kernel
  // intern_name(prefix + what) by (prefix, what): the same label recomputed in every layer and micro-batch is
  // built and looked up in the process-wide table once per simulation (simulation bookkeeping only)
  struct PrefixedKey {
    const char* prefix;
    const char* what;
    bool operator==(const PrefixedKey&) const = default;
  };
  struct PrefixedKeyHash {
    size_t operator()(const PrefixedKey& k) const noexcept {
      return std::hash<const void*>()(k.what) * 0x9E3779B97F4A7C15ull ^ std::hash<const void*>()(k.prefix);
    }
  };
  std::unordered_map<PrefixedKey, const char*, PrefixedKeyHash> prefixed_;
  const char* prefixed(const char* prefix, const char* what);
};

inline StreamScope::StreamScope(Engine& e, Stream s) : e_(e), caller_(e.stream) { e.stream = s; }
inline StreamScope::~StreamScope() { e_.stream = caller_; }

}  // namespace trainmem::sim
