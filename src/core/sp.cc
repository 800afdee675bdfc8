// Sequence parallelism with tensor parallelism (sp.h): what is simulated.
#include "trainmem/sp.h"

#include <fmt/format.h>

#include "trainmem/error.h"
#include "trainmem/tp.h"

namespace trainmem {

void sp_check(const ModelSpec& m, uint64_t tp, uint64_t seq) {
  if (m.tp <= 1) tp_check(m, tp);  // the global model: the plan's family, shapes and head (tp.h)
  if (m.attn_impl != AttnImpl::kSdpa) {
    // LlamaModel.forward builds the mask from inputs_embeds, the rank's (B, T/tp, C) shard (cache_position of
    // T/tp), while the attention runs on the gathered (B, T, C): eager's materialized mask does not fit it
    throw Error(fmt::format("{}: sequence parallelism is simulated with sdpa attention (is_causal, no mask); {} "
                            "runs {}, whose causal mask LlamaModel makes from the rank's seq / tp embeddings",
                            tp, m.name, attn_impl_name(m.attn_impl)));
  }
  if (m.attn.sliding_window > 0 && seq >= m.attn.sliding_window) {
    throw Error(fmt::format("{}: {} slides a {}-token window over a {}-token sequence; the SDPA sliding-window mask "
                            "(made from the rank's seq / tp positions) under sequence parallelism is not simulated",
                            tp, m.name, m.attn.sliding_window, seq));
  }
  if (m.attn.out_bias || m.mlp.bias) {
    throw Error(fmt::format("{}: {} has biased o_proj / down_proj; RowwiseParallel's replicated bias added to the "
                            "Partial output under sequence parallelism was not read, and is not simulated",
                            tp, m.name));
  }
  if (seq % tp != 0) {
    // Shard._to_replicate_tensor / _reduce_shard_tensor pad an uneven Shard(1) before the collectives
    throw Error(fmt::format("{}: --seq {} is not divisible by {}: Shard(1)'s padded collectives for an uneven "
                            "sequence are not simulated", tp, seq, tp));
  }
}

}  // namespace trainmem
