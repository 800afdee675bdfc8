// --dp N with DDP: one rank of DistributedDataParallel (ddp.h, loop.cc). The bucket assignment is checked
// against real DDP (torch 1.13, gloo, one rank) in validate/cpu/ddp.py (ctest oracle.ddp_buckets); these tests
// pin the rules: c10d's compute_bucket_assignment_by_size arithmetic, the rebuild's order (old buckets freed
// first), gradient_as_bucket_view, the defaults of the loops, and what is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "test_util.h"
#include "trainmem/ddp.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

std::vector<uint64_t> sizes(const std::vector<DdpBucket>& v) {
  std::vector<uint64_t> r;
  for (const DdpBucket& b : v) r.push_back(b.bytes);
  return r;
}

TEST(DdpBuckets, FirstBucketCapThenCapEachOvershootingByItsLastTensor) {
  // limits [100, 250]: 60+60 >= 100 closes the first bucket (overshoot by one tensor); then 250: 60+60+60+60+60
  // = 300 >= 250 closes at the fifth tensor; the rest stays open
  std::vector<BucketInput> t;
  for (uint32_t i = 0; i < 9; ++i) t.push_back({i, 60, DType::kF32});
  const auto b = assign_buckets(t, {100, 250}, true);
  EXPECT_EQ(sizes(b), (std::vector<uint64_t>{120, 300, 120}));
  EXPECT_EQ(b[1].indices, (std::vector<uint32_t>{2, 3, 4, 5, 6}));
}

TEST(DdpBuckets, ATensorLargerThanTheCapGetsItsOwnBucket) {
  const std::vector<BucketInput> t{{0, 10, DType::kF32}, {1, 1000, DType::kF32}, {2, 10, DType::kF32}};
  // 10 < 50, then 10 + 1000 >= 50 closes [0, 1]; the big one cannot share a bucket with what follows
  const auto b = assign_buckets(t, {50}, true);
  EXPECT_EQ(sizes(b), (std::vector<uint64_t>{1010, 10}));
  const std::vector<BucketInput> big_first{{0, 1000, DType::kF32}, {1, 10, DType::kF32}};
  EXPECT_EQ(sizes(assign_buckets(big_first, {50}, true)), (std::vector<uint64_t>{1000, 10}));
}

TEST(DdpBuckets, BucketsArePerDtypeEachWithItsOwnLimitSequence) {
  const std::vector<BucketInput> t{{0, 80, DType::kF32}, {1, 40, DType::kBF16}, {2, 40, DType::kF32},
                                   {3, 40, DType::kBF16}, {4, 10, DType::kF32}};
  // float32: 80 < 100, 120 >= 100 closes [0, 2]; bfloat16: 80 < 100 stays open; float32 [4] open
  const auto b = assign_buckets(t, {100, 1000}, false);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].indices, (std::vector<uint32_t>{0, 2}));  // sorted by their smallest index
  EXPECT_EQ(b[0].dtype, DType::kF32);
  EXPECT_EQ(b[1].indices, (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(b[1].dtype, DType::kBF16);
  EXPECT_EQ(b[2].indices, (std::vector<uint32_t>{4}));
}

TEST(DdpBuckets, TheFirstIterationHasOneBucketPerDtypeWithoutFindUnusedParameters) {
  Scenario s = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"}, {"dp", "4"},
                                             {"find_unused_parameters", "false"}});
  const Estimate e = run(s);
  ASSERT_TRUE(e.ddp);
  ASSERT_EQ(e.ddp->initial_buckets.size(), 1u);  // bucket_size_limits = [sys.maxsize]
  EXPECT_EQ(e.ddp->initial_buckets[0], e.state.weights.value);  // float32 weights under bf16 autocast
  EXPECT_GT(e.ddp->rebuilt_buckets.size(), 1u);
  EXPECT_LE(e.ddp->rebuilt_buckets.front(), uint64_t{1024 * 1024} + 50257ull * 768 * 4);
  uint64_t total = 0;
  for (uint64_t b : e.ddp->rebuilt_buckets) total += b;
  EXPECT_EQ(total, e.state.weights.value);
}

// The rebuild at step 2's forward: initialize_buckets starts with buckets_.clear(), so the old bucket is freed
// before the new ones are allocated: the buckets' live bytes never exceed one set of gradients.
TEST(DdpBuckets, TheRebuildFreesTheOldBucketBeforeAllocatingTheNewOnes) {
  Scenario s = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"}, {"dp", "2"},
                                             {"find_unused_parameters", "false"}});
  const Estimate e = run(s);
  const size_t k = static_cast<size_t>(Category::kDdpBuckets);
  LiveBytes live;
  uint64_t max_ddp = 0;
  size_t frees = 0, allocs_after_free = 0;
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    if (ev.phase != Phase::kSetup) max_ddp = std::max(max_ddp, live.by_category[k].value);
    if (ev.category != Category::kDdpBuckets || ev.step != 2 || ev.phase != Phase::kForward) continue;
    if (ev.kind == Event::kFree) ++frees;
    if (ev.kind == Event::kAlloc && frees > 0) ++allocs_after_free;
  }
  EXPECT_EQ(frees, 1u);
  EXPECT_EQ(allocs_after_free, e.ddp->rebuilt_buckets.size());
  EXPECT_EQ(max_ddp, e.state.weights.value);  // never two sets of buckets (the construction aside)
}

