// --dp-rank (setup.h TrainSetup::dp_rank): estimate simulates any rank of a data-parallel group, and rank 0, the
// default, holds the most. The shards are padded alike, so ranks differ only where the real elements do: FSDP2's
// unpadded local shards (torch.chunk leaves the last ranks short) and ZeRO-1/2's partitions (the padding and the
// parameters each partition holds); DDP's replicas and ZeRO-3's padded partitions are alike byte for byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"
#include "trainmem/zero.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

// TinyLlama cut to 2 layers over 3 ranks: hidden 2048, ffn 5632 and vocab 32000 rows do not divide by 3, so
// every sharded tensor has a short last chunk.
Estimate rank_estimate(const std::string& sharding, std::optional<uint64_t> rank, uint64_t dp = 3) {
  std::vector<FieldChange> f = {{"model", "tinyllama-1.1b"}, {"overrides", "num_hidden_layers=2"}, {"batch", "1"},
                                {"seq", "256"}, {"dp", std::to_string(dp)}, {"sharding", sharding}};
  if (rank) f.push_back({"dp_rank", std::to_string(*rank)});
  // DeepSpeed's bf16 engine (zero.cc resolve_zero refuses autocast)
  if (sharding.rfind("zero", 0) == 0) f.push_back({"precision", "bf16"});
  return estimate(resolve(scenario_from(f), MapFileReader()));
}

uint64_t model_states(const Estimate& e) {
  return e.state.weights.value + e.state.gradients.value + e.state.optimizer_state.value;
}

// The default rank holds the most: rank 0 (DDP, ZeRO-3, FSDP2), or under ZeRO-1/2 the rank whose partitions keep
// the most gradient elements (zero_fullest_rank). Every rank simulated, none above it.
TEST(DpRank, TheDefaultRankHoldsTheMostUnderEverySharding) {
  for (const char* sharding : {"ddp", "zero1", "zero2", "zero3", "fsdp2"}) {
    SCOPED_TRACE(sharding);
    const Estimate chosen = rank_estimate(sharding, std::nullopt);
    for (uint64_t r = 0; r < 3; ++r) {
      const Estimate e = rank_estimate(sharding, r);
      EXPECT_GE(chosen.memory.peak_allocated.value, e.memory.peak_allocated.value) << "rank " << r;
      EXPECT_GE(chosen.memory.peak_reserved.value, e.memory.peak_reserved.value) << "rank " << r;
      EXPECT_GE(model_states(chosen), model_states(e)) << "rank " << r;
    }
  }
}

// ZeRO-1/2's ranks differ in what their partitions hold (params_in_partition, boundary parameters in full, and
// their slices): without --dp-rank every class of alike ranks is simulated and the worst shown, its rows covering
// the whole group.
TEST(DpRank, ZeroDefaultIsTheWorstOfEveryRank) {
  for (const char* sharding : {"zero1", "zero2"}) {
    SCOPED_TRACE(sharding);
    const Estimate chosen = rank_estimate(sharding, std::nullopt);
    ASSERT_TRUE(chosen.zero);
    const ZeroFigures& z = *chosen.zero;
    uint64_t covered = 0, highest = 0;
    for (const ZeroFigures::RankRow& r : z.rank_rows) {
      covered += r.ranks;
      highest = std::max(highest, r.peak_reserved.value);
      // each row is what --dp-rank gives for its rank
      EXPECT_EQ(r.peak_reserved.value, rank_estimate(sharding, r.rank).memory.peak_reserved.value) << r.rank;
    }
    EXPECT_EQ(covered, 3u);
    EXPECT_EQ(z.rank_classes, z.rank_rows.size());
    EXPECT_EQ(z.rank_rows[z.worst].rank, z.options.rank);
    EXPECT_EQ(chosen.memory.peak_reserved.value, highest);
  }
}

// Ranks of one class (zero_rank_classes) are alike: simulated, every one of them gives the same step. GPT-2 over 64
// ranks puts many partitions inside wte; the classes are checked rank by rank.
TEST(DpRank, RanksOfOneClassSimulateAlike) {
  const ResolvedScenario r = resolve(scenario_from(std::vector<FieldChange>{{"model", "gpt2"}, {"overrides", "n_layer=1"}}),
                                     MapFileReader());
  const uint64_t dp = 64;
  const std::vector<ZeroRankClass> classes = zero_rank_classes(zero_group_numels(r.inventory), dp);
  uint64_t covered = 0;
  for (const ZeroRankClass& c : classes) covered += c.ranks;
  EXPECT_EQ(covered, dp);
  ASSERT_LT(classes.size(), dp);  // some ranks are alike (else this test checks nothing)
  // the classes' members: rank r belongs to the class whose layout it shares; simulate one member beside the
  // representative for every class with more than one
  auto run_rank = [&](uint64_t rank) {
    return estimate(resolve(scenario_from(std::vector<FieldChange>{
                                {"model", "gpt2"}, {"overrides", "n_layer=1"}, {"batch", "1"}, {"seq", "64"},
                                {"dp", std::to_string(dp)}, {"sharding", "zero2"}, {"precision", "bf16"},
                                {"dp_rank", std::to_string(rank)}}),
                            MapFileReader()));
  };
  size_t checked = 0;
  for (const ZeroRankClass& c : classes) {
    if (c.ranks < 2) continue;
    const Estimate a = run_rank(c.rank);
    // the next rank of the class: the first rank above c.rank with the same held elements and layout
    for (uint64_t other = c.rank + 1; other < dp; ++other) {
      const Estimate b = run_rank(other);
      if (b.zero->group_in_partition != a.zero->group_in_partition) continue;
      EXPECT_EQ(a.memory.peak_reserved.value, b.memory.peak_reserved.value) << c.rank << " vs " << other;
      EXPECT_EQ(a.memory.peak_allocated.value, b.memory.peak_allocated.value) << c.rank << " vs " << other;
      ++checked;
      break;
    }
  }
  EXPECT_GT(checked, 0u);
}

