// `trainmem formulas`: the seeds' closed forms side by side with the exact inventory.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "json_text.h"
#include "text_table.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"
#include "trainmem/error.h"
#include "trainmem/sim.h"
#include <algorithm>

namespace trainmem {

namespace {

std::vector<std::string> bytes_row(const std::string& name, Bytes b, const std::string& note) {
  return {name, with_commas(b.value), format_bytes(b), note};
}

std::string gib2(Bytes b) { return fmt::format("{:.2f} GiB", static_cast<double>(b.value) / 1073741824.0); }

// ZeRO's Table 1 and DeepSpeed's estimators (DeepSpeed prints "GB" meaning 2^30 bytes, two decimals).
std::string zero_tables(const ZeroPaperStates& z, const DeepSpeedEstimates& d) {
  using TT = report::TextTable;
  TT t({{"ZeRO stage", TT::kLeft}, {"bytes per device", TT::kRight}, {"", TT::kRight}, {"formula", TT::kLeft}});
  const auto row = [&](const char* name, Bytes b, const char* formula) {
    t.row({name, with_commas(b.value), format_bytes(b), formula});
  };
  row("baseline (DDP)", z.baseline, "(2 + 2 + K)Psi");
  row("P_os (stage 1)", z.os, "2Psi + 2Psi + K*Psi/N");
  row("P_os+g (stage 2)", z.os_g, "2Psi + (2 + K)Psi/N");
  row("P_os+g+p (stage 3)", z.os_g_p, "(2 + 2 + K)Psi/N");
  std::string out = fmt::format("ZeRO (arXiv 1910.02054) Table 1: model states of mixed-precision Adam, Psi = {}, "
                                "K = {}, N = {}\n", with_commas(z.psi.value), kZeroPaperK, z.n) + t.str();
  TT ds({{"DeepSpeed", TT::kLeft}, {"per GPU", TT::kRight}, {"per CPU", TT::kRight}, {"options", TT::kLeft}});
  for (const DeepSpeedRow& r : d.zero2) {
    ds.row({"ZeRO-2", gib2(r.gpu), gib2(r.cpu), fmt::format("offload_optimizer={}", r.offload_optimizer ? "cpu" : "none")});
  }
  for (const DeepSpeedRow& r : d.zero3) {
    ds.row({"ZeRO-3", gib2(r.gpu), gib2(r.cpu),
            fmt::format("offload_param={}, offload_optimizer={}, zero_init={}", r.offload_param ? "cpu" : "none",
                        r.offload_optimizer ? "cpu" : "none", r.zero_init ? 1 : 0)});
  }
  out += fmt::format("\nDeepSpeed's estimators (estimate_zero2/zero3_model_states_mem_needs, 0.19.6): {} GPUs on "
                     "one node, largest layer {} parameters (x4 = {})\n",
                     d.gpus_per_node * d.nodes, with_commas(d.largest_layer_params.value), gib2(d.largest_layer_memory)) +
         ds.str();
  out += "model states only: no activations, buffers, workspaces or communication buffers (trainmem estimate "
         "--dp N --sharding ddp|zero1|zero2|zero3|fsdp2 simulates a rank, --dp-rank which)\n";
  return out;
}

// Seed 002's FLOPs and 6N·tokens beside the simulated step's products (one optimizer step, every micro-batch).
uint64_t products(const FlopLedger& l, WorkPhase p) {
  return checked_add(l.flops[static_cast<size_t>(p)][static_cast<size_t>(FlopKind::kMatmul)],
                     l.flops[static_cast<size_t>(p)][static_cast<size_t>(FlopKind::kAttention)], "FLOPs");
}

std::string flops_table(const FormulaReport& f) {
  using TT = report::TextTable;
  const Seed002Flops& k = f.flops;
  const uint64_t micro = std::max<uint64_t>(f.setup.grad_accum, 1);
  TT t({{"term", TT::kLeft}, {"FLOPs", TT::kRight}, {"", TT::kRight}, {"formula", TT::kLeft}});
  auto row = [&](const std::string& name, uint64_t v, const std::string& formula) {
    t.row({name, with_commas(v), fmt::format("{:.4g}", static_cast<double>(v)), formula});
  };
  row("seed 002 per layer", k.layer_macs, "3b(12sh^2 + 2s^2h), multiply-adds as the seed counts");
  row("seed 002 layers", k.layers_flops, "2 x L x 3b(12sh^2 + 2s^2h): FLOPs, forward + backward");
  row("output head", k.head_flops, "6bshv (not in the seed's form)");
  row("6N tokens", k.six_n_tokens, "6 x N (inventory) x b x s");
  t.rule();
  const FlopLedger& l = f.simulated;
  row("simulated forward products", products(l, WorkPhase::kForward) / micro,
      "matmul + attention kernels, per micro-batch");
  row("simulated backward products", products(l, WorkPhase::kBackward) / micro, "per micro-batch");
  row("simulated recompute products", products(l, WorkPhase::kRecompute) / micro, "checkpointing's second forward");
  row("simulated step, all kernels", l.total_flops(), "+ elementwise, norms, optimizer; every micro-batch");
  return "FLOPs of one step: seed 002 (Korthikanti et al. appendix A, retold) and 6N·tokens beside the simulated "
         "kernels (trainmem/flops.h)\n" + t.str() +
         "  the closed forms count the layers' GEMMs over every (query, key) pair; a causal fused attention kernel "
         "skips the\n  pairs above the diagonal and flash's backward recomputes QK^T (flops.h)\n";
}

}  // namespace

FormulaReport formula_report(const ResolvedScenario& r) {
  const Scenario& q = r.request;
  const Optimizer o = q.train.optimizer;
  if (q.train.generate > 0) {
    throw FieldError("generate", fmt::format("{}: the seeds' closed forms have no KV cache (seed 004 disables "
                                             "use_cache); `trainmem estimate` simulates generation", q.train.generate));
  }
  if (q.was_given("dp") && q.train.task != Task::kTrain) {
    throw FieldError("dp", fmt::format("{}: ZeRO's and DeepSpeed's closed forms are of training (model states); "
                                       "leave --dp out for --task inference", q.train.dp));
  }
  if (q.train.dp_rank) {
    throw FieldError("dp_rank", fmt::format("{}: ZeRO's and DeepSpeed's closed forms split the model states evenly over "
                                            "the ranks; `trainmem estimate` simulates one rank's shards",
                                            *q.train.dp_rank));
  }
  for (std::string_view f : {"tp", "sequence_parallel", "pp", "pp_schedule", "micro_batches", "pp_virtual_stages", "rank"}) {
    // tensor parallelism (tp.h), pipeline parallelism (pp.h)
    if (q.was_given(f)) {
      const bool pp = f != "tp" && f != "sequence_parallel";
      throw FieldError(std::string(f), fmt::format("{}: the seeds' closed forms are of the whole model on one "
                                                   "GPU; `trainmem estimate` simulates {}",
                                                   field_text(q, f), pp ? "every pipeline rank" : "a tensor-parallel rank"));
    }
  }
  if (q.train.task == Task::kTrain && o != Optimizer::kAdamW && o != Optimizer::kAdam) {
    throw FieldError("optimizer", fmt::format("{}: the seeds' closed forms count Adam(W) state (seed 001: 8 bytes, "
                                              "seed 002: 12 bytes per parameter); `trainmem estimate` simulates {}",
                                              optimizer_name(o), optimizer_name(o)));
  }
  for (std::string_view f : {"optimizer_impl", "gpu", "gpus", "loop", "torch", "alloc_conf", "steps", "lora", "lora_dtype",
                             "freeze", "checkpointing", "checkpoint_reentrant", "checkpoint_every",
                             "input_require_grads", "optimizer_in_backward", "sharding", "bucket_cap_mb",
                             "gradient_as_bucket_view", "find_unused_parameters"}) {
    if (q.was_given(f)) {
      throw FieldError(std::string(f), fmt::format("{}: the seeds' closed forms do not depend on it; `trainmem "
                                                   "estimate` simulates it", field_text(q, f)));
    }
  }
  FormulaReport f{r.model, r.setup, parameter_count(r.inventory), {}, {}, {}, seed004_calculator(r.model, r.inventory, r.setup)};
  if (r.setup.task == Task::kTrain) {  // seeds 000-002 describe a training step
    f.seed001 = seed001_contract(r.model, r.setup);
    f.seed002 = seed002_korthikanti(r.model, r.setup);
    f.seed000 = seed000_peak(r.model, r.inventory, r.setup);
    f.flops = seed002_flops(r.model, r.inventory, r.setup);
    f.simulated = simulate(r.model, r.inventory, r.setup, r.options).flops;
    if (q.was_given("dp")) {
      // Psi: the parameters, tied ones once (DeepSpeed's model_to_params dedupes by data_ptr)
      f.zero = zero_paper_states(f.inventory_parameters, r.setup.dp);
      f.deepspeed = deepspeed_estimates(f.inventory_parameters, largest_module_params(r.inventory), r.setup.dp, 1);
    }
  }
  return f;
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

  const Seed004Calculator& v = f.seed004;
  TT t4(cols);
  t4.row({"parameters + buffers", with_commas(v.params.value), "", "inventory"});
  t4.row(bytes_row("parameters", v.parameters,
                   fmt::format("P x {}{}", v.bytes_per_param,
                               v.training ? (v.bytes_per_param == 6 ? " (fp32 master + 16-bit copy)" : "")
                                          : " (the load dtype)")));
  t4.row(bytes_row("activations", v.activations,
                   v.training ? "L x sbh(34 + 5as/h) (Korthikanti sec 4.1)" : "one layer's: sbh(34 + 5as/h)"));
  if (v.training) {
    t4.row(bytes_row("gradients", v.gradients, "P x 4"));
    t4.row(bytes_row("optimizer states", v.optimizer, "P x 8 (Adam: first and second moments)"));
  }
  t4.row(bytes_row("outputs", v.outputs, v.training ? "B x S x V x 4 x 2 (float32 logits and softmax)"
                                                    : "B x S x V x 4 (float32 logits)"));
  t4.row(bytes_row("CUDA kernels", v.cuda_low, "300 MiB (low end)"));
  t4.rule();
  t4.row(bytes_row("total", v.total_low, "sum, with 300 MiB of kernels"));
  t4.row(bytes_row("total", v.total_high, "sum, with 2000 MiB of kernels (high end)"));
  const std::string seed004 = fmt::format("seed 004 VRAM calculator ({})\n", v.training ? "training" : "inference") + t4.str();
  if (!v.training) {
    return out + seed004 + "\nseeds 000-002 describe a training step: not shown for --task inference\n";
  }

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
  out += "seed 000 nanoGPT under autocast\n" + t3.str() + "\n" + seed004;
  out += "\n" + flops_table(f);
  if (f.zero) out += "\n" + zero_tables(*f.zero, *f.deepspeed);
  return out;
}

std::string render_formulas_json(const FormulaReport& f) {
  const Seed001Contract& c = f.seed001;
  const Seed002Korthikanti& k = f.seed002;
  const Seed000Peak& p = f.seed000;
  const Seed004Calculator& v = f.seed004;
  nlohmann::json seed004 = {{"training", v.training}, {"params_and_buffers", v.params.value},
                            {"bytes_per_param", v.bytes_per_param}, {"parameter_bytes", v.parameters.value},
                            {"activation_bytes_per_layer", v.activations_per_layer.value},
                            {"activation_bytes", v.activations.value}, {"gradient_bytes", v.gradients.value},
                            {"optimizer_bytes", v.optimizer.value}, {"output_bytes", v.outputs.value},
                            {"cuda_low_bytes", v.cuda_low.value}, {"cuda_high_bytes", v.cuda_high.value},
                            {"total_low_bytes", v.total_low.value}, {"total_high_bytes", v.total_high.value}};
  if (!v.training) {
    return report::json_text({{"model", f.model.name},
                              {"setup", {{"batch", f.setup.batch}, {"seq", f.setup.seq}, {"task", "inference"},
                                         {"precision", precision_name(f.setup.precision)}}},
                              {"inventory_parameters", f.inventory_parameters.value},
                              {"seed004", seed004}});
  }
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
      {"seed004", seed004},
      {"flops", {{"seed002_layer_macs", f.flops.layer_macs}, {"seed002_layers_flops", f.flops.layers_flops},
                 {"head_flops", f.flops.head_flops}, {"six_n_tokens", f.flops.six_n_tokens},
                 {"simulated_forward_products", products(f.simulated, WorkPhase::kForward)},
                 {"simulated_backward_products", products(f.simulated, WorkPhase::kBackward)},
                 {"simulated_recompute_products", products(f.simulated, WorkPhase::kRecompute)},
                 {"simulated_total", f.simulated.total_flops()}}},
  };
  if (f.zero) {
    const ZeroPaperStates& z = *f.zero;
    out["zero"] = {{"psi", z.psi.value}, {"k", kZeroPaperK}, {"n", z.n}, {"baseline_bytes", z.baseline.value},
                   {"os_bytes", z.os.value}, {"os_g_bytes", z.os_g.value}, {"os_g_p_bytes", z.os_g_p.value}};
    const DeepSpeedEstimates& d = *f.deepspeed;
    const auto rows = [](const std::vector<DeepSpeedRow>& rs) {
      nlohmann::json a = nlohmann::json::array();
      for (const DeepSpeedRow& r : rs) {
        a.push_back({{"offload_param", r.offload_param}, {"offload_optimizer", r.offload_optimizer},
                     {"zero_init", r.zero_init}, {"gpu_bytes", r.gpu.value}, {"cpu_bytes", r.cpu.value}});
      }
      return a;
    };
    out["deepspeed"] = {{"total_params", d.total_params.value}, {"largest_layer_params", d.largest_layer_params.value},
                        {"gpus_per_node", d.gpus_per_node}, {"nodes", d.nodes},
                        {"largest_layer_memory_bytes", d.largest_layer_memory.value},
                        {"zero2", rows(d.zero2)}, {"zero3", rows(d.zero3)}};
  }
  return report::json_text(out);
}

}  // namespace trainmem
