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

namespace {
// bitsandbytes optim/optimizer.py: Optimizer2State/Optimizer1State.init_state: parameters with fewer than
// min_8bit_size = 4096 elements keep float32 states; `get_state_buffer` pages a state when is_paged and
// p.numel() >= 1e5; the blockwise absmax has one float32 per block: `blocks = n // 256` (+1 for a remainder)
// since bitsandbytes 0.44.0 (PR #1365 "Change 8bit optimizer blocksize 2048->256"), `n // 2048` before.
constexpr uint64_t kMin8bitSize = 4096;
constexpr uint64_t kPagedMinElems = 100'000;
constexpr uint64_t k8bitBlock = 256;
constexpr uint64_t k8bitBlockBefore044 = 2048;
constexpr BnbVersion kBnbSmallBlocks{0, 44};
}  // namespace

std::optional<BnbVersion> parse_bnb_version(std::string_view s) {
  BnbVersion v;
  const auto dot = s.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  auto num = [](std::string_view t, uint32_t& out) {
    if (t.empty() || t.size() > 4) return false;
    out = 0;
    for (char c : t) {
      if (c < '0' || c > '9') return false;
      out = out * 10 + static_cast<uint32_t>(c - '0');
    }
    return true;
  };
  std::string_view rest = s.substr(dot + 1);
  const auto dot2 = rest.find('.');
  uint32_t patch = 0;
  if (dot2 != std::string_view::npos && !num(rest.substr(dot2 + 1), patch)) return std::nullopt;
  if (!num(s.substr(0, dot), v.major) || !num(rest.substr(0, dot2), v.minor)) return std::nullopt;
  return v;
}

uint64_t bnb_block_size(std::optional<BnbVersion> v) {
  return v && *v < kBnbSmallBlocks ? k8bitBlockBefore044 : k8bitBlock;
}

bool is_bnb_optim(Optimizer o) {
  return o == Optimizer::kAdamW8bit || o == Optimizer::kPagedAdamW8bit || o == Optimizer::kPagedAdamW ||
         o == Optimizer::kLion || o == Optimizer::kLion8bit;
}

