// Scenario fields by name, and resolve(): every default and every rule between fields, in one place.
#include "trainmem/scenario.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <set>

#include "trainmem/cp.h"
#include "trainmem/error.h"
#include "trainmem/family.h"
#include "trainmem/fsdp.h"
#include "trainmem/ep.h"
#include "trainmem/sp.h"
#include "trainmem/tp.h"

#include "../config/key_reader.h"
#include "../families/registry.h"

namespace trainmem {

namespace {

[[noreturn]] void bad(std::string_view field, std::string_view value, std::string_view expected) {
  throw FieldError(std::string(field), fmt::format("\"{}\": expected {}", value, expected));
}

// A decimal number: digits and at most one point ("0x10", "1e3", " 5" are refused).
double decimal(std::string_view field, std::string_view v, std::string_view expected) {
  const size_t digits = static_cast<size_t>(std::count_if(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; }));
  const size_t points = static_cast<size_t>(std::count(v.begin(), v.end(), '.'));
  if (v.size() > 24 || digits == 0 || points > 1 || digits + points != v.size()) bad(field, v, expected);
  return std::strtod(std::string(v).c_str(), nullptr);
}


// Bounds of the sizes a request may ask for. Far above any real run; they keep every derived count within
// 64 bits long before the checked arithmetic would have to say so.
constexpr uint64_t kMaxBatch = uint64_t{1} << 20;
constexpr uint64_t kMaxSeq = uint64_t{1} << 24;
// --generate: every decode step is simulated (one forward of every layer per token), so the count is bounded to
// keep an estimate within seconds; 32,768 new tokens is past what a generate() call is used for.
constexpr uint64_t kMaxGenerate = uint64_t{1} << 15;
// Data-parallel ranks: 2^20, an order of magnitude past the largest published training clusters (~100k GPUs)
constexpr uint64_t kMaxRanks = uint64_t{1} << 20;
// --micro-batches: each is simulated (a few hundred layer passes per rank stay within the event bound at 1,024)
constexpr uint64_t kMaxPpMicroBatches = 1024;
constexpr uint64_t kMaxPpVirtualStages = 64;  // stages per rank (each holds at least one layer)
constexpr uint64_t kMaxGradAccum = uint64_t{1} << 20;
constexpr uint64_t kMaxSteps = 16;  // the steady state is reached at step 2; more steps only repeat it
constexpr uint64_t kMaxLayersPerCheckpoint = 1024;  // the bound on layers
// torch.chunk's SplitBackward0 has one output per chunk; the simulator's nodes hold at most kMaxEdges (16)
constexpr uint64_t kMaxLossChunks = 16;
constexpr uint64_t kMaxLoraRank = 65536;             // far above any published LoRA rank (4 to 256)

// fnmatch-style: `*` matches any run of characters (dots included), `?` one character.
// "r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj": fields separated by commas; after targets=, names
// separated by commas or '+' up to the next field. "" or "default" keeps every default.
LoraSetup parse_lora(std::string_view v) {
  LoraSetup l;
  l.on = true;
  if (v.empty() || v == "default" || v == "true") return l;
  const std::string expected =
      "fields r=N, alpha=X, dropout=P (0 <= P < 1) and targets=a,b (or all-linear), like r=16,alpha=32,targets=q_proj,v_proj";
  bool in_targets = false;
  size_t i = 0;
  while (i <= v.size()) {
    const size_t comma = std::min(v.find(',', i), v.size());
    const std::string_view tok = v.substr(i, comma - i);
    i = comma + 1;
    const size_t eq = tok.find('=');
    if (eq == std::string_view::npos) {
      if (!in_targets || tok.empty()) bad("lora", v, expected);
      l.targets.emplace_back(tok);
      continue;
    }
    const std::string_view key = tok.substr(0, eq), val = tok.substr(eq + 1);
    in_targets = false;
    char* end = nullptr;
    const std::string sval(val);
    if (key == "r") {
      if (sval.empty() || sval.find_first_not_of("0123456789") != std::string::npos || sval.size() > 7) bad("lora", v, expected);
      l.r = std::stoull(sval);
      if (l.r == 0 || l.r > kMaxLoraRank) bad("lora", v, fmt::format("a rank r from 1 to {}", kMaxLoraRank));
    } else if (key == "alpha") {
      l.alpha = std::strtod(sval.c_str(), &end);
      if (sval.empty() || *end != '\0' || !(l.alpha > 0.0) || l.alpha > 1e6) bad("lora", v, expected);
    } else if (key == "dropout") {
      l.dropout = std::strtod(sval.c_str(), &end);
      if (sval.empty() || *end != '\0' || !(l.dropout >= 0.0) || !(l.dropout < 1.0)) bad("lora", v, expected);
    } else if (key == "targets") {
      if (val.empty()) bad("lora", v, "at least one target after targets=, like targets=q_proj,v_proj");
      in_targets = true;
      size_t j = 0;
      while (j <= val.size()) {
        const size_t plus = std::min(val.find('+', j), val.size());
        if (plus > j) l.targets.emplace_back(val.substr(j, plus - j));
        j = plus + 1;
      }
    } else {
      bad("lora", v, expected);
    }
  }
  // module names: letters, digits, '_', '.' and '-' (so that a list reads back unambiguously)
  for (const std::string& t : l.targets) {
    if (t.empty() || t.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") !=
                         std::string::npos) {
      bad("lora", v, "targets that are module names (letters, digits, '_', '.', '-'), like targets=q_proj,v_proj");
    }
  }
  if (std::find(l.targets.begin(), l.targets.end(), "all-linear") != l.targets.end() && l.targets.size() > 1) {
    bad("lora", v, "targets=all-linear alone, or a list of module names");
  }
  return l;
}

bool glob_match(std::string_view pattern, std::string_view name) {
  size_t p = 0, n = 0, star = std::string_view::npos, back = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      back = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++back;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

constexpr Field kFields[] = {
    {"model", "preset name (trainmem models) or path to a config.json (or a folder holding one)", FieldGroup::kModel},
    {"impl", "hf | nanogpt | stack (default: nanogpt for model_type nanogpt, stack for mlp, hf otherwise)", FieldGroup::kModel},
    {"attention", "eager | sdpa", FieldGroup::kModel},
    {"moe_routing", "balanced | worst: which experts the router picks, for mixture-of-experts models (balanced: "
                    "the B*T*k assignments spread evenly over the experts, the remainder to the lowest indices; "
                    "worst: every token routed to the same k experts)", FieldGroup::kModel},
    {"moe_experts", "eager | grouped_mm: transformers' experts_implementation for mixture-of-experts models "
                    "(transformers 5.x picks grouped_mm when none is given; grouped_mm is not simulated under "
                    "autocast)", FieldGroup::kModel},
    {"head", "causal-lm | masked-lm | seq-cls | token-cls: the task head on the model (default: the config's "
             "architectures[0], else the family's own: causal-lm for decoders, masked-lm for encoders)",
     FieldGroup::kModel},
    {"num_labels", "labels of a seq-cls or token-cls head (default: the config's len(id2label), else num_labels, "
                   "else 2)", FieldGroup::kModel},
    {"overrides", "override a config key: --set key=value (repeatable)", FieldGroup::kModel, true},
    {"task", "train | inference: one training step, or a forward pass in model.eval() under "
             "torch.inference_mode() (no saved tensors, gradients or optimizer)", FieldGroup::kTraining},
    {"batch", "micro-batch size", FieldGroup::kTraining},
    {"seq", "sequence length in tokens", FieldGroup::kTraining},
    {"target_seq", "encoder-decoder models (t5): decoder tokens per sequence, the labels' length (default 0: the "
                   "same as --seq, which is the encoder's)", FieldGroup::kTraining},
    {"precision", "fp32 | fp16-amp | bf16-amp | fp16 | bf16", FieldGroup::kTraining},
    {"optimizer", "adamw | adam | sgd | sgd-momentum | none | adamw8bit | paged-adamw8bit | paged-adamw | lion | "
                  "lion8bit | adafactor | adafactor-torch", FieldGroup::kTraining},
    {"optimizer_impl", "auto | foreach | fused | for-loop", FieldGroup::kTraining},
    {"optimizer_in_backward", "true | false: torchtune's optimizer_in_bwd: each parameter stepped and its "
                              "gradient freed in its post-accumulate-grad hook (plain loop, torch >= 2.1)",
     FieldGroup::kTraining},
    {"optimizer_version", "bitsandbytes release whose 8-bit state layout to model, like 0.43 (default: the newest; "
                          "blocks of 2048 before 0.44, 256 since)", FieldGroup::kTraining},
    {"grad_accum", "micro-batches per optimizer step", FieldGroup::kTraining},
    {"checkpointing", "none | full | selective: gradient checkpointing of the decoder layers (full: transformers' "
                      "gradient_checkpointing_enable; selective: torchtitan's op-level SAC)", FieldGroup::kTraining},
    {"checkpoint_reentrant", "true | false: torch.utils.checkpoint's use_reentrant (default: the modelled code's: "
                             "false for transformers 5.x, true for nanoGPT and layer stacks)", FieldGroup::kTraining},
    {"checkpoint_every", "checkpoint every N-th layer (those whose index is a multiple of N)", FieldGroup::kTraining},
    {"lora", "PEFT LoRA: r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj (each optional: PEFT's defaults r=8, "
             "alpha=8, dropout 0, the model's default targets; targets=all-linear for every Linear but the head)",
     FieldGroup::kModel},
    {"lora_dtype", "fp32 | base: LoRA adapters in float32 (PEFT >= 0.12) or in the model's dtype", FieldGroup::kModel},
    {"input_require_grads", "true | false: enable_input_require_grads (default: on for LoRA with checkpointing)",
     FieldGroup::kTraining},
    {"quantize", "none | nf4 | fp4: a bitsandbytes 4-bit base (QLoRA) with every Linear but the head quantized",
     FieldGroup::kModel},
    {"double_quant", "true | false: bnb_4bit_use_double_quant (default false, as transformers)", FieldGroup::kModel},
    {"compute_dtype", "fp32 | bf16 | fp16: bnb_4bit_compute_dtype (default fp32, as transformers)", FieldGroup::kModel},
    {"quant_storage", "uint8 | bf16: bnb_4bit_quant_storage, the packed weights' dtype (default uint8, as "
                      "transformers; bf16 lets FSDP2 shard them)", FieldGroup::kModel},
    {"kbit_prepare", "true | false: peft's prepare_model_for_kbit_training (float32 non-quantized parameters, "
                     "reentrant checkpointing, input grads; default true with --quantize)", FieldGroup::kModel},
    {"freeze", "freeze the parameters whose names match a glob (* matches anything): --freeze 'model.layers.0.*' "
               "(repeatable); frozen rows get no gradient and no optimizer state", FieldGroup::kModel, true},
    {"loss", "ce | chunked | liger-fused: transformers' cross-entropy over the whole logits, torchtune's chunked "
             "output head with CEWithChunkedOutputLoss, or Liger-Kernel's fused linear cross-entropy",
     FieldGroup::kTraining},
    {"loss_chunks", "torchtune's num_output_chunks for --loss chunked (default 8, as torchtune)", FieldGroup::kTraining},
    {"logits_to_keep", "transformers' logits_to_keep: the head and the loss over the last N positions only "
                       "(default 0: all)", FieldGroup::kTraining},
    {"generate", "with --task inference: model.generate(max_new_tokens=N), greedy, with transformers' DynamicCache: "
                 "the --seq prompt prefilled, then N-1 one-token decode steps (default 0: one forward pass)",
     FieldGroup::kTraining},
    {"dp", "data-parallel ranks (GPUs): estimate simulates one rank of --sharding; trainmem formulas prints ZeRO's "
           "and DeepSpeed's per-rank closed forms for them (default 1)", FieldGroup::kTraining},
    {"sharding", "ddp | fsdp1 | fsdp2 | zero1 | zero2 | zero3: how the --dp ranks share the model (DDP, FSDP1's "
                 "FullyShardedDataParallel and FSDP2's fully_shard through accelerate, DeepSpeed ZeRO-1/2/3 under the "
                 "Trainer)",
     FieldGroup::kTraining},
    {"dp_rank", "with --dp: the data-parallel rank whose shards are simulated (default: the one holding the most, "
                "rank 0, or under ZeRO-1/2 the rank whose partition keeps the most gradients)", FieldGroup::kTraining},
    {"dp_shard", "with --sharding fsdp2: HSDP's shard degree K, a divisor of --dp from 2 to --dp: fully_shard over a "
                 "(dp_replicate, dp_shard) = (dp / K, K) mesh, the states sharded over K ranks and replicated over dp / "
                 "K groups (accelerate's ParallelismConfig(dp_replicate_size, dp_shard_size); default: --dp, plain FSDP2)",
     FieldGroup::kTraining},
    {"bucket_cap_mb", "DDP's bucket_cap_mb, in MiB (default: what the loop passes: none, so DDP's 25 with a 1 MiB "
                      "first bucket)", FieldGroup::kTraining},
    {"gradient_as_bucket_view", "true | false: DDP's gradient_as_bucket_view (default false, as DDP, the Trainer "
                                "and nanoGPT)", FieldGroup::kTraining},
    {"find_unused_parameters", "true | false: DDP's find_unused_parameters (default: the Trainer's, true unless "
                               "gradient checkpointing; false for nanoGPT and plain loops, DDP's own)",
     FieldGroup::kTraining},
    {"reduce_bucket_size", "DeepSpeed ZeRO's reduce_bucket_size, in elements (default 5e8, DeepSpeedZeroConfig's; "
                           "the Trainer's \"auto\" is hidden_size^2)", FieldGroup::kTraining},
    {"overlap_comm", "true | false: DeepSpeed ZeRO's overlap_comm, a second IPG bucket (default false below stage 3)",
     FieldGroup::kTraining},
    {"offload", "none | optimizer | params | optimizer,params: DeepSpeed ZeRO's offload to CPU memory, reported as "
                "host memory (optimizer: stages 1-3, params: stage 3; default none)", FieldGroup::kTraining},
    // DeepSpeed ZeRO-3's coordinator settings (DeepSpeedZeroConfig's stage3_* keys), in elements
    {"param_persistence_threshold", "ZeRO-3 (default 1e5; the Trainer's \"auto\": 10 * hidden_size)", FieldGroup::kTraining},
    {"prefetch_bucket_size", "ZeRO-3 (default 5e7; the Trainer's \"auto\": 0.9 * hidden_size^2)", FieldGroup::kTraining},
    {"max_live_parameters", "ZeRO-3: the cap on gathered elements the prefetch keeps to (default 1e9)", FieldGroup::kTraining},
    {"max_reuse_distance", "ZeRO-3: keep a module reused within this many elements (default 1e9)", FieldGroup::kTraining},
    {"cp", "context-parallel ranks: torch's context_parallel as accelerate drives it (ring attention, the sequence "
           "sharded with the head-tail load balancer); estimate simulates every CP rank at --seq / N tokens (their "
           "ring steps differ) and names the worst, with the model states whole on the rank, or with --sharding "
           "fsdp2 sharded over the dp x cp ranks (FSDP2's dp_shard_cp mesh); Llama (model_type llama) with SDPA "
           "only (default 1)", FieldGroup::kTraining},
    {"cp_rank", "with --cp: the context-parallel rank simulated, 0 to N - 1 (default: every one, the worst shown)",
     FieldGroup::kTraining},
    {"pp", "pipeline-parallel ranks: each holds one stage (torchtitan's split); estimate simulates every rank and "
           "names the worst (default 1)", FieldGroup::kTraining},
    {"pp_schedule", "gpipe | 1f1b | interleaved-1f1b: torch.distributed.pipelining's schedule for --pp (default "
                    "1f1b, torchtitan's; zero-bubble: not simulated)", FieldGroup::kTraining},
    {"micro_batches", "the pipeline's micro-batches per step (n_microbatches), each of --batch sequences (default: "
                      "--pp)", FieldGroup::kTraining},
    {"pp_virtual_stages", "with --pp-schedule interleaved-1f1b: stages per rank (default 2, torchtitan's for a "
                          "multi-stage schedule)", FieldGroup::kTraining},
    {"rank", "with --pp: the pipeline rank whose step estimate and timeline show (default: the worst)",
     FieldGroup::kTraining},
    {"reshard_after_forward", "true | false: FSDP2's reshard_after_forward for the decoder layers and the embedding "
                              "(default true, accelerate's for fsdp_version 2; the tail [norm, lm_head] keeps false)",
     FieldGroup::kTraining},
    {"fsdp1_prefetch", "none | backward_pre: FSDP1's backward_prefetch (default none, the Trainer's NO_PREFETCH; "
                          "backward_pre: the next unit all-gathered at each unit's pre-backward)", FieldGroup::kTraining},
    {"tp", "tensor-parallel ranks: transformers' tp_plan=\"auto\" (Llama-shaped decoders); estimate simulates one "
           "rank's local model (default 1)", FieldGroup::kTraining},
    {"sequence_parallel", "true | false: sequence parallelism with --tp (torchtitan's TP + SP plan on transformers' "
                          "modules, with its loss_parallel cross-entropy; default false: transformers' tp_plan)",
     FieldGroup::kTraining},
    {"ep", "expert-parallel ranks: transformers' DistributedConfig(tp_size=N, ep_size=N) (mixtral, qwen3_moe): "
           "E/N local experts, attention under --tp N; estimate simulates rank 0 (default 1)", FieldGroup::kTraining},
    {"nccl_channels", "NCCL's ring channels per communicator, for its buffers outside the caching allocator "
                      "(default: the GPU catalog's reading for the card; NCCL_DEBUG=INFO prints \"N coll channels\")",
     FieldGroup::kRuntime},
    {"nccl_nvls", "true | false: NCCL's NVLink SHARP buffers (NCCL_NVLS_ENABLE; default: on for sm_90 NVSwitch "
                  "cards when more than 2 GPUs of a communicator share a node)", FieldGroup::kRuntime},
    {"gpus_per_node", "GPUs per node, for the communicators' local ranks (default 8, an HGX node)", FieldGroup::kRuntime},
    {"nccl_tree", "true | false: count NCCL's tree connections (all-reduce's Tree algorithm, connected at the first "
                  "all-reduce the tuner gives it; default false)", FieldGroup::kRuntime},
    {"nccl_gdr", "true | false: GPUDirect RDMA for NCCL's connections to other nodes, their buffers on the GPU "
                 "(false: in pinned host memory; default true, HGX/DGX nodes)", FieldGroup::kRuntime},
    {"net_gbps", "per-GPU inter-node network bandwidth, per direction, in GB/s, for the step time of collectives "
                 "whose group spans nodes (default: the GPU catalog's reference node: DGX H100/H200 50, DGX A100 25)",
     FieldGroup::kRuntime},
    {"gpu",
     "GPU from the catalog (trainmem gpus, any case) or a memory size like 24GiB (a generic sm_80 card); "
     "sets the architecture (default sm_80)",
     FieldGroup::kRuntime},
    {"gpus", "N x a GPU, like 8xh100-80gb: N ranks (--dp N) on that GPU (--gpu); the per-rank step is simulated",
     FieldGroup::kRuntime},
    {"loop", "training script: nanogpt | hf | seed000 | plain (default: by --impl)", FieldGroup::kRuntime},
    {"torch", "PyTorch version whose runtime behaviour to model (1.13 .. 2.11)", FieldGroup::kRuntime},
    {"alloc_conf", "PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True", FieldGroup::kRuntime},
    {"steps", "optimizer steps to simulate (the first creates the optimizer state)", FieldGroup::kRuntime},
};

// An integer in [1, max] written with digits only, so "-3", "1.5", "1e3" and "" are rejected.
uint64_t count(std::string_view field, std::string_view s, uint64_t max) {
  const std::string expected = fmt::format("an integer in [1, {}]", max);
  if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string_view::npos) bad(field, s, expected);
  uint64_t v = 0;
  for (char ch : s) {
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, static_cast<uint64_t>(ch - '0'), &v)) {
      bad(field, s, expected);
    }
  }
  if (v < 1 || v > max) bad(field, s, expected);
  return v;
}

