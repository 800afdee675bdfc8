// The request (Scenario), its fields by name, resolve()'s defaults and rules, and trainable rows.
#include "trainmem/scenario.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/report.h"

namespace trainmem {
namespace {

using testing::error_of;
using testing::MapFileReader;

std::string field_of_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const FieldError& e) {
    return e.field();
  }
  return "";
}

TEST(Scenario, FieldsParseAsTheirTypesAndErrorsNameTheField) {
  Scenario s;
  set_field(s, "batch", "4");
  set_field(s, "precision", "fp16-amp");
  set_field(s, "optimizer_impl", "fused");
  EXPECT_EQ(s.train.batch, 4u);
  EXPECT_EQ(s.train.precision, Precision::kFp16Amp);
  EXPECT_EQ(s.train.optimizer_impl, OptimizerImpl::kFused);
  EXPECT_TRUE(s.was_given("batch"));
  EXPECT_FALSE(s.was_given("seq"));
  EXPECT_EQ(error_of([&] { set_field(s, "batch", "-3"); }), "batch \"-3\": expected an integer in [1, 1048576]");
  EXPECT_EQ(field_of_error([&] { set_field(s, "precision", "fp8"); }), "precision");
  EXPECT_EQ(error_of([&] { set_field(s, "loop", "auto"); }), "loop \"auto\": expected nanogpt, hf, seed000 or plain");
}

TEST(Scenario, EveryFieldRoundTripsThroughItsText) {
  Scenario s;
  for (const Field& f : scenario_fields()) {
    if (f.repeatable || f.name == "gpu" || f.name == "alloc_conf" || f.name == "loop" || f.name == "impl" ||
        f.name == "checkpoint_reentrant" || f.name == "lora" || f.name == "input_require_grads" || f.name == "head" ||
        f.name == "num_labels") {
      continue;  // empty by default: the value is resolve()'s to choose
    }
    const std::string text = field_text(s, f.name);
    Scenario t;
    set_field(t, f.name, text);
    EXPECT_EQ(field_text(t, f.name), text) << f.name;
  }
}

TEST(Scenario, TheGpuDecidesTheSimulatedArchitecture) {
  Scenario s;
  s.model.model = "gpt2";
  EXPECT_EQ(resolve(s, MapFileReader()).options.sm, 80u);  // no device: sm_80
  set_field(s, "gpu", "H100-80GB");                        // catalog names in any case
  const ResolvedScenario r = resolve(s, MapFileReader());
  EXPECT_EQ(r.options.sm, 90u);
  EXPECT_EQ(r.setup.gpu, "h100-80gb");
  // The estimate of the resolved scenario simulates sm_90: Hopper's 32 MiB cuBLAS workspace
  // (CublasHandlePool.cpp), not sm_80's 8,519,680 bytes.
  const Estimate e = estimate(r);
  EXPECT_EQ(e.options.sm, 90u);
}

TEST(Scenario, AGpuGivenBySizeIsAGenericCardOfThatSize) {
  const GpuSpec g = resolve_gpu("24GiB");
  EXPECT_EQ(g.runtime_total.value, 24 * kGiB);
  EXPECT_EQ(g.sm, kGenericGpuSm);
  EXPECT_EQ(resolve_gpu("80GB").runtime_total.value, 80'000'000'000u);
  EXPECT_EQ(field_of_error([] { resolve_gpu("24"); }), "gpu");         // a bare number
  EXPECT_EQ(field_of_error([] { resolve_gpu("512MiB"); }), "gpu");     // below 1 GiB
  EXPECT_EQ(field_of_error([] { resolve_gpu("a300"); }), "gpu");
}

TEST(Scenario, ResolveAppliesTheModelsOwnLoopAndOptimizer) {
  Scenario s;
  s.model.model = "nanogpt-gpt2";
  const ResolvedScenario r = resolve(s, MapFileReader());
  EXPECT_EQ(r.options.loop, LoopKind::kNanoGpt);
  EXPECT_EQ(r.setup.optimizer_impl, OptimizerImpl::kFused);  // configure_optimizers: fused AdamW on CUDA
  s.model.model = "gpt2";
  EXPECT_EQ(resolve(s, MapFileReader()).options.loop, LoopKind::kHf);
  EXPECT_EQ(resolve(s, MapFileReader()).setup.optimizer_impl, OptimizerImpl::kForeach);
}

TEST(Scenario, BfSixteenOnACardWithoutBfSixteenIsSaid) {
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "gpu", "t4");
  EXPECT_EQ(resolve(s, MapFileReader()).warnings.size(), 1u);
  set_field(s, "precision", "fp16-amp");
  EXPECT_TRUE(resolve(s, MapFileReader()).warnings.empty());
}