std::vector<StateTensor> optimizer_state_tensors(Optimizer o, OptimizerImpl impl, const std::vector<uint64_t>& shape,
                                                 DType pd, uint64_t bnb_block) {
  const uint64_t n = numel(shape).value;
  std::vector<StateTensor> s;
  switch (o) {
    case Optimizer::kAdamW:
    case Optimizer::kAdam:
      // torch/optim/adam.py _init_group: step (0-d float32, on the device only when fused or capturable),
      // exp_avg and exp_avg_sq = zeros_like(p)
      if (impl == OptimizerImpl::kFused) s.push_back({{}, DType::kF32, false, "step"});
      s.push_back({shape, pd, false, "exp_avg"});
      s.push_back({shape, pd, false, "exp_avg_sq"});
      break;
    case Optimizer::kSgdMomentum: s.push_back({shape, pd, false, "momentum_buffer"}); break;
    case Optimizer::kSgd:
    case Optimizer::kNone: break;
    case Optimizer::kAdamW8bit:
    case Optimizer::kPagedAdamW8bit: {
      const bool paged = o == Optimizer::kPagedAdamW8bit && n >= kPagedMinElems;
      if (n < kMin8bitSize) {
        s.push_back({shape, DType::kF32, paged, "state1"});
        s.push_back({shape, DType::kF32, paged, "state2"});
      } else {
        s.push_back({shape, DType::kU8, paged, "state1 (8-bit)"});
        s.push_back({shape, DType::kU8, paged, "state2 (8-bit)"});
        s.push_back({{ceil_div(n, bnb_block)}, DType::kF32, false, "absmax1"});
        s.push_back({{ceil_div(n, bnb_block)}, DType::kF32, false, "absmax2"});
      }
      break;
    }
    case Optimizer::kPagedAdamW: {
      const bool paged = n >= kPagedMinElems;  // 32-bit states: float32 whatever the parameter's dtype
      s.push_back({shape, DType::kF32, paged, "state1"});
      s.push_back({shape, DType::kF32, paged, "state2"});
      break;
    }
    case Optimizer::kLion: s.push_back({shape, DType::kF32, false, "state1"}); break;  // Optimizer1State, 32-bit
    case Optimizer::kLion8bit:
      // optim/lion.py Lion8bit: Optimizer1State with optim_bits=8: Optimizer1State.init_state keeps one state
      // (uint8 with one float32 absmax per block, or float32 under min_8bit_size)
      if (n < kMin8bitSize) {
        s.push_back({shape, DType::kF32, false, "state1"});
      } else {
        s.push_back({shape, DType::kU8, false, "state1 (8-bit)"});
        s.push_back({{ceil_div(n, bnb_block)}, DType::kF32, false, "absmax1"});
      }
      break;
    case Optimizer::kAdafactor:
      // transformers optimization.py Adafactor.step: factored when len(shape) >= 2: exp_avg_sq_row
      // shape[:-1] and exp_avg_sq_col shape[:-2] + shape[-1:], float32; otherwise exp_avg_sq, float32;
      // exp_avg only with beta1 (default None)
      if (shape.size() >= 2) {
        s.push_back({std::vector<uint64_t>(shape.begin(), shape.end() - 1), DType::kF32, false, "exp_avg_sq_row"});
        std::vector<uint64_t> col(shape.begin(), shape.end() - 2);
        col.push_back(shape.back());
        s.push_back({col, DType::kF32, false, "exp_avg_sq_col"});
      } else {
        s.push_back({shape, DType::kF32, false, "exp_avg_sq"});
      }
      // state["RMS"] = self._rms(p_data_fp32) = tensor.norm(2) / numel**0.5: a 0-d float32 device tensor kept
      // in the state (initialised to the Python int 0, replaced by a tensor at every step)
      s.push_back({{}, DType::kF32, false, "RMS"});
      break;
    case Optimizer::kAdafactorTorch:
      // torch/optim/_adafactor.py Adafactor._init_group: `step` = torch.tensor(0.0) on the CPU (no device
      // bytes); when p.grad.dim() > 1, row_var = p.grad.new_zeros(shape with [-1] = 1) and col_var =
      // p.grad.new_zeros(shape with [-2] = 1), both in the gradient's (= the parameter's) dtype; otherwise
      // variance = torch.zeros_like(p.grad). No first moment.
      if (shape.size() > 1) {
        std::vector<uint64_t> row = shape, col = shape;
        row[row.size() - 1] = 1;
        col[col.size() - 2] = 1;
        s.push_back({row, pd, false, "row_var"});
        s.push_back({col, pd, false, "col_var"});
      } else {
        s.push_back({shape, pd, false, "variance"});
      }
      break;
  }
  return s;
}

std::vector<StateTensor> optimizer_shared_state(Optimizer o) {
  // Optimizer2State.init_state: self.name2qmap["dynamic"] / ["udynamic"] (create_dynamic_map: 256 float32
  // values each), moved to the parameter's device once
  if (o == Optimizer::kAdamW8bit || o == Optimizer::kPagedAdamW8bit) {
    return {{{256}, DType::kF32, false, "qmap1 (dynamic)"}, {{256}, DType::kF32, false, "qmap2 (udynamic)"}};
  }
  // Optimizer1State.init_state moves only name2qmap["dynamic"] to the device
  if (o == Optimizer::kLion8bit) return {{{256}, DType::kF32, false, "qmap1 (dynamic)"}};
  return {};
}

bool needs_shared_state(const std::vector<StateTensor>& param_state) {
  for (const StateTensor& t : param_state) {
    if (t.dtype == DType::kU8) return true;
  }
  return false;
}

bool default_checkpoint_reentrant(Impl model_impl) { return model_impl != Impl::kHf; }

bool reentrant_checkpointing(const TrainSetup& s, Impl model_impl) {
  return s.checkpointing != Checkpointing::kNone && s.checkpoint_reentrant.value_or(default_checkpoint_reentrant(model_impl));
}

bool is_torch_optim(Optimizer o) {
  return o == Optimizer::kAdamW || o == Optimizer::kAdam || o == Optimizer::kSgd || o == Optimizer::kSgdMomentum;
}

