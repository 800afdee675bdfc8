// Tensor parallelism per rank (tp.h): the local shapes against transformers' own sharding rules, computed here
// from the plan's text and get_tensor_shard's arithmetic (not from trainmem's tp_style), the refusals, and the
// saved activations per layer against a closed form derived from the modeling code (the Llama analogue of
// Korthikanti et al. 2022, Table 2).
#include <fmt/format.h>

#include <regex>
#include <string>

#include "test_util.h"
#include "trainmem/inventory.h"
#include "trainmem/tp.h"

namespace trainmem {
namespace {

using testing::MapFileReader;
using testing::scenario_of;

// LlamaConfig.base_model_tp_plan (configuration_llama.py @008e574) with the model prefix, and
// LlamaForCausalLM._tp_plan, as transformers merges them.
const std::map<std::string, std::string> kPlan = {
    {"model.layers.*.self_attn.q_proj", "colwise"}, {"model.layers.*.self_attn.k_proj", "colwise"},
    {"model.layers.*.self_attn.v_proj", "colwise"}, {"model.layers.*.self_attn.o_proj", "rowwise"},
    {"model.layers.*.mlp.gate_proj", "colwise"},    {"model.layers.*.mlp.up_proj", "colwise"},
    {"model.layers.*.mlp.down_proj", "rowwise"},    {"lm_head", "colwise_gather_output"},
};

// _get_parameter_tp_plan (tensor_parallel.py 5.x): layer numbers become "*", then the name or its module.
std::string plan_of(const std::string& name) {
  const std::string generic = std::regex_replace(name, std::regex(R"(\.\d+(\.|$))"), ".*$1");
  if (auto it = kPlan.find(generic); it != kPlan.end()) return it->second;
  const std::string module = generic.substr(0, generic.rfind('.'));
  if (auto it = kPlan.find(module); it != kPlan.end()) return it->second;
  return "";
}

// get_tensor_shard for rank 0: shard_size = ceil(n / world_size); rank 0 gets [0, min(shard_size, n)).
uint64_t rank0_rows(uint64_t n, uint64_t t) { return std::min((n + t - 1) / t, n); }

std::vector<uint64_t> expected_local(const TensorRow& global, uint64_t t) {
  std::vector<uint64_t> s = global.shape;
  const std::string style = plan_of(global.name);
  const bool bias = global.name.size() > 5 && global.name.substr(global.name.size() - 5) == ".bias";
  if (style == "colwise" || style == "colwise_gather_output") {
    // ColwiseParallel.shard_tensor: bias get_tensor_shard(..., -1), weight (..., -2)
    const size_t d = bias ? s.size() - 1 : s.size() - 2;
    s[d] = rank0_rows(s[d], t);
  } else if (style == "rowwise" && !bias) {
    s.back() = rank0_rows(s.back(), t);  // RowwiseParallel.shard_tensor: weight (..., -1); bias param[...]
  }
  return s;
}

void expect_local_shapes(const std::string& model, uint64_t t, std::initializer_list<const char*> overrides = {}) {
  Scenario g = scenario_of(model, {});
  for (const char* o : overrides) set_field(g, "overrides", o);
  Scenario l = g;
  set_field(l, "tp", std::to_string(t));
  const Inventory global = resolve(g, MapFileReader()).inventory;
  const Inventory local = resolve(l, MapFileReader()).inventory;
  ASSERT_EQ(global.parameters.size(), local.parameters.size());
  size_t sharded = 0;
  for (size_t i = 0; i < global.parameters.size(); ++i) {
    const TensorRow& gr = global.parameters[i];
    const TensorRow& lr = local.parameters[i];
    ASSERT_EQ(gr.name, lr.name);
    EXPECT_EQ(lr.shape, expected_local(gr, t)) << model << " " << gr.name;
    const bool shard = lr.shape != gr.shape;
    sharded += shard;
    EXPECT_EQ(lr.tp_dim >= 0, shard) << gr.name;  // the inventory marks exactly the sharded rows
  }
  EXPECT_GT(sharded, 0u);
  ASSERT_EQ(global.buffers.size(), local.buffers.size());  // rotary inv_freq: replicated
}

TEST(Tp, LocalShapesFollowTransformersShardingOfTheLlamaPlan) {
  expect_local_shapes("llama-3-8b", 8);
  expect_local_shapes("llama-3-8b", 2);
  expect_local_shapes("mistral-7b", 4);
  expect_local_shapes("llama-2-7b", 8);
  // qwen2's q/k/v biases are colwise-sharded; an untied head (qwen2-0.5b ties it by default)
  expect_local_shapes("qwen2-0.5b", 2, {"tie_word_embeddings=false"});
  // llama's attention_bias / mlp_bias: the colwise biases sharded, the rowwise (o_proj, down_proj) replicated
  expect_local_shapes("llama-3-8b", 4, {"attention_bias=true", "mlp_bias=true", "num_hidden_layers=2"});
}

TEST(Tp, Llama3_8bRankHoldsItsShareOfTheParameters) {
  // by hand, transformers' shards of Llama-3-8B over 8 ranks: embed_tokens 128256 x 4096 replicated; per layer
  // q 512x4096, k 128x4096, v 128x4096, o 4096x512, gate/up 1792x4096, down 4096x1792, two norms 4096; final
  // norm 4096; lm_head 16032 x 4096
  const uint64_t layer = 512 * 4096 + 2 * 128 * 4096 + 4096 * 512 + 3 * 1792 * 4096 + 2 * 4096;
  const uint64_t expect = 128256ull * 4096 + 32 * layer + 4096 + 16032ull * 4096;
  Scenario s = scenario_of("llama-3-8b", {{"tp", "8"}});
  EXPECT_EQ(parameter_count(resolve(s, MapFileReader()).inventory).value, expect);
}

TEST(Tp, RefusesWhatIsNotSimulatedNamingIt) {
  auto msg = [](Scenario s) { return testing::error_of([&] { (void)resolve(s, MapFileReader()); }); };
  EXPECT_NE(msg(scenario_of("gpt2", {{"tp", "2"}})).find("gpt2"), std::string::npos);
  EXPECT_NE(msg(scenario_of("qwen3-0.6b", {{"tp", "2"}})).find("qwen3"), std::string::npos);
  EXPECT_NE(msg(scenario_of("mixtral-8x7b", {{"tp", "2"}})).find("mixtral"), std::string::npos);
  EXPECT_NE(msg(scenario_of("qwen2-0.5b", {{"tp", "2"}})).find("tie_word_embeddings"), std::string::npos);
  // Llama-3-8B has 8 kv heads: 16 ranks would get uneven (empty) shards
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "16"}})).find("num_key_value_heads"), std::string::npos);
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "2"}, {"sequence_parallel", "true"}, {"attention", "eager"}})).find("sequence"),
            std::string::npos);
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"sequence_parallel", "false"}})).find("--tp"), std::string::npos);
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "2"}, {"dp", "2"}})).find("data parallel"), std::string::npos);
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "2"}, {"loss", "chunked"}})).find("loss"), std::string::npos);
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "4"}, {"gpus", "6xh100-80gb"}})).find("divide"), std::string::npos);
}

