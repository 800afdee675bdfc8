// The step time of a simulated step on a GPU (trainmem/flops.h): a roofline per counted kernel, a launch
// overhead per kernel, and the data-parallel and tensor-parallel collectives over the catalog's link bandwidth,
// overlapped with compute as the frameworks overlap them; under a pipeline, the schedule over every rank's
// step (pipeline_step_time). Nothing here is fitted to a measurement.
#include <algorithm>

#include <fmt/format.h>

#include "trainmem/estimate.h"
#include "trainmem/error.h"
#include "trainmem/names.h"
#include "trainmem/nccl.h"
#include "trainmem/plan.h"

namespace trainmem {

namespace {

// CUDA kernel launch overhead, seconds per kernel: "Every time the CPU submits a kernel to the GPU, it goes
// through a series of driver and runtime calls. This process takes about 4-6 μs" (susun-blog.com, "pegainfer
// (3): From Launch Overhead to CUDA Graph", measured on an RTX 5070 Ti, CUDA 13.0); the lower end, added to
// every kernel (PyTorch eager launches each op's kernel from the host; CPU-side framework overhead is not
// modelled, nor is the overlap of a launch with the previous kernel).
constexpr double kLaunchSeconds = 4e-6;

// The FLOP/s a product in `dt` runs at: the tensor-core peak of its dtype. float32 products run on the CUDA
// cores: torch.backends.cuda.matmul.allow_tf32 is False by default since PyTorch 1.12 (torch/backends/cuda
// docs: "allow_tf32 ... defaults to False"), so TF32 is not used.
double product_peak(const GpuPerf& g, DType dt) {
  double t = g.fp32_tflops;
  if (dt == DType::kBF16 && g.bf16_tflops > 0) t = g.bf16_tflops;
  if (dt == DType::kF16 && g.fp16_tflops > 0) t = g.fp16_tflops;
  return t * 1e12;
}

// NCCL's ring algorithms (nccl-tests doc/PERFORMANCE.md, "bus bandwidth"): an all-reduce over n ranks moves
// 2(n-1)/n of the buffer over each rank's link, an all-gather or a reduce-scatter (n-1)/n of the whole
// (gathered) buffer.
double all_reduce_seconds(double bytes, uint64_t n, double bw) {
  return n <= 1 ? 0.0 : 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) * bytes / bw;
}
double all_gather_seconds(double full_bytes, uint64_t n, double bw) {
  return n <= 1 ? 0.0 : static_cast<double>(n - 1) / static_cast<double>(n) * full_bytes / bw;
}

// Where the collectives run. The ranks are laid out as nccl.cc's process_groups() says (consecutive per node,
// rank = node x gpus_per_node + local; tensor parallel innermost, then context, data, pipeline outermost:
// torchtitan's mesh ["pp", "dp_replicate", "dp_shard", "cp", "tp"], accelerate's ["dp_replicate", "dp_shard", "cp",
// "sp", "tp"]). A group all of whose members share a node runs its ring over the node's link (NVLink) at
// link_gbps; a group that spans nodes runs it through each GPU's NIC: NCCL's ring crosses every node boundary over
// the network, so its bus bandwidth (nccl-tests doc/PERFORMANCE.md: busBw, the per-rank link speed the ring's
// 2(n-1)/n or (n-1)/n factor is measured against) is bounded by min(NVLink, NIC) = the NIC's. The NIC's: the
// catalog's reference node (GpuPerf::net_gbps) or --net-gbps; a card with neither keeps link_gbps (noted).
// Not modelled: NCCL's tree and NVLS/SHARP algorithms, rail-optimised versus other fabrics, congestion.
struct Fabric {
  std::vector<ProcessGroup> groups;
  uint64_t per_node = 8;
  double link = 0, net = 0;  // bytes/s
  bool net_known = false;
  std::string net_from;
  std::vector<std::string> spanning;  // the timed groups (and sends) that cross nodes, for the note
};
Fabric fabric(const TrainSetup& s, const GpuPerf& g) {
  Fabric f;
  f.groups = process_groups(s);
  f.per_node = std::max<uint64_t>(s.nccl.gpus_per_node, 1);
  f.link = g.link_gbps * 1e9;
  if (s.nccl.net_gbps) {
    f.net = *s.nccl.net_gbps * 1e9;
    f.net_known = true;
    f.net_from = "--net-gbps";
  } else if (g.net_gbps > 0) {
    f.net = g.net_gbps * 1e9;
    f.net_known = true;
    f.net_from = g.net_node + ", data/gpus/gpus.json net_source";
  }
  return f;
}
// The bandwidth of the `kind` group's collectives; records the group when it spans nodes.
double group_bw(Fabric& f, ProcessGroup::Kind kind, const char* what) {
  for (const ProcessGroup& p : f.groups) {
    if (p.kind != kind || p.ranks < 2) continue;
    if (local_ranks(p, f.per_node) >= p.ranks) return f.link;
    if (std::find(f.spanning.begin(), f.spanning.end(), what) == f.spanning.end()) f.spanning.push_back(what);
    return f.net_known ? std::min(f.link, f.net) : f.link;
  }
  return f.link;
}
// The note on the groups that cross nodes (none: no note, the single-node output unchanged).
void fabric_note(StepTime& t, const Fabric& f, const GpuSpec& gpu) {
  if (f.spanning.empty()) return;
  std::string what;
  for (size_t i = 0; i < f.spanning.size(); ++i) {
    what += (i == 0 ? "" : i + 1 == f.spanning.size() ? " and " : ", ") + f.spanning[i];
  }
  if (f.net_known) {
    t.notes.push_back(fmt::format(
        "{} span nodes ({} GPUs per node, ranks consecutive, tensor parallel innermost): timed at the network's {} GB/s "
        "per GPU and direction ({}); groups within a node at the link's {} GB/s",
        what, f.per_node, f.net / 1e9, f.net_from, gpu.perf.link_gbps));
  } else {
    t.notes.push_back(fmt::format(
        "{} span nodes ({} GPUs per node): timed at the node's link bandwidth ({} GB/s); the {} has no reference "
        "multi-node system in the catalog, so its inter-node network is unknown (pass --net-gbps)",
        what, f.per_node, gpu.perf.link_gbps, gpu.name));
  }
}

// HSDP's replicate group's bandwidth (records it when it spans nodes); the link's without HSDP (unused then).
double hsdp_ar_bw(Fabric& f, const FsdpFigures& fs) {
  if (fs.options.replicate <= 1) return f.link;
  return group_bw(f, ProcessGroup::Kind::kDataReplicate, "HSDP replicate groups");
}

// The roofline over one ledger's kernels: each at the slower of its FLOPs (products at the measured share of
// their dtype's peak, the rest on the CUDA cores at the FP32 peak) and its bytes (at the memory bandwidth), plus
// a launch each; by bound and by phase.
struct KernelSeconds {
  double compute_bound = 0, memory_bound = 0, launch = 0;
  std::array<double, kWorkPhases> phase{};
  double total() const { return compute_bound + memory_bound + launch; }
};
KernelSeconds kernel_seconds(const FlopLedger& L, const GpuPerf& g) {
  KernelSeconds k;
  const double hbm = g.hbm_gbps * 1e9;
  for (const KernelRow& r : L.rows) {
    const bool product = r.kind == FlopKind::kMatmul || r.kind == FlopKind::kAttention;
    // products at the measured achievable share of the peak; the rest on the CUDA cores at the FP32 peak
    const double peak = product ? product_peak(g, r.dtype) * g.matmul_efficiency : g.fp32_tflops * 1e12;
    const double tf = static_cast<double>(r.flops) / peak;
    const double tb = static_cast<double>(r.bytes) / hbm;
    const double n = static_cast<double>(r.count);
    (tf >= tb ? k.compute_bound : k.memory_bound) += std::max(tf, tb) * n;
    k.launch += kLaunchSeconds * n;
    k.phase[static_cast<size_t>(r.phase)] += (std::max(tf, tb) + kLaunchSeconds) * n;
  }
  return k;
}

// The ledger's totals and its kernels' roofline into `t`.
void set_kernels(StepTime& t, const FlopLedger& L, const KernelSeconds& k) {
  t.flops = L.total_flops();
  t.flops_by = L.flops;
  t.bytes_by = L.bytes;
  t.kernels = L.kernels;
  t.compute_bound_seconds = k.compute_bound;
  t.memory_bound_seconds = k.memory_bound;
  t.launch_seconds = k.launch;
  t.phase_seconds = k.phase;
}

// Tensor parallelism's collectives of one phase (transformers' tp_plan): each blocks the op after it.
double tp_seconds(const FlopLedger& L, WorkPhase p, uint64_t tp, double bw) {
  if (tp <= 1) return 0.0;
  const size_t i = static_cast<size_t>(p);
  return all_reduce_seconds(static_cast<double>(L.tp_all_reduce_bytes[i]), tp, bw) +
         all_gather_seconds(static_cast<double>(L.tp_all_gather_bytes[i]), tp, bw);
}

// FSDP2's collectives per pass over the units: the all-gathers before the forward, those again before the
// backward (units resharded after their forward, not the root), the reduce-scatters; `first` is the first unit's
// all-gather, which nothing hides (with several FSDP roots, one per stage module under interleaved-1f1b, each root's
// first, summed: an upper bound, as a later stage's first gather may run behind the earlier stage's compute).
// HSDP (--dp-shard K): the gathers and reduce-scatters run in the dp_shard group (K ranks, `bw`), and each unit's
// reduced shard (reduce dtype) is all-reduced over the dp_replicate group (R ranks, `ar_bw`) after its
// reduce-scatter (foreach_reduce: all_reduce_stream waits for the reduce-scatter stream); `ar` sums them.
// `post_backward` is the reduce-scatters and all-reduces together: one after the other on one link (both groups on
// NVLink, or both through the NIC), side by side when they use different links (the units pipeline: unit i's
// all-reduce runs beside unit i-1's reduce-scatter).
struct FsdpSeconds {
  double ag_fwd = 0, ag_bwd = 0, rs = 0, first = 0, ar = 0, post_backward = 0;
};
FsdpSeconds fsdp_seconds(const FsdpFigures& f, double bw, double ar_bw) {
  const FsdpOptions& o = f.options;
  FsdpSeconds x;
  const uint64_t dp = o.ranks;  // the shard group: --dp (x cp), or HSDP's dp_shard
  for (size_t i = 0; i < f.units.size(); ++i) {
    const FsdpUnit& u = f.units[i];
    // the gathered bytes and the reduce-scattered ones (trainable rows only: PEFT's frozen base is gathered, never
    // reduced) from fsdp_unit_buffers; without LoRA, shard_numel x W in param_dtype and reduce_dtype
    const double full = static_cast<double>(u.gather_numel) * static_cast<double>(dp);
    const double grads = static_cast<double>(u.grad_numel) * static_cast<double>(dp);
    const double a = all_gather_seconds(full * static_cast<double>(itemsize(u.gather_dtype)), dp, bw);
    // each FSDP root's first all-gather (one root but under interleaved-1f1b, where each stage module is one)
    if (std::find(f.root_begin.begin(), f.root_begin.end(), i) != f.root_begin.end()) x.first += a;
    x.ag_fwd += a;
    if (u.reshard_after_forward && u.kind != FsdpUnit::kRoot) x.ag_bwd += a;
    if (u.grad_numel == 0) continue;  // a frozen unit: no reduce-scatter
    x.rs += all_gather_seconds(grads * static_cast<double>(itemsize(u.reduce_dtype)), dp, bw);
    if (o.replicate > 1) {
      x.ar += all_reduce_seconds(static_cast<double>(u.grad_numel) * static_cast<double>(itemsize(u.reduce_dtype)),
                                 o.replicate, ar_bw);
    }
  }
  x.post_backward = ar_bw == bw ? x.rs + x.ar : std::max(x.rs, x.ar);
  return x;
}

// Model FLOPs (PaLM, Chowdhery et al. 2022, appendix B: MFU counts the model's forward and backward, not
// rematerialisation): the simulated products of the forward and backward, per rank.
uint64_t model_flops(const FlopLedger& L) {
  uint64_t model = 0;
  for (WorkPhase p : {WorkPhase::kForward, WorkPhase::kBackward}) {
    for (FlopKind k : {FlopKind::kMatmul, FlopKind::kAttention}) {
      model = checked_add(model, L.flops[static_cast<size_t>(p)][static_cast<size_t>(k)], "model FLOPs");
    }
  }
  return model;
}

// The notes every step time carries where they apply.
void common_notes(StepTime& t, const GpuSpec& gpu, const TrainSetup& s) {
  if (gpu.perf.matmul_efficiency >= 1) {
    t.notes.push_back(fmt::format("{}: no measured matmul efficiency in the catalog; products at the datasheet peak",
                                  gpu.name));
  }
  if (s.optimizer != Optimizer::kAdamW && s.optimizer != Optimizer::kAdam && s.optimizer != Optimizer::kSgd &&
      s.optimizer != Optimizer::kSgdMomentum && s.optimizer != Optimizer::kNone) {
    t.notes.push_back("this optimizer's update is not counted");
  }
}

}  // namespace

