// HSDP with context parallel: --sharding fsdp2 --dp D --dp-shard K --cp C, fully_shard over accelerate's 2-D
// (dp_replicate, dp_shard_cp) mesh (parallelism_config.py fsdp_dim_names = ["dp_replicate", "dp_shard_cp"], the
// shard dimension the flattened ["dp_shard", "cp"]; torchtitan's ("dp_replicate", "dp_shard_cp") alike): each shard
// group holds K data-parallel ranks' C CP ranks, D / K replicas (fsdp.h apply_hsdp_mesh). The expected figures are
// worked by hand from that rule, or are the simulations the composition must reproduce byte for byte: the
// parameters, gradients and FSDP buffers of HSDP over a shard group of the same size without CP, and the
// activations of FSDP2 over dp x cp (the CP rank's, ring attention).
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp.h"
#include "trainmem/nccl.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

using testing::category_events;

// TinyLlama's shapes, two layers, bf16 autocast, as cp_test.cc and cpfsdp_test.cc run them
Scenario tiny(uint64_t seq, std::initializer_list<std::pair<const char*, std::string>> extra = {}) {
  return testing::tiny_llama(seq, extra);
}

// --sharding fsdp2 --dp D --dp-shard K --cp C, as resolve() leaves the setup
TrainSetup hsdp_cp(uint64_t dp, uint64_t k, uint64_t cp) {
  TrainSetup s;
  s.dp = dp;
  s.dp_shard = k;
  s.cp = cp;
  s.sharding = Sharding::kFsdp2;
  return s;
}

// --dp 6 --dp-shard 3 --cp 2: shard groups of 3 x 2 = 6 ranks, 2 replicas. Data-parallel rank 4 is dp_shard
// index 4 mod 3 = 1 of replica 4 / 3 = 1; its CP rank 0 is row 1 x 2 + 0 = 2 of the flattened (dp_shard, cp).
TEST(HsdpCpRules, TheShardGroupIsDpShardTimesCpAndTheRankIsRowMajor) {
  TrainSetup s = hsdp_cp(6, 3, 2);
  FsdpOptions f;
  apply_hsdp_mesh(f, s);
  EXPECT_EQ(f.ranks, 6u);
  EXPECT_EQ(f.replicate, 2u);
  EXPECT_EQ(f.rank, 0u);
  EXPECT_EQ(f.replicate_rank, 0u);
  s.dp_rank = 4;
  apply_hsdp_mesh(f, s);
  EXPECT_EQ(f.rank, 2u);
  EXPECT_EQ(f.replicate_rank, 1u);
  EXPECT_EQ(hsdp_shard_degree(s), 3u);
  s.dp_shard = 6;  // K = dp: one replica, the flattened dp x cp mesh (rank 4 x 2 = 8 of 12)
  apply_hsdp_mesh(f, s);
  EXPECT_EQ(f.ranks, 12u);
  EXPECT_EQ(f.replicate, 1u);
  EXPECT_EQ(f.rank, 8u);
  EXPECT_EQ(hsdp_shard_degree(s), 0u);
}

