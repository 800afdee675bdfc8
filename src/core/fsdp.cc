// FSDP2's shard arithmetic and accelerate's wrapping policy, per rank (fsdp.h). Sources: pytorch/pytorch
// torch/distributed/fsdp/_fully_shard/ (_fsdp_param.py FSDPParam._init_sharded_param, _fsdp_common.py
// _chunk_with_empty and _get_dim0_padded_size, _fsdp_collectives.py foreach_all_gather and foreach_reduce,
// _fsdp_param_group.py, _fsdp_state.py; read at pytorch main 2026 commits 010ae4a / 002a76f / 01c9f4f: the 2.9
// code has the same buffers), huggingface/accelerate 16cb6eb (1.15.0.dev0) src/accelerate/utils/fsdp_utils.py
// fsdp2_prepare_model and utils/dataclasses.py FullyShardedDataParallelPlugin.
#include "trainmem/fsdp.h"

#include <fmt/format.h>

#include <algorithm>

#include "../families/registry.h"
#include "trainmem/error.h"
#include "trainmem/model.h"
#include "trainmem/pp.h"
#include "trainmem/sim.h"

namespace trainmem {

// What both FSDP versions refuse alike under accelerate (fsdp1.h, resolve_fsdp); `v` is "FSDP2" or "FSDP1", `flag`
// "fsdp2" or "fsdp1", `wrapper` what that sharding runs.
void refuse_under_accelerate_fsdp(const TrainSetup& s, const ModelSpec& m, const char* v, const char* flag,
                                  const char* wrapper) {
  const auto refuse = [](const char* field, const std::string& what) { throw FieldError(field, what); };
  if (m.family != Family::kLlama || m.impl != Impl::kHf) {
    refuse("sharding", fmt::format("{}: simulated for the llama family's transformers models (llama, mistral, "
                                   "qwen2, ...); {} ({}) has no FSDP unit hooks yet", flag, m.model_type,
                                   family_descriptor(m.family).name));
  }
  if (m.head != Head::kCausalLm) refuse("head", fmt::format("{} is simulated for the causal-LM head only", v));
  if (s.optimizer != Optimizer::kAdamW && s.optimizer != Optimizer::kAdam) {
    refuse("optimizer", fmt::format("{}: {} is simulated with torch AdamW/Adam over the sharded parameters",
                                    name_of(s.optimizer), v));
  }
  if (s.optimizer_in_backward) refuse("optimizer_in_backward", fmt::format("true: not simulated under {}", v));
  // (FSDP2 takes a 4-bit base: resolve_fsdp)
  if (s.quant.type != Quantize::kNone && std::string_view(v) != "FSDP2") {
    refuse("quantize", fmt::format("quantized base weights are not simulated under {} (they are under --sharding "
                                   "fsdp2)", v));
  }
  // (FSDP2 takes frozen rows as it takes LoRA's frozen base: in their units, all-gathered, never reduce-scattered)
  if (!s.freeze.empty() && std::string_view(v) != "FSDP2") {
    refuse("freeze", fmt::format("frozen parameters are not simulated under {} (they are under --sharding fsdp2)", v));
  }
  const auto not_ddp = [&](const char* field) {
    refuse(field, fmt::format("a DDP setting; --sharding {} runs {}, which builds no DDP Reducer", flag, wrapper));
  };
  if (s.bucket_cap_mb) not_ddp("bucket_cap_mb");
  if (s.gradient_as_bucket_view) not_ddp("gradient_as_bucket_view");
  if (s.find_unused_parameters) not_ddp("find_unused_parameters");
}

FsdpDtypes accelerate_fsdp_dtypes(Precision p, const char* v) {
  FsdpDtypes d;
  switch (p) {
    case Precision::kBf16Amp:
      // The Trainer's bf16=True is accelerate's mixed_precision "bf16": fsdp2_prepare_model upcasts every trainable
      // parameter to float32 ("Upcast to fp32 master weights; MixedPrecisionPolicy.param_dtype handles compute
      // cast"), and FullyShardedDataParallelPlugin.set_mixed_precision builds MixedPrecisionPolicy(param_dtype=bf16,
      // reduce_dtype=bf16, output_dtype=bf16). FSDP1's Accelerator.prepare_model still wraps forward in autocast
      // (native_amp); FSDP2's _prepare_fsdp2 never calls prepare_model, so no autocast there (loop.cc).
      // (FSDP1: MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16) and prepare_model's upcast of
      // every low-precision FlatParameter, fsdp1.cc.)
      d.orig = DType::kF32;
      d.mixed = true;
      d.param = DType::kBF16;
      d.reduce = DType::kBF16;
      break;
    case Precision::kFp32:
    case Precision::kBf16:
      // mixed_precision "no": MixedPrecisionPolicy() (all None); the parameters stay in the model's dtype
      d.orig = param_dtype(p);
      d.param = d.orig;
      d.reduce = d.orig;
      break;
    default:
      throw FieldError("precision", fmt::format("{}: fp16 under {} needs a sharded gradient scaler, not simulated "
                                                "(bf16-amp, bf16 and fp32 are)", name_of(p), v));
  }
  return d;
}

uint64_t fsdp2_mesh_ranks(const TrainSetup& s) {
  return checked_mul(s.dp, std::max<uint64_t>(s.cp, 1), "FSDP2 mesh (dp x cp)");
}

uint64_t fsdp2_mesh_rank(const TrainSetup& s) {
  // the flattened (dp_shard, cp) mesh, cp innermost: data-parallel rank d's CP rank c is d x cp + c
  return checked_add(checked_mul(s.dp_rank.value_or(0), std::max<uint64_t>(s.cp, 1), "FSDP2 mesh rank"),
                     s.cp_rank.value_or(0), "FSDP2 mesh rank");
}

// HSDP (fsdp.h). Sources: accelerate 16cb6eb parallelism_config.py ParallelismConfig (dp_replicate_size x
// dp_shard_size = the data-parallel size; "dp_replicate_size > 1 and dp_shard_size == 1 is an invalid
// configuration, to use pure DP, use DistributedDataParallelKwargs instead"; _get_mesh's order ["dp_replicate",
// "dp_shard", "cp", "sp", "tp"]; fsdp_dim_names ["dp_replicate", "dp_shard_cp"]) and utils/fsdp_utils.py
// fsdp2_prepare_model (`"mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]`); torchtitan v0.2.0
// parallel_dims.py (dp_replicate * dp_shard * cp * tp * pp == world_size; mesh ["pp", "dp_replicate", ...,
// "dp_shard_..", "cp", "tp"]) and models/llama3/infra/parallelize.py (`dp_mesh_dim_names = ("dp_replicate",
// "dp_shard_cp")` when dp_replicate_enabled). fully_shard on a 2-D mesh is HSDP (torch _fully_shard/
// _fully_shard.py: `elif mesh.ndim == 2: mesh_info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)`):
// the parameters are chunked over the shard dimension only (FSDPParam._init_sharded_param: shard_world_size).
// Without --dp-shard the mesh is the flattened dp (x cp) one (fsdp2_mesh_ranks).
// With --cp C the shard dimension is accelerate's flattened "dp_shard_cp" (fsdp_dim_names ["dp_replicate",
// "dp_shard_cp"]; torchtitan's ("dp_replicate", "dp_shard_cp") too): shard groups of K x C ranks, each holding
// K data-parallel ranks' C CP ranks, row-major (dp_shard outer, cp inner: DeviceMesh._flatten of ["dp_shard",
// "cp"]), so data-parallel rank d's CP rank c is shard rank (d mod K) x C + c of replicate group d / K.
// ParallelismConfig.__post_init__ allows it ("set dp_replicate_size == 1 and dp_shard_size > 1 to compose HSDP +
// TP/CP for 3D parallel" is its message for the refused dp_shard_size 1; the check is `(tp_size > 1 or cp_size >
// 1) and dp_replicate_size > 1 and dp_shard_size == 1`, so dp_shard_size > 1 with a replicate dimension passes).
void apply_hsdp_mesh(FsdpOptions& f, const TrainSetup& s) {
  const uint64_t dp = s.dp;
  f.ranks = fsdp2_mesh_ranks(s);
  f.rank = fsdp2_mesh_rank(s);
  f.replicate = 1;
  if (s.dp_shard) {
    const uint64_t k = *s.dp_shard;
    if (k < 2 || k > dp || dp % k != 0) {
      std::string divisors;
      for (uint64_t d = 2; d <= dp && divisors.size() < 80; ++d) {
        if (dp % d == 0) divisors += fmt::format("{}{}", divisors.empty() ? "" : ", ", d);
      }
      throw FieldError("dp_shard", fmt::format(
          "{}: expected a divisor of --dp {} from 2 to {} ({}; dp = dp_replicate x dp_shard){}", k, dp, dp,
          divisors.empty() ? "none" : divisors,
          k != 1 ? ""
          : s.sequence_parallel
              ? ". A shard degree of 1 replicates without sharding (DDP over the replicas), which is not simulated "
                "over the TP + SP model"
              : ". A shard degree of 1 replicates without sharding, which accelerate's ParallelismConfig refuses "
                "(dp_replicate_size > 1 with dp_shard_size 1): that is --sharding ddp"));
    }
    // (K = dp: one replica, the flattened dp (x cp) mesh above; the same figures)
    const uint64_t cp = std::max<uint64_t>(s.cp, 1);
    const uint64_t d = s.dp_rank.value_or(0);
    f.ranks = checked_mul(k, cp, "HSDP shard group (dp_shard x cp)");
    f.replicate = dp / k;
    f.rank = checked_add(checked_mul(d % k, cp, "HSDP shard rank"), s.cp_rank.value_or(0), "HSDP shard rank");
    f.replicate_rank = d / k;
  }
}

uint64_t hsdp_shard_degree(const TrainSetup& s) {
  if (s.sharding != Sharding::kFsdp2 || !s.dp_shard) return 0;
  const uint64_t k = *s.dp_shard;
  return k > 1 && k < s.dp && s.dp % k == 0 ? k : 0;
}

bool torchtitan_fsdp2(const TrainSetup& s) {
  // (the mesh is dp x cp: torchtitan shards over the CP ranks too, also with one data-parallel rank)
  return fsdp2_mesh_ranks(s) > 1 && s.sharding == Sharding::kFsdp2 && (s.pp > 1 || s.sequence_parallel);
}

uint64_t hsdp_node_shard_degree(uint64_t dp, uint64_t tp, uint64_t cp, uint64_t gpus_per_node) {
  if (cp > 1) return 0;
  const uint64_t k = gpus_per_node / std::max<uint64_t>(tp, 1);
  return k > 1 && k < dp && dp % k == 0 ? k : 0;
}

FsdpOptions resolve_fsdp(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch) {
  FsdpOptions f;
  if (s.dp_shard && (s.dp <= 1 || s.sharding != Sharding::kFsdp2)) {
    throw FieldError("dp_shard", fmt::format("{}: HSDP's shard degree; it applies with --sharding fsdp2 and --dp above "
                                             "1 (--sharding is {}, --dp {})",
                                             *s.dp_shard, name_of(s.sharding), s.dp));
  }
  if (fsdp2_mesh_ranks(s) <= 1 || s.sharding != Sharding::kFsdp2) {
    if (s.reshard_after_forward) {
      throw FieldError("reshard_after_forward", "FSDP2's setting: it takes --dp N (N > 1) or --cp N with --sharding fsdp2");
    }
    return f;
  }
  const auto refuse = [](const char* field, const std::string& what) { throw FieldError(field, what); };
  if (loop != LoopKind::kHf) {
    refuse("loop", fmt::format("{}: FSDP2 is simulated as the transformers Trainer runs it through accelerate "
                               "(--loop hf, fsdp_version 2)", name_of(loop)));
  }
  // accelerator.py: `if not is_torch_version(">=", FSDP2_PYTORCH_VERSION): raise ImportError(...)`, "2.6.0"
  if (torch < TorchVersion{2, 6}) {
    refuse("torch", s.sequence_parallel
                        ? fmt::format("{}: FSDP2 over the TP + SP model is simulated for PyTorch 2.6 and later (the "
                                      "fully_shard and DTensor of accelerate's FSDP2_PYTORCH_VERSION, 2.6.0)",
                                      torch_version_name(torch))
                        : fmt::format("{}: accelerate's FSDP2 requires PyTorch >= 2.6.0 (FSDP2_PYTORCH_VERSION)",
                                      torch_version_name(torch)));
  }
  // The forward hooks of the embedding and the tail [final norm, lm_head] sit in the llama family's program
  // (src/sim/forward_programs/llama.cc); the decoder layers' in run_layers (src/sim/layers.h).
  refuse_under_accelerate_fsdp(s, m, "FSDP2", "fsdp2", "fully_shard");
  // --tp T with --sharding fsdp2, as accelerate's examples/torch_native_parallelism/nd_parallel.py runs it
  // (16cb6eb): ParallelismConfig(dp_shard_size=D, tp_size=T), FullyShardedDataParallelPlugin(fsdp_version=2),
  // mixed_precision="bf16", from_pretrained(tp_plan="auto", device_mesh=accelerator.torch_device_mesh) shards the
  // model first, then accelerate's fsdp2_prepare_model calls fully_shard with mesh=torch_device_mesh[fsdp_dim_names] ("dp_shard_cp",
  // utils/fsdp_utils.py; ParallelismConfig mesh order dp_replicate, dp_shard, cp, sp, tp). FSDPParam's
  // _init_sharding_spec_tp (torch _fully_shard/_fsdp_param.py) returns `param._local_tensor`, which
  // _init_sharded_param chunks on dim 0 over the dp shard mesh (_chunk_with_empty, padded on the local dim 0): the
  // rank's TP-local inventory (apply_tensor_parallel) sharded over W = dp (dp x cp under --cp: "dp_shard_cp"), the
  // all-gather outputs TP-local.
  if (s.tp > 1 && s.ep > 1) {
    refuse("ep", fmt::format("{}: FSDP2 over expert-parallel shards is not simulated", s.ep));
  }
  if (m.embed.tied) {
    refuse("sharding", "fsdp2: tied input/output embeddings (accelerate's tail unit then holds the shared weight, "
                       "gathered at the start of the forward) are not simulated");
  }
  if (s.loss != LossKind::kCe) {
    refuse("loss", "FSDP2 is simulated with transformers' cross-entropy (--loss ce): the chunked and fused heads "
                   "run lm_head outside the tail unit's hooks");
  }
  // PEFT LoRA (fsdp_units, fsdp_unit_buffers, src/sim/fsdp.cc): simulated as the Trainer runs it with accelerate's
  // FSDP2 over the PeftModel, on the data-parallel mesh or, with --cp, the flattened dp_shard x cp one (accelerate
  // shards the PeftModel over fsdp_dim_names as any model: the same units over more ranks); under a pipeline or
  // the TP + SP model (torchtitan's policies, which wrap no PeftModel) it is not. (--tp is refused with LoRA before
  // this; --quantize by refuse_under_accelerate_fsdp.)
  if (s.lora.on && (s.pp > 1 || s.sequence_parallel)) {
    refuse("lora", fmt::format("LoRA under FSDP2 is simulated for accelerate's mesh (--dp, HSDP's --dp-shard, --cp), "
                               "not with {}", s.pp > 1 ? "--pp (torchtitan's policy)" : "--sequence-parallel (torchtitan's policy)"));
  }
  // --input-require-grads (enable_input_require_grads, PEFT's default with checkpointing): its forward hook on the
  // input embeddings, registered before fully_shard, runs before the embedding unit's _post_forward, so the
  // embeddings require grad when FSDP registers its pre-backward hook on them: the embedding unit's pre_backward
  // then runs in the backward (an unshard), while its RegisterPostBackwardFunction still is not registered (its
  // only input, the ids, needs no grad: _register_post_backward_hook), so its post_backward stays in the final
  // callback. The simulator's hooks (src/sim/fsdp.cc backward_hook) follow requires_grad as autograd does.
  // FSDP2's pre-backward hook does the unshard when a layer is recomputed (FSDPState._pre_forward returns early in
  // PRE_BACKWARD); reentrant checkpointing runs the recompute inside CheckpointFunction.backward, outside the
  // hooks' bookkeeping as simulated here
  if (reentrant_checkpointing(s, m.impl)) {
    refuse("checkpoint_reentrant",
           fmt::format("true: reentrant checkpointing under FSDP2 is not simulated (use_reentrant=False is transformers "
                       "5.x's default{})",
                       s.quant.type != Quantize::kNone && s.quant.prepare
                           ? "; --quantize's prepare_model_for_kbit_training turns reentrant on: pass "
                             "--checkpoint-reentrant false, as gradient_checkpointing_kwargs={\"use_reentrant\": False}"
                           : ""));
  }
  // QLoRA: fsdp2_prepare_model (accelerate 16cb6eb) collects every Params4bit that is frozen and not floating (bnb's
  // default uint8 quant_storage) and, `if incompatible_params4bit and is_torch_version(">=", "2.7.0")`, passes
  // them to fully_shard as ignored_params ("Excluding from FSDP2 sharding to prevent quant_state corruption"). On
  // an older torch they reach fully_shard, whose _init_sharded_param makes nn.Parameter(uint8 shard) requiring
  // grad: "only Tensors of floating point dtype can require gradients" (accelerate issue #3983).
  if (s.quant.type != Quantize::kNone && !is_floating(s.quant.storage)) {
    if (torch < TorchVersion{2, 7}) {
      refuse("torch", fmt::format("{}: a 4-bit base under FSDP2 needs PyTorch >= 2.7, where accelerate passes the "
                                  "uint8 Params4bit to fully_shard as ignored_params (before 2.7 fully_shard fails on "
                                  "them: only floating-point tensors can require gradients)",
                                  torch_version_name(torch)));
    }
    f.ignore_packed_4bit = true;
  }
  // (a floating quant_storage equal to MixedPrecisionPolicy.param_dtype is not cast: init_dtype_attrs drops a
  // param_dtype equal to the parameter's; --quant-storage offers bf16, which every policy here gathers as is)
  f.bnb_4bit = s.quant.type != Quantize::kNone;
  f.on = true;
  // the mesh: dp ranks, or dp x cp under --cp (fsdp2_mesh_ranks; with --tp, of the TP-local model; under --pp,
  // torchtitan's dp_shard_cp), or the K-rank shard groups of HSDP (--dp-shard K); --dp-rank: the rank whose shards are simulated (validate_setup
  // checked it; rank 0 unless given, since torch.chunk leaves the last ones short), under --cp its CP rank
  // (--cp-rank) in the flattened mesh (fsdp2_mesh_rank) (apply_hsdp_mesh)
  apply_hsdp_mesh(f, s);
  // FullyShardedDataParallelPlugin.__post_init__: reshard_after_forward None -> env FSDP_RESHARD_AFTER_FORWARD,
  // default "true" for fsdp_version 2
  f.reshard_after_forward = s.reshard_after_forward.value_or(true);
  // the Trainer leaves the model on the CPU under FSDP (place_model_on_device), and fsdp2_prepare_model without
  // cpu_ram_efficient_loading (its default) shards it there; under --tp, from_pretrained's tp_plan has already put
  // the TP-local parameters on the device
  // (a 4-bit base is quantized onto the rank's GPU by from_pretrained, bnb's update_device_map {"": current
  // device}, so fully_shard finds the model there, and fsdp2_prepare_model's `model_has_params4bit` also skips the
  // float32 upcast: the parameters keep prepare_model_for_kbit_training's dtypes, float32 but for the Params4bit)
  f.move_then_shard = s.tp <= 1 && s.quant.type == Quantize::kNone;
  const FsdpDtypes d = accelerate_fsdp_dtypes(s.precision, "FSDP2");
  f.orig_dtype = d.orig;
  f.mixed = d.mixed;
  f.param_dtype = d.param;
  f.reduce_dtype = d.reduce;
  // transformers Trainer._prepare_for_training (main 2026): `is_fsdp2 -> delay_optimizer_creation = False`, so
  // update_fsdp_plugin_peft (peft's fsdp_auto_wrap_policy) is not called under FSDP2: accelerate's
  // transformer_auto_wrap_policy over _no_split_modules (LlamaDecoderLayer, reached through PeftModel.__getattr__
  // -> LoraModel -> LlamaForCausalLM) wraps the decoder layers, adapters inside each layer's unit
  f.peft = s.lora.on;
  return f;
}

FsdpParamDtypes fsdp_param_dtypes(const TensorRow& r, const FsdpOptions& o) {
  FsdpParamDtypes d;
  // the sharded data keeps the parameter's dtype: the model's, PEFT's float32 adapters (--lora-dtype fp32).
  // accelerate's fsdp2_prepare_model upcasts only `param.requires_grad and param.dtype != torch.float32` to
  // float32 when mixed_precision != "no" (accelerate PR #3848, "Upcast FSDP2 parameters only if requires_grad"):
  // under bf16-amp every row is float32 already (o.orig_dtype), frozen ones included
  d.orig = stored_dtype(r, o.orig_dtype);
  // FSDPParam.init_dtype_attrs: `if param_dtype == self.orig_dtype: param_dtype = None` (no cast, no copy-in);
  // _get_param_all_gather_inputs's use_foreach_copy: `fsdp_param.param_dtype is not None` (no offload, no
  // fsdp_pre_all_gather extension here)
  d.copy = o.mixed && o.param_dtype != d.orig;
  d.param = d.copy ? o.param_dtype : d.orig;
  return d;
}

void fsdp_unit_buffers(FsdpUnit& u, const Inventory& inv, const FsdpOptions& o) {
  u.gather_numel = u.copy_in_numel = u.grad_numel = u.trainable_params = 0;
  bool first = true, mixed_inputs = false, trainable = false;
  uint64_t gather_bytes = 0;
  for (int32_t row : u.rows) {
    const TensorRow& r = inv.parameters[static_cast<size_t>(row)];
    const FsdpParamDtypes d = fsdp_param_dtypes(r, o);
    const uint64_t n = fsdp_shard(stored_shape(r), o.ranks, o.rank).padded_numel;
    // _get_all_gather_input_metadatas: all_gather_dtype = the first input's; any other dtype -> torch.uint8, and
    // foreach_all_gather views every input as uint8 (all_gather_input_numel then counts bytes)
    if (first) u.gather_dtype = d.param;
    if (d.param != u.gather_dtype) mixed_inputs = true;
    first = false;
    u.gather_numel = checked_add(u.gather_numel, n, "FSDP all-gather");
    gather_bytes = checked_add(gather_bytes, bytes_of(Elems(n), d.param).value, "FSDP all-gather");
    // flat_foreach_copy_input = torch.empty(sum of the foreach-copy inputs' numel, dtype=the first one's param_dtype)
    if (d.copy) {
      if (u.copy_in_numel == 0) u.copy_in_dtype = d.param;
      u.copy_in_numel = checked_add(u.copy_in_numel, n, "FSDP copy-in");
    }
    if (!r.trainable) continue;
    // FSDPParamGroup._init_mp_dtypes: over `p.sharded_param.requires_grad` params only, "FSDP expects uniform
    // original parameter dtype" (pytorch main 002a76f; PR #154103 "allow different dtypes for no grad model
    // params"); post_backward reduce-scatters fsdp_params_with_grad, the padded sizes of their gradients
    if (trainable && d.orig != u.grad_orig_dtype) {
      throw Error(fmt::format("FSDP2: {} holds trainable parameters of dtypes {} and {}: FSDP asserts \"FSDP expects "
                              "uniform original parameter dtype\"", u.name, dtype_name(u.grad_orig_dtype),
                              dtype_name(d.orig)));
    }
    trainable = true;
    u.grad_orig_dtype = d.orig;
    u.grad_dtype = d.param;  // the unsharded parameter's .grad (AccumulateGrad: the parameter's dtype)
    u.grad_numel = checked_add(u.grad_numel, n, "FSDP reduce-scatter");
    u.trainable_params = checked_add(u.trainable_params, r.elems.value, "FSDP unit");
  }
  if (mixed_inputs) {
    u.gather_dtype = DType::kU8;
    u.gather_numel = gather_bytes;
  }
  // foreach_reduce: `reduce_dtype = reduce_dtype or grad_dtype`; FSDPParam.init_dtype_attrs drops a reduce_dtype
  // equal to the param_dtype (mixed here means param_dtype set: the policy's reduce_dtype, or the gradients')
  u.reduce_dtype = o.mixed ? o.reduce_dtype : u.grad_dtype;
  if (!trainable) {
    // a frozen unit (PEFT's embedding and lm_head): no gradient, no reduce-scatter (grad_numel 0)
    u.grad_orig_dtype = u.grad_dtype = o.orig_dtype;
    u.reduce_dtype = o.mixed ? o.reduce_dtype : o.orig_dtype;
  }
}

FsdpShard fsdp_shard(const std::vector<uint64_t>& shape, uint64_t ranks, uint64_t rank) {
  if (ranks == 0 || rank >= ranks) throw Error("internal: FSDP shard of a rank outside the world");
  FsdpShard sh;
  // Shard(0) of a 0-d parameter: none in the simulated families
  if (shape.empty()) throw Error("internal: FSDP2 shard of a 0-d parameter");
  uint64_t rest = 1;
  for (size_t d = 1; d < shape.size(); ++d) rest = checked_mul(rest, shape[d], "FSDP shard");
  // torch.chunk(tensor, W, dim=0): chunks of ceil(dim0 / W) rows, the last ones short or empty
  // (_chunk_with_empty pads the list with empty tensors); padded_sharded_size = chunks[0].size()
  sh.rows_padded = ceil_div(shape[0], ranks);
  const uint64_t start = checked_mul(sh.rows_padded, rank, "FSDP shard");
  sh.rows_local = start >= shape[0] ? 0 : std::min(sh.rows_padded, shape[0] - start);
  sh.padded_numel = checked_mul(sh.rows_padded, rest, "FSDP shard");
  sh.local_numel = checked_mul(sh.rows_local, rest, "FSDP shard");
  sh.unsharded_padded_numel = checked_mul(sh.padded_numel, ranks, "FSDP unsharded");
  sh.local_shape = shape;
  sh.local_shape[0] = sh.rows_local;
  return sh;
}

std::vector<FsdpUnit> fsdp_units(const ModelSpec& m, const Inventory& inv, const FsdpOptions& o) {
  const FamilyDescriptor& fd = family_descriptor(m.family);
  std::vector<FsdpUnit> units;
  // fsdp2_prepare_model: fully_shard on each module the auto-wrap policy picks (get_module_children_bottom_up:
  // the decoder layers, _no_split_modules), then the input embedding (untied), then the tail [final norm,
  // output embedding] with reshard_after_forward=False, then the root model with the rest (reshard_after_forward
  // None: False for the root, FSDPState._lazy_init). Units are listed in forward order.
  FsdpUnit embed;
  embed.kind = FsdpUnit::kEmbed;
  embed.reshard_after_forward = o.reshard_after_forward;
  embed.name = std::string(fd.input_embedding.substr(0, fd.input_embedding.rfind('.')));
  std::vector<FsdpUnit> layers(m.layers);
  for (uint64_t l = 0; l < m.layers; ++l) {
    layers[l].kind = FsdpUnit::kLayer;
    layers[l].layer = static_cast<int32_t>(l);
    layers[l].reshard_after_forward = o.reshard_after_forward;
    layers[l].name = fmt::format("{}.{}", fd.layer_prefix, l);
  }
  FsdpUnit tail;
  tail.kind = FsdpUnit::kTail;
  tail.name = "[model.norm, lm_head]";
  tail.reshard_after_forward = false;
  FsdpUnit root;
  root.kind = FsdpUnit::kRoot;
  root.name = "model (root)";
  root.reshard_after_forward = false;
  const std::string prefix = std::string(fd.layer_prefix) + ".";
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    const std::string& n = inv.parameters[i].name;
    // fully_shard's ignored_params (QLoRA's uint8 Params4bit, FsdpOptions::ignore_packed_4bit): in no unit, whole
    if (fsdp_ignored(inv.parameters[i], o)) continue;
    FsdpUnit* u = &root;
    if (n == fd.input_embedding) {
      u = &embed;
    } else if (n.rfind(prefix, 0) == 0) {
      const uint64_t l = std::stoull(n.substr(prefix.size()));
      if (l >= m.layers) throw Error(fmt::format("internal: {} is past the model's {} layers", n, m.layers));
      u = &layers[l];
    } else if ((!o.peft && n.rfind("model.norm.", 0) == 0) || n.rfind("lm_head.", 0) == 0) {
      // _find_final_norm: the last child of the base model whose class name has "Norm" (LlamaRMSNorm `norm`);
      // get_output_embeddings(): lm_head
      // Under PEFT (o.peft) the model is the PeftModel: `getattr(model, "base_model_prefix")` reaches
      // LlamaForCausalLM's "model" through PeftModel.__getattr__ -> LoraModel (BaseTuner).__getattr__, and
      // `getattr(model, "model")` then returns LoraModel.model, the LlamaForCausalLM itself (peft 5d602fd
      // peft_model.py, tuners/tuners_utils.py: `self.model = model`), whose children `model` (LlamaModel) and
      // `lm_head` have no "Norm" in their class names: final_norm is None, the tail is [lm_head] alone, and
      // model.norm.weight stays with the root (fully_shard(model) without reshard_after_forward)
      u = &tail;
    }
    u->rows.push_back(static_cast<int32_t>(i));
    const FsdpShard sh = fsdp_shard(stored_shape(inv.parameters[i]), o.ranks, o.rank);
    u->shard_numel = checked_add(u->shard_numel, sh.padded_numel, "FSDP unit");
    u->params = checked_add(u->params, inv.parameters[i].elems.value, "FSDP unit");
  }
  const bool peft_root = o.peft && !root.rows.empty() &&
                         std::all_of(root.rows.begin(), root.rows.end(), [&](int32_t r) {
                           return inv.parameters[static_cast<size_t>(r)].name.rfind("model.norm.", 0) == 0;
                         });
  if (!root.rows.empty() && !peft_root) {
    throw FieldError("sharding", fmt::format("fsdp2: {} parameter(s) outside the embedding, the layers and the tail "
                                             "(first: {}) would sit in the root unit, which is not simulated",
                                             root.rows.size(), inv.parameters[static_cast<size_t>(root.rows[0])].name));
  }
  if (embed.rows.empty() || tail.rows.empty()) {
    throw FieldError("sharding", "fsdp2: a tied or missing input/output embedding (one tail unit holding the shared "
                                 "weight) is not simulated");
  }
  if (peft_root) {
    tail.name = "[lm_head]";
    // the root's FSDPState: its pre-forward (the first hook of the model's forward) all-gathers its parameters,
    // FSDPState._lazy_init leaves the root unsharded after forward (reshard_after_forward None for the root), and
    // all_states (the final callback's order) starts with it
    root.name = "model (root: model.norm)";
    units.push_back(std::move(root));
  }
  units.push_back(std::move(embed));
  for (FsdpUnit& u : layers) units.push_back(std::move(u));
  units.push_back(std::move(tail));
  for (FsdpUnit& u : units) fsdp_unit_buffers(u, inv, o);
  return units;
}

