// DistributedDataParallel's bucket rules, per rank (ddp.h). Sources: pytorch/pytorch
// torch/nn/parallel/distributed.py (DistributedDataParallel.__init__, _ddp_init_helper),
// torch/csrc/distributed/c10d/reducer.cpp (compute_bucket_assignment_by_size, rebuild_buckets,
// initialize_buckets, should_rebuild_buckets), and the scripts that construct DDP.
#include "trainmem/ddp.h"

#include <fmt/format.h>

#include <algorithm>

#include "trainmem/error.h"
#include "trainmem/sim.h"

namespace trainmem {

namespace {
constexpr NameRow<Sharding> kShardings[] = {
    {Sharding::kDdp, "ddp", "DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets"},
    {Sharding::kFsdp1, "fsdp1", "FullyShardedDataParallel (a FlatParameter per unit) under accelerate (fsdp1.h)"},
    {Sharding::kFsdp2, "fsdp2", "fully_shard (per-parameter DTensor shards) under accelerate (fsdp.h)"},
    {Sharding::kZero1, "zero1", "DeepSpeed ZeRO stage 1: optimizer state partitioned (zero.h)"},
    {Sharding::kZero2, "zero2", "DeepSpeed ZeRO stage 2: optimizer state and gradients partitioned (zero.h)"},
    {Sharding::kZero3, "zero3", "DeepSpeed ZeRO stage 3: parameters, gradients and optimizer state partitioned (zero.h)"},
};
}  // namespace

std::span<const NameRow<Sharding>> name_table(Sharding) { return kShardings; }

DdpOptions resolve_ddp(const TrainSetup& s, LoopKind loop, TorchVersion torch) {
  DdpOptions d;
  if (s.dp <= 1) return d;
  if (s.task != Task::kTrain) {
    throw FieldError("dp", fmt::format("{}: data parallelism is simulated for training (DDP's gradient buckets); "
                                       "for --task inference each rank holds an independent replica: use --dp 1",
                                       s.dp));
  }
  // DeepSpeed ZeRO stages 1 and 2: resolve_zero (zero.cc)
  if (s.sharding == Sharding::kZero1 || s.sharding == Sharding::kZero2 || s.sharding == Sharding::kZero3) return d;
  if (s.sharding == Sharding::kFsdp2) return d;  // fully_shard: resolve_fsdp (fsdp.cc)
  if (s.sharding == Sharding::kFsdp1) return d;  // FullyShardedDataParallel: resolve_fsdp1 (fsdp1.cc)
  if (s.sharding != Sharding::kDdp) {
    throw FieldError("sharding", fmt::format("{}: not simulated yet (ddp, fsdp1, fsdp2, zero1, zero2 and zero3 are)", name_of(s.sharding)));
  }
  if (loop == LoopKind::kSeed000) {
    throw FieldError("loop", "seed000: DDP is not simulated for the seed 000 fork (its zero_grad(set_to_none=False) "
                             "keeps gradients that gradient_as_bucket_view and the bucket rebuild would alias)");
  }
  if (s.optimizer_in_backward) {
    throw FieldError("optimizer_in_backward", "true: with DDP the optimizer runs in DDP's comm hook "
                                              "(_apply_optim_in_backward_hook), which is not simulated");
  }
  d.on = true;
  d.ranks = s.dp;
  // distributed.py __init__: bucket_cap_mb=None means 25 and bucket_bytes_cap_default = True;
  // self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024). The Trainer passes bucket_cap_mb only when
  // TrainingArguments.ddp_bucket_cap_mb is set (trainer.py _wrap_model); nanoGPT's train.py calls
  // DDP(model, device_ids=[ddp_local_rank]) with the defaults.
  const double mb = s.bucket_cap_mb.value_or(kDdpDefaultBucketCapMb);
  if (!(mb * 1024 * 1024 >= 1) || mb > 1024 * 1024) {  // set_field refuses these too; a front end may not use it
    throw FieldError("bucket_cap_mb", fmt::format("{}: expected a decimal size in MiB from 1/1048576 (one byte) to "
                                                  "1048576, like 25 or 0.5", mb));
  }
  d.bucket_bytes = static_cast<uint64_t>(mb * 1024 * 1024);  // Python's int() truncates
  // the Reducer's first_bucket_bytes_cap (_ddp_init_helper): dist._DEFAULT_FIRST_BUCKET_BYTES when
  // bucket_cap_mb is left at its default, bucket_bytes_cap when the caller gives one (torch 2.x; torch 1.13's
  // _ddp_init_helper passes dist._DEFAULT_FIRST_BUCKET_BYTES always)
  // The Trainer hands its kwargs to accelerate's DistributedDataParallelKwargs, whose to_kwargs() passes only the
  // values that differ from the dataclass's defaults (bucket_cap_mb: int = 25): a Trainer's 25 reaches DDP as
  // "not given" (accelerate utils/dataclasses.py KwargsHandler.to_kwargs)
  const bool cap_default = !s.bucket_cap_mb.has_value() || (loop == LoopKind::kHf && mb == kDdpDefaultBucketCapMb);
  d.first_bucket_bytes = cap_default || torch < TorchVersion{2, 0} ? kDdpDefaultFirstBucketBytes : d.bucket_bytes;
  // gradient_as_bucket_view: DDP's default False; neither nanoGPT nor the Trainer passes it (_wrap_model sets
  // accelerator.ddp_handler = DistributedDataParallelKwargs(**kwargs) with find_unused_parameters, bucket_cap_mb
  // and broadcast_buffers only; the dataclass's default is False): true simulates a script that passes it
  d.bucket_view = s.gradient_as_bucket_view.value_or(false);
  // find_unused_parameters: DDP's default False (nanoGPT, plain scripts). The Trainer (_wrap_model):
  //   if self.args.ddp_find_unused_parameters is not None: ... = self.args.ddp_find_unused_parameters
  //   elif isinstance(model, PreTrainedModel): ... = not model.is_gradient_checkpointing
  //   else: kwargs["find_unused_parameters"] = True
  // A LoRA model is peft's PeftModel, not a PreTrainedModel: True.
  const bool trainer_default = s.lora.on || s.checkpointing == Checkpointing::kNone;
  d.find_unused = s.find_unused_parameters.value_or(loop == LoopKind::kHf && trainer_default);
  if (d.find_unused && s.checkpointing != Checkpointing::kNone && s.checkpoint_reentrant.value_or(false)) {
    // reentrant checkpointing runs each layer's forward again inside backward: DDP's autograd hooks then mark
    // its parameters ready twice, and the Reducer raises "Expected to mark a variable ready only once"
    throw FieldError(s.find_unused_parameters ? "find_unused_parameters" : "checkpoint_reentrant",
                     fmt::format("true: DDP with find_unused_parameters=True{} and reentrant checkpointing fails "
                                 "in backward (\"Expected to mark a variable ready only once\"); use "
                                 "--checkpoint-reentrant false or --find-unused-parameters false",
                                 s.find_unused_parameters ? "" : " (the Trainer's default for a LoRA model)"));
  }
  // reducer.h should_rebuild_buckets: (static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_
  d.rebuild = !d.find_unused;
  return d;
}

std::vector<DdpBucket> assign_buckets(const std::vector<BucketInput>& tensors, const std::vector<uint64_t>& limits,
                                      bool in_given_order) {
  if (limits.empty()) throw Error("internal: DDP bucket assignment without a size limit");
  struct Open {
    DdpBucket b;
    size_t limit = 0;  // index into limits (bucket_size_limit_iterators)
  };
  std::vector<DdpBucket> closed;
  std::vector<Open> open;  // per dtype, in order of first appearance
  for (const BucketInput& t : tensors) {
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) { return o.b.dtype == t.dtype; });
    if (it == open.end()) {
      open.push_back(Open{DdpBucket{{}, 0, t.dtype}, 0});
      it = open.end() - 1;
    }
    it->b.indices.push_back(t.index);
    it->b.bytes = checked_add(it->b.bytes, t.bytes, "DDP bucket bytes");
    // `if (bucket.size >= bucket_size_limit)`: close it and advance to the next limit (the last repeats)
    if (it->b.bytes >= limits[it->limit]) {
      closed.push_back(std::move(it->b));
      it->b = DdpBucket{{}, 0, t.dtype};
      if (it->limit + 1 < limits.size()) ++it->limit;
    }
  }
  // "Add remaining buckets" (an unordered_map over dtype and device in c10d: its order across dtypes is the
  // hash's; here, first appearance)
  for (Open& o : open) {
    if (!o.b.indices.empty()) closed.push_back(std::move(o.b));
  }
  if (!in_given_order) {
    // "sort resulting buckets by the minimum tensor index they include"
    std::stable_sort(closed.begin(), closed.end(), [](const DdpBucket& a, const DdpBucket& b) {
      return *std::min_element(a.indices.begin(), a.indices.end()) <
             *std::min_element(b.indices.begin(), b.indices.end());
    });
  }
  return closed;
}

}  // namespace trainmem
