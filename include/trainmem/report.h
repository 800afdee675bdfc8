// Reports: what trainmem prints. Tables for people (binary units and shares, like bloaty), JSON for programs
// (integers for every byte count). Each render_* function is pure: it returns the text.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/formulas.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"
#include "trainmem/plan.h"

namespace trainmem {

struct ModelListing {
  std::string name;
  std::string model_type;
  Elems parameters;
  std::string source;
};

// Every preset (trainmem models): its name, model_type, parameter count and source.
std::vector<ModelListing> model_listings();
std::string render_models_table(const std::vector<ModelListing>& models);
std::string render_models_json(const std::vector<ModelListing>& models);
std::string render_gpus_table(const std::vector<GpuSpec>& gpus);
std::string render_gpus_json(const std::vector<GpuSpec>& gpus);

// The dtype a listing of the tensors shows them in: float32, float16 or bfloat16; throws FieldError naming "dtype".
DType listing_dtype(std::string_view text);
std::string render_inventory_table(const ModelSpec& m, const Inventory& inv, DType dtype);
std::string render_inventory_json(const ModelSpec& m, const Inventory& inv, DType dtype);

struct FormulaReport {
  ModelSpec model;
  TrainSetup setup;
  Elems inventory_parameters;
  Seed001Contract seed001;
  Seed002Korthikanti seed002;
  Seed000Peak seed000;
  Seed004Calculator seed004;  // the only one for --task inference: the other seeds' forms are of training
  // --dp N given (training): ZeRO's Table 1 and DeepSpeed's estimators per rank, for N GPUs on one node
  std::optional<ZeroPaperStates> zero;
  std::optional<DeepSpeedEstimates> deepspeed;
  // training: seed 002's FLOPs and the 6N·tokens rule beside the simulated step's (flops.h)
  Seed002Flops flops;
  FlopLedger simulated;
};
// The seeds' closed forms for a scenario. They assume Adam(W) state and no particular device: an optimizer
// without that state, or a device or runtime field, is refused rather than silently ignored.
FormulaReport formula_report(const ResolvedScenario& r);
std::string render_formulas_table(const FormulaReport& f);
std::string render_formulas_json(const FormulaReport& f);

// `trainmem timeline`: the step's events with live bytes by category and the allocator's view.
enum class TimelineGranularity {
  kEvent,  // every allocation, free and change of category (filtered by min_bytes)
  kLayer,  // one row per run of events in the same step, micro-batch, phase and layer
  kPhase,  // one row per run of events in the same step, micro-batch and phase
};
struct TimelineOptions {
  TimelineGranularity granularity = TimelineGranularity::kLayer;
  uint64_t min_bytes = 0;          // event rows: only tensors of at least this size (live bytes still count all)
  std::optional<uint32_t> step;    // only this optimizer step (0: the setup before the first step)
  uint64_t unit = 0;               // table columns in this many bytes (1: exact bytes); 0: MiB or GiB by size
};
// "B", "KiB", "MiB", "GiB" as a number of bytes; "auto" as 0.
std::optional<uint64_t> parse_unit(std::string_view s);
struct TimelineRow {
  size_t first_event = 0, last_event = 0;  // inclusive range of timeline events
  uint32_t step = 0, micro = 0;
  Phase phase = Phase::kSetup;
  int32_t layer = -1;
  // event rows: the event itself
  Event::Kind kind = Event::kAlloc;
  Category category = Category::kActivations;
  Category from = Category::kActivations;
  std::string tensor;
  Bytes bytes;
  uint64_t block = 0;              // allocator block of the tensor (alloc and free events)
  // every row
  size_t events = 0;
  LiveBytes live;                  // after the last event
  Bytes max_live;                  // highest total of live tensors within the row
  uint64_t allocated = 0, reserved = 0;          // allocator statistics after the last event
  uint64_t max_allocated = 0, max_reserved = 0;  // highest within the row
  std::string largest;             // the largest tensor allocated within the row
  Bytes largest_bytes;
  bool peak_live = false, peak_allocated = false, peak_reserved = false;  // the run's peaks fall here
  bool oom = false;                // with a GPU: the first allocation that would fail there falls here
};
std::vector<TimelineRow> timeline_rows(const Estimate& e, const TimelineOptions& o);
std::span<const NameRow<TimelineGranularity>> name_table(TimelineGranularity);
std::optional<TimelineGranularity> parse_granularity(std::string_view s);
// The timeline's options from their text (--by, --unit, --min-bytes with an optional unit, --step of the
// `steps` simulated); throws FieldError naming the option.
TimelineOptions parse_timeline_options(std::string_view by, std::string_view unit, std::string_view min_bytes,
                                       std::string_view step, uint32_t steps);
std::string render_timeline_table(const Estimate& e, const TimelineOptions& o, const std::vector<TimelineRow>& rows);
std::string render_timeline_csv(const Estimate& e, const TimelineOptions& o, const std::vector<TimelineRow>& rows);
std::string render_timeline_json(const Estimate& e, const TimelineOptions& o, const std::vector<TimelineRow>& rows);

// How the CLI spells a scenario field ("optimizer_impl" -> "--optimizer-impl", "overrides" -> "--set"), and a
// list of changes ("--precision bf16 --attention sdpa").
std::string cli_flag(std::string_view field);
std::string cli_words(std::span<const FieldChange> changes);
std::string cli_words(const FitSuggestion& sg);
// An error's message as the CLI prints it after "trainmem: ": a FieldError names the field by its flag
// ("--batch \"-3\": expected ..."), any other Error is its message. Every front end shows this text.
std::string error_message(const Error& e);

std::string render_fit_table(const FitResult& r);
std::string render_plan_table(const PlanResult& r);
std::string render_plan_json(const PlanResult& r);
std::string render_fit_json(const FitResult& r);

// NCCL's communicators of a rank (nccl.h), one line each, for the estimate's and fit's GPU lines ("" for none).
std::string render_nccl(const NcclLedger& l);
std::string render_estimate_table(const Estimate& e, const GpuSpec* gpu);
// A paragraph explaining a large fragmentation (large_fragmentation()), or "".
std::string fragmentation_note(const AllocatorFigures& m);
std::string render_verdict(const DeviceVerdict& v, const GpuSpec* gpu);
std::string render_estimate_json(const Estimate& e, const GpuSpec* gpu);

// The step time (flops.h) as text lines for estimate and fit, and as the JSON `time` object.
// With --pp, `shown_rank` names the rank whose kernels and collectives the lines after the pipeline line show.
std::string render_step_time(const StepTime& t, const GpuSpec& gpu, const TrainSetup& s, uint64_t shown_rank = 0);

}  // namespace trainmem
