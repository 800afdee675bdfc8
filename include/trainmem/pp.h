// Pipeline parallelism, per rank: torch.distributed.pipelining's schedules (PyTorch 2.9,
// torch/distributed/pipelining/schedules.py and stage.py) as torchtitan applies them to a decoder (torchtitan
// v0.2.0 29624e3, the release of PyTorch 2.9's time, torchtitan/distributed/pipeline_parallel.py; the split is
// the same at b5bcd76, where it is _generate_llm_fqn_per_model_part). The stage split and each rank's order of
// forward and backward actions are here (pure functions, unit-tested against the sources' formulas); the
// simulator (loop.cc) runs them. Independent of layer shapes: a stage is a range of layer indices, with the
// embeddings on the first and the final norm, the head and the loss on the last.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "trainmem/names.h"

namespace trainmem {

// --pp-schedule: ScheduleGPipe, Schedule1F1B (single stage per rank), ScheduleInterleaved1F1B (named to be
// refused with a reason), and the zero-bubble schedules (refused).
enum class PpSchedule { kGpipe, k1f1b, kInterleaved1f1b, kZeroBubble };
std::span<const NameRow<PpSchedule>> name_table(PpSchedule);

// One stage's modules in torchtitan's split (_generate_llm_fqn_per_model_part): layers [begin, end), and
// whether it holds tok_embeddings (first) and norm + lm_head (last).
struct PpStagePart {
  uint64_t stage = 0;
  uint64_t layer_begin = 0, layer_end = 0;
  bool embeddings = false, head = false;
  uint64_t layers() const { return layer_end - layer_begin; }
};

// torchtitan's _generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight, output_weight): the
// embeddings count as `input_weight` layers and norm + output as `output_weight` (torchtitan's
// pipeline_parallel_first_stage_less_layers / _last_stage_less_layers, both 1 by default). Throws
// trainmem::Error where torchtitan raises.
std::vector<PpStagePart> pp_stage_split(uint64_t stages, uint64_t layers, uint64_t input_weight = 1,
                                        uint64_t output_weight = 1);

// One compute action of a rank: forward or (full) backward of `micro` (0-based) on `stage`.
struct PpAction {
  uint64_t stage = 0;
  bool forward = true;
  uint64_t micro = 0;
};

// The order in which rank `rank` of `pp` runs its actions for one step of `micro_batches` micro-batches:
// ScheduleGPipe._step_microbatches (every forward, then every backward) and Schedule1F1B._step_microbatches
// (warmup_chunks = min(n_microbatches, num_stages - stage_index) forwards, then backward/forward pairs, then the
// remaining backwards), one stage per rank (stage == rank); ScheduleInterleaved1F1B's
// _calculate_single_rank_operations with `virtual_stages` stages per rank (stages rank, rank + pp, ...: torchtitan's
// "loop" style), its idle steps (None) left out. Throws trainmem::Error where the schedule raises.
std::vector<PpAction> pp_rank_actions(PpSchedule s, uint64_t rank, uint64_t pp, uint64_t micro_batches,
                                      uint64_t virtual_stages = 1);

// The stages rank `rank` of `pp` holds with `virtual_stages` each (torchtitan's
// _get_pp_rank_to_stage_indices_mapping, "loop" style: rank + s * pp_degree).
std::vector<uint64_t> pp_rank_stages(uint64_t rank, uint64_t pp, uint64_t virtual_stages);

// The most micro-batches whose forward has run and whose backward has not, over `actions`, for `stage`.
uint64_t pp_max_in_flight(const std::vector<PpAction>& actions, uint64_t stage);
// The most (stage, micro-batch) chunks in flight at once over all of a rank's stages, each weighted by
// `weight(stage)` (its layers, say): the moment a rank holds the most.
template <typename W>
uint64_t pp_max_weighted_in_flight(const std::vector<PpAction>& actions, W weight) {
  uint64_t now = 0, most = 0;
  for (const PpAction& a : actions) {
    if (a.forward) {
      now += weight(a.stage);
      most = now > most ? now : most;
    } else {
      now -= weight(a.stage);
    }
  }
  return most;
}

struct Inventory;
// Where the row `name` (the Llama-shaped decoder's names) sits among `parts`: in no stage's module (staged false: a
// buffer such as the rotary embedding's, which every stage keeps), or in a stage's module, then the index of the
// part holding it (parts.size() when none of them does).
struct PpRowPlace {
  bool staged = false;
  size_t part = 0;
};
PpRowPlace pp_row_place(std::string_view name, const std::vector<PpStagePart>& parts);

// The rows of `inv` that stages `parts` hold, in the model's order (the Llama-shaped decoder's names); throws
// for a parameter in no stage.
Inventory pp_stage_inventory(const Inventory& inv, const std::vector<PpStagePart>& parts);

// The resolved pipeline of one simulated rank.
struct PpOptions {
  bool on = false;
  PpSchedule schedule = PpSchedule::k1f1b;
  uint64_t ranks = 1;          // pp
  uint64_t micro_batches = 1;  // n_microbatches
  uint64_t rank = 0;           // the simulated pp rank
  std::vector<PpStagePart> parts;  // its stages, in stage order (one, or virtual_stages for interleaved-1f1b)
  std::vector<PpAction> actions;
};

}  // namespace trainmem
