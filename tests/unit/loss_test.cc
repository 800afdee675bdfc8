// The loss options: torchtune's chunked output head with CEWithChunkedOutputLoss and Liger-Kernel's fused linear
// cross-entropy against transformers' ForCausalLMLoss, and transformers' logits_to_keep, each pinned by what the
// simulated step allocates and saves, derived from the shapes below.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"
#include "sim/forward_programs/hf_common.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

// One Llama-2-7B layer: C = 4096, V = 32000; B = 2, T = 128, bf16 weights.
constexpr uint64_t kB = 2, kT = 128, kV = 32000;

Scenario llama(const std::string& loss, const std::string& chunks = "") {
  Scenario s = testing::scenario_of("llama-2-7b", {{"overrides", "num_hidden_layers=1"},
                                                   {"precision", "bf16"},
                                                   {"batch", std::to_string(kB)},
                                                   {"seq", std::to_string(kT)},
                                                   {"loss", loss}});
  if (!chunks.empty()) set_field(s, "loss_chunks", chunks);
  return s;
}

using testing::run;

// The float32 copies of the logits made in the first step's forward and loss (backward's gradients of the
// copies carry the same label): their count and size.
struct Upcasts {
  int count = 0;
  uint64_t bytes = 0;
};
Upcasts upcasts(const Estimate& e, const std::string& what) {
  Upcasts u;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc || ev.step != 1 || ev.phase == Phase::kBackward || what != ev.label.what) continue;
    ++u.count;
    u.bytes = ev.bytes.value;
  }
  return u;
}

TEST(Loss, ChunkedUpcastsOneChunkOfLogitsAtATime) {
  // ForCausalLMLoss: logits.float() is one (B*T, V) float32 tensor; CEWithChunkedOutputLoss upcasts each of the
  // n (B*T/n, V) chunks on its own (compute_cross_entropy: logits.float()).
  const Upcasts ce = upcasts(run(llama("ce")), "logits.float()");
  EXPECT_EQ(ce.count, 1);
  EXPECT_EQ(ce.bytes, kB * kT * kV * 4);
  const Upcasts ch = upcasts(run(llama("chunked", "4")), "logits_chunk.float()");
  EXPECT_EQ(ch.count, 4);
  EXPECT_EQ(ch.bytes, kB * (kT / 4) * kV * 4);
}

TEST(Loss, ChunkedSavesWhatCeSavesPlusOneScalarPerChunk) {
  // Autograd still saves every chunk's log_softmax output (B*T/n x V float32 each, B*T*V*4 in all, as ce's one),
  // every labels chunk (reshape(-1) of a (B, T/n) column slice copies it when B > 1: B*T*8 in all, as ce's
  // shift_labels copy), and the head's input (each chunk's matmul operand, a copy of a non-contiguous (B, T/n, C)
  // slice: B*T*C*2 in all, as ce's hidden states). What differs: n NllLossBackward0 total_weight scalars (4 B
  // each) instead of one, and total_elements (an int64 scalar) saved by the division.
  const uint64_t n = 4;
  const uint64_t ce = run(llama("ce")).sim->saved_activations.value;
  const uint64_t ch = run(llama("chunked", std::to_string(n))).sim->saved_activations.value;
  EXPECT_EQ(ch, ce + 4 * (n - 1) + 8);
}

// The most live bytes during the first step's forward and loss.
uint64_t forward_peak(const Estimate& e) {
  LiveBytes live;
  uint64_t peak = 0;
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    if (ev.step == 1 && (ev.phase == Phase::kForward || ev.phase == Phase::kLoss)) {
      peak = std::max(peak, live.total.value);
    }
  }
  return peak;
}

TEST(Loss, ChunkedLowersTheForwardPeakByTheUpcastItAvoids) {
  // At the loss, ce holds the bf16 logits, their whole float32 copy and the float32 log-probabilities at once;
  // chunked holds the bf16 chunks, one chunk's float32 copy and the log-probabilities: (n - 1) / n of the copy
  // (B*T*V*4) less, but for the scalars live at the last chunk's log_softmax: total_elements (int64, 8 B), the
  // seven earlier chunks' nll total_weight (4 B each) and the running total_loss (4 B): 40 B. (The head's saved
  // input weighs the same in both: ce's hidden states, chunked's per-chunk operand copies with h out of scope.)
  const uint64_t ce = forward_peak(run(llama("ce")));
  const uint64_t ch = forward_peak(run(llama("chunked", "8")));
  EXPECT_EQ(ce - ch, kB * kT * kV * 4 * 7 / 8 - (8 + 7 * 4 + 4));
}

