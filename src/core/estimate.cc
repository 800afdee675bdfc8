#include "trainmem/estimate.h"

#include "trainmem/formulas.h"

namespace trainmem {

// torch.optim Adam(W) keeps state['step'] as a float32 scalar tensor: on the parameter's device when fused
// or capturable, on the CPU otherwise (torch/optim/adamw.py _init_group).
inline constexpr uint64_t kOptimizerStepBytes = 4;

Estimate estimate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s) {
  validate_setup(m, s);
  Estimate e;
  e.model = m;
  e.setup = s;
  e.setup.optimizer_impl = resolve_optimizer_impl(s.optimizer, s.optimizer_impl, m.impl);
  const DType pd = param_dtype(s.precision);
  e.parameters = parameter_count(inv);
  e.trainable = e.parameters;
  e.weights = parameter_bytes(inv, pd);
  e.buffers = buffer_bytes(inv, pd);
  e.gradients = bytes_of(e.trainable, pd);
  e.optimizer_moments = bytes_of(e.trainable, pd) * optimizer_states_per_param(s.optimizer);
  const bool adam = s.optimizer == Optimizer::kAdamW || s.optimizer == Optimizer::kAdam;
  if (adam && e.setup.optimizer_impl == OptimizerImpl::kFused) {
    e.optimizer_steps = Bytes(kOptimizerStepBytes) * inv.parameters.size();
  }
  e.optimizer_state = e.optimizer_moments + e.optimizer_steps;
  e.inputs = bytes_of(Elems(checked_mul(s.batch, s.seq, "tokens")), DType::kI64) * 2;
  const Seed000Peak closed = seed000_peak(m, inv, s);
  e.activations = closed.activations;
  e.activations_method = "seed 000 closed form L(36Ne+6Na)+6Ne+6Nl";
  const std::string pd_name(dtype_name(pd));
  e.components = {
      {"weights", e.weights, pd_name + " parameters"},
      {"buffers", e.buffers, "registered buffers"},
      {"gradients", e.gradients, pd_name + " .grad of every parameter"},
      {"optimizer state", e.optimizer_state, std::string(optimizer_name(s.optimizer)) + " state"},
      {"inputs", e.inputs, "int64 input ids and targets"},
      {"activations", e.activations, e.activations_method},
      // Seed 000: the peak is at the start of backward, when the fp32 gradient of the logits is allocated.
      {"backward transient", bytes_of(closed.nl, DType::kF32), "fp32 grad of the logits (4Nl, seed 000)"},
  };
  for (const Component& c : e.components) e.peak_allocated += c.bytes;
  return e;
}

}  // namespace trainmem
