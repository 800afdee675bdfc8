// --task inference: a forward pass in model.eval() under torch.inference_mode(). No graph is recorded, so
// nothing is saved for backward, no gradient or optimizer state exists, and dropout is off; the script keeps
// the returned logits bound. The live bytes are checked op by op against real PyTorch in
// validate/cpu/inference.py (ctest oracle.inference_forward); these tests pin the rules themselves.
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

Scenario gpt2(const std::string& task) {
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "overrides", "n_layer=2");
  set_field(s, "precision", "fp16");
  set_field(s, "batch", "2");
  set_field(s, "seq", "64");
  set_field(s, "task", task);
  return s;
}

Estimate run(const Scenario& s) { return estimate(resolve(s, MapFileReader())); }

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

}  // namespace
}  // namespace trainmem