std::optional<StepTime> step_time(const Estimate& e, const GpuSpec& gpu) {
  // --pp: the pipeline's step, computed from every rank by estimate() (pipeline_step_time)
  if (e.pp) return e.time;
  const GpuPerf& g = gpu.perf;
  if (!g.known() || !e.sim) return std::nullopt;
  const TrainSetup& s = e.setup;
  // not modelled: expert parallelism's all-to-alls, and the offloaded optimizer's and parameters' host work and
  // copies; a pipeline's ranks (pipeline_step_time has them all)
  if (s.pp > 1 || s.ep > 1 || s.offload_optimizer || s.offload_params) {
    return std::nullopt;
  }
  const FlopLedger& L = e.sim->flops;
  if (L.overflow) return std::nullopt;  // FLOPs beyond 2^64: no figure to time
  StepTime t;
  set_kernels(t, L, kernel_seconds(L, g));
  const double compute = t.compute_bound_seconds + t.memory_bound_seconds + t.launch_seconds;
  const uint64_t micro = s.task == Task::kTrain ? std::max<uint64_t>(s.grad_accum, 1) : 1;
  const double m = static_cast<double>(micro);  // the step's micro-batches, as a factor of per-micro-batch times
  const double fwd = t.phase_seconds[static_cast<size_t>(WorkPhase::kForward)] / m;
  const double bwd = (t.phase_seconds[static_cast<size_t>(WorkPhase::kBackward)] +
                      t.phase_seconds[static_cast<size_t>(WorkPhase::kRecompute)]) /
                     m;
  Fabric fab = fabric(s, g);
  double exposed = 0, total = 0;

  // Tensor parallelism (transformers' tp_plan): each all-reduce and all-gather blocks the op after it; none is
  // overlapped.
  if (s.tp > 1) {
    const double tp_bw = group_bw(fab, ProcessGroup::Kind::kTensor, "tensor-parallel groups");
    for (size_t p = 0; p < kWorkPhases; ++p) {
      const double c = tp_seconds(L, static_cast<WorkPhase>(p), s.tp, tp_bw);
      total += c;
      exposed += c;
    }
  }
  // Context parallel (cp.h, src/sim/cp_attention.cc): each ring-attention call's K/V all-gather (_AllGatherRotater,
  // in forward, recompute and backward) and, in backward, one float32 dK/dV permute per ring step
  // (_AllToAllRotater: ft_c.permute_tensor, each rank's buffer to its ring neighbour), as the simulated step
  // allocated them (their buffers' bytes, the last step's). Timed as all exposed (an upper bound): the all-gather
  // is issued before the first ring step and waited on at the second, so only the causal local block can hide
  // it; each permute hides behind the next step's flash backward, the last one behind nothing.
  if (s.cp > 1) {
    const double cp_bw = group_bw(fab, ProcessGroup::Kind::kContext, "context-parallel groups");
    uint32_t last = 0;
    for (const Event& ev : e.sim->timeline.events) last = std::max(last, ev.step);
    double c = 0;
    for (const Event& ev : e.sim->timeline.events) {
      if (ev.kind != Event::kAlloc || ev.step != last) continue;
      std::string_view w(ev.label.what);
      if (w.starts_with("recompute: ")) w.remove_prefix(11);  // full checkpointing's forward, run again
      if (w == "cp kv all-gather") c += all_gather_seconds(static_cast<double>(ev.bytes.value), s.cp, cp_bw);
      if (w == "cp grad kv all-to-all") c += static_cast<double>(ev.bytes.value) / cp_bw;
    }
    total += c;
    exposed += c;
    t.notes.push_back("context parallel: the ring's K/V all-gathers and dK/dV permutes are timed as exposed (an upper "
                      "bound: the causal first block and each next step's backward can hide part of them); the ring's "
                      "kernels at the roofline, not validated: torchtitan's measured tokens/s fall faster with cp");
  }
  // FSDP2 under --cp shards over dp x cp ranks (fsdp.h fsdp2_mesh_ranks): its collectives run over all of them
  const uint64_t dp = e.fsdp ? e.fsdp->options.ranks : s.dp;
  const double bw = dp > 1 ? group_bw(fab, ProcessGroup::Kind::kData, "data-parallel groups") : fab.link;
  if (e.ddp && dp > 1) {
    // DDP: the Reducer all-reduces each bucket as soon as its gradients are ready, during the synced
    // micro-batch's backward (torch/csrc/distributed/c10d/reducer.cpp mark_bucket_ready ->
    // all_reduce_bucket). Exposed: what the backward cannot hide, and at least the last bucket, which is ready
    // only when the backward ends.
    const std::vector<uint64_t>& b = e.ddp->rebuilt_buckets.empty() ? e.ddp->initial_buckets : e.ddp->rebuilt_buckets;
    double all = 0, last = 0;
    for (uint64_t x : b) all += all_reduce_seconds(static_cast<double>(x), dp, bw);
    if (!b.empty()) last = all_reduce_seconds(static_cast<double>(b.back()), dp, bw);
    total += all;
    exposed += std::max(all - bwd, last);
  } else if (e.zero && e.zero->options.stage == 3 && dp > 1) {
    // DeepSpeed ZeRO-3 (stage3.py, partitioned_param_coordinator.py): the simulator's own all-gathers and
    // reduce-scatters where it issues them (FlopLedger::dp_*, loop.cc z3_gather / z3_reduce_ipg): each module's
    // parameters gathered before its forward and, unless max_reuse_distance kept them, again before its backward
    // (or recomputation), the next modules of the trace prefetched behind the current one's compute
    // (stage3_prefetch_bucket_size); the gradients reduce-scattered per IPG bucket during every micro-batch's
    // backward, overlapped with it when overlap_comm (True for stage 3). Exposed per micro-batch: the largest
    // gather of each pass (the embedding's, the first of the forward, in the Llama-shaped models), which
    // nothing prefetches, and what each pass's compute cannot hide.
    auto gather = [&](WorkPhase p) {
      return all_gather_seconds(static_cast<double>(L.dp_all_gather_bytes[static_cast<size_t>(p)]), dp, bw);
    };
    auto largest = [&](WorkPhase p) {
      return all_gather_seconds(static_cast<double>(L.dp_largest_gather_bytes[static_cast<size_t>(p)]), dp, bw);
    };
    const double ag_fwd = gather(WorkPhase::kForward) / m;
    const double ag_bwd = (gather(WorkPhase::kBackward) + gather(WorkPhase::kRecompute)) / m;
    const double first_fwd = largest(WorkPhase::kForward);
    const double first_bwd = std::max(largest(WorkPhase::kBackward), largest(WorkPhase::kRecompute));
    double rs_bytes = 0;
    for (uint64_t x : L.dp_reduce_scatter_bytes) rs_bytes += static_cast<double>(x);
    const double rs = all_gather_seconds(rs_bytes, dp, bw) / m;
    total += (ag_fwd + ag_bwd + rs) * m;
    t.notes.push_back("ZeRO-3: the simulated all-gathers and reduce-scatters are timed; DeepSpeed's per-module hooks "
                      "(fetch, prefetch, release: Python on the host between kernels) are not, nor ZeRO-3's own kernels "
                      "around them (the gathers' copies, the gradients' partition copies)");
    exposed += (first_fwd + std::max(0.0, ag_fwd - first_fwd - fwd) + first_bwd +
                std::max(0.0, ag_bwd - first_bwd - bwd) + (e.zero->options.overlap_comm ? std::max(0.0, rs - bwd) : rs)) *
               m;
  } else if (e.zero && dp > 1) {
    // DeepSpeed ZeRO-1/2: the gradients are reduce-scattered during the synced backward (overlapped when
    // overlap_comm), then the updated bit16 partitions are all-gathered after the step (all_gather_dp_groups),
    // on the critical path.
    const double grads = static_cast<double>(e.zero->bit16_flat.value);
    const double rs = all_gather_seconds(grads, dp, bw);
    const double ag = all_gather_seconds(grads, dp, bw);
    total += rs + ag;
    exposed += (e.zero->options.overlap_comm ? std::max(0.0, rs - bwd) : rs) + ag;
  } else if (e.fsdp && dp > 1) {
    // FSDP2 (fully_shard): each unit's parameters are all-gathered before its forward and, resharded after it,
    // again before its backward; its gradients are reduce-scattered after its backward (the synced
    // micro-batch). The next unit's all-gather is prefetched behind the current unit's compute (implicit
    // forward prefetch, backward prefetch by default): exposed is the first unit's gather and what each pass's
    // compute cannot hide.
    // HSDP (--dp-shard K): those in the dp_shard group, and each unit's all-reduce over dp_replicate after its
    // reduce-scatter (fsdp_seconds), counted as the reduce-scatters are
    const auto [ag_fwd, ag_bwd, rs, first, ar, post] = fsdp_seconds(*e.fsdp, bw, hsdp_ar_bw(fab, *e.fsdp));
    total += (ag_fwd + ag_bwd) * m + rs + ar;
    exposed += (first + std::max(0.0, ag_fwd - first - fwd) + std::max(0.0, ag_bwd - bwd)) * m +
               std::max(0.0, post - bwd);
  }
  if (e.fsdp1 && dp > 1) {
    // FSDP1 (FullyShardedDataParallel, FULL_SHARD): each FlatParameter all-gathered (W x S, param_dtype) before its
    // forward, the layers' again before their backward (the root stays unsharded), each unit's flat gradient
    // reduce-scattered (reduce_dtype) in its post-backward. Forward: the CPU issues the next unit's all-gather on the
    // unshard stream while the GPU computes (first exposed, the rest behind the forward's compute). Backward:
    // BACKWARD_PRE issues the next unit's all-gather at the current unit's pre-backward (behind the backward's
    // compute); without backward prefetch (the Trainer's NO_PREFETCH) each is issued at its own unit's pre-backward
    // and waited on at once: exposed.
    const Fsdp1Options& o = e.fsdp1->options;
    double ag_fwd = 0, ag_bwd = 0, rs = 0, first = 0;
    for (const Fsdp1Unit& u : e.fsdp1->units) {
      const double full = static_cast<double>(u.layout.padded_unsharded_numel);
      const double a = all_gather_seconds(full * static_cast<double>(itemsize(o.param_dtype)), dp, bw);
      if (u.kind == Fsdp1Unit::kRoot) first = a;  // the root's, before the embedding
      ag_fwd += a;
      if (u.kind != Fsdp1Unit::kRoot) ag_bwd += a;
      rs += all_gather_seconds(full * static_cast<double>(itemsize(o.reduce_dtype)), dp, bw);
    }
    // --grad-accum M: the all-gathers run in every micro-batch (FULL_SHARD reshards under no_sync too), the
    // reduce-scatters in the synced last one only (the Trainer's no_sync before it)
    total += (ag_fwd + ag_bwd) * m + rs;
    exposed += (first + std::max(0.0, ag_fwd - first - fwd) + (o.backward_prefetch ? std::max(0.0, ag_bwd - bwd) : ag_bwd)) * m +
               std::max(0.0, rs - bwd);
  }
  t.comm_seconds = total;
  t.comm_exposed_seconds = exposed;
  t.comm_overlapped_seconds = std::max(0.0, total - exposed);
  t.step_seconds = compute + exposed;
  fabric_note(t, fab, gpu);
  // tokens of one optimizer step over every data-parallel rank (a tensor-parallel group shares its tokens; each
  // of the cp ranks of a context-parallel group holds seq / cp of its sequences' tokens)
  uint64_t tokens = checked_mul(s.batch, s.seq, "tokens");
  if (s.task == Task::kTrain) {
    tokens = checked_mul(checked_mul(tokens, micro, "tokens"),
                         checked_mul(std::max<uint64_t>(s.dp, 1), std::max<uint64_t>(s.cp, 1), "tokens"), "tokens");
  }
  if (s.task == Task::kInference && s.generate > 0) tokens = checked_mul(s.batch, s.generate, "tokens");
  t.tokens = tokens;
  t.tokens_per_second = t.step_seconds > 0 ? static_cast<double>(tokens) / t.step_seconds : 0;
  const uint64_t model = model_flops(L);
  t.model_flops = model;
  // (torchtitan's FSDP2 over the sequence-parallel model computes in its param_dtype, without autocast:
  // resolve_sp_fsdp, as under a pipeline below)
  const bool tt_sp = e.fsdp && e.fsdp->torchtitan_sp && e.fsdp->options.mixed;
  t.peak_tflops = product_peak(g, tt_sp ? e.fsdp->options.param_dtype : compute_dtype(s.precision)) / 1e12;
  t.mfu = t.step_seconds > 0 ? static_cast<double>(model) / (t.step_seconds * t.peak_tflops * 1e12) : 0;
  common_notes(t, gpu, s);
  return t;
}

