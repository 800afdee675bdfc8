// The parameter inventory against published exact parameter counts (sum(p.numel() for p in
// model.parameters()), tied weights once) and against seed 000's steady-state rows.
#include "trainmem/inventory.h"

#include <gtest/gtest.h>

#include <fstream>
#include <optional>
#include <sstream>

#include "test_util.h"
#include "trainmem/estimate.h"

namespace trainmem {
namespace {

using testing::from_json;
using testing::preset;

struct Published {
  const char* preset;
  uint64_t count;
  const char* source;
  // The module set the count is of, where it is not the preset's whole model: the preset built with this head
  // (--head), less the parameters whose names start with `minus` (a task head the published backbone lacks).
  std::optional<Head> head = std::nullopt;
  const char* minus = nullptr;
  const char* minus2 = nullptr;
  // Also leave out RoBERTa's position rows 0..padding_idx, which no position id reaches
  // (create_position_ids_from_input_ids starts at padding_idx + 1) and a published backbone may not have.
  bool less_unreached_positions = false;
};

// Every preset with the exact count published for the real checkpoint. Sources are quoted in the
// research notes behind data/models; each line names the primary one.
constexpr Published kPublished[] = {
    {"gpt2", 124'439'808, "keras-team/keras-hub gpt2_presets.py@0e1444f gpt2_base_en params; arXiv:2502.00706 Tab.4"},
    {"gpt2-medium", 354'823'168, "keras-hub gpt2_presets.py gpt2_medium_en; arXiv:2502.00706 Table 4"},
    {"gpt2-large", 774'030'080, "keras-hub gpt2_presets.py gpt2_large_en; arXiv:2502.00706 Table 4"},
    {"gpt2-xl", 1'557'611'200, "keras-hub gpt2_presets.py gpt2_extra_large_en"},
    {"nanogpt-gpt2", 124'373'760, "seed 000 steady-state table, 'N Parameters' row (Actual)"},
    {"llama-2-7b", 6'738'415'616, "keras-hub llama_presets.py@5d163ca llama2_7b_en"},
    {"llama-2-13b", 13'015'864'320, "arXiv:2502.13533 (LoRAM) Table 4, '#Orig. Params' of LLaMA-2-13B"},
    {"llama-3-8b", 8'030'261'248, "keras-hub llama3_presets.py@2f5dce1 llama3_8b_en"},
    {"llama-3.1-70b", 70'553'706'496, "Hugging Face Hub API meta-llama/Llama-3.3-70B-Instruct safetensors.total"},
    // Llama 3 70B has Llama 3.1/3.3 70B's shapes (only the context length and rope scaling differ, which hold no
    // parameters): the same published total
    {"llama-3-70b", 70'553'706'496, "Hugging Face Hub API meta-llama/Llama-3.3-70B-Instruct safetensors.total (same shapes)"},
    {"mistral-7b", 7'241'732'096, "keras-hub mistral_presets.py@0e1444f mistral_7b_en"},
    {"mixtral-8x7b", 46'702'792'704, "keras-hub mixtral_presets.py@36ad74e mixtral_8_7b_en (all experts)"},
    {"qwen3-30b-a3b", 30'532'122'624, "keras-hub qwen3_moe_presets.py@79c5664 qwen3_moe_30b_a3b_en (all experts)"},
    {"tinyllama-1.1b", 1'100'048'384, "arXiv:2502.00706 Table 4, TinyLlama/TinyLlama-1.1B-Chat-v1.0"},
    {"qwen2-0.5b", 494'032'768, "arXiv:2502.00706 Table 4, Qwen/Qwen2-0.5B"},
    {"qwen3-0.6b", 596'049'920, "public GitHub measurements '596,049,920 params ... Qwen3ForCausalLM' (tied)"},
    {"gemma-2b", 2'506'172'416, "keras-hub gemma_presets.py@02aeee5 gemma_2b_en; arXiv:2502.00706 Table 4"},
    {"gemma-2-2b", 2'614'341'888, "keras-hub gemma_presets.py gemma2_2b_en; arXiv:2502.00706 Table 4"},
    {"phi-3-mini", 3'821'079'552, "keras-hub phi3_presets.py phi3_mini_4k_instruct_en; arXiv:2502.00706 Tab.4"},
    {"pythia-160m", 162'322'944, "Pythia model card, 'Naming convention and parameter count' table"},
    {"opt-125m", 125'239'296, "pytorch/PiPPy examples/hf/opt/pippy_opt.py '# size: 125,239,296'; 2502.00706"},
    {"gemma-3-1b-it", 999'885'952, "keras-hub gemma3_presets.py@46f3b4a gemma3_instruct_1b (and gemma3_1b)"},
    {"phi-2", 2'779'683'840, "Hugging Face Hub API microsoft/phi-2: safetensors.parameters F16 2779683840"},
    // keras-hub's BertBackbone has the pooler (pooled_dense) and no task head: transformers' BertModel with its
    // BertPooler, i.e. BertForSequenceClassification less its classifier
    {"bert-base-uncased", 109'482'240, "keras-hub bert_presets.py@0e1444f bert_base_en_uncased params",
     Head::kSeqCls, "classifier."},
    // keras-hub's RobertaBackbone (roberta_backbone.py@7eea6c8): token and position embeddings with
    // max_sequence_length=512 rows, LayerNorm, the layers; no token types, no pooler, no head. transformers'
    // RobertaModel(add_pooling_layer=False) less token_type_embeddings and the 2 rows below padding_idx + 1.
    {"roberta-base", 124'052'736, "keras-hub roberta_presets.py@d7a5c31 roberta_base_en params", Head::kTokenCls,
     "classifier.", "roberta.embeddings.token_type_embeddings.", true},
    {"falcon-rw-1b", 1'311'625'216, "keras-hub falcon_presets.py@aa42194 falcon_refinedweb_1b_en (tied head)"},
    {"t5-small", 60'506'624, "keras-nlp t5_presets.py t5_small params (mattdangerw/keras-hub@0df99da)"},
    {"flan-t5-base", 247'577'856, "sdpetrides/t5x-train-and-test README.md@7742ecb t5x T5.1.1 base 247577856"},
};

TEST(Inventory, EveryPresetMatchesItsPublishedParameterCount) {
  ASSERT_EQ(presets().size(), std::size(kPublished)) << "a preset without a published count to test against";
  for (const Published& p : kPublished) {
    ModelRequest req;
    req.model = p.preset;
    req.head = p.head;
    const ModelSpec m = load_model(req, testing::MapFileReader());
    const Inventory inv = build_inventory(m);
    uint64_t count = parameter_count(inv).value;
    for (const TensorRow& r : inv.parameters) {
      if ((p.minus && r.name.starts_with(p.minus)) || (p.minus2 && r.name.starts_with(p.minus2))) {
        count -= r.elems.value;
      }
    }
    if (p.less_unreached_positions) count -= m.position_offset * m.hidden;
    EXPECT_EQ(count, p.count) << p.preset << " (source: " << p.source << ")";
  }
}

std::string read_testdata(const std::string& name) {
  std::ifstream in(std::string(TRAINMEM_SOURCE_DIR) + "/tests/testdata/configs/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Inventory, OtherCheckpointsConfigJsonGiveTheirPublishedCounts) {
  // config.json files of checkpoints that are not presets, read from disk as a user would pass them.
  EXPECT_EQ(parameter_count(build_inventory(from_json(read_testdata("llama-3.2-1b-instruct.json")))).value,
            1'235'814'400u);  // arXiv:2502.00706 Table 4, meta-llama/Llama-3.2-1B-Instruct (tied)
  EXPECT_EQ(parameter_count(build_inventory(from_json(read_testdata("qwen2-0.5b-instruct.json")))).value,
            494'032'768u);  // same shapes as Qwen2-0.5B (arXiv:2502.00706 Table 4)
  EXPECT_EQ(parameter_count(build_inventory(from_json(read_testdata("qwen2-1.5b-instruct.json")))).value,
            1'543'714'304u);  // arXiv:2502.00706 Table 4, Qwen/Qwen2-1.5B
  EXPECT_EQ(parameter_count(build_inventory(from_json(read_testdata("smollm2-135m.json")))).value,
            134'515'008u);  // public GitHub notes "SmolLM2-135M ... 134,515,008"
  EXPECT_EQ(parameter_count(build_inventory(from_json(read_testdata("qwen1.5-moe-a2.7b.json")))).value,
            14'315'784'192u);  // keras-hub qwen_moe_presets.py@41e055b qwen1.5_moe_2.7b_en (all experts)
}

TEST(Inventory, Gpt2UsesConv1DLayoutAndNanoGptUsesLinearLayout) {
  const Inventory hf = build_inventory(preset("gpt2"));
  ASSERT_GE(hf.parameters.size(), 5u);
  EXPECT_EQ(hf.parameters[0].name, "transformer.wte.weight");
  EXPECT_EQ(hf.parameters[4].name, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(hf.parameters[4].shape, (std::vector<uint64_t>{768, 2304}));  // Conv1D: (in, out)
  EXPECT_EQ(hf.parameters.back().name, "transformer.ln_f.bias");           // lm_head tied: not listed
  EXPECT_TRUE(hf.buffers.empty());  // transformers 5.x GPT-2 registers no buffers

  const Inventory nano = build_inventory(preset("nanogpt-gpt2", AttnImpl::kEager));
  EXPECT_EQ(nano.parameters[3].name, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(nano.parameters[3].shape, (std::vector<uint64_t>{2304, 768}));  // nn.Linear: (out, in)
  EXPECT_EQ(nano.buffers.size(), 12u);
  EXPECT_EQ(nano.buffers[0].name, "transformer.h.0.attn.bias");
  EXPECT_EQ(nano.buffers[0].shape, (std::vector<uint64_t>{1, 1, 1024, 1024}));
}

TEST(Inventory, NanoGptWithFlashAttentionHasNoMaskBuffers) {
  // model.py registers the causal mask only `if not self.flash`.
  EXPECT_TRUE(build_inventory(preset("nanogpt-gpt2", AttnImpl::kSdpa)).buffers.empty());
}

TEST(Inventory, ReproducesSeed000SteadyStateRows) {
  // Seed 000, GPT2 Small table: N Parameters 124,373,760; Model Memory 547,826,688 (weights + the fp32 causal
  // masks); Gradients 497,495,040; Adam buffers 994,990,080 predicted, 994,990,380 actual.
  const ModelSpec m = preset("nanogpt-gpt2", AttnImpl::kEager);
  const Inventory inv = build_inventory(m);
  EXPECT_EQ(parameter_count(inv).value, 124'373'760u);
  EXPECT_EQ((parameter_bytes(inv, DType::kF32) + buffer_bytes(inv, DType::kF32)).value, 547'826'688u);
  TrainSetup s;
  s.batch = 12;
  s.seq = 1024;
  s.precision = Precision::kBf16Amp;
  const Estimate e = estimate(m, inv, s, SimOptions{});
  EXPECT_EQ(e.state.gradients.value, 497'495'040u);
  EXPECT_EQ(e.state.optimizer_moments.value, 994'990'080u);
  // nanoGPT's AdamW is fused on CUDA, so each of the 75 parameter tensors has a 4-byte `step` on the device:
  // the 300 bytes the seed's snapshot shows beyond its prediction.
  EXPECT_EQ(inv.parameters.size(), 75u);
  EXPECT_EQ(e.state.optimizer_state.value, 994'990'380u);
}

TEST(Inventory, LlamaFamilyArchitectureDifferencesAreRows) {
  // Qwen2: q/k/v biases, no o_proj bias.
  const Inventory q2 = build_inventory(preset("qwen2-0.5b"));
  EXPECT_EQ(q2.parameters[2].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(q2.parameters[7].name, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(q2.parameters[8].name, "model.layers.0.mlp.gate_proj.weight");
  // Qwen3: head_dim 128 with 16 heads on a 1024-wide model, plus q_norm/k_norm.
  const Inventory q3 = build_inventory(preset("qwen3-0.6b"));
  EXPECT_EQ(q3.parameters[1].shape, (std::vector<uint64_t>{2048, 1024}));
  EXPECT_EQ(q3.parameters[5].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(q3.parameters[5].shape, (std::vector<uint64_t>{128}));
  // Phi-3: fused projections.
  const Inventory phi = build_inventory(preset("phi-3-mini"));
  EXPECT_EQ(phi.parameters[2].name, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(phi.parameters[2].shape, (std::vector<uint64_t>{9216, 3072}));
  EXPECT_EQ(phi.parameters[3].name, "model.layers.0.mlp.gate_up_proj.weight");
  // Mixtral (transformers 5.x): fused 3-D experts.
  const Inventory mix = build_inventory(preset("mixtral-8x7b"));
  EXPECT_EQ(mix.parameters[5].name, "model.layers.0.mlp.gate.weight");
  EXPECT_EQ(mix.parameters[6].shape, (std::vector<uint64_t>{8, 28672, 4096}));
  // Gemma2: four norms per layer.
  const Inventory g2 = build_inventory(preset("gemma-2-2b"));
  EXPECT_EQ(g2.parameters[11].name, "model.layers.0.post_feedforward_layernorm.weight");
}

TEST(Inventory, DeepseekV3LatentAttentionShapes) {
  // DeepseekV3Attention.__init__ (modular_deepseek_v3.py @000c33f) on DeepseekV3Config's defaults: C 7168,
  // 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk 128 + 64, v 128.
  const Inventory inv = build_inventory(from_json(R"({"model_type": "deepseek_v3", "num_hidden_layers": 4})"));
  using S = std::vector<uint64_t>;
  const std::vector<std::pair<std::string, S>> want = {
      {"model.embed_tokens.weight", S{129'280, 7168}},
      {"model.layers.0.self_attn.q_a_proj.weight", S{1536, 7168}},
      {"model.layers.0.self_attn.q_a_layernorm.weight", S{1536}},
      {"model.layers.0.self_attn.q_b_proj.weight", S{128 * 192, 1536}},
      {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", S{512 + 64, 7168}},
      {"model.layers.0.self_attn.kv_a_layernorm.weight", S{512}},
      {"model.layers.0.self_attn.kv_b_proj.weight", S{128 * (128 + 128), 512}},
      {"model.layers.0.self_attn.o_proj.weight", S{7168, 128 * 128}},
      {"model.layers.0.mlp.gate_proj.weight", S{18'432, 7168}},  // first_k_dense_replace: a dense MLP
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(inv.parameters[i].name, want[i].first);
    EXPECT_EQ(inv.parameters[i].shape, want[i].second) << want[i].first;
  }
  // layer 3 (the first MoE layer): experts, gate (+ its buffer), shared experts, then the layer norms
  auto row = [&](const std::string& name) {
    for (const TensorRow& r : inv.parameters) {
      if (r.name == name) return r.shape;
    }
    return S{};
  };
  EXPECT_EQ(row("model.layers.3.mlp.experts.gate_up_proj"), (S{256, 2 * 2048, 7168}));
  EXPECT_EQ(row("model.layers.3.mlp.experts.down_proj"), (S{256, 7168, 2048}));
  EXPECT_EQ(row("model.layers.3.mlp.gate.weight"), (S{256, 7168}));
  EXPECT_EQ(row("model.layers.3.mlp.shared_experts.up_proj.weight"), (S{2048, 7168}));
  ASSERT_EQ(inv.buffers.size(), 3u);
  EXPECT_EQ(inv.buffers[0].name, "model.layers.3.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(inv.buffers[0].shape, (S{256}));
  EXPECT_EQ(inv.buffers[1].name, "model.rotary_emb.inv_freq");
  EXPECT_EQ(inv.buffers[1].shape, (S{32}));  // qk_rope_head_dim 64 / 2
}

TEST(Inventory, RotaryModelsRegisterInverseFrequencyBuffers) {
  const Inventory inv = build_inventory(preset("llama-2-7b"));
  ASSERT_EQ(inv.buffers.size(), 2u);
  EXPECT_EQ(inv.buffers[0].name, "model.rotary_emb.inv_freq");
  EXPECT_EQ(inv.buffers[0].shape, (std::vector<uint64_t>{64}));  // head_dim 128 / 2
  EXPECT_FALSE(inv.buffers[0].persistent);
  // NeoX rotates 25% of each 64-wide head: 16 dims, 8 frequencies.
  const Inventory neox = build_inventory(preset("pythia-160m"));
  EXPECT_EQ(neox.buffers[0].name, "gpt_neox.rotary_emb.inv_freq");
  EXPECT_EQ(neox.buffers[0].shape, (std::vector<uint64_t>{8}));
  // Gemma's scaled embedding keeps its scale as a 0-dim buffer.
  EXPECT_EQ(build_inventory(preset("gemma-2b")).buffers[0].name, "model.embed_tokens.embed_scale");
}

TEST(Inventory, FalconLayoutsFollowTheConfig) {
  // falcon-rw-1b (sequential, per-head q|k|v, biases, ALiBi): FalconDecoderLayer assigns self_attention and mlp
  // first, then post_attention_layernorm before input_layernorm; the rotary buffers exist for ALiBi models too.
  const Inventory rw = build_inventory(preset("falcon-rw-1b"));
  const std::vector<std::string> layer0 = {
      "transformer.h.0.self_attention.query_key_value.weight", "transformer.h.0.self_attention.query_key_value.bias",
      "transformer.h.0.self_attention.dense.weight",           "transformer.h.0.self_attention.dense.bias",
      "transformer.h.0.mlp.dense_h_to_4h.weight",              "transformer.h.0.mlp.dense_h_to_4h.bias",
      "transformer.h.0.mlp.dense_4h_to_h.weight",              "transformer.h.0.mlp.dense_4h_to_h.bias",
      "transformer.h.0.post_attention_layernorm.weight",       "transformer.h.0.post_attention_layernorm.bias",
      "transformer.h.0.input_layernorm.weight",                "transformer.h.0.input_layernorm.bias"};
  for (size_t i = 0; i < layer0.size(); ++i) EXPECT_EQ(rw.parameters[1 + i].name, layer0[i]);
  EXPECT_EQ(rw.parameters[1].shape, (std::vector<uint64_t>{6'144, 2'048}));  // 3 * hidden_size
  EXPECT_EQ(rw.parameters.back().name, "transformer.ln_f.bias");            // tied: no lm_head.weight
  ASSERT_EQ(rw.buffers.size(), 2u);
  EXPECT_EQ(rw.buffers[0].name, "transformer.rotary_emb.inv_freq");
  EXPECT_EQ(rw.buffers[0].shape, (std::vector<uint64_t>{32}));  // head_dim 64 / 2
  // new_decoder_architecture (falcon-40b's layout at a small size): (NH + 2 * KV) * D wide, ln_attn and ln_mlp;
  // untied: lm_head.weight last
  const Inventory na = build_inventory(from_json(
      R"({"model_type": "falcon", "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 8,
          "num_kv_heads": 2, "new_decoder_architecture": true, "tie_word_embeddings": false, "vocab_size": 100})"));
  EXPECT_EQ(na.parameters[1].shape, (std::vector<uint64_t>{(8 + 2 * 2) * 32, 256}));
  EXPECT_EQ(na.parameters[5].name, "transformer.h.0.ln_attn.weight");
  EXPECT_EQ(na.parameters[7].name, "transformer.h.0.ln_mlp.weight");
  EXPECT_EQ(na.parameters.back().name, "lm_head.weight");
}

TEST(Inventory, CastingTheModelCastsFloatingBuffersOnly) {
  const Inventory nano = build_inventory(preset("nanogpt-gpt2", AttnImpl::kEager));
  EXPECT_EQ(buffer_bytes(nano, DType::kF32).value, 50'331'648u);    // 12 x 1024^2 x 4
  EXPECT_EQ(buffer_bytes(nano, DType::kBF16).value, 25'165'824u);  // model.to(bfloat16) casts the fp32 masks
}

TEST(Inventory, OptWithProjectionAndPostNormFollowsTheConfig) {
  // facebook/opt-350m: word_embed_proj_dim 512 != hidden 1024 adds project_in/project_out, and
  // do_layer_norm_before=False removes the decoder's final_layer_norm. 331,196,416 is the count public
  // experiment tables give for OPT-350M.
  const std::string cfg = R"({"model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24,
      "num_attention_heads": 16, "word_embed_proj_dim": 512, "do_layer_norm_before": false,
      "max_position_embeddings": 2048, "vocab_size": 50272})";
  const Inventory inv = build_inventory(from_json(cfg));
  EXPECT_EQ(parameter_count(inv).value, 331'196'416u);
  EXPECT_EQ(inv.parameters[2].name, "model.decoder.project_out.weight");
  EXPECT_EQ(inv.parameters[2].shape, (std::vector<uint64_t>{512, 1024}));
}

}  // namespace
}  // namespace trainmem