// torchtitan v0.2.0 under a pipeline (fsdp.h). Sources: pytorch/torchtitan v0.2.0
// torchtitan/models/llama3/infra/parallelize.py parallelize_llama / apply_fsdp, torchtitan/config/job_config.py
// Training.dtype / mixed_precision_param / mixed_precision_reduce and Parallelism.fsdp_reshard_after_forward.
FsdpOptions fsdp_torchtitan_pp_options(uint64_t ranks) {
  if (ranks < 2) throw Error("internal: torchtitan's FSDP2 policy needs a mesh of 2 or more ranks");
  FsdpOptions f;
  f.on = true;
  f.ranks = ranks;
  f.rank = 0;
  // apply_fsdp, policy "default": `reshard_after_forward = not pp_enabled` ("For PP, by default do not reshard
  // after forward to avoid per-microbatch all-gathers"); the blocks and tok_embeddings get it, [norm, output]
  // gets `reshard_after_forward_policy == "always"` (False), and the root fully_shard(model) its default
  f.reshard_after_forward = false;
  // Training.dtype = "float32": the parameters (hence their shards), gradients and optimizer states are fp32
  f.orig_dtype = DType::kF32;
  // apply_fsdp: MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[mixed_precision_param] ("bfloat16"),
  // reduce_dtype=TORCH_DTYPE_MAP[mixed_precision_reduce] ("float32"))
  f.mixed = true;
  f.param_dtype = DType::kBF16;
  f.reduce_dtype = DType::kF32;
  return f;
}

