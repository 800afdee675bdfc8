// The step time of a pipeline (step_time.cc pipeline_step_time), against the schedule's arithmetic done here by
// hand from each rank's own simulated ledger (estimate --rank r): per rank the roofline of its kernels by phase,
// then M·max_r(f_r + b_r) + Σ_{r ≠ slowest}(f_r + b_r) / v + the fill and drain sends + max_r(o_r) (GPipe and 1F1B:
// (m + p - 1)(t_f + t_b) for equal stages, Narayanan et al. 2021 section 2.2.1; interleaved: the bubble / v, 2.2.2).
// B=micro-batch T=seq C=hidden M=micro-batches p=pipeline ranks v=stages per rank
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "test_util.h"
#include "trainmem/flops.h"
#include "trainmem/gpu.h"

namespace trainmem {
namespace {

// The roofline of one ledger's kernels of `phase`, by hand: each kernel at the slower of its FLOPs (products at
// the catalog's matmul efficiency times its dtype's tensor-core peak; the rest at the FP32 peak) and its bytes,
// plus 4 µs of launch (step_time.cc kLaunchSeconds).
double phase_seconds(const FlopLedger& l, WorkPhase phase, const GpuPerf& g) {
  double s = 0;
  for (const KernelRow& r : l.rows) {
    if (r.phase != phase) continue;
    const bool product = r.kind == FlopKind::kMatmul || r.kind == FlopKind::kAttention;
    double peak = g.fp32_tflops * 1e12;
    if (product) peak = (r.dtype == DType::kBF16 ? g.bf16_tflops : g.fp32_tflops) * 1e12 * g.matmul_efficiency;
    s += (std::max(static_cast<double>(r.flops) / peak, static_cast<double>(r.bytes) / (g.hbm_gbps * 1e9)) + 4e-6) *
         static_cast<double>(r.count);
  }
  return s;
}

struct Rank {
  double f = 0, b = 0, o = 0;  // per micro-batch forward, backward + recompute; the optimizer step
};

// TinyLlama's shapes (hidden 2048) cut to `layers`, bf16, on H100s; every rank simulated on its own.
std::vector<std::pair<const char*, std::string>> pipeline(uint64_t layers, uint64_t micro, const char* schedule = "1f1b",
                                                          const char* virtual_stages = nullptr) {
  std::vector<std::pair<const char*, std::string>> f = {
      {"overrides", "num_hidden_layers=" + std::to_string(layers)}, {"batch", "1"}, {"seq", "64"}, {"pp", "2"},
      {"precision", "bf16"}, {"gpu", "h100-80gb"}, {"micro_batches", std::to_string(micro)}, {"pp_schedule", schedule}};
  if (virtual_stages) f.push_back({"pp_virtual_stages", virtual_stages});
  return f;
}
Estimate run(const std::vector<std::pair<const char*, std::string>>& fields, int rank = -1) {
  Scenario s;
  s.model.model = "tinyllama-1.1b";
  for (const auto& [k, v] : fields) set_field(s, k, v);
  if (rank >= 0) set_field(s, "rank", std::to_string(rank));
  return testing::run(s);
}
std::vector<Rank> ranks_by_hand(const std::vector<std::pair<const char*, std::string>>& fields, uint64_t micro) {
  const GpuPerf& g = find_gpu("h100-80gb").perf;
  std::vector<Rank> out;
  for (int r = 0; r < 2; ++r) {
    const Estimate e = run(fields, r);
    const FlopLedger& l = e.sim->flops;
    const double m = static_cast<double>(micro);
    out.push_back({phase_seconds(l, WorkPhase::kForward, g) / m,
                   (phase_seconds(l, WorkPhase::kBackward, g) + phase_seconds(l, WorkPhase::kRecompute, g)) / m,
                   phase_seconds(l, WorkPhase::kOptimizer, g)});
  }
  return out;
}

TEST(PpTime, TwoStagesAreTheScheduleOverEachRanksLedger) {
  // p = 2, M = 4, no data or tensor parallelism: the only communication is the stage output (1, 64, 2048) in
  // bf16 forward and its gradient backward, once each on the fill and drain, at the H100's 450 GB/s
  const auto fields = pipeline(2, 4);
  const std::vector<Rank> r = ranks_by_hand(fields, 4);
  const Estimate e = run(fields);
  ASSERT_TRUE(e.time && e.time->pipeline);
  const PipelineTime& p = *e.time->pipeline;
  const double a = r[0].f + r[0].b, b = r[1].f + r[1].b;
  const double send = 1.0 * 64 * 2048 * 2 / 450e9;
  const double expected = 4 * std::max(a, b) + std::min(a, b) + 2 * send + std::max(r[0].o, r[1].o);
  EXPECT_NEAR(e.time->step_seconds, expected, 1e-12 * expected);
  EXPECT_NEAR(p.bubble_seconds, std::min(a, b), 1e-15);
  EXPECT_NEAR(p.send_seconds, 2 * send, 1e-18);
  EXPECT_EQ(p.slowest_rank, a >= b ? 0u : 1u);
  EXPECT_EQ(p.gather_seconds, 0.0);
  // for equal stages (a = b) this is (M + p - 1)(f + b) + o; here rank 0 holds the embeddings and rank 1 the head
  // tokens of the step: B·T·M (one data-parallel replica); MFU over both ranks' GPUs
  EXPECT_EQ(e.time->tokens, 1u * 64u * 4u);
  const Estimate r0 = run(fields, 0), r1 = run(fields, 1);
  ASSERT_TRUE(r0.time && r1.time);
  EXPECT_NEAR(r0.time->step_seconds, e.time->step_seconds, 0.0);  // every rank reports the same pipeline step
  const double model = static_cast<double>(r0.time->model_flops) * 2;  // the mean of both ranks, times 2
  EXPECT_NEAR(e.time->mfu, model / (e.time->step_seconds * 989.5e12 * 2), 1e-9);
  // fit and plan ask step_time() of the pipeline's estimate: the same figure
  const std::optional<StepTime> again = step_time(e, find_gpu("h100-80gb"));
  ASSERT_TRUE(again);
  EXPECT_EQ(again->step_seconds, e.time->step_seconds);
}

TEST(PpTime, MoreMicroBatchesLowerTheBubbleShare) {
  double last = 1;
  for (uint64_t m : {2, 4, 16}) {
    const Estimate e = run(pipeline(4, m));
    ASSERT_TRUE(e.time && e.time->pipeline);
    const double share = e.time->pipeline->bubble_seconds / e.time->step_seconds;
    EXPECT_LT(share, last) << m;
    last = share;
  }
  EXPECT_LT(last, 0.1);  // (p - 1)/(M + p - 1) = 1/17 for equal stages
}

TEST(PpTime, InterleavingDividesTheBubbleByTheStagesPerRank) {
  // 6 layers in p·v = 4 stages (torchtitan's split: embeddings and head count as a layer each)
  const Estimate e = run(pipeline(6, 4, "interleaved-1f1b", "2"));
  ASSERT_TRUE(e.time && e.time->pipeline);
  const PipelineTime& p = *e.time->pipeline;
  EXPECT_EQ(p.virtual_stages, 2u);
  ASSERT_EQ(p.rank_seconds.size(), 2u);
  const double slow = std::max(p.rank_seconds[0], p.rank_seconds[1]);
  const double other = std::min(p.rank_seconds[0], p.rank_seconds[1]);
  EXPECT_NEAR(p.bubble_seconds, other / 2, 1e-15);
  EXPECT_NEAR(p.steady_seconds, 4 * slow, 1e-12);
  // 2(p·v - 1) sends of the (1, 64, 2048) bf16 activation or gradient on the fill and drain
  EXPECT_NEAR(p.send_seconds, 6 * (64.0 * 2048 * 2 / 450e9), 1e-18);
  // the same layers under 1F1B: the same work per rank, twice the bubble
  const Estimate one = run(pipeline(6, 4));
  ASSERT_TRUE(one.time && one.time->pipeline);
  EXPECT_GT(one.time->pipeline->bubble_seconds, p.bubble_seconds);
}

TEST(PpTime, Llama70bOverTensorPipelineAndFsdp2HasAStepTime) {
  // the README's 70B example: 256 H100s as TP 8 x PP 4 x FSDP2 over 8, fp32 with FSDP2's bf16 mixed precision
  const Estimate e = testing::run(testing::scenario_of(
      "llama-3.1-70b", {{"gpus", "256xh100-80gb"}, {"tp", "8"}, {"pp", "4"}, {"sharding", "fsdp2"},
                        {"precision", "fp32"}, {"micro_batches", "8"}, {"batch", "1"}, {"seq", "8192"},
                        {"checkpointing", "selective"}}));
  ASSERT_TRUE(e.time && e.time->pipeline);
  const StepTime& t = *e.time;
  const PipelineTime& p = *t.pipeline;
  EXPECT_EQ(p.ranks, 4u);
  EXPECT_EQ(t.tokens, 1u * 8192u * 8u * 8u);  // B·T·M·dp
  EXPECT_NEAR(t.step_seconds, p.gather_seconds + p.steady_seconds + p.bubble_seconds + p.send_seconds + p.tail_seconds,
              1e-9);
  EXPECT_GT(p.gather_seconds, 0.0);  // FSDP2's all-gathers, once per step
  EXPECT_GT(p.tail_seconds, 0.0);
  EXPECT_EQ(t.peak_tflops, 989.5);  // the products run in FSDP2's bf16 param_dtype, not fp32
  EXPECT_GT(t.mfu, 0.0);
  EXPECT_LT(t.mfu, 1.0);
  // 4 ranks, 8 micro-batches: the bubble is near (p - 1)/(M + p - 1) = 3/11 of the step
  EXPECT_NEAR(p.bubble_seconds / t.step_seconds, 3.0 / 11, 0.03);
}

}  // namespace
}  // namespace trainmem
