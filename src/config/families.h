// Internal: one reader per config family. Each fills a ModelSpec from a KeyReader over the config object.
#pragma once

#include "key_reader.h"
#include "trainmem/model.h"

namespace trainmem::config {

void read_gpt2(const KeyReader& r, ModelSpec& m);      // model_type gpt2
void read_nanogpt(const KeyReader& r, ModelSpec& m);   // model_type nanogpt (GPTConfig keys)
void read_gpt_neox(const KeyReader& r, ModelSpec& m);  // model_type gpt_neox
void read_opt(const KeyReader& r, ModelSpec& m);       // model_type opt
void read_phi(const KeyReader& r, ModelSpec& m);       // model_type phi
void read_falcon(const KeyReader& r, ModelSpec& m);    // model_type falcon
// llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral, gemma3_text,
// starcoder2. Returns false for other model types.
bool read_llama_family(const KeyReader& r, const std::string& model_type, ModelSpec& m);
void read_stack(const KeyReader& r, ModelSpec& m);     // model_type mlp
void read_bert(const KeyReader& r, std::string_view model_type, ModelSpec& m);  // model_type bert, roberta
void read_t5(const KeyReader& r, ModelSpec& m);        // model_type t5

// Shared readers.
// Rotary embeddings rotate an even number of dims per head: rotate_half splits them in two halves and the
// cos/sin tables hold one frequency per pair (inv_freq = 1 / base ** (arange(0, dim, 2) / dim)); with an
// odd count the shapes do not match and the model cannot run. Throws naming `key` (the key that sets it).
void check_rotary_dims(const KeyReader& r, std::string_view key, const ModelSpec& m);
// hidden_act / activation_function value -> Act; error names the key and lists the supported values.
Act read_activation(const KeyReader& r, std::initializer_list<std::string_view> keys, std::string_view def);
// A dropout probability in [0, 1].
double read_probability(const KeyReader& r, std::initializer_list<std::string_view> keys, double def);
// Heads and head_dim: checks that heads divide `width` when head_dim is derived, and kv_heads divide heads.
// A missing head count warns, naming `defaults_of` (see KeyReader::shape).
void read_heads(const KeyReader& r, std::initializer_list<std::string_view> head_keys, uint64_t def_heads,
                std::string_view defaults_of, std::initializer_list<std::string_view> width_keys, uint64_t width,
                AttentionSpec& a);

}  // namespace trainmem::config
