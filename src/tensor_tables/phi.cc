// Phi (phi-1, phi-1.5, phi-2) as transformers builds it: PhiForCausalLM (modeling_phi.py, 5.x). Separate biased
// q/k/v projections and `dense`, optional LayerNorms on q and k, one LayerNorm per layer, fc1/fc2 with bias, a
// final_layernorm and an lm_head with a bias.
// B=micro-batch T=seq C=hidden L=layers V=vocab F=ffn H=heads KV=kv-heads D=head-dim
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

void phi_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, F = m.mlp.ffn;
  const uint64_t H = m.attn.heads, KV = m.attn.kv_heads, D = m.attn.head_dim;
  auto linear = [&](const std::string& name, uint64_t out, uint64_t in) {
    t.param(name + ".weight", {out, in});
    t.param(name + ".bias", {out});  // every nn.Linear of PhiAttention and PhiMLP has bias=True
  };
  // PhiModel.__init__: embed_tokens, layers, rotary_emb, embed_dropout, final_layernorm
  t.param("model.embed_tokens.weight", {V, C});
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    // PhiDecoderLayer: self_attn, mlp, input_layernorm, resid_dropout
    // PhiAttention: q_proj (C -> H*D), k_proj, v_proj (C -> KV*D), dense (H*D -> C), then with qk_layernorm
    // q_layernorm and k_layernorm = nn.LayerNorm(hidden_size // num_attention_heads)
    linear(p + "self_attn.q_proj", H * D, C);
    linear(p + "self_attn.k_proj", KV * D, C);
    linear(p + "self_attn.v_proj", KV * D, C);
    linear(p + "self_attn.dense", C, H * D);
    if (m.attn.qk_norm) {
      t.param(p + "self_attn.q_layernorm.weight", {D});
      t.param(p + "self_attn.q_layernorm.bias", {D});
      t.param(p + "self_attn.k_layernorm.weight", {D});
      t.param(p + "self_attn.k_layernorm.bias", {D});
    }
    // PhiMLP: fc1 (C -> F), fc2 (F -> C)
    linear(p + "mlp.fc1", F, C);
    linear(p + "mlp.fc2", C, F);
    t.param(p + "input_layernorm.weight", {C});
    t.param(p + "input_layernorm.bias", {C});
  }
  rotary_buffers("model.rotary_emb.", m.attn.rotary_dim, t);  // PhiModel.rotary_emb (PhiRotaryEmbedding)
  t.param("model.final_layernorm.weight", {C});
  t.param("model.final_layernorm.bias", {C});
  // PhiForCausalLM.lm_head = nn.Linear(hidden_size, vocab_size, bias=True); a tied weight is listed once (as
  // model.embed_tokens.weight), the bias always
  if (!m.embed.tied) t.param("lm_head.weight", {V, C});
  if (m.embed.head_bias) t.param("lm_head.bias", {V});
}

}  // namespace trainmem::models
