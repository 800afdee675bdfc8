// Config ingestion: defaults, aliases, overrides, and the error message for every kind of bad input.
#include "trainmem/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "test_util.h"
#include "trainmem/inventory.h"

namespace trainmem {
namespace {

using testing::error_of;
using testing::from_json;
using testing::MapFileReader;

TEST(Config, MissingKeysTakeTheTransformersDefaults) {
  // GPT2Config() defaults build GPT-2 small: 124,439,808 parameters.
  const ModelSpec gpt2 = from_json(R"({"model_type": "gpt2"})");
  EXPECT_EQ(parameter_count(build_inventory(gpt2)).value, 124'439'808u);
  EXPECT_EQ(gpt2.mlp.act, Act::kGeluNew);
  EXPECT_DOUBLE_EQ(gpt2.dropout.resid, 0.1);
  // LlamaConfig() defaults are Llama-2-7B's shapes: 6,738,415,616.
  EXPECT_EQ(parameter_count(build_inventory(from_json(R"({"model_type": "llama"})"))).value, 6'738'415'616u);
  // nanoGPT GPTConfig() defaults: vocab 50304, bias True.
  const ModelSpec nano = from_json(R"({"model_type": "nanogpt"})");
  EXPECT_EQ(nano.embed.vocab_size, 50304u);
  EXPECT_TRUE(nano.norm.bias);
  EXPECT_EQ(nano.impl, Impl::kNanoGpt);
}

TEST(Config, PhiTakesPhiConfigDefaults) {
  // PhiConfig() defaults are phi-1 / phi-1.5's shapes (hidden 2048, 24 layers, 32 heads, ffn 8192, vocab 51200):
  // 1,418,270,720 parameters, the safetensors total the Hugging Face Hub reports for microsoft/phi-1_5.
  const ModelSpec m = from_json(R"({"model_type": "phi"})");
  EXPECT_EQ(parameter_count(build_inventory(m)).value, 1'418'270'720u);
  EXPECT_EQ(m.attn.kv_heads, 32u);      // num_key_value_heads=None -> num_attention_heads
  EXPECT_EQ(m.attn.rotary_dim, 32u);    // int(head_dim 64 * partial_rotary_factor 0.5)
  EXPECT_EQ(m.mlp.act, Act::kGeluNew);  // hidden_act="gelu_new"
  EXPECT_FALSE(m.embed.tied);
  EXPECT_TRUE(m.embed.head_bias);       // lm_head = nn.Linear(..., bias=True)
  EXPECT_FALSE(m.attn.qk_norm);
  EXPECT_TRUE(m.parallel_residual);
  EXPECT_DOUBLE_EQ(m.dropout.resid, 0.0);
  // qk_layernorm=True: q_layernorm and k_layernorm, LayerNorm(head_dim) with weight and bias, in every layer
  const ModelSpec q = from_json(R"({"model_type": "phi", "qk_layernorm": true})");
  EXPECT_EQ(parameter_count(build_inventory(q)).value, 1'418'270'720u + 24u * 4u * 64u);
  // A tied head still has its own bias: the weight is listed once, the bias stays
  const ModelSpec t = from_json(R"({"model_type": "phi", "tie_word_embeddings": true})");
  EXPECT_EQ(parameter_count(build_inventory(t)).value, 1'418'270'720u - 51'200u * 2'048u);
}

TEST(Config, FalconTakesFalconConfigDefaults) {
  // FalconConfig() (configuration_falcon.py, 5.x) is falcon-7b's shape: vocab 65024, hidden 4544, 32 layers, 71
  // heads, multi_query and parallel_attn, no bias, ffn_hidden_size None -> 4 * hidden, activation "gelu", tied.
  const ModelSpec m = from_json(R"({"model_type": "falcon"})");
  EXPECT_EQ(m.family, Family::kFalcon);
  EXPECT_EQ(m.embed.vocab_size, 65'024u);
  EXPECT_EQ(m.hidden, 4'544u);
  EXPECT_EQ(m.layers, 32u);
  EXPECT_EQ(m.attn.heads, 71u);
  EXPECT_EQ(m.attn.head_dim, 64u);
  EXPECT_EQ(m.attn.kv_heads, 1u);  // multi_query: self.num_kv_heads = 1
  EXPECT_EQ(m.attn.falcon_qkv, FalconQkv::kMultiQuery);
  EXPECT_EQ(m.mlp.ffn, 18'176u);
  EXPECT_EQ(m.mlp.act, Act::kGeluErf);
  EXPECT_FALSE(m.attn.qkv_bias);
  EXPECT_FALSE(m.mlp.bias);
  EXPECT_FALSE(m.attn.alibi);
  EXPECT_EQ(m.attn.rotary_dim, 64u);
  EXPECT_TRUE(m.parallel_residual);
  EXPECT_EQ(m.norms_per_layer, 1u);  // one input_layernorm
  EXPECT_TRUE(m.embed.tied);
  EXPECT_EQ(m.max_positions, 0u);
  EXPECT_DOUBLE_EQ(m.dropout.attn, 0.0);
  EXPECT_DOUBLE_EQ(m.dropout.resid, 0.0);
  // query_key_value is hidden_size + 2 * head_dim wide for multi_query
  const Inventory inv = build_inventory(m);
  EXPECT_EQ(inv.parameters[1].name, "transformer.h.0.self_attention.query_key_value.weight");
  EXPECT_EQ(inv.parameters[1].shape, (std::vector<uint64_t>{4'672, 4'544}));

  // new_decoder_architecture: num_kv_heads None -> num_attention_heads, num_ln_in_parallel_attn None -> 2
  const ModelSpec n = from_json(R"({"model_type": "falcon", "new_decoder_architecture": true})");
  EXPECT_EQ(n.attn.kv_heads, 71u);
  EXPECT_EQ(n.attn.falcon_qkv, FalconQkv::kGroups);
  EXPECT_EQ(n.norms_per_layer, 2u);  // ln_attn and ln_mlp
  EXPECT_TRUE(n.parallel_residual);
  // multi_query false, parallel_attn false (falcon-rw): per-head q|k|v and two layer norms, in sequence
  const ModelSpec rw = from_json(R"({"model_type": "falcon", "multi_query": false, "parallel_attn": false,
                                     "alibi": true, "bias": true})");
  EXPECT_EQ(rw.attn.kv_heads, 71u);
  EXPECT_EQ(rw.attn.falcon_qkv, FalconQkv::kPerHead);
  EXPECT_FALSE(rw.parallel_residual);
  EXPECT_EQ(rw.norms_per_layer, 2u);
  EXPECT_TRUE(rw.attn.alibi);
  EXPECT_TRUE(rw.attn.qkv_bias && rw.attn.out_bias && rw.mlp.bias);
}

TEST(Config, FalconAliasesFollowTheDataclass) {
  // __post_init__: n_embed (the old spelling) replaces hidden_size when both are given
  EXPECT_EQ(from_json(R"({"model_type": "falcon", "n_embed": 256, "hidden_size": 128, "num_attention_heads": 4})")
                .hidden,
            256u);
  EXPECT_EQ(from_json(R"({"model_type": "falcon", "hidden_size": 128, "num_attention_heads": 4})").hidden, 128u);
  // explicit values: num_kv_heads under new_decoder_architecture, ffn_hidden_size
  const ModelSpec m = from_json(R"({"model_type": "falcon", "hidden_size": 128, "num_attention_heads": 8,
                                    "num_kv_heads": 2, "new_decoder_architecture": true, "ffn_hidden_size": 96,
                                    "num_ln_in_parallel_attn": 1})");
  EXPECT_EQ(m.attn.kv_heads, 2u);
  EXPECT_EQ(m.mlp.ffn, 96u);
  EXPECT_EQ(m.norms_per_layer, 1u);
  // 5.x FalconConfig has no attribute_map: n_layer and n_head are keys nothing reads
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "falcon"})", {"n_layer=2"}); }),
            "test.json: --set \"n_layer=2\": no supported architecture reads key \"n_layer\" for model_type "
            "\"falcon\" (did you mean \"num_hidden_layers\"?)");
}

TEST(ConfigErrors, FalconLayoutsTransformersCannotRun) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "falcon", "new_decoder_architecture": true,
                                         "parallel_attn": false})"); }),
            "test.json: key \"parallel_attn\" = false: expected true with \"new_decoder_architecture\": true "
            "(FalconDecoderLayer.forward has no layer norm to run otherwise: it registers input_layernorm and "
            "post_attention_layernorm but reads ln_attn/ln_mlp)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "falcon", "num_ln_in_parallel_attn": 2})"); }),
            "test.json: key \"num_ln_in_parallel_attn\" = 2: expected not 2 without \"new_decoder_architecture\" "
            "(FalconDecoderLayer.forward runs input_layernorm, which __init__ does not register then)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "falcon", "new_decoder_architecture": true,
                                         "num_kv_heads": 5})"); }),
            "test.json: key \"num_kv_heads\" = 5: expected a divisor of \"num_attention_heads\" = 71 (each "
            "key/value group serves NH / KV query heads)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "falcon", "multi_query": false, "num_kv_heads": 1})"); }),
            "test.json: key \"num_kv_heads\" = 1: expected \"num_attention_heads\" = 71 (or no value) with "
            "\"multi_query\": false and no \"new_decoder_architecture\" (FalconAttention.forward reshapes the 71 "
            "key heads of _split_heads to num_kv_heads)");
}