OptimizerImpl resolve_optimizer_impl(Optimizer o, OptimizerImpl impl, Impl model_impl) {
  // torch/optim/_adafactor.py Adafactor: foreach=None runs _single_tensor_adafactor (its docstring: it
  // "will default to the slower single tensor for-loop implementation unless this flag is explicitly True")
  if (o == Optimizer::kAdafactorTorch) return OptimizerImpl::kForLoop;
  if (!is_torch_optim(o)) return OptimizerImpl::kAuto;  // nothing runs, or not torch.optim's code paths
  if (impl != OptimizerImpl::kAuto) return impl;
  // nanoGPT configure_optimizers: use_fused = fused_available and device_type == 'cuda' (AdamW only).
  if (model_impl == Impl::kNanoGpt && o == Optimizer::kAdamW) return OptimizerImpl::kFused;
  // torch.optim: foreach is the default when every tensor is on CUDA (_default_to_fused_or_foreach).
  return OptimizerImpl::kForeach;
}

std::string step_label(const TrainSetup& s) {
  if (s.task == Task::kInference && s.generate > 0) {
    return fmt::format("inference: generate(max_new_tokens={}), greedy, DynamicCache", s.generate);
  }
  if (s.task == Task::kInference) return "inference (forward only, torch.inference_mode())";
  return optimizer_label(s.optimizer, s.optimizer_impl, s.optimizer_in_backward);
}

std::string optimizer_label(Optimizer o, OptimizerImpl impl, bool in_backward) {
  if (o == Optimizer::kNone) return "no optimizer";
  return fmt::format("{} ({}){}", optimizer_name(o), optimizer_impl_name(impl), in_backward ? " in backward" : "");
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
    {Optimizer::kAdamW8bit, "adamw8bit", "bitsandbytes AdamW8bit: 8-bit blockwise states (float32 under 4096 elements)"},
    {Optimizer::kPagedAdamW8bit, "paged-adamw8bit", "bitsandbytes PagedAdamW8bit: 8-bit states, large ones paged"},
    {Optimizer::kPagedAdamW, "paged-adamw", "bitsandbytes PagedAdamW: float32 states, large ones paged"},
    {Optimizer::kLion, "lion", "bitsandbytes Lion (32-bit): one float32 state"},
    {Optimizer::kLion8bit, "lion8bit", "bitsandbytes Lion8bit: one 8-bit blockwise state (float32 under 4096 elements)"},
    {Optimizer::kAdafactor, "adafactor", "transformers' Adafactor: factored float32 second moments"},
    {Optimizer::kAdafactorTorch, "adafactor-torch",
     "torch.optim.Adafactor (torch >= 2.5): factored second moments in the parameter's dtype"},
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
    {Checkpointing::kSelective, "selective",
     "torchtitan's op-level SAC: checkpointed layers also keep their matmul (all but every second mm) and "
     "attention outputs; backward recomputes the rest"},
};
}  // namespace

std::span<const NameRow<Checkpointing>> name_table(Checkpointing) { return kCheckpointings; }

constexpr NameRow<LossKind> kLossKinds[] = {
    {LossKind::kCe, "ce", "transformers' ForCausalLMLoss: the whole logits upcast to float32 at once"},
    {LossKind::kChunked, "chunked",
     "torchtune's chunked output head and CEWithChunkedOutputLoss: one chunk upcast to float32 at a time"},
    {LossKind::kLigerFused, "liger-fused",
     "Liger-Kernel's fused linear cross-entropy: the head's gradients computed in forward, one chunk of logits "
     "at a time"},
};
std::span<const NameRow<LossKind>> name_table(LossKind) { return kLossKinds; }

