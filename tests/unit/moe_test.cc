// The mixture-of-experts block (src/sim/forward_programs/moe.cc): the routing assumption, and what the eager
// experts loop of transformers 5.x MixtralExperts allocates, derived from the shapes below.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/inventory.h"
#include "trainmem/scenario.h"
#include "sim/forward_programs/hf_common.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

MoeSpec moe(uint64_t experts, uint64_t top_k, MoeRouting routing) {
  MoeSpec m;
  m.experts = experts;
  m.top_k = top_k;
  m.routing = routing;
  return m;
}

TEST(Moe, BalancedRoutingSpreadsTheAssignmentsRemainderToTheLowestExperts) {
  // 22 tokens x top-2 = 44 assignments over 3 experts: 14 each, the 2 left over to experts 0 and 1
  EXPECT_EQ(sim::routed_tokens(moe(3, 2, MoeRouting::kBalanced), 22), (std::vector<uint64_t>{15, 15, 14}));
  // 3 tokens x top-2 over 8 experts: 6 experts get one token each, experts 6 and 7 none
  EXPECT_EQ(sim::routed_tokens(moe(8, 2, MoeRouting::kBalanced), 3), (std::vector<uint64_t>{1, 1, 1, 1, 1, 1, 0, 0}));
}

TEST(Moe, WorstRoutingSendsEveryTokenToTheSameKExperts) {
  EXPECT_EQ(sim::routed_tokens(moe(4, 2, MoeRouting::kWorst), 32), (std::vector<uint64_t>{32, 32, 0, 0}));
  EXPECT_EQ(sim::routed_tokens(moe(4, 1, MoeRouting::kWorst), 5), (std::vector<uint64_t>{5, 0, 0, 0}));
}

// Mixtral-8x7B, one layer: E = 8, F = 14336, C = 4096; bf16 weights, B = 1, T = 64.
constexpr uint64_t kE = 8, kF = 14336, kC = 4096;

Estimate mixtral(const std::string& routing, const std::string& experts = "eager") {
  return testing::run(testing::scenario_of("mixtral-8x7b", {{"overrides", "num_hidden_layers=1"},
                                                            {"precision", "bf16"},
                                                            {"batch", "1"},
                                                            {"seq", "64"},
                                                            {"moe_routing", routing},
                                                            {"moe_experts", experts}}));
}

// Allocations of `bytes` in the first step's backward.
int backward_allocations_of(const Estimate& e, uint64_t bytes) {
  int n = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && ev.step == 1 && ev.phase == Phase::kBackward && ev.bytes.value == bytes) ++n;
  }
  return n;
}

TEST(Moe, EveryExpertWithTokensGetsAWholeSizeGradientOfTheFusedExperts) {
  // self.gate_up_proj[expert_idx] is a select: SelectBackward0's select_backward allocates zeros of the whole
  // (E, 2F, C) parameter for each expert the loop ran (its gradient is added into the first in place), and the
  // same for down_proj (E, C, F). Balanced: 64 x 2 assignments reach all 8 experts; worst: experts 0 and 1 only.
  const uint64_t gate_up = kE * 2 * kF * kC * 2, down = kE * kC * kF * 2;
  EXPECT_EQ(backward_allocations_of(mixtral("balanced"), gate_up), 8);
  EXPECT_EQ(backward_allocations_of(mixtral("worst"), gate_up), 2);
  EXPECT_EQ(backward_allocations_of(mixtral("balanced"), down), 8);
  EXPECT_EQ(backward_allocations_of(mixtral("worst"), down), 2);
}

TEST(Moe, GroupedMmGivesOneGradientOfEachFusedExpertTensorWhateverTheRouting) {
  // grouped_mm_experts_forward multiplies by the whole gate_up_proj.transpose(-2, -1): one _grouped_mm backward,
  // one (E, C, 2F) gradient; and it gathers the N*k token-expert rows twice (hidden_states[token_idx], then
  // [perm]), (N*k, C) bf16 each, whatever the routing.
  const uint64_t gate_up = kE * 2 * kF * kC * 2, down = kE * kC * kF * 2;
  for (const char* routing : {"balanced", "worst"}) {
    const Estimate e = mixtral(routing, "grouped_mm");
    EXPECT_EQ(backward_allocations_of(e, gate_up), 1) << routing;
    EXPECT_EQ(backward_allocations_of(e, down), 1) << routing;
  }
  EXPECT_EQ(mixtral("balanced", "grouped_mm").sim->saved_activations.value,
            mixtral("worst", "grouped_mm").sim->saved_activations.value);
}

TEST(Moe, TheDefaultEagerLoopIsSaidUnlessTheExpertsImplementationIsGiven) {
  // transformers 5.x picks grouped_mm when no experts_implementation is given; trainmem's default is the eager loop
  Scenario s;
  s.model.model = "mixtral-8x7b";
  set_field(s, "precision", "bf16");
  auto says_eager = [](const ResolvedScenario& r) {
    for (const std::string& w : r.warnings) {
      if (w.find("eager loop") != std::string::npos) return true;
    }
    return false;
  };
  EXPECT_TRUE(says_eager(resolve(s, MapFileReader())));
  Scenario g = s;
  set_field(g, "moe_experts", "grouped_mm");
  EXPECT_FALSE(says_eager(resolve(g, MapFileReader())));
  Scenario dense;
  dense.model.model = "mistral-7b";
  EXPECT_FALSE(says_eager(resolve(dense, MapFileReader())));
}