// --pp > 1. The pipeline's step from every rank's simulated step (ranks[r] is rank r's Estimate, its ledger over
// its stages and every micro-batch):
//   step = G + M·max_r(f_r + b_r) + Σ_{r ≠ slowest}(f_r + b_r) / v + S + max_r(rs_r + o_r)
// f_r, b_r: rank r's forward and backward (with recomputation) per micro-batch, kernels and blocking
// tensor-parallel collectives; M micro-batches; v stages per rank. For p equal stages the middle terms are
// (m + p - 1)(t_f + t_b) for GPipe and 1F1B, whose pipeline bubble is (p - 1)(t_f + t_b), a fraction (p - 1)/m of
// the ideal m(t_f + t_b) (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
// Using Megatron-LM", SC'21, section 2.2.1), and the interleaved schedule divides the bubble by v (section
// 2.2.2; arXiv 2104.04473). The bubble's share of the whole step, (p - 1)/(m + p - 1), is what Huawei's CANN 7.0
// large-model training guide states for 1F1B (hiascend.com, page PT_LMTMOG_000086, pipeline bubble analysis).
// With unequal stages the slowest stage sets the steady pace and every other stage's forward and backward of one
// micro-batch lies on the fill and drain once.
// S: the sends of the stage outputs (B, T, C) forward and their gradients backward, point to point at the link
// bandwidth; on the critical path on the fill and drain only (2(p·v - 1) sends: the first micro-batch's
// forward crosses every stage boundary, the last one's backward too); in the steady phase each send overlaps
// the other micro-batches' compute.
// G: FSDP2 under torchtitan's pipeline keeps the parameters unsharded across the micro-batches
// (reshard_after_forward False; src/sim/fsdp.cc pp_*): each unit is all-gathered once, by the rank's first
// forward (the root's pre-forward hook; the next unit prefetched behind the current one's compute), and the
// first micro-batch reaches rank r only after rank r - 1's first forward: the exposed all-gathers of every rank
// add up along the fill.
// rs_r, o_r: the reduce-scatters, once after the last backward (pp_post_backward), and the optimizer; each rank
// steps on its own, the step ends with the last (an upper bound: ranks past the first end their last backward
// before rank 0 does).
std::optional<StepTime> pipeline_step_time(const std::vector<Estimate>& ranks, const PpFigures& f,
                                           const GpuSpec& gpu) {
  const GpuPerf& g = gpu.perf;
  if (!g.known() || ranks.size() != f.ranks || ranks.empty()) return std::nullopt;
  const TrainSetup& s = ranks[0].setup;
  // not modelled beside the pipeline: as step_time
  if (s.cp > 1 || s.ep > 1 || s.offload_optimizer || s.offload_params || s.task != Task::kTrain) return std::nullopt;
  for (const Estimate& e : ranks) {
    if (!e.sim || e.sim->flops.overflow || (e.zero && e.zero->options.stage == 3)) return std::nullopt;
  }
  Fabric fab = fabric(s, g);
  const double tp_bw = s.tp > 1 ? group_bw(fab, ProcessGroup::Kind::kTensor, "tensor-parallel groups") : fab.link;
  const double M = static_cast<double>(std::max<uint64_t>(f.micro_batches, 1));
  const uint64_t v = std::max<uint64_t>(f.virtual_stages, 1);
  const uint64_t dp = s.dp;
  const double dp_bw = dp > 1 ? group_bw(fab, ProcessGroup::Kind::kData, "data-parallel groups") : fab.link;
  PipelineTime pt;
  pt.schedule = std::string(name_of(f.schedule));
  pt.ranks = f.ranks;
  pt.micro_batches = f.micro_batches;
  pt.virtual_stages = v;
  StepTime t;
  std::vector<double> fwd(ranks.size()), bwd(ranks.size());
  uint64_t model_sum = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const Estimate& e = ranks[r];
    const FlopLedger& L = e.sim->flops;
    const KernelSeconds k = kernel_seconds(L, g);
    const double tpf = tp_seconds(L, WorkPhase::kForward, s.tp, tp_bw);
    const double tpb =
        tp_seconds(L, WorkPhase::kBackward, s.tp, tp_bw) + tp_seconds(L, WorkPhase::kRecompute, s.tp, tp_bw);
    const double tpo = tp_seconds(L, WorkPhase::kOptimizer, s.tp, tp_bw);
    fwd[r] = (k.phase[static_cast<size_t>(WorkPhase::kForward)] + tpf) / M;
    bwd[r] = (k.phase[static_cast<size_t>(WorkPhase::kBackward)] + k.phase[static_cast<size_t>(WorkPhase::kRecompute)] +
              tpb) / M;
    const double opt = k.phase[static_cast<size_t>(WorkPhase::kOptimizer)] + tpo;
    double gather = 0, rs = 0, comm = tpf + tpb + tpo;
    if (e.fsdp && dp > 1) {
      const FsdpSeconds x = fsdp_seconds(*e.fsdp, dp_bw, hsdp_ar_bw(fab, *e.fsdp));
      // one gather per unit per step (no unit reshards after its forward under the pipeline, so ag_bwd is 0)
      gather = x.first + std::max(0.0, x.ag_fwd - x.first - fwd[r]) + std::max(0.0, x.ag_bwd - bwd[r]);
      rs = x.post_backward;  // HSDP: with the all-reduces over dp_replicate (fsdp_seconds)
      comm += x.ag_fwd + x.ag_bwd + x.rs + x.ar;
    }
    pt.gather_seconds += gather;
    pt.tail_seconds = std::max(pt.tail_seconds, rs + opt);
    pt.rank_seconds.push_back(fwd[r] + bwd[r]);
    model_sum = checked_add(model_sum, model_flops(L), "model FLOPs");
    if (r == f.shown) {
      set_kernels(t, L, k);
      t.comm_seconds = comm;
      t.comm_exposed_seconds = tpf + tpb + tpo + gather + rs;
    }
  }
  size_t slow = 0;
  for (size_t r = 1; r < ranks.size(); ++r) {
    if (fwd[r] + bwd[r] > fwd[slow] + bwd[slow]) slow = r;
  }
  double others = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (r != slow) others += fwd[r] + bwd[r];
  }
  pt.slowest_rank = slow;
  pt.forward_seconds = fwd[slow];
  pt.backward_seconds = bwd[slow];
  pt.steady_seconds = M * (fwd[slow] + bwd[slow]);
  pt.bubble_seconds = others / static_cast<double>(v);
  // the stage output each rank sends (loop.cc pp_hidden_dtype): FSDP2's param_dtype under its mixed precision,
  // else the parameters' dtype
  const Estimate& shown = ranks[f.shown];
  const bool mixed = shown.fsdp && shown.fsdp->options.mixed;
  const DType hidden_dtype = mixed ? shown.fsdp->options.param_dtype : param_dtype(s.precision);
  const double hidden = static_cast<double>(s.batch) * static_cast<double>(s.seq) *
                        static_cast<double>(shown.model.hidden) * static_cast<double>(itemsize(hidden_dtype));
  const uint64_t boundaries = checked_mul(f.ranks, v, "pipeline stages") - 1;
  // each boundary's send at the link's bandwidth, or the network's where its two ranks sit on different nodes:
  // stage k on pipeline rank k mod p, the pipeline's ranks `stride` apart (pp outermost, nccl.cc process_groups),
  // taken for the pipeline group of global rank 0
  uint64_t stride = 1;
  for (const ProcessGroup& p : fab.groups) {
    if (p.kind == ProcessGroup::Kind::kPipeline) stride = std::max<uint64_t>(p.stride, 1);
  }
  const double net_bw = fab.net_known ? std::min(fab.link, fab.net) : fab.link;
  uint64_t crossing = 0;
  for (uint64_t k = 0; k < boundaries; ++k) {
    const uint64_t a = k % f.ranks, b = (k + 1) % f.ranks;
    if (a * stride / fab.per_node != b * stride / fab.per_node) ++crossing;
  }
  if (crossing > 0) fab.spanning.push_back(fmt::format("{} of the {} stage boundaries", crossing, boundaries));
  pt.send_seconds = 2.0 * static_cast<double>(boundaries - crossing) * hidden / fab.link +
                    2.0 * static_cast<double>(crossing) * hidden / net_bw;
  t.comm_seconds += pt.send_seconds;
  t.comm_exposed_seconds += pt.send_seconds;
  t.comm_overlapped_seconds = std::max(0.0, t.comm_seconds - t.comm_exposed_seconds);
  t.step_seconds = pt.gather_seconds + pt.steady_seconds + pt.bubble_seconds + pt.send_seconds + pt.tail_seconds;
  t.tokens = checked_mul(checked_mul(checked_mul(s.batch, s.seq, "tokens"), f.micro_batches, "tokens"),
                         std::max<uint64_t>(dp, 1), "tokens");
  t.tokens_per_second = t.step_seconds > 0 ? static_cast<double>(t.tokens) / t.step_seconds : 0;
  // MFU over the pipeline's GPUs: every rank's model FLOPs over (step · peak · p); model_flops is their mean
  t.model_flops = model_sum / f.ranks;
  t.peak_tflops = product_peak(g, mixed ? shown.fsdp->options.param_dtype : compute_dtype(s.precision)) / 1e12;
  t.mfu = t.step_seconds > 0 ? static_cast<double>(model_sum) /
                                   (t.step_seconds * t.peak_tflops * 1e12 * static_cast<double>(f.ranks))
                             : 0;
  t.notes.push_back(fmt::format(
      "pipeline ({}): micro-batches x the slowest rank's forward + backward, plus the other ranks' once on the fill "
      "and drain{} (for equal stages the bubble (p - 1)(t_f + t_b){}, Narayanan et al. 2021, section 2.2); the {} "
      "stage-to-stage sends of the fill and drain at the link bandwidth (the network's between nodes); then the "
      "longest of the ranks' reduce-scatters and optimizer",
      pt.schedule, v > 1 ? fmt::format(" divided by the {} stages per rank", v) : std::string(),
      v > 1 ? " / v" : "", 2 * boundaries));
  if (dp > 1 && shown.fsdp) {
    t.notes.push_back(v > 1 ? "FSDP2 under the pipeline, one FSDP root per stage module: each unit all-gathered once "
                              "per step, by its stage's first forward (every root's first gather counted exposed, on "
                              "every rank along the fill: an upper bound, as a later stage's first gather may run "
                              "behind the earlier stage's compute), and reduce-scattered once after its stage's last "
                              "backward, exposed"
                            : "FSDP2 under the pipeline: each unit all-gathered once per step, by the rank's first forward "
                              "(the exposed gathers of every rank add up along the fill), and reduce-scattered once after the "
                              "last backward, exposed");
  }
  fabric_note(t, fab, gpu);
  common_notes(t, gpu, s);
  t.pipeline = std::move(pt);
  return t;
}

// plan.h: the products alone, at the rate step_time() gives them (the lower bound plan prunes with).
double products_seconds(const FlopLedger& l, const GpuPerf& g) {
  double t = 0;
  for (const KernelRow& r : l.rows) {
    if (r.kind != FlopKind::kMatmul && r.kind != FlopKind::kAttention) continue;
    t += static_cast<double>(r.flops) * static_cast<double>(r.count) / (product_peak(g, r.dtype) * g.matmul_efficiency);
  }
  return t;
}

}  // namespace trainmem
