// DeepSpeed ZeRO stages 1 and 2, per rank: DeepSpeedZeroOptimizer (deepspeedai/DeepSpeed edaa722, 0.19.6,
// deepspeed/runtime/zero/stage_1_and_2.py) as the HF Trainer's DeepSpeed integration builds it. The partition
// arithmetic is here (pure functions, unit-tested against the source's formulas); the simulator (loop.cc)
// allocates what it says.
#pragma once

#include <cstdint>
#include <vector>

#include "trainmem/inventory.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"

namespace trainmem {

enum class LoopKind;

// The ZeRO optimizer's settings as the modelled run passes them, resolved.
struct ZeroOptions {
  bool on = false;
  uint32_t stage = 0;              // 1 or 2
  uint64_t ranks = 1;              // dp: the data-parallel world size
  uint64_t rank = 0;               // the simulated rank (--dp-rank, default 0)
  uint64_t reduce_bucket_elems = 0;     // reduce_bucket_size, in elements
  uint64_t allgather_bucket_elems = 0;  // allgather_bucket_size, in elements
  bool overlap_comm = false;       // a second IPG buffer (buf_1)
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  // --- stage 3 and offload (appended for ZeRO-3; zero3 below) ---
  bool offload_optimizer = false;  // offload_optimizer.device cpu (stages 1, 2, 3)
  bool offload_params = false;     // offload_param.device cpu (stage 3)
  bool pin_memory = true;          // offload_*.pin_memory: DeepSpeedZeroOffload*Config's default True
  uint64_t param_persistence_threshold = 0;  // stage3_param_persistence_threshold, elements
  uint64_t model_persistence_threshold = 0;  // stage3_model_persistence_threshold, elements
  uint64_t prefetch_bucket_elems = 0;        // stage3_prefetch_bucket_size, elements
  uint64_t max_live_parameters = 0;          // stage3_max_live_parameters, elements (caps the prefetch)
  uint64_t max_reuse_distance = 0;           // stage3_max_reuse_distance, elements
  uint64_t sub_group_size = 0;               // sub_group_size, elements
};

// DeepSpeedZeroConfig's defaults (runtime/zero/config.py, 0.19.6): reduce_bucket_size and allgather_bucket_size
// Field(pp_int(5e8)); overlap_comm None, resolved by overlap_comm_valid to `stage == ZeroStageEnum.weights`
// (False for stages 1 and 2); contiguous_gradients True; reduce_scatter True.
inline constexpr uint64_t kZeroDefaultBucketElems = 500000000;
// stage_1_and_2.py __init__: `self.nccl_start_alignment_factor = 2  # 4-byte alignment/sizeof(fp16) = 2`
inline constexpr uint64_t kZeroNcclStartAlignment = 2;
// DeepSpeedZeroConfig (runtime/zero/config.py, 0.19.6) stage-3 defaults: prefetch_bucket_size Field(pp_int(5e7)),
// param_persistence_threshold Field(pp_int(1e5)), model_persistence_threshold Field(pp_int(sys.maxsize)),
// max_live_parameters Field(pp_int(1e9)), max_reuse_distance Field(pp_int(1e9)), sub_group_size Field(pp_int(1e9))
inline constexpr uint64_t kZero3DefaultPrefetchElems = 50000000;
inline constexpr uint64_t kZero3DefaultPersistenceThreshold = 100000;
inline constexpr uint64_t kZero3DefaultModelPersistence = 9223372036854775807ULL;  // sys.maxsize
inline constexpr uint64_t kZero3DefaultMaxLive = 1000000000;
inline constexpr uint64_t kZero3DefaultMaxReuse = 1000000000;
inline constexpr uint64_t kZero3DefaultSubGroupSize = 1000000000;

// The defaults of the code that runs (cited in zero.cc); throws trainmem::Error for what is not simulated.
// Off (on == false) unless dp > 1 and sharding is zero1/zero2.
ZeroOptions resolve_zero(const TrainSetup& s, LoopKind loop, TorchVersion torch);

// One parameter's place in its group's flat buffer, and the partitions its gradient goes to
// (initialize_gradient_partition: param_to_partition_ids and grad_start_offset).
struct ZeroParamPlace {
  uint64_t start = 0;                 // offset of its first element in the flat buffer
  uint64_t numel = 0;
  std::vector<uint32_t> partitions;   // partition ids it overlaps, ascending
  std::vector<uint64_t> offsets;      // per partition: the offset within the parameter where that part starts
};

// One parameter group's flat buffer, as DeepSpeedZeroOptimizer.__init__ builds it for `rank` of `dp`.
struct ZeroGroupLayout {
  uint64_t numel = 0;           // orig_group_numel: sum of the group's trainable parameters
  uint64_t aligned_numel = 0;   // the flat buffer: ceil(numel / (2 * dp)) * (2 * dp) elements
  uint64_t partition_size = 0;  // aligned_numel / dp: every rank's fp32 master partition
  uint64_t padding = 0;         // groups_padding of `rank`: how much of its partition lies past numel
  uint64_t first_offset = 0;    // offset into the first parameter of params_in_partition
  std::vector<uint32_t> in_partition;  // positions (in the group) of params_in_partition, in order
  uint64_t in_partition_numel = 0;     // sum of their numel: boundary parameters counted in full
  std::vector<ZeroParamPlace> places;  // per parameter of the group
};
ZeroGroupLayout zero_group_layout(const std::vector<uint64_t>& numels, uint64_t dp, uint64_t rank);
// DeepSpeedZeroOptimizer's param groups as the Trainer hands them over (Trainer.create_optimizer): the trainable
// rows of the weight-decayed group, then the rest (in_decay_group), in named_parameters() order; an empty group
// is left out (__init__ reads bit16_groups[i][0].dtype).
std::vector<std::vector<int32_t>> zero_param_groups(const Inventory& inv);
// The rank whose params_in_partition hold the most elements over `groups` (each group's trainable numels, in
// order; boundary parameters in full, as zero_group_layout counts them), and that count. It is the only allocation
// of ZeRO-1/2 whose size depends on the rank (copy_grads_in_partition's grads_in_partition, stage 1's kept
// .grad of the partition's parameters): estimate simulates this rank unless --dp-rank names one. Ties: the lowest.
struct ZeroFullestRank {
  uint64_t rank = 0;
  uint64_t in_partition_numel = 0;
};
// Each zero_param_groups group's numels, in order.
std::vector<std::vector<uint64_t>> zero_group_numels(const Inventory& inv);
ZeroFullestRank zero_fullest_rank(const std::vector<std::vector<uint64_t>>& groups, uint64_t dp);

// The ranks of a ZeRO-1/2 group sorted into classes whose steps are alike: the same params_in_partition, the same
// slices of them (get_flat_partition: the first from first_offset, the last cut at the partition's end, zeros
// padding a short one), which is all of the layout that depends on the rank. Ranks of one class are simulated
// once. Sorted by in_partition_numel, most first (ties: the lowest rank). Only for dp <= kZeroRanksSearched (the
// work is O(dp x parameters)).
struct ZeroRankClass {
  uint64_t rank = 0;                // the lowest rank of the class
  uint64_t ranks = 0;               // how many ranks are alike
  uint64_t in_partition_numel = 0;  // over the groups
};
inline constexpr uint64_t kZeroRanksSearched = 4096;
std::vector<ZeroRankClass> zero_rank_classes(const std::vector<std::vector<uint64_t>>& groups, uint64_t dp);

// averaged_gradients[i] of `layout`'s rank at the boundary (get_flat_partition, return_tensor_list=True): the
// element counts of the narrowed gradients of params_in_partition (the first from first_offset, the last cut at
// partition_size), then the zeros that pad a short partition (or one zeros(partition_size) when the partition
// holds no parameter).
std::vector<uint64_t> zero_partition_slices(const ZeroGroupLayout& layout, std::vector<uint64_t>* pad = nullptr);

// One gradient's slices as average_tensor lists them for the IPG bucket: per parameter in bucket order, its
// partitions' slices sorted by offset, consecutive slices of the same partition merged (rank_and_offsets).
// Returns the merged slices' element counts, in order.
std::vector<uint64_t> zero_bucket_slices(const std::vector<const ZeroParamPlace*>& bucket);

// allreduce_and_scatter over those slices with numel_per_bucket = reduce_bucket_size: a small bucket closes
// when its running numel exceeds the limit; each is flattened (torch's flatten_dense_tensors: a view for one
// tensor, at::cat otherwise) before the all-reduce. Returns, per small bucket, the elements the flatten
// allocates (0 for a single slice: a view).
std::vector<uint64_t> zero_reduce_flat_allocs(const std::vector<uint64_t>& slices, uint64_t reduce_bucket_elems);

// --- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3, runtime/zero/stage3.py; zero.Init, partition_parameters.py) -----

// _partition_param: ds_tensor of tensor_size // world elements, tensor_size = _aligned_size = ds_numel +
// _padding_size (world - numel % world, or 0): ceil(numel / world) elements on every rank.
uint64_t zero3_partition_numel(uint64_t numel, uint64_t world);
// _padding_size: what the last rank's partition holds past the parameter's elements.
uint64_t zero3_padding(uint64_t numel, uint64_t world);

// parameter_offload.py mark_persistent_parameters over named_parameters() in order: skipped once the running
// total would pass model_threshold; persistent when numel <= param_threshold. Returns one flag per parameter.
std::vector<char> zero3_persistent(const std::vector<uint64_t>& numels, uint64_t param_threshold,
                                   uint64_t model_threshold);

// _create_fp16_sub_groups: a group's parameters cut into sub-groups once the running sum of partition_numel
// reaches sub_group_size (the whole group when it is not larger). Returns each sub-group's partition elements.
std::vector<uint64_t> zero3_sub_groups(const std::vector<uint64_t>& partition_numels, uint64_t sub_group_size);

// reduce_scatter_coalesced (runtime/comm/coalesced_collectives.py) over one IPG bucket's gradients: the
// interleaved flat buffer torch.cat builds, world * sum(ceil(numel / world)) elements; 0 when it is a view (one
// tensor whose numel divides by the world).
uint64_t zero3_reduce_scatter_flat(const std::vector<uint64_t>& numels, uint64_t world);

// One rank's ZeRO-3 model states, in elements (what DeepSpeedZeroOptimizer_Stage3 allocates), device or host by
// the offload settings. The parameters here are the trainable ones in the Trainer's groups' order; `frozen` the
// partitions of the others (never in the optimizer).
struct Zero3States {
  uint64_t lp_partitions = 0;     // lp_param_buffer: sum of ds_tensor numel over the trainable parameters
  uint64_t frozen_partitions = 0; // ds_tensors of the parameters outside the optimizer
  uint64_t persistent_full = 0;   // the persistent parameters' full data, kept on the device once gathered
  uint64_t fp32_partitions = 0;   // fp32_partitioned_groups_flat
  uint64_t grad_partitions = 0;   // grad_partitions_flat_buffer (gradient_accumulation_dtype: the model's)
  uint64_t fp32_grad = 0;         // offload: every sub-group's fp32 .grad buffer (pinned); else the step's largest
  std::vector<uint64_t> sub_groups;  // partition elements per sub-group
  uint64_t largest_param = 0;     // the largest parameter, gathered (padded to the world)
};

}  // namespace trainmem
