// --cp N: context parallelism per rank (cp.h, src/sim/cp_attention.cc). The expected figures are computed here
// from torch's rules (torch/distributed/tensor/experimental/_context_parallel/_attention.py and
// _load_balancer.py), not from trainmem's functions: the head-tail sharding, the ring's steps, the all-gathered
// K/V per attention call, and the claim that a rank of --cp N at --seq T runs the model of --seq T/N except
// for attention's own buffers.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "test_util.h"
#include "trainmem/cp.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/nccl.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

TEST(CpRules, TheRankHoldsSeqOverCpTokensAndTheHeadTailBalancerWantsTwoChunksPerRank) {
  // _HeadTailLoadBalancer: chunk_size = seq // (2 * world_size), two chunks per rank
  EXPECT_EQ(cp_local_seq(8192, 4), 2 * (8192 / (2 * 4)));
  EXPECT_EQ(cp_local_seq(262144, 8), 32768u);  // torchtitan Table 2's CP8 row: 256K tokens, 32K per rank
  EXPECT_EQ(cp_local_seq(100, 1), 100u);       // no CP: no balancer
  EXPECT_THROW(cp_local_seq(100, 4), Error);   // 100 % 8 != 0 (divisible by 4 is not enough)
  EXPECT_THROW(cp_local_seq(12, 4), Error);
  EXPECT_EQ(cp_local_seq(16, 4), 4u);
}

TEST(CpRules, RingStepsFollowTemplatedRingAttentionsThreeBranches) {
  // _templated_ring_attention, load balancing on, causal: i == 0 -> (query, key, value); i <= rank ->
  // (query, key.chunk(2)[0], value.chunk(2)[0]); else (query.chunk(2)[1], key, value, partial=True)
  auto eq = [](const std::vector<RingStep>& a, const std::vector<RingStep>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].q_len, b[i].q_len) << i;
      EXPECT_EQ(a[i].kv_len, b[i].kv_len) << i;
      EXPECT_EQ(a[i].partial, b[i].partial) << i;
    }
  };
  eq(ring_steps(8, 4, 0), {{8, 8, false}, {4, 8, true}, {4, 8, true}, {4, 8, true}});
  eq(ring_steps(8, 4, 1), {{8, 8, false}, {8, 4, false}, {4, 8, true}, {4, 8, true}});
  eq(ring_steps(8, 4, 3), {{8, 8, false}, {8, 4, false}, {8, 4, false}, {8, 4, false}});
  eq(ring_steps(8, 1, 0), {{8, 8, false}});
}

TEST(CpRules, TheAllGatheredKeysAndValuesAreTheWholeSequences) {
  // Llama-3-8B: 8 KV heads of 128, bf16; torchtitan Table 2 keeps 32768 tokens per rank. all_gather_tensor of
  // cat(k.flatten(), v.flatten()): cp x 2 x B x Hk x L x D x 2 bytes = K and V of the whole cp x 32768 tokens
  for (uint64_t cp : {1u, 2u, 4u, 8u}) {
    const uint64_t whole_kv = 2ull * 1 * 8 * (32768 * cp) * 128 * 2;
    EXPECT_EQ(cp_kv_gather_bytes(1, 8, 32768, 128, DType::kBF16, cp), whole_kv) << cp;
  }
  EXPECT_EQ(cp_kv_gather_bytes(1, 8, 32768, 128, DType::kBF16, 8), 1024ull * 1024 * 1024);  // 1 GiB at CP8
  EXPECT_EQ(cp_kv_cat_bytes(2, 4, 64, 64, DType::kF32), 2ull * 2 * 4 * 64 * 64 * 4);
}

// TinyLlama's shapes (32 heads, 4 KV heads of 64), two layers, bf16 autocast: SDPA runs the flash kernel.
using testing::tiny_llama;
Scenario tiny(uint64_t seq, std::initializer_list<std::pair<const char*, std::string>> extra = {}) {
  return tiny_llama(seq, extra);
}

