// The step time's text lines and JSON object (trainmem/flops.h, src/pipeline/step_time.cc).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "time_report.h"
#include "trainmem/report.h"

namespace trainmem {

namespace {

std::string ms(double s) { return fmt::format("{:.1f} ms", s * 1e3); }

}  // namespace

std::string render_step_time(const StepTime& t, const GpuSpec& gpu, const TrainSetup& s, uint64_t shown_rank) {
  const GpuPerf& g = gpu.perf;
  std::string out = fmt::format(
      "STEP TIME on {} (a roofline over the simulated kernels, trainmem/flops.h): {} per {}, {} tokens/s, "
      "MFU {:.1f}%\n",
      gpu.name, ms(t.step_seconds),
      s.task == Task::kTrain ? "optimizer step"
      : s.generate > 0       ? fmt::format("generate() of {} new tokens (prefill and decode)", s.generate)
                             : std::string("forward"),
      with_commas(static_cast<uint64_t>(t.tokens_per_second + 0.5)), t.mfu * 100);
  if (t.pipeline) {
    const PipelineTime& p = *t.pipeline;
    out += fmt::format("  pipeline ({}, {} ranks x {} micro-batches{}): bubble {} ({:.1f}% of the step); steady {} = "
                       "{} x rank {}'s forward {} + backward {} per micro-batch; sends on the fill and drain {}",
                       p.schedule, p.ranks, p.micro_batches,
                       p.virtual_stages > 1 ? fmt::format(", {} stages per rank", p.virtual_stages) : std::string(),
                       ms(p.bubble_seconds), t.step_seconds > 0 ? 100 * p.bubble_seconds / t.step_seconds : 0.0,
                       ms(p.steady_seconds), p.micro_batches, p.slowest_rank, ms(p.forward_seconds),
                       ms(p.backward_seconds), ms(p.send_seconds));
    if (p.gather_seconds > 0) out += fmt::format("; FSDP2 all-gathers on the fill {}", ms(p.gather_seconds));
    out += fmt::format("; the longest reduce-scatters and optimizer after a last backward {}\n", ms(p.tail_seconds));
    out += "  per micro-batch, forward + backward by rank:";
    for (size_t r = 0; r < p.rank_seconds.size(); ++r) {
      out += fmt::format("{} rank {} {}", r == 0 ? "" : ",", r, ms(p.rank_seconds[r]));
    }
    out += "; the lines below are rank " + std::to_string(shown_rank) + "'s\n";
  }
  out += fmt::format("  kernels: {} compute-bound, {} memory-bound, {} launch overhead; by phase: forward {}, "
                     "backward {}, recompute {}, optimizer {}\n",
                     ms(t.compute_bound_seconds), ms(t.memory_bound_seconds), ms(t.launch_seconds),
                     ms(t.phase_seconds[0]), ms(t.phase_seconds[1]), ms(t.phase_seconds[2]), ms(t.phase_seconds[3]));
  if (t.comm_seconds > 0) {
    out += fmt::format("  communication: {} in all, {} overlapped with compute, {} exposed\n", ms(t.comm_seconds),
                       ms(t.comm_overlapped_seconds), ms(t.comm_exposed_seconds));
  }
  out += fmt::format("  per rank and step: {:.4g} FLOPs simulated, {:.4g} model FLOPs (forward + backward products) "
                     "against {:g} TFLOP/s; products at {:.1f}% of the datasheet peak, bytes at {:g} GB/s\n",
                     static_cast<double>(t.flops), static_cast<double>(t.model_flops), t.peak_tflops,
                     g.matmul_efficiency * 100, g.hbm_gbps);
  for (const std::string& n : t.notes) out += "  note: " + n + "\n";
  return out;
}

nlohmann::json pipeline_time_json(const PipelineTime& p) {
  return {{"schedule", p.schedule},
          {"ranks", p.ranks},
          {"micro_batches", p.micro_batches},
          {"virtual_stages", p.virtual_stages},
          {"slowest_rank", p.slowest_rank},
          {"forward_seconds", p.forward_seconds},
          {"backward_seconds", p.backward_seconds},
          {"steady_seconds", p.steady_seconds},
          {"bubble_seconds", p.bubble_seconds},
          {"send_seconds", p.send_seconds},
          {"gather_seconds", p.gather_seconds},
          {"tail_seconds", p.tail_seconds},
          {"rank_seconds", p.rank_seconds}};
}

nlohmann::json step_time_json(const StepTime& t) {
  nlohmann::json by_phase = nlohmann::json::object();
  for (size_t p = 0; p < kWorkPhases; ++p) {
    nlohmann::json kinds = nlohmann::json::object();
    for (size_t k = 0; k < kFlopKinds; ++k) {
      kinds[std::string(flop_kind_name(static_cast<FlopKind>(k)))] = {{"flops", t.flops_by[p][k]},
                                                                      {"bytes", t.bytes_by[p][k]}};
    }
    by_phase[std::string(work_phase_name(static_cast<WorkPhase>(p)))] = {{"seconds", t.phase_seconds[p]},
                                                                          {"kinds", kinds}};
  }
  nlohmann::json j = {{"step_seconds", t.step_seconds},
          {"tokens_per_second", t.tokens_per_second},
          {"mfu", t.mfu},
          {"flops", t.flops},
          {"model_flops", t.model_flops},
          {"tokens", t.tokens},
          {"peak_tflops", t.peak_tflops},
          {"kernels", t.kernels},
          {"breakdown",
           {{"compute_bound_seconds", t.compute_bound_seconds},
            {"memory_bound_seconds", t.memory_bound_seconds},
            {"launch_seconds", t.launch_seconds},
            {"comm_seconds", t.comm_seconds},
            {"comm_overlapped_seconds", t.comm_overlapped_seconds},
            {"comm_exposed_seconds", t.comm_exposed_seconds},
            {"phases", by_phase}}},
          {"notes", t.notes}};
  if (t.pipeline) j["pipeline"] = pipeline_time_json(*t.pipeline);
  return j;
}

}  // namespace trainmem
