// Config readers for the Llama family. One table holds each model type's transformers defaults and the
// architecture facts its modeling file hard-wires; read_llama_family reads the keys.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"
#include "trainmem/units.h"

namespace trainmem::config {

namespace {

struct LlamaFamilyDefaults {
  std::string_view model_type;
  std::string_view config_class;  // named in the warning for a missing shape key
  uint64_t vocab, hidden, ffn, layers, heads;
  uint64_t kv_heads;   // 0: num_key_value_heads=None -> num_attention_heads
  uint64_t head_dim;   // 0: head_dim=None -> hidden_size // num_attention_heads
  uint64_t max_pos;
  bool tied;
  std::string_view act;
  // Architecture facts of the modeling file (not config keys):
  bool qkv_bias_fixed;      // qwen2: q/k/v always biased, o_proj never
  bool reads_attention_bias;  // attention_bias key exists (q, k, v and o biases)
  bool reads_mlp_bias;      // mlp_bias key exists
  bool qk_norm;             // qwen3
  bool fused;               // phi3: qkv_proj and gate_up_proj
  uint64_t norms_per_layer; // gemma2: 4
  bool moe;                 // mixtral
  bool scaled_embeddings;   // gemma, gemma2: embeddings * sqrt(hidden)
};

// Defaults from each configuration_<model_type>.py in transformers (the __init__ signature).
constexpr LlamaFamilyDefaults kFamily[] = {
    // type      config class     vocab   hidden ffn    L   NH  KV  D    max_pos  tied  act
    {"llama",    "LlamaConfig",    32000,  4096, 11008, 32, 32, 0,  0,   2048,    false, "silu",
     false, true, true, false, false, 2, false, false},
    {"mistral",  "MistralConfig",  32000,  4096, 14336, 32, 32, 8,  0,   131072,  false, "silu",
     false, false, false, false, false, 2, false, false},
    {"qwen2",    "Qwen2Config",    151936, 4096, 22016, 32, 32, 32, 0,   32768,   false, "silu",
     true, false, false, false, false, 2, false, false},
    {"qwen3",    "Qwen3Config",    151936, 4096, 22016, 32, 32, 32, 128, 32768,   false, "silu",
     false, true, false, true, false, 2, false, false},
    {"gemma",    "GemmaConfig",    256000, 3072, 24576, 28, 16, 16, 256, 8192,    true,  "gelu_pytorch_tanh",
     false, true, false, false, false, 2, false, true},
    {"gemma2",   "Gemma2Config",   256000, 2304, 9216,  26, 8,  4,  256, 8192,    true,  "gelu_pytorch_tanh",
     false, true, false, false, false, 4, false, true},
    {"phi3",     "Phi3Config",     32064,  3072, 8192,  32, 32, 0,  0,   4096,    false, "silu",
     false, false, false, false, true, 2, false, false},
    {"mixtral",  "MixtralConfig",  32000,  4096, 14336, 32, 32, 8,  0,   131072,  false, "silu",
     false, false, false, false, false, 2, true, false},
    // Gemma3TextConfig: vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    // num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    // max_position_embeddings=131_072, tie_word_embeddings=True, attention_bias=False; Gemma3Attention always has
    // q_norm / k_norm (Gemma3RMSNorm(head_dim)), Gemma3DecoderLayer four norms, Gemma3TextScaledWordEmbedding.
    {"gemma3_text", "Gemma3TextConfig", 262208, 2304, 9216, 26, 8, 4, 256, 131072, true, "gelu_pytorch_tanh",
     false, true, false, true, false, 4, false, true},
    // Starcoder2Config: vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
    // num_attention_heads=24, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh", max_position_embeddings=4096,
    // tie_word_embeddings not passed (PretrainedConfig's True); use_bias, the LayerNorms and the non-gated MLP are
    // read in read_starcoder2.
    {"starcoder2", "Starcoder2Config", 49152, 3072, 12288, 30, 24, 2, 0, 4096, true, "gelu_pytorch_tanh",
     false, false, false, false, false, 2, false, false},
    // Qwen2MoeConfig / Qwen3MoeConfig (configuration_qwen2_moe.py, configuration_qwen3_moe.py, transformers 5.x
    // @008e574); qwen2_moe's q/k/v biases are its qkv_bias key (read below), qwen3_moe has no head_dim field
    // (Qwen3Attention: getattr(config, "head_dim", None) or hidden_size // num_attention_heads)
    {"qwen2_moe", "Qwen2MoeConfig", 151936, 2048, 5632, 24, 16, 16, 0,   32768,   false, "silu",
     false, false, false, false, false, 2, true, false},
    {"qwen3_moe", "Qwen3MoeConfig", 151936, 2048, 6144, 24, 32, 4,  0,   32768,   false, "silu",
     false, true, false, true, false, 2, true, false},
    // DeepseekV3Config (configuration_deepseek_v3.py, transformers 5.x @001f85b): vocab_size=129280,
    // hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
    // num_key_value_heads=128, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
    // attention_bias=False. A llama-family row: modular_deepseek_v3.py (@000c33f) builds DeepseekV3DecoderLayer,
    // DeepseekV3Model and DeepseekV3ForCausalLM from LlamaDecoderLayer, LlamaModel and LlamaForCausalLM (same
    // forward, same norms, one rotary table); only the attention (MLA) and the MoE block are its own, read in
    // read_deepseek_v3 and branched on in llama.cc / moe.cc.
    {"deepseek_v3", "DeepseekV3Config", 129280, 7168, 18432, 61, 128, 128, 0, 4096, false, "silu",
     false, true, false, false, false, 2, false, false},
};

const LlamaFamilyDefaults* find_family(const std::string& t) {
  for (const auto& d : kFamily) {
    if (d.model_type == t) return &d;
  }
  return nullptr;
}

// The sliding window of the layers that have one (0: none), as each configuration class decides it:
// MistralConfig, MixtralConfig, Phi3Config: sliding_window (default 4096, None, None), every layer;
// Qwen2Config, Qwen3Config: `self.sliding_window = sliding_window if self.use_sliding_window else None`
// (use_sliding_window=False, sliding_window=4096), the layers from max_window_layers on;
// Gemma2Config: sliding_window=4096, every other layer. Llama and Gemma have none.
uint64_t read_sliding_window(const KeyReader& r, const std::string& t, uint64_t layers) {
  if (t == "mistral") return r.optional_integer({"sliding_window"}, 1, kMaxPositions).value_or(4096);
  if (t == "mixtral" || t == "phi3") return r.optional_integer({"sliding_window"}, 1, kMaxPositions).value_or(0);
  if (t == "gemma2") return r.optional_integer({"sliding_window"}, 1, kMaxPositions).value_or(4096);
  if (t == "qwen2" || t == "qwen3" || t == "qwen2_moe" || t == "qwen3_moe") {
    const bool on = r.boolean({"use_sliding_window"}, false);
    const uint64_t w = r.optional_integer({"sliding_window"}, 1, kMaxPositions).value_or(4096);
    const uint64_t from = r.optional_integer({"max_window_layers"}, 0, kMaxLayers).value_or(28);
    // layer_types: "sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
    return on && layers > from ? w : 0;
  }
  // Gemma3TextConfig sliding_window=4096 on its sliding layers; Starcoder2Config sliding_window=None, every layer
  if (t == "gemma3_text") return r.optional_integer({"sliding_window"}, 1, kMaxPositions).value_or(4096);
  if (t == "starcoder2") return r.optional_integer({"sliding_window"}, 1, kMaxPositions).value_or(0);
  return 0;
}

// Gemma3TextConfig's attention pattern and softcaps: attn_logit_softcapping=None, final_logit_softcapping=None
// (0 here: off); sliding_window=4096 (the mask of the sliding layers; its size changes no tensor's shape);
// layer_types=None -> ["sliding_attention" if bool((i + 1) % self._sliding_window_pattern) else "full_attention"
// for i in range(self.num_hidden_layers)] with _sliding_window_pattern = kwargs.get("sliding_window_pattern", 6).
void read_gemma3_layers(const KeyReader& r, ModelSpec& m) {
  m.attn.softcap = r.has({"attn_logit_softcapping"}) ? r.number({"attn_logit_softcapping"}, 0.0, 0.0, 1e9) : 0.0;
  m.final_softcap = r.has({"final_logit_softcapping"}) ? r.number({"final_logit_softcapping"}, 0.0, 0.0, 1e9) : 0.0;
  r.integer({"sliding_window"}, 4096, 1, kMaxPositions);
  const uint64_t pattern = r.integer({"sliding_window_pattern"}, 6, 1, kMaxLayers);
  m.attn.sliding_layers.clear();
  if (const nlohmann::json* types = r.find({"layer_types"}); types && !types->is_null()) {
    if (!types->is_array() || types->size() != m.layers) {
      r.fail("layer_types", *types, fmt::format("a list of {} (num_hidden_layers) \"sliding_attention\" or "
                                                "\"full_attention\" entries", m.layers));
    }
    for (const nlohmann::json& t : *types) {
      if (t == "sliding_attention" || t == "full_attention") {
        m.attn.sliding_layers.push_back(t == "sliding_attention");
      } else {
        r.fail("layer_types", t, "\"sliding_attention\" or \"full_attention\"");
      }
    }
    return;
  }
  for (uint64_t i = 0; i < m.layers; ++i) m.attn.sliding_layers.push_back((i + 1) % pattern != 0);
}

// Starcoder2 (modeling_starcoder2.py, generated from modular_starcoder2.py on Mistral's): Starcoder2Config
// use_bias=True (q/k/v/o_proj and Starcoder2MLP's c_fc/c_proj: nn.Linear(..., bias=config.use_bias)),
// norm_epsilon=1e-5 (input_layernorm, post_attention_layernorm and the final norm are nn.LayerNorm, with bias),
// residual_dropout=0.0 (after o_proj and after c_proj), embedding_dropout=0.0 (on the embeddings), sliding_window=None
// (the mask only), attention_dropout=0.0. Starcoder2MLP: c_proj(act(c_fc(x))), not gated.
void read_starcoder2(const KeyReader& r, ModelSpec& m) {
  const bool bias = r.boolean({"use_bias"}, true);
  m.attn.qkv_bias = m.attn.out_bias = m.mlp.bias = bias;
  m.mlp.gated = false;
  m.norm = {NormKind::kLayerNorm, true, true};
  m.dropout.resid = read_probability(r, {"residual_dropout"}, 0.0);
  m.dropout.embd = read_probability(r, {"embedding_dropout"}, 0.0);
  r.optional_integer({"sliding_window"}, 1, kMaxPositions);
}

// DeepseekV3Config (configuration_deepseek_v3.py @001f85b): moe_intermediate_size=2048, n_shared_experts=1,
// n_routed_experts=256 (attribute_map num_local_experts -> n_routed_experts), routed_scaling_factor=2.5,
// kv_lora_rank=512, q_lora_rank=1536 (None: no query compression), qk_rope_head_dim=64, v_head_dim=128,
// qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
// norm_topk_prob=True, rope_interleave=True; qk_head_dim = qk_nope_head_dim + qk_rope_head_dim and
// head_dim = qk_rope_head_dim (LlamaRotaryEmbedding's dim). DeepseekV3ForCausalLM is LlamaForCausalLM: there is
// no router auxiliary loss, so output_router_logits / router_aux_loss_coef are not read.
void read_deepseek_v3(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "transformers' DeepseekV3Config";
  auto& a = m.attn.mla;
  a.kv_lora_rank = r.shape({"kv_lora_rank"}, 512, 1, kMaxWidth, kDefaults);
  a.q_lora_rank = r.given_null("q_lora_rank") ? 0 : r.shape({"q_lora_rank"}, 1536, 1, kMaxWidth, kDefaults);
  a.qk_rope = r.shape({"qk_rope_head_dim"}, 64, 1, kMaxWidth, kDefaults);
  a.qk_nope = r.shape({"qk_nope_head_dim"}, 128, 1, kMaxWidth, kDefaults);
  a.v_head_dim = r.shape({"v_head_dim"}, 128, 1, kMaxWidth, kDefaults);
  a.interleave = r.boolean({"rope_interleave"}, true);
  if (a.qk_rope % 2 != 0) {
    r.fail("qk_rope_head_dim", a.qk_rope, "an even number (rotate_half splits the rotated dims in two halves)");
  }
  // DeepseekV3Attention: num_key_value_groups = num_attention_heads // num_key_value_heads, but the keys it
  // builds have num_attention_heads heads (k_rot.expand to k_pass's heads): repeat_kv with a group above 1
  // would not match the queries. Every DeepSeek-V3 config has them equal.
  if (m.attn.kv_heads != m.attn.heads) {
    r.fail("num_key_value_heads", m.attn.kv_heads,
           fmt::format("num_attention_heads = {} (MLA's keys have one head per query head)", m.attn.heads));
  }
  m.attn.head_dim = a.qk_nope + a.qk_rope;
  m.attn.rotary_dim = a.qk_rope;
  // The rotary table: LlamaRotaryEmbedding with rope_parameters' rope_type. "default" and "yarn" (DeepSeek-V3's)
  // give the same inv_freq shape (dim / 2) and the same forward ops (yarn changes values and
  // attention_scaling, and DeepseekV3Attention's softmax scale by yarn_get_mscale: values only); the dynamic
  // types re-compute inv_freq inside the forward (dynamic_rope_update): not simulated.
  for (std::string_view key : {"rope_parameters", "rope_scaling"}) {
    const nlohmann::json* rope = r.find({key});
    if (!rope || !rope->is_object()) continue;
    auto it = rope->find("rope_type");
    if (it == rope->end()) it = rope->find("type");
    if (it == rope->end()) continue;
    if (!it->is_string() || (*it != "default" && *it != "yarn")) {
      r.fail(key, *rope, "rope_type \"default\" or \"yarn\" (the dynamic RoPE types are not simulated)");
    }
  }
  // DeepseekV3MoE: experts (DeepseekV3NaiveMoe, MixtralExperts' 3-D layout, intermediate_dim =
  // moe_intermediate_size), gate (DeepseekV3TopkRouter), shared_experts (DeepseekV3MLP with intermediate_size
  // moe_intermediate_size * n_shared_experts) in every layer from first_k_dense_replace on.
  auto& e = m.moe;
  e.experts = r.shape({"n_routed_experts", "num_local_experts"}, 256, 1, kMaxExperts, kDefaults);
  e.top_k = r.shape({"num_experts_per_tok"}, 8, 1, kMaxExperts, kDefaults);
  e.ffn = r.shape({"moe_intermediate_size"}, 2048, 1, kMaxWidth, kDefaults);
  const uint64_t shared = r.shape({"n_shared_experts"}, 1, 1, kMaxExperts, kDefaults);
  e.shared_ffn = checked_mul(e.ffn, shared, "moe_intermediate_size * n_shared_experts");
  e.groups = r.shape({"n_group"}, 8, 1, kMaxExperts, kDefaults);
  e.topk_groups = r.shape({"topk_group"}, 4, 1, kMaxExperts, kDefaults);
  e.norm_topk_prob = r.boolean({"norm_topk_prob"}, true);
  (void)r.number({"routed_scaling_factor"}, 2.5, 0.0, 1e9);
  const uint64_t dense = r.integer({"first_k_dense_replace"}, 3, 0, kMaxLayers);
  // route_tokens_to_experts: view(-1, n_group, n_routed_experts // n_group).topk(2) within each group, then
  // torch.topk(group_scores, k=topk_group) and torch.topk(scores_for_choice, k=top_k)
  if (e.experts % e.groups != 0 || e.experts / e.groups < 2) {
    r.fail("n_group", e.groups,
           fmt::format("a divisor of \"n_routed_experts\" = {} leaving at least 2 experts per group (each group "
                       "scores its top 2)", e.experts));
  }
  if (e.topk_groups > e.groups) r.fail("topk_group", e.topk_groups, fmt::format("at most \"n_group\" = {}", e.groups));
  if (e.top_k > e.experts) {
    r.fail("num_experts_per_tok", e.top_k, fmt::format("at most \"n_routed_experts\" = {}", e.experts));
  }
  m.moe.dense_layers.clear();
  for (uint64_t l = 0; l < dense && l < m.layers; ++l) m.moe.dense_layers.push_back(l);
}

}  // namespace

bool read_llama_family(const KeyReader& r, const std::string& model_type, ModelSpec& m) {
  const LlamaFamilyDefaults* d = find_family(model_type);
  if (!d) return false;
  m.family = Family::kLlama;
  const std::string defaults_of = fmt::format("transformers' {}", d->config_class);
  m.embed.vocab_size = r.shape({"vocab_size"}, d->vocab, 1, kMaxVocab, defaults_of);
  m.hidden = r.shape({"hidden_size"}, d->hidden, 1, kMaxWidth, defaults_of);
  m.mlp.ffn = r.shape({"intermediate_size"}, d->ffn, 1, kMaxWidth, defaults_of);
  m.layers = r.shape({"num_hidden_layers"}, d->layers, 1, kMaxLayers, defaults_of);
  // A default of None (0 here) is derived from other keys, not a guess: only a numeric default warns.
  m.attn.kv_heads = d->kv_heads ? r.shape({"num_key_value_heads"}, d->kv_heads, 1, kMaxHeads, defaults_of)
                                : r.optional_integer({"num_key_value_heads"}, 1, kMaxHeads).value_or(0);
  m.attn.head_dim = d->head_dim ? r.shape({"head_dim"}, d->head_dim, 1, kMaxWidth, defaults_of)
                                : r.optional_integer({"head_dim"}, 1, kMaxWidth).value_or(0);
  read_heads(r, {"num_attention_heads"}, d->heads, defaults_of, {"hidden_size"}, m.hidden, m.attn);
  m.max_positions = 0;  // rotary positions: max_position_embeddings does not bound training sequences
  m.attn.rotary_dim = m.attn.head_dim;
  if (model_type == "phi3") {
    // Phi3RotaryEmbedding rotates int(head_dim * partial_rotary_factor) dims.
    const double f = r.number({"partial_rotary_factor"}, 1.0, 0.0, 1.0);
    m.attn.rotary_dim = static_cast<uint64_t>(static_cast<double>(m.attn.head_dim) * f);
  }
  check_rotary_dims(r, r.has({"head_dim"}) ? "head_dim" : "hidden_size", m);
  m.embed.tied = r.boolean({"tie_word_embeddings"}, d->tied);
  m.embed.scaled_by_sqrt_hidden = d->scaled_embeddings;
  // Gemma2MLP uses ACT2FN[config.hidden_activation]; every other MLP (GemmaMLP inherits LlamaMLP) uses
  // ACT2FN[config.hidden_act].
  m.mlp.act = model_type == "gemma2" || model_type == "gemma3_text" ? read_activation(r, {"hidden_activation"}, d->act)
                                                                    : read_activation(r, {"hidden_act"}, d->act);
  m.mlp.gated = true;
  m.mlp.fused_gate_up = d->fused;
  m.attn.fused_qkv = d->fused;
  m.attn.qk_norm = d->qk_norm;
  if (d->qkv_bias_fixed) m.attn.qkv_bias = true;
  if (d->reads_attention_bias) m.attn.qkv_bias = m.attn.out_bias = r.boolean({"attention_bias"}, false);
  if (d->reads_mlp_bias) m.mlp.bias = r.boolean({"mlp_bias"}, false);
  m.norm = {NormKind::kRmsNorm, false, true};
  m.norms_per_layer = d->norms_per_layer;
  if (model_type == "gemma2") m.attn.softcap = r.number({"attn_logit_softcapping"}, 50.0, 0.0, 1e9);
  if (model_type == "gemma3_text") read_gemma3_layers(r, m);
  if (model_type == "starcoder2") read_starcoder2(r, m);
  if (model_type == "qwen2_moe") {
    // Qwen2MoeAttention: q/k/v_proj bias=config.qkv_bias (qkv_bias: bool = True), o_proj bias=False
    m.attn.qkv_bias = r.boolean({"qkv_bias"}, true);
  }
  if (d->moe && model_type != "mixtral") {
    // Qwen2MoeConfig: moe_intermediate_size: int = 1408, shared_expert_intermediate_size: int = 5632,
    // num_experts_per_tok: int = 4, num_experts: int = 60, norm_topk_prob: bool = False, decoder_sparse_step: int = 1,
    // mlp_only_layers: list[int] | None = None (-> []). Qwen3MoeConfig: moe_intermediate_size: int = 768,
    // num_experts_per_tok: int = 8, num_experts: int = 128, the rest the same and no shared expert.
    const bool q2 = model_type == "qwen2_moe";
    m.moe.experts = r.shape({"num_experts"}, q2 ? 60 : 128, 1, kMaxExperts, defaults_of);
    m.moe.top_k = r.shape({"num_experts_per_tok"}, q2 ? 4 : 8, 1, kMaxExperts, defaults_of);
    m.moe.ffn = r.shape({"moe_intermediate_size"}, q2 ? 1408 : 768, 1, kMaxWidth, defaults_of);
    if (q2) m.moe.shared_ffn = r.shape({"shared_expert_intermediate_size"}, 5632, 1, kMaxWidth, defaults_of);
    m.moe.norm_topk_prob = r.boolean({"norm_topk_prob"}, false);
    m.moe.sparse_step = r.integer({"decoder_sparse_step"}, 1, 1, kMaxLayers);
    if (const nlohmann::json* v = r.find({"mlp_only_layers"}); v && !v->is_null()) {
      const std::string expected = fmt::format("a list of layer indices below num_hidden_layers = {}", m.layers);
      if (!v->is_array()) r.fail("mlp_only_layers", *v, expected);
      for (const nlohmann::json& x : *v) {
        if (!x.is_number_unsigned() || x.get<uint64_t>() >= m.layers) r.fail("mlp_only_layers", *v, expected);
        m.moe.dense_layers.push_back(x.get<uint64_t>());
      }
    }
    if (m.moe.top_k > m.moe.experts) {
      r.fail("num_experts_per_tok", m.moe.top_k, fmt::format("at most \"num_experts\" = {}", m.moe.experts));
    }
    // Qwen*MoeForCausalLM.forward (MixtralForCausalLM's): the router aux loss when output_router_logits
    if (r.boolean({"output_router_logits"}, false)) {
      r.fail("output_router_logits", true, "false (the router's load-balancing loss is not simulated yet)");
    }
    (void)r.number({"router_aux_loss_coef"}, 0.001, 0.0, 1e9);
  }
  if (model_type == "deepseek_v3") read_deepseek_v3(r, m);
  if (model_type == "mixtral") {
    // MixtralConfig (configuration_mixtral.py, transformers 5.x @008e574): num_experts_per_tok: int = 2,
    // num_local_experts: int = 8, attribute_map = {"num_experts": "num_local_experts"},
    // output_router_logits: bool = False, router_aux_loss_coef: float = 0.001, router_jitter_noise: float = 0.0.
    // MixtralExperts: intermediate_dim = config.intermediate_size; the router always renormalizes.
    m.moe.experts = r.shape({"num_local_experts", "num_experts"}, 8, 1, kMaxExperts, defaults_of);
    m.moe.ffn = m.mlp.ffn;
    m.moe.top_k = r.shape({"num_experts_per_tok"}, 2, 1, kMaxExperts, defaults_of);
    if (m.moe.top_k > m.moe.experts) {
      r.fail("num_experts_per_tok", m.moe.top_k,
             fmt::format("at most \"num_local_experts\" = {}", m.moe.experts));
    }
    // MixtralForCausalLM.forward adds load_balancing_loss_func(...) * router_aux_loss_coef to the loss when
    // output_router_logits; MixtralSparseMoeBlock multiplies the hidden states by uniform noise in training when
    // router_jitter_noise > 0. Neither is simulated yet: refused rather than left out of the estimate.
    if (r.boolean({"output_router_logits"}, false)) {
      r.fail("output_router_logits", true, "false (the router's load-balancing loss is not simulated yet)");
    }
    (void)r.number({"router_aux_loss_coef"}, 0.001, 0.0, 1e9);
    const double jitter = r.number({"router_jitter_noise"}, 0.0, 0.0, 1.0);
    if (jitter > 0.0) r.fail("router_jitter_noise", jitter, "0.0 (router jitter in training is not simulated yet)");
  }
  m.attn.sliding_window = read_sliding_window(r, model_type, m.layers);
  m.dropout.attn = read_probability(r, {"attention_dropout"}, 0.0);
  if (model_type == "phi3") {
    m.dropout.embd = read_probability(r, {"embd_pdrop"}, 0.0);
    m.dropout.resid = read_probability(r, {"resid_pdrop"}, 0.0);
  }
  return true;
}

}  // namespace trainmem::config
