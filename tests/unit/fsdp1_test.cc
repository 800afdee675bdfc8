// --dp N --sharding fsdp1: one rank of FSDP1 (FullyShardedDataParallel) under accelerate (fsdp1.h,
// src/sim/fsdp1.cc). No GPU here: these tests pin the flat-parameter arithmetic to numbers worked by hand from the
// source's rules (_flat_param.py _init_flat_param_and_metadata: before each parameter a padding of
// aligned - total % aligned when below aligned, aligned = 16 bytes / the dtype's size; then a padding of
// W - total % W when below W; _get_shard: chunks of ceil(total / W)), the Trainer's units, and what the simulated
// rank allocates. validate/cpu/fsdp1.py checks the same layouts against PyTorch 1.13's FlatParamHandle.
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp1.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

TEST(Fsdp1Layout, AlignmentIsSixteenBytes) {
  EXPECT_EQ(fsdp1_aligned_numel(DType::kBF16), 8u);
  EXPECT_EQ(fsdp1_aligned_numel(DType::kF16), 8u);
  EXPECT_EQ(fsdp1_aligned_numel(DType::kF32), 4u);
}

// numels 5, 3, 10 with 8-element alignment on 8 ranks: 5 at 0, pad 3, 3 at 8, pad 5, 10 at 16, total 26, pad 6 to
// 32 = 8 x 4. Without alignment (use_orig_params=False): 18 elements, S = ceil(18 / 8) = 3, 24 gathered, the
// last ranks' shards F.pad-ded (6 elements).
TEST(Fsdp1Layout, PaddingByHand) {
  const Fsdp1Layout a = fsdp1_layout({5, 3, 10}, 8, 8);
  EXPECT_EQ(a.offsets, (std::vector<uint64_t>{0, 8, 16}));
  EXPECT_EQ(a.align_padding, 8u);
  EXPECT_EQ(a.world_padding, 6u);
  EXPECT_EQ(a.unpadded_numel, 32u);
  EXPECT_EQ(a.shard_numel, 4u);
  EXPECT_EQ(a.padded_unsharded_numel, 32u);
  EXPECT_EQ(a.params, 18u);
  // rank r holds [4r, 4r + 4): the 5 at [0, 5) gives 4 to rank 0 and 1 to rank 1, the 3 at [8, 11) 3 to rank 2,
  // the 10 at [16, 26) 4, 4, 2 to ranks 4, 5, 6; rank 3 and rank 7 hold padding only
  EXPECT_EQ(fsdp1_numel_in_shard(a, 0, 0), 4u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 0, 1), 1u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 1, 0), 0u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 1, 2), 3u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 2, 3), 0u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 2, 4), 4u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 2, 6), 2u);
  EXPECT_EQ(fsdp1_numel_in_shard(a, 2, 7), 0u);
  const Fsdp1Layout u = fsdp1_layout({5, 3, 10}, 0, 8);
  EXPECT_EQ(u.offsets, (std::vector<uint64_t>{0, 5, 8}));
  EXPECT_EQ(u.unpadded_numel, 18u);
  EXPECT_EQ(u.shard_numel, 3u);
  EXPECT_EQ(u.padded_unsharded_numel, 24u);
  EXPECT_EQ(u.world_padding, 6u);
  EXPECT_THROW(fsdp1_layout({}, 8, 8), Error);
}

