// torchtitan v0.2.0's FSDP2 policy on a pipeline rank (fsdp.h fsdp_torchtitan_pp_options / fsdp_stage_units): the
// units and their shards, checked against sizes computed by hand from the source's rules; then the simulated
// composition (--pp P --dp D --sharding fsdp2): what it gathers, accumulates and reduce-scatters per step, its
// sharded states, its dp = 1 invariant and what it still refuses; under interleaved-1f1b, one FSDP root per stage
// module the rank holds (PpFsdpInterleaved).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

// llama8 over --pp 2 with 2 stages per rank (4 stages: torchtitan's split of 10 over 4, as pp_stage_split(4, 8)),
// --dp 8, 4 micro-batches, --precision fp32
TrainSetup interleaved_setup(uint64_t dp) {
  TrainSetup s = pp_fsdp_setup(dp);
  s.pp_schedule = PpSchedule::kInterleaved1f1b;
  s.pp_virtual_stages = 2;
  return s;
}

// The stage's parameters by hand (kLayer, kEmbed, kTail above).
uint64_t stage_params(const PpStagePart& p) {
  return kLayer * p.layers() + (p.embeddings ? kEmbed : 0) + (p.head ? kTail : 0);
}

// The FSDP units of a rank's stages: the embedding's, one a layer, the tail's
uint64_t units_of(const std::vector<PpStagePart>& stages) {
  uint64_t n = 0;
  for (const PpStagePart& p : stages) n += p.layers() + (p.embeddings ? 1 : 0) + (p.head ? 1 : 0);
  return n;
}

