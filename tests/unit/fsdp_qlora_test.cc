// --dp N --sharding fsdp2 --quantize nf4 --lora ...: QLoRA under FSDP2 as accelerate runs it (fsdp.h
// FsdpOptions::ignore_packed_4bit; Fsdp2::shard_on_device). bitsandbytes' default uint8 quant_storage makes every
// Params4bit frozen and not floating, so accelerate 16cb6eb's fsdp2_prepare_model passes them to fully_shard as
// ignored_params (torch >= 2.7): whole on every rank, in no unit. Every figure is worked by hand from those rules
// and the shapes of fsdp_lora_test.cc's model (llama, hidden 256, intermediate 688, 4 heads of 64, 2 KV heads,
// vocab 1000, 2 layers; LoRA r=8 on q_proj and v_proj; 4 ranks), here with its seven Linears per layer quantized
// (prepare_model_for_kbit_training's checkpointing, non-reentrant: FSDP2 refuses the reentrant kind).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

Scenario qlora(std::initializer_list<std::pair<const char*, std::string>> more = {}, bool sharded = true) {
  Scenario s = testing::fsdp2_probe_model({{"quantize", "nf4"}, {"lora", "r=8,targets=q_proj,v_proj"},
                                           {"compute_dtype", "bf16"}, {"checkpoint_reentrant", "false"}});
  if (sharded) {
    set_field(s, "dp", "4");
    set_field(s, "sharding", "fsdp2");
  }
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

// Per layer: q 256x256 = 65,536, k and v 128x256 = 32,768 each, o 65,536, gate, up and down 176,128 each: 724,992
// quantized elements, packed two to a byte: 362,496 bytes, whole on each rank. What the units hold, per rank (W = 4,
// no padding): a layer's two norms (512 -> 128) and adapters (7,168 -> 1,792), float32 (prepare_model_for_kbit_training
// casts the norms, PEFT makes the adapters float32); the embedding and lm_head 1000x256 -> 64,000 each; the root's
// model.norm 256 -> 64.
constexpr uint64_t kPackedPerLayer = 362496, kLayerUnitShard = 128 + 1792, kAdapterShard = 1792;
constexpr uint64_t kShardedElems = 64000 + 64000 + 64 + 2 * kLayerUnitShard;  // 131,904

TEST(FsdpQloraUnits, TheParams4bitAreInNoUnitAndWholeOnEveryRank) {
  const Estimate e = run(qlora());
  ASSERT_TRUE(e.fsdp);
  const FsdpFigures& f = *e.fsdp;
  EXPECT_TRUE(f.options.ignore_packed_4bit);
  EXPECT_EQ(f.ignored_rows, 14u);
  EXPECT_EQ(f.ignored_params.value, 2 * kPackedPerLayer);
  EXPECT_EQ(f.sharded_params.value, kShardedElems * 4);
  // the rank's weights: its shards and the whole 4-bit base
  EXPECT_EQ(e.state.weights.value, kShardedElems * 4 + 2 * kPackedPerLayer);
  ASSERT_EQ(f.units.size(), 5u);  // the root (model.norm), the embedding, 2 layers, [lm_head]
  for (size_t i : {2u, 3u}) {
    const FsdpUnit& u = f.units[i];
    EXPECT_EQ(u.rows.size(), 6u);  // 2 norms, 4 adapters: no q, k, v, o, gate, up, down
    EXPECT_EQ(u.gather_numel, kLayerUnitShard);
    EXPECT_EQ(u.gather_dtype, DType::kBF16);   // MixedPrecisionPolicy(param_dtype=bf16) over float32 rows
    EXPECT_EQ(u.copy_in_numel, kLayerUnitShard);
    EXPECT_EQ(u.grad_numel, kAdapterShard);
  }
  // the step's all-gathers: a layer's 4 x 1,920 bfloat16 elements, never a quantized weight
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc || ev.step != 2) continue;
    const std::string w = ev.label.what;
    if (w.rfind("FSDP all-gather output", 0) == 0 && ev.label.layer >= 0) EXPECT_EQ(ev.bytes.value, 4 * kLayerUnitShard * 2);
    if (w.rfind("FSDP reduce-scatter input", 0) == 0) EXPECT_EQ(ev.bytes.value, 4 * kAdapterShard * 2);
  }
}

