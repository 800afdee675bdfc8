// `trainmem timeline`: the simulated step event by event (or grouped by layer or phase), with the live bytes
// of each category, the caching allocator's allocated and reserved bytes, and where the peaks are.
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "json_text.h"
#include "text_table.h"
#include "trainmem/error.h"
#include "trainmem/family.h"
#include "trainmem/report.h"

namespace trainmem {

namespace {

// The columns a person reads: categories folded into the six the step is made of.
struct Group {
  const char* name;
  std::initializer_list<Category> categories;
  bool generation_only = false;  // a column only when the step generates (--generate): the KV cache
  bool ddp_only = false;         // a column only with data parallelism (dp > 1): DDP's buckets
  bool fsdp_only = false;        // a column only under --sharding fsdp2: its gathered and reduce-scatter buffers
};
const Group kGroups[] = {
    {"weights", {Category::kWeights, Category::kBuffers}},
    {"grads", {Category::kGradients}},
    {"optim", {Category::kOptimizer}},
    {"activ", {Category::kInputs, Category::kActivations, Category::kWeightCopies}},
    {"bwd+tmp", {Category::kBackward, Category::kTemporaries}},
    {"wksp", {Category::kWorkspace}},
    {"kv", {Category::kKvCache}, true},
    {"ddp", {Category::kDdpBuckets, Category::kZeroBuckets}, false, true},
    {"fsdp", {Category::kFsdpBuffers}, false, true, true},
};

bool shown(const Group& g, const Estimate& e) {
  return (!g.generation_only || e.setup.generate > 0) && (!g.ddp_only || e.setup.dp > 1) &&
         (!g.fsdp_only || e.setup.sharding == Sharding::kFsdp2);
}

uint64_t group_bytes(const LiveBytes& live, const Group& g) {
  uint64_t b = 0;
  for (Category c : g.categories) b += live.by_category[static_cast<size_t>(c)].value;
  return b;
}

uint64_t block_of(const Estimate& e, size_t i) {
  const Event& ev = e.sim->timeline.events[i];
  const auto& a = e.alloc->allocated;
  if (ev.kind == Event::kRecategorize || ev.kind == Event::kEmptyCache || i >= a.size()) return 0;
  const uint64_t before = i == 0 ? 0 : a[i - 1];
  return ev.kind == Event::kAlloc ? a[i] - std::min(a[i], before) : before - std::min(before, a[i]);
}

std::string kind_name(Event::Kind k) {
  switch (k) {
    case Event::kAlloc: return "alloc";
    case Event::kFree: return "free";
    case Event::kRecategorize: return "becomes";
    case Event::kEmptyCache: return "empty_cache";
  }
  return "?";
}

std::string granularity_name(TimelineGranularity g) {
  switch (g) {
    case TimelineGranularity::kEvent: return "event";
    case TimelineGranularity::kLayer: return "layer";
    case TimelineGranularity::kPhase: return "phase";
  }
  return "?";
}

std::string where(const TimelineRow& r, const ModelSpec& m) { return r.layer >= 0 ? layer_name(m, r.layer) : "-"; }

std::string marks(const TimelineRow& r, const Estimate& e) {
  std::vector<std::string> m;
  if (r.oom) m.push_back("OUT OF MEMORY on the " + e.device->gpu);
  if (r.peak_live) m.emplace_back("peak live tensors");
  if (r.peak_allocated) m.emplace_back("peak allocated");
  if (r.peak_reserved) m.emplace_back("peak reserved");
  std::string s;
  for (const auto& x : m) s += (s.empty() ? "<- " : ", ") + x;
  return s;
}

// Display unit for a table: MiB below 10 GiB, GiB above.
struct Unit {
  const char* name;
  uint64_t bytes;
  int decimals;
};
Unit unit_for(uint64_t largest, uint64_t chosen) {
  switch (chosen) {
    case 1: return Unit{"bytes", 1, 0};
    case kKiB: return Unit{"KiB", kKiB, 1};
    case kMiB: return Unit{"MiB", kMiB, 1};
    case kGiB: return Unit{"GiB", kGiB, 2};
    default: break;
  }
  return largest >= 10 * kGiB ? Unit{"GiB", kGiB, 2} : Unit{"MiB", kMiB, 1};
}
std::string in_unit(uint64_t b, const Unit& u) {
  if (u.bytes == 1) return with_commas(b);
  return fmt::format("{:.{}f}", static_cast<double>(b) / static_cast<double>(u.bytes), u.decimals);
}

}  // namespace

std::optional<uint64_t> parse_unit(std::string_view s) {
  if (s == "auto") return 0;
  if (s == "B") return 1;
  if (s == "KiB") return kKiB;
  if (s == "MiB") return kMiB;
  if (s == "GiB") return kGiB;
  return std::nullopt;
}

namespace {
constexpr NameRow<TimelineGranularity> kGranularities[] = {
    {TimelineGranularity::kEvent, "event", "one row per allocation, free and change of category"},
    {TimelineGranularity::kLayer, "layer", "one row per run of events in the same phase and layer"},
    {TimelineGranularity::kPhase, "phase", "one row per run of events in the same phase"},
};
}  // namespace

std::span<const NameRow<TimelineGranularity>> name_table(TimelineGranularity) { return kGranularities; }
std::optional<TimelineGranularity> parse_granularity(std::string_view s) { return parse_name<TimelineGranularity>(s); }

TimelineOptions parse_timeline_options(std::string_view by, std::string_view unit, std::string_view min_bytes,
                                       std::string_view step, uint32_t steps) {
  TimelineOptions o;
  const auto g = parse_granularity(by);
  if (!g) throw FieldError("by", fmt::format("\"{}\": expected {}", by, names_list<TimelineGranularity>()));
  o.granularity = *g;
  const auto u = parse_unit(unit);
  if (!u) throw FieldError("unit", fmt::format("\"{}\": expected auto, B, KiB, MiB or GiB", unit));
  o.unit = *u;
  const auto mb = parse_size(min_bytes);
  if (!mb) {
    throw FieldError("min_bytes", fmt::format("\"{}\": expected a number of bytes (an integer, 0 or more), with an "
                                              "optional unit like 1MiB", min_bytes));
  }
  o.min_bytes = *mb;
  if (!step.empty()) {
    const auto st = parse_size(step);
    bool unit_given = false;
    (void)parse_size(step, &unit_given);
    if (!st || unit_given || *st > steps) {
      throw FieldError("step", fmt::format("\"{}\": expected a simulated step: 0 (setup) to {}", step, steps));
    }
    o.step = static_cast<uint32_t>(*st);
  }
  return o;
}

std::vector<TimelineRow> timeline_rows(const Estimate& e, const TimelineOptions& o) {
  const auto& events = e.sim->timeline.events;
  const AllocatorReplay& alloc = *e.alloc;
  std::vector<TimelineRow> rows;
  LiveBytes live;
  TimelineRow* cur = nullptr;
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& ev = events[i];
    apply(live, ev);
    const uint32_t step = ev.phase == Phase::kSetup ? 0 : ev.step;
    const uint64_t allocated = i < alloc.allocated.size() ? alloc.allocated[i] : 0;
    const uint64_t reserved = i < alloc.reserved.size() ? alloc.reserved[i] : 0;
    const bool is_peak_live = i == e.sim->peak.event;
    const bool is_peak_alloc = i == alloc.peak_allocated_event;
    const bool is_peak_resv = i == alloc.peak_reserved_event;
    const bool is_oom = e.device && e.device->oom && i == e.device->oom->event;
    if (o.step && step != *o.step) continue;
    int32_t layer = o.granularity == TimelineGranularity::kPhase ? -1 : ev.label.layer;
    // Workspaces, op temporaries and parameter gradients named by the parameter stay in the run of the op
    // that made them.
    // A free happens during whatever op is running, so it stays in the current run too.
    if (cur && (ev.kind == Event::kFree ||
                (layer < 0 && (ev.category == Category::kWorkspace || ev.category == Category::kTemporaries ||
                               ev.category == Category::kGradients)))) {
      layer = cur->layer;
    }
    bool start = cur == nullptr;
    if (o.granularity == TimelineGranularity::kEvent) {
      // Small tensors are left out of the listing (their bytes stay in the live totals), peaks never.
      if (ev.bytes.value < o.min_bytes && !is_peak_live && !is_peak_alloc && !is_peak_resv && !is_oom) continue;
      start = true;
    } else if (cur) {
      start = cur->step != step || cur->micro != ev.micro || cur->phase != ev.phase || cur->layer != layer ||
              cur->last_event + 1 != i;
    }
    if (start) {
      rows.emplace_back();
      cur = &rows.back();
      cur->first_event = i;
      cur->step = step;
      cur->micro = ev.micro;
      cur->phase = ev.phase;
      cur->layer = layer;
      if (o.granularity == TimelineGranularity::kEvent) {
        cur->kind = ev.kind;
        cur->category = ev.category;
        cur->from = ev.from;
        cur->tensor = label_name(ev.label, e.model);
        cur->bytes = ev.bytes;
        cur->block = block_of(e, i);
      }
    }
    cur->last_event = i;
    ++cur->events;
    cur->live = live;
    cur->max_live = std::max(cur->max_live, live.total);
    cur->allocated = allocated;
    cur->reserved = reserved;
    cur->max_allocated = std::max(cur->max_allocated, allocated);
    cur->max_reserved = std::max(cur->max_reserved, reserved);
    if (ev.kind == Event::kAlloc && ev.bytes > cur->largest_bytes) {
      cur->largest_bytes = ev.bytes;
      cur->largest = label_name(ev.label, e.model);
    }
    cur->peak_live = cur->peak_live || is_peak_live;
    cur->peak_allocated = cur->peak_allocated || is_peak_alloc;
    cur->peak_reserved = cur->peak_reserved || is_peak_resv;
    cur->oom = cur->oom || is_oom;
  }
  return rows;
}

