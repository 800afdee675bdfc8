// --dp N --sharding fsdp2 --lora ...: one rank of FSDP2 (fully_shard through accelerate's fsdp2_prepare_model) over
// a PEFT LoRA model (fsdp.h FsdpOptions::peft, fsdp_unit_buffers; src/sim/fsdp.cc). The figures are worked by hand
// from the source's rules (cited in src/core/fsdp.cc), and the unit layout and collective sizes of this very model
// were read from real code once: accelerate 1.15.0 + peft 0.21.0 + transformers 5.17.0 on torch 2.11 (one H200,
// a fake process group of world size 4, rank 0; validate/cuda/fsdp2_lora_probe.py prints them):
//   units: the root with 1 parameter ([256]: model.norm), model.embed_tokens, model.layers.0 and .1 (13 parameters,
//          4 of them trainable each), lm_head alone
//   bf16-amp (mixed_precision "bf16", an fp32 model): all-gathers of 256 (root), 256,000 (embedding, lm_head) and
//          732,672 (each layer) bfloat16 elements; per layer one reduce-scatter of 4 bfloat16 gradients of 7,168
//          elements, orig_dtype float32
//   bf16 (mixed_precision "no", a bf16 model, float32 adapters): each layer's all-gather is uint8, 1,479,680 bytes;
//          its reduce-scatter float32, 7,168 elements
//   no all-gather of the root in the backward; the embedding's all-gather again in layer 0's backward (prefetch)
// The model: llama, hidden 256, intermediate 688, 4 heads of 64, 2 KV heads, vocab 1000, 2 layers; LoRA r=8 on
// q_proj (256 -> 256) and v_proj (256 -> 128); 4 ranks.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

