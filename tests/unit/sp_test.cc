// Sequence parallelism with tensor parallelism (sp.h): PyTorch-native TP + SP with torchtitan's plan on
// transformers' Llama modules. The saved activations per layer against closed forms derived by hand from the
// program (modeling_llama.py, torch.distributed.tensor.parallel's styles, DTensor's redistribute and autograd's
// save rules), set beside Korthikanti et al. 2022 Table 2 (seed 002), the per-step collective bytes counted by
// hand from the plan, the rank's shards, and the refusals.
#include <fmt/format.h>

#include <string>

#include "test_util.h"
#include "trainmem/inventory.h"
#include "trainmem/report.h"
#include "trainmem/sp.h"
#include "trainmem/tp.h"

namespace trainmem {
namespace {

using testing::MapFileReader;
using testing::scenario_of;

Scenario llama(std::initializer_list<std::pair<const char*, std::string>> fields) {
  Scenario s = scenario_of("llama-3-8b", {{"steps", "1"}});
  for (const auto& [f, v] : fields) set_field(s, f, v);
  return s;
}

// saved_activations of a one- and a two-layer llama-3-8b: their difference is one decoder layer's
uint64_t simulated_layer_saved(uint64_t t, bool sp, const char* precision, uint64_t seq, uint64_t batch) {
  auto saved = [&](int layers) {
    Scenario s = llama({{"precision", precision}, {"tp", std::to_string(t)}, {"batch", std::to_string(batch)},
                        {"seq", std::to_string(seq)}, {"sequence_parallel", sp ? "true" : "false"}});
    set_field(s, "overrides", fmt::format("num_hidden_layers={}", layers));
    return testing::run(s).peak.saved_activations.value;
  };
  return saved(2) - saved(1);
}

// One LlamaDecoderLayer's saved bytes with sdpa attention (is_causal, memory-efficient/flash kernel: no s^2
// term), no dropout, derived op by op. s tokens, b sequences, h hidden, a heads, g kv heads, D head dim, F ffn,
// t ranks (the rank's a/t heads, g/t kv heads, F/t ffn).
//
// bf16 weights (no autocast):
//   each LlamaRMSNorm saves h.to(float32) (pow and h * rsqrt: 4 bytes), rsqrt's (.., 1) output (4), and
//   h.to(bf16) (weight * h: 2): 6sbh + 4sb per norm on the tokens it sees
//   transformers' TP (no SP): the norms see s tokens, and each norm's (s, b, h) output is saved by the linears
//     after it (all_reduce_backward passes a view): 2 x (6sbh + 4sb + 2sbh) = 16sbh + 8sb
//   TP + SP: the norms see s/t tokens (SequenceParallel): (12sbh + 8sb)/t; the linears after each save
//     PrepareModuleInput's gathered (s, b, h) (one tensor shared by q/k/v, one by gate/up): 2 x 2sbh = 4sbh
//   attention (both): sdpa saves q_embed 2sb(aD/t), k_embed and v 2sb(gD/t) each, its output 2sb(aD/t) (also
//     o_proj's input) and logsumexp 4b(a/t)s: sb(4aD + 4gD)/t + 4abs/t; rotary saves cos/sin (not per layer)
//   MLP (both): gate's output (silu), silu's output and up's output (the product), the product (down_proj):
//     4 x 2sb(F/t) = 8sbF/t; the rowwise outputs (all_reduce clone, or reduce-scatter shard) are not saved
//
// bf16 autocast over fp32 weights (the default): the residual stream is float32. Each norm's input is the fp32
//   layer input or residual (h.to(float32) is a no-op, so the norm saves the input itself: 4sbh) plus its fp32
//   normalized output (4sbh) and rsqrt; the linears after a norm each save their own bf16 autocast copy of the
//   (gathered, for SP) norm output: 5 x 2sbh = 10sbh, full sequence in both programs; q and k are cast again
//   for sdpa (2sb(aD/t), 2sb(gD/t)); v_proj's bf16 output is saved as v. Per layer: the layer input and the
//   attention residual (4sbh each), two normalized outputs (4sbh each), rsqrt 2 x 4sb: 16sbh + 8sb, over t
//   under SP; plus 10sbh, sb(4aD + 4gD)/t + 4abs/t, 8sbF/t, and the layer's autocast weight copies (2 bytes per
//   local weight element: 2h(aD + 2gD)/t + 2aDh/t + 6hF/t).
//
// Korthikanti et al. 2022 (seed 002, GPT: fp16 LayerNorms, dropout masks, 4h GELU MLP, softmax materialized)
// gives sbh(10 + 24/t + 5as/(ht)) under TP and sbh(34/t + 5as/(ht)) under Megatron's SP. Against the bf16 form
// here: no dropout masks (llama's are 0), no 5as/(ht) (sdpa keeps logsumexp only), RMSNorm's fp32 copy (6sbh
// per norm instead of 2), grouped kv heads (4gD instead of 4aD for k and v), SwiGLU's 8F/h instead of GELU's
// 16, and under SP the gathered inputs kept whole (4sbh) where Megatron saves its s/t shard and re-gathers in
// backward: PyTorch's SP saves 4sbh + 12sbh/t of the norm terms, Megatron's 4sbh/t.
uint64_t closed_form(bool sp, bool amp, uint64_t s, uint64_t b, uint64_t h, uint64_t a, uint64_t g, uint64_t D,
                     uint64_t F, uint64_t t) {
  const uint64_t sbh = s * b * h, sb = s * b;
  const uint64_t shared = sb * (4 * a * D + 4 * g * D) / t + 4 * a * b * s / t + 8 * sb * F / t;
  if (!amp) return shared + (sp ? (12 * sbh + 8 * sb) / t + 4 * sbh : 16 * sbh + 8 * sb);
  const uint64_t weight_copies = (2 * h * (a * D + 2 * g * D) + 2 * a * D * h + 6 * h * F) / t;
  return shared + weight_copies + 10 * sbh + (sp ? (16 * sbh + 8 * sb) / t : 16 * sbh + 8 * sb);
}

TEST(Sp, SavedActivationsPerLayerEqualTheClosedForm) {
  for (uint64_t t : {2, 4, 8}) {
    for (bool sp : {false, true}) {
      EXPECT_EQ(simulated_layer_saved(t, sp, "bf16", 1024, 2), closed_form(sp, false, 1024, 2, 4096, 32, 8, 128, 14336, t))
          << "bf16 tp " << t << " sp " << sp;
      EXPECT_EQ(simulated_layer_saved(t, sp, "bf16-amp", 1024, 2), closed_form(sp, true, 1024, 2, 4096, 32, 8, 128, 14336, t))
          << "bf16-amp tp " << t << " sp " << sp;
    }
  }
}

TEST(Sp, Llama3_8bAtTp8AgainstKorthikanti) {
  // s = 4096, b = 1, tp 8 (the brief's anchor): sbh = 2^24
  const uint64_t s = 4096, b = 1, h = 4096, t = 8, sbh = s * b * h;
  const uint64_t tp = simulated_layer_saved(t, false, "bf16", s, b), sp = simulated_layer_saved(t, true, "bf16", s, b);
  EXPECT_EQ(tp, closed_form(false, false, s, b, h, 32, 8, 128, 14336, t));
  EXPECT_EQ(sp, closed_form(true, false, s, b, h, 32, 8, 128, 14336, t));
  // by hand: sb(4aD + 4gD)/t = 10,485,760; 4abs/t = 65,536; 8sbF/t = 58,720,256; TP adds 16sbh + 8sb =
  // 268,468,224; SP adds (12sbh + 8sb)/t = 25,169,920 and the gathered 4sbh = 67,108,864
  EXPECT_EQ(tp, 337'739'776u);  // 20.13 sbh
  EXPECT_EQ(sp, 161'550'336u);  // 9.63 sbh
  // Korthikanti's, in bytes: TP sbh(10 + 24/8 + 5*32*4096/(4096*8)) = 33 sbh; SP sbh(34/8 + 20) = 24.25 sbh
  const uint64_t korthikanti_tp = 33 * sbh, korthikanti_sp = 97 * sbh / 4;
  EXPECT_EQ(korthikanti_tp, 553'648'128u);
  EXPECT_EQ(korthikanti_sp, 406'847'488u);
  // what SP saves per layer: Korthikanti (10 - 10/t) sbh = 8.75 sbh; the PyTorch program (12sbh + 8sb)(1 - 1/t)
  // = 10.5 sbh + 7sb: the norms' 16sbh + 8sb go to 1/t, but the 4sbh of norm outputs the linears saved stay
  // whole as the gathered inputs
  EXPECT_EQ(tp - sp, (12 * sbh + 8 * s * b) * 7 / 8);
  EXPECT_EQ(korthikanti_tp - korthikanti_sp, 35 * sbh / 4);
}

TEST(Sp, CollectiveBytesPerStepFollowThePlan) {
  // bf16 weights, B=2, T=512, two layers, tp 4: every redistribution's whole tensor, as sp_ops counts it
  const uint64_t B = 2, T = 512, C = 4096, V = 128256, L = 2, t = 4;
  Scenario s = llama({{"precision", "bf16"}, {"tp", std::to_string(t)}, {"batch", std::to_string(B)},
                      {"seq", std::to_string(T)}, {"sequence_parallel", "true"}});
  set_field(s, "overrides", fmt::format("num_hidden_layers={}", L));
  const Estimate e = testing::run(s);
  const FlopLedger& l = e.sim->flops;
  const auto fw = static_cast<size_t>(WorkPhase::kForward), bw = static_cast<size_t>(WorkPhase::kBackward);
  // forward: embed_tokens' reduce-scatter, per layer two all-gathers and two reduce-scatters, lm_head's input
  // all-gather (the logits stay Shard(-1) under loss_parallel)
  EXPECT_EQ(l.tp_all_gather_bytes[fw], 2 * B * T * C * (1 + 4 * L + 1));
  // backward: each reversed
  EXPECT_EQ(l.tp_all_gather_bytes[bw], 2 * B * T * C * (1 + 4 * L + 1));
  // loss_parallel's three (N, 1) float32 all-reduces (max, sum of exp, the gathered target log-probabilities),
  // forward only: its fused backward needs none
  EXPECT_EQ(l.tp_all_reduce_bytes[fw], 3 * B * T * 4);
  for (size_t p = 1; p < kWorkPhases; ++p) EXPECT_EQ(l.tp_all_reduce_bytes[p], 0u) << p;
  (void)V;
}

TEST(Sp, LossParallelSavesTheRanksFloat32LogProbabilitiesOnly) {
  // LogSoftmaxBackward0 saves the (N, V/t) float32 result, NllLossBackward0 the same tensor; the .float() copy
  // and the bf16 logits are not saved: with bf16 weights (no autocast copies) the vocabulary changes the saved
  // bytes by 4 N dV / t alone (the lm_head's saved input does not depend on it)
  auto saved = [](uint64_t vocab) {
    Scenario s = llama({{"precision", "bf16"}, {"tp", "4"}, {"batch", "2"}, {"seq", "512"}, {"sequence_parallel", "true"}});
    set_field(s, "overrides", "num_hidden_layers=1");
    set_field(s, "overrides", fmt::format("vocab_size={}", vocab));
    return testing::run(s).peak.saved_activations.value;
  };
  EXPECT_EQ(saved(128256) - saved(64000), 4u * 2 * 512 * (128256 - 64000) / 4);
}

TEST(Sp, EmbeddingAndLmHeadAreVocabShardsNormsReplicated) {
  const ResolvedScenario r = resolve(llama({{"tp", "8"}, {"sequence_parallel", "true"}}), MapFileReader());
  EXPECT_TRUE(r.model.sp);
  const TensorRow* embed = nullptr;
  for (const TensorRow& row : r.inventory.parameters) {
    if (row.name == "model.embed_tokens.weight") embed = &row;
  }
  ASSERT_NE(embed, nullptr);
  // RowwiseParallel on nn.Embedding: Shard(0) of (V, C), V = 128256 rows over 8 ranks
  EXPECT_EQ(embed->shape, (std::vector<uint64_t>{128256 / 8, 4096}));
  EXPECT_EQ(embed->tp_dim, 0);
  // SequenceParallel replicates the norms: 2 per layer and the final one, h each
  EXPECT_EQ(tp_split(r.model).replicated, (2 * 32 + 1) * 4096u);
}

TEST(Sp, TheEmbeddingGradientIsTheWholeVocabulary) {
  // embedding_dense_backward has no rowwise strategy: with its Replicate gradient and ids, every rank builds the
  // (V, C) gradient (a Replicate DTensor kept as the Shard(0) weight's .grad); every other gradient is the
  // rank's shard. float32 gradients (bf16 autocast over float32 weights): at clip_grad_norm_, 4 bytes per local
  // parameter element plus 4 (V - V/t) C
  Scenario s = llama({{"tp", "4"}, {"batch", "1"}, {"seq", "256"}, {"sequence_parallel", "true"}});
  set_field(s, "overrides", "num_hidden_layers=1");
  const Estimate e = testing::run(s);
  const uint64_t local = parameter_count(resolve(s, MapFileReader()).inventory).value, V = 128256, C = 4096;
  TimelineOptions o;
  o.granularity = TimelineGranularity::kPhase;
  o.step = 1;  // llama() simulates one step
  bool seen = false;
  for (const TimelineRow& r : timeline_rows(e, o)) {
    if (r.phase != Phase::kGradClip) continue;
    seen = true;
    EXPECT_EQ(r.live.by_category[static_cast<size_t>(Category::kGradients)].value, 4 * local + 4 * (V - V / 4) * C);
  }
  EXPECT_TRUE(seen);
}

TEST(Sp, RefusesWhatIsNotSimulatedNamingIt) {
  auto msg = [](Scenario s) { return testing::error_of([&] { (void)resolve(s, MapFileReader()); }); };
  auto has = [&](std::initializer_list<std::pair<const char*, std::string>> f, const char* what) {
    const std::string m = msg(llama(f));
    EXPECT_NE(m.find(what), std::string::npos) << m;
  };
  has({{"sequence_parallel", "true"}}, "--tp above 1");
  has({{"tp", "2"}, {"sequence_parallel", "true"}, {"attention", "eager"}}, "sdpa");
  has({{"tp", "8"}, {"sequence_parallel", "true"}, {"seq", "1020"}}, "not divisible by 8");
  has({{"tp", "2"}, {"sequence_parallel", "true"}, {"checkpointing", "selective"}}, "selective");
  // data parallelism: FSDP2 only (sp_fsdp_test), DDP / ZeRO / FSDP1 refused
  has({{"tp", "2"}, {"sequence_parallel", "true"}, {"dp", "2"}}, "--sharding fsdp2 (torchtitan's apply_fsdp");
  has({{"tp", "2"}, {"sequence_parallel", "true"}, {"task", "inference"}}, "training");
  has({{"tp", "2"}, {"sequence_parallel", "true"}, {"logits_to_keep", "1"}}, "logits_to_keep");
  // mistral-7b slides a 4096-token window
  const std::string m = msg(scenario_of("mistral-7b", {{"tp", "2"}, {"sequence_parallel", "true"}, {"seq", "8192"}}));
  EXPECT_NE(m.find("sliding"), std::string::npos) << m;
}

TEST(Sp, FullCheckpointingKeepsTheShardedLayerInputs) {
  // transformers' gradient checkpointing saves each layer's input: under SP the rank's (B, T/t, C) shard
  auto saved = [](int layers) {
    Scenario s = llama({{"precision", "bf16"}, {"tp", "4"}, {"batch", "2"}, {"seq", "512"},
                        {"sequence_parallel", "true"}, {"checkpointing", "full"}});
    set_field(s, "overrides", fmt::format("num_hidden_layers={}", layers));
    return testing::run(s).peak.saved_activations.value;
  };
  EXPECT_EQ(saved(2) - saved(1), 2u * 512 / 4 * 4096 * 2);
}

}  // namespace
}  // namespace trainmem