std::string render_timeline_table(const Estimate& e, const TimelineOptions& o, const std::vector<TimelineRow>& rows) {
  using TT = report::TextTable;
  const Unit u = unit_for(e.memory.peak_reserved.value, o.unit);
  const bool ev = o.granularity == TimelineGranularity::kEvent;
  std::vector<std::pair<std::string, TT::Align>> cols = {{"step", TT::kRight}, {"phase", TT::kLeft}};
  if (ev) {
    cols.insert(cols.begin(), {"#", TT::kRight});
    cols.push_back({"event", TT::kLeft});
    cols.push_back({"tensor", TT::kLeft});
    cols.push_back({"bytes", TT::kRight});
  } else if (o.granularity == TimelineGranularity::kLayer) {
    cols.push_back({"layer", TT::kLeft});
  }
  for (const Group& g : kGroups) {
    if (shown(g, e)) cols.push_back({g.name, TT::kRight});
  }
  cols.push_back({"live", TT::kRight});
  if (!ev) cols.push_back({"max live", TT::kRight});
  cols.push_back({"allocated", TT::kRight});
  if (!ev) cols.push_back({"max alloc", TT::kRight});
  cols.push_back({"reserved", TT::kRight});
  if (!ev) cols.push_back({"largest new tensor", TT::kLeft});
  cols.push_back({"", TT::kLeft});
  TT t(cols);
  const bool micro = e.setup.grad_accum > 1;
  for (const TimelineRow& r : rows) {
    std::vector<std::string> cells;
    if (ev) cells.push_back(std::to_string(r.first_event));
    cells.push_back(micro && r.step > 0 ? fmt::format("{}.{}", r.step, r.micro) : std::to_string(r.step));
    cells.push_back(std::string(phase_name(r.phase)));
    if (ev) {
      cells.push_back(r.kind == Event::kRecategorize
                          ? fmt::format("{} -> {}", category_name(r.from), category_name(r.category))
                          : fmt::format("{} {}", kind_name(r.kind), category_name(r.category)));
      cells.push_back(r.tensor);
      cells.push_back(with_commas(r.bytes.value));
    } else if (o.granularity == TimelineGranularity::kLayer) {
      cells.push_back(where(r, e.model));
    }
    for (const Group& g : kGroups) {
      if (shown(g, e)) cells.push_back(in_unit(group_bytes(r.live, g), u));
    }
    cells.push_back(in_unit(r.live.total.value, u));
    if (!ev) cells.push_back(in_unit(r.max_live.value, u));
    cells.push_back(in_unit(r.allocated, u));
    if (!ev) cells.push_back(in_unit(r.max_allocated, u));
    cells.push_back(in_unit(r.reserved, u));
    if (!ev) cells.push_back(r.largest.empty() ? "" : fmt::format("{} ({})", r.largest, format_bytes(r.largest_bytes)));
    cells.push_back(marks(r, e));
    t.row(std::move(cells));
  }
  const ModelSpec& m = e.model;
  const TrainSetup& s = e.setup;
  std::string head = fmt::format(
      "{}{}: batch {} x seq {}, {}, {}, {}, PyTorch {}\n"
      "{} rows ({} granularity{}); in {}: live tensors by category, live total, allocated and reserved (the "
      "caching allocator) after each row{}\n",
      m.name, m.moe.experts > 0 ? " (" + moe_routing_note(m).substr(2) + ")" : std::string(), s.batch, s.seq, precision_name(s.precision), step_label(s), loop_label(e.setup, e.options.loop),
      torch_version_name(e.options.torch), rows.size(), granularity_name(o.granularity),
      ev && o.min_bytes > 0 ? fmt::format(", tensors of at least {}", format_bytes(Bytes(o.min_bytes))) : "",
      u.name, ev ? "" : ", and the highest live and allocated within it");
  std::string foot = fmt::format(
      "\npeak live tensors {} (in {}); peak allocated {}; peak reserved {}\n",
      format_bytes(e.peak.live_total), moment_name(e.peak.phase, e.peak.step), format_bytes(e.memory.peak_allocated),
      format_bytes(e.memory.peak_reserved));
  if (e.setup.grad_accum > 2) {
    head += fmt::format("micro-batches 1 and 2 of each step's {} are simulated; the others repeat micro-batch 2\n",
                        e.setup.grad_accum);
  }
  if (const auto& f = e.pp) {  // --pp: whose step this is
    head += fmt::format("pipeline rank {} of {} ({}{} over {} micro-batches){}; the worst rank is {}\n", f->shown,
                        f->ranks, name_of(f->schedule),
                        f->virtual_stages > 1 ? fmt::format(", {} stages per rank", f->virtual_stages) : "",
                        f->micro_batches, f->shown == f->worst ? ", the worst" : " (--rank)", f->worst);
  }
  if (e.setup.cp > 1) {  // --cp: whose step this is (every CP rank simulated without --cp-rank: the worst)
    head += fmt::format("CP rank {} of {} (seq {} of {}){}\n", e.setup.cp_rank.value_or(0), e.setup.cp, s.seq,
                        e.setup.cp_seq, e.cp ? fmt::format(", the worst of the {} simulated", e.setup.cp) : " (--cp-rank)");
  }
  if (e.device) {
    foot += '\n';
    foot += render_verdict(*e.device, nullptr);
  }
  return head + "\n" + t.str() + foot;
}