// "true" or "false", nothing else
bool boolean(std::string_view field, std::string_view s) {
  if (s != "true" && s != "false") bad(field, s, "true or false");
  return s == "true";
}

// field_text of an optional true|false setting: "" when not given (the modelled code's default)
std::string optional_boolean_text(const std::optional<bool>& b) { return b ? (*b ? "true" : "false") : ""; }

template <typename E>
E named(std::string_view field, std::string_view s, std::optional<E> v) {
  if (!v) bad(field, s, names_list<E>());
  return *v;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

// Liger-Kernel's fused linear cross-entropy (--loss liger-fused) where trainmem models what Liger patches in:
// apply_liger_kernel_to_<model> (src/liger_kernel/transformers/monkey_patch.py) replaces the *ForCausalLM
// forward of the llama-shaped families with lce_forward; it has no patch for gpt2, opt or gpt_neox.
void check_liger_fused(const ModelSpec& m, const TrainSetup& t, bool hf) {
  if (!hf || m.family != Family::kLlama) {
    throw FieldError("loss", fmt::format("{}: Liger patches the llama-shaped transformers causal LMs (--impl hf: "
                                         "llama, mistral, qwen2, qwen3, gemma, phi3, mixtral); {} is not one",
                                         name_of(t.loss), m.name));
  }
  // Liger's MoE patches swap the experts too (monkey_patch.py: `modeling_*.XxxExperts = LigerExperts` on
  // transformers 5) and its MoE lce_forward adds the router loss: neither is modelled.
  if (m.moe.experts > 0) {
    throw FieldError("loss", fmt::format("{}: Liger's kernels for mixture-of-experts models (LigerExperts, the MoE "
                                         "lce_forward) are not modelled; {} is one", name_of(t.loss), m.name));
  }
  // gemma2's lce_forward passes final_logit_softcapping to the kernel (HAS_SOFTCAPPING); not modelled here.
  if (m.model_type == "gemma2" || m.final_softcap > 0) {
    throw FieldError("loss", fmt::format("{}: {}'s final logit softcapping inside Liger's kernel is not "
                                         "modelled", name_of(t.loss), m.model_type));
  }
  // Under autocast the kernel's matmuls cast the float32 head weight to 16 bits in every chunk and torch >= 2.8
  // takes the addmm(out_dtype=float32) path (fused_linear_cross_entropy_forward); only the storage-dtype path
  // is modelled.
  if (uses_autocast(t.precision)) {
    throw FieldError("precision", fmt::format("{}: --loss liger-fused is modelled without autocast only (fp32, "
                                              "fp16 or bf16)", name_of(t.precision)));
  }
  // lce_forward slices the hidden states with logits_to_keep but passes the whole labels to the loss.
  if (t.logits_to_keep != 0) {
    throw FieldError("logits_to_keep", fmt::format("{}: Liger's lce_forward keeps the whole labels; use it with "
                                                   "--loss ce", t.logits_to_keep));
  }
}

// The loss options only where the modelled code has them: both are transformers-model features (a layer stack
// has no head, nanoGPT computes its own loss), and each must fit the sequence.
void check_loss(const ModelSpec& m, const TrainSetup& t) {
  const bool hf = m.impl == Impl::kHf && input_kind(m) == InputKind::kTokenIds;
  // The chunked and fused losses and logits_to_keep replace or slice a causal LM's head; the masked-LM and
  // classification heads compute their own CrossEntropyLoss over every row (bert.cc)
  if (m.head != Head::kCausalLm && (t.loss != LossKind::kCe || t.logits_to_keep != 0)) {
    const bool loss = t.loss != LossKind::kCe;
    throw FieldError(loss ? "loss" : "logits_to_keep",
                     fmt::format("{}: a causal-LM option; {} has the {} head, whose loss is its own CrossEntropyLoss",
                                 loss ? std::string(name_of(t.loss)) : std::to_string(t.logits_to_keep), m.name,
                                 head_name(m.head)));
  }
  if (t.loss == LossKind::kLigerFused) {
    check_liger_fused(m, t, hf);
  } else if (t.loss == LossKind::kChunked) {
    if (!hf) {
      throw FieldError("loss", fmt::format("{}: a chunked loss needs a transformers causal LM (--impl hf); {} has "
                                           "its own loss", name_of(t.loss), m.name));
    }
    if (m.model_type == "gemma2" || m.final_softcap > 0) {
      throw FieldError("loss", fmt::format("{}: {}'s final logit softcapping is not part of torchtune's chunked "
                                           "output head", name_of(t.loss), m.model_type));
    }
    if (m.embed.head_bias) {  // Phi: lm_head = nn.Linear(hidden_size, vocab_size, bias=True)
      throw FieldError("loss", fmt::format("{}: {}'s lm_head has a bias, which torchtune's chunked output head "
                                           "(a bias-free linear per chunk) does not model", name_of(t.loss), m.name));
    }
    // chunked_output splits the hidden states with .chunk(n, dim=1) and CEWithChunkedOutputLoss the labels with
    // .tensor_split(n, dim=1): the two agree (and zip pairs matching chunks) only when n divides the sequence.
    if (t.seq % t.loss_chunks != 0) {
      throw FieldError("loss_chunks", fmt::format("{}: must divide --seq {} (torchtune chunks the logits with "
                                                  ".chunk() and the labels with .tensor_split(), which differ "
                                                  "otherwise)", t.loss_chunks, t.seq));
    }
    if (t.logits_to_keep != 0) {
      throw FieldError("logits_to_keep", fmt::format("{}: torchtune's chunked output head has no logits_to_keep; use "
                                                     "it with --loss ce", t.logits_to_keep));
    }
  }
  if (t.loss != LossKind::kChunked && t.loss_chunks != 8) {
    throw FieldError("loss_chunks", fmt::format("{}: chunks are for --loss chunked (the loss is {})", t.loss_chunks,
                                                name_of(t.loss)));
  }
  if (t.logits_to_keep != 0) {
    if (!hf) {
      throw FieldError("logits_to_keep", fmt::format("{}: a transformers ForCausalLM argument (--impl hf); {} has "
                                                     "none", t.logits_to_keep, m.name));
    }
    if (t.logits_to_keep > t.seq) {
      throw FieldError("logits_to_keep", fmt::format("{}: more than the sequence (--seq {})", t.logits_to_keep, t.seq));
    }
  }
}

}  // namespace

