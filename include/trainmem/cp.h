// Context parallelism (--cp N), per rank: torch's context_parallel() as accelerate drives it
// (Accelerator.maybe_context_parallel -> torch.distributed.tensor.experimental.context_parallel, ring attention
// for SDPA). The rules are here, pure; the simulator allocates what they say (src/sim/cp_attention.cc).
//
// Sources (pytorch/pytorch, torch/distributed/tensor/experimental/_context_parallel/_attention.py and
// _load_balancer.py; huggingface/accelerate@16cb6eb src/accelerate/accelerator.py, parallelism_config.py,
// state.py):
//  - the batch's buffers (input_ids, labels, position_ids) are sharded on the sequence dim by the default
//    _HeadTailLoadBalancer (_cp_options.enable_load_balance = True), which asserts seq % (2 * cp) == 0 and gives
//    each rank two chunks of seq / (2 * cp): every activation of a rank has seq / cp tokens;
//  - SDPA's aten._scaled_dot_product_{flash,efficient,cudnn}_attention(_backward) are dispatched to
//    _templated_ring_attention(_backward); the K/V exchange is _AllGatherRotater by default
//    (_cp_options.rotate_method = _RotateMethod.ALL_GATHER), the K/V-gradient exchange is always
//    _AllToAllRotater (_templated_ring_attention_backward's dkv_rotater);
//  - weights are not sharded by CP itself.
#pragma once

#include <cstdint>
#include <vector>

#include "trainmem/dtype.h"

namespace trainmem {

// The rank's tokens per sequence: seq / cp. Throws trainmem::Error unless seq % (2 * cp) == 0
// (_HeadTailLoadBalancer._generate_indices: `assert seq_length % (world_size * 2) == 0`).
uint64_t cp_local_seq(uint64_t seq, uint64_t cp);

// One step i of the ring on a rank (_templated_ring_attention with is_causal and load balancing):
// i == 0: the local q, k, v (causal); 0 < i <= rank: q with the first half of the received k, v
// (key.chunk(2, dim=2)[0]); i > rank: the second half of q (query.chunk(2, dim=2)[1]) with all of k, v,
// and the merge updates only the second half (partial).
struct RingStep {
  uint64_t q_len = 0;   // query tokens of the op call
  uint64_t kv_len = 0;  // key/value tokens of the op call
  bool partial = false; // _SDPAMerger.step(..., partial): only the second half of out/lse is merged
};
std::vector<RingStep> ring_steps(uint64_t local_seq, uint64_t cp, uint64_t rank);

// _AllGatherRotater.exchange_buffers: ft_c.all_gather_tensor of torch.cat([key.flatten(), value.flatten()])
// along dim 0: cp * 2 * B * Hk * L * D elements of the key's dtype, allocated once per ring-attention call
// (forward, and again in backward: its kv_rotater).
uint64_t cp_kv_gather_bytes(uint64_t batch, uint64_t kv_heads, uint64_t local_seq, uint64_t head_dim, DType dt,
                            uint64_t cp);
// The K/V buffer one step sends: torch.cat([key.flatten(), value.flatten()]), 2 * B * Hk * L * D elements
// (the key's dtype in forward; float32 for the gradients in backward, convert_to_f32 = True).
uint64_t cp_kv_cat_bytes(uint64_t batch, uint64_t kv_heads, uint64_t local_seq, uint64_t head_dim, DType dt);

}  // namespace trainmem
