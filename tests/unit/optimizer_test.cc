// Memory-lean optimizers: the state each keeps per parameter, against the rules of their source.
#include <gtest/gtest.h>

#include <map>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"
#include "trainmem/timeline.h"

namespace trainmem {
namespace {

using testing::scenario_of;

// The optimizer phase's live temporaries: at(event, live bytes after it) for each of their allocations.
template <class F>
void walk_optimizer_temporaries(const Estimate& e, F at) {
  std::map<uint64_t, uint64_t> live;
  uint64_t now = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.phase != Phase::kOptimizer || ev.category != Category::kTemporaries) continue;
    if (ev.kind == Event::kAlloc) {
      live[ev.storage] = ev.bytes.value;
      now += ev.bytes.value;
      at(ev, now);
    } else if (ev.kind == Event::kFree && live.count(ev.storage)) {
      now -= live[ev.storage];
      live.erase(ev.storage);
    }
  }
}

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
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdamW8bit, OptimizerImpl::kAuto, big, DType::kBF16, 256), false),
            2 * n + 2 * 4 * (n / 256));  // 2.03125 B per parameter
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdamW8bit, OptimizerImpl::kAuto, small, DType::kBF16, 256), false),
            2 * 4 * 4000u);
  // paged: get_state_buffer pages states of at least 1e5 elements (managed memory); absmax stays ordinary
  const auto paged = optimizer_state_tensors(Optimizer::kPagedAdamW8bit, OptimizerImpl::kAuto, big, DType::kBF16, 256);
  EXPECT_EQ(bytes(paged, true), 2 * n);
  EXPECT_EQ(bytes(paged, false), 2 * 4 * (n / 256));
  // the two 256-entry quantization maps, once per optimizer
  EXPECT_EQ(bytes(optimizer_shared_state(Optimizer::kAdamW8bit), false), 2 * 256 * 4u);
}

TEST(Optimizers, AdafactorKeepsFactoredSecondMoments) {
  // transformers optimization.py Adafactor: exp_avg_sq_row shape[:-1] and exp_avg_sq_col shape[:-2] +
  // shape[-1:] in float32 for a matrix; exp_avg_sq for a vector; no first moment (beta1=None); and
  // state["RMS"] = _rms(p_data_fp32), a 0-d float32 tensor (4 bytes).
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdafactor, OptimizerImpl::kAuto, {1024, 4096}, DType::kBF16, 256), false),
            4 * (1024 + 4096u) + 4);
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdafactor, OptimizerImpl::kAuto, {4096}, DType::kBF16, 256), false),
            4 * 4096u + 4);
}

TEST(Optimizers, BitsandbytesBeforeZeroFortyFourUsesBlocksOf2048) {
  // optim/optimizer.py Optimizer2State.init_state before 0.44: `blocks = n // 2048; blocks += 1 if n % 2048 > 0`
  // (PR #1365 made it 256 in 0.44.0); the 8-bit states themselves are n bytes either way.
  EXPECT_EQ(bnb_block_size(BnbVersion{0, 43}), 2048u);
  EXPECT_EQ(bnb_block_size(BnbVersion{0, 44}), 256u);
  EXPECT_EQ(bnb_block_size(std::nullopt), 256u);
  const uint64_t n = 4097ull * 4097;  // 2048 x 8196 + 1: the last block holds one element
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdamW8bit, OptimizerImpl::kAuto, {4097, 4097}, DType::kBF16,
                                          bnb_block_size(BnbVersion{0, 43})), false),
            2 * n + 2 * 4 * (n / 2048 + 1));
}

TEST(Optimizers, BitsandbytesVersionIsParsedAndBelongsToBitsandbytes) {
  ASSERT_TRUE(parse_bnb_version("0.43.3"));
  EXPECT_EQ(*parse_bnb_version("0.43.3"), (BnbVersion{0, 43}));
  EXPECT_FALSE(parse_bnb_version("0.x"));
  EXPECT_FALSE(parse_bnb_version("43"));
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "optimizer_version", "0.43");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("only bitsandbytes"),
            std::string::npos);
}

TEST(Optimizers, Lion8bitKeepsOneBlockwiseState) {
  // optim/lion.py Lion8bit = Optimizer1State(optim_bits=8): state1 uint8 and absmax1 (one float32 per 256),
  // float32 under 4096 elements; one quantization map ("dynamic") moved to the device.
  const uint64_t n = 4096ull * 4096;
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kLion8bit, OptimizerImpl::kAuto, {4096, 4096}, DType::kBF16, 256), false),
            n + 4 * (n / 256));
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kLion8bit, OptimizerImpl::kAuto, {4000}, DType::kBF16, 256), false),
            4 * 4000u);
  EXPECT_EQ(bytes(optimizer_shared_state(Optimizer::kLion8bit), false), 256 * 4u);
}

