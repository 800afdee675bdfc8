// estimate(): the memory of a training step, component by component, from the step simulator (sim.h).
#pragma once

#include <string>
#include <vector>

#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"
#include "trainmem/units.h"

namespace trainmem {

// One line of the breakdown at the peak; the peak is the sum of the components.
struct Component {
  std::string name;
  Bytes bytes;
  std::string note;  // what it is
};

struct Estimate {
  ModelSpec model;
  TrainSetup setup;     // with optimizer_impl resolved
  SimOptions options;   // loop, torch version, GPU architecture
  Elems parameters, trainable;
  // Exact tensor sizes from the inventory (requested bytes):
  Bytes weights;            // parameters only, in their storage dtype
  Bytes buffers;            // registered buffers (after model.to(dtype) for cast precisions)
  Bytes gradients;          // one .grad per trainable parameter, in the parameter dtype
  Bytes optimizer_state;    // state tensors on the device (moments, momentum, fused `step` scalars)
  Bytes optimizer_moments;  // of which exp_avg/exp_avg_sq or momentum_buffer
  Bytes optimizer_steps;    // of which `step` scalars (device tensors only with fused/capturable)
  Bytes inputs;             // one micro-batch of input ids and targets
  // From the simulated step (requested bytes):
  Bytes saved_activations;  // storages autograd holds at the end of forward, each once, excluding
                            // parameters and buffers
  Bytes activations;        // at the peak: everything but weights, buffers, gradients, optimizer state,
                            // inputs and workspaces
  Bytes steady_state;       // memory_allocated() just before the next step's forward
  Bytes peak_allocated;     // the highest total of live tensors
  Phase peak_phase = Phase::kForward;
  uint32_t peak_step = 0, peak_micro = 0;
  std::vector<Component> components;  // live at the peak, summing to peak_allocated
  SimResult sim;
};

Estimate estimate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o);

}  // namespace trainmem
