// Tensor parallelism per rank, as an HF user gets it: transformers 5.x `from_pretrained(..., tp_plan="auto")`.
// The model's plan (LlamaConfig.base_model_tp_plan, configuration_llama.py @008e574; LlamaForCausalLM._tp_plan)
// names a style per module; each style shards the weights at load (tensor_parallel.py get_tensor_shard) and
// hooks the module's forward with collectives (ColwiseParallel / RowwiseParallel._prepare_*_fn). TP shapes a
// rank's model: the ModelSpec holds one rank's local dims (heads/t, kv heads/t, ffn/t, lm_head rows V/t), so
// whatever runs over the rank (DDP, ZeRO, FSDP over the dp ranks; a pipeline stage) sees the local tensors.
#pragma once

#include <cstdint>
#include <string_view>

#include "trainmem/inventory.h"
#include "trainmem/model.h"

namespace trainmem {

// transformers' TP styles that a Llama-shaped plan uses (tensor_parallel.py ParallelInterface._global_mapping).
enum class TpStyle {
  kReplicated,           // no plan entry: the whole tensor on every rank ("using default 'replicate' plan")
  kColwise,              // ColwiseParallel(): weight Shard(-2) (out/t rows), bias Shard(-1)
  kRowwise,              // RowwiseParallel(): weight Shard(-1) (in/t columns), bias replicated
  kColwiseGatherOutput,  // ColwiseParallel(gather_output=True): colwise, output all-gathered (lm_head)
};

// The style of a parameter of `m` under the model's own plan (by name, as _get_parameter_tp_plan matches it:
// the module's entry covers its .weight and .bias). Only for models tp_check accepts.
TpStyle tp_style(const ModelSpec& m, std::string_view param_name);

// Throws trainmem::Error when `tp` ranks of `m` are not simulated: a family or model_type whose plan is not
// modelled (named), sizes that do not divide by tp, a tied lm_head, a head other than causal LM.
void tp_check(const ModelSpec& m, uint64_t tp);
// The part of tp_check every plan with this attention and lm_head shares (expert parallelism's too, ep.h): the
// causal-LM head, an untied lm_head, heads / kv heads / vocab (and with dense_mlp the MLP's ffn) divisible by tp.
void tp_check_head_and_shards(const ModelSpec& m, uint64_t tp, bool dense_mlp);

// The global model `m` becomes one rank's local model under `tp` ranks (tp_check first): heads, kv heads and
// ffn divided by tp, m.tp = tp (the llama table gives lm_head V/tp rows). tp 1 leaves it as it is.
void apply_tensor_parallel(ModelSpec& m, uint64_t tp);

// Marks each parameter row of a local model's inventory with its TP shard (TensorRow::tp_dim).
void mark_tp_shards(const ModelSpec& local, Inventory& inv);

// A rank's parameters under tp ranks: the elements it holds a 1/tp shard of, and the replicated ones.
struct TpSplit {
  uint64_t sharded = 0;     // elements of the local shards (colwise, rowwise, lm_head)
  uint64_t replicated = 0;  // elements every TP rank holds whole (embed_tokens, norms, rowwise biases)
};
TpSplit tp_split(const ModelSpec& local);

}  // namespace trainmem
