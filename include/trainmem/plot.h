// Pictures of a step: `trainmem timeline --plot` (the step like PyTorch's memory_viz "Active Memory Timeline":
// live bytes stacked by category over the events, the caching allocator's allocated and reserved curves, the
// phases, the peak and the tensors live at it, the GPU's capacity) and `trainmem estimate --plot` (the breakdown
// at the peak against the card). The data (timeline_plot) and the SVG text (render_*_svg) are pure functions of
// the estimate, so that every front end (CLI, Python, web page) draws the same picture from the same numbers.
// Bytes stay integers; doubles are only coordinates.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/estimate.h"
#include "trainmem/timeline.h"

namespace trainmem {

// One pixel column of the picture: a run of consecutive events, drawn as the moment with the most live bytes
// among them (so that no peak is ever lost by the down-sampling) and the highest allocated and reserved.
struct PlotColumn {
  size_t first_event = 0, last_event = 0;  // inclusive range of timeline events
  size_t top_event = 0;                    // the event with the most live bytes in the column (the first of equals)
  LiveBytes live;                          // live bytes right after top_event
  uint64_t allocated = 0, reserved = 0;    // the highest memory_allocated() and memory_reserved() in the column
};

// A run of events in one phase of one micro-batch: a band of the picture.
struct PlotPhase {
  size_t first_event = 0, last_event = 0;  // inclusive
  Phase phase = Phase::kSetup;
  uint32_t step = 0, micro = 0;
};

// A tensor live at some moment: its name in the model's names, its category then, its bytes (requested).
struct PlotTensor {
  std::string name;
  Category category = Category::kActivations;
  Bytes bytes;
  size_t alloc_event = 0;  // the event that allocated it
  bool of_parameter = false;  // a parameter's (or buffer's) own storage, .grad or optimizer state: named by it
};

struct TimelinePlot {
  std::string title;     // the scenario, as the timeline table's header states it
  std::string subtitle;  // the peaks
  size_t first_event = 0, last_event = 0;  // the events drawn (inclusive): all of them, or one step's
  std::vector<PlotColumn> columns;
  std::vector<PlotPhase> phases;
  std::array<Bytes, kCategoryCount> category_peak{};  // each category's highest live bytes in the range
  // the moment with the most live tensors in the range (the run's peak when the range holds it), and its column
  Moment peak;
  size_t peak_column = 0;
  std::vector<PlotTensor> peak_tensors;  // the largest tensors live at the peak, largest first
  uint64_t max_allocated = 0, max_reserved = 0;
};

inline constexpr size_t kPlotColumns = 900;      // pixel columns of the timeline's plot area
inline constexpr size_t kPlotPeakTensors = 8;    // largest tensors named at the peak

// The picture's data: the events of `step` (0: the setup; none: every event) in at most `columns` columns of
// consecutive events, the same number of events in each (give or take one).
TimelinePlot timeline_plot(const Estimate& e, std::optional<uint32_t> step = std::nullopt,
                           size_t columns = kPlotColumns, size_t peak_tensors = kPlotPeakTensors);

// Every tensor live right after event `at`, largest first (then in allocation order), with the category it
// has at that moment (a gradient in flight may have become a .grad). Their bytes add up to the live total.
std::vector<PlotTensor> live_tensors_after(const Estimate& e, size_t at);

// The SVG documents (standalone, no plotting runtime): the timeline picture and the breakdown at the peak.
std::string render_timeline_svg(const Estimate& e, const TimelinePlot& p);
std::string render_breakdown_svg(const Estimate& e);
// A self-contained HTML page: the timeline picture inline, then `table` (the timeline's text table) below it.
std::string render_timeline_html(const Estimate& e, const TimelinePlot& p, std::string_view table);

// Text for XML character data and attribute values: & < > " ' escaped.
std::string xml_escape(std::string_view s);

}  // namespace trainmem