TEST(Config, T5TakesT5ConfigDefaults) {
  // T5Config() defaults are t5-small's shapes: 60,506,624 parameters (keras-nlp t5_presets.py t5_small "params").
  const ModelSpec m = from_json(R"({"model_type": "t5"})");
  EXPECT_EQ(m.family, Family::kT5);
  EXPECT_EQ(parameter_count(build_inventory(m)).value, 60'506'624u);
  EXPECT_EQ(m.embed.vocab_size, 32128u);
  EXPECT_EQ(m.hidden, 512u);                 // d_model
  EXPECT_EQ(m.attn.heads, 8u);               // num_heads
  EXPECT_EQ(m.attn.head_dim, 64u);           // d_kv
  EXPECT_EQ(m.mlp.ffn, 2048u);               // d_ff
  EXPECT_EQ(m.layers, 6u);                   // num_layers
  EXPECT_EQ(m.encdec.decoder_layers, 6u);    // num_decoder_layers=None -> num_layers
  EXPECT_EQ(m.encdec.rel_buckets, 32u);      // relative_attention_num_buckets
  EXPECT_EQ(m.encdec.rel_max_distance, 128u);
  EXPECT_EQ(m.mlp.act, Act::kRelu);          // feed_forward_proj="relu"
  EXPECT_FALSE(m.mlp.gated);
  EXPECT_TRUE(m.embed.tied);                 // PretrainedConfig's tie_word_embeddings=True
  EXPECT_EQ(m.attn_impl, AttnImpl::kEager);  // T5Attention has no SDPA path
  EXPECT_DOUBLE_EQ(m.dropout.resid, 0.1);    // dropout_rate
  EXPECT_DOUBLE_EQ(m.dropout.attn, 0.1);
}

TEST(Config, T5AliasesAndDecoderLayers) {
  // attribute_map: hidden_size->d_model, num_attention_heads->num_heads, num_hidden_layers->num_layers
  const ModelSpec a = from_json(
      R"({"model_type": "t5", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3})");
  EXPECT_EQ(a.hidden, 256u);
  EXPECT_EQ(a.attn.heads, 4u);
  EXPECT_EQ(a.layers, 3u);
  EXPECT_EQ(a.encdec.decoder_layers, 3u);
  const ModelSpec d = from_json(R"({"model_type": "t5", "num_layers": 8, "num_decoder_layers": 2})");
  EXPECT_EQ(d.layers, 8u);
  EXPECT_EQ(d.encdec.decoder_layers, 2u);
  // inner_dim = num_heads * d_kv need not be d_model (flan-t5-small: 6 heads of 64 over d_model 512)
  const ModelSpec w = from_json(R"({"model_type": "t5", "d_model": 512, "num_heads": 6, "d_kv": 64})");
  EXPECT_EQ(w.attn.heads * w.attn.head_dim, 384u);
}

TEST(Config, T5FeedForwardProj) {
  // "gated-gelu" -> dense_act_fn "gelu_new" ("for backwards compatibility"), is_gated_act
  const ModelSpec g = from_json(R"({"model_type": "t5", "feed_forward_proj": "gated-gelu"})");
  EXPECT_TRUE(g.mlp.gated);
  EXPECT_EQ(g.mlp.act, Act::kGeluNew);
  const ModelSpec s = from_json(R"({"model_type": "t5", "feed_forward_proj": "gated-silu"})");
  EXPECT_TRUE(s.mlp.gated);
  EXPECT_EQ(s.mlp.act, Act::kSilu);
  const ModelSpec e = from_json(R"({"model_type": "t5", "feed_forward_proj": "gelu"})");
  EXPECT_FALSE(e.mlp.gated);
  EXPECT_EQ(e.mlp.act, Act::kGeluErf);
  // a saved dense_act_fn / is_gated_act is set after T5Config derives them (PretrainedConfig's kwargs)
  const ModelSpec o = from_json(R"({"model_type": "t5", "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu"})");
  EXPECT_EQ(o.mlp.act, Act::kGeluErf);
  // gated-gelu, untied: 2 x 32128 x 512 embeddings more than a relu T5 of the same widths, plus a wi_1 per block
  const ModelSpec u = from_json(R"({"model_type": "t5", "feed_forward_proj": "gated-gelu",
                                    "tie_word_embeddings": false})");
  EXPECT_EQ(parameter_count(build_inventory(u)).value, 60'506'624u + 32'128u * 512u + 12u * 512u * 2'048u);
}

