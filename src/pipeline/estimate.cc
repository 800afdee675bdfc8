#include "trainmem/estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

#include "trainmem/ddp.h"
#include "trainmem/zero.h"
#include "trainmem/error.h"
#include "trainmem/family.h"

namespace trainmem {

// torch.optim Adam(W) keeps state['step'] as a float32 scalar tensor: on the parameter's device when fused
// or capturable, on the CPU otherwise (torch/optim/adam.py _init_group).
namespace {

const char* category_note(Category c) {
  switch (c) {
    case Category::kWeights: return "parameters";
    case Category::kBuffers: return "registered buffers";
    case Category::kGradients: return ".grad of the parameters";
    case Category::kOptimizer: return "optimizer state";
    case Category::kInputs: return "the batch: input ids (and targets, when training)";
    case Category::kActivations: return "forward tensors held by Python or saved for backward";
    case Category::kWeightCopies: return "autocast's 16-bit copies of the weights, saved for backward";
    case Category::kBackward: return "gradients in flight through the backward pass";
    case Category::kTemporaries: return "op scratch and optimizer temporaries";
    case Category::kWorkspace: return "cuBLAS/cuBLASLt workspaces (one per thread)";
    case Category::kKvCache: return "the KV cache: keys and values of every layer, every token so far";
    // (NCCL's own buffers are outside the caching allocator: the DDP section under the table says so)
    case Category::kDdpBuckets: return "DDP's flat gradient buckets, all-reduced in place";
    case Category::kZeroBuckets: return "DeepSpeed ZeRO's IPG gradient buckets and reduction copies";
    case Category::kFsdpBuffers: return "FSDP's all-gather and reduce-scatter buffers, unsharded parameters";
  }
  return "";
}

// --generate: the cache at the end (its tokens and bytes), and memory_allocated() over the prefill (step 1 of
// the timeline) and over the decode steps (steps 2 ..), from the replayed allocator.
GenerationFigures generation_figures(const SimResult& sim, const AllocatorReplay& a, const TrainSetup& s) {
  GenerationFigures g;
  g.new_tokens = s.generate;
  g.cached_tokens = s.seq + s.generate - 1;
  g.kv_cache_end = sim.generation_end.live.by_category[static_cast<size_t>(Category::kKvCache)];
  // every layer's cache is (B, KV, tokens, D): linear in the tokens
  if (g.kv_cache_end.value % g.cached_tokens != 0) throw Error("internal: a KV cache not linear in its tokens");
  g.kv_per_token = Bytes(g.kv_cache_end.value / g.cached_tokens);
  const auto& ev = sim.timeline.events;
  for (size_t i = 0; i < ev.size() && i < a.allocated.size(); ++i) {
    if (ev[i].phase != Phase::kForward) continue;
    Bytes& peak = ev[i].step <= 1 ? g.prefill_peak_allocated : g.decode_peak_allocated;
    peak = std::max(peak, Bytes(a.allocated[i]));
  }
  const size_t end = sim.generation_end.event == 0 ? 0 : sim.generation_end.event - 1;
  g.end_allocated = Bytes(a.allocated[end]);
  g.end_reserved = Bytes(a.reserved[end]);
  return g;
}

}  // namespace

std::string label_name(const Label& l, const ModelSpec& m) {
  if (l.row == kRowBackwardOf) {
    return l.layer >= 0 ? fmt::format("backward of {} {}", layer_name(m, l.layer), l.what)
                        : fmt::format("backward of {}", l.what);
  }
  // A tensor named after a parameter or buffer (its copy, gradient or state) carries the full name.
  if (l.layer >= 0 && l.row < 0) return layer_name(m, l.layer) + " " + l.what;
  return l.what;
}

bool large_fragmentation(const AllocatorFigures& m) {
  return m.peak_reserved.value > 0 && m.fragmentation.value > m.peak_reserved.value / 100 * kLargeFragmentationPercent;
}

Bytes usable_bytes(const GpuSpec& gpu, Bytes margin, const NcclLedger& nccl) {
  const uint64_t held = checked_add(checked_add(gpu.context.value, nccl.total.value, "context + NCCL"), margin.value,
                                    "context + NCCL + margin");
  return Bytes(gpu.runtime_total.value - std::min(gpu.runtime_total.value, held));
}

DeviceVerdict device_verdict(const Estimate& e, const GpuSpec& gpu, const AllocatorConfig& ac, Bytes margin) {
  DeviceVerdict v;
  v.gpu = gpu.name;
  v.capacity = gpu.runtime_total;
  v.context = gpu.context;
  // NCCL's communicators are set up at the first collective (DDP's construction-time broadcast, ZeRO's and
  // FSDP's first all-gather), before the step's peak: what they hold is not the allocator's to reserve
  v.nccl = nccl_ledger(process_groups(e.setup, e.options.pp.on ? std::optional<uint64_t>(e.options.pp.rank)
                                                                 : std::nullopt),
                       gpu, e.setup.nccl);
  v.margin = margin;
  v.usable = usable_bytes(gpu, margin, v.nccl);
  const AllocatorReplay r = replay_allocator(e.sim->timeline, ac, e.options.torch, v.usable);
  v.fits = !r.oom;
  v.peak_reserved = r.peak_reserved;
  v.unlimited_peak_reserved = e.memory.peak_reserved;
  // nvidia-smi on this GPU: what the allocator reserves there (less than without a limit when it had to
  // release its cache), plus the context; for a step that does not fit, what it would need.
  v.device_total = (v.fits ? v.peak_reserved : e.memory.peak_reserved) + gpu.context + v.nccl.total;
  // bitsandbytes' paged optimizer state (cudaMallocManaged) counts while resident; the driver may evict it to
  // the host rather than fail, so it does not decide the verdict
  v.device_total += e.state.paged_optimizer_state;
  v.alloc_retries = r.alloc_retries;
  v.headroom = signed_difference(v.usable.value, r.peak_reserved.value, "the headroom on the device");
  if (r.oom) {
    // short by at least the overflow of the first failing allocation (after the cache was released)
    const uint64_t need = checked_add(r.oom->reserved.value, r.oom->segment.value, "reserved + segment");
    const Event& ev = e.sim->timeline.events[r.oom->event];
    DeviceVerdict::Oom o;
    o.event = r.oom->event;
    o.phase = ev.phase;
    o.step = ev.step;
    o.micro = ev.micro;
    o.tensor = label_name(ev.label, e.model);
    o.category = ev.category;
    o.requested = r.oom->requested;
    o.segment = r.oom->segment;
    o.allocated = r.oom->allocated;
    o.reserved = r.oom->reserved;
    o.overflow = Bytes(need - std::min(v.usable.value, need));
    // Two lower bounds of what is missing: the first failing allocation's overflow, and the peak of allocated
    // blocks beyond what the allocator may reserve (no packing can hold more than that).
    const uint64_t beyond = e.memory.peak_allocated.value - std::min(e.memory.peak_allocated.value, v.usable.value);
    o.short_by = Bytes(std::max(o.overflow.value, beyond));
    v.headroom = signed_difference(0, o.short_by.value, "the memory the device is short by");
    // The tensors live just before the failing allocation, largest first (none when it is the first).
    std::vector<LiveBlock> live;
    if (r.oom->event > 0) live = live_blocks_after(e.sim->timeline, ac, e.options.torch, r.oom->event - 1);
    // Each storage's category at that moment (a gradient in flight may have become a .grad since).
    const auto& events = e.sim->timeline.events;
    std::vector<Category> by_storage;
    for (size_t i = 0; i < r.oom->event && i < events.size(); ++i) {
      if (events[i].storage >= by_storage.size()) by_storage.resize(events[i].storage + 1);
      by_storage[events[i].storage] = events[i].category;
    }
    auto current_category = [&](size_t alloc_event) {
      const uint64_t id = events[alloc_event].storage;
      return id < by_storage.size() ? by_storage[id] : events[alloc_event].category;
    };
    std::sort(live.begin(), live.end(), [](const LiveBlock& a, const LiveBlock& b) {
      return a.block != b.block ? a.block > b.block : a.alloc_event < b.alloc_event;
    });
    for (const LiveBlock& b : live) {
      o.live_total += b.requested;
      o.live_by_category[static_cast<size_t>(current_category(b.alloc_event))] += b.requested;
      if (o.live.size() < 12) {
        const Event& a = events[b.alloc_event];
        o.live.push_back({label_name(a.label, e.model), current_category(b.alloc_event), b.requested, b.block});
      }
    }
    v.oom = std::move(o);
  }
  return v;
}



Estimate estimate(const ResolvedScenario& r) {
  return estimate(r.model, r.inventory, r.setup, r.options, r.alloc, r.gpu ? &*r.gpu : nullptr);
}

// --sharding zero3: one rank's model states where DeepSpeedZeroOptimizer_Stage3 puts them (the same arithmetic
// the simulator allocates: zero3_partition_numel, zero3_persistent, zero3_sub_groups), and DeepSpeed's estimator
// for the same offload settings (stage3.py estimate_zero3_model_states_mem_needs, zero_init=True, one node).
ZeroFigures zero3_figures(const Inventory& inv, const ZeroOptions& z, const TrainSetup& s, DType pd, StateBytes& st) {
  ZeroFigures f;
  f.options = z;
  std::vector<uint64_t> numels;
  for (const TensorRow& r : inv.parameters) numels.push_back(r.elems.value);
  const std::vector<char> persist = zero3_persistent(numels, z.param_persistence_threshold, z.model_persistence_threshold);
  uint64_t lp = 0, frozen = 0, pers_full = 0, pad = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const uint64_t part = zero3_partition_numel(numels[i], z.ranks);
    f.largest_param = std::max(f.largest_param, numels[i]);
    // rank 0's partition holds min(part, numel) real elements; the padding is on the last rank
    pad += zero3_padding(numels[i], z.ranks);
    if (persist[i]) {
      ++f.persistent_params;
      f.persistent_numel += numels[i];
      pers_full += numels[i];
    }
    (inv.parameters[i].trainable ? lp : frozen) += part;
  }
  f.partition_padding = pad;
  std::vector<uint64_t> subs;
  uint64_t trainable_parts = 0;
  for (const std::vector<int32_t>& g : zero_param_groups(inv)) {
    std::vector<uint64_t> parts;
    for (int32_t r : g) parts.push_back(zero3_partition_numel(numels[static_cast<size_t>(r)], z.ranks));
    for (uint64_t x : zero3_sub_groups(parts, z.sub_group_size)) {
      subs.push_back(x);
      trainable_parts += x;
    }
    f.group_numel.push_back(0);
    for (int32_t r : g) f.group_numel.back() += numels[static_cast<size_t>(r)];
    f.group_partition.push_back(0);
    for (uint64_t x : parts) f.group_partition.back() += x;
  }
  f.lp_partitions = bytes_of(Elems(lp + frozen), pd);
  f.persistent_full = bytes_of(Elems(pers_full), pd);
  f.grad_partitions = bytes_of(Elems(trainable_parts), pd);  // gradient_accumulation_dtype: the model's
  f.fp32_partitions = bytes_of(Elems(trainable_parts), DType::kF32);
  for (uint64_t x : subs) {
    for (const StateTensor& t : optimizer_state_tensors(s.optimizer, s.optimizer_impl, {x}, DType::kF32,
                                                        bnb_block_size(s.optimizer_version))) {
      f.optimizer_state += bytes_of(numel(t.shape), t.dtype);
    }
  }
  f.ipg_buffers = z.contiguous_gradients ? bytes_of(Elems(z.reduce_bucket_elems), pd) : Bytes{};
  uint64_t largest_sub = 0;
  for (uint64_t x : subs) largest_sub = std::max(largest_sub, x);
  f.fp32_grad = bytes_of(Elems(largest_sub), DType::kF32);
  // where each lives (stage3.py _create_fp16_partitions_with_defragmentation, _create_fp32_partitions,
  // initialize_optimizer_states, _setup_for_real_optimizer; partition_parameters.py _partition_param)
  auto host = [&](const char* what, Bytes b, bool pinned) {
    if (b.value == 0) return;
    f.host.push_back({what, b, pinned});
    (pinned ? f.host_pinned : f.host_pageable) += b;
  };
  Bytes dev = f.persistent_full + f.ipg_buffers;
  if (z.offload_params) {
    // every trainable ds_tensor moves into param_groups_fp16_flat_cpu_memory (get_accelerator().pin_memory(
    // torch.empty(flat_buffer_size)): pinned whatever pin_memory says; _move_to_flat_buffer), the persistent ones
    // too; a frozen one stays where _partition_param put it: the CPU (pinned with pin_memory), or the device when
    // persistent
    uint64_t pers_fr = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (persist[i] && !inv.parameters[i].trainable) pers_fr += zero3_partition_numel(numels[i], z.ranks);
    }
    host("bf16 parameter partitions (param_groups_fp16_flat_cpu_memory)", bytes_of(Elems(lp), pd), true);
    host("frozen parameter partitions (ds_tensor)", bytes_of(Elems(frozen - pers_fr), pd), z.pin_memory);
    dev += bytes_of(Elems(pers_fr), pd);
  } else {
    dev += f.lp_partitions;
  }
  if (z.offload_optimizer) {
    // fp32: fp16 flat .to('cpu', fp32).clone() (pageable); DeepSpeedCPUAdam's state zeros_like on the CPU
    // (pageable); each sub-group's fp32 .grad: torch.zeros then pin_memory with pin_memory; the bf16 grad
    // partitions' flat buffer on self.device = cpu, pinned with pin_memory
    host("fp32 master partitions (fp32_partitioned_groups_flat)", f.fp32_partitions, false);
    host("DeepSpeedCPUAdam state (exp_avg, exp_avg_sq)", f.optimizer_state, false);
    f.fp32_grad_buffers = bytes_of(Elems(trainable_parts), DType::kF32);
    host("fp32 gradient buffers (subgroup_gradient_buffer)", f.fp32_grad_buffers, z.pin_memory);
    host("bf16 gradient partitions (grad_partitions_flat_buffer)", f.grad_partitions, z.pin_memory);
  } else {
    dev += f.grad_partitions + f.fp32_partitions + f.optimizer_state;
  }
  f.device_states = dev;
  // estimate_zero3_model_states_mem_needs: largest_layer_memory = 4 * largest_layer_params; gpu_mem =
  // largest_layer_memory + int(18 * total_params / total_gpus) without offload, + int(2 * total_params /
  // total_gpus) with the optimizer offloaded, largest_layer_memory alone with both
  const uint64_t P = st.parameters.value, L = 4 * f.largest_param;
  // (the estimator has no row for parameters offloaded without the optimizer: cpu_offload_params only counts
  // under cpu_offload; 0 here, "no row" in the report)
  f.deepspeed_zero3_estimate = Bytes(z.offload_params ? (z.offload_optimizer ? L : 0)
                                     : z.offload_optimizer ? L + 2 * P / z.ranks : L + 18 * P / z.ranks);
  // the state summary: this rank's device-side parts
  st.weights = (z.offload_params ? Bytes{} : f.lp_partitions) + f.persistent_full;
  st.gradients = z.offload_optimizer ? Bytes{} : f.grad_partitions;
  st.optimizer_moments = z.offload_optimizer ? Bytes{} : f.optimizer_state;
  st.optimizer_steps = Bytes{};
  st.optimizer_state = st.optimizer_moments;
  return f;
}