TEST(Tp, GpusAreTensorParallelGroupsTimesDataParallelRanks) {
  Scenario s = scenario_of("llama-3-8b", {{"tp", "8"}, {"gpus", "8xh100-80gb"}});
  EXPECT_EQ(resolve(s, MapFileReader()).setup.dp, 1u);
  Scenario two = scenario_of("llama-3-8b", {{"tp", "4"}, {"gpus", "8xh100-80gb"}});  // dp 2 under DDP: not composed (fsdp2 is: tp_fsdp_test.cc)
  EXPECT_THROW(resolve(two, MapFileReader()), FieldError);
}

// Saved activations per decoder layer of transformers' LlamaDecoderLayer under tp ranks, eager attention, bf16
// weights (no autocast), no dropout; derived op by op from modeling_llama.py and autograd's save rules:
//   each LlamaRMSNorm: h.to(float32) saved by pow (4sbh), rsqrt's output (4sb), h.to(bf16) saved by
//     weight * h (2sbh), its output saved by the next linears (2sbh)          -> 2 norms: 16sbh + 8sb
//   q*cos and rotate_half(q)*sin save cos and sin only (the rotary table does not require grad)
//   matmul(q, k^T) saves q_embed (2sb(aD/t)) and repeat_kv(k); softmax(float32) saves its output
//     (4 b(a/t) s^2), .to(bf16) is saved by matmul(attn, v) (2 b(a/t) s^2) with repeat_kv(v). repeat_kv
//     (expand then reshape) copies to a/t heads, 2sb(aD/t) each, unless the rank holds one kv head: then the
//     reshape merges a size-1 dim and is a view with a 0 stride; torch.matmul's bmm path then reshapes it to
//     (b * a/t, s, D), again a view when b = 1 (the (g/t = 1)-head tensor saved, 2sb(gD/t)) and otherwise a
//     copy of 2sb(aD/t) that bmm saves (at::native _matmul_impl: expand(...).reshape({batch, n, m}))
//   transpose(1, 2).contiguous() saved by o_proj (2sb(aD/t)); o_proj's partial output is not saved and
//     all_reduce_forward's clone feeds the residual add, which saves nothing
//   silu saves gate's output, mul saves silu's output and up's output, down saves the product: 4 x 2sb(F/t)
// Total, with r = a heads (g for one local kv head and b = 1): 16sbh + 8sb + (sb/t)(4aD + 4rD + 8F) + 6as^2b/t. With
// aD = h and r = a: sbh(16 + 8/t + 8F/(ht) + 6as/(ht)) + 8sb, the analogue of Korthikanti's
// sbh(10 + 24/t + 5as/(ht)) for GPT-3 (fp16 LayerNorm, dropout masks, 4h GELU MLP).
uint64_t llama_layer_saved(uint64_t s, uint64_t b, uint64_t h, uint64_t a, uint64_t g, uint64_t D, uint64_t F,
                           uint64_t t) {
  const uint64_t r = g / t == 1 && b == 1 ? g : a;
  return 16 * s * b * h + 8 * s * b + s * b * (4 * a * D + 4 * r * D + 8 * F) / t + 6 * a * s * s * b / t;
}

uint64_t simulated_layer_saved(uint64_t t, uint64_t seq, uint64_t batch) {
  auto saved = [&](int layers) {
    Scenario s = scenario_of("llama-3-8b", {{"precision", "bf16"}, {"attention", "eager"}, {"steps", "1"}});
    set_field(s, "overrides", fmt::format("num_hidden_layers={}", layers));
    set_field(s, "tp", std::to_string(t));
    set_field(s, "batch", std::to_string(batch));
    set_field(s, "seq", std::to_string(seq));
    return testing::run(s).peak.saved_activations.value;
  };
  return saved(2) - saved(1);
}

TEST(Tp, SavedActivationsPerLayerEqualTheClosedForm) {
  for (uint64_t t : {1, 2, 4, 8}) {
    EXPECT_EQ(simulated_layer_saved(t, 512, 2), llama_layer_saved(512, 2, 4096, 32, 8, 128, 14336, t)) << "tp " << t;
  }
  EXPECT_EQ(simulated_layer_saved(8, 256, 1), llama_layer_saved(256, 1, 4096, 32, 8, 128, 14336, 8));
}

}  // namespace
}  // namespace trainmem