TEST(ConfigErrors, T5FeedForwardProjFormat) {
  const std::string expected =
      "`gated-{ACT_FN}` or `{ACT_FN}`, e.g. 'gated-gelu' or 'relu' (T5Config: not a valid activation function of "
      "the dense layer)";
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "t5", "feed_forward_proj": "relu-gated"})"); }),
            "test.json: key \"feed_forward_proj\" = \"relu-gated\": expected " + expected);
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "t5", "feed_forward_proj": "gated-gelu-new"})"); }),
            "test.json: key \"feed_forward_proj\" = \"gated-gelu-new\": expected " + expected);
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "t5", "feed_forward_proj": "gated-mish"})"); }),
            "test.json: key \"feed_forward_proj\" = \"gated-mish\": expected an activation of transformers' "
            "ACT2FN: one of gelu_new, gelu_fast, gelu_pytorch_tanh, gelu, quick_gelu, silu, relu, sigmoid");
}

TEST(Config, Gemma3TextTakesGemma3TextConfigDefaults) {
  const ModelSpec m = from_json(R"({"model_type": "gemma3_text"})");
  EXPECT_EQ(m.family, Family::kLlama);
  EXPECT_EQ(m.hidden, 2304u);
  EXPECT_EQ(m.layers, 26u);
  EXPECT_EQ(m.attn.heads, 8u);
  EXPECT_EQ(m.attn.kv_heads, 4u);
  EXPECT_EQ(m.attn.head_dim, 256u);
  EXPECT_EQ(m.embed.vocab_size, 262'208u);
  EXPECT_TRUE(m.embed.tied);
  EXPECT_TRUE(m.attn.qk_norm);
  EXPECT_EQ(m.norms_per_layer, 4u);
  EXPECT_TRUE(m.embed.scaled_by_sqrt_hidden);
  EXPECT_EQ(m.mlp.act, Act::kGeluTanh);  // hidden_activation="gelu_pytorch_tanh"
  EXPECT_DOUBLE_EQ(m.attn.softcap, 0.0);  // attn_logit_softcapping=None
  EXPECT_DOUBLE_EQ(m.final_softcap, 0.0);  // final_logit_softcapping=None
  // layer_types=None: "sliding_attention" if bool((i + 1) % 6) else "full_attention"
  ASSERT_EQ(m.attn.sliding_layers.size(), 26u);
  for (uint64_t i = 0; i < 26; ++i) EXPECT_EQ(m.attn.sliding_layers[i], (i + 1) % 6 != 0) << i;
  // layer_types, when given, wins over sliding_window_pattern
  const ModelSpec t = from_json(
      R"({"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window_pattern": 2,
          "layer_types": ["full_attention", "sliding_attention"], "final_logit_softcapping": 30.0})");
  EXPECT_EQ(t.attn.sliding_layers, (std::vector<bool>{false, true}));
  EXPECT_DOUBLE_EQ(t.final_softcap, 30.0);
}

