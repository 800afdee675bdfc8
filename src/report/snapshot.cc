// PyTorch memory snapshots (snapshot.h). The snapshot's layout is torch/csrc/cuda/Module.cpp's
// THCPModule_memorySnapshot (2.x): {"segments": [{"device", "address", "total_size", "allocated_size",
// "active_size", "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable", "frames",
// "blocks": [{"address", "size", "requested_size", "state", "frames"}]}], "device_traces": [[{"action",
// "addr", "size", "stream", "time_us", "frames"}]]}; torch/utils/viz/MemoryViz.js (pytorch.org/memory_viz)
// reads it: segments by "device", alloc / free_requested / free_completed / segment_* entries by "addr",
// an entry's optional "category" colours the Active Memory Timeline.
#include "trainmem/snapshot.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "json_text.h"
#include "text_table.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

std::string_view action_name(AllocatorTraceEntry::Action a) {
  switch (a) {
    case AllocatorTraceEntry::kAlloc: return "alloc";
    case AllocatorTraceEntry::kFreeRequested: return "free_requested";
    case AllocatorTraceEntry::kFreeCompleted: return "free_completed";
    case AllocatorTraceEntry::kSegmentAlloc: return "segment_alloc";
    case AllocatorTraceEntry::kSegmentFree: return "segment_free";
    case AllocatorTraceEntry::kSegmentMap: return "segment_map";
    case AllocatorTraceEntry::kSegmentUnmap: return "segment_unmap";
  }
  return "?";
}

// memory_viz shows an entry's frames innermost first, each as "filename:line:name".
PyValue frames_of(const Estimate& e, const Event& ev, size_t event) {
  const uint32_t step = ev.phase == Phase::kSetup ? 0 : ev.step;
  return PyList{
      PyDict{{"name", label_name(ev.label, e.model)}, {"filename", std::string(category_name(ev.category))},
             {"line", 0}},
      PyDict{{"name", moment_name(ev.phase, step, e.setup.grad_accum > 1 ? ev.micro : 0)},
             {"filename", "trainmem"}, {"line", static_cast<uint64_t>(event)}},
  };
}

}  // namespace

