// The PyTorch CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, native backend), replayed over a step
// timeline: what memory_allocated (block sizes, with the rounding "gaps"), max_memory_reserved (segments) and
// the first out-of-memory would be. One device; each event's stream picks its pools (a stream reuses only its
// own cached blocks). Ordinary training allocates everything on the default stream; FSDP2's collectives'
// buffers come from its side streams.
//
// Cross-stream frees (record_stream) are replayed at the free event: a block used on another stream is
// reusable once the program frees it, as if that stream had finished with it. That is the policy where the
// real release waits on GPU progress (FSDP1's record_stream, ProcessGroupNCCL's stashed tensors), which a
// timeline without GPU times cannot know; FSDP2 orders its frees with events the program waits on, so its
// frees are where the program makes them.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/buffer_cache.h"
#include "trainmem/runtime.h"
#include "trainmem/timeline.h"
#include "trainmem/units.h"

namespace trainmem {

// Constants of CUDACachingAllocator.cpp (2.x, unchanged since 1.13).
inline constexpr uint64_t kMinBlockSize = 512;            // "all sizes are rounded to at least 512 bytes"
inline constexpr uint64_t kSmallSize = 1048576;           // "largest 'small' allocation is 1 MiB"
inline constexpr uint64_t kSmallBuffer = 2097152;         // "'small' allocations are packed in 2 MiB blocks"
inline constexpr uint64_t kLargeBuffer = 20971520;        // "'large' allocations may be packed in 20 MiB blocks"
inline constexpr uint64_t kMinLargeAlloc = 10485760;      // "allocations between 1 and 10 MiB may use kLargeBuffer"
inline constexpr uint64_t kRoundLarge = 2097152;          // "round up large allocations to 2 MiB"
inline constexpr size_t kRoundUpPowerOfTwoIntervals = 16; // CUDAAllocatorConfig: one division count per interval

// PYTORCH_CUDA_ALLOC_CONF options that change the allocator's decisions.
struct AllocatorConfig {
  uint64_t max_split_size = std::numeric_limits<uint64_t>::max();  // max_split_size_mb (default unlimited)
  uint64_t max_non_split_rounding = kLargeBuffer;                  // max_non_split_rounding_mb (2.6+)
  std::array<uint64_t, kRoundUpPowerOfTwoIntervals> roundup_power2_divisions{};  // 0: plain 512 rounding
  bool expandable_segments = false;
  double garbage_collection_threshold = 0.0;  // parsed and validated; only acts with a memory fraction
};

// Parses a PYTORCH_CUDA_ALLOC_CONF string ("max_split_size_mb:128,expandable_segments:True"); throws
// trainmem::Error with the message PyTorch would give for an invalid one.
AllocatorConfig parse_alloc_conf(std::string_view conf, TorchVersion torch);

// CUDACachingAllocator's round_size: the size a block for `requested` bytes will have.
uint64_t round_size(uint64_t requested, const AllocatorConfig& c, TorchVersion torch);
// get_allocation_size: the segment cudaMalloc'ed when no cached block fits a rounded size.
uint64_t allocation_size(uint64_t rounded);

// What the caching allocator's statistics read after each event of a timeline.
struct AllocatorReplay {
  ReuseVector<uint64_t> allocated;  // allocated_bytes.all.current after each event (block sizes)
  ReuseVector<uint64_t> reserved;   // reserved_bytes.all.current after each event (segments)
  Bytes peak_allocated;             // max_memory_allocated
  size_t peak_allocated_event = 0;
  Bytes peak_reserved;              // max_memory_reserved
  size_t peak_reserved_event = 0;
  uint64_t segments_peak = 0;
  uint64_t alloc_retries = 0;       // num_alloc_retries: cudaMalloc failed, cache released, retried
  // The first allocation that could not be satisfied even after releasing the cache (an OOM).
  struct Oom {
    size_t event = 0;
    Bytes requested, rounded, segment;
    Bytes allocated, reserved, free_in_device;
  };
  std::optional<Oom> oom;
};

// A block live at some moment: the event that allocated it and its sizes.
struct LiveBlock {
  size_t alloc_event = 0;
  Bytes requested;  // the tensor's bytes
  Bytes block;      // what memory_allocated counts for it
};
// The blocks live right after event `at` (used to explain an out-of-memory and the rounding gaps).
std::vector<LiveBlock> live_blocks_after(const Timeline& tl, const AllocatorConfig& c, TorchVersion torch,
                                         size_t at);

// The allocator's own trace of a replay, as torch.cuda.memory._record_memory_history() records it
// (CUDACachingAllocator's record_trace): every block handed out and given back with its address, every
// segment cudaMalloc'ed or freed (pages mapped or unmapped with expandable segments), and the segments with
// their blocks at the end. Addresses are the replay's own (segments are placed downwards from 2^60).
struct AllocatorTraceEntry {
  enum Action : uint8_t { kAlloc, kFreeRequested, kFreeCompleted, kSegmentAlloc, kSegmentFree, kSegmentMap,
                          kSegmentUnmap };
  Action action;
  size_t event = 0;    // the timeline event it belongs to
  uint64_t addr = 0;
  uint64_t size = 0;   // alloc / free: the requested bytes (record_trace's orig_size); segment: its bytes
  Stream stream = Stream::kDefault;
};
struct AllocatorBlockState {
  uint64_t addr = 0, size = 0;
  bool allocated = false;
  uint64_t requested = 0;  // allocated blocks: the tensor's bytes
  size_t alloc_event = 0;  // allocated blocks: the event that allocated it
};
struct AllocatorSegmentState {
  uint64_t addr = 0, size = 0;
  Stream stream = Stream::kDefault;
  bool small = false, expandable = false;
  std::vector<AllocatorBlockState> blocks;  // in address order, covering the segment
};
struct AllocatorTrace {
  std::vector<AllocatorTraceEntry> entries;
  std::vector<AllocatorSegmentState> segments;  // after the last event, by address
};
AllocatorTrace trace_allocator(const Timeline& tl, const AllocatorConfig& c, TorchVersion torch);

// Replays `tl` through the allocator. `capacity`: device memory available to segments (the CUDA runtime
// total minus the context); empty for an unlimited device.
AllocatorReplay replay_allocator(const Timeline& tl, const AllocatorConfig& c, TorchVersion torch,
                                 std::optional<Bytes> capacity);

}  // namespace trainmem