TEST(Config, Starcoder2TakesStarcoder2ConfigDefaults) {
  const ModelSpec m = from_json(R"({"model_type": "starcoder2"})");
  EXPECT_EQ(m.family, Family::kLlama);
  EXPECT_EQ(m.embed.vocab_size, 49'152u);
  EXPECT_EQ(m.hidden, 3072u);
  EXPECT_EQ(m.mlp.ffn, 12'288u);
  EXPECT_EQ(m.layers, 30u);
  EXPECT_EQ(m.attn.heads, 24u);
  EXPECT_EQ(m.attn.kv_heads, 2u);
  EXPECT_EQ(m.attn.head_dim, 128u);
  EXPECT_TRUE(m.embed.tied);  // tie_word_embeddings is not a Starcoder2Config argument: PretrainedConfig's True
  EXPECT_EQ(m.norm.kind, NormKind::kLayerNorm);
  EXPECT_TRUE(m.norm.bias);
  EXPECT_FALSE(m.mlp.gated);  // Starcoder2MLP: c_proj(act(c_fc(x)))
  EXPECT_TRUE(m.attn.qkv_bias && m.attn.out_bias && m.mlp.bias);  // use_bias=True
  EXPECT_EQ(m.mlp.act, Act::kGeluTanh);
  // use_bias=False drops every projection's bias (the LayerNorms keep theirs)
  const ModelSpec nb = from_json(R"({"model_type": "starcoder2", "use_bias": false})");
  EXPECT_FALSE(nb.attn.qkv_bias || nb.attn.out_bias || nb.mlp.bias);
  EXPECT_TRUE(nb.norm.bias);
  const uint64_t C = 3072, F = 12'288, KV = 256, L = 30;
  EXPECT_EQ(parameter_count(build_inventory(m)).value - parameter_count(build_inventory(nb)).value,
            L * (C + KV + KV + C + F + C));
}

TEST(Config, BertTakesBertConfigDefaultsAndItsHead) {
  // BertConfig() is bert-base-uncased's shape; no architectures: the family's own head, BertForMaskedLM.
  const ModelSpec m = from_json(R"({"model_type": "bert"})");
  EXPECT_EQ(m.family, Family::kBert);
  EXPECT_EQ(m.head, Head::kMaskedLm);
  EXPECT_EQ(m.embed.vocab_size, 30'522u);
  EXPECT_EQ(m.max_positions, 512u);
  EXPECT_EQ(m.type_vocab, 2u);
  EXPECT_EQ(m.mlp.act, Act::kGeluErf);  // hidden_act="gelu": nn.functional.gelu
  EXPECT_TRUE(m.embed.tied);
  EXPECT_FALSE(m.pre_norm);
  EXPECT_DOUBLE_EQ(m.dropout.resid, 0.1);
  EXPECT_DOUBLE_EQ(m.classifier_dropout, 0.1);  // classifier_dropout=None -> hidden_dropout_prob
  // BertModel 108,891,648 (no pooler) + the MLM head (bias V, transform dense C*C + C, LayerNorm 2C)
  EXPECT_EQ(parameter_count(build_inventory(m)).value, 108'891'648u + 30'522u + 768u * 768u + 768u + 2u * 768u);
  // The head from architectures[0]; num_labels as PreTrainedConfig resolves it: id2label's length, else
  // num_labels, else 2
  const ModelSpec s = from_json(R"({"model_type": "bert", "architectures": ["BertForSequenceClassification"]})");
  EXPECT_EQ(s.head, Head::kSeqCls);
  EXPECT_EQ(s.num_labels, 2u);
  EXPECT_EQ(from_json(R"({"model_type": "bert", "architectures": ["BertForTokenClassification"],
                          "id2label": {"0": "O", "1": "B-PER", "2": "I-PER"}, "num_labels": 7})").num_labels,
            3u);
  EXPECT_EQ(from_json(R"({"model_type": "bert"})", {"num_labels=5"}).num_labels, 5u);
  // --head and --num-labels override the config
  ModelRequest req;
  req.head = Head::kTokenCls;
  req.num_labels = 9;
  const ModelSpec t = model_from_json(R"({"model_type": "bert", "architectures": ["BertForMaskedLM"]})", "t.json", req);
  EXPECT_EQ(t.head, Head::kTokenCls);
  EXPECT_EQ(t.num_labels, 9u);
  // BertForSequenceClassification keeps BertModel's pooler (dense C*C + C) and adds classifier (N*C + N);
  // BertForTokenClassification has no pooler
  EXPECT_EQ(parameter_count(build_inventory(s)).value, 108'891'648u + 768u * 768u + 768u + 2u * 768u + 2u);
  EXPECT_EQ(parameter_count(build_inventory(t)).value, 108'891'648u + 9u * 768u + 9u);
  EXPECT_EQ(from_json(R"({"model_type": "bert", "max_position_embeddings": 128})").max_positions, 128u);
}

TEST(Config, RobertaTakesRobertaConfigDefaultsAndItsHeads) {
  // RobertaConfig(): BertConfig's shape with vocab_size=50265 and pad_token_id=1; position ids start at
  // padding_idx + 1 = 2, so the 512 rows hold 510 tokens
  const ModelSpec m = from_json(R"({"model_type": "roberta"})");
  EXPECT_EQ(m.family, Family::kRoberta);
  EXPECT_EQ(m.head, Head::kMaskedLm);
  EXPECT_EQ(m.embed.vocab_size, 50'265u);
  EXPECT_EQ(m.embed.position_rows, 512u);
  EXPECT_EQ(m.position_offset, 2u);
  EXPECT_EQ(m.max_positions, 510u);
  // RobertaModel without the pooler: embeddings (V + 512 + 2 rows of C, LayerNorm 2C) + 12 BERT layers
  constexpr uint64_t C = 768, kModel = (50'265u + 512u + 2u) * C + 2u * C + 12u * 7'087'872u;
  const Inventory inv = build_inventory(m);
  // RobertaLMHead: bias V, dense C*C + C, layer_norm 2C (decoder tied to the word embeddings and to bias)
  EXPECT_EQ(parameter_count(inv).value, kModel + 50'265u + C * C + C + 2u * C);
  // RobertaEmbeddings deletes BertEmbeddings' position_embeddings and registers a new one: listed last
  EXPECT_EQ(inv.parameters[4].name, "roberta.embeddings.position_embeddings.weight");
  EXPECT_EQ(inv.parameters[inv.parameters.size() - 5].name, "lm_head.bias");
  // RobertaForSequenceClassification: no pooler; RobertaClassificationHead dense (C*C + C) and out_proj (N*C + N)
  const ModelSpec s = from_json(R"({"model_type": "roberta", "architectures": ["RobertaForSequenceClassification"],
                                    "id2label": {"0": "neg", "1": "neu", "2": "pos"}})");
  EXPECT_EQ(s.head, Head::kSeqCls);
  EXPECT_EQ(parameter_count(build_inventory(s)).value, kModel + C * C + C + 3u * C + 3u);
  const ModelSpec t = from_json(R"({"model_type": "roberta", "architectures": ["RobertaForTokenClassification"]})");
  EXPECT_EQ(parameter_count(build_inventory(t)).value, kModel + 2u * C + 2u);
  EXPECT_NE(error_of([] { from_json(R"({"model_type": "roberta", "max_position_embeddings": 2})"); })
                .find("more than pad_token_id + 1 = 2"),
            std::string::npos);
}

TEST(Config, DecoderSequenceClassificationReplacesTheLmHeadWithScore) {
  // GenericForSequenceClassification: the base model, then score = nn.Linear(hidden, num_labels, bias=False); no
  // lm_head (tied or not). pad_token_id is read: the pooling needs it.
  const char* kLlama = R"({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "tie_word_embeddings": false, "pad_token_id": 3)";
  const ModelSpec lm = from_json(std::string(kLlama) + "}");
  EXPECT_EQ(lm.head, Head::kCausalLm);
  const ModelSpec s = from_json(std::string(kLlama) + R"(, "architectures": ["LlamaForSequenceClassification"],
                                                          "num_labels": 5})");
  EXPECT_EQ(s.head, Head::kSeqCls);
  EXPECT_EQ(s.num_labels, 5u);
  EXPECT_EQ(s.pad_token_id, 3u);
  const Inventory inv = build_inventory(s);
  EXPECT_EQ(inv.parameters.back().name, "score.weight");
  EXPECT_EQ(parameter_count(inv).value, parameter_count(build_inventory(lm)).value - 96u * 64u + 5u * 64u);
  EXPECT_NE(error_of([] {
              from_json(R"({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]})");
            }).find("needs pad_token_id"),
            std::string::npos);
}

TEST(ConfigErrors, DecoderTokenClassificationAndDistilbertAreRefused) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "architectures": ["LlamaForTokenClassification"]})"); }),
            "test.json: key \"architectures\" = [\"LlamaForTokenClassification\"]: expected a class of a head "
            "simulated for model_type \"llama\" (causal-lm, seq-cls); its token-cls head is not simulated yet "
            "(--head picks another)");
  EXPECT_NE(error_of([] { from_json(R"({"model_type": "distilbert"})"); }).find("DistilBERT is not simulated yet"),
            std::string::npos);
}

