#include "trainmem/setup.h"

#include <fmt/format.h>

#include "trainmem/error.h"
#include "trainmem/family.h"

namespace trainmem {

DType param_dtype(Precision p) {
  switch (p) {
    case Precision::kFp16: return DType::kF16;
    case Precision::kBf16: return DType::kBF16;
    default: return DType::kF32;
  }
}

DType compute_dtype(Precision p) {
  switch (p) {
    case Precision::kFp16Amp:
    case Precision::kFp16: return DType::kF16;
    case Precision::kBf16Amp:
    case Precision::kBf16: return DType::kBF16;
    case Precision::kFp32: return DType::kF32;
  }
  return DType::kF32;
}

bool uses_autocast(Precision p) { return p == Precision::kFp16Amp || p == Precision::kBf16Amp; }

uint64_t optimizer_states_per_param(Optimizer o) {
  switch (o) {
    case Optimizer::kAdamW:
    case Optimizer::kAdam: return 2;          // exp_avg, exp_avg_sq
    case Optimizer::kSgdMomentum: return 1;   // momentum_buffer
    case Optimizer::kSgd:                     // momentum=0: no state
    case Optimizer::kNone: return 0;
  }
  return 0;
}

OptimizerImpl resolve_optimizer_impl(Optimizer o, OptimizerImpl impl, Impl model_impl) {
  if (o == Optimizer::kNone) return OptimizerImpl::kAuto;  // nothing runs
  if (impl != OptimizerImpl::kAuto) return impl;
  // nanoGPT configure_optimizers: use_fused = fused_available and device_type == 'cuda' (AdamW only).
  if (model_impl == Impl::kNanoGpt && o == Optimizer::kAdamW) return OptimizerImpl::kFused;
  // torch.optim: foreach is the default when every tensor is on CUDA (_default_to_fused_or_foreach).
  return OptimizerImpl::kForeach;
}

std::string optimizer_label(Optimizer o, OptimizerImpl impl) {
  if (o == Optimizer::kNone) return "no optimizer";
  return fmt::format("{} ({})", optimizer_name(o), optimizer_impl_name(impl));
}

namespace {
constexpr NameRow<Precision> kPrecisions[] = {
    {Precision::kFp32, "fp32", "everything float32"},
    {Precision::kFp16Amp, "fp16-amp", "float32 weights, torch.autocast(float16), GradScaler"},
    {Precision::kBf16Amp, "bf16-amp", "float32 weights, torch.autocast(bfloat16)"},
    {Precision::kFp16, "fp16", "model.to(float16): weights, gradients and optimizer state in float16"},
    {Precision::kBf16, "bf16", "model.to(bfloat16): weights, gradients and optimizer state in bfloat16"},
};
constexpr NameRow<Optimizer> kOptimizers[] = {
    {Optimizer::kAdamW, "adamw", "torch.optim.AdamW: exp_avg and exp_avg_sq per parameter"},
    {Optimizer::kAdam, "adam", "torch.optim.Adam: exp_avg and exp_avg_sq per parameter"},
    {Optimizer::kSgd, "sgd", "torch.optim.SGD without momentum: no state"},
    {Optimizer::kSgdMomentum, "sgd-momentum", "torch.optim.SGD with momentum: momentum_buffer per parameter"},
    {Optimizer::kNone, "none", "no optimizer step (forward and backward only)"},
};
constexpr NameRow<OptimizerImpl> kOptimizerImpls[] = {
    {OptimizerImpl::kAuto, "auto", "fused for nanoGPT's AdamW, foreach otherwise (torch.optim's CUDA default)"},
    {OptimizerImpl::kForeach, "foreach", "_multi_tensor_* with torch._foreach_ ops"},
    {OptimizerImpl::kFused, "fused", "_fused_adamw_ kernels; `step` is a device tensor"},
    {OptimizerImpl::kForLoop, "for-loop", "_single_tensor_*"},
};
constexpr NameRow<Quantize> kQuantizes[] = {
    {Quantize::kNone, "none", "the base weights in the model's dtype"},
    {Quantize::kNf4, "nf4", "bitsandbytes 4-bit NormalFloat (Linear4bit, quant_type nf4)"},
    {Quantize::kFp4, "fp4", "bitsandbytes 4-bit float (Linear4bit, quant_type fp4): the same bytes as nf4"},
    {Quantize::kInt8, "int8", "bitsandbytes LLM.int8 (Linear8bitLt): not simulated yet"},
};
constexpr NameRow<Checkpointing> kCheckpointings[] = {
    {Checkpointing::kNone, "none", "every activation autograd saves is kept from forward to backward"},
    {Checkpointing::kFull, "full", "checkpointed layers keep only their input; backward recomputes them"},
};
}  // namespace

std::span<const NameRow<Checkpointing>> name_table(Checkpointing) { return kCheckpointings; }
std::span<const NameRow<Quantize>> name_table(Quantize) { return kQuantizes; }
std::span<const NameRow<Precision>> name_table(Precision) { return kPrecisions; }
std::span<const NameRow<Optimizer>> name_table(Optimizer) { return kOptimizers; }
std::span<const NameRow<OptimizerImpl>> name_table(OptimizerImpl) { return kOptimizerImpls; }

std::string_view precision_name(Precision p) { return name_of(p); }
std::string_view optimizer_name(Optimizer o) { return name_of(o); }
std::string_view optimizer_impl_name(OptimizerImpl i) { return name_of(i); }
std::optional<Precision> parse_precision(std::string_view s) { return parse_name<Precision>(s); }
std::optional<Optimizer> parse_optimizer(std::string_view s) { return parse_name<Optimizer>(s); }
std::optional<OptimizerImpl> parse_optimizer_impl(std::string_view s) { return parse_name<OptimizerImpl>(s); }

void validate_setup(const ModelSpec& m, const TrainSetup& s) {
  if (s.batch == 0) throw FieldError("batch", "0: expected a micro-batch of at least 1 sequence");
  if (s.seq == 0) throw FieldError("seq", "0: expected at least 1 token per sequence");
  if (s.grad_accum == 0) throw FieldError("grad_accum", "0: expected at least 1 micro-batch per optimizer step");
  if (s.optimizer == Optimizer::kNone && s.optimizer_impl != OptimizerImpl::kAuto) {
    throw FieldError("optimizer_impl", fmt::format("{}: there is no optimizer (the optimizer is none)",
                                                   optimizer_impl_name(s.optimizer_impl)));
  }
  if (input_kind(m) == InputKind::kFeatures) return;  // no sequence axis: T multiplies the rows
  if (m.max_positions != 0 && s.seq > m.max_positions) {
    throw FieldError("seq", fmt::format("{}: {} has a learned position table of {} positions; a longer sequence "
                            "cannot be embedded", s.seq, m.name, m.max_positions));
  }
}

}  // namespace trainmem