TEST(Loss, LogitsToKeepRunsTheHeadOverTheKeptPositionsOnly) {
  // LlamaForCausalLM.forward: logits = self.lm_head(hidden_states[:, -logits_to_keep:, :]): (B, K, V) bf16,
  // and the loss over those positions: its float32 copy (B*K, V).
  Scenario s = llama("ce");
  set_field(s, "logits_to_keep", "16");
  const Upcasts u = upcasts(run(s), "logits.float()");
  EXPECT_EQ(u.count, 1);
  EXPECT_EQ(u.bytes, kB * 16 * kV * 4);
}

std::string refusal(Scenario s, const char* field, const char* value) {
  set_field(s, field, value);
  try {
    resolve(s, MapFileReader());
  } catch (const FieldError& e) {
    return e.field() + ": " + e.what();
  }
  return "accepted";
}

TEST(Loss, RefusesCombinationsTheModelledCodeDoesNotHave) {
  EXPECT_NE(refusal(llama("chunked"), "loss_chunks", "3").find("loss_chunks"), std::string::npos);  // 3 ∤ 128
  EXPECT_NE(refusal(llama("ce"), "loss_chunks", "4").find("loss_chunks"), std::string::npos);
  EXPECT_NE(refusal(llama("chunked"), "logits_to_keep", "16").find("logits_to_keep"), std::string::npos);
  EXPECT_NE(refusal(llama("ce"), "logits_to_keep", "129").find("logits_to_keep"), std::string::npos);
  EXPECT_NE(refusal(llama("chunked"), "loop", "nanogpt").find("loss"), std::string::npos);  // labels-free script
  EXPECT_EQ(refusal(llama("chunked"), "loop", "plain"), "accepted");  // model(**batch).loss.backward()
  EXPECT_THROW(set_field(*std::make_unique<Scenario>(), "loss_chunks", "17"), FieldError);  // SplitBackward0 edges
  EXPECT_THROW(set_field(*std::make_unique<Scenario>(), "loss", "focal"), FieldError);
  // Liger: llama-shaped transformers models only, no autocast, no gemma2 softcapping, no logits_to_keep
  EXPECT_EQ(refusal(llama("liger-fused"), "loop", "plain"), "accepted");
  EXPECT_NE(refusal(llama("liger-fused"), "precision", "bf16-amp").find("precision"), std::string::npos);
  EXPECT_NE(refusal(llama("liger-fused"), "logits_to_keep", "16").find("logits_to_keep"), std::string::npos);
  EXPECT_NE(refusal(llama("liger-fused"), "loss_chunks", "4").find("loss_chunks"), std::string::npos);
  Scenario g;
  g.model.model = "gpt2";
  EXPECT_NE(refusal(g, "loss", "liger-fused").find("Liger patches"), std::string::npos);
}

// ---- Liger-Kernel's fused linear cross-entropy ------------------------------------------------------------

TEST(Loss, LigerChunkSizeFollowsTheIncFactorFormula) {
  // inc_factor = cdiv(V, H); chunk_size = next_power_of_2(cdiv(BT, inc_factor)); num_chunks = cdiv(BT, chunk_size)
  // The test model: BT = 2*128 = 256, V = 32000, H = 4096: inc 8, cdiv(256, 8) = 32 -> 32 rows, 8 chunks.
  EXPECT_EQ(sim::liger_chunking(256, 32000, 4096).size, 32u);
  EXPECT_EQ(sim::liger_chunking(256, 32000, 4096).count, 8u);
  // Liger's own comment: BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048
  EXPECT_EQ(sim::liger_chunking(4096 * 4, 32000, 4096).size, 2048u);
  EXPECT_EQ(sim::liger_chunking(4096 * 4, 32000, 4096).count, 8u);
  // Llama-3-8B at B=4, T=2048: inc = cdiv(128256, 4096) = 32, cdiv(8192, 32) = 256 -> 256 rows, 32 chunks
  EXPECT_EQ(sim::liger_chunking(8192, 128256, 4096).size, 256u);
  EXPECT_EQ(sim::liger_chunking(8192, 128256, 4096).count, 32u);
  // BT = 1000: cdiv(1000, 8) = 125 rounds up to 128; cdiv(1000, 128) = 8 chunks, the last of 1000 - 896 = 104 rows
  EXPECT_EQ(sim::liger_chunking(1000, 32000, 4096).size, 128u);
  EXPECT_EQ(sim::liger_chunking(1000, 32000, 4096).count, 8u);
  // V <= H: inc 1, one chunk of next_power_of_2(BT) rows
  EXPECT_EQ(sim::liger_chunking(300, 1000, 4096).size, 512u);
  EXPECT_EQ(sim::liger_chunking(300, 1000, 4096).count, 1u);
}

constexpr uint64_t kH = 4096, kBT = kB * kT, kRows = 32, kChunks = 8;