TEST(ConfigErrors, BertHeadsAndLabels) {
  EXPECT_EQ(error_of([] {
              from_json(R"({"model_type": "bert", "architectures": ["BertForSequenceClassification"], "num_labels": 1})");
            }),
            "test.json: num_labels 1: with 1 label transformers computes a regression loss (MSELoss), which is not "
            "simulated; use 2 or more (--num-labels)");
  ModelRequest req;
  req.head = Head::kCausalLm;
  EXPECT_EQ(error_of([&] { model_from_json(R"({"model_type": "bert"})", "t.json", req); }),
            "t.json: --head causal-lm: the causal-lm head is not simulated for model_type \"bert\" (its family "
            "builds: masked-lm, seq-cls, token-cls)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "bert", "is_decoder": true})"); }),
            "test.json: key \"is_decoder\" = true: expected false: the decoder mode (BertLMHeadModel, a causal mask) "
            "is not simulated; the encoder is");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "bert"})", {"tie_word_embeddings=false"}); }).find("untied"),
            std::string::npos);  // the reader accepts it; the masked-LM table refuses it
  EXPECT_NE(error_of([] { build_inventory(from_json(R"({"model_type": "bert", "tie_word_embeddings": false})")); })
                .find("tie_word_embeddings false with the masked-LM head"),
            std::string::npos);
}

TEST(Config, DeepseekV3TakesDeepseekV3ConfigDefaults) {
  // DeepseekV3Config() (configuration_deepseek_v3.py @001f85b) is DeepSeek-V3's main model. Its count by hand:
  // attention per layer q_a_proj 1536x7168 + q_a_layernorm 1536 + q_b_proj (128x192)x1536 + kv_a_proj_with_mqa
  // (512+64)x7168 + kv_a_layernorm 512 + kv_b_proj (128x256)x512 + o_proj 7168x(128x128) = 187,107,328, norms
  // 2x7168; 3 dense layers of MLP 3x7168x18432 = 396,361,728; 58 MoE layers of experts 256x3x2048x7168 +
  // gate 256x7168 + shared experts 3x2048x7168 = 11,320,164,352; embeddings and lm_head 2x129280x7168, final norm
  // 7168: 671,026,404,352, DeepSeek's "671B" main model (README_WEIGHTS.md), and the oracle's reference model's.
  const ModelSpec m = from_json(R"({"model_type": "deepseek_v3"})");
  EXPECT_EQ(m.family, Family::kLlama);
  EXPECT_EQ(parameter_count(build_inventory(m)).value, 671'026'404'352u);
  EXPECT_EQ(m.attn.heads, 128u);
  EXPECT_EQ(m.attn.kv_heads, 128u);
  EXPECT_EQ(m.attn.head_dim, 192u);  // qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
  EXPECT_EQ(m.attn.rotary_dim, 64u);
  EXPECT_EQ(m.attn.mla.q_lora_rank, 1536u);
  EXPECT_EQ(m.attn.mla.kv_lora_rank, 512u);
  EXPECT_EQ(m.attn.mla.v_head_dim, 128u);
  EXPECT_TRUE(m.attn.mla.interleave);
  EXPECT_FALSE(m.embed.tied);
  EXPECT_EQ(m.moe.experts, 256u);
  EXPECT_EQ(m.moe.top_k, 8u);
  EXPECT_EQ(m.moe.ffn, 2048u);
  EXPECT_EQ(m.moe.shared_ffn, 2048u);
  EXPECT_EQ(m.moe.groups, 8u);
  EXPECT_EQ(m.moe.topk_groups, 4u);
  EXPECT_TRUE(m.moe.norm_topk_prob);
  EXPECT_EQ(m.moe.dense_layers, (std::vector<uint64_t>{0, 1, 2}));  // first_k_dense_replace=3
  EXPECT_FALSE(is_moe_layer(m, 2));
  EXPECT_TRUE(is_moe_layer(m, 3));
  // q_lora_rank null: one q_proj (128x192)x7168 in place of q_a_proj, q_a_layernorm and q_b_proj, in 61 layers
  const ModelSpec q = from_json(R"({"model_type": "deepseek_v3", "q_lora_rank": null})");
  EXPECT_EQ(q.attn.mla.q_lora_rank, 0u);
  EXPECT_EQ(parameter_count(build_inventory(q)).value, 671'026'404'352ull + 61ull * (24'576ull * 7168 - 48'760'320));
  // num_local_experts is DeepseekV3Config's attribute_map alias of n_routed_experts
  EXPECT_EQ(from_json(R"({"model_type": "deepseek_v3", "num_local_experts": 64})").moe.experts, 64u);
}

TEST(ConfigErrors, DeepseekV3RefusesWhatItDoesNotModel) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "deepseek_v3", "num_key_value_heads": 64})"); }),
            "test.json: key \"num_key_value_heads\" = 64: expected num_attention_heads = 128 (MLA's keys have one "
            "head per query head)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "deepseek_v3", "n_group": 3})"); }),
            "test.json: key \"n_group\" = 3: expected a divisor of \"n_routed_experts\" = 256 leaving at least 2 "
            "experts per group (each group scores its top 2)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "deepseek_v3", "topk_group": 9})"); }),
            "test.json: key \"topk_group\" = 9: expected at most \"n_group\" = 8");
  EXPECT_EQ(error_of([] {
              from_json(R"({"model_type": "deepseek_v3", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})");
            }),
            "test.json: key \"rope_scaling\" = {\"factor\":2.0,\"rope_type\":\"dynamic\"}: expected rope_type "
            "\"default\" or \"yarn\" (the dynamic RoPE types are not simulated)");
}

TEST(ConfigErrors, Gemma3LayerTypesMustNameEachLayer) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gemma3_text", "num_hidden_layers": 2,
                                         "layer_types": ["full_attention"]})"); }),
            "test.json: key \"layer_types\" = [\"full_attention\"]: expected a list of 2 (num_hidden_layers) "
            "\"sliding_attention\" or \"full_attention\" entries");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gemma3_text", "num_hidden_layers": 1,
                                         "layer_types": ["chunked_attention"]})"); }),
            "test.json: key \"layer_types\" = \"chunked_attention\": expected \"sliding_attention\" or "
            "\"full_attention\"");
}

TEST(ConfigErrors, PhiNeedsRotaryDims) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "phi", "partial_rotary_factor": 0.01})"); }),
            "test.json: key \"partial_rotary_factor\" = 0.01: expected a factor that leaves at least 2 rotary dims of "
            "the head's 64 (0 rotary dims is not simulated)");
}

TEST(Config, AliasesAndNullMeanTheSameAsTransformers) {
  // attribute_map: hidden_size -> n_embd; null head_dim and num_key_value_heads are derived.
  EXPECT_EQ(from_json(R"({"model_type": "gpt2", "hidden_size": 1024, "n_head": 16})").hidden, 1024u);
  const ModelSpec m = from_json(R"({"model_type": "llama", "head_dim": null, "num_key_value_heads": null})");
  EXPECT_EQ(m.attn.head_dim, 128u);
  EXPECT_EQ(m.attn.kv_heads, 32u);
}

