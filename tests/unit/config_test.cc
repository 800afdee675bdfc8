// Config ingestion: defaults, aliases, overrides, and the error message for every kind of bad input.
#include "trainmem/config.h"

#include <gtest/gtest.h>

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
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "bert"})"); }),
            "test.json: key \"model_type\" = \"bert\": expected one of gpt2, nanogpt, llama, mistral, qwen2, qwen3, "
            "gemma, gemma2, phi3, mixtral, gpt_neox, opt, mlp");
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
            "test.json: key \"n_layer\" = 0: expected an integer in [1, 100000]");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": -3})"); }),
            "test.json: key \"n_layer\" = -3: expected an integer in [1, 100000]");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": 2.5})"); }),
            "test.json: key \"n_layer\" = 2.5: expected an integer in [1, 100000] (not a fractional or exponent-form "
            "number)");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "gpt2", "n_layer": "12"})"); }),
            "test.json: key \"n_layer\" = \"12\": expected an integer in [1, 100000], not a string");
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "tie_word_embeddings": "yes"})"); }),
            "test.json: key \"tie_word_embeddings\" = \"yes\": expected true or false");
}

TEST(ConfigErrors, AbsurdSizesAreRejectedNotWrapped) {
  EXPECT_EQ(error_of([] { from_json(R"({"model_type": "llama", "num_hidden_layers": 1000000000})"); }),
            "test.json: key \"num_hidden_layers\" = 1000000000: expected an integer in [1, 100000]");
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
            "test.json: key \"n_layer\" = \"abc\": expected an integer in [1, 100000], not a string");
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
