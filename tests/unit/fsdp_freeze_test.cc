// --freeze under --sharding fsdp2: frozen rows stay in their units, all-gathered like the rest and never
// reduce-scattered (FSDPParamGroup.post_backward reduce-scatters fsdp_params_with_grad only; accelerate's
// fsdp2_prepare_model upcasts `param.requires_grad` rows only, and every row of a bf16-amp model is float32 already).
// The figures are worked by hand for fsdp_lora_test.cc's model without adapters (llama, hidden 256, intermediate
// 688, 4 heads of 64, 2 KV heads, vocab 1000, 2 layers; 4 ranks): a decoder layer holds 725,504 elements, 181,376
// per rank; the embedding and lm_head 64,000 per rank each.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

Scenario tiny(std::initializer_list<std::pair<const char*, std::string>> more = {}) {
  Scenario s = testing::fsdp2_probe_model({{"dp", "4"}, {"sharding", "fsdp2"}});
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

constexpr uint64_t kLayerShard = 181376, kEmbedShard = 64000;

// Step 2's reduce-scatter inputs, by unit label and layer.
std::map<std::string, uint64_t> reduce_scatters(const Estimate& e) {
  std::map<std::string, uint64_t> rs;
  for (const Event& ev : e.sim->timeline.events) {
    const std::string w = ev.label.what;
    if (ev.step == 2 && ev.kind == Event::kAlloc && w.rfind("FSDP reduce-scatter input", 0) == 0) {
      rs[w + std::to_string(ev.label.layer)] = ev.bytes.value;
    }
  }
  return rs;
}

TEST(FsdpFreeze, AFrozenLayerIsGatheredButNeverReduced) {
  const Estimate full = run(tiny());
  const Estimate frozen = run(tiny({{"freeze", "model.layers.0.*"}}));
  // its shard keeps no gradient and no AdamW moments (float32: bf16-amp's upcast shards)
  EXPECT_EQ(full.state.gradients.value - frozen.state.gradients.value, kLayerShard * 4);
  EXPECT_EQ(full.state.optimizer_moments.value - frozen.state.optimizer_moments.value, 2 * kLayerShard * 4);
  EXPECT_EQ(frozen.state.weights.value, full.state.weights.value);
  const auto rs_full = reduce_scatters(full), rs_frozen = reduce_scatters(frozen);
  EXPECT_EQ(rs_full.size(), 4u);  // the embedding, two layers, the tail
  EXPECT_EQ(rs_frozen.size(), 3u);
  EXPECT_EQ(rs_frozen.count("FSDP reduce-scatter input0"), 0u);
  EXPECT_EQ(rs_frozen.at("FSDP reduce-scatter input1"), 4 * kLayerShard * 2);  // bfloat16, the whole mesh's
  // the frozen layer is all-gathered as often as the trained one: in the forward, and in the backward that
  // passes through it to the trained embedding
  int gathers0 = 0, gathers1 = 0;
  for (const Event& ev : frozen.sim->timeline.events) {
    if (ev.step != 2 || ev.kind != Event::kAlloc || std::string(ev.label.what) != "FSDP all-gather output") continue;
    if (ev.label.layer == 0) ++gathers0;
    if (ev.label.layer == 1) ++gathers1;
  }
  EXPECT_EQ(gathers0, 2);
  EXPECT_EQ(gathers1, 2);
}

TEST(FsdpFreeze, AFrozenEmbeddingUnitHasNoReduceScatter) {
  const Estimate full = run(tiny());
  const Estimate frozen = run(tiny({{"freeze", "model.embed_tokens.*"}}));
  EXPECT_EQ(full.state.gradients.value - frozen.state.gradients.value, kEmbedShard * 4);
  EXPECT_EQ(reduce_scatters(frozen).count("FSDP reduce-scatter input (model.embed_tokens)-1"), 0u);
  EXPECT_EQ(reduce_scatters(full).count("FSDP reduce-scatter input (model.embed_tokens)-1"), 1u);
}

TEST(FsdpFreeze, Fsdp1StillRefusesFrozenRows) {
  EXPECT_THROW(run(tiny({{"sharding", "fsdp1"}, {"freeze", "model.layers.0.*"}})), FieldError);
}

}  // namespace
}  // namespace trainmem
