// torchtitan v0.2.0's FSDP2 policy on a pipeline rank (fsdp.h fsdp_torchtitan_pp_options / fsdp_stage_units): the
// units and their shards, checked against sizes computed by hand from the source's rules; then the simulated
// composition (--pp P --dp D --sharding fsdp2): what it gathers, accumulates and reduce-scatters per step, its
// sharded states, its dp = 1 invariant and what it still refuses.
#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "test_util.h"
#include "trainmem/dtype.h"
#include "trainmem/error.h"
#include "trainmem/fsdp.h"
#include "trainmem/pp.h"
#include "trainmem/timeline.h"

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

// The composition as simulated: llama8 over --pp 2, --dp 8, 4 micro-batches of 1F1B, --precision fp32
// (torchtitan's training.dtype float32).
TrainSetup pp_fsdp_setup(uint64_t dp) {
  TrainSetup s = testing::train_setup(1, 32, Precision::kFp32);
  s.pp = 2;
  s.micro_batches = 4;
  s.dp = dp;
  s.sharding = Sharding::kFsdp2;
  return s;
}

// The stage's parameters by hand (kLayer, kEmbed, kTail above).
uint64_t stage_params(const PpStagePart& p) {
  return kLayer * p.layers() + (p.embeddings ? kEmbed : 0) + (p.head ? kTail : 0);
}

// `check(rank, that rank's estimate, its stage, the stage's parameters by hand)` for both ranks of pp_fsdp_setup(8)
template <typename F>
void each_rank_at_dp8(F check) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  const std::vector<PpStagePart> parts = pp_stage_split(2, m.layers);
  for (uint64_t r = 0; r < 2; ++r) {
    TrainSetup s = pp_fsdp_setup(8);
    s.rank = r;
    check(r, estimate(m, inv, s, SimOptions{}), parts[r], stage_params(parts[r]));
  }
}

struct StepBytes {
  uint64_t gathers = 0, gathered = 0;        // "FSDP all-gather output": count, bytes
  uint64_t unsharded = 0;                    // the unsharded parameters' storage, (re)allocated
  uint64_t accumulated = 0;                  // FSDPParam.unsharded_accumulated_grad
  uint64_t reduce_scatters = 0, reduced = 0;  // "FSDP reduce-scatter input": count, bytes
};
StepBytes step_bytes(const Estimate& e, uint32_t step) {
  StepBytes b;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc || ev.step != step) continue;
    const std::string_view w = ev.label.what;
    if (w.starts_with("FSDP all-gather output")) {
      ++b.gathers;
      b.gathered += ev.bytes.value;
    }
    if (w.ends_with("(FSDP unsharded)")) b.unsharded += ev.bytes.value;
    if (w.ends_with("(FSDP unsharded_accumulated_grad)")) b.accumulated += ev.bytes.value;
    if (w.starts_with("FSDP reduce-scatter input")) {
      ++b.reduce_scatters;
      b.reduced += ev.bytes.value;
    }
  }
  return b;
}

// reshard_after_forward False and stage.py's no-sync backwards: in a step (the second: the first also runs shape
// inference) each unit is all-gathered once, by its first forward, in bf16 (2 B x the stage's parameters), and
// stays unsharded through the 4 micro-batches; each parameter's gradient is converted once to an fp32
// unsharded_accumulated_grad (4 B x the stage's parameters) and each unit reduce-scattered once after the last
// backward, in fp32 (4 B x the stage's parameters). Per micro-batch resharding would gather 2 x 4 times as much.
TEST(PpFsdp, GathersOncePerStepAndReduceScattersOnceAfterTheLastMicroBatch) {
  each_rank_at_dp8([](uint64_t r, const Estimate& e, const PpStagePart& part, uint64_t P) {
    const uint64_t units = part.layers() + (part.embeddings ? 1 : 0) + (part.head ? 1 : 0);
    const StepBytes b = step_bytes(e, 2);
    EXPECT_EQ(b.gathers, units) << "rank " << r;
    EXPECT_EQ(b.gathered, 2 * P) << "rank " << r;
    EXPECT_EQ(b.unsharded, 2 * P) << "rank " << r;
    EXPECT_EQ(b.accumulated, 4 * P) << "rank " << r;
    EXPECT_EQ(b.reduce_scatters, units) << "rank " << r;
    EXPECT_EQ(b.reduced, 4 * P) << "rank " << r;
    ASSERT_TRUE(e.fsdp);
    EXPECT_TRUE(e.fsdp->torchtitan_pp);
    EXPECT_EQ(e.fsdp->units.size(), units);
  });
}