std::span<const Field> scenario_fields() { return kFields; }

bool Scenario::was_given(std::string_view field) const {
  return std::find(given.begin(), given.end(), field) != given.end();
}

void set_field(Scenario& s, std::string_view f, std::string_view v) {
  if (!s.was_given(f)) s.given.emplace_back(f);
  if (f == "model") {
    s.model.model = std::string(v);
  } else if (f == "impl") {
    s.model.impl = named(f, v, parse_name<Impl>(v));
  } else if (f == "attention") {
    s.model.attention = named(f, v, parse_name<AttnImpl>(v));
  } else if (f == "moe_routing") {
    s.model.moe_routing = named(f, v, parse_name<MoeRouting>(v));
  } else if (f == "moe_experts") {
    s.model.moe_experts = named(f, v, parse_name<MoeExperts>(v));
  } else if (f == "head") {
    s.model.head = named(f, v, parse_name<Head>(v));
  } else if (f == "num_labels") {
    s.model.num_labels = count(f, v, kMaxNumLabels);
  } else if (f == "overrides") {
    s.model.overrides.emplace_back(v);
  } else if (f == "batch") {
    s.train.batch = count(f, v, kMaxBatch);
  } else if (f == "seq") {
    s.train.seq = count(f, v, kMaxSeq);
  } else if (f == "target_seq") {
    s.train.target_seq = v == "0" ? 0 : count(f, v, kMaxSeq);  // 0: the same as --seq
  } else if (f == "grad_accum") {
    s.train.grad_accum = count(f, v, kMaxGradAccum);
  } else if (f == "precision") {
    s.train.precision = named(f, v, parse_name<Precision>(v));
  } else if (f == "optimizer") {
    s.train.optimizer = named(f, v, parse_name<Optimizer>(v));
  } else if (f == "optimizer_impl") {
    s.train.optimizer_impl = named(f, v, parse_name<OptimizerImpl>(v));
  } else if (f == "optimizer_in_backward") {
    s.train.optimizer_in_backward = boolean(f, v);
  } else if (f == "optimizer_version" && v.empty()) {
    s.train.optimizer_version.reset();  // the newest layout (get_field's text for "not given")
  } else if (f == "optimizer_version") {
    const auto b = parse_bnb_version(v);
    if (!b) throw FieldError(std::string(f), fmt::format("\"{}\": expected a bitsandbytes version like 0.43 or 0.45.2", v));
    s.train.optimizer_version = *b;
  } else if (f == "checkpointing") {
    s.train.checkpointing = named(f, v, parse_name<Checkpointing>(v));
  } else if (f == "checkpoint_reentrant") {
    s.train.checkpoint_reentrant = boolean(f, v);
  } else if (f == "checkpoint_every") {
    s.train.checkpoint_every = count(f, v, kMaxLayersPerCheckpoint);
  } else if (f == "lora") {
    s.train.lora = parse_lora(v);
  } else if (f == "lora_dtype") {
    if (v != "fp32" && v != "base") bad(f, v, "fp32 or base");
    s.train.lora.fp32 = v == "fp32";
  } else if (f == "input_require_grads") {
    s.train.input_require_grads = boolean(f, v);
  } else if (f == "quantize") {
    s.train.quant.type = named(f, v, parse_name<Quantize>(v));
  } else if (f == "double_quant" || f == "kbit_prepare") {
    (f == "double_quant" ? s.train.quant.double_quant : s.train.quant.prepare) = boolean(f, v);
  } else if (f == "compute_dtype") {
    if (v == "fp32") s.train.quant.compute = DType::kF32;
    else if (v == "bf16") s.train.quant.compute = DType::kBF16;
    else if (v == "fp16") s.train.quant.compute = DType::kF16;
    else bad(f, v, "fp32, bf16 or fp16");
  } else if (f == "quant_storage") {
    if (v == "uint8") s.train.quant.storage = DType::kU8;
    else if (v == "bf16") s.train.quant.storage = DType::kBF16;
    else bad(f, v, "uint8 or bf16");
  } else if (f == "freeze") {
    if (v.empty()) bad(f, v, "a glob over parameter names, like 'model.layers.0.*'");
    s.train.freeze.emplace_back(v);
  } else if (f == "task") {
    s.train.task = named(f, v, parse_name<Task>(v));
  } else if (f == "loss") {
    s.train.loss = named(f, v, parse_name<LossKind>(v));
  } else if (f == "loss_chunks") {
    s.train.loss_chunks = count(f, v, kMaxLossChunks);
  } else if (f == "logits_to_keep") {
    s.train.logits_to_keep = v == "0" ? 0 : count(f, v, kMaxSeq);
  } else if (f == "generate") {
    s.train.generate = v == "0" ? 0 : count(f, v, kMaxGenerate);
  } else if (f == "dp") {
    s.train.dp = count(f, v, kMaxRanks);
  } else if (f == "dp_rank" && v.empty()) {
    s.train.dp_rank.reset();
  } else if (f == "dp_rank") {
    s.train.dp_rank = v == "0" ? 0 : count(f, v, kMaxRanks);
  } else if (f == "dp_shard" && v.empty()) {
    s.train.dp_shard.reset();
  } else if (f == "dp_shard") {
    s.train.dp_shard = v == "0" ? 0 : count(f, v, kMaxRanks);  // 0 reaches resolve_fsdp's message
  } else if (f == "cp") {
    s.train.cp = count(f, v, kMaxRanks);
  } else if (f == "cp_rank" && v.empty()) {
    s.train.cp_rank.reset();
  } else if (f == "cp_rank") {
    s.train.cp_rank = v == "0" ? 0 : count(f, v, kMaxRanks);
  } else if (f == "sharding") {
    s.train.sharding = named(f, v, parse_name<Sharding>(v));
  } else if ((f == "bucket_cap_mb" || f == "gradient_as_bucket_view" || f == "find_unused_parameters") && v.empty()) {
    // field_text's "not given": what the modelled loop passes (resolve_ddp)
    if (f == "bucket_cap_mb") s.train.bucket_cap_mb.reset();
    if (f == "gradient_as_bucket_view") s.train.gradient_as_bucket_view.reset();
    if (f == "find_unused_parameters") s.train.find_unused_parameters.reset();
  } else if (f == "bucket_cap_mb") {
    // a decimal number of MiB, digits and at most one point ("0x10", "1e3", " 5" are refused), of at least one
    // byte once DDP computes int(bucket_cap_mb * 1024 * 1024)
    const std::string expected = "a decimal size in MiB from 1/1048576 (one byte) to 1048576, like 25 or 0.5";
    const double mb = decimal(f, v, expected);
    if (!(mb * 1024 * 1024 >= 1) || mb > 1048576) bad(f, v, expected);
    s.train.bucket_cap_mb = mb;
  } else if (f == "gradient_as_bucket_view") {
    s.train.gradient_as_bucket_view = boolean(f, v);
  } else if (f == "find_unused_parameters") {
    s.train.find_unused_parameters = boolean(f, v);
  } else if ((f == "reduce_bucket_size" || f == "overlap_comm") && v.empty()) {
    if (f == "reduce_bucket_size") s.train.reduce_bucket_size.reset();  // DeepSpeedZeroConfig's default (resolve_zero)
    if (f == "overlap_comm") s.train.overlap_comm.reset();
  } else if (f == "offload") {
    // DeepSpeed ZeRO offload (zero.h resolve_zero checks the stage)
    if (v == "none" || v.empty()) {
      s.train.offload_optimizer = s.train.offload_params = false;
    } else if (v == "optimizer" || v == "params" || v == "optimizer,params" || v == "params,optimizer") {
      s.train.offload_optimizer = v.find("optimizer") != std::string_view::npos;
      s.train.offload_params = v.find("params") != std::string_view::npos;
    } else {
      throw FieldError(std::string(f), fmt::format("{}: expected none, optimizer, params or optimizer,params", v));
    }
  } else if (f == "param_persistence_threshold" || f == "prefetch_bucket_size" || f == "max_live_parameters" ||
             f == "max_reuse_distance") {
    // DeepSpeed ZeRO-3's coordinator settings, in elements; empty: DeepSpeedZeroConfig's default (resolve_zero)
    std::optional<uint64_t>& t = f == "param_persistence_threshold" ? s.train.param_persistence_threshold
                                 : f == "prefetch_bucket_size"      ? s.train.prefetch_bucket_size
                                 : f == "max_live_parameters"       ? s.train.max_live_parameters
                                                                    : s.train.max_reuse_distance;
    if (v.empty()) {
      t.reset();
    } else {
      // DeepSpeedZeroConfig: Field(..., ge=0): 0 is allowed (no prefetch, release at once, nothing persistent)
      t = v == "0" ? 0 : count(f, v, uint64_t{1} << 40);
    }
  } else if (f == "reduce_bucket_size") {
    s.train.reduce_bucket_size = count(f, v, uint64_t{1} << 40);
  } else if (f == "overlap_comm") {
    s.train.overlap_comm = boolean(f, v);
  } else if (f == "pp") {
    s.train.pp = count(f, v, kMaxRanks);
  } else if (f == "pp_schedule") {
    s.train.pp_schedule = named(f, v, parse_name<PpSchedule>(v));
  } else if (f == "micro_batches") {
    s.train.micro_batches = v.empty() ? 0 : count(f, v, kMaxPpMicroBatches);
  } else if (f == "pp_virtual_stages") {
    s.train.pp_virtual_stages = v.empty() ? 0 : count(f, v, kMaxPpVirtualStages);
  } else if (f == "rank" && v.empty()) {
    s.train.rank.reset();
  } else if (f == "rank") {
    s.train.rank = v == "0" ? 0 : count(f, v, kMaxRanks);
  } else if (f == "reshard_after_forward") {
    if (v.empty()) {
      s.train.reshard_after_forward.reset();  // accelerate's default (resolve_fsdp)
    } else {
      s.train.reshard_after_forward = boolean(f, v);
    }
  } else if (f == "fsdp1_prefetch") {
    if (v.empty() || v == "none") {
      s.train.backward_prefetch_pre = v.empty() ? std::nullopt : std::optional<bool>(false);
    } else if (v == "backward_pre") {
      s.train.backward_prefetch_pre = true;
    } else {
      throw FieldError(std::string(f), fmt::format("\"{}\": expected none or backward_pre (BACKWARD_POST is not simulated)", v));
    }
  } else if (f == "tp") {
    s.train.tp = count(f, v, kMaxRanks);
  } else if (f == "sequence_parallel") {
    s.train.sequence_parallel = boolean(f, v);
  } else if (f == "ep") {
    s.train.ep = count(f, v, kMaxRanks);
  } else if (f == "nccl_channels" && v.empty()) {
    s.train.nccl.channels.reset();  // the GPU catalog's reading
  } else if (f == "nccl_channels") {
    // MAXCHANNELS 64 (nccl src/include/device.h)
    s.train.nccl.channels = static_cast<uint32_t>(count(f, v, 64));
  } else if (f == "nccl_nvls" && v.empty()) {
    s.train.nccl.nvls.reset();
  } else if (f == "nccl_nvls") {
    s.train.nccl.nvls = boolean(f, v);
  } else if (f == "nccl_tree" && v.empty()) {
    s.train.nccl.tree.reset();
  } else if (f == "nccl_tree") {
    s.train.nccl.tree = boolean(f, v);
  } else if (f == "nccl_gdr" && v.empty()) {
    s.train.nccl.gdr.reset();
  } else if (f == "nccl_gdr") {
    s.train.nccl.gdr = boolean(f, v);
  } else if (f == "gpus_per_node") {
    s.train.nccl.gpus_per_node = count(f, v, kMaxRanks);
  } else if (f == "net_gbps" && v.empty()) {
    s.train.nccl.net_gbps.reset();  // the GPU catalog's
  } else if (f == "net_gbps") {
    const std::string expected = "a decimal bandwidth in GB/s above 0 and at most 100000, like 50 or 12.5";
    const double gbps = decimal(f, v, expected);
    if (!(gbps > 0) || gbps > 100000) bad(f, v, expected);
    s.train.nccl.net_gbps = gbps;
  } else if (f == "gpu") {
    s.train.gpu = std::string(v);
  } else if (f == "gpus" && v.empty()) {
    s.gpus.clear();  // not given (field_text's empty default)
  } else if (f == "gpus") {
    const size_t x = v.find_first_of("xX");
    const std::string expected = "N x a GPU, like 8xh100-80gb or 4x24GiB";
    if (x == std::string_view::npos || x == 0 || x + 1 == v.size()) bad(f, v, expected);
    (void)count(f, v.substr(0, x), kMaxRanks);  // the count is checked here, the GPU by resolve()
    s.gpus = std::string(v);
  } else if (f == "loop") {
    const auto k = parse_name<LoopKind>(v);
    if (!k || *k == LoopKind::kAuto) bad(f, v, "nanogpt, hf, seed000 or plain");
    s.loop = *k;
  } else if (f == "torch") {
    const auto t = parse_torch_version(v);
    if (!t) bad(f, v, "a PyTorch version from 1.13 to 2.11, like 2.9");
    s.torch = *t;
  } else if (f == "alloc_conf") {
    s.alloc_conf = std::string(v);
  } else if (f == "steps") {
    s.steps = static_cast<uint32_t>(count(f, v, kMaxSteps));
  } else {
    throw Error(fmt::format("internal: no scenario field \"{}\"", f));
  }
}

