// --task inference: a forward pass in model.eval() under torch.inference_mode(). No graph is recorded, so
// nothing is saved for backward, no gradient or optimizer state exists, and dropout is off; the script keeps
// the returned logits bound. The live bytes are checked op by op against real PyTorch in
// validate/cpu/inference.py (ctest oracle.inference_forward); these tests pin the rules themselves.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

Scenario gpt2(const std::string& task) {
  return testing::scenario_of(
      "gpt2", {{"overrides", "n_layer=2"}, {"precision", "fp16"}, {"batch", "2"}, {"seq", "64"}, {"task", task}});
}

using testing::run;

TEST(Inference, RecordsNoGraphSoNothingIsSavedAndNoGradientOrOptimizerStateExists) {
  const Estimate e = run(gpt2("inference"));
  EXPECT_EQ(e.peak.saved_activations.value, 0u);
  EXPECT_EQ(e.state.gradients.value, 0u);
  EXPECT_EQ(e.state.optimizer_state.value, 0u);
  EXPECT_EQ(e.setup.optimizer, Optimizer::kNone);
  const Estimate t = run(gpt2("train"));
  EXPECT_GT(t.peak.saved_activations.value, 0u);
  EXPECT_LT(e.peak.live_total.value, t.peak.live_total.value);
}

TEST(Inference, KeepsTheLogitsTheModelReturnsUntilTheNextCall) {
  // After the forward, the only activation left is the (B, T, V) fp16 logits, 2 x 64 x 50,257 x 2 bytes
  // (GPT-2's vocabulary), held by the script's `outputs`; every layer's tensors are gone.
  const Estimate e = run(gpt2("inference"));
  const uint64_t logits = 2ull * 64 * 50257 * 2;
  const LiveBytes& after = e.sim->after_forward.live;
  EXPECT_EQ(after.by_category[static_cast<size_t>(Category::kActivations)].value, logits);
  EXPECT_EQ(after.by_category[static_cast<size_t>(Category::kInputs)].value, 2ull * 64 * 8);  // the ids only
}

TEST(Inference, TurnsDropoutOffAsModelEvalDoes) {
  // GPT-2's configs have dropout 0.1: in training every dropout makes a mask; eval() makes none, so the same
  // forward with and without the probabilities peaks at the same bytes.
  Scenario with = gpt2("inference");
  Scenario without = gpt2("inference");
  set_field(without, "overrides", "resid_pdrop=0");
  set_field(without, "overrides", "embd_pdrop=0");
  set_field(without, "overrides", "attn_pdrop=0");
  EXPECT_EQ(run(with).peak.live_total.value, run(without).peak.live_total.value);
}

TEST(Inference, RefusesTrainingOptionsInsteadOfIgnoringThem) {
  for (const auto& [field, value] : {std::pair<std::string, std::string>{"checkpointing", "full"},
                                     {"optimizer", "adamw"},
                                     {"lora", "r=8"},
                                     {"freeze", "transformer.h.0.*"},
                                     {"grad_accum", "2"},
                                     {"quantize", "nf4"}}) {
    Scenario s = gpt2("inference");
    set_field(s, field, value);
    try {
      run(s);
      ADD_FAILURE() << field << " was accepted";
    } catch (const FieldError& e) {
      EXPECT_EQ(e.field(), field);
    }
  }
  Scenario none = gpt2("inference");
  set_field(none, "optimizer", "none");
  EXPECT_NO_THROW(run(none));
}

// --generate: model.generate() with transformers' DynamicCache, one forward per new token.
Scenario generating(const std::string& model, const std::string& layers_key, uint64_t new_tokens) {
  return testing::scenario_of(model, {{"overrides", layers_key + "=2"},
                                      {"precision", "fp16"},
                                      {"batch", "3"},
                                      {"seq", "40"},
                                      {"task", "inference"},
                                      {"generate", std::to_string(new_tokens)}});
}

uint64_t kv_bytes(const LiveBytes& l) { return l.by_category[static_cast<size_t>(Category::kKvCache)].value; }

TEST(Generation, CachesKeysAndValuesOfEveryLayerForThePromptAndEveryNewTokenButTheLast) {
  // Each layer caches (B, KV, tokens, D) keys and values in the model dtype. The last new token is never fed
  // back, so the cache ends at seq + N - 1 tokens. Llama-3-8B has 8 KV heads of 128 (grouped-query), GPT-2
  // 12 heads of 64, Pythia-160M 12 of 64.
  struct Case {
    const char* model;
    const char* layers_key;
    uint64_t kv_heads, head_dim;
  };
  for (const Case& c : {Case{"llama-3-8b", "num_hidden_layers", 8, 128}, Case{"gpt2", "n_layer", 12, 64},
                        Case{"pythia-160m", "num_hidden_layers", 12, 64}}) {
    const Estimate e = run(generating(c.model, c.layers_key, 7));
    ASSERT_TRUE(e.generation.has_value()) << c.model;
    const uint64_t per_token = 2 /*layers*/ * 2 /*k and v*/ * 3 /*B*/ * c.kv_heads * c.head_dim * 2 /*fp16*/;
    EXPECT_EQ(e.generation->kv_per_token.value, per_token) << c.model;
    EXPECT_EQ(e.generation->cached_tokens, 40u + 7 - 1) << c.model;
    EXPECT_EQ(e.generation->kv_cache_end.value, per_token * (40 + 7 - 1)) << c.model;
    EXPECT_EQ(kv_bytes(e.sim->generation_end.live), e.generation->kv_cache_end.value) << c.model;
    // after the prefill: the prompt's tokens only
    EXPECT_EQ(kv_bytes(e.sim->after_forward.live), per_token * 40) << c.model;
  }
}