std::string render_timeline_csv(const Estimate& e, const TimelineOptions& o, const std::vector<TimelineRow>& rows) {
  (void)e;
  const bool ev = o.granularity == TimelineGranularity::kEvent;
  std::string out = "first_event,last_event,step,micro_batch,phase,layer,events";
  if (ev) out += ",kind,category,from_category,tensor,bytes,block_bytes";
  for (size_t c = 0; c < kCategoryCount; ++c) {
    std::string n(category_name(static_cast<Category>(c)));
    std::replace(n.begin(), n.end(), ' ', '_');
    out += ",live_" + n + "_bytes";
  }
  out += ",live_bytes,max_live_bytes,allocated_bytes,max_allocated_bytes,reserved_bytes,max_reserved_bytes,peak\n";
  auto quoted = [](const std::string& s) {
    if (s.find_first_of(",\"") == std::string::npos) return s;
    std::string q = "\"";
    for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  };
  for (const TimelineRow& r : rows) {
    out += fmt::format("{},{},{},{},{},{},{}", r.first_event, r.last_event, r.step, r.micro, phase_name(r.phase),
                       r.layer, r.events);
    if (ev) {
      out += fmt::format(",{},{},{},{},{},{}", kind_name(r.kind), category_name(r.category),
                         r.kind == Event::kRecategorize ? category_name(r.from) : "", quoted(r.tensor), r.bytes.value,
                         r.block);
    }
    for (size_t c = 0; c < kCategoryCount; ++c) out += fmt::format(",{}", r.live.by_category[c].value);
    std::string peak;
    if (r.peak_live) peak += "live ";
    if (r.peak_allocated) peak += "allocated ";
    if (r.peak_reserved) peak += "reserved ";
    if (r.oom) peak += "oom ";
    if (!peak.empty()) peak.pop_back();
    out += fmt::format(",{},{},{},{},{},{},{}\n", r.live.total.value, r.max_live.value, r.allocated, r.max_allocated,
                       r.reserved, r.max_reserved, peak);
  }
  return out;
}