PyValue snapshot_of(const Estimate& e, const AllocatorConfig& ac) {
  const Timeline& tl = e.sim->timeline;
  const AllocatorTrace t = trace_allocator(tl, ac, e.options.torch);
  // Addresses: moved so that the lowest segment starts at kSnapshotBaseAddress.
  uint64_t lowest = std::numeric_limits<uint64_t>::max(), highest = 0;
  for (const AllocatorTraceEntry& x : t.entries) {
    if (x.action == AllocatorTraceEntry::kSegmentAlloc || x.action == AllocatorTraceEntry::kSegmentMap) {
      lowest = std::min(lowest, x.addr);
      highest = std::max(highest, x.addr + x.size);
    }
  }
  if (lowest == std::numeric_limits<uint64_t>::max()) lowest = highest = 0;
  constexpr uint64_t kJsExact = uint64_t{1} << 53;
  if (highest - lowest >= kJsExact - kSnapshotBaseAddress) {
    throw Error(fmt::format("the replayed step spans {} B of addresses: beyond the 2^53 that memory_viz reads "
                            "exactly", highest - lowest));
  }
  auto addr = [&](uint64_t a) { return kSnapshotBaseAddress + (a - lowest); };

  // The live storages' categories as the run goes (a tensor may change category: a gradient becomes .grad).
  std::unordered_map<uint64_t, std::pair<Category, size_t>> storage;  // id -> category, allocating event
  std::unordered_map<uint64_t, uint64_t> block_storage;               // replay address of a live block -> id
  PyList trace;
  trace.reserve(t.entries.size());
  size_t next = 0;  // timeline events applied so far
  auto apply_until = [&](size_t event) {
    for (; next <= event && next < tl.events.size(); ++next) {
      const Event& ev = tl.events[next];
      if (ev.kind == Event::kAlloc) storage[ev.storage] = {ev.category, next};
      if (ev.kind == Event::kRecategorize) {
        if (auto it = storage.find(ev.storage); it != storage.end()) it->second.first = ev.category;
      }
    }
  };
  for (const AllocatorTraceEntry& x : t.entries) {
    apply_until(x.event);
    const Event& ev = tl.events[x.event];
    PyDict d{{"action", std::string(action_name(x.action))},
             {"addr", addr(x.addr)},
             {"size", x.size},
             {"stream", static_cast<int64_t>(x.stream)},
             {"time_us", static_cast<uint64_t>(x.event)}};
    const bool tensor = x.action == AllocatorTraceEntry::kAlloc || x.action == AllocatorTraceEntry::kFreeRequested ||
                        x.action == AllocatorTraceEntry::kFreeCompleted;
    if (tensor) {
      // A free's frames and category are the tensor's (memory_viz shows the free with them).
      size_t at = x.event;
      Category cat = ev.category;
      if (x.action == AllocatorTraceEntry::kAlloc) {
        block_storage[x.addr] = ev.storage;
      } else if (auto b = block_storage.find(x.addr); b != block_storage.end()) {
        if (auto s = storage.find(b->second); s != storage.end()) std::tie(cat, at) = s->second;
        if (x.action == AllocatorTraceEntry::kFreeCompleted) block_storage.erase(b);
      }
      Event shown = tl.events[at];
      shown.category = cat;
      d.emplace_back("frames", frames_of(e, shown, at));
      d.emplace_back("category", std::string(category_name(cat)));
    } else {
      d.emplace_back("frames", PyList{});
      // memory_viz: once any entry has a category, "unknown" must be one of them (annotate_snapshot)
      d.emplace_back("category", "unknown");
    }
    trace.emplace_back(std::move(d));
  }
  apply_until(tl.events.size());

  PyList segments;
  for (const AllocatorSegmentState& s : t.segments) {
    uint64_t allocated = 0, requested = 0;
    PyList blocks;
    for (const AllocatorBlockState& b : s.blocks) {
      PyDict bd{{"address", addr(b.addr)},
                {"size", b.size},
                {"requested_size", b.allocated ? b.requested : 0},
                {"state", b.allocated ? "active_allocated" : "inactive"}};
      if (b.allocated) {
        allocated += b.size;
        requested += b.requested;
        const Event& ev = tl.events[b.alloc_event];
        Event shown = ev;
        if (auto it = storage.find(ev.storage); it != storage.end()) shown.category = it->second.first;
        bd.emplace_back("frames", frames_of(e, shown, b.alloc_event));
      } else {
        bd.emplace_back("frames", PyList{});
      }
      blocks.emplace_back(std::move(bd));
    }
    segments.emplace_back(PyDict{{"device", 0},
                                 {"address", addr(s.addr)},
                                 {"total_size", s.size},
                                 {"allocated_size", allocated},
                                 {"active_size", allocated},
                                 {"requested_size", requested},
                                 {"stream", static_cast<int64_t>(s.stream)},
                                 {"segment_type", s.small ? "small" : "large"},
                                 {"segment_pool_id", PyTuple{{0, 0}}},
                                 {"is_expandable", s.expandable},
                                 {"frames", PyList{}},
                                 {"blocks", std::move(blocks)}});
  }
  return PyDict{{"segments", std::move(segments)}, {"device_traces", PyList{PyValue(std::move(trace))}}};
}

std::string render_snapshot_pickle(const Estimate& e, const AllocatorConfig& ac) {
  return pickle_dumps(snapshot_of(e, ac));
}

// ---- import ----

