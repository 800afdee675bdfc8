// gpu_reduce_kernel's staging buffer and semaphores (trainmem/cuda_reduce.h) against an H100's allocations
// (validate/cuda/reduce_probe.py: x.sum(0) of an (R, C) tensor, torch 2.11.0+cu130, 132 SMs).
#include "trainmem/cuda_reduce.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "test_util.h"

namespace trainmem {
namespace {

ReduceShape rows_to_columns(uint64_t rows, uint64_t cols, uint32_t elem) {
  ReduceShape r;
  r.ndim = 2;
  r.sizes = {rows, cols};
  r.strides = {static_cast<int64_t>(cols), 1};
  r.reduced = 1u;  // dim 0
  r.in_bytes = r.out_bytes = elem;
  r.acc_bytes = 4;  // float, for float, half and bfloat16 sums
  return r;
}

const CudaDevice kH100{132, 2048};

TEST(CudaReduce, EverySumTheH100ProbeRanHasItsStagingBufferAndSemaphoresToTheByte) {
  std::ifstream in(std::string(TRAINMEM_SOURCE_DIR) + "/validate/measured/probes/h100-80gb-hbm3_reduce_probe.jsonl");
  ASSERT_TRUE(in);
  std::string line;
  int cases = 0, global = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("env")) {
      EXPECT_EQ(j["env"]["multi_processor_count"], kH100.multiprocessors);
      EXPECT_EQ(j["env"]["max_threads_per_multi_processor"], kH100.max_threads_per_sm);
      continue;
    }
    const std::string dt = j["dtype"];
    const uint32_t elem = dt == "fp32" ? 4 : 2;
    const uint64_t rows = j["rows"], cols = j["cols"];
    // The probe's allocations: the output (cols elements), then the staging buffer and the semaphores when the
    // launch reduces across blocks.
    std::vector<uint64_t> allocs;
    for (const auto& ev : j["events"]) {
      if (ev[0] == "alloc") allocs.push_back(ev[1]);
    }
    ASSERT_GE(allocs.size(), 1u);
    EXPECT_EQ(allocs[0], cols * elem);
    const ReduceScratch s = reduce_scratch(rows_to_columns(rows, cols, elem), kH100);
    EXPECT_EQ(s.accumulation, 0u);
    ASSERT_EQ(s.launches.size(), 1u);
    SCOPED_TRACE(dt + " " + std::to_string(rows) + " x " + std::to_string(cols));
    if (allocs.size() == 1) {
      EXPECT_EQ(s.launches[0].staging, 0u);
      EXPECT_EQ(s.launches[0].semaphores, 0u);
    } else {
      ASSERT_EQ(allocs.size(), 3u);
      EXPECT_EQ(s.launches[0].staging, allocs[1]);
      EXPECT_EQ(s.launches[0].semaphores, allocs[2]);
      ++global;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 105);
  EXPECT_EQ(global, 87);  // 18 sums (256 rows, and 1024 x 64) are too short to reduce across blocks
}

TEST(CudaReduce, ALayersWeightGradientOfBatchTimesSequenceRowsTakesTheSameBufferAsItsTwoDimensionalForm) {
  // sum_to of a (B, T, C) gradient to (C): TensorIterator coalesces B and T into one reduced dim.
  ReduceShape r;
  r.ndim = 3;
  r.sizes = {2, 2048, 4096};
  r.strides = {2048 * 4096, 4096, 1};
  r.reduced = 0b011;
  r.in_bytes = r.out_bytes = 2;
  const ReduceScratch three = reduce_scratch(r, kH100);
  const ReduceScratch two = reduce_scratch(rows_to_columns(4096, 4096, 2), kH100);
  ASSERT_EQ(three.launches.size(), 1u);
  EXPECT_EQ(three.launches[0].staging, two.launches[0].staging);
  EXPECT_EQ(three.launches[0].staging, 134'217'728u);  // the layer probe's 128 MiB block
  EXPECT_EQ(three.launches[0].semaphores, 128u);
}

TEST(CudaReduce, FewerSmsSpreadTheSumOverFewerBlocks) {
  // ctas_per_output = max(min(ceil(target_grid / grid), ceil(vpt / 16)), ceil(vpt / 256)): at 8192 x 4096 the
  // first term decides, so the buffer scales with the SM count (A100: 108 SMs, grid 32, 54 blocks per output).
  const ReduceScratch h100 = reduce_scratch(rows_to_columns(8192, 4096, 2), kH100);
  const ReduceScratch a100 = reduce_scratch(rows_to_columns(8192, 4096, 2), CudaDevice{108, 2048});
  EXPECT_EQ(h100.launches[0].staging, 4ull * 4096 * 66 * 128);
  EXPECT_EQ(a100.launches[0].staging, 4ull * 4096 * 54 * 128);
}

TEST(CudaReduce, AFullSumReducesAcrossBlocksWithoutTheBlockWidthFactor) {
  // All dims reduced: block.x runs along the input (block_x_reduce), so the staging buffer holds one float per
  // block: 512 threads, 4 blocks per SM, ceil(528 / 1) = 528 vs ceil(2048 / 16) = 128 blocks: 128 x 4 B.
  ReduceShape r;
  r.ndim = 1;
  r.sizes = {1u << 20};
  r.strides = {1};
  r.reduced = 1;
  const ReduceScratch s = reduce_scratch(r, kH100);
  ASSERT_EQ(s.launches.size(), 1u);
  EXPECT_EQ(s.launches[0].staging, 128u * 4);
  EXPECT_EQ(s.launches[0].semaphores, 4u);
}

TEST(CudaReduce, ASumBeyondThirtyTwoBitIndexingRunsInHalvesWithAnAccumulationBufferFor16BitOutputs) {
  // 2^17 x 2^14 bf16 is 4 GiB: with_32bit_indexing halves the rows once (each half's last byte at offset
  // 2^31 - 2, the largest 32-bit indexing allows) and, bfloat16 not accumulating in itself, one float per output
  // lives across the launches. In float the halves are still too large and are halved again.
  const ReduceScratch bf16 = reduce_scratch(rows_to_columns(1u << 17, 1u << 14, 2), kH100);
  EXPECT_EQ(bf16.launches.size(), 1u);  // two alike launches: the second leaves the allocator as it was
  EXPECT_EQ(bf16.accumulation, (1u << 14) * 4u);
  const ReduceScratch f32 = reduce_scratch(rows_to_columns(1u << 17, 1u << 14, 4), kH100);
  EXPECT_EQ(f32.launches.size(), 1u);
  // An odd row count splits unevenly: 2^17 + 1 rows into 2^16 (fits 32-bit indexing) and 2^16 + 1 (halved
  // again: 2^15 and 2^15 + 1). ctas_per_output = ceil(values per thread / 256) here: 64, 32 and 33.
  const ReduceScratch odd = reduce_scratch(rows_to_columns((1u << 17) + 1, 1u << 14, 2), kH100);
  ASSERT_EQ(odd.launches.size(), 3u);
  EXPECT_EQ(odd.launches[0].staging, 4ull * 16384 * 64 * 128);
  EXPECT_EQ(odd.launches[1].staging, 4ull * 16384 * 32 * 128);
  EXPECT_EQ(odd.launches[2].staging, 4ull * 16384 * 33 * 128);
  EXPECT_EQ(f32.accumulation, 0u);  // float accumulates in its own output
}

TEST(CudaReduce, AReductionOfTrillionsOfElementsIsDerivedWithoutVisitingItsLaunches) {
  // 2^40 float elements: about 2^10 launches of 2^31 bytes each, all alike; derived once per distinct shape.
  const ReduceScratch s = reduce_scratch(rows_to_columns(1ull << 28, 1u << 12, 4), kH100);
  EXPECT_EQ(s.launches.size(), 1u);
  EXPECT_EQ(s.accumulation, 0u);
}

TEST(CudaReduce, ResidentThreadsPerSmFollowTheComputeCapability) {
  EXPECT_EQ(max_threads_per_sm(70), 2048u);
  EXPECT_EQ(max_threads_per_sm(75), 1024u);
  EXPECT_EQ(max_threads_per_sm(80), 2048u);
  EXPECT_EQ(max_threads_per_sm(86), 1536u);
  EXPECT_EQ(max_threads_per_sm(89), 1536u);
  EXPECT_EQ(max_threads_per_sm(90), 2048u);
}

TEST(CudaReduce, AnEmptyReductionIsRefused) {
  ReduceShape r = rows_to_columns(0, 8, 4);
  EXPECT_THROW(reduce_scratch(r, kH100), std::invalid_argument);
  EXPECT_THROW(reduce_scratch(rows_to_columns(8, 8, 4), CudaDevice{}), std::invalid_argument);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// Every staging buffer a step allocates, and how many.
std::pair<uint64_t, std::vector<uint64_t>> staging_buffers(const Estimate& e) {
  std::vector<uint64_t> sizes;
  uint64_t semaphores = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc) continue;
    const std::string_view w(ev.label.what);
    if (w == "reduce kernel staging buffer") sizes.push_back(ev.bytes.value);
    if (w == "reduce kernel semaphores") ++semaphores;
  }
  return {semaphores, sizes};
}

