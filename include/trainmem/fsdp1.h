// PyTorch FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, one FlatParameter per wrapped module) per rank,
// as the transformers Trainer runs it through accelerate (fsdp_config version 1: FullyShardedDataParallelPlugin
// (fsdp_version=1), Accelerator.prepare_model wraps FSDP(model, ...)). The flat-parameter arithmetic and the units
// are here (pure functions, unit-tested against the source's rules); the simulator (src/sim/fsdp1.cc) allocates
// what they say.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainmem/dtype.h"
#include "trainmem/inventory.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"

namespace trainmem {

struct ModelSpec;
enum class LoopKind;

// FullyShardedDataParallel's settings as the Trainer passes them (resolve_fsdp1 cites each one).
struct Fsdp1Options {
  bool on = false;
  uint64_t ranks = 1;               // the process group's size W (--dp)
  uint64_t rank = 0;                // the simulated rank (0)
  DType orig_dtype = DType::kF32;   // the FlatParameter's dtype (accelerate upcasts flat params to float32)
  bool mixed = false;               // MixedPrecision.param_dtype set (and differing from orig_dtype)
  DType param_dtype = DType::kF32;  // _fwd_bwd_param_dtype: the unsharded flat parameter's dtype
  DType reduce_dtype = DType::kF32; // _reduce_dtype: the reduce-scatter's dtype
  bool use_orig_params = true;      // the Trainer's fsdp_config default "true"
  bool backward_prefetch = false;   // BACKWARD_PRE; the Trainer's default is "NO_PREFETCH" (None)
  bool sync_module_states = true;   // the Trainer's fsdp_config default "true": each unit broadcast at wrap
};

// _init_utils.py PARAM_BROADCAST_BUCKET_SIZE = int(250 * 1024 * 1024): sync_module_states' broadcast buckets
inline constexpr uint64_t kFsdp1ParamBroadcastBucketBytes = 250ull * 1024 * 1024;

// The defaults of the code that runs; throws trainmem::Error for what is not simulated. Off unless dp > 1 and
// --sharding fsdp1.
Fsdp1Options resolve_fsdp1(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch);

// _get_aligned_numel(unsharded_dtype): ALIGNMENT = 16 bytes // the dtype's size (use_orig_params=True passes
// align_addresses, with _fwd_bwd_param_dtype).
uint64_t fsdp1_aligned_numel(DType unsharded_dtype);

// One FlatParameter's layout (FlatParamHandle._init_flat_param_and_metadata, shard, _get_shard).
struct Fsdp1Layout {
  std::vector<uint64_t> offsets;   // each parameter's start in the unsharded flat parameter
  std::vector<uint64_t> numels;    // each parameter's numel (no padding)
  uint64_t params = 0;             // sum of numels
  uint64_t align_padding = 0;      // alignment padding tensors between parameters (aligned_numel > 0)
  uint64_t world_padding = 0;      // the padding tensor making the total divisible by W (aligned_numel > 0), or
                                   // the F.pad of the last ranks' shards (aligned_numel 0)
  uint64_t unpadded_numel = 0;     // _unpadded_unsharded_size: the FlatParameter's numel when flattened
  uint64_t shard_numel = 0;        // S = chunks[0].numel(): every rank's _local_shard (padded)
  uint64_t padded_unsharded_numel = 0;  // _padded_unsharded_size = W x S (_full_param_padded)
};
// `numels` in flattening order; aligned_numel 0: no alignment (use_orig_params=False).
Fsdp1Layout fsdp1_layout(const std::vector<uint64_t>& numels, uint64_t aligned_numel, uint64_t ranks);
// How many of parameter p's elements lie in rank's shard [rank x S, (rank + 1) x S) (_get_shard_metadata's
// numel_in_shard; 0 when not in_shard).
uint64_t fsdp1_numel_in_shard(const Fsdp1Layout& l, size_t p, uint64_t rank);

// One FSDP unit: the decoder layers that accelerate's TRANSFORMER_BASED_WRAP policy wraps (_no_split_modules), and
// the root FullyShardedDataParallel(model) with every parameter left (the embedding, the final norm, lm_head).
struct Fsdp1Unit {
  enum Kind : uint8_t { kRoot, kLayer } kind = kLayer;
  int32_t layer = -1;            // kLayer: its index
  std::string name;              // "model.layers.3", "model (root)"
  std::vector<int32_t> rows;     // inventory rows, in flattening order
  Fsdp1Layout layout;
};
// In wrapping order: the layers (wrapped bottom-up first), then the root.
std::vector<Fsdp1Unit> fsdp1_units(const ModelSpec& m, const Inventory& inv, const Fsdp1Options& o);

}  // namespace trainmem
