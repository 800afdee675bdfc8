// DeepSpeed ZeRO stage 1/2's partition arithmetic, per rank (zero.h). Source: deepspeedai/DeepSpeed edaa722
// (0.19.6): deepspeed/runtime/zero/stage_1_and_2.py (DeepSpeedZeroOptimizer.__init__,
// get_data_parallel_partitions, get_partition_info, initialize_gradient_partition, average_tensor,
// allreduce_and_scatter), runtime/zero/config.py (DeepSpeedZeroConfig), runtime/engine.py
// (_do_optimizer_sanity_check, get_data_types, _configure_zero_optimizer), runtime/utils.py
// (align_dense_tensors).
#include "trainmem/zero.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "trainmem/error.h"
#include "trainmem/sim.h"

namespace trainmem {

ZeroOptions resolve_zero(const TrainSetup& s, LoopKind loop, TorchVersion torch) {
  ZeroOptions z;
  const bool zero = s.sharding == Sharding::kZero1 || s.sharding == Sharding::kZero2 || s.sharding == Sharding::kZero3;
  if (s.dp <= 1 || !zero) {
    if (s.reduce_bucket_size || s.overlap_comm || s.offload_optimizer || s.offload_params ||
        s.param_persistence_threshold || s.prefetch_bucket_size || s.max_live_parameters || s.max_reuse_distance) {
      const char* f = s.reduce_bucket_size ? "reduce_bucket_size" : s.overlap_comm ? "overlap_comm"
                      : s.param_persistence_threshold ? "param_persistence_threshold"
                      : s.prefetch_bucket_size ? "prefetch_bucket_size" : s.max_live_parameters ? "max_live_parameters"
                      : s.max_reuse_distance ? "max_reuse_distance" : "offload";
      throw FieldError(f, "DeepSpeed ZeRO's setting: it takes --dp N (N > 1) with --sharding zero1, zero2 or zero3");
    }
    return z;
  }
  if (s.offload_params && s.sharding != Sharding::kZero3) {
    // offload_config.py DeepSpeedZeroOffloadParamConfig: "Valid only with stage 3."
    throw FieldError("offload", "params: parameter offload (offload_param) is valid only with --sharding zero3");
  }
  for (const auto& [f, v] : {std::pair{"param_persistence_threshold", &s.param_persistence_threshold},
                             std::pair{"prefetch_bucket_size", &s.prefetch_bucket_size},
                             std::pair{"max_live_parameters", &s.max_live_parameters},
                             std::pair{"max_reuse_distance", &s.max_reuse_distance}}) {
    if (*v && s.sharding != Sharding::kZero3) throw FieldError(f, "a ZeRO-3 setting: it takes --sharding zero3");
  }
  // engine._do_optimizer_sanity_check: bf16 with fp32 gradient accumulation at stage 1 (no offload) goes to
  // BF16_Optimizer (runtime/bf16_optimizer.py, not simulated); with the default grad_accum_dtype (None: the
  // model dtype, engine.get_data_types) stages 1 and 2 run DeepSpeedZeroOptimizer (partition_grads = stage 2).
  if (loop != LoopKind::kHf) {
    throw FieldError("loop", fmt::format("{}: DeepSpeed ZeRO is simulated as the transformers Trainer runs it "
                                         "(--loop hf, a DeepSpeed config with zero_optimization.stage 2)",
                                         name_of(loop)));
  }
  // The Trainer's "auto" bf16 follows --bf16; DeepSpeed's engine then casts the parameters (not the buffers)
  // to bfloat16 (engine._configure_distributed_model -> _cast_module_mixed_precision) and runs no autocast:
  // the forward and backward are pure bf16, the fp32 master partition lives in the ZeRO optimizer. That is
  // this simulator's --precision bf16 (model.to(bfloat16)), less the buffers (left fp32 by DeepSpeed: small).
  if (s.precision != Precision::kBf16) {
    throw FieldError("precision", fmt::format(
        "{}: under DeepSpeed (bf16: {{enabled: true}}) the engine casts the model's parameters to bfloat16 and keeps "
        "fp32 master partitions in the ZeRO optimizer: use --precision bf16 (fp16 with its loss scaler and fp32 "
        "ZeRO are not simulated)", name_of(s.precision)));
  }
  if (s.optimizer != Optimizer::kAdamW && s.optimizer != Optimizer::kAdam) {
    throw FieldError("optimizer", fmt::format("{}: ZeRO is simulated with the Trainer's torch AdamW/Adam over the "
                                              "fp32 partitions (ZERO_SUPPORTED_OPTIMIZERS)", name_of(s.optimizer)));
  }
  if (s.optimizer_in_backward) {
    throw FieldError("optimizer_in_backward", "true: DeepSpeed's ZeRO optimizer steps its fp32 partitions itself");
  }
  if (s.quant.type != Quantize::kNone) {
    throw FieldError("quant", "quantized base weights are not simulated under DeepSpeed ZeRO");
  }
  if (s.lora.on) {
    // engine._cast_module_mixed_precision casts every floating parameter to bf16 (`if p.is_floating_point() and
    // p.dtype != param_dtype: p.data = p.data.to(param_dtype)`), PEFT's float32 adapters included, before the
    // module moves to the device: not the adapters this simulator loads
    throw FieldError("lora", "LoRA under DeepSpeed ZeRO is not simulated yet (the engine casts PEFT's float32 "
                             "adapters to bf16 before the model reaches the device)");
  }
  // the DDP settings shape DistributedDataParallel's Reducer, which a DeepSpeed engine does not build
  const auto not_ddp = [&](const char* field, const std::string& value) {
    throw FieldError(field, fmt::format("{}: a DDP setting; --sharding {} runs DeepSpeed's engine, which builds no DDP "
                                        "Reducer", value, name_of(s.sharding)));
  };
  if (s.bucket_cap_mb) not_ddp("bucket_cap_mb", fmt::format("{}", *s.bucket_cap_mb));
  if (s.gradient_as_bucket_view) not_ddp("gradient_as_bucket_view", *s.gradient_as_bucket_view ? "true" : "false");
  if (s.find_unused_parameters) not_ddp("find_unused_parameters", *s.find_unused_parameters ? "true" : "false");
  // DeepSpeed 0.19.6's requirements/requirements.txt: torch>=2.0.0
  if (torch < TorchVersion{2, 0}) {
    throw FieldError("torch", fmt::format("{}: DeepSpeed 0.19.6 requires torch >= 2.0.0", torch_version_name(torch)));
  }
  z.on = true;
  z.stage = s.sharding == Sharding::kZero1 ? 1 : s.sharding == Sharding::kZero2 ? 2 : 3;
  z.offload_optimizer = s.offload_optimizer;
  z.offload_params = s.offload_params;
  // ZeRO-3 (stage3.py DeepSpeedZeroOptimizer_Stage3) and offload: settings as DeepSpeedZeroConfig's defaults
  // (zero.h), the persistence threshold as given. The Trainer's "auto" values (transformers integrations/
  // deepspeed.py and accelerate: reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
  // stage3_param_persistence_threshold = 10*h) apply to configs that say "auto": pass them with
  // --reduce-bucket-size, --param-persistence-threshold and --prefetch-bucket-size.
  z.param_persistence_threshold = s.param_persistence_threshold.value_or(kZero3DefaultPersistenceThreshold);
  z.model_persistence_threshold = kZero3DefaultModelPersistence;
  z.prefetch_bucket_elems = s.prefetch_bucket_size.value_or(kZero3DefaultPrefetchElems);
  z.max_live_parameters = s.max_live_parameters.value_or(kZero3DefaultMaxLive);
  z.max_reuse_distance = s.max_reuse_distance.value_or(kZero3DefaultMaxReuse);
  z.sub_group_size = kZero3DefaultSubGroupSize;
  if (z.offload_optimizer && z.stage < 3) {
    // stage_1_and_2.py's cpu_offload path (async_accumulate_grad_in_cpu_via_gpu, the pinned
    // accumulated_grads_in_cpu and the CPU fp32 partitions) is not simulated yet
    throw FieldError("offload", fmt::format("optimizer: ZeRO-{} optimizer offload is not simulated yet (zero3 is)", z.stage));
  }
  if (z.stage == 3 && s.task != Task::kTrain) {
    throw FieldError("sharding", "zero3: DeepSpeed ZeRO-3 is simulated for training (--task train)");
  }
  // With offload_optimizer the Trainer's own torch optimizer is refused by the engine (_configure_basic_optimizer:
  // zero_force_ds_cpu_optimizer, default True, raises ZeRORuntimeException for a client optimizer that is not
  // DeepSpeedCPUAdam): the config's "optimizer" section (AdamW) makes DeepSpeedCPUAdam, whose state
  // (ops/adam/cpu_adam.py: exp_avg, exp_avg_sq = torch.zeros_like(p.data)) lives beside the CPU fp32 partitions.
  if (z.offload_optimizer && s.optimizer != Optimizer::kAdamW && s.optimizer != Optimizer::kAdam) {
    throw FieldError("optimizer", "offload_optimizer runs DeepSpeedCPUAdam: use adamw or adam");
  }
  if (z.stage == 3 && s.grad_accum > 1) {
    // partition_grads accumulates micro-batches into grad_partitions_flat_buffer in place (add_); the offload
    // path's round trip through a device copy (cuda_grad_buffer) is not simulated: refused rather than guessed
    if (z.offload_optimizer) {
      throw FieldError("grad_accum", fmt::format("{}: gradient accumulation with ZeRO-3 optimizer offload is not "
                                                 "simulated yet", s.grad_accum));
    }
  }
  z.ranks = s.dp;
  // --dp-rank: the rank whose partitions are simulated (validate_setup checked it; estimate picks the worst when
  // it is not given)
  z.rank = s.dp_rank.value_or(0);
  // reduce_bucket_size: DeepSpeedZeroConfig's Field(pp_int(5e8)) when the config leaves it out. The Trainer's
  // "auto" (transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize:
  // hidden_size * hidden_size) applies only to configs that say "auto": pass --reduce-bucket-size for those.
  z.reduce_bucket_elems = s.reduce_bucket_size.value_or(kZeroDefaultBucketElems);
  if (z.reduce_bucket_elems == 0) throw FieldError("reduce_bucket_size", "0: expected a positive element count");
  z.allgather_bucket_elems = kZeroDefaultBucketElems;
  // overlap_comm: None resolves to False below stage 3 (config.py overlap_comm_valid), True at stage 3. Stage 3
  // has one IPG buffer per communication dtype whatever overlap_comm says (stage3.py _setup_for_real_optimizer);
  // overlap_comm there only picks the reduce stream.
  z.overlap_comm = s.overlap_comm.value_or(z.stage == 3);
  return z;
}

ZeroGroupLayout zero_group_layout(const std::vector<uint64_t>& numels, uint64_t dp, uint64_t rank) {
  if (dp == 0 || rank >= dp) throw Error("internal: ZeRO layout for a rank outside the world");
  ZeroGroupLayout g;
  for (uint64_t n : numels) g.numel = checked_add(g.numel, n, "ZeRO group elements");
  // __init__: alignment = nccl_start_alignment_factor * world_size; flatten_dense_tensors_aligned pads the list
  // with zeros(alignment - numel % alignment) (utils.align_dense_tensors) before flattening
  const uint64_t alignment = checked_mul(kZeroNcclStartAlignment, dp, "ZeRO alignment");
  g.aligned_numel = checked_mul(ceil_div(g.numel, alignment), alignment, "ZeRO flat buffer elements");
  // get_data_parallel_partitions: base_size = numel // dp, the first numel % dp partitions one larger; the
  // alignment makes them equal. partition_size = len(bit16_groups_flat[i]) / dp.
  g.partition_size = g.aligned_numel / dp;
  const uint64_t start_index = g.partition_size * rank, end_index = start_index + g.partition_size;
  // groups_padding: the part of this rank's partition past the group's real elements
  if (g.numel <= start_index) {
    g.padding = g.partition_size;
  } else if (g.numel < end_index) {
    g.padding = end_index - g.numel;
  }
  uint64_t current = 0;
  for (size_t k = 0; k < numels.size(); ++k) {
    ZeroParamPlace p;
    p.start = current;
    p.numel = numels[k];
    // get_partition_info: in this rank's partition if it starts inside it, or if it straddles its start
    // (then first_offset = start_index - current_index); boundary parameters count in full
    if (start_index <= current && current < end_index) {
      g.in_partition.push_back(static_cast<uint32_t>(k));
      g.in_partition_numel += p.numel;
    } else if (current < start_index && start_index < current + p.numel) {
      g.in_partition.push_back(static_cast<uint32_t>(k));
      g.in_partition_numel += p.numel;
      g.first_offset = start_index - current;
    }
    // initialize_gradient_partition, for every partition id: the same two tests, with grad_start_offset 0 or
    // (partition start - current_index)
    // Partitions before current / partition_size end at or before `current` and match neither test, and the
    // walk stops at the first partition that starts past the parameter: the same set in O(partitions spanned),
    // not O(world size) per parameter (--dp up to 2^20 over thousands of parameters stays within milliseconds).
    for (uint64_t pid = g.partition_size == 0 ? dp : current / g.partition_size; pid < dp; ++pid) {
      const uint64_t ps = g.partition_size * pid, pe = ps + g.partition_size;
      if (ps <= current && current < pe) {
        p.partitions.push_back(static_cast<uint32_t>(pid));
        p.offsets.push_back(0);
      } else if (current < ps && ps < current + p.numel) {
        p.partitions.push_back(static_cast<uint32_t>(pid));
        p.offsets.push_back(ps - current);
      } else if (ps >= current + p.numel) {
        break;
      }
    }
    current += p.numel;
    g.places.push_back(std::move(p));
  }
  return g;
}

std::vector<uint64_t> zero_partition_slices(const ZeroGroupLayout& g, std::vector<uint64_t>* pad) {
  std::vector<uint64_t> out;
  if (pad) pad->clear();
  // `if len(tensor_list) == 0: zero_buffer = torch.zeros(int(partition_size), ...)`
  if (g.in_partition.empty()) {
    out.push_back(g.partition_size);
    if (pad) pad->push_back(g.partition_size);
    return out;
  }
  uint64_t current = 0;
  for (size_t k = 0; k < g.in_partition.size(); ++k) {
    uint64_t n = g.places[g.in_partition[k]].numel;
    if (k == 0 && g.first_offset > 0) n -= g.first_offset;  // `if i == 0 and first_offset > 0`
    n = std::min(n, g.partition_size - current);              // `if num_elements > (partition_size - current_size)`
    out.push_back(n);
    current += n;
  }
  // "this means its the last partition and does not align with the dp boundary. We need to pad"
  if (current < g.partition_size) {
    out.push_back(g.partition_size - current);
    if (pad) pad->push_back(g.partition_size - current);
  }
  return out;
}

std::vector<uint64_t> zero_bucket_slices(const std::vector<const ZeroParamPlace*>& bucket) {
  // average_tensor: for each (param) of bucket.params, partition_ids_w_offsets sorted by offset; the slice of
  // partition idx runs to the next one's offset (the last to param.numel()); a slice merges into the previous
  // one when `partition_id == prev_id` (same process group and copy ranks without MoE or Muon)
  std::vector<uint64_t> out;
  int64_t prev = -1;
  for (const ZeroParamPlace* p : bucket) {
    std::vector<std::pair<uint64_t, uint32_t>> by_offset;
    for (size_t k = 0; k < p->partitions.size(); ++k) by_offset.push_back({p->offsets[k], p->partitions[k]});
    std::sort(by_offset.begin(), by_offset.end());
    for (size_t k = 0; k < by_offset.size(); ++k) {
      const uint64_t end = k + 1 == by_offset.size() ? p->numel : by_offset[k + 1].first;
      const uint64_t numel = end - by_offset[k].first;
      if (static_cast<int64_t>(by_offset[k].second) == prev && !out.empty()) {
        out.back() += numel;
      } else {
        out.push_back(numel);
      }
      prev = by_offset[k].second;
    }
  }
  return out;
}

std::vector<uint64_t> zero_reduce_flat_allocs(const std::vector<uint64_t>& slices, uint64_t reduce_bucket_elems) {
  // average_tensor with use_multi_rank_bucket_allreduce (DeepSpeedZeroConfig default True) puts every slice in
  // one ("allreduce", group) bucket -> allreduce_and_scatter: small_bucket.append(tensor); numel += tensor.numel(); `if numel > numel_per_bucket`:
  // allreduce_and_copy_with_multiple_ranks (allreduce_bucket: tensor = self.flatten(bucket)) and restart; the
  // rest after the loop
  std::vector<uint64_t> out;
  uint64_t numel = 0, count = 0;
  auto flush = [&] {
    out.push_back(count > 1 ? numel : 0);
    numel = 0;
    count = 0;
  };
  for (uint64_t n : slices) {
    numel += n;
    ++count;
    if (numel > reduce_bucket_elems) flush();
  }
  if (count > 0) flush();
  return out;
}

std::vector<std::vector<int32_t>> zero_param_groups(const Inventory& inv) {
  std::vector<int32_t> decay, rest;
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    if (!inv.parameters[i].trainable) continue;  // `if param.requires_grad`
    (in_decay_group(inv.parameters[i]) ? decay : rest).push_back(static_cast<int32_t>(i));
  }
  std::vector<std::vector<int32_t>> groups;
  for (std::vector<int32_t>* g : {&decay, &rest}) {
    if (!g->empty()) groups.push_back(std::move(*g));
  }
  return groups;
}