Scenario probe(std::initializer_list<std::pair<const char*, std::string>> more = {}, bool lora = true,
               bool sharded = true) {
  Scenario s = testing::fsdp2_probe_model();
  if (sharded) {
    set_field(s, "dp", "4");
    set_field(s, "sharding", "fsdp2");
  }
  if (lora) set_field(s, "lora", "r=8,targets=q_proj,v_proj");
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

// Per rank (W = 4, every dim divisible: no padding):
//   a layer's base: q 256x256 = 65,536, k and v 128x256 = 32,768 each, o 65,536, gate and up 688x256 = 176,128 each,
//     down 256x688 = 176,128, two norms 256 each: 725,504 -> 181,376 per rank
//   its adapters: q lora_A 8x256 = 2,048 and lora_B 256x8 = 2,048, v lora_A 2,048 and lora_B 128x8 = 1,024:
//     7,168 -> 1,792 per rank (lora_A's 8 rows: 2 per rank)
//   the layer's all-gather input: 183,168 elements (x 4 = the probe's 732,672); in bf16 with float32 adapters
//     181,376 x 2 + 1,792 x 4 = 369,920 bytes (x 4 = the probe's 1,479,680 uint8 elements)
//   embedding and lm_head 1000x256 -> 64,000 per rank; the root's norm 256 -> 64
constexpr uint64_t kLayerShard = 183168, kAdapterShard = 1792, kEmbedShard = 64000, kNormShard = 64;

TEST(FsdpLoraUnits, ThePeftModelsUnitsAndBuffersByHand) {
  const Estimate e = run(probe());
  ASSERT_TRUE(e.fsdp.has_value());
  const FsdpFigures& f = *e.fsdp;
  ASSERT_EQ(f.units.size(), 5u);
  // the root keeps model.norm (accelerate's _find_final_norm finds no norm under the PeftModel), the tail is lm_head
  EXPECT_EQ(f.units[0].kind, FsdpUnit::kRoot);
  EXPECT_EQ(f.units[0].rows.size(), 1u);
  EXPECT_FALSE(f.units[0].reshard_after_forward);
  EXPECT_EQ(f.units[1].name, "model.embed_tokens");
  EXPECT_EQ(f.units[2].rows.size(), 13u);
  EXPECT_EQ(f.units[4].name, "[lm_head]");
  EXPECT_EQ(f.units[4].rows.size(), 1u);
  // bf16-amp: every row float32 (the model's and the adapters'), all gathered through a bfloat16 copy-in
  const FsdpUnit& l = f.units[2];
  EXPECT_EQ(l.gather_dtype, DType::kBF16);
  EXPECT_EQ(l.gather_numel * 4, 732672u);
  EXPECT_EQ(l.gather_numel, kLayerShard);
  EXPECT_EQ(l.copy_in_numel, kLayerShard);
  EXPECT_EQ(l.grad_numel * 4, 7168u);  // the reduce-scatter input: the 4 adapters' gradients
  EXPECT_EQ(l.trainable_params, 7168u);
  EXPECT_EQ(l.grad_dtype, DType::kBF16);
  EXPECT_EQ(l.reduce_dtype, DType::kBF16);
  EXPECT_EQ(l.grad_orig_dtype, DType::kF32);
  EXPECT_EQ(f.units[0].gather_numel * 4, 256u);
  EXPECT_EQ(f.units[1].gather_numel * 4, 256000u);
  for (size_t i : {0, 1, 4}) EXPECT_EQ(f.units[i].grad_numel, 0u) << f.units[i].name;
  // the rank's states: every shard float32; gradients and AdamW's two moments over the adapters' shards only
  const uint64_t shards = kNormShard + 2 * kEmbedShard + 2 * kLayerShard;
  EXPECT_EQ(f.sharded_params.value, 4 * shards);
  EXPECT_EQ(f.sharded_grads.value, 4 * 2 * kAdapterShard);
  EXPECT_EQ(f.optimizer_state.value, 8 * 2 * kAdapterShard);
}

TEST(FsdpLoraUnits, PureBf16WithFloat32AdaptersGathersBytes) {
  const Estimate e = run(probe({{"precision", "bf16"}}));
  const FsdpUnit& l = e.fsdp->units[2];
  // mixed_precision "no": MixedPrecisionPolicy(), the base stays bfloat16 and PEFT's adapters float32: the inputs'
  // dtypes differ, so foreach_all_gather gathers uint8 (the probe's 1,479,680), with no copy-in
  EXPECT_EQ(l.gather_dtype, DType::kU8);
  EXPECT_EQ(l.gather_numel, 181376u * 2 + kAdapterShard * 4);
  EXPECT_EQ(l.gather_numel * 4, 1479680u);
  EXPECT_EQ(l.copy_in_numel, 0u);
  EXPECT_EQ(l.reduce_dtype, DType::kF32);
  EXPECT_EQ(l.grad_orig_dtype, DType::kF32);
  // the embedding (frozen, bfloat16 alone) gathers bfloat16
  EXPECT_EQ(e.fsdp->units[1].gather_dtype, DType::kBF16);
  // --lora-dtype base: bfloat16 adapters, one dtype again
  const Estimate b = run(probe({{"precision", "bf16"}, {"lora_dtype", "base"}}));
  EXPECT_EQ(b.fsdp->units[2].gather_dtype, DType::kBF16);
  EXPECT_EQ(b.fsdp->units[2].gather_numel, kLayerShard);
  EXPECT_EQ(b.fsdp->sharded_grads.value, 2u * 2 * kAdapterShard);
}

// The simulated rank's buffers, step 2: each layer's all-gather (forward, and the backward's re-gather after the
// reshard), the root's once (it never reshards after forward), the embedding's in the forward and again as layer
// 0's backward prefetch, lm_head's once; one reduce-scatter per layer over the adapters, none for the frozen units;
// gradients for the adapters only; nothing of FSDP's left at the end of the step.
TEST(FsdpLoraSim, FrozenUnitsGatherButNeverReduce) {
  const Estimate e = run(probe());
  std::map<std::string, int> ag, rs;  // by label and layer: step 2's all-gathers and reduce-scatters
  LiveBytes end;  // live bytes once the last event ran
  for (const Event& ev : e.sim->timeline.events) {
    apply(end, ev);
    const std::string w = ev.label.what;
    if (ev.step != 2 || ev.kind != Event::kAlloc) continue;
    if (w.rfind("FSDP all-gather output", 0) == 0) {
      ++ag[w + std::to_string(ev.label.layer)];
      if (ev.label.layer == 1) EXPECT_EQ(ev.bytes.value, 4 * kLayerShard * 2);
    }
    if (w.rfind("FSDP reduce-scatter input", 0) == 0) {
      ++rs[w + std::to_string(ev.label.layer)];
      EXPECT_EQ(ev.bytes.value, 4 * kAdapterShard * 2);  // bfloat16
    }
    if (w == "FSDP sharded gradients (reduce-scatter output upcast)") EXPECT_EQ(ev.bytes.value, kAdapterShard * 4);
    if (ev.category == Category::kGradients) {
      EXPECT_TRUE(w.find("lora_") != std::string::npos || w.rfind("FSDP", 0) == 0) << w;
    }
  }
  EXPECT_EQ(ag["FSDP all-gather output0"], 2);
  EXPECT_EQ(ag["FSDP all-gather output1"], 2);
  EXPECT_EQ(ag["FSDP all-gather output (model (root: model.norm))-1"], 1);
  EXPECT_EQ(ag["FSDP all-gather output (model.embed_tokens)-1"], 2);
  EXPECT_EQ(ag["FSDP all-gather output ([lm_head])-1"], 1);
  EXPECT_EQ(rs.size(), 2u);
  EXPECT_EQ(rs["FSDP reduce-scatter input0"], 1);
  EXPECT_EQ(rs["FSDP reduce-scatter input1"], 1);
  EXPECT_EQ(end.by_category[static_cast<size_t>(Category::kFsdpBuffers)].value, 0u);
}

// LoRA against full fine-tuning under the same FSDP2: the shards grow by the adapters' (float32), the sharded
// gradients and AdamW's state shrink to the adapters'; the gathered layer grows by the adapters' shards.
TEST(FsdpLoraSim, DiffersFromFullFsdp2ByTheFrozenBase) {
  const Estimate lora = run(probe());
  const Estimate full = run(probe({}, false));
  const FsdpFigures& a = *lora.fsdp;
  const FsdpFigures& b = *full.fsdp;
  EXPECT_EQ(a.sharded_params.value - b.sharded_params.value, 4 * 2 * kAdapterShard);
  EXPECT_EQ(b.sharded_grads.value, b.sharded_params.value);  // full: every shard has its gradient
  EXPECT_EQ(a.sharded_grads.value, 4 * 2 * kAdapterShard);
  EXPECT_EQ(b.optimizer_state.value, 2 * b.sharded_params.value);
  EXPECT_EQ(a.optimizer_state.value, 8 * 2 * kAdapterShard);
  // full FSDP2's tail holds the norm; the PeftModel's root does
  EXPECT_EQ(b.units.size(), 4u);
  EXPECT_EQ(b.units[2].gather_numel + kAdapterShard, a.units[2].gather_numel);
  EXPECT_EQ(b.units[2].grad_numel, b.units[2].gather_numel);
}

// Against the single-GPU LoRA run (--sharding fsdp2 needs --dp above 1, so that is --dp 1 without it): with no
// casts (fp32; bf16 with float32 adapters) autograd saves the same tensors, FSDP2 only adding its buffers and
// holding shards. Under bf16-amp the unsharded parameters are bfloat16 already (MixedPrecisionPolicy.param_dtype):
// autocast makes no weight copies and PEFT no float32 input casts for bfloat16 adapters, so FSDP2 saves less.
TEST(FsdpLoraSim, SavesWhatTheSingleGpuRunSaves) {
  EXPECT_THROW(run(probe({{"dp", "1"}})), Error);
  for (const char* p : {"fp32", "bf16", "bf16-amp"}) {
    const Estimate sharded = run(probe({{"precision", p}}));
    const Estimate single = run(probe({{"precision", p}}, true, false));
    if (std::string_view(p) == "bf16-amp") {
      EXPECT_LT(sharded.peak.saved_activations.value, single.peak.saved_activations.value);
    } else {
      EXPECT_EQ(sharded.peak.saved_activations.value, single.peak.saved_activations.value) << p;
    }
  }
}

// Checkpointing turns enable_input_require_grads on for LoRA: the embeddings require grad, so the embedding unit's
// pre-backward hook runs in the backward and copies the prefetched all-gather out into its unsharded weight, which
// the final callback's post_backward frees; without it the prefetched output is only dropped there.
TEST(FsdpLoraSim, InputRequireGradsUnshardsTheEmbeddingInTheBackward) {
  const auto unsharded_in_backward = [](const Estimate& e) {
    int n = 0;
    for (const Event& ev : e.sim->timeline.events) {
      if (ev.kind == Event::kAlloc && ev.step == 2 && ev.phase == Phase::kBackward &&
          std::string_view(ev.label.what) == "model.embed_tokens.weight (FSDP unsharded)") {
        ++n;
      }
    }
    return n;
  };
  const Estimate irg = run(probe({{"checkpointing", "full"}}));
  EXPECT_EQ(irg.setup.input_require_grads.value_or(false), true);
  EXPECT_EQ(unsharded_in_backward(irg), 1);
  EXPECT_EQ(unsharded_in_backward(run(probe({{"checkpointing", "full"}, {"input_require_grads", "false"}}))), 0);
  EXPECT_EQ(unsharded_in_backward(run(probe())), 0);
}

// Gradient accumulation: no_sync keeps the adapters' unsharded bfloat16 .grad (2 x 7,168 x 2 bytes) between the
// micro-batches, nothing for the frozen rows.
TEST(FsdpLoraSim, NoSyncKeepsOnlyTheAdaptersGradients) {
  const Estimate e = run(probe({{"grad_accum", "2"}}));
  LiveBytes live;
  bool checked = false;
  const size_t gk = static_cast<size_t>(Category::kGradients);
  for (const Event& ev : e.sim->timeline.events) {
    if (!checked && ev.step == 2 && ev.micro == 2) {
      EXPECT_EQ(live.by_category[gk].value, 2u * 2 * 7168);
      checked = true;
    }
    apply(live, ev);
  }
  EXPECT_TRUE(checked);
}

TEST(FsdpLoraRefusals, WhatIsNotSimulated) {
  // (QLoRA: simulated, the uint8 Params4bit left whole as fully_shard's ignored_params: fsdp_qlora_test.cc)
  // (--cp: simulated, FSDP2 over the flattened dp_shard x cp mesh: cpfsdp_test.cc)
  EXPECT_THROW(run(probe({{"pp", "2"}, {"precision", "fp32"}})), Error);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// What the rank holds once the model is sharded, against the probe's torch.cuda.memory_allocated() after
// accelerator.prepare (sharding is per parameter, so the units do not change it): every padded shard (and the two
// rotary buffers, inv_freq and original_inv_freq, 32 float32 each) in its own block, rounded up to 512 bytes
// (CUDACachingAllocator's kMinBlockSize; every block here is below 1 MiB). The probe read 1,979,904 bytes
// (bf16-amp: an fp32 model) and 998,912 (bf16 with float32 adapters), under accelerate's default NO_WRAP policy
// (the shards are per parameter: the units do not change them).
uint64_t allocated_after_load(const Estimate& e) {
  uint64_t held = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.phase != Phase::kSetup || ev.step > 1) continue;
    const uint64_t block = (ev.bytes.value + 511) / 512 * 512;
    if (ev.kind == Event::kAlloc) held += block;
    if (ev.kind == Event::kFree) held -= block;
  }
  return held;
}

