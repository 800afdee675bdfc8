// The Llama family as transformers builds it: LlamaForCausalLM and the models that share its layout
// (mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral). Differences are spec fields, each read in one place:
//   qwen2: q/k/v biases            qwen3: q_norm/k_norm (D)      gemma2: 4 RMSNorms per layer
//   phi3: fused qkv_proj and gate_up_proj                        mixtral: router + E experts per layer
//   gemma3_text: q/k norms, 4 norms, a rotary table per layer type
//   starcoder2: LayerNorms with bias, biased q/k/v/o, c_fc/c_proj MLP with bias
//   qwen2_moe / qwen3_moe: router + E experts (+ qwen2_moe's gated shared expert) in the sparse layers
//   deepseek_v3: latent attention (MLA); experts, router (+ e_score_correction_bias) and shared experts from
//   layer first_k_dense_replace on
// B=micro-batch T=seq C=hidden L=layers NH=heads KV=kv-heads D=head-dim F=ffn V=vocab E=experts
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

namespace {

// DeepseekV3Attention.__init__ (modular_deepseek_v3.py @000c33f), in registration order:
//   q_lora_rank None: q_proj = Linear(C, NH * qk_head_dim, bias=False)
//   else: q_a_proj = Linear(C, q_lora_rank, bias=attention_bias), q_a_layernorm = RMSNorm(q_lora_rank),
//         q_b_proj = Linear(q_lora_rank, NH * qk_head_dim, bias=False)
//   kv_a_proj_with_mqa = Linear(C, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
//   kv_a_layernorm = RMSNorm(kv_lora_rank)
//   kv_b_proj = Linear(kv_lora_rank, NH * (qk_nope_head_dim + v_head_dim), bias=False)
//   o_proj = Linear(NH * v_head_dim, C, bias=attention_bias)
void mla_rows(const ModelSpec& m, const std::string& p, Table& t) {
  const auto& a = m.attn.mla;
  const uint64_t C = m.hidden, NH = m.attn.heads, QK = m.attn.head_dim;
  const bool bias = m.attn.qkv_bias;  // attention_bias
  const std::string s = p + "self_attn.";
  if (a.q_lora_rank == 0) {
    t.param(s + "q_proj.weight", {NH * QK, C});
  } else {
    t.param(s + "q_a_proj.weight", {a.q_lora_rank, C});
    if (bias) t.param(s + "q_a_proj.bias", {a.q_lora_rank});
    t.param(s + "q_a_layernorm.weight", {a.q_lora_rank});
    t.param(s + "q_b_proj.weight", {NH * QK, a.q_lora_rank});
  }
  t.param(s + "kv_a_proj_with_mqa.weight", {a.kv_lora_rank + a.qk_rope, C});
  if (bias) t.param(s + "kv_a_proj_with_mqa.bias", {a.kv_lora_rank + a.qk_rope});
  t.param(s + "kv_a_layernorm.weight", {a.kv_lora_rank});
  t.param(s + "kv_b_proj.weight", {NH * (a.qk_nope + a.v_head_dim), a.kv_lora_rank});
  t.param(s + "o_proj.weight", {C, NH * a.v_head_dim});
  if (bias) t.param(s + "o_proj.bias", {C});
}

// DeepseekV3MoE.__init__: experts (DeepseekV3NaiveMoe: MixtralExperts' gate_up_proj (E, 2F, C), down_proj
// (E, C, F), F = moe_intermediate_size), gate (DeepseekV3TopkRouter: weight = nn.Parameter((E, C)), then
// register_buffer("e_score_correction_bias", torch.zeros(E))), shared_experts (DeepseekV3MLP = Qwen2MoeMLP:
// gate_proj, up_proj, down_proj without bias, intermediate moe_intermediate_size * n_shared_experts).
void deepseek_moe_rows(const ModelSpec& m, const std::string& p, Table& t) {
  const uint64_t C = m.hidden, F = m.moe.ffn, E = m.moe.experts, S = m.moe.shared_ffn;
  t.param(p + "mlp.experts.gate_up_proj", {E, 2 * F, C});
  t.param(p + "mlp.experts.down_proj", {E, C, F});
  t.raw_param(p + "mlp.gate.weight", {E, C});
  t.buffer(p + "mlp.gate.e_score_correction_bias", {E}, DType::kF32, true);
  t.param(p + "mlp.shared_experts.gate_proj.weight", {S, C});
  t.param(p + "mlp.shared_experts.up_proj.weight", {S, C});
  t.param(p + "mlp.shared_experts.down_proj.weight", {C, S});
}

void attention_rows(const ModelSpec& m, const std::string& p, Table& t) {
  if (m.attn.mla.kv_lora_rank > 0) {
    mla_rows(m, p, t);
    return;
  }
  const uint64_t C = m.hidden, D = m.attn.head_dim, Q = m.attn.heads * D, KV = m.attn.kv_heads * D;
  const std::string a = p + "self_attn.";
  if (m.attn.fused_qkv) {
    // Phi3Attention registers o_proj before qkv_proj.
    t.param(a + "o_proj.weight", {C, Q});
    t.param(a + "qkv_proj.weight", {Q + 2 * KV, C});
    return;
  }
  t.param(a + "q_proj.weight", {Q, C});
  if (m.attn.qkv_bias) t.param(a + "q_proj.bias", {Q});
  t.param(a + "k_proj.weight", {KV, C});
  if (m.attn.qkv_bias) t.param(a + "k_proj.bias", {KV});
  t.param(a + "v_proj.weight", {KV, C});
  if (m.attn.qkv_bias) t.param(a + "v_proj.bias", {KV});
  t.param(a + "o_proj.weight", {C, Q});
  if (m.attn.out_bias) t.param(a + "o_proj.bias", {C});
  if (m.attn.qk_norm) {
    t.param(a + "q_norm.weight", {D});
    t.param(a + "k_norm.weight", {D});
  }
}

void moe_rows(const ModelSpec& m, const std::string& p, Table& t) {
  // MixtralSparseMoeBlock: a router gate (MixtralTopKRouter.weight (E, C)) and E experts stored as two fused
  // 3-D tensors (transformers 5.x MixtralExperts: gate_up_proj (E, 2F, C), down_proj (E, C, F)).
  // Qwen2MoeSparseMoeBlock.__init__ adds shared_expert (Qwen2MoeMLP with shared_expert_intermediate_size) and
  // shared_expert_gate (Linear(C, 1, bias=False)) after them; Qwen3MoeSparseMoeBlock registers experts before gate.
  const uint64_t C = m.hidden, F = m.moe.ffn, E = m.moe.experts;
  const bool experts_first = m.model_type == "qwen3_moe";
  // under expert parallelism (ep.h) the experts are Shard(0): E / ep local experts; the router stays (E, C)
  const uint64_t EL = E / (m.ep == 0 ? 1 : m.ep);
  if (!experts_first) t.raw_param(p + "mlp.gate.weight", {E, C});
  t.param(p + "mlp.experts.gate_up_proj", {EL, 2 * F, C});
  t.param(p + "mlp.experts.down_proj", {EL, C, F});
  if (experts_first) t.raw_param(p + "mlp.gate.weight", {E, C});
  if (m.moe.shared_ffn > 0) {
    const uint64_t S = m.moe.shared_ffn;
    t.param(p + "mlp.shared_expert.gate_proj.weight", {S, C});
    t.param(p + "mlp.shared_expert.up_proj.weight", {S, C});
    t.param(p + "mlp.shared_expert.down_proj.weight", {C, S});
    t.param(p + "mlp.shared_expert_gate.weight", {1, C});
  }
}

void mlp_rows(const ModelSpec& m, uint64_t l, const std::string& p, Table& t) {
  const uint64_t C = m.hidden, F = m.mlp.ffn;
  if (is_moe_layer(m, l)) {
    if (m.model_type == "deepseek_v3") {
      deepseek_moe_rows(m, p, t);
    } else {
      moe_rows(m, p, t);
    }
    return;
  }
  if (m.mlp.fused_gate_up) {
    t.param(p + "mlp.gate_up_proj.weight", {2 * F, C});
    t.param(p + "mlp.down_proj.weight", {C, F});
    return;
  }
  if (!m.mlp.gated) {
    // Starcoder2MLP registers c_fc (C -> F) then c_proj (F -> C)
    t.param(p + "mlp.c_fc.weight", {F, C});
    if (m.mlp.bias) t.param(p + "mlp.c_fc.bias", {F});
    t.param(p + "mlp.c_proj.weight", {C, F});
    if (m.mlp.bias) t.param(p + "mlp.c_proj.bias", {C});
    return;
  }
  t.param(p + "mlp.gate_proj.weight", {F, C});
  if (m.mlp.bias) t.param(p + "mlp.gate_proj.bias", {F});
  t.param(p + "mlp.up_proj.weight", {F, C});
  if (m.mlp.bias) t.param(p + "mlp.up_proj.bias", {F});
  t.param(p + "mlp.down_proj.weight", {C, F});
  if (m.mlp.bias) t.param(p + "mlp.down_proj.bias", {C});
}

void norm_rows(const ModelSpec& m, const std::string& p, Table& t) {
  const uint64_t C = m.hidden;
  const bool ln = m.norm.kind == NormKind::kLayerNorm;  // Starcoder2's nn.LayerNorm: weight, bias
  t.param(p + "input_layernorm.weight", {C});
  if (ln) t.param(p + "input_layernorm.bias", {C});
  t.param(p + "post_attention_layernorm.weight", {C});
  if (ln) t.param(p + "post_attention_layernorm.bias", {C});
  if (m.norms_per_layer == 4) {  // Gemma2 / Gemma3 sandwich norms
    t.param(p + "pre_feedforward_layernorm.weight", {C});
    t.param(p + "post_feedforward_layernorm.weight", {C});
  }
}

}  // namespace

