// trainmem: how much GPU memory will training this transformer take, and why.
// A thin CLI over the library: parse flags, run the pipeline, print. Errors print "trainmem: <message>" and
// exit 2.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <string>

#include "trainmem/allocator.h"
#include "trainmem/config.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/formulas.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"
#include "trainmem/report.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"

namespace {

using namespace trainmem;

constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 3;  // a defect of trainmem, not of the input

[[noreturn]] void bad_flag(const std::string& flag, const std::string& value, const std::string& expected);
uint64_t parse_count(const std::string& flag, const std::string& s, uint64_t max);

// The value a parse_* function found, or a bad-flag error naming what was expected.
template <typename V>
V parsed(const std::optional<V>& v, const std::string& flag, const std::string& value, const std::string& expected) {
  if (!v) bad_flag(flag, value, expected);
  return *v;
}

// Flags shared by the subcommands, as strings: they are parsed strictly after CLI11 has read them, so that
// every bad value gets the same kind of message.
struct Flags {
  std::string model = "gpt2", impl, attention = "sdpa", format = "table", dtype = "float32";
  std::vector<std::string> overrides;
  std::string batch = "8", seq = "1024", grad_accum = "1";
  std::string precision = "bf16-amp", optimizer = "adamw", optimizer_impl = "auto", gpu;
  std::string loop, torch = "2.9", alloc_conf, steps = "2";
  std::string by = "layer", min_bytes = "0", step, unit = "auto";
  std::string solve = "batch", margin = "5%";
};

void add_model_flags(CLI::App* c, Flags& f) {
  c->add_option("--model,-m", f.model, "preset name (trainmem models) or path to a config.json")->capture_default_str();
  c->add_option("--impl", f.impl, "hf | nanogpt (default: nanogpt for model_type nanogpt, hf otherwise)");
  c->add_option("--attention", f.attention, "eager | sdpa")->capture_default_str();
  c->add_option("--set", f.overrides, "override a config key: --set key=value (repeatable)");
}

void add_setup_flags(CLI::App* c, Flags& f) {
  c->add_option("--batch,-b", f.batch, "micro-batch size")->capture_default_str();
  c->add_option("--seq,-s", f.seq, "sequence length in tokens")->capture_default_str();
  c->add_option("--precision,-p", f.precision, "fp32 | fp16-amp | bf16-amp | fp16 | bf16")->capture_default_str();
  c->add_option("--optimizer", f.optimizer, "adamw | adam | sgd | sgd-momentum | none")->capture_default_str();
  c->add_option("--optimizer-impl", f.optimizer_impl, "auto | foreach | fused | for-loop")->capture_default_str();
  c->add_option("--grad-accum", f.grad_accum, "micro-batches per optimizer step")->capture_default_str();
  c->add_option("--gpu", f.gpu, "GPU from the catalog (trainmem gpus); sets the architecture (default sm_80)");
  c->add_option("--loop", f.loop, "training script: nanogpt | hf | seed000 | plain (default: by --impl)");
  c->add_option("--torch", f.torch, "PyTorch version whose runtime behaviour to model (1.13 .. 2.11)")
      ->capture_default_str();
  c->add_option("--alloc-conf", f.alloc_conf, "PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True");
  c->add_option("--steps", f.steps, "optimizer steps to simulate (the first creates the optimizer state)")
      ->capture_default_str();
}

SimOptions sim_options(const Flags& f, const TrainSetup& s) {
  SimOptions o;  // the loop stays kAuto (the model's own) unless --loop names one
  if (!f.loop.empty()) o.loop = parsed(parse_loop(f.loop), "--loop", f.loop, "nanogpt, hf, seed000 or plain");
  o.torch = parsed(parse_torch_version(f.torch), "--torch", f.torch, "a PyTorch version from 1.13 to 2.11, like 2.9");
  if (!s.gpu.empty()) o.sm = find_gpu(s.gpu).sm;
  o.steps = static_cast<uint32_t>(parse_count("--steps", f.steps, 16));
  return o;
}

void add_format_flag(CLI::App* c, Flags& f) {
  c->add_option("--format,-f", f.format, "table | json")->capture_default_str();
}

[[noreturn]] void bad_flag(const std::string& flag, const std::string& value, const std::string& expected) {
  throw Error(fmt::format("{} \"{}\": expected {}", flag, value, expected));
}

// A positive integer in [1, max]: digits only, so "-3", "1.5", "1e3" and "" are rejected.
// An integer in [min, max] written with digits only, so "-3", "1.5", "1e3" and "" are rejected; `expected`
// describes it in the error.
uint64_t parse_uint(const std::string& flag, const std::string& s, uint64_t min, uint64_t max,
                    const std::string& expected) {
  if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos) {
    bad_flag(flag, s, expected);
  }
  uint64_t v = 0;
  for (char ch : s) {
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, static_cast<uint64_t>(ch - '0'), &v)) {
      bad_flag(flag, s, expected);
    }
  }
  if (v < min || v > max) bad_flag(flag, s, expected);
  return v;
}