TEST(Generation, EndsWithTheLastTokenAppendedBeforeGenerateDropsItsLocals) {
  // "at the end" is the moment validate/cpu/generate.py marks "end of generate": the loop is over and
  // generate() has not yet returned, so the float32 next_token_logits (B, V) and the last decode step's
  // model_inputs clones, (B, 1) int64 each, are still bound. The three frees that follow are theirs.
  const Estimate e = run(generating("gpt2", "n_layer", 4));
  const auto& ev = e.sim->timeline.events;
  const size_t end = e.sim->generation_end.event;
  ASSERT_GE(ev.size(), end + 3);
  const uint64_t B = 3, V = 50257;
  EXPECT_EQ(ev[end].kind, Event::kFree);
  EXPECT_STREQ(ev[end].label.what, "next_token_logits (float32 copy)");
  EXPECT_EQ(ev[end].bytes.value, B * V * 4);
  EXPECT_STREQ(ev[end + 1].label.what, "model_inputs input_ids (clone)");
  EXPECT_STREQ(ev[end + 2].label.what, "model_inputs position_ids (clone)");
  EXPECT_EQ(ev[end + 1].bytes.value + ev[end + 2].bytes.value, 2 * B * 1 * 8);
}

TEST(Generation, GrowsTheCacheByTorchCatSoEachUpdateHoldsTheOldAndTheNewCopyOfOneLayer) {
  // DynamicLayer.update: self.keys = torch.cat([self.keys, key_states], dim=-2) allocates the grown tensor
  // before the old one is freed: the live cache peaks one layer's keys (or values) above its final size.
  const Estimate e = run(generating("gpt2", "n_layer", 5));
  uint64_t max_kv = 0;
  LiveBytes live;
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    max_kv = std::max(max_kv, kv_bytes(live));
  }
  const uint64_t one_layer_keys_before_last = 3ull * 12 * (40 + 5 - 2) * 64 * 2;
  EXPECT_EQ(max_kv, e.generation->kv_cache_end.value + one_layer_keys_before_last);
}

TEST(Generation, PassesLogitsToKeepOneSoThePrefillMakesLogitsForTheLastPositionOnly) {
  // generate() sets logits_to_keep=1: the head runs on the last position only, so no (B, T, V) logits are ever
  // made, only (B, 1, V) ones and their float32 copy. GPT-2: V = 50,257.
  const Estimate g = run(generating("gpt2", "n_layer", 1));
  uint64_t largest = 0;
  for (const Event& ev : g.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && ev.category == Category::kActivations) largest = std::max(largest, ev.bytes.value);
  }
  EXPECT_LT(largest, 3ull * 40 * 50257 * 2);  // never the whole (B, T, V) logits
}

TEST(Generation, ReusesTheAutocastWeightCopiesOfThePrefillInEveryDecodeStep) {
  // `with torch.autocast(...): model.generate(...)` is one autocast region: each float32 weight is cast once.
  Scenario one = generating("gpt2", "n_layer", 1);
  Scenario many = generating("gpt2", "n_layer", 6);
  set_field(one, "precision", "fp16-amp");
  set_field(many, "precision", "fp16-amp");
  auto copies = [](const Estimate& e) {
    uint64_t n = 0;
    for (const Event& ev : e.sim->timeline.events) n += ev.kind == Event::kAlloc && ev.category == Category::kWeightCopies;
    return n;
  };
  EXPECT_GT(copies(run(one)), 0u);
  EXPECT_EQ(copies(run(one)), copies(run(many)));
}

TEST(Generation, RefusesWhatItDoesNotModel) {
  auto field_of = [](Scenario s) {
    try {
      run(s);
    } catch (const FieldError& e) {
      return std::string(e.field());
    }
    return std::string("accepted");
  };
  Scenario train = generating("gpt2", "n_layer", 4);
  set_field(train, "task", "train");
  EXPECT_EQ(field_of(train), "generate");
  Scenario keep = generating("gpt2", "n_layer", 4);
  set_field(keep, "logits_to_keep", "1");
  EXPECT_EQ(field_of(keep), "logits_to_keep");
  Scenario past_table = generating("gpt2", "n_layer", 4);
  set_field(past_table, "seq", "1020");
  set_field(past_table, "generate", "6");  // positions 0 .. 1024: one past GPT-2's 1,024
  EXPECT_EQ(field_of(past_table), "generate");
  set_field(past_table, "generate", "5");
  EXPECT_EQ(field_of(past_table), "accepted");
  // Mistral-7B's layers attend to a window of 4,096: DynamicSlidingWindowLayer drops the oldest tokens from there
  Scenario sliding = generating("mistral-7b", "num_hidden_layers", 57);
  set_field(sliding, "seq", "4040");  // 4,040 + 56 = 4,096 cached at the end: the window
  EXPECT_EQ(field_of(sliding), "generate");
  set_field(sliding, "generate", "56");
  EXPECT_EQ(field_of(sliding), "accepted");
}

}  // namespace
}  // namespace trainmem