void rotary_buffers(const std::string& prefix, uint64_t rotary_dim, Table& t) {
  // inv_freq = 1 / base ** (arange(0, dim, 2) / dim): one entry per pair of rotated dims.
  const uint64_t n = rotary_dim / 2 + rotary_dim % 2;
  t.buffer(prefix + "inv_freq", {n}, DType::kF32, false);
  t.buffer(prefix + "original_inv_freq", {n}, DType::kF32, false);
}

void llama_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size;
  // under sequence parallelism (sp.h) embed_tokens is RowwiseParallel: this rank's V / tp rows
  t.param("model.embed_tokens.weight", {m.sp ? V / m.tp : V, C});
  if (m.embed.scaled_by_sqrt_hidden) {
    // Gemma's GemmaTextScaledWordEmbedding: register_buffer("embed_scale", torch.tensor(hidden**0.5),
    // persistent=False), a 0-dim float32 tensor.
    t.buffer("model.embed_tokens.embed_scale", {}, DType::kF32, false);
  }
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    // DecoderLayer registers self_attn, mlp, then its norms.
    attention_rows(m, p, t);
    mlp_rows(m, l, p, t);
    norm_rows(m, p, t);
  }
  t.param("model.norm.weight", {C});
  if (m.norm.kind == NormKind::kLayerNorm) t.param("model.norm.bias", {C});
  // One rotary embedding for the whole model (model.rotary_emb since transformers 4.45), registered after
  // the final norm.
  if (!m.attn.sliding_layers.empty()) {
    // Gemma3RotaryEmbedding (5.x): for each layer type of config.layer_types,
    // register_buffer(f"{layer_type}_inv_freq", ...) and f"{layer_type}_original_inv_freq" (a clone). transformers
    // walks set(config.layer_types), whose order is Python's string hashing; listed here in order of first use.
    bool sliding_done = false, full_done = false;
    for (bool sliding : m.attn.sliding_layers) {
      bool& done = sliding ? sliding_done : full_done;
      if (done) continue;
      done = true;
      rotary_buffers(sliding ? "model.rotary_emb.sliding_attention_" : "model.rotary_emb.full_attention_",
                     m.attn.rotary_dim, t);
    }
  } else {
    rotary_buffers("model.rotary_emb.", m.attn.rotary_dim, t);
  }
  if (m.head == Head::kSeqCls) {
    // GenericForSequenceClassification: self.score = nn.Linear(hidden_size, num_labels, bias=False), no lm_head
    t.param("score.weight", {m.num_labels, C});
    return;
  }
  // under tensor parallelism lm_head is colwise_gather_output: this rank's V / tp rows (tp.h)
  if (!m.embed.tied) t.param("lm_head.weight", {V / m.tp, C});
}

}  // namespace trainmem::models