// A positive integer in [1, max].
uint64_t parse_count(const std::string& flag, const std::string& s, uint64_t max) {
  return parse_uint(flag, s, 1, max, fmt::format("an integer in [1, {}]", max));
}

ModelSpec load(const Flags& f) {
  ModelRequest req;
  req.model = f.model;
  req.overrides = f.overrides;
  if (!f.impl.empty()) req.impl = parsed(parse_impl(f.impl), "--impl", f.impl, "hf or nanogpt");
  req.attention = parsed(parse_attn_impl(f.attention), "--attention", f.attention, "eager or sdpa");
  return load_model(req, DiskFileReader());
}

TrainSetup setup_from(const Flags& f) {
  TrainSetup s;
  s.batch = parse_count("--batch", f.batch, 1u << 20);
  s.seq = parse_count("--seq", f.seq, 1u << 24);
  s.grad_accum = parse_count("--grad-accum", f.grad_accum, 1u << 20);
  s.precision = parsed(parse_precision(f.precision), "--precision", f.precision, "fp32, fp16-amp, bf16-amp, fp16 or bf16");
  s.optimizer = parsed(parse_optimizer(f.optimizer), "--optimizer", f.optimizer, "adamw, adam, sgd, sgd-momentum or none");
  s.optimizer_impl = parsed(parse_optimizer_impl(f.optimizer_impl), "--optimizer-impl", f.optimizer_impl, "auto, foreach, fused or for-loop");
  if (!f.gpu.empty()) s.gpu = find_gpu(f.gpu).name;
  return s;
}

bool json_format(const Flags& f) {
  if (f.format != "table" && f.format != "json") bad_flag("--format", f.format, "table or json");
  return f.format == "json";
}

int run_models(const Flags& f) {
  std::vector<ModelListing> rows;
  for (const Preset& p : presets()) {
    ModelRequest req;
    req.model = std::string(p.name);
    const ModelSpec m = load_model(req, DiskFileReader());
    rows.push_back({m.name, m.model_type, parameter_count(build_inventory(m)), m.source});
  }
  std::cout << (json_format(f) ? render_models_json(rows) : render_models_table(rows));
  return 0;
}

int run_params(const Flags& f) {
  const ModelSpec m = load(f);
  const auto d = parse_dtype(f.dtype);
  if (!d || !is_floating(*d)) bad_flag("--dtype", f.dtype, "float32, float16 or bfloat16");
  const Inventory inv = build_inventory(m);
  std::cout << (json_format(f) ? render_inventory_json(m, inv, *d) : render_inventory_table(m, inv, *d));
  return 0;
}

int run_formulas(const Flags& f) {
  const ModelSpec m = load(f);
  const TrainSetup s = setup_from(f);
  validate_setup(m, s);
  const Inventory inv = build_inventory(m);
  const FormulaReport r{m, s, parameter_count(inv), seed001_contract(m, s), seed002_korthikanti(m, s),
                        seed000_peak(m, inv, s)};
  std::cout << (json_format(f) ? render_formulas_json(r) : render_formulas_table(r));
  return 0;
}

int run_timeline(const Flags& f) {
  const ModelSpec m = load(f);
  const TrainSetup s = setup_from(f);
  if (f.format != "table" && f.format != "csv" && f.format != "json") bad_flag("--format", f.format, "table, csv or json");
  TimelineOptions to;
  to.granularity = parsed(parse_granularity(f.by), "--by", f.by, "event, layer or phase");
  to.unit = parsed(parse_unit(f.unit), "--unit", f.unit, "auto, B, KiB, MiB or GiB");
  to.min_bytes = parse_uint("--min-bytes", f.min_bytes, 0, uint64_t{1} << 62, "a number of bytes (an integer, 0 or more)");
  const Inventory inv = build_inventory(m);
  SimOptions o = sim_options(f, s);
  if (!f.step.empty()) {
    to.step = static_cast<uint32_t>(
        parse_uint("--step", f.step, 0, o.steps, fmt::format("a simulated step: 0 (setup) to {}", o.steps)));
  }
  const GpuSpec* gpu = s.gpu.empty() ? nullptr : &find_gpu(s.gpu);
  const Estimate e = estimate(m, inv, s, o, parse_alloc_conf(f.alloc_conf, o.torch), gpu);
  const auto rows = timeline_rows(e, to);
  if (f.format == "csv") {
    std::cout << render_timeline_csv(e, to, rows);
  } else if (f.format == "json") {
    std::cout << render_timeline_json(e, to, rows);
  } else {
    std::cout << render_timeline_table(e, to, rows);
  }
  return 0;
}

