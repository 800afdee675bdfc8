// `trainmem estimate`: the breakdown table and the JSON contract.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "text_table.h"
#include "trainmem/report.h"

namespace trainmem {

namespace {

std::string headline(const Estimate& e) {
  const ModelSpec& m = e.model;
  const TrainSetup& s = e.setup;
  std::string accum = s.grad_accum > 1 ? fmt::format(", {} micro-batches per step", s.grad_accum) : "";
  return fmt::format(
      "{} (model_type {}, {} code, {} attention): batch {} x seq {}, {}, {} ({}){}\n"
      "{} training loop, PyTorch {}, sm_{}; parameters: {} ({:.1f} M)\n",
      m.name, m.model_type, impl_name(m.impl), attn_impl_name(m.attn_impl), s.batch, s.seq,
      precision_name(s.precision), optimizer_name(s.optimizer), optimizer_impl_name(s.optimizer_impl), accum,
      loop_name(e.options.loop), torch_version_name(e.options.torch), e.options.sm, with_commas(e.parameters.value),
      static_cast<double>(e.parameters.value) / 1e6);
}

std::string where(const Estimate& e) {
  return fmt::format("{} of step {}{}", phase_name(e.peak_phase), e.peak_step,
                     e.setup.grad_accum > 1 ? fmt::format(", micro-batch {}", e.peak_micro) : "");
}

}  // namespace

std::string render_estimate_table(const Estimate& e, const GpuSpec* gpu) {
  using TT = report::TextTable;
  TT t({{"at the peak", TT::kLeft}, {"bytes", TT::kRight}, {"size", TT::kRight}, {"share", TT::kRight},
        {"what", TT::kLeft}});
  const uint64_t total = e.peak_allocated.value;
  for (const Component& c : e.components) {
    t.row({c.name, with_commas(c.bytes.value), format_bytes(c.bytes), report::percent(c.bytes.value, total), c.note});
  }
  t.rule();
  t.row({"peak", with_commas(total), format_bytes(e.peak_allocated), "100.0%", "in the " + where(e)});
  std::string out = headline(e) + "\n" + t.str();
  out += fmt::format("\n  steady state (before a step's forward): {} ({})\n", with_commas(e.steady_state.value),
                     format_bytes(e.steady_state));
  out += fmt::format("  saved for backward at the end of forward: {} ({})\n", with_commas(e.saved_activations.value),
                     format_bytes(e.saved_activations));
  if (gpu) {
    out += fmt::format("\n{} ({}): {} usable by the process; the peak of live tensors uses {} of it\n", gpu->name,
                       gpu->torch_name, format_bytes(gpu->runtime_total),
                       report::percent(total, gpu->runtime_total.value));
  }
  return out;
}

std::string render_estimate_json(const Estimate& e, const GpuSpec* gpu) {
  const ModelSpec& m = e.model;
  const TrainSetup& s = e.setup;
  nlohmann::json comps = nlohmann::json::array();
  for (const Component& c : e.components) comps.push_back({{"name", c.name}, {"bytes", c.bytes.value}, {"note", c.note}});
  nlohmann::json out = {
      {"model", {{"name", m.name}, {"model_type", m.model_type}, {"source", m.source}}},
      {"setup", {{"model", m.name}, {"impl", impl_name(m.impl)}, {"attention", attn_impl_name(m.attn_impl)},
                 {"batch", s.batch}, {"seq", s.seq}, {"precision", precision_name(s.precision)},
                 {"optimizer", optimizer_name(s.optimizer)}, {"optimizer_impl", optimizer_impl_name(s.optimizer_impl)},
                 {"grad_accum", s.grad_accum}, {"gpu", s.gpu.empty() ? nlohmann::json() : nlohmann::json(s.gpu)},
                 {"loop", loop_name(e.options.loop)}, {"torch", torch_version_name(e.options.torch)},
                 {"sm", e.options.sm}, {"param_dtype", dtype_name(param_dtype(s.precision))},
                 {"compute_dtype", dtype_name(compute_dtype(s.precision))}}},
      {"parameters", {{"count", e.parameters.value}, {"trainable", e.trainable.value}}},
      {"memory", {{"weights_bytes", e.weights.value}, {"buffers_bytes", e.buffers.value},
                  {"gradients_bytes", e.gradients.value}, {"optimizer_state_bytes", e.optimizer_state.value},
                  {"optimizer_moments_bytes", e.optimizer_moments.value},
                  {"optimizer_steps_bytes", e.optimizer_steps.value}, {"inputs_bytes", e.inputs.value},
                  {"saved_activations_bytes", e.saved_activations.value},
                  {"activations_bytes", e.activations.value}, {"steady_state_bytes", e.steady_state.value},
                  {"peak_allocated_bytes", e.peak_allocated.value}, {"peak_phase", phase_name(e.peak_phase)},
                  {"peak_step", e.peak_step}, {"peak_micro_batch", e.peak_micro}}},
      {"peak_components", comps},
  };
  if (gpu) {
    out["device"] = {{"name", gpu->name}, {"torch_name", gpu->torch_name}, {"sm", gpu->sm},
                     {"capacity_bytes", gpu->runtime_total.value}};
  }
  return out.dump(2) + "\n";
}

}  // namespace trainmem
