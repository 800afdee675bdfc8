// Expert parallelism per rank, as transformers 5.x does it: DistributedConfig(tp_size=N, ep_size=N)
// (docs/source/en/expert_parallelism.md @03af9e8: "The current all-reduce implementation requires
// ep_size=tp_size, so every rank in an expert group receives the same tokens"; "Expert parallelism automatically
// enables tensor parallelism for attention layers"). One communicator: the EP group is the TP group.
// Per rank: attention under the TP plan (tp.h: q/k/v colwise, o_proj rowwise, lm_head colwise_gather_output),
// the experts' 3-D parameters Shard(0) (the "grouped_gemm" style, MoEParamShard(Shard(0), shards_expert_dim=True)
// in integrations/tensor_parallel.py: E/ep local experts, module.num_experts set to the local count), the router
// replicated ("ep_router", EpRouterParallel: no shard_param; its forward hook masks the top-k to the local
// experts), and the experts' output all-reduced ("moe_tp_experts", MoEExpertsParallel: a Partial DTensor
// redistributed to Replicate). Rank 0 holds global experts [0, E/ep), the ones the routing assumption loads most
// (routed_tokens()): rank 0 is the worst rank under both --moe-routing assumptions.
#pragma once

#include <cstdint>

#include "trainmem/inventory.h"
#include "trainmem/model.h"

namespace trainmem {

// Throws trainmem::Error when `ep` ranks of `m` are not simulated: a model type other than mixtral or qwen3_moe
// (named, with why), experts not divisible by ep (GroupedGemmParallel / EpRouterParallel raise "must be divisible"),
// attention sizes or vocab not divisible (tp_check's rules), tied or non-causal-LM heads, dense MLP layers.
void ep_check(const ModelSpec& m, uint64_t ep);

// The global model `m` becomes rank 0's local model under ep = tp ranks: heads and kv heads divided by ep,
// m.tp = m.ep = ep (the tensor table gives lm_head V/ep rows and experts (E/ep, ...)); m.moe.experts stays the
// global E (the router's (E, C) weight is replicated and routes over all E). ep 1 leaves it as it is.
void apply_expert_parallel(ModelSpec& m, uint64_t ep);

// Marks the experts' rows of a local model's inventory as sharded (TensorRow::tp_dim = 0, Shard(0)), after
// mark_tp_shards marked the attention and lm_head.
void mark_ep_shards(const ModelSpec& local, Inventory& inv);

}  // namespace trainmem