TEST(Optimizers, TorchAdafactorKeepsKeepdimVariancesInTheParameterDtype) {
  // torch/optim/_adafactor.py Adafactor._init_group: row_var = p.grad.new_zeros([..., m, 1]) and col_var =
  // p.grad.new_zeros([..., 1, n]) in the gradient's dtype (2 bytes for bf16); a vector keeps variance =
  // zeros_like(grad); `step` is a CPU tensor (no device bytes).
  const auto m = optimizer_state_tensors(Optimizer::kAdafactorTorch, OptimizerImpl::kForLoop, {1024, 4096}, DType::kBF16, 256);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].shape, (std::vector<uint64_t>{1024, 1}));
  EXPECT_EQ(m[1].shape, (std::vector<uint64_t>{1, 4096}));
  EXPECT_EQ(bytes(m, false), 2 * (1024 + 4096u));
  EXPECT_EQ(bytes(optimizer_state_tensors(Optimizer::kAdafactorTorch, OptimizerImpl::kForLoop, {4096}, DType::kF32, 256), false),
            4 * 4096u);
}

TEST(Optimizers, TorchAdafactorNeedsTorch25) {
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "optimizer", "adafactor-torch");
  set_field(s, "torch", "2.4");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("from torch 2.5 on"),
            std::string::npos);
  set_field(s, "torch", "2.5");
  EXPECT_EQ(resolve(s, testing::MapFileReader()).setup.optimizer_impl, OptimizerImpl::kForLoop);  // foreach=None
  set_field(s, "optimizer_impl", "foreach");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("not simulated yet"),
            std::string::npos);
}

TEST(Optimizers, TorchAdafactorHoldsTheLastUpdateUntilTheNextParameterRebindsIt) {
  // _single_tensor_adafactor's locals outlive their iteration: `update` (the previous parameter's full-size
  // var_estimate) is released only when the next parameter rebinds it, after that parameter's
  // var_estimate = row_var @ col_var exists. So while wpe (the second parameter) is updated, wte's update is
  // still live: the optimizer's temporaries reach wte + wpe, and never two copies of wte.
  Scenario s = scenario_of("gpt2", {{"batch", "1"}, {"seq", "16"}, {"precision", "fp32"},
                                    {"optimizer", "adafactor-torch"}});
  const ResolvedScenario r = resolve(s, testing::MapFileReader());
  uint64_t wte = 0, wpe = 0;
  for (const TensorRow& row : r.inventory.parameters) {
    if (row.name.find("wte.weight") != std::string::npos) wte = row.elems.value * 4;
    if (row.name.find("wpe.weight") != std::string::npos) wpe = row.elems.value * 4;
  }
  ASSERT_GT(wte, 0u);
  ASSERT_GT(wpe, 0u);
  const Estimate e = estimate(r);
  uint64_t peak = 0;
  walk_optimizer_temporaries(e, [&](const Event&, uint64_t now) { peak = std::max(peak, now); });
  EXPECT_GE(peak, wte + wpe);
  EXPECT_LT(peak, 2 * wte);
}

TEST(Optimizers, TransformersAdafactorKeepsItsLocalsAcrossParametersAndNegatesTheUpdate) {
  // optimization.py Adafactor.step: `update` is a local of the loop over all parameters, so wte's update is
  // still live when wpe's `grad**2` is computed; `p_data_fp32.add_(-update)` allocates -update, a full-size
  // float32 tensor, once per parameter and step.
  Scenario s = scenario_of("gpt2", {{"batch", "1"}, {"seq", "16"}, {"precision", "fp32"}, {"optimizer", "adafactor"},
                                    {"steps", "1"}});
  const ResolvedScenario r = resolve(s, testing::MapFileReader());
  int32_t wpe_row = -1;
  uint64_t wte = 0, trainable = 0;
  for (size_t i = 0; i < r.inventory.parameters.size(); ++i) {
    const TensorRow& row = r.inventory.parameters[i];
    if (row.name.find("wte.weight") != std::string::npos) wte = row.elems.value * 4;
    if (row.name.find("wpe.weight") != std::string::npos) wpe_row = static_cast<int32_t>(i);
    trainable += row.trainable ? 1 : 0;
  }
  ASSERT_GT(wte, 0u);
  ASSERT_GE(wpe_row, 0);
  const Estimate e = estimate(r);
  uint64_t at_wpe = 0, negs = 0;
  walk_optimizer_temporaries(e, [&](const Event& ev, uint64_t now) {
    const std::string what = ev.label.what;
    if (what == "adafactor grad**2" && ev.label.row == wpe_row) at_wpe = now;
    if (what == "adafactor -update") ++negs;
  });
  EXPECT_GE(at_wpe, wte);
  EXPECT_EQ(negs, trainable);
}