TEST(Moe, GroupedMmIsRefusedUnderAutocast) {
  Scenario s;
  s.model.model = "mixtral-8x7b";
  set_field(s, "precision", "bf16-amp");
  set_field(s, "moe_experts", "grouped_mm");
  EXPECT_THROW(resolve(s, MapFileReader()), FieldError);
}

TEST(Moe, TheRoutingAssumptionIsPartOfTheResolvedModel) {
  EXPECT_EQ(mixtral("worst").model.moe.routing, MoeRouting::kWorst);
  EXPECT_EQ(mixtral("balanced").model.moe.routing, MoeRouting::kBalanced);
  EXPECT_EQ(moe_routing_note(mixtral("worst").model), ", worst MoE routing");
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

using testing::error_of;
using testing::from_json;
using testing::MapFileReader;

TEST(MoeConfig, QwenMoeTypesTakeTheirConfigClassDefaults) {
  // Qwen2MoeConfig: 60 experts, top-4, moe_intermediate_size 1408, a 5632-wide shared expert, no renormalization,
  // q/k/v biases (qkv_bias=True); Qwen3MoeConfig: 128 experts, top-8, 768, no shared expert, q/k norms.
  const ModelSpec q2 = from_json(R"({"model_type": "qwen2_moe"})");
  EXPECT_EQ(q2.moe.experts, 60u);
  EXPECT_EQ(q2.moe.top_k, 4u);
  EXPECT_EQ(q2.moe.ffn, 1408u);
  EXPECT_EQ(q2.moe.shared_ffn, 5632u);
  EXPECT_FALSE(q2.moe.norm_topk_prob);
  EXPECT_TRUE(q2.attn.qkv_bias);
  EXPECT_FALSE(q2.attn.out_bias);
  const ModelSpec q3 = from_json(R"({"model_type": "qwen3_moe"})");
  EXPECT_EQ(q3.moe.experts, 128u);
  EXPECT_EQ(q3.moe.top_k, 8u);
  EXPECT_EQ(q3.moe.ffn, 768u);
  EXPECT_EQ(q3.moe.shared_ffn, 0u);
  EXPECT_TRUE(q3.attn.qk_norm);
  EXPECT_EQ(q3.attn.head_dim, 64u);  // no head_dim field: hidden_size // num_attention_heads
  // Mixtral's experts are intermediate_size wide and its router always renormalizes.
  const ModelSpec mx = from_json(R"({"model_type": "mixtral", "num_experts": 4})");  // attribute_map alias
  EXPECT_EQ(mx.moe.experts, 4u);
  EXPECT_EQ(mx.moe.ffn, 14336u);
  EXPECT_TRUE(mx.moe.norm_topk_prob);
}

TEST(MoeConfig, DenseLayersFollowDecoderSparseStepAndMlpOnlyLayers) {
  // Qwen2MoeDecoderLayer: sparse iff layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0
  const ModelSpec m = from_json(
      R"({"model_type": "qwen2_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  std::vector<bool> sparse;
  for (uint64_t l = 0; l < 6; ++l) sparse.push_back(is_moe_layer(m, l));
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  const Inventory inv = build_inventory(m);
  bool dense_mlp_in_layer_3 = false;
  for (const auto& p : inv.parameters) dense_mlp_in_layer_3 |= p.name == "model.layers.3.mlp.gate_proj.weight";
  EXPECT_TRUE(dense_mlp_in_layer_3);
}

TEST(MoeConfig, RoutersAreNotLinearsForPeftAllLinear) {
  // transformers 5.x MixtralTopKRouter holds `self.weight = nn.Parameter(...)`, no nn.Linear: PEFT's all-linear
  // adapts q/k/v/o only (the experts are 3-D parameters); qwen2_moe adds its shared expert's three projections
  // and the shared_expert_gate Linear(C, 1).
  Scenario s;
  s.model.model = "mixtral-8x7b";
  set_field(s, "overrides", "num_hidden_layers=1");
  set_field(s, "lora", "r=8,targets=all-linear");
  size_t adapters = 0;
  for (const TensorRow& r : resolve(s, MapFileReader()).inventory.parameters) {
    adapters += r.adapter ? 1 : 0;
    EXPECT_EQ(r.name.find("mlp.gate.lora"), std::string::npos) << r.name;
  }
  EXPECT_EQ(adapters, 2u * 4u);  // lora_A and lora_B of q, k, v and o_proj (one layer)
  Scenario q = s;
  q.model.model = std::string(TRAINMEM_SOURCE_DIR) + "/tests/testdata/configs/qwen1.5-moe-a2.7b.json";
  size_t q_adapters = 0;
  for (const TensorRow& r : resolve(q).inventory.parameters) q_adapters += r.adapter ? 1 : 0;
  EXPECT_EQ(q_adapters, 2u * (4u + 3u + 1u));  // and of shared_expert.{gate,up,down}_proj, shared_expert_gate
}

TEST(MoeConfig, BadExpertKeysAreRefusedNamingTheKey) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "qwen2_moe", "num_hidden_layers": 4, "mlp_only_layers": [4]})"); }),
            "test.json: key \"mlp_only_layers\" = [4]: expected a list of layer indices below num_hidden_layers = 4");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "qwen3_moe", "num_experts": 4})"); }),
            "test.json: key \"num_experts_per_tok\" = 8: expected at most \"num_experts\" = 4");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "mixtral", "router_jitter_noise": 0.01})"); }),
            "test.json: key \"router_jitter_noise\" = 0.01: expected 0.0 (router jitter in training is not simulated "
            "yet)");
}

}  // namespace
}  // namespace trainmem
