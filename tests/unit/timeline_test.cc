// `trainmem timeline`: rows grouped by event, layer and phase, live bytes that add up, peaks marked where the
// simulator and the allocator put them, and the CSV/JSON forms.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/gpu.h"
#include "trainmem/report.h"

namespace trainmem {
namespace {

// Seed 000's model at a small batch: the structure of the step is the same as at B=12, and it runs fast.
const Estimate& gpt2() { return testing::seed000_small(); }

TimelineOptions by(TimelineGranularity g, std::optional<uint32_t> step = std::nullopt, uint64_t min_bytes = 0) {
  TimelineOptions o;
  o.granularity = g;
  o.step = step;
  o.min_bytes = min_bytes;
  return o;
}

TEST(Timeline, LayerRowsFollowTheModelForwardThenBackwardInReverse) {
  const auto rows = timeline_rows(gpt2(), by(TimelineGranularity::kLayer, 2));
  std::vector<int32_t> forward, backward;
  for (const TimelineRow& r : rows) {
    if (r.layer < 0) continue;
    (r.phase == Phase::kForward ? forward : backward).push_back(r.layer);
  }
  std::vector<int32_t> up(12), down(12);
  for (int32_t l = 0; l < 12; ++l) {
    up[l] = l;
    down[l] = 11 - l;
  }
  EXPECT_EQ(forward, up);   // one row per block, in order
  EXPECT_EQ(backward, down);
}

TEST(Timeline, RowsCoverEveryEventOfTheirStepOnce) {
  const Estimate& e = gpt2();
  for (TimelineGranularity g : {TimelineGranularity::kEvent, TimelineGranularity::kLayer, TimelineGranularity::kPhase}) {
    size_t covered = 0, expected = 0;
    for (const Event& ev : e.sim->timeline.events) expected += ev.phase != Phase::kSetup && ev.step == 2;
    const auto rows = timeline_rows(e, by(g, 2));
    for (size_t i = 0; i < rows.size(); ++i) {
      covered += rows[i].events;
      EXPECT_EQ(rows[i].last_event - rows[i].first_event + 1, rows[i].events);
      if (i > 0) EXPECT_GT(rows[i].first_event, rows[i - 1].last_event);
    }
    EXPECT_EQ(covered, expected);
  }
}

TEST(Timeline, LiveBytesAfterEachRowAddUpFromTheEvents) {
  const Estimate& e = gpt2();
  const auto rows = timeline_rows(e, by(TimelineGranularity::kPhase));
  LiveBytes live;
  size_t next = 0;
  for (const TimelineRow& r : rows) {
    for (; next <= r.last_event; ++next) apply(live, e.sim->timeline.events[next]);
    EXPECT_EQ(r.live.total, live.total);
    Bytes sum;
    for (const Bytes& b : r.live.by_category) sum += b;
    EXPECT_EQ(sum, r.live.total);
    EXPECT_EQ(r.allocated, e.alloc->allocated[r.last_event]);
    EXPECT_EQ(r.reserved, e.alloc->reserved[r.last_event]);
  }
  // At the end of the run only the model, its gradients' absence (set_to_none) and optimizer state remain.
  const TimelineRow& last = rows.back();
  EXPECT_EQ(last.phase, Phase::kZeroGrad);
  EXPECT_EQ(last.live.by_category[static_cast<size_t>(Category::kGradients)].value, 0u);
  EXPECT_EQ(last.live.by_category[static_cast<size_t>(Category::kOptimizer)], e.state.optimizer_state);
}

TEST(Timeline, PeaksAreMarkedOnTheRowsThatHoldThem) {
  const Estimate& e = gpt2();
  for (TimelineGranularity g : {TimelineGranularity::kEvent, TimelineGranularity::kLayer, TimelineGranularity::kPhase}) {
    int live = 0, alloc = 0, resv = 0;
    for (const TimelineRow& r : timeline_rows(e, by(g))) {
      if (r.peak_live) {
        ++live;
        EXPECT_EQ(r.max_live, e.peak.live_total);
        EXPECT_EQ(r.phase, e.peak.phase);
      }
      if (r.peak_allocated) {
        ++alloc;
        EXPECT_EQ(r.max_allocated, e.memory.peak_allocated.value);
      }
      if (r.peak_reserved) {
        ++resv;
        EXPECT_EQ(r.max_reserved, e.memory.peak_reserved.value);
      }
      EXPECT_LE(r.max_live, e.peak.live_total);
      EXPECT_LE(r.max_allocated, e.memory.peak_allocated.value);
    }
    EXPECT_EQ(live, 1);
    EXPECT_EQ(alloc, 1);
    EXPECT_EQ(resv, 1);
  }
}

TEST(Timeline, EventRowsBelowMinBytesAreLeftOutButPeaksStay) {
  const Estimate& e = gpt2();
  const uint64_t min = 4 * kMiB;
  const auto rows = timeline_rows(e, by(TimelineGranularity::kEvent, std::nullopt, min));
  bool peak = false;
  for (const TimelineRow& r : rows) {
    EXPECT_EQ(r.events, 1u);
    EXPECT_EQ(r.bytes, e.sim->timeline.events[r.first_event].bytes);
    if (r.peak_live || r.peak_allocated || r.peak_reserved) {
      peak = true;
    } else {
      EXPECT_GE(r.bytes.value, min) << r.tensor;
    }
  }
  EXPECT_TRUE(peak);
  EXPECT_LT(rows.size(), e.sim->timeline.events.size() / 4);
}

TEST(Timeline, EventRowsCarryTheAllocatorBlockOfTheTensor) {
  const Estimate& e = gpt2();
  for (const TimelineRow& r : timeline_rows(e, by(TimelineGranularity::kEvent, 1))) {
    if (r.kind == Event::kRecategorize || r.bytes.value == 0) continue;
    EXPECT_GE(r.block, round_size(r.bytes.value, {}, e.options.torch)) << r.tensor;
    EXPECT_EQ(r.block % kMinBlockSize, 0u) << r.tensor;
  }
}

TEST(Timeline, BackwardAllocationsAreNamedAfterTheForwardOpOfTheirLayer) {
  const Estimate& e = gpt2();
  bool seen = false;
  for (const TimelineRow& r : timeline_rows(e, by(TimelineGranularity::kEvent, 2))) {
    if (r.phase != Phase::kBackward || r.kind != Event::kAlloc || r.category != Category::kBackward) continue;
    if (r.tensor == "grad of the loss") continue;  // torch.autograd.backward's seed, before any node runs
    EXPECT_EQ(r.tensor.rfind("backward of ", 0), 0u) << r.tensor;
    if (r.tensor.rfind("backward of transformer.h.5 ", 0) == 0) {  // the model's own layer name
      seen = true;
      EXPECT_EQ(r.layer, 5);
    }
  }
  EXPECT_TRUE(seen);
}

TEST(Timeline, AutocastWeightCopiesBelongToTheLayerThatUsesThem) {
  const Estimate& e = gpt2();
  for (const TimelineRow& r : timeline_rows(e, by(TimelineGranularity::kEvent, 2))) {
    if (r.kind != Event::kAlloc || r.category != Category::kWeightCopies) continue;
    if (r.tensor.rfind("transformer.h.", 0) != 0) continue;
    const std::string layer = r.tensor.substr(14, r.tensor.find('.', 14) - 14);
    EXPECT_EQ(std::to_string(r.layer), layer) << r.tensor;
  }
}

TEST(Timeline, CsvHasOneHeaderAndEqualColumnCounts) {
  const Estimate& e = gpt2();
  const TimelineOptions o = by(TimelineGranularity::kEvent, 2, kMiB);
  const auto rows = timeline_rows(e, o);
  std::istringstream in(render_timeline_csv(e, o, rows));
  std::string line;
  std::getline(in, line);
  const auto columns = std::count(line.begin(), line.end(), ',');
  size_t n = 0;
  while (std::getline(in, line)) {
    // tensor names have no commas or quotes here, so a plain count is exact
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), columns) << line;
    ++n;
  }
  EXPECT_EQ(n, rows.size());
}

