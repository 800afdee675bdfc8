// The caching allocator model: its documented rules (c10/cuda/CUDACachingAllocator.cpp), PYTORCH_CUDA_ALLOC_CONF
// parsing, and the figures PyTorch's allocator reported in seed 000 and seed 003.
#include "trainmem/allocator.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/gpu.h"
#include "trainmem/report.h"

namespace trainmem {
namespace {

using testing::error_of;
constexpr TorchVersion kTorch{2, 9};

// A timeline from a list of operations: +n allocates n bytes (the next id), -k frees the k-th allocation.
Timeline timeline(const std::vector<int64_t>& ops) {
  Timeline t;
  std::vector<uint64_t> sizes;
  for (int64_t op : ops) {
    Event e{};
    if (op > 0) {
      e.kind = Event::kAlloc;
      e.storage = static_cast<uint32_t>(sizes.size());
      e.bytes = Bytes(static_cast<uint64_t>(op));
      sizes.push_back(static_cast<uint64_t>(op));
    } else {
      e.kind = Event::kFree;
      e.storage = static_cast<uint32_t>(-op);
      e.bytes = Bytes(sizes[e.storage]);
    }
    t.events.push_back(e);
  }
  return t;
}

// Each segment's address in cudaMalloc order and each allocation's block address, as trace_allocator records them.
std::pair<std::vector<uint64_t>, std::vector<uint64_t>> segments_and_blocks(const Timeline& t) {
  std::vector<uint64_t> segment, handed;
  for (const AllocatorTraceEntry& e : trace_allocator(t, {}, kTorch).entries) {
    if (e.action == AllocatorTraceEntry::kSegmentAlloc) segment.push_back(e.addr);
    if (e.action == AllocatorTraceEntry::kAlloc) handed.push_back(e.addr);
  }
  return {segment, handed};
}

constexpr int64_t MiB = 1 << 20;

TEST(AllocatorRules, RoundSizeIsAMultipleOf512WithPowerOfTwoDivisionsWhenConfigured) {
  const AllocatorConfig none;
  EXPECT_EQ(round_size(1, none, kTorch), 512u);
  EXPECT_EQ(round_size(1'000'000, none, kTorch), 1'000'448u);
  EXPECT_EQ(round_size(8'519'680, none, kTorch), 8'519'680u);
  AllocatorConfig four;
  four.roundup_power2_divisions.fill(4);
  EXPECT_EQ(round_size(1200, four, kTorch), 1536u);            // 1200 <= 512 * 4: plain 512 rounding
  EXPECT_EQ(round_size(600 * MiB, four, kTorch), 640u * MiB);  // quarters of [512, 1024) MiB
  EXPECT_EQ(round_size(512 * MiB, four, kTorch), 512u * MiB);  // powers of two stay
}

TEST(AllocatorRules, SegmentSizeByPool) {
  EXPECT_EQ(allocation_size(512), 2u * MiB);               // small pool: 2 MiB segments
  EXPECT_EQ(allocation_size(MiB), 2u * MiB);
  EXPECT_EQ(allocation_size(MiB + 512), 20u * MiB);        // 1-10 MiB: 20 MiB segments
  EXPECT_EQ(allocation_size(10 * MiB), 10u * MiB);         // >= 10 MiB: rounded to 2 MiB
  EXPECT_EQ(allocation_size(11 * MiB), 12u * MiB);
}

TEST(AllocatorRules, ALargeBlockIsSplitOnlyWhenMoreThanOneMiBRemains) {
  // 11 MiB in a 12 MiB segment: 1 MiB remains, not > 1 MiB: the whole 12 MiB is allocated (a 1 MiB gap).
  AllocatorReplay r = replay_allocator(timeline({11 * MiB}), {}, kTorch, std::nullopt);
  EXPECT_EQ(r.allocated.back(), 12u * MiB);
  EXPECT_EQ(r.reserved.back(), 12u * MiB);
  // 10.5 MiB in a 12 MiB segment: 1.5 MiB remains and is split off; a later 1.5 MiB tensor reuses it.
  r = replay_allocator(timeline({10 * MiB + MiB / 2, MiB + MiB / 2}), {}, kTorch, std::nullopt);
  EXPECT_EQ(r.allocated.back(), 12u * MiB);
  EXPECT_EQ(r.reserved.back(), 12u * MiB);
}

TEST(AllocatorRules, SmallTensorsPackIntoTwoMiBSegments) {
  // 4096 tensors of 512 B fill exactly one 2 MiB segment; the next one opens a second.
  std::vector<int64_t> ops(4096, 500);
  Timeline t = timeline({});
  for (size_t i = 0; i < ops.size() + 1; ++i) t.events.push_back(Event{Event::kAlloc, Category::kActivations,
                                                                        Category::kActivations, Phase::kForward, 0, 0,
                                                                        static_cast<uint32_t>(i), Bytes(500), Label{}});
  const AllocatorReplay r = replay_allocator(t, {}, kTorch, std::nullopt);
  EXPECT_EQ(r.allocated.back(), 4097u * 512);
  EXPECT_EQ(r.reserved.back(), 4u * MiB);
  EXPECT_EQ(r.segments_peak, 2u);
}

TEST(AllocatorRules, FreedBlocksAreCachedAndReusedBestFit) {
  // 30 MiB and 20 MiB segments; freeing both then asking for 18 MiB takes the 20 MiB block (best fit), not
  // a new segment, and reserved memory never shrinks on free.
  const AllocatorReplay r = replay_allocator(timeline({30 * MiB, 20 * MiB, -0, -1, 18 * MiB}), {}, kTorch, std::nullopt);
  EXPECT_EQ(r.reserved.back(), 50u * MiB);
  EXPECT_EQ(r.allocated.back(), 18u * MiB);  // the 2 MiB remainder (> 1 MiB) is split off and stays cached
}

TEST(AllocatorRules, AmongCachedBlocksOfOneSizeBestFitTakesTheLowestAddress) {
  // BlockComparatorSize orders a pool's cached blocks by (size, address) and get_free_block takes the first of
  // at least the rounded size: with twelve 30 MiB segments freed in a scrambled order beside a 40 MiB one and a
  // 24 MiB one (23 MiB rounded up to 2 MiB, get_allocation_size), a 26 MiB request and then eleven 30 MiB ones
  // take the 30 MiB blocks by increasing address (the replay places segments downwards, so the last one
  // cudaMalloc'ed has the lowest), then a 30 MiB request takes the 40 MiB block; the 24 MiB one is never used.
  std::vector<int64_t> ops(12, 30 * MiB);
  ops.push_back(40 * MiB);
  ops.push_back(23 * MiB);
  for (int64_t k : {5, 0, 13, 11, 3, 8, 1, 12, 10, 6, 2, 9, 4, 7}) ops.push_back(-k);
  ops.push_back(26 * MiB);
  for (int i = 0; i < 12; ++i) ops.push_back(30 * MiB);
  const Timeline t = timeline(ops);
  const auto [segment, handed] = segments_and_blocks(t);
  ASSERT_EQ(segment.size(), 14u);  // nothing after the frees needs a new segment
  ASSERT_EQ(handed.size(), 27u);
  for (size_t j = 0; j < 12; ++j) EXPECT_EQ(handed[14 + j], segment[11 - j]) << "request " << j;
  EXPECT_EQ(handed[26], segment[12]);  // the 40 MiB block
  EXPECT_EQ(replay_allocator(t, {}, kTorch, std::nullopt).reserved.back(), (12u * 30 + 40 + 24) * MiB);
}

TEST(AllocatorRules, BestFitOrdersSizesWithinOneSizeClassThenAddresses) {
  // The replay keeps a pool's cached blocks in size classes of 16 an octave (caching_allocator.cc FreeSet): 64 MiB
  // and 66 MiB share a class (4 MiB wide from 64 MiB), where PyTorch's (size, address) order still decides. Four
  // segments of 66, 64, 66 and 64 MiB (each request a multiple of 2 MiB: its own segment), freed scrambled; then a
  // 63 MiB request takes the lower-addressed 64 MiB block (no split: a 1 MiB remainder is not above kSmallSize), a
  // 65 MiB one the lower 66 MiB block, then 64 MiB the other 64 and 65 MiB the other 66 (segments are placed
  // downwards: the last one cudaMalloc'ed has the lowest address); a fifth 64 MiB request needs a new segment.
  std::vector<int64_t> ops{66 * MiB, 64 * MiB, 66 * MiB, 64 * MiB, -2, -0, -3, -1,
                           63 * MiB, 65 * MiB, 64 * MiB, 65 * MiB, 64 * MiB};
  const auto [segment, handed] = segments_and_blocks(timeline(ops));
  ASSERT_EQ(segment.size(), 5u);
  ASSERT_EQ(handed.size(), 9u);
  EXPECT_EQ(handed[4], segment[3]);  // 63 MiB: the lower 64 MiB block
  EXPECT_EQ(handed[5], segment[2]);  // 65 MiB: the lower 66 MiB block
  EXPECT_EQ(handed[6], segment[1]);  // 64 MiB: the other 64
  EXPECT_EQ(handed[7], segment[0]);  // 65 MiB: the other 66
  EXPECT_EQ(handed[8], segment[4]);
}

TEST(AllocatorRules, AStreamReusesOnlyItsOwnCachedBlocks) {
  // BlockComparatorSize orders by stream first: a 30 MiB block freed on FSDP2's all-gather stream is not
  // handed to the default stream, which cudaMallocs a segment of its own; the same stream reuses it.
  Timeline t = timeline({30 * MiB, -0, 30 * MiB, 30 * MiB, -1, -2});
  t.events[0].stream = t.events[1].stream = Stream::kFsdpAllGatherCopyIn;
  const AllocatorReplay r = replay_allocator(t, {}, kTorch, std::nullopt);
  EXPECT_EQ(r.reserved[2], 60u * MiB);  // the default stream's request
  EXPECT_EQ(r.reserved[3], 90u * MiB);
  t.events[2].stream = t.events[4].stream = Stream::kFsdpAllGatherCopyIn;
  const AllocatorReplay same = replay_allocator(t, {}, kTorch, std::nullopt);
  EXPECT_EQ(same.reserved[2], 30u * MiB);  // reused on its own stream
  EXPECT_EQ(same.peak_reserved.value, 60u * MiB);
  // empty_cache returns every stream's free segments
  t.events.push_back(Event{Event::kEmptyCache});
  EXPECT_EQ(replay_allocator(t, {}, kTorch, std::nullopt).reserved.back(), 0u);
}

TEST(AllocatorRules, NeighbouringFreeBlocksMerge) {
  // Three 4 MiB tensors share one 20 MiB segment; freed together they merge back into one 20 MiB block,
  // which a 19 MiB request can use whole.
  const AllocatorReplay r =
      replay_allocator(timeline({4 * MiB, 4 * MiB, 4 * MiB, -0, -1, -2, 19 * MiB}), {}, kTorch, std::nullopt);
  EXPECT_EQ(r.reserved.back(), 20u * MiB);
  EXPECT_EQ(r.allocated.back(), 20u * MiB);  // 1 MiB remainder is not split
}

TEST(AllocatorRules, MaxSplitSizeKeepsOversizeBlocksForLargeRequests) {
  AllocatorConfig c = parse_alloc_conf("max_split_size_mb:64", kTorch);
  // A cached 100 MiB block is not handed to a 30 MiB request: a new segment is made.
  const AllocatorReplay r = replay_allocator(timeline({100 * MiB, -0, 30 * MiB}), c, kTorch, std::nullopt);
  EXPECT_EQ(r.reserved.back(), 130u * MiB);
  // But an 90 MiB request may take it whole (within max_non_split_rounding, 20 MiB).
  const AllocatorReplay r2 = replay_allocator(timeline({100 * MiB, -0, 90 * MiB}), c, kTorch, std::nullopt);
  EXPECT_EQ(r2.reserved.back(), 100u * MiB);
  EXPECT_EQ(r2.allocated.back(), 100u * MiB);
}

TEST(AllocatorRules, ExpandableSegmentsAllocateExactlyAndGrowByPages) {
  const AllocatorConfig c = parse_alloc_conf("expandable_segments:True", kTorch);
  // 11 MiB: no 1 MiB gap (any remainder is split); the large pool maps 20 MiB pages.
  AllocatorReplay r = replay_allocator(timeline({11 * MiB}), c, kTorch, std::nullopt);
  EXPECT_EQ(r.allocated.back(), 11u * MiB);
  EXPECT_EQ(r.reserved.back(), 20u * MiB);
  // The segment grows in place: 11 + 15 MiB fit in two pages.
  r = replay_allocator(timeline({11 * MiB, 15 * MiB}), c, kTorch, std::nullopt);
  EXPECT_EQ(r.reserved.back(), 40u * MiB);
  EXPECT_EQ(r.allocated.back(), 26u * MiB);
}

TEST(AllocatorRules, CacheIsReleasedAndCudaMallocRetriedBeforeGivingUp) {
  // On a 100 MiB device: 60 MiB is freed to the cache, then 70 MiB does not fit beside it; the allocator
  // frees the cached segment and retries (num_alloc_retries).
  AllocatorReplay r = replay_allocator(timeline({60 * MiB, -0, 70 * MiB}), {}, kTorch, Bytes(100 * MiB));
  EXPECT_FALSE(r.oom);
  EXPECT_EQ(r.alloc_retries, 1u);
  EXPECT_EQ(r.reserved.back(), 70u * MiB);
  // With the 60 MiB still live it is an out-of-memory, reported for the 70 MiB segment.
  r = replay_allocator(timeline({60 * MiB, 70 * MiB}), {}, kTorch, Bytes(100 * MiB));
  ASSERT_TRUE(r.oom);
  EXPECT_EQ(r.oom->event, 1u);
  EXPECT_EQ(r.oom->segment.value, 70u * MiB);
  EXPECT_EQ(r.oom->reserved.value, 60u * MiB);
}

TEST(AllocConf, ParsesPyTorchSyntaxAndRejectsWhatPyTorchRejects) {
  AllocatorConfig c = parse_alloc_conf("max_split_size_mb:128, roundup_power2_divisions:[256:1,512:2,>:8]", {2, 5});
  EXPECT_EQ(c.max_split_size, 128u * MiB);
  EXPECT_EQ(c.roundup_power2_divisions[7], 1u);  // [128, 256) MiB gets the first key's value
  EXPECT_EQ(c.roundup_power2_divisions[9], 8u);  // up to 2.8, '>' also overwrites the last explicit interval
  EXPECT_EQ(c.roundup_power2_divisions[15], 8u);
  EXPECT_EQ(error_of([] { parse_alloc_conf("max_split_size_mb:20", {2, 5}); }),
            "alloc_conf \"max_split_size_mb:20\": CachingAllocator option max_split_size_mb too small, must be > 20");
  EXPECT_EQ(error_of([] { parse_alloc_conf("expandable_segments:yes", kTorch); }),
            "alloc_conf \"expandable_segments:yes\": Expected a single True/False argument for expandable_segments");
  EXPECT_EQ(error_of([] { parse_alloc_conf("garbage_collection_threshold:1.5", kTorch); }),
            "alloc_conf \"garbage_collection_threshold:1.5\": garbage_collect_threshold too big, set it 0.0~1.0");
  EXPECT_EQ(error_of([] { parse_alloc_conf("max_spilt_size_mb:128", kTorch); }),
            "alloc_conf \"max_spilt_size_mb:128\": Unrecognized CachingAllocator option: max_spilt_size_mb");
  EXPECT_EQ(error_of([] { parse_alloc_conf("roundup_power2_divisions:3", kTorch); }),
            "alloc_conf \"roundup_power2_divisions:3\": For roundups, the divisions has to be power of 2 ");
}

// ---- measured figures -----------------------------------------------------------------------------------

Estimate seed000() {
  const testing::Seed000Run run(3);
  return estimate(run.m, build_inventory(run.m), run.s, run.o);
}

nlohmann::json seed000_measured() {
  std::ifstream in(std::string(TRAINMEM_SOURCE_DIR) + "/validate/measured/seed000_trace.json");
  return nlohmann::json::parse(in).at("measured");
}

TEST(AllocatorSeed000, SteadyStateMemoryAllocatedWithItsGapsWithinFiveHundredthsOfAPercent) {
  // Seed 000: torch.cuda.memory_allocated() = 2,064,403,456 B at the start of a step, of which 6,855,368 B are
  // gaps. (The model reproduces it to the byte; the issue asks for 0.05%.)
  const Estimate e = seed000();
  const double measured = 2'064'403'456.0;
  EXPECT_NEAR(static_cast<double>(e.memory.steady_state.value), measured, measured * 0.0005);
  EXPECT_EQ(e.memory.steady_state.value, 2'064'403'456u);
  EXPECT_EQ(e.memory.steady_state.value - e.sim->steady.live.total.value, 6'855'368u);  // the gaps
}

TEST(AllocatorSeed000, ReservedMemoryAtBothSnapshotsIsReproduced) {
  const Estimate e = seed000();
  const nlohmann::json me = seed000_measured();
  // pre-forward of the second iteration and after the third iteration's forward
  size_t second_forward = 0, third_after = e.sim->after_forward.event - 1;
  for (size_t i = 0; i < e.sim->timeline.events.size(); ++i) {
    const Event& ev = e.sim->timeline.events[i];
    if (ev.step == 2 && ev.phase == Phase::kForward) {
      second_forward = i - 1;
      break;
    }
  }
  EXPECT_EQ(e.alloc->reserved[second_forward], me.at("steady_state_reserved_bytes").get<uint64_t>());
  EXPECT_EQ(e.alloc->reserved[third_after], me.at("after_forward_step3_reserved_bytes").get<uint64_t>());
  EXPECT_EQ(e.alloc->allocated[third_after], me.at("after_forward_memory_allocated_bytes").get<uint64_t>());
}

TEST(AllocatorSeed000, PeakAllocatedWithinHalfAPercentOfTheMeasured21898GiB) {
  const Estimate e = seed000();
  const double measured = 21.898;  // GiB, "pytorch.cuda.max_memory_allocated() returns 21.898GB"
  EXPECT_NEAR(to_gib(e.memory.peak_allocated), measured, measured * 0.005);
  EXPECT_NEAR(to_gib(e.memory.peak_allocated), measured, 0.0005);  // in fact to the printed precision
  EXPECT_EQ(e.peak.phase, Phase::kBackward);
}

// Seed 000's text calls its run bf16 autocast; its trace shows GradScaler, i.e. float16. With bf16 autocast (no
// GradScaler) the figures move by a few hundred KiB and stay within what the issue asks: peak allocated within
// 0.5% of 21.898 GiB, saved activations within 1% of the 17.673 GiB snapshot, steady state within 0.5%.
TEST(AllocatorSeed000, WithBf16AutocastTheFiguresStayWithinTheIssuesTolerances) {
  testing::Seed000Run run(3);
  run.s.precision = Precision::kBf16Amp;
  const Estimate e = estimate(run.m, build_inventory(run.m), run.s, run.o);
  EXPECT_NEAR(to_gib(e.memory.peak_allocated), 21.898, 21.898 * 0.005);
  EXPECT_NEAR(to_gib(e.peak.saved_activations), 17.673, 17.673 * 0.01);
  EXPECT_NEAR(static_cast<double>(e.memory.steady_state.value), 2'064'403'456.0, 2'064'403'456.0 * 0.005);
  EXPECT_NE(e.memory.steady_state.value, 2'064'403'456u);  // no GradScaler state: not the float16 run's exact figure
}

// Seed 003's experiments, as a layer stack with no optimizer and PyTorch 2.3 (Colab, 2024).
AllocatorReplay stack(const std::string& json, uint64_t batch, const SimResult** sim_out) {
  static SimResult sim;
  const ModelSpec m = testing::from_json(json);
  TrainSetup s;
  s.batch = batch;
  s.seq = 1;
  s.precision = Precision::kFp32;
  s.optimizer = Optimizer::kNone;
  SimOptions o;
  o.loop = LoopKind::kPlain;
  o.torch = {2, 3};
  o.steps = 1;
  sim = simulate(m, build_inventory(m), s, o);
  *sim_out = &sim;
  return replay_allocator(sim.timeline, {}, o.torch, std::nullopt);
}

uint64_t allocated_at_end_of(const SimResult& sim, const AllocatorReplay& r, Phase p) {
  size_t last = 0;
  for (size_t i = 0; i < sim.timeline.events.size(); ++i) {
    if (sim.timeline.events[i].phase == p) last = i;
  }
  return r.allocated[last];
}

TEST(AllocatorSeed003, SingleLinearLayerForwardAndBackward) {
  // "Memory after forward pass: 8778752" and "Memory after backward pass: 17555456" for nn.Linear(256, 250)
  // with a (1, 256) float32 input: 512-byte blocks plus one cuBLAS workspace per thread.
  const SimResult* sim = nullptr;
  const AllocatorReplay r = stack(R"({"model_type": "mlp", "input": 256, "layers": [{"linear": 250}]})", 1, &sim);
  EXPECT_EQ(allocated_at_end_of(*sim, r, Phase::kForward), 8'778'752u);
  EXPECT_EQ(allocated_at_end_of(*sim, r, Phase::kBackward), 17'555'456u);
}

TEST(AllocatorSeed003, TwoLayerNetworkForwardAndBackward) {
  // test_multi_layer_forward/backward: Linear(200,100), ReLU, Linear(100,200), Sigmoid, batch 5. The seed's
  // expected totals: weights and biases in 512-byte blocks, the input of each Linear, the output, one
  // workspace after forward; after backward the gradients, the input x and output y, two workspaces.
  const SimResult* sim = nullptr;
  const AllocatorReplay r = stack(
      R"({"model_type": "mlp", "input": 200, "layers": [{"linear": 100}, "relu", {"linear": 200}, "sigmoid"]})", 5, &sim);
  const uint64_t params = 80'384 + 512 + 80'384 + 1'024;
  EXPECT_EQ(allocated_at_end_of(*sim, r, Phase::kForward), params + 4'096 + 2'048 + 4'096 + 8'519'680);
  EXPECT_EQ(allocated_at_end_of(*sim, r, Phase::kBackward), 2 * params + 4'096 + 4'096 + 2 * 8'519'680);
}

// An out-of-memory at the very first allocation (a 10-million-token vocabulary on a T4): nothing else is live,
// and the verdict says so instead of listing the rest of the run.
TEST(DeviceVerdict, OutOfMemoryAtTheFirstAllocationHasNothingLive) {
  const ModelSpec m = testing::preset("gpt2");
  ModelSpec big = m;
  big.embed.vocab_size = 10'000'000;
  const GpuSpec& t4 = find_gpu("t4");
  const Estimate e = estimate(big, build_inventory(big), testing::train_setup(1, 8), SimOptions{}, {}, &t4);
  ASSERT_TRUE(e.device && e.device->oom);
  EXPECT_EQ(e.device->oom->event, 0u);
  EXPECT_EQ(e.device->oom->tensor, "transformer.wte.weight");
  EXPECT_TRUE(e.device->oom->live.empty());
  EXPECT_EQ(e.device->oom->live_total.value, 0u);
  EXPECT_LT(e.device->headroom, 0);
}

// Names from files are not always UTF-8: JSON output replaces what is not, rather than failing.
TEST(Reports, JsonOfANonUtf8ModelNameIsStillJson) {
  ModelSpec m = testing::preset("gpt2");
  m.name = "configs/caf\xe9.json";  // Latin-1
  const Estimate e = estimate(m, build_inventory(m), testing::train_setup(1, 16), SimOptions{});
  const auto j = nlohmann::json::parse(render_estimate_json(e, nullptr));
  EXPECT_EQ(j["model"]["name"].get<std::string>(), "configs/caf\xef\xbf\xbd.json");  // U+FFFD
}

}  // namespace
}  // namespace trainmem