TEST(Scenario, FitRefusesTheSizeItSolvesFor) {
  Scenario s;
  s.model.model = "gpt2";
  set_field(s, "gpu", "a100-80gb");
  set_field(s, "batch", "4");
  FitRequest r;
  EXPECT_EQ(field_of_error([&] { fit(s, r, MapFileReader()); }), "batch");
  Scenario no_gpu;
  no_gpu.model.model = "gpt2";
  EXPECT_EQ(field_of_error([&] { fit(no_gpu, r, MapFileReader()); }), "gpu");
}

TEST(Scenario, FrozenRowsGetNoGradientsAndNoOptimizerState) {
  // Freeze every parameter but the last layer's: PyTorch gives a requires_grad=False parameter no .grad, and
  // the optimizer (built over p.requires_grad parameters, as nanoGPT and the Trainer do) no state for it.
  Scenario s;
  s.model.model = "gpt2";
  s.train = testing::train_setup(2, 64, Precision::kFp32);
  ResolvedScenario r = resolve(s, MapFileReader());
  uint64_t trainable = 0;
  for (TensorRow& row : r.inventory.parameters) {
    row.trainable = row.name.rfind("transformer.h.11.", 0) == 0;
    if (row.trainable) trainable += row.elems.value * 4;
  }
  ASSERT_GT(trainable, 0u);
  const Estimate e = estimate(r);
  EXPECT_EQ(e.state.gradients.value, trainable);
  EXPECT_EQ(e.state.optimizer_moments.value, 2 * trainable);
  // The simulated step agrees: the most gradient and optimizer bytes ever live are those of the trainable rows.
  LiveBytes live;
  uint64_t max_grad = 0, max_opt = 0;
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    max_grad = std::max(max_grad, live.by_category[static_cast<size_t>(Category::kGradients)].value);
    max_opt = std::max(max_opt, live.by_category[static_cast<size_t>(Category::kOptimizer)].value);
  }
  EXPECT_EQ(max_grad, trainable);
  EXPECT_EQ(max_opt, 2 * trainable);
}

// Front ends (the CLI's flags, the Python module's keywords) give fields by name in any order: scenario_from
// applies them in the table's order, so that lora (which resets the adapters' dtype) comes before lora_dtype.
TEST(Scenario, FieldsByNameApplyInTheTablesOrderWhateverTheOrderGiven) {
  const std::vector<FieldChange> dtype_first = {{"lora_dtype", "base"}, {"lora", "r=8"}, {"batch", "3"}};
  const std::vector<FieldChange> lora_first = {{"batch", "3"}, {"lora", "r=8"}, {"lora_dtype", "base"}};
  const Scenario a = scenario_from(dtype_first), b = scenario_from(lora_first);
  EXPECT_FALSE(a.train.lora.fp32);
  EXPECT_EQ(a.train.lora.fp32, b.train.lora.fp32);
  EXPECT_EQ(a.train.batch, 3u);
  const std::vector<FieldChange> twice = {{"overrides", "n_layer=2"}, {"freeze", "a.*"}, {"overrides", "n_head=4"}};
  EXPECT_EQ(scenario_from(twice).model.overrides, (std::vector<std::string>{"n_layer=2", "n_head=4"}));
}

TEST(Scenario, AFieldNameThatIsNoFieldNamesTheNearest) {
  const std::vector<FieldChange> typo = {{"bacth", "8"}};
  EXPECT_EQ(error_of([&] { (void)scenario_from(typo); }), "unknown field \"bacth\" (did you mean \"batch\"?)");
  const std::vector<FieldChange> underscore = {{"optimizer-impl", "fused"}};
  EXPECT_EQ(error_of([&] { (void)scenario_from(underscore); }),
            "unknown field \"optimizer-impl\" (did you mean \"optimizer_impl\"?)");
}

// The messages every front end shows: a field by its flag, as the CLI prints it after "trainmem: ".
TEST(Scenario, ErrorMessagesNameAFieldByItsFlag) {
  EXPECT_EQ(error_message(FieldError("optimizer_impl", "\"x\": expected auto")), "--optimizer-impl \"x\": expected auto");
  EXPECT_EQ(error_message(FieldError("overrides", "\"k\"")), "--set \"k\"");
  EXPECT_EQ(error_message(Error("plain")), "plain");
  EXPECT_EQ(error_of([] { (void)fit_request("width", "5%"); }), "solve \"width\": expected batch or seq");
  EXPECT_EQ(fit_request("seq", "2GiB").solve, FitDimension::kSeq);
  EXPECT_EQ(listing_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(error_of([] { (void)listing_dtype("int8"); }), "dtype \"int8\": expected float32, float16 or bfloat16");
}

// The model alone: a one-token sequence, so that a 512-position model is listed whatever the training default.
TEST(Scenario, TheModelAloneIgnoresTheTrainingSequence) {
  Scenario s;
  set_field(s, "model", "bert-base-uncased");
  EXPECT_NE(error_of([&] { (void)resolve(s); }), "");
  const ResolvedScenario r = resolve_model(s, DiskFileReader());
  EXPECT_EQ(r.model.name, "bert-base-uncased");
}

}  // namespace
}  // namespace trainmem