TEST(Config, SetOverridesAnyKeyBeforeItIsRead) {
  const ModelSpec m = from_json(R"({"model_type": "gpt2"})", {"n_layer=24", "tie_word_embeddings=false"});
  EXPECT_EQ(m.layers, 24u);
  EXPECT_FALSE(m.embed.tied);
  // Presets too.
  ModelRequest req;
  req.model = "llama-2-7b";
  req.overrides = {"num_hidden_layers=2"};
  EXPECT_EQ(load_model(req, MapFileReader()).layers, 2u);
}

TEST(Config, ModelArgumentIsAPresetOrAFile) {
  MapFileReader files;
  files.files["/tmp/x/config.json"] = R"({"model_type": "opt"})";
  ModelRequest req;
  req.model = "/tmp/x/config.json";
  EXPECT_EQ(load_model(req, files).model_type, "opt");
  req.model = "gpt3";
  EXPECT_EQ(error_of([&] { load_model(req, files); }),
            "--model \"gpt3\": not a preset (see `trainmem models`) and no readable file at that path");
}

TEST(ConfigErrors, MalformedEmptyAndNonObjectJson) {
  EXPECT_EQ(error_of([] { from_json(""); }), "test.json: the file is empty (expected a JSON object like a config.json)");
  EXPECT_EQ(error_of([] { from_json("{\"model_type\": "); }).rfind("test.json: not valid JSON: ", 0), 0u);
  EXPECT_EQ(error_of([] { from_json("[1, 2]"); }),
            "test.json: expected a JSON object (a config.json), got a JSON array");
}

TEST(ConfigErrors, MissingAndUnknownModelType) {
  EXPECT_EQ(error_of([] { from_json(R"({"n_layer": 2})"); }),
            "test.json: missing required key \"model_type\" (expected a string)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "bart"})"); }),
            "test.json: key \"model_type\" = \"bart\": expected one of gpt2, nanogpt, llama, mistral, qwen2, qwen3, "
            "gemma, gemma2, phi3, mixtral, qwen2_moe, qwen3_moe, gemma3_text, starcoder2, deepseek_v3, gpt_neox, opt, "
            "phi, bert, roberta, falcon, t5, mlp");
}

TEST(ConfigErrors, HeadsThatDoNotDivideTheWidth) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_embd": 768, "n_head": 7})"); }),
            "test.json: key \"n_head\" = 7: expected a divisor of \"n_embd\" = 768 (the head width is n_embd / heads)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "num_key_value_heads": 5})"); }),
            "test.json: key \"num_key_value_heads\" = 5: expected a divisor of \"num_attention_heads\" = 32 (each "
            "key/value head serves a group of query heads)");
  // An explicit head_dim lifts the divisibility requirement, as in transformers (Gemma: 8 x 256 on 2048).
  EXPECT_NO_THROW(from_json(R"({"model_type": "llama", "hidden_size": 1000, "num_attention_heads": 8,
                                "head_dim": 128})"));
}

TEST(ConfigErrors, SizesMustBePositiveIntegers) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": 0})"); }),
            "test.json: key \"n_layer\" = 0: expected an integer in [1, 1024]");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": -3})"); }),
            "test.json: key \"n_layer\" = -3: expected an integer in [1, 1024]");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": 2.5})"); }),
            "test.json: key \"n_layer\" = 2.5: expected an integer in [1, 1024] (not a fractional or exponent-form "
            "number)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": "12"})"); }),
            "test.json: key \"n_layer\" = \"12\": expected an integer in [1, 1024], not a string");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "tie_word_embeddings": "yes"})"); }),
            "test.json: key \"tie_word_embeddings\" = \"yes\": expected true or false");
}

TEST(ConfigErrors, AbsurdSizesAreRejectedNotWrapped) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "num_hidden_layers": 1000000000})"); }),
            "test.json: key \"num_hidden_layers\" = 1000000000: expected an integer in [1, 1024]");
  // A number beyond 64 bits parses as a float and is rejected as such.
  EXPECT_NE(error_of([] { from_json(R"({"model_type": "llama", "vocab_size": 99999999999999999999999})"); }), "");
}

TEST(ConfigErrors, BadEnumValuesAndOverrides) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "hidden_act": "mish"})"); }),
            "test.json: key \"hidden_act\" = \"mish\": expected one of gelu_new, gelu_fast, gelu_pytorch_tanh, gelu, "
            "quick_gelu, silu, swish, relu, sigmoid");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2"})", {"n_layer"}); }),
            "--set \"n_layer\": expected key=value (e.g. --set n_layer=24)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2"})", {"n_layer=abc"}); }),
            "test.json: key \"n_layer\" = \"abc\": expected an integer in [1, 1024], not a string");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "mixtral", "num_experts_per_tok": 9})"); }),
            "test.json: key \"num_experts_per_tok\" = 9: expected at most \"num_local_experts\" = 8");
}

TEST(ConfigErrors, ImplementationMustFitTheModel) {
  ModelRequest req;
  req.impl = Impl::kNanoGpt;
  EXPECT_EQ(error_of([&] { model_from_json(R"({"model_type": "llama"})", "l.json", req); }),
            "l.json: --impl nanogpt builds GPT-2 shaped models only (model_type gpt2 or nanogpt), not model_type "
            "\"llama\"");
  req.impl = Impl::kHf;
  EXPECT_NE(error_of([&] { model_from_json(R"({"model_type": "nanogpt", "bias": false})", "n.json", req); }), "");
  // nanoGPT can build a GPT-2 config (it loads GPT-2 checkpoints): same parameter count as transformers.
  req.impl = Impl::kNanoGpt;
  EXPECT_EQ(parameter_count(build_inventory(model_from_json(R"({"model_type": "gpt2"})", "g.json", req))).value,
            124'439'808u);
}

