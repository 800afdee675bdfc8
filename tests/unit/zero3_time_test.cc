// DeepSpeed ZeRO-3's collectives in the step time (step_time.cc): the simulator counts each all-gather and
// reduce-scatter where it issues them (FlopLedger::dp_*), checked here against the partition arithmetic done by
// hand from the inventory (ceil(numel / world) per rank, gathered to world x that), then the time's arithmetic.
#include <gtest/gtest.h>

#include <algorithm>

#include "test_util.h"
#include "trainmem/flops.h"
#include "trainmem/gpu.h"

namespace trainmem {
namespace {

size_t at(WorkPhase p) { return static_cast<size_t>(p); }

Estimate zero3(std::initializer_list<std::pair<const char*, std::string>> extra) {
  Scenario s = testing::scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=2"}, {"batch", "1"},
                                                       {"seq", "64"}, {"precision", "bf16"}, {"gpu", "h100-80gb"},
                                                       {"dp", "2"}, {"sharding", "zero3"}});
  for (const auto& [f, v] : extra) set_field(s, f, v);
  return testing::run(s);
}

TEST(Zero3Time, EveryParameterIsGatheredInTheForwardAndEveryGradientReduceScattered) {
  // the counted (last) step's forward gathers every module once, persistent ones included (the optimizer step
  // released them); its backward reduce-scatters every trainable gradient once: world x ceil(numel / world)
  // bf16 elements each, over the 2 ranks
  const Estimate e = zero3({});
  ASSERT_TRUE(e.zero && e.time);
  uint64_t padded = 0;
  for (const TensorRow& r : build_inventory(e.model).parameters) padded += (r.elems.value + 1) / 2 * 2;
  const FlopLedger& l = e.sim->flops;
  EXPECT_EQ(l.dp_all_gather_bytes[at(WorkPhase::kForward)], 2 * padded);
  uint64_t rs = 0;
  for (uint64_t x : l.dp_reduce_scatter_bytes) rs += x;
  EXPECT_EQ(rs, 2 * padded);
  EXPECT_EQ(l.dp_all_gather_bytes[at(WorkPhase::kOptimizer)], 0u);
  // the largest gather of the forward: the embedding (32000 x 2048), alone in its module
  EXPECT_EQ(l.dp_largest_gather_bytes[at(WorkPhase::kForward)], 2u * 32000 * 2048);
  // the backward re-gathers at most what the forward did (modules kept by max_reuse_distance are not)
  EXPECT_LE(l.dp_all_gather_bytes[at(WorkPhase::kBackward)] + l.dp_all_gather_bytes[at(WorkPhase::kRecompute)],
            2 * padded);
  // the time: all-gathers and reduce-scatters move (n-1)/n of their whole buffer over the 450 GB/s NVLink
  const double ag = static_cast<double>(l.dp_all_gather_bytes[0] + l.dp_all_gather_bytes[1] +
                                        l.dp_all_gather_bytes[2]);
  EXPECT_NEAR(e.time->comm_seconds, 0.5 * (ag + static_cast<double>(rs)) / 450e9, 1e-12);
  EXPECT_GE(e.time->comm_exposed_seconds, 0.5 * 2.0 * 32000 * 2048 / 450e9 - 1e-15);  // the embedding's gather
  EXPECT_LE(e.time->comm_exposed_seconds, e.time->comm_seconds + 1e-15);
  EXPECT_NEAR(e.time->step_seconds, e.time->compute_bound_seconds + e.time->memory_bound_seconds +
                                        e.time->launch_seconds + e.time->comm_exposed_seconds, 1e-12);
}

TEST(Zero3Time, GradientAccumulationGathersAndReduceScattersEveryMicroBatch) {
  const Estimate one = zero3({}), two = zero3({{"grad_accum", "2"}});
  ASSERT_TRUE(one.time && two.time);
  const FlopLedger &a = one.sim->flops, &b = two.sim->flops;
  // the persistent parameters (numel <= stage3_param_persistence_threshold, 1e5 by default: the five RMS norms of
  // 2048) stay gathered from the first micro-batch's forward until the optimizer step
  uint64_t persistent = 0;
  for (const TensorRow& r : build_inventory(one.model).parameters) {
    if (r.elems.value <= 100000) persistent += (r.elems.value + 1) / 2 * 2 * 2;
  }
  EXPECT_EQ(persistent, 5u * 2048 * 2);
  EXPECT_EQ(b.dp_all_gather_bytes[at(WorkPhase::kForward)],
            2 * a.dp_all_gather_bytes[at(WorkPhase::kForward)] - persistent);
  EXPECT_EQ(b.dp_reduce_scatter_bytes[at(WorkPhase::kBackward)], 2 * a.dp_reduce_scatter_bytes[at(WorkPhase::kBackward)]);
  EXPECT_EQ(two.time->tokens, 2 * one.time->tokens);
}

TEST(Zero3Time, OffloadIsStillRefused) {
  // the host's optimizer step and the copies between host and device are not modelled
  EXPECT_FALSE(zero3({{"offload", "optimizer"}}).time);
}

}  // namespace
}  // namespace trainmem