constexpr NameRow<Task> kTasks[] = {
    {Task::kTrain, "train", "one training step: forward, loss, backward, the optimizer step"},
    {Task::kInference, "inference",
     "a forward pass in model.eval() under torch.inference_mode(): no graph, no gradients, no optimizer"},
};
std::span<const NameRow<Task>> name_table(Task) { return kTasks; }
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
  // --dp-rank, for every sharding (resolve() refuses it without --dp above 1, with its own message)
  if (s.dp > 1 && s.dp_rank && *s.dp_rank >= s.dp) {
    throw FieldError("dp_rank", fmt::format("{}: the data-parallel group has ranks 0 to {}", *s.dp_rank, s.dp - 1));
  }
  // --cp-rank
  if (s.cp_rank && s.cp <= 1) {
    throw FieldError("cp_rank", fmt::format("{}: a context-parallel rank; it applies with --cp above 1", *s.cp_rank));
  }
  if (s.cp_rank && *s.cp_rank >= s.cp) {
    throw FieldError("cp_rank", fmt::format("{}: the context-parallel group has ranks 0 to {}", *s.cp_rank, s.cp - 1));
  }
  if (s.optimizer == Optimizer::kNone && s.optimizer_impl != OptimizerImpl::kAuto) {
    throw FieldError("optimizer_impl", fmt::format("{}: there is no optimizer (the optimizer is none)",
                                                   optimizer_impl_name(s.optimizer_impl)));
  }
  if (s.optimizer == Optimizer::kAdafactorTorch && s.optimizer_impl != OptimizerImpl::kAuto &&
      s.optimizer_impl != OptimizerImpl::kForLoop) {
    throw FieldError("optimizer_impl", fmt::format("{}: torch's Adafactor is simulated on its default single-tensor "
                                                   "path (for-loop); _multi_tensor_adafactor is not simulated yet and "
                                                   "there is no fused Adafactor", optimizer_impl_name(s.optimizer_impl)));
  }
  if (!is_torch_optim(s.optimizer) && s.optimizer != Optimizer::kAdafactorTorch &&
      s.optimizer_impl != OptimizerImpl::kAuto) {
    throw FieldError("optimizer_impl", fmt::format("{}: {} has one implementation (foreach, fused and for-loop are "
                                                   "torch.optim's)", optimizer_impl_name(s.optimizer_impl),
                                                   optimizer_name(s.optimizer)));
  }
  if (s.optimizer_in_backward && s.grad_accum > 1) {
    // torchtune recipes/full_finetune_single_device.py _setup_optimizer / setup: "Gradient accumulation is
    // not supported with optimizer in bwd" (each gradient is consumed and freed as soon as it is accumulated)
    throw FieldError("grad_accum", fmt::format("{}: optimizer-in-backward steps every parameter as its gradient "
                                               "arrives, so it cannot accumulate micro-batches (torchtune refuses "
                                               "it); use --grad-accum 1", s.grad_accum));
  }
  if (s.optimizer_in_backward && s.optimizer == Optimizer::kNone) {
    throw FieldError("optimizer_in_backward", "true: there is no optimizer to step in backward (the optimizer is none)");
  }
  if (s.optimizer_version && !is_bnb_optim(s.optimizer)) {
    throw FieldError("optimizer_version", fmt::format("{}.{}: only bitsandbytes' optimizers have a versioned state "
                                                      "layout, and the optimizer is {}", s.optimizer_version->major,
                                                      s.optimizer_version->minor, optimizer_name(s.optimizer)));
  }
  // --target-seq: the decoder's length of an encoder-decoder model; a decoder-only model has one sequence
  if (s.target_seq != 0 && m.family != Family::kT5) {
    throw FieldError("target_seq", fmt::format("{}: only encoder-decoder models (t5) have a decoder sequence apart "
                                               "from --seq; {} ({}) has one sequence: use --seq", s.target_seq, m.name,
                                               m.model_type));
  }
  if (input_kind(m) == InputKind::kFeatures) return;  // no sequence axis: T multiplies the rows
  if (m.max_positions != 0 && s.seq > m.max_positions) {
    throw FieldError("seq", fmt::format("{}: {} has a learned position table of {} positions; a longer sequence "
                            "cannot be embedded", s.seq, m.name, m.max_positions));
  }
  // generate() feeds the prompt and every new token but the last: positions 0 .. seq + generate - 2
  if (m.max_positions != 0 && s.generate > 0 && s.seq + s.generate - 1 > m.max_positions) {
    throw FieldError("generate", fmt::format("{}: the prompt of {} tokens and {} new ones pass {}'s learned position "
                                             "table of {} positions", s.generate, s.seq, s.generate - 1, m.name,
                                             m.max_positions));
  }
}

}  // namespace trainmem
