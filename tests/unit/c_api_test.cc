// The C API (c_api.h), natively: the web page's front end over the library. A request gives the same answer as
// the library's own calls (the CLI's path: set_field in the table's order, resolve, estimate/fit, render), every
// error comes back as {"ok": false} with the CLI's wording, and only the request's files are read.
#include "trainmem/c_api.h"
#include "trainmem/plan.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/gpu.h"
#include "trainmem/plot.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using nlohmann::json;

json call(const char* (*fn)(const char*), const json& request) { return json::parse(fn(request.dump().c_str())); }

Scenario scenario(std::initializer_list<std::pair<const char*, const char*>> fields) {
  Scenario s;
  for (const auto& [f, v] : fields) set_field(s, f, v);
  return s;
}

TEST(CApi, EstimateIsTheLibrarysAnswer) {
  const json a = call(trainmem_estimate_json, {{"fields", {{"model", "gpt2"}, {"batch", "2"}, {"seq", "128"},
                                                           {"gpu", "t4"}}},
                                               {"plots", {"breakdown", "timeline"}}});
  ASSERT_TRUE(a["ok"]) << a.dump();
  const ResolvedScenario r = resolve(scenario({{"model", "gpt2"}, {"batch", "2"}, {"seq", "128"}, {"gpu", "t4"}}),
                                     testing::MapFileReader());
  const Estimate e = estimate(r);
  EXPECT_EQ(a["estimate"], json::parse(render_estimate_json(e, &*r.gpu)));
  EXPECT_EQ(a["table"], render_estimate_table(e, &*r.gpu));
  EXPECT_EQ(a["svg"]["breakdown"], render_breakdown_svg(e));
  EXPECT_EQ(a["svg"]["timeline"], render_timeline_svg(e, timeline_plot(e)));
  // GPT-2 small's parameters, as `trainmem models` lists them (GPT2LMHeadModel, head tied to wte)
  EXPECT_EQ(a["estimate"]["parameters"]["count"], 124439808u);
  EXPECT_EQ(a["estimate"]["memory"]["peak_allocated_bytes"], e.memory.peak_allocated.value);
  EXPECT_EQ(a["estimate"]["device"]["name"], "t4");
}

TEST(CApi, TimelineRowsAsTheCliListsThem) {
  const json a = call(trainmem_estimate_json, {{"fields", {{"model", "gpt2"}, {"batch", "1"}, {"seq", "64"}}},
                                               {"timeline", {{"by", "phase"}, {"step", "2"}}}});
  ASSERT_TRUE(a["ok"]) << a.dump();
  const Estimate e = estimate(resolve(scenario({{"model", "gpt2"}, {"batch", "1"}, {"seq", "64"}}), testing::MapFileReader()));
  const TimelineOptions to = parse_timeline_options("phase", "auto", "0", "2", e.options.steps);
  EXPECT_EQ(a["timeline"], json::parse(render_timeline_json(e, to, timeline_rows(e, to))));
  const json bad = call(trainmem_estimate_json, {{"fields", json::object()}, {"timeline", {{"by", "op"}}}});
  EXPECT_FALSE(bad["ok"]);
  EXPECT_EQ(bad["field"], "by");
}

TEST(CApi, FieldValuesAsTheCliTypesThem) {
  // a number or a boolean is its text; a repeatable field takes a list; without plots, no pictures
  const json a = call(trainmem_estimate_json, {{"fields", {{"model", "gpt2"}, {"batch", 2}, {"seq", 64},
                                                           {"overrides", {"n_layer=2", "n_head=4"}},
                                                           {"checkpoint_reentrant", false}}}});
  ASSERT_TRUE(a["ok"]) << a.dump();
  const Scenario s = scenario({{"model", "gpt2"}, {"overrides", "n_layer=2"}, {"overrides", "n_head=4"},
                               {"batch", "2"}, {"seq", "64"}, {"checkpoint_reentrant", "false"}});
  EXPECT_EQ(a["estimate"], json::parse(render_estimate_json(estimate(resolve(s, testing::MapFileReader())), nullptr)));
  EXPECT_EQ(a["svg"], json::object());
  EXPECT_FALSE(a["estimate"].contains("device"));
}

TEST(CApi, ErrorsAreAnswersWithTheClisWords) {
  auto error = [](const char* text) {
    const json a = json::parse(trainmem_estimate_json(text));
    EXPECT_FALSE(a["ok"]);
    return a;
  };
  EXPECT_EQ(error(R"({"fields": {"batch": "0"}})")["error"], "--batch \"0\": expected an integer in [1, 1048576]");
  EXPECT_EQ(error(R"({"fields": {"batch": "0"}})")["field"], "batch");
  EXPECT_EQ(error(R"({"fields": {"batch": [1, 2]}})")["error"], "--batch a list: this field takes one value");
  EXPECT_EQ(error(R"({"fields": {"batch": {"a": 1}}})")["error"],
            "--batch {\"a\":1}: expected a string, a number or a boolean");
  EXPECT_EQ(error(R"({"fields": {"batchsize": "2"}})")["error"],
            "request: \"batchsize\" is not a scenario field (trainmem_fields_json)");
  EXPECT_EQ(error(R"({"fields": {}, "plots": ["pie"]})")["error"],
            "request: plot \"pie\": expected \"breakdown\" or \"timeline\"");
  EXPECT_EQ(error("[1]")["error"], "request: expected a JSON object like {\"fields\": {\"model\": \"gpt2\"}}");
  EXPECT_EQ(error("{").value("error", "").rfind("request: not JSON (", 0), 0u);
  EXPECT_EQ(json::parse(trainmem_estimate_json(nullptr))["error"], "request: no text (a null pointer)");
  // a rule between fields, from resolve()
  const json lora = call(trainmem_estimate_json, {{"fields", {{"model", "gpt2"}, {"lora", "r=0"}}}});
  EXPECT_EQ(lora["field"], "lora");
}