namespace {
// torchtitan's policy (fsdp_torchtitan_pp_options) over the mesh resolve_fsdp resolved: the shard group, the
// replicate group (HSDP, --dp-shard K: torchtitan shards over ("dp_replicate", "dp_shard_cp") when dp_replicate is
// enabled, the policy unchanged, apply_hsdp_mesh) and the rank's coordinates (--dp-rank, checked there)
FsdpOptions torchtitan_policy_over(const FsdpOptions& mesh) {
  FsdpOptions f = fsdp_torchtitan_pp_options(mesh.ranks);
  f.rank = mesh.rank;
  f.replicate = mesh.replicate;
  f.replicate_rank = mesh.replicate_rank;
  return f;
}
}  // namespace

FsdpOptions resolve_pp_fsdp(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch) {
  if (s.reshard_after_forward && fsdp2_mesh_ranks(s) > 1 && s.sharding == Sharding::kFsdp2) {
    // torchtitan's parallelism.fsdp_reshard_after_forward "always" / "never" are other programs under a pipeline
    // (an all-gather per micro-batch); its "default" (False under PP) is the one simulated
    throw FieldError("reshard_after_forward", "under --pp, FSDP2 is simulated with torchtitan's default policy only "
                                              "(fsdp_reshard_after_forward \"default\": not pp_enabled, i.e. false)");
  }
  const FsdpOptions checked = resolve_fsdp(s, m, loop, torch);
  if (!checked.on) return checked;
  if (s.precision != Precision::kFp32) {
    // torchtitan's training.dtype: "float32" (the default) keeps fp32 sharded parameters, gradients and optimizer
    // states, the compute in MixedPrecisionPolicy's bfloat16; "bfloat16" converts the model first (bf16 shards,
    // an fp32 reduce, a downcast of each reduced shard), not simulated
    throw FieldError("precision", fmt::format("{}: FSDP2 under --pp is simulated as torchtitan's training.dtype "
                                              "\"float32\" with mixed_precision_param bfloat16 applied by "
                                              "fully_shard: use --precision fp32", precision_name(s.precision)));
  }
  return torchtitan_policy_over(checked);
}

