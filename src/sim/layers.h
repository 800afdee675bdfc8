// The layer seam: every forward program runs its stack of layers through run_layers(), so a per-layer policy
// (activation checkpointing here; later FSDP's all-gather before a layer and reshard after it, offload) has
// exactly one place to hook in, instead of one copy of the loop per family.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "ops.h"

namespace trainmem::sim {

// What a decoder layer takes besides the hidden state: the attention mask, the rotary cos/sin and the
// position ids (empty handles when the model has none). Most transformers models pass them as keyword
// arguments; under gradient checkpointing those ride in the checkpoint's functools.partial, which keeps them
// alive until the layer's backward (GradientCheckpointingLayer.__call__), and only the hidden state is a
// checkpoint input. Arguments passed positionally are checkpoint inputs too, saved by the checkpoint.
struct LayerArgs {
  T mask;
  T cos, sin;
  T position;                       // position_ids, or GPT-2's cache_position (its storage)
  bool positional = false;          // mask and position are positional arguments (GPT-2's block call)
};

// One layer: the next hidden state from this one.
using LayerFn = std::function<T(uint64_t layer, T hidden, const LayerArgs& args)>;

// torch.utils.checkpoint.checkpoint(layer, hidden, use_reentrant=True): CheckpointFunction (checkpoint.py).
// Forward under no_grad, saving only the input; its backward detaches the input, runs the layer again with
// grad and the forward's autocast state, and runs torch.autograd.backward on the recomputed output inside the
// outer backward.
T checkpoint_reentrant(Ctx& c, uint64_t l, T hidden, const LayerArgs& args, std::shared_ptr<const LayerFn> fn);
// checkpoint(..., use_reentrant=False), PyTorch >= 2.1 (_checkpoint_without_reentrant_generator): forward with
// grad, every tensor the region would save replaced by a holder; the first unpack in backward runs the layer
// again and keeps the tensors it saves (stopping once all are recomputed: early_stop=True); each is owned by
// the node that unpacks it and freed when that node is done.
T checkpoint_non_reentrant(Ctx& c, uint64_t l, T hidden, const LayerArgs& args, std::shared_ptr<const LayerFn> fn);

// FSDP2's hooks around a unit that is not a decoder layer (the embedding, the tail [final norm, lm_head]):
// `x` unchanged without --sharding fsdp2.
inline T fsdp_pre_forward(Ctx& c, int32_t unit, T x) { return c.fsdp ? c.fsdp->pre_forward(c, unit, std::move(x)) : x; }
inline T fsdp_post_forward(Ctx& c, int32_t unit, T x) { return c.fsdp ? c.fsdp->post_forward(c, unit, std::move(x)) : x; }

// hidden = layer(l, hidden) for l in 0..layers-1, with c.layer naming the layer for the timeline's labels.
// `layer` takes the hidden state by value and returns the next one: the caller's variable is rebound to the
// result, as `hidden = decoder_layer(hidden)` rebinds it in the modeling code. The caller's variable holds the
// input while the layer runs (a copy is passed, not the caller's reference), so it is released only when the
// layer returns, unless autograd saved it. That matters under no_grad (inference, a reentrant checkpoint's
// first forward), where nothing else keeps it (found by the CPU oracle's inference timeline). The layers that
// c.checkpoint selects run checkpointed.
template <typename F, typename ArgsOf>
T run_layers_with(Ctx& c, uint64_t layers, T hidden, ArgsOf&& args_of, F&& layer) {
  std::shared_ptr<const LayerFn> fn;  // made once, when a layer is checkpointed
  for (uint64_t l = c.pp.begin; l < layers && l < c.pp.end; ++l) {  // a pipeline stage's layers (Ctx::pp)
    c.layer = static_cast<int32_t>(l);
    const LayerArgs& args = args_of(l);
    // FSDP2: the decoder layer's fully_shard pre-forward hook (unshard; RegisterPostBackwardFunction on the input)
    if (c.fsdp) hidden = c.fsdp->pre_forward(c, c.layer, std::move(hidden));
    const CheckpointPolicy& p = c.checkpoint;
    if (p.mode != CheckpointPolicy::kNone && l % p.every == 0 && c.e.grad_mode) {
      if (!fn) fn = std::make_shared<const LayerFn>(layer);
      hidden = p.reentrant ? checkpoint_reentrant(c, l, hidden, args, fn) : checkpoint_non_reentrant(c, l, hidden, args, fn);
    } else {
      hidden = layer(l, hidden, args);
    }
    // FSDP2's post-forward hook (reshard; the pre-backward hook on the output). Outside the checkpoint here, inside
    // it in transformers (GradientCheckpointingLayer checkpoints nn.Module.__call__): the same order, as the hooks
    // are skipped in the recompute (FSDPState._pre_forward/_post_forward return early in PRE_BACKWARD) and
    // RegisterPostBackwardFunction saves nothing.
    if (c.fsdp) hidden = c.fsdp->post_forward(c, c.layer, std::move(hidden));
  }
  c.layer = -1;
  return hidden;
}

template <typename F>
T run_layers(Ctx& c, uint64_t layers, T hidden, const LayerArgs& args, F&& layer) {
  return run_layers_with(c, layers, std::move(hidden), [&](uint64_t) -> const LayerArgs& { return args; }, layer);
}

// run_layers() where layers take different arguments (Gemma3: a sliding layer gets the sliding-window mask and the
// local rotary table, a full layer the causal mask and the global one): layer l gets args[l] (one per layer).
template <typename F>
T run_layers(Ctx& c, uint64_t layers, T hidden, const std::vector<LayerArgs>& args, F&& layer) {
  return run_layers_with(c, layers, std::move(hidden), [&](uint64_t l) -> const LayerArgs& { return args.at(l); },
                         layer);
}

}  // namespace trainmem::sim
