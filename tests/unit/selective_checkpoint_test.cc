// Selective (op-level) activation checkpointing as torchtitan applies it (torchtitan/distributed/
// activation_checkpoint.py, SelectiveAC; torch/utils/checkpoint.py create_selective_checkpoint_contexts): the
// bytes a layer keeps beyond full checkpointing are the outputs of the ops the policy saves, from shapes.
// torch 1.13 (the CPU oracle) has no create_selective_checkpoint_contexts nor the flash sdpa op; the op stream
// the policy sees is checked against real torch in validate/cpu/sac_ops.py (eager attention, float32).
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

Scenario two_layers(const std::string& model, const std::string& layers_key, const std::string& attention,
                    const std::string& checkpointing) {
  Scenario s;
  s.model.model = model;
  set_field(s, "overrides", layers_key + "=2");
  set_field(s, "attention", attention);
  set_field(s, "precision", "bf16-amp");
  set_field(s, "batch", "2");
  set_field(s, "seq", "128");
  set_field(s, "checkpointing", checkpointing);
  return s;
}

uint64_t saved(const Scenario& s) { return estimate(resolve(s, MapFileReader())).peak.saved_activations.value; }

// What selective keeps at the end of forward beyond what full keeps (each layer's input).
uint64_t kept_beyond_full(const std::string& model, const std::string& key, const std::string& attention) {
  return saved(two_layers(model, key, attention, "selective")) - saved(two_layers(model, key, attention, "full"));
}

constexpr uint64_t kB = 2, kT = 128, kBf16 = 2, kF32 = 4;

TEST(SelectiveCheckpointing, Gpt2KeepsEveryAddmmAndTheFlashOutputs) {
  // GPT-2 (n_embd 768, 12 heads): Conv1D is torch.addmm, in the save set and not one of the policy's mm ops,
  // so all four are kept: c_attn (3h), attn.c_proj (h), c_fc (4h), mlp.c_proj (h), bf16 under autocast.
  // sdpa on sm_80 in bf16 without a mask is _scaled_dot_product_flash_attention: its output (B, T, h) bf16
  // and logsumexp (B, H, T) float32.
  const uint64_t h = 768, heads = 12;
  const uint64_t addmm = kB * kT * (3 * h + h + 4 * h + h) * kBf16;
  const uint64_t flash = kB * kT * h * kBf16 + kB * heads * kT * kF32;
  EXPECT_EQ(kept_beyond_full("gpt2", "n_layer", "sdpa"), 2 * (addmm + flash));
}

TEST(SelectiveCheckpointing, EagerAttentionKeepsBothBmmOutputs) {
  // eager attention: torch.matmul(q, k^T) and torch.matmul(probs, v) run aten.bmm, always saved: the scores
  // (B*H, T, T) and the context (B*H, T, D); softmax and dropout are recomputed.
  const uint64_t h = 768, heads = 12, d = 64;
  const uint64_t addmm = kB * kT * (3 * h + h + 4 * h + h) * kBf16;
  const uint64_t bmm = kB * heads * kT * kT * kBf16 + kB * heads * kT * d * kBf16;
  EXPECT_EQ(kept_beyond_full("gpt2", "n_layer", "eager"), 2 * (addmm + bmm));
}

TEST(SelectiveCheckpointing, LlamaRecomputesEverySecondMm) {
  // TinyLlama (hidden 2048, 32 heads of 64, 4 KV heads, intermediate 5632): seven bias-free linears, each
  // aten.mm in this order: q, k, v, o, gate, up, down. The policy counts them and keeps the odd ones (q, v,
  // gate, down), recomputing k, o and up. Plus the flash output and logsumexp.
  const uint64_t h = 2048, kv = 4 * 64, inter = 5632, heads = 32;
  const uint64_t mm = kB * kT * (h + kv + inter + h) * kBf16;
  const uint64_t flash = kB * kT * h * kBf16 + kB * heads * kT * kF32;
  EXPECT_EQ(kept_beyond_full("tinyllama-1.1b", "num_hidden_layers", "sdpa"), 2 * (mm + flash));
}