Estimate in_backward_run(bool in_backward) {
  Scenario s = scenario_of("qwen3-0.6b", {{"batch", "1"}, {"seq", "32"}, {"precision", "bf16"}, {"loop", "plain"}});
  set_field(s, "optimizer_in_backward", in_backward ? "true" : "false");
  return testing::run(s);
}

TEST(Optimizers, OptimizerInBackwardStepsEachParameterInItsHookAndFreesItsGradient) {
  // torchtune register_optim_in_bwd_hooks: optim_dict[p].step(); optim_dict[p].zero_grad() in the
  // post-accumulate-grad hook: the state is created during step 1's backward (lazily, per parameter), every
  // .grad is freed in backward, and the recipe runs no optimizer step of its own.
  const Estimate in = in_backward_run(true), out = in_backward_run(false);
  uint64_t state_in_backward = 0, optimizer_phase = 0;
  std::map<uint64_t, uint64_t> grads;
  for (const Event& ev : in.sim->timeline.events) {
    if (ev.phase == Phase::kOptimizer) ++optimizer_phase;
    if (ev.kind == Event::kAlloc && ev.category == Category::kOptimizer && ev.phase == Phase::kBackward) {
      state_in_backward += ev.bytes.value;
    }
    const bool grad = ev.category == Category::kGradients;
    if (ev.kind == Event::kRecategorize && grad) grads[ev.storage] = 1;
    if (ev.kind == Event::kAlloc && grad) grads[ev.storage] = 1;
    if (ev.kind == Event::kFree) grads.erase(ev.storage);
  }
  EXPECT_EQ(optimizer_phase, 0u);
  EXPECT_EQ(state_in_backward, in.state.optimizer_state.value);  // AdamW: exp_avg, exp_avg_sq (foreach: no step)
  EXPECT_EQ(in.state.optimizer_state, out.state.optimizer_state);
  EXPECT_TRUE(grads.empty());  // no .grad outlives its update
  EXPECT_EQ(in.state.gradients.value, 0u);
  EXPECT_LT(in.peak.live_total.value, out.peak.live_total.value);
}

TEST(Optimizers, OptimizerInBackwardGivesEachEightBitParameterItsOwnQuantizationMaps) {
  // One bitsandbytes optimizer per parameter: each has its own name2qmap, moved to the device in
  // init_state's 8-bit branch only, so the 2 x 256 float32 maps come once per parameter of >= 4096 elements
  // (qwen3-0.6b: 28 layers x 7 projections + the tied embedding; the norms keep float32 states).
  Scenario s = scenario_of("qwen3-0.6b", {{"batch", "1"}, {"seq", "32"}, {"precision", "bf16"}, {"loop", "plain"},
                                          {"optimizer", "adamw8bit"}});
  const Estimate one = testing::run(s);
  set_field(s, "optimizer_in_backward", "true");
  const Estimate each = testing::run(s);
  const uint64_t maps = 2 * 256 * 4;
  EXPECT_EQ(each.state.optimizer_state.value, one.state.optimizer_state.value + (28 * 7 + 1) * maps - maps);
  uint64_t qmaps = 0;
  for (const Event& ev : each.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && ev.category == Category::kOptimizer && ev.bytes.value == 256 * 4 &&
        std::string(ev.label.what).rfind("qmap", 0) == 0) {
      ++qmaps;
    }
  }
  EXPECT_EQ(qmaps, 2 * (28 * 7 + 1u));
}

TEST(Optimizers, OptimizerInBackwardIsRefusedWhereTorchtuneRefusesIt) {
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "optimizer_in_backward", "true");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("clips gradients"),
            std::string::npos);  // the Trainer loop clips
  set_field(s, "loop", "plain");
  set_field(s, "grad_accum", "2");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("cannot accumulate"),
            std::string::npos);
  set_field(s, "grad_accum", "1");
  set_field(s, "torch", "2.0");
  EXPECT_NE(testing::error_of([&] { resolve(s, testing::MapFileReader()); }).find("from torch 2.1 on"),
            std::string::npos);
}

TEST(Optimizers, PagedStateIsOutsideTheAllocatorButInTheDeviceTotal) {
  Scenario s = scenario_of("qwen3-0.6b", {{"batch", "1"}, {"seq", "64"}, {"precision", "bf16"},
                                          {"optimizer", "paged-adamw8bit"}, {"gpu", "a100-80gb"}});
  const Estimate paged = testing::run(s);
  set_field(s, "optimizer", "adamw8bit");
  const Estimate plain = testing::run(s);
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