std::vector<std::vector<uint64_t>> zero_group_numels(const Inventory& inv) {
  std::vector<std::vector<uint64_t>> out;
  for (const std::vector<int32_t>& rows : zero_param_groups(inv)) {
    out.emplace_back();
    for (int32_t row : rows) out.back().push_back(inv.parameters[static_cast<size_t>(row)].elems.value);
  }
  return out;
}

ZeroFullestRank zero_fullest_rank(const std::vector<std::vector<uint64_t>>& groups, uint64_t dp) {
  if (dp == 0) throw Error("internal: ZeRO partitions over an empty world");
  // per rank, the sum over groups of in_partition_numel: each parameter counts for the partition it starts in and
  // for every partition whose start lies inside it (get_partition_info's two tests), O(parameters + dp) in all
  std::vector<uint64_t> held(dp, 0);
  for (const std::vector<uint64_t>& numels : groups) {
    const ZeroGroupLayout g = zero_group_layout(numels, dp, 0);
    uint64_t current = 0;
    for (uint64_t n : numels) {
      for (uint64_t pid = current / g.partition_size; pid < dp && (pid == current / g.partition_size ||
                                                                   g.partition_size * pid < current + n); ++pid) {
        held[pid] = checked_add(held[pid], n, "ZeRO partition elements");
      }
      current += n;
    }
  }
  ZeroFullestRank f;
  for (uint64_t r = 0; r < dp; ++r) {
    if (held[r] > f.in_partition_numel) f = {r, held[r]};
  }
  return f;
}

