// The pictures' data and text (plot.h): columns that keep every column's fullest moment and so the peak, the
// tensors live at the peak adding up to the live total, one step's range, and SVG text that escapes, repeats
// byte for byte, and states the figures. tests/svg/check_svg.py reads the drawn SVG back through its axes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/gpu.h"
#include "trainmem/plot.h"

namespace trainmem {
namespace {

// Seed 000's model at a small batch: thousands of events, several per column.
const Estimate& gpt2() { return testing::seed000_small(); }

// The same step on a T4, with a batch that does not fit there.
const Estimate& gpt2_on_t4_oom() {
  static const Estimate e = [] {
    const ModelSpec m = testing::preset("gpt2");
    const GpuSpec& t4 = find_gpu("t4");
    SimOptions o;
    o.sm = t4.sm;
    return estimate(m, build_inventory(m), testing::train_setup(16, 1024), o, {}, &t4);
  }();
  return e;
}

TEST(Plot, ColumnsCoverEveryEventOnceInOrder) {
  const Estimate& e = gpt2();
  const TimelinePlot p = timeline_plot(e);
  const size_t n = e.sim->timeline.events.size();
  ASSERT_GT(n, kPlotColumns);  // several events per column
  ASSERT_EQ(p.columns.size(), kPlotColumns);
  EXPECT_EQ(p.first_event, 0u);
  EXPECT_EQ(p.last_event, n - 1);
  size_t next = 0;
  for (const PlotColumn& c : p.columns) {
    EXPECT_EQ(c.first_event, next);
    EXPECT_GE(c.last_event, c.first_event);
    EXPECT_LE(c.last_event - c.first_event + 1, n / kPlotColumns + 1);  // the same number, give or take one
    next = c.last_event + 1;
  }
  EXPECT_EQ(next, n);
}

TEST(Plot, EachColumnShowsItsFullestMomentAndItsHighestAllocatorFigures) {
  const Estimate& e = gpt2();
  const TimelinePlot p = timeline_plot(e);
  const auto& events = e.sim->timeline.events;
  LiveBytes live;
  size_t i = 0;
  for (const PlotColumn& c : p.columns) {
    Bytes most;
    uint64_t allocated = 0, reserved = 0;
    for (; i <= c.last_event; ++i) {
      apply(live, events[i]);
      most = std::max(most, live.total);
      allocated = std::max(allocated, e.alloc->allocated[i]);
      reserved = std::max(reserved, e.alloc->reserved[i]);
    }
    EXPECT_EQ(c.live.total, most);
    Bytes sum;
    for (const Bytes& b : c.live.by_category) sum += b;
    EXPECT_EQ(sum, c.live.total);  // the stack's top is the column's live total
    EXPECT_EQ(c.allocated, allocated);
    EXPECT_EQ(c.reserved, reserved);
  }
}

TEST(Plot, ThePeakIsNeverLostByTheDownSampling) {
  const Estimate& e = gpt2();
  const TimelinePlot p = timeline_plot(e);
  EXPECT_EQ(p.peak.event, e.sim->peak.event);
  EXPECT_EQ(p.peak.live.total, e.peak.live_total);
  const PlotColumn& c = p.columns[p.peak_column];
  EXPECT_GE(p.peak.event, c.first_event);
  EXPECT_LE(p.peak.event, c.last_event);
  EXPECT_EQ(c.live.total, e.peak.live_total);
  EXPECT_EQ(c.live.by_category, e.sim->peak.live.by_category);
  EXPECT_EQ(p.max_allocated, e.memory.peak_allocated.value);
  EXPECT_EQ(p.max_reserved, e.memory.peak_reserved.value);
  // coarser still: two columns
  const TimelinePlot two = timeline_plot(e, std::nullopt, 2);
  ASSERT_EQ(two.columns.size(), 2u);
  EXPECT_EQ(std::max(two.columns[0].live.total, two.columns[1].live.total), e.peak.live_total);
}

TEST(Plot, TheTensorsLiveAtThePeakAddUpToItsLiveBytes) {
  const Estimate& e = gpt2();
  const auto all = live_tensors_after(e, e.sim->peak.event);
  std::array<Bytes, kCategoryCount> by_category{};
  Bytes total;
  for (const PlotTensor& t : all) {
    total += t.bytes;
    by_category[static_cast<size_t>(t.category)] += t.bytes;
  }
  EXPECT_EQ(total, e.peak.live_total);
  EXPECT_EQ(by_category, e.sim->peak.live.by_category);
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end(),
                             [](const PlotTensor& a, const PlotTensor& b) { return a.bytes > b.bytes; }));
  const TimelinePlot p = timeline_plot(e);
  ASSERT_EQ(p.peak_tensors.size(), kPlotPeakTensors);
  for (size_t k = 0; k < kPlotPeakTensors; ++k) EXPECT_EQ(p.peak_tensors[k].name, all[k].name);
  EXPECT_THROW(live_tensors_after(e, e.sim->timeline.events.size()), Error);
}