std::string field_text(const Scenario& s, std::string_view f) {
  if (f == "model") return s.model.model;
  if (f == "impl") return s.model.impl ? std::string(name_of(*s.model.impl)) : "";
  if (f == "attention") return std::string(name_of(s.model.attention));
  if (f == "moe_routing") return std::string(name_of(s.model.moe_routing));
  if (f == "moe_experts") return std::string(name_of(s.model.moe_experts));
  if (f == "head") return s.model.head ? std::string(name_of(*s.model.head)) : "";
  if (f == "num_labels") return s.model.num_labels ? std::to_string(*s.model.num_labels) : "";
  if (f == "batch") return std::to_string(s.train.batch);
  if (f == "seq") return std::to_string(s.train.seq);
  if (f == "target_seq") return std::to_string(s.train.target_seq);
  if (f == "grad_accum") return std::to_string(s.train.grad_accum);
  if (f == "precision") return std::string(name_of(s.train.precision));
  if (f == "optimizer") return std::string(name_of(s.train.optimizer));
  if (f == "optimizer_impl") return std::string(name_of(s.train.optimizer_impl));
  if (f == "optimizer_in_backward") return s.train.optimizer_in_backward ? "true" : "false";
  if (f == "optimizer_version") {
    const auto& b = s.train.optimizer_version;
    return b ? fmt::format("{}.{}", b->major, b->minor) : std::string();
  }
  if (f == "gpu") return s.train.gpu;
  if (f == "gpus") return s.gpus;
  if (f == "checkpointing") return std::string(name_of(s.train.checkpointing));
  if (f == "checkpoint_reentrant") {
    return optional_boolean_text(s.train.checkpoint_reentrant);
  }
  if (f == "checkpoint_every") return std::to_string(s.train.checkpoint_every);
  if (f == "lora_dtype") return s.train.lora.fp32 ? "fp32" : "base";
  if (f == "quantize") return std::string(name_of(s.train.quant.type));
  if (f == "double_quant") return s.train.quant.double_quant ? "true" : "false";
  if (f == "kbit_prepare") return s.train.quant.prepare ? "true" : "false";
  if (f == "compute_dtype") {
    return s.train.quant.compute == DType::kBF16 ? "bf16" : s.train.quant.compute == DType::kF16 ? "fp16" : "fp32";
  }
  if (f == "quant_storage") return s.train.quant.storage == DType::kBF16 ? "bf16" : "uint8";
  if (f == "input_require_grads") {
    return optional_boolean_text(s.train.input_require_grads);
  }
  if (f == "lora") {
    if (!s.train.lora.on) return "";
    const LoraSetup& l = s.train.lora;
    std::string t = fmt::format("r={},alpha={},dropout={}", l.r, l.alpha, l.dropout);
    for (size_t i = 0; i < l.targets.size(); ++i) t += (i ? "+" : ",targets=") + l.targets[i];
    return t;
  }
  if (f == "task") return std::string(name_of(s.train.task));
  if (f == "loss") return std::string(name_of(s.train.loss));
  if (f == "loss_chunks") return std::to_string(s.train.loss_chunks);
  if (f == "logits_to_keep") return std::to_string(s.train.logits_to_keep);
  if (f == "generate") return std::to_string(s.train.generate);
  if (f == "dp") return std::to_string(s.train.dp);
  if (f == "sharding") return std::string(name_of(s.train.sharding));
  if (f == "dp_rank") return s.train.dp_rank ? std::to_string(*s.train.dp_rank) : "";
  if (f == "dp_shard") return s.train.dp_shard ? std::to_string(*s.train.dp_shard) : "";
  if (f == "cp") return std::to_string(s.train.cp);
  if (f == "cp_rank") return s.train.cp_rank ? std::to_string(*s.train.cp_rank) : "";
  if (f == "pp") return std::to_string(s.train.pp);
  if (f == "pp_schedule") return std::string(name_of(s.train.pp_schedule));
  if (f == "micro_batches") return s.train.micro_batches ? std::to_string(s.train.micro_batches) : "";
  if (f == "rank") return s.train.rank ? std::to_string(*s.train.rank) : "";
  if (f == "pp_virtual_stages") return s.train.pp_virtual_stages ? std::to_string(s.train.pp_virtual_stages) : "";
  if (f == "bucket_cap_mb") return s.train.bucket_cap_mb ? fmt::format("{}", *s.train.bucket_cap_mb) : "";
  if (f == "gradient_as_bucket_view") {
    return optional_boolean_text(s.train.gradient_as_bucket_view);
  }
  if (f == "nccl_channels") return s.train.nccl.channels ? std::to_string(*s.train.nccl.channels) : "";
  if (f == "nccl_nvls") return optional_boolean_text(s.train.nccl.nvls);
  if (f == "nccl_tree") return optional_boolean_text(s.train.nccl.tree);
  if (f == "nccl_gdr") return optional_boolean_text(s.train.nccl.gdr);
  if (f == "gpus_per_node") return std::to_string(s.train.nccl.gpus_per_node);
  if (f == "net_gbps") return s.train.nccl.net_gbps ? fmt::format("{}", *s.train.nccl.net_gbps) : "";
  if (f == "reduce_bucket_size") return s.train.reduce_bucket_size ? std::to_string(*s.train.reduce_bucket_size) : "";
  if (f == "overlap_comm") return optional_boolean_text(s.train.overlap_comm);
  if (f == "offload") {
    const TrainSetup& t = s.train;
    return t.offload_optimizer && t.offload_params ? "optimizer,params" : t.offload_optimizer ? "optimizer"
           : t.offload_params ? "params" : "";
  }
  for (const auto& [name, v] : {std::pair{"param_persistence_threshold", &s.train.param_persistence_threshold},
                                std::pair{"prefetch_bucket_size", &s.train.prefetch_bucket_size},
                                std::pair{"max_live_parameters", &s.train.max_live_parameters},
                                std::pair{"max_reuse_distance", &s.train.max_reuse_distance}}) {
    if (f == name) return *v ? std::to_string(**v) : "";
  }
  if (f == "reshard_after_forward") {
    return optional_boolean_text(s.train.reshard_after_forward);
  }
  if (f == "fsdp1_prefetch") {
    return s.train.backward_prefetch_pre ? (*s.train.backward_prefetch_pre ? "backward_pre" : "none") : "";
  }
  if (f == "tp") return std::to_string(s.train.tp);
  if (f == "ep") return std::to_string(s.train.ep);
  if (f == "sequence_parallel") return s.train.sequence_parallel ? "true" : "false";
  if (f == "find_unused_parameters") {
    return optional_boolean_text(s.train.find_unused_parameters);
  }
  if (f == "loop") return s.loop == LoopKind::kAuto ? "" : std::string(name_of(s.loop));
  if (f == "torch") return torch_version_name(s.torch);
  if (f == "alloc_conf") return s.alloc_conf;
  if (f == "steps") return std::to_string(s.steps);
  return "";
}

Scenario with_changes(Scenario s, std::span<const FieldChange> changes) {
  for (const FieldChange& c : changes) set_field(s, c.field, c.value);
  return s;
}