// GPT-2 124M's block in fp32 (4-element alignment) on 7 ranks: ln_1 768 + 768, c_attn 768 x 2304 = 1,769,472 +
// 2,304, c_proj 589,824 + 768, ln_2 768 + 768, c_fc 2,359,296 + 3,072, mlp.c_proj 2,359,296 + 768 = 7,087,872
// elements, every one a multiple of 4 (no alignment padding); 7,087,872 = 7 x 1,012,553 + 1: 6 elements of
// world-size padding, 7,087,878 = 7 x 1,012,554.
TEST(Fsdp1Layout, Gpt2BlockOnSevenRanks) {
  const Fsdp1Layout l = fsdp1_layout({768, 768, 1769472, 2304, 589824, 768, 768, 768, 2359296, 3072, 2359296, 768},
                                     fsdp1_aligned_numel(DType::kF32), 7);
  EXPECT_EQ(l.params, 7087872u);
  EXPECT_EQ(l.align_padding, 0u);
  EXPECT_EQ(l.world_padding, 6u);
  EXPECT_EQ(l.shard_numel, 1012554u);
  EXPECT_EQ(l.padded_unsharded_numel, 7087878u);
}

// Llama-3-8B on 8 ranks with bf16 compute (8-element alignment). A decoder layer: q 4096 x 4096 = 16,777,216,
// k and v 1024 x 4096 = 4,194,304 each, o 16,777,216, gate/up/down 14336 x 4096 = 58,720,256 each, two norms of
// 4,096: 218,112,000, divisible by 8: S = 27,264,000, no padding. The root: embed_tokens 128256 x 4096 =
// 525,336,576, norm 4,096, lm_head 525,336,576: 1,050,677,248, S = 131,334,656. On 6 ranks the root needs 2
// elements of world-size padding (1,050,677,248 = 6 x 175,112,874 + 4): S = 175,112,875.
TEST(Fsdp1Layout, Llama3LayerAndRootByHand) {
  const std::vector<uint64_t> layer{16777216, 4194304, 4194304, 16777216, 58720256, 58720256, 58720256, 4096, 4096};
  const Fsdp1Layout l = fsdp1_layout(layer, 8, 8);
  EXPECT_EQ(l.params, 218112000u);
  EXPECT_EQ(l.shard_numel, 27264000u);
  EXPECT_EQ(l.align_padding + l.world_padding, 0u);
  // rank 0's shard [0, 27,264,000): q (16,777,216), k (4,194,304), v (4,194,304), o's first 2,098,176
  EXPECT_EQ(fsdp1_numel_in_shard(l, 0, 0), 16777216u);
  EXPECT_EQ(fsdp1_numel_in_shard(l, 3, 0), 2098176u);
  EXPECT_EQ(fsdp1_numel_in_shard(l, 4, 0), 0u);
  const Fsdp1Layout root = fsdp1_layout({525336576, 4096, 525336576}, 8, 8);
  EXPECT_EQ(root.shard_numel, 131334656u);
  const Fsdp1Layout root6 = fsdp1_layout({525336576, 4096, 525336576}, 8, 6);
  EXPECT_EQ(root6.world_padding, 2u);
  EXPECT_EQ(root6.shard_numel, 175112875u);
}

// A llama of 2 layers, hidden 60, 4 heads of 16 with 2 KV heads, intermediate 200, vocab 1001, on 8 ranks: 60 is
// not a multiple of 8, so the norms and the root get alignment padding.
//   layer (bf16 compute, 8-element alignment): q 64 x 60 = 3,840 at 0, k 32 x 60 = 1,920 at 3,840, v 1,920 at
//   5,760, o 60 x 64 = 3,840 at 7,680, gate/up 200 x 60 = 12,000 at 11,520 and 23,520, down 60 x 200 = 12,000 at
//   35,520, input_layernorm 60 at 47,520, pad 4, post_attention_layernorm 60 at 47,584, pad 4 to 47,648 = 8 x 5,956
//   root: embed_tokens 1001 x 60 = 60,060 at 0, pad 4, norm 60 at 60,064, pad 4, lm_head 60,060 at 60,128, pad 4 to
//   120,192 = 8 x 15,024
// Rank 0's shards hold parameters only (its ranges end before any padding): 5,956 x 2 + 15,024 = 26,936 elements.
Scenario tiny(std::initializer_list<std::pair<const char*, std::string>> more = {}) {
  Scenario s = testing::scenario_of(
      "llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"overrides", "hidden_size=60"},
                     {"overrides", "intermediate_size=200"}, {"overrides", "num_attention_heads=4"},
                     {"overrides", "num_key_value_heads=2"}, {"overrides", "head_dim=16"}, {"overrides", "vocab_size=1001"},
                     {"batch", "1"}, {"seq", "32"}, {"dp", "8"}, {"sharding", "fsdp1"}});
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