TEST(Plot, OneStepIsItsOwnEventsAndItsOwnPeak) {
  const Estimate& e = gpt2();
  const TimelinePlot setup = timeline_plot(e, 0);
  for (size_t i = setup.first_event; i <= setup.last_event; ++i) {
    EXPECT_EQ(e.sim->timeline.events[i].phase, Phase::kSetup);
  }
  EXPECT_LT(setup.columns.size(), kPlotColumns);  // fewer events than columns: one event each
  for (const PlotColumn& c : setup.columns) EXPECT_EQ(c.first_event, c.last_event);
  EXPECT_EQ(setup.peak.event, setup.last_event);  // loading only allocates
  const TimelinePlot step2 = timeline_plot(e, 2);
  EXPECT_EQ(step2.peak.event, e.sim->peak.event);  // the run's peak is in step 2
  EXPECT_NE(step2.subtitle.find("(step 2 only)"), std::string::npos);
  EXPECT_THROW(timeline_plot(e, 7), FieldError);
  EXPECT_THROW(timeline_plot(e, std::nullopt, 0), Error);
}

TEST(Plot, TheSvgIsTheSameTextEachTimeAndStatesThePeak) {
  const Estimate& e = gpt2();
  const TimelinePlot p = timeline_plot(e);
  const std::string svg = render_timeline_svg(e, p);
  EXPECT_EQ(svg, render_timeline_svg(e, timeline_plot(e)));
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find(fmt::format("data-bytes=\"{}\" data-event=\"{}\"", e.peak.live_total.value, e.sim->peak.event)),
            std::string::npos);
  EXPECT_NE(svg.find(">peak " + format_bytes(e.peak.live_total) + "<"), std::string::npos);
  EXPECT_NE(svg.find(">" + format_bytes(e.memory.peak_reserved) + "<"), std::string::npos);
  EXPECT_EQ(svg.find("id=\"capacity\""), std::string::npos);  // no GPU, no capacity line
  EXPECT_NE(svg.find("data-category=\"activations\""), std::string::npos);
  EXPECT_EQ(svg.find("data-category=\"kv cache\""), std::string::npos);  // never live here: not in the legend
  const std::string html = render_timeline_html(e, p, "a < b & c");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find(svg), std::string::npos);
  EXPECT_NE(html.find("a &lt; b &amp; c"), std::string::npos);
}

TEST(Plot, AGpuAddsItsCapacityAndTheFailingAllocation) {
  const Estimate& e = gpt2_on_t4_oom();
  ASSERT_TRUE(e.device && e.device->oom);
  const std::string svg = render_timeline_svg(e, timeline_plot(e));
  EXPECT_NE(svg.find(fmt::format("id=\"capacity\" data-bytes=\"{}\"", find_gpu("t4").runtime_total.value)),
            std::string::npos);
  EXPECT_NE(svg.find(">out of memory: " + xml_escape(e.device->oom->tensor)), std::string::npos);
  const std::string bars = render_breakdown_svg(e);
  EXPECT_NE(bars.find("DOES NOT FIT the t4: short by at least " + format_bytes(e.device->oom->short_by)),
            std::string::npos);
}

TEST(Plot, TheBreakdownAddsUpToTheLiveBytesAtThePeak) {
  const Estimate& e = gpt2();
  const std::string svg = render_breakdown_svg(e);
  EXPECT_EQ(svg, render_breakdown_svg(e));
  for (const Component& c : e.peak.components) {
    if (c.bytes.value == 0) continue;
    EXPECT_NE(svg.find(fmt::format("data-category=\"{}\" data-bytes=\"{}\"", c.name, c.bytes.value)), std::string::npos)
        << c.name;
  }
  EXPECT_NE(svg.find(fmt::format("id=\"allocated\" data-bytes=\"{}\"", e.memory.peak_allocated.value)), std::string::npos);
  EXPECT_NE(svg.find("no GPU given (--gpu)"), std::string::npos);
}

TEST(Plot, TextIsEscapedForXml) {
  EXPECT_EQ(xml_escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
  EXPECT_EQ(xml_escape("model.layers.0 attn softmax"), "model.layers.0 attn softmax");
}

}  // namespace
}  // namespace trainmem
