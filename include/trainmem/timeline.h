// The step timeline: every allocation and free of one or more training steps, in order, with the category of
// the memory and the phase of the step. Produced by the simulator (sim.h), consumed by the allocator model and
// the reports.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/units.h"

namespace trainmem {

// What a block of memory holds.
enum class Category : uint8_t {
  kWeights,        // parameters
  kBuffers,        // registered buffers
  kGradients,      // .grad of parameters
  kOptimizer,      // optimizer state (moments, momentum, fused `step`)
  kInputs,         // input ids and targets
  kActivations,    // forward results: held by Python or saved by autograd for backward
  kWeightCopies,   // autocast's cached 16-bit copies of float32 parameters
  kBackward,       // gradients flowing through the backward pass (not yet a parameter's .grad)
  kTemporaries,    // op-internal scratch (casts, workspaces of single kernels, optimizer temporaries)
  kWorkspace,      // persistent cuBLAS / cuBLASLt workspaces
  kKvCache,        // transformers' KV cache (past_key_values) while generating
  kDdpBuckets,     // DistributedDataParallel's flat gradient buckets and its construction-time broadcast buffers
  kZeroBuckets,    // DeepSpeed ZeRO's IPG gradient buckets and the reduction's flattened copies
  kFsdpBuffers,    // FSDP2's and FSDP1's all-gather copy-in and output, unsharded parameters, reduce-scatter input and output
};
inline constexpr size_t kCategoryCount = 14;
std::string_view category_name(Category c);

// Where in the training loop an event happens.
enum class Phase : uint8_t { kSetup, kForward, kLoss, kBackward, kGradClip, kOptimizer, kZeroGrad };
std::string_view phase_name(Phase p);
// "the backward of step 2" (", micro-batch 1" when `micro` is non-zero), or "the model load (setup)".
std::string moment_name(Phase p, uint32_t step, uint32_t micro = 0);

// What a tensor is, cheap to record: a static description, the layer it belongs to (-1: none) and, for
// parameters, buffers and their gradients or state, the inventory row.
struct Label {
  const char* what = "";
  int32_t layer = -1;
  int32_t row = -1;
};
// A copy of `name` that lives as long as the process: labels point at names, and a timeline outlives the
// inventory whose names it shows. Thread-safe; each distinct name is stored once.
const char* intern_name(std::string_view name);

// Label::row of a tensor allocated by a backward function: `what` and `layer` name the forward op whose
// backward made it ("backward of h.3 attn softmax").
inline constexpr int32_t kRowBackwardOf = -2;
// Label::row of a tensor a backward function allocates under a name of its own (bitsandbytes' dequantized
// weight): it keeps `what`, and takes the layer of the node's forward op.
inline constexpr int32_t kRowNamedInBackward = -3;

// The CUDA stream an allocation is made on (torch.cuda.current_stream() then). The caching allocator keeps each
// stream's cached blocks apart (BlockComparatorSize orders by stream first; a block is reused only by its own
// stream), so buffers allocated on a side stream reserve segments of their own. FSDP2's are the side streams
// modelled (FSDPCommContext.lazy_init).
enum class Stream : uint8_t {
  kDefault,                // the current (default) stream: the model, autograd and the optimizer
  kFsdpAllGatherCopyIn,    // FSDP2's all_gather_copy_in_stream: the copy-in buffer and the all-gather output
  kFsdpReduceScatter,      // FSDP2's reduce_scatter_stream: the reduce-scatter output and its upcast
  // FSDP1's streams (_runtime_utils.py _init_streams, shared by every unit of the root):
  kFsdp1Unshard,           // _unshard_stream: the all-gather destination _full_param_padded
  kFsdp1PostBackward,      // _post_backward_stream: new_sharded_grad and its cast to the parameter dtype
  kFsdp1PreUnshard,        // _pre_unshard_stream: the low-precision shard _mp_shard
  kFsdpAllReduce,          // FSDP2's all_reduce_stream under HSDP: the post-reduce upcast of the sharded gradients
  // FSDP2 roots beyond the first on one rank (torchtitan's fully_shard on each pipeline model part under
  // interleaved-1f1b): each root's FSDPState._lazy_init -> FSDPCommContext.lazy_init creates its own streams, so
  // root k >= 1's copy-in, reduce-scatter and all-reduce streams are the values fsdp2_root_stream gives, from here
  kFsdpRootStreams,
};
// The FSDP2 roots beyond the first whose streams have pools (--pp-virtual-stages up to 1 + this under FSDP2)
inline constexpr size_t kFsdpExtraRoots = 7;
inline constexpr size_t kStreamCount = 7 + 3 * kFsdpExtraRoots;
// The stream of FSDP2 root `root` (0: the first, the named values) for a kind among kFsdpAllGatherCopyIn,
// kFsdpReduceScatter and kFsdpAllReduce
inline Stream fsdp2_root_stream(Stream kind, size_t root) {
  if (root == 0) return kind;
  const size_t k = kind == Stream::kFsdpAllGatherCopyIn ? 0 : kind == Stream::kFsdpReduceScatter ? 1 : 2;
  return static_cast<Stream>(static_cast<size_t>(Stream::kFsdpRootStreams) + 3 * (root - 1) + k);
}

struct Event {
  enum Kind : uint8_t { kAlloc, kFree, kRecategorize, kEmptyCache } kind;  // kEmptyCache: torch.cuda.empty_cache()
  Category category;    // for kRecategorize: the new category
  Category from;        // for kRecategorize: the old category
  Phase phase;
  uint32_t step;        // optimizer step (1-based)
  uint32_t micro;       // micro-batch within the step (1-based)
  uint64_t storage;     // id of the storage (block) the event concerns
  Bytes bytes;          // requested bytes (numel x itemsize)
  Label label;          // what the tensor is
  Stream stream = Stream::kDefault;  // the stream the storage was allocated on (its block's pool)
};

struct Timeline {
  std::vector<Event> events;
};

// Live bytes per category at one moment.
struct LiveBytes {
  std::array<Bytes, kCategoryCount> by_category{};
  Bytes total;
};

// Live bytes after `ev`, given the live bytes before it.
inline void apply(LiveBytes& live, const Event& ev) {
  Bytes& cat = live.by_category[static_cast<size_t>(ev.category)];
  switch (ev.kind) {
    case Event::kAlloc:
      cat += ev.bytes;
      live.total += ev.bytes;
      break;
    case Event::kFree:
      cat -= ev.bytes;
      live.total -= ev.bytes;
      break;
    case Event::kRecategorize:
      live.by_category[static_cast<size_t>(ev.from)] -= ev.bytes;
      cat += ev.bytes;
      break;
    case Event::kEmptyCache:  // returns cached segments to the driver: no tensor changes
      break;
  }
}

}  // namespace trainmem
