// estimate(): the memory of one training step, component by component.
// For now weights, buffers, gradients and optimizer state come from the inventory, exactly, and activations
// from seed 000's closed form (see formulas.h).
#pragma once

#include <string>
#include <vector>

#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/setup.h"
#include "trainmem/units.h"

namespace trainmem {

// One line of the breakdown; the peak is the sum of the components.
struct Component {
  std::string name;
  Bytes bytes;
  std::string note;  // what it is and where the number comes from
};

struct Estimate {
  ModelSpec model;
  TrainSetup setup;  // with optimizer_impl resolved
  Elems parameters, trainable;
  Bytes weights;          // parameters only, in their storage dtype
  Bytes buffers;          // registered buffers (after model.to(dtype) for cast precisions)
  Bytes gradients;        // one .grad per trainable parameter, in the parameter dtype
  Bytes optimizer_state;  // state tensors on the device (moments, momentum, fused `step` scalars)
  Bytes optimizer_moments;  // of which exp_avg/exp_avg_sq or momentum_buffer
  Bytes optimizer_steps;    // of which `step` scalars (device tensors only with fused/capturable)
  Bytes inputs;           // input ids and targets, int64 (B, T) each
  Bytes activations;
  std::string activations_method;
  std::vector<Component> components;  // live at the peak, summing to peak_allocated
  Bytes peak_allocated;
};

Estimate estimate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s);

}  // namespace trainmem
