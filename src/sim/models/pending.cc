// Forward programs not written yet.
#include "../forward.h"
#include "trainmem/error.h"

namespace trainmem::sim {

ForwardOut gpt2_forward(Ctx&, const ModelSpec&, const LoadedModel&, const T&, const T*) {
  throw Error("the step simulator does not model transformers' GPT-2 yet");
}
ForwardOut llama_forward(Ctx&, const ModelSpec&, const LoadedModel&, const T&, const T*) {
  throw Error("the step simulator does not model the Llama family yet");
}
ForwardOut gpt_neox_forward(Ctx&, const ModelSpec&, const LoadedModel&, const T&, const T*) {
  throw Error("the step simulator does not model GPT-NeoX yet");
}
ForwardOut opt_forward(Ctx&, const ModelSpec&, const LoadedModel&, const T&, const T*) {
  throw Error("the step simulator does not model OPT yet");
}
ForwardOut stack_forward(Ctx&, const ModelSpec&, const LoadedModel&, const T&) {
  throw Error("the step simulator does not model layer stacks yet");
}
T causal_lm_loss(Ctx&, const T&, const T&) { throw Error("not yet"); }

}  // namespace trainmem::sim