TEST(SelectiveCheckpointing, NanoGptWithoutBiasesKeepsTheFirstAndThirdMm) {
  // nanoGPT's GPT-2 preset has bias=False: c_attn, attn.c_proj, c_fc, mlp.c_proj are all aten.mm; the policy
  // keeps the first and third (c_attn 3h, c_fc 4h) and recomputes both c_proj. Plus the flash output.
  const uint64_t h = 768, heads = 12;
  const uint64_t mm = kB * kT * (3 * h + 4 * h) * kBf16;
  const uint64_t flash = kB * kT * h * kBf16 + kB * heads * kT * kF32;
  // full checkpointing non-reentrant, like selective, so that both keep the same layer inputs
  Scenario full = two_layers("nanogpt-gpt2", "n_layer", "sdpa", "full");
  set_field(full, "checkpoint_reentrant", "false");
  EXPECT_EQ(saved(two_layers("nanogpt-gpt2", "n_layer", "sdpa", "selective")) - saved(full), 2 * (mm + flash));
}

TEST(SelectiveCheckpointing, TheRecomputeSkipsTheKeptOpsAndRunsTheRest) {
  const Estimate e = estimate(resolve(two_layers("tinyllama-1.1b", "num_hidden_layers", "sdpa", "selective"),
                                      MapFileReader()));
  int recomputed_k = 0, recomputed_q = 0, kept_q_freed = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.phase != Phase::kBackward) continue;
    const std::string what = ev.label.what;
    if (ev.kind == Event::kAlloc && what == "recompute: attn.k_proj") ++recomputed_k;
    if (ev.kind == Event::kAlloc && what == "recompute: attn.q_proj") ++recomputed_q;
    if (ev.kind == Event::kFree && what == "kept for recompute: attn.q_proj") ++kept_q_freed;
  }
  EXPECT_EQ(recomputed_k, 2 * 2);  // two layers, two steps
  EXPECT_EQ(recomputed_q, 0);      // taken from the frame's cache
  EXPECT_EQ(kept_q_freed, 2 * 2);  // the forward's q_proj output, freed in the layer's backward
  // memory_allocated() after forward lies between none's and full's (the peak of two layers is the
  // optimizer step's, the same for all three)
  const uint64_t sel = e.memory.after_forward.value;
  const auto after_forward = [](const char* mode) {
    return estimate(resolve(two_layers("tinyllama-1.1b", "num_hidden_layers", "sdpa", mode), MapFileReader()))
        .memory.after_forward.value;
  };
  EXPECT_LT(sel, after_forward("none"));
  EXPECT_GT(sel, after_forward("full"));
}

TEST(SelectiveCheckpointing, NeedsTheNonReentrantCheckpoint) {
  Scenario s = two_layers("gpt2", "n_layer", "sdpa", "selective");
  set_field(s, "checkpoint_reentrant", "true");
  try {
    resolve(s, MapFileReader());
    FAIL() << "selective with use_reentrant=True was accepted";
  } catch (const FieldError& e) {
    EXPECT_EQ(e.field(), "checkpoint_reentrant");
  }
  // nanoGPT defaults to reentrant checkpointing; selective runs non-reentrant there too
  Scenario n;
  n.model.model = "nanogpt-gpt2";
  set_field(n, "checkpointing", "selective");
  EXPECT_EQ(resolve(n, MapFileReader()).setup.checkpoint_reentrant, std::optional<bool>(false));
}

TEST(SelectiveCheckpointing, IsRefusedWithAFourBitBase) {
  Scenario s = two_layers("tinyllama-1.1b", "num_hidden_layers", "sdpa", "selective");
  set_field(s, "quantize", "nf4");
  set_field(s, "lora", "r=8");
  EXPECT_THROW(resolve(s, MapFileReader()), FieldError);
}

}  // namespace
}  // namespace trainmem