namespace {

constexpr std::string_view kMeasurementFormat = "trainmem-measurement-v1";

uint64_t non_negative(const PyValue& v, std::string_view what, std::string_view key, size_t i) {
  const int64_t* x = v.integer();
  if (!x || *x < 0) {
    throw Error(fmt::format("{}: device trace entry {}: \"{}\" is not a non-negative integer", what, i, key));
  }
  return static_cast<uint64_t>(*x);
}

MeasuredTrace from_pickle(std::string_view bytes, std::string_view what) {
  const PyValue root = pickle_loads(bytes, what);
  if (!root.dict()) {
    throw Error(fmt::format("{}: the pickle holds a {} where torch.cuda.memory._snapshot() returns a dict with "
                            "\"segments\" and \"device_traces\"", what, root.list() ? "list (a snapshot of "
                            "segments only, without a trace)" : "value"));
  }
  const PyValue* traces = root.get("device_traces");
  if (!traces || !traces->list()) {
    throw Error(fmt::format("{}: no \"device_traces\" list: record the trace with "
                            "torch.cuda.memory._record_memory_history() before taking the snapshot", what));
  }
  const PyList* trace = nullptr;
  size_t devices = 0;
  for (const PyValue& t : *traces->list()) {
    const PyList* l = t.list();
    if (!l) throw Error(fmt::format("{}: \"device_traces\" holds something that is not a list", what));
    if (!l->empty()) {
      ++devices;
      trace = l;
    }
  }
  if (devices == 0) throw Error(fmt::format("{}: every device trace is empty (was the history recorded?)", what));
  if (devices > 1) {
    throw Error(fmt::format("{}: {} devices have a trace; trainmem compares one device's (take the snapshot "
                            "of a single-device run)", what, devices));
  }
  MeasuredTrace m;
  m.format = "snapshot pickle";  // shown as "measured from the snapshot pickle"
  for (size_t i = 0; i < trace->size(); ++i) {
    const PyValue& e = (*trace)[i];
    const PyValue* action = e.get("action");
    if (!action || !action->str()) throw Error(fmt::format("{}: device trace entry {} has no \"action\"", what, i));
    const std::string& a = *action->str();
    if (a != "alloc" && a != "free_completed") continue;
    const PyValue* ad = e.get("addr");
    const PyValue* sz = e.get("size");
    if (!ad || !sz) throw Error(fmt::format("{}: device trace entry {} ({}) lacks \"addr\" or \"size\"", what, i, a));
    m.actions.push_back({a == "alloc", non_negative(*ad, what, "addr", i), non_negative(*sz, what, "size", i)});
  }
  return m;
}

MeasuredTrace from_json(std::string_view bytes, std::string_view what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes);
  } catch (const nlohmann::json::exception& ex) {
    throw Error(fmt::format("{}: neither a snapshot pickle nor valid JSON ({})", what, ex.what()));
  }
  if (!j.is_object() || !j.contains("format") || j["format"] != kMeasurementFormat) {
    throw Error(fmt::format("{}: JSON without \"format\": \"{}\" (expected a torch.cuda.memory._snapshot() "
                            "pickle or a file of validate/cuda/measure.py)", what, kMeasurementFormat));
  }
  MeasuredTrace m;
  m.format = fmt::format("{} file", kMeasurementFormat);
  const auto trace = j.find("trace");
  if (trace == j.end() || !trace->is_object() || !trace->contains("events") || !(*trace)["events"].is_array()) {
    throw Error(fmt::format("{}: no \"trace\" with \"events\" (the run's allocator trace was not recorded)", what));
  }
  int alloc_code = -1, free_code = -1;
  if (auto acts = trace->find("actions"); acts != trace->end() && acts->is_object()) {
    for (const auto& [code, name] : acts->items()) {
      if (!name.is_string()) continue;
      int c = -1;
      try {
        c = std::stoi(code);
      } catch (const std::exception&) {
        throw Error(fmt::format("{}: trace.actions key \"{}\" is not an integer", what, code));
      }
      if (name == "alloc") alloc_code = c;
      if (name == "free_completed") free_code = c;
    }
  }
  if (alloc_code < 0 || free_code < 0) {
    throw Error(fmt::format("{}: trace.actions does not name \"alloc\" and \"free_completed\"", what));
  }
  size_t i = 0;
  for (const auto& ev : (*trace)["events"]) {
    if (!ev.is_array() || ev.size() < 3 || !ev[0].is_number_integer() || !ev[1].is_number_unsigned() ||
        !ev[2].is_number_unsigned()) {
      throw Error(fmt::format("{}: trace event {} is not [action, size, address, ...] with non-negative "
                              "integers", what, i));
    }
    const int code = ev[0].get<int>();
    if (code == alloc_code || code == free_code) {
      m.actions.push_back({code == alloc_code, ev[2].get<uint64_t>(), ev[1].get<uint64_t>()});
    }
    ++i;
  }
  m.truncated = trace->value("truncated", false);
  if (auto args = j.find("trainmem_args"); args != j.end() && args->is_array()) {
    for (const auto& a : *args) {
      if (a.is_string()) m.trainmem_args.push_back(a.get<std::string>());
    }
  }
  if (auto figs = j.find("figures"); figs != j.end() && figs->is_object()) {
    for (const auto& [name, f] : figs->items()) {
      if (f.is_object() && f.contains("bytes") && f["bytes"].is_number_unsigned()) {
        m.figures.emplace_back(name, f["bytes"].get<uint64_t>());
      }
    }
  }
  return m;
}

}  // namespace

