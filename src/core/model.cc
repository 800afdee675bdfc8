#include "trainmem/model.h"

namespace trainmem {

std::string_view family_name(Family f) {
  switch (f) {
    case Family::kGpt2: return "gpt2";
    case Family::kLlama: return "llama";
    case Family::kGptNeox: return "gpt_neox";
    case Family::kOpt: return "opt";
    case Family::kStack: return "mlp";
  }
  return "?";
}

std::string_view impl_name(Impl i) {
  switch (i) {
    case Impl::kHf: return "hf";
    case Impl::kNanoGpt: return "nanogpt";
    case Impl::kStack: return "stack";
  }
  return "?";
}

std::string_view attn_impl_name(AttnImpl a) { return a == AttnImpl::kEager ? "eager" : "sdpa"; }

std::string_view act_name(Act a) {
  switch (a) {
    case Act::kGeluNew: return "gelu_new";
    case Act::kGeluFast: return "gelu_fast";
    case Act::kGeluTanh: return "gelu_pytorch_tanh";
    case Act::kGeluErf: return "gelu";
    case Act::kQuickGelu: return "quick_gelu";
    case Act::kSilu: return "silu";
    case Act::kRelu: return "relu";
    case Act::kSigmoid: return "sigmoid";
  }
  return "?";
}

}  // namespace trainmem
