// The C API (c_api.h): a JSON request becomes set_field() calls, resolve(), estimate() or fit(); the answer is
// the report's JSON and SVG text. Nothing here computes a number: the CLI and this API call the same functions.
#include "trainmem/c_api.h"

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/gpu.h"
#include "trainmem/plot.h"
#include "trainmem/plan.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

#include "../report/json_text.h"

namespace trainmem {
namespace {

using nlohmann::json;

// The request's "files": the only files a request can read (the web page has no disk; a native caller passes
// what it means the model to read, so the answer never depends on the caller's working folder).
class RequestFiles final : public FileReader {
 public:
  explicit RequestFiles(std::map<std::string, std::string> files) : files_(std::move(files)) {}
  std::optional<std::string> read(const std::string& path) const override {
    auto it = files_.find(path);
    if (it == files_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::map<std::string, std::string> files_;
};

struct Request {
  Scenario scenario;
  std::vector<FieldChange> given;  // the fields as given, in the table's order (plan sets its own on top)
  std::map<std::string, std::string> files;
  json options;  // the rest of the request ("plots", "fit")
};

// A field's value as the CLI's flag would have it: text as is, a number or a boolean as its JSON text.
std::string value_text(std::string_view field, const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number() || v.is_boolean()) return v.dump();
  throw FieldError(std::string(field), fmt::format("{}: expected a string, a number or a boolean",
                                                   v.dump(-1, ' ', false, json::error_handler_t::replace)));
}

Request parse_request(const char* text) {
  if (text == nullptr) throw Error("request: no text (a null pointer)");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("request: not JSON ({})", e.what()));
  }
  if (!j.is_object()) throw Error("request: expected a JSON object like {\"fields\": {\"model\": \"gpt2\"}}");
  Request r;
  const json fields = j.value("fields", json::object());
  if (!fields.is_object()) throw Error("request: \"fields\" must be an object of field names to values");
  for (const auto& [name, value] : fields.items()) {
    bool known = false;
    for (const Field& f : scenario_fields()) known = known || f.name == name;
    if (!known) throw Error(fmt::format("request: \"{}\" is not a scenario field (trainmem_fields_json)", name));
  }
  // In the table's order, as the CLI applies its flags, so that a rule on what was given sees the same order.
  for (const Field& f : scenario_fields()) {
    auto it = fields.find(f.name);
    if (it == fields.end()) continue;
    if (it->is_array()) {
      if (!f.repeatable) throw FieldError(std::string(f.name), "a list: this field takes one value");
      for (const json& v : *it) {
        set_field(r.scenario, f.name, value_text(f.name, v));
        r.given.push_back({std::string(f.name), value_text(f.name, v)});
      }
    } else {
      set_field(r.scenario, f.name, value_text(f.name, *it));
      r.given.push_back({std::string(f.name), value_text(f.name, *it)});
    }
  }
  const json files = j.value("files", json::object());
  if (!files.is_object()) throw Error("request: \"files\" must be an object of paths to file texts");
  for (const auto& [path, content] : files.items()) {
    if (!content.is_string()) throw Error(fmt::format("request: file \"{}\": expected its text as a string", path));
    r.files[path] = content.get<std::string>();
  }
  r.options = std::move(j);
  return r;
}

// The text handed back: owned here, valid until the next call on this thread.
const char* answer(json j) {
  thread_local std::string text;
  text = report::json_text(j, -1);
  return text.c_str();
}

// Runs `body` (which fills the answer after "ok": true) and turns every error into {"ok": false, ...}.
template <typename Body>
const char* guarded(Body body) {
  try {
    json out = {{"ok", true}};
    body(out);
    return answer(std::move(out));
  } catch (const FieldError& e) {
    // as the CLI says it: the field by its flag, then what is wrong with the value
    return answer({{"ok", false}, {"error", error_message(e)}, {"field", e.field()}});
  } catch (const Error& e) {
    return answer({{"ok", false}, {"error", error_message(e)}});
  } catch (const std::exception& e) {
    return answer({{"ok", false}, {"error", fmt::format("internal error: {}", e.what())}, {"internal", true}});
  }
}

json warnings_of(const std::vector<std::string>& a, const std::vector<std::string>& b = {}) {
  json w = json::array();
  for (const std::string& s : a) w.push_back(s);
  for (const std::string& s : b) w.push_back(s);
  return w;
}

}  // namespace
}  // namespace trainmem