uint64_t allocs_labelled(const Estimate& e, std::string_view what, uint64_t bytes) {
  uint64_t n = 0;
  for (const Event& ev : e.sim->timeline.events) {
    std::string_view w(ev.label.what);
    if (w.starts_with("recompute: ")) w.remove_prefix(11);  // full checkpointing's forward, run again
    if (ev.kind == Event::kAlloc && w == what) {
      EXPECT_EQ(ev.bytes.value, bytes) << what;
      ++n;
    }
  }
  return n;
}

TEST(CpSim, CpOneIsByteIdenticalToNoCp) {
  const Estimate a = run(tiny(256));
  const Estimate b = run(tiny(256, {{"cp", "1"}}));
  EXPECT_EQ(a.peak.live_total.value, b.peak.live_total.value);
  EXPECT_EQ(a.peak.saved_activations.value, b.peak.saved_activations.value);
  EXPECT_EQ(a.memory.peak_allocated.value, b.memory.peak_allocated.value);
  EXPECT_EQ(a.memory.peak_reserved.value, b.memory.peak_reserved.value);
  ASSERT_EQ(a.sim->timeline.events.size(), b.sim->timeline.events.size());
  for (size_t i = 0; i < a.sim->timeline.events.size(); ++i) {
    ASSERT_EQ(a.sim->timeline.events[i].bytes.value, b.sim->timeline.events[i].bytes.value) << i;
  }
}

TEST(CpSim, ARankRunsTheModelAtSeqOverCpPlusOneOutputCopyPerLayer) {
  // Derivation: context_parallel shards input_ids, labels and position_ids to T/N tokens, so every module but
  // attention sees the tensors of a T/N run (the rotary cos/sin from the sharded position_ids, the logits and
  // the loss over the rank's T/N labels). Attention's autograd node saves the local q, k, v, the merged output
  // and logsumexp: the shapes of a T/N run. One difference: the ring returns self._out.to(dtype) of a
  // torch.cat (rank 0's last merge is partial), a contiguous (B, H, L, D) tensor, where the flash kernel's
  // output is a transposed (B, L, H, D) one; transformers' attn_output.transpose(1, 2).contiguous() is then a
  // copy, which o_proj saves: B x L x H x D x 2 bytes more per layer.
  const uint64_t layers = 2, B = 1, L = 64, H = 32, D = 64;
  const Estimate cp = run(tiny(256, {{"cp", "4"}, {"cp_rank", "0"}}));
  const Estimate local = run(tiny(64));
  EXPECT_EQ(cp.state.weights.value, local.state.weights.value);
  EXPECT_EQ(cp.state.gradients.value, local.state.gradients.value);
  EXPECT_EQ(cp.state.optimizer_state.value, local.state.optimizer_state.value);
  EXPECT_EQ(cp.peak.saved_activations.value, local.peak.saved_activations.value + layers * B * L * H * D * 2);
  // The last rank's merges are all full ones (`i <= rank` for every step): `out - sigmoid(..) * (out - block_out)`
  // takes its first operand's layout, the flash kernel's (B, L, H, D) from step 0 (torch 1.13 on CPU: the last
  // rank's output has strides (L*H*D, D, H*D, 1), every other rank's are contiguous), so the transpose(1, 2)
  // .contiguous() is a view and the rank saves what a T/N run saves.
  EXPECT_EQ(run(tiny(256, {{"cp", "4"}, {"cp_rank", "3"}})).peak.saved_activations.value,
            local.peak.saved_activations.value);
  EXPECT_EQ(run(tiny(256, {{"cp", "4"}, {"cp_rank", "2"}})).peak.saved_activations.value,
            cp.peak.saved_activations.value);
}

