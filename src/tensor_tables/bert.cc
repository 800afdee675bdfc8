// BERT and RoBERTa as transformers 5.x builds them (modeling_bert.py, modular_roberta.py): BertModel (embeddings,
// encoder, and the pooler only where the head uses it) under BertForMaskedLM, BertForSequenceClassification or
// BertForTokenClassification, and the RobertaFor* classes (RobertaLMHead, RobertaClassificationHead).
// B=micro-batch T=seq C=hidden L=layers V=vocab P=position rows Y=token types F=ffn N=num_labels
#include <fmt/format.h>

#include "table.h"
#include "trainmem/error.h"

namespace trainmem::models {

void bert_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, P = m.embed.position_rows, Y = m.type_vocab, F = m.mlp.ffn;
  const uint64_t N = m.num_labels;
  auto linear = [&](const std::string& name, uint64_t out, uint64_t in) {
    t.param(name + ".weight", {out, in});
    t.param(name + ".bias", {out});
  };
  auto layer_norm = [&](const std::string& name) {
    t.param(name + ".weight", {C});
    t.param(name + ".bias", {C});
  };
  // RoBERTa's modules are BERT's under "roberta." (RobertaPreTrainedModel.base_model_prefix)
  const bool roberta = m.family == Family::kRoberta;
  const std::string base = roberta ? "roberta." : "bert.";
  // BertEmbeddings.__init__: word, position and token_type embeddings, LayerNorm, then the buffers
  // position_ids = arange(max_position_embeddings).expand((1, -1)) and token_type_ids = zeros of that size
  // (int64, persistent=False). RobertaEmbeddings.__init__ (modular_roberta.py) runs it, then
  // `del self.position_embeddings` and registers a new one (with padding_idx): it is listed last.
  t.param(base + "embeddings.word_embeddings.weight", {V, C});
  if (!roberta) t.param(base + "embeddings.position_embeddings.weight", {P, C});
  t.param(base + "embeddings.token_type_embeddings.weight", {Y, C});
  layer_norm(base + "embeddings.LayerNorm");
  if (roberta) t.param(base + "embeddings.position_embeddings.weight", {P, C});
  t.buffer(base + "embeddings.position_ids", {1, P}, DType::kI64, false);
  t.buffer(base + "embeddings.token_type_ids", {1, P}, DType::kI64, false);
  for (uint64_t l = 0; l < m.layers; ++l) {
    // BertLayer: attention (BertSelfAttention query/key/value, BertSelfOutput dense + LayerNorm),
    // intermediate (dense), output (dense + LayerNorm)
    const std::string p = fmt::format("{}encoder.layer.{}.", base, l);
    for (const char* n :
         {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"}) {
      linear(p + n, C, C);
    }
    layer_norm(p + "attention.output.LayerNorm");
    linear(p + "intermediate.dense", F, C);
    linear(p + "output.dense", C, F);
    layer_norm(p + "output.LayerNorm");
  }
  if (m.head == Head::kMaskedLm && !m.embed.tied) {
    throw Error(fmt::format("{}: tie_word_embeddings false with the masked-LM head (an untied decoder) is not "
                            "simulated", m.name));
  }
  switch (m.head) {
    case Head::kSeqCls:
      if (roberta) {
        // RobertaModel(config, add_pooling_layer=False); RobertaClassificationHead: dense (C, C), out_proj (N, C)
        linear("classifier.dense", C, C);
        linear("classifier.out_proj", N, C);
      } else {
        // BertModel(config) keeps its BertPooler (dense + tanh); BertForSequenceClassification's classifier
        linear("bert.pooler.dense", C, C);
        linear("classifier", N, C);
      }
      break;
    case Head::kTokenCls:
      linear("classifier", N, C);  // BertModel / RobertaModel(config, add_pooling_layer=False)
      break;
    case Head::kMaskedLm:
      // BertOnlyMLMHead -> BertLMPredictionHead: its own `bias` (V) is listed before its submodules
      // (named_parameters yields a module's parameters, then its children's); transform (dense, LayerNorm);
      // decoder.weight is tied to the word embeddings and decoder.bias to `bias` (_tied_weights_keys).
      // RobertaLMHead: the same under lm_head (bias, dense, layer_norm; decoder tied)
      t.param(roberta ? "lm_head.bias" : "cls.predictions.bias", {V});
      linear(roberta ? "lm_head.dense" : "cls.predictions.transform.dense", C, C);
      layer_norm(roberta ? "lm_head.layer_norm" : "cls.predictions.transform.LayerNorm");
      break;
    case Head::kCausalLm:
      throw Error("internal: BERT and RoBERTa have no causal-LM head here (is_decoder is refused)");
  }
}

}  // namespace trainmem::models