TEST(Fsdp1Units, TrainerUnitsAndRankZeroStatesByHand) {
  const Estimate e = run(tiny());
  ASSERT_TRUE(e.fsdp1.has_value());
  const Fsdp1Figures& f = *e.fsdp1;
  ASSERT_EQ(f.units.size(), 3u);
  EXPECT_EQ(f.units[0].name, "model.layers.0");
  EXPECT_EQ(f.units[2].name, "model (root)");
  const Fsdp1Layout& l = f.units[0].layout;
  EXPECT_EQ(l.offsets, (std::vector<uint64_t>{0, 3840, 5760, 7680, 11520, 23520, 35520, 47520, 47584}));
  EXPECT_EQ(l.params, 47640u);
  EXPECT_EQ(l.align_padding, 4u);
  EXPECT_EQ(l.world_padding, 4u);
  EXPECT_EQ(l.shard_numel, 5956u);
  const Fsdp1Layout& r = f.units[2].layout;
  EXPECT_EQ(r.offsets, (std::vector<uint64_t>{0, 60064, 60128}));
  EXPECT_EQ(r.align_padding, 8u);
  EXPECT_EQ(r.world_padding, 4u);
  EXPECT_EQ(r.shard_numel, 15024u);
  // bf16-amp: fp32 flat parameters (accelerate's upcast), bf16 gathers and reduce-scatters
  EXPECT_EQ(f.options.orig_dtype, DType::kF32);
  EXPECT_EQ(f.options.param_dtype, DType::kBF16);
  EXPECT_EQ(f.options.reduce_dtype, DType::kBF16);
  EXPECT_TRUE(f.options.use_orig_params);
  EXPECT_FALSE(f.options.backward_prefetch);  // the Trainer's NO_PREFETCH
  EXPECT_EQ(f.shard_elems, 26936u);
  EXPECT_EQ(f.local_elems, 26936u);
  EXPECT_EQ(f.padding_elems, 8u + 8u + 12u);
  EXPECT_EQ(f.sharded_params.value, 4u * 26936);
  EXPECT_EQ(f.sharded_grads.value, 4u * 26936);
  EXPECT_EQ(f.optimizer_state.value, 8u * 26936);  // foreach AdamW: exp_avg, exp_avg_sq (its step on the CPU)
  EXPECT_EQ(e.state.weights.value, 4u * 26936);
}

