// Config reader for T5 (model_type t5): T5ForConditionalGeneration's encoder and decoder stacks. Every default
// is T5Config's (transformers configuration_t5.py), so a config.json missing a key builds what transformers builds.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"
#include "trainmem/names.h"

namespace trainmem::config {

namespace {

// T5Config.__init__: act_info = feed_forward_proj.split("-"); dense_act_fn = act_info[-1];
// is_gated_act = act_info[0] == "gated"; `if len(act_info) > 1 and act_info[0] != "gated" or len(act_info) > 2:
// raise ValueError(...)`; "for backwards compatibility": `if feed_forward_proj == "gated-gelu": dense_act_fn =
// "gelu_new"`. T5DenseActDense / T5DenseGatedActDense then take ACT2FN[config.dense_act_fn].
void read_feed_forward_proj(const KeyReader& r, ModelSpec& m) {
  const std::string proj = r.text({"feed_forward_proj"}, "relu");
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t dash = proj.find('-', start);
    parts.push_back(proj.substr(start, dash == std::string::npos ? std::string::npos : dash - start));
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  if ((parts.size() > 1 && parts[0] != "gated") || parts.size() > 2) {
    r.fail("feed_forward_proj", nlohmann::json(proj),
           "`gated-{ACT_FN}` or `{ACT_FN}`, e.g. 'gated-gelu' or 'relu' (T5Config: not a valid activation function "
           "of the dense layer)");
  }
  std::string act = proj == "gated-gelu" ? "gelu_new" : parts.back();
  bool gated = parts[0] == "gated";
  // PretrainedConfig.__init__ runs last in T5Config.__init__ and sets every remaining kwarg as an attribute, so a
  // saved "dense_act_fn" / "is_gated_act" (flan-t5's config.json has both) overrides the derived value.
  if (r.has({"dense_act_fn"})) act = r.text({"dense_act_fn"}, act);
  gated = r.boolean({"is_gated_act"}, gated);
  const auto a = parse_name<Act>(act);
  if (!a) {
    std::string allowed;
    for (const auto& row : name_table(Act{})) allowed += (allowed.empty() ? "" : ", ") + std::string(row.name);
    r.fail(r.has({"dense_act_fn"}) ? "dense_act_fn" : "feed_forward_proj",
           nlohmann::json(r.has({"dense_act_fn"}) ? act : proj), "an activation of transformers' ACT2FN: one of " + allowed);
  }
  m.mlp.act = *a;
  m.mlp.gated = gated;
}

}  // namespace

// transformers T5Config (configuration_t5.py): vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
// num_decoder_layers=None ("Will use the same value as `num_layers` if not set"), num_heads=8,
// relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
// layer_norm_epsilon=1e-6, initializer_factor=1.0, feed_forward_proj="relu", is_encoder_decoder=True,
// use_cache=True, pad_token_id=0, eos_token_id=1, classifier_dropout=0.0; tie_word_embeddings=True
// (PretrainedConfig's default). attribute_map: hidden_size->d_model, num_attention_heads->num_heads,
// num_hidden_layers->num_layers.
void read_t5(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "transformers' T5Config";
  m.family = Family::kT5;
  m.embed.vocab_size = r.shape({"vocab_size"}, 32128, 1, kMaxVocab, kDefaults);
  m.hidden = r.shape({"d_model", "hidden_size"}, 512, 1, kMaxWidth, kDefaults);
  // T5Attention: inner_dim = n_heads * key_value_proj_dim (d_kv), independent of d_model
  m.attn.head_dim = r.shape({"d_kv"}, 64, 1, kMaxWidth, kDefaults);
  m.mlp.ffn = r.shape({"d_ff"}, 2048, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"num_layers", "num_hidden_layers"}, 6, 1, kMaxLayers, kDefaults);
  m.encdec.decoder_layers = r.optional_integer({"num_decoder_layers"}, 1, kMaxLayers).value_or(m.layers);
  m.attn.heads = r.shape({"num_heads", "num_attention_heads"}, 8, 1, kMaxHeads, kDefaults);
  m.attn.kv_heads = m.attn.heads;
  m.encdec.rel_buckets = r.shape({"relative_attention_num_buckets"}, 32, 1, kMaxPositions, kDefaults);
  // only the bucketing's range: no tensor has this size, so a missing key (t5-small's config) does not warn
  m.encdec.rel_max_distance = r.integer({"relative_attention_max_distance"}, 128, 1, kMaxPositions);
  read_feed_forward_proj(r, m);
  // T5LayerNorm: weight only, RMS without the mean (T5's own module, not nn.LayerNorm)
  m.norm = {NormKind::kRmsNorm, false, true};
  r.number({"layer_norm_epsilon"}, 1e-6, 0.0, 1.0);
  m.embed.tied = r.boolean({"tie_word_embeddings"}, true);
  // T5Attention: q, k, v, o are nn.Linear(..., bias=False); T5DenseActDense's wi / wo too
  m.attn.qkv_bias = m.attn.out_bias = m.mlp.bias = false;
  m.max_positions = 0;  // relative position buckets: no table bounds the sequence
  // T5Attention as modelled (modeling_t5.py before transformers PR #47014) computes matmul, position bias and
  // softmax itself whatever attn_implementation says (T5PreTrainedModel declared no _supports_sdpa): eager
  m.attn_impl = AttnImpl::kEager;
  // nn.Dropout(config.dropout_rate) everywhere (T5Stack, T5LayerSelfAttention, T5LayerFF, the dense layers) and
  // F.dropout(attn_weights, p=self.dropout) with self.dropout = config.dropout_rate
  const double p = read_probability(r, {"dropout_rate"}, 0.1);
  m.dropout = {p, p, p, p};
  // _shift_right reads decoder_start_token_id and pad_token_id (values only)
  r.optional_integer({"decoder_start_token_id"}, 0, kMaxVocab);
  r.optional_integer({"pad_token_id"}, 0, kMaxVocab);
}

}  // namespace trainmem::config
