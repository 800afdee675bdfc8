// Speed of the pipeline, measured with Google Benchmark (`make bench`). The headline case is one full
// training step of a 70B model (Llama-3-70B shapes) at sequence 8192.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <ctime>

#include "trainmem/allocator.h"
#include "trainmem/config.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"
#include "trainmem/plan.h"
#include "trainmem/pp.h"
#include "trainmem/sim.h"
#include "trainmem/tp.h"

namespace {

using namespace trainmem;

class NoFiles final : public FileReader {
 public:
  std::optional<std::string> read(const std::string&) const override { return std::nullopt; }
};

ModelSpec llama70b() {
  ModelRequest req;
  req.model = "llama-3-8b";
  req.overrides = {"hidden_size=8192", "num_hidden_layers=80", "num_attention_heads=64", "num_key_value_heads=8",
                   "intermediate_size=28672"};
  return load_model(req, NoFiles());
}

TrainSetup setup(uint64_t batch, uint64_t seq) {
  TrainSetup s;
  s.batch = batch;
  s.seq = seq;
  s.precision = Precision::kBf16;
  return s;
}

SimOptions one_step() {
  SimOptions o;
  o.steps = 1;
  return o;
}

// One training step (forward, loss, backward, optimizer step) of a 70B model at T=8192, tensor by tensor.
void BM_SimulateStep70B_T8192(benchmark::State& state) {
  const ModelSpec m = llama70b();
  const Inventory inv = build_inventory(m);
  const TrainSetup s = setup(1, 8192);
  const SimOptions o = one_step();
  size_t events = 0;
  for (auto _ : state) {
    SimResult r = simulate(m, inv, s, o);
    events = r.timeline.events.size();
    benchmark::DoNotOptimize(r.peak.live.total.value);
  }
  state.counters["events"] = static_cast<double>(events);
}
BENCHMARK(BM_SimulateStep70B_T8192)->Unit(benchmark::kMicrosecond);

// The caching allocator replayed over that step's timeline.
void BM_AllocatorReplay70B_T8192(benchmark::State& state) {
  const ModelSpec m = llama70b();
  const Inventory inv = build_inventory(m);
  const SimResult r = simulate(m, inv, setup(1, 8192), one_step());
  for (auto _ : state) {
    AllocatorReplay a = replay_allocator(r.timeline, {}, TorchVersion{2, 9}, std::nullopt);
    benchmark::DoNotOptimize(a.peak_reserved.value);
  }
}
BENCHMARK(BM_AllocatorReplay70B_T8192)->Unit(benchmark::kMicrosecond);

// The default two-step estimate (the optimizer state appears in the first step, the second is steady).
void BM_Estimate70B_T8192(benchmark::State& state) {
  const ModelSpec m = llama70b();
  const Inventory inv = build_inventory(m);
  SimOptions o = one_step();
  o.steps = 2;
  for (auto _ : state) {
    Estimate e = estimate(m, inv, setup(1, 8192), o);
    benchmark::DoNotOptimize(e.memory.peak_reserved.value);
  }
}
BENCHMARK(BM_Estimate70B_T8192)->Unit(benchmark::kMillisecond);

// The added cost of the time model on that estimate: the roofline over the counted kernels and the collectives
// (step_time.cc), given the estimate (the FLOP counting itself runs inside every simulation, in the cases above).
void BM_StepTime70B_T8192(benchmark::State& state) {
  const ModelSpec m = llama70b();
  const Inventory inv = build_inventory(m);
  SimOptions o = one_step();
  o.steps = 2;
  const GpuSpec& gpu = find_gpu("h100-80gb");
  const Estimate e = estimate(m, inv, setup(1, 8192), o);
  for (auto _ : state) {
    std::optional<StepTime> t = step_time(e, gpu);
    benchmark::DoNotOptimize(t->step_seconds);
  }
  state.counters["kernel_rows"] = static_cast<double>(e.sim->flops.rows.size());
  state.counters["kernels"] = static_cast<double>(e.sim->flops.kernels);
}
BENCHMARK(BM_StepTime70B_T8192)->Unit(benchmark::kMicrosecond);

// The two-step estimate of the 70B model at T=8192 under the Trainer's loop, with `s` shaped by `shape`; with
// tp > 1, rank 0's local model of transformers' tp_plan (tp.h).
// `ranks`: the rank steps one estimate simulates, one after the other (a pipeline's ranks, ZeRO-2's classes of
// alike ranks); cpu_ms_per_rank is the process's CPU time per iteration divided by them.
template <typename Shape>
void estimate_70b_hf(benchmark::State& state, Shape shape, uint64_t tp = 1, uint64_t ranks = 1) {
  ModelSpec m = llama70b();
  if (tp > 1) apply_tensor_parallel(m, tp);
  Inventory inv = build_inventory(m);
  if (tp > 1) mark_tp_shards(m, inv);
  TrainSetup s = setup(1, 8192);
  shape(s);
  SimOptions o = one_step();
  o.steps = 2;
  o.loop = LoopKind::kHf;
  const std::clock_t cpu0 = std::clock();
  for (auto _ : state) {
    Estimate e = estimate(m, inv, s, o);
    benchmark::DoNotOptimize(e.memory.peak_reserved.value);
  }
  const double cpu_ms = 1e3 * static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  state.counters["ranks"] = static_cast<double>(ranks);
  state.counters["cpu_ms_per_rank"] = cpu_ms / static_cast<double>(state.iterations() * ranks);
}

// A 70B model over 64 data-parallel ranks at T=8192: one rank of DDP (buckets at construction and the rebuild at
// step 2), every class of alike ZeRO-2 ranks (64 partition layouts, each simulated: estimate_zero_ranks; the layout
// of every parameter over 64 partitions, the IPG buckets), and one rank of
// FSDP2's units (every parameter's dim-0 shard, the all-gathers, reshards and reduce-scatters of 82 units).
// Arg 3: the 64 GPUs as --tp 8 x FSDP2 over 8 data-parallel ranks (--gpus 64xh100-80gb --tp 8 --sharding fsdp2):
// the TP-local model's shards, its units' gathers, and the TP collectives' buffers.
void BM_EstimatePerRank70B_T8192(benchmark::State& state) {
  const Sharding kinds[] = {Sharding::kDdp, Sharding::kZero2, Sharding::kFsdp2, Sharding::kFsdp2};
  const Sharding sharding = kinds[state.range(0)];
  const uint64_t tp = state.range(0) == 3 ? 8 : 1;
  estimate_70b_hf(state, [&](TrainSetup& s) {
    s.dp = 64 / tp;
    s.tp = tp;
    s.sharding = sharding;
  }, tp, sharding == Sharding::kZero2 ? 64 : 1);
  state.SetLabel(tp > 1 ? "fsdp2 over tp 8, dp 8" : std::string(name_of(sharding)));
}
BENCHMARK(BM_EstimatePerRank70B_T8192)->Arg(0)->Arg(1)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond);

