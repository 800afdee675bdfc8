// Expert parallelism per rank (ep.h): the local shapes against transformers' own plan rules, computed here from
// the plans' text (base_model_tp_plan's attention entries, base_model_ep_plan's expert entries) and the shard
// arithmetic of the styles (not from trainmem's mark_* functions), the refusals, and the MoE layer's saved
// activations per rank against a closed form derived from the modeling code under balanced routing.
#include <fmt/format.h>

#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"
#include "trainmem/ep.h"
#include "trainmem/inventory.h"

namespace trainmem {
namespace {

using testing::MapFileReader;
using testing::scenario_of;

// The plans with the model prefix, as transformers merges them under DistributedConfig(tp_size=N, ep_size=N):
// the attention of base_model_tp_plan (MixtralConfig / Qwen3MoeConfig: q/k/v colwise, o_proj rowwise; qwen3_moe's
// q_norm/k_norm "replicated_with_grad_allreduce"), base_model_ep_plan ("layers.*.mlp.gate": "ep_router",
// "layers.*.mlp.experts.gate_up_proj" / "down_proj": "grouped_gemm", "layers.*.mlp.experts": "moe_tp_experts"),
// and <Type>ForCausalLM._tp_plan lm_head "colwise_gather_output".
const std::map<std::string, std::string> kPlan = {
    {"model.layers.*.self_attn.q_proj", "colwise"},
    {"model.layers.*.self_attn.k_proj", "colwise"},
    {"model.layers.*.self_attn.v_proj", "colwise"},
    {"model.layers.*.self_attn.o_proj", "rowwise"},
    {"model.layers.*.self_attn.q_norm", "replicated_with_grad_allreduce"},
    {"model.layers.*.self_attn.k_norm", "replicated_with_grad_allreduce"},
    {"model.layers.*.mlp.gate", "ep_router"},
    {"model.layers.*.mlp.experts.gate_up_proj", "grouped_gemm"},
    {"model.layers.*.mlp.experts.down_proj", "grouped_gemm"},
    {"model.layers.*.mlp.experts", "moe_tp_experts"},
    {"lm_head", "colwise_gather_output"},
};

// _get_parameter_tp_plan: an entry whose "*" stands for the layer number matches the parameter's name, else its
// module's (the name without its last component)
std::string plan_of(const std::string& name) {
  const std::string module = name.substr(0, name.rfind('.'));
  for (const std::string& target : {name, module}) {
    for (const auto& [key, style] : kPlan) {
      const std::regex pattern(std::regex_replace(std::regex_replace(key, std::regex(R"(\.)"), R"(\.)"),
                                                  std::regex(R"(\*)"), R"(\d+)"));
      if (std::regex_match(target, pattern)) return style;
    }
  }
  return "";
}

std::vector<uint64_t> expected_local(const TensorRow& global, uint64_t n) {
  std::vector<uint64_t> s = global.shape;
  const std::string style = plan_of(global.name);
  if (style == "colwise" || style == "colwise_gather_output") s[s.size() - 2] /= n;  // weight Shard(-2)
  if (style == "rowwise") s.back() /= n;                                               // weight Shard(-1)
  // MoEParamShard(Shard(0)): rank r holds experts [r * E/n, (r + 1) * E/n)
  if (style == "grouped_gemm") s[0] /= n;
  return s;  // ep_router, replicated_with_grad_allreduce, no entry: whole
}

void expect_local_shapes(const std::string& model, uint64_t n, std::initializer_list<const char*> overrides = {}) {
  Scenario g = scenario_of(model, {});
  for (const char* o : overrides) set_field(g, "overrides", o);
  Scenario l = g;
  set_field(l, "ep", std::to_string(n));
  const ResolvedScenario lr = resolve(l, MapFileReader());
  EXPECT_EQ(lr.setup.tp, n);  // --ep N is tp_size = ep_size = N
  std::map<std::string, TensorRow> global;
  for (const TensorRow& row : resolve(g, MapFileReader()).inventory.parameters) global.emplace(row.name, row);
  EXPECT_EQ(global.size(), lr.inventory.parameters.size());
  size_t experts = 0;
  for (const TensorRow& r : lr.inventory.parameters) {
    const auto it = global.find(r.name);
    ASSERT_NE(it, global.end()) << r.name;
    const std::vector<uint64_t> want = expected_local(it->second, n);
    EXPECT_EQ(r.shape, want) << model << " " << r.name;
    EXPECT_EQ(r.tp_dim >= 0, want != it->second.shape) << r.name;  // exactly the sharded rows are marked
    experts += plan_of(r.name) == "grouped_gemm" ? 1 : 0;
  }
  EXPECT_GT(experts, 0u);
}

TEST(Ep, LocalShapesFollowTheEpAndAttentionPlans) {
  expect_local_shapes("mixtral-8x7b", 8, {"num_hidden_layers=2"});
  expect_local_shapes("mixtral-8x7b", 2, {"num_hidden_layers=2"});
  expect_local_shapes("qwen3-30b-a3b", 4, {"num_hidden_layers=2"});
  expect_local_shapes("qwen3-30b-a3b", 2, {"num_hidden_layers=2"});
}

TEST(Ep, Mixtral8x7bRankHoldsOneExpertPerLayer) {
  // by hand, Mixtral-8x7B (hidden 4096, 32 heads of 128, 8 kv heads, 8 experts of 14336, vocab 32000, 32 layers)
  // over 8 ranks: embed_tokens 32000 x 4096 whole; per layer q 512x4096, k 128x4096, v 128x4096, o 4096x512,
  // router 8x4096 whole, one expert gate_up 2*14336 x 4096 and down 4096 x 14336, two norms 4096; final norm;
  // lm_head 4000 x 4096
  const uint64_t per_layer[] = {512 * 4096, 128 * 4096, 128 * 4096, 4096 * 512, 8 * 4096,
                                 2ull * 14336 * 4096, 4096ull * 14336, 4096, 4096};
  uint64_t expect = 32000ull * 4096 + 4096 + 4000ull * 4096;
  for (uint64_t n : per_layer) expect += 32 * n;
  const Scenario s = scenario_of("mixtral-8x7b", {{"ep", "8"}});
  EXPECT_EQ(parameter_count(resolve(s, MapFileReader()).inventory).value, expect);
}

TEST(Ep, RefusesWhatIsNotSimulatedNamingIt) {
  struct Refusal {
    const char* model;
    std::vector<std::pair<std::string, std::string>> fields;
    const char* says;
  };
  const Refusal refusals[] = {
      {"mixtral-8x7b", {{"ep", "3"}}, "divisible"},  // transformers: "num_experts must be divisible by ep_size"
      {"mixtral-8x7b", {{"ep", "4"}, {"tp", "2"}}, "ep_size = tp_size"},  // the all-reduce implementation
      {"llama-3-8b", {{"ep", "2"}}, "experts"},
      {"qwen3-30b-a3b", {{"ep", "8"}}, "num_key_value_heads"},  // 4 kv heads over 8 ranks
      {"mixtral-8x7b", {{"ep", "2"}, {"dp", "2"}}, "data parallel"},
      {"mixtral-8x7b", {{"ep", "2"}, {"moe_experts", "grouped_mm"}}, "grouped_mm"},
      {"mixtral-8x7b", {{"ep", "2"}, {"pp", "2"}}, "pipeline"},
      {"mixtral-8x7b", {{"ep", "2"}, {"task", "inference"}}, "inference"},
  };
  for (const Refusal& r : refusals) {
    Scenario s = scenario_of(r.model, {});
    for (const auto& [k, v] : r.fields) set_field(s, k, v);
    const std::string said = testing::error_of([&] { (void)resolve(s, MapFileReader()); });
    EXPECT_NE(said.find(r.says), std::string::npos) << r.model << ": " << said;
  }
  Scenario same = scenario_of("mixtral-8x7b", {{"ep", "2"}, {"tp", "2"}});  // the same sizes: accepted
  EXPECT_EQ(resolve(same, MapFileReader()).setup.tp, 2u);
}

// Saved activations of one Mixtral decoder layer on rank 0 of ep = tp = n ranks, eager attention and eager experts,
// bf16 weights (no autocast), no dropout, balanced routing; derived op by op from modeling_mixtral.py,
// tensor_parallel.py's EP styles and autograd's save rules:
//   attention and the two norms: tp_test's closed form without its MLP term (the norm's output is saved by the
//     router's F.linear): 16sbh + 8sb + (sb/n)(4aD + 4rD) + 6as^2b/n
//   router: F.linear's output is not saved; softmax(float32) saves its output (4NE); topk saves its indices (8Nk);
//     the renormalization router_top_value /= sum saves the sum (4N) and the quotient (4Nk) (DivBackward0 of an
//     in-place div: other and result)
//   ep_router: router_scores.masked_fill(non_local_mask, 0.0) saves the (N, k) bool mask (Nk); the integer ops
//     and the all-reduce save nothing
//   each local expert with m tokens: torch.where's (m, 2) int64 (16m: token_idx and top_k_pos are its columns,
//     saved by the two index ops and index_add_), current_state (2mC, saved by the gate_up linear), the gate_up
//     output (4mF: silu saves gate, mul saves up, both views of it), silu's output (2mF, saved by mul), the
//     product (2mF, saved by down), down's output (2mC) and top_k_weights[token_idx, top_k_pos, None] (4m,
//     float32), saved by the weighting mul (whose bf16 x float32 product is float32), and the .to(bf16) copy of
//     that product (2mC), which index_add_ saves (derivatives.yaml index_add: the source's gradient is
//     grad.index_select(dim, index).expand_as(source)): m(6C + 8F + 20)
// With N = sb tokens, k experts per token, E experts: balanced routing gives expert e floor(Nk/E) tokens, one more
// for e < Nk mod E; rank 0 holds experts [0, E/n).
uint64_t mixtral_layer_saved(uint64_t s, uint64_t b, uint64_t h, uint64_t a, uint64_t g, uint64_t D, uint64_t F,
                             uint64_t E, uint64_t k, uint64_t n) {
  const uint64_t N = s * b;
  const uint64_t r = g / n == 1 && b == 1 ? g : a;
  const uint64_t attention = 16 * N * h + 8 * N + N * (4 * a * D + 4 * r * D) / n + 6 * a * s * s * b / n;
  const uint64_t router = 4 * N * E + 8 * N * k + 4 * N + 4 * N * k + (n > 1 ? N * k : 0);
  uint64_t experts = 0;
  for (uint64_t e = 0; e < E / n; ++e) {
    const uint64_t m = N * k / E + (e < N * k % E ? 1 : 0);
    experts += m * (6 * h + 8 * F + 20);
  }
  return attention + router + experts;
}

// One layer's saved bytes: the simulation with two layers less the one with one (hidden 1024, 8 heads of 128, 8 kv
// heads, 8 experts of 2048, top-2; bf16 weights, eager attention and experts), rank 0 of n.
uint64_t simulated_layer_saved(uint64_t n, uint64_t seq, uint64_t batch) {
  std::vector<std::pair<std::string, std::string>> fields = {
      {"precision", "bf16"}, {"attention", "eager"}, {"steps", "1"}, {"moe_experts", "eager"},
      {"batch", std::to_string(batch)}, {"seq", std::to_string(seq)}};
  if (n > 1) fields.emplace_back("ep", std::to_string(n));
  uint64_t saved[2] = {0, 0};
  for (int layers : {1, 2}) {
    Scenario s = scenario_of("mixtral-8x7b", {});
    for (const char* o : {"hidden_size=1024", "num_attention_heads=8", "intermediate_size=2048"}) {
      set_field(s, "overrides", o);
    }
    set_field(s, "overrides", fmt::format("num_hidden_layers={}", layers));
    for (const auto& [k, v] : fields) set_field(s, k, v);
    saved[layers - 1] = testing::run(s).peak.saved_activations.value;
  }
  return saved[1] - saved[0];
}

TEST(Ep, MoeLayerSavedActivationsEqualTheClosedForm) {
  for (uint64_t n : {1, 2, 4, 8}) {
    EXPECT_EQ(simulated_layer_saved(n, 256, 2), mixtral_layer_saved(256, 2, 1024, 8, 8, 128, 2048, 8, 2, n))
        << "ep " << n;
  }
  // an uneven split: 3 x 101 x 2 = 606 assignments over 8 experts (76 for the first 6, 75 for the others)
  EXPECT_EQ(simulated_layer_saved(4, 101, 3), mixtral_layer_saved(101, 3, 1024, 8, 8, 128, 2048, 8, 2, 4));
}

}  // namespace
}  // namespace trainmem