TEST(FsdpLoraSim, ShardsAsTheProbeAllocatedThem) {
  EXPECT_EQ(allocated_after_load(run(probe())), 1979904u);
  EXPECT_EQ(allocated_after_load(run(probe({{"precision", "bf16"}}))), 998912u);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// The tail [lm_head]'s pre-forward hook fires on lm_head's input, after the final norm (which the root holds): its
// all-gather comes after the norm's output; full FSDP2's tail [model.norm, lm_head] gathers before the norm runs.
TEST(FsdpLoraSim, TheTailGathersAfterTheFinalNorm) {
  const auto order = [](const Estimate& e, const char* tail) {
    int64_t gather = -1, norm_out = -1, i = 0;
    for (const Event& ev : e.sim->timeline.events) {
      ++i;
      if (ev.kind != Event::kAlloc || ev.step != 2 || ev.phase != Phase::kForward) continue;
      const std::string_view w = ev.label.what;
      if (w == tail) gather = i;
      if (w.rfind("norm", 0) == 0 && ev.label.layer < 0) norm_out = i;  // the final norm's tensors
    }
    return std::pair<int64_t, int64_t>{gather, norm_out};
  };
  const auto [peft_gather, peft_norm] = order(run(probe()), "FSDP all-gather output ([lm_head])");
  const auto [full_gather, full_norm] = order(run(probe({}, false)), "FSDP all-gather output ([model.norm, lm_head])");
  ASSERT_GT(peft_norm, 0);
  ASSERT_GT(full_norm, 0);
  EXPECT_GT(peft_gather, peft_norm);
  EXPECT_LT(full_gather, full_norm);
}

}  // namespace
}  // namespace trainmem
