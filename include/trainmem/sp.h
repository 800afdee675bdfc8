// Sequence parallelism with tensor parallelism per rank: PyTorch-native TP + SP
// (torch.distributed.tensor.parallel's styles over DTensor, PyTorch 2.9), with the plan torchtitan's
// transformers_modeling_backend applies to a transformers Llama-shaped model (torchtitan
// experiments/transformers_modeling_backend/parallelize.py apply_non_moe_tp @9810191bb, the classic
// parallelize_module plan):
//   embed_tokens: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) (vocab-parallel: V/tp rows)
//   per layer: input_layernorm, post_attention_layernorm: SequenceParallel();
//     self_attn: PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
//                                   desired_input_kwarg_layouts={"hidden_states": Replicate()});
//     q/k/v_proj: ColwiseParallel(); o_proj: RowwiseParallel(output_layouts=Shard(1));
//     mlp: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),));
//     gate_proj, up_proj: ColwiseParallel(); down_proj: RowwiseParallel(output_layouts=Shard(1))
//   norm: SequenceParallel(); lm_head ("output"): ColwiseParallel(input_layouts=Shard(1),
//     output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)
// The same styles and layouts as torchtitan's own Llama3 apply_tp (models/llama3/infra/parallelize.py, before
// @76d5c72e2). Simulated with loss_parallel on (torchtitan's default: disable_loss_parallel = False,
// config/configs.py @9810191bb): lm_head keeps its (B, T, V/tp) Shard(-1) logits and trainer.py's loss_fn
// (components/loss.py cross_entropy_loss, reduction="sum", then / global_valid_tokens) runs under
// loss_parallel() on them (sp_ops.h); position_ids (1, T) are passed in as the backend's model.forward does
// (torch.arange(local_seq_len).unsqueeze(0)). The rest of the step is trainmem's transformers training loop
// (autocast, AdamW foreach, clip_grad_norm_), not torchtitan's trainer (its fused AdamW, its clip_grad_norm_).
//
// Not this program: transformers 5.x's own "sequence_parallel" style (tensor_parallel.py SequenceParallel:
// all_gather / reduce_scatter on the LAST dim, no model's tp_plan uses it) and Megatron-LM's SP.
#pragma once

#include <cstdint>

#include "trainmem/model.h"

namespace trainmem {

// Throws trainmem::Error when sequence parallelism over `tp` ranks at `seq` tokens is not simulated for the
// (global or local) model `m`: what tp_check refuses, eager attention (its (B, 1, T/tp, T/tp) mask from
// cache_position, which the gathered queries do not fit), an SDPA sliding-window mask, a biased rowwise linear
// (o_proj / down_proj: the DTensor bias add on a Partial output was not read), a sequence not divisible by tp
// (Shard(1)'s padding is not simulated).
void sp_check(const ModelSpec& m, uint64_t tp, uint64_t seq);

}  // namespace trainmem