namespace {
// The units of one stage module `p` (rows of stage_inv, the rank's inventory)
std::vector<FsdpUnit> stage_units_of(const Inventory& stage_inv, const PpStagePart& p, const FsdpOptions& o) {
  // apply_fsdp on each stage model (torchtitan's pipeline_llm prunes the Transformer per stage: tok_embeddings
  // None off the first stage, norm and output None off the last): fully_shard(tok_embeddings) if present, each
  // TransformerBlock, [norm, output] if present, then the root with what is left (nothing here). Units are in
  // forward order.
  std::vector<FsdpUnit> units;
  auto add = [&](FsdpUnit::Kind kind, int32_t layer, std::string name, bool reshard, auto member) {
    FsdpUnit u;
    u.kind = kind;
    u.layer = layer;
    u.name = std::move(name);
    u.reshard_after_forward = reshard;
    for (size_t i = 0; i < stage_inv.parameters.size(); ++i) {
      if (!member(stage_inv.parameters[i].name)) continue;
      u.rows.push_back(static_cast<int32_t>(i));
      const FsdpShard sh = fsdp_shard(stored_shape(stage_inv.parameters[i]), o.ranks, o.rank);
      u.shard_numel = checked_add(u.shard_numel, sh.padded_numel, "FSDP unit");
      u.params = checked_add(u.params, stage_inv.parameters[i].elems.value, "FSDP unit");
    }
    if (u.rows.empty()) throw Error(fmt::format("internal: FSDP unit {} has no parameters on this stage", u.name));
    fsdp_unit_buffers(u, stage_inv, o);
    units.push_back(std::move(u));
  };
  auto starts = [](const std::string& n, const std::string& pre) { return n.rfind(pre, 0) == 0; };
  if (p.embeddings) {
    add(FsdpUnit::kEmbed, -1, "model.embed_tokens", o.reshard_after_forward,
        [&](const std::string& n) { return starts(n, "model.embed_tokens."); });
  }
  for (uint64_t l = p.layer_begin; l < p.layer_end; ++l) {
    const std::string pre = fmt::format("model.layers.{}.", l);
    add(FsdpUnit::kLayer, static_cast<int32_t>(l), pre.substr(0, pre.size() - 1), o.reshard_after_forward,
        [&](const std::string& n) { return starts(n, pre); });
  }
  if (p.head) {
    add(FsdpUnit::kTail, -1, "[model.norm, lm_head]", false,
        [&](const std::string& n) { return starts(n, "model.norm.") || starts(n, "lm_head."); });
  }
  return units;
}
}  // namespace