// The rank's model states are its stage's shards: fp32 parameters and gradients, 4 B x P / 8 each; AdamW's two
// fp32 moments, 8 B x P / 8 (every dim 0 divides by 8: no padding).
TEST(PpFsdp, ShardedStatesAreTheStagesParametersOverTheDataParallelRanks) {
  each_rank_at_dp8([](uint64_t, const Estimate& e, const PpStagePart&, uint64_t P) {
    EXPECT_EQ(e.state.parameters.value, P);
    EXPECT_EQ(e.fsdp->sharded_params.value, 4 * P / 8);
    EXPECT_EQ(e.fsdp->sharded_grads.value, 4 * P / 8);
    EXPECT_EQ(e.state.weights.value, 4 * P / 8);
    EXPECT_EQ(e.state.optimizer_moments.value, 8 * P / 8);
    EXPECT_EQ(e.fsdp->padding_elems, 0u);
  });
}

// The README's 70B run, --gpus 256xh100-80gb --tp 8 --pp 4 (dp 8), rank 0, by hand from llama-3.1-70b's config
// (hidden 8192, intermediate 28672, 64 heads of 128 with 8 KV heads, vocab 128256) and transformers' tp_plan at 8:
//   a layer: q, o 1024 x 8192 = 8,388,608 each; k, v 128 x 8192 = 1,048,576 each; gate, up, down 3584 x 8192 =
//            29,360,128 each; two norms 8192 each: 106,971,136
//   embed_tokens (replicated under tp_plan): 128256 x 8192 = 1,050,673,152
//   stage 0 (torchtitan's split of 80 layers + 2 over 4: the embeddings and layers 0-19): 3,190,095,872
// sharded fp32 parameters 4 B x 3,190,095,872 / 8 = 1,595,047,936; gathered once per step in bf16
// 2 B x 3,190,095,872 = 6,380,191,744; accumulated unsharded in fp32 4 B x 3,190,095,872 = 12,760,383,488.
TEST(PpFsdp, Llama70bTp8Pp4Dp8FirstStageByHand) {
  const Estimate e = testing::run(testing::scenario_of(
      "llama-3.1-70b", {{"gpus", "256xh100-80gb"}, {"tp", "8"}, {"pp", "4"}, {"sharding", "fsdp2"}, {"precision", "fp32"},
                        {"micro_batches", "8"}, {"batch", "1"}, {"seq", "8192"}, {"checkpointing", "selective"},
                        {"rank", "0"}}));
  EXPECT_EQ(e.state.parameters.value, 3190095872u);
  ASSERT_TRUE(e.fsdp);
  EXPECT_EQ(e.fsdp->options.ranks, 8u);
  EXPECT_EQ(e.fsdp->sharded_params.value, 1595047936u);
  const StepBytes b = step_bytes(e, 2);
  EXPECT_EQ(b.gathered, 6380191744u);
  EXPECT_EQ(b.accumulated, 12760383488u);
  EXPECT_EQ(b.reduced, 12760383488u);
}

// With one data-parallel rank torchtitan applies no FSDP at all (parallel_dims.fsdp_enabled is dp_shard > 1):
// --dp 1 --sharding fsdp2 is the plain pipeline, byte for byte.
TEST(PpFsdp, OneDataParallelRankIsThePlainPipeline) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  TrainSetup plain = pp_fsdp_setup(1);
  plain.sharding = Sharding::kDdp;
  const Estimate a = estimate(m, inv, plain, SimOptions{});
  const Estimate b = estimate(m, inv, pp_fsdp_setup(1), SimOptions{});
  EXPECT_FALSE(b.fsdp);
  EXPECT_EQ(a.memory.peak_allocated, b.memory.peak_allocated);
  EXPECT_EQ(a.memory.peak_reserved, b.memory.peak_reserved);
  EXPECT_EQ(a.sim->timeline.events.size(), b.sim->timeline.events.size());
  ASSERT_TRUE(a.pp && b.pp);
  for (size_t r = 0; r < a.pp->rows.size(); ++r) EXPECT_EQ(a.pp->rows[r].peak_reserved, b.pp->rows[r].peak_reserved);
}

// What stays refused, each with its reason: other shardings under a pipeline, FSDP2 over several stages per rank
// (interleaved-1f1b), torchtitan's training.dtype bfloat16, a reshard_after_forward other than the default.
TEST(PpFsdp, RefusesWhatItDoesNotSimulate) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  for (Sharding sh : {Sharding::kDdp, Sharding::kZero1, Sharding::kZero2, Sharding::kZero3, Sharding::kFsdp1}) {
    TrainSetup s = pp_fsdp_setup(8);
    s.sharding = sh;
    const std::string why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
    EXPECT_NE(why.find("under a pipeline are not simulated"), std::string::npos) << why;
  }
  TrainSetup s = pp_fsdp_setup(8);
  s.pp_schedule = PpSchedule::kInterleaved1f1b;
  s.pp_virtual_stages = 2;
  std::string why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
  EXPECT_NE(why.find("interleaved-1f1b"), std::string::npos) << why;
  s = pp_fsdp_setup(8);
  s.precision = Precision::kBf16;
  why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
  EXPECT_NE(why.find("use --precision fp32"), std::string::npos) << why;
  s = pp_fsdp_setup(8);
  s.reshard_after_forward = true;
  why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
  EXPECT_NE(why.find("default policy"), std::string::npos) << why;
}

}  // namespace
}  // namespace trainmem
