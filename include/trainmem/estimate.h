// estimate(): the memory of a training step, component by component, from the step simulator (sim.h).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "trainmem/allocator.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/scenario.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"
#include "trainmem/units.h"
#include "trainmem/zero.h"
#include "trainmem/fsdp.h"
#include "trainmem/fsdp1.h"

namespace trainmem {

// One line of the breakdown at the peak; the peak is the sum of the components.
struct Component {
  std::string name;
  Bytes bytes;
  std::string note;  // what it is
};

// A tensor live at some moment, for explaining a peak or an out-of-memory.
struct LiveTensor {
  std::string name;  // "h.11.attn softmax", "transformer.wte.weight"
  Category category = Category::kActivations;
  Bytes bytes;       // requested
  Bytes block;       // block size in the caching allocator
};

// Whether the step fits the GPU, and if not, the out-of-memory it would hit.
struct DeviceVerdict {
  std::string gpu;
  Bytes capacity;      // the CUDA runtime total (torch.cuda.get_device_properties().total_memory)
  Bytes context;       // held outside the caching allocator (CUDA context, kernels)
  NcclLedger nccl;     // NCCL's communicators' buffers, outside the caching allocator too (nccl.h)
  Bytes margin;        // kept free on purpose (trainmem fit's safety margin; 0 for estimate)
  Bytes usable;        // capacity - context - NCCL - margin: what the caching allocator can reserve
  bool fits = true;
  Bytes peak_reserved;   // max_memory_reserved on this device: below the unlimited figure when the allocator
                         // had to release its cache to satisfy a request
  Bytes unlimited_peak_reserved;  // max_memory_reserved on a device without limit (Estimate::peak_reserved)
  uint64_t alloc_retries = 0;  // num_alloc_retries: cudaMalloc failures answered by releasing the cache
  int64_t headroom = 0;  // usable - peak reserved on this device; when it does not fit, -Oom::short_by
  struct Oom {
    size_t event = 0;
    Phase phase = Phase::kForward;
    uint32_t step = 0, micro = 0;
    std::string tensor;  // the tensor whose allocation fails
    Category category = Category::kActivations;
    Bytes requested, segment;  // its bytes and the segment cudaMalloc was asked for
    Bytes allocated, reserved;  // allocator state at that moment (after releasing its cache)
    Bytes overflow;             // reserved + segment - usable
    Bytes short_by;             // at least this much more would be needed: max(overflow, peak allocated - usable)
    std::vector<LiveTensor> live;  // the largest live tensors at that moment
    Bytes live_total;
    std::array<Bytes, kCategoryCount> live_by_category{};  // all live tensors then, by category
  };
  std::optional<Oom> oom;
  // What nvidia-smi would show for this process: reserved on this GPU plus the context when the step fits;
  // when it does not, what the step would need (reserved without a limit plus the context), which is more
  // than the card has.
  Bytes device_total;
};

// What the model state and one batch take, exact from the inventory and the setup (requested bytes).
struct StateBytes {
  Elems parameters, trainable;
  Bytes weights;            // parameters only, in their storage dtype
  Bytes buffers;            // registered buffers (after model.to(dtype) for cast precisions)
  Bytes gradients;          // one .grad per trainable parameter, in the parameter dtype
  Bytes optimizer_state;    // state tensors on the device (moments, momentum, fused `step` scalars)
  Bytes optimizer_moments;  // of which exp_avg/exp_avg_sq or momentum_buffer
  Bytes optimizer_steps;    // of which `step` scalars (device tensors only with fused/capturable)
  Bytes paged_optimizer_state;  // bitsandbytes' paged states: cudaMallocManaged memory, outside the caching
                                // allocator (not in memory_allocated), but what nvidia-smi counts while resident
  Bytes inputs;             // one micro-batch of input ids and targets
};

// The simulated step's tensors (requested bytes): what autograd keeps, and what is live at the peak.
struct PeakBreakdown {
  Bytes saved_activations;  // storages autograd holds at the end of forward, each once, excluding
                            // parameters (FSDP's unsharded ones too), buffers and storages resized to 0
  Bytes activations;        // at the peak: everything but weights, buffers, gradients, optimizer state,
                            // inputs and workspaces
  Bytes live_total;         // the highest total of live tensors: the sum of the components
  Phase phase = Phase::kForward;
  uint32_t step = 0, micro = 0;
  std::vector<Component> components;  // live at the peak, summing to live_total
};

// The caching allocator replayed over the step without a device limit (block and segment sizes).
struct AllocatorFigures {
  Bytes steady_state;            // memory_allocated() just before the last simulated step's forward
  Bytes steady_state_reserved;   // memory_reserved() then
  Bytes after_forward;           // memory_allocated() after the last step's (last micro-batch's) forward and
                                 // loss, before backward
  Bytes after_forward_reserved;  // memory_reserved() then
  Bytes peak_allocated;          // max_memory_allocated()
  Bytes peak_reserved;           // max_memory_reserved()
  Bytes fragmentation;           // peak_reserved - peak_allocated: cached but unallocated at the reserved peak
  uint64_t segments = 0;         // cudaMalloc segments at the reserved peak
};

// --generate: the KV cache and the two phases of generate() (the prompt's forward, then one forward per new
// token), from the simulated run.
struct GenerationFigures {
  uint64_t new_tokens = 0;        // max_new_tokens
  uint64_t cached_tokens = 0;     // in the cache at the end: the prompt and every new token but the last
  Bytes kv_per_token;             // what one more token of the batch adds to the cache: keys and values, every layer
  Bytes kv_cache_end;             // the cache at the end (requested bytes)
  Bytes prefill_peak_allocated;   // max memory_allocated() over the prefill
  Bytes decode_peak_allocated;    // max memory_allocated() over the decode steps (0 with one new token)
  Bytes end_allocated, end_reserved;  // memory_allocated() and memory_reserved() at the end, the cache still held
};

// --dp N with DDP: one rank's DistributedDataParallel, as simulated (ddp.h).
struct DdpFigures {
  uint64_t ranks = 1;
  uint64_t bucket_cap_bytes = 0, first_bucket_cap_bytes = 0;
  bool gradient_as_bucket_view = false, find_unused_parameters = false;
  std::vector<uint64_t> initial_buckets;  // bytes per bucket at construction, in the Reducer's order
  std::vector<uint64_t> rebuilt_buckets;  // after the rebuild (empty when the Reducer does not rebuild)
  // the DDP parameter indices (positions among the trainable parameters) of each bucket, as above
  std::vector<std::vector<uint32_t>> initial_params, rebuilt_params;
  bool rebuilds = false;     // Reducer::should_rebuild_buckets: (static_graph || !find_unused_parameters)
  uint32_t rebuild_step = 0;  // the step whose forward rebuilt them; 0: none simulated (--steps 1)
};

// --dp N --sharding zero1|zero2: one rank of DeepSpeed ZeRO stage 1 or 2 under the Trainer, as simulated (zero.h).
struct ZeroFigures {
  ZeroOptions options;  // the resolved settings (resolve_zero)
  // per parameter group (the Trainer's decay / no-decay groups): elements, the aligned flat buffer, the
  // partition, and this rank's params_in_partition (boundary parameters in full)
  std::vector<uint64_t> group_numel, group_aligned, group_partition, group_in_partition;
  Bytes bit16_flat;          // bit16_groups_flat: every rank's full bf16 copy
  Bytes fp32_master;         // single_partition_of_fp32_groups
  Bytes optimizer_state;     // the optimizer's state over the fp32 partitions
  Bytes grads_in_partition;  // the bf16 partition gradients held from the backward to the step
  Bytes full_grads;          // stage 1: the full bf16 .grad of every parameter, until the boundary's reduction
  Bytes ipg_buffers;         // buf_0 (+ buf_1), allocated per backward
  Bytes fp32_grad;           // single_grad_partition at the step (transient, the largest group)
  Bytes deepspeed_estimate;  // estimate_zero2_model_states_mem_needs (no offload): 2P + int(18P / N)
  ZeroFullestRank fullest;    // stages 1/2: the rank whose params_in_partition hold the most
  // Stages 1/2 without --dp-rank: each class of alike ranks (zero_rank_classes) simulated, fullest first, at most
  // kZeroRanksSimulated of them; this estimate is the worst one's (as PpFigures::worst names it). Empty when
  // --dp-rank named the rank or dp is beyond kZeroRanksSearched (then the fullest).
  struct RankRow {
    uint64_t rank = 0, ranks = 0, in_partition_numel = 0;
    Bytes peak_allocated, peak_reserved;
    bool fits = true;
  };
  std::vector<RankRow> rank_rows;
  uint64_t rank_classes = 0;  // classes in all (those past kZeroRanksSimulated not simulated)
  size_t worst = 0;           // index in rank_rows
  // --- ZeRO-3 (stage 3) and offload: this rank's model states where DeepSpeed puts them ---
  uint64_t persistent_params = 0, persistent_numel = 0;  // mark_persistent_parameters
  uint64_t partition_padding = 0;    // elements of padding in this rank's ds_tensors (the last rank's, summed)
  uint64_t largest_param = 0;        // the largest parameter's elements (its gathered buffer: padded to the world)
  Bytes lp_partitions;               // lp_param_buffer + frozen ds_tensors (device, or host with offload params)
  Bytes persistent_full;             // the persistent parameters' full data: from the second forward on, kept
                                     // gathered through each forward and backward (released at the step)
  Bytes grad_partitions;             // grad_partitions_flat_buffer (device, or host with offload optimizer)
  Bytes fp32_partitions;             // fp32_partitioned_groups_flat (device, or host with offload optimizer)
  Bytes fp32_grad_buffers;           // offload: each sub-group's pinned fp32 .grad buffer (host)
  Bytes device_states;               // what of the above is on the device, plus the IPG buffer
  Bytes deepspeed_zero3_estimate;    // estimate_zero3_model_states_mem_needs' gpu_mem for these offload settings
  // Host memory (CPU RAM) of this rank, offload only: pinned (page-locked) and pageable, with what holds it
  struct HostRow {
    std::string what;
    Bytes bytes;
    bool pinned = false;
  };
  std::vector<HostRow> host;
  Bytes host_pinned, host_pageable;
};

// --pp N: every rank of the pipeline, simulated (pp.h); the estimate around it is `shown`'s.
struct PpRankFigures {
  uint64_t rank = 0;
  std::vector<PpStagePart> parts;     // its stages (one; several with interleaved-1f1b): layers, embeddings, head
  std::vector<uint64_t> in_flight;    // per stage: most micro-batches whose forward ran and whose backward has not
  Bytes weights;                // its stage's parameters
  Bytes saved_activations;      // autograd's saved tensors when most micro-batches are in flight
  Bytes peak_live;              // the highest total of live tensors
  Bytes peak_allocated, peak_reserved;
  std::optional<bool> fits;     // with a GPU
};
struct PpFigures {
  PpSchedule schedule = PpSchedule::k1f1b;
  uint64_t ranks = 1, micro_batches = 1, virtual_stages = 1;
  std::vector<PpRankFigures> rows;  // by rank
  // the worst rank: with a GPU, the one with the least headroom there; without one, or among equals, the one with
  // the highest peak reserved, then peak allocated; the first of equals (estimate.cc worse_rank: ZeRO's and CP's
  // rule too)
  uint64_t worst = 0;
  uint64_t shown = 0;               // the rank the estimate shows (--rank, else the worst)
};

// --cp N without --cp-rank: every CP rank simulated (their ring attentions differ: cp.h ring_steps); the estimate
// around it is the worst one's.
struct CpFigures {
  struct Row {
    uint64_t rank = 0;
    Bytes peak_allocated, peak_reserved;
    std::optional<bool> fits;  // with a GPU
  };
  std::vector<Row> rows;  // by CP rank
  // the worst rank (the one shown), as PpFigures::worst names it
  uint64_t worst = 0;
};

// --dp N --sharding fsdp2: one rank of FSDP2 (fully_shard) under accelerate, as simulated (fsdp.h).
struct FsdpFigures {
  FsdpOptions options;         // the resolved settings (resolve_fsdp)
  std::vector<FsdpUnit> units;  // in forward order, with their padded shard sizes
  Bytes sharded_params;        // every _sharded_param_data (padded), orig dtype
  Bytes ignored_params;        // fully_shard's ignored_params, whole on the rank (QLoRA's uint8 Params4bit)
  uint64_t ignored_rows = 0;   // how many
  Bytes sharded_grads;         // every unit's reduce-scatter result (padded), orig dtype
  Bytes optimizer_state;       // AdamW over the local (unpadded) shards
  uint64_t padding_elems = 0;  // padded minus unpadded elements on this rank
  uint64_t local_elems = 0;    // this rank's unpadded parameter elements
  uint64_t first_rank_elems = 0, last_rank_elems = 0;  // ranks 0's and W - 1's unpadded elements: most, fewest
  bool torchtitan_pp = false;  // torchtitan's apply_fsdp on a pipeline stage (resolve_pp_fsdp), not accelerate's
  bool torchtitan_sp = false;  // torchtitan's apply_fsdp over its TP + SP plan (resolve_sp_fsdp), not accelerate's
  // under a pipeline: the index in `units` of each FSDP root's first unit, one root per stage module the rank holds
  // (several with interleaved-1f1b: fsdp_stage_roots); {0} otherwise
  std::vector<size_t> root_begin{0};
};

// --dp N --sharding fsdp1: one rank of FSDP1 (FullyShardedDataParallel) under accelerate, as simulated (fsdp1.h).
struct Fsdp1Figures {
  Fsdp1Options options;           // the resolved settings (resolve_fsdp1)
  std::vector<Fsdp1Unit> units;   // in wrapping order: the decoder layers, then the root
  Bytes sharded_params;           // every unit's _local_shard (S elements, padding included), orig dtype
  Bytes sharded_grads;            // every unit's _saved_grad_shard (S elements), orig dtype
  Bytes optimizer_state;          // AdamW over the original parameters' shard views (padding excluded)
  uint64_t local_elems = 0;       // this rank's parameter elements (numel_in_shard, summed)
  uint64_t shard_elems = 0;       // the S of every unit, summed
  uint64_t padding_elems = 0;     // alignment and world-size padding in the flat parameters (all ranks)
  // --grad-accum N > 1: the unsharded flat gradients no_sync keeps between micro-batches (every unit's flat_param.grad,
  // the unpadded flat numel in param_dtype), from the first micro-batch's post-backward to the last one's; 0 without
  Bytes no_sync_kept_grads;
};

// The estimate of one step, in its natural parts; the timeline and the allocator's per-event figures are
// shared (an Estimate copies cheaply, and a binding can hand them out without copying them).
struct Estimate {
  ModelSpec model;
  TrainSetup setup;     // with optimizer_impl resolved
  SimOptions options;   // loop, torch version, GPU architecture
  StateBytes state;
  PeakBreakdown peak;
  AllocatorFigures memory;
  std::optional<DeviceVerdict> device;  // with a GPU: whether it fits there, and what nvidia-smi would show
  std::optional<GenerationFigures> generation;  // --generate only
  std::optional<DdpFigures> ddp;                // --dp > 1: per rank
  std::optional<ZeroFigures> zero;              // --sharding zero1|zero2: per rank
  std::optional<PpFigures> pp;                  // --pp > 1: every rank; the rest is rank pp->shown's
  std::optional<CpFigures> cp;                  // --cp > 1 without --cp-rank: every CP rank; the rest is the worst's
  std::optional<FsdpFigures> fsdp;              // --sharding fsdp2: per rank
  std::optional<Fsdp1Figures> fsdp1;            // --sharding fsdp1: per rank
  std::optional<StepTime> time;                 // with a GPU whose catalog row has its peaks (flops.h)
  std::shared_ptr<const SimResult> sim;
  std::shared_ptr<const AllocatorReplay> alloc;
  std::vector<std::string> warnings;  // the simulated program's (SimResult::warnings)
};

// The full estimate of a resolved scenario: with a GPU, the device totals and the verdict too.
Estimate estimate(const ResolvedScenario& r);

// The same from the stages' inputs; `gpu` (optional) adds the device totals and the verdict, and decides the
// architecture that is simulated (o.sm is replaced by the GPU's).
// `margin`: kept free on the GPU for the verdict (fit's safety margin). With --pp, every rank is simulated and
// the estimate is the worst rank's (PpFigures::worst) unless the setup names one.
Estimate estimate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o,
                  const AllocatorConfig& ac = {}, const GpuSpec* gpu = nullptr, Bytes margin = {});
