// The step time's text lines and JSON object (trainmem/flops.h, src/pipeline/step_time.cc).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "time_report.h"
#include "trainmem/report.h"

namespace trainmem {

namespace {

std::string ms(double s) { return fmt::format("{:.1f} ms", s * 1e3); }

}  // namespace

std::string render_step_time(const StepTime& t, const GpuSpec& gpu, const TrainSetup& s) {
  const GpuPerf& g = gpu.perf;
  std::string out = fmt::format(
      "STEP TIME on {} (a roofline over the simulated kernels, trainmem/flops.h): {} per {}, {} tokens/s, "
      "MFU {:.1f}%\n",
      gpu.name, ms(t.step_seconds),
      s.task == Task::kTrain ? "optimizer step"
      : s.generate > 0       ? fmt::format("generate() of {} new tokens (prefill and decode)", s.generate)
                             : std::string("forward"),
      with_commas(static_cast<uint64_t>(t.tokens_per_second + 0.5)), t.mfu * 100);
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
  return {{"step_seconds", t.step_seconds},
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
}

}  // namespace trainmem