TEST(Config, MissingShapeKeysWarnAndTakeTheDefault) {
  std::vector<std::string> warnings;
  const ModelSpec m = model_from_json(R"({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
      "num_attention_heads": 9, "vocab_size": 49152})", "l.json", ModelRequest(), &warnings);
  EXPECT_EQ(m.layers, 32u);
  EXPECT_EQ(warnings, std::vector<std::string>{
                          "l.json: key \"num_hidden_layers\" is missing; using transformers' LlamaConfig default 32"});
  // A default of None is derived from the other keys, not a guess: Llama's num_key_value_heads (= heads) and
  // GPT-2's n_inner (= 4 * n_embd) do not warn. Mistral's num_key_value_heads defaults to 8: that warns.
  warnings.clear();
  model_from_json(R"({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
      "n_layer": 12, "n_head": 12})", "g.json", ModelRequest(), &warnings);
  EXPECT_TRUE(warnings.empty());
  model_from_json(R"({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
      "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32})", "m.json", ModelRequest(),
                  &warnings);
  EXPECT_EQ(warnings, std::vector<std::string>{"m.json: key \"num_key_value_heads\" is missing; using "
                                               "transformers' MistralConfig default 8"});
  // Every shape key of an empty GPT-2 config, in the order read; nanoGPT names its own dataclass.
  warnings.clear();
  model_from_json(R"({"model_type": "gpt2"})", "e.json", ModelRequest(), &warnings);
  ASSERT_EQ(warnings.size(), 5u);
  EXPECT_EQ(warnings[0], "e.json: key \"vocab_size\" is missing; using transformers' GPT2Config default 50257");
  EXPECT_EQ(warnings[4], "e.json: key \"n_head\" is missing; using transformers' GPT2Config default 12");
  warnings.clear();
  model_from_json(R"({"model_type": "nanogpt", "n_layer": 2})", "n.json", ModelRequest(), &warnings);
  EXPECT_EQ(warnings[0], "n.json: key \"vocab_size\" is missing; using nanoGPT's GPTConfig default 50304");
}

TEST(Config, PresetsHaveEveryShapeKey) {
  for (const Preset& p : presets()) {
    ModelRequest req;
    req.model = std::string(p.name);
    std::vector<std::string> warnings;
    load_model(req, MapFileReader(), &warnings);
    EXPECT_EQ(warnings, std::vector<std::string>{}) << p.name;
  }
}

TEST(Config, SetOfAnAliasWinsOverTheSpellingInTheFile) {
  // The gpt2 preset spells the layer count "n_layer"; "num_hidden_layers" is its attribute_map alias.
  ModelRequest req;
  req.model = "gpt2";
  req.overrides = {"num_hidden_layers=3"};
  const ModelSpec m = load_model(req, MapFileReader());
  EXPECT_EQ(m.layers, 3u);
  // 9 fewer GPT-2 small blocks of 7,087,872 parameters each (2 LayerNorms, c_attn, c_proj, c_fc, c_proj).
  EXPECT_EQ(parameter_count(build_inventory(m)).value, 124'439'808u - 9u * 7'087'872u);
  // Of two aliases set, the last one wins; set to null, the alias means absent: the default, not the file's.
  EXPECT_EQ(from_json(R"({"model_type": "gpt2"})", {"num_hidden_layers=3", "n_layer=5"}).layers, 5u);
  EXPECT_EQ(from_json(R"({"model_type": "gpt2", "n_layer": 4})", {"num_hidden_layers=null"}).layers, 12u);
}

TEST(ConfigErrors, SetOfAKeyThatNothingReads) {
  ModelRequest req;
  req.model = "llama-2-7b";
  req.overrides = {"num_hidden_layer=2"};
  EXPECT_EQ(error_of([&] { load_model(req, MapFileReader()); }),
            "preset llama-2-7b: --set \"num_hidden_layer=2\": no supported architecture reads key \"num_hidden_layer\" "
            "for model_type \"llama\" (did you mean \"num_hidden_layers\"?)");
  // Another family's spelling: Llama reads num_hidden_layers, not GPT-2's n_layer.
  req.overrides = {"n_layer=2"};
  EXPECT_EQ(error_of([&] { load_model(req, MapFileReader()); }),
            "preset llama-2-7b: --set \"n_layer=2\": no supported architecture reads key \"n_layer\" for model_type "
            "\"llama\" (did you mean \"num_hidden_layers\"?)");
  // A nested key is checked by its top-level key; Gemma 2 reads hidden_activation, not hidden_act.
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2"})", {"rope_scaling.factor=2"}); }),
            "test.json: --set \"rope_scaling.factor=2\": no supported architecture reads key \"rope_scaling\" for "
            "model_type \"gpt2\" (did you mean \"n_positions\"?)");
  EXPECT_NE(error_of([] { from_json(R"({"model_type": "gemma2"})", {"hidden_act=gelu"}); }).find(
                "(did you mean \"hidden_activation\"?)"),
            std::string::npos);
  // Keys of the file itself that nothing reads stay ignored, as in transformers; so do the bookkeeping keys.
  EXPECT_NO_THROW(from_json(R"({"model_type": "gpt2", "lora_r": 8})"));
  EXPECT_NO_THROW(from_json(R"({"model_type": "gpt2"})", {"_source=mine", "architectures=null", "model_type=gpt2"}));
  // OPT reads _remove_final_layer_norm even where it changes nothing (post-norm).
  EXPECT_NO_THROW(from_json(R"({"model_type": "opt"})", {"do_layer_norm_before=false",
                                                        "_remove_final_layer_norm=true"}));
}

TEST(ConfigErrors, OnlyTheHeadsEachFamilyBuilds) {
  const std::string head_error =
      "test.json: key \"architectures\" = [\"LlamaForTokenClassification\"]: expected a class of a head simulated "
      "for model_type \"llama\" (causal-lm, seq-cls); its token-cls head is not simulated yet (--head picks "
      "another)";
  EXPECT_EQ(error_of([] {
              from_json(R"({"model_type": "llama", "architectures": ["LlamaForTokenClassification"]})");
            }),
            head_error);
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "bert", "architectures": ["BertForQuestionAnswering"]})"); }),
            "test.json: key \"architectures\" = [\"BertForQuestionAnswering\"]: expected ...ForCausalLM, "
            "...LMHeadModel, ...ForMaskedLM, ...ForSequenceClassification or ...ForTokenClassification; other task "
            "heads (question answering, multiple choice, pretraining) are not modelled yet (--head picks one that is)");
  for (const char* head : {"LlamaForTokenClassification", "OPTForQuestionAnswering", "GPT2DoubleHeadsModel",
                           "BertForMaskedLM", "LlamaModel"}) {
    const std::string text = std::string(R"({"model_type": "llama", "architectures": [")") + head + "\"]}";
    EXPECT_NE(error_of([&] { from_json(text); }), "") << head;
  }
  // One task head among several is one too many.
  EXPECT_NE(error_of([] {
              from_json(R"({"model_type": "llama", "architectures": ["LlamaForCausalLM", "LlamaForTokenClassification"]})");
            }),
            "");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "architectures": "LlamaForCausalLM"})"); }),
            "test.json: key \"architectures\" = \"LlamaForCausalLM\": expected a list of class names like "
            "[\"LlamaForCausalLM\"]");
  // Causal LMs, and configs that name no class (nanoGPT, hand-written ones).
  EXPECT_NO_THROW(from_json(R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})"));
  EXPECT_NO_THROW(from_json(R"({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})"));
  EXPECT_NO_THROW(from_json(R"({"model_type": "opt", "architectures": ["OPTForCausalLM"]})"));
  EXPECT_NO_THROW(from_json(R"({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})"));
  EXPECT_NO_THROW(from_json(R"({"model_type": "llama", "architectures": []})"));
  EXPECT_NO_THROW(from_json(R"({"model_type": "llama", "architectures": null})"));
}

