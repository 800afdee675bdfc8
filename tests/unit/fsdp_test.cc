// --dp N --sharding fsdp2: one rank of FSDP2 (fully_shard) under accelerate (fsdp.h, src/sim/fsdp.cc). No GPU and
// no torch >= 2.6 here (the CPU oracle has torch 1.13, which has no fully_shard): these tests pin the shard
// arithmetic to numbers worked by hand from the source's rule (FSDPParam._init_sharded_param: torch.chunk on dim 0,
// padded to chunks[0]), the units of accelerate's fsdp2_prepare_model, and what the simulated rank allocates.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

// torch.chunk(t, 8, dim=0) of 1001 rows: chunks of ceil(1001 / 8) = 126 rows, seven full (882 rows) and the last
// 1001 - 882 = 119; every rank's _sharded_param_data is padded to 126 rows.
TEST(FsdpShard, VocabNotDivisibleByTheWorldIsPaddedOnTheLastRank) {
  const FsdpShard r0 = fsdp_shard({1001, 64}, 8, 0);
  EXPECT_EQ(r0.rows_padded, 126u);
  EXPECT_EQ(r0.rows_local, 126u);
  EXPECT_EQ(r0.padded_numel, 126u * 64);
  EXPECT_EQ(r0.local_numel, 126u * 64);
  EXPECT_EQ(r0.unsharded_padded_numel, 1008u * 64);  // all_gather_outputs[0]: 8 x 126 rows
  EXPECT_EQ(r0.local_shape, (std::vector<uint64_t>{126, 64}));
  const FsdpShard r7 = fsdp_shard({1001, 64}, 8, 7);
  EXPECT_EQ(r7.rows_padded, 126u);
  EXPECT_EQ(r7.rows_local, 119u);
  EXPECT_EQ(r7.padded_numel - r7.local_numel, 7u * 64);  // the 7 padding rows
  EXPECT_EQ(r7.local_shape, (std::vector<uint64_t>{119, 64}));
  // 3 rows over 8 ranks: chunks of 1 row, ranks 3..7 get _chunk_with_empty's empty chunks (padded to 1 row)
  EXPECT_EQ(fsdp_shard({3, 5}, 8, 2).rows_local, 1u);
  EXPECT_EQ(fsdp_shard({3, 5}, 8, 3).rows_local, 0u);
  EXPECT_EQ(fsdp_shard({3, 5}, 8, 3).padded_numel, 5u);
  // a 1-d norm weight of 4096 on 8 ranks: 512 each, no padding
  EXPECT_EQ(fsdp_shard({4096}, 8, 0).padded_numel, 512u);
  // 13 rows on 4 ranks: 4, 4, 4, 1
  EXPECT_EQ(fsdp_shard({13, 2}, 4, 3).rows_local, 1u);
  EXPECT_EQ(fsdp_shard({13, 2}, 4, 3).rows_padded, 4u);
  EXPECT_THROW(fsdp_shard({13, 2}, 4, 4), Error);
}

// A llama of 2 layers, hidden 64, 4 heads of 16 with 2 KV heads, intermediate 200, vocab 1001, on 8 ranks.
Scenario tiny(std::initializer_list<std::pair<const char*, std::string>> more = {}) {
  Scenario s = testing::scenario_of(
      "llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"overrides", "hidden_size=64"},
                     {"overrides", "intermediate_size=200"}, {"overrides", "num_attention_heads=4"},
                     {"overrides", "num_key_value_heads=2"}, {"overrides", "head_dim=16"}, {"overrides", "vocab_size=1001"},
                     {"batch", "1"}, {"seq", "32"}, {"dp", "8"}, {"sharding", "fsdp2"}});
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