TEST(CudaReduceSim, EveryRmsNormWeightGradientTakesAStagingBufferSizedByTheCardsSms) {
  // TinyLlama's RMSNorm weights (2048, float32 under autocast) get their gradient as autograd's sum_to of the
  // (4, 2048, 2048) product over its 8192 rows: per backward, two per layer and the final norm's, 5 in all.
  // H100 (132 SMs): ctas = max(min(ceil(2112 / 16), ceil(2048 / 16)), 8) = 128; A100 (108): min(108, 128).
  const auto on = [](const char* gpu) {
    return staging_buffers(testing::run(testing::tiny_llama(2048, {{"batch", "4"}, {"gpu", gpu}, {"steps", "1"}})));
  };
  const auto h100 = on("h100-80gb");
  const auto a100 = on("a100-80gb");
  EXPECT_EQ(h100.second, std::vector<uint64_t>(5, 4ull * 2048 * 128 * 128));
  EXPECT_EQ(a100.second, std::vector<uint64_t>(5, 4ull * 2048 * 108 * 128));
  EXPECT_EQ(h100.first, 5u);  // one semaphore block (4 B x 16 output blocks) beside each
}

TEST(CudaReduceSim, AShortSequenceSumsInOneBlockPerOutputAndTakesNoBuffer) {
  // 1 x 256 rows: 64 values per thread once the warps split them, under max_values_per_thread (256).
  const auto s = staging_buffers(testing::run(testing::tiny_llama(256, {{"gpu", "h100-80gb"}, {"steps", "1"}})));
  EXPECT_TRUE(s.second.empty());
  EXPECT_EQ(s.first, 0u);
}

}  // namespace
}  // namespace trainmem