TEST(Timeline, JsonListsRowsAndThePeaks) {
  const Estimate& e = gpt2();
  const TimelineOptions o = by(TimelineGranularity::kLayer);
  const auto rows = timeline_rows(e, o);
  const auto j = nlohmann::json::parse(render_timeline_json(e, o, rows));
  EXPECT_EQ(j["rows"].size(), rows.size());
  EXPECT_EQ(j["peak"]["live_tensor_bytes"].get<uint64_t>(), e.peak.live_total.value);
  EXPECT_EQ(j["peak"]["allocated_bytes"].get<uint64_t>(), e.memory.peak_allocated.value);
  EXPECT_EQ(j["peak"]["reserved_bytes"].get<uint64_t>(), e.memory.peak_reserved.value);
  EXPECT_EQ(j["events_total"].get<size_t>(), e.sim->timeline.events.size());
  for (const auto& r : j["rows"]) {
    uint64_t sum = 0;
    for (const auto& [k, v] : r["live_bytes"].items()) sum += v.get<uint64_t>();
    EXPECT_EQ(sum, r["live_total_bytes"].get<uint64_t>());
  }
}

TEST(Timeline, NamesOutliveTheInventoryTheyCameFrom) {
  Estimate e;
  {
    const ModelSpec m = testing::preset("gpt2");
    const Inventory inv = build_inventory(m);  // gone before the names are read
    e = estimate(m, inv, testing::train_setup(1, 64), SimOptions{});
  }
  const auto rows = timeline_rows(e, by(TimelineGranularity::kEvent, 0));
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.front().tensor, "transformer.wte.weight");
}