// The simulated rank: per unit the padded unsharded flat parameter (8 x S, bf16) on the unshard stream, the _mp_shard
// (S, bf16) on the pre-unshard stream, the unsharded flat gradient (bf16) and the sharded gradient (S, fp32, after the
// bf16 new_sharded_grad) on the post-backward stream; the optimizer's state over the rank's views; nothing of FSDP's
// left at the end of the step but the sharded gradients.
TEST(Fsdp1Sim, BuffersByNameSizeAndStream) {
  const Estimate e = run(tiny());
  uint64_t full = 0, mp = 0, flat_grad = 0, sharded = 0, new_sharded = 0;
  LiveBytes live;
  const size_t fk = static_cast<size_t>(Category::kFsdpBuffers);
  uint64_t max_unsharded_in_backward = 0, unsharded_now = 0;
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    const std::string_view w = ev.label.what;
    if (w == "FSDP1 unsharded flat parameter" || w == "FSDP1 unsharded flat parameter (model (root))") {
      unsharded_now += ev.kind == Event::kAlloc ? 1 : 0;
      unsharded_now -= ev.kind == Event::kFree ? 1 : 0;
      if (ev.phase == Phase::kBackward) max_unsharded_in_backward = std::max(max_unsharded_in_backward, unsharded_now);
    }
    if (ev.kind != Event::kAlloc || ev.step != 2) continue;
    if (w == "FSDP1 unsharded flat parameter" && ev.label.layer == 1) {
      ++full;
      EXPECT_EQ(ev.bytes.value, 8u * 5956 * 2);
      EXPECT_EQ(ev.stream, Stream::kFsdp1Unshard);
    }
    if (w == "FSDP1 low-precision shard (_mp_shard)" && ev.label.layer == 1) {
      ++mp;
      EXPECT_EQ(ev.bytes.value, 5956u * 2);
      EXPECT_EQ(ev.stream, Stream::kFsdp1PreUnshard);
    }
    if (w == "FSDP1 unsharded flat gradient" && ev.label.layer == 1) {
      ++flat_grad;
      EXPECT_EQ(ev.bytes.value, 47648u * 2);
      EXPECT_EQ(ev.stream, Stream::kDefault);
    }
    if (w == "FSDP1 new_sharded_grad" && ev.label.layer == 1) {
      ++new_sharded;
      EXPECT_EQ(ev.bytes.value, 5956u * 2);
      EXPECT_EQ(ev.stream, Stream::kFsdp1PostBackward);
    }
    if (w == "FSDP1 sharded gradient" && ev.label.layer == 1) {
      ++sharded;
      EXPECT_EQ(ev.bytes.value, 5956u * 4);
      EXPECT_EQ(ev.category, Category::kGradients);
      EXPECT_EQ(ev.stream, Stream::kFsdp1PostBackward);
    }
    if (w == "FSDP1 unsharded flat parameter (model (root))") EXPECT_EQ(ev.bytes.value, 120192u * 2);
  }
  EXPECT_EQ(full, 2u);  // the forward's unshard and the pre-backward's (FULL_SHARD resharded it after forward)
  EXPECT_EQ(mp, 2u);
  EXPECT_EQ(flat_grad, 1u);
  EXPECT_EQ(new_sharded, 1u);
  EXPECT_EQ(sharded, 1u);
  // NO_PREFETCH: in the backward the root's flat parameter and the running layer's, no more
  EXPECT_EQ(max_unsharded_in_backward, 2u);
  EXPECT_EQ(live.by_category[fk].value, 0u);
  // the optimizer's state: rank 0's views, 26,936 fp32 elements, two moments each
  EXPECT_EQ(live.by_category[static_cast<size_t>(Category::kOptimizer)].value, 8u * 26936);
}

// backward_prefetch BACKWARD_PRE: each pre-backward hook all-gathers the unit before it in post-forward order
// (_ExecOrderData.get_handle_to_backward_prefetch: index - 1); the root's, on the loss, the last layer's. So the
// root, the running layer and the prefetched one are unsharded at once; the step gathers each layer once in the
// backward all the same.
TEST(Fsdp1Sim, BackwardPrePrefetchesOneUnitAhead) {
  const Estimate e = run(tiny({{"fsdp1_prefetch", "backward_pre"}}));
  ASSERT_TRUE(e.fsdp1->options.backward_prefetch);
  uint64_t now = 0, most = 0, gathers = 0;
  for (const Event& ev : e.sim->timeline.events) {
    const std::string_view w = ev.label.what;
    if (w != "FSDP1 unsharded flat parameter" && w != "FSDP1 unsharded flat parameter (model (root))") continue;
    now += ev.kind == Event::kAlloc ? 1 : 0;
    now -= ev.kind == Event::kFree ? 1 : 0;
    if (ev.phase == Phase::kBackward) most = std::max(most, now);
    if (ev.kind == Event::kAlloc && ev.step == 2 && ev.phase == Phase::kBackward) ++gathers;
  }
  EXPECT_EQ(most, 3u);
  EXPECT_EQ(gathers, 2u);
  const Estimate none = run(tiny({{"fsdp1_prefetch", "none"}}));
  EXPECT_GT(e.memory.peak_allocated.value, none.memory.peak_allocated.value - 1);
  EXPECT_THROW(run(tiny({{"fsdp1_prefetch", "backward_post"}})), Error);
}

