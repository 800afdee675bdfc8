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
                                            {"seq", "64"}, {"task", task}, {"head", head}});
  if (head == "seq-cls" || head == "token-cls") set_field(s, "num_labels", "3");  // the classifiers' labels
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

TEST(Heads, TheLossIsTheConfigsProblemTypeOrRefused) {
  // ForSequenceClassificationLoss / BertForSequenceClassification.forward read config.problem_type first:
  // "regression" -> MSELoss, "multi_label_classification" -> BCEWithLogitsLoss; only the single-label
  // cross-entropy is simulated, so a config naming another loss is refused, not simulated as the wrong one
  const auto head = [](const std::string& extra) {
    return testing::from_json(R"({"model_type": "bert", "architectures": ["BertForSequenceClassification"],
                                  "num_hidden_layers": 1)" + extra + "}");
  };
  EXPECT_EQ(head("").head, Head::kSeqCls);
  EXPECT_EQ(head(R"(, "problem_type": null)").head, Head::kSeqCls);
  EXPECT_EQ(head(R"(, "problem_type": "single_label_classification")").head, Head::kSeqCls);
  const std::string why = testing::error_of([&] { head(R"(, "problem_type": "multi_label_classification")"); });
  EXPECT_NE(why.find("key \"problem_type\" = \"multi_label_classification\""), std::string::npos) << why;
  EXPECT_NE(why.find("BCEWithLogitsLoss"), std::string::npos) << why;
}

TEST(Heads, OneLabelIsARegressionForSequencesButNotForTokens) {
  // BertForSequenceClassification: num_labels == 1 -> "regression" (MSELoss); BertForTokenClassification's loss is
  // CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1)) whatever num_labels is
  const auto bert = [](const char* arch) {
    return testing::from_json(std::string(R"({"model_type": "bert", "num_hidden_layers": 1, "num_labels": 1,
                                               "architectures": [")") + arch + R"("]})");
  };
  EXPECT_EQ(bert("BertForTokenClassification").num_labels, 1u);
  EXPECT_NE(testing::error_of([&] { bert("BertForSequenceClassification"); }).find("regression"), std::string::npos);
}

TEST(Heads, NumLabelsIsRefusedForAHeadWithoutLabels) {
  Scenario s = testing::scenario_of("gpt2", {{"overrides", "n_layer=1"}, {"num_labels", "5"}});
  EXPECT_NE(testing::error_of([&] { run(s); }).find("--num-labels 5: the causal-lm head has no labels"),
            std::string::npos);
  Scenario mlm = testing::scenario_of("bert-base-uncased", {{"overrides", "num_hidden_layers=1"}, {"head", "masked-lm"},
                                                            {"num_labels", "5"}});
  EXPECT_THROW(run(mlm), Error);
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