TEST(Timeline, TheFailingAllocationIsMarkedWhenAGpuIsGiven) {
  const ModelSpec m = testing::preset("gpt2");
  TrainSetup s;
  s.batch = 16;
  s.seq = 1024;
  s.grad_accum = 3;
  const GpuSpec& t4 = find_gpu("t4");
  SimOptions o;
  o.sm = t4.sm;
  const Estimate e = estimate(m, build_inventory(m), s, o, {}, &t4);
  ASSERT_TRUE(e.device && e.device->oom);
  for (TimelineGranularity g : {TimelineGranularity::kEvent, TimelineGranularity::kPhase}) {
    int marked = 0;
    for (const TimelineRow& r : timeline_rows(e, by(g, std::nullopt, 64 * kMiB))) {
      if (!r.oom) continue;
      ++marked;
      EXPECT_GE(e.device->oom->event, r.first_event);
      EXPECT_LE(e.device->oom->event, r.last_event);
    }
    EXPECT_EQ(marked, 1);
  }
  const TimelineOptions o2 = by(TimelineGranularity::kPhase);
  const std::string table = render_timeline_table(e, o2, timeline_rows(e, o2));
  EXPECT_NE(table.find("OUT OF MEMORY on the t4"), std::string::npos);
  EXPECT_NE(table.find("DOES NOT FIT"), std::string::npos);
  EXPECT_NE(table.find("micro-batches 1 and 2 of each step's 3 are simulated"), std::string::npos);
}

TEST(Timeline, GranularityNamesParse) {
  EXPECT_EQ(parse_granularity("event"), TimelineGranularity::kEvent);
  EXPECT_EQ(parse_granularity("layer"), TimelineGranularity::kLayer);
  EXPECT_EQ(parse_granularity("phase"), TimelineGranularity::kPhase);
  EXPECT_EQ(parse_granularity("op"), std::nullopt);
}

}  // namespace
}  // namespace trainmem