std::string render_timeline_json(const Estimate& e, const TimelineOptions& o, const std::vector<TimelineRow>& rows) {
  const bool ev = o.granularity == TimelineGranularity::kEvent;
  nlohmann::json out_rows = nlohmann::json::array();
  for (const TimelineRow& r : rows) {
    nlohmann::json live = nlohmann::json::object();
    for (size_t c = 0; c < kCategoryCount; ++c) {
      live[std::string(category_name(static_cast<Category>(c)))] = r.live.by_category[c].value;
    }
    nlohmann::json j = {{"first_event", r.first_event}, {"last_event", r.last_event}, {"step", r.step},
                        {"micro_batch", r.micro},        {"phase", phase_name(r.phase)}, {"layer", r.layer},
                        {"events", r.events},            {"live_bytes", live},
                        {"live_total_bytes", r.live.total.value}, {"max_live_bytes", r.max_live.value},
                        {"allocated_bytes", r.allocated}, {"max_allocated_bytes", r.max_allocated},
                        {"reserved_bytes", r.reserved},   {"max_reserved_bytes", r.max_reserved},
                        {"peak_live", r.peak_live},       {"peak_allocated", r.peak_allocated},
                        {"peak_reserved", r.peak_reserved},   {"oom", r.oom}};
    if (ev) {
      j["kind"] = kind_name(r.kind);
      j["category"] = category_name(r.category);
      if (r.kind == Event::kRecategorize) j["from_category"] = category_name(r.from);
      j["tensor"] = r.tensor;
      j["bytes"] = r.bytes.value;
      j["block_bytes"] = r.block;
    } else if (!r.largest.empty()) {
      j["largest_tensor"] = r.largest;
      j["largest_tensor_bytes"] = r.largest_bytes.value;
    }
    out_rows.push_back(std::move(j));
  }
  nlohmann::json out = {
      {"model", e.model.name},
      {"granularity", granularity_name(o.granularity)},
      {"min_bytes", o.min_bytes},
      {"step", o.step ? nlohmann::json(*o.step) : nlohmann::json()},
      {"events_total", e.sim->timeline.events.size()},
      {"peak", {{"live_tensor_bytes", e.peak.live_total.value}, {"live_event", e.sim->peak.event},
                {"allocated_bytes", e.memory.peak_allocated.value}, {"allocated_event", e.alloc->peak_allocated_event},
                {"reserved_bytes", e.memory.peak_reserved.value}, {"reserved_event", e.alloc->peak_reserved_event}}},
      {"rows", out_rows},
  };
  if (const auto& f = e.pp) out["pp"] = {{"shown_rank", f->shown}, {"worst_rank", f->worst}, {"ranks", f->ranks}};
  if (e.device) {
    out["device"] = {{"name", e.device->gpu}, {"fits", e.device->fits},
                     {"oom_event", e.device->oom ? nlohmann::json(e.device->oom->event) : nlohmann::json()}};
  }
  return report::json_text(out, 1);
}

}  // namespace trainmem
