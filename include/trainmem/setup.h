// TrainSetup: how the model is trained (precision, optimizer, batch, sequence, device), independent of the
// model's shape. Parsing of the CLI spellings lives here so that every front end accepts the same words.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/dtype.h"
#include "trainmem/pp.h"
#include "trainmem/model.h"
#include "trainmem/names.h"
#include "trainmem/nccl.h"

namespace trainmem {

enum class Precision {
  kFp32,     // everything float32
  kFp16Amp,  // torch.autocast(dtype=float16) over float32 weights (with a GradScaler)
  kBf16Amp,  // torch.autocast(dtype=bfloat16) over float32 weights
  kFp16,     // model.to(float16): weights, gradients, optimizer state and buffers in float16
  kBf16,     // model.to(bfloat16)
};

enum class Optimizer {
  kAdamW, kAdam, kSgd, kSgdMomentum, kNone,
  kAdamW8bit,       // bitsandbytes AdamW8bit (optim_bits=8): blockwise 8-bit states
  kPagedAdamW8bit,  // bitsandbytes PagedAdamW8bit: the same, large states in paged (managed) memory
  kPagedAdamW,      // bitsandbytes PagedAdamW: float32 states in paged memory
  kLion,            // bitsandbytes Lion (32-bit): one float32 state
  kAdafactor,       // transformers' Adafactor (the Trainer's optim="adafactor"), factored second moments
  kLion8bit,        // bitsandbytes Lion8bit: one blockwise 8-bit state
  kAdafactorTorch,  // torch.optim.Adafactor (torch >= 2.5): keepdim row/col variances in the parameter's dtype
};



// Which torch.optim code path runs the update (it decides temporaries and where `step` lives).
enum class OptimizerImpl {
  kAuto,     // nanoGPT: fused (configure_optimizers passes fused=True on CUDA); otherwise foreach, the
             // torch.optim default on CUDA
  kForeach,  // _multi_tensor_* (torch._foreach_ ops)
  kFused,    // _fused_adamw_ kernels; `step` is a device tensor
  kForLoop,  // _single_tensor_*
};

// A bitsandbytes release (--optimizer-version), whose 8-bit state layout is modelled.
struct BnbVersion {
  uint32_t major = 0, minor = 0;
  friend auto operator<=>(BnbVersion, BnbVersion) = default;
};
std::optional<BnbVersion> parse_bnb_version(std::string_view s);  // "0.43", "0.43.3"
// Elements per float32 absmax of bitsandbytes' blockwise 8-bit states; empty: the newest release's.
uint64_t bnb_block_size(std::optional<BnbVersion> v);
// bitsandbytes' optimizers (the ones --optimizer-version applies to).
bool is_bnb_optim(Optimizer o);

// One state tensor an optimizer keeps for a parameter (created at its first step).
struct StateTensor {
  std::vector<uint64_t> shape;
  DType dtype = DType::kF32;
  bool paged = false;  // in cudaMallocManaged memory: not the caching allocator's, so not in memory_allocated
  const char* what = "";
};
// The state tensors of `o` for a parameter of `shape` stored as `param_dtype`, in the order the optimizer
// creates them; the source of each rule is cited in setup.cc.
// `bnb_block` is bnb_block_size() of the bitsandbytes release modelled.
std::vector<StateTensor> optimizer_state_tensors(Optimizer o, OptimizerImpl impl, const std::vector<uint64_t>& shape,
                                                 DType param_dtype, uint64_t bnb_block);
// State created once per optimizer, on the first step (bitsandbytes' quantization maps).
std::vector<StateTensor> optimizer_shared_state(Optimizer o);
// Whether a parameter's state needs that shared state: bitsandbytes moves its qmaps to the device only in
// init_state's 8-bit branch (a parameter of at least min_8bit_size elements).
bool needs_shared_state(const std::vector<StateTensor>& param_state);


// Gradient (activation) checkpointing of the decoder layers, as transformers' gradient_checkpointing_enable()
// applies it: each checkpointed layer's call goes through torch.utils.checkpoint.checkpoint.
enum class Checkpointing {
  kNone,
  kFull,  // the whole layer is recomputed in backward (every `checkpoint_every`-th layer)
  // torchtitan's op-level selective activation checkpointing (SelectiveAC): non-reentrant checkpointing of
  // the layer whose forward keeps the outputs of the matmuls (all but every second mm) and of attention,
  // and whose recompute runs only the rest
  kSelective,
};
std::span<const NameRow<Checkpointing>> name_table(Checkpointing);

// PEFT LoRA (peft: tuners/lora/config.py LoraConfig defaults: r=8, lora_alpha=8, lora_dropout=0.0).
struct LoraSetup {
  bool on = false;
  uint64_t r = 8;
  double alpha = 8.0;                // scaling = alpha / r: a Python number, no memory of its own
  double dropout = 0.0;              // nn.Dropout(p) when > 0, nn.Identity() otherwise
  std::vector<std::string> targets;  // module-name suffixes, or {"all-linear"}; empty: PEFT's default for the model
  bool fp32 = true;                  // adapters in float32 (get_peft_model autocast_adapter_dtype=True, peft >= 0.12)
};

// A k-bit base (bitsandbytes through transformers' BitsAndBytesConfig), for QLoRA.
enum class Quantize { kNone, kNf4, kFp4, kInt8 };
std::span<const NameRow<Quantize>> name_table(Quantize);
struct QuantSetup {
  Quantize type = Quantize::kNone;
  bool double_quant = false;             // bnb_4bit_use_double_quant (transformers' default False)
  DType compute = DType::kF32;           // bnb_4bit_compute_dtype (transformers' default None: float32)
  bool prepare = true;                   // peft's prepare_model_for_kbit_training (as QLoRA recipes call it)
  DType storage = DType::kU8;            // bnb_4bit_quant_storage (transformers' default uint8; FSDP-QLoRA: bf16)
};

// How the loss is computed from the final hidden states (transformers models).
enum class LossKind {
  kCe,       // transformers' ForCausalLMLoss over the whole (B, T, V) logits (loss_utils.py)
  kChunked,  // torchtune: TransformerDecoder.chunked_output + CEWithChunkedOutputLoss (one chunk upcast at a time)
  kLigerFused,  // Liger-Kernel: LigerFusedLinearCrossEntropyFunction (head and loss fused, gradients in forward)
};
std::span<const NameRow<LossKind>> name_table(LossKind);

// What one step is: a training step, or a forward pass for inference (model.eval() under
// torch.inference_mode(): no autograd graph, so nothing is saved for backward, and no optimizer).
enum class Task { kTrain, kInference };
std::span<const NameRow<Task>> name_table(Task);

// How data-parallel ranks share the model (--sharding): DDP (full replicas, gradient buckets all-reduced) and
// DeepSpeed ZeRO stages 1 and 2 are simulated; FSDP and ZeRO-3 are named so that they can be refused with a
// reason.
enum class Sharding { kDdp, kFsdp1, kFsdp2, kZero1, kZero2, kZero3 };
std::span<const NameRow<Sharding>> name_table(Sharding);

struct TrainSetup {
  Task task = Task::kTrain;
  uint64_t batch = 8;      // B: micro-batch size
  uint64_t seq = 1024;     // T: tokens per sequence
  Precision precision = Precision::kBf16Amp;
  Optimizer optimizer = Optimizer::kAdamW;
  OptimizerImpl optimizer_impl = OptimizerImpl::kAuto;
  std::optional<BnbVersion> optimizer_version;  // bitsandbytes release; empty: the newest layout
  // torchtune's optimizer_in_bwd: one optimizer per parameter, stepped (and its .grad freed) in the
  // parameter's post-accumulate-grad hook during backward
  bool optimizer_in_backward = false;
  uint64_t grad_accum = 1;  // micro-batches per optimizer step
  std::string gpu;          // catalog name, empty when not given
  Checkpointing checkpointing = Checkpointing::kNone;
  // use_reentrant; empty: the default of the code that runs it (transformers 5.x: False, since transformers
  // PR #43203; nanoGPT and layer stacks: torch.utils.checkpoint's own default, True)
  std::optional<bool> checkpoint_reentrant;
  uint64_t checkpoint_every = 1;   // checkpoint layers whose index is a multiple of this (every_n_layers)
  std::vector<std::string> freeze; // parameter-name globs whose rows get requires_grad=False
  LoraSetup lora;
  QuantSetup quant;
  // enable_input_require_grads (the input embedding's output requires grad); empty: on for LoRA with
  // checkpointing, as transformers and PEFT turn it on then
  std::optional<bool> input_require_grads;
  LossKind loss = LossKind::kCe;
  // torchtune's num_output_chunks: 8 in CEWithChunkedOutputLoss.__init__ and every recipe config that sets it
  uint64_t loss_chunks = 8;
  // transformers' logits_to_keep: the head (and the loss) over the last N positions only; 0: all of them
  uint64_t logits_to_keep = 0;
  // --task inference only: transformers' model.generate(input_ids, max_new_tokens=generate), greedy, with its
  // default DynamicCache: a prefill of the `seq` prompt tokens, then generate - 1 one-token decode steps.
  // 0: one forward pass of `seq` tokens (no cache).
  uint64_t generate = 0;
  // Data-parallel ranks (GPUs). With more than one, estimate simulates one rank of `sharding` (DDP, ZeRO-1/2);
  // `trainmem formulas` prints ZeRO's and DeepSpeed's per-rank closed forms for them.
  uint64_t dp = 1;
  Sharding sharding = Sharding::kDdp;  // how the dp ranks share the model (DDP, DeepSpeed ZeRO-1/2)
  // The data-parallel rank simulated (0 to dp - 1). Empty: the one holding the most. FSDP2: rank 0 (every shard
  // padded alike, torch.chunk's short chunks on the last ranks, whose optimizer state is smaller); ZeRO-1/2: the
  // rank whose params_in_partition hold the most (zero_fullest_rank); DDP's and ZeRO-3's ranks are alike.
  std::optional<uint64_t> dp_rank;
  // HSDP (--sharding fsdp2 --dp-shard K): fully_shard over a (dp_replicate, dp_shard) = (dp / K, K) mesh, the
  // states sharded over the K ranks of a shard group and replicated over the dp / K groups (fsdp.h). Empty: K = dp,
  // FSDP2 over the whole data-parallel group.
  std::optional<uint64_t> dp_shard;
  // DistributedDataParallel's arguments (ddp.h); empty: what the modelled loop passes (resolve_ddp)
  std::optional<double> bucket_cap_mb;          // bucket_cap_mb (MiB despite the name)
  std::optional<bool> gradient_as_bucket_view;  // gradient_as_bucket_view
  std::optional<bool> find_unused_parameters;   // find_unused_parameters
  // DeepSpeed ZeRO's zero_optimization settings (zero.h); empty: DeepSpeedZeroConfig's defaults (resolve_zero)
  std::optional<uint64_t> reduce_bucket_size;  // reduce_bucket_size, in elements
  std::optional<bool> overlap_comm;            // overlap_comm
  // DeepSpeed ZeRO offload (--offload optimizer|params|optimizer,params): offload_optimizer / offload_param
  // device cpu (stage 3 for params); and stage3_param_persistence_threshold (elements; empty: DeepSpeed's 1e5)
  bool offload_optimizer = false;
  bool offload_params = false;
  std::optional<uint64_t> param_persistence_threshold;
  // stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance (elements; empty: DeepSpeed's
  // 5e7, 1e9, 1e9)
  std::optional<uint64_t> prefetch_bucket_size, max_live_parameters, max_reuse_distance;
  // FSDP2's fully_shard settings (fsdp.h); empty: accelerate's FullyShardedDataParallelPlugin defaults
  std::optional<bool> reshard_after_forward;   // reshard_after_forward
  // FSDP1's backward_prefetch (fsdp1.h; field fsdp1_prefetch): true BACKWARD_PRE, false None; empty: the Trainer's "NO_PREFETCH"
  std::optional<bool> backward_prefetch_pre;
  // Tensor-parallel ranks (tp.h): transformers 5.x tp_plan="auto" over `tp` GPUs; estimate simulates one rank's
  // local model. 1: none. sequence_parallel: PyTorch-native TP + SP with torchtitan's plan in place of
  // transformers' (sp.h).
  uint64_t tp = 1;
  bool sequence_parallel = false;
  // Expert-parallel ranks (ep.h): DistributedConfig(tp_size=ep, ep_size=ep); resolve() sets tp = ep. 1: none.
  uint64_t ep = 1;
  NcclSetup nccl;  // NCCL's communicators (nccl.h): channels, NVLS, GPUs per node
  // Context-parallel ranks (cp.h): torch's context_parallel as accelerate drives it. With more than one, `seq`
  // is the rank's share (resolve() divides --seq by cp) and SDPA runs ring attention.
  uint64_t cp = 1;
  uint64_t cp_seq = 0;  // --seq as given (the whole sequence) when cp > 1; 0 otherwise
  // The CP rank simulated (0 to cp - 1): its ring attention's steps differ (cp.h ring_steps). Empty: estimate()
  // simulates every CP rank and reports the worst (CpFigures); a simulation alone runs rank 0.
  std::optional<uint64_t> cp_rank;
  // N: an encoder-decoder's (T5's) decoder tokens per sequence, the labels' (B, N) (seq is the encoder's);
  // 0: the same as seq. Only encoder-decoder models take it.
  uint64_t target_seq = 0;
  // Pipeline parallelism (pp.h): pp ranks, each one stage (torchtitan's split), running `pp_schedule` over
  // `micro_batches` micro-batches of `batch` each per step; estimate simulates every rank and reports the
  // worst (or `rank`).
  uint64_t pp = 1;
  PpSchedule pp_schedule = PpSchedule::k1f1b;  // torchtitan's default pipeline_parallel_schedule "1F1B"
  uint64_t micro_batches = 0;                  // n_microbatches; 0: not given (pp)
  // interleaved-1f1b: stages per rank; 0: not given (torchtitan's default for a multi-stage schedule, 2)
  uint64_t pp_virtual_stages = 0;
  std::optional<uint64_t> rank;                // the rank whose step estimate and timeline show; empty: the worst
};

// The dtype parameters are stored in (and gradients and optimizer state follow).
DType param_dtype(Precision p);
// The dtype matmuls run in: the autocast dtype, or the storage dtype without autocast.
DType compute_dtype(Precision p);
bool uses_autocast(Precision p);

// use_reentrant when the setup leaves it open: the modelled code's default (transformers 5.x
// gradient_checkpointing_enable passes {"use_reentrant": False}, transformers PR #43203; nanoGPT and layer
// stacks call torch.utils.checkpoint, whose own default is True).
bool default_checkpoint_reentrant(Impl model_impl);
// Whether the setup checkpoints layers with the reentrant kind (--checkpoint-reentrant, else the default above).
bool reentrant_checkpointing(const TrainSetup& s, Impl model_impl);

// AdamW, Adam, SGD: torch.optim's, with foreach/fused/for-loop code paths.
bool is_torch_optim(Optimizer o);
// The implementation that actually runs for `o` and `impl` with a model built by `model_impl`.
OptimizerImpl resolve_optimizer_impl(Optimizer o, OptimizerImpl impl, Impl model_impl);

// The enums' spellings (names.h); the *_name/parse_* functions below read these tables.
std::span<const NameRow<Precision>> name_table(Precision);
std::span<const NameRow<Optimizer>> name_table(Optimizer);
std::span<const NameRow<OptimizerImpl>> name_table(OptimizerImpl);

std::string_view precision_name(Precision p);
std::string_view optimizer_name(Optimizer o);
std::string_view optimizer_impl_name(OptimizerImpl i);
// "adamw (fused)", or "no optimizer".
std::string optimizer_label(Optimizer o, OptimizerImpl impl, bool in_backward);  // in_backward: optimizer-in-backward
// What runs, for report headers: "inference (forward only)" for --task inference, else the optimizer's label.
std::string step_label(const TrainSetup& s);
std::optional<Precision> parse_precision(std::string_view s);
std::optional<Optimizer> parse_optimizer(std::string_view s);
std::optional<OptimizerImpl> parse_optimizer_impl(std::string_view s);

// Throws trainmem::Error when the setup cannot run on the model (zero sizes, a sequence longer than a
// learned position table, ...).
void validate_setup(const ModelSpec& m, const TrainSetup& s);

}  // namespace trainmem
