// fit(): the largest micro-batch (or sequence) whose training step fits a GPU, found by searching over the
// whole pipeline (simulator and caching allocator), and, when even the smallest does not fit, what would.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/allocator.h"
#include "trainmem/estimate.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/scenario.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"

namespace trainmem {

// Memory kept free on top of the prediction: a share of the device (in basis points) or a byte count.
struct Margin {
  uint64_t basis_points = 500;     // 500 = 5% of the CUDA runtime total
  std::optional<Bytes> bytes;      // when set, used instead of the share
  Bytes of(const GpuSpec& gpu) const;
  std::string describe() const;    // "5%", "2.0 GiB"
};
// "5%", "2.5%", "0", "2GiB", "512MiB", "1000000B"; throws trainmem::Error naming --margin otherwise (a bare
// number other than 0 too: "--margin 5" is more likely a forgotten "%" than five bytes).
Margin parse_margin(std::string_view s);

enum class FitDimension { kBatch, kSeq };
std::optional<FitDimension> parse_fit_dimension(std::string_view s);
std::string_view fit_dimension_name(FitDimension d);
std::span<const NameRow<FitDimension>> name_table(FitDimension);

// One simulated setup of the search.
struct FitProbe {
  uint64_t batch = 0, seq = 0;
  bool fits = false;
  Bytes peak_allocated;    // max_memory_allocated
  Bytes peak_reserved;     // max_memory_reserved on a device without limit: comparable across probes
  bool large_fragmentation = false;  // large_fragmentation() of that replay
  Bytes reserved_on_device, device_total;  // when it fits: max_memory_reserved on this GPU, and nvidia-smi
  int64_t headroom = 0;    // fits: limit - reserved on the device; does not: minus what is missing at least
                           // (DeviceVerdict::Oom::short_by)
  uint64_t alloc_retries = 0;  // times the allocator had to release its cache to stay under the limit
  std::string failure;     // why it does not fit: where the OOM happens, or that the sizes overflow
  std::optional<uint64_t> pp_worst_rank;  // --pp: the rank these figures are (the least headroom of all)
  std::optional<StepTime> time;           // when it fits and the GPU's peaks are catalogued (flops.h)
};

// A change to the setup that would save memory (or raise the answer), and what it gives at the smallest size.
struct FitSuggestion {
  std::vector<FieldChange> changes;  // {{"precision", "bf16"}}: the front end words them ("--precision bf16")
  std::string what;         // what the change means for training
  std::optional<FitProbe> at_one;      // the setup with this change at the smallest size; empty: not simulated
  int64_t saves = 0;                   // peak reserved saved against the original setup at that size
  std::optional<uint64_t> largest;     // the largest batch (or sequence) that fits with the change
};

struct FitRequest {
  FitDimension solve = FitDimension::kBatch;
  Margin margin;
  uint64_t max_batch = uint64_t{1} << 20;
  uint64_t max_seq = uint64_t{1} << 24;  // further limited by a learned position table
};

struct FitResult {
  ModelSpec model;
  TrainSetup setup;      // as given, with the optimizer implementation resolved
  SimOptions options;
  FitDimension solve = FitDimension::kBatch;
  GpuSpec gpu;
  Bytes margin;          // bytes kept free
  Bytes limit;           // what the caching allocator may reserve: runtime total - context - NCCL - margin
  NcclLedger nccl;       // NCCL's buffers on a rank of the setup (nccl.h)
  std::optional<uint64_t> largest;   // empty: even 1 does not fit
  bool capped = false;               // the search stopped at the largest size it may try
  uint64_t cap = 0;
  std::vector<FitProbe> probes;      // every setup simulated, in increasing size
  std::vector<FitSuggestion> suggestions;  // changes that save memory: when even size 1 does not fit, each one
                                           // that saves; when it fits, each one that raises the answer
  std::vector<std::vector<FieldChange>> not_helpful;
  // Several DDP ranks: the shardings tried, least sharded first (zero1, zero2, fsdp2, zero3), each with whether
  // it fits at size 1 and its largest size; `smallest_sharding` is the first that fits ("ddp" when the setup
  // itself does), empty when none does.
  struct ShardingTry {
    std::string sharding;
    bool fits = false;
    std::optional<uint64_t> largest;
  };
  std::vector<ShardingTry> sharding_ladder;
  std::optional<std::string> smallest_sharding;
  std::vector<std::string> warnings;       // resolve()'s, for the front end to say
  bool suggestions_cut = false;            // fit's bound on work was reached before every change was simulated  // changes tried that would save (or raise) nothing here
};

// Searches the largest micro-batch (solve kBatch, at s.seq) or sequence (kSeq, at s.batch) that fits `gpu`
// with the margin. Memory is assumed to grow with the size (checked at the answer: it fits and the next
// size does not).
// fit() of a scenario: the solved size must not be given (it is the search's to find); solving for the
// sequence, the micro-batch defaults to 1. Needs a GPU.
FitResult fit(const Scenario& s, const FitRequest& r, const FileReader& files);

// The request from its text, as a front end takes it: `solve` batch or seq, `margin` as parse_margin reads it;
// throws FieldError naming "solve" or "margin".
FitRequest fit_request(std::string_view solve, std::string_view margin);

// ... over a given inventory (its rows' ownership: frozen, LoRA adapters, 4-bit weights).
FitResult fit(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o,
              const AllocatorConfig& ac, const GpuSpec& gpu, const FitRequest& r);

FitResult fit(const ModelSpec& m, const TrainSetup& s, const SimOptions& o, const AllocatorConfig& ac,
              const GpuSpec& gpu, const FitRequest& r);

}  // namespace trainmem