// `check(rank, that rank's estimate, its stages, their parameters by hand)` for both ranks of setup(8): stage r of 2
// under pp_fsdp_setup, stages r and r + 2 of 4 under interleaved_setup
template <typename F>
void each_rank_at_dp8(F check, TrainSetup (*setup)(uint64_t) = pp_fsdp_setup) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  const uint64_t v = std::max<uint64_t>(setup(8).pp_virtual_stages, 1);  // 0: unset, one stage per rank
  const std::vector<PpStagePart> parts = pp_stage_split(2 * v, m.layers);
  for (uint64_t r = 0; r < 2; ++r) {
    TrainSetup s = setup(8);
    s.rank = r;
    std::vector<PpStagePart> mine;
    uint64_t P = 0;
    for (uint64_t k = 0; k < v; ++k) {
      mine.push_back(parts[r + 2 * k]);
      P += stage_params(mine.back());
    }
    check(r, estimate(m, inv, s, SimOptions{}), mine, P);
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

// Step 2 of rank r's estimate (the first also runs shape inference): each of its `units` all-gathered once, in bf16
// (2 B x its P parameters), kept unsharded, its gradients accumulated once in fp32 (4 B x P) and reduce-scattered
// once, in fp32 (4 B x P)
void expect_gathered_once_per_step(const Estimate& e, uint64_t r, uint64_t units, uint64_t P) {
  const StepBytes b = step_bytes(e, 2);
  EXPECT_EQ(b.gathers, units) << "rank " << r;
  EXPECT_EQ(b.gathered, 2 * P) << "rank " << r;
  EXPECT_EQ(b.unsharded, 2 * P) << "rank " << r;
  EXPECT_EQ(b.accumulated, 4 * P) << "rank " << r;
  EXPECT_EQ(b.reduce_scatters, units) << "rank " << r;
  EXPECT_EQ(b.reduced, 4 * P) << "rank " << r;
}

// reshard_after_forward False and stage.py's no-sync backwards: in a step (the second: the first also runs shape
// inference) each unit is all-gathered once, by its first forward, in bf16 (2 B x the stage's parameters), and
// stays unsharded through the 4 micro-batches; each parameter's gradient is converted once to an fp32
// unsharded_accumulated_grad (4 B x the stage's parameters) and each unit reduce-scattered once after the last
// backward, in fp32 (4 B x the stage's parameters). Per micro-batch resharding would gather 2 x 4 times as much.
TEST(PpFsdp, GathersOncePerStepAndReduceScattersOnceAfterTheLastMicroBatch) {
  each_rank_at_dp8([](uint64_t r, const Estimate& e, const std::vector<PpStagePart>& stages, uint64_t P) {
    const uint64_t units = units_of(stages);
    expect_gathered_once_per_step(e, r, units, P);
    ASSERT_TRUE(e.fsdp);
    EXPECT_TRUE(e.fsdp->torchtitan_pp);
    EXPECT_EQ(e.fsdp->units.size(), units);
  });
}

// The rank's model states are its stage's shards: fp32 parameters and gradients, 4 B x P / 8 each; AdamW's two
// fp32 moments, 8 B x P / 8 (every dim 0 divides by 8: no padding).
TEST(PpFsdp, ShardedStatesAreTheStagesParametersOverTheDataParallelRanks) {
  each_rank_at_dp8([](uint64_t, const Estimate& e, const std::vector<PpStagePart>&, uint64_t P) {
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
// --dp 1 --sharding fsdp2 is the plain pipeline, byte for byte, under 1F1B and interleaved-1f1b alike.
TEST(PpFsdp, OneDataParallelRankIsThePlainPipeline) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  for (TrainSetup (*setup)(uint64_t) : {pp_fsdp_setup, interleaved_setup}) {
    TrainSetup plain = setup(1);
    plain.sharding = Sharding::kDdp;
    const Estimate a = estimate(m, inv, plain, SimOptions{});
    const Estimate b = estimate(m, inv, setup(1), SimOptions{});
    EXPECT_FALSE(b.fsdp);
    EXPECT_EQ(a.memory.peak_allocated, b.memory.peak_allocated);
    EXPECT_EQ(a.memory.peak_reserved, b.memory.peak_reserved);
    EXPECT_EQ(a.sim->timeline.events.size(), b.sim->timeline.events.size());
    ASSERT_TRUE(a.pp && b.pp);
    for (size_t r = 0; r < a.pp->rows.size(); ++r) EXPECT_EQ(a.pp->rows[r].peak_reserved, b.pp->rows[r].peak_reserved);
  }
}

// What stays refused, each with its reason: other shardings under a pipeline, more FSDP roots (stage modules) per
// rank than the allocator has streams for, torchtitan's training.dtype bfloat16, a reshard_after_forward other than
// the default.
TEST(PpFsdp, RefusesWhatItDoesNotSimulate) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  for (Sharding sh : {Sharding::kDdp, Sharding::kZero1, Sharding::kZero2, Sharding::kZero3, Sharding::kFsdp1}) {
    TrainSetup s = pp_fsdp_setup(8);
    s.sharding = sh;
    const std::string why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
    // DDP: torchtitan itself refuses it beside a pipeline; the others are not simulated
    EXPECT_NE(why.find(sh == Sharding::kDdp ? "DDP has not supported > 1D parallelism" : "under a pipeline are not simulated"),
              std::string::npos) << why;
  }
  TrainSetup s = pp_fsdp_setup(8);
  s.pp_schedule = PpSchedule::kInterleaved1f1b;
  s.pp_virtual_stages = kFsdpExtraRoots + 2;  // 9 stages per rank: 18 stages of llama8's 10 layers and ends
  s.micro_batches = 18;
  std::string why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
  EXPECT_NE(why.find("9 with --sharding fsdp2: expected at most 8"), std::string::npos) << why;
  s = pp_fsdp_setup(8);
  s.precision = Precision::kBf16;
  why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
  EXPECT_NE(why.find("use --precision fp32"), std::string::npos) << why;
  s = pp_fsdp_setup(8);
  s.reshard_after_forward = true;
  why = testing::error_of([&] { estimate(m, inv, s, SimOptions{}); });
  EXPECT_NE(why.find("default policy"), std::string::npos) << why;
}


// --- interleaved-1f1b: torchtitan's pipeline_llm runs parallelize_fn (apply_fsdp) on each model part, so each stage
// module a rank holds is its own FSDP root (its own units, comm context and streams), and PyTorch 2.9's
// PipelineScheduleMulti._step_microbatches gives each stage its manual post-backward after that stage's n-th
// backward (backward_counter[stage_index] == n_microbatches) ---

// rank r holds stages r and r + 2 (torchtitan's "loop" style): two roots, each with exactly its stage's units
TEST(PpFsdpInterleaved, EachStageModuleIsItsOwnRoot) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  const std::vector<PpStagePart> all = pp_stage_split(4, m.layers);
  for (uint64_t r = 0; r < 2; ++r) {
    const std::vector<PpStagePart> mine = {all[r], all[r + 2]};
    const Inventory rank_inv = pp_stage_inventory(inv, mine);
    const std::vector<std::vector<FsdpUnit>> roots = fsdp_stage_roots(rank_inv, mine, fsdp_torchtitan_pp_options(8));
    ASSERT_EQ(roots.size(), 2u);
    for (size_t j = 0; j < 2; ++j) {
      const PpStagePart& p = mine[j];
      ASSERT_EQ(roots[j].size(), p.layers() + (p.embeddings ? 1 : 0) + (p.head ? 1 : 0)) << "rank " << r;
      uint64_t params = 0;
      for (const FsdpUnit& u : roots[j]) {
        params += u.params;
        if (u.kind == FsdpUnit::kLayer) {
          EXPECT_GE(static_cast<uint64_t>(u.layer), p.layer_begin);
          EXPECT_LT(static_cast<uint64_t>(u.layer), p.layer_end);
        }
      }
      EXPECT_EQ(params, stage_params(p)) << "rank " << r << " root " << j;
    }
  }
}

// Each stage's units are gathered once per step, by its first forward, and reduce-scattered once: per rank
// 2 B x (both stages' parameters) gathered in bf16, 4 B x accumulated unsharded in fp32, 4 B x reduce-scattered.
// Rank 0's order (ScheduleInterleaved1F1B, 4 micro-batches over 2 ranks, by hand: warmup (2-1)x2 + 2x(2-1-0) = 4):
//   F0.0 F0.1 F2.0 F2.1 | F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 | B2.2 B2.3 B0.2 B0.3
// so stage 2 (the second root) reduce-scatters in B2.3, before stage 0's backwards of micro-batches 2 and 3; stage 0
// in B0.3. (One post-backward after the rank's last backward would reduce-scatter both in B0.3.)
TEST(PpFsdpInterleaved, EachStageReduceScattersAfterItsOwnLastBackward) {
  each_rank_at_dp8([](uint64_t r, const Estimate& e, const std::vector<PpStagePart>& stages, uint64_t P) {
    expect_gathered_once_per_step(e, r, units_of(stages), P);
    ASSERT_TRUE(e.fsdp);
    EXPECT_EQ(e.fsdp->root_begin.size(), 2u);
    const PpStagePart& first = stages[0];
    const PpStagePart& second = stages[1];
    if (r != 0) return;
    // rank 0: where each root's reduce-scatters fall in step 2 (a layer's label carries its layer index)
    auto in = [](const PpStagePart& p, int32_t layer) {
      return layer >= 0 && static_cast<uint64_t>(layer) >= p.layer_begin && static_cast<uint64_t>(layer) < p.layer_end;
    };
    size_t last_rs_second = 0, first_rs_first = SIZE_MAX, first_b02 = SIZE_MAX;
    const auto& ev = e.sim->timeline.events;
    for (size_t i = 0; i < ev.size(); ++i) {
      if (ev[i].step != 2) continue;
      const bool rs = ev[i].kind == Event::kAlloc && std::string_view(ev[i].label.what).starts_with("FSDP reduce-scatter input");
      if (rs && in(second, ev[i].label.layer)) {
        EXPECT_EQ(ev[i].micro, 4u);  // in B2.3
        last_rs_second = i;
      }
      if (rs && in(first, ev[i].label.layer)) {
        EXPECT_EQ(ev[i].micro, 4u);  // in B0.3
        first_rs_first = std::min(first_rs_first, i);
      }
      if (ev[i].phase == Phase::kBackward && ev[i].micro == 3 && in(first, ev[i].label.layer)) first_b02 = std::min(first_b02, i);
    }
    EXPECT_LT(last_rs_second, first_b02);
    EXPECT_LT(first_b02, first_rs_first);
  }, interleaved_setup);
}

// Each root allocates on streams of its own (FSDPCommContext.lazy_init per root): the second root's all-gather
// outputs on stream 7 (the first after the 7 named ones) and its reduce-scatter outputs on stream 8; the first
// root's on the named FSDP2 streams.
TEST(PpFsdpInterleaved, EachRootHasItsOwnStreams) {
  EXPECT_EQ(static_cast<int>(fsdp2_root_stream(Stream::kFsdpAllGatherCopyIn, 1)), 7);
  EXPECT_EQ(static_cast<int>(fsdp2_root_stream(Stream::kFsdpReduceScatter, 1)), 8);
  EXPECT_EQ(static_cast<int>(fsdp2_root_stream(Stream::kFsdpAllReduce, 1)), 9);
  EXPECT_EQ(fsdp2_root_stream(Stream::kFsdpReduceScatter, 0), Stream::kFsdpReduceScatter);
  const ModelSpec m = llama8();
  const std::vector<PpStagePart> all = pp_stage_split(4, m.layers);
  const Estimate e = estimate(m, build_inventory(m), interleaved_setup(8), SimOptions{});
  size_t gathers[2] = {0, 0}, outputs[2] = {0, 0};
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc || ev.label.layer < 0) continue;
    const size_t root = static_cast<uint64_t>(ev.label.layer) >= all[2].layer_begin ? 1 : 0;
    const std::string_view w = ev.label.what;
    if (w.starts_with("FSDP all-gather output")) {
      ++gathers[root];
      EXPECT_EQ(static_cast<int>(ev.stream), root ? 7 : static_cast<int>(Stream::kFsdpAllGatherCopyIn)) << w;
    }
    if (w.starts_with("FSDP reduce-scatter output") || w.starts_with("FSDP sharded gradients")) {
      ++outputs[root];
      EXPECT_EQ(static_cast<int>(ev.stream), root ? 8 : static_cast<int>(Stream::kFsdpReduceScatter)) << w;
    }
  }
  EXPECT_GT(gathers[0], 0u);
  EXPECT_GT(gathers[1], 0u);
  EXPECT_GT(outputs[0], 0u);
  EXPECT_GT(outputs[1], 0u);
}

