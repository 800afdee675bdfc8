// trainmem fit: the margin grammar, the search's answer (it fits, the next size does not), agreement with a
// plain estimate at the answer, the measured seed 000 run, and the suggestions for a setup that never fits.
#include "trainmem/fit.h"
#include "trainmem/report.h"

#include <gtest/gtest.h>

#include <map>

#include "test_util.h"

namespace trainmem {
namespace {

using testing::error_of;

TEST(Margin, ParsesSharesAndSizes) {
  EXPECT_EQ(parse_margin("5%").basis_points, 500u);
  EXPECT_FALSE(parse_margin("5%").bytes);
  EXPECT_EQ(parse_margin("2.5%").basis_points, 250u);
  EXPECT_EQ(parse_margin("0.25%").basis_points, 25u);
  EXPECT_EQ(parse_margin("0%").basis_points, 0u);
  EXPECT_EQ(parse_margin("2GiB").bytes, Bytes(2 * kGiB));
  EXPECT_EQ(parse_margin("512MiB").bytes, Bytes(512 * kMiB));
  EXPECT_EQ(parse_margin("1000B").bytes, Bytes(1000));
  EXPECT_EQ(parse_margin("0").bytes, Bytes(0));
}

TEST(Margin, RejectsWhatIsNotAShareOrASize) {
  // a bare number other than 0 is refused: "--margin 5" is a forgotten "%" more likely than five bytes
  for (const char* bad : {"", "%", "100%", "150%", "-5%", "5.%", "1.234%", "abc", "2GB", "-1", "1e9", "2 GiB",
                          "99999999999999999999", "5", "123456"}) {
    EXPECT_NE(error_of([&] { parse_margin(bad); }).find("margin \""), std::string::npos) << bad;
  }
}

TEST(Margin, AShareIsTakenOfTheRuntimeTotal) {
  const GpuSpec& gpu = find_gpu("a100-80gb");
  EXPECT_EQ(parse_margin("5%").of(gpu).value, gpu.runtime_total.value / 20);
  EXPECT_EQ(parse_margin("0%").of(gpu).value, 0u);
  EXPECT_EQ(parse_margin("1GiB").of(gpu), Bytes(kGiB));
}

// nanoGPT GPT-2 small at T=1024 with bf16 autocast: the default nanoGPT setup.
struct Gpt2Small {
  ModelSpec m = testing::preset("nanogpt-gpt2", AttnImpl::kEager);
  TrainSetup s;
  SimOptions o;
  Gpt2Small() {
    s.seq = 1024;
    s.precision = Precision::kBf16Amp;
  }
};

FitRequest margin(const char* m) {
  FitRequest r;
  r.margin = parse_margin(m);
  return r;
}

TEST(Fit, TheAnswerFitsAndTheNextBatchDoesNot) {
  Gpt2Small x;
  const FitResult r = fit(x.m, x.s, x.o, {}, find_gpu("a100-40gb"), margin("5%"));
  ASSERT_TRUE(r.largest);
  bool fits = false, next = true;
  for (const FitProbe& p : r.probes) {
    if (p.batch == *r.largest) fits = p.fits;
    if (p.batch == *r.largest + 1) next = p.fits;
    EXPECT_EQ(p.seq, 1024u);
    if (p.fits) {
      EXPECT_LE(p.reserved_on_device, r.limit) << p.batch;  // what the allocator reserves stays under the limit
      EXPECT_EQ(p.device_total, p.reserved_on_device + r.gpu.context);
    } else {
      EXPECT_LT(p.headroom, 0) << p.batch;
      EXPECT_NE(p.failure.find("out of memory in the"), std::string::npos) << p.failure;
    }
  }
  EXPECT_TRUE(fits);
  EXPECT_FALSE(next);
  for (size_t i = 1; i < r.probes.size(); ++i) EXPECT_LT(r.probes[i - 1].batch, r.probes[i].batch);
  EXPECT_EQ(r.setup.batch, *r.largest);
}

// The search is only as good as its probes: one that fits needed no more than the limit, and one that does
// not fit needs more. A larger card never gives a smaller answer.
TEST(Fit, LargerCardsNeverFitLess) {
  Gpt2Small x;
  uint64_t previous = 0;
  for (const char* gpu : {"t4", "a10g", "a100-40gb", "a100-80gb", "h200"}) {
    const FitResult r = fit(x.m, x.s, x.o, {}, find_gpu(gpu), margin("0%"));
    const uint64_t got = r.largest.value_or(0);
    EXPECT_GE(got, previous) << gpu;
    previous = got;
  }
}

// Seed 000 trained nanoGPT GPT-2 small at B=12, T=1024 (float16 autocast, PyTorch 2.0) on an A100; its
// measured max_memory_reserved was 25,910,312,960 B. On either A100 that batch must fit, with no margin.
TEST(Fit, Seed000sMeasuredBatchFitsTheA100) {
  const testing::Seed000Run run(3);
  for (const char* gpu : {"a100-80gb", "a100-40gb"}) {
    const FitResult r = fit(run.m, run.s, run.o, {}, find_gpu(gpu), margin("0%"));
    ASSERT_TRUE(r.largest) << gpu;
    EXPECT_GE(*r.largest, 12u) << gpu;
  }
}

TEST(Fit, AWiderMarginNeverAllowsALargerBatch) {
  Gpt2Small x;
  uint64_t previous = UINT64_MAX;
  for (const char* m : {"0%", "5%", "20%", "50%"}) {
    const FitResult r = fit(x.m, x.s, x.o, {}, find_gpu("a100-80gb"), margin(m));
    ASSERT_TRUE(r.largest) << m;
    EXPECT_LE(*r.largest, previous) << m;
    previous = *r.largest;
  }
}

TEST(Fit, SequenceSearchStopsAtALearnedPositionTable) {
  const ModelSpec m = testing::preset("gpt2");
  TrainSetup s;
  s.batch = 1;
  FitRequest req = margin("5%");
  req.solve = FitDimension::kSeq;
  const FitResult r = fit(m, s, SimOptions{}, {}, find_gpu("h200"), req);
  ASSERT_TRUE(r.largest);
  EXPECT_EQ(*r.largest, 1024u);
  EXPECT_TRUE(r.capped);
  EXPECT_EQ(r.cap, 1024u);
}

TEST(Fit, ASetupThatNeverFitsGetsSimulatedAlternatives) {
  // Llama-3-8B with float32 AdamW state (bf16 autocast) needs ~128 GB for weights, gradients and moments.
  const ModelSpec m = testing::preset("llama-3-8b");
  const TrainSetup s = testing::train_setup(1, 2048);
  SimOptions o;
  const GpuSpec& gpu = find_gpu("h100-80gb");
  const FitResult r = fit(m, s, o, {}, gpu, margin("5%"));
  EXPECT_FALSE(r.largest);
  ASSERT_EQ(r.probes.size(), 1u);
  EXPECT_FALSE(r.probes[0].fits);
  EXPECT_NE(r.probes[0].failure.find("out of memory in the"), std::string::npos);
  bool bf16 = false, checkpointing = false;
  int64_t full_saves = 0, selective_saves = 0;
  for (const FitSuggestion& sg : r.suggestions) {
    if (cli_words(sg) == "--precision bf16") {
      bf16 = true;
      ASSERT_TRUE(sg.at_one);
      // The same setup with bf16 weights, simulated directly.
      TrainSetup s2 = s;
      s2.precision = Precision::kBf16;
      SimOptions o2 = o;
      o2.sm = gpu.sm;
      const Estimate e = estimate(m, build_inventory(m), s2, o2);
      EXPECT_EQ(sg.at_one->peak_allocated, e.memory.peak_allocated);
      EXPECT_EQ(sg.saves, static_cast<int64_t>(r.probes[0].peak_reserved.value) -
                              static_cast<int64_t>(sg.at_one->peak_reserved.value));
      EXPECT_GT(sg.saves, static_cast<int64_t>(40 * kGiB));  // 4 bytes of 8 B parameters x 3 states saved, at least
    }
    if (cli_words(sg) == "--checkpointing full") {
      checkpointing = true;
      ASSERT_TRUE(sg.at_one);  // simulated, recompute and all
      EXPECT_GT(sg.saves, 0);
      full_saves = sg.saves;
    }
    if (cli_words(sg) == "--checkpointing selective") {
      ASSERT_TRUE(sg.at_one);  // simulated: the kept matmul and attention outputs, the recompute of the rest
      selective_saves = sg.saves;
    }
    if (sg.at_one && sg.at_one->fits) EXPECT_TRUE(sg.largest);
  }
  EXPECT_TRUE(bf16);
  EXPECT_TRUE(checkpointing);
  // selective keeps more of each layer than full: it saves memory, but less
  EXPECT_GT(selective_saves, 0);
  EXPECT_LT(selective_saves, full_saves);
}

TEST(Fit, SequenceSearchWithoutAPositionLimitStopsWhereMemoryDoes) {
  // Qwen3 uses rotary embeddings: no table limits the sequence, the device does.
  const ModelSpec m = testing::preset("qwen3-0.6b");
  TrainSetup s;
  s.batch = 1;
  s.precision = Precision::kBf16;
  FitRequest req = margin("5%");
  req.solve = FitDimension::kSeq;
  const FitResult r = fit(m, s, SimOptions{}, {}, find_gpu("a100-40gb"), req);
  ASSERT_TRUE(r.largest);
  EXPECT_FALSE(r.capped);
  EXPECT_GT(*r.largest, 4096u);
  EXPECT_LT(*r.largest, r.cap);
}

TEST(Fit, ALayerStackHasNoSequenceToSolve) {
  const ModelSpec m = testing::from_json(R"({"model_type": "mlp", "input": 256, "layers": [{"linear": 250}]})");
  FitRequest req;
  req.solve = FitDimension::kSeq;
  EXPECT_NE(error_of([&] { fit(m, TrainSetup{}, SimOptions{}, {}, find_gpu("t4"), req); }).find("no sequence axis"),
            std::string::npos);
}

TEST(Fit, AMarginThatLeavesNothingIsRefused) {
  const ModelSpec m = testing::preset("gpt2");
  EXPECT_NE(error_of([&] { fit(m, TrainSetup{}, SimOptions{}, {}, find_gpu("t4"), margin("15GiB")); })
                .find("leaves nothing"),
            std::string::npos);
}

TEST(Fit, ChangesThatSaveNothingAreNotSuggested) {
  // GPT-2 small on a T4 with 14.5 GiB kept free: nothing fits; at seq 512 fused AdamW saves nothing at
  // micro-batch 1 (its foreach temporaries fit in blocks the step has cached already; at other lengths the
  // placement differs and fused saves a few MiB, so the example's length matters, not its value).
  const ModelSpec m = testing::preset("gpt2");
  TrainSetup s;
  s.seq = 512;
  SimOptions o;
  const FitResult r = fit(m, s, o, {}, find_gpu("t4"), margin("99%"));
  ASSERT_FALSE(r.largest);
  ASSERT_EQ(r.not_helpful.size(), 1u);
  EXPECT_EQ(cli_words(r.not_helpful[0]), "--optimizer-impl fused");
  for (const FitSuggestion& sg : r.suggestions) {
    if (sg.at_one) EXPECT_TRUE(sg.saves > 0 || sg.at_one->fits) << cli_words(sg);
  }
}

TEST(Fit, DimensionNamesParse) {
  EXPECT_EQ(parse_fit_dimension("batch"), FitDimension::kBatch);
  EXPECT_EQ(parse_fit_dimension("seq"), FitDimension::kSeq);
  EXPECT_EQ(parse_fit_dimension("tokens"), std::nullopt);
}

TEST(Fit, SeveralDdpRanksAreOfferedTheShardingsLeastShardedFirstAndTheSmallestThatFitsIsNamed) {
  // Llama-3-8B on 8 H100s under DDP: each rank holds every state in float32 (bf16 autocast) and does not fit.
  // ZeRO-1 partitions the optimizer state, ZeRO-2 the gradients too (both with ZeRO's bf16 weights), FSDP2 and
  // ZeRO-3 the parameters as well: each is simulated, each fits here, and ZeRO-1, the least sharded, is named.
  Scenario s = testing::scenario_of("llama-3-8b", {{"gpus", "8xh100-80gb"}, {"seq", "2048"}});
  FitRequest req;
  const FitResult r = fit(s, req, testing::MapFileReader());
  EXPECT_FALSE(r.largest.has_value());
  std::vector<std::string> tried;
  for (const FitSuggestion& sug : r.suggestions) {
    if (sug.changes.front().field != "sharding") continue;
    tried.push_back(sug.changes.front().value);
    EXPECT_TRUE(sug.at_one->fits) << sug.changes.front().value;
    if (sug.changes.front().value == "fsdp2" || sug.changes.front().value == "fsdp1") {
      EXPECT_EQ(sug.changes.size(), 1u);  // accelerate's mixed precision: the setup's bf16-amp stays
      continue;
    }
    ASSERT_EQ(sug.changes.size(), 2u);
    EXPECT_EQ(sug.changes[1].field, "precision");
    EXPECT_EQ(sug.changes[1].value, "bf16");
  }
  EXPECT_EQ(tried, (std::vector<std::string>{"zero1", "zero2", "fsdp2", "fsdp1", "zero3"}));
  ASSERT_EQ(r.sharding_ladder.size(), 5u);
  EXPECT_EQ(r.smallest_sharding, "zero1");
  // more sharding saves more: ZeRO-1 reserves more than ZeRO-2, which reserves more than FSDP2, at micro-batch 1
  std::map<std::string, uint64_t> reserved;
  for (const FitSuggestion& sug : r.suggestions) reserved[sug.changes.front().value] = sug.at_one->peak_reserved.value;
  EXPECT_GT(reserved["zero1"], reserved["zero2"]);
  EXPECT_GT(reserved["zero2"], reserved["fsdp2"]);
  // nanoGPT's loop is not the Trainer's: DeepSpeed's rank is not simulated there, so it is not offered
  Scenario n = testing::scenario_of("nanogpt-gpt2", {{"gpus", "8xa100-40gb"}, {"seq", "1024"}});
  for (const FitSuggestion& sug : fit(n, req, testing::MapFileReader()).suggestions) {
    EXPECT_NE(sug.changes.front().field, "sharding");
  }
}

}  // namespace
}  // namespace trainmem
