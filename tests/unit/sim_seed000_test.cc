// The step simulator against seed 000's measured PyTorch memory trace (validate/measured/seed000_trace.json,
// extracted by validate/seed000/extract.py from the author's published snapshot): nanoGPT GPT-2 small,
// batch 12, seq 1024, float16 autocast, fused AdamW, no flash attention, A100, PyTorch 2.0.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/sim.h"

namespace trainmem {
namespace {

struct TraceEvent {
  bool alloc;
  uint64_t bytes;
};

struct Trace {
  std::vector<TraceEvent> events;
  uint64_t peak = 0;
  nlohmann::json measured;
};

const Trace& trace() {
  static const Trace t = [] {
    Trace r;
    std::ifstream in(std::string(TRAINMEM_SOURCE_DIR) + "/validate/measured/seed000_trace.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    r.measured = j.at("measured");
    std::unordered_set<uint64_t> seen;
    uint64_t live = 0;
    for (const auto& e : j.at("events")) {
      const uint64_t id = e[0].get<uint64_t>(), size = e[1].get<uint64_t>();
      const bool alloc = seen.insert(id).second;
      live = alloc ? live + size : live - size;
      r.peak = std::max(r.peak, live);
      r.events.push_back({alloc, size});
    }
    return r;
  }();
  return t;
}

SimResult simulate_seed000(uint32_t steps) {
  const testing::Seed000Run run(steps);
  return simulate(run.m, build_inventory(run.m), run.s, run.o);
}

TEST(SimSeed000, PeakOfLiveTensorsEqualsTheMeasuredTraceToTheByte) {
  EXPECT_EQ(trace().peak, 23'506'407'752u);  // the trace's own maximum
  EXPECT_EQ(simulate_seed000(3).peak.live.total.value, trace().peak);
}

TEST(SimSeed000, SteadyStateEqualsTheSnapshotMinusItsGaps) {
  // Snapshot mem_pre_fwd-step1: memory_allocated 2,064,403,456 B of which 6,855,368 B are gaps (blocks larger
  // than their tensors); the tensors themselves are the difference.
  const uint64_t tensors = trace().measured.at("steady_state_memory_allocated_bytes").get<uint64_t>() -
                           trace().measured.at("steady_state_gap_bytes").get<uint64_t>();
  EXPECT_EQ(simulate_seed000(2).steady.live.total.value, tensors);
}

TEST(SimSeed000, ActivationsAfterForwardEqualTheSecondSnapshot) {
  // Snapshot mem_fwd_allocated-step3 (after the forward, before backward) minus the steady-state snapshot, each
  // without its gaps: what the forward pass adds, 17.673 GiB in the seed. The simulator's moment is after the
  // loss and the prefetch of the next batch, which is where that snapshot was taken.
  const auto& me = trace().measured;
  const uint64_t after = me.at("after_forward_memory_allocated_bytes").get<uint64_t>() -
                         me.at("after_forward_gap_bytes").get<uint64_t>();
  const SimResult r = simulate_seed000(3);
  EXPECT_EQ(r.after_forward.live.total.value, after);
  const uint64_t steady = me.at("steady_state_memory_allocated_bytes").get<uint64_t>() -
                          me.at("steady_state_gap_bytes").get<uint64_t>();
  EXPECT_NEAR(to_gib(Bytes(after - steady)), 17.673, 0.0005);
}

TEST(SimSeed000, EveryTensorOfAtLeastOneMiBIsAllocatedAndFreedInTheMeasuredOrder) {
  // Tensors below 1 MiB include cub's sort scratch and GradScaler's scalars, which are not modelled.
  constexpr uint64_t kMin = 1 << 20;
  std::vector<std::pair<bool, uint64_t>> measured, simulated;
  for (const TraceEvent& e : trace().events) {
    if (e.bytes >= kMin) measured.emplace_back(e.alloc, e.bytes);
  }
  for (const Event& e : simulate_seed000(3).timeline.events) {
    if (e.bytes.value >= kMin && e.kind != Event::kRecategorize) simulated.emplace_back(e.kind == Event::kAlloc, e.bytes.value);
  }
  // The trace ends in the third step's backward; compare its length.
  ASSERT_GE(simulated.size(), measured.size());
  simulated.resize(measured.size());
  size_t first_diff = measured.size();
  for (size_t i = 0; i < measured.size(); ++i) {
    if (measured[i] != simulated[i]) {
      first_diff = i;
      break;
    }
  }
  EXPECT_EQ(first_diff, measured.size()) << "first difference at event " << first_diff << " of " << measured.size();
  EXPECT_GT(measured.size(), 3000u);
}

}  // namespace
}  // namespace trainmem