// HSDP under the interleaved pipeline (--dp 16 --dp-shard 8): each root shards over the 8 ranks of its shard group
// (not the 16 data-parallel ranks): rank 0's sharded fp32 parameters are 4 B x (stages 0 and 2's parameters) / 8,
// and each unit is still gathered once and reduce-scattered once per step.
TEST(PpFsdpInterleaved, HsdpShardsEachRootOverTheShardGroup) {
  const ModelSpec m = llama8();
  const std::vector<PpStagePart> all = pp_stage_split(4, m.layers);
  TrainSetup s = interleaved_setup(16);
  s.dp_shard = 8;
  const Estimate e = estimate(m, build_inventory(m), s, SimOptions{});
  ASSERT_TRUE(e.fsdp);
  EXPECT_EQ(e.fsdp->options.replicate, 2u);
  EXPECT_EQ(e.fsdp->options.ranks, 8u);
  EXPECT_EQ(e.fsdp->root_begin.size(), 2u);
  const uint64_t P = stage_params(all[0]) + stage_params(all[2]);
  EXPECT_EQ(e.fsdp->sharded_params.value, 4 * P / 8);
  expect_gathered_once_per_step(e, 0, units_of({all[0], all[2]}), P);
}

// The rank's states are its stages': interleaved rank r (stages r and r + 2 of 4) holds exactly what 1F1B ranks r and
// r + 2 of --pp 4 hold between them (the same torchtitan split of 4 stages), shards, moments and gathered bytes.
TEST(PpFsdpInterleaved, TwoStagesStatesAreTheTwo1f1bRanksStates) {
  const ModelSpec m = llama8();
  const Inventory inv = build_inventory(m);
  for (uint64_t r = 0; r < 2; ++r) {
    TrainSetup s = interleaved_setup(8);
    s.rank = r;
    const Estimate e = estimate(m, inv, s, SimOptions{});
    TrainSetup one = pp_fsdp_setup(8);
    one.pp = 4;
    one.rank = r;
    const Estimate a = estimate(m, inv, one, SimOptions{});
    one.rank = r + 2;
    const Estimate b = estimate(m, inv, one, SimOptions{});
    EXPECT_EQ(e.state.parameters, a.state.parameters + b.state.parameters);
    EXPECT_EQ(e.fsdp->sharded_params, a.fsdp->sharded_params + b.fsdp->sharded_params);
    EXPECT_EQ(e.fsdp->sharded_grads, a.fsdp->sharded_grads + b.fsdp->sharded_grads);
    EXPECT_EQ(e.state.optimizer_moments, a.state.optimizer_moments + b.state.optimizer_moments);
    EXPECT_EQ(e.fsdp->units.size(), a.fsdp->units.size() + b.fsdp->units.size());
    const StepBytes x = step_bytes(e, 2), y = step_bytes(a, 2), z = step_bytes(b, 2);
    EXPECT_EQ(x.gathered, y.gathered + z.gathered);
    EXPECT_EQ(x.accumulated, y.accumulated + z.accumulated);
    EXPECT_EQ(x.reduced, y.reduced + z.reduced);
  }
}

