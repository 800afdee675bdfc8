// FLOPs and bytes moved, counted by the simulated ops themselves (src/sim/ops_*.cc call Engine::count next to
// the kernel they stand for), and the step time a roofline over those kernels gives on a GPU.
//
// Conventions (each op's comment says which it follows):
// - A product of (m x k) by (k x n) is 2mnk FLOPs (one multiply and one add per term); its backward is two
//   such products (the input's and the weight's gradient), each counted where the backward computes it.
// - Attention counts QK^T and AV as products over the positions the kernel computes: the math path and eager
//   attention compute every (query, key) pair; a causal flash or memory-efficient kernel skips the tiles wholly
//   above the diagonal, counted here as the T(T+1)/2 pairs on or below it (per head and batch row, when the
//   query and key lengths are equal). Flash's backward recomputes QK^T (and the softmax) from its saved
//   logsumexp before its dQ, dK, dV products (FlashAttention-2, Dao 2023, Algorithm 2): 2 + 3 = 5 products
//   in backward against 2 in forward.
// - Elementwise, normalisation and softmax kernels count one FLOP per output element per arithmetic step
//   named in their comment; they are bound by the bytes they read and write, which are counted too.
// - Bytes are what the kernel reads and writes once from device memory (no cache reuse modelled).
// - Work under torch.utils.checkpoint's recomputation counts in the kRecompute phase, again.
// B=micro-batch T=seq C=hidden
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/dtype.h"

