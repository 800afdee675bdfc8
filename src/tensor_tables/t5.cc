// T5 as transformers builds it: T5ForConditionalGeneration (modeling_t5.py). One shared token embedding, an
// encoder T5Stack and a decoder T5Stack (the decoder's blocks add a cross-attention layer), a relative position
// bias only in block 0 of each stack, T5LayerNorm (a weight, no bias), bias-free linears, and an lm_head that is
// the shared embedding when tie_word_embeddings.
// C=d_model I=num_heads*d_kv F=d_ff V=vocab NB=relative_attention_num_buckets NH=num_heads
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

namespace {

// T5Block(config, has_relative_attention_bias=bool(i == 0)): self.layer = [T5LayerSelfAttention,
// (decoder) T5LayerCrossAttention, T5LayerFF], each registering its attention / dense module before its layer_norm.
void t5_block(const ModelSpec& m, const std::string& p, bool decoder, bool first, Table& t) {
  const uint64_t C = m.hidden, I = m.attn.heads * m.attn.head_dim, F = m.mlp.ffn;
  auto attention = [&](const std::string& a, bool bias) {
    // T5Attention.__init__: q, k, v = nn.Linear(d_model, inner_dim, bias=False), o = nn.Linear(inner_dim, d_model,
    // bias=False), then `if self.has_relative_attention_bias: self.relative_attention_bias =
    // nn.Embedding(self.relative_attention_num_buckets, self.n_heads)`
    t.param(a + "q.weight", {I, C});
    t.param(a + "k.weight", {I, C});
    t.param(a + "v.weight", {I, C});
    t.param(a + "o.weight", {C, I});
    if (bias) t.raw_param(a + "relative_attention_bias.weight", {m.encdec.rel_buckets, m.attn.heads});
  };
  attention(p + "layer.0.SelfAttention.", first);
  t.param(p + "layer.0.layer_norm.weight", {C});
  uint64_t ff = 1;
  if (decoder) {
    // T5LayerCrossAttention: T5Attention(config, has_relative_attention_bias=False)
    attention(p + "layer.1.EncDecAttention.", false);
    t.param(p + "layer.1.layer_norm.weight", {C});
    ff = 2;
  }
  const std::string d = fmt::format("{}layer.{}.DenseReluDense.", p, ff);
  if (m.mlp.gated) {  // T5DenseGatedActDense: wi_0, wi_1 (d_model -> d_ff), wo (d_ff -> d_model)
    t.param(d + "wi_0.weight", {F, C});
    t.param(d + "wi_1.weight", {F, C});
  } else {  // T5DenseActDense: wi, wo
    t.param(d + "wi.weight", {F, C});
  }
  t.param(d + "wo.weight", {C, F});
  t.param(fmt::format("{}layer.{}.layer_norm.weight", p, ff), {C});
}

}  // namespace

void t5_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size;
  // T5ForConditionalGeneration.__init__: self.shared = nn.Embedding(vocab_size, d_model); both stacks take it as
  // embed_tokens (the same Parameter, listed once by named_parameters())
  t.raw_param("shared.weight", {V, C});
  for (const bool decoder : {false, true}) {
    const std::string s = decoder ? "decoder." : "encoder.";
    const uint64_t layers = decoder ? m.encdec.decoder_layers : m.layers;
    for (uint64_t l = 0; l < layers; ++l) t5_block(m, fmt::format("{}block.{}.", s, l), decoder, l == 0, t);
    t.param(s + "final_layer_norm.weight", {C});  // T5Stack: self.final_layer_norm after self.block
  }
  // self.lm_head = nn.Linear(d_model, vocab_size, bias=False); tied to shared when tie_word_embeddings
  if (!m.embed.tied) t.param("lm_head.weight", {V, C});
}

}  // namespace trainmem::models