TEST(CApi, OnlyTheRequestsFilesAreRead) {
  const std::string config = R"({"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1000,
                                 "n_positions": 256})";
  const json a = call(trainmem_estimate_json, {{"fields", {{"model", "config.json"}, {"batch", "2"}, {"seq", "64"}}},
                                               {"files", {{"config.json", config}}}});
  ASSERT_TRUE(a["ok"]) << a.dump();
  testing::MapFileReader files;
  files.files["config.json"] = config;
  const ResolvedScenario r = resolve(scenario({{"model", "config.json"}, {"batch", "2"}, {"seq", "64"}}), files);
  EXPECT_EQ(a["estimate"], json::parse(render_estimate_json(estimate(r), nullptr)));
  // a file on this machine's disk is not the request's
  const json b = call(trainmem_estimate_json, {{"fields", {{"model", TRAINMEM_SOURCE_DIR "/data/models/gpt2.json"}}}});
  EXPECT_FALSE(b["ok"]);
  EXPECT_EQ(b["error"], "--model \"" TRAINMEM_SOURCE_DIR "/data/models/gpt2.json\": not a preset (see `trainmem "
                        "models`) and no readable file at that path");
  const json c = call(trainmem_estimate_json, {{"fields", {{"model", "config.json"}}}, {"files", {{"config.json", 3}}}});
  EXPECT_EQ(c["error"], "request: file \"config.json\": expected its text as a string");
}

TEST(CApi, FitIsTheLibrarysAnswer) {
  const json a = call(trainmem_fit_json, {{"fields", {{"model", "gpt2"}, {"seq", "256"}, {"gpu", "t4"}}},
                                          {"fit", {{"margin", "2GiB"}}}});
  ASSERT_TRUE(a["ok"]) << a.dump();
  FitRequest fr;
  fr.margin = parse_margin("2GiB");
  const FitResult res = fit(scenario({{"model", "gpt2"}, {"seq", "256"}, {"gpu", "t4"}}), fr, testing::MapFileReader());
  EXPECT_EQ(a["fit"], json::parse(render_fit_json(res)));
  EXPECT_EQ(a["table"], render_fit_table(res));
  ASSERT_TRUE(res.largest);
  EXPECT_EQ(a["fit"]["largest"], *res.largest);
  const json bad = call(trainmem_fit_json, {{"fields", {{"gpu", "t4"}}}, {"fit", {{"solve", "width"}}}});
  EXPECT_EQ(bad["error"], "--solve \"width\": expected batch or seq");
}

TEST(CApi, PlanIsTheLibrarysAnswer) {
  const json a = call(trainmem_plan_json, {{"fields", {{"model", "gpt2"}, {"seq", "256"}, {"gpus", "8xh100-80gb"}}},
                                           {"plan", {{"global_batch", 32}, {"top", "3"}}}});
  ASSERT_TRUE(a["ok"]) << a.dump();
  PlanRequest pr;
  pr.global_batch = 32;
  pr.top = 3;
  const std::vector<FieldChange> given = {{"model", "gpt2"}, {"seq", "256"}, {"gpus", "8xh100-80gb"}};
  const PlanResult res = plan(given, pr, testing::MapFileReader());
  EXPECT_EQ(a["plan"], json::parse(render_plan_json(res)));
  EXPECT_EQ(a["table"], render_plan_table(res));
  EXPECT_EQ(a["plan"]["rows"].size(), 3u);
  const json bad = call(trainmem_plan_json, {{"fields", {{"model", "gpt2"}, {"gpus", "8xh100-80gb"}}}});
  EXPECT_EQ(bad["error"], "--global-batch missing: plan needs the sequences per optimizer step over the cluster");
}

TEST(CApi, ListingsAndTheFieldTable) {
  const json m = json::parse(trainmem_models_json());
  EXPECT_EQ(m["models"].size(), presets().size());
  EXPECT_EQ(m["models"], json::parse(render_models_json(model_listings())));
  const json g = json::parse(trainmem_gpus_json());
  EXPECT_EQ(g["gpus"].size(), gpu_catalog().size());
  const json f = json::parse(trainmem_fields_json());
  ASSERT_EQ(f["fields"].size(), scenario_fields().size());
  for (size_t i = 0; i < scenario_fields().size(); ++i) {
    EXPECT_EQ(f["fields"][i]["name"], scenario_fields()[i].name);
    EXPECT_EQ(f["fields"][i]["flag"], cli_flag(scenario_fields()[i].name));
  }
  EXPECT_EQ(f["fields"][0]["default"], "gpt2");
  EXPECT_EQ(f["fields"][0]["group"], "model");
}

}  // namespace
}  // namespace trainmem
