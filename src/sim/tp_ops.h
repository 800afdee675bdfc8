// The collectives transformers 5.x's tensor parallelism hooks around a rank's local modules
// (src/transformers/integrations/tensor_parallel.py: _AllReduceBackward, _AllReduceForward, _AllGather, called by
// ColwiseParallel._prepare_input_fn / _prepare_output_fn and RowwiseParallel._prepare_output_fn), as ops: what each
// allocates and frees on the rank, forward and backward. Modelled: the 5.x file whose ParallelInterface maps
// "colwise_gather_output" to ColwiseParallel(gather_output=True) over these autograd Functions (the docs' list of
// partitioning strategies shows the same mapping). A later rewrite on DTensor ("Registry of named TP styles for the
// DTensor backend") allocates the same in training (funcol's all_reduce clones, a colwise input's Partial gradient
// is all-reduced into a new tensor, a Replicate->Shard(-1) gradient is a clone of its chunk), except lm_head's
// gather: all_gather_into_tensor's (tp*B, T, V/tp) buffer then torch.cat of its chunks, against tp - 1
// empty_like shards here; and its inference path all-reduces rowwise outputs in place. Not modelled. The communication itself moves no memory of the caching
// allocator here: dist.all_reduce and dist.all_gather write in place into tensors the Python code allocated (NCCL's
// own buffers are outside the allocator, parallel.md section 7).
#pragma once

#include <cstdint>

#include "ops.h"

namespace trainmem::sim {

// all_reduce_backward(x) (_AllReduceBackward.apply): forward `return x`; a custom Function that returns an input
// unmodified gives back a view of it (torch/csrc/autograd/custom_function.cpp _process_backward_mode_ad: "An input
// has been returned, but it wasn't modified. Return it as a view so that we can attach a new grad_fn to the
// Variable."), so no storage. Backward: grad_output = grad_output.clone();
// dist.all_reduce(grad_output): a new gradient of x's shape.
T tp_all_reduce_backward(Ctx& c, const T& x);
// all_reduce_forward(x) (_AllReduceForward.apply): x = x.clone(); dist.all_reduce(x): a new tensor (the partial
// sums are dropped by the caller); backward `return grad_output`.
T tp_all_reduce_forward(Ctx& c, const T& x, const char* what);
// all_gather(x) over `tp` ranks, on the last dim (_AllGather.apply): x = x.contiguous();
// tensor_list = [torch.empty_like(x) for _ in range(world_size)]; tensor_list[rank] = x (one empty dropped);
// dist.all_gather(tensor_list, x); return torch.cat(tensor_list, dim=last_dim).contiguous() (the list dies with
// the frame). Backward: chunks = torch.chunk(grad_output, world_size, dim=-1); chunks[rank].contiguous(): a new
// (..., n/tp) copy (a last-dim chunk of a dense tensor is not contiguous).
T tp_all_gather_last(Ctx& c, const T& x, uint64_t tp, const char* what);

}  // namespace trainmem::sim