TEST(ConfigErrors, NumbersBeyondADoubleAreBadInput) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "vocab_size": 1e400})"); }),
            "test.json: not valid JSON: a number is out of range: key \"vocab_size\" = 1e400 (beyond the largest "
            "double, about 1.8e308)");
  // The key path of a nested number; an array element is named by the key that holds the array.
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "rope_scaling": {"type": "linear",
                                      "factor": -1e999}})"); }),
            "test.json: not valid JSON: a number is out of range: key \"rope_scaling.factor\" = -1e999 (beyond the "
            "largest double, about 1.8e308)");
  EXPECT_EQ(error_of([] { from_json(R"({"a": {"b": 1}, "eos": [2, 1e400]})"); }),
            "test.json: not valid JSON: a number is out of range: key \"eos\" = 1e400 (beyond the largest double, "
            "about 1.8e308)");
  EXPECT_EQ(error_of([] { from_json("[" + std::string(400, '9') + "]"); }),
            "test.json: not valid JSON: a number is out of range: 9999999999999999999999999999999999999... (beyond "
            "the largest double, about 1.8e308)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2"})", {"n_layer=1e400"}); }),
            "test.json: --set \"n_layer=1e400\": the number 1e400 is out of range (beyond the largest double, about "
            "1.8e308)");
  // Text that merely starts like a number stays text.
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2"})", {"n_layer=1e400x"}); }),
            "test.json: key \"n_layer\" = \"1e400x\": expected an integer in [1, 1024], not a string");
}

TEST(ConfigErrors, ValuesInMessagesAreBoundedAndValidUtf8) {
  // Command-line bytes that are not UTF-8 are shown with U+FFFD instead of failing to print.
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2"})", {"n_layer=\xff"}); }),
            "test.json: key \"n_layer\" = \"\xEF\xBF\xBD\": expected an integer in [1, 1024], not a string");
  // A value 200,000 arrays deep is shown three levels deep: printing it whole would overflow the stack.
  const size_t depth = 200'000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  EXPECT_EQ(error_of([&] { from_json(R"({"model_type": "llama", "num_hidden_layers": )" + deep + "}"); }),
            "test.json: key \"num_hidden_layers\" = [[[...]]]: expected an integer in [1, 1024], not a array");
  EXPECT_EQ(error_of([&] { from_json(R"({"model_type": "llama", "hidden_act": )" + deep + "}"); }).substr(0, 41),
            "test.json: key \"hidden_act\" = [[[...]]]: ");
  // A long list is cut at 60 characters.
  std::string list = "[0";
  for (int i = 1; i < 100'000; ++i) list += "," + std::to_string(i);
  EXPECT_EQ(error_of([&] { from_json(R"({"model_type": "llama", "hidden_size": )" + list + "]}"); }),
            "test.json: key \"hidden_size\" = [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,...: "
            "expected an integer in [1, 16777216], not a array");
}

// Files and folders served from memory.
class FolderReader final : public FileReader {
 public:
  std::map<std::string, std::string> files;
  std::set<std::string> folders;
  std::optional<std::string> read(const std::string& path) const override {
    auto it = files.find(path);
    if (it == files.end()) return std::nullopt;
    return it->second;
  }
  bool is_directory(const std::string& path) const override { return folders.contains(path); }
};

TEST(Config, ModelFolderMeansItsConfigJson) {
  FolderReader fs;
  fs.folders = {"ckpt", "ckpt/", "empty"};
  fs.files["ckpt/config.json"] = R"({"model_type": "opt", "num_hidden_layers": 2})";
  ModelRequest req;
  req.model = "ckpt";
  EXPECT_EQ(load_model(req, fs).layers, 2u);
  req.model = "ckpt/";
  EXPECT_EQ(load_model(req, fs).layers, 2u);
  req.overrides = {"num_hidden_layers=x"};
  EXPECT_EQ(error_of([&] { load_model(req, fs); }),
            "ckpt/config.json: key \"num_hidden_layers\" = \"x\": expected an integer in [1, 1024], not a string");
  req.model = "empty";
  EXPECT_EQ(error_of([&] { load_model(req, fs); }), "--model \"empty\": a directory without a config.json");
}

TEST(ConfigErrors, DiskFileReaderRefusesDevicesAndHugeFiles) {
  const DiskFileReader disk;
  EXPECT_EQ(error_of([&] { disk.read("/dev/zero"); }),
            "/dev/zero: not a regular file (expected a config.json of at most 64 MiB)");
  // A sparse file one byte past the bound: refused from its size, without reading it.
  const std::string huge = ::testing::TempDir() + "trainmem_config_test_huge.json";
  { std::ofstream(huge, std::ios::binary).put('{'); }
  std::filesystem::resize_file(huge, kMaxConfigFileBytes + 1);
  EXPECT_EQ(error_of([&] { disk.read(huge); }),
            huge + ": larger than 64 MiB, the most read as a config.json (real ones are at most a few hundred KB)");
  std::filesystem::remove(huge);
  EXPECT_FALSE(disk.read(huge).has_value());
  EXPECT_TRUE(disk.is_directory(::testing::TempDir()));
}

TEST(Config, LayerStackForAllocatorExperiments) {
  const ModelSpec m = from_json(R"({"model_type": "mlp", "input": 200,
      "layers": [{"linear": 100}, "relu", {"linear": 200}, "sigmoid"]})");
  EXPECT_EQ(m.stack.size(), 4u);
  const Inventory inv = build_inventory(m);
  EXPECT_EQ(parameter_count(inv).value, 200u * 100 + 100 + 100 * 200 + 200);
  EXPECT_EQ(inv.parameters[2].name, "2.weight");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "mlp", "input": 4, "layers": ["tanh"]})"); }),
            "test.json: key \"layers[0]\" = \"tanh\": expected \"relu\", \"gelu\", \"sigmoid\", \"layer_norm\" or "
            "{\"linear\": N}");
}

}  // namespace
}  // namespace trainmem
