// What the rest of the pipeline asks of a model's architecture family, answered by the family registry
// (src/families/registry.cc) rather than by switches on Family spread over the stages.
#pragma once

#include <string>
#include <string_view>

#include "trainmem/model.h"

namespace trainmem {

// What one micro-batch of input is.
enum class InputKind {
  kTokenIds,  // input ids and targets, (B, T) int64 each; the model computes a causal-LM loss
  kFeatures,  // a float (B, features) batch and no targets: `loss = model(x).sum()` (seed 003's layer stacks);
              // there is no sequence axis, so the sequence length does not apply
};
InputKind input_kind(const ModelSpec& m);

// Layer i's name as the model's own parameter names spell it: "model.layers.3", "transformer.h.3", or "3" for a
// layer stack.
std::string layer_name(const ModelSpec& m, int64_t layer);

// "gpt2, nanogpt, llama, ...": every model_type the registry reads, for error messages.
std::string supported_model_types();

}  // namespace trainmem