MeasuredTrace read_measured_trace(std::string_view bytes, std::string_view what) {
  if (bytes.empty()) throw Error(fmt::format("{}: the file is empty (expected a snapshot pickle)", what));
  if (static_cast<uint8_t>(bytes[0]) == 0x80) return from_pickle(bytes, what);
  const size_t first = bytes.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && bytes[first] == '{') return from_json(bytes, what);
  throw Error(fmt::format("{}: neither a snapshot pickle (protocol 2 or later: the first byte 0x80) nor a "
                          "{} JSON", what, kMeasurementFormat));
}

// ---- alignment ----

namespace {

// Past the edit budget: match equal sizes greedily, looking ahead a few allocations on either side.
void greedy(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b, size_t i, size_t n, size_t j, size_t m,
            std::vector<std::pair<size_t, size_t>>& out) {
  constexpr size_t kWindow = 64;
  while (i < n && j < m) {
    if (a[i] == b[j]) {
      out.emplace_back(i++, j++);
      continue;
    }
    size_t da = kWindow + 1, db = kWindow + 1;
    for (size_t k = 1; k <= kWindow && i + k < n; ++k) {
      if (a[i + k] == b[j]) {
        da = k;
        break;
      }
    }
    for (size_t k = 1; k <= kWindow && j + k < m; ++k) {
      if (b[j + k] == a[i]) {
        db = k;
        break;
      }
    }
    if (da <= kWindow && da <= db) {
      i += da;
    } else if (db <= kWindow) {
      j += db;
    } else {
      ++i;
      ++j;
    }
  }
}

}  // namespace

