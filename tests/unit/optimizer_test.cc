// Memory-lean optimizers: the state each keeps per parameter, against the rules of their source.
#include <gtest/gtest.h>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

uint64_t bytes(const std::vector<StateTensor>& ts, bool paged) {
  uint64_t b = 0;
  for (const StateTensor& t : ts) {
    if (t.paged != paged) continue;
    uint64_t n = 1;
    for (uint64_t d : t.shape) n *= d;
    b += n * itemsize(t.dtype);
  }
  return b;
}

TEST(Optimizers, BitsandbytesEightBitStatesAreBlockwise) {
  // optim/optimizer.py Optimizer2State.init_state (bnb >= 0.44): uint8 state1 and state2 (n bytes each) and a
  // float32 absmax per 256 elements for each; under min_8bit_size = 4096 elements, float32 states.
  const std::vector<uint64_t> big{4096, 4096}, small{4000};
  const uint64_t n = 4096ull * 4096;
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdamW8bit, OptimizerImpl::kAuto, big, DType::kBF16), false),
            2 * n + 2 * 4 * (n / 256));  // 2.03125 B per parameter
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdamW8bit, OptimizerImpl::kAuto, small, DType::kBF16), false),
            2 * 4 * 4000u);
  // paged: get_state_buffer pages states of at least 1e5 elements (managed memory); absmax stays ordinary
  const auto paged = optimizer_state_tensors(Optimizer::kPagedAdamW8bit, OptimizerImpl::kAuto, big, DType::kBF16);
  EXPECT_EQ(bytes(paged, true), 2 * n);
  EXPECT_EQ(bytes(paged, false), 2 * 4 * (n / 256));
  // the two 256-entry quantization maps, once per optimizer
  EXPECT_EQ(bytes(optimizer_shared_state(Optimizer::kAdamW8bit), false), 2 * 256 * 4u);
}

TEST(Optimizers, AdafactorKeepsFactoredSecondMoments) {
  // transformers optimization.py Adafactor: exp_avg_sq_row shape[:-1] and exp_avg_sq_col shape[:-2] +
  // shape[-1:] in float32 for a matrix; exp_avg_sq for a vector; no first moment (beta1=None).
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdafactor, OptimizerImpl::kAuto, {1024, 4096}, DType::kBF16), false),
            4 * (1024 + 4096u));
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdafactor, OptimizerImpl::kAuto, {4096}, DType::kBF16), false),
            4 * 4096u);
}

TEST(Optimizers, PagedStateIsOutsideTheAllocatorButInTheDeviceTotal) {
  Scenario s;
  s.model.model = "qwen3-0.6b";
  for (auto [f, v] : std::initializer_list<std::pair<const char*, const char*>>{
           {"batch", "1"}, {"seq", "64"}, {"precision", "bf16"}, {"optimizer", "paged-adamw8bit"}, {"gpu", "a100-80gb"}}) {
    set_field(s, f, v);
  }
  const Estimate paged = estimate(resolve(s, testing::MapFileReader()));
  set_field(s, "optimizer", "adamw8bit");
  const Estimate plain = estimate(resolve(s, testing::MapFileReader()));
  EXPECT_GT(paged.state.paged_optimizer_state.value, 0u);
  EXPECT_EQ(paged.state.optimizer_state + paged.state.paged_optimizer_state, plain.state.optimizer_state);
  EXPECT_LT(paged.memory.peak_allocated, plain.memory.peak_allocated);  // not in memory_allocated
  EXPECT_EQ(paged.device->device_total, paged.device->peak_reserved + paged.device->context + paged.state.paged_optimizer_state);
}

TEST(Optimizers, TorchImplementationsBelongToTorchOptimizers) {
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "optimizer", "adamw8bit");
  set_field(s, "optimizer_impl", "fused");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("has one implementation"),
            std::string::npos);
}

}  // namespace
}  // namespace trainmem
