// The encoder families: BERT and RoBERTa (transformers 5.x modeling_bert.py / modeling_roberta.py). RoBERTa's
// modules are BERT's under other names (roberta.*, lm_head.*), with position ids that start at padding_idx + 1.
// B=micro-batch T=seq C=hidden L=layers NH=heads F=ffn V=vocab P=position rows N=num_labels
#include <fmt/format.h>

#include "families.h"

namespace trainmem::config {

namespace {

struct EncoderDefaults {
  std::string_view defaults_of;
  uint64_t vocab, pad_token_id;
};

// transformers BertConfig.__init__ (configuration_bert.py): vocab_size=30522, hidden_size=768,
// num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, hidden_act="gelu",
// hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
// layer_norm_eps=1e-12, pad_token_id=0, use_cache=True, classifier_dropout=None.
constexpr EncoderDefaults kBert = {"transformers' BertConfig", 30522, 0};
// transformers RobertaConfig.__init__ (configuration_roberta.py): BertConfig's defaults except vocab_size=50265
// and pad_token_id=1 (bos_token_id=0, eos_token_id=2).
constexpr EncoderDefaults kRoberta = {"transformers' RobertaConfig", 50265, 1};

}  // namespace

void read_bert(const KeyReader& r, std::string_view model_type, ModelSpec& m) {
  const bool roberta = model_type == "roberta";
  const EncoderDefaults& d = roberta ? kRoberta : kBert;
  const std::string_view kDefaults = d.defaults_of;
  m.family = roberta ? Family::kRoberta : Family::kBert;
  m.embed.vocab_size = r.shape({"vocab_size"}, d.vocab, 1, kMaxVocab, kDefaults);
  m.hidden = r.shape({"hidden_size"}, 768, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"num_hidden_layers"}, 12, 1, kMaxLayers, kDefaults);
  read_heads(r, {"num_attention_heads"}, 12, kDefaults, {"hidden_size"}, m.hidden, m.attn);
  m.mlp.ffn = r.shape({"intermediate_size"}, 3072, 1, kMaxWidth, kDefaults);
  m.mlp.act = read_activation(r, {"hidden_act"}, "gelu");  // BertIntermediate and the MLM transform
  m.mlp.bias = m.attn.qkv_bias = m.attn.out_bias = true;     // every nn.Linear of BertLayer has a bias
  m.type_vocab = r.shape({"type_vocab_size"}, 2, 1, kMaxVocab, kDefaults);
  const uint64_t rows = r.shape({"max_position_embeddings"}, 512, 1, kMaxPositions, kDefaults);
  m.embed.position_rows = rows;
  m.max_positions = rows;
  if (roberta) {
    // RobertaEmbeddings: position ids from padding_idx + 1 (create_position_ids_from_input_ids:
    // cumsum(mask) * mask + padding_idx), so a sequence of T tokens needs rows padding_idx + 1 .. padding_idx + T
    const uint64_t pad = r.integer({"pad_token_id"}, d.pad_token_id, 0, kMaxVocab - 1);
    m.position_offset = pad + 1;
    m.pad_token_id = pad;
    if (rows <= m.position_offset) {
      r.fail("max_position_embeddings", nlohmann::json(rows),
             fmt::format("more than pad_token_id + 1 = {} (RoBERTa's positions start after padding_idx)",
                         m.position_offset));
    }
    m.max_positions = rows - m.position_offset;
  } else {
    (void)r.integer({"pad_token_id"}, d.pad_token_id, 0, kMaxVocab - 1);  // word_embeddings' padding_idx
  }
  m.norm = {NormKind::kLayerNorm, true, true};
  m.pre_norm = false;  // post-LN: LayerNorm(dense(x) + input_tensor) in BertSelfOutput and BertOutput
  m.final_norm = false;
  // BertForMaskedLM._tied_weights_keys: cls.predictions.decoder.weight -> bert.embeddings.word_embeddings.weight
  m.embed.tied = r.boolean({"tie_word_embeddings"}, true);
  m.dropout.embd = m.dropout.resid = read_probability(r, {"hidden_dropout_prob"}, 0.1);
  m.dropout.attn = read_probability(r, {"attention_probs_dropout_prob"}, 0.1);
  // BertForSequenceClassification: classifier_dropout if not None else hidden_dropout_prob
  const nlohmann::json* cd = r.find({"classifier_dropout"});
  m.classifier_dropout = cd && !cd->is_null() ? read_probability(r, {"classifier_dropout"}, 0.0) : m.dropout.resid;
  // BertModel._create_attention_masks: is_decoder builds a causal mask (BertLMHeadModel); cross-attention
  // layers need encoder_hidden_states. Neither is the encoder simulated here.
  if (r.boolean({"is_decoder"}, false)) {
    r.fail("is_decoder", nlohmann::json(true), "false: the decoder mode (BertLMHeadModel, a causal mask) is not "
                                               "simulated; the encoder is");
  }
  if (r.boolean({"add_cross_attention"}, false)) {
    r.fail("add_cross_attention", nlohmann::json(true), "false: cross-attention layers are not simulated");
  }
}

}  // namespace trainmem::config