std::vector<std::pair<size_t, size_t>> align_sizes(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t lo = 0;
  while (lo < a.size() && lo < b.size() && a[lo] == b[lo]) {
    out.emplace_back(lo, lo);
    ++lo;
  }
  size_t n = a.size(), m = b.size();
  std::vector<std::pair<size_t, size_t>> tail;
  while (n > lo && m > lo && a[n - 1] == b[m - 1]) tail.emplace_back(--n, --m);
  // Myers (1986), "An O(ND) difference algorithm": the furthest-reaching D-paths, kept per D for the walk back.
  const auto N = static_cast<int64_t>(n - lo), M = static_cast<int64_t>(m - lo);
  auto eq = [&](int64_t x, int64_t y) { return a[lo + static_cast<size_t>(x)] == b[lo + static_cast<size_t>(y)]; };
  std::vector<std::vector<int64_t>> V;  // V[d][k + d]: furthest x on diagonal k with d edits
  bool found = false;
  int64_t D = 0;
  if (N > 0 && M > 0) {
    const auto max_d = static_cast<int64_t>(std::min<uint64_t>(kMaxAlignEdits, static_cast<uint64_t>(N + M)));
    for (int64_t d = 0; d <= max_d && !found; ++d) {
      std::vector<int64_t> v(static_cast<size_t>(2 * d + 1));
      for (int64_t k = -d; k <= d; k += 2) {
        int64_t x;
        if (d == 0) {
          x = 0;
        } else {
          const auto& p = V.back();  // V[d-1], k in [-(d-1), d-1]
          auto pv = [&](int64_t kk) { return p[static_cast<size_t>(kk + d - 1)]; };
          x = (k == -d || (k != d && pv(k - 1) < pv(k + 1))) ? pv(k + 1) : pv(k - 1) + 1;
        }
        int64_t y = x - k;
        while (x < N && y < M && x >= 0 && y >= 0 && eq(x, y)) ++x, ++y;
        v[static_cast<size_t>(k + d)] = x;
        if (x >= N && y >= M) found = true;
      }
      V.push_back(std::move(v));
      D = d;
    }
  } else {
    found = true;
  }
  if (found && N > 0 && M > 0) {
    std::vector<std::pair<size_t, size_t>> mid;
    int64_t x = N, y = M;
    for (int64_t d = D; d > 0; --d) {
      const auto& p = V[static_cast<size_t>(d - 1)];
      auto pv = [&](int64_t kk) { return p[static_cast<size_t>(kk + d - 1)]; };
      const int64_t k = x - y;
      const bool down = k == -d || (k != d && pv(k - 1) < pv(k + 1));
      const int64_t pk = down ? k + 1 : k - 1;
      const int64_t px = pv(pk), py = px - pk;
      const int64_t sx = down ? px : px + 1;  // after the edit, where the snake starts
      for (int64_t t = x - sx - 1; t >= 0; --t) {
        mid.emplace_back(lo + static_cast<size_t>(sx + t), lo + static_cast<size_t>(sx + t - k));
      }
      x = px;
      y = py;
    }
    for (int64_t t = x - 1; t >= 0; --t) mid.emplace_back(lo + static_cast<size_t>(t), lo + static_cast<size_t>(t));
    std::reverse(mid.begin(), mid.end());
    out.insert(out.end(), mid.begin(), mid.end());
  } else if (!found) {
    greedy(a, b, lo, n, lo, m, out);
  }
  std::reverse(tail.begin(), tail.end());
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

// ---- diff ----

SnapshotDiff diff_snapshot(const Estimate& e, const MeasuredTrace& m) {
  const Timeline& tl = e.sim->timeline;
  SnapshotDiff d;
  d.format = m.format;
  d.truncated = m.truncated;

  // Measured: live requested bytes after each action; each alloc's ordinal; the blocks live at the peak.
  std::vector<uint64_t> msizes;
  std::vector<size_t> alloc_action;  // alloc ordinal -> action index
  std::unordered_map<uint64_t, size_t> live_by_addr;  // address -> alloc ordinal
  std::vector<uint64_t> mlive(m.actions.size());
  uint64_t live = 0, peak = 0;
  size_t peak_action = 0;
  bool any = false;
  for (size_t i = 0; i < m.actions.size(); ++i) {
    const MeasuredTrace::Action& a = m.actions[i];
    if (a.alloc) {
      live_by_addr[a.addr] = msizes.size();
      alloc_action.push_back(i);
      msizes.push_back(a.size);
      live = checked_add(live, a.size, "the measured live bytes");
    } else if (auto it = live_by_addr.find(a.addr); it != live_by_addr.end()) {
      live -= std::min(live, msizes[it->second]);
      live_by_addr.erase(it);
    } else {
      ++d.frees_before_trace;
    }
    mlive[i] = live;
    if (!any || live > peak) {
      peak = live;
      peak_action = i;
      any = true;
    }
  }
  if (msizes.empty()) throw Error("the measured trace holds no allocation");

  // Predicted: the simulated allocations (the allocator sees only those of at least one byte).
  std::vector<uint64_t> psizes;
  std::vector<size_t> palloc_event;
  for (size_t i = 0; i < tl.events.size(); ++i) {
    const Event& ev = tl.events[i];
    if (ev.kind == Event::kAlloc && ev.bytes.value > 0) {
      psizes.push_back(ev.bytes.value);
      palloc_event.push_back(i);
    }
  }
  d.measured_allocs = msizes.size();
  d.predicted_allocs = psizes.size();
  const auto pairs = align_sizes(msizes, psizes);
  d.aligned = pairs.size();
  std::vector<std::optional<size_t>> m2p(msizes.size());
  std::vector<std::optional<size_t>> p2m(psizes.size());
  for (const auto& [i, j] : pairs) {
    m2p[i] = j;
    p2m[j] = i;
  }
  while (d.same_prefix < msizes.size() && d.same_prefix < psizes.size() &&
         msizes[d.same_prefix] == psizes[d.same_prefix]) {
    ++d.same_prefix;
  }
  if (d.same_prefix < msizes.size() && d.same_prefix < psizes.size()) {
    d.diverge_measured = d.same_prefix;
    d.diverge_measured_size = msizes[d.same_prefix];
    const Event& ev = tl.events[palloc_event[d.same_prefix]];
    d.diverge_predicted = fmt::format("{} ({} B, {} in {})", label_name(ev.label, e.model), with_commas(ev.bytes.value),
                                      category_name(ev.category), moment_name(ev.phase, ev.phase == Phase::kSetup ? 0 : ev.step));
  }

  // Both sides just before the first simulated allocation after `event` that lines up with a measured one: the
  // same moment of the run on both (a free between `event` and that allocation counts on both sides).
  std::vector<uint64_t> plive(tl.events.size());
  {
    LiveBytes l;
    for (size_t i = 0; i < tl.events.size(); ++i) {
      apply(l, tl.events[i]);
      plive[i] = l.total.value;
    }
  }
  auto before = [&](size_t event) -> SnapshotDiffRow {
    const auto it = std::upper_bound(palloc_event.begin(), palloc_event.end(), event);
    for (auto j = static_cast<size_t>(it - palloc_event.begin()); j < psizes.size(); ++j) {
      if (p2m[j]) {
        const size_t act = alloc_action[*p2m[j]], ev = palloc_event[j];
        return {"", ev == 0 ? 0 : plive[ev - 1], act == 0 ? 0 : mlive[act - 1]};
      }
    }
    return {"", event < plive.size() ? plive[event] : 0, std::nullopt};
  };
  const uint64_t end = plive.empty() ? 0 : plive.back();
  SnapshotDiffRow steady = before(e.sim->steady.event);
  steady.name = "steady state (a step's start)";
  d.moments.push_back({"peak live tensors", e.sim->peak.live.total.value, peak});
  d.moments.push_back(steady);
  d.moments.push_back({"end of the run", end, mlive.empty() ? 0 : mlive.back()});

  // Categories at the measured peak: each live block takes the category its aligned simulated tensor has at the
  // simulated moment aligned with the peak (the last aligned allocation at or before it).
  size_t moment = 0;
  bool have_moment = false;
  for (size_t k = 0; k < alloc_action.size() && alloc_action[k] <= peak_action; ++k) {
    if (m2p[k]) {
      moment = palloc_event[*m2p[k]];
      have_moment = true;
    }
  }
  auto moment_of = [&](size_t event) {
    const Event& ev = tl.events[event];
    return moment_name(ev.phase, ev.phase == Phase::kSetup ? 0 : ev.step, e.setup.grad_accum > 1 ? ev.micro : 0);
  };
  d.predicted_peak_moment = moment_of(e.sim->peak.event);
  d.measured_peak_moment = have_moment ? moment_of(moment) : "before any allocation lines up";
  // The simulated storages live at `moment`, with their category then and their bytes.
  struct SimLive {
    Category category;
    uint64_t bytes;
    bool taken = false;
  };
  std::unordered_map<uint64_t, SimLive> sim_live;  // storage -> ...
  for (size_t i = 0; have_moment && i <= moment; ++i) {
    const Event& ev = tl.events[i];
    if (ev.kind == Event::kAlloc && ev.bytes.value > 0) sim_live[ev.storage] = {ev.category, ev.bytes.value};
    if (ev.kind == Event::kRecategorize) {
      if (auto it = sim_live.find(ev.storage); it != sim_live.end()) it->second.category = ev.category;
    }
    if (ev.kind == Event::kFree) sim_live.erase(ev.storage);
  }
  std::array<uint64_t, kCategoryCount> measured_cat{};
  uint64_t unmatched = 0;
  {
    std::unordered_map<uint64_t, size_t> at_peak;  // address -> alloc ordinal
    size_t ordinal = 0;
    for (size_t i = 0; i <= peak_action && i < m.actions.size(); ++i) {
      const MeasuredTrace::Action& a = m.actions[i];
      if (a.alloc) {
        at_peak[a.addr] = ordinal++;
      } else {
        at_peak.erase(a.addr);
      }
    }
    std::vector<size_t> live_blocks;
    for (const auto& [addr, k] : at_peak) live_blocks.push_back(k);
    std::sort(live_blocks.begin(), live_blocks.end());
    // First each block lined up with a simulated tensor that is live then; then, among equal sizes, the
    // blocks left and the simulated tensors left in allocation order (a run of equal sizes, 4-byte scalars
    // say, lines up ambiguously: the sequences alone cannot tell which of them lives on).
    std::vector<size_t> left;
    for (size_t k : live_blocks) {
      if (m2p[k]) {
        if (auto it = sim_live.find(tl.events[palloc_event[*m2p[k]]].storage);
            it != sim_live.end() && !it->second.taken && it->second.bytes == msizes[k]) {
          it->second.taken = true;
          measured_cat[static_cast<size_t>(it->second.category)] += msizes[k];
          continue;
        }
      }
      left.push_back(k);
    }
    std::unordered_map<uint64_t, std::vector<uint64_t>> free_by_size;  // bytes -> storages, by allocation
    std::vector<std::pair<uint64_t, uint64_t>> order;                  // (storage, bytes)
    for (const auto& [id, sl] : sim_live) {
      if (!sl.taken) order.emplace_back(id, sl.bytes);
    }
    std::sort(order.begin(), order.end());
    for (auto it = order.rbegin(); it != order.rend(); ++it) free_by_size[it->second].push_back(it->first);
    for (size_t k : left) {
      auto& ids = free_by_size[msizes[k]];
      if (ids.empty()) {
        unmatched += msizes[k];
        continue;
      }
      measured_cat[static_cast<size_t>(sim_live.at(ids.back()).category)] += msizes[k];
      ids.pop_back();
    }
  }
  const LiveBytes& pl = e.sim->peak.live;
  for (size_t c = 0; c < kCategoryCount; ++c) {
    if (pl.by_category[c].value == 0 && measured_cat[c] == 0) continue;
    d.categories.push_back({std::string(category_name(static_cast<Category>(c))), pl.by_category[c].value, measured_cat[c]});
  }
  d.categories.push_back({"unmatched", 0, unmatched});
  d.categories.push_back({"total", pl.total.value, peak});

  // torch.cuda's figures of a measurement file, against the estimate's
  const std::pair<std::string_view, uint64_t> ours[] = {
      {"steady_state_allocated_bytes", e.memory.steady_state.value},
      {"after_forward_allocated_bytes", e.memory.after_forward.value},
      {"peak_allocated_bytes", e.memory.peak_allocated.value},
      {"steady_state_reserved_bytes", e.memory.steady_state_reserved.value},
      {"after_forward_reserved_bytes", e.memory.after_forward_reserved.value},
      {"peak_reserved_bytes", e.memory.peak_reserved.value},
  };
  for (const auto& [name, measured] : m.figures) {
    for (const auto& [n, predicted] : ours) {
      if (n == name) d.figures.push_back({name, predicted, measured});
    }
  }
  return d;
}

namespace {

std::string cell(const std::optional<uint64_t>& v) { return v ? with_commas(*v) : "-"; }
std::string diff_cell(const SnapshotDiffRow& r) {
  if (!r.predicted || !r.measured) return "-";
  const auto p = static_cast<double>(*r.predicted), m = static_cast<double>(*r.measured);
  const bool neg = *r.predicted < *r.measured;
  const uint64_t mag = neg ? *r.measured - *r.predicted : *r.predicted - *r.measured;
  if (mag == 0) return "0";
  return fmt::format("{}{}{}", neg ? "-" : "+", with_commas(mag),
                     *r.measured > 0 ? fmt::format(" ({:+.3f}%)", 100.0 * (p - m) / m) : std::string());
}

void table(std::string& out, const char* first, const std::vector<SnapshotDiffRow>& rows) {
  using TT = report::TextTable;
  TT t({{first, TT::kLeft}, {"predicted", TT::kRight}, {"measured", TT::kRight}, {"predicted - measured", TT::kRight}});
  for (const SnapshotDiffRow& r : rows) t.row({r.name, cell(r.predicted), cell(r.measured), diff_cell(r)});
  out += t.str();
}

nlohmann::json rows_json(const std::vector<SnapshotDiffRow>& rows) {
  nlohmann::json a = nlohmann::json::array();
  for (const SnapshotDiffRow& r : rows) {
    nlohmann::json j = {{"name", r.name},
                        {"predicted_bytes", r.predicted ? nlohmann::json(*r.predicted) : nlohmann::json()},
                        {"measured_bytes", r.measured ? nlohmann::json(*r.measured) : nlohmann::json()}};
    if (r.predicted && r.measured) {
      j["diff_bytes"] = static_cast<int64_t>(*r.predicted) - static_cast<int64_t>(*r.measured);
    }
    a.push_back(std::move(j));
  }
  return a;
}

}  // namespace

std::string render_snapshot_diff_table(const Estimate& e, const SnapshotDiff& d) {
  std::string out = fmt::format(
      "{}: batch {} x seq {}, {}, {}; predicted by trainmem, measured from the {}\n"
      "allocations: {} measured, {} predicted, {} lined up by size (longest common subsequence); the first {} "
      "are the same\n",
      e.model.name, e.setup.batch, e.setup.seq, precision_name(e.setup.precision), step_label(e.setup), d.format,
      with_commas(d.measured_allocs), with_commas(d.predicted_allocs), with_commas(d.aligned),
      with_commas(d.same_prefix));
  if (d.diverge_measured) {
    out += fmt::format("they part at allocation {}: measured {} B, predicted {}\n", with_commas(*d.diverge_measured + 1),
                       with_commas(d.diverge_measured_size), d.diverge_predicted);
  }
  if (d.frees_before_trace > 0 || d.truncated) {
    out += fmt::format("the trace began after {} blocks were allocated{}: measured live bytes leave them out\n",
                       with_commas(d.frees_before_trace), d.truncated ? " (the recorder's buffer was full)" : "");
  }
  out += "\nlive tensor bytes (requested sizes, as the trace records them)\n";
  table(out, "moment", d.moments);
  out += fmt::format("\nat the peak: predicted at trainmem's ({}), measured at the trace's (lined up with {}); each "
                     "measured block takes the category of the simulated tensor it lines up with\n",
                     d.predicted_peak_moment, d.measured_peak_moment);
  table(out, "category", d.categories);
  if (!d.figures.empty()) {
    out += "\ntorch.cuda's figures of the measurement (block sizes, with the allocator's rounding)\n";
    table(out, "figure", d.figures);
  }
  return out;
}

std::string render_snapshot_diff_json(const Estimate& e, const SnapshotDiff& d) {
  nlohmann::json out = {
      {"model", e.model.name},
      {"format", d.format},
      {"measured_allocations", d.measured_allocs},
      {"predicted_allocations", d.predicted_allocs},
      {"aligned_allocations", d.aligned},
      {"same_prefix", d.same_prefix},
      {"frees_before_trace", d.frees_before_trace},
      {"truncated", d.truncated},
      {"moments", rows_json(d.moments)},
      {"categories_at_peak", rows_json(d.categories)},
      {"predicted_peak_moment", d.predicted_peak_moment},
      {"measured_peak_moment", d.measured_peak_moment},
      {"figures", rows_json(d.figures)},
  };
  if (d.diverge_measured) {
    out["diverge"] = {{"allocation_index", *d.diverge_measured}, {"measured_bytes", d.diverge_measured_size},
                      {"predicted", d.diverge_predicted}};
  }
  return report::json_text(out, 1);
}

}  // namespace trainmem
