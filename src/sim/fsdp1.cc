// FSDP1 per rank in the simulator (fsdp1.h). Sources: pytorch/pytorch torch/distributed/fsdp/_runtime_utils.py
// (_lazy_init -> _share_state_and_init_handle_attrs, _init_streams, _unshard, _reshard, _pre_forward,
// _pre_forward_unshard, _post_forward, _post_forward_reshard, _root_pre_forward, _pre_backward_hook,
// _post_backward_hook, _post_backward_reshard, _should_free_in_backward, _reduce_grad, _get_reduce_scatter_tensors,
// _accumulate_sharded_grad, _cast_grad_to_param_dtype, _prefetch_handle), _flat_param.py (FlatParamHandle
// flatten_tensors, shard, _get_shard, init_flat_param_attributes, pre_unshard, _use_low_precision_shard, unshard,
// _alloc_padded_unsharded_flat_param, post_unshard, _free_low_precision_sharded_param, reshard,
// _free_unsharded_flat_param, _get_unflat_views_aligned, prepare_gradient_for_optim, prepare_gradient_for_backward,
// _use_unsharded_views, _use_unsharded_grad_views, _use_sharded_grad_views, _reset_flat_param_grad_info_if_needed,
// _writeback_orig_params), _runtime_utils.py _finalize_params, fully_sharded_data_parallel.py (no_sync), _init_utils.py
// (_init_param_handle_from_module, _move_module_to_device), _exec_order_utils.py (get_handle_to_backward_prefetch).
//
// Gradient checkpointing (the Trainer's, inside each FSDP-wrapped layer) needs nothing here: the layer's output
// carries the unit's pre-backward hook, which unshards before the checkpoint's backward recomputes; the recompute
// uses the forward's parameter views (_use_unsharded_views in BACKWARD_PRE sets `tensor.data = view` on the Tensors
// saved in FORWARD, "to preserve the autograd graph so that the post-backward hook fires (e.g. for reentrant AC)"),
// so it allocates no parameter bytes, and the views the recomputed graph saves keep none once the reshard resizes
// _full_param_padded's storage to 0. Under no_sync, _writeback_orig_params finds each .grad on flat_param.grad's
// storage (no writeback) and _reset_flat_param_grad_info_if_needed keeps flat_param.grad (the .grads are set).
//
// record_stream: FSDP1 frees the unsharded flat parameter, the low-precision shard and the autograd-computed flat
// gradient with _no_dispatch_record_stream, so the caching allocator reuses their blocks only once the recording
// streams' work is done. The simulator follows the policy FSDP2's code on main states (include/trainmem/allocator.h):
// a cross-stream free is replayed at the free event, as if that stream had finished (a timeline without GPU times
// cannot know when it does). limit_all_gathers' _FreeEventQueue (at most 2 in-flight frees before the CPU waits)
// bounds how far the CPU runs ahead of those frees; under that policy it changes no allocation.
#include "fsdp1.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <string_view>

#include "trainmem/error.h"

