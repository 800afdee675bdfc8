// transformers 5.x BertForMaskedLM / BertForSequenceClassification / BertForTokenClassification
// (modeling_bert.py), labels given, use_cache=False (an encoder: config.is_decoder is False), and the RoBERTa
// classes (modular_roberta.py): BertModel's layers under RobertaEmbeddings, RobertaLMHead and
// RobertaClassificationHead, all named under "roberta.".
// B=micro-batch T=seq C=hidden H=heads D=head-dim F=ffn V=vocab N=num_labels
#include <fmt/format.h>

#include "../layers.h"
#include "../ops_util.h"
#include "hf_common.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace {

// RobertaPreTrainedModel.base_model_prefix "roberta", BertPreTrainedModel's "bert"
std::string_view base(const ModelSpec& m) { return m.family == Family::kRoberta ? "roberta" : "bert"; }

// x[:, i] of a (B, T, C) tensor: a (B, C) view (TensorIndexing: the full slice `:` returns x itself, the int
// selects). SelectBackward0 saves nothing; its backward is zeros of x's size with the gradient copied in.
T select_dim1(Ctx& c, const T& x) {
  const Shape xs = x.shape();
  T out = c.e.view(x, Shape{xs[0], xs[2]}, Strides{x->strides[0], x->strides[2]});
  c.e.record("SelectBackward0", {&x}, {&out}, {}, [xs](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? detail::grad_empty(e, xs, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

// RobertaEmbeddings.create_position_ids_from_input_ids (modular_roberta.py): mask = input_ids.ne(padding_idx)
// .int(); incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask;
// return incremental_indices.long() + padding_idx. Each temporary is freed once the next op has returned
// (cumsum of an int32 tensor gives int64). Returns the (B, T) int64 position ids.
T roberta_position_ids(Ctx& c, const T& ids) {
  const Shape s = ids.shape();
  auto make = [&](DType dt, const char* what) { return c.e.empty(s, dt, Category::kTemporaries, c.L(what)); };
  T mask;
  {
    T ne = make(DType::kBool, "input_ids.ne(padding_idx)");
    mask = make(DType::kI32, "mask .int()");
  }
  T inc;
  {
    T cs = make(DType::kI64, "torch.cumsum(mask, dim=1)");
    T typed = make(DType::kI32, "cumsum .type_as(mask)");
    cs.reset();
    T plus = make(DType::kI32, "+ past_key_values_length");
    typed.reset();
    inc = make(DType::kI32, "* mask");
  }
  T as_long = make(DType::kI64, "incremental_indices.long()");
  return c.e.empty(s, DType::kI64, Category::kActivations, c.L("position_ids (+ padding_idx)"));
}

// BertEmbeddings.forward (5.x): position_ids = self.position_ids[:, past : past + T] (a view of the buffer);
// token_type_ids as passed, else the buffer's zeros gathered at position_ids and expanded to (B, T);
// embeddings = inputs_embeds + token_type_embeddings; embeddings = embeddings + position_embeddings;
// LayerNorm; dropout. The locals (inputs_embeds, token_type_embeddings, position_embeddings) live until it
// returns. RobertaEmbeddings.forward: the same, with position_ids from create_position_ids_from_input_ids
// ((B, T): the gather of the token types is then (B, T) too).
T bert_embeddings(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  auto n = [&](const char* s) { return param_name("{}.embeddings.{}", base(m), s); };
  T position_ids;
  if (m.family == Family::kRoberta) {
    position_ids = roberta_position_ids(c, ids);
  } else {
    const T& pbuf = w.buf(n("position_ids"));
    position_ids = c.e.view(pbuf, Shape{1, Tn}, pbuf->strides);
  }
  T token_type_ids;
  if (c.token_type_ids) {
    token_type_ids = *c.token_type_ids;
  } else {
    // buffered_token_type_ids = self.token_type_ids.expand(position_ids.shape[0], -1) (a view);
    // torch.gather(buffered, dim=1, index=position_ids) -> a new int64 of position_ids' shape; .expand(B, T)
    T gathered = c.e.empty(position_ids.shape(), DType::kI64, Category::kActivations, c.L("token_type_ids (gather)"));
    const int64_t row_stride = position_ids.shape()[0] == 1 ? 0 : static_cast<int64_t>(Tn);
    token_type_ids = c.e.view(gathered, Shape{B, Tn}, Strides{row_stride, 1});
  }
  T inputs_embeds = embedding(c, w.p(n("word_embeddings.weight")), ids, "word_embeddings");
  T token_type_embeddings =
      embedding(c, w.p(n("token_type_embeddings.weight")), token_type_ids, "token_type_embeddings");
  T embeddings = add(c, inputs_embeds, token_type_embeddings, "inputs_embeds + token_type_embeddings");
  T position_embeddings = embedding(c, w.p(n("position_embeddings.weight")), position_ids, "position_embeddings");
  embeddings = add(c, embeddings, position_embeddings, "embeddings + position_embeddings");
  embeddings =
      layer_norm(c, embeddings, &w.p(n("LayerNorm.weight")), &w.p(n("LayerNorm.bias")), "embeddings.LayerNorm");
  return dropout(c, embeddings, m.dropout.embd, "embeddings.dropout");
}

// BertModel._create_attention_masks -> masking_utils.create_bidirectional_mask (transformers 5.x, commit
// 00c4411cbe15): _preprocess_mask_arguments makes `attention_mask.to(device, dtype=torch.bool)`, then sdpa_mask
// (also under eager_mask) with allow_is_bidirectional_skip=True returns None when
// _ignore_bidirectional_mask_sdpa finds `padding_mask.all()`. The collator's mask, padded to the batch's longest
// sequence (--seq), is all ones: no 4-D mask is made for eager or sdpa, and the layers attend to everything.
void bidirectional_mask(Ctx& c, uint64_t B, uint64_t Tn) {
  if (!c.attention_mask) return;  // attention_mask None: _preprocess_mask_arguments makes nothing either
  T as_bool = c.e.empty(Shape{B, Tn}, DType::kBool, Category::kTemporaries, c.L("attention_mask.to(torch.bool)"));
  T all = c.e.empty(Shape{}, DType::kBool, Category::kTemporaries, c.L("padding_mask.all()"));
}

// eager_attention_forward (modeling_bert.py 5.x): matmul(q, k^T) * scaling, (+ mask: None here),
// nn.functional.softmax(dim=-1) with no dtype (float32 under autocast, as the op's autocast policy makes it),
// dropout, matmul with v, transpose(1, 2).contiguous(). Returns the output and the attention weights.
AttnOut bert_eager_attention(Ctx& c, const T& q, const T& k, const T& v, double dropout_p) {
  T w = matmul(c, q, transpose(c, k, 2, 3), "attn q@k^T");
  w = mul_scalar(c, w, "attn * scaling");
  w = softmax(c, w, std::nullopt, "attn softmax");
  w = dropout(c, w, dropout_p, "attn dropout");
  T o = matmul(c, w, v, "attn @ v");
  o = contiguous(c, transpose(c, o, 1, 2), "attn output contiguous");
  return AttnOut{o, w};
}

// BertAttention: BertSelfAttention (query/key/value, each .view(B, T, -1, D).transpose(1, 2); the attention
// interface; attn_output.reshape(B, T, -1).contiguous()) then BertSelfOutput (dense, dropout,
// LayerNorm(hidden + input_tensor)). `weights` receives attn_weights, which BertLayer binds to `_` until it
// returns.
T bert_attention(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& x, T& weights) {
  auto n = [&](const char* s) { return param_name("{}.encoder.layer.{}.attention.{}", base(m), l, s); };
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], H = m.attn.heads, D = m.attn.head_dim;
  auto heads = [&](const char* wn, const char* bn, const char* what) {
    T p = linear(c, x, w.p(n(wn)), &w.p(n(bn)), what);
    return transpose(c, view(c, p, Shape{B, Tn, H, D}), 1, 2);
  };
  T o;
  {
    T q = heads("self.query.weight", "self.query.bias", "attention.self.query");
    T k = heads("self.key.weight", "self.key.bias", "attention.self.key");
    T v = heads("self.value.weight", "self.value.bias", "attention.self.value");
    if (m.attn_impl == AttnImpl::kEager) {
      AttnOut a = bert_eager_attention(c, q, k, v, m.dropout.attn);
      o = std::move(a.output);
      weights = std::move(a.weights);
    } else {
      // sdpa_attention_forward (integrations/sdpa_attention.py): is_causal = q_len > 1 and attention_mask is None
      // and module.is_causal; BertSelfAttention.is_causal is config.is_decoder (False): not causal
      o = contiguous(c, transpose(c, sdpa(c, q, k, v, nullptr, m.dropout.attn, false), 1, 2),
                     "attn output contiguous");
    }
  }
  o = contiguous(c, reshape(c, o, Shape{B, Tn, H * D}), "attn output contiguous");
  // BertAttention: `attention_output = self.output(attention_output, hidden_states)`: the caller's name keeps the
  // self-attention output alive until BertSelfOutput returns
  T h = linear(c, o, w.p(n("output.dense.weight")), &w.p(n("output.dense.bias")), "attention.output.dense");
  h = dropout(c, h, m.dropout.resid, "attention.output.dropout");
  return layer_norm(c, add(c, h, x, "hidden + input_tensor"), &w.p(n("output.LayerNorm.weight")),
                    &w.p(n("output.LayerNorm.bias")), "attention.output.LayerNorm");
}

// BertLayer.forward: self_attention_output, _ = self.attention(...); apply_chunking_to_forward with
// chunk_size_feed_forward 0 calls feed_forward_chunk: intermediate (dense, act), output (dense, dropout,
// LayerNorm(hidden + attention_output)).
T bert_layer(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& hidden) {
  auto n = [&](const char* s) { return param_name("{}.encoder.layer.{}.{}", base(m), l, s); };
  T weights;  // `_`
  T attention_output = bert_attention(c, m, w, l, hidden, weights);
  T out;
  {
    T intermediate = linear(c, attention_output, w.p(n("intermediate.dense.weight")),
                            &w.p(n("intermediate.dense.bias")), "intermediate.dense");
    intermediate = activation(c, m.mlp.act, intermediate);
    T h = linear(c, intermediate, w.p(n("output.dense.weight")), &w.p(n("output.dense.bias")), "output.dense");
    h = dropout(c, h, m.dropout.resid, "output.dropout");
    out = layer_norm(c, add(c, h, attention_output, "hidden + attention_output"), &w.p(n("output.LayerNorm.weight")),
                     &w.p(n("output.LayerNorm.bias")), "output.LayerNorm");
  }
  return out;
}

// CrossEntropyLoss()(logits.view(-1, K), labels.view(-1)): the masked-LM loss (K = V, labels -100 where
// unmasked: every B*T row goes through the loss), the token-classification one (K = N), and
// single_label_classification (problem_type None, num_labels > 1, int64 labels: K = N, labels (B,)).
T flat_cross_entropy(Ctx& c, const T& logits, const T& labels) {
  const uint64_t K = logits.shape().back();
  const uint64_t rows = logits.shape().numel().value / K;
  const T flat = view(c, logits, Shape{rows, K});
  const T tflat = view(c, labels, Shape{labels.shape().numel().value});
  return cross_entropy(c, flat, tflat);
}

}  // namespace

ForwardOut bert_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  c.layer = -1;
  // BertModel.forward (RobertaModel's too): cache_position = torch.arange(past, past + T) (int64), bound until it
  // returns
  T cache_position = c.e.empty(Shape{Tn}, DType::kI64, Category::kActivations, c.L("cache_position"));
  // embedding_output stays bound in BertModel.forward while the encoder runs (BertEncoder rebinds its own name)
  T embedding_output = bert_embeddings(c, m, w, ids);
  bidirectional_mask(c, B, Tn);
  T hidden = run_layers(c, m.layers, embedding_output, LayerArgs{},
                        [&](uint64_t l, T h, const LayerArgs&) { return bert_layer(c, m, w, l, h); });
  // `outputs` (last_hidden_state, pooler_output) stays bound in the head's forward until it returns
  const T sequence_output = hidden;
  ForwardOut out;
  const bool roberta = m.family == Family::kRoberta;
  switch (m.head) {
    case Head::kSeqCls: {
      if (roberta) {
        cache_position.reset();  // RobertaModel (BertModel, add_pooling_layer=False) returns
        embedding_output.reset();
        // RobertaClassificationHead.forward: x = features[:, 0, :] (<s>); dropout; dense; torch.tanh; dropout;
        // out_proj
        T x = dropout(c, select_dim1(c, sequence_output), m.classifier_dropout, "classifier.dropout");
        x = linear(c, x, w.p("classifier.dense.weight"), &w.p("classifier.dense.bias"), "classifier.dense");
        x = tanh(c, x, "classifier tanh");
        x = dropout(c, x, m.classifier_dropout, "classifier.dropout");
        out.logits = linear(c, x, w.p("classifier.out_proj.weight"), &w.p("classifier.out_proj.bias"),
                            "classifier.out_proj");
        break;
      }
      // BertPooler: dense(hidden_states[:, 0]), tanh; then the classifier's dropout and Linear(C, N)
      T pooled = linear(c, select_dim1(c, sequence_output), w.p("bert.pooler.dense.weight"),
                        &w.p("bert.pooler.dense.bias"), "pooler.dense");
      pooled = tanh(c, pooled, "pooler.activation");
      cache_position.reset();  // BertModel.forward returns
      embedding_output.reset();
      const T pooler_output = pooled;
      pooled = dropout(c, pooled, m.classifier_dropout, "classifier dropout");
      out.logits = linear(c, pooled, w.p("classifier.weight"), &w.p("classifier.bias"), "classifier");
      break;
    }
    case Head::kTokenCls: {
      cache_position.reset();  // BertModel.forward returns
      embedding_output.reset();
      T h = dropout(c, sequence_output, m.classifier_dropout, "classifier dropout");
      out.logits = linear(c, h, w.p("classifier.weight"), &w.p("classifier.bias"), "classifier");
      break;
    }
    case Head::kMaskedLm: {
      cache_position.reset();  // BertModel.forward returns
      embedding_output.reset();
      // BertLMPredictionHead: transform (dense, act, LayerNorm), then decoder: Linear(C, V) whose weight is the
      // word embeddings and whose bias is cls.predictions.bias (tied). RobertaLMHead.forward: dense, gelu
      // (activations.gelu: GELUActivation, the erf form, whatever hidden_act says), layer_norm, decoder (tied to
      // the word embeddings and lm_head.bias)
      const std::string_view dense = roberta ? "lm_head.dense" : "cls.predictions.transform.dense";
      const std::string_view norm = roberta ? "lm_head.layer_norm" : "cls.predictions.transform.LayerNorm";
      T h = linear(c, sequence_output, w.p(param_name("{}.weight", dense)), &w.p(param_name("{}.bias", dense)),
                   dense.data());
      h = activation(c, roberta ? Act::kGeluErf : m.mlp.act, h);
      h = layer_norm(c, h, &w.p(param_name("{}.weight", norm)), &w.p(param_name("{}.bias", norm)), norm.data());
      out.logits = linear(c, h, w.p(param_name("{}.embeddings.word_embeddings.weight", base(m))),
                          &w.p(roberta ? "lm_head.bias" : "cls.predictions.bias"), "MLM decoder");
      break;
    }
    case Head::kCausalLm:
      throw Error("internal: the causal-LM head of BERT and RoBERTa is not simulated");
  }
  if (labels) out.loss = flat_cross_entropy(c, out.logits, *labels);
  return out;
}

}  // namespace trainmem::sim