Scenario scenario_from(std::span<const FieldChange> given) {
  std::set<std::string, std::less<>> names;
  for (const Field& field : kFields) names.emplace(field.name);
  for (const FieldChange& c : given) {
    if (!names.contains(c.field)) {
      const std::string nearest = config::nearest_name(c.field, names);
      throw Error(fmt::format("unknown field \"{}\"{}", c.field,
                              nearest.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", nearest)));
    }
  }
  Scenario s;
  for (const Field& field : kFields) {
    for (const FieldChange& c : given) {
      if (c.field == field.name) set_field(s, c.field, c.value);
    }
  }
  return s;
}

ResolvedScenario resolve_model(Scenario s, const FileReader& files) {
  s.train.seq = 1;
  return resolve(s, files);
}

GpuSpec resolve_gpu(std::string_view text) {
  const std::string want = lower(text);
  for (const GpuSpec& g : gpu_catalog()) {
    if (lower(g.name) == want) return g;
  }
  // A memory size with its unit ("24GiB", "80GB"), at least 1 GiB and at most 1 PiB: a bare number is more
  // likely a typo than a card, and the bounds keep every later sum within 64 bits.
  bool unit = false;
  if (const auto size = parse_size(text, &unit); size && unit) {
    if (*size >= kGiB && *size <= kGiB * 1024 * 1024) {
      // A generic card of the given size: the architecture and the context of the catalog's A100-80GB, the
      // card whose context seed 000 measured (863 MiB after the first CUDA tensor, PyTorch 2.0).
      const GpuSpec& ref = find_gpu("a100-80gb");
      GpuSpec g;
      g.name = std::string(text);
      g.torch_name = fmt::format("a generic sm_{} GPU with {} for the CUDA runtime", kGenericGpuSm,
                                 format_bytes(Bytes(*size)));
      g.sm = kGenericGpuSm;
      g.multiprocessors = ref.multiprocessors;
      g.runtime_total = Bytes(*size);
      g.smi_total = g.runtime_total;
      g.datasheet_gb = g.runtime_total.value / 1'000'000'000;
      g.context = ref.context;
      g.source = "given by size (--gpu " + std::string(text) + "): the size is taken as the CUDA runtime's total";
      g.context_source = "the A100-80GB's: " + ref.context_source;
      return g;
    }
  }
  std::string names;
  for (const GpuSpec& g : gpu_catalog()) names += (names.empty() ? "" : ", ") + g.name;
  throw FieldError("gpu", fmt::format("\"{}\": unknown GPU; expected one of {}, or a memory size from 1GiB, like 24GiB", text, names));
}

// --task inference: what a forward pass in model.eval() under torch.inference_mode() leaves out. No optimizer
// and no gradients (the optimizer field is refused unless none); dropout off (eval); and the training-only
// options refused rather than ignored. 4-bit bases are not simulated for inference yet.
void resolve_inference(const Scenario& s, ResolvedScenario& r) {
  const auto refuse = [](const char* field, const std::string& value) {
    throw FieldError(field, fmt::format("{}: a training option; --task inference runs a forward pass only", value));
  };
  if (s.was_given("optimizer") && s.train.optimizer != Optimizer::kNone) refuse("optimizer", std::string(name_of(s.train.optimizer)));
  if (s.train.checkpointing != Checkpointing::kNone) refuse("checkpointing", std::string(name_of(s.train.checkpointing)));
  if (s.train.lora.on) refuse("lora", "LoRA adapters");
  if (!s.train.freeze.empty()) refuse("freeze", s.train.freeze.front());
  if (s.train.grad_accum != 1) refuse("grad_accum", std::to_string(s.train.grad_accum));
  if (s.train.optimizer_in_backward) refuse("optimizer_in_backward", "true");
  if (s.train.loss != LossKind::kCe) refuse("loss", std::string(name_of(s.train.loss)));
  if (s.train.input_require_grads.value_or(false)) refuse("input_require_grads", "true");
  if (s.was_given("loop")) refuse("loop", std::string(name_of(s.loop)));
  if (s.train.quant.type != Quantize::kNone) {
    throw FieldError("quantize", fmt::format("{}: a 4-bit base is not simulated for inference yet",
                                             name_of(s.train.quant.type)));
  }
  if (s.train.generate > 0 && r.model.head != Head::kCausalLm) {
    // BertForMaskedLM.can_generate() is False, and a classifier has no next-token logits: an encoder or a
    // classification head runs one forward pass (--task inference without --generate)
    throw FieldError("generate", fmt::format("{}: {} with the {} head cannot generate (generate() needs a causal-LM "
                                             "head; transformers' masked-LM and classification models refuse it); "
                                             "leave --generate out for one forward pass", s.train.generate,
                                             r.model.name, head_name(r.model.head)));
  }
  if (s.train.generate > 0) {
    // GenerationMixin.generate with its default DynamicCache: what the transformers programs model.
    if (r.model.impl != Impl::kHf) {
      throw FieldError("generate", fmt::format("{}: generation is modelled for transformers' models (--impl hf); {} "
                                               "is built by {}", s.train.generate, r.model.name,
                                               impl_name(r.model.impl)));
    }
    // DynamicCache gives a sliding-window layer a DynamicSlidingWindowLayer, which keeps the last window - 1
    // tokens once the sequence reaches the window (and its mask stops being ignorable by SDPA); below the window
    // it holds what DynamicLayer holds. Past it is not simulated yet.
    const uint64_t w = r.model.attn.sliding_window;
    if (w > 0 && s.train.seq + s.train.generate - 1 >= w) {
      throw FieldError("generate", fmt::format("{}: the prompt of {} tokens and {} new ones reach {}'s sliding window "
                                               "of {} tokens, where DynamicSlidingWindowLayer starts dropping the "
                                               "oldest; that cache is not simulated yet (stay below the window)",
                                               s.train.generate, s.train.seq, s.train.generate - 1, r.model.name, w));
    }
    // generate() sets logits_to_keep=1 itself (GenerationMixin.generate, step 6)
    if (s.train.logits_to_keep != 0) {
      throw FieldError("logits_to_keep", fmt::format("{}: generate() passes logits_to_keep=1 itself; leave it out "
                                                     "with --generate", s.train.logits_to_keep));
    }
  }
  r.setup.optimizer = Optimizer::kNone;
  r.model.dropout = DropoutSpec{};  // model.eval(): every nn.Dropout is the identity
}

namespace {

// ---- context parallel (--cp N, cp.h) -----------------------------------------------------------------------
// What is simulated: one CP rank (rank 0) of torch's context_parallel under accelerate
// (Accelerator.maybe_context_parallel), the model's weights replicated (accelerate's
// ACCELERATE_ALLOW_CP_STANDALONE path, state.py), the batch's input_ids, labels and position_ids sharded to
// seq / cp tokens, SDPA's flash kernel replaced by ring attention. Everything else is refused, not guessed.
void resolve_cp(const Scenario& s, ResolvedScenario& r) {
  const uint64_t n = r.setup.cp;
  auto refuse = [&](std::string_view field, const std::string& why) {
    throw FieldError(std::string(field), fmt::format("{} with --cp {}: {}", field_text(s, field), n, why));
  };
  if (r.model.impl != Impl::kHf || r.model.model_type != "llama") {
    throw FieldError("cp", fmt::format("{}: context parallel is simulated for the Llama decoders (model_type llama) "
                                       "only; {} (model_type {}) is not", n, r.model.name, r.model.model_type));
  }
  if (r.model.attn_impl != AttnImpl::kSdpa) {
    // context_parallel replaces SDPA's kernels (_attention.py _sdpa_handler); accelerate's CP docs ask for sdpa
    refuse("attention", "context parallel shards SDPA's attention (ring attention); eager attention computes the "
                        "full (T, T) scores and is not dispatched to it");
  }
  if (s.train.task == Task::kInference) {
    refuse("task", "context parallel is simulated for training steps only");
  }
  // --sharding fsdp2: FSDP2 over the dp_shard x cp mesh (fsdp.h fsdp2_mesh_ranks), the way accelerate and
  // torchtitan run context parallel; --dp D is ParallelismConfig's dp_shard_size (dp_replicate_size 1)
  const bool fsdp2 = s.was_given("sharding") && s.train.sharding == Sharding::kFsdp2;
  if (s.was_given("sharding") && !fsdp2) {
    const Sharding sh = s.train.sharding;
    // accelerate 16cb6eb state.py: "Using `cp_size>1` requires FSDP2, but the provided `fsdp_plugin` is using
    // FSDP1"; ParallelismConfig.__post_init__: "Tensor/Context parallelism (tp/cp_size > 1) cannot be used with
    // pure data parallelism (dp_replicate_size > 1 and dp_shard_size == 1)"
    refuse("sharding", sh == Sharding::kFsdp1 ? "accelerate refuses FSDP1 with context parallel (state.py: \"Using "
                                                "`cp_size>1` requires FSDP2\"); --sharding fsdp2 is simulated"
                       : sh == Sharding::kDdp ? "accelerate runs context parallel under an FSDP2 plugin (state.py) "
                                                "and refuses it with pure data parallelism (ParallelismConfig: "
                                                "dp_replicate_size > 1 and dp_shard_size == 1); without --sharding "
                                                "the weights are replicated, --sharding fsdp2 shards them over dp x cp"
                                              : "DeepSpeed ZeRO composed with torch's context_parallel is not "
                                                "simulated; --sharding fsdp2 (FSDP2 over dp x cp) is");
  }
  if (r.setup.dp > 1 && !fsdp2) {
    // accelerate ParallelismConfig.__post_init__ refuses cp with pure data parallelism (dp_replicate_size > 1,
    // dp_shard_size == 1); what accelerate and torchtitan run is FSDP2 over dp_shard x cp
    refuse("dp", "accelerate refuses context parallel with pure data parallelism (ParallelismConfig); FSDP2 "
                 "sharded over dp x cp is simulated: add --sharding fsdp2");
  }
  // --pp P: torchtitan's 4-D layout. Its train step runs the pipeline schedule inside the context-parallel
  // context (train.py: `with self.train_context(optional_context_parallel_ctx): ... self.pp_schedule.step(...)`,
  // create_context_parallel_ctx sharding inputs and labels on the sequence dim), so every stage's SDPA is the ring
  // (the same _templated_ring_attention) on the rank's seq / N tokens, micro-batch after micro-batch. torchtitan
  // shards the model whenever CP is on (parallel_dims.py: `fsdp_enabled = dp_shard_enabled or cp_enabled`, FSDP2
  // over the flattened dp_shard x cp mesh), and its TP is TP + SP (apply_tp's SequenceParallel norms), which CP does
  // not compose with here.
  if (r.setup.pp > 1) {
    if (!fsdp2) {
      refuse("pp", "torchtitan shards the model over dp_shard x cp whenever context parallel is on (ParallelDims."
                   "fsdp_enabled: dp_shard_enabled or cp_enabled): add --sharding fsdp2");
    }
    if (r.setup.tp > 1) {
      refuse("tp", "under --pp with context parallel, torchtitan's tensor parallelism is TP + SP (apply_tp), which is "
                   "not simulated with context parallel");
    }
  }
  // --tp T (tp.h; check_tp_setup's rules, sequence parallelism refused by check_sp_setup): CP x TP as accelerate
  // runs it (16cb6eb examples/torch_native_parallelism/nd_parallel.py: ParallelismConfig(dp_shard_size, tp_size,
  // cp_size), from_pretrained(tp_plan="auto", device_mesh=accelerator.torch_device_mesh), whose "tp" dimension
  // transformers' initialize_tensor_parallelism takes: `device_mesh = device_mesh["tp"]`; _prepare_cp's
  // context_parallel(mesh=torch_device_mesh["cp"]); docs/source/concept_guides/context_parallelism.md: "Context
  // parallelism is compatible with other parallelism strategies, such as data parallelism, tensor parallelism and
  // FSDP2"). The rank's model is the TP-local one (heads / tp): q, k, v reach SDPA as plain (B, H/tp, T/cp, D)
  // tensors (transformers' tensor_parallel.py collectives are autograd Functions on local tensors), so the ring runs
  // over the local heads (cp_attention.cc takes them from the shapes) and every other op is plain TP's at seq / cp
  // tokens. The rank simulated is TP rank 0, and each CP rank in turn (estimate_cp_ranks) or --cp-rank's.
  if (r.setup.loss == LossKind::kChunked) {
    refuse("loss", "torchtune's chunked loss is not a transformers/accelerate loss; use ce or liger-fused");
  }
  if (r.setup.logits_to_keep != 0) refuse("logits_to_keep", "not simulated with context parallel");
  // accelerate state.py: cp_size > 1 without an FSDP2 plugin raises unless ACCELERATE_ALLOW_CP_STANDALONE=true;
  // its docs (concept_guides/context_parallelism.md): "context parallelism only works if you use
  // FullyShardedDataParallelPlugin ... with version set to 2"
  if (fsdp2 && r.setup.dp_shard && *r.setup.dp_shard < r.setup.dp) {
    // HSDP (fsdp.h apply_hsdp_mesh): accelerate's fsdp_dim_names ("dp_replicate", "dp_shard_cp")
    const uint64_t k = *r.setup.dp_shard;
    r.warnings.push_back(fmt::format(
        "--cp {} --sharding fsdp2 --dp-shard {}: one rank of HSDP over the (dp_replicate, dp_shard_cp) = ({}, {} x {}) "
        "mesh (accelerate's fsdp_dim_names; torchtitan's (\"dp_replicate\", \"dp_shard_cp\")){}, its activations a CP "
        "rank's (--seq / {} tokens, ring attention)", n, k, r.setup.dp / k, k, n,
        // --tp T: TP rank 0's local model (tp_plan="auto"), the tp dimension innermost in accelerate's mesh
        r.setup.tp > 1 ? fmt::format(" sharding TP rank 0's local parameters (--tp {}, tp_plan=\"auto\": the "
                                     "(dp_replicate, dp_shard, cp, tp) = ({}, {}, {}, {}) mesh, {} local heads)",
                                     r.setup.tp, r.setup.dp / k, k, n, r.setup.tp, r.model.attn.heads)
                       : std::string(),
        n));
  } else if (fsdp2 && r.setup.tp > 1) {
    // accelerate's mesh order ["dp_replicate", "dp_shard", "cp", "sp", "tp"] (ParallelismConfig._get_mesh), FSDP2
    // over mesh["dp_shard_cp"] (fsdp_dim_names; utils/fsdp_utils.py fsdp2_prepare_model) of the TP-local model
    r.warnings.push_back(fmt::format(
        "--cp {} --tp {} --sharding fsdp2: one rank (a CP rank, TP rank 0) of accelerate's (dp_shard, cp, tp) = "
        "({}, {}, {}) mesh (ParallelismConfig(dp_shard_size={}, cp_size={}, tp_size={}), {} GPUs): the TP-local "
        "parameters (tp_plan=\"auto\") sharded by FSDP2 over the flattened \"dp_shard_cp\" mesh ({} ranks), its "
        "activations --seq / {} tokens with ring attention over the {} local heads",
        n, r.setup.tp, r.setup.dp, n, r.setup.tp, r.setup.dp, n, r.setup.tp,
        checked_mul(checked_mul(r.setup.dp, n, "dp x cp"), r.setup.tp, "dp x cp x tp"),
        checked_mul(r.setup.dp, n, "dp x cp"), n, r.model.attn.heads));
  } else if (fsdp2 && r.setup.pp > 1) {
    r.warnings.push_back(fmt::format(
        "--cp {} --pp {} --sharding fsdp2: simulated as torchtitan's layout of context_parallel around the pipeline "
        "schedule (every stage's SDPA the ring, at --seq / {} tokens) and apply_fsdp on each stage over the "
        "flattened dp_shard x cp mesh ({} x {} = {} ranks)",
        n, r.setup.pp, n, r.setup.dp, n, checked_mul(r.setup.dp, n, "dp x cp")));
  } else if (fsdp2) {
    r.warnings.push_back(fmt::format(
        "--cp {} --sharding fsdp2: one rank of FSDP2 over the flattened dp_shard x cp mesh ({} x {} = {} ranks: "
        "accelerate's \"dp_shard_cp\", torchtitan's resolve_fsdp_mesh), its activations a CP rank's (--seq / {} "
        "tokens, ring attention)", n, r.setup.dp, n, checked_mul(r.setup.dp, n, "dp x cp"), n));
  } else if (r.setup.tp > 1) {
    r.warnings.push_back(fmt::format(
        "--cp {} --tp {}: one rank (a CP rank, TP rank 0) of a (cp, tp) = ({}, {}) mesh ({} GPUs): the TP-local "
        "parameters (tp_plan=\"auto\") whole on every CP rank (accelerate's ACCELERATE_ALLOW_CP_STANDALONE=true "
        "path), its activations --seq / {} tokens with ring attention over the {} local heads; accelerate shards "
        "the parameters with FSDP2 over dp_shard x cp: --sharding fsdp2",
        n, r.setup.tp, n, r.setup.tp, n * r.setup.tp, n, r.model.attn.heads));
  } else {
    r.warnings.push_back("--cp: the weights, gradients and optimizer state are simulated whole on every CP rank "
                         "(accelerate's ACCELERATE_ALLOW_CP_STANDALONE=true path); accelerate and torchtitan shard "
                         "them with FSDP2 over dp_shard x cp: --sharding fsdp2");
  }
  try {
    r.setup.cp_seq = r.setup.seq;
    r.setup.seq = cp_local_seq(r.setup.seq, n);
  } catch (const Error& e) {
    throw FieldError("seq", e.what());
  }
}

}  // namespace

// What --sequence-parallel true composes with (sp.h): FSDP2 data parallelism and pipeline stages (torchtitan's 2-D
// and 3-D meshes; no context or expert ranks), training, every position's logits, no selective checkpointing; the
// model's own limits in sp_check.
void check_sp_setup(const Scenario& s, ResolvedScenario& r) {
  const TrainSetup& t = s.train;
  auto refuse = [&](const char* field, const std::string& why) {
    throw FieldError(field, fmt::format("{}: not simulated with --sequence-parallel true ({})", field_text(s, field), why));
  };
  // --dp D: check_tp_setup refused every sharding but fsdp2, which is torchtitan's apply_fsdp over the TP-local
  // model on the dp dimension of its (dp_shard, tp) mesh (fsdp.h resolve_sp_fsdp); DDP, FSDP1 and ZeRO are not
  // simulated over it
  // --pp P: torchtitan's 3-D layout, its pipeline stages over the TP + SP model (pp.h; the stages exchange the
  // residual stream's (B, T/tp, C) shards), with FSDP2 over dp its apply_fsdp on each stage (resolve_pp_fsdp)
  if (t.cp > 1) refuse("cp", "context parallelism shares the sequence dimension with it and is not simulated with it");
  if (t.ep > 1) refuse("ep", "expert parallelism's plan has no sequence-parallel form here");
  if (t.task != Task::kTrain) refuse("task", "the simulated program is torchtitan's training step");
  if (r.setup.checkpointing == Checkpointing::kSelective) {
    refuse("checkpointing", "torchtitan's selective policy saves the reduce-scatter outputs (_c10d_functional."
                            "reduce_scatter_tensor in its save list), which is not simulated; none and full are");
  }
  if (t.logits_to_keep != 0) refuse("logits_to_keep", "the lm_head's gathered input is the whole sequence");
  try {
    sp_check(r.model, t.tp, r.setup.seq);
  } catch (const Error& e) {
    throw FieldError("sequence_parallel", fmt::format("true: {}", e.what()));
  }
  r.warnings.push_back(fmt::format(
      "--sequence-parallel: simulated as PyTorch-native TP + SP with torchtitan's plan on transformers' modules "
      "(SequenceParallel norms, PrepareModuleInput all-gathers, Shard(1) reduce-scattered o_proj/down_proj, "
      "vocabulary-parallel embed_tokens, lm_head's Shard(-1) logits) and torchtitan's cross_entropy_loss under "
      "loss_parallel, inside trainmem's transformers training step ({}optimizer, loop); Megatron-LM's SP "
      "is not simulated", uses_autocast(r.setup.precision) ? "autocast, " : ""));
  if (torchtitan_fsdp2(r.setup)) {
    const uint64_t k = hsdp_shard_degree(r.setup);
    const std::string mesh = k ? fmt::format("its (dp_replicate, dp_shard, tp) = ({}, {}, {}) mesh", r.setup.dp / k, k, t.tp)
                               : fmt::format("its (dp_shard, tp) = ({}, {}) mesh", r.setup.dp, t.tp);
    if (r.setup.pp > 1) {
      // the pipeline stage's FSDP2 is resolve_pp_fsdp's: reshard_after_forward false, no gradient sync until each
      // stage's last micro-batch backward (stage.py backward_maybe_with_nosync)
      r.warnings.push_back(fmt::format(
          "--tp {} --sequence-parallel true --pp {} with --sharding fsdp2: simulated as torchtitan's 3-D layout "
          "(apply_non_moe_tp, then apply_fsdp on each pipeline stage over the {} data-parallel ranks of {}: fp32 shards "
          "of the TP-local parameters, bf16 all-gathers kept across micro-batches, fp32 reduce-scatters after each "
          "stage's last backward, no autocast)", t.tp, r.setup.pp, r.setup.dp, mesh));
    } else {
      r.warnings.push_back(fmt::format(
          "--tp {} --sequence-parallel true with --sharding fsdp2: simulated as torchtitan's parallelize_hf_transformers "
          "(apply_non_moe_tp, then apply_fsdp over the {} data-parallel ranks of {}: fp32 shards of the TP-local "
          "parameters, bf16 all-gathers, fp32 reduce-scatters, no autocast, no no_sync under gradient accumulation)",
          t.tp, r.setup.dp, mesh));
    }
  }
}

// What --tp and --sequence-parallel compose with so far (tp.h); everything else is refused, said why.
void check_tp_setup(const Scenario& s, const ResolvedScenario& r) {
  const TrainSetup& t = s.train;
  if (t.sequence_parallel && t.tp <= 1) {
    throw FieldError("sequence_parallel", "true: sequence parallelism shards the sequence over the tensor-parallel "
                                          "ranks; it applies with --tp above 1");
  }
  if (s.was_given("sequence_parallel") && t.tp <= 1) {
    throw FieldError("sequence_parallel", "false: a tensor-parallel setting; it applies with --tp above 1");
  }
  if (t.tp <= 1) return;
  auto refuse = [&](const char* field, const std::string& why) {
    throw FieldError(field, fmt::format("{}: not simulated with --tp {} ({})", field_text(s, field), t.tp, why));
  };
  // --sharding fsdp2: FSDP2 over the TP-local model (fsdp.cc resolve_fsdp). DDP over it is what neither framework
  // runs: accelerate's ParallelismConfig.__post_init__ raises "Tensor/Context parallelism (tp/cp_size > 1) cannot
  // be used with pure data parallelism (dp_replicate_size > 1 and dp_shard_size == 1)", torchtitan's
  // parallelize_llama "DDP has not supported > 1D parallelism". FSDP1 and ZeRO over it are not simulated.
  if (r.setup.dp > 1 && t.sharding != Sharding::kFsdp2) {
    const bool gpus = !s.gpus.empty();
    const std::string why =
        t.sharding == Sharding::kDdp
            ? "replicated by DDP: accelerate refuses tensor parallelism with pure data parallelism (ParallelismConfig: "
              "\"cannot be used with pure data parallelism\") and torchtitan DDP with any other parallelism (\"DDP has "
              "not supported > 1D parallelism\"); both shard instead"
            : fmt::format("; tensor parallelism composed with data parallelism by {} over the TP-local model is not "
                          "simulated yet; what is",
                          name_of(t.sharding));
    throw FieldError(gpus ? "gpus" : "dp",
                     fmt::format("{}: {} data-parallel ranks of --tp {} GPUs each{}{}: --sharding fsdp2 ({})",
                                 gpus ? s.gpus : std::to_string(r.setup.dp), r.setup.dp, t.tp,
                                 t.sharding == Sharding::kDdp ? ", " : "", why,
                                 t.sequence_parallel ? "torchtitan's apply_fsdp over its TP + SP plan"
                                                     : "accelerate's ParallelismConfig(tp_size, dp_shard_size)"));
  }
  if (t.lora.on) refuse("lora", "PEFT's adapters on tensor-parallel linears were not read");
  if (t.quant.type != Quantize::kNone) refuse("quantize", "4-bit bases under tensor parallelism were not read");
  if (t.loss != LossKind::kCe) refuse("loss", "the plan's lm_head gathers the whole logits for transformers' loss");
  if (t.generate > 0) refuse("generate", "generation under tensor parallelism was not validated");
}

// What --ep composes with (ep.h): --tp equal to it (or not given: set to it), the rest of check_tp_setup's rules,
// and the eager experts only.
void check_ep_setup(const Scenario& s, const ResolvedScenario& r) {
  if (s.train.ep <= 1) return;
  if (r.model.moe.impl == MoeExperts::kGroupedMm) {
    throw FieldError("moe_experts", fmt::format("grouped_mm: not simulated with --ep {} (how grouped_mm_experts_forward "
                                                "handles the ep_router's sentinel index num_experts was not read); "
                                                "use --moe-experts eager", s.train.ep));
  }
  if (s.train.task == Task::kInference) {
    throw FieldError("task", fmt::format("inference: not simulated with --ep {} (the expert-parallel forward was "
                                         "validated in training only)", s.train.ep));
  }
  if (s.train.pp > 1) {
    throw FieldError("pp", fmt::format("{}: pipeline stages with --ep {} are not simulated (transformers' expert "
                                       "parallel plan inside torch.distributed.pipelining stages was not read)",
                                       s.train.pp, s.train.ep));
  }
}

ResolvedScenario resolve(const Scenario& s, const FileReader& files) {
  if (s.train.ep > 1 && s.train.tp != s.train.ep) {
    // docs/source/en/expert_parallelism.md: "The current all-reduce implementation requires ep_size=tp_size"; model
    // loading "rejects enabled EP layouts with ep_size != tp_size because all-reduce requires identical tokens
    // within each expert group". --ep N is DistributedConfig(tp_size=N, ep_size=N).
    if (s.was_given("tp") && s.train.tp > 1) {
      throw FieldError("ep", fmt::format("{}: with --tp {}: transformers requires ep_size = tp_size (the experts' "
                                         "outputs are all-reduced over the TP group, whose ranks share the tokens); "
                                         "give --ep alone, or --tp {}", s.train.ep, s.train.tp, s.train.ep));
    }
    Scenario with_tp = s;
    with_tp.train.tp = s.train.ep;
    return resolve(with_tp, files);
  }
  ResolvedScenario r;
  r.request = s;
  r.model = load_model(s.model, files, &r.warnings);  // a shape key missing from the config is said, not silent
  if (r.model.family == Family::kT5 && s.was_given("attention") && s.model.attention == AttnImpl::kSdpa) {
    throw FieldError("attention", fmt::format("sdpa: {} is simulated on T5Attention's own eager path (matmul, "
                                              "position bias, softmax); T5's SDPA path (transformers PR #47014, "
                                              "the attention interface) is not simulated yet", r.model.name));
  }
  if (r.model.moe.experts > 0 && !s.was_given("moe_experts")) {
    // transformers 5.x PreTrainedModel.get_correct_experts_implementation: `"grouped_mm" if requested_experts is
    // None` (falling back to eager only when _grouped_mm_can_dispatch fails); trainmem's default is the eager loop
    // (MixtralExperts.forward), whose memory differs: said, not silent.
    r.warnings.push_back(
        "the experts are simulated as transformers' eager loop (experts_implementation=\"eager\"); transformers "
        "5.x picks grouped_mm when none is given: --moe-experts grouped_mm simulates that one");
  }
  // Tensor parallelism (tp.h): the model becomes one rank's local model before its inventory is built
  if (s.train.tp > 1) {
    try {
      if (s.train.ep > 1) {
        apply_expert_parallel(r.model, s.train.ep);  // the attention's TP plan and the experts' ep_plan (ep.h)
      } else {
        apply_tensor_parallel(r.model, s.train.tp);
        r.model.sp = s.train.sequence_parallel;  // sequence parallelism (sp.h): the embedding's V/tp rows
      }
    } catch (const FieldError&) {
      throw;
    } catch (const Error& e) {
      throw FieldError(s.train.ep > 1 ? "ep" : "tp", e.what());
    }
  }
  r.inventory = build_inventory(r.model);
  mark_tp_shards(r.model, r.inventory);
  mark_ep_shards(r.model, r.inventory);
  r.setup = s.train;
  std::string gpu_text = s.train.gpu;  // --gpu, or the GPU of --gpus
  if (!s.gpus.empty()) {
    // "8xh100-80gb": set_field checked the form and the count
    const size_t x = s.gpus.find_first_of("xX");
    uint64_t n = std::stoull(s.gpus.substr(0, x));
    const std::string name = s.gpus.substr(x + 1);
    // the GPUs are dp x tp x pp ranks: tensor-parallel groups of tp GPUs, pipeline ranks of pp such groups
    if (s.train.tp > 1 && n % s.train.tp != 0) {
      throw FieldError("gpus", fmt::format("{}: {} GPUs do not divide into --tp {} ranks", s.gpus, n, s.train.tp));
    }
    n /= s.train.tp;
    const uint64_t pp = std::max<uint64_t>(s.train.pp, 1);
    if (n % pp != 0) {
      throw FieldError("gpus", fmt::format("{}: {} GPUs do not divide into --pp {} pipeline ranks", s.gpus, n * s.train.tp, pp));
    }
    n /= pp;
    // --cp: context-parallel groups of cp GPUs (cp.h); dp = N / (tp x pp x cp)
    if (s.train.cp > 1 && n % s.train.cp != 0) {
      throw FieldError("gpus", fmt::format("{}: {} GPUs / (tp {} x pp {}) = {} do not divide into --cp {} ranks", s.gpus,
                                           n * s.train.tp * pp, s.train.tp, pp, n, s.train.cp));
    }
    n /= s.train.cp;
    if (s.was_given("dp") && s.train.dp != n) {
      // (each factor divides the --gpus count, checked above: the products stay below it)
      const uint64_t group = s.train.tp * pp * std::max<uint64_t>(s.train.cp, 1);
      throw FieldError("gpus", fmt::format("{}: {} GPUs make {} data-parallel ranks of tp x pp x cp = {} x {} x {} "
                                           "GPUs, but --dp {}; give one of the two",
                                           s.gpus, n * group, n, s.train.tp, pp, std::max<uint64_t>(s.train.cp, 1),
                                           s.train.dp));
    }
    if (!s.train.gpu.empty() && lower(s.train.gpu) != lower(name)) {
      throw FieldError("gpus", fmt::format("{}: --gpu {} names another GPU; give one of the two", s.gpus, s.train.gpu));
    }
    r.setup.dp = n;
    gpu_text = name;
  }
  if (s.train.generate > 0 && s.train.task != Task::kInference) {
    throw FieldError("generate", fmt::format("{}: generation runs the model for inference; add --task inference",
                                             s.train.generate));
  }
  validate_setup(r.model, r.setup);
  check_tp_setup(s, r);
  if (s.train.sequence_parallel) check_sp_setup(s, r);  // sp.h
  // (under --pp the FSDP2 policy is torchtitan's apply_fsdp on the stage: resolve_pp_fsdp, no such choice)
  // (SP: check_sp_setup; with --cp the mesh is (dp_shard, cp, tp): resolve_cp's warning says it)
  if (r.setup.dp > 1 && s.train.tp > 1 && r.setup.pp <= 1 && !s.train.sequence_parallel && r.setup.cp <= 1) {
    // transformers' own DistributedConfig(tp_size, fsdp_size) path (distributed/fsdp.py
    // apply_fully_sharded_data_parallelism) shards at from_pretrained with MixedPrecisionPolicy(param_dtype=bf16,
    // reduce_dtype=float32) only when fsdp_mixed_precision, and without accelerate's fp32 upcast; accelerate's
    // fsdp2_prepare_model then returns the model as it is (is_type_fsdp)
    // under HSDP (--dp-shard K) the config is ParallelismConfig(dp_replicate_size=dp/K, dp_shard_size=K, tp_size=T)
    const uint64_t k = hsdp_shard_degree(r.setup);
    const std::string mesh = k > 0 ? fmt::format("dp_replicate_size={}, dp_shard_size={}", r.setup.dp / k, k)
                                   : fmt::format("dp_shard_size={}", r.setup.dp);
    r.warnings.push_back(fmt::format("--tp {} with --sharding fsdp2: simulated as accelerate's ND-parallel path "
                                     "(ParallelismConfig({}, tp_size={}), fsdp2_prepare_model: fp32 shards, "
                                     "bf16 gathers and reduce-scatters); transformers' DistributedConfig(tp_size, "
                                     "fsdp_size) applies its own fully_shard (no fp32 upcast, float32 reduce-scatters) "
                                     "and is not simulated", s.train.tp, mesh, s.train.tp));
  }
  check_ep_setup(s, r);
  if (r.model.moe.experts > 0 && r.model.moe.impl == MoeExperts::kGroupedMm && uses_autocast(r.setup.precision)) {
    // whether autocast casts torch._grouped_mm's operands (and which dtypes its CUDA kernel takes) is not
    // established from a source here: refused rather than guessed
    throw FieldError("moe_experts", fmt::format("grouped_mm: not simulated under autocast (--precision {}); use "
                                                "fp32, fp16 or bf16 weights, or --moe-experts eager",
                                                name_of(r.setup.precision)));
  }
  if (s.train.task == Task::kInference) resolve_inference(s, r);
  if (r.setup.cp > 1) resolve_cp(s, r);  // --cp N: the rank's sequence (cp.h)
  // (--cp-rank: validate_setup)
  // The data-parallel settings shape a rank's buckets: with one process there are none, so a setting given
  // without --dp above 1 would change nothing (refused, not ignored)
  if (r.setup.dp <= 1) {
    const TrainSetup& t = s.train;
    for (std::string_view f : {"sharding", "dp_rank", "dp_shard", "bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters"}) {
      // (an empty value given to an optional setting means "not given": what the loop passes; --cp N with
      // --sharding fsdp2 shards over the CP ranks: resolve_cp checked it)
      const bool set = f == "sharding"                  ? s.was_given(f) && r.setup.cp <= 1
                       : f == "dp_rank"                 ? t.dp_rank.has_value()
                       : f == "dp_shard"                ? t.dp_shard.has_value()
                       : f == "bucket_cap_mb"           ? t.bucket_cap_mb.has_value()
                       : f == "gradient_as_bucket_view" ? t.gradient_as_bucket_view.has_value()
                                                        : t.find_unused_parameters.has_value();
      if (set) {
        throw FieldError(std::string(f), fmt::format("{}: a data-parallel setting; it applies with --dp above 1",
                                                     field_text(s, f)));
      }
    }
  } else if (s.train.dp_shard && s.train.sharding != Sharding::kFsdp2) {
    // HSDP is fully_shard over a 2-D mesh (fsdp.h apply_hsdp_mesh); the other shardings take no shard degree
    throw FieldError("dp_shard", fmt::format("{}: HSDP's shard degree; it applies with --sharding fsdp2 (--sharding is {})",
                                             *s.train.dp_shard, name_of(s.train.sharding)));
  } else if (s.train.dp_rank && *s.train.dp_rank >= r.setup.dp) {
    throw FieldError("dp_rank", fmt::format("{}: the data-parallel group has ranks 0 to {}", *s.train.dp_rank,
                                            r.setup.dp - 1));
  }
  // Pipeline parallelism (pp.h): its settings apply with --pp above 1 (refused, not ignored, otherwise);
  // n_microbatches defaults to the stages (the fewest PipelineScheduleSingle accepts)
  if (r.setup.pp <= 1) {
    for (std::string_view f : {"pp_schedule", "micro_batches", "rank", "pp_virtual_stages"}) {
      if (s.was_given(f) && !field_text(s, f).empty()) {
        throw FieldError(std::string(f), fmt::format("{}: a pipeline setting; it applies with --pp above 1", field_text(s, f)));
      }
    }
  } else {
    if (r.setup.micro_batches == 0) r.setup.micro_batches = r.setup.pp;
    // torchtitan _get_pipeline_metadata without pipeline_parallel_layers_per_stage: "stages_per_rank = 1 if
    // is_single_stage_schedule else 2"
    if (r.setup.pp_virtual_stages == 0) {
      r.setup.pp_virtual_stages = r.setup.pp_schedule == PpSchedule::kInterleaved1f1b ? 2 : 1;
    }
  }
  // A bitsandbytes 4-bit base: the Linear weights packed, their quantization state as extra rows.
  if (s.train.quant.type == Quantize::kInt8) {
    throw FieldError("quantize", "int8: LLM.int8 (Linear8bitLt) bases are not simulated yet; nf4 or fp4 are");
  }
  if (s.train.quant.type != Quantize::kNone) {
    if (r.model.family == Family::kGpt2 && r.model.impl == Impl::kHf) {
      throw FieldError("quantize", fmt::format("{}: a 4-bit GPT-2 (transformers' Conv1D layers) is not simulated "
                                               "yet", name_of(s.train.quant.type)));
    }
    if (input_kind(r.model) != InputKind::kTokenIds) {
      throw FieldError("quantize", fmt::format("{}: a layer stack is not a transformers model", name_of(s.train.quant.type)));
    }
    quantize_4bit_rows(r.inventory, s.train.quant.double_quant, s.train.quant.storage);
    if (s.train.quant.prepare) {
      // prepare_model_for_kbit_training: every parameter frozen; each 16-bit one that is not Params4bit cast to
      // float32 (embeddings, norms, lm_head); gradient checkpointing, reentrant ({} kwargs: torch's default in
      // every transformers version), with enable_input_require_grads
      for (TensorRow& row : r.inventory.parameters) {
        row.trainable = false;
        if (!row.packed_4bit) row.fp32 = true;
      }
      if (!s.was_given("checkpointing")) r.setup.checkpointing = Checkpointing::kFull;
      if (!s.was_given("checkpoint_reentrant")) r.setup.checkpoint_reentrant = true;
      if (!s.was_given("input_require_grads")) r.setup.input_require_grads = true;
    }
  }
  // PEFT LoRA: adapter rows after each targeted Linear, every base row frozen.
  if (s.train.lora.on) {
    LoraSetup& l = r.setup.lora;
    const FamilyDescriptor& fam = family_descriptor(r.model.family);
    // peft utils/constants.py@00073fe TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has the family's
    // defaults for mixtral but no entry for qwen2_moe, qwen3_moe, starcoder2 or deepseek_v3: PEFT asks for
    // target_modules there.
    const bool peft_has_no_default = r.model.model_type == "qwen2_moe" || r.model.model_type == "qwen3_moe" ||
                                     r.model.model_type == "starcoder2" || r.model.model_type == "deepseek_v3";
    if (l.targets.empty() && !peft_has_no_default) {
      for (std::string_view t : fam.lora_targets) l.targets.emplace_back(t);
    }
    if (l.targets.empty()) {
      throw FieldError("lora", fmt::format("targets: PEFT has no default target modules for {} (model_type {}); "
                                           "name them, like targets=all-linear", r.model.name, r.model.model_type));
    }
    const bool conv1d = r.model.family == Family::kGpt2 && r.model.impl == Impl::kHf;  // transformers' Conv1D
    if (add_lora_rows(r.inventory, l.r, l.targets, l.fp32, conv1d) == 0) {
      std::string names;
      for (const std::string& t : l.targets) names += (names.empty() ? "" : ",") + t;
      throw FieldError("lora", fmt::format("targets={}: no Linear of {} is named so (trainmem params lists the "
                                           "modules)", names, r.model.name));
    }
  }
  if (!r.setup.input_require_grads) {
    r.setup.input_require_grads = s.train.lora.on && s.train.checkpointing != Checkpointing::kNone;
  }
  // Frozen rows (requires_grad_(False)): each glob must name something, and something must stay trainable.
  for (const std::string& glob : s.train.freeze) {
    bool any = false;
    for (TensorRow& row : r.inventory.parameters) {
      if (glob_match(glob, row.name)) {
        row.trainable = false;
        any = true;
      }
    }
    if (!any) {
      throw FieldError("freeze", fmt::format("\"{}\": matches no parameter of {} (trainmem params lists their names)",
                                             glob, r.model.name));
    }
  }
  if (trainable_rows(r.inventory) == 0) {
    if (s.train.quant.type != Quantize::kNone) {
      throw FieldError("quantize", fmt::format("{}: a quantized base is frozen (prepare_model_for_kbit_training, "
                                               "Params4bit): add adapters to train, like --lora r=16",
                                               name_of(s.train.quant.type)));
    }
    throw FieldError("freeze", "froze every parameter: nothing is left to train (loss.backward() would fail)");
  }
  if (r.setup.checkpointing == Checkpointing::kSelective) {
    // bitsandbytes' 4-bit matmul runs its own dequantize and matmul ops, which the policy is not modelled for
    if (s.train.quant.type != Quantize::kNone) {
      throw FieldError("checkpointing", fmt::format("selective: not modelled with --quantize {} (use full)",
                                                    name_of(s.train.quant.type)));
    }
    // create_selective_checkpoint_contexts works through the non-reentrant checkpoint's context_fn only
    // (torch/utils/checkpoint.py: "Passing context_fn or debug is only supported when use_reentrant=False");
    // torchtitan's SelectiveAC wraps with checkpoint_wrapper's default CheckpointImpl.NO_REENTRANT.
    if (r.setup.checkpoint_reentrant.value_or(false)) {
      throw FieldError("checkpoint_reentrant", "true: selective checkpointing needs use_reentrant=False "
                                               "(torch.utils.checkpoint takes context_fn only without reentrancy)");
    }
    r.setup.checkpoint_reentrant = false;
  }
  check_loss(r.model, r.setup);
  if (!r.setup.checkpoint_reentrant) r.setup.checkpoint_reentrant = default_checkpoint_reentrant(r.model.impl);
  // The optimizer code path that runs (fused for nanoGPT's AdamW, foreach for torch.optim on CUDA).
  r.setup.optimizer_impl = resolve_optimizer_impl(r.setup.optimizer, s.train.optimizer_impl, r.model.impl);
  // --pp, and FSDP2 over the TP + SP model: torchtitan's trainer runs the step, and its optimizer's implementation
  // defaults to "fused" (components/optimizer/optimizer.py OptimizersContainer.Config)
  if ((r.setup.pp > 1 || torchtitan_fsdp2(r.setup)) && s.train.optimizer_impl == OptimizerImpl::kAuto && is_torch_optim(r.setup.optimizer)) {
    r.setup.optimizer_impl = OptimizerImpl::kFused;
  }
  // torch.optim.Adafactor first ships in torch 2.5 (torch/optim/_adafactor.py; torch/optim/__init__.py
  // exports Adafactor from 2.5 on): an older torch has no such optimizer to model.
  if (s.train.optimizer == Optimizer::kAdafactorTorch && s.torch < TorchVersion{2, 5}) {
    throw FieldError("optimizer", fmt::format("adafactor-torch: torch.optim.Adafactor exists from torch 2.5 on, and "
                                              "--torch is {}; use --torch 2.5 or later, or transformers' adafactor",
                                              torch_version_name(s.torch)));
  }
  r.options.loop = s.loop == LoopKind::kAuto ? default_loop(r.model) : s.loop;
  if ((s.train.loss != LossKind::kCe || s.train.logits_to_keep) && r.options.loop != LoopKind::kHf &&
      r.options.loop != LoopKind::kPlain) {
    // nanoGPT's scripts call the model without labels and compute their own loss from whole logits; the
    // Trainer and a plain `model(**batch).loss.backward()` take the model's (or the recipe's) loss
    throw FieldError(s.train.loss != LossKind::kCe ? "loss" : "logits_to_keep",
                     fmt::format("needs the transformers training loop (--loop hf) or a plain one (--loop plain), "
                                 "not --loop {}", name_of(r.options.loop)));
  }
  r.options.torch = s.torch;
  if (s.train.optimizer_in_backward) {
    // Tensor.register_post_accumulate_grad_hook, which torchtune's register_optim_in_bwd_hooks uses, exists
    // from torch 2.1 on; and the recipe refuses clip_grad_norm with optimizer_in_bwd (no full set of
    // gradients ever exists), which the nanoGPT and Trainer loops apply: only the plain loop runs it.
    if (s.torch < TorchVersion{2, 1}) {
      throw FieldError("optimizer_in_backward", fmt::format("true: Tensor.register_post_accumulate_grad_hook "
                                                            "exists from torch 2.1 on, and --torch is {}",
                                                            torch_version_name(s.torch)));
    }
    if (r.options.loop != LoopKind::kPlain) {
      throw FieldError("optimizer_in_backward", fmt::format("true: the {} loop clips gradients (clip_grad_norm_ "
                                                            "1.0), which needs every gradient at once; torchtune "
                                                            "refuses clipping with optimizer-in-backward: use "
                                                            "--loop plain", loop_name(r.options.loop)));
    }
  }
  r.options.steps = s.steps;
  if (!gpu_text.empty()) {
    try {
      r.gpu = resolve_gpu(gpu_text);
    } catch (const FieldError& e) {
      if (s.gpus.empty()) throw;
      throw FieldError("gpus", fmt::format("{}: {}", s.gpus, e.detail()));
    }
    r.setup.gpu = r.gpu->name;
    r.options.sm = r.gpu->sm;  // the device decides the kernels (SDPA backends, cuBLAS workspace size)
    r.options.multiprocessors = r.gpu->multiprocessors;  // and the reductions' staging buffers (cuda_reduce.h)
    if (r.gpu->sm < 80 && compute_dtype(r.setup.precision) == DType::kBF16 && r.model.attn_impl == AttnImpl::kSdpa) {
      r.warnings.push_back(fmt::format(
          "the {} (sm_{}) has no bfloat16 tensor cores: scaled_dot_product_attention falls back to its math "
          "kernel, which keeps the attention probabilities, so this step needs more memory here than on a newer "
          "card; fp16 (--precision fp16-amp) uses the memory-efficient kernel on it",
          r.gpu->name, r.gpu->sm));
    }
  }
  r.alloc = parse_alloc_conf(s.alloc_conf, s.torch);
  return r;
}

ResolvedScenario resolve(const Scenario& s) { return resolve(s, DiskFileReader()); }

}  // namespace trainmem
