// trainmem._core: the library for Python (the package trainmem, python/trainmem/__init__.py, is its front).
// Like the CLI, it only turns input into a request and a result into something Python reads: keywords become
// fields of the Scenario by name (scenario_from: the field table and parsing the CLI's flags go through), and
// results come back as the library's own JSON renderings, the documents `trainmem ... --format json` prints.
// No rule lives here (one core, many front ends): the numbers cannot differ from the CLI's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/gpu.h"
#include "trainmem/plan.h"
#include "trainmem/plot.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace py = pybind11;

namespace {

using namespace trainmem;

// Fields by name with their text, as the package turns keywords into them (True -> "true", 8 -> "8").
using Fields = std::vector<std::pair<std::string, std::string>>;

// A config.json given as text (a dict of config.json keys, a PretrainedConfig's to_dict()), served at `path`
// (the model field's value); every other path from the disk.
struct ConfigText {
  std::string path, text;
};

class ConfigReader final : public FileReader {
 public:
  explicit ConfigReader(std::optional<ConfigText> c) : config_(std::move(c)) {}
  std::optional<std::string> read(const std::string& path) const override {
    if (config_ && path == config_->path) return config_->text;
    return disk_.read(path);
  }
  bool is_directory(const std::string& path) const override {
    return !(config_ && path == config_->path) && disk_.is_directory(path);
  }

 private:
  std::optional<ConfigText> config_;
  DiskFileReader disk_;
};

std::optional<ConfigText> config_of(const std::optional<std::pair<std::string, std::string>>& c) {
  if (!c) return std::nullopt;
  return ConfigText{c->first, c->second};
}

Scenario scenario_of(const Fields& fields) {
  std::vector<FieldChange> given;
  given.reserve(fields.size());
  for (const auto& [name, value] : fields) given.push_back({name, value});
  return scenario_from(given);
}

// One estimate, kept whole so that its timeline can be listed at any granularity afterwards.
struct EstimateResult {
  Estimate estimate;
  std::optional<GpuSpec> gpu;
  std::vector<std::string> warnings;  // resolve()'s, then the simulated program's (the CLI's order)

