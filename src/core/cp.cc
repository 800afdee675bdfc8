// Context parallelism rules (cp.h). Source: pytorch/pytorch
// torch/distributed/tensor/experimental/_context_parallel/_attention.py (_templated_ring_attention,
// _is_causal_behavior, _AllGatherRotater) and _load_balancer.py (_HeadTailLoadBalancer).
#include "trainmem/cp.h"

#include <fmt/format.h>

#include "trainmem/error.h"
#include "trainmem/units.h"

namespace trainmem {

uint64_t cp_local_seq(uint64_t seq, uint64_t cp) {
  if (cp == 0) throw Error("cp: 0 context-parallel ranks; expected at least 1");
  if (cp == 1) return seq;
  // _HeadTailLoadBalancer._generate_indices: assert seq_length % (world_size * 2) == 0
  if (seq % (2 * cp) != 0) {
    throw Error(fmt::format("{}: not a multiple of 2 x --cp {} = {}: torch's context_parallel shards "
                            "the sequence with its head-tail load balancer (_HeadTailLoadBalancer asserts "
                            "seq_length % (2 * world_size) == 0)",
                            seq, cp, 2 * cp));
  }
  return seq / cp;
}

std::vector<RingStep> ring_steps(uint64_t local_seq, uint64_t cp, uint64_t rank) {
  std::vector<RingStep> steps;
  for (uint64_t i = 0; i < cp; ++i) {
    // _is_causal_behavior: with load balancing no step is SKIP; i == 0 is IS_CAUSAL, the rest NOT_IS_CAUSAL
    if (i == 0) {
      steps.push_back({local_seq, local_seq, false});
    } else if (i <= rank) {
      steps.push_back({local_seq, local_seq / 2, false});  // key.chunk(2, dim=2)[0]
    } else {
      steps.push_back({local_seq / 2, local_seq, true});  // query.chunk(2, dim=2)[1], partial=True
    }
  }
  return steps;
}

uint64_t cp_kv_cat_bytes(uint64_t batch, uint64_t kv_heads, uint64_t local_seq, uint64_t head_dim, DType dt) {
  uint64_t n = checked_mul(2, batch, "cp kv buffer");
  n = checked_mul(n, kv_heads, "cp kv buffer");
  n = checked_mul(n, local_seq, "cp kv buffer");
  n = checked_mul(n, head_dim, "cp kv buffer");
  return checked_mul(n, itemsize(dt), "cp kv buffer");
}

uint64_t cp_kv_gather_bytes(uint64_t batch, uint64_t kv_heads, uint64_t local_seq, uint64_t head_dim, DType dt,
                            uint64_t cp) {
  return checked_mul(cp_kv_cat_bytes(batch, kv_heads, local_seq, head_dim, dt), cp, "cp kv all-gather");
}

}  // namespace trainmem