// --pp N (pp.h): each rank's stage simulated in turn, the worst named; the estimate is that rank's (or --rank's).
namespace {

// Whether rank estimate `a` is worse than `b`, for the pipeline's ranks, ZeRO's rank classes and the CP ranks
// alike: with a GPU, less headroom (the NCCL buffers outside the allocator can differ by rank); without one, or on
// equal headroom, the higher peak reserved, then the higher peak allocated. On equal figures `b`, the rank found
// first, stays the worst.
bool worse_rank(const Estimate& a, const Estimate& b, bool gpu) {
  if (gpu && a.device->headroom != b.device->headroom) return a.device->headroom < b.device->headroom;
  return std::tie(a.memory.peak_reserved, a.memory.peak_allocated) > std::tie(b.memory.peak_reserved, b.memory.peak_allocated);
}

// --sharding zero1/zero2 over dp ranks without --dp-rank: each class of alike ranks (zero_rank_classes) simulated,
// the fullest partitions first, at most kZeroRanksSimulated; the worst one's estimate, with every class's row.
// Beyond kZeroRanksSearched ranks the classes are not enumerated: the fullest partition's rank (zero_fullest_rank).
constexpr size_t kZeroRanksSimulated = 64;
Estimate estimate_zero_ranks(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o0,
                             const AllocatorConfig& ac, const GpuSpec* gpu, Bytes margin) {
  const std::vector<std::vector<uint64_t>> groups = zero_group_numels(inv);
  TrainSetup one = s;
  if (s.dp > kZeroRanksSearched) {
    one.dp_rank = zero_fullest_rank(groups, s.dp).rank;
    return estimate(m, inv, one, o0, ac, gpu, margin);
  }
  const std::vector<ZeroRankClass> classes = zero_rank_classes(groups, s.dp);
  std::vector<ZeroFigures::RankRow> rows;
  std::optional<Estimate> worst;
  size_t worst_at = 0;
  for (size_t i = 0; i < classes.size() && i < kZeroRanksSimulated; ++i) {
    one.dp_rank = classes[i].rank;
    Estimate e = estimate(m, inv, one, o0, ac, gpu, margin);
    ZeroFigures::RankRow row{classes[i].rank, classes[i].ranks, classes[i].in_partition_numel,
                             e.memory.peak_allocated, e.memory.peak_reserved, e.device ? e.device->fits : true};
    rows.push_back(row);
    if (!worst || worse_rank(e, *worst, gpu != nullptr)) {
      worst = std::move(e);
      worst_at = i;
    }
  }
  if (!worst || !worst->zero) throw Error("internal: no ZeRO rank simulated");
  worst->zero->rank_rows = std::move(rows);
  worst->zero->rank_classes = classes.size();
  worst->zero->worst = worst_at;
  return std::move(*worst);
}

// --cp N without --cp-rank: rank r's ring attention runs r steps of the whole query against half the received
// keys and N - 1 - r of half the query against all of them (cp.h ring_steps), so the ranks' transients differ (the
// forward's by about a third between rank 0 and the others, the CPU oracle validate/cpu/ring_attention.py): every
// CP rank is simulated and the worst named, as for a pipeline.
Estimate estimate_cp_ranks(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o,
                           const AllocatorConfig& ac, const GpuSpec* gpu, Bytes margin) {
  CpFigures f;
  std::optional<Estimate> worst;
  TrainSetup one = s;
  for (uint64_t r = 0; r < s.cp; ++r) {
    one.cp_rank = r;
    Estimate e = estimate(m, inv, one, o, ac, gpu, margin);
    CpFigures::Row row{r, e.memory.peak_allocated, e.memory.peak_reserved, std::nullopt};
    if (e.device) row.fits = e.device->fits;
    f.rows.push_back(row);
    if (!worst || worse_rank(e, *worst, gpu != nullptr)) {
      worst = std::move(e);
      f.worst = r;
    }
  }
  if (!worst) throw Error("internal: no CP rank simulated");
  worst->cp = std::move(f);
  return std::move(*worst);
}

// What the pipeline simulation covers; anything else is refused with its reason.
void check_pipeline(const ModelSpec& m, const TrainSetup& s, LoopKind loop, TorchVersion torch) {
  auto no = [](const std::string& why) { throw Error("--pp: " + why); };
  const bool multi = s.pp_schedule == PpSchedule::kInterleaved1f1b;
  if (multi && s.pp_virtual_stages < 2) {
    // torchtitan _get_pipeline_metadata: "Multi-stage schedule requires at least 2 stages per rank"
    no(fmt::format("--pp-virtual-stages {}: interleaved-1f1b needs at least 2 stages per rank (torchtitan raises)",
                   s.pp_virtual_stages));
  }
  if (!multi && s.pp_virtual_stages > 1) {
    // "Single stage schedule requires exactly 1 stage per rank"
    no(fmt::format("--pp-virtual-stages {}: {} runs exactly one stage per rank (torchtitan raises)",
                   s.pp_virtual_stages, name_of(s.pp_schedule)));
  }
  if (s.pp_schedule == PpSchedule::kZeroBubble) {
    no("zero-bubble schedules are not simulated: they split each backward into input (stage_backward_input) and "
       "weight (stage_backward_weight) passes, keeping the weight pass's graph alive between them");
  }
  if (s.task != Task::kTrain) no("pipelines are simulated for training only");
  if (torch != TorchVersion{2, 9} && torch != TorchVersion{2, 11}) {
    // the buffers' lifetimes change between releases: 2.8 and older kept every stage's outputs, PyTorch PR
    // #165822 (October 2025) adds step(return_outputs=False), PR #164329 frees the inputs' gradients in
    // stage_backward; 2.9's and 2.11's stage.py, _backward.py and schedules.py are what is simulated (2.10's are
    // not read)
    no(fmt::format("--torch {}: simulated for PyTorch 2.9's and 2.11's torch.distributed.pipelining only (the "
                   "stage's buffers and outputs live differently in other releases)", torch_version_name(torch)));
  }
  if (torch == TorchVersion{2, 11} && multi) {
    // 2.11's ScheduleInterleaved1F1B is a _PipelineScheduleRuntime (schedules.py:2507): its lowered SEND_B / RECV_B
    // actions decide how long an input gradient's send holds it (RuntimeFacts::pp_stage_backward_releases_input_
    // grads), and that runtime is not transcribed
    no("--torch 2.11 with interleaved-1f1b: the input gradients' send lifetimes of 2.11's _PipelineScheduleRuntime "
       "are not simulated; use --torch 2.9 or a single-stage schedule");
  }
  if (m.family != Family::kLlama || m.impl != Impl::kHf || !m.attn.sliding_layers.empty() || m.head != Head::kCausalLm) {
    no("simulated for transformers' Llama-shaped causal LMs (model.embed_tokens / model.layers / model.norm / "
       "lm_head) without sliding-window layer types; not for " + m.model_type);
  }
  if (m.embed.tied) {
    no("a tied lm_head (tie_word_embeddings) would be shared by the first and last stages; not simulated");
  }
  // --dp D --sharding fsdp2: torchtitan v0.2.0's apply_fsdp on each rank's stage module (fsdp.h resolve_pp_fsdp,
  // fsdp_stage_units), its hooks run per micro-batch in the schedule's order (src/sim/fsdp.cc pp_*)
  // interleaved-1f1b: pipeline_llm applies apply_fsdp to each model part, one FSDP root per stage module with its
  // own streams (loop.cc pp_fsdp, fsdp.h fsdp_stage_roots), each reduce-scattered after its own last backward
  if (fsdp2_mesh_ranks(s) > 1 && s.sharding == Sharding::kFsdp2 && multi && s.pp_virtual_stages > kFsdpExtraRoots + 1) {
    throw FieldError("pp_virtual_stages",
                     fmt::format("{} with --sharding fsdp2: expected at most {} (each stage module is an FSDP root with "
                                 "its own streams' allocator pools, and {} are simulated per rank)",
                                 s.pp_virtual_stages, kFsdpExtraRoots + 1, kFsdpExtraRoots + 1));
  }
  if (s.dp > 1 && s.sharding == Sharding::kDdp) {
    // torchtitan's parallelize_llama applies DDP only when it is the whole world: `if parallel_dims.world_size !=
    // dp_replicate_mesh.size(): raise RuntimeError("DDP has not supported > 1D parallelism")` (v0.2.0: `if
    // world_mesh.ndim > 1`); its data parallelism beside a pipeline is FSDP2 (or HSDP)
    no(fmt::format("--dp {} --sharding ddp: torchtitan runs no DDP beside a pipeline (parallelize_llama: \"DDP has "
                   "not supported > 1D parallelism\"); its data parallelism there is FSDP2: --sharding fsdp2", s.dp));
  }
  if (s.dp > 1 && s.sharding != Sharding::kFsdp2) {
    no(fmt::format("--dp {} --sharding {}: FSDP1 and ZeRO under a pipeline are not simulated (torchtitan's "
                   "FSDP2 is: --sharding fsdp2)", s.dp, name_of(s.sharding)));
  }
  if (s.lora.on || s.quant.type != Quantize::kNone || !s.freeze.empty()) {
    no("LoRA, 4-bit quantization and frozen rows are not simulated under a pipeline");
  }
  if (s.grad_accum > 1) no("--grad-accum: use --micro-batches (the pipeline's micro-batches per step)");
  if (s.loss != LossKind::kCe || s.logits_to_keep) no("only transformers' ForCausalLMLoss over every position");
  if (s.optimizer_in_backward) no("optimizer-in-backward is not simulated under a pipeline");
  if (uses_autocast(s.precision)) {
    // torchtitan/config/configs.py mixed_precision_param: "it takes effect via torch.autocast when
    // data_replicate_degree >= 1 and no other parallelism is enabled"; under a pipeline mixed precision comes
    // from fully_shard, which is not simulated here. (An autocast region across micro-batches would also share
    // the cached weight casts between their graphs.)
    no(fmt::format("--precision {}: torchtitan runs torch.autocast only without other parallelism (its mixed "
                   "precision under a pipeline is FSDP's: --dp N --sharding fsdp2 --precision fp32); use --precision "
                   "fp32 or bf16 (torchtitan's training.dtype)", precision_name(s.precision)));
  }
  if (loop != LoopKind::kHf) no("the torchtitan-style loop is simulated with the hf loop only");
  if (!multi && s.micro_batches < s.pp) {
    // PipelineScheduleSingle.__init__: "Number of microbatches ({n_microbatches}) must be greater than or equal
    // to the number of stages ({self._num_stages})."
    no(fmt::format("--micro-batches {} is less than --pp {} (PipelineScheduleSingle raises: the number of "
                   "micro-batches must be at least the number of stages)", s.micro_batches, s.pp));
  }
}

}  // namespace

