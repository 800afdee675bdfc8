// GPT-NeoX (Pythia) as transformers builds it: GPTNeoXForCausalLM. LayerNorms with bias, a fused
// query_key_value projection with bias, an untied output embedding (embed_out) by default.
// B=micro-batch T=seq C=hidden L=layers V=vocab F=ffn
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

void gpt_neox_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, F = m.mlp.ffn;
  const uint64_t QKV = m.attn.heads * m.attn.head_dim * 3;
  t.param("gpt_neox.embed_in.weight", {V, C});
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string p = fmt::format("gpt_neox.layers.{}.", l);
    // GPTNeoXLayer registers input_layernorm, post_attention_layernorm, attention, mlp.
    t.param(p + "input_layernorm.weight", {C});
    t.param(p + "input_layernorm.bias", {C});
    t.param(p + "post_attention_layernorm.weight", {C});
    t.param(p + "post_attention_layernorm.bias", {C});
    t.param(p + "attention.query_key_value.weight", {QKV, C});
    if (m.attn.qkv_bias) t.param(p + "attention.query_key_value.bias", {QKV});
    t.param(p + "attention.dense.weight", {C, C});
    if (m.attn.out_bias) t.param(p + "attention.dense.bias", {C});
    t.param(p + "mlp.dense_h_to_4h.weight", {F, C});
    t.param(p + "mlp.dense_h_to_4h.bias", {F});
    t.param(p + "mlp.dense_4h_to_h.weight", {C, F});
    t.param(p + "mlp.dense_4h_to_h.bias", {C});
  }
  t.param("gpt_neox.final_layer_norm.weight", {C});
  t.param("gpt_neox.final_layer_norm.bias", {C});
  rotary_buffers("gpt_neox.rotary_emb.", m.attn.rotary_dim, t);  // GPTNeoXModel.rotary_emb
  if (!m.embed.tied) t.param("embed_out.weight", {V, C});
}

}  // namespace trainmem::models
