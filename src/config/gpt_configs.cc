// Config readers for GPT-2, nanoGPT, GPT-NeoX and OPT. Every default is the one of the transformers
// configuration class named in the comment above the reader (or nanoGPT's GPTConfig dataclass), so that a
// config.json missing a key builds the same model as transformers would.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"

namespace trainmem::config {

// transformers GPT2Config (configuration_gpt2.py): vocab_size=50257, n_positions=1024, n_embd=768,
// n_layer=12, n_head=12, n_inner=None (-> 4*n_embd in GPT2Block), activation_function="gelu_new",
// resid_pdrop=embd_pdrop=attn_pdrop=0.1, tie_word_embeddings=True (PretrainedConfig default).
// attribute_map: hidden_size->n_embd, max_position_embeddings->n_positions, num_attention_heads->n_head,
// num_hidden_layers->n_layer.
void read_gpt2(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "transformers' GPT2Config";
  m.family = Family::kGpt2;
  m.embed.vocab_size = r.shape({"vocab_size"}, 50257, 1, kMaxVocab, kDefaults);
  m.embed.position_rows = r.shape({"n_positions", "max_position_embeddings"}, 1024, 1, kMaxPositions, kDefaults);
  m.max_positions = m.embed.position_rows;
  m.hidden = r.shape({"n_embd", "hidden_size"}, 768, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"n_layer", "num_hidden_layers"}, 12, 1, kMaxLayers, kDefaults);
  read_heads(r, {"n_head", "num_attention_heads"}, 12, kDefaults, {"n_embd", "hidden_size"}, m.hidden, m.attn);
  m.attn.fused_qkv = m.attn.qkv_bias = m.attn.out_bias = true;  // Conv1D c_attn / c_proj, always biased
  m.mlp.ffn = r.optional_integer({"n_inner"}, 1, kMaxWidth).value_or(4 * m.hidden);
  m.mlp.bias = true;
  m.mlp.act = read_activation(r, {"activation_function"}, "gelu_new");
  m.norm = {NormKind::kLayerNorm, true, true};
  m.embed.tied = r.boolean({"tie_word_embeddings"}, true);
  m.dropout.embd = read_probability(r, {"embd_pdrop"}, 0.1);
  m.dropout.attn = read_probability(r, {"attn_pdrop"}, 0.1);
  m.dropout.resid = read_probability(r, {"resid_pdrop"}, 0.1);
}

// nanoGPT model.py GPTConfig: block_size=1024, vocab_size=50304 ("GPT-2 vocab_size of 50257, padded up to
// nearest multiple of 64 for efficiency"), n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True.
// The MLP is always 4*n_embd with nn.GELU() (erf), the lm_head is always tied to wte.
void read_nanogpt(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "nanoGPT's GPTConfig";
  m.family = Family::kGpt2;
  m.embed.vocab_size = r.shape({"vocab_size"}, 50304, 1, kMaxVocab, kDefaults);
  m.embed.position_rows = r.shape({"block_size"}, 1024, 1, kMaxPositions, kDefaults);
  m.max_positions = m.embed.position_rows;
  m.hidden = r.shape({"n_embd"}, 768, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"n_layer"}, 12, 1, kMaxLayers, kDefaults);
  read_heads(r, {"n_head"}, 12, kDefaults, {"n_embd"}, m.hidden, m.attn);
  const bool bias = r.boolean({"bias"}, true);
  m.attn.fused_qkv = true;
  m.attn.qkv_bias = m.attn.out_bias = m.mlp.bias = bias;
  m.mlp.ffn = 4 * m.hidden;
  m.mlp.act = Act::kGeluErf;
  m.norm = {NormKind::kLayerNorm, bias, true};
  m.embed.tied = true;
  const double p = read_probability(r, {"dropout"}, 0.0);
  m.dropout = {p, p, p, 0.0};
}