// At the moment rank 0 holds the most micro-batches in flight (F0.2, by hand from the order above: 3 of stage 0
// and 2 of stage 2), both stages' units are gathered (reshard_after_forward False; no post-backward yet in the
// step): 2 B x both stages' parameters unsharded, and no accumulated gradient yet (step 1's were reduce-scattered).
TEST(PpFsdpInterleaved, BothStagesAreGatheredWhileTheMostMicroBatchesAreInFlight) {
  const ModelSpec m = llama8();
  const std::vector<PpStagePart> all = pp_stage_split(4, m.layers);
  const Estimate e = estimate(m, build_inventory(m), interleaved_setup(8), SimOptions{});
  const uint64_t P = stage_params(all[0]) + stage_params(all[2]);
  int64_t unsharded = 0, accumulated = 0;
  const auto& ev = e.sim->timeline.events;
  const size_t at = e.sim->after_forward.event;
  ASSERT_EQ(e.sim->after_forward.step, 2u);
  ASSERT_EQ(e.sim->after_forward.micro, 3u);  // micro-batch 2 (1-based 3) of stage 0
  for (size_t i = 0; i < at && i < ev.size(); ++i) {
    const std::string_view w = ev[i].label.what;
    const int64_t sign = ev[i].kind == Event::kAlloc ? 1 : ev[i].kind == Event::kFree ? -1 : 0;
    // (the unsharded parameters' storages; their .grad, named after them, are gradients)
    if (w.ends_with("(FSDP unsharded)") && ev[i].category == Category::kFsdpBuffers) {
      unsharded += sign * static_cast<int64_t>(ev[i].bytes.value);
    }
    if (w.ends_with("(FSDP unsharded_accumulated_grad)")) accumulated += sign * static_cast<int64_t>(ev[i].bytes.value);
  }
  EXPECT_EQ(unsharded, static_cast<int64_t>(2 * P));
  EXPECT_EQ(accumulated, 0);
}