TEST(Loss, LigerMakesOneChunkOfLogitsAtATimeAndNoUpcast) {
  const Estimate e = run(llama("liger-fused"));
  const Upcasts u = upcasts(e, "liger logits_chunk");
  EXPECT_EQ(u.count, static_cast<int>(kChunks));
  EXPECT_EQ(u.bytes, kRows * kV * 2);  // (32, V) bf16
  EXPECT_EQ(upcasts(e, "logits.float()").count, 0);
  EXPECT_EQ(upcasts(e, "liger grad_input").bytes, kBT * kH * 2);
}

TEST(Loss, LigerAccumulatesTheHeadGradientOnlyWhenTheHeadIsTrainable) {
  // trainable: grad_weight (V, H) bf16 once, and per chunk mm(...) (V, H) bf16 and its .float() (V, H) float32
  const Estimate t = run(llama("liger-fused"));
  EXPECT_EQ(upcasts(t, "liger grad_weight").bytes, kV * kH * 2);
  EXPECT_EQ(upcasts(t, "mm(grad_logits_chunk.t(), _input_chunk)").count, static_cast<int>(kChunks));
  EXPECT_EQ(upcasts(t, "mm(...).float()").count, static_cast<int>(kChunks));
  EXPECT_EQ(upcasts(t, "mm(...).float()").bytes, kV * kH * 4);
  // frozen head (as under LoRA): weight_needs_grad is False, grad_weight is None, no (V, H) work
  Scenario s = llama("liger-fused");
  set_field(s, "freeze", "lm_head.weight");
  const Estimate f = run(s);
  EXPECT_EQ(upcasts(f, "liger grad_weight").count, 0);
  EXPECT_EQ(upcasts(f, "mm(grad_logits_chunk.t(), _input_chunk)").count, 0);
  // what autograd saves differs by exactly the saved grad_weight
  EXPECT_EQ(t.sim->saved_activations.value - f.sim->saved_activations.value, kV * kH * 2);
}

TEST(Loss, LigerSavesThePrecomputedGradientsInsteadOfTheLogProbabilities) {
  // ce saves, for the head and the loss: the head's input (the final hidden states, BT*H*2), the float32
  // log-probabilities (BT*V*4), the shift_labels copy (BT*8; B > 1) and nll's total_weight (4 B). Liger saves
  // grad_input (BT*H*2) and grad_weight (V*H*2); the labels are not saved.
  const uint64_t ce = run(llama("ce")).sim->saved_activations.value;
  const uint64_t lg = run(llama("liger-fused")).sim->saved_activations.value;
  EXPECT_EQ(lg + kBT * kV * 4 + kBT * 8 + 4, ce + kV * kH * 2);
}

TEST(Loss, LigerGradWeightBecomesTheHeadsGradWithoutACopy) {
  // backward returns the saved grad_weight; once the node has run its saved tensors are released, so the head's
  // AccumulateGrad steals it as .grad (the storage is recategorized, no (V, H) clone is allocated).
  const Estimate e = run(llama("liger-fused"));
  uint64_t gw = 0;
  int stolen = 0, cloned = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.step != 1) continue;
    if (ev.kind == Event::kAlloc && std::string("liger grad_weight") == ev.label.what) gw = ev.storage;
    if (ev.kind == Event::kRecategorize && ev.storage == gw && ev.category == Category::kGradients) ++stolen;
    if (ev.kind == Event::kAlloc && ev.category == Category::kGradients && ev.bytes.value == kV * kH * 2) ++cloned;
  }
  EXPECT_EQ(stolen, 1);
  EXPECT_EQ(cloned, 0);
}

// Live bytes just before the first step-1 allocation labelled `what`.
uint64_t live_before(const Estimate& e, const std::string& what) {
  LiveBytes live;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && ev.step == 1 && what == ev.label.what) return live.total.value;
    apply(live, ev);
  }
  return 0;
}

TEST(Loss, LigerForwardPeakIsTheGradientBuffersPlusOneChunkAndTheWeightGradientTemporaries) {
  // From the padded labels on, at the first chunk's .float(): padded labels B*(T+1)*8 and the shift_labels copy
  // B*T*8; grad_input BT*H*2; grad_weight V*H*2; loss_1d BT*4; target_mask BT; one logits chunk 32*V*2; the mm
  // result V*H*2 and its float32 copy V*H*4 (the 0-dim sum is gone, the grad_input temporary too).
  const Estimate e = run(llama("liger-fused"));
  const uint64_t base = live_before(e, "padded labels");
  const uint64_t added = kB * (kT + 1) * 8 + kB * kT * 8 + kBT * kH * 2 + kV * kH * 2 + kBT * 4 + kBT +
                         kRows * kV * 2 + kV * kH * 2 + kV * kH * 4;
  EXPECT_EQ(forward_peak(e), base + added);
}

}  // namespace
}  // namespace trainmem