// transformers GPTNeoXConfig (configuration_gpt_neox.py): vocab_size=50432, hidden_size=6144,
// num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576, hidden_act="gelu",
// rotary_pct=0.25 (partial_rotary_factor in newer versions), max_position_embeddings=2048,
// use_parallel_residual=True, attention_bias=True, attention_dropout=0.0, hidden_dropout=0.0,
// tie_word_embeddings=False.
void read_gpt_neox(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "transformers' GPTNeoXConfig";
  m.family = Family::kGptNeox;
  m.embed.vocab_size = r.shape({"vocab_size"}, 50432, 1, kMaxVocab, kDefaults);
  m.hidden = r.shape({"hidden_size"}, 6144, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"num_hidden_layers"}, 44, 1, kMaxLayers, kDefaults);
  read_heads(r, {"num_attention_heads"}, 64, kDefaults, {"hidden_size"}, m.hidden, m.attn);
  m.mlp.ffn = r.shape({"intermediate_size"}, 24576, 1, kMaxWidth, kDefaults);
  m.mlp.act = read_activation(r, {"hidden_act"}, "gelu");
  m.mlp.bias = true;
  m.attn.fused_qkv = true;
  m.attn.qkv_bias = m.attn.out_bias = r.boolean({"attention_bias"}, true);
  const double pct = r.number({"partial_rotary_factor", "rotary_pct"}, 0.25, 0.0, 1.0);
  // GPTNeoXRotaryEmbedding: dim = int(head_dim * partial_rotary_factor)
  m.attn.rotary_dim = static_cast<uint64_t>(static_cast<double>(m.attn.head_dim) * pct);
  check_rotary_dims(r, r.has({"partial_rotary_factor"}) ? "partial_rotary_factor" : "rotary_pct", m);
  m.max_positions = 0;  // rotary positions: no table bounds the sequence
  m.parallel_residual = r.boolean({"use_parallel_residual"}, true);
  m.norm = {NormKind::kLayerNorm, true, true};
  m.embed.tied = r.boolean({"tie_word_embeddings"}, false);
  m.dropout.attn = read_probability(r, {"attention_dropout"}, 0.0);
  m.dropout.resid = read_probability(r, {"hidden_dropout"}, 0.0);
}

// transformers OPTConfig (configuration_opt.py): vocab_size=50272, hidden_size=768, num_hidden_layers=12,
// ffn_dim=3072, max_position_embeddings=2048, do_layer_norm_before=True, _remove_final_layer_norm=False,
// word_embed_proj_dim=None (-> hidden_size), dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
// num_attention_heads=12, activation_function="relu", enable_bias=True,
// layer_norm_elementwise_affine=True, tie_word_embeddings=True.
// OPTLearnedPositionalEmbedding keeps 2 extra rows: "OPT is set up so that if padding_idx is specified then
// offset the embedding ids by 2".
void read_opt(const KeyReader& r, ModelSpec& m) {
  constexpr uint64_t kOptPositionOffset = 2;
  constexpr std::string_view kDefaults = "transformers' OPTConfig";
  m.family = Family::kOpt;
  m.embed.vocab_size = r.shape({"vocab_size"}, 50272, 1, kMaxVocab, kDefaults);
  m.hidden = r.shape({"hidden_size"}, 768, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"num_hidden_layers"}, 12, 1, kMaxLayers, kDefaults);
  read_heads(r, {"num_attention_heads"}, 12, kDefaults, {"hidden_size"}, m.hidden, m.attn);
  m.mlp.ffn = r.shape({"ffn_dim"}, 3072, 1, kMaxWidth, kDefaults);
  m.mlp.act = read_activation(r, {"activation_function"}, "relu");
  m.max_positions =
      r.shape({"max_position_embeddings"}, 2048, 1, kMaxPositions - kOptPositionOffset, kDefaults);
  m.embed.position_rows = m.max_positions + kOptPositionOffset;
  const uint64_t proj = r.optional_integer({"word_embed_proj_dim"}, 1, kMaxWidth).value_or(m.hidden);
  m.embed.proj_dim = proj == m.hidden ? 0 : proj;
  m.pre_norm = r.boolean({"do_layer_norm_before"}, true);
  // Read even when it does not matter (post-norm): a key that is never read is an unknown --set key.
  const bool remove_final_norm = r.boolean({"_remove_final_layer_norm"}, false);
  m.final_norm = m.pre_norm && !remove_final_norm;
  const bool bias = r.boolean({"enable_bias"}, true);
  m.attn.qkv_bias = m.attn.out_bias = m.mlp.bias = bias;
  m.norm = {NormKind::kLayerNorm, true, r.boolean({"layer_norm_elementwise_affine"}, true)};
  m.embed.tied = r.boolean({"tie_word_embeddings"}, true);
  m.dropout.resid = read_probability(r, {"dropout"}, 0.1);
  m.dropout.attn = read_probability(r, {"attention_dropout"}, 0.0);
  m.dropout.act = read_probability(r, {"activation_dropout"}, 0.0);
}

}  // namespace trainmem::config