  std::string json() const { return render_estimate_json(estimate, gpu ? &*gpu : nullptr); }
  // `trainmem timeline --by <by> --min-bytes <min_bytes> [--step <step>] --format json` of this estimate
  std::string timeline_json(const std::string& by, const std::string& min_bytes, const std::string& step) const {
    const TimelineOptions o = parse_timeline_options(by, "auto", min_bytes, step, estimate.options.steps);
    return render_timeline_json(estimate, o, timeline_rows(estimate, o));
  }
  // `trainmem estimate --plot`'s picture: the breakdown at the peak (against the card with a GPU)
  std::string breakdown_svg() const { return render_breakdown_svg(estimate); }
  // `trainmem timeline [--step <step>] --plot`'s picture of the step
  std::string timeline_svg(const std::string& step) const {
    const TimelineOptions o = parse_timeline_options("layer", "auto", "0", step, estimate.options.steps);
    return render_timeline_svg(estimate, timeline_plot(estimate, o.step));
  }
};

EstimateResult run_estimate(const Fields& fields, const std::optional<std::pair<std::string, std::string>>& config) {
  const ResolvedScenario r = resolve(scenario_of(fields), ConfigReader(config_of(config)));
  EstimateResult out{estimate(r), r.gpu, r.warnings};
  out.warnings.insert(out.warnings.end(), out.estimate.warnings.begin(), out.estimate.warnings.end());
  return out;
}

// `trainmem fit --solve <solve> --margin <margin> --format json`, and the warnings the CLI prints
std::pair<std::string, std::vector<std::string>> run_fit(
    const Fields& fields, const std::optional<std::pair<std::string, std::string>>& config, const std::string& solve,
    const std::string& margin) {
  const FitRequest req = fit_request(solve, margin);
  const FitResult res = fit(scenario_of(fields), req, ConfigReader(config_of(config)));
  return {render_fit_json(res), res.warnings};
}

// `trainmem plan --global-batch <n> --nodes <n> --top <n> --margin <m> --format json`, and its warnings
std::pair<std::string, std::vector<std::string>> run_plan(
    const Fields& fields, const std::optional<std::pair<std::string, std::string>>& config,
    const std::string& global_batch, const std::string& nodes, const std::string& top, const std::string& margin) {
  const PlanRequest req = plan_request(global_batch, nodes, top, margin);
  std::vector<FieldChange> given;
  for (const auto& [name, value] : fields) given.push_back({name, value});
  const PlanResult res = plan(given, req, ConfigReader(config_of(config)));
  return {render_plan_json(res), res.warnings};
}

// `trainmem params --dtype <dtype> --format json`, and the warnings the CLI prints
std::pair<std::string, std::vector<std::string>> run_params(
    const Fields& fields, const std::optional<std::pair<std::string, std::string>>& config, const std::string& dtype) {
  const ResolvedScenario r = resolve_model(scenario_of(fields), ConfigReader(config_of(config)));
  const DType d = listing_dtype(dtype);
  return {render_inventory_json(r.model, r.inventory, d), r.warnings};
}

// Every field of the scenario the fields make, with its text (field_text: defaults included), in table order.
std::vector<std::pair<std::string, std::string>> field_texts(const Fields& fields) {
  const Scenario s = scenario_of(fields);
  std::vector<std::pair<std::string, std::string>> out;
  for (const Field& f : scenario_fields()) {
    if (!f.repeatable) out.emplace_back(f.name, field_text(s, f.name));
  }
  return out;
}

std::string_view group_name(FieldGroup g) {
  switch (g) {
    case FieldGroup::kModel: return "model";
    case FieldGroup::kTraining: return "training";
    case FieldGroup::kRuntime: return "runtime";
  }
  return "?";
}

// trainmem.Error: the class, created once with the module and never freed (it lives as long as the process).
PyObject* g_error = nullptr;

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "trainmem's C++ core (use the package trainmem, not this module)";
  m.attr("version") = TRAINMEM_VERSION;  // the CLI's --version
  g_error = py::exception<Error>(m, "Error", PyExc_Exception).ptr();
  Py_INCREF(g_error);
  // The CLI's message (error_message, what it prints after "trainmem: "); a FieldError also names its field
  // (the field table's name: "batch") and the rest of the message (detail).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object err = py::reinterpret_borrow<py::object>(g_error)(error_message(e));
      if (const auto* f = dynamic_cast<const FieldError*>(&e)) {
        err.attr("field") = f->field();
        err.attr("detail") = f->detail();
      }
      PyErr_SetObject(g_error, err.ptr());
    }
  });

  m.def("fields", [] {
    std::vector<py::tuple> out;
    const Scenario defaults;
    for (const Field& f : scenario_fields()) {
      out.push_back(py::make_tuple(std::string(f.name), std::string(f.help), std::string(group_name(f.group)),
                                   f.repeatable, f.repeatable ? std::string() : field_text(defaults, f.name)));
    }
    return out;
  }, "The scenario's fields: (name, help, group, repeatable, default text), in table order");
  m.def("check", [](const Fields& fields) { (void)scenario_of(fields); }, py::arg("fields"),
        "Raises Error when a field is unknown or a value does not parse");
  m.def("field_texts", &field_texts, py::arg("fields"));
  m.def("cli_flag", [](const std::string& field) { return cli_flag(field); }, py::arg("field"));

  py::class_<EstimateResult>(m, "EstimateResult")
      .def("json", &EstimateResult::json, py::call_guard<py::gil_scoped_release>())
      .def("timeline_json", &EstimateResult::timeline_json, py::arg("by"), py::arg("min_bytes"), py::arg("step"),
           py::call_guard<py::gil_scoped_release>())
      .def("breakdown_svg", &EstimateResult::breakdown_svg, py::call_guard<py::gil_scoped_release>())
      .def("timeline_svg", &EstimateResult::timeline_svg, py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def_readonly("warnings", &EstimateResult::warnings);
  m.def("estimate", &run_estimate, py::arg("fields"), py::arg("config"), py::call_guard<py::gil_scoped_release>());
  m.def("fit", &run_fit, py::arg("fields"), py::arg("config"), py::arg("solve"), py::arg("margin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("plan", &run_plan, py::arg("fields"), py::arg("config"), py::arg("global_batch"), py::arg("nodes"),
        py::arg("top"), py::arg("margin"), py::call_guard<py::gil_scoped_release>());
  m.def("params", &run_params, py::arg("fields"), py::arg("config"), py::arg("dtype"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gpus", [] { return render_gpus_json(gpu_catalog()); });
}
