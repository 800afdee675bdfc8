// Expert parallelism per rank under transformers 5.x's DistributedConfig(tp_size=N, ep_size=N); see ep.h.
//
// The plans (configuration_<type>.py of the releases with base_model_ep_plan, e.g. glm/lfm2_moe/llama4 and the
// MoE families that carry one):
//   base_model_ep_plan = {"layers.*.mlp.gate": "ep_router", "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
//     "layers.*.mlp.experts.down_proj": "grouped_gemm", "layers.*.mlp.experts": "moe_tp_experts"}
// and the attention of base_model_tp_plan (q/k/v "colwise", o_proj "rowwise"; qwen3_moe's q_norm/k_norm
// "replicated_with_grad_allreduce", Qwen3MoeConfig.base_model_tp_plan), lm_head "colwise_gather_output".
// The styles (integrations/tensor_parallel.py, the DTensor backend's ParallelInterface._global_mapping):
//   "grouped_gemm": MoEParamShard(Shard(0), shards_expert_dim=True).shard_param: module.num_experts =
//     meta.shape[0] // mesh.size(); distribute_tensor(meta, mesh, [Shard(0)]): (E/ep, 2F, C) and (E/ep, C, F)
//   "ep_router": EpRouterParallel: no shard_param (the (E, C) router weight stays whole)
//   "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce: the norm weight stays whole
#include "trainmem/ep.h"

#include <fmt/format.h>

#include <string>

#include "trainmem/error.h"
#include "trainmem/tp.h"

namespace trainmem {

void ep_check(const ModelSpec& m, uint64_t ep) {
  if (ep <= 1) return;
  if (m.moe.experts == 0) {
    throw Error(fmt::format("{}: expert parallelism shards the experts of a mixture-of-experts model; {} has none "
                            "(use --tp)", ep, m.name));
  }
  if (m.impl != Impl::kHf || (m.model_type != "mixtral" && m.model_type != "qwen3_moe")) {
    throw Error(fmt::format("{}: expert parallelism is simulated for mixtral and qwen3_moe; {} (model_type {}) "
                            "has another plan (deepseek_v3: MLA attention and shared experts; qwen2_moe: a shared "
                            "expert) that was not read", ep, m.name, m.model_type));
  }
  if (m.moe.experts % ep != 0) {
    // GroupedGemmParallel.shard_tensor / EpRouterParallel: "num_experts must be divisible by ep_size"
    throw Error(fmt::format("{}: {} has {} experts, not divisible by {}: transformers raises \"num_experts must be "
                            "divisible by ep_size\"", ep, m.name, m.moe.experts, ep));
  }
  if (m.moe.shared_ffn > 0 || !m.moe.dense_layers.empty() || m.moe.sparse_step != 1) {
    throw Error(fmt::format("{}: {} has dense MLP layers or a shared expert; their plan under expert parallelism "
                            "is not simulated", ep, m.name));
  }
  if (m.attn.fused_qkv || m.attn.mla.kv_lora_rank > 0 || !m.mlp.gated) {
    throw Error(fmt::format("{}: {} is not the Llama-shaped attention the plan shards", ep, m.name));
  }
  // the attention and lm_head run under the TP plan over ep_size = tp_size ranks: tp_check's rules for them
  tp_check_head_and_shards(m, ep, false);
}

void apply_expert_parallel(ModelSpec& m, uint64_t ep) {
  if (ep <= 1) return;
  ep_check(m, ep);
  m.attn.heads /= ep;
  m.attn.kv_heads /= ep;
  m.tp = ep;
  m.ep = ep;
}

void mark_ep_shards(const ModelSpec& local, Inventory& inv) {
  if (local.ep <= 1) return;
  for (TensorRow& r : inv.parameters) {
    // "layers.*.mlp.experts.gate_up_proj" / "down_proj": grouped_gemm, Shard(0)
    if (r.name.ends_with("mlp.experts.gate_up_proj") || r.name.ends_with("mlp.experts.down_proj")) r.tp_dim = 0;
  }
}

}  // namespace trainmem