std::vector<ZeroRankClass> zero_rank_classes(const std::vector<std::vector<uint64_t>>& groups, uint64_t dp) {
  if (dp == 0 || dp > kZeroRanksSearched) throw Error("internal: ZeRO rank classes over too many ranks");
  std::map<std::vector<uint64_t>, size_t> seen;
  std::vector<ZeroRankClass> out;
  for (uint64_t r = 0; r < dp; ++r) {
    std::vector<uint64_t> key;
    uint64_t held = 0;
    for (const std::vector<uint64_t>& numels : groups) {
      const ZeroGroupLayout g = zero_group_layout(numels, dp, r);
      key.insert(key.end(), g.in_partition.begin(), g.in_partition.end());
      key.push_back(UINT64_MAX);  // (positions are below it: a separator)
      const std::vector<uint64_t> slices = zero_partition_slices(g);
      key.insert(key.end(), slices.begin(), slices.end());
      key.push_back(UINT64_MAX);
      held = checked_add(held, g.in_partition_numel, "ZeRO partition elements");
    }
    auto [it, fresh] = seen.emplace(std::move(key), out.size());
    if (fresh) out.push_back({r, 0, held});
    ++out[it->second].ranks;
  }
  std::stable_sort(out.begin(), out.end(), [](const ZeroRankClass& a, const ZeroRankClass& b) {
    return a.in_partition_numel > b.in_partition_numel;
  });
  return out;
}

