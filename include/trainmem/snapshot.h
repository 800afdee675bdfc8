// Interop with PyTorch's memory snapshots (torch.cuda.memory._snapshot(), the pickle pytorch.org/memory_viz
// opens):
//   - export: the simulated run as such a snapshot, its device trace replayed by trainmem's caching allocator
//     (`trainmem timeline --format snapshot`);
//   - import: a real snapshot (or a trainmem-measurement-v1 JSON, whose trace holds the same actions), its
//     trace lined up with the simulated allocations, and predicted vs measured compared (`trainmem diff`).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/allocator.h"
#include "trainmem/estimate.h"
#include "trainmem/pickle.h"

namespace trainmem {

// Exported addresses: the replay's segments moved to start here (0x7f0000000000, where CUDA's device
// addresses lie on Linux x86-64), so that every address stays below 2^53, the integers memory_viz's
// JavaScript reads exactly.
inline constexpr uint64_t kSnapshotBaseAddress = 0x7f0000000000;

// The snapshot of the run of `e` (allocator configuration `ac`): {"segments", "device_traces"} as
// torch.cuda.memory._snapshot() returns them, one device. Each alloc / free entry's frames name the tensor
// ({"name": label, "filename": category, "line": 0}) and the moment of the step ({"name": "the forward of
// step 1", "filename": "trainmem", "line": event}); "category" colours memory_viz's timeline; "time_us" is
// the timeline's event index.
PyValue snapshot_of(const Estimate& e, const AllocatorConfig& ac);
std::string render_snapshot_pickle(const Estimate& e, const AllocatorConfig& ac);

// A measured allocator trace: the allocations and completed frees of one device, in order.
struct MeasuredTrace {
  struct Action {
    bool alloc = true;  // false: free_completed
    uint64_t addr = 0;
    uint64_t size = 0;  // the requested bytes (record_trace's orig_size / requested_size)
  };
  std::string format;  // "snapshot pickle" or "trainmem-measurement-v1"
  std::vector<Action> actions;
  bool truncated = false;                   // the recorder's ring buffer was full (measurement files say so)
  std::vector<std::string> trainmem_args;   // measurement files: the scenario the run was
  // measurement files: torch.cuda's own figures ("peak_allocated_bytes" -> bytes)
  std::vector<std::pair<std::string, uint64_t>> figures;
};
// Reads a snapshot pickle (it starts with the byte 0x80) or a trainmem-measurement-v1 JSON; `what` names the
// input in errors. Throws trainmem::Error on anything else.
MeasuredTrace read_measured_trace(std::string_view bytes, std::string_view what);

// Which allocations of two sequences of requested sizes are the same tensor: the longest common subsequence
// (Myers' O(ND) diff) of the sizes, as index pairs (measured, predicted), increasing. Past kMaxAlignEdits
// insertions and deletions, a greedy match within a window of sizes takes over.
inline constexpr size_t kMaxAlignEdits = 3000;
std::vector<std::pair<size_t, size_t>> align_sizes(const std::vector<uint64_t>& measured,
                                                   const std::vector<uint64_t>& predicted);

// Predicted vs measured.
struct SnapshotDiffRow {
  std::string name;
  std::optional<uint64_t> predicted, measured;
};
struct SnapshotDiff {
  std::string format;
  size_t measured_allocs = 0, predicted_allocs = 0, aligned = 0, same_prefix = 0;
  size_t frees_before_trace = 0;  // frees of blocks allocated before the trace began
  bool truncated = false;
  // the first allocation where the sequences part (absent when one is a prefix of the other)
  std::optional<size_t> diverge_measured;  // 0-based index among the allocations (the table says it 1-based)
  uint64_t diverge_measured_size = 0;
  std::string diverge_predicted;  // the simulated tensor there, with its size
  std::string predicted_peak_moment;  // "the backward of step 2": trainmem's peak
  std::string measured_peak_moment;   // the simulated moment the trace's peak lines up with
  std::vector<SnapshotDiffRow> moments;     // live tensor bytes at the peak, the steady state, the end
  std::vector<SnapshotDiffRow> categories;  // at the peak: predicted at trainmem's, measured at the trace's
  std::vector<SnapshotDiffRow> figures;     // measurement files: torch.cuda's figures against trainmem's
};
SnapshotDiff diff_snapshot(const Estimate& e, const MeasuredTrace& m);
std::string render_snapshot_diff_table(const Estimate& e, const SnapshotDiff& d);
std::string render_snapshot_diff_json(const Estimate& e, const SnapshotDiff& d);

}  // namespace trainmem