extern "C" {

const char* trainmem_estimate_json(const char* request_json) {
  using namespace trainmem;
  return guarded([&](json& out) {
    const Request req = parse_request(request_json);
    const ResolvedScenario r = resolve(req.scenario, RequestFiles(req.files));
    const GpuSpec* gpu = r.gpu ? &*r.gpu : nullptr;
    const Estimate e = estimate(r);
    out["estimate"] = json::parse(render_estimate_json(e, gpu));
    out["table"] = render_estimate_table(e, gpu);
    out["warnings"] = warnings_of(r.warnings, e.warnings);
    json svg = json::object();
    const json plots = req.options.value("plots", json::array());
    if (!plots.is_array()) throw Error("request: \"plots\" must be a list like [\"breakdown\", \"timeline\"]");
    for (const json& p : plots) {
      if (p == "breakdown") {
        svg["breakdown"] = render_breakdown_svg(e);
      } else if (p == "timeline") {
        svg["timeline"] = render_timeline_svg(e, timeline_plot(e));
      } else {
        throw Error(fmt::format("request: plot {}: expected \"breakdown\" or \"timeline\"", p.dump()));
      }
    }
    out["svg"] = std::move(svg);
    // "timeline": {"by": "layer", "unit": "auto", "min_bytes": "0", "step": ""}: trainmem timeline --format json
    if (req.options.contains("timeline")) {
      const json t = req.options["timeline"];
      if (!t.is_object()) throw Error("request: \"timeline\" must be an object like {\"by\": \"layer\"}");
      const TimelineOptions to =
          parse_timeline_options(t.value("by", std::string("layer")), t.value("unit", std::string("auto")),
                                 t.value("min_bytes", std::string("0")), t.value("step", std::string()),
                                 r.options.steps);
      out["timeline"] = json::parse(render_timeline_json(e, to, timeline_rows(e, to)));
    }
  });
}

const char* trainmem_fit_json(const char* request_json) {
  using namespace trainmem;
  return guarded([&](json& out) {
    const Request req = parse_request(request_json);
    const json o = req.options.value("fit", json::object());
    FitRequest fr;
    const std::string solve = o.value("solve", std::string("batch"));
    const auto dim = parse_fit_dimension(solve);
    if (!dim) throw FieldError("solve", fmt::format("\"{}\": expected batch or seq", solve));
    fr.solve = *dim;
    fr.margin = parse_margin(o.value("margin", std::string("5%")));
    const FitResult res = fit(req.scenario, fr, RequestFiles(req.files));
    out["fit"] = json::parse(render_fit_json(res));
    out["table"] = render_fit_table(res);
    out["warnings"] = warnings_of(res.warnings);
  });
}

const char* trainmem_plan_json(const char* request_json) {
  using namespace trainmem;
  return guarded([&](json& out) {
    const Request req = parse_request(request_json);
    const json o = req.options.value("plan", json::object());
    auto text = [&](const char* key, const char* def) {
      return o.contains(key) ? value_text(key, o[key]) : std::string(def);
    };
    const PlanRequest pr = plan_request(text("global_batch", ""), text("nodes", ""), text("top", "10"),
                                        text("margin", "5%"));
    const PlanResult res = plan(req.given, pr, RequestFiles(req.files));
    out["plan"] = json::parse(render_plan_json(res));
    out["table"] = render_plan_table(res);
    out["warnings"] = warnings_of(res.warnings);
  });
}

const char* trainmem_models_json(void) {
  using namespace trainmem;
  return guarded([](json& out) { out["models"] = json::parse(render_models_json(model_listings())); });
}

const char* trainmem_gpus_json(void) {
  using namespace trainmem;
  return guarded([](json& out) { out["gpus"] = json::parse(render_gpus_json(gpu_catalog())); });
}

const char* trainmem_fields_json(void) {
  using namespace trainmem;
  return guarded([](json& out) {
    const Scenario defaults;
    json fields = json::array();
    for (const Field& f : scenario_fields()) {
      const char* group = f.group == FieldGroup::kModel ? "model" : f.group == FieldGroup::kTraining ? "training" : "runtime";
      fields.push_back({{"name", f.name}, {"help", f.help}, {"group", group}, {"repeatable", f.repeatable},
                        {"default", f.repeatable ? "" : field_text(defaults, f.name)}, {"flag", cli_flag(f.name)}});
    }
    out["fields"] = std::move(fields);
  });
}

}  // extern "C"
