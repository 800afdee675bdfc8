// FSDP1 (FullyShardedDataParallel) per rank in the simulator: each unit's sharded FlatParameter, the all-gather
// into its padded unsharded flat parameter before the unit runs, the reshard after it, the unsharded flat gradient
// reduce-scattered in the post-backward hook, as torch/distributed/fsdp/_runtime_utils.py and _flat_param.py run
// them (the arithmetic: trainmem/fsdp1.h).
#pragma once

#include <vector>

#include "forward.h"
#include "trainmem/fsdp.h"  // kFsdpUnitEmbed, kFsdpUnitTail: the hook ids the forward programs pass
#include "trainmem/fsdp1.h"

namespace trainmem::sim {

class Fsdp1 : public FsdpHooks {
 public:
  Fsdp1(Engine& e, const Inventory& inv, const Fsdp1Options& o, std::vector<Fsdp1Unit> units);
  // The optimizer's view of row i: its elements in this rank's shard (0: not in the shard, no .grad, no state).
  uint64_t numel_in_shard(size_t row) const { return in_shard_[row]; }
  // The engine's post_accumulate_grad: row r's gradient reached its AccumulateGrad. When every row of a unit has
  // its gradient, the unit's FlatParameter gets its flat gradient (SplitWithSizesBackward's cat) and its
  // post-backward hook runs.
  void grad_ready(int32_t row);
  // The root's pre-backward hook on the loss: queues the final callback, clears the flat gradients' info, and with
  // BACKWARD_PRE prefetches the last unit of the forward.
  void root_pre_backward();
  // _post_backward_final_callback -> _finalize_params: the sharded gradients become the original parameters'
  // .grad views for the optimizer (use_orig_params: _use_sharded_grad_views).
  void final_callback();
  // FullyShardedDataParallel.no_sync (accelerate's Accelerator.no_sync -> model.no_sync for FSDP1): every state's
  // _sync_gradients is False inside it, the Trainer's micro-batches but the last (sync false).
  void set_sync(bool sync) { sync_ = sync; }
  // The root's _post_forward once the model's forward returns (its unsharded flat parameter is kept for backward)
  void root_post_forward();
  // The root FSDP's forward (FullyShardedDataParallel.forward) starts at kFsdpUnitEmbed's pre-forward; the layers'
  // at theirs; kFsdpUnitTail's hooks are the root's own module code (no unit boundary).
  T post_forward(Ctx& c, int32_t unit, T output) override;
  T pre_forward(Ctx& c, int32_t unit, T input) override;
  // The Trainer leaves the model on the CPU (place_model_on_device False under FSDP) and accelerate's prepare_model
  // wraps FSDP(model, device_id=...): per unit, in wrapping order, the parameters moved to the device, flattened and
  // sharded. Loads the buffers and the model's parameter handles into `w`.
  void load(LoadedModel& w, DType model_dtype);

 private:
  struct Unit {
    Fsdp1Unit spec;
    T full;           // _full_param_padded: W x S in param_dtype (storage resized to 0 while sharded)
    T local;          // _local_shard: S in orig dtype
    T mp;             // _mp_shard: S in param_dtype (mixed precision), resized to 0 between unshards
    T saved_grad;     // _saved_grad_shard / flat_param.grad: S in orig dtype
    T unsharded_grad; // flat_param.grad kept by no_sync: the unpadded unsharded flat gradient in param_dtype
    bool grad_views = false;  // the original parameters' .grad set by _use_unsharded_grad_views (not None)
    bool unsharded = false;
    bool post_backward_done = false;
    size_t grads = 0;  // rows whose gradient arrived this backward
    int64_t post_forward_index = -1;
  };
  Unit& unit(int32_t id);
  bool holds_buffer(const Unit& u, const std::string& name) const;
  void sync_module_states(const Unit& u, DType model_dtype);
  void lazy_init();
  void unshard(Unit& u);
  void reshard(Unit& u);
  void pre_backward(Unit& u);
  void post_backward(Unit& u);
  void use_unsharded_grad_views(Unit& u);
  T pre_backward_hook(T x, size_t ui);

  Engine& e_;
  const Inventory& inv_;
  Fsdp1Options o_;
  std::vector<Unit> units_;  // wrapping order: the layers, then the root
  std::vector<int32_t> unit_of_;   // per row: its unit's index
  std::vector<uint64_t> in_shard_;  // per row: numel_in_shard on this rank
  std::vector<T> sharded_view_;     // per row: the sharded view (orig dtype) the optimizer steps
  std::vector<T> unsharded_;        // per row: the original parameter viewing the unit's _full_param_padded
  std::vector<size_t> post_forward_order_;  // _exec_order_data.handles_post_forward_order (unit indices)
  LoadedModel* w_ = nullptr;
  bool lazy_done_ = false;
  bool sync_ = true;  // _sync_gradients
  size_t root_ = 0;
  int32_t first_layer_ = 0;
};

}  // namespace trainmem::sim
