// `trainmem formulas`: the seeds' closed forms side by side with the exact inventory.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "json_text.h"
#include "text_table.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

std::vector<std::string> bytes_row(const std::string& name, Bytes b, const std::string& note) {
  return {name, with_commas(b.value), format_bytes(b), note};
}

}  // namespace

FormulaReport formula_report(const ResolvedScenario& r) {
  const Scenario& q = r.request;
  const Optimizer o = q.train.optimizer;
  if (o != Optimizer::kAdamW && o != Optimizer::kAdam) {
    throw FieldError("optimizer", fmt::format("{}: the seeds' closed forms count Adam(W) state (seed 001: 8 bytes, "
                                              "seed 002: 12 bytes per parameter); `trainmem estimate` simulates {}",
                                              optimizer_name(o), optimizer_name(o)));
  }
  for (std::string_view f : {"optimizer_impl", "gpu", "loop", "torch", "alloc_conf", "steps", "lora", "lora_dtype",
                             "freeze", "checkpointing", "checkpoint_reentrant", "checkpoint_every",
                             "input_require_grads", "optimizer_in_backward"}) {
    if (q.was_given(f)) {
      throw FieldError(std::string(f), fmt::format("{}: the seeds' closed forms do not depend on it; `trainmem "
                                                   "estimate` simulates it", field_text(q, f)));
    }
  }
  return FormulaReport{r.model, r.setup, parameter_count(r.inventory), seed001_contract(r.model, r.setup),
                       seed002_korthikanti(r.model, r.setup), seed000_peak(r.model, r.inventory, r.setup)};
}

std::string render_formulas_table(const FormulaReport& f) {
  const ModelSpec& m = f.model;
  std::string out = fmt::format("{}: B={} T={} C={} L={} NH={} KV={} V={} I={}, {}\n", m.name, f.setup.batch,
                                f.setup.seq, m.hidden, m.layers, m.attn.heads, m.attn.kv_heads, m.embed.vocab_size,
                                m.mlp.ffn, precision_name(f.setup.precision));
  out += fmt::format("exact parameter count (inventory): {}\n\n", with_commas(f.inventory_parameters.value));
  using TT = report::TextTable;
  const std::vector<std::pair<std::string, TT::Align>> cols = {
      {"term", TT::kLeft}, {"bytes / elements", TT::kRight}, {"", TT::kRight}, {"formula", TT::kLeft}};

  const Seed001Contract& c = f.seed001;
  const int64_t diff = static_cast<int64_t>(c.p_total.value) - static_cast<int64_t>(f.inventory_parameters.value);
  TT t1(cols);
  t1.row({"parameter_count", with_commas(c.p_total.value), fmt::format("{}{} vs inventory", diff < 0 ? "-" : "+", with_commas(static_cast<uint64_t>(diff < 0 ? -diff : diff))),
          "V*H + L*(2H + 2H^2 + 2H*D_kv + 3H*I) + H"});
  t1.row(bytes_row("weight_memory", c.weights, fmt::format("P x {}", c.bytes_per_weight)));
  t1.row(bytes_row("gradient_memory", c.gradients, "P x 4"));
  t1.row(bytes_row("optimizer_memory", c.optimizer, "P x 8"));
  t1.row(bytes_row("activation_memory", c.activations, "L x S x H x 10 x 4 (one sequence)"));
  t1.row(bytes_row("M_cuda", c.cuda, "512 MB"));
  t1.rule();
  t1.row(bytes_row("total_memory", c.total, "sum"));
  out += "seed 001 training-memory-kernel-v1\n" + t1.str() + "\n";

  const Seed002Korthikanti& k = f.seed002;
  TT t2(cols);
  t2.row(bytes_row("activations per layer", k.activations_per_layer, "sbh(34 + 5as/h)"));
  t2.row(bytes_row("activations", k.activations, "L x per layer"));
  t2.row({"parameters", with_commas(k.params.value), "", "12Lh^2 + vh + sh"});
  t2.row(bytes_row("weights", k.weights, "2P (fp16)"));
  t2.row(bytes_row("gradients", k.gradients, "2P (fp16)"));
  t2.row(bytes_row("optimizer state", k.optimizer, "12P (fp32 copy, momentum, variance)"));
  t2.rule();
  t2.row(bytes_row("total", k.total, "sum"));
  out += "seed 002 Korthikanti et al.\n" + t2.str() + "\n";

  const Seed000Peak& p = f.seed000;
  TT t3(cols);
  t3.row({"Ne", with_commas(p.ne.value), "", "B*T*C"});
  t3.row({"Na", with_commas(p.na.value), "", "B*NH*T^2"});
  t3.row({"Nl", with_commas(p.nl.value), "", "B*T*V"});
  t3.row({"N", with_commas(p.n.value), "", "parameters (inventory)"});
  t3.row({"Nbuf", with_commas(p.nbuf.value), "", "buffer elements (inventory)"});
  t3.row(bytes_row("activations", p.activations, "L(36Ne + 6Na) + 6Ne + 6Nl"));
  t3.row(bytes_row("steady state", p.steady_state, "16N + 4Nbuf"));
  t3.rule();
  t3.row(bytes_row("peak", p.peak, "L(36Ne + 6Na) + 6Ne + 10Nl + 16N + 4Nbuf"));
  out += "seed 000 nanoGPT under autocast\n" + t3.str();
  return out;
}

std::string render_formulas_json(const FormulaReport& f) {
  const Seed001Contract& c = f.seed001;
  const Seed002Korthikanti& k = f.seed002;
  const Seed000Peak& p = f.seed000;
  nlohmann::json out = {
      {"model", f.model.name},
      {"setup", {{"batch", f.setup.batch}, {"seq", f.setup.seq}, {"precision", precision_name(f.setup.precision)}}},
      {"inventory_parameters", f.inventory_parameters.value},
      {"seed001", {{"p_embed", c.p_embed.value}, {"p_layer", c.p_layer.value}, {"p_norm", c.p_norm.value},
                   {"parameter_count", c.p_total.value}, {"weight_bytes", c.weights.value},
                   {"gradient_bytes", c.gradients.value}, {"optimizer_bytes", c.optimizer.value},
                   {"activation_bytes", c.activations.value}, {"cuda_bytes", c.cuda.value},
                   {"total_bytes", c.total.value}}},
      {"seed002", {{"activation_bytes_per_layer", k.activations_per_layer.value},
                   {"activation_bytes", k.activations.value}, {"parameters", k.params.value},
                   {"weight_bytes", k.weights.value}, {"gradient_bytes", k.gradients.value},
                   {"optimizer_bytes", k.optimizer.value}, {"total_bytes", k.total.value}}},
      {"seed000", {{"ne", p.ne.value}, {"na", p.na.value}, {"nl", p.nl.value}, {"n", p.n.value},
                   {"nbuf", p.nbuf.value}, {"activation_bytes", p.activations.value},
                   {"steady_state_bytes", p.steady_state.value}, {"peak_bytes", p.peak.value}}},
  };
  return report::json_text(out);
}

}  // namespace trainmem
