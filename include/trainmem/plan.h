// plan(): the fastest training setups that fit a cluster. Given a model, N GPUs, a global batch and a sequence
// length, it enumerates the ways to run the step (tensor, pipeline and context parallel sizes, the data-parallel
// sharding, activation checkpointing, precision, micro-batch and accumulation, fused or foreach optimizer),
// simulates each that can fit through the same pipeline as `estimate` (every rule is estimate's, resolve's and
// step_time's: plan only chooses), and ranks those that fit by predicted throughput.
//
// The search is bounded, not exhaustive over hopeless setups:
// - a throughput bound: the step of a family can be no faster than its products (matmuls and attention) at the
//   roofline's product rate, taken from one reference simulation per compute class (tp, cp, checkpointing,
//   precision) and scaled by the rank's tokens (exact: a product's FLOPs are linear in the micro-batch), and
//   with a pipeline no faster than (M + (p - 1) / v) / (M p) of the whole model's products (step_time's schedule);
//   families are tried best bound first and a family whose bound cannot enter the top N is not simulated;
// - the micro-batch search of one family starts at 1: a family that does not fit one sequence per micro-batch
//   costs one or two simulations, and the sizes above are searched by doubling and bisection as fit does.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "trainmem/fit.h"
#include "trainmem/flops.h"
#include "trainmem/gpu.h"
#include "trainmem/scenario.h"
#include "trainmem/units.h"