// HSDP (dp 4, K 2) x cp 2 shards over groups of 4 ranks, as HSDP (dp 8, K 4) without CP does: the same shards,
// gathers, reduce-scatters and all-reduces, in order; the activations are the CP rank's, those of FSDP2 over
// dp 2 x cp 2 (bf16: FSDP's own casts aside, see cpfsdp_test.cc), event for event.
TEST(HsdpCpSim, StatesAreHsdpOverTheShardGroupAndActivationsTheCpRanks) {
  const Estimate hc = run(tiny(256, {{"cp", "2"}, {"dp", "4"}, {"dp_shard", "2"}, {"sharding", "fsdp2"}}));
  const Estimate h = run(tiny(256, {{"dp", "8"}, {"dp_shard", "4"}, {"sharding", "fsdp2"}}));
  ASSERT_TRUE(hc.fsdp.has_value());
  EXPECT_EQ(hc.fsdp->options.ranks, 4u);
  EXPECT_EQ(hc.fsdp->options.replicate, 2u);
  EXPECT_EQ(hc.fsdp->sharded_params.value, h.fsdp->sharded_params.value);
  EXPECT_EQ(hc.fsdp->sharded_grads.value, h.fsdp->sharded_grads.value);
  EXPECT_EQ(hc.fsdp->optimizer_state.value, h.fsdp->optimizer_state.value);
  EXPECT_EQ(hc.state.optimizer_state.value, h.state.optimizer_state.value);
  EXPECT_EQ(category_events(hc, Category::kFsdpBuffers), category_events(h, Category::kFsdpBuffers));
  EXPECT_FALSE(category_events(hc, Category::kFsdpBuffers).empty());
  // by hand: a layer's q, o 2048 x 2048, k, v 256 x 2048, gate, up, down 5632 x 2048 and two norms of 2048 are
  // 44,044,288 parameters; the embedding and lm_head 32000 x 2048 each, the final norm 2048: 219,162,624 in all,
  // every dim 0 divisible by 4, so a quarter per rank, in fp32 shards (accelerate's upcast): 219,162,624 bytes
  EXPECT_EQ(hc.fsdp->sharded_params.value, 219162624u);
  EXPECT_EQ(hc.fsdp->padding_elems, 0u);
  const Estimate hc16 = run(tiny(256, {{"cp", "2"}, {"dp", "4"}, {"dp_shard", "2"}, {"sharding", "fsdp2"}, {"precision", "bf16"}}));
  const Estimate cf16 = run(tiny(256, {{"cp", "2"}, {"dp", "2"}, {"sharding", "fsdp2"}, {"precision", "bf16"}}));
  for (Category c : {Category::kActivations, Category::kBackward, Category::kInputs}) {
    EXPECT_EQ(category_events(hc16, c), category_events(cf16, c)) << category_name(c);
    EXPECT_FALSE(category_events(hc16, c).empty());
  }
}

// --dp-shard equal to --dp under --cp is the flattened dp x cp mesh itself: the same estimate, byte for byte.
TEST(HsdpCpSim, OneReplicaIsFsdp2OverDpTimesCpByteForByte) {
  const Estimate a = run(tiny(256, {{"cp", "2"}, {"dp", "4"}, {"sharding", "fsdp2"}}));
  const Estimate b = run(tiny(256, {{"cp", "2"}, {"dp", "4"}, {"dp_shard", "4"}, {"sharding", "fsdp2"}}));
  EXPECT_EQ(b.fsdp->options.replicate, 1u);
  EXPECT_EQ(render_estimate_json(a, nullptr), render_estimate_json(b, nullptr));
  EXPECT_EQ(render_estimate_table(a, nullptr), render_estimate_table(b, nullptr));
}

// The communicators: the flattened dp_shard x cp group (K x C ranks, T apart), the replicate group (D / K ranks,
// K x C x T apart: accelerate's mesh order dp_replicate, dp_shard, cp, sp, tp) and ring attention's cp group.
TEST(HsdpCpSim, CommunicatorsAreTheShardGroupTheReplicasAndTheCpGroup) {
  TrainSetup s = hsdp_cp(4, 2, 2);
  std::vector<ProcessGroup> g = process_groups(s);
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0].ranks, 4u);
  EXPECT_EQ(g[0].stride, 1u);
  EXPECT_EQ(g[0].kind, ProcessGroup::Kind::kData);
  EXPECT_EQ(g[1].ranks, 2u);
  EXPECT_EQ(g[1].stride, 4u);
  EXPECT_EQ(g[1].kind, ProcessGroup::Kind::kDataReplicate);
  EXPECT_EQ(g[2].ranks, 2u);
  EXPECT_EQ(g[2].kind, ProcessGroup::Kind::kContext);
  s.tp = 2;
  g = process_groups(s);
  EXPECT_EQ(g[0].stride, 2u);
  EXPECT_EQ(g[1].stride, 8u);
}

}  // namespace
}  // namespace trainmem