// A 70B pipeline at T=8192: --pp 4 --micro-batches 8, every rank simulated (1F1B: one stage of about 20 layers
// per rank with up to 4 micro-batches in flight; interleaved-1f1b: two stages of about 10 layers per rank), and
// the 1F1B pipeline over --tp 8 shards (transformers' tp_plan: the local shapes and the collectives' buffers).
void BM_EstimatePp70B_T8192(benchmark::State& state) {
  const bool interleaved = state.range(0) == 1, tp = state.range(0) == 2;
  estimate_70b_hf(state, [&](TrainSetup& s) {
    s.pp = 4;
    s.micro_batches = 8;
    s.pp_schedule = interleaved ? PpSchedule::kInterleaved1f1b : PpSchedule::k1f1b;
    s.pp_virtual_stages = interleaved ? 2 : 1;
  }, tp ? 8 : 1, 4);
  state.SetLabel(interleaved ? "interleaved-1f1b, 4 ranks x 2 stages" : tp ? "1f1b, 4 ranks, tp 8" : "1f1b, 4 ranks");
}
BENCHMARK(BM_EstimatePp70B_T8192)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);

// The 70B model as TP8 x PP4 x FSDP2 (--gpus 64xh100-80gb or 256xh100-80gb --tp 8 --pp 4 --sharding fsdp2
// --precision fp32 --micro-batches 8 --checkpointing selective): every pipeline rank simulated, each its TP-local
// stage sharded over the Arg data-parallel ranks by torchtitan's apply_fsdp (the units' gathers once per step, the
// fp32 gradient accumulation over 8 micro-batches, the reduce-scatters after the last).
void BM_EstimatePpFsdp70B_T8192(benchmark::State& state) {
  const auto dp = static_cast<uint64_t>(state.range(0));
  estimate_70b_hf(state, [&](TrainSetup& s) {
    s.precision = Precision::kFp32;  // torchtitan's training.dtype; bf16 compute by MixedPrecisionPolicy
    s.checkpointing = Checkpointing::kSelective;
    s.tp = 8;
    s.pp = 4;
    s.micro_batches = 8;
    s.pp_schedule = PpSchedule::k1f1b;
    s.dp = dp;
    s.sharding = Sharding::kFsdp2;
  }, 8, 4);
  state.SetLabel(fmt::format("1f1b, 4 ranks, tp 8, fsdp2 dp {}", dp));
}
BENCHMARK(BM_EstimatePpFsdp70B_T8192)->Arg(2)->Arg(8)->Unit(benchmark::kMillisecond);

