// The family registry's one table. A row names, for one architecture family, the config readers of its
// model_type values (src/config), and per implementation its tensor table (src/tensor_tables) and forward
// program (src/sim/forward_programs).
#include "registry.h"

#include <fmt/format.h>

#include "../config/families.h"
#include "../sim/forward.h"
#include "../tensor_tables/table.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

using config::KeyReader;

// Adapters from the readers' own signatures to ConfigReader.
void gpt2_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_gpt2(r, m); }
void nanogpt_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_nanogpt(r, m); }
void gpt_neox_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_gpt_neox(r, m); }
void opt_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_opt(r, m); }
void phi_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_phi(r, m); }
void falcon_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_falcon(r, m); }
void stack_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_stack(r, m); }
void bert_config(const KeyReader& r, std::string_view t, ModelSpec& m) { config::read_bert(r, t, m); }
void t5_config(const KeyReader& r, std::string_view, ModelSpec& m) { config::read_t5(r, m); }
void llama_config(const KeyReader& r, std::string_view t, ModelSpec& m) {
  if (!config::read_llama_family(r, std::string(t), m)) throw Error(fmt::format("internal: no llama defaults for {}", t));
}

// The layer stack computes no loss of its own: the loop's `y.sum()` does.
sim::ForwardOut stack_program(sim::Ctx& c, const ModelSpec& m, const sim::LoadedModel& w, const sim::T& x,
                              const sim::T*) {
  return sim::stack_forward(c, m, w, x);
}

constexpr ModelType kGpt2Types[] = {{"gpt2", gpt2_config, Impl::kHf}, {"nanogpt", nanogpt_config, Impl::kNanoGpt}};
constexpr Program kGpt2Programs[] = {{Impl::kHf, models::gpt2_tensors, sim::gpt2_forward, LoopKind::kHf},
                                     {Impl::kNanoGpt, models::nanogpt_tensors, sim::nanogpt_forward, LoopKind::kNanoGpt}};

// Every model_type whose modeling file is LlamaForCausalLM's shape (src/config/llama_configs.cc has each one's
// defaults and architecture facts).
constexpr ModelType kLlamaTypes[] = {
    {"llama", llama_config, Impl::kHf},  {"mistral", llama_config, Impl::kHf}, {"qwen2", llama_config, Impl::kHf},
    {"qwen3", llama_config, Impl::kHf},  {"gemma", llama_config, Impl::kHf},   {"gemma2", llama_config, Impl::kHf},
    {"phi3", llama_config, Impl::kHf},   {"mixtral", llama_config, Impl::kHf}, {"qwen2_moe", llama_config, Impl::kHf},
    {"qwen3_moe", llama_config, Impl::kHf}, {"gemma3_text", llama_config, Impl::kHf}, {"starcoder2", llama_config, Impl::kHf},
    {"deepseek_v3", llama_config, Impl::kHf},
};
constexpr Program kLlamaPrograms[] = {{Impl::kHf, models::llama_tensors, sim::llama_forward, LoopKind::kHf}};

constexpr ModelType kNeoxTypes[] = {{"gpt_neox", gpt_neox_config, Impl::kHf}};
constexpr Program kNeoxPrograms[] = {{Impl::kHf, models::gpt_neox_tensors, sim::gpt_neox_forward, LoopKind::kHf}};

constexpr ModelType kOptTypes[] = {{"opt", opt_config, Impl::kHf}};
constexpr Program kOptPrograms[] = {{Impl::kHf, models::opt_tensors, sim::opt_forward, LoopKind::kHf}};

constexpr ModelType kPhiTypes[] = {{"phi", phi_config, Impl::kHf}};
constexpr Program kPhiPrograms[] = {{Impl::kHf, models::phi_tensors, sim::phi_forward, LoopKind::kHf}};

constexpr ModelType kFalconTypes[] = {{"falcon", falcon_config, Impl::kHf}};
constexpr Program kFalconPrograms[] = {{Impl::kHf, models::falcon_tensors, sim::falcon_forward, LoopKind::kHf}};
constexpr ModelType kT5Types[] = {{"t5", t5_config, Impl::kHf}};
constexpr Program kT5Programs[] = {{Impl::kHf, models::t5_tensors, sim::t5_forward, LoopKind::kHf}};

constexpr ModelType kStackTypes[] = {{"mlp", stack_config, Impl::kStack}};
constexpr Program kStackPrograms[] = {{Impl::kStack, models::stack_tensors, stack_program, LoopKind::kPlain}};

// The encoders (bert.cc): BertModel / RobertaModel under BertForMaskedLM, ...ForSequenceClassification and
// ...ForTokenClassification.
constexpr ModelType kBertTypes[] = {{"bert", bert_config, Impl::kHf}};
constexpr ModelType kRobertaTypes[] = {{"roberta", bert_config, Impl::kHf}};
constexpr Program kBertPrograms[] = {{Impl::kHf, models::bert_tensors, sim::bert_forward, LoopKind::kHf}};
constexpr Head kEncoderHeads[] = {Head::kMaskedLm, Head::kSeqCls, Head::kTokenCls};
// The Llama-shaped decoders: ...ForCausalLM, and ...ForSequenceClassification (GenericForSequenceClassification,
// modeling_layers.py: score over the final hidden states, pooled at the last non-pad token)
constexpr Head kDecoderHeads[] = {Head::kCausalLm, Head::kSeqCls};