// Per unit, the padded shard elements by hand (rows / 8 rounded up, times the other dims):
//   embedding 1001 x 64: 126 x 64 = 8,064
//   layer: q_proj 64x64 -> 8x64 = 512; k_proj, v_proj 32x64 -> 4x64 = 256 each; o_proj 512; gate/up 200x64 -> 25x64
//          = 1,600 each; down 64x200 -> 8x200 = 1,600; two norms 64 -> 8 each: 6,352 (x 8 = its 50,816 parameters)
//   tail: norm 8 + lm_head 8,064 = 8,072
TEST(FsdpUnits, AccelerateUnitsAndTheirShardsByHand) {
  const Estimate e = run(tiny());
  ASSERT_TRUE(e.fsdp.has_value());
  const FsdpFigures& f = *e.fsdp;
  ASSERT_EQ(f.units.size(), 4u);
  EXPECT_EQ(f.units[0].name, "model.embed_tokens");
  EXPECT_EQ(f.units[1].name, "model.layers.0");
  EXPECT_EQ(f.units[3].name, "[model.norm, lm_head]");
  EXPECT_EQ(f.units[0].shard_numel, 8064u);
  EXPECT_EQ(f.units[1].shard_numel, 6352u);
  EXPECT_EQ(f.units[2].shard_numel, 6352u);
  EXPECT_EQ(f.units[3].shard_numel, 8072u);
  EXPECT_EQ(f.units[1].params, 50816u);
  EXPECT_TRUE(f.units[1].reshard_after_forward);
  EXPECT_FALSE(f.units[3].reshard_after_forward);
  // bf16-amp: fp32 shards (accelerate's upcast), bf16 gathers and reduce-scatters
  EXPECT_EQ(f.options.orig_dtype, DType::kF32);
  EXPECT_EQ(f.options.param_dtype, DType::kBF16);
  EXPECT_EQ(f.options.reduce_dtype, DType::kBF16);
  const uint64_t shards = 8064 + 2 * 6352 + 8072;
  EXPECT_EQ(f.sharded_params.value, 4 * shards);
  EXPECT_EQ(f.sharded_grads.value, 4 * shards);
  EXPECT_EQ(f.optimizer_state.value, 8 * shards);  // rank 0's local shards are unpadded; foreach AdamW's step on the CPU
  EXPECT_EQ(f.padding_elems, 0u);                  // rank 0 holds full chunks
  EXPECT_EQ(e.state.weights.value, 4 * shards);
}

// The simulated rank: each unit's all-gather output (8 x its shard, bf16) and copy-in, its reduce-scatter input
// (bf16) and the fp32 upcast of the output, named in the timeline; nothing of FSDP's left at the end of the step.
TEST(FsdpSim, BuffersByNameAndSizeFreedByTheStepsEnd) {
  const Estimate e = run(tiny());
  uint64_t ag_layer = 0, rs_layer = 0, copy_in = 0, upcast = 0, unsharded_allocs = 0;
  LiveBytes live;
  const size_t fk = static_cast<size_t>(Category::kFsdpBuffers);
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    if (ev.kind != Event::kAlloc || ev.step != 2) continue;
    const std::string_view w = ev.label.what;
    // the streams they are allocated on (get_all_gather_streams; foreach_reduce's reduce_scatter_stream)
    if (w == "FSDP all-gather output" && ev.label.layer == 1) {
      ++ag_layer;
      EXPECT_EQ(ev.bytes.value, 8u * 6352 * 2);
      EXPECT_EQ(ev.stream, Stream::kFsdpAllGatherCopyIn);
    }
    if (w == "FSDP reduce-scatter input" && ev.label.layer == 1) {
      ++rs_layer;
      EXPECT_EQ(ev.bytes.value, 8u * 6352 * 2);
      EXPECT_EQ(ev.stream, Stream::kDefault);
    }
    if (w == "FSDP all-gather copy-in" && ev.label.layer == 1) {
      ++copy_in;
      EXPECT_EQ(ev.bytes.value, 6352u * 2);
      EXPECT_EQ(ev.stream, Stream::kFsdpAllGatherCopyIn);
    }
    if (w == "FSDP sharded gradients (reduce-scatter output upcast)" && ev.label.layer == 1) {
      ++upcast;
      EXPECT_EQ(ev.bytes.value, 6352u * 4);
      EXPECT_EQ(ev.stream, Stream::kFsdpReduceScatter);
    }
    if (w == "model.layers.1.mlp.down_proj.weight (FSDP unsharded)") {
      ++unsharded_allocs;
      EXPECT_EQ(ev.bytes.value, 64u * 200 * 2);  // 8 x 8 padded rows of 200, bf16
      EXPECT_EQ(ev.category, Category::kFsdpBuffers);
      EXPECT_EQ(ev.stream, Stream::kDefault);  // copy-out's resize_ runs on the current stream
    }
  }
  EXPECT_EQ(ag_layer, 2u);          // the forward's unshard, the backward's prefetch (reshard after forward)
  EXPECT_EQ(copy_in, 2u);
  EXPECT_EQ(rs_layer, 1u);
  EXPECT_EQ(upcast, 1u);
  EXPECT_EQ(unsharded_allocs, 2u);  // copied out in the forward and again in the backward
  EXPECT_EQ(live.by_category[fk].value, 0u);
  // the embedding's all-gather output pads 1001 rows to 1008
  bool embed = false;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && std::string_view(ev.label.what) == "FSDP all-gather output (model.embed_tokens)") {
      EXPECT_EQ(ev.bytes.value, 1008u * 64 * 2);
      embed = true;
    }
  }
  EXPECT_TRUE(embed);
}