// The brief's 70B run, --gpus 64xh100-80gb --tp 8 --pp 4 --pp-schedule interleaved-1f1b --pp-virtual-stages 2 (dp 2),
// rank 0, by hand: torchtitan's split of 80 layers + 2 over 8 stages (generate_llm_fqn_per_model_part: 82 // 8 = 10
// per stage, the 82 % 8 = 2 extra to stages 0 and 1): stage 0 the embeddings and layers 0-9, stage 4 layers 41-50;
// with the per-layer and embedding counts of Llama70bTp8Pp4Dp8FirstStageByHand: 1,050,673,152 + 20 x 106,971,136 =
// 3,190,095,872 parameters. Sharded fp32 over 2 ranks: 4 B x 3,190,095,872 / 2 = 6,380,191,744; gathered once per
// step in bf16: 2 B x 3,190,095,872 = 6,380,191,744; accumulated in fp32: 4 B x 3,190,095,872 = 12,760,383,488.
TEST(PpFsdpInterleaved, Llama70bTp8Pp4V2Dp2FirstRankByHand) {
  const Estimate e = testing::run(testing::scenario_of(
      "llama-3.1-70b", {{"gpus", "64xh100-80gb"}, {"tp", "8"}, {"pp", "4"}, {"sharding", "fsdp2"}, {"precision", "fp32"},
                        {"pp_schedule", "interleaved-1f1b"}, {"pp_virtual_stages", "2"}, {"micro_batches", "8"},
                        {"batch", "1"}, {"seq", "8192"}, {"checkpointing", "selective"}, {"rank", "0"}}));
  EXPECT_EQ(e.state.parameters.value, 3190095872u);
  ASSERT_TRUE(e.fsdp);
  EXPECT_EQ(e.fsdp->options.ranks, 2u);
  EXPECT_EQ(e.fsdp->root_begin.size(), 2u);
  EXPECT_EQ(e.fsdp->units.size(), 21u);  // the embedding and 10 layers; 10 layers
  EXPECT_EQ(e.fsdp->root_begin[1], 11u);
  EXPECT_EQ(e.fsdp->sharded_params.value, 6380191744u);
  const StepBytes b = step_bytes(e, 2);
  EXPECT_EQ(b.gathered, 6380191744u);
  EXPECT_EQ(b.accumulated, 12760383488u);
  EXPECT_EQ(b.reduced, 12760383488u);
}

}  // namespace
}  // namespace trainmem