int run_fit(const Flags& f, bool batch_given, bool seq_given) {
  const ModelSpec m = load(f);
  TrainSetup s = setup_from(f);
  const bool json = json_format(f);
  if (s.gpu.empty()) bad_flag("--gpu", "", "a GPU from the catalog (trainmem gpus): fit needs a device");
  FitRequest r;
  r.solve = parsed(parse_fit_dimension(f.solve), "--solve", f.solve, "batch or seq");
  r.margin = parse_margin(f.margin);
  // The solved size is fit's to find; the other one is given (the micro-batch defaults to 1 when solving for
  // the sequence).
  if (r.solve == FitDimension::kBatch && batch_given) {
    throw Error(fmt::format("--batch {}: fit finds the micro-batch; leave --batch out, or keep it and find the "
                            "sequence with --solve seq", f.batch));
  }
  if (r.solve == FitDimension::kSeq && seq_given) {
    throw Error(fmt::format("--seq {}: with --solve seq, fit finds the sequence length; leave --seq out", f.seq));
  }
  if (r.solve == FitDimension::kSeq && !batch_given) s.batch = 1;
  const SimOptions o = sim_options(f, s);
  const FitResult res = fit(m, s, o, parse_alloc_conf(f.alloc_conf, o.torch), find_gpu(s.gpu), r);
  std::cout << (json ? render_fit_json(res) : render_fit_table(res));
  return 0;
}

int run_estimate(const Flags& f) {
  const ModelSpec m = load(f);
  const TrainSetup s = setup_from(f);
  const bool json = json_format(f);
  const Inventory inv = build_inventory(m);
  const SimOptions o = sim_options(f, s);
  const GpuSpec* gpu = s.gpu.empty() ? nullptr : &find_gpu(s.gpu);
  const Estimate e = estimate(m, inv, s, o, parse_alloc_conf(f.alloc_conf, o.torch), gpu);
  std::cout << (json ? render_estimate_json(e, gpu) : render_estimate_table(e, gpu));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainmem: how much GPU memory training a transformer takes, and why"};
  app.require_subcommand(1);
  Flags f;
  auto* models = app.add_subcommand("models", "list the built-in model presets with their parameter counts");
  add_format_flag(models, f);
  app.add_subcommand("gpus", "list the GPU catalog");
  auto* params = app.add_subcommand("params", "every parameter and buffer tensor with shape, elements and bytes");
  add_model_flags(params, f);
  params->add_option("--dtype", f.dtype, "float32 | float16 | bfloat16")->capture_default_str();
  add_format_flag(params, f);
  auto* formulas = app.add_subcommand("formulas", "the seed documents' closed forms side by side");
  add_model_flags(formulas, f);
  add_setup_flags(formulas, f);
  add_format_flag(formulas, f);
  auto* est = app.add_subcommand("estimate", "peak GPU memory of one training step, component by component");
  add_model_flags(est, f);
  add_setup_flags(est, f);
  add_format_flag(est, f);
  auto* tl = app.add_subcommand("timeline", "the simulated step event by event, with live bytes and peaks");
  add_model_flags(tl, f);
  add_setup_flags(tl, f);
  tl->add_option("--format,-f", f.format, "table | csv | json")->capture_default_str();
  tl->add_option("--by", f.by, "event | layer | phase: one row per event, or per run of events")
      ->capture_default_str();
  tl->add_option("--min-bytes", f.min_bytes, "with --by event: list only tensors of at least this many bytes")
      ->capture_default_str();
  tl->add_option("--step", f.step, "only this optimizer step (0: model load and setup)");
  tl->add_option("--unit", f.unit, "table columns in auto | B | KiB | MiB | GiB")->capture_default_str();
  auto* fitc = app.add_subcommand("fit", "the largest micro-batch (or sequence) that fits a GPU, or what would fit");
  add_model_flags(fitc, f);
  add_setup_flags(fitc, f);
  add_format_flag(fitc, f);
  fitc->add_option("--solve", f.solve, "batch | seq: which size to maximise (the other stays as given)")
      ->capture_default_str();
  fitc->add_option("--margin", f.margin, "memory kept free: a share of the GPU (5%) or a size (2GiB)")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitBadInput;
  }
  try {
    if (models->parsed()) return run_models(f);
    if (app.got_subcommand("gpus")) {
      std::cout << render_gpus_table(gpu_catalog());
      return 0;
    }
    if (params->parsed()) return run_params(f);
    if (formulas->parsed()) return run_formulas(f);
    if (est->parsed()) return run_estimate(f);
    if (tl->parsed()) return run_timeline(f);
    if (fitc->parsed()) return run_fit(f, fitc->count("--batch") > 0, fitc->count("--seq") > 0);
  } catch (const Error& e) {
    std::cerr << "trainmem: " << e.what() << "\n";
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "trainmem: internal error: " << e.what() << "\n";
    return kExitInternal;
  }
  return 0;
}
