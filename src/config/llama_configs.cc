// Config readers for the Llama family. One table holds each model type's transformers defaults and the
// architecture facts its modeling file hard-wires; read_llama_family reads the keys.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"

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
    // Qwen2MoeConfig / Qwen3MoeConfig (configuration_qwen2_moe.py, configuration_qwen3_moe.py, transformers 5.x
    // @008e574); qwen2_moe's q/k/v biases are its qkv_bias key (read below), qwen3_moe has no head_dim field
    // (Qwen3Attention: getattr(config, "head_dim", None) or hidden_size // num_attention_heads)
    {"qwen2_moe", "Qwen2MoeConfig", 151936, 2048, 5632, 24, 16, 16, 0,   32768,   false, "silu",
     false, false, false, false, false, 2, true, false},
    {"qwen3_moe", "Qwen3MoeConfig", 151936, 2048, 6144, 24, 32, 4,  0,   32768,   false, "silu",
     false, true, false, true, false, 2, true, false},
};

const LlamaFamilyDefaults* find_family(const std::string& t) {
  for (const auto& d : kFamily) {
    if (d.model_type == t) return &d;
  }
  return nullptr;
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
  m.mlp.act = model_type == "gemma2" ? read_activation(r, {"hidden_activation"}, d->act)
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
  m.dropout.attn = read_probability(r, {"attention_dropout"}, 0.0);
  if (model_type == "phi3") {
    m.dropout.embd = read_probability(r, {"embd_pdrop"}, 0.0);
    m.dropout.resid = read_probability(r, {"resid_pdrop"}, 0.0);
  }
  return true;
}

}  // namespace trainmem::config