// --- ZeRO-3 -----------------------------------------------------------------------------------------------

uint64_t zero3_padding(uint64_t numel, uint64_t world) {
  if (world == 0) throw Error("internal: ZeRO-3 partition over an empty world");
  // partition_parameters.py _padding_size: remainder = ds_numel % world; (world - remainder) if remainder else 0
  const uint64_t remainder = numel % world;
  return remainder ? world - remainder : 0;
}

uint64_t zero3_partition_numel(uint64_t numel, uint64_t world) {
  // _partition_param: tensor_size = self._aligned_size(param) (ds_numel + _padding_size);
  // partition_size = tensor_size // self._partition_world_size(param)
  return checked_add(numel, zero3_padding(numel, world), "ZeRO-3 aligned size") / world;
}

std::vector<char> zero3_persistent(const std::vector<uint64_t>& numels, uint64_t param_threshold,
                                   uint64_t model_threshold) {
  std::vector<char> out(numels.size(), 0);
  uint64_t total = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    // `if param.ds_numel + total_persistent_parameters > model_threshold: continue`
    if (numels[i] > model_threshold || total > model_threshold - numels[i]) continue;
    // `if param.ds_numel <= param_threshold: param.ds_persist = True; total += param.ds_numel`
    if (numels[i] <= param_threshold) {
      out[i] = 1;
      total += numels[i];
    }
  }
  return out;
}

