// FSDP1's flat-parameter arithmetic and the Trainer's wrapping policy, per rank (fsdp1.h). Sources: pytorch/pytorch
// torch/distributed/fsdp/_flat_param.py (FlatParamHandle.__init__, _init_flat_param_and_metadata, flatten_tensors,
// shard, _get_unpadded_shard, _get_shard, _get_shard_metadata, init_flat_param_attributes, _get_aligned_numel),
// _runtime_utils.py, _init_utils.py; read through the index at commits fe03cf6 (_flat_param.py) and the 2.x
// _runtime_utils.py with PEP 585 annotations (FSDP1 is in maintenance: the same buffers since 2.1).
// huggingface/accelerate 16cb6eb (1.15.0.dev0) utils/dataclasses.py FullyShardedDataParallelPlugin,
// accelerator.py prepare_model (the FSDP1 branch), state.py; huggingface/transformers 5.x training_args.py
// TrainingArguments._process_fsdp_args (the fsdp_config defaults for version 1).
#include "trainmem/fsdp1.h"

#include "trainmem/fsdp.h"

#include <fmt/format.h>

#include <tuple>

#include "../families/registry.h"
#include "trainmem/error.h"
#include "trainmem/model.h"
#include "trainmem/sim.h"

namespace trainmem {

Fsdp1Options resolve_fsdp1(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch) {
  const auto refuse = [](const char* field, const std::string& what) { throw FieldError(field, what); };
  const bool wanted = s.dp > 1 && s.sharding == Sharding::kFsdp1;
  if (!wanted && s.backward_prefetch_pre) {
    refuse("fsdp1_prefetch", "FSDP1's setting: it takes --dp N (N > 1) with --sharding fsdp1");
  }
  if (!wanted) return Fsdp1Options{};
  if (s.task != Task::kTrain) refuse("task", "FSDP1 is simulated for training");
  if (loop != LoopKind::kHf) {
    refuse("loop", fmt::format("{}: FSDP1 is simulated as the transformers Trainer runs it through accelerate "
                               "(--loop hf, fsdp_config version 1)", name_of(loop)));
  }
  // _flat_param.py's FlatParamHandle (use_orig_params alignment padding, _get_aligned_numel) as in PyTorch >= 2.1
  if (torch < TorchVersion{2, 1}) {
    refuse("torch", fmt::format("{}: FSDP1 is simulated as PyTorch >= 2.1 runs it (use_orig_params' alignment "
                                "padding, _flat_param.py)", torch_version_name(torch)));
  }
  // The root unit's forward hooks sit in the llama family's program (kFsdpUnitEmbed / kFsdpUnitTail), the
  // decoder layers' in run_layers (src/sim/layers.h); the other rules FSDP2 shares (fsdp.cc)
  refuse_under_accelerate_fsdp(s, m, "FSDP1", "fsdp1", "FullyShardedDataParallel");
  if (m.embed.tied) {
    refuse("sharding", "fsdp1: tied input/output embeddings (one shared parameter in the root FlatParameter) are not "
                       "simulated");
  }
  if (s.loss != LossKind::kCe) refuse("loss", "FSDP1 is simulated with transformers' cross-entropy (--loss ce)");
  if (s.lora.on) refuse("lora", "LoRA under FSDP1 is not simulated (mixed requires_grad within a FlatParameter)");
  if (s.input_require_grads.value_or(false)) refuse("input_require_grads", "true: not simulated under FSDP1");
  // --checkpointing full and --grad-accum N are simulated (src/sim/fsdp1.cc). The Trainer's gradient_checkpointing
  // (transformers trainer.py: model.gradient_checkpointing_enable) makes each decoder layer a GradientCheckpointingLayer
  // whose __call__ checkpoints the layer INSIDE its FullyShardedDataParallel wrapper, so FSDP's forward hooks are not
  // part of the recompute; reentrant or not (--checkpoint-reentrant), the unit's _pre_backward_hook has unsharded the
  // FlatParameter before the recompute runs. fsdp_config's activation_checkpointing (accelerate accelerator.py
  // prepare_model: apply_activation_checkpointing with checkpoint_wrapper, CheckpointImpl.NO_REENTRANT, around the
  // decoder layer inside its FSDP unit) runs the same recompute as --checkpointing full --checkpoint-reentrant false;
  // the Trainer refuses both at once (trainer.py create_accelerator_and_postprocess: "can't be set to True
  // simultaneously").
  if (s.checkpointing == Checkpointing::kSelective) {
    refuse("checkpointing", "selective: under FSDP1 the Trainer checkpoints whole decoder layers (gradient_checkpointing, "
                            "or fsdp_config's activation_checkpointing): use full");
  }
  // --grad-accum N: the Trainer runs every micro-batch but the last under accelerator.no_sync (FSDP1's no_sync:
  // _sync_gradients False), which keeps each unit's unsharded flat gradient between micro-batches (Fsdp1::set_sync).
  if (s.tp > 1 || s.pp > 1 || s.cp > 1 || s.ep > 1) {
    refuse("sharding", "fsdp1 with tensor, pipeline, context or expert parallelism is not simulated (fsdp2 composes "
                       "with --tp and --pp)");
  }
  if (s.reshard_after_forward) {
    refuse("reshard_after_forward", "an FSDP2 setting; FSDP1 is simulated with the Trainer's FULL_SHARD");
  }
  Fsdp1Options f;
  f.on = true;
  f.ranks = s.dp;
  // --dp-rank: the rank whose shards are simulated (validate_setup checked it; rank 0 unless given: it holds full
  // chunks of parameters, the world-size padding sits at the end, on the last ranks)
  f.rank = s.dp_rank.value_or(0);
  // training_args.py _process_fsdp_args, version 1: reshard_after_forward "full_shard" (accelerate:
  // ShardingStrategy.FULL_SHARD), forward_prefetch "false", backward_prefetch "NO_PREFETCH" (the plugin's
  // __post_init__ turns it into None), use_orig_params "true", sync_module_states "true"; limit_all_gathers only
  // when given (the plugin's default True). The rate limiter only makes the CPU wait on GPU events: with frees
  // replayed where the program makes them (allocator.h), it changes no allocation.
  f.use_orig_params = true;
  f.backward_prefetch = s.backward_prefetch_pre.value_or(false);
  // bf16=True is accelerate's mixed_precision "bf16": AcceleratorState calls fsdp_plugin.set_mixed_precision,
  // MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16); prepare_model upcasts every
  // low-precision FlatParameter to float32 ("we follow DeepSpeed's strategy to hold the parameters in full
  // precision") and still wraps the forward in autocast (native_amp). mixed_precision "no": no MixedPrecision.
  const FsdpDtypes d = accelerate_fsdp_dtypes(s.precision, "FSDP1");
  std::tie(f.orig_dtype, f.param_dtype, f.reduce_dtype, f.mixed) = std::tuple(d.orig, d.param, d.reduce, d.mixed);
  return f;
}

uint64_t fsdp1_aligned_numel(DType unsharded_dtype) {
  // _get_aligned_numel: "NOTE: This alignment constraint comes from TorchInductor." ALIGNMENT = 16  # bytes
  return 16 / itemsize(unsharded_dtype);
}

Fsdp1Layout fsdp1_layout(const std::vector<uint64_t>& numels, uint64_t aligned, uint64_t ranks) {
  if (numels.empty()) throw Error("internal: an FSDP1 FlatParameter of no parameters");  // "Expects non-empty `params`"
  if (ranks == 0) throw Error("internal: FSDP1 over no ranks");
  Fsdp1Layout l;
  uint64_t total = 0;
  for (uint64_t n : numels) {
    // _init_flat_param_and_metadata: before each parameter, `numel_to_pad = aligned_numel - (total_numel %
    // aligned_numel)`, a padding tensor when 0 < numel_to_pad < aligned_numel
    if (aligned > 0) {
      const uint64_t pad = aligned - total % aligned;
      if (pad > 0 && pad < aligned) {
        l.align_padding = checked_add(l.align_padding, pad, "FSDP1 flat parameter");
        total = checked_add(total, pad, "FSDP1 flat parameter");
      }
    }
    l.offsets.push_back(total);
    l.numels.push_back(n);
    total = checked_add(total, n, "FSDP1 flat parameter");
    l.params = checked_add(l.params, n, "FSDP1 flat parameter");
  }
  if (aligned > 0) {
    // "Pad to be divisible by world size to avoid a copy for the post-backward reduce-scatter": a padding tensor
    // of world_size - total % world_size when that is below world_size, flattened into the FlatParameter
    const uint64_t pad = ranks - total % ranks;
    if (pad > 0 && pad < ranks) {
      l.world_padding = pad;
      total = checked_add(total, pad, "FSDP1 flat parameter");
    }
  }
  // FlatParameter._init_metadata: _unpadded_unsharded_size = the flattened size (with the padding tensors above)
  l.unpadded_numel = total;
  // shard -> _get_shard: chunks = flatten(tensor).chunk(world_size); numel_to_pad = chunks[0].numel() -
  // chunk.numel(); F.pad: every rank's shard has chunks[0].numel() = ceil(total / W) elements
  l.shard_numel = ceil_div(total, ranks);
  // init_flat_param_attributes: padded_unsharded_numel = flat_param.numel() * world_size
  l.padded_unsharded_numel = checked_mul(l.shard_numel, ranks, "FSDP1 flat parameter");
  if (aligned == 0) l.world_padding = l.padded_unsharded_numel - total;
  return l;
}

uint64_t fsdp1_numel_in_shard(const Fsdp1Layout& l, size_t p, uint64_t rank) {
  // _get_shard_metadata: the rank's [start, end] = [S * rank, S * (rank + 1) - 1] intersected with the parameter's
  // [offset, offset + numel - 1]
  const uint64_t start = checked_mul(l.shard_numel, rank, "FSDP1 shard");
  const uint64_t end = checked_add(start, l.shard_numel, "FSDP1 shard");
  const uint64_t a = l.offsets.at(p), b = a + l.numels.at(p);
  const uint64_t lo = std::max(a, start), hi = std::min(b, end);
  return hi > lo ? hi - lo : 0;
}

std::vector<Fsdp1Unit> fsdp1_units(const ModelSpec& m, const Inventory& inv, const Fsdp1Options& o) {
  const FamilyDescriptor& fd = family_descriptor(m.family);
  // accelerate's set_auto_wrap_policy: transformer_auto_wrap_policy over model._no_split_modules (the decoder layer
  // class); _recursive_wrap wraps the children bottom-up, each decoder layer its own FullyShardedDataParallel, then
  // FSDP(model) takes what is left: its FlatParameter flattens the remaining parameters in named_modules() order
  // (model.embed_tokens, model.norm, lm_head)
  std::vector<Fsdp1Unit> layers(m.layers);
  for (uint64_t l = 0; l < m.layers; ++l) {
    layers[l].kind = Fsdp1Unit::kLayer;
    layers[l].layer = static_cast<int32_t>(l);
    layers[l].name = fmt::format("{}.{}", fd.layer_prefix, l);
  }
  Fsdp1Unit root;
  root.kind = Fsdp1Unit::kRoot;
  root.name = "model (root)";
  const std::string prefix = std::string(fd.layer_prefix) + ".";
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    const std::string& n = inv.parameters[i].name;
    Fsdp1Unit* u = &root;
    if (n.rfind(prefix, 0) == 0) {
      const uint64_t l = std::stoull(n.substr(prefix.size()));
      if (l >= m.layers) throw Error(fmt::format("internal: {} is past the model's {} layers", n, m.layers));
      u = &layers[l];
    }
    u->rows.push_back(static_cast<int32_t>(i));
  }
  // use_orig_params=True: align_addresses, _aligned_numel = _get_aligned_numel(_fwd_bwd_param_dtype)
  const uint64_t aligned = o.use_orig_params ? fsdp1_aligned_numel(o.param_dtype) : 0;
  std::vector<Fsdp1Unit> units;
  auto finish = [&](Fsdp1Unit& u) {
    if (u.rows.empty()) throw Error(fmt::format("internal: FSDP1 unit {} has no parameters", u.name));
    std::vector<uint64_t> numels;
    for (int32_t r : u.rows) numels.push_back(inv.parameters[static_cast<size_t>(r)].elems.value);
    u.layout = fsdp1_layout(numels, aligned, o.ranks);
    units.push_back(std::move(u));
  };
  for (Fsdp1Unit& u : layers) finish(u);
  finish(root);
  return units;
}

}  // namespace trainmem