// peft: utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING ("gpt2": ["c_attn"], "llama" and
// the other Llama-shaped types (gemma3_text too) and "opt": ["q_proj", "v_proj"], "gpt_neox": ["query_key_value"]).
constexpr std::string_view kQV[] = {"q_proj", "v_proj"};
constexpr std::string_view kCAttn[] = {"c_attn"};
constexpr std::string_view kQKV[] = {"query_key_value"};
// peft constants.py: "phi": ["q_proj", "v_proj", "fc1", "fc2"]
constexpr std::string_view kPhiLora[] = {"q_proj", "v_proj", "fc1", "fc2"};
// peft constants.py: "bert": ["query", "value"]
constexpr std::string_view kBertLora[] = {"query", "value"};  // and "roberta": ["query", "value"]
// peft constants.py: "falcon": ["query_key_value"]
// peft constants.py: "t5": ["q", "v"]
constexpr std::string_view kT5Lora[] = {"q", "v"};

const FamilyDescriptor kFamilies[] = {
    {Family::kGpt2, "gpt2", kGpt2Types, kGpt2Programs, InputKind::kTokenIds, "transformer.h", "transformer.wte.weight",
     kCAttn},
    {Family::kLlama, "llama", kLlamaTypes, kLlamaPrograms, InputKind::kTokenIds, "model.layers",
     "model.embed_tokens.weight", kQV, kDecoderHeads},
    {Family::kGptNeox, "gpt_neox", kNeoxTypes, kNeoxPrograms, InputKind::kTokenIds, "gpt_neox.layers",
     "gpt_neox.embed_in.weight", kQKV},
    {Family::kOpt, "opt", kOptTypes, kOptPrograms, InputKind::kTokenIds, "model.decoder.layers",
     "model.decoder.embed_tokens.weight", kQV},
    {Family::kPhi, "phi", kPhiTypes, kPhiPrograms, InputKind::kTokenIds, "model.layers", "model.embed_tokens.weight",
     kPhiLora},
    {Family::kBert, "bert", kBertTypes, kBertPrograms, InputKind::kTokenIds, "bert.encoder.layer",
     "bert.embeddings.word_embeddings.weight", kBertLora, kEncoderHeads},
    {Family::kRoberta, "roberta", kRobertaTypes, kBertPrograms, InputKind::kTokenIds, "roberta.encoder.layer",
     "roberta.embeddings.word_embeddings.weight", kBertLora, kEncoderHeads},
    {Family::kFalcon, "falcon", kFalconTypes, kFalconPrograms, InputKind::kTokenIds, "transformer.h",
     "transformer.word_embeddings.weight", kQKV},
    // T5ForConditionalGeneration: timeline layers 0..L-1 are encoder.block.*, L.. decoder.block.* (layer_name)
    {Family::kT5, "t5", kT5Types, kT5Programs, InputKind::kTokenIds, "encoder.block", "shared.weight", kT5Lora},
    {Family::kStack, "mlp", kStackTypes, kStackPrograms, InputKind::kFeatures, "", "", {}},
};

}  // namespace

std::span<const FamilyDescriptor> families() { return kFamilies; }

const FamilyDescriptor& family_descriptor(Family f) {
  for (const FamilyDescriptor& d : kFamilies) {
    if (d.family == f) return d;
  }
  throw Error("internal: a family without a descriptor");
}

const FamilyDescriptor* find_model_type(std::string_view model_type, const ModelType** type) {
  for (const FamilyDescriptor& d : kFamilies) {
    for (const ModelType& t : d.model_types) {
      if (t.name == model_type) {
        if (type) *type = &t;
        return &d;
      }
    }
  }
  return nullptr;
}

const Program& program_for(const ModelSpec& m) {
  const FamilyDescriptor& d = family_descriptor(m.family);
  for (const Program& p : d.programs) {
    if (p.impl == m.impl) return p;
  }
  throw Error(fmt::format("--impl {} cannot build model_type \"{}\" (the {} family is built by {})", impl_name(m.impl),
                          m.model_type, d.name, impl_name(d.programs.front().impl)));
}

std::string supported_model_types() {
  std::string s;
  for (const FamilyDescriptor& d : kFamilies) {
    for (const ModelType& t : d.model_types) s += (s.empty() ? "" : ", ") + std::string(t.name);
  }
  return s;
}

InputKind input_kind(const ModelSpec& m) { return family_descriptor(m.family).input; }

std::string layer_name(const ModelSpec& m, int64_t layer) {
  if (m.family == Family::kT5 && layer >= 0 && static_cast<uint64_t>(layer) >= m.layers) {
    return fmt::format("decoder.block.{}", static_cast<uint64_t>(layer) - m.layers);  // t5_forward's numbering
  }
  const std::string_view prefix = family_descriptor(m.family).layer_prefix;
  return prefix.empty() ? std::to_string(layer) : fmt::format("{}.{}", prefix, layer);
}

}  // namespace trainmem