SimOptions pp_rank_options(const SimOptions& o0, const TrainSetup& s, const std::vector<PpStagePart>& parts,
                           uint64_t rank) {
  const uint64_t v = std::max<uint64_t>(s.pp_virtual_stages, 1);
  SimOptions o = o0;
  o.pp.on = true;
  o.pp.schedule = s.pp_schedule;
  o.pp.ranks = s.pp;
  o.pp.micro_batches = s.micro_batches;
  o.pp.rank = rank;
  for (uint64_t st : pp_rank_stages(rank, s.pp, v)) o.pp.parts.push_back(parts[st]);
  o.pp.actions = pp_rank_actions(s.pp_schedule, rank, s.pp, s.micro_batches, v);
  return o;
}

Estimate estimate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o0,
                  const AllocatorConfig& ac, const GpuSpec* gpu, Bytes margin) {
  if (s.pp > 1 && !o0.pp.on) {
    validate_setup(m, s);
    check_pipeline(m, s, resolved(o0, m).loop, o0.torch);
    const uint64_t v = std::max<uint64_t>(s.pp_virtual_stages, 1);
    // torchtitan: the model split into pp * stages_per_rank stages (_generate_llm_fqn_per_model_part)
    const std::vector<PpStagePart> parts = pp_stage_split(checked_mul(s.pp, v, "pp x virtual stages"), m.layers);
    if (s.rank && *s.rank >= s.pp) throw Error(fmt::format("--rank {}: the pipeline has ranks 0 to {}", *s.rank, s.pp - 1));
    // torchtitan's optimizer: OptimizersContainer.Config.implementation = "fused" (components/optimizer/
    // optimizer.py); the setup's own choice where it makes one
    TrainSetup ps = s;
    if (ps.optimizer_impl == OptimizerImpl::kAuto && is_torch_optim(ps.optimizer)) ps.optimizer_impl = OptimizerImpl::kFused;
    PpFigures f;
    f.schedule = s.pp_schedule;
    f.ranks = s.pp;
    f.micro_batches = s.micro_batches;
    f.virtual_stages = v;
    std::vector<Estimate> ranks;
    for (uint64_t r = 0; r < s.pp; ++r) {
      const SimOptions o = pp_rank_options(o0, s, parts, r);
      const Inventory stage_inv = pp_stage_inventory(inv, o.pp.parts);
      Estimate e = estimate(m, stage_inv, ps, o, ac, gpu, margin);
      PpRankFigures row;
      row.rank = r;
      row.parts = o.pp.parts;
      for (const PpStagePart& part : o.pp.parts) row.in_flight.push_back(pp_max_in_flight(o.pp.actions, part.stage));
      row.weights = e.state.weights;
      row.saved_activations = e.peak.saved_activations;
      row.peak_live = e.peak.live_total;
      row.peak_allocated = e.memory.peak_allocated;
      row.peak_reserved = e.memory.peak_reserved;
      if (e.device) row.fits = e.device->fits;
      f.rows.push_back(row);
      if (r > 0 && worse_rank(e, ranks[f.worst], gpu != nullptr)) f.worst = r;
      ranks.push_back(std::move(e));
    }
    f.shown = s.rank.value_or(f.worst);
    std::optional<StepTime> time = gpu ? pipeline_step_time(ranks, f, *gpu) : std::nullopt;
    Estimate out = std::move(ranks[f.shown]);
    out.pp = std::move(f);
    out.time = std::move(time);
    return out;
  }
  validate_setup(m, s);
  if (s.cp > 1 && !s.cp_rank) return estimate_cp_ranks(m, inv, s, o0, ac, gpu, margin);
  // --sharding zero1/zero2 without --dp-rank: the ranks' partitions hold different parameters (params_in_partition
  // and their slices), so their steps differ, by a third of the peak on some layouts: every class of alike ranks
  // is simulated and the worst named, as for a pipeline. (FSDP2's rank 0 holds the most; DDP's and ZeRO-3's ranks
  // are alike.)
  if (s.dp > 1 && !s.dp_rank && (s.sharding == Sharding::kZero1 || s.sharding == Sharding::kZero2)) {
    return estimate_zero_ranks(m, inv, s, o0, ac, gpu, margin);
  }
  SimOptions o = o0;
  // dp > 1: one rank of DistributedDataParallel (ddp.h); refuses what it does not simulate
  const LoopKind loop = resolved(o0, m).loop;
  const DdpOptions ddp = resolve_ddp(s, loop, o0.torch);
  const ZeroOptions zopt = resolve_zero(s, loop, o0.torch);  // --sharding zero2 (zero.h)
  // --sharding fsdp2 (fsdp.h): accelerate's policy, or torchtitan's on a pipeline stage
  // (torchtitan's after its TP + SP plan over the sequence-parallel model: resolve_sp_fsdp)
  const FsdpOptions fopt = resolve_fsdp2_policy(s, m, loop, o0.torch, o0.pp.on);
  const Fsdp1Options f1opt = resolve_fsdp1(s, m, loop, o0.torch);  // --sharding fsdp1 (fsdp1.h)
  if (gpu) {
    o.sm = gpu->sm;  // the device decides the kernels: an H100 is simulated as sm_90
    o.multiprocessors = gpu->multiprocessors;  // and its SM count the reductions' staging buffers
  }
  Estimate e;
  e.model = m;
  e.setup = s;
  e.options = resolved(o, m);
  e.setup.optimizer_impl = resolve_optimizer_impl(s.optimizer, s.optimizer_impl, m.impl);
  const DType pd = param_dtype(s.precision);
  StateBytes& st = e.state;
  st.parameters = parameter_count(inv);
  st.trainable = trainable_count(inv);  // gradients and optimizer state exist for these rows only
  st.weights = parameter_bytes(inv, pd);
  st.buffers = buffer_bytes(inv, pd);
  // token ids and targets (int64 each), or one float feature batch
  const bool features = input_kind(m) == InputKind::kFeatures;
  const Elems tokens(checked_mul(s.batch, features ? m.stack_input : s.seq, "tokens"));
  st.inputs = features ? bytes_of(tokens, pd) : bytes_of(tokens, DType::kI64) * 2;

  const auto sim = std::make_shared<const SimResult>(simulate(m, inv, e.setup, o));
  // Gradients and optimizer state exist for the trainable rows the backward reached (all of them, unless a
  // reentrant checkpoint's input did not require grad).
  // Each in its parameter's dtype (float32 LoRA adapters on a 16-bit model).
  // The optimizer's state: optimizer_state_tensors() for each of those rows, the same tensors the simulated
  // step creates; paged ones live outside the caching allocator.
  Bytes with_grad;
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    const TensorRow& r = inv.parameters[i];
    if (i >= sim->param_has_grad.size() || !sim->param_has_grad[i] || !r.trainable) continue;
    const DType d = stored_dtype(r, pd);
    with_grad += bytes_of(r.elems, d);
    for (const StateTensor& t : optimizer_state_tensors(s.optimizer, e.setup.optimizer_impl, r.shape, d,
                                                                  bnb_block_size(s.optimizer_version))) {
      const Bytes b = bytes_of(numel(t.shape), t.dtype);
      if (t.paged) {
        st.paged_optimizer_state += b;
      } else if (std::string_view(t.what) == "step") {
        st.optimizer_steps += b;
      } else {
        st.optimizer_moments += b;
      }
    }
  }
  // per-parameter optimizers (optimizer-in-backward) whose parameter's state is 8-bit, each with its own qmaps
  uint64_t eight_bit = 0;
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    const TensorRow& r = inv.parameters[i];
    if (i >= sim->param_has_grad.size() || !sim->param_has_grad[i] || !r.trainable) continue;
    eight_bit += needs_shared_state(optimizer_state_tensors(s.optimizer, e.setup.optimizer_impl, r.shape,
                                                            stored_dtype(r, pd), bnb_block_size(s.optimizer_version)))
                     ? 1 : 0;
  }
  if (with_grad.value > 0) {
    // once per optimizer object: one optimizer, or one per parameter with optimizer-in-backward
    const uint64_t optimizers = s.optimizer_in_backward ? eight_bit : 1;
    for (const StateTensor& t : optimizer_shared_state(s.optimizer)) {
      st.optimizer_moments += bytes_of(Elems(checked_mul(t.shape[0], optimizers, "optimizer state elements")), t.dtype);
    }
  }
  // optimizer-in-backward frees each .grad right after its update (zero_grad(set_to_none=True) in the hook):
  // no gradient outlives the backward; those in flight are in the timeline's peak
  st.gradients = s.optimizer_in_backward ? Bytes{} : with_grad;
  // DDP's gradient_as_bucket_view: each .grad is a view of its bucket (counted in the buckets)
  if (ddp.bucket_view) st.gradients = Bytes{};
  st.optimizer_state = st.optimizer_moments + st.optimizer_steps;
  e.sim = sim;
  e.warnings = sim->warnings;
  if (zopt.on && zopt.stage == 3) {
    e.zero = zero3_figures(inv, zopt, e.setup, pd, st);
  } else if (const ZeroOptions& z = zopt; z.on) {
    // one rank's model states, from the same layout the simulator allocates (zero_group_layout)
    ZeroFigures f;
    f.options = z;
    Bytes in_partition, largest_partition;
    const std::vector<std::vector<uint64_t>> groups = zero_group_numels(inv);
    f.fullest = zero_fullest_rank(groups, z.ranks);
    for (const std::vector<uint64_t>& numels : groups) {
      const ZeroGroupLayout l = zero_group_layout(numels, z.ranks, z.rank);
      f.group_numel.push_back(l.numel);
      f.group_aligned.push_back(l.aligned_numel);
      f.group_partition.push_back(l.partition_size);
      f.group_in_partition.push_back(l.in_partition_numel);
      f.bit16_flat += bytes_of(Elems(l.aligned_numel), pd);
      f.fp32_master += bytes_of(Elems(l.partition_size), DType::kF32);
      largest_partition = std::max(largest_partition, bytes_of(Elems(l.partition_size), DType::kF32));
      in_partition += bytes_of(Elems(l.in_partition_numel), pd);
      for (const StateTensor& t : optimizer_state_tensors(s.optimizer, e.setup.optimizer_impl, {l.partition_size},
                                                          DType::kF32, bnb_block_size(s.optimizer_version))) {
        f.optimizer_state += bytes_of(numel(t.shape), t.dtype);
      }
    }
    f.grads_in_partition = in_partition;
    f.ipg_buffers = bytes_of(Elems(checked_mul(z.reduce_bucket_elems, z.overlap_comm ? 2 : 1, "ZeRO IPG")), pd);
    f.fp32_grad = largest_partition;
    // stage_1_and_2.py estimate_zero2_model_states_mem_needs(cpu_offload=False):
    // gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
    const uint64_t P = st.trainable.value;
    f.deepspeed_estimate = Bytes(checked_add(checked_mul(2, P, "DeepSpeed estimate"),
                                             checked_mul(18, P, "DeepSpeed estimate") / z.ranks, "DeepSpeed estimate"));
    // the per-rank model states in the state summary: the flat bf16 buffer, the partition gradients, the
    // optimizer's state over the partitions (the fp32 master partition is reported beside them, in the ZeRO note)
    // Frozen rows are in no optimizer group, so never flattened: they stay the bf16 tensors they were (every
    // row is in the model dtype here: resolve_zero refuses LoRA's float32 adapters and 4-bit bases).
    const Bytes all_weights = st.weights, trainable_weights = bytes_of(st.trainable, pd);
    if (trainable_weights.value > all_weights.value) throw Error("internal: trainable weights above all weights");
    st.weights = f.bit16_flat + Bytes(all_weights.value - trainable_weights.value);
    // stage 2: the partition gradients; stage 1: every parameter's full bit16 .grad until the boundary's reduction
    if (z.stage == 1) f.full_grads = bytes_of(st.trainable, pd);
    st.gradients = z.stage == 1 ? f.full_grads : f.grads_in_partition;
    st.optimizer_moments = f.optimizer_state;
    st.optimizer_steps = Bytes{};
    st.optimizer_state = f.optimizer_state;
    e.zero = std::move(f);
  }
  // FSDP's per-rank model states: the rank's shards, its sharded gradients, the optimizer's state over them
  const auto set_sharded_states = [&st](Bytes weights, Bytes grads, Bytes moments, Bytes steps) {
    st.weights = weights;
    st.gradients = grads;
    st.optimizer_moments = moments;
    st.optimizer_steps = steps;
    st.optimizer_state = moments + steps;
  };
  if (fopt.on) {
    // one rank's model states, from the same shards the simulator allocates (fsdp_shard): the padded parameter
    // shards and the padded reduce-scatter results in the orig dtype, AdamW's state over the unpadded local shards
    FsdpFigures f;
    Bytes moments, steps;
    f.options = fopt;
    if (o0.pp.on) {
      // one FSDP root per stage module (fsdp_stage_roots), their units in stage order
      f.root_begin.clear();
      for (std::vector<FsdpUnit>& root : fsdp_stage_roots(inv, o0.pp.parts, fopt)) {
        f.root_begin.push_back(f.units.size());
        for (FsdpUnit& u : root) f.units.push_back(std::move(u));
      }
    } else {
      f.units = fsdp_units(m, inv, fopt);
    }
    f.torchtitan_pp = o0.pp.on;
    f.torchtitan_sp = !o0.pp.on && s.sequence_parallel;
    for (const TensorRow& r : inv.parameters) {
      if (fsdp_ignored(r, fopt)) {  // in no unit: whole on every rank (fsdp_units), frozen
        f.ignored_params += stored_bytes(r, param_dtype(s.precision));
        ++f.ignored_rows;
        continue;
      }
      const FsdpShard sh = fsdp_shard(stored_shape(r), fopt.ranks, fopt.rank);  // (4-bit: the packed storage's)
      const DType orig = fsdp_param_dtypes(r, fopt).orig;  // per row: PEFT's float32 adapters on a 16-bit base
      f.sharded_params += bytes_of(Elems(sh.padded_numel), orig);
      f.padding_elems = checked_add(f.padding_elems, sh.padded_numel - sh.local_numel, "FSDP padding");
      f.local_elems = checked_add(f.local_elems, sh.local_numel, "FSDP shard");
      // (torch.chunk: rank 0's chunk is the longest, the last rank's the shortest)
      f.first_rank_elems = checked_add(f.first_rank_elems, fsdp_shard(stored_shape(r), fopt.ranks, 0).local_numel, "FSDP shard");
      f.last_rank_elems = checked_add(f.last_rank_elems, fsdp_shard(stored_shape(r), fopt.ranks, fopt.ranks - 1).local_numel, "FSDP shard");
      if (!r.trainable) continue;  // frozen rows (LoRA's base) are in no optimizer group
      for (const StateTensor& t : optimizer_state_tensors(s.optimizer, e.setup.optimizer_impl, sh.local_shape,
                                                          orig, bnb_block_size(s.optimizer_version))) {
        const Bytes b = bytes_of(numel(t.shape), t.dtype);
        f.optimizer_state += b;
        (std::string_view(t.what) == "step" ? steps : moments) += b;
      }
    }
    // grad_output: one padded flat tensor per unit over its trainable rows (all of them without LoRA), in the
    // group's orig dtype (fsdp_unit_buffers)
    for (const FsdpUnit& u : f.units) f.sharded_grads += bytes_of(Elems(u.grad_numel), u.grad_orig_dtype);
    set_sharded_states(f.sharded_params + f.ignored_params, f.sharded_grads, moments, steps);
    e.fsdp = std::move(f);
  }
  if (f1opt.on) {
    // one rank's model states, from the layouts the simulator allocates: each unit's padded shard S in the orig
    // dtype (_local_shard, and _saved_grad_shard after the backward), AdamW's state over the original parameters'
    // shard views (use_orig_params: numel_in_shard elements each, the padding excluded)
    Fsdp1Figures f;
    Bytes moments, steps;
    f.options = f1opt;
    f.units = fsdp1_units(m, inv, f1opt);
    for (const Fsdp1Unit& u : f.units) {
      const Fsdp1Layout& l = u.layout;
      f.shard_elems = checked_add(f.shard_elems, l.shard_numel, "FSDP1 shard");
      f.padding_elems = checked_add(f.padding_elems, l.padded_unsharded_numel - l.params, "FSDP1 padding");
      for (size_t p = 0; p < u.rows.size(); ++p) {
        const uint64_t n = fsdp1_numel_in_shard(l, p, f1opt.rank);
        if (n == 0) continue;  // not in this rank's shard: no .grad, no state
        f.local_elems = checked_add(f.local_elems, n, "FSDP1 shard");
        for (const StateTensor& t : optimizer_state_tensors(s.optimizer, e.setup.optimizer_impl, {n}, f1opt.orig_dtype,
                                                            bnb_block_size(s.optimizer_version))) {
          const Bytes b = bytes_of(numel(t.shape), t.dtype);
          f.optimizer_state += b;
          (std::string_view(t.what) == "step" ? steps : moments) += b;
        }
      }
    }
    f.sharded_params = bytes_of(Elems(f.shard_elems), f1opt.orig_dtype);
    f.sharded_grads = f.sharded_params;
    // no_sync (--grad-accum N > 1): _post_backward_hook keeps flat_param.grad, the unpadded unsharded flat gradient
    // autograd computed in param_dtype (_runtime_utils.py: `if not state._sync_gradients: ... return`)
    if (s.grad_accum > 1) {
      for (const Fsdp1Unit& u : f.units) f.no_sync_kept_grads += bytes_of(Elems(u.layout.unpadded_numel), f1opt.param_dtype);
    }
    set_sharded_states(f.sharded_params, f.sharded_grads, moments, steps);
    e.fsdp1 = std::move(f);
  }
  if (const DdpOptions& d = ddp; d.on) {
    DdpFigures f;
    f.ranks = d.ranks;
    f.bucket_cap_bytes = d.bucket_bytes;
    f.first_bucket_cap_bytes = d.first_bucket_bytes;
    f.gradient_as_bucket_view = d.bucket_view;
    f.find_unused_parameters = d.find_unused;
    f.rebuilds = d.rebuild;
    f.rebuild_step = sim->ddp_rebuild_step;
    for (size_t k = 0; k < sim->ddp_buckets.size() && k < 2; ++k) {
      for (const DdpBucket& b : sim->ddp_buckets[k]) {
        (k == 0 ? f.initial_buckets : f.rebuilt_buckets).push_back(b.bytes);
        (k == 0 ? f.initial_params : f.rebuilt_params).push_back(b.indices);
      }
    }
    e.ddp = std::move(f);
  }
  PeakBreakdown& pk = e.peak;
  pk.saved_activations = sim->saved_activations;
  pk.live_total = sim->peak.live.total;
  pk.phase = sim->peak.phase;
  pk.step = sim->peak.step;
  pk.micro = sim->peak.micro;
  pk.activations = sim->activations_at_peak;
  for (size_t i = 0; i < kCategoryCount; ++i) {
    const Category c = static_cast<Category>(i);
    const Bytes b = sim->peak.live.by_category[i];
    if (b.value == 0 && c != Category::kActivations) continue;
    pk.components.push_back({std::string(category_name(c)), b, category_note(c)});
  }

  const auto alloc = std::make_shared<const AllocatorReplay>(replay_allocator(sim->timeline, ac, o.torch, std::nullopt));
  e.alloc = alloc;
  AllocatorFigures& mem = e.memory;
  if (!alloc->allocated.empty()) {
    mem.steady_state = Bytes(alloc->allocated[sim->steady.event]);
    mem.steady_state_reserved = Bytes(alloc->reserved[sim->steady.event]);
    // SimResult::after_forward.event is the index of the first event after the forward
    const size_t af = sim->after_forward.event == 0 ? 0 : sim->after_forward.event - 1;
    mem.after_forward = Bytes(alloc->allocated[af]);
    mem.after_forward_reserved = Bytes(alloc->reserved[af]);
  }
  if (s.generate > 0 && !alloc->allocated.empty()) e.generation = generation_figures(*sim, *alloc, s);
  mem.peak_allocated = alloc->peak_allocated;
  mem.peak_reserved = alloc->peak_reserved;
  mem.fragmentation = mem.peak_reserved - mem.peak_allocated;
  mem.segments = alloc->segments_peak;
  if (gpu) e.device = device_verdict(e, *gpu, ac, margin);
  if (gpu) e.time = step_time(e, *gpu);
  return e;
}

}  // namespace trainmem
