// Falcon as transformers builds it: FalconForCausalLM (modeling_falcon.py, 5.x). A fused query_key_value
// FalconLinear whose width depends on the layout (multi-query, per-head, grouped), biases on every FalconLinear
// or none (config.bias), the layer norms of the layout, and a tied lm_head by default.
// B=micro-batch T=seq C=hidden L=layers NH=heads KV=kv-heads D=head-dim V=vocab F=ffn
#include <fmt/format.h>

#include <tuple>

#include "table.h"

namespace trainmem::models {

void falcon_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, F = m.mlp.ffn;
  // FalconAttention: qkv_out_dim = (num_kv_heads * 2 + num_attention_heads) * head_dim; multi_query has one key
  // and one value head (hidden_size + 2 * head_dim), the per-head layout NH of each (3 * hidden_size)
  const uint64_t QKV = (m.attn.heads + 2 * m.attn.kv_heads) * m.attn.head_dim;
  auto linear = [&](const std::string& name, uint64_t out, uint64_t in) {
    t.param(name + ".weight", {out, in});
    if (m.attn.qkv_bias) t.param(name + ".bias", {out});  // FalconLinear(..., bias=config.bias)
  };
  auto norm = [&](const std::string& name) {
    t.param(name + ".weight", {C});
    t.param(name + ".bias", {C});
  };
  t.param("transformer.word_embeddings.weight", {V, C});
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string p = fmt::format("transformer.h.{}.", l);
    // FalconDecoderLayer.__init__ assigns self_attention (query_key_value, dense) and mlp (dense_h_to_4h,
    // dense_4h_to_h) before its layer norms: (name, out_features, in_features)
    const std::tuple<const char*, uint64_t, uint64_t> linears[] = {
        {"self_attention.query_key_value", QKV, C}, {"self_attention.dense", C, C},
        {"mlp.dense_h_to_4h", F, C}, {"mlp.dense_4h_to_h", C, F}};
    for (const auto& [name, out, in] : linears) linear(p + name, out, in);
    if (!m.parallel_residual) {
      norm(p + "post_attention_layernorm");  // `if not config.parallel_attn:` assigns this one first
      norm(p + "input_layernorm");
    } else if (m.norms_per_layer == 2) {
      norm(p + "ln_attn");  // num_ln_in_parallel_attn == 2
      norm(p + "ln_mlp");
    } else {
      norm(p + "input_layernorm");
    }
  }
  norm("transformer.ln_f");
  // FalconModel assigns rotary_emb after ln_f, for ALiBi models too (inv_freq, original_inv_freq)
  rotary_buffers("transformer.rotary_emb.", m.attn.rotary_dim, t);
  if (!m.embed.tied) t.param("lm_head.weight", {V, C});
}

}  // namespace trainmem::models
