// OPT as transformers builds it: OPTForCausalLM. Learned positions with an offset of 2 rows
// (OPTLearnedPositionalEmbedding), optional project_in/project_out when word_embed_proj_dim != hidden
// (opt-350m), post-norm layers when do_layer_norm_before=False, tied lm_head.
// B=micro-batch T=seq C=hidden L=layers V=vocab P=position rows F=ffn W=word_embed_proj_dim
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

void opt_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, P = m.embed.position_rows, F = m.mlp.ffn;
  const uint64_t W = m.embed.proj_dim != 0 ? m.embed.proj_dim : C;
  const bool b = m.attn.qkv_bias;  // enable_bias: every Linear of the decoder layers
  const bool affine = m.norm.affine;  // layer_norm_elementwise_affine
  auto layer_norm = [&](const std::string& name) {
    if (!affine) return;
    t.param(name + ".weight", {C});
    t.param(name + ".bias", {C});
  };
  auto linear = [&](const std::string& name, uint64_t out, uint64_t in) {
    t.param(name + ".weight", {out, in});
    if (b) t.param(name + ".bias", {out});
  };
  t.param("model.decoder.embed_tokens.weight", {V, W});
  t.param("model.decoder.embed_positions.weight", {P, C});
  if (W != C) {
    t.param("model.decoder.project_out.weight", {W, C});  // nn.Linear(C, W, bias=False)
    t.param("model.decoder.project_in.weight", {C, W});   // nn.Linear(W, C, bias=False)
  }
  if (m.final_norm) layer_norm("model.decoder.final_layer_norm");
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string p = fmt::format("model.decoder.layers.{}.", l);
    linear(p + "self_attn.k_proj", C, C);
    linear(p + "self_attn.v_proj", C, C);
    linear(p + "self_attn.q_proj", C, C);
    linear(p + "self_attn.out_proj", C, C);
    layer_norm(p + "self_attn_layer_norm");
    linear(p + "fc1", F, C);
    linear(p + "fc2", C, F);
    layer_norm(p + "final_layer_norm");
  }
  // lm_head (V, W) is tied to embed_tokens by default and then listed once.
  if (!m.embed.tied) t.param("lm_head.weight", {V, W});
}

}  // namespace trainmem::models
