// FSDP2 per rank in the simulator (fsdp.h). Sources: pytorch/pytorch torch/distributed/fsdp/_fully_shard/
// _fsdp_param_group.py (FSDPParamGroup.unshard, wait_for_unshard, reshard, pre_forward, post_forward,
// pre_backward, post_backward, _backward_prefetch, finalize_backward), _fsdp_collectives.py (foreach_all_gather,
// _get_param_all_gather_inputs, foreach_all_gather_copy_out, foreach_reduce), _fsdp_param.py (FSDPParam:
// init_all_gather_outputs, alloc_all_gather_outputs, to_sharded / free_storage), _fsdp_state.py (FSDPState
// _pre_forward, _post_forward, _pre_backward, _root_post_backward_final_callback).
#include "fsdp.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "trainmem/error.h"

namespace trainmem::sim {

namespace {
// A decoder layer's buffers are named after the layer by the timeline's label (Label::layer); the others carry
// their unit's name.
const char* unit_label(const char* what, const FsdpUnit& u) {
  return u.layer >= 0 ? intern_name(fmt::format("FSDP {}", what)) : intern_name(fmt::format("FSDP {} ({})", what, u.name));
}
}  // namespace

Fsdp2::Fsdp2(Engine& e, const Inventory& inv, const FsdpOptions& o, std::vector<FsdpUnit> units, size_t root)
    : e_(e), inv_(inv), o_(o), root_(root) {
  if (root > kFsdpExtraRoots) {
    throw Error(fmt::format("FSDP2 roots on one rank: at most {} are simulated (each has its own streams)", kFsdpExtraRoots + 1));
  }
  for (FsdpUnit& spec : units) {
    const auto k = static_cast<int64_t>(units_.size());
    if (spec.kind == FsdpUnit::kEmbed) embed_ = k;
    if (spec.kind == FsdpUnit::kTail) tail_ = k;
    if (spec.kind == FsdpUnit::kRoot) root_unit_ = k;
    if (spec.kind == FsdpUnit::kLayer && layer0_ < 0) {
      layer0_ = k;
      first_layer_ = spec.layer;
    }
    Unit& u = units_.emplace_back();
    u.spec = std::move(spec);
  }
  unsharded_.resize(inv.parameters.size());
  sharded_.resize(inv.parameters.size());
  sgrad_.resize(inv.parameters.size());
  accumulated_.resize(inv.parameters.size());
}

// fsdp_units' order (the embedding, decoder layers 0 .. L-1, the tail) or fsdp_stage_units' (a pipeline stage's:
// the embedding on the first, its layers in order, the tail on the last): the layers are consecutive units
Fsdp2::Unit& Fsdp2::unit(int32_t id) {
  Unit* u = nullptr;
  int64_t k = -1;
  if (id == kFsdpUnitEmbed) k = embed_;
  if (id == kFsdpUnitTail) k = tail_;
  if (id == kFsdpUnitRoot) k = root_unit_;
  if (id >= 0 && layer0_ >= 0 && id >= first_layer_) k = layer0_ + (id - first_layer_);
  if (k >= 0 && static_cast<size_t>(k) < units_.size()) u = &units_[static_cast<size_t>(k)];
  const FsdpUnit::Kind want = id == kFsdpUnitEmbed ? FsdpUnit::kEmbed
                              : id == kFsdpUnitTail ? FsdpUnit::kTail
                              : id == kFsdpUnitRoot ? FsdpUnit::kRoot
                                                    : FsdpUnit::kLayer;
  if (!u || u->spec.kind != want || (want == FsdpUnit::kLayer && u->spec.layer != id)) {
    throw Error(fmt::format("internal: no FSDP unit {}", id));
  }
  return *u;
}

void Fsdp2::load(LoadedModel& w, DType buffer_dtype) { load_roots({this}, w, buffer_dtype); }

void Fsdp2::load_roots(const std::vector<Fsdp2*>& roots, LoadedModel& w, DType buffer_dtype) {
  if (roots.empty()) throw Error("internal: no FSDP2 root to load");
  const Inventory& inv = roots.front()->inv_;
  std::vector<std::pair<Fsdp2*, int32_t>> owner(inv.parameters.size(), {nullptr, -1});
  for (Fsdp2* f : roots) {
    for (const Unit& u : f->units_) {
      for (int32_t r : u.spec.rows) owner[static_cast<size_t>(r)] = {f, u.spec.layer};
    }
  }
  // every row is in a unit but fully_shard's ignored ones (QLoRA's uint8 Params4bit), loaded whole
  for (size_t i = 0; i < owner.size(); ++i) {
    if (!owner[i].first && !fsdp_ignored(inv.parameters[i], roots.front()->o_)) throw Error(fmt::format("internal: {} is in no FSDP unit", inv.parameters[i].name));
  }
  // (PEFT's adapters exist before fully_shard, which shards each unit's parameters in named_parameters() order,
  // the adapters beside their base weights: not after every base row)
  // Under accelerate the shards exist before load_model, which then takes them and loads the buffers (the root's
  // fully_shard moves them last); elsewhere load_model makes each shard as it goes.
  // a 4-bit base (QLoRA) is on the GPU before fully_shard: its own sequence (shard_on_device)
  if (roots.size() == 1 && roots.front()->o_.bnb_4bit) {
    roots.front()->shard_on_device(w, buffer_dtype);
    roots.front()->w_ = &w;
    return;
  }
  const bool moved = roots.size() == 1 && roots.front()->o_.move_then_shard;
  std::vector<T> held = moved ? roots.front()->move_then_shard() : std::vector<T>{};
  w = load_model(
      roots.front()->e_, inv, buffer_dtype,
      [&](size_t i) { return moved ? owner[i].first->sharded_[i] : owner[i].first->shard_row(i, owner[i].second); },
      {}, {}, /*adapters_last=*/false);
  held.clear();  // fsdp2_prepare_model returns
  for (Fsdp2* f : roots) f->w_ = &w;
}

// fsdp2_prepare_model's fully_shard calls in wrapping order: the decoder layers (get_module_children_bottom_up),
// the input embedding, the tail [final norm, lm_head], the root (the buffers). Each: _move_states_to_device moves
// the unit's parameters to the device whole (`tensor.data = tensor.to(device)`, in the post-order module walk of
// _get_managed_modules), FSDPParam's _init_sharded_param allocates each padded shard, and the whole copies are
// freed when fully_shard returns ("Let `param_data` be freed normally when its ref count reaches 0 when the
// `fully_shard` call returns"), except the embedding's and the tail's: fsdp2_prepare_model's locals input_weight and
// output_weight (accelerate 16cb6eb utils/fsdp_utils.py, taken before those fully_shard calls) hold the Parameter
// objects whose .data the move replaced, so those copies live until it returns, and the tail's norm with them
// (measured; its holder was not traced). Returns them, for the caller to drop once the buffers are loaded.
// Measured under a fake process group (validate/measured/h200_hf_dist_fsdp2x8_*.json), allocation for allocation:
// a layer's 9 whole parameters, its 9 shards, the 9 freed; the embedding, its shard; the norm, lm_head, their
// shards; the two rotary buffers; then the embedding, lm_head and norm copies freed.
std::vector<const Fsdp2::Unit*> Fsdp2::wrapping_order() const {
  std::vector<const Unit*> order;
  for (const FsdpUnit::Kind k : {FsdpUnit::kLayer, FsdpUnit::kEmbed, FsdpUnit::kTail, FsdpUnit::kRoot}) {
    for (const Unit& u : units_) {
      if (u.spec.kind == k) order.push_back(&u);
    }
  }
  return order;
}

std::vector<T> Fsdp2::move_then_shard() {
  std::vector<T> held;
  for (const Unit* u : wrapping_order()) {
    std::vector<T> whole;
    for (int32_t r : u->spec.rows) {
      const TensorRow& row = inv_.parameters[static_cast<size_t>(r)];
      // the dtype fully_shard receives: accelerate's upcast of the trainable ones (fsdp_param_dtypes)
      whole.push_back(e_.empty(Shape::of(row.shape), fsdp_param_dtypes(row, o_).orig, Category::kWeights,
                               Label{intern_name(fmt::format("{} (whole, before fully_shard)", row.name)), u->spec.layer, r}));
    }
    for (int32_t r : u->spec.rows) shard_row(static_cast<size_t>(r), u->spec.layer);
    // held to the return: the embedding's and the tail's (above); the root's (PEFT's model.norm) too, since the
    // root's fully_shard moves the buffers (load_model, after this) before its shards exist and returns last
    if (u->spec.kind != FsdpUnit::kLayer) {
      for (T& t : whole) held.push_back(std::move(t));
    }
  }
  // freed as the function's frame goes: the embeddings' Parameters (input_weight, output_weight) first
  std::stable_partition(held.begin(), held.end(), [](const T& t) { return t.shape().n == 2; });
  return held;
}

// QLoRA (FsdpOptions::bnb_4bit). from_pretrained quantizes the model onto the rank's GPU (bnb's
// update_device_map: {"": current device}) and get_peft_model adds the adapters there, as without FSDP: every row
// whole, the buffers with them (load_model). accelerate 16cb6eb fsdp2_prepare_model then takes
// `original_sd = model.state_dict()` (after the upcast it skips for a Params4bit model): detached tensors sharing
// every parameter's storage, and per double-quantized Linear4bit one new tensor, QuantState.as_dict(packed=True)'s
// `"nested_quant_map": self.state2.code.clone()` (bitsandbytes functional.py; its other entries share storage or
// are CPU tensors). fully_shard then shards each unit in wrapping order (uint8 Params4bit are ignored_params, left
// as they are; bf16-stored ones are in their layer's unit); _move_states_to_device finds everything on the device (`tensor.to(device)` returns it) and
// _init_sharded_param allocates each padded shard. The whole tensors outlive fully_shard, held by original_sd, a
// local of fsdp2_prepare_model until it returns: CPython clears the frame's locals in co_varnames order, so
// original_sd's entries go first, in state_dict (insertion) order, then input_weight (the input embedding) and
// output_weight (lm_head), whose Parameters those locals also hold.
void Fsdp2::shard_on_device(LoadedModel& w, DType model_dtype) {
  std::vector<T> whole(inv_.parameters.size());
  w = load_model(e_, inv_, model_dtype, [&](size_t i) {
    const TensorRow& r = inv_.parameters[i];
    // fully_shard's ignored_params stay the model's; a row that goes to a unit is a plain tensor here (its
    // Parameter, replaced by fully_shard, is not simulated)
    if (fsdp_ignored(r, o_)) return whole_parameter(e_, inv_, i, model_dtype);
    whole[i] = e_.empty(Shape::of(stored_shape(r)), fsdp_param_dtypes(r, o_).orig, Category::kWeights,
                        Label{intern_name(fmt::format("{} (whole, before fully_shard)", r.name)), -1, static_cast<int32_t>(i)});
    return whole[i];
  });
  // original_sd: state_dict order is the inventory's (each Linear4bit's quant-state entries after its weight)
  std::vector<T> sd;
  for (size_t i = 0; i < inv_.parameters.size(); ++i) {
    const TensorRow& r = inv_.parameters[i];
    if (whole[i]) sd.push_back(whole[i]);
    if (!r.packed_4bit) continue;
    const auto code = w.buffer_row.find(r.name + ".quant_state.state2.code");
    if (code == w.buffer_row.end()) continue;  // not double-quantized: no clone
    const T& src = w.buffers[static_cast<size_t>(code->second)];
    sd.push_back(e_.empty(src.shape(), src.dtype(), Category::kBuffers,
                          Label{intern_name(fmt::format("{}.nested_quant_map (state_dict clone)", r.name)), -1, -1}));
  }
  for (const Unit* u : wrapping_order()) {
    for (int32_t r : u->spec.rows) {
      const auto i = static_cast<size_t>(r);
      w.params[i] = shard_row(i, u->spec.layer);
    }
  }
  // (the embedding unit's one row; lm_head, the tail's: untied, fsdp_units)
  T input_weight = whole[static_cast<size_t>(units_[static_cast<size_t>(embed_)].spec.rows.at(0))];
  T output_weight;
  for (int32_t r : units_[static_cast<size_t>(tail_)].spec.rows) {
    if (inv_.parameters[static_cast<size_t>(r)].name == "lm_head.weight") output_weight = whole[static_cast<size_t>(r)];
  }
  whole.clear();
  for (T& t : sd) t.reset();
  input_weight.reset();
  output_weight.reset();
}

// fully_shard -> FSDPParam._init_sharded_param: the parameter on the device, chunked on dim 0; this rank's chunk
// copied into `padded_sharded_param = param_data.new_zeros(padded_sharded_size)` (_sharded_param_data) and the
// module's parameter replaced by a DTensor over its unpadded view. (The full parameter fully_shard first moves
// to the device, one module at a time: move_then_shard.)
T Fsdp2::shard_row(size_t i, int32_t layer) {
  const TensorRow& r = inv_.parameters[i];
  const FsdpShard sh = fsdp_shard(stored_shape(r), o_.ranks, o_.rank);  // a packed 4-bit row: its storage's
  const FsdpParamDtypes dt = fsdp_param_dtypes(r, o_);  // per parameter: PEFT's float32 adapters on a 16-bit base
  const Label l{intern_name(r.name), layer, static_cast<int32_t>(i)};
  const T data = e_.empty(Shape{sh.padded_numel}, dt.orig, Category::kWeights, l);
  const Shape local = Shape::of(sh.local_shape);
  sharded_[i] = e_.view(data, local, contiguous_strides(local));
  // the unsharded parameter: a view of all_gather_outputs[0] (W x the padded shard, param_dtype), freed until
  // the first all-gather (init_unsharded_param after the first copy-out; free_storage on reshard)
  // (FSDPParam._init_unsharded_param: nn.Parameter(..., requires_grad=self.sharded_param.requires_grad))
  unsharded_[i] = e_.parameter_unallocated(Shape::of(stored_shape(r)), dt.param, static_cast<int32_t>(i),
                                           bytes_of(Elems(sh.unsharded_padded_numel), dt.param),
                                           Category::kFsdpBuffers,
                                           Label{intern_name(fmt::format("{} (FSDP unsharded)", r.name)), layer, -1},
                                           r.trainable);
  return sharded_[i];
}

// _to_unsharded / _to_sharded: _setattr_on_modules swaps the module's parameter
void Fsdp2::set_module_params(const Unit& u, bool unsharded) {
  for (int32_t r : u.spec.rows) {
    const auto i = static_cast<size_t>(r);
    w_->params[i] = unsharded ? unsharded_[i] : sharded_[i];
  }
}

// FSDPParamGroup.unshard -> foreach_all_gather: `if self._all_gather_result is not None: return` (already called)
// and `if self.is_unsharded: return`.
void Fsdp2::unshard(Unit& u) {
  if (u.ag_result || u.unsharded) return;
  // _get_param_all_gather_inputs: with param_dtype set (the foreach-copy fast path) flat_foreach_copy_input =
  // torch.empty(sum of the padded shards' numel, dtype=param_dtype), the shards cast into its splits; without it,
  // the shards themselves (no copy). Per parameter (fsdp_unit_buffers): under LoRA a frozen base row already in
  // param_dtype is no copy-in, and inputs of several dtypes make a uint8 all-gather over their bytes.
  // FSDPCommContext.get_all_gather_streams: unshards in FORWARD and PRE_BACKWARD (the backward prefetch sets
  // PRE_BACKWARD) without async_op run foreach_all_gather `with device_handle.stream(all_gather_copy_in_stream)`:
  // the copy-in and the all-gather output come from that stream's pool
  const StreamScope copy_in_stream(e_, fsdp2_root_stream(Stream::kFsdpAllGatherCopyIn, root_));
  T copy_in = u.spec.copy_in_numel ? e_.empty(Shape{u.spec.copy_in_numel}, u.spec.copy_in_dtype, Category::kFsdpBuffers,
                                              Label{unit_label("all-gather copy-in", u.spec), u.spec.layer, -1})
                                    : T();
  // all_gather_output = torch.empty((all_gather_input_numel * world_size,)); all_gather_copy_in copies the inputs
  // into its narrow(rank) view (no allocation); param_all_gather_inputs dies when foreach_all_gather returns
  u.ag_result = e_.empty(Shape{checked_mul(u.spec.gather_numel, o_.ranks, "FSDP all-gather")}, u.spec.gather_dtype,
                         Category::kFsdpBuffers, Label{unit_label("all-gather output", u.spec), u.spec.layer, -1});
}

// FSDPParamGroup.wait_for_unshard
void Fsdp2::wait_for_unshard(Unit& u) {
  if (!u.ag_result) return;  // `if not self._all_gather_result: return  # no preceding unshard`
  // "implicit prefetch": in forward the previous unit's all-gather output, kept for overlap, is freed first
  if (u.state == State::kForward) ag_state_.reset();
  // foreach_all_gather_copy_out: per parameter init_all_gather_outputs + alloc_all_gather_outputs (the padded
  // unsharded tensor, resized back to full), split_with_sizes_copy into them; init_unsharded_param views them
  for (int32_t r : u.spec.rows) e_.resize_storage(unsharded_[static_cast<size_t>(r)]->storage, true);
  set_module_params(u, true);
  u.unsharded = true;
  // forward (sync): comm_ctx.all_gather_state = AllGatherState(self._all_gather_result, event) until the next
  // unit's wait or the root's post-forward; otherwise freed now (`self._all_gather_result = None`)
  if (u.state == State::kForward) {
    ag_state_ = std::move(u.ag_result);
  } else {
    u.ag_result.reset();
  }
}

// FSDPParamGroup.reshard: in forward only when reshard_after_forward; FSDPParam.to_sharded -> free_storage
// (all_gather_outputs' storage resize_(0))
void Fsdp2::reshard(Unit& u) {
  if (u.state == State::kForward && !u.spec.reshard_after_forward) return;
  if (!u.unsharded) return;
  for (int32_t r : u.spec.rows) e_.resize_storage(unsharded_[static_cast<size_t>(r)]->storage, false);
  set_module_params(u, false);
  u.unsharded = false;
}

// An identity over `x` (when it requires grad) whose backward runs the unit's post_backward (post) or
// pre_backward: the graph position of RegisterPostBackwardFunction and of a tensor hook. It allocates nothing.
T Fsdp2::backward_hook(const char* name, T x, size_t ui, bool post) {
  if (!x || !x->requires_grad || !e_.grad_mode) return x;
  T out = e_.view(x, x.shape(), x->strides);
  e_.record(name, {&x}, {&out}, {}, [this, ui, post](Engine&, Node&, Grads& g) {
    if (post) {
      post_backward(units_[ui]);
    } else {
      pre_backward(units_[ui]);
    }
    return Grads{g[0]};
  });
  return out;
}

T Fsdp2::pre_forward(Ctx& c, int32_t id, T input) {
  // the tail's first module: the final norm, or lm_head alone when the PeftModel's root keeps the norm
  // (fsdp_units): its pre-forward hook (and cast_forward_inputs) fires on lm_head's input, the norm's output
  if (id == kFsdpUnitLmHead) {
    if (!o_.peft) return input;
    id = kFsdpUnitTail;
  } else if (id == kFsdpUnitTail && o_.peft) {
    return input;
  }
  Unit& u = unit(id);
  const auto ui = static_cast<size_t>(&u - units_.data());
  u.state = State::kForward;
  // FSDPState._pre_forward: cast_forward_inputs (MixedPrecisionPolicy's default True) casts floating inputs to
  // param_dtype (_cast_fp_tensor: a no-op when already so)
  if (o_.mixed && input && is_floating(input.dtype()) && input.dtype() != o_.param_dtype) {
    input = to(c, input, o_.param_dtype, "FSDP cast_forward_inputs");
  }
  unshard(u);
  wait_for_unshard(u);
  // _register_post_backward_hook: RegisterPostBackwardFunction.apply(self, *inputs that require grad); its
  // backward runs post_backward once the unit's input gradient is computed
  return backward_hook("FSDP RegisterPostBackwardFunction", std::move(input), ui, true);
}

T Fsdp2::post_forward(Ctx& c, int32_t id, T output) {
  Unit& u = unit(id);
  const auto ui = static_cast<size_t>(&u - units_.data());
  reshard(u);
  // _record_post_forward
  u.post_forward_indices.push_back(post_forward_order_.size());
  post_forward_order_.push_back(ui);
  u.state = State::kIdle;
  // FSDPState._register_pre_backward_hook: output.register_hook(self._pre_backward), run when its gradient is ready
  output = backward_hook("FSDP pre-backward hook", std::move(output), ui, false);
  // MixedPrecisionPolicy.output_dtype (accelerate: bf16): _cast_fp_tensor on the outputs, a no-op when already so
  if (o_.mixed && output && is_floating(output.dtype()) && output.dtype() != o_.param_dtype) {
    output = to(c, output, o_.param_dtype, "FSDP output_dtype cast");
  }
  return output;
}

void Fsdp2::root_post_forward() { ag_state_.reset(); }

// The root's own parameters (PEFT: the final norm, fsdp_units): FSDPState._pre_forward of the root module, the
// first hook of the model's forward, runs FSDPParamGroup.pre_forward (the all-gather, kept in all_gather_state
// until the embedding's wait_for_unshard). The root never reshards after forward (FSDPState._lazy_init) and its
// inputs need no grad, so its post_backward (a reshard: the norm is frozen) waits for the final callback, and its
// pre-backward hook on the loss finds it unsharded, its prefetch target (the tail) too: neither is simulated.
void Fsdp2::root_pre_forward() {
  if (root_unit_ < 0) return;
  Unit& u = units_[static_cast<size_t>(root_unit_)];
  u.state = State::kForward;
  unshard(u);
  wait_for_unshard(u);
  u.state = State::kIdle;
}

// FSDPParamGroup.pre_backward(default_prefetch=True)
void Fsdp2::pre_backward(Unit& u) {
  if (u.state == State::kPreBackward) return;
  u.state = State::kPreBackward;
  unshard(u);  // a no-op if prefetched
  wait_for_unshard(u);
  // _backward_prefetch: the unit before this one in post-forward order, all-gathered now (its copy-out waits for
  // its own pre-backward)
  if (u.post_forward_indices.empty()) return;
  const size_t curr = u.post_forward_indices.back();
  u.post_forward_indices.pop_back();
  if (curr == 0) return;
  Unit& target = units_[post_forward_order_[curr - 1]];
  const State saved = target.state;  // use_training_state(PRE_BACKWARD)
  target.state = State::kPreBackward;
  unshard(target);
  target.state = saved;
}

// FSDPParamGroup.post_backward with reduce_grads (no gradient accumulation): the unsharded gradients taken from
// .grad, the unit resharded, then foreach_reduce.
void Fsdp2::post_backward(Unit& u) {
  u.state = State::kPostBackward;
  // accumulate_unsharded_grad_if_needed: `unsharded_accumulated_grad += unsharded_param.grad` (in place, the
  // reduce dtype promoting the bf16 operand: no temporary) and `unsharded_param.grad = None`
  for (int32_t r : u.spec.rows) {
    const auto i = static_cast<size_t>(r);
    if (accumulated_[i] && e_.grad(r)) e_.grad(r).reset();
  }
  // `if not self.reduce_grads`: reshard (reshard_after_backward) and keep the unsharded .grad, into which the next
  // backward's AccumulateGrad adds in place; to_accumulated_grad_if_needed converts it when reduce_dtype is set
  // and differs from the gradient's (FSDPParam.init_dtype_attrs drops a reduce_dtype equal to param_dtype, so
  // accelerate's policies never convert; torchtitan's bf16 parameters with an fp32 reduce do):
  // `unsharded_accumulated_grad = unsharded_grad.to(self.reduce_dtype)`, the .grad set to None
  if (!reduce_grads_) {
    if (reshard_after_backward_) reshard(u);
    for (int32_t r : u.spec.rows) {
      const auto i = static_cast<size_t>(r);
      T& g = e_.grad(r);
      if (!g || !o_.mixed || g.dtype() == o_.reduce_dtype) continue;
      accumulated_[i] = e_.empty(g.shape(), o_.reduce_dtype, Category::kGradients,
                                 Label{intern_name(fmt::format("{} (FSDP unsharded_accumulated_grad)", inv_.parameters[i].name)),
                                       u.spec.layer, -1});
      g.reset();
    }
    return;
  }
  std::vector<T> grads;
  std::vector<int32_t> with_grad;
  for (int32_t r : u.spec.rows) {
    const auto i = static_cast<size_t>(r);
    T& g = e_.grad(r);
    // "May have an accumulated gradient of the reduce dtype if the previous backward did not reduce-scatter":
    // unsharded_grads.append(unsharded_accumulated_grad_data); unsharded_accumulated_grad = None
    if (accumulated_[i]) {
      grads.push_back(std::move(accumulated_[i]));
      accumulated_[i].reset();
      with_grad.push_back(r);
      continue;
    }
    if (!g) continue;
    grads.push_back(std::move(g));  // unsharded_grads.append(...); unsharded_param.grad = None
    g.reset();
    with_grad.push_back(r);
  }
  reshard(u);
  if (grads.empty()) return;
  // `self.comm_ctx.reduce_scatter_state = None`: the previous unit's reduce-scatter input goes
  rs_state_.reset();
  const DType grad_dtype = grads.front().dtype();
  const DType reduce = o_.mixed ? o_.reduce_dtype : grad_dtype;  // `reduce_dtype = reduce_dtype or grad_dtype`
  // padded_unsharded_sizes: _get_dim0_padded_size per gradient; reduce_scatter_input = empty(sum, reduce_dtype).
  // (A narrowing cast would add a grad_dtype temporary; the resolved policies never narrow: bf16 -> bf16, fp32 ->
  // fp32.) foreach_reduce_scatter_copy_in: chunk_cat into it, then `unsharded_grads.clear()` frees the gradients.
  // (every row of the unit has a gradient in the modelled runs: the unit's padded shard numel, fsdp_units' sum)
  uint64_t n = u.spec.shard_numel;
  if (with_grad.size() != u.spec.rows.size()) {
    n = 0;
    for (int32_t r : with_grad) n = checked_add(n, fsdp_shard(stored_shape(inv_.parameters[static_cast<size_t>(r)]), o_.ranks, o_.rank).padded_numel, "FSDP RS");
  }
  T rs_input = e_.empty(Shape{checked_mul(n, o_.ranks, "FSDP reduce-scatter")}, reduce, Category::kFsdpBuffers,
                        Label{unit_label("reduce-scatter input", u.spec), u.spec.layer, -1});
  grads.clear();
  // reduce_output = empty(reduce_scatter_output_numel, reduce_dtype); grad_output = _to_dtype_if_needed(
  // reduce_output, orig_dtype): a new tensor when they differ, and reduce_output dies when foreach_reduce returns.
  // The sharded gradients are as_strided views of grad_output (unpadded, per parameter).
  // (orig_dtype: the group's _orig_dtype, its trainable parameters': PEFT's float32 adapters on a 16-bit base)
  const bool upcast = reduce != u.spec.grad_orig_dtype;
  // `with device_handle.stream(reduce_scatter_stream): reduce_output = ...allocate(...)`, and the upcast runs
  // `with device_handle.stream(post_reduce_stream)` (the reduce-scatter stream without HSDP): both from that
  // stream's pool, so the sharded gradients' blocks live there until the optimizer frees them
  std::optional<StreamScope> rs_stream(std::in_place, e_, fsdp2_root_stream(Stream::kFsdpReduceScatter, root_));
  T reduce_output = e_.empty(Shape{n}, reduce, upcast ? Category::kFsdpBuffers : Category::kGradients,
                             Label{unit_label(upcast ? (o_.replicate > 1 ? "reduce-scatter output (all-reduced, held to the final callback)"
                                                                         : "reduce-scatter output")
                                                     : "sharded gradients (reduce-scatter output)", u.spec),
                                   u.spec.layer, -1});
  // HSDP (o_.replicate > 1; foreach_reduce's `if all_reduce_group is not None` branch): dist.all_reduce(reduce_output)
  // over the replicate group, in place, `with device_handle.stream(all_reduce_stream)`, and post_reduce_stream =
  // all_reduce_stream, so the upcast below is allocated from that stream's pool. all_reduce_input = reduce_output is
  // returned and kept in FSDPParamGroup._all_reduce_state until the unit's _wait_for_post_backward (its next
  // post_backward, or finalize_backward in the final callback): the reduce-dtype buffer outlives foreach_reduce.
  // (all_reduce_grads False, whose partial_reduce_output accumulates without the all-reduce, is
  // FSDPModule.set_requires_all_reduce(False), which neither accelerate nor torchtitan calls; no_sync (accelerate's,
  // and torch.distributed.pipelining's stage under torchtitan's PP; torchtitan's trainer itself calls none),
  // set_requires_gradient_sync(False), sets reduce_grads and all_reduce_grads False alike: no foreach_reduce at all.)
  if (o_.replicate > 1) {
    rs_stream.reset();
    rs_stream.emplace(e_, fsdp2_root_stream(Stream::kFsdpAllReduce, root_));
  }
  T grad_output = upcast ? e_.empty(Shape{n}, u.spec.grad_orig_dtype, Category::kGradients,
                                    Label{unit_label("sharded gradients (reduce-scatter output upcast)", u.spec), u.spec.layer, -1})
                         : reduce_output;
  rs_stream.reset();
  if (o_.replicate > 1) u.ar_state = reduce_output;
  for (int32_t r : with_grad) {
    const auto i = static_cast<size_t>(r);
    if (sgrad_[i]) continue;  // `sharded_param.grad._local_tensor += new_sharded_grad`: in place
    sgrad_[i] = e_.view(grad_output, sharded_[i].shape(), contiguous_strides(sharded_[i].shape()));
  }
  // comm_ctx.reduce_scatter_state = ReduceScatterState(reduce_scatter_input, event): kept until the next unit's
  // post_backward or the final callback
  rs_state_ = std::move(rs_input);
}

void Fsdp2::final_callback() {
  // all_states in named_modules() order (the embedding first): post_backward where autograd did not run it
  for (Unit& u : units_) {
    if (u.state != State::kPostBackward) post_backward(u);
    u.state = State::kIdle;
    // finalize_backward: _wait_for_post_backward drops HSDP's _all_reduce_state; a mistargeted prefetch's
    // all-gather result is dropped
    u.ar_state.reset();
    u.ag_result.reset();
    u.post_forward_indices.clear();
  }
  post_forward_order_.clear();
  rs_state_.reset();  // the last unit's reduce-scatter state
  // the optimizer, the Trainer's clipping and zero_grad see the sharded parameters' .grad
  for (size_t i = 0; i < sgrad_.size(); ++i) {
    if (sgrad_[i]) e_.grad(static_cast<int32_t>(i)) = std::move(sgrad_[i]);
    sgrad_[i].reset();
  }
}

// Under a pipeline (fsdp.h). Source: torch/distributed/pipelining/stage.py (PyTorch 2.9)
// _PipelineStageBase.backward_maybe_with_nosync's FSDPModule branch and its manual post-backward (in later
// releases _PipelineStageBase._post_backward, run once after the step's last backward: the same calls, at the same
// point for the single-stage schedules simulated here), and _fsdp_state.py FSDPState._pre_backward /
// _root_post_backward_final_callback.
void Fsdp2::pp_begin_backward() {
  reshard_after_backward_ = false;
  reduce_grads_ = false;
}

void Fsdp2::pp_end_backward() {
  // the callback of a backward that is not the last: post_backward where autograd did not run it, states IDLE
  for (Unit& u : units_) {
    if (u.state != State::kPostBackward) post_backward(u);
    u.state = State::kIdle;
  }
}

void Fsdp2::pp_post_backward() {
  reshard_after_backward_ = true;
  reduce_grads_ = true;
  // `for state in fsdp_state._state_ctx.all_states: if state._fsdp_param_group: post_backward()`: all_states in
  // the root's named_modules() order (the embedding, the layers, [norm, output]; the root holds no parameter)
  for (Unit& u : units_) post_backward(u);
  final_callback();
}

// --- memoized pipeline actions (memo.h) ---

Fsdp2::MemoSnapshot Fsdp2::memo_snapshot() const {
  auto id = [](const T& t) { return t ? t->storage : UINT64_MAX; };
  MemoSnapshot m;
  for (const Unit& u : units_) {
    m.state.push_back(static_cast<uint8_t>(u.state));
    m.unsharded.push_back(u.unsharded ? 1 : 0);
    m.ag_result.push_back(id(u.ag_result));
    m.ar_state.push_back(id(u.ar_state));
    m.indices.push_back(u.post_forward_indices);
  }
  m.order = post_forward_order_;
  m.ag_state = id(ag_state_);
  m.rs_state = id(rs_state_);
  m.reduce_grads = reduce_grads_;
  m.reshard_after_backward = reshard_after_backward_;
  for (const T& t : sgrad_) m.sgrad.push_back(id(t));
  for (const T& t : accumulated_) m.accumulated.push_back(id(t));
  return m;
}

void Fsdp2::memo_key(std::vector<uint64_t>& out, bool backward) const {
  out.push_back(units_.size());
  for (const Unit& u : units_) {
    // pre_backward's reading of the indices: none (0); an index with no prefetch to do (1): curr == 0 returns, and
    // a target already unsharded or with an all-gather result makes unshard() return at once (the target's state,
    // set around it, is restored); else 2 + the target unit's index. Only pre_backward reads the indices, and only
    // a backward runs it (the pre-backward hook's node): a forward's key leaves them out (it pushes, whatever the
    // values).
    uint64_t top = 0;
    if (backward && !u.post_forward_indices.empty()) {
      const size_t curr = u.post_forward_indices.back();
      top = 1;
      if (curr != 0) {
        const Unit& target = units_[post_forward_order_[curr - 1]];
        if (!target.ag_result && !target.unsharded) top = 2 + post_forward_order_[curr - 1];
      }
    }
    out.push_back(static_cast<uint64_t>(u.state) | (u.unsharded ? 1u << 8 : 0) | (u.ag_result ? 1u << 9 : 0) |
                  (u.ar_state ? 1u << 10 : 0));
    out.push_back(top);
  }
  out.push_back((ag_state_ ? 1 : 0) | (rs_state_ ? 2 : 0));
  // the pipeline's two flags and, per row, two bits: the sharded gradient and the accumulated unsharded gradient
  // exist (read by post_backward and the final callbacks only: a backward's)
  if (!backward) return;
  out.push_back((reduce_grads_ ? 1 : 0) | (reshard_after_backward_ ? 2 : 0));
  uint64_t word = 0;
  size_t bits = 0;
  for (size_t i = 0; i < sgrad_.size(); ++i) {
    word |= (sgrad_[i] ? uint64_t{1} : 0) << bits;
    word |= (accumulated_[i] ? uint64_t{2} : 0) << bits;
    bits += 2;
    if (bits == 64) {
      out.push_back(word);
      word = 0;
      bits = 0;
    }
  }
  out.push_back(word);
}

std::optional<Fsdp2::MemoDelta> Fsdp2::memo_delta(const MemoSnapshot& b, const MemoSnapshot& a) {
  // handles: the same storages before and after (made, kept or dropped by the action: not memoized)
  if (b.ag_result != a.ag_result || b.ar_state != a.ar_state || b.ag_state != a.ag_state || b.rs_state != a.rs_state ||
      b.sgrad != a.sgrad || b.accumulated != a.accumulated || b.state.size() != a.state.size()) {
    return std::nullopt;
  }
  // the order: extended by a tail
  if (a.order.size() < b.order.size() || !std::equal(b.order.begin(), b.order.end(), a.order.begin())) return std::nullopt;
  MemoDelta d;
  d.state = a.state;
  d.unsharded = a.unsharded;
  d.order_tail.assign(a.order.begin() + static_cast<std::ptrdiff_t>(b.order.size()), a.order.end());
  if (a.reduce_grads != b.reduce_grads) d.reduce_grads = a.reduce_grads ? 1 : 0;
  if (a.reshard_after_backward != b.reshard_after_backward) d.reshard_after_backward = a.reshard_after_backward ? 1 : 0;
  // each unit's indices: its first (size - pops) kept, then the positions of its units in the tail
  for (size_t u = 0; u < b.indices.size(); ++u) {
    std::vector<size_t> pushed;
    for (size_t j = 0; j < d.order_tail.size(); ++j) {
      if (d.order_tail[j] == u) pushed.push_back(b.order.size() + j);
    }
    if (a.indices[u].size() < pushed.size()) return std::nullopt;
    const size_t kept = a.indices[u].size() - pushed.size();
    if (kept > b.indices[u].size()) return std::nullopt;
    if (!std::equal(b.indices[u].begin(), b.indices[u].begin() + static_cast<std::ptrdiff_t>(kept), a.indices[u].begin()) ||
        !std::equal(pushed.begin(), pushed.end(), a.indices[u].begin() + static_cast<std::ptrdiff_t>(kept))) {
      return std::nullopt;
    }
    d.pops.push_back(static_cast<uint32_t>(b.indices[u].size() - kept));
  }
  return d;
}

void Fsdp2::memo_apply(const MemoDelta& d) {
  if (d.state.size() != units_.size()) throw Error("internal: an FSDP2 memo delta of another root");
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    unit.state = static_cast<State>(d.state[u]);
    if (unit.unsharded != (d.unsharded[u] != 0)) {
      unit.unsharded = d.unsharded[u] != 0;
      set_module_params(unit, unit.unsharded);
    }
    for (uint32_t k = 0; k < d.pops[u]; ++k) unit.post_forward_indices.pop_back();
  }
  for (size_t ui : d.order_tail) {
    units_[ui].post_forward_indices.push_back(post_forward_order_.size());
    post_forward_order_.push_back(ui);
  }
  if (d.reduce_grads >= 0) reduce_grads_ = d.reduce_grads != 0;
  if (d.reshard_after_backward >= 0) reshard_after_backward_ = d.reshard_after_backward != 0;
}

}  // namespace trainmem::sim