TEST(CpSim, EveryCpRankIsSimulatedAndTheWorstShown) {
  // rank r's ring runs r steps of the whole query against half the received K/V and 3 - r of half the query
  // against all of it: four different steps, each simulated; without a GPU the worst is the highest peak reserved
  const Estimate e = run(tiny(256, {{"cp", "4"}, {"steps", "1"}}));
  ASSERT_TRUE(e.cp.has_value());
  ASSERT_EQ(e.cp->rows.size(), 4u);
  uint64_t worst = 0;
  for (uint64_t r = 0; r < 4; ++r) {
    const CpFigures::Row& row = e.cp->rows[r];
    EXPECT_EQ(row.rank, r);
    const Estimate one = run(tiny(256, {{"cp", "4"}, {"steps", "1"}, {"cp_rank", std::to_string(r)}}));
    EXPECT_FALSE(one.cp.has_value());  // a rank named: that rank alone
    EXPECT_EQ(row.peak_allocated.value, one.memory.peak_allocated.value) << r;
    EXPECT_EQ(row.peak_reserved.value, one.memory.peak_reserved.value) << r;
    if (std::tie(row.peak_reserved.value, row.peak_allocated.value) >
        std::tie(e.cp->rows[worst].peak_reserved.value, e.cp->rows[worst].peak_allocated.value)) {
      worst = r;
    }
  }
  EXPECT_EQ(e.cp->worst, worst);
  EXPECT_EQ(e.setup.cp_rank.value_or(99), worst);  // the estimate around the rows is the worst rank's
  EXPECT_EQ(e.memory.peak_reserved.value, e.cp->rows[worst].peak_reserved.value);
}

TEST(CpSim, TheCpRankIsTheInnerIndexOfFsdp2sFlattenedMesh) {
  // accelerate's "dp_shard_cp" flattens (dp_shard, cp) row-major: data-parallel rank d's CP rank c is d x cp + c
  const Estimate e = run(tiny(256, {{"cp", "2"}, {"dp", "2"}, {"sharding", "fsdp2"}, {"cp_rank", "1"}, {"steps", "1"}}));
  ASSERT_TRUE(e.fsdp.has_value());
  EXPECT_EQ(e.fsdp->options.ranks, 4u);
  EXPECT_EQ(e.fsdp->options.rank, 1u);
}

TEST(CpSim, EachAttentionCallAllGathersTheWholeSequencesKeysAndValuesInForwardAndBackward) {
  // cp 4 x 2 x B 1 x Hk 4 x L 64 x D 64 x 2 bytes, once per call (_AllGatherRotater), forward and backward
  const uint64_t gathered = 4ull * 2 * 1 * 4 * 64 * 64 * 2;
  const uint64_t layers = 2;  // one optimizer step (--steps 1)
  EXPECT_EQ(allocs_labelled(run(tiny(256, {{"cp", "4"}, {"steps", "1"}})), "cp kv all-gather", gathered), 2 * layers);
  // full checkpointing runs each layer's forward again in backward: a third gather per layer
  EXPECT_EQ(allocs_labelled(run(tiny(256, {{"cp", "4"}, {"checkpointing", "full"}, {"steps", "1"}})), "cp kv all-gather", gathered),
            3 * layers);
  // reentrant checkpointing (its first forward under no_grad still runs the ring): the same three
  EXPECT_EQ(allocs_labelled(run(tiny(256, {{"cp", "4"}, {"checkpointing", "full"}, {"checkpoint_reentrant", "true"},
                                          {"steps", "1"}})),
                            "cp kv all-gather", gathered),
            3 * layers);
  // selective checkpointing (torchtitan's SAC): the policy sees the flash op that context_parallel dispatches to
  // the ring and saves its outputs, so the recompute takes them and runs no ring: the gathers of no checkpointing
  const Estimate sel = run(tiny(256, {{"cp", "4"}, {"checkpointing", "selective"}, {"steps", "1"}}));
  EXPECT_EQ(allocs_labelled(sel, "cp kv all-gather", gathered), 2 * layers);
  uint64_t recomputed = 0;  // while the rest of each layer is recomputed
  for (const Event& ev : sel.sim->timeline.events) {
    recomputed += ev.kind == Event::kAlloc && std::string_view(ev.label.what).starts_with("recompute: ") ? 1 : 0;
  }
  EXPECT_GT(recomputed, 0u);
  // the K/V gradients travel by all-to-all (dkv_rotater is always _AllToAllRotater), float32, one buffer per
  // step: cp steps per backward call
  EXPECT_EQ(allocs_labelled(run(tiny(256, {{"cp", "4"}, {"steps", "1"}})), "cp grad kv all-to-all",
                            2ull * 1 * 4 * 64 * 64 * 4),
            4 * layers);
}

