#include "trainmem/pp.h"

#include <fmt/format.h>

#include <algorithm>

#include "trainmem/error.h"
#include "trainmem/inventory.h"

namespace trainmem {

std::span<const NameRow<PpSchedule>> name_table(PpSchedule) {
  // the single-stage schedules, then the multi-stage ones; the zero-bubble family is named to be refused
  static constexpr NameRow<PpSchedule> kSchedules[] = {
      {PpSchedule::kGpipe, "gpipe", "ScheduleGPipe: every forward, then every backward"},
      {PpSchedule::k1f1b, "1f1b", "Schedule1F1B: warmup forwards, then one backward and one forward (torchtitan's default)"},
      {PpSchedule::kInterleaved1f1b, "interleaved-1f1b", "ScheduleInterleaved1F1B: several stages per rank"},
      {PpSchedule::kZeroBubble, "zero-bubble", "ScheduleInterleavedZeroBubble / ZBVZeroBubble (not simulated)"}};
  return kSchedules;
}

// torchtitan/distributed/pipeline_parallel.py generate_llm_fqn_per_model_part (v0.2.0; _generate_llm_fqn_per_model_part
// at b5bcd76, the same rule), transcribed:
//   num_effective_layers = num_layers + input_weight + output_weight
//   layers_per_stage = num_effective_layers // num_stages; extra_layers = num_effective_layers % num_stages
//   stage i gets layers_per_stage (+1 if i < extra_layers) effective layers; the first stage's include
//   input_weight for tok_embeddings, the last stage's output_weight for norm + lm_head.
std::vector<PpStagePart> pp_stage_split(uint64_t stages, uint64_t layers, uint64_t input_weight, uint64_t output_weight) {
  if (stages < 1) throw Error("--pp: the number of stages must be at least 1");
  std::vector<PpStagePart> out;
  if (stages == 1) {  // "Single stage gets everything"
    out.push_back(PpStagePart{0, 0, layers, true, true});
    return out;
  }
  const uint64_t effective = layers + input_weight + output_weight;
  if (stages > effective) {
    throw Error(fmt::format("--pp {}: more stages than effective layers ({} layers + {} for the embeddings + {} for "
                            "the norm and head; torchtitan's _generate_llm_fqn_per_model_part raises)",
                            stages, layers, input_weight, output_weight));
  }
  const uint64_t per = effective / stages, extra = effective % stages;
  if (input_weight > per || output_weight > per) {
    throw Error(fmt::format("--pp {}: {} effective layers per stage, fewer than the embeddings' or the head's weight "
                            "(torchtitan's _generate_llm_fqn_per_model_part raises)", stages, per));
  }
  uint64_t current = 0;
  for (uint64_t i = 0; i < stages; ++i) {
    PpStagePart p;
    p.stage = i;
    uint64_t n = per + (i < extra ? 1 : 0);
    if (i == 0) {
      p.embeddings = true;
      n -= input_weight;
    } else if (i == stages - 1) {
      p.head = true;
      n -= output_weight;
    }
    p.layer_begin = current;
    current = std::min(layers, current + n);  // `if current_layer < num_layers`
    p.layer_end = current;
    out.push_back(p);
  }
  return out;
}

std::vector<uint64_t> pp_rank_stages(uint64_t rank, uint64_t pp, uint64_t v) {
  // torchtitan pipeline_parallel.py: pipeline_module_split._get_stage_indices (v0.2.0) and
  // _get_pp_rank_to_stage_indices_mapping (b5bcd76),
  // style "loop":
  //   tuple(pp_rank + s * pp_degree for s in range(stages_per_rank))
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < v; ++i) out.push_back(rank + i * pp);
  return out;
}

namespace {

// schedules.py ScheduleInterleaved1F1B (PyTorch 2.9), transcribed:
//   number_of_rounds = max(1, n_microbatches // pp_group_size)
//   microbatches_per_round = n_microbatches // number_of_rounds (ValueError unless it divides n_microbatches)
//   warmup_ops = min((n_local_stages - 1) * microbatches_per_round + 2 * (pp_group_size - 1 - rank),
//                    n_microbatches * n_local_stages)
//   fwd_bwd_ops = n_local_stages * n_microbatches - warmup_ops; cooldown_ops = warmup_ops
//   forward_stage_index(step) = ((step // microbatches_per_round) % n_local_stages) * pp_group_size + rank
//   backward_stage_index(step) = (n_local_stages - 1 - ((step - warmup_ops) // microbatches_per_round)
//                                 % n_local_stages) * pp_group_size + rank
// and _get_1f1b_rank_ops without zero bubble: op < warmup_ops: F; then F and FULL_BACKWARD per op; then
// FULL_BACKWARD per op; each stage's micro-batch index counting up from 0 (the None idle steps left out).
std::vector<PpAction> interleaved_actions(uint64_t rank, uint64_t pp, uint64_t m, uint64_t v) {
  const uint64_t rounds = std::max<uint64_t>(1, m / pp);
  if (m % rounds != 0) {
    throw Error(fmt::format("--micro-batches {}: ScheduleInterleaved1F1B requires the number of micro-batches to be a "
                            "multiple of the number of rounds ({} = max(1, {} // {}))", m, rounds, m, pp));
  }
  const uint64_t per_round = m / rounds;
  const uint64_t warmup = std::min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v);
  const uint64_t fwd_bwd = m * v - warmup, cooldown = m * v - fwd_bwd;
  auto fwd_stage = [&](uint64_t step) { return ((step / per_round) % v) * pp + rank; };
  auto bwd_stage = [&](uint64_t step) { return (v - 1 - ((step - warmup) / per_round) % v) * pp + rank; };
  std::vector<uint64_t> fwd_mb(v * pp, 0), bwd_mb(v * pp, 0);
  std::vector<PpAction> a;
  for (uint64_t op = 0; op < warmup + fwd_bwd + cooldown; ++op) {
    if (op < warmup) {
      const uint64_t st = fwd_stage(op);
      a.push_back({st, true, fwd_mb[st]++});
    } else if (op < warmup + fwd_bwd) {
      const uint64_t f = fwd_stage(op);
      a.push_back({f, true, fwd_mb[f]++});
      const uint64_t b = bwd_stage(op);
      a.push_back({b, false, bwd_mb[b]++});
    } else {
      const uint64_t b = bwd_stage(op);
      a.push_back({b, false, bwd_mb[b]++});
    }
  }
  return a;
}

}  // namespace

