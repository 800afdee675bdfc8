// The layer seam: every forward program runs its stack of layers through run_layers(), so a per-layer policy
// (activation checkpointing, FSDP's all-gather before a layer and reshard after it, offload) has exactly one
// place to hook in, instead of one copy of the loop per family.
#pragma once

#include <cstdint>
#include <utility>

#include "ops.h"

namespace trainmem::sim {

// hidden = layer(l, hidden) for l in 0..layers-1, with c.layer naming the layer for the timeline's labels.
// `layer` takes the hidden state by value and returns the next one: the caller's variable is rebound to the
// result, as `hidden = decoder_layer(hidden)` rebinds it in the modeling code, so the input is released when
// the layer returns unless autograd saved it.
template <typename LayerFn>
T run_layers(Ctx& c, uint64_t layers, T hidden, LayerFn&& layer) {
  for (uint64_t l = 0; l < layers; ++l) {
    c.layer = static_cast<int32_t>(l);
    hidden = layer(l, std::move(hidden));
  }
  c.layer = -1;
  return hidden;
}

}  // namespace trainmem::sim
