// PyTorch FSDP2 (fully_shard, torch/distributed/fsdp/_fully_shard/) per rank, as the transformers Trainer runs
// it through accelerate's FSDP2 path (accelerate utils/fsdp_utils.py fsdp2_prepare_model, huggingface/accelerate
// 16cb6eb, 1.15.0.dev0). The shard arithmetic and the wrapping policy are here (pure functions, unit-tested
// against the source's rules); the simulator (src/sim/fsdp.cc) allocates what they say.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainmem/dtype.h"
#include "trainmem/inventory.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"

namespace trainmem {

struct ModelSpec;
enum class LoopKind;
struct PpStagePart;

// fully_shard's settings as accelerate passes them, resolved.
struct FsdpOptions {
  bool on = false;
  uint64_t ranks = 1;   // the shard mesh size W: --dp (or --gpus N), or HSDP's dp_shard (--dp-shard K)
  uint64_t rank = 0;    // the simulated rank's index in its shard group (--dp-rank mod W, default 0)
  // HSDP (--dp-shard K < dp): fully_shard's 2-D mesh (dp_replicate, dp_shard) = (replicate, ranks); each unit's
  // reduce-scatter over the shard group is followed by an all-reduce over the replicate group (foreach_reduce).
  // 1: plain FSDP2 (a 1-D mesh).
  uint64_t replicate = 1;
  uint64_t replicate_rank = 0;  // the simulated rank's replicate group index (--dp-rank / W)
  bool reshard_after_forward = true;  // FullyShardedDataParallelPlugin.reshard_after_forward (FSDP2: True)
  DType orig_dtype = DType::kF32;     // the sharded parameters' dtype (accelerate upcasts to float32)
  bool mixed = false;                 // MixedPrecisionPolicy.param_dtype set
  DType param_dtype = DType::kF32;    // all-gather and unsharded-parameter dtype (orig_dtype when not mixed)
  DType reduce_dtype = DType::kF32;   // reduce-scatter dtype (the gradients' when not mixed)
  // accelerate's fsdp2_prepare_model on the model the Trainer leaves on the CPU: fully_shard moves each unit's
  // parameters to the device whole before sharding them, unit by unit in wrapping order (Fsdp2::load_roots).
  // False where the parameters reach the device otherwise: torchtitan's meta-device init under PP or SP, and
  // from_pretrained's tp_plan under TP, whose whole TP-local parameters fully_shard then frees unit by unit (that
  // transient, and accelerate's on-device float32 upcast of them under bf16-amp, is not simulated: the shards are),
  // and a 4-bit base, which bitsandbytes quantizes onto the GPU (bnb_4bit: that transient is simulated).
  bool move_then_shard = false;
  // PEFT LoRA (--lora): the model fsdp2_prepare_model wraps is a PeftModel, whose base rows are frozen and whose
  // final norm accelerate's _find_final_norm does not find, so it stays in the root unit (fsdp_units)
  bool peft = false;
  // QLoRA (--quantize nf4|fp4): the model from_pretrained quantized onto the rank's GPU (bnb's
  // update_device_map), which fully_shard shards there (Fsdp2::shard_on_device)
  bool bnb_4bit = false;
  // bitsandbytes' default uint8 quant_storage makes every Params4bit a frozen non-floating parameter, which
  // accelerate's fsdp2_prepare_model passes to fully_shard as ignored_params (accelerate 16cb6eb
  // utils/fsdp_utils.py, PR #3987): left whole on every rank; fsdp_units leaves those rows out of every unit. A
  // floating quant_storage (--quant-storage bf16) is sharded like any frozen parameter, its packed shape
  // (stored_shape) chunked on dim 0.
  bool ignore_packed_4bit = false;
};

// Whether row `r` is one of fully_shard's ignored_params under `o` (FsdpOptions::ignore_packed_4bit): in no unit,
// whole on every rank.
inline bool fsdp_ignored(const TensorRow& r, const FsdpOptions& o) { return o.ignore_packed_4bit && r.packed_4bit; }

// What FSDP2 and FSDP1 (fsdp1.h) refuse alike under accelerate: other families (no unit hooks), other heads,
// optimizers other than torch AdamW/Adam, quantized or frozen weights, DDP's settings. `v` "FSDP2"/"FSDP1", `flag`
// "fsdp2"/"fsdp1", `wrapper` what the sharding runs ("fully_shard", "FullyShardedDataParallel").
void refuse_under_accelerate_fsdp(const TrainSetup& s, const ModelSpec& m, const char* v, const char* flag,
                                  const char* wrapper);
// accelerate's mixed precision for both versions: bf16-amp -> float32 shards, bf16 gathers and reduces; fp32 and
// bf16 -> the model's dtype throughout; fp16 refused (a sharded gradient scaler).
struct FsdpDtypes {
  DType orig = DType::kF32, param = DType::kF32, reduce = DType::kF32;
  bool mixed = false;
};
FsdpDtypes accelerate_fsdp_dtypes(Precision p, const char* v);

// --cp N with --sharding fsdp2 (context parallel under FSDP2): the FSDP mesh is dp_shard x cp, flattened.
// accelerate 16cb6eb parallelism_config.py: fsdp_dim_names = [..., "dp_shard_cp"], dp_shard_cp_dim_names =
// ["dp_shard", "cp"] (the enabled ones), build_device_mesh: device_mesh[dp_shard_cp_dim_names]._flatten(
// "dp_shard_cp"); utils/fsdp_utils.py fsdp2_prepare_model: fully_shard(mesh=mesh[fsdp_dim_names]). torchtitan
// b5bcd76 distributed/fsdp.py resolve_fsdp_mesh: shard axes ("dp_shard", "cp"). The mesh's size is dp x cp
// (--dp is dp_shard_size; cp 1 without --cp).
uint64_t fsdp2_mesh_ranks(const TrainSetup& s);
// The simulated rank's index in that flattened mesh: the mesh order is [dp_shard, cp] (ParallelismConfig._get_mesh
// mesh_order ["dp_replicate", "dp_shard", "cp", "sp", "tp"]) and DeviceMesh._flatten keeps row-major order, so
// data-parallel rank d's CP rank c is d x cp + c, with d = --dp-rank and c = --cp-rank (0 unless given).
uint64_t fsdp2_mesh_rank(const TrainSetup& s);

// The defaults of the code that runs (cited in fsdp.cc); throws trainmem::Error for what is not simulated.
// Off unless --sharding fsdp2 over more than one rank (fsdp2_mesh_ranks: dp, or dp x cp under --cp).
FsdpOptions resolve_fsdp(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch);

// HSDP's mesh from --dp D and --dp-shard K (fsdp.cc cites the rules): K must divide D, 2 <= K <= D (K = D is plain
// FSDP2); throws FieldError("dp_shard") otherwise. Sets ranks = K (K x C under --cp C: the flattened dp_shard_cp),
// replicate = D / K and the rank's coordinates (dp_shard innermost: --dp-rank d is shard rank d mod K, times C
// under --cp, of replicate group d / K).
void apply_hsdp_mesh(FsdpOptions& f, const TrainSetup& s);
// HSDP's shard degree K when the setup runs fully_shard over a 2-D (dp_replicate, dp_shard) mesh (dp_shard_cp
// under --cp): --sharding fsdp2, --dp-shard K with 1 < K < dp and K dividing dp; 0 otherwise (apply_hsdp_mesh
// refuses the invalid values).
uint64_t hsdp_shard_degree(const TrainSetup& s);
// Whether the rank's FSDP2 is torchtitan's (fp32 parameters with fully_shard's bf16 policy, no autocast:
// resolve_pp_fsdp, resolve_sp_fsdp) rather than accelerate's: --sharding fsdp2 over dp > 1 ranks under a pipeline
// or over the TP + SP model.
bool torchtitan_fsdp2(const TrainSetup& s);
// The shard degree of HSDP sharded within a node, as fit and plan offer it: K = the node's data-parallel ranks
// (gpus_per_node / (tp x cp): tensor and context parallel are the inner mesh dimensions) when 1 < K < dp, K divides
// dp and cp is 1; 0 when no such HSDP exists (under --cp HSDP over the dp_shard x cp mesh is simulated when
// --dp-shard asks for it, and not offered).
uint64_t hsdp_node_shard_degree(uint64_t dp, uint64_t tp, uint64_t cp, uint64_t gpus_per_node);

// One parameter's dim-0 shard (FSDPParam._init_sharded_param: chunks = _chunk_with_empty(tensor, W, dim=0);
// padded_sharded_size = chunks[0].size(); sharded_param = chunks[rank], a view of the padded buffer).
struct FsdpShard {
  uint64_t rows_padded = 0;     // ceil(dim0 / W): every rank's padded dim 0
  uint64_t rows_local = 0;      // this rank's unpadded dim 0 (torch.chunk: min(rows_padded, dim0 - rank * rows_padded))
  uint64_t padded_numel = 0;    // _sharded_param_data: rows_padded x the other dims
  uint64_t local_numel = 0;     // the DTensor's local tensor: rows_local x the other dims
  uint64_t unsharded_padded_numel = 0;  // all_gather_outputs[0]: W x padded_numel
  std::vector<uint64_t> local_shape;    // the optimizer's view of the shard
};
FsdpShard fsdp_shard(const std::vector<uint64_t>& shape, uint64_t ranks, uint64_t rank);

// One fully_shard unit (an FSDPParamGroup) as accelerate's fsdp2_prepare_model makes them: every decoder layer
// (transformer_auto_wrap_policy over _no_split_modules), the input embedding, the tail [final norm, lm_head]
// (reshard_after_forward=False), and the root with what is left.
struct FsdpUnit {
  enum Kind : uint8_t { kEmbed, kLayer, kTail, kRoot } kind = kLayer;
  int32_t layer = -1;                // kLayer: its index
  std::string name;                  // "model.layers.3", "model.embed_tokens", "[model.norm, lm_head]"
  std::vector<int32_t> rows;         // inventory rows, in named_parameters() order
  bool reshard_after_forward = true;
  uint64_t shard_numel = 0;          // all_gather_input_numel: sum of padded shard numels
  uint64_t params = 0;               // sum of unpadded numels
  // The unit's buffers with per-parameter dtypes (fsdp_unit_buffers; they differ under LoRA: frozen base rows in
  // the model's dtype, float32 adapters, only the adapters trainable). Without LoRA: gather_dtype = param_dtype,
  // gather_numel = copy_in_numel (when mixed) = grad_numel = shard_numel.
  DType gather_dtype = DType::kF32;  // all_gather_output's dtype: uint8 when the inputs' dtypes differ
  uint64_t gather_numel = 0;         // all_gather_input_numel in gather_dtype elements (bytes when uint8)
  DType copy_in_dtype = DType::kF32; // the foreach-copy input of the parameters whose param_dtype is set
  uint64_t copy_in_numel = 0;        // its numel (0: no copy-in)
  uint64_t grad_numel = 0;           // padded shard numel of the trainable rows: reduce_scatter_output_numel
  uint64_t trainable_params = 0;     // unpadded numel of the trainable rows
  DType grad_dtype = DType::kF32;    // the unsharded gradients' dtype (the trainable rows' param dtype)
  DType reduce_dtype = DType::kF32;  // foreach_reduce's reduce_dtype (the gradients' when the policy sets none)
  DType grad_orig_dtype = DType::kF32;  // the group's _orig_dtype (the trainable rows'): the sharded gradients'
};
// A parameter's dtypes under fully_shard (FSDPParam.init_dtype_attrs): `orig` the sharded data's (the row's stored
// dtype: stored_dtype(row, o.orig_dtype)), `param` the all-gather and unsharded parameter's (param_dtype when
// the policy sets one that differs from orig, else orig), `copy` whether _get_param_all_gather_inputs's foreach
// copy casts it (param_dtype set).
struct FsdpParamDtypes {
  DType orig = DType::kF32, param = DType::kF32;
  bool copy = false;
};
FsdpParamDtypes fsdp_param_dtypes(const TensorRow& r, const FsdpOptions& o);
// Fills u's buffer fields from its rows (the rules are cited in fsdp.cc); throws trainmem::Error where FSDP2
// asserts (trainable rows of several original dtypes in one group).
void fsdp_unit_buffers(FsdpUnit& u, const Inventory& inv, const FsdpOptions& o);
// Unit id passed to the forward hooks (sim::FsdpHooks): a layer's index, or these.
inline constexpr int32_t kFsdpUnitEmbed = -2;
inline constexpr int32_t kFsdpUnitTail = -3;
inline constexpr int32_t kFsdpUnitRoot = -4;  // the root's own parameters (PEFT: the final norm, FsdpOptions::peft)
// The output projection's start, after the final norm: where the tail unit begins when it is [lm_head] alone (PEFT);
// a no-op otherwise (the tail began at kFsdpUnitTail, before the norm)
inline constexpr int32_t kFsdpUnitLmHead = -5;
std::vector<FsdpUnit> fsdp_units(const ModelSpec& m, const Inventory& inv, const FsdpOptions& o);

// --- torchtitan v0.2.0's FSDP2 policy on a pipeline rank (--pp P --sharding fsdp2 --dp D) ---
// The simulator runs it per stage and per micro-batch in the schedule's order (src/sim/fsdp.cc pp_* and loop.cc
// pp_backward). Differences from accelerate's policy above, one place each:
// - fsdp_torchtitan_pp_options: fp32 sharded parameters (training.dtype "float32"), MixedPrecisionPolicy(param_dtype
//   bf16 = training.mixed_precision_param, reduce_dtype fp32 = training.mixed_precision_reduce), no autocast, and
//   reshard_after_forward False on every unit (fsdp_reshard_after_forward "default" = `not pp_enabled`).
// - fsdp_stage_units: the units of one rank's stage modules (apply_fsdp on the pruned stage model).
FsdpOptions fsdp_torchtitan_pp_options(uint64_t ranks);
// resolve_fsdp's refusals, then the policy above; refuses what it does not simulate (the settings torchtitan does
// not take under a pipeline, training.dtype bfloat16). Off unless --sharding fsdp2 over a dp (x cp) mesh of 2 or
// more ranks.
FsdpOptions resolve_pp_fsdp(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch);
std::vector<FsdpUnit> fsdp_stage_units(const Inventory& stage_inv, const std::vector<PpStagePart>& parts,
                                       const FsdpOptions& o);
// The same split into one FSDP root per stage module (torchtitan's pipeline_llm runs parallelize_fn, hence
// apply_fsdp, on each model part: several roots per rank under interleaved-1f1b): [j] holds parts[j]'s units, rows
// of the rank's inventory.
std::vector<std::vector<FsdpUnit>> fsdp_stage_roots(const Inventory& rank_inv, const std::vector<PpStagePart>& parts,
                                                    const FsdpOptions& o);

// --- torchtitan's FSDP2 policy over the sequence-parallel model (--tp T --sequence-parallel true --dp D
// --sharding fsdp2: torchtitan's 2-D (dp_shard, tp) mesh) ---
// parallelize_hf_transformers (experiments/transformers_modeling_backend/parallelize.py @9810191bb) runs
// apply_non_moe_tp (sp.h), then apply_fsdp on the dp mesh dimension ("fsdp", or ("dp_replicate", "fsdp") for HSDP)
// over the TP-local DTensor parameters: fsdp_units' units (the embedding, each decoder layer, [norm, lm_head],
// the root), fp32 shards (training.dtype "float32"), MixedPrecisionPolicy(param_dtype bf16, reduce_dtype fp32),
// no autocast (maybe_enable_amp: "FSDP handles mixed precision"), reshard_after_forward True on the embedding
// and the layers (policy "default": not pp_enabled; --reshard-after-forward false is policy "never"), False on
// the tail. resolve_fsdp's refusals first; off unless --sequence-parallel true, dp > 1 and --sharding fsdp2.
FsdpOptions resolve_sp_fsdp(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch);
// The FSDP2 policy one rank runs: torchtitan's on a pipeline stage (`pp`: resolve_pp_fsdp), torchtitan's after
// its TP + SP plan (resolve_sp_fsdp), else accelerate's (resolve_fsdp).
FsdpOptions resolve_fsdp2_policy(const TrainSetup& s, const ModelSpec& m, LoopKind loop, TorchVersion torch, bool pp);

}  // namespace trainmem
