// Internal helper for the per-family tensor tables: each family lists its tensors one row at a time, in the
// order nn.Module registers them (which is the order of named_parameters() and named_buffers()).
#pragma once

#include <string>
#include <vector>

#include "trainmem/inventory.h"

namespace trainmem::models {

class Table {
 public:
  void param(std::string name, std::vector<uint64_t> shape);
  // A parameter whose module is not an nn.Linear although the row looks like one (TensorRow::not_linear).
  void raw_param(std::string name, std::vector<uint64_t> shape);
  void buffer(std::string name, std::vector<uint64_t> shape, DType dtype, bool persistent);
  Inventory take() { return std::move(inv_); }

 private:
  Inventory inv_;
};

// One table per family (src/models/<family>.cc).
void gpt2_tensors(const ModelSpec& m, Table& t);      // HF GPT2LMHeadModel
void nanogpt_tensors(const ModelSpec& m, Table& t);   // nanoGPT GPT
void llama_tensors(const ModelSpec& m, Table& t);     // HF LlamaForCausalLM and relatives
void gpt_neox_tensors(const ModelSpec& m, Table& t);  // HF GPTNeoXForCausalLM
void opt_tensors(const ModelSpec& m, Table& t);       // HF OPTForCausalLM
void phi_tensors(const ModelSpec& m, Table& t);       // HF PhiForCausalLM
void falcon_tensors(const ModelSpec& m, Table& t);    // HF FalconForCausalLM
void stack_tensors(const ModelSpec& m, Table& t);     // nn.Sequential layer stack
void bert_tensors(const ModelSpec& m, Table& t);      // HF BertFor{MaskedLM,SequenceClassification,TokenClassification}
void t5_tensors(const ModelSpec& m, Table& t);        // HF T5ForConditionalGeneration

// GPT-2's buffers (none in transformers 5.x).
void gpt2_buffers(const ModelSpec& m, Table& t);
// The rotary embedding's inverse frequencies: inv_freq (rotary_dim/2,) float32, persistent=False, and in
// transformers 5.x a registered clone original_inv_freq of the same shape.
void rotary_buffers(const std::string& prefix, uint64_t rotary_dim, Table& t);

}  // namespace trainmem::models
