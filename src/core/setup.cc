#include "trainmem/setup.h"

#include <fmt/format.h>

#include "trainmem/error.h"

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

std::string_view precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kFp16Amp: return "fp16-amp";
    case Precision::kBf16Amp: return "bf16-amp";
    case Precision::kFp16: return "fp16";
    case Precision::kBf16: return "bf16";
  }
  return "?";
}

std::string_view optimizer_name(Optimizer o) {
  switch (o) {
    case Optimizer::kAdamW: return "adamw";
    case Optimizer::kAdam: return "adam";
    case Optimizer::kSgd: return "sgd";
    case Optimizer::kSgdMomentum: return "sgd-momentum";
    case Optimizer::kNone: return "none";
  }
  return "?";
}

std::string_view optimizer_impl_name(OptimizerImpl i) {
  switch (i) {
    case OptimizerImpl::kAuto: return "auto";
    case OptimizerImpl::kForeach: return "foreach";
    case OptimizerImpl::kFused: return "fused";
    case OptimizerImpl::kForLoop: return "for-loop";
  }
  return "?";
}

std::optional<Precision> parse_precision(std::string_view s) {
  for (Precision p : {Precision::kFp32, Precision::kFp16Amp, Precision::kBf16Amp, Precision::kFp16,
                      Precision::kBf16}) {
    if (precision_name(p) == s) return p;
  }
  return std::nullopt;
}

std::optional<Optimizer> parse_optimizer(std::string_view s) {
  for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdam, Optimizer::kSgd, Optimizer::kSgdMomentum,
                      Optimizer::kNone}) {
    if (optimizer_name(o) == s) return o;
  }
  return std::nullopt;
}

std::optional<OptimizerImpl> parse_optimizer_impl(std::string_view s) {
  for (OptimizerImpl i : {OptimizerImpl::kAuto, OptimizerImpl::kForeach, OptimizerImpl::kFused,
                          OptimizerImpl::kForLoop}) {
    if (optimizer_impl_name(i) == s) return i;
  }
  return std::nullopt;
}

void validate_setup(const ModelSpec& m, const TrainSetup& s) {
  if (s.batch == 0) throw Error("--batch 0: expected a micro-batch of at least 1 sequence");
  if (s.seq == 0) throw Error("--seq 0: expected at least 1 token per sequence");
  if (s.grad_accum == 0) throw Error("--grad-accum 0: expected at least 1 micro-batch per optimizer step");
  if (s.optimizer == Optimizer::kNone && s.optimizer_impl != OptimizerImpl::kAuto) {
    throw Error(fmt::format("--optimizer-impl {}: there is no optimizer (--optimizer none)",
                            optimizer_impl_name(s.optimizer_impl)));
  }
  if (m.family == Family::kStack) return;  // a layer stack has no sequence axis: T multiplies the rows
  if (m.max_positions != 0 && s.seq > m.max_positions) {
    throw Error(fmt::format("--seq {}: {} has a learned position table of {} positions; a longer sequence "
                            "cannot be embedded", s.seq, m.name, m.max_positions));
  }
}

}  // namespace trainmem
