// The task heads (--head, architectures[0]): the batch each head's Trainer collator makes, and what the model
// returns. The op-by-op bytes are checked against real PyTorch in validate/cpu/grid.py and inference.py (ctest
// oracle.cpu_grid, oracle.inference_forward); these tests pin the shapes themselves.
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;
constexpr uint64_t B = 2, T = 64, kI64 = 8;

Scenario two_layers(const std::string& model, const std::string& head, const std::string& task,
                    const std::string& layers_key = "num_hidden_layers=2") {
  Scenario s = testing::scenario_of(model, {{"overrides", layers_key}, {"precision", "fp16"}, {"batch", "2"},
                                            {"seq", "64"}, {"task", task}, {"head", head}, {"num_labels", "3"}});
  return s;
}

uint64_t inputs_after_forward(const Estimate& e) {
  return e.sim->after_forward.live.by_category[static_cast<size_t>(Category::kInputs)].value;
}
uint64_t activations_after_forward(const Estimate& e) {
  return e.sim->after_forward.live.by_category[static_cast<size_t>(Category::kActivations)].value;
}

TEST(Heads, TheBatchIsWhatTheHeadsCollatorMakes) {
  // BertTokenizer's input_ids, token_type_ids and attention_mask, (B, T) int64 each; the labels of
  // DataCollatorWithPadding (B,) for sequence classification, of DataCollatorForTokenClassification and
  // DataCollatorForLanguageModeling (B, T)
  EXPECT_EQ(inputs_after_forward(run(two_layers("bert-base-uncased", "seq-cls", "train"))),
            3 * B * T * kI64 + B * kI64);
  EXPECT_EQ(inputs_after_forward(run(two_layers("bert-base-uncased", "token-cls", "train"))), 4 * B * T * kI64);
  EXPECT_EQ(inputs_after_forward(run(two_layers("bert-base-uncased", "masked-lm", "train"))), 4 * B * T * kI64);
  // RobertaTokenizer.model_input_names has no token_type_ids
  EXPECT_EQ(inputs_after_forward(run(two_layers("roberta-base", "masked-lm", "train"))), 3 * B * T * kI64);
  // A decoder's batch stays input_ids and labels; the seq-cls labels are (B,)
  Scenario llama = two_layers("tinyllama-1.1b", "seq-cls", "train");
  set_field(llama, "overrides", "pad_token_id=2");
  EXPECT_EQ(inputs_after_forward(run(llama)), B * T * kI64 + B * kI64);
}

TEST(Heads, InferenceKeepsWhatTheHeadReturns) {
  // model.eval() under inference_mode: the script's `outputs` holds the logits, fp16 here; every layer's
  // tensors are gone. Sequence classification returns (B, num_labels), token classification (B, T, num_labels).
  constexpr uint64_t kHalf = 2, N = 3;
  EXPECT_EQ(activations_after_forward(run(two_layers("bert-base-uncased", "seq-cls", "inference"))), B * N * kHalf);
  EXPECT_EQ(activations_after_forward(run(two_layers("roberta-base", "seq-cls", "inference"))), B * N * kHalf);
  EXPECT_EQ(activations_after_forward(run(two_layers("roberta-base", "token-cls", "inference"))), B * T * N * kHalf);
  // GenericForSequenceClassification returns pooled_logits (B, N); its (B, T, N) logits die with forward
  Scenario llama = two_layers("tinyllama-1.1b", "seq-cls", "inference");
  set_field(llama, "overrides", "pad_token_id=2");
  EXPECT_EQ(activations_after_forward(run(llama)), B * N * kHalf);
}

}  // namespace
}  // namespace trainmem