TEST(DpRank, DdpAndZero3RanksAreAlikeByteForByte) {
  for (const char* sharding : {"ddp", "zero3"}) {
    SCOPED_TRACE(sharding);
    const Estimate first = rank_estimate(sharding, 0), last = rank_estimate(sharding, 2);
    EXPECT_EQ(first.memory.peak_allocated.value, last.memory.peak_allocated.value);
    EXPECT_EQ(first.memory.peak_reserved.value, last.memory.peak_reserved.value);
    EXPECT_EQ(model_states(first), model_states(last));
  }
}

// The rank given is the one simulated: the last rank's short chunks give a smaller optimizer state (AdamW's
// zeros_like over the unpadded local shard), its padded parameter and gradient shards stay the same size.
TEST(DpRank, Fsdp2LastRankHoldsFewerRealElements) {
  const Estimate first = rank_estimate("fsdp2", 0), mid = rank_estimate("fsdp2", 1), last = rank_estimate("fsdp2", 2);
  ASSERT_TRUE(first.fsdp && mid.fsdp && last.fsdp);
  EXPECT_EQ(last.fsdp->options.rank, 2u);
  EXPECT_LT(last.state.optimizer_state.value, first.state.optimizer_state.value);
  EXPECT_EQ(last.fsdp->sharded_params.value, first.fsdp->sharded_params.value);
  // torch.chunk's chunks cover every element once: the three ranks' local elements add up to the model
  EXPECT_EQ(first.fsdp->local_elems + mid.fsdp->local_elems + last.fsdp->local_elems, first.state.parameters.value);
  // and each rank's figures name rank 0's and the last rank's counts
  EXPECT_EQ(first.fsdp->first_rank_elems, first.fsdp->local_elems);
  EXPECT_EQ(first.fsdp->last_rank_elems, last.fsdp->local_elems);
  EXPECT_GT(first.fsdp->first_rank_elems, first.fsdp->last_rank_elems);
}

// ZeRO-2 keeps the gradients of the parameters in its partition (params_in_partition, boundary ones in full): the
// rank given is the one simulated, partitions alike in size.
TEST(DpRank, Zero2RankGivenIsTheOneSimulated) {
  const Estimate first = rank_estimate("zero2", 0), last = rank_estimate("zero2", 2);
  ASSERT_TRUE(first.zero && last.zero);
  EXPECT_EQ(last.zero->options.rank, 2u);
  EXPECT_NE(last.state.gradients.value, first.state.gradients.value);
  EXPECT_EQ(last.zero->fp32_master.value, first.zero->fp32_master.value);
}

// zero_fullest_rank's one pass agrees with zero_group_layout's per-rank rule (get_partition_info) over every rank.
TEST(DpRank, FullestRankIsTheMaximumOfEveryRanksLayout) {
  const ResolvedScenario r = resolve(scenario_from(std::vector<FieldChange>{{"model", "llama-3-8b"}}), MapFileReader());
  const std::vector<std::vector<uint64_t>> groups = zero_group_numels(r.inventory);
  for (uint64_t dp : {2, 3, 8, 24, 64}) {
    SCOPED_TRACE(dp);
    uint64_t best = 0, best_rank = 0;
    for (uint64_t rank = 0; rank < dp; ++rank) {
      uint64_t held = 0;
      for (const std::vector<uint64_t>& g : groups) held += zero_group_layout(g, dp, rank).in_partition_numel;
      if (held > best) best = held, best_rank = rank;
    }
    const ZeroFullestRank f = zero_fullest_rank(groups, dp);
    EXPECT_EQ(f.rank, best_rank);
    EXPECT_EQ(f.in_partition_numel, best);
  }
}

TEST(DpRank, OutsideTheGroupIsRefusedNamingTheField) {
  try {
    rank_estimate("fsdp2", 3);
    FAIL() << "rank 3 of 3 accepted";
  } catch (const FieldError& e) {
    EXPECT_EQ(e.field(), "dp_rank");
    EXPECT_NE(std::string(e.what()).find("ranks 0 to 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rank_estimate("ddp", 1, 1), FieldError);  // no data-parallel group to pick from
}

// The library checks the rank too (validate_setup), for every sharding, when a setup bypasses resolve().
TEST(DpRank, EstimateRefusesARankOutsideTheGroupWithoutResolve) {
  for (const char* sharding : {"ddp", "zero2", "zero3", "fsdp1", "fsdp2"}) {
    SCOPED_TRACE(sharding);
    std::vector<FieldChange> f = {{"model", "tinyllama-1.1b"}, {"overrides", "num_hidden_layers=2"}, {"batch", "1"},
                                  {"seq", "64"}, {"dp", "3"}, {"sharding", sharding}};
    if (std::string(sharding).rfind("zero", 0) == 0) f.push_back({"precision", "bf16"});
    ResolvedScenario r = resolve(scenario_from(f), MapFileReader());
    r.setup.dp_rank = 3;
    try {
      estimate(r);
      FAIL() << "rank 3 of 3 accepted";
    } catch (const FieldError& e) {
      EXPECT_EQ(e.field(), "dp_rank");
      EXPECT_NE(std::string(e.what()).find("ranks 0 to 2"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace trainmem
