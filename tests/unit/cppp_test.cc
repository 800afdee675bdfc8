// --cp C --pp P --sharding fsdp2: context parallel around a pipeline, as torchtitan runs it (train.py: the
// schedule's step() inside train_context(optional_context_parallel_ctx), inputs and labels sharded on the sequence
// dim by create_context_parallel_ctx; parallel_dims.py: FSDP2 on whenever CP is, over the flattened dp_shard x cp
// mesh). The claims, each checked against simulations already validated on their own:
//  - CP shapes the batch: on every pipeline rank, every op outside attention is the pipeline's at --seq T / C with
//    FSDP2 over dp x C data-parallel ranks (the same shards), byte for byte and in order;
//  - each pipeline rank's row is the worst of its CP ranks, each simulated;
//  - what torchtitan does not run is refused: CP without FSDP2, CP with its TP (TP + SP).
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

// TinyLlama's shapes with four layers, batch 1, torchtitan's training.dtype float32 (FSDP2's bf16 param_dtype:
// SDPA's flash kernel), two micro-batches of 1F1B over two stages
Scenario pipe(uint64_t seq, std::initializer_list<std::pair<const char*, std::string>> extra) {
  Scenario s = testing::scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=4"},
                                                       {"batch", "1"},
                                                       {"seq", std::to_string(seq)},
                                                       {"precision", "fp32"},
                                                       {"pp", "2"},
                                                       {"sharding", "fsdp2"}});
  for (const auto& [k, v] : extra) set_field(s, k, v);
  return s;
}

using Ev = std::tuple<int, std::string, uint64_t>;  // (event kind, label, bytes)

// One category's events outside attention: without SDPA's tensors, the flash kernels' scratch, the ring's own
// buffers ("cp ...") and the copy of the ring's contiguous output (cp_test.cc derives it)
std::vector<Ev> outside_attention(const Estimate& e, Category c) {
  std::vector<Ev> out;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.category != c) continue;
    const std::string_view w(ev.label.what);
    if (w.find("sdpa") != std::string_view::npos || w.find("flash") != std::string_view::npos ||
        w.starts_with("cp ") || w == "attn output contiguous") {
      continue;
    }
    out.emplace_back(static_cast<int>(ev.kind), std::string(w), ev.bytes.value);
  }
  return out;
}

TEST(CpPpSim, EveryOpOutsideAttentionIsThePipelinesAtSeqOverCp) {
  for (const char* rank : {"0", "1"}) {
    for (const char* cp_rank : {"0", "1"}) {
      // CP 2 x dp 1: FSDP2 over the 2 CP ranks; the pipeline alone at half the tokens with FSDP2 over 2 dp ranks
      const Estimate cp = run(pipe(512, {{"cp", "2"}, {"cp_rank", cp_rank}, {"rank", rank}}));
      const Estimate local = run(pipe(256, {{"dp", "2"}, {"rank", rank}}));
      ASSERT_TRUE(cp.fsdp.has_value());
      EXPECT_EQ(cp.fsdp->options.ranks, 2u);
      EXPECT_EQ(cp.setup.seq, 256u);
      EXPECT_EQ(cp.state.weights.value, local.state.weights.value);
      for (Category c : {Category::kActivations, Category::kInputs, Category::kGradients, Category::kFsdpBuffers,
                         Category::kOptimizer}) {
        const std::vector<Ev> a = outside_attention(cp, c), b = outside_attention(local, c);
        EXPECT_FALSE(a.empty()) << category_name(c);
        EXPECT_EQ(a, b) << "pipeline rank " << rank << ", CP rank " << cp_rank << ": " << category_name(c);
      }
    }
  }
}

TEST(CpPpSim, EachPipelineRankShowsTheWorstOfItsCpRanks) {
  const Estimate e = run(pipe(512, {{"cp", "2"}, {"steps", "1"}}));
  ASSERT_TRUE(e.pp.has_value());
  ASSERT_EQ(e.pp->rows.size(), 2u);
  for (uint64_t r = 0; r < 2; ++r) {
    uint64_t worst = 0;
    for (const char* c : {"0", "1"}) {
      const Estimate one = run(pipe(512, {{"cp", "2"}, {"steps", "1"}, {"rank", std::to_string(r)}, {"cp_rank", c}}));
      worst = std::max(worst, one.memory.peak_reserved.value);
    }
    EXPECT_EQ(e.pp->rows[r].peak_reserved.value, worst) << r;
  }
  ASSERT_TRUE(e.cp.has_value());  // the rank shown lists its CP ranks
  EXPECT_EQ(e.cp->rows.size(), 2u);
}

TEST(CpPpRefusals, WhatTorchtitanDoesNotRunIsRefused) {
  auto field_of = [](const Scenario& s) {
    try {
      run(s);
    } catch (const FieldError& e) {
      return std::string(e.field());
    }
    return std::string("accepted");
  };
  Scenario no_fsdp = pipe(512, {{"cp", "2"}});
  set_field(no_fsdp, "sharding", "ddp");
  EXPECT_EQ(field_of(no_fsdp), "sharding");  // resolve_cp: DDP with CP
  Scenario unsharded = testing::scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=4"}, {"batch", "1"},
                                                               {"seq", "512"}, {"precision", "fp32"}, {"pp", "2"},
                                                               {"cp", "2"}});
  EXPECT_EQ(field_of(unsharded), "pp");  // torchtitan shards whenever CP is on
  EXPECT_EQ(field_of(pipe(512, {{"cp", "2"}, {"tp", "2"}, {"dp", "2"}})), "tp");
}

}  // namespace
}  // namespace trainmem
