"""Rank 0 of transformers 5.x expert parallelism (DistributedConfig(tp_size=N, ep_size=N)) on a reference MoE
model (models.py: Mixtral), after tp_shard.apply_tp has sharded the attention and lm_head (the TP plan's part).

`apply_ep(model, ep)` does, for rank 0, what src/transformers/integrations/tensor_parallel.py's EP styles do
(the DTensor backend's ParallelInterface._global_mapping):

* "grouped_gemm" (MoEParamShard(Shard(0), shards_expert_dim=True).shard_param): experts.gate_up_proj and
  experts.down_proj keep rows [0, E/ep) (Shard(0), rank 0) and module.num_experts = E // ep;
* "ep_router" (EpRouterParallel.transform_output_post_forward), a forward hook on the router: the top-k scores
  of non-local experts are zeroed (masked_fill), their indices sent to the sentinel num_local_experts, the local
  ones made local (fmod);
* "moe_tp_experts" (MoEExpertsParallel, is_expert_parallel=True): the experts' input through _AllReduceBackward
  (identity forward, in-place all_reduce of the gradient) and the output all-reduced (Partial -> Replicate: a new
  tensor; the stand-in is a clone and an in-place gloo world-size-1 all_reduce, as tp_shard._AllReduceForward);
* the experts' loop takes the sentinel as one more one_hot class (num_classes = num_experts + 1) and skips it
  (`if expert_idx == self.num_experts: continue`).
Only the collectives are stood in for, as in tp_shard.py.
"""

import torch
from torch import nn

import models
import tp_shard


class _EpAllReduceBackward(torch.autograd.Function):
    """tensor_parallel.py _AllReduceBackward (the MoE one): identity forward, dist.all_reduce(grad) in place."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        tp_shard._all_reduce_(grad)
        return grad


def _router_hook(num_local_experts):
    ep_rank = 0

    def hook(mod, inputs, output):
        router_logits, router_scores, router_indices = output
        non_local_mask = (router_indices // num_local_experts) != ep_rank
        router_scores = router_scores.masked_fill(non_local_mask, 0.0)
        router_indices = router_indices.masked_fill(non_local_mask, -1)
        if num_local_experts > 1:
            router_indices = torch.fmod(router_indices, num_local_experts)
        else:
            router_indices = router_indices.masked_fill(router_indices > 0, 0).masked_fill(router_indices < 0, -1)
        router_indices = router_indices.masked_fill(router_indices == -1, num_local_experts)
        return router_logits, router_scores, router_indices

    return hook


def apply_ep(model, ep):
    """Shard the experts of `model` for rank 0 of `ep` ranks and hook the routers and experts."""
    if ep <= 1:
        return model
    for name, mod in model.named_modules():
        if isinstance(mod, models.MixtralExperts):
            local = mod.num_experts // ep
            with torch.no_grad():
                mod.gate_up_proj = nn.Parameter(mod.gate_up_proj[:local].clone())
                mod.down_proj = nn.Parameter(mod.down_proj[:local].clone())
            mod.num_experts = local
            mod.ep_sentinel = 1  # models.MixtralExperts.forward: one_hot over num_experts + 1 classes
            mod.register_forward_pre_hook(
                lambda m, inputs: (_EpAllReduceBackward.apply(inputs[0]),) + tuple(inputs[1:]))
            mod.register_forward_hook(lambda m, inputs, outputs: tp_shard._AllReduceForward.apply(outputs, ep))
        elif isinstance(mod, models.MixtralTopKRouter):
            mod.register_forward_hook(_router_hook(mod.num_experts // ep))
    return model