std::vector<FsdpUnit> fsdp_stage_units(const Inventory& stage_inv, const std::vector<PpStagePart>& parts,
                                       const FsdpOptions& o) {
  std::vector<FsdpUnit> units;  // the roots' units, stage by stage as the rank holds them
  for (std::vector<FsdpUnit>& root : fsdp_stage_roots(stage_inv, parts, o)) {
    for (FsdpUnit& u : root) units.push_back(std::move(u));
  }
  return units;
}

// torchtitan over its TP + SP plan (fsdp.h). Sources: pytorch/torchtitan 9810191bb
// torchtitan/experiments/transformers_modeling_backend/parallelize.py parallelize_hf_transformers / apply_fsdp
// (the same policy as v0.2.0's models/llama3/infra/parallelize.py apply_fsdp; disable_fsdp_gradient_division sets
// the divide factor 1.0, which foreach_reduce applies in place: no memory), torchtitan/distributed/utils.py
// maybe_enable_amp, torchtitan/config/configs.py (Training.dtype "float32", mixed_precision_param "bfloat16",
// mixed_precision_reduce "float32", Parallelism.fsdp_reshard_after_forward "default"). FSDP2 over a TP DTensor
// (torch _fully_shard/_fsdp_param.py FSDPParam._init_sharded_param: `self._tp_spec = cast(DTensor, param)._spec`,
// the local tensor chunked on dim 0 over the dp shard mesh; the all-gather outputs TP-local): fsdp_shard on the
// rank's TP-local inventory, as for accelerate's FSDP2 over TP.
FsdpOptions resolve_sp_fsdp(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch) {
  const FsdpOptions checked = resolve_fsdp(s, m, loop, torch);  // the mesh (HSDP included) and the refusals
  if (!checked.on || !s.sequence_parallel) return checked;
  if (s.precision != Precision::kFp32) {
    // torchtitan keeps fp32 parameters (training.dtype "float32") and runs no autocast under FSDP
    // (maybe_enable_amp); fully_shard's MixedPrecisionPolicy casts the gathers to bfloat16
    throw FieldError("precision", fmt::format("{}: FSDP2 over the sequence-parallel model is simulated as torchtitan "
                                              "runs it: training.dtype \"float32\" parameters, no autocast, "
                                              "mixed_precision_param bfloat16 applied by fully_shard: use --precision fp32",
                                              precision_name(s.precision)));
  }
  FsdpOptions f = torchtitan_policy_over(checked);  // the dtypes (the same policy)
  // apply_fsdp: policy "default" -> reshard_after_forward = not pp_enabled (True) on the embedding and each block;
  // "never" (--reshard-after-forward false) -> False. The tail's `reshard_after_forward_policy == "always"` is
  // False under both (fsdp_units gives the tail False); "always" (the tail too) is not simulated
  f.reshard_after_forward = checked.reshard_after_forward;
  return f;
}

FsdpOptions resolve_fsdp2_policy(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch, bool pp) {
  if (pp) return resolve_pp_fsdp(s, m, loop, torch);
  if (s.sequence_parallel) return resolve_sp_fsdp(s, m, loop, torch);
  return resolve_fsdp(s, m, loop, torch);
}

std::vector<std::vector<FsdpUnit>> fsdp_stage_roots(const Inventory& rank_inv, const std::vector<PpStagePart>& parts,
                                                    const FsdpOptions& o) {
  std::vector<std::vector<FsdpUnit>> roots;
  size_t covered = 0;
  for (const PpStagePart& p : parts) {
    roots.push_back(stage_units_of(rank_inv, p, o));
    for (const FsdpUnit& u : roots.back()) covered += u.rows.size();
  }
  if (covered != rank_inv.parameters.size()) {
    throw Error(fmt::format("internal: {} of the stage's {} parameters in its FSDP units", covered,
                            rank_inv.parameters.size()));
  }
  return roots;
}

}  // namespace trainmem