TEST(DdpBuckets, GradientAsBucketViewLeavesNoGradientOfItsOwn) {
  auto with = [](const char* view) {
    return run(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"},
                                             {"dp", "2"}, {"gradient_as_bucket_view", view}}));
  };
  const Estimate v = with("true"), c = with("false");
  const size_t g = static_cast<size_t>(Category::kGradients);
  // after the last backward, before the optimizer: .grad is the bucket's view, or a tensor of its own
  auto grads_before_step = [&](const Estimate& e) {
    LiveBytes live;
    uint64_t at = 0;
    for (const Event& ev : e.sim->timeline.events) {
      if (ev.step == 2 && ev.phase == Phase::kOptimizer) break;
      apply(live, ev);
      at = live.by_category[g].value;
    }
    return at;
  };
  EXPECT_EQ(grads_before_step(v), 0u);
  EXPECT_EQ(grads_before_step(c), c.state.weights.value);
  EXPECT_EQ(v.state.gradients.value, 0u);
  EXPECT_LT(v.peak.live_total.value, c.peak.live_total.value);
}

TEST(DdpDefaults, TheTrainerFindsUnusedParametersUnlessCheckpointingAndNanoGptDoesNot) {
  auto ddp_of = [](std::initializer_list<std::pair<const char*, const char*>> extra) {
    std::vector<std::pair<std::string, std::string>> f{{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"},
                                                       {"dp", "2"}};
    for (const auto& [k, v] : extra) f.emplace_back(k, v);
    Scenario s = testing::scenario_of("gpt2", {});
    for (const auto& [k, v] : f) set_field(s, k, v);
    return *run(s).ddp;
  };
  const DdpFigures hf = ddp_of({});
  EXPECT_TRUE(hf.find_unused_parameters);   // Trainer: not model.is_gradient_checkpointing
  EXPECT_TRUE(hf.rebuilt_buckets.empty());  // should_rebuild_buckets is false with find_unused_parameters
  EXPECT_GT(hf.initial_buckets.size(), 1u);  // [1 MiB, 25 MiB] from the start
  EXPECT_FALSE(ddp_of({{"checkpointing", "full"}}).find_unused_parameters);
  const DdpFigures capped = ddp_of({{"find_unused_parameters", "false"}, {"bucket_cap_mb", "10"}});
  EXPECT_EQ(capped.bucket_cap_bytes, 10u * 1024 * 1024);
  EXPECT_EQ(capped.first_bucket_cap_bytes, 10u * 1024 * 1024);  // torch 2.x: an explicit cap for the first too
  EXPECT_EQ(ddp_of({{"bucket_cap_mb", "10"}, {"torch", "1.13"}}).first_bucket_cap_bytes, 1024u * 1024);
  // accelerate's to_kwargs drops a Trainer's 25 (the dataclass default): DDP sees bucket_cap_mb=None
  EXPECT_EQ(ddp_of({{"bucket_cap_mb", "25"}}).first_bucket_cap_bytes, 1024u * 1024);
  EXPECT_EQ(ddp_of({{"bucket_cap_mb", "25"}, {"loop", "plain"}}).first_bucket_cap_bytes, 25u * 1024 * 1024);
}

TEST(DdpDefaults, TheTrainerFindsUnusedParametersForALoraModelWhichIsNoPreTrainedModel) {
  // trainer.py _wrap_model: `elif isinstance(model, PreTrainedModel): not model.is_gradient_checkpointing` /
  // `else: kwargs["find_unused_parameters"] = True`; get_peft_model returns a PeftModel
  const auto figures = [](std::initializer_list<std::pair<const char*, std::string>> extra) {
    Scenario s = testing::scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=2"}, {"batch", "1"},
                                                         {"seq", "32"}, {"dp", "2"}, {"lora", "r=8"}});
    for (const auto& [k, v] : extra) set_field(s, k, v);
    return *run(s).ddp;
  };
  EXPECT_TRUE(figures({}).find_unused_parameters);
  EXPECT_TRUE(figures({{"checkpointing", "full"}}).find_unused_parameters);  // non-reentrant (5.x default): runs
  // reentrant checkpointing under find_unused_parameters=True: the Reducer's "Expected to mark a variable ready
  // only once"
  const std::string why = testing::error_of([&] { figures({{"checkpointing", "full"}, {"checkpoint_reentrant", "true"}}); });
  EXPECT_NE(why.find("Expected to mark a variable ready only once"), std::string::npos) << why;
}