// fp32 (MixedPrecisionPolicy()): no copy-in, gathers and reduce-scatters in float32, the reduce-scatter output is
// the gradient itself (no upcast).
TEST(FsdpSim, Fp32HasNoCopyInAndNoUpcast) {
  const Estimate e = run(tiny({{"precision", "fp32"}}));
  for (const Event& ev : e.sim->timeline.events) {
    const std::string_view w = ev.label.what;
    EXPECT_NE(w, "FSDP all-gather copy-in");
    EXPECT_NE(w, "FSDP sharded gradients (reduce-scatter output upcast)");
    if (ev.kind == Event::kAlloc && w == "FSDP all-gather output" && ev.label.layer == 0) {
      EXPECT_EQ(ev.bytes.value, 8u * 6352 * 4);
    }
  }
}

// reshard_after_forward=false: the layers stay gathered from the forward to their backward, so the backward
// all-gathers nothing for them (one all-gather per layer per step) and more is live after the forward.
TEST(FsdpSim, NoReshardAfterForwardKeepsLayersGathered) {
  const Estimate keep = run(tiny({{"reshard_after_forward", "false"}}));
  const Estimate drop = run(tiny());
  size_t ag = 0;
  for (const Event& ev : keep.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && ev.step == 2 && std::string_view(ev.label.what) == "FSDP all-gather output" &&
        ev.label.layer == 0) {
      ++ag;
    }
  }
  EXPECT_EQ(ag, 1u);
  // two layers' unsharded bf16 parameters (8 x 6,352 x 2 bytes each) more after the forward
  EXPECT_EQ(keep.memory.after_forward.value - drop.memory.after_forward.value >= 2u * 8 * 6352 * 2, true);
}

// The llama-3-8b decoder layer: 4096 x 4096 (q, o) + 2 x 1024 x 4096 (k, v) + 3 x 14336 x 4096 (gate, up, down)
// + 2 x 4096 (norms) = 218,112,000 parameters; gathered in bf16 that is 436,224,000 bytes (416.0 MiB), and the
// persistent per-rank states are 16 B x P / W (fp32 shard, fp32 gradient, two fp32 Adam moments), all dims
// divisible by 8 so nothing is padded.
TEST(FsdpSim, Llama3_8bLayerAndPersistentStatesPerRank) {
  const Estimate e = run(testing::scenario_of("llama-3-8b", {{"gpus", "8xh100-80gb"}, {"sharding", "fsdp2"},
                                                             {"checkpointing", "selective"}, {"batch", "2"},
                                                             {"seq", "8192"}}));
  ASSERT_TRUE(e.fsdp.has_value());
  const FsdpFigures& f = *e.fsdp;
  EXPECT_EQ(f.units[1].params, 218112000u);
  EXPECT_EQ(f.units[1].shard_numel * 8 * 2, 436224000u);
  const uint64_t P = 8030261248u;
  EXPECT_EQ(f.sharded_params.value + f.sharded_grads.value + f.optimizer_state.value, 16 * P / 8);
  EXPECT_EQ(f.padding_elems, 0u);
  ASSERT_TRUE(e.device.has_value());
}

