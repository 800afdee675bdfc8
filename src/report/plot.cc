// The timeline picture's data (plot.h): the events in pixel columns, each drawn as its moment with the most live
// bytes, the phase bands, and the tensors live at the peak. Integers only; the drawing is in svg.cc.
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "trainmem/error.h"
#include "trainmem/family.h"
#include "trainmem/plot.h"

namespace trainmem {

namespace {

uint32_t step_of(const Event& ev) { return ev.phase == Phase::kSetup ? 0 : ev.step; }

// The inclusive range of events drawn: every event, or those of one step.
std::pair<size_t, size_t> event_range(const Timeline& tl, std::optional<uint32_t> step) {
  const size_t n = tl.events.size();
  if (n == 0) throw Error("the timeline has no events to draw");
  if (!step) return {0, n - 1};
  size_t first = n, last = 0;
  for (size_t i = 0; i < n; ++i) {
    if (step_of(tl.events[i]) != *step) continue;
    first = std::min(first, i);
    last = i;
  }
  if (first == n) throw FieldError("step", fmt::format("\"{}\": no events of that step were simulated", *step));
  return {first, last};
}

// "GPT-2: batch 8 x seq 1024, bf16-amp, adamw (foreach), hf loop, PyTorch 2.9", as the timeline table's head.
std::string scenario_title(const Estimate& e) {
  const TrainSetup& s = e.setup;
  std::string t = fmt::format("{}: batch {} x seq {}, {}, {}, {}, PyTorch {}", e.model.name, s.batch, s.seq,
                              precision_name(s.precision), step_label(s), loop_label(s, e.options.loop),
                              torch_version_name(e.options.torch));
  if (s.grad_accum > 1) t += fmt::format(", {} micro-batches", s.grad_accum);
  if (e.pp) t += fmt::format(", pipeline rank {} of {}", e.pp->shown, e.pp->ranks);
  if (s.dp > 1) t += fmt::format(", rank 0 of {}", s.dp);
  if (e.device) t += ", on the " + e.device->gpu;
  return t;
}

}  // namespace

std::vector<PlotTensor> live_tensors_after(const Estimate& e, size_t at) {
  const auto& events = e.sim->timeline.events;
  if (at >= events.size()) throw Error(fmt::format("event {} is beyond the timeline's {} events", at, events.size()));
  // storage -> the event that allocated it, and its category now
  std::map<uint64_t, std::pair<size_t, Category>> live;
  for (size_t i = 0; i <= at; ++i) {
    const Event& ev = events[i];
    switch (ev.kind) {
      case Event::kAlloc: live[ev.storage] = {i, ev.category}; break;
      case Event::kFree: live.erase(ev.storage); break;
      case Event::kRecategorize: {
        auto it = live.find(ev.storage);
        if (it != live.end()) it->second.second = ev.category;
        break;
      }
      case Event::kEmptyCache: break;
    }
  }
  std::vector<PlotTensor> out;
  out.reserve(live.size());
  for (const auto& [storage, a] : live) {
    const Event& ev = events[a.first];
    out.push_back({label_name(ev.label, e.model), a.second, ev.bytes, a.first, ev.label.row >= 0});
  }
  std::sort(out.begin(), out.end(), [](const PlotTensor& x, const PlotTensor& y) {
    return x.bytes != y.bytes ? x.bytes > y.bytes : x.alloc_event < y.alloc_event;
  });
  return out;
}

TimelinePlot timeline_plot(const Estimate& e, std::optional<uint32_t> step, size_t columns, size_t peak_tensors) {
  if (columns == 0) throw Error("a timeline picture needs at least one column");
  const auto& events = e.sim->timeline.events;
  const AllocatorReplay& alloc = *e.alloc;
  TimelinePlot p;
  std::tie(p.first_event, p.last_event) = event_range(e.sim->timeline, step);
  p.title = scenario_title(e);
  const uint64_t n = p.last_event - p.first_event + 1;
  const uint64_t c = std::min<uint64_t>(n, columns);
  p.columns.resize(c);
  for (uint64_t k = 0; k < c; ++k) {  // column k: events [first + k n / c, first + (k + 1) n / c)
    p.columns[k].first_event = p.first_event + k * n / c;
    p.columns[k].last_event = p.first_event + (k + 1) * n / c - 1;
  }
  const bool global_peak_in_range = e.sim->peak.event >= p.first_event && e.sim->peak.event <= p.last_event;
  LiveBytes live;
  size_t col = 0;
  bool have_peak = false;
  for (size_t i = 0; i <= p.last_event; ++i) {
    const Event& ev = events[i];
    apply(live, ev);
    if (i < p.first_event) continue;
    while (p.columns[col].last_event < i) ++col;
    PlotColumn& pc = p.columns[col];
    const uint64_t allocated = i < alloc.allocated.size() ? alloc.allocated[i] : 0;
    const uint64_t reserved = i < alloc.reserved.size() ? alloc.reserved[i] : 0;
    if (i == pc.first_event || live.total > pc.live.total) {
      pc.top_event = i;
      pc.live = live;
    }
    pc.allocated = std::max(pc.allocated, allocated);
    pc.reserved = std::max(pc.reserved, reserved);
    p.max_allocated = std::max(p.max_allocated, allocated);
    p.max_reserved = std::max(p.max_reserved, reserved);
    for (size_t k = 0; k < kCategoryCount; ++k) p.category_peak[k] = std::max(p.category_peak[k], live.by_category[k]);
    const bool is_peak = global_peak_in_range ? i == e.sim->peak.event : !have_peak || live.total > p.peak.live.total;
    if (is_peak) {
      p.peak = Moment{i, ev.phase, step_of(ev), ev.micro, live};
      p.peak_column = col;
      have_peak = true;
    }
    const uint32_t st = step_of(ev);
    if (p.phases.empty() || p.phases.back().phase != ev.phase || p.phases.back().step != st ||
        p.phases.back().micro != ev.micro) {
      p.phases.push_back({i, i, ev.phase, st, ev.micro});
    }
    p.phases.back().last_event = i;
  }
  // The peak's column shows the peak itself (a tie earlier in the column would show the same total).
  PlotColumn& pk = p.columns[p.peak_column];
  pk.top_event = p.peak.event;
  pk.live = p.peak.live;
  auto tensors = live_tensors_after(e, p.peak.event);
  if (tensors.size() > peak_tensors) tensors.resize(peak_tensors);
  p.peak_tensors = std::move(tensors);
  p.subtitle = fmt::format("peak live tensors {} in {}; peak allocated {}; peak reserved {}",
                           format_bytes(p.peak.live.total), moment_name(p.peak.phase, p.peak.step,
                                                                        e.setup.grad_accum > 1 ? p.peak.micro : 0),
                           format_bytes(Bytes(p.max_allocated)), format_bytes(Bytes(p.max_reserved)));
  if (step) p.subtitle += *step == 0 ? " (the setup only)" : fmt::format(" (step {} only)", *step);
  return p;
}

}  // namespace trainmem