TEST(DdpRefusals, DataParallelSettingsWithoutDataParallelismAreRefusedNotIgnored) {
  for (const auto& [field, value] : {std::pair<const char*, const char*>{"sharding", "zero3"},
                                     {"bucket_cap_mb", "5"},
                                     {"gradient_as_bucket_view", "true"},
                                     {"find_unused_parameters", "false"}}) {
    Scenario s = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}});
    set_field(s, field, value);
    try {
      run(s);
      ADD_FAILURE() << field << " was accepted with --dp 1";
    } catch (const FieldError& e) {
      EXPECT_EQ(e.field(), field);
    }
  }
}

TEST(DdpRefusals, BucketCapIsADecimalNumberOfMibOfAtLeastOneByte) {
  for (const char* bad : {"0x10", "1e3", " 5", "5 ", ".", "1.2.3", "-1", "0", "0.0000001", "1048577"}) {
    Scenario s;
    EXPECT_THROW(set_field(s, "bucket_cap_mb", bad), FieldError) << bad;
  }
  Scenario s;
  set_field(s, "bucket_cap_mb", "0.5");
  EXPECT_EQ(*s.train.bucket_cap_mb, 0.5);
  set_field(s, "bucket_cap_mb", "");  // an empty value: not given (what the loop passes)
  EXPECT_FALSE(s.train.bucket_cap_mb.has_value());
}

TEST(Gpus, NxAGpuIsTheRanksOnThatGpu) {
  // --gpus 8xh100-80gb: --dp 8 on the H100 (data parallelism is the only parallelism simulated so far)
  const ResolvedScenario r = resolve(testing::scenario_of("gpt2", {{"gpus", "8xH100-80GB"}}), testing::MapFileReader());
  EXPECT_EQ(r.setup.dp, 8u);
  ASSERT_TRUE(r.gpu.has_value());
  EXPECT_EQ(r.gpu->name, "h100-80gb");
  EXPECT_EQ(resolve(testing::scenario_of("gpt2", {{"gpus", "4x24GiB"}}), testing::MapFileReader()).setup.dp, 4u);
  // the same facts given twice must agree
  const auto field_of = [](std::initializer_list<std::pair<const char*, std::string>> f) {
    try {
      resolve(testing::scenario_of("gpt2", f), testing::MapFileReader());
    } catch (const FieldError& e) {
      return e.field();
    }
    return std::string("accepted");
  };
  EXPECT_EQ(field_of({{"gpus", "8xh100-80gb"}, {"dp", "4"}}), "gpus");
  EXPECT_EQ(field_of({{"gpus", "8xh100-80gb"}, {"gpu", "a100-80gb"}}), "gpus");
  EXPECT_EQ(field_of({{"gpus", "8xh100-80gb"}, {"dp", "8"}, {"gpu", "h100-80gb"}}), "accepted");
  EXPECT_EQ(field_of({{"gpus", "8xnot-a-gpu"}}), "gpus");
  for (const char* bad : {"8", "x8", "8x", "0xh100-80gb", "-1xh100-80gb", "8.5xh100-80gb"}) {
    Scenario s;
    EXPECT_THROW(set_field(s, "gpus", bad), FieldError) << bad;
  }
}

TEST(DdpReport, SaysWhenTheRebuildFallsPastTheSimulatedSteps) {
  const Estimate e = run(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"},
                                                       {"dp", "2"}, {"find_unused_parameters", "false"},
                                                       {"steps", "1"}}));
  EXPECT_TRUE(e.ddp->rebuilds);
  EXPECT_TRUE(e.ddp->rebuilt_buckets.empty());
  const std::string t = render_estimate_table(e, nullptr);
  EXPECT_NE(t.find("past the simulated steps"), std::string::npos) << t;
  EXPECT_EQ(t.find("find_unused_parameters=True keeps"), std::string::npos) << t;
  const Estimate two = run(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"},
                                                         {"dp", "2"}, {"find_unused_parameters", "false"}}));
  EXPECT_EQ(two.ddp->rebuild_step, 2u);
}

TEST(DdpRefusals, OtherShardingsAndTheSeed000LoopAreNotSimulated) {
  Scenario s = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"dp", "2"}, {"sharding", "fsdp1"}});
  try {
    run(s);
    FAIL() << "fsdp1 is not simulated for gpt2";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("no FSDP unit hooks yet"), std::string::npos) << err.what();
  }
  Scenario n = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"dp", "2"}, {"loop", "seed000"}});
  EXPECT_THROW(run(n), Error);
}

TEST(DdpReport, SaysPerRankAndShowsTheBucketsAsTheirOwnCategory) {
  const Estimate e = run(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"},
                                                       {"dp", "8"}}));
  const std::string t = render_estimate_table(e, nullptr);
  EXPECT_NE(t.find("per rank, 8 ranks (DDP)"), std::string::npos) << t;
  EXPECT_NE(t.find("ddp buckets"), std::string::npos) << t;
  EXPECT_NE(t.find("NCCL"), std::string::npos) << t;
}

}  // namespace
}  // namespace trainmem
