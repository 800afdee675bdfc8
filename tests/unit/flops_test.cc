// FLOPs counted by the simulated ops (flops.h), against counts made here by hand from the shapes, seed 002's
// closed form and the 6N·tokens rule where their assumptions hold, and the step time's arithmetic (step_time.cc).
// B=micro-batch T=seq h=hidden L=layers V=vocab H=heads D=head-dim
#include "trainmem/flops.h"
#include "trainmem/formulas.h"
#include "trainmem/report.h"

#include <gtest/gtest.h>

#include <cmath>

#include "test_util.h"

namespace trainmem {
namespace {

uint64_t products(const FlopLedger& l, WorkPhase p) {
  return l.flops[static_cast<size_t>(p)][static_cast<size_t>(FlopKind::kMatmul)] +
         l.flops[static_cast<size_t>(p)][static_cast<size_t>(FlopKind::kAttention)];
}
uint64_t of(const FlopLedger& l, WorkPhase p, FlopKind k) { return l.flops[static_cast<size_t>(p)][static_cast<size_t>(k)]; }

// GPT-2 small's shapes (its config.json: n_embd 768, n_layer 12, n_head 12, vocab 50257, n_inner None = 4h)
constexpr uint64_t kH = 768, kL = 12, kV = 50257, kHeads = 12, kD = 64;

// One layer's forward products by hand: c_attn (T,h)x(h,3h), c_proj (T,h)x(h,h), c_fc (T,h)x(h,4h),
// mlp c_proj (T,4h)x(4h,h): 2BT·h·(3h + h + 4h + 4h) = 24BTh^2; QK^T and AV over every pair: 2·2·B·T·T·h.
uint64_t layer_forward(uint64_t B, uint64_t T) { return 24 * B * T * kH * kH + 4 * B * T * T * kH; }
uint64_t head_forward(uint64_t B, uint64_t T) { return 2 * B * T * kH * kV; }

Estimate gpt2(std::initializer_list<std::pair<const char*, std::string>> extra) {
  Scenario s = testing::scenario_of("gpt2", {{"batch", "2"}, {"seq", "64"}});
  for (const auto& [f, v] : extra) set_field(s, f, v);
  return testing::run(s);
}

TEST(Flops, EagerGpt2ProductsAreThreeForwardsAndMatchSeed002PlusTheHead) {
  const Estimate e = gpt2({{"attention", "eager"}});
  const FlopLedger& l = e.sim->flops;
  const uint64_t fwd = kL * layer_forward(2, 64) + head_forward(2, 64);
  EXPECT_EQ(products(l, WorkPhase::kForward), fwd);
  EXPECT_EQ(products(l, WorkPhase::kBackward), 2 * fwd);  // every product's two gradients
  EXPECT_EQ(products(l, WorkPhase::kRecompute), 0u);
  EXPECT_EQ(of(l, WorkPhase::kForward, FlopKind::kAttention), 0u);  // eager attention: bmm products
  // seed 002: 2·L·3b(12sh^2 + 2s^2h) FLOPs, exactly the layers' products; the head (6bshv) is what it omits
  const Seed002Flops s = seed002_flops(e.model, build_inventory(e.model), e.setup);
  EXPECT_EQ(s.layer_macs, 3 * 2 * (12 * 64 * kH * kH + 2 * 64 * 64 * kH));
  EXPECT_EQ(products(l, WorkPhase::kForward) + products(l, WorkPhase::kBackward), s.layers_flops + s.head_flops);
  // 6N·tokens counts every parameter (the embeddings too, which do no product here) and no attention
  const uint64_t N = 124439808;  // GPT-2 small with its position table (the model card's 124M; trainmem models)
  EXPECT_EQ(s.six_n_tokens, 6 * N * 2 * 64);
}

// The loop simulates two micro-batches of a step (the first for every one before the last), so a step of 5 must
// still count five micro-batches' products, and the step time five micro-batches' tokens.
TEST(Flops, GradientAccumulationCountsEveryMicroBatchOfTheStep) {
  const uint64_t fwd = kL * layer_forward(2, 64) + head_forward(2, 64);
  for (const char* accum : {"1", "2", "5"}) {
    const Estimate e = gpt2({{"attention", "eager"}, {"grad_accum", accum}, {"gpu", "h100-80gb"}});
    const uint64_t m = std::stoull(accum);
    EXPECT_EQ(products(e.sim->flops, WorkPhase::kForward), m * fwd) << accum;
    EXPECT_EQ(products(e.sim->flops, WorkPhase::kBackward), 2 * m * fwd) << accum;
    ASSERT_TRUE(e.time) << accum;
    EXPECT_EQ(e.time->tokens, m * 2 * 64) << accum;
  }
}

TEST(Flops, FullCheckpointingRecomputesEachLayersForwardOnce) {
  const Estimate e = gpt2({{"attention", "eager"}, {"checkpointing", "full"}});
  const FlopLedger& l = e.sim->flops;
  EXPECT_EQ(products(l, WorkPhase::kRecompute), kL * layer_forward(2, 64));  // the head is not checkpointed
  EXPECT_EQ(products(l, WorkPhase::kForward), kL * layer_forward(2, 64) + head_forward(2, 64));
  EXPECT_EQ(products(l, WorkPhase::kBackward), 2 * (kL * layer_forward(2, 64) + head_forward(2, 64)));
}

TEST(Flops, FusedCausalAttentionCountsThePairsOnOrBelowTheDiagonalAndFlashRecomputesQK) {
  const uint64_t B = 2, T = 64;
  const Estimate e = gpt2({{"gpu", "a100-80gb"}});  // sdpa, bf16 autocast, sm_80: the flash kernel
  const FlopLedger& l = e.sim->flops;
  const uint64_t pairs = B * kHeads * T * (T + 1) / 2;
  EXPECT_EQ(of(l, WorkPhase::kForward, FlopKind::kAttention), kL * (2 * pairs * kD + 2 * pairs * kD));
  // S = QK^T again, dV, dP, dQ, dK: five products of 2·pairs·D
  EXPECT_EQ(of(l, WorkPhase::kBackward, FlopKind::kAttention), kL * 5 * 2 * pairs * kD);
  EXPECT_EQ(of(l, WorkPhase::kForward, FlopKind::kMatmul), kL * 24 * B * T * kH * kH + head_forward(B, T));
}

TEST(Flops, AdamWCountsFourteenFlopsPerTrainableElementPerStep) {
  const Estimate e = gpt2({{"optimizer_impl", "fused"}});
  const uint64_t N = 124439808;
  EXPECT_EQ(of(e.sim->flops, WorkPhase::kOptimizer, FlopKind::kOptimizer), 14 * N);
  EXPECT_EQ(e.sim->flops.bytes[static_cast<size_t>(WorkPhase::kOptimizer)][static_cast<size_t>(FlopKind::kOptimizer)],
            7 * 4 * N);  // fused: param, grad, exp_avg, exp_avg_sq read; three written; float32
}

TEST(Flops, LoraAddsTheAdaptersProductsOnly) {
  // PEFT's default targets for GPT-2: c_attn (h -> 3h); r = 8: lora_A (T,h)x(h,r), lora_B (T,r)x(r,3h)
  const uint64_t B = 2, T = 64, r = 8;
  const Estimate base = gpt2({{"attention", "eager"}});
  const Estimate lora = gpt2({{"attention", "eager"}, {"lora", "r=8"}});
  const uint64_t adapters = kL * 2 * B * T * (kH * r + r * 3 * kH);
  EXPECT_EQ(products(lora.sim->flops, WorkPhase::kForward), products(base.sim->flops, WorkPhase::kForward) + adapters);
  // backward: frozen weights need no weight gradient (the input gradient still flows through every layer), the
  // adapters need both
  EXPECT_LT(products(lora.sim->flops, WorkPhase::kBackward), products(base.sim->flops, WorkPhase::kBackward));
}

TEST(StepTime, OnlyWithAGpuWhosePeaksAreCatalogued) {
  EXPECT_FALSE(gpt2({}).time);
  EXPECT_FALSE(gpt2({{"gpu", "a10g"}}).time);  // no datasheet row for the A10G yet
  const Estimate e = gpt2({{"gpu", "h100-80gb"}});
  ASSERT_TRUE(e.time);
  const StepTime& t = *e.time;
  EXPECT_NEAR(t.step_seconds, t.compute_bound_seconds + t.memory_bound_seconds + t.launch_seconds +
                                  t.comm_exposed_seconds, 1e-12);
  EXPECT_EQ(t.tokens, 2u * 64u);
  EXPECT_NEAR(t.tokens_per_second, 128.0 / t.step_seconds, 1e-6);
  EXPECT_EQ(t.peak_tflops, 989.5);  // H100 SXM BF16 dense (datasheet 1,979 with sparsity)
  EXPECT_NEAR(t.mfu, static_cast<double>(t.model_flops) / (t.step_seconds * 989.5e12), 1e-12);
  double phases = 0;
  for (double p : t.phase_seconds) phases += p;
  EXPECT_NEAR(phases, t.compute_bound_seconds + t.memory_bound_seconds + t.launch_seconds, 1e-12);
}

TEST(StepTime, DdpAllReducesEveryGradientByteOverTheRing) {
  // dp = 2 on A100s: the buckets hold every float32 gradient once; ring all-reduce moves 2(n-1)/n of them over
  // the 300 GB/s (per direction) NVLink
  const Estimate e = gpt2({{"gpu", "a100-80gb"}, {"dp", "2"}});
  ASSERT_TRUE(e.time);
  const double grads = 4.0 * 124439808;
  EXPECT_NEAR(e.time->comm_seconds, 2.0 * 1 / 2 * grads / 300e9, 1e-12);
  EXPECT_GE(e.time->comm_exposed_seconds, 0.0);
  EXPECT_LE(e.time->comm_exposed_seconds, e.time->comm_seconds);
  EXPECT_EQ(e.time->tokens, 2u * 2u * 64u);  // both ranks' micro-batches
}

TEST(StepTime, ZeroReduceScattersTheGradientsAndAllGathersTheParameters) {
  // DeepSpeed ZeRO-2 over 2 A100s: the bit16 flat buffer reduce-scattered (during the backward) and all-gathered
  // (after the step), (n-1)/n of it each over the 300 GB/s link; the all-gather is always exposed
  const Estimate e = gpt2({{"gpu", "a100-80gb"}, {"dp", "2"}, {"sharding", "zero2"}, {"precision", "bf16"}});
  ASSERT_TRUE(e.time && e.zero);
  const double flat = static_cast<double>(e.zero->bit16_flat.value);
  EXPECT_NEAR(e.time->comm_seconds, 2 * (0.5 * flat / 300e9), 1e-12);
  EXPECT_GE(e.time->comm_exposed_seconds, 0.5 * flat / 300e9 - 1e-12);
}

TEST(StepTime, ContextParallelTimesTheRingsExchangesAsExposed) {
  // --cp 2 at seq 32: 16 tokens per rank, 4 KV heads of 64, bf16. Per layer: the forward's and the backward's K/V
  // all-gather, output 2 x (2 x 1 x 4 x 16 x 64) x 2 bytes = 32,768, (n-1)/n of it over the link; two float32
  // dK/dV permutes (one per ring step), 2 x 1 x 4 x 16 x 64 x 4 = 32,768 bytes each, whole. Two layers, the
  // H100's 450 GB/s NVLink per direction; all of it exposed (step_time.cc: an upper bound).
  const Estimate e = testing::run(testing::scenario_of(
      "tinyllama-1.1b", {{"overrides", "num_hidden_layers=2"}, {"batch", "1"}, {"seq", "32"}, {"cp", "2"}, {"precision", "bf16"},
                         {"gpu", "h100-80gb"}, {"steps", "1"}}));
  ASSERT_TRUE(e.time);
  const double per_layer = 2 * (0.5 * 32768 / 450e9) + 2 * (32768 / 450e9);
  EXPECT_NEAR(e.time->comm_seconds, 2 * per_layer, 1e-15);
  EXPECT_NEAR(e.time->comm_exposed_seconds, 2 * per_layer, 1e-15);
  // each of the two CP ranks holds 16 of every sequence's 32 tokens: one step trains 32 tokens
  EXPECT_EQ(e.time->tokens, 32u);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

TEST(Flops, MixtureOfExpertsCountsOnlyTheRoutedRows) {
  // Mixtral's shapes (config.json): hidden 4096, intermediate 14336, 32 heads, 8 key/value heads of 128, vocab
  // 32000, 8 experts, top-2. One layer, B = 1, T = 64: 128 routed rows whichever experts they go to.
  constexpr uint64_t C = 4096, F = 14336, T = 64, V = 32000, E = 8, k = 2;
  for (const char* routing : {"balanced", "worst"}) {
    const Estimate e = testing::run(testing::scenario_of(
        "mixtral-8x7b", {{"overrides", "num_hidden_layers=1"}, {"precision", "bf16"}, {"batch", "1"}, {"seq", "64"},
                         {"moe_routing", routing}}));
    const uint64_t attention_linears = 2 * T * C * (C + 1024 + 1024 + C);  // q, k, v (8 x 128), o
    const uint64_t router = 2 * T * C * E;
    const uint64_t experts = T * k * 2 * 3 * C * F;  // gate, up, down for each routed row only
    const uint64_t head = 2 * T * C * V;
    // the rotary embedding's inv_freq_expanded @ position_ids_expanded: (D/2, 1) x (1, T) once per forward
    const uint64_t rotary = 2 * (128 / 2) * T * 1;
    EXPECT_EQ(of(e.sim->flops, WorkPhase::kForward, FlopKind::kMatmul),
              attention_linears + router + experts + head + rotary)
        << routing;
  }
}

TEST(Flops, ATensorParallelRankCountsItsLocalShapes) {
  // transformers' tp_plan for Llama: q/k/v/gate/up and lm_head column-wise, o/down row-wise: every product of a
  // rank is half of the whole model's at tp = 2 (and so is attention, over half the heads); the rotary
  // embedding's (D/2, 1) x (1, T) product (D = 64) is every rank's whole
  auto run = [](const char* tp) {
    return testing::run(testing::scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=2"}, {"batch", "1"},
                                                               {"seq", "64"}, {"precision", "bf16"}, {"tp", tp}}));
  };
  const Estimate one = run("1"), two = run("2");
  const uint64_t rotary = 2 * 32 * 64;
  EXPECT_EQ(2 * (products(two.sim->flops, WorkPhase::kForward) - rotary),
            products(one.sim->flops, WorkPhase::kForward) - rotary);
  EXPECT_GT(two.sim->flops.tp_all_reduces[static_cast<size_t>(WorkPhase::kForward)], 0u);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

TEST(Flops, RingAttentionCountsRankZerosPairsPerStep) {
  // --cp 2, TinyLlama (32 heads of 64), one layer, seq 256: rank 0 holds 128 tokens; step 0 is causal over its own
  // 128 x 128 (128·129/2 pairs per head), step 1 takes the second half of its queries (64) against the other
  // rank's 128 keys (the head-tail load balancer, cp.h ring_steps)
  const Estimate e = testing::run(testing::scenario_of(
      "tinyllama-1.1b", {{"overrides", "num_hidden_layers=1"}, {"batch", "1"}, {"seq", "256"}, {"cp", "2"}}));
  const uint64_t pairs = 32 * (128 * 129 / 2 + 64 * 128);
  EXPECT_EQ(of(e.sim->flops, WorkPhase::kForward, FlopKind::kAttention), 4 * pairs * 64);
  EXPECT_EQ(of(e.sim->flops, WorkPhase::kBackward, FlopKind::kAttention), 10 * pairs * 64);
}

}  // namespace
}  // namespace trainmem
