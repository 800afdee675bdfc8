// trainmem: how much GPU memory will training this transformer take, and why.
// A thin CLI over the library: each flag is a field of the request (scenario.h), given to set_field() as
// typed; resolve(), estimate() and fit() hold every rule; the report renders the result. Errors print
// "trainmem: <message>"; the exit code says what happened (kExit* below).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/formulas.h"
#include "trainmem/plot.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"
#include "trainmem/snapshot.h"
#include "serve.h"

namespace {

using namespace trainmem;

constexpr int kExitDoesNotFit = 1;  // estimate/fit with --gpu: the step does not fit (a launch would OOM)
constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 3;    // a defect of trainmem, not of the input

// The flags, as typed. Scenario fields go to set_field() in the table's order; the rest are the subcommands'.
struct Flags {
  std::map<std::string, std::vector<std::string>, std::less<>> fields;
  std::string format = "table", dtype = "float32";
  std::string by = "layer", min_bytes = "0", step, unit = "auto";
  std::string solve = "batch", margin = "5%";
  std::string plot;  // --plot FILE: the step as an SVG picture
  std::string snapshot;  // diff --snapshot FILE: a measured run's snapshot pickle or measurement JSON
  std::string global_batch, nodes, top = "10";  // trainmem plan
  cli::ServeOptions serve;  // trainmem serve
};

// Short spellings, kept from earlier versions of the CLI.
std::string flag_names(std::string_view field) {
  const std::string flag = cli_flag(field);
  if (field == "model") return flag + ",-m";
  if (field == "batch") return flag + ",-b";
  if (field == "seq") return flag + ",-s";
  if (field == "precision") return flag + ",-p";
  return flag;
}

void add_fields(CLI::App* c, Flags& f, std::initializer_list<FieldGroup> groups) {
  const Scenario defaults;
  for (const Field& field : scenario_fields()) {
    if (std::find(groups.begin(), groups.end(), field.group) == groups.end()) continue;
    const std::string def = field_text(defaults, field.name);
    const std::string help = def.empty() || field.repeatable ? std::string(field.help)
                                                            : fmt::format("{} (default: {})", field.help, def);
    auto* opt = c->add_option(flag_names(field.name), f.fields[std::string(field.name)], help);
    if (!field.repeatable) opt->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
}

void add_format_flag(CLI::App* c, Flags& f, std::string_view choices = "table | json") {
  c->add_option("--format,-f", f.format, std::string(choices))->capture_default_str();
}

std::vector<FieldChange> given_fields(const Flags& f) {
  std::vector<FieldChange> given;
  for (const auto& [name, values] : f.fields) {
    for (const std::string& v : values) given.push_back({name, v});
  }
  return given;
}

Scenario scenario_from(const Flags& f) { return trainmem::scenario_from(given_fields(f)); }

ResolvedScenario resolved_from(const Flags& f) { return resolve(scenario_from(f)); }

// What the library has to say besides the answer (a default taken, a slower kernel on this card), once the
// question has been answered.
void warn(const std::vector<std::string>& warnings) {
  for (const std::string& w : warnings) std::cerr << "trainmem: warning: " << w << "\n";
}

// --plot FILE: the library draws, the CLI only writes the file.
void write_plot(const std::string& path, const std::string& svg) {
  std::ofstream out(path, std::ios::binary);
  if (out) out << svg;
  if (!out || !out.flush()) {
    throw FieldError("plot", fmt::format("\"{}\": cannot write the picture there ({})", path, std::strerror(errno)));
  }
}

bool json_format(const Flags& f) {
  if (f.format != "table" && f.format != "json") throw FieldError("format", fmt::format("\"{}\": expected table or json", f.format));
  return f.format == "json";
}

int run_models(const Flags& f) {
  const std::vector<ModelListing> rows = model_listings();
  std::cout << (json_format(f) ? render_models_json(rows) : render_models_table(rows));
  return 0;
}

int run_gpus(const Flags& f) {
  std::cout << (json_format(f) ? render_gpus_json(gpu_catalog()) : render_gpus_table(gpu_catalog()));
  return 0;
}

int run_params(const Flags& f) {
  const ResolvedScenario r = resolve_model(scenario_from(f), DiskFileReader());
  const DType d = listing_dtype(f.dtype);
  const bool json = json_format(f);
  std::cout << (json ? render_inventory_json(r.model, r.inventory, d) : render_inventory_table(r.model, r.inventory, d));
  warn(r.warnings);
  return 0;
}

int run_formulas(const Flags& f) {
  const ResolvedScenario r = resolved_from(f);
  const bool json = json_format(f);
  const FormulaReport rep = formula_report(r);
  std::cout << (json ? render_formulas_json(rep) : render_formulas_table(rep));
  warn(r.warnings);
  return 0;
}

int run_estimate(const Flags& f) {
  const ResolvedScenario r = resolved_from(f);
  const bool json = json_format(f);
  const GpuSpec* gpu = r.gpu ? &*r.gpu : nullptr;
  const Estimate e = estimate(r);
  if (!f.plot.empty()) write_plot(f.plot, render_breakdown_svg(e));
  std::cout << (json ? render_estimate_json(e, gpu) : render_estimate_table(e, gpu));
  warn(r.warnings);
  warn(e.warnings);
  return e.device && !e.device->fits ? kExitDoesNotFit : 0;
}

int run_timeline(const Flags& f) {
  if (f.format != "table" && f.format != "csv" && f.format != "json" && f.format != "html" &&
      f.format != "snapshot") {
    throw FieldError("format", fmt::format("\"{}\": expected table, csv, json, html or snapshot", f.format));
  }
  const ResolvedScenario r = resolved_from(f);
  TimelineOptions to = parse_timeline_options(f.by, f.unit, f.min_bytes, f.step, r.options.steps);
  if (f.format == "snapshot" && isatty(STDOUT_FILENO)) {
    throw FieldError("format", "\"snapshot\": a binary pickle; send it to a file (> step.pickle), not the terminal");
  }
  if (f.format == "snapshot" && to.step) {
    throw FieldError("step", fmt::format("\"{}\": --format snapshot exports the whole run (a snapshot's trace "
                                         "starts where its blocks do)", f.step));
  }
  const Estimate e = estimate(r);
  if (f.format == "snapshot") {
    if (!f.plot.empty()) write_plot(f.plot, render_timeline_svg(e, timeline_plot(e, to.step)));
    std::cout << render_snapshot_pickle(e, r.alloc) << std::flush;
    warn(r.warnings);
    warn(e.warnings);
    return 0;
  }
  const auto rows = timeline_rows(e, to);
  if (!f.plot.empty() || f.format == "html") {
    const TimelinePlot p = timeline_plot(e, to.step);
    if (!f.plot.empty()) write_plot(f.plot, render_timeline_svg(e, p));
    if (f.format == "html") std::cout << render_timeline_html(e, p, render_timeline_table(e, to, rows));
  }
  if (f.format == "html") {
    // the page holds the table
  } else if (f.format == "csv") {
    std::cout << render_timeline_csv(e, to, rows);
  } else if (f.format == "json") {
    std::cout << render_timeline_json(e, to, rows);
  } else {
    std::cout << render_timeline_table(e, to, rows);
  }
  warn(r.warnings);
  warn(e.warnings);
  return 0;
}

// diff --snapshot FILE: a measured run against the simulated one. A measurement file names its own scenario
// (trainmem_args): used when no --model is given.
int run_diff(Flags f) {
  const bool json = json_format(f);
  std::error_code ec;
  if (std::filesystem::is_directory(f.snapshot, ec)) {
    throw FieldError("snapshot", fmt::format("\"{}\": a folder; expected a snapshot pickle or a measurement JSON", f.snapshot));
  }
  if (std::filesystem::exists(f.snapshot, ec) && !std::filesystem::is_regular_file(f.snapshot, ec)) {
    throw FieldError("snapshot", fmt::format("\"{}\": not a regular file (expected a snapshot pickle or a "
                                             "measurement JSON)", f.snapshot));
  }
  if (const auto size = std::filesystem::file_size(f.snapshot, ec); !ec && size > kPickleMaxBytes) {
    throw FieldError("snapshot", fmt::format("\"{}\": {} bytes, larger than the 4 GiB trainmem reads", f.snapshot, size));
  }
  std::ifstream in(f.snapshot, std::ios::binary);
  if (!in) throw FieldError("snapshot", fmt::format("\"{}\": cannot read it ({})", f.snapshot, std::strerror(errno)));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw FieldError("snapshot", fmt::format("\"{}\": cannot read it", f.snapshot));
  const MeasuredTrace m = read_measured_trace(bytes, f.snapshot);
  if (f.fields["model"].empty()) {
    if (m.trainmem_args.empty()) {
      throw FieldError("model", "missing: give the scenario of the measured run (--model and its flags)");
    }
    std::map<std::string, std::string, std::less<>> field_of;
    for (const Field& field : scenario_fields()) field_of[cli_flag(field.name)] = std::string(field.name);
    for (size_t i = 0; i < m.trainmem_args.size(); i += 2) {
      auto it = field_of.find(m.trainmem_args[i]);
      if (it == field_of.end() || i + 1 >= m.trainmem_args.size()) {
        throw Error(fmt::format("{}: trainmem_args: \"{}\" is not a flag with a value", f.snapshot, m.trainmem_args[i]));
      }
      f.fields[it->second].push_back(m.trainmem_args[i + 1]);
    }
  }
  const ResolvedScenario r = resolved_from(f);
  const Estimate e = estimate(r);
  const SnapshotDiff d = diff_snapshot(e, m);
  std::cout << (json ? render_snapshot_diff_json(e, d) : render_snapshot_diff_table(e, d));
  warn(r.warnings);
  warn(e.warnings);
  return 0;
}

int run_fit(const Flags& f) {
  const bool json = json_format(f);
  const FitRequest req = fit_request(f.solve, f.margin);
  const Scenario s = scenario_from(f);
  const FitResult res = fit(s, req, DiskFileReader());
  warn(res.warnings);
  std::cout << (json ? render_fit_json(res) : render_fit_table(res));
  return res.largest ? 0 : kExitDoesNotFit;
}

int run_plan(const Flags& f) {
  const bool json = json_format(f);
  const PlanRequest req = plan_request(f.global_batch, f.nodes, f.top, f.margin);
  const PlanResult res = plan(given_fields(f), req, DiskFileReader());
  warn(res.warnings);
  std::cout << (json ? render_plan_json(res) : render_plan_table(res));
  return res.rows.empty() ? kExitDoesNotFit : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainmem: how much GPU memory training a transformer takes, and why"};
  app.set_version_flag("--version", std::string("trainmem ") + TRAINMEM_VERSION);
  app.require_subcommand(1);
  app.footer(
      "Exit codes: 0 done (and, with --gpu, the step fits); 1 estimate or fit with --gpu: the step does not fit; "
      "2 bad input; 3 internal error.");
  Flags f;
  constexpr auto kModel = FieldGroup::kModel;
  constexpr auto kTraining = FieldGroup::kTraining;
  constexpr auto kRuntime = FieldGroup::kRuntime;
  auto* models = app.add_subcommand("models", "list the built-in model presets with their parameter counts");
  add_format_flag(models, f);
  auto* gpus = app.add_subcommand("gpus", "list the GPU catalog");
  add_format_flag(gpus, f);
  auto* params = app.add_subcommand("params", "every parameter and buffer tensor with shape, elements and bytes");
  add_fields(params, f, {kModel});
  params->add_option("--dtype", f.dtype, "float32 | float16 | bfloat16")->capture_default_str();
  add_format_flag(params, f);
  auto* formulas = app.add_subcommand("formulas", "the seed documents' closed forms side by side");
  add_fields(formulas, f, {kModel, kTraining, kRuntime});  // runtime fields are refused with a reason
  add_format_flag(formulas, f);
  auto* est = app.add_subcommand("estimate", "peak GPU memory of one training step, component by component");
  add_fields(est, f, {kModel, kTraining, kRuntime});
  add_format_flag(est, f);
  est->add_option("--plot", f.plot, "also draw the breakdown at the peak (against the card with --gpu) as an SVG "
                                    "picture in this file");
  auto* tl = app.add_subcommand("timeline", "the simulated step event by event, with live bytes and peaks");
  add_fields(tl, f, {kModel, kTraining, kRuntime});
  add_format_flag(tl, f, "table | csv | json | html (a page with the picture and the table) | snapshot (a PyTorch "
                         "memory snapshot pickle of the run, for pytorch.org/memory_viz)");
  tl->add_option("--plot", f.plot, "also draw the run (with --step, that step) as an SVG picture in this file: live "
                                   "bytes by category, allocated and reserved, the phases, the peak, the card");
  tl->add_option("--by", f.by, "event | layer | phase: one row per event, or per run of events")->capture_default_str();
  tl->add_option("--min-bytes", f.min_bytes, "with --by event: list only tensors of at least this size (4096, 1MiB)")
      ->capture_default_str();
  tl->add_option("--step", f.step, "only this optimizer step (0: model load and setup)");
  tl->add_option("--unit", f.unit, "table columns in auto | B | KiB | MiB | GiB")->capture_default_str();
  auto* fitc = app.add_subcommand("fit", "the largest micro-batch (or sequence) that fits a GPU, or what would fit");
  add_fields(fitc, f, {kModel, kTraining, kRuntime});
  add_format_flag(fitc, f);
  fitc->add_option("--solve", f.solve, "batch | seq: which size to maximise (the other stays as given)")
      ->capture_default_str();
  fitc->add_option("--margin", f.margin, "memory kept free: a share of the GPU (5%) or a size (2GiB)")
      ->capture_default_str();

  auto* planc = app.add_subcommand("plan", "the fastest setups that fit a cluster: parallel sizes, sharding, "
                                           "checkpointing, precision and micro-batch, ranked by predicted tokens/s");
  add_fields(planc, f, {kModel, kTraining, kRuntime});
  add_format_flag(planc, f);
  planc->add_option("--global-batch", f.global_batch, "sequences per optimizer step over the whole cluster "
                                                      "(required)");
  planc->add_option("--nodes", f.nodes, "nodes the --gpus are spread over (sets --gpus-per-node to N / nodes)");
  planc->add_option("--top", f.top, "setups ranked")->capture_default_str();
  planc->add_option("--margin", f.margin, "memory kept free on every GPU: a share (5%) or a size (2GiB)")
      ->capture_default_str();

  auto* diffc = app.add_subcommand("diff", "a measured run (a torch.cuda.memory._snapshot() pickle or a "
                                           "measurement JSON) against the simulated one, category by category");
  add_fields(diffc, f, {kModel, kTraining, kRuntime});
  diffc->add_option("--snapshot", f.snapshot, "the measured run: a snapshot pickle with its device trace, or a "
                                              "trainmem-measurement-v1 JSON (its scenario is used without --model)")
      ->required();
  add_format_flag(diffc, f);

  auto* srv = app.add_subcommand("serve", "serve the web page (make web builds it) on this machine over HTTP");
  srv->add_option("--port", f.serve.port, "TCP port (0: any free port)")->capture_default_str();
  srv->add_option("--host", f.serve.host, "address to listen on")->capture_default_str();
  srv->add_option("--root", f.serve.root, "the page's folder (default: web/ beside this executable, where make web "
                                          "puts it)");

  // A first word that names no subcommand: say so (CLI11 would ask for a subcommand instead).
  auto known = [&](const char* name) {
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (sub->get_name() == name) return true;
    }
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !known(argv[1])) {
    std::cerr << fmt::format("trainmem: unknown subcommand \"{}\"; expected models, gpus, params, formulas, "
                             "estimate, timeline, fit, plan, diff or serve (trainmem --help)\n", argv[1]);
    return kExitBadInput;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitBadInput;
  }
  try {
    if (models->parsed()) return run_models(f);
    if (gpus->parsed()) return run_gpus(f);
    if (params->parsed()) return run_params(f);
    if (formulas->parsed()) return run_formulas(f);
    if (est->parsed()) return run_estimate(f);
    if (tl->parsed()) return run_timeline(f);
    if (fitc->parsed()) return run_fit(f);
    if (diffc->parsed()) return run_diff(f);
    if (planc->parsed()) return run_plan(f);
    if (srv->parsed()) {
      if (f.serve.root.empty()) f.serve.root = cli::default_web_root(argc > 0 ? argv[0] : nullptr);
      cli::serve(f.serve);
    }
  } catch (const Error& e) {
    std::cerr << "trainmem: " << error_message(e) << "\n";
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "trainmem: internal error: " << e.what() << "\n";
    return kExitInternal;
  }
  return 0;
}