// The setup of rank 0 of 8 for Llama-3-8B cut to 4 layers under bf16 autocast (float32 parameters), allocation for
// allocation, as validate/measured/h200_hf_dist_fsdp2x8_llama3_4layers_sdpa_b2_t2048_bf16amp.json recorded it (a
// fake process group on an H200) and as fsdp2_prepare_model's fully_shard calls make it: each decoder layer's
// parameters moved to the device whole (post-order module walk: q, k, v, o, gate, up, down, the two norms), then
// each one's padded shard (rows / 8: 512 x 4096, 128 x 4096, ..., 1792 x 4096, 512 x 14336, 512); then the
// embedding, its shard; the tail (norm, lm_head), its shards; the root moves the two rotary buffers last. And the
// reserved memory when accelerate's prepare returns: 6,041,894,912 B measured.
TEST(FsdpLoad, FullyShardMovesEachUnitWholeThenShardsItAsMeasured) {
  const Estimate e = run(testing::scenario_of(
      "llama-3-8b", {{"overrides", "num_hidden_layers=4"}, {"batch", "2"}, {"seq", "2048"}, {"dp", "8"},
                     {"sharding", "fsdp2"}, {"precision", "bf16-amp"}, {"torch", "2.11"}}));
  const uint64_t H = 4096, KV = 1024, F = 14336, V = 128256, W = 8;
  std::vector<uint64_t> want;
  for (int l = 0; l < 4; ++l) {
    for (uint64_t x : {H * H, KV * H, KV * H, H * H, F * H, F * H, H * F, H, H}) want.push_back(4 * x);
    for (uint64_t x : {H / W * H, KV / W * H, KV / W * H, H / W * H, F / W * H, F / W * H, H / W * F, H / W, H / W}) {
      want.push_back(4 * x);
    }
  }
  const uint64_t inv_freq = 128 / 2;  // head_dim / 2 float32 elements, and original_inv_freq alike
  for (uint64_t x : {V * H, V / W * H, H, V * H, H / W, V / W * H, inv_freq, inv_freq}) want.push_back(4 * x);
  const testing::SetupAllocs got = testing::setup_allocs(e);
  EXPECT_EQ(got.bytes, want);
  EXPECT_EQ(got.reserved, 6041894912u);
}

// Gradient accumulation: accelerate's no_sync sets requires_gradient_sync False for every micro-batch but the last,
// so the first backward reduce-scatters nothing and leaves every unsharded bf16 .grad alive (2 bytes x all 229,824
// parameters: 64,064 + 2 x 50,816 + 64 + 64,064) into the second micro-batch, whose backward adds into them and
// reduce-scatters each unit once.
TEST(FsdpSim, NoSyncMicroBatchKeepsUnshardedGradients) {
  const Estimate e = run(tiny({{"grad_accum", "4"}}));
  size_t rs[3] = {0, 0, 0};
  LiveBytes live;
  bool checked = false;
  const size_t gk = static_cast<size_t>(Category::kGradients);
  for (const Event& ev : e.sim->timeline.events) {
    if (!checked && ev.step == 2 && ev.micro == 2) {
      EXPECT_EQ(live.by_category[gk].value, 2u * 229824);
      checked = true;
    }
    apply(live, ev);
    if (ev.kind == Event::kAlloc && ev.step == 2 && std::string_view(ev.label.what).find("reduce-scatter input") == 5) {  // "FSDP reduce-scatter input..."
      ++rs[ev.micro];
    }
  }
  EXPECT_TRUE(checked);
  EXPECT_EQ(rs[1], 0u);
  EXPECT_EQ(rs[2], 4u);  // the embedding, two layers, the tail
}

TEST(FsdpRefusals, WhatIsNotSimulated) {
  const auto refused = [](std::initializer_list<std::pair<const char*, std::string>> more) {
    EXPECT_THROW(run(tiny(more)), Error);
  };
  // (LoRA is simulated: fsdp_lora_test.cc; QLoRA's 4-bit base is refused there)
  refused({{"precision", "fp16-amp"}});
  refused({{"checkpointing", "full"}, {"checkpoint_reentrant", "true"}});
  refused({{"optimizer", "sgd"}});
  refused({{"loss", "chunked"}});
  refused({{"torch", "2.5"}});
  refused({{"bucket_cap_mb", "25"}});
  // another family's program has no unit hooks
  Scenario g = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"dp", "8"}, {"sharding", "fsdp2"}});
  EXPECT_THROW(run(g), Error);
  // the setting needs fsdp2
  Scenario d = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"dp", "8"}, {"reshard_after_forward", "false"}});
  EXPECT_THROW(run(d), Error);
  // fsdp1: simulated too (fsdp1_test.cc), with its own figures
  Scenario f1 = tiny();
  set_field(f1, "sharding", "fsdp1");
  EXPECT_TRUE(run(f1).fsdp1.has_value());
}

}  // namespace
}  // namespace trainmem