TEST(Fsdp1Report, NamesTheFlatParametersAndTheJson) {
  const Estimate e = run(tiny());
  const std::string t = render_estimate_table(e, nullptr);
  EXPECT_NE(t.find("per rank, 8 ranks (FSDP1)"), std::string::npos) << t;
  EXPECT_NE(t.find("FSDP1 (FullyShardedDataParallel through accelerate"), std::string::npos) << t;
  EXPECT_NE(t.find("flat 47,648 = 47,640 parameters + 4 alignment + 4 world-size padding; shard S 5,956"), std::string::npos) << t;
  const std::string j = render_estimate_json(e, nullptr);
  EXPECT_NE(j.find("\"fsdp1\""), std::string::npos);
  EXPECT_NE(j.find("\"shard_numel\": 15024"), std::string::npos) << j;
}

// Llama-3-8B on 8 ranks, rank 0, by hand: 32 layers x 27,264,000 + 131,334,656 = 1,003,782,656 shard elements,
// all parameters on rank 0 (no padding anywhere): fp32 parameters 4,015,130,624 B, fp32 gradients the same, AdamW
// 8,030,261,248 B.
TEST(Fsdp1Units, Llama3On8RanksPerRankStates) {
  const Estimate e = run(testing::scenario_of("llama-3-8b", {{"batch", "1"}, {"seq", "64"}, {"dp", "8"},
                                                             {"sharding", "fsdp1"}, {"overrides", "num_hidden_layers=2"}}));
  // two layers keep the test fast: 2 x 27,264,000 + 131,334,656 = 185,862,656
  ASSERT_TRUE(e.fsdp1.has_value());
  EXPECT_EQ(e.fsdp1->shard_elems, 185862656u);
  EXPECT_EQ(e.fsdp1->sharded_params.value, 4u * 185862656);
  EXPECT_EQ(e.fsdp1->optimizer_state.value, 8u * 185862656);
  const uint64_t full = 32u * 27264000 + 131334656;
  EXPECT_EQ(full, 1003782656u);
  EXPECT_EQ(4 * full, 4015130624u);
  EXPECT_EQ(8 * full, 8030261248u);
}

TEST(Fsdp1Refusals, WhatIsNotSimulated) {
  auto refused = [](std::initializer_list<std::pair<const char*, std::string>> more, const char* what) {
    const std::string why = testing::error_of([&] { run(tiny(more)); });
    EXPECT_NE(why.find(what), std::string::npos) << why;
  };
  refused({{"checkpointing", "full"}}, "activation checkpointing under FSDP1");
  refused({{"grad_accum", "2"}}, "gradient accumulation under FSDP1");
  refused({{"precision", "fp16-amp"}}, "ShardedGradScaler");
  refused({{"torch", "2.0"}}, "PyTorch >= 2.1");
  refused({{"loop", "nanogpt"}}, "--loop hf");
  refused({{"reshard_after_forward", "false"}}, "FSDP2's setting");
  refused({{"bucket_cap_mb", "25"}}, "DDP setting");
  refused({{"optimizer", "sgd"}}, "AdamW/Adam");
  refused({{"overrides", "tie_word_embeddings=true"}}, "tied input/output embeddings");
  const std::string g = testing::error_of([] {
    run(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"dp", "8"}, {"sharding", "fsdp1"}}));
  });
  EXPECT_NE(g.find("llama family"), std::string::npos) << g;
}

}  // namespace
}  // namespace trainmem
