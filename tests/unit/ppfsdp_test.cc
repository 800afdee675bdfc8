// torchtitan v0.2.0's FSDP2 policy on a pipeline rank (fsdp.h fsdp_torchtitan_pp_options / fsdp_stage_units): the
// units and their shards, checked against sizes computed by hand from the source's rules. The simulator does not
// run the composition yet; check_pipeline refuses it (the last test).
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/dtype.h"
#include "trainmem/error.h"
#include "trainmem/fsdp.h"
#include "trainmem/pp.h"

namespace trainmem {
namespace {

// A llama of 8 layers, hidden 64, 4 heads of 16 with 2 KV heads, intermediate 160, vocab 96 (untied). By hand:
//   layer: q 64x64 = 4,096; k, v 32x64 = 2,048 each; o 4,096; gate, up 160x64 = 10,240 each; down 64x160 = 10,240;
//          two norms 64 each: 43,136
//   embed_tokens 96x64 = 6,144; [norm, lm_head] 64 + 6,144 = 6,208
// On 8 data-parallel ranks every dim 0 divides by 8 (64, 32, 160, 96): each shard is the unit's parameters / 8.
constexpr uint64_t kLayer = 43136, kEmbed = 6144, kTail = 6208;

ModelSpec llama8() {
  return testing::from_json(R"({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": false,
                                "num_hidden_layers": 8})");
}

// torchtitan apply_fsdp under PP: policy "default" -> reshard_after_forward = not pp_enabled = False;
// MixedPrecisionPolicy(param_dtype=bf16 (mixed_precision_param), reduce_dtype=fp32 (mixed_precision_reduce));
// training.dtype float32.
TEST(PpFsdp, TorchtitanPolicy) {
  const FsdpOptions o = fsdp_torchtitan_pp_options(8);
  EXPECT_TRUE(o.on);
  EXPECT_EQ(o.ranks, 8u);
  EXPECT_FALSE(o.reshard_after_forward);
  EXPECT_EQ(o.orig_dtype, DType::kF32);
  EXPECT_TRUE(o.mixed);
  EXPECT_EQ(o.param_dtype, DType::kBF16);
  EXPECT_EQ(o.reduce_dtype, DType::kF32);
  EXPECT_THROW(fsdp_torchtitan_pp_options(1), Error);
}

// --pp 4 over 8 layers (torchtitan's split counts the embeddings and the head as one layer each: 10 over 4 stages),
// --dp 8: each stage's units and, per stage, the bytes the policy implies:
//   sharded states: fp32 parameter + fp32 gradient + AdamW's two fp32 moments = 16 B x stage parameters / 8;
//   gathered parameters (reshard_after_forward False: kept from the first micro-batch's forward to the last
//   backward): bf16, 2 B x stage parameters; accumulated unsharded gradients (reduce dtype): 4 B x stage parameters.
TEST(PpFsdp, StageUnitsAndBytesByHand) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  const FsdpOptions o = fsdp_torchtitan_pp_options(8);
  const std::vector<PpStagePart> parts = pp_stage_split(4, m.layers);
  ASSERT_EQ(parts.size(), 4u);
  uint64_t layers_seen = 0;
  for (const PpStagePart& p : parts) {
    const Inventory stage = pp_stage_inventory(inv, {p});
    const std::vector<FsdpUnit> units = fsdp_stage_units(stage, {p}, o);
    ASSERT_EQ(units.size(), p.layers() + (p.embeddings ? 1 : 0) + (p.head ? 1 : 0));
    const uint64_t params = kLayer * p.layers() + (p.embeddings ? kEmbed : 0) + (p.head ? kTail : 0);
    uint64_t shard = 0, total = 0;
    for (const FsdpUnit& u : units) {
      shard += u.shard_numel;
      total += u.params;
      EXPECT_FALSE(u.reshard_after_forward) << u.name;
      if (u.kind == FsdpUnit::kLayer) EXPECT_EQ(u.shard_numel, kLayer / 8) << u.name;
    }
    if (p.embeddings) {
      EXPECT_EQ(units.front().name, "model.embed_tokens");
      EXPECT_EQ(units.front().shard_numel, kEmbed / 8);
    }
    if (p.head) {
      EXPECT_EQ(units.back().name, "[model.norm, lm_head]");
      EXPECT_EQ(units.back().shard_numel, kTail / 8);
    }
    EXPECT_EQ(total, params);
    EXPECT_EQ(16 * shard, 16 * params / 8);  // sharded states
    EXPECT_EQ(itemsize(o.param_dtype) * total, 2 * params);   // gathered once, bf16
    EXPECT_EQ(itemsize(o.reduce_dtype) * total, 4 * params);  // unsharded_accumulated_grad, fp32
    layers_seen += p.layers();
  }
  EXPECT_EQ(layers_seen, 8u);
  EXPECT_TRUE(parts.front().embeddings);
  EXPECT_TRUE(parts.back().head);
}

// A world that does not divide dim 0 pads each shard (torch.chunk, ceil): 3 ranks, the layer by hand:
// q 64 -> 22 rows x 64 = 1,408; k, v 32 -> 11 x 64 = 704 each; o 1,408; gate, up 160 -> 54 x 64 = 3,456 each;
// down 64 -> 22 x 160 = 3,520; norms 64 -> 22 each: 14,700
TEST(PpFsdp, PaddedShardsOnThreeRanks) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  const std::vector<PpStagePart> parts = pp_stage_split(4, m.layers);
  const PpStagePart& mid = parts[1];
  ASSERT_GT(mid.layers(), 0u);
  const std::vector<FsdpUnit> units = fsdp_stage_units(pp_stage_inventory(inv, {mid}), {mid}, fsdp_torchtitan_pp_options(3));
  ASSERT_EQ(units.size(), mid.layers());
  EXPECT_EQ(units[0].shard_numel, 14700u);
  EXPECT_EQ(units[0].name, "model.layers." + std::to_string(mid.layer_begin));
}

// Not simulated yet: the simulator refuses --dp above 1 under a pipeline, fsdp2 included.
TEST(PpFsdp, CompositionStillRefused) {
  const ModelSpec m = llama8();
  TrainSetup s = testing::train_setup(2, 32, Precision::kFp32);
  s.pp = 4;
  s.micro_batches = 8;
  s.dp = 8;
  s.sharding = Sharding::kFsdp2;
  const std::string why = testing::error_of([&] { estimate(m, build_inventory(m), s, SimOptions{}); });
  EXPECT_NE(why.find("fsdp2"), std::string::npos) << why;
}

}  // namespace
}  // namespace trainmem