namespace trainmem::sim {

namespace {
// "FSDP1 <what>", with the unit's name unless it is a decoder layer (the timeline's Label::layer names those)
const char* flat_label(const Fsdp1Unit& u, std::string_view what) {
  std::string text = "FSDP1 ";
  text += what;
  if (u.layer < 0) text += " (" + u.name + ")";
  return intern_name(text);
}
}  // namespace

Fsdp1::Fsdp1(Engine& e, const Inventory& inv, const Fsdp1Options& o, std::vector<Fsdp1Unit> units)
    : e_(e), inv_(inv), o_(o) {
  unit_of_.assign(inv.parameters.size(), -1);
  in_shard_.assign(inv.parameters.size(), 0);
  sharded_view_.resize(inv.parameters.size());
  unsharded_.resize(inv.parameters.size());
  for (Fsdp1Unit& spec : units) {
    const auto k = static_cast<int32_t>(units_.size());
    if (spec.kind == Fsdp1Unit::kRoot) root_ = static_cast<size_t>(k);
    for (size_t p = 0; p < spec.rows.size(); ++p) {
      const auto r = static_cast<size_t>(spec.rows[p]);
      unit_of_[r] = k;
      in_shard_[r] = fsdp1_numel_in_shard(spec.layout, p, o.rank);
    }
    Unit& u = units_.emplace_back();
    u.spec = std::move(spec);
  }
  for (size_t r = 0; r < unit_of_.size(); ++r) {
    if (unit_of_[r] < 0) throw Error(fmt::format("internal: {} is in no FSDP1 unit", inv.parameters[r].name));
  }
  if (units_.empty() || units_[root_].spec.kind != Fsdp1Unit::kRoot) throw Error("internal: FSDP1 without a root unit");
  first_layer_ = units_.front().spec.kind == Fsdp1Unit::kLayer ? units_.front().spec.layer : 0;
}

Fsdp1::Unit& Fsdp1::unit(int32_t id) {
  if (id == kFsdpUnitEmbed || id == kFsdpUnitTail) return units_[root_];
  const int64_t k = static_cast<int64_t>(id) - first_layer_;
  if (id < 0 || k < 0 || static_cast<size_t>(k) >= units_.size() || units_[static_cast<size_t>(k)].spec.layer != id) {
    throw Error(fmt::format("internal: no FSDP1 unit {}", id));
  }
  return units_[static_cast<size_t>(k)];
}

void Fsdp1::load(LoadedModel& w, DType model_dtype) {
  if (model_dtype != o_.orig_dtype) {
    throw Error(fmt::format("internal: FSDP1's flat parameters in {} but the model loaded in {}", dtype_name(o_.orig_dtype),
                            dtype_name(model_dtype)));
  }
  // Each unit's _full_param_padded (W x S, param_dtype), the storage the original parameters view while unsharded
  // (use_orig_params: _use_unsharded_views); it has no bytes until the first unshard
  for (Unit& u : units_) {
    const Fsdp1Layout& l = u.spec.layout;
    u.full = e_.empty_unallocated(Shape{l.padded_unsharded_numel}, o_.param_dtype,
                                  bytes_of(Elems(l.padded_unsharded_numel), o_.param_dtype), Category::kFsdpBuffers,
                                  Label{flat_label(u.spec, "unsharded flat parameter"), u.spec.layer, -1});
  }
  // The parameters as the original-parameter views into their unit's flat parameter (no bytes of their own); the
  // model's buffers without bytes until the root unit moves them (below)
  w = load_model(
      e_, inv_, model_dtype,
      [&](size_t i) {
        const TensorRow& r = inv_.parameters[i];
        const Unit& u = units_[static_cast<size_t>(unit_of_[i])];
        unsharded_[i] = e_.parameter_view(u.full, Shape::of(r.shape), static_cast<int32_t>(i),
                                          Label{intern_name(r.name), u.spec.layer, static_cast<int32_t>(i)});
        return unsharded_[i];
      },
      {},
      [&](size_t b) {
        const TensorRow& r = inv_.buffers[b];
        const DType dt = stored_dtype(r, model_dtype);
        return e_.empty_unallocated(Shape::of(r.shape), dt, bytes_of(r.elems, dt), Category::kBuffers,
                                    Label{intern_name(r.name), -1, static_cast<int32_t>(b)});
      });
  w_ = &w;
  // FSDP(model, auto_wrap_policy=...): _recursive_wrap wraps the decoder layers first, then the root; each
  // _init_param_handle_from_module runs _move_module_to_device (the unit's parameters, still on the CPU, moved one
  // by one), then FlatParamHandle: flatten_tensors (torch.cat of the flattened parameters and the padding
  // tensors) into the FlatParameter, the originals becoming views of it (their device copies freed), then shard():
  // _get_shard's chunk.clone() (F.pad only where the chunk is short), and the unsharded storage resized to 0.
  // With sync_module_states, between the move and the flattening: _sync_module_params_and_buffers.
  for (Unit& u : units_) {
    const Fsdp1Layout& l = u.spec.layout;
    // _move_module_to_device walks the unit's modules breadth first (a deque from the unit's module, not into
    // nested FSDP instances), collecting each one's own parameters and buffers, and moves the parameters, then the
    // buffers: a stable sort of the rows by module depth is that order (a layer's norms before its attention and
    // MLP weights; the root's lm_head before the embedding). Measured: the open FSDP1 run's setup, allocation for
    // allocation.
    std::vector<int32_t> bfs = u.spec.rows;
    const auto depth = [this](int32_t r) {
      const std::string& n = inv_.parameters[static_cast<size_t>(r)].name;
      return std::count(n.begin(), n.end(), '.');
    };
    std::stable_sort(bfs.begin(), bfs.end(), [&](int32_t a, int32_t b) { return depth(a) < depth(b); });
    std::vector<T> moved;
    for (int32_t r : bfs) {
      const TensorRow& row = inv_.parameters[static_cast<size_t>(r)];
      moved.push_back(e_.empty(Shape::of(row.shape), model_dtype, Category::kWeights,
                               Label{intern_name(row.name), u.spec.layer, r}));
    }
    // then the buffers of the unit's modules (the root's: those outside every layer)
    for (size_t b = 0; b < inv_.buffers.size(); ++b) {
      if (holds_buffer(u, inv_.buffers[b].name)) e_.resize_storage(w.buffers[b]->storage, true);
    }
    // the Trainer's fsdp_config sync_module_states "true" (training_args.py _process_fsdp_args, fsdp1.cc)
    sync_module_states(u, model_dtype);
    // _construct_padding_tensor: torch.ones(numel) * _FLAT_PARAM_PADDING_VALUE per padding tensor (the alignment
    // paddings and the world-size one); the products live in params_to_flatten until the cat
    std::vector<T> pads;
    uint64_t prev_end = 0;
    auto pad = [&](uint64_t n) {
      T ones = e_.empty(Shape{n}, model_dtype, Category::kTemporaries, Label{"FSDP1 padding tensor (ones)", u.spec.layer, -1});
      pads.push_back(e_.empty(Shape{n}, model_dtype, Category::kTemporaries, Label{"FSDP1 padding tensor", u.spec.layer, -1}));
    };
    for (size_t p = 0; p < l.offsets.size(); ++p) {
      if (l.offsets[p] > prev_end) pad(l.offsets[p] - prev_end);
      prev_end = l.offsets[p] + l.numels[p];
    }
    if (l.unpadded_numel > prev_end) pad(l.unpadded_numel - prev_end);
    T flat = e_.empty(Shape{l.unpadded_numel}, model_dtype, Category::kWeights,
                      Label{flat_label(u.spec, "FlatParameter (unsharded, at wrap)"), u.spec.layer, -1});
    moved.clear();
    pads.clear();
    // _get_shard: chunks[rank].clone(), then F.pad to chunks[0].numel() when short (the last ranks)
    const uint64_t start = l.shard_numel * o_.rank;
    const uint64_t chunk = start >= l.unpadded_numel ? 0 : std::min(l.shard_numel, l.unpadded_numel - start);
    if (chunk < l.shard_numel) {
      T cloned = e_.empty(Shape{chunk}, model_dtype, Category::kTemporaries, Label{"FSDP1 shard clone", u.spec.layer, -1});
      u.local = e_.empty(Shape{l.shard_numel}, model_dtype, Category::kWeights, Label{flat_label(u.spec, "sharded FlatParameter"), u.spec.layer, -1});
    } else {
      u.local = e_.empty(Shape{l.shard_numel}, model_dtype, Category::kWeights, Label{flat_label(u.spec, "sharded FlatParameter"), u.spec.layer, -1});
    }
    flat.reset();  // flat_param._typed_storage()._resize_(0); flat_param.set_(sharded_flat_param)
    // _use_sharded_views: each original parameter a 1-d view of its elements in the shard (none: size 0)
    for (int32_t r : u.spec.rows) {
      const auto i = static_cast<size_t>(r);
      if (in_shard_[i] == 0) continue;
      sharded_view_[i] = e_.view(u.local, Shape{in_shard_[i]}, contiguous_strides(Shape{in_shard_[i]}));
    }
  }
  for (size_t i = 0; i < sharded_view_.size(); ++i) {
    if (sharded_view_[i]) w.params[i] = sharded_view_[i];
  }
}

// Whether unit u's module holds the buffer `name` (a layer unit's name is its module's path; the root holds those
// outside every layer)
bool Fsdp1::holds_buffer(const Unit& u, const std::string& name) const {
  const Unit* owner = nullptr;
  for (const Unit& l : units_) {
    if (l.spec.kind == Fsdp1Unit::kLayer && name.rfind(l.spec.name + ".", 0) == 0) owner = &l;
  }
  return u.spec.kind == Fsdp1Unit::kLayer ? owner == &u : owner == nullptr;
}

// _init_param_handle_from_module -> _sync_module_params_and_buffers(module, managed_params, process_group): the
// module's buffers not yet synced (`if not getattr(buffer, FSDP_SYNCED, False)`: the layers are wrapped first, so
// the root takes the buffers outside every layer), then its managed parameters in named_parameters() order, through
// _sync_params_and_buffers(process_group, module_states, PARAM_BROADCAST_BUCKET_SIZE = 250 MiB, src=0) ->
// dist._broadcast_coalesced. Read in torch 2.x torch/distributed/fsdp/_init_utils.py; measured under a fake process
// group on an H200 (validate/measured/open/h200_hf_dist_fsdp1x8_*.json: a layer's two flats of 384 and 448 MiB, the
// root's [the two rotary buffers, embed_tokens] and [norm, lm_head]).
void Fsdp1::sync_module_states(const Unit& u, DType model_dtype) {
  std::vector<BucketInput> states;
  for (const TensorRow& b : inv_.buffers) {
    if (!holds_buffer(u, b.name)) continue;
    const DType dt = stored_dtype(b, model_dtype);
    states.push_back({static_cast<uint32_t>(states.size()), bytes_of(b.elems, dt).value, dt});
  }
  for (int32_t r : u.spec.rows) {
    const TensorRow& row = inv_.parameters[static_cast<size_t>(r)];
    states.push_back({static_cast<uint32_t>(states.size()), bytes_of(row.elems, model_dtype).value, model_dtype});
  }
  broadcast_coalesced(e_, states, kFsdp1ParamBroadcastBucketBytes, Category::kTemporaries,
                      "FSDP1 sync_module_states broadcast (flat)");
}

// _lazy_init at the root's first forward: _share_state_and_init_handle_attrs runs init_flat_param_attributes for
// the root's handle, then for every other state (_all_fsdp_states: the root, then the layers in module order), on
// the current stream
void Fsdp1::lazy_init() {
  if (lazy_done_) return;
  lazy_done_ = true;
  std::vector<size_t> order{root_};
  for (size_t k = 0; k < units_.size(); ++k) {
    if (k != root_) order.push_back(k);
  }
  for (size_t k : order) {
    Unit& u = units_[k];
    const Fsdp1Layout& l = u.spec.layout;
    if (o_.mixed) {
      // _mp_shard = torch.empty_like(_local_shard, dtype=_fwd_bwd_param_dtype); _free_storage(_mp_shard)
      u.mp = e_.empty(Shape{l.shard_numel}, o_.param_dtype, Category::kFsdpBuffers,
                      Label{flat_label(u.spec, "low-precision shard (_mp_shard)"), u.spec.layer, -1});
      e_.resize_storage(u.mp->storage, false);
    }
    // _full_param_padded = torch.empty(padded_unsharded_numel, dtype=unsharded_param_dtype); _free_storage
    e_.resize_storage(u.full->storage, true);
    e_.resize_storage(u.full->storage, false);
    if (o_.mixed) {
      // _full_prec_full_param_padded = torch.empty(padded_unsharded_numel, dtype=flat_param.dtype); _free_storage
      T full_prec = e_.empty(Shape{l.padded_unsharded_numel}, o_.orig_dtype, Category::kFsdpBuffers,
                             Label{flat_label(u.spec, "full-precision unsharded flat parameter (init)"), u.spec.layer, -1});
    }
  }
}

// _unshard(state, handle, unshard_stream, pre_unshard_stream)
void Fsdp1::unshard(Unit& u) {
  if (u.unsharded) return;  // needs_unshard(): already the padded unsharded size
  if (o_.mixed) {
    // `with stream(pre_unshard_stream): handle.pre_unshard()` -> _use_low_precision_shard: _alloc_storage(_mp_shard),
    // the fp32 shard copied (cast) into it
    const StreamScope pre(e_, Stream::kFsdp1PreUnshard);
    e_.resize_storage(u.mp->storage, true);
  }
  // limit_all_gathers: _free_event_queue.dequeue_if_needed() and event.synchronize() (no allocation)
  {
    // `with stream(unshard_stream): handle.unshard(); handle.post_unshard()`: _alloc_padded_unsharded_flat_param
    // (_full_param_padded resized to W x S), all_gather_into_tensor, then _free_low_precision_sharded_param
    const StreamScope us(e_, Stream::kFsdp1Unshard);
    e_.resize_storage(u.full->storage, true);
    if (o_.mixed) e_.resize_storage(u.mp->storage, false);
  }
  u.unsharded = true;
  // _use_unsharded_flat_param -> _use_unsharded_views: the original parameters view _full_param_padded
  for (int32_t r : u.spec.rows) {
    const auto i = static_cast<size_t>(r);
    w_->params[i] = unsharded_[i];
  }
}

// _reshard(free_unsharded_flat_param=True): FlatParamHandle.reshard -> _free_unsharded_flat_param
// (_no_dispatch_record_stream, _free_storage), then _use_sharded_views
void Fsdp1::reshard(Unit& u) {
  if (!u.unsharded) return;
  e_.resize_storage(u.full->storage, false);
  u.unsharded = false;
  for (int32_t r : u.spec.rows) {
    const auto i = static_cast<size_t>(r);
    if (sharded_view_[i]) w_->params[i] = sharded_view_[i];
  }
}

// An identity over `x` whose backward runs the unit's _pre_backward_hook (a tensor hook on the unit's output): the
// graph position of output.register_hook. It allocates nothing.
T Fsdp1::pre_backward_hook(T x, size_t ui) {
  if (!x || !x->requires_grad || !e_.grad_mode) return x;
  T out = e_.view(x, x.shape(), x->strides);
  e_.record("FSDP1 pre-backward hook", {&x}, {&out}, {}, [this, ui](Engine&, Node&, Grads& g) {
    pre_backward(units_[ui]);
    return Grads{g[0]};
  });
  return out;
}

T Fsdp1::pre_forward(Ctx&, int32_t id, T input) {
  if (id == kFsdpUnitTail || id == kFsdpUnitLmHead) return input;  // inside the root's forward
  Unit& u = unit(id);
  if (id == kFsdpUnitEmbed) {
    // FullyShardedDataParallel.forward of the root: _root_pre_forward (_lazy_init; _reset_flat_param_grad_info_if_needed:
    // a flat gradient whose original parameters' .grad were all set to None is dropped), then _pre_forward's unshard
    lazy_init();
    for (Unit& v : units_) {
      bool none = true;
      for (int32_t r : v.spec.rows) none = none && !e_.grad(r);
      // under no_sync the original parameters' .grad view the kept unsharded gradient (_use_unsharded_grad_views)
      if (none && !v.grad_views) v.saved_grad.reset();
    }
  }
  u.post_backward_done = false;
  u.grads = 0;
  unshard(u);
  // MixedPrecision(cast_forward_inputs=False) for the non-root units: no cast (the root casts only floating inputs;
  // the ids are integers)
  return input;
}

T Fsdp1::post_forward(Ctx&, int32_t id, T output) {
  if (id == kFsdpUnitEmbed || id == kFsdpUnitTail) return output;  // inside the root's forward
  Unit& u = unit(id);
  const auto ui = static_cast<size_t>(&u - units_.data());
  // _post_forward_reshard: FULL_SHARD frees a non-root unit's unsharded flat parameter
  reshard(u);
  u.post_forward_index = static_cast<int64_t>(post_forward_order_.size());  // record_post_forward
  post_forward_order_.push_back(ui);
  // _register_pre_backward_hooks on the output tensors that require grad
  return pre_backward_hook(std::move(output), ui);
}

void Fsdp1::root_post_forward() {
  Unit& u = units_[root_];
  // _post_forward_reshard: "Do not free the root's parameters in the post-forward for FULL_SHARD"
  u.post_forward_index = static_cast<int64_t>(post_forward_order_.size());
  post_forward_order_.push_back(root_);
}

void Fsdp1::root_pre_backward() { pre_backward(units_[root_]); }

// _pre_backward_hook: unshard if needed, then _prefetch_handle(BACKWARD): with BACKWARD_PRE,
// _get_handle_to_prefetch -> get_handle_to_backward_prefetch: handles_post_forward_order[index - 1]
void Fsdp1::pre_backward(Unit& u) {
  unshard(u);
  if (!o_.backward_prefetch || u.post_forward_index <= 0) return;
  Unit& target = units_[post_forward_order_[static_cast<size_t>(u.post_forward_index - 1)]];
  if (!target.post_backward_done) unshard(target);
}

void Fsdp1::grad_ready(int32_t row) {
  Unit& u = units_[static_cast<size_t>(unit_of_[static_cast<size_t>(row)])];
  if (++u.grads < u.spec.rows.size()) return;
  // SplitWithSizesBackward of the views (_get_unflat_views_aligned: torch.split over _numels_with_padding): once the
  // last view's gradient arrives, the flat gradient (the unsharded flat parameter's numel, param_dtype) is the cat
  // of them, and AccumulateGrad makes it flat_param.grad; the views' gradients die with the node's input buffer.
  // (The zeros it cats for the padding slices are below 16 elements each, not simulated.)
  T flat = e_.empty(Shape{u.spec.layout.unpadded_numel}, o_.param_dtype, Category::kFsdpBuffers,
                    Label{flat_label(u.spec, "unsharded flat gradient"), u.spec.layer, -1});
  for (int32_t r : u.spec.rows) e_.grad(r).reset();
  // The FlatParameter's AccumulateGrad (torch/csrc/autograd/functions/accumulate_grad.h accumulateGrad): with no
  // flat_param.grad it takes `flat` as the gradient (stolen: the post-hook's extra reference is expected); with the
  // unsharded gradient a no_sync micro-batch kept, `variable_grad += new_grad` in place (grad mode off in backward),
  // `flat` staying alive until the post hooks return (engine.cpp call_function keeps the inputs for them)
  if (!u.unsharded_grad) u.unsharded_grad = flat;
  // FlatParameter's AccumulateGrad post-hook: _post_backward_hook
  u.post_backward_done = true;
  // _post_backward_reshard: _should_free_in_backward = `state._sync_gradients or handle._sharding_strategy in
  // RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES`: FULL_SHARD frees the unsharded flat parameter under no_sync too
  reshard(u);
  if (!sync_) {
    // `if not state._sync_gradients: if handle._use_orig_params: handle._use_unsharded_grad_views(); return`: the
    // unsharded flat gradient stays in flat_param.grad (param_dtype, the unpadded unsharded numel) until the synced
    // micro-batch reduce-scatters it; _finalize_params leaves it ("Preserve the gradient accumulation state if not
    // synchronizing gradients")
    use_unsharded_grad_views(u);
    return;  // `flat` dies here unless it is the kept gradient
  }
  {
    // `with stream(post_backward_stream)`: the gradient is already reduce_dtype (param_dtype == reduce_dtype in the
    // simulated policies: no .to(reduce_dtype)); _reduce_grad: `unsharded_grad = flat_param.grad.data;
    // flat_param.grad = None` (the accumulated one after no_sync micro-batches), _get_reduce_scatter_tensors pads
    // only when W x chunks[0] exceeds the flat numel (never with use_orig_params' world-size padding),
    // new_sharded_grad = torch.empty_like(chunks[0]); reduce_scatter_tensor
    const StreamScope pb(e_, Stream::kFsdp1PostBackward);
    const Fsdp1Layout& l = u.spec.layout;
    T padded;
    if (l.padded_unsharded_numel > l.unpadded_numel) {
      padded = e_.empty(Shape{l.padded_unsharded_numel}, o_.reduce_dtype, Category::kFsdpBuffers,
                        Label{flat_label(u.spec, "padded unsharded gradient (F.pad)"), u.spec.layer, -1});
    }
    T sharded = e_.empty(Shape{l.shard_numel}, o_.reduce_dtype,
                         o_.reduce_dtype == o_.orig_dtype ? Category::kGradients : Category::kFsdpBuffers,
                         Label{flat_label(u.spec, o_.reduce_dtype == o_.orig_dtype ? "sharded gradient" : "new_sharded_grad"),
                               u.spec.layer, -1});
    // _accumulate_sharded_grad -> _cast_grad_to_param_dtype: `sharded_grad.data = sharded_grad.data.to(param.dtype)`
    // when they differ (the bf16 reduce under an fp32 FlatParameter); the low-precision one freed at return
    if (o_.reduce_dtype != o_.orig_dtype) {
      T cast = e_.empty(Shape{l.shard_numel}, o_.orig_dtype, Category::kGradients,
                        Label{flat_label(u.spec, "sharded gradient"), u.spec.layer, -1});
      sharded = std::move(cast);
    }
    // _saved_grad_shard = sharded_grad: no _saved_grad_shard exists here (prepare_gradient_for_optim deletes it
    // each step, and no_sync micro-batches do not reduce), so the Trainer's accumulation never sums sharded grads
    if (u.saved_grad) throw Error("internal: FSDP1 sharded gradient accumulation outside no_sync is not simulated");
    u.saved_grad = std::move(sharded);
  }
  // _post_reduce_grad_callback -> _use_sharded_grad_views: the original parameters' .grad become views of the
  // sharded gradient (same dtype: no empty_like), dropping their views of the unsharded one; the unsharded gradient
  // (autograd_computed_grad, record_stream'd on the post-backward stream) dies as the hook returns, then `flat`
  u.grad_views = false;
  u.unsharded_grad.reset();
  flat.reset();
}

// FlatParamHandle._use_unsharded_grad_views: each original parameter's .grad a view of flat_param.grad. The
// parameter is the 1-d sharded view (orig dtype, its numel_in_shard) while the view has the original shape and
// param_dtype, so where shape or dtype differ: `if param.grad is None: param.grad = torch.empty_like(param)`, then
// `param.grad.data = view` frees that allocation at once (size 0 for a parameter outside the shard: no bytes).
// Once set, .grad stays (the next no_sync micro-batch and the post-forward reshard reuse it) until the synced
// micro-batch's _use_sharded_grad_views and zero_grad(set_to_none=True).
void Fsdp1::use_unsharded_grad_views(Unit& u) {
  if (u.grad_views) return;
  u.grad_views = true;
  for (int32_t r : u.spec.rows) {
    const auto i = static_cast<size_t>(r);
    const TensorRow& row = inv_.parameters[i];
    const bool same_shape = row.shape.size() == 1 && in_shard_[i] == row.elems.value;
    if (in_shard_[i] == 0 || (same_shape && o_.param_dtype == o_.orig_dtype)) continue;
    T tmp = e_.empty(Shape{in_shard_[i]}, o_.orig_dtype, Category::kTemporaries,
                     Label{"FSDP1 _use_unsharded_grad_views empty_like(param)", u.spec.layer, r});
  }
}

void Fsdp1::final_callback() {
  // _post_backward_final_callback -> _finalize_params: prepare_gradient_for_optim (flat_param.grad =
  // _saved_grad_shard), the original parameters' .grad the sharded views (_use_sharded_grad_views); _catch_all_reshard
  for (Unit& u : units_) {
    if (!u.post_backward_done) throw Error(fmt::format("internal: FSDP1 unit {} got no gradient", u.spec.name));
    reshard(u);
    u.grads = 0;
    // _finalize_params: `if not state._sync_gradients: return` (the unsharded gradient stays in flat_param.grad)
    if (!sync_) continue;
    for (int32_t r : u.spec.rows) {
      const auto i = static_cast<size_t>(r);
      if (in_shard_[i] == 0 || !u.saved_grad) continue;
      e_.grad(r) = e_.view(u.saved_grad, Shape{in_shard_[i]}, contiguous_strides(Shape{in_shard_[i]}));
    }
  }
  post_forward_order_.clear();
}

}  // namespace trainmem::sim