// One pipeline rank as estimate() simulates it under --pp: `o` with SimOptions::pp set for `rank` (its stages of
// `parts`, the model split into pp x virtual stages by pp_stage_split, and its schedule's actions). Its estimate
// is estimate() over pp_stage_inventory(inv, result.pp.parts) (with torchtitan's fused optimizer where the setup
// leaves the implementation to the loop).
SimOptions pp_rank_options(const SimOptions& o, const TrainSetup& s, const std::vector<PpStagePart>& parts,
                           uint64_t rank);

// Whether fragmentation (reserved but not allocated at the reserved peak) is a large share of reserved: more
// than kLargeFragmentationPercent, where a neighbouring size can differ by a whole segment and the report says
// why (display only: no byte figure depends on it).
inline constexpr uint64_t kLargeFragmentationPercent = 10;
bool large_fragmentation(const AllocatorFigures& m);

// What the caching allocator may reserve on `gpu` with `margin` kept free: the runtime total less the context,
// NCCL's buffers and the margin (0 when they take it all).
Bytes usable_bytes(const GpuSpec& gpu, Bytes margin, const NcclLedger& nccl = {});

// Whether the step of `e` fits `gpu` with `margin` kept free: the caching allocator replayed with the device
// limit (freeing its cache and retrying before it gives up, as PyTorch does).
DeviceVerdict device_verdict(const Estimate& e, const GpuSpec& gpu, const AllocatorConfig& ac, Bytes margin = {});

// The step time of `e` on `gpu`: a roofline over the simulated step's kernels, launch overheads and the
// collectives (src/pipeline/step_time.cc). nullopt when the catalog has no peaks for the GPU, or for what it
// does not model: context and expert parallelism and offload.
// With --pp, the pipeline's step (pipeline_step_time), which estimate() computed from every rank.
std::optional<StepTime> step_time(const Estimate& e, const GpuSpec& gpu);

// --pp > 1: the step of the whole pipeline from every rank's simulated step (ranks[r] is rank r's, as
// estimate() simulates them): the schedule over each rank's forward and backward per micro-batch, the
// stage-to-stage sends on the fill and drain, FSDP2's collectives and the optimizer (src/pipeline/step_time.cc
// says how). The kernel and communication figures are rank f.shown's. nullopt as step_time.
std::optional<StepTime> pipeline_step_time(const std::vector<Estimate>& ranks, const PpFigures& f,
                                           const GpuSpec& gpu);

// The name of a timeline label in the model's own names ("model.layers.3 attn softmax", a parameter's name).
std::string label_name(const Label& l, const ModelSpec& m);

}  // namespace trainmem