TEST(CpSim, GpusAreDataParallelGroupsOfCpRanks) {
  // --gpus 8xh100-80gb --cp 8: one CP group, no data parallelism left; --cp 4: two DP ranks, refused (dp)
  EXPECT_EQ(run(tiny(256, {{"cp", "8"}, {"gpus", "8xh100-80gb"}, {"steps", "1"}})).setup.dp, 1u);
  try {
    run(tiny(256, {{"cp", "4"}, {"gpus", "8xh100-80gb"}}));
    ADD_FAILURE() << "--gpus 8 --cp 4 (dp 2) was accepted";
  } catch (const FieldError& e) {
    EXPECT_EQ(e.field(), "dp");
  }
}

TEST(CpSim, TheCpGroupIsACommunicatorOfCpRanks) {
  TrainSetup s;
  s.cp = 4;
  const auto g = process_groups(s);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].ranks, 4u);
  EXPECT_EQ(g[0].name, "context parallel (the world group)");  // the only parallelism: the whole world
}

TEST(CpRefusals, WhatIsNotSimulatedIsRefusedWithTheField) {
  const std::pair<Scenario, const char*> cases[] = {
      {tiny(256, {{"cp", "4"}, {"attention", "eager"}}), "attention"},
      {tiny(256, {{"cp", "4"}, {"dp", "2"}}), "dp"},
      {tiny(256, {{"cp", "4"}, {"task", "inference"}}), "task"},
      {tiny(100, {{"cp", "4"}}), "seq"},
      {tiny(256, {{"cp", "2"}, {"pp", "2"}}), "pp"},
      {tiny(256, {{"cp", "2"}, {"sharding", "fsdp1"}}), "sharding"},
      // with FSDP2 over dp x cp (cpfsdp_test.cc): the other shardings, PP (TP: cptp_test.cc)
      {tiny(256, {{"cp", "4"}, {"dp", "2"}, {"sharding", "fsdp1"}}), "sharding"},  // accelerate: FSDP2 only
      {tiny(256, {{"cp", "4"}, {"dp", "2"}, {"sharding", "zero2"}}), "sharding"},
      {tiny(256, {{"cp", "4"}, {"dp", "2"}, {"sharding", "zero3"}}), "sharding"},
      {tiny(256, {{"cp", "4"}, {"dp", "2"}, {"sharding", "ddp"}}), "sharding"},    // pure replicate
      {tiny(256, {{"cp", "2"}, {"pp", "2"}, {"dp", "2"}, {"sharding", "fsdp2"}, {"tp", "2"}, {"precision", "fp32"}}),
       "tp"},  // torchtitan's TP under a pipeline is TP + SP
      {tiny(256, {{"cp", "2"}, {"sharding", "fsdp2"}, {"dp_rank", "1"}}), "dp_rank"},
      {tiny(256, {{"cp", "4"}, {"cp_rank", "4"}}), "cp_rank"},  // ranks 0 to 3
      {tiny(256, {{"cp_rank", "1"}}), "cp_rank"},               // without --cp
      {tiny(256, {{"cp", "4"}, {"gpus", "6xh100-80gb"}}), "gpus"},
      {testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"seq", "64"}, {"cp", "2"}}), "cp"},
  };
  for (const auto& [s, field] : cases) {
    try {
      run(s);
      ADD_FAILURE() << field << " was accepted with --cp";
    } catch (const FieldError& e) {
      EXPECT_EQ(e.field(), field) << e.what();
    }
  }
  // float32 compute runs the memory-efficient kernel, whose padded logsumexp the ring does not merge
  EXPECT_NE(testing::error_of([] { run(tiny(256, {{"cp", "4"}, {"precision", "fp32"}})); }).find("flash"),
            std::string::npos);
}

}  // namespace
}  // namespace trainmem