std::vector<uint64_t> zero3_sub_groups(const std::vector<uint64_t>& partition_numels, uint64_t sub_group_size) {
  uint64_t total = 0;
  for (uint64_t n : partition_numels) total = checked_add(total, n, "ZeRO-3 group elements");
  // `if sub_group_size is None or sub_group_size >= params_group_numel: return [params_group]`
  if (sub_group_size >= total) return {total};
  std::vector<uint64_t> out;
  uint64_t local = 0;
  for (size_t i = 0; i < partition_numels.size(); ++i) {
    local += partition_numels[i];
    // `if local_sub_group_size >= sub_group_size or id(param) == id(params_group[-1])`
    if (local >= sub_group_size || i + 1 == partition_numels.size()) {
      out.push_back(local);
      local = 0;
    }
  }
  return out;
}

uint64_t zero3_reduce_scatter_flat(const std::vector<uint64_t>& numels, uint64_t world) {
  // `if len(tensors) == 1 and tensors[0].numel() % world_sz == 0: tensor_partition_flat_buffer = tensors[0].view(-1)`
  if (numels.size() == 1 && numels[0] % world == 0) return 0;
  // else torch.cat of every rank's chunk of every tensor, each padded to ceil(numel / world)
  uint64_t per_rank = 0;
  for (uint64_t n : numels) per_rank = checked_add(per_rank, ceil_div(n, world), "ZeRO-3 reduce-scatter");
  return checked_mul(per_rank, world, "ZeRO-3 reduce-scatter buffer");
}

}  // namespace trainmem