std::vector<PpAction> pp_rank_actions(PpSchedule s, uint64_t rank, uint64_t pp, uint64_t m, uint64_t v) {
  std::vector<PpAction> a;
  if (s == PpSchedule::kGpipe) {
    // ScheduleGPipe._step_microbatches: for i in range(n_microbatches): forward_one_chunk(i) (and the loss);
    // then for i in range(n_microbatches): backward_one_chunk(i)
    for (uint64_t i = 0; i < m; ++i) a.push_back({rank, true, i});
    for (uint64_t i = 0; i < m; ++i) a.push_back({rank, false, i});
    return a;
  }
  if (s == PpSchedule::kInterleaved1f1b) return interleaved_actions(rank, pp, m, v);
  if (s != PpSchedule::k1f1b) throw Error("internal: pp_rank_actions of a schedule not simulated");
  if (v != 1) throw Error("internal: a single-stage schedule with virtual stages");
  // Schedule1F1B._step_microbatches: warmup_chunks = min(self._n_microbatches, self._num_stages -
  // self._stage.stage_index); then `while True:` backward_one_chunk(bwd_mb_index); `if fwd_mb_index ==
  // self._n_microbatches: break`; forward_one_chunk(fwd_mb_index); then the cooldown backwards.
  const uint64_t warmup = std::min(m, pp - rank);
  uint64_t fwd = 0, bwd = 0;
  for (; fwd < warmup; ++fwd) a.push_back({rank, true, fwd});
  while (true) {
    a.push_back({rank, false, bwd++});
    if (fwd == m) break;
    a.push_back({rank, true, fwd++});
  }
  while (bwd < m) a.push_back({rank, false, bwd++});
  return a;
}

uint64_t pp_max_in_flight(const std::vector<PpAction>& actions, uint64_t stage) {
  uint64_t now = 0, most = 0;
  for (const PpAction& x : actions) {
    if (x.stage != stage) continue;
    if (x.forward) {
      most = std::max(most, ++now);
    } else {
      --now;
    }
  }
  return most;
}

// The rows one stage holds, as torchtitan's _pipeline_module_split leaves them (modules not in the stage's
// list are deleted; buffers of the kept modules and the model's own rotary table stay): the Llama-shaped
// decoder's names (modeling_llama.py): model.embed_tokens on the first stage, model.layers.{i} for the stage's
// layers, model.norm and lm_head on the last; every other buffer (model.rotary_emb.inv_freq) on every stage.
PpRowPlace pp_row_place(std::string_view name, const std::vector<PpStagePart>& parts) {
  auto first = [&](auto pred) {
    return PpRowPlace{true, static_cast<size_t>(std::find_if(parts.begin(), parts.end(), pred) - parts.begin())};
  };
  auto starts = [&](std::string_view pre) { return name.substr(0, pre.size()) == pre; };
  if (starts("model.embed_tokens.")) return first([](const PpStagePart& p) { return p.embeddings; });
  if (starts("model.norm.") || starts("lm_head.")) return first([](const PpStagePart& p) { return p.head; });
  constexpr std::string_view kLayers = "model.layers.";
  if (starts(kLayers)) {
    const uint64_t l = std::stoull(std::string(name.substr(kLayers.size())));
    return first([&](const PpStagePart& p) { return l >= p.layer_begin && l < p.layer_end; });
  }
  return PpRowPlace{};
}

Inventory pp_stage_inventory(const Inventory& inv, const std::vector<PpStagePart>& parts) {
  auto keep = [&](const std::string& name, bool parameter) {
    const PpRowPlace at = pp_row_place(name, parts);
    if (at.staged) return at.part < parts.size();
    if (parameter) throw Error(fmt::format("--pp: parameter {} is in no pipeline stage (not simulated)", name));
    return true;
  };
  Inventory out;
  std::vector<size_t> kept_before(inv.parameters.size() + 1, 0);  // kept parameter rows before row i
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    const bool k = keep(inv.parameters[i].name, true);
    kept_before[i + 1] = kept_before[i] + (k ? 1 : 0);
    if (k) out.parameters.push_back(inv.parameters[i]);
  }
  for (const TensorRow& b : inv.buffers) {
    if (!keep(b.name, false)) continue;
    TensorRow r = b;
    r.load_after = kept_before[std::min(b.load_after, inv.parameters.size())];
    out.buffers.push_back(std::move(r));
  }
  return out;
}

}  // namespace trainmem
