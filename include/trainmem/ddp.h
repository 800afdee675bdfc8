// DistributedDataParallel, per rank: the Reducer's gradient buckets (torch/nn/parallel/distributed.py,
// torch/csrc/distributed/c10d/reducer.cpp) and the construction-time broadcast (torch/distributed/utils.py
// _sync_module_states -> comm.cpp broadcast_coalesced). The rules are here; the simulator (loop.cc) allocates
// what they say.
#pragma once

#include <cstdint>
#include <vector>

#include "trainmem/dtype.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"

namespace trainmem {

enum class LoopKind;

// DDP's settings as the modelled script passes them, resolved.
struct DdpOptions {
  bool on = false;
  uint64_t ranks = 1;
  uint64_t bucket_bytes = 0;        // bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)
  uint64_t first_bucket_bytes = 0;  // the Reducer's first_bucket_bytes_cap
  bool bucket_view = false;         // gradient_as_bucket_view
  bool find_unused = false;         // find_unused_parameters
  bool rebuild = true;              // Reducer::should_rebuild_buckets: (static_graph || !find_unused_parameters)
};

// The defaults of the code that runs (cited in ddp.cc); throws trainmem::Error for what is not simulated.
DdpOptions resolve_ddp(const TrainSetup& s, LoopKind loop, TorchVersion torch);

// One tensor offered to compute_bucket_assignment_by_size: its index (the parameter's position in DDP's
// parameter list), bytes (numel * element_size) and dtype (buckets are per dtype and device).
struct BucketInput {
  uint32_t index = 0;
  uint64_t bytes = 0;
  DType dtype = DType::kF32;
};
struct DdpBucket {
  std::vector<uint32_t> indices;  // DDP parameter indices, in bucket order
  uint64_t bytes = 0;             // the flat bucket's bytes (sum of its tensors)
  DType dtype = DType::kF32;
};

// c10d's compute_bucket_assignment_by_size (reducer.cpp): per dtype, tensors join the open bucket until its
// size reaches the current limit (>=, so a bucket overshoots by its last tensor; a tensor larger than the limit
// closes a bucket of its own); then the next limit applies (the last one repeats). `in_given_order`: the
// tensors come in gradient-ready order (a rebuild) and the buckets stay in closing order, open ones appended
// per dtype in order of first appearance; otherwise the buckets are sorted by their smallest index.
std::vector<DdpBucket> assign_buckets(const std::vector<BucketInput>& tensors, const std::vector<uint64_t>& limits,
                                      bool in_given_order);

// broadcast_coalesced's chunks: compute_bucket_assignment_by_size with the single limit `buffer` over the
// module's states in order; a chunk of one tensor is flattened as a view (no allocation).
inline constexpr uint64_t kDdpBroadcastBucketBytes = 250ull * 1024 * 1024;  // distributed.py broadcast_bucket_size
inline constexpr uint64_t kDdpDefaultFirstBucketBytes = 1024 * 1024;       // dist._DEFAULT_FIRST_BUCKET_BYTES
inline constexpr double kDdpDefaultBucketCapMb = 25;                        // bucket_cap_mb default (25)

}  // namespace trainmem