namespace trainmem {

enum class FlopKind : uint8_t {
  kMatmul,       // mm / addmm / bmm / grouped_mm: linear layers, LoRA adapters, eager attention's products
  kAttention,    // fused scaled_dot_product_attention kernels (flash, memory-efficient): QK^T and AV
  kElementwise,  // casts, adds, activations, dropout, copies, embedding gathers
  kNorm,         // layer/RMS norm, softmax, cross-entropy's log-softmax
  kOptimizer,    // the optimizer step and gradient clipping
};
inline constexpr size_t kFlopKinds = 5;
std::string_view flop_kind_name(FlopKind k);

enum class WorkPhase : uint8_t { kForward, kBackward, kRecompute, kOptimizer };
inline constexpr size_t kWorkPhases = 4;
std::string_view work_phase_name(WorkPhase p);

// One kind of kernel of the counted step: `count` launches, each of `flops` FLOPs moving `bytes` bytes, with
// its operands in `dtype`. Identical kernels (the same op in every layer) are one row.
struct KernelRow {
  FlopKind kind = FlopKind::kElementwise;
  WorkPhase phase = WorkPhase::kForward;
  DType dtype = DType::kF32;
  uint64_t flops = 0, bytes = 0;
  uint64_t count = 0;
};

// What the simulated step computed: the last simulated optimizer step, every micro-batch of it (or, for
// --task inference, the forward).
struct FlopLedger {
  std::array<std::array<uint64_t, kFlopKinds>, kWorkPhases> flops{};  // [phase][kind]
  std::array<std::array<uint64_t, kFlopKinds>, kWorkPhases> bytes{};
  uint64_t kernels = 0;
  // A count passed 2^64 - 1 (counts saturate rather than stop the simulation): the figures are lower bounds and
  // no step time is derived from them.
  bool overflow = false;
  std::vector<KernelRow> rows;  // by first appearance
  // Collectives the ops issue themselves (tensor parallelism's all-reduces and all-gathers, tp_ops.cc): per
  // phase, how many and their bytes (the tensor each rank holds). DDP's, ZeRO-1/2's and FSDP's are timed from
  // their buckets and units (step_time.cc), ZeRO-3's from the dp_* counts below.
  std::array<uint64_t, kWorkPhases> tp_all_reduces{}, tp_all_reduce_bytes{};
  std::array<uint64_t, kWorkPhases> tp_all_gathers{}, tp_all_gather_bytes{};  // bytes of the gathered output
  // Data-parallel collectives the simulator issues where the framework does (DeepSpeed ZeRO-3's parameter
  // all-gathers and gradient reduce-scatters, src/sim/loop.cc z3_gather / z3_reduce_ipg): per phase, how many,
  // their bytes (the gathered output; the reduce-scatter's whole input) and the largest single all-gather.
  std::array<uint64_t, kWorkPhases> dp_all_gathers{}, dp_all_gather_bytes{}, dp_largest_gather_bytes{};
  std::array<uint64_t, kWorkPhases> dp_reduce_scatters{}, dp_reduce_scatter_bytes{};
  uint64_t total_flops() const;
  uint64_t total_bytes() const;
  uint64_t phase_flops(WorkPhase p) const;
  uint64_t kind_flops(FlopKind k) const;
};

// The GPU facts the roofline needs (data/gpus/gpus.json): datasheet peaks, dense (no 2:4 sparsity).
struct GpuPerf {
  double fp32_tflops = 0;     // FP32 on the CUDA cores (non-tensor)
  double tf32_tflops = 0;     // TF32 tensor core, dense; 0 when the card has none
  double bf16_tflops = 0;     // BF16 tensor core with FP32 accumulate, dense; 0 when the card has none
  double fp16_tflops = 0;     // FP16 tensor core with FP32 accumulate, dense
  double hbm_gbps = 0;        // device memory bandwidth, GB/s (10^9 bytes)
  double link_gbps = 0;       // GPU-to-GPU bandwidth inside a node, per direction, GB/s (NVLink; PCIe when none)
  // Per-GPU inter-node bandwidth of the reference node the card ships in (DGX: one NIC per GPU), per direction,
  // GB/s; 0: no such node in the catalog (PCIe cards), collectives across nodes then run at link_gbps (noted)
  double net_gbps = 0;
  std::string net_node, net_source;  // the reference node in a few words ("DGX H100/H200: ..."), the citation
  double matmul_efficiency = 1;  // measured achievable matmul FLOP/s over the datasheet peak (MAMF); 1: none
  std::string source, efficiency_source;
  bool known() const { return fp32_tflops > 0 && hbm_gbps > 0; }
};

// --pp > 1: how the pipeline's schedule turns every rank's kernels into one step (step_time.cc
// pipeline_step_time). Per micro-batch figures are a rank's kernels and blocking tensor-parallel collectives over
// its stages, divided by the micro-batches.
struct PipelineTime {
  std::string schedule;             // gpipe, 1f1b, interleaved-1f1b
  uint64_t ranks = 1, micro_batches = 1, virtual_stages = 1;
  uint64_t slowest_rank = 0;        // the rank with the largest forward + backward per micro-batch
  double forward_seconds = 0;       // the slowest rank's, per micro-batch
  double backward_seconds = 0;      // the slowest rank's backward and recomputation, per micro-batch
  double steady_seconds = 0;        // micro-batches x the slowest rank's forward + backward
  double bubble_seconds = 0;        // the other ranks' forward + backward on the fill and drain (/ virtual stages)
  double send_seconds = 0;          // stage-to-stage sends on the fill and drain
  double gather_seconds = 0;        // FSDP2's exposed all-gathers on the fill (every rank's first forward)
  double tail_seconds = 0;          // the slowest rank's reduce-scatters and optimizer after its last backward
  std::vector<double> rank_seconds; // per rank: forward + backward per micro-batch
};

// How the step's kernels and collectives are turned into seconds (trainmem's model, each constant cited
// where it is defined in src/core/step_time.cc).
struct StepTime {
  double step_seconds = 0;
  double tokens_per_second = 0;  // tokens of the global batch (every data-parallel rank) per second
  double mfu = 0;                // model FLOPs (6·N·tokens + attention, per rank) / (step time · bf16 or fp32 peak)
  uint64_t model_flops = 0;      // per rank per step: 6·N_trainable... as in `formulas` (see step_time.cc)
  uint64_t flops = 0;            // per rank per step, as simulated (FlopLedger::total_flops)
  double compute_bound_seconds = 0;  // kernels whose FLOPs take longer than their bytes
  double memory_bound_seconds = 0;   // kernels whose bytes take longer than their FLOPs
  double launch_seconds = 0;         // per-kernel launch overhead
  double comm_seconds = 0;           // collectives, in all
  double comm_overlapped_seconds = 0;  // hidden behind compute
  double comm_exposed_seconds = 0;     // on the critical path
  std::array<double, kWorkPhases> phase_seconds{};  // kernel time by phase (forward, backward, recompute, optimizer)
  uint64_t tokens = 0;               // tokens per optimizer step over the global batch
  double peak_tflops = 0;            // the peak MFU divides by
  std::array<std::array<uint64_t, kFlopKinds>, kWorkPhases> flops_by{}, bytes_by{};  // the ledger's, [phase][kind]
  uint64_t kernels = 0;
  std::vector<std::string> notes;    // assumptions that apply to this run
  // --pp > 1: the schedule's figures; the kernel, phase and communication figures above are then the shown
  // rank's, model_flops the pipeline ranks' mean, and step_seconds the schedule's (not their sum)
  std::optional<PipelineTime> pipeline;
};

}  // namespace trainmem