namespace trainmem {

struct PlanRequest {
  uint64_t global_batch = 0;  // sequences per optimizer step over every data-parallel rank (required)
  uint64_t nodes = 0;         // nodes the GPUs are spread over (gpus_per_node = N / nodes); 0: as given
  size_t top = 10;            // rows ranked
  Margin margin;              // kept free on every GPU, as fit
};

// One way to run the step: the fields plan sets on top of the user's scenario.
struct PlanSetup {
  uint64_t dp = 1, tp = 1, pp = 1, cp = 1;
  Sharding sharding = Sharding::kDdp;
  uint64_t dp_shard = 0;  // HSDP: fsdp2's shard degree (--dp-shard K; 0: FSDP2 over the whole dp)
  Checkpointing checkpointing = Checkpointing::kNone;
  Precision precision = Precision::kBf16Amp;
  bool mixed = true;          // mixed precision (fp32 master weights) as the framework runs it, or pure bf16
  OptimizerImpl optimizer_impl = OptimizerImpl::kAuto;  // kAuto: the code's own (DeepSpeed's optimizer)
  PpSchedule schedule = PpSchedule::k1f1b;
  uint64_t virtual_stages = 1;
  uint64_t batch = 1;         // micro-batch
  uint64_t accumulation = 1;  // micro-batches per step: --grad-accum, or the pipeline's --micro-batches
  // The fields, as a front end would give them (--tp 8 --sharding fsdp2 ...): what the user runs `estimate` with.
  std::vector<FieldChange> changes() const;
  bool deepspeed() const;  // sharded by DeepSpeed ZeRO (its own optimizer and precision)
  // whether `sharding` applies: data-parallel ranks, or --cp ranks under FSDP2 (sharded over dp x cp, fsdp.h)
  bool sharded() const { return dp > 1 || (cp > 1 && sharding == Sharding::kFsdp2); }
  bool hsdp() const { return dp > 1 && dp_shard > 0; }  // FSDP2 over a (dp / dp_shard, dp_shard) mesh
};
// The fields of a setup's `trainmem estimate` command: the user's, less those plan chose, then plan's. A field the
// user gave was held fixed, so plan's value for it is the user's, or how its framework spells the same choice
// (--precision bf16-amp under ZeRO is DeepSpeed's bf16): plan's wins.
std::vector<FieldChange> plan_fields(std::span<const FieldChange> given, std::span<const FieldChange> chosen);
// "tp8 pp1 dp8 fsdp2 full": the family of a setup (everything but the micro-batch and the optimizer's code path)
std::string plan_family_name(const PlanSetup& s);
// The sharding as plan's tables name it: "hsdp RxK" (R replicas x K-rank shard groups), the sharding's name, or ""
// when no sharding applies (one rank).
std::string plan_sharding_name(const PlanSetup& s);
// "mixed bf16" (autocast, DeepSpeed's bf16 with fp32 master partitions, torchtitan's fp32 + FSDP2 bf16 policy) or
// "pure bf16" (bf16 weights, gradients and optimizer states)
std::string plan_precision_name(const PlanSetup& s);

struct PlanRow {
  PlanSetup setup;
  // Memory as fit judges it: the caching allocator replayed with the margin kept free, releasing its cache and
  // retrying before it gives up, as PyTorch does (estimate's "peak reserved" is the replay without a limit)
  Bytes peak_reserved;    // max_memory_reserved on the device with the margin kept free (the worst pipeline rank's)
  Bytes device_total;     // what nvidia-smi shows
  int64_t headroom = 0;   // usable - reserved, the margin already kept free
  uint64_t alloc_retries = 0;  // > 0: it fits only because the allocator released its cache that many times
  std::optional<uint64_t> pp_worst_rank;
  StepTime time;
  double bound_tokens_per_second = 0;  // the family's throughput bound, for the record (>= time's)
  size_t order = 0;                    // its family's place in the search order (ties keep it)
  // The same setup with torch.optim's foreach update instead of the fused one (empty: not tried, as for
  // DeepSpeed's own optimizer or an implementation given)
  struct Foreach {
    bool fits = false;
    Bytes peak_reserved;
    std::optional<double> step_seconds;
  };
  std::optional<Foreach> foreach;
};

// Why a family has no row: each family the enumeration made ends in exactly one of these.
enum class PlanVerdict : uint8_t {
  kRanked,       // fits; its best setup is a row (in the top N or below it)
  kDoesNotFit,   // does not fit at any micro-batch tried (1, and the whole rank batch)
  kRefused,      // resolve() or estimate() refuses it: not simulated, with the library's reason
  kNoTime,       // fits, but step_time has no model for it
  kBatch,        // the global batch does not divide into the data-parallel ranks (or micro-batches)
  kPruned,       // its throughput bound is below the N-th best found: never simulated
  kBudget,       // the search's bound on work was reached before it was simulated
};
std::string_view plan_verdict_name(PlanVerdict v);

struct PlanFamily {
  PlanSetup setup;          // micro-batch 1 (or the best found)
  PlanVerdict verdict = PlanVerdict::kRanked;
  std::string why_field;    // kRefused by a FieldError: the field it names
  std::string why;          // the library's message, the shortfall, the bound
  double bound_tokens_per_second = 0;
  int64_t best_headroom = 0;  // kDoesNotFit: the headroom at the smallest micro-batch tried (negative: short by)
  uint64_t smallest_batch = 1;  // kDoesNotFit: that micro-batch
  bool screened = false;        // kDoesNotFit without a simulation of its own: a variant of its layout that keeps
                                // less does not fit (best_headroom is that one's)
};

struct PlanResult {
  std::string model;
  GpuSpec gpu;
  uint64_t gpus = 0, gpus_per_node = 8;
  uint64_t global_batch = 0, seq = 0;
  Bytes margin;
  std::vector<PlanRow> rows;        // every family's best setup that fits and is timed, fastest first (top N)
  size_t ranked_total = 0;          // rows before the cut to N
  std::vector<PlanFamily> families; // in the order tried
  std::vector<std::string> fixed;   // fields the user gave, kept in every setup
  std::vector<FieldChange> given;   // the user's fields (the model, the sequence, ...), for the command to run
  // why the first row is first: its summary, then against the fastest row differing in each dimension (tp, pp,
  // cp, sharding, checkpointing, precision), or what the other values did on its layout
  std::vector<std::string> best_reason;
  uint64_t simulations = 0;         // estimates run (a pipeline's counts each rank)
  uint64_t reference_simulations = 0;
  std::vector<std::string> notes;   // assumptions of the search
  std::vector<std::string> warnings;
};

// Plans `base` (a scenario with --gpus NxGPU and the fields to keep) over the cluster. Throws FieldError for a
// missing or bad request (no --gpus, a field plan chooses given with a value it cannot keep).
// `given`: the user's fields, as scenario_from() takes them (plan sets its own on top of them).
PlanResult plan(std::span<const FieldChange> given, const PlanRequest& r, const FileReader& files);

// The request from its text, as a front end takes it; throws FieldError naming global_batch, nodes, top, margin.
PlanRequest plan_request(std::string_view global_batch, std::string_view nodes, std::string_view top,
                         std::string_view margin);

// The time of the ledger's products (matmuls and attention) at the roofline's product rate on `g`: what any
// step computing them takes at least (step_time.cc).
double products_seconds(const FlopLedger& l, const GpuPerf& g);

}  // namespace trainmem
