// Sequence parallelism's collectives as ops: PyTorch-native TP + SP (torch.distributed.tensor.parallel styles
// over DTensor), as torchtitan applies them to a transformers model (sp.h). What each redistribution allocates on
// the rank, forward and backward:
//   funcol.all_gather_tensor(x, gather_dim, group) (torch/distributed/_functional_collectives.py): x must be
//     contiguous; all_gather_into_tensor writes a (tp*B, ...) buffer gathered on dim 0; for gather_dim != 0,
//     `res = torch.cat(torch.chunk(res, group_size, dim=0), dim=gather_dim)`: a second, rearranged copy, after
//     which the buffer dies.
//   funcol.reduce_scatter_tensor(x, op, scatter_dim, group): for scatter_dim != 0, `tensor_list =
//     torch.chunk(self, group_size, dim=scatter_dim); self = torch.cat(tensor_list)`: a copy of the whole input
//     rearranged on dim 0; then reduce_scatter_tensor's (size / tp) output; the copy dies with the frame.
//   DTensor's Redistribute (torch/distributed/tensor/_redistribute.py) is an autograd.Function: its forward saves
//   no tensor (the specs only), its backward redistributes the gradient back to the input's placements, a Partial
//   becoming Replicate first: Shard(1) -> Replicate's backward is a Partial -> Shard(1) reduce-scatter, Partial ->
//   Shard(1)'s backward a Shard(1) -> Replicate all-gather (placement_types.py Shard._to_replicate_tensor,
//   Shard._reduce_shard_tensor).
// The NCCL transfers themselves write into these tensors (their own buffers are outside the caching allocator).
#pragma once

#include <cstdint>

#include "ops.h"

namespace trainmem::sim {

// Shard(1) -> Replicate of a (B, T/tp, C) local shard (PrepareModuleInput's desired Replicate; ColwiseParallel's
// input_layouts=Shard(1)): the (tp*B, T/tp, C) all_gather_into_tensor buffer, then the (B, T, C) torch.cat, which
// the following linears save. Backward: the (B, T, C) gradient (a Partial sum) reduce-scattered to Shard(1): a
// (tp*B, T/tp, C) torch.cat copy, then the (B, T/tp, C) gradient.
T sp_all_gather_seq(Ctx& c, const T& x, uint64_t tp, const char* what);

// Partial -> Shard(1) of a rowwise linear's (B, T, C) partial output (RowwiseParallel(output_layouts=Shard(1))):
// the (tp*B, T/tp, C) torch.cat copy, then the (B, T/tp, C) reduce_scatter_tensor output. Backward: Shard(1) ->
// Replicate of the (B, T/tp, C) gradient: the all_gather_into_tensor buffer and the (B, T, C) torch.cat.
// `pending`, when given, receives the torch.cat copy, which the collective's work keeps until the output's first
// use, for the caller to drop there (sp_ops.cc scatter_seq).
T sp_reduce_scatter_seq(Ctx& c, const T& x, uint64_t tp, const char* what, T* pending = nullptr);

// embedding() whose backward builds a (grad_rows, C) weight gradient (ops_products.cc): the DTensor embedding
// of a vocabulary shard, whose embedding_dense_backward runs on the whole vocabulary (sp_vocab_embedding)
T embedding_grad_rows(Ctx& c, const T& weight, const T& ids, uint64_t grad_rows, const char* what);

// RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) on nn.Embedding (the vocabulary-parallel
// embedding): `weight` holds V/tp rows, its gradient is the whole (V, C) (sp_ops.cc). The DTensor embedding op's
// MaskPartial (placement_types.py MaskPartial._partition_value / _mask_tensor): mask = (ids < offset) | (ids >=
// offset + V/tp) (two bool temporaries, then the (B, T) mask kept in the placement's MaskBuffer until the
// reduction); masked = ids.clone() - offset (the clone dies; the lookup's indices die after it); masked[mask] = 0
// and the reduction's apply_mask zero rows in place (their nonzero() index buffers are not simulated, sp_ops.cc);
// the local (B, T, C) lookup, then _reduce_shard_value's reduce-scatter to (B, T/tp, C). `pending` receives the
// reduce-scatter's input copy, which its work keeps until the output's first use (wait_tensor): the first decoder
// layer's norm, after LlamaModel's rotary table; the caller drops it there.
T sp_vocab_embedding(Ctx& c, const T& weight, const T& ids, uint64_t tp, const char* what, T& pending);

}  // namespace trainmem::sim

namespace trainmem::sim {

// torchtitan's loss under loss_parallel() (the default with TP): cross_entropy_loss(pred, labels) =
// F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=-100) on the
// lm_head's (B, T, V/tp) Shard(-1) logits, through DTensor's custom handlers (torch/distributed/tensor/parallel/
// loss.py): _log_softmax (amax, all_reduce(MAX), x - max, exp, sum, all_reduce(SUM), log, shifted - logsumexp:
// the shifted logits and exp(shifted) beside the result), _nll_loss_forward (a MaskPartial gather and an
// all_reduce of (N, 1)), and in backward _nll_loss_and_log_softmax_backward (zeros_like(x), then
// (grad_input + exp(x)) * grad_output; _log_softmax_backward_handler returns its gradient as is). Then
// trainer.py's `loss = loss_sum / global_valid_tokens`. Returns the loss.
T sp_loss_parallel_cross_entropy(Ctx& c, const T& logits, const T& labels, uint64_t tp);

}  // namespace trainmem::sim