// One pipeline rank of that case (--dp 2), the Arg rank alone (0: the embeddings and layers 0-19 with 4
// micro-batches in flight; 3: layers 61-79, the norm, lm_head and the loss), as estimate() simulates each rank of
// the pipeline: the rank's stage inventory, schedule actions and torchtitan's fused optimizer (estimate.cc), then
// the rank's estimate. Checked once against the whole pipeline's row for that rank before the timing.
void BM_EstimatePpFsdpRank70B_T8192(benchmark::State& state) {
  const auto rank = static_cast<uint64_t>(state.range(0));
  ModelSpec m = llama70b();
  apply_tensor_parallel(m, 8);
  Inventory inv = build_inventory(m);
  mark_tp_shards(m, inv);
  TrainSetup s = setup(1, 8192);
  s.precision = Precision::kFp32;
  s.checkpointing = Checkpointing::kSelective;
  s.tp = 8;
  s.pp = 4;
  s.micro_batches = 8;
  s.pp_schedule = PpSchedule::k1f1b;
  s.dp = 2;
  s.sharding = Sharding::kFsdp2;
  SimOptions o = one_step();
  o.steps = 2;
  o.loop = LoopKind::kHf;
  const Estimate whole = estimate(m, inv, s, o);
  // estimate()'s pipeline branch for one rank (src/pipeline/estimate.cc)
  TrainSetup ps = s;
  ps.optimizer_impl = OptimizerImpl::kFused;  // torchtitan's optimizer implementation
  const SimOptions ro = pp_rank_options(o, s, pp_stage_split(s.pp, m.layers), rank);
  const Inventory stage_inv = pp_stage_inventory(inv, ro.pp.parts);
  if (!whole.pp || estimate(m, stage_inv, ps, ro).memory.peak_reserved != whole.pp->rows[rank].peak_reserved) {
    state.SkipWithError("one rank's estimate differs from the pipeline's row for it");
    return;
  }
  const std::clock_t cpu0 = std::clock();
  for (auto _ : state) {
    Estimate e = estimate(m, stage_inv, ps, ro);
    benchmark::DoNotOptimize(e.memory.peak_reserved.value);
  }
  const double cpu_ms = 1e3 * static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  state.counters["cpu_ms_per_rank"] = cpu_ms / static_cast<double>(state.iterations());
  state.SetLabel(fmt::format("1f1b rank {} of 4, tp 8, fsdp2 dp 2", rank));
}
BENCHMARK(BM_EstimatePpFsdpRank70B_T8192)->Arg(0)->Arg(3)->Unit(benchmark::kMillisecond);

// Building the parameter inventory of a 70B model (723 named tensors).
void BM_Inventory70B(benchmark::State& state) {
  const ModelSpec m = llama70b();
  for (auto _ : state) benchmark::DoNotOptimize(build_inventory(m).parameters.size());
}
BENCHMARK(BM_Inventory70B)->Unit(benchmark::kMicrosecond);

// GPT-2 small, seed 000's setup, for scale.
void BM_SimulateStepGpt2Small(benchmark::State& state) {
  ModelRequest req;
  req.model = "nanogpt-gpt2";
  req.attention = AttnImpl::kEager;
  const ModelSpec m = load_model(req, NoFiles());
  const Inventory inv = build_inventory(m);
  TrainSetup s = setup(12, 1024);
  s.precision = Precision::kBf16Amp;
  for (auto _ : state) benchmark::DoNotOptimize(simulate(m, inv, s, one_step()).peak.live.total.value);
}
BENCHMARK(BM_SimulateStepGpt2Small)->Unit(benchmark::kMicrosecond);

// `trainmem fit` for seed 000's model on an A100 80GB at T=1024: doubling and bisection over full estimates
// (14 probes, micro-batches 1 to 128).
void BM_FitGpt2SmallA100(benchmark::State& state) {
  ModelRequest req;
  req.model = "nanogpt-gpt2";
  const ModelSpec m = load_model(req, NoFiles());
  TrainSetup s = setup(1, 1024);
  s.precision = Precision::kBf16Amp;
  SimOptions o = one_step();
  o.steps = 2;
  size_t probes = 0;
  for (auto _ : state) {
    const FitResult r = fit(m, s, o, {}, find_gpu("a100-80gb"), FitRequest{});
    probes = r.probes.size();
    benchmark::DoNotOptimize(r.largest);
  }
  state.counters["probes"] = static_cast<double>(probes);
}
BENCHMARK(BM_FitGpt2SmallA100)->Unit(benchmark::kMillisecond);

// `trainmem plan` (issue 13's done-when): Llama 3 70B on 64 H100 80GB, a global batch of 512 sequences of 8,192
// tokens: every layout enumerated, screened and ranked (arg 0), and the same with tensor and pipeline sizes given
// (arg 1: --tp 8 --pp 1), the search a user narrows.
void BM_Plan70B_64xH100(benchmark::State& state) {
  std::vector<FieldChange> given = {{"model", "llama-3-70b"}, {"gpus", "64xh100-80gb"}, {"seq", "8192"}};
  if (state.range(0) == 1) given.insert(given.end(), {{"tp", "8"}, {"pp", "1"}});
  PlanRequest r;
  r.global_batch = 512;
  uint64_t sims = 0;
  size_t families = 0;
  for (auto _ : state) {
    const PlanResult p = plan(given, r, NoFiles());
    sims = p.simulations + p.reference_simulations;
    families = p.families.size();
    benchmark::DoNotOptimize(p.rows.data());
  }
  state.counters["simulations"] = static_cast<double>(sims);
  state.counters["families"] = static_cast<double>(families);
}
BENCHMARK(BM_Plan70B_64xH100)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