// The load: from_pretrained has the model whole on the GPU (bnb's device_map), and fsdp2_prepare_model's
// original_sd holds every whole tensor until it returns, so at the last shard the rank holds the base whole, every
// other row whole (float32: the embedding and lm_head 1,024,000 bytes each, five norms 5,120, the adapters 57,344)
// and every shard; when it returns, the shards and the 4-bit base. With double quantization, state_dict() clones
// each Linear4bit's state2.code (256 float32), held as long.
TEST(FsdpQloraSim, TheWholeRowsLiveUntilFsdp2PrepareModelReturns) {
  for (const bool dq : {false, true}) {
    const Estimate e = run(qlora({{"double_quant", dq ? "true" : "false"}}));
    const uint64_t whole = 1024000 * 2 + 5120 + 57344;
    const size_t wk = static_cast<size_t>(Category::kWeights), bk = static_cast<size_t>(Category::kBuffers);
    LiveBytes live;
    uint64_t max_weights = 0, max_buffers = 0, clones = 0;
    bool first_forward = false;
    for (const Event& ev : e.sim->timeline.events) {
      if (ev.phase != Phase::kSetup && !first_forward) {
        first_forward = true;
        EXPECT_EQ(live.by_category[wk].value, kShardedElems * 4 + 2 * kPackedPerLayer) << dq;
      }
      apply(live, ev);
      if (ev.phase != Phase::kSetup) continue;
      max_weights = std::max(max_weights, live.by_category[wk].value);
      max_buffers = std::max(max_buffers, live.by_category[bk].value);
      if (ev.kind == Event::kAlloc && std::string_view(ev.label.what).find("nested_quant_map (state_dict clone)") != std::string_view::npos) {
        EXPECT_EQ(ev.bytes.value, 256u * 4);
        ++clones;
      }
    }
    EXPECT_TRUE(first_forward);
    EXPECT_EQ(max_weights, 2 * kPackedPerLayer + whole + kShardedElems * 4) << dq;
    EXPECT_EQ(clones, dq ? 14u : 0u);
    EXPECT_EQ(max_buffers - live.by_category[bk].value, dq ? 14u * 256 * 4 : 0u);  // only the clones come and go
  }
}

// Against the single-GPU QLoRA run: with no casts (fp32; pure bf16) FSDP2 runs the same ops on its unsharded
// parameters, so autograd saves the same tensors.
TEST(FsdpQloraSim, SavesWhatTheSingleGpuRunSaves) {
  for (const char* p : {"fp32", "bf16"}) {
    const Estimate sharded = run(qlora({{"precision", p}}));
    const Estimate single = run(qlora({{"precision", p}}, false));
    EXPECT_EQ(sharded.peak.saved_activations.value, single.peak.saved_activations.value) << p;
  }
}

// --quant-storage bf16 (bnb_4bit_quant_storage=torch.bfloat16, the FSDP-QLoRA recipe): the packed weights are
// ((n + 1) // 4, 1) bfloat16, frozen and floating, so fully_shard shards them with the layer: per layer 724,992 / 4
// = 181,248 elements, 45,312 per rank (q 4,096, k and v 2,048 each, o 4,096, gate, up and down 11,008 each), gathered
// as they are (bfloat16 is param_dtype already: no copy-in) beside the norms' and adapters' 1,920.
TEST(FsdpQloraUnits, Bf16StorageShardsThePackedWeightsWithTheirLayer) {
  const Estimate e = run(qlora({{"quant_storage", "bf16"}}));
  const FsdpFigures& f = *e.fsdp;
  EXPECT_FALSE(f.options.ignore_packed_4bit);
  EXPECT_EQ(f.ignored_rows, 0u);
  constexpr uint64_t kPackedShard = 45312;
  EXPECT_EQ(f.sharded_params.value, kShardedElems * 4 + 2 * kPackedShard * 2);
  EXPECT_EQ(e.state.weights.value, f.sharded_params.value);
  for (size_t i : {2u, 3u}) {
    const FsdpUnit& u = f.units[i];
    EXPECT_EQ(u.rows.size(), 13u);
    EXPECT_EQ(u.gather_numel, kLayerUnitShard + kPackedShard);
    EXPECT_EQ(u.gather_dtype, DType::kBF16);
    EXPECT_EQ(u.copy_in_numel, kLayerUnitShard);
    EXPECT_EQ(u.grad_numel, kAdapterShard);
  }
  int gathers = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && ev.step == 2 && ev.label.layer >= 0 &&
        std::string_view(ev.label.what).rfind("FSDP all-gather output", 0) == 0) {
      EXPECT_EQ(ev.bytes.value, 4 * (kLayerUnitShard + kPackedShard) * 2);
      ++gathers;
    }
  }
  EXPECT_EQ(gathers, 2 * 2);  // each layer in the forward and (checkpointed) in the backward
  // the same bytes as uint8 storage: the single-GPU run is unchanged, saving what the FSDP2 one saves
  const Estimate single = run(qlora({{"quant_storage", "bf16"}, {"precision", "fp32"}}, false));
  EXPECT_EQ(single.state.weights.value, run(qlora({{"precision", "fp32"}}, false)).state.weights.value);
  EXPECT_EQ(run(qlora({{"quant_storage", "bf16"}, {"precision", "fp32"}})).peak.saved_activations.value,
            single.peak.saved_activations.value);
  // no ignored_params: PyTorch 2.6 (FSDP2's own floor under accelerate) runs it
  EXPECT_NO_THROW(run(qlora({{"quant_storage", "bf16"}, {"torch", "2.6"}})));
}

TEST(FsdpQloraRefusals, OlderTorchAndFsdp1) {
  // torch 2.6: accelerate passes no ignored_params, and fully_shard fails on the uint8 Params4bit
  try {
    run(qlora({{"torch", "2.6"}}));
    ADD_FAILURE() << "torch 2.6 was not refused";
  } catch (const FieldError& err) {
    EXPECT_EQ(err.field(), "torch");
  }
  EXPECT_THROW(run(qlora({{"sharding", "fsdp1"}})), FieldError);
}

}  // namespace
}  // namespace trainmem
