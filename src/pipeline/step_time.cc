// The step time of a simulated step on a GPU (trainmem/flops.h): a roofline per counted kernel, a launch
// overhead per kernel, and the data-parallel and tensor-parallel collectives over the catalog's link bandwidth,
// overlapped with compute as the frameworks overlap them. Nothing here is fitted to a measurement.
#include <algorithm>

#include <fmt/format.h>

#include "trainmem/estimate.h"
#include "trainmem/error.h"
#include "trainmem/plan.h"

namespace trainmem {

namespace {

// CUDA kernel launch overhead, seconds per kernel: "Every time the CPU submits a kernel to the GPU, it goes
// through a series of driver and runtime calls. This process takes about 4-6 μs" (susun-blog.com, "pegainfer
// (3): From Launch Overhead to CUDA Graph", measured on an RTX 5070 Ti, CUDA 13.0); the lower end, added to
// every kernel (PyTorch eager launches each op's kernel from the host; CPU-side framework overhead is not
// modelled, nor is the overlap of a launch with the previous kernel).
constexpr double kLaunchSeconds = 4e-6;
// A GPU node: NVLink (or PCIe) joins at most this many ranks; beyond, the inter-node network (InfiniBand, not in
// the catalog) carries the collectives, which here are still timed at the node's link bandwidth (a note says so).
// HGX/DGX A100 and H100 boards hold 8 GPUs (the catalog's nccl_source logs: 8 GPUs through NVSwitch).
constexpr uint64_t kGpusPerNode = 8;

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

}  // namespace

std::optional<StepTime> step_time(const Estimate& e, const GpuSpec& gpu) {
  const GpuPerf& g = gpu.perf;
  if (!g.known() || !e.sim) return std::nullopt;
  const TrainSetup& s = e.setup;
  // not modelled: the pipeline's bubble and sends, ring attention's exchanges, expert parallelism's all-to-alls,
  // ZeRO-3's gathers, and the offloaded optimizer's host work
  if (s.pp > 1 || s.cp > 1 || s.ep > 1 || (e.zero && e.zero->options.stage == 3) || s.offload_optimizer ||
      s.offload_params) {
    return std::nullopt;
  }
  const FlopLedger& L = e.sim->flops;
  if (L.overflow) return std::nullopt;  // FLOPs beyond 2^64: no figure to time
  StepTime t;
  t.flops = L.total_flops();
  t.flops_by = L.flops;
  t.bytes_by = L.bytes;
  t.kernels = L.kernels;
  const double hbm = g.hbm_gbps * 1e9;
  for (const KernelRow& r : L.rows) {
    const bool product = r.kind == FlopKind::kMatmul || r.kind == FlopKind::kAttention;
    // products at the measured achievable share of the peak; the rest on the CUDA cores at the FP32 peak
    const double peak = product ? product_peak(g, r.dtype) * g.matmul_efficiency : g.fp32_tflops * 1e12;
    const double tf = static_cast<double>(r.flops) / peak;
    const double tb = static_cast<double>(r.bytes) / hbm;
    const double n = static_cast<double>(r.count);
    (tf >= tb ? t.compute_bound_seconds : t.memory_bound_seconds) += std::max(tf, tb) * n;
    t.launch_seconds += kLaunchSeconds * n;
    t.phase_seconds[static_cast<size_t>(r.phase)] += (std::max(tf, tb) + kLaunchSeconds) * n;
  }
  const double compute = t.compute_bound_seconds + t.memory_bound_seconds + t.launch_seconds;
  const uint64_t micro = s.task == Task::kTrain ? std::max<uint64_t>(s.grad_accum, 1) : 1;
  const double fwd = t.phase_seconds[static_cast<size_t>(WorkPhase::kForward)] / static_cast<double>(micro);
  const double bwd = (t.phase_seconds[static_cast<size_t>(WorkPhase::kBackward)] +
                      t.phase_seconds[static_cast<size_t>(WorkPhase::kRecompute)]) /
                     static_cast<double>(micro);
  const double bw = g.link_gbps * 1e9;
  double exposed = 0, total = 0;

  // Tensor parallelism (transformers' tp_plan): each all-reduce and all-gather blocks the op after it; none is
  // overlapped.
  if (s.tp > 1) {
    for (size_t p = 0; p < kWorkPhases; ++p) {
      const double c = all_reduce_seconds(static_cast<double>(L.tp_all_reduce_bytes[p]), s.tp, bw) +
                       all_gather_seconds(static_cast<double>(L.tp_all_gather_bytes[p]), s.tp, bw);
      total += c;
      exposed += c;
    }
  }
  const uint64_t dp = s.dp;
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
    const FsdpOptions& o = e.fsdp->options;
    double ag_fwd = 0, ag_bwd = 0, rs = 0, first = 0;
    for (const FsdpUnit& u : e.fsdp->units) {
      const double full = static_cast<double>(u.shard_numel) * static_cast<double>(dp);
      const double a = all_gather_seconds(full * static_cast<double>(itemsize(o.param_dtype)), dp, bw);
      if (first == 0) first = a;
      ag_fwd += a;
      if (u.reshard_after_forward && u.kind != FsdpUnit::kRoot) ag_bwd += a;
      rs += all_gather_seconds(full * static_cast<double>(itemsize(o.reduce_dtype)), dp, bw);
    }
    const double m = static_cast<double>(micro);
    total += (ag_fwd + ag_bwd) * m + rs;
    exposed += (first + std::max(0.0, ag_fwd - first - fwd) + std::max(0.0, ag_bwd - bwd)) * m +
               std::max(0.0, rs - bwd);
  }
  t.comm_seconds = total;
  t.comm_exposed_seconds = exposed;
  t.comm_overlapped_seconds = std::max(0.0, total - exposed);
  t.step_seconds = compute + exposed;
  if (dp > kGpusPerNode || s.tp * dp > kGpusPerNode) {
    t.notes.push_back(fmt::format("more than {} ranks: collectives timed at the node's link bandwidth ({} GB/s); the "
                                  "inter-node network is not in the catalog",
                                  kGpusPerNode, g.link_gbps));
  }
  // tokens of one optimizer step over every data-parallel rank (a tensor-parallel group shares its tokens)
  uint64_t tokens = checked_mul(s.batch, s.seq, "tokens");
  if (s.task == Task::kTrain) {
    tokens = checked_mul(checked_mul(tokens, micro, "tokens"), std::max<uint64_t>(dp, 1), "tokens");
  }
  if (s.task == Task::kInference && s.generate > 0) tokens = checked_mul(s.batch, s.generate, "tokens");
  t.tokens = tokens;
  t.tokens_per_second = t.step_seconds > 0 ? static_cast<double>(tokens) / t.step_seconds : 0;
  // Model FLOPs (PaLM, Chowdhery et al. 2022, appendix B: MFU counts the model's forward and backward, not
  // rematerialisation): the simulated products of the forward and backward, per rank.
  uint64_t model = 0;
  for (WorkPhase p : {WorkPhase::kForward, WorkPhase::kBackward}) {
    for (FlopKind k : {FlopKind::kMatmul, FlopKind::kAttention}) {
      model = checked_add(model, L.flops[static_cast<size_t>(p)][static_cast<size_t>(k)], "model FLOPs");
    }
  }
  t.model_flops = model;
  t.peak_tflops = product_peak(g, compute_dtype(s.precision)) / 1e12;
  t.mfu = t.step_seconds > 0 ? static_cast<double>(model) / (t.step_seconds * t.peak_tflops * 1e12) : 0;
  if (g.matmul_efficiency >= 1) {
    t.notes.push_back(fmt::format("{}: no measured matmul efficiency in the catalog; products at the datasheet peak",
                                  gpu.name));
  }
  if (s.optimizer != Optimizer::kAdamW && s.optimizer != Optimizer::kAdam && s.optimizer != Optimizer::kSgd &&
      s.optimizer != Optimizer::kSgdMomentum && s.optimizer != Optimizer::kNone) {
    t.notes.push_back("this optimizer's update is not counted");
  }
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
