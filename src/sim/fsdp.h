// FSDP2 (fully_shard) per rank in the simulator: the sharded parameters, the all-gathers before each unit, the
// reshard after it, the backward prefetch, and the reduce-scatter of each unit's gradients, as
// torch/distributed/fsdp/_fully_shard/ runs them (the arithmetic: trainmem/fsdp.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "forward.h"
#include "trainmem/fsdp.h"

namespace trainmem::sim {

class Fsdp2 : public FsdpHooks {
 public:
  // `root`: this FSDP root's index on the rank (0 but under a pipeline with several stage modules per rank, where
  // each model part is its own root with its own streams: fsdp2_root_stream)
  Fsdp2(Engine& e, const Inventory& inv, const FsdpOptions& o, std::vector<FsdpUnit> units, size_t root = 0);
  // fully_shard over the model as fsdp2_prepare_model calls it: per parameter the padded dim-0 shard (the module
  // then holds the sharded parameter) and the unsharded parameter, whose storage starts freed. Loads the model
  // into `w` (buffers as load_model does).
  void load(LoadedModel& w, DType buffer_dtype);
  // The same for several roots on one rank (torchtitan's apply_fsdp on each pipeline model part): one load of the
  // rank's model, each parameter sharded by the root whose unit holds it.
  static void load_roots(const std::vector<Fsdp2*>& roots, LoadedModel& w, DType buffer_dtype);
  T pre_forward(Ctx& c, int32_t unit, T input) override;
  T post_forward(Ctx& c, int32_t unit, T output) override;
  // The root module's post-forward (FSDPState._post_forward of the iteration's forward root): the last
  // all-gather output kept for overlap is freed.
  void root_post_forward();
  // The root module's pre-forward when the root unit holds parameters (PEFT's final norm): their all-gather.
  void root_pre_forward();
  // Row i's unsharded parameter (autograd's leaf while its unit is unsharded): PEFT's adapters as the program
  // uses them (LoraPolicy)
  const T& unsharded(size_t i) const { return unsharded_[i]; }
  // _root_post_backward_final_callback, queued by the first pre-backward hook: post_backward of the units whose
  // inputs needed no gradient (the embedding), then the last reduce-scatter input freed. The sharded gradients
  // become the parameters' .grad for the optimizer.
  void final_callback();
  // The sharded gradients (DTensor .grad), per inventory row: views of each unit's reduce-scatter result.
  std::vector<T>& sharded_grads() { return sgrad_; }
  // FSDPModule.set_requires_gradient_sync, as accelerate's no_sync sets it around every micro-batch but the
  // last (the Trainer's `context = partial(accelerator.no_sync, model=model) if i != len(batch_samples) - 1`)
  void set_requires_gradient_sync(bool sync) { reduce_grads_ = sync; }

  // --- under a pipeline (torch/distributed/pipelining/stage.py, PyTorch 2.9): torchtitan's stage module is the
  // FSDP root; its units are the stage's (fsdp_stage_units) ---
  // backward_maybe_with_nosync before each micro-batch's backward: set_is_last_backward(False),
  // set_reshard_after_backward(False), set_requires_gradient_sync(False)
  void pp_begin_backward();
  // the _root_post_backward_final_callback that the backward queued (is_last_backward False): post_backward of the
  // units autograd did not reach (the first stage's embedding), every state IDLE; no finalize
  void pp_end_backward();
  // After the last micro-batch's backward ("Manually call post backward for FSDP"): set_is_last_backward(True),
  // set_reshard_after_backward(True), set_requires_gradient_sync(True), post_backward of every param group in
  // all_states order (the reduce-scatters), then _root_post_backward_final_callback (finalize)
  void pp_post_backward();

  // --- memoized pipeline actions (memo.h) ---
  // Everything of this root that a pipeline action reads or changes, as plain values (storage ids, UINT64_MAX for
  // none): each unit's training state, unsharded flag, all-gather result, all-reduce state and post-forward
  // indices; the comm context's all-gather and reduce-scatter states and post-forward order; the two flags the
  // pipeline sets; per row the sharded gradient and the accumulated unsharded gradient.
  struct MemoSnapshot {
    std::vector<uint8_t> state, unsharded;
    std::vector<uint64_t> ag_result, ar_state;
    std::vector<std::vector<size_t>> indices;
    std::vector<size_t> order;
    uint64_t ag_state = UINT64_MAX, rs_state = UINT64_MAX;
    bool reduce_grads = true, reshard_after_backward = true;
    std::vector<uint64_t> sgrad, accumulated;
    bool operator==(const MemoSnapshot&) const = default;
  };
  MemoSnapshot memo_snapshot() const;
  // The key words of this root (memo.h): every value the hooks branch on, with the post-forward indices reduced to
  // what pre_backward reads of them (whether a unit has one, and the unit its top one names as prefetch target),
  // which only a backward's key holds: pre_backward runs in backward only (the pre-backward hook's node).
  void memo_key(std::vector<uint64_t>& out, bool backward) const;
  // What an action did to the root, as a change that applies to any state with the same key: the units' states
  // and unsharded flags after it, the units appended to the post-forward order (each pushing its position on its
  // unit's indices), the indices each unit popped, and the flags. nullopt when the action did anything else (a
  // handle made, kept or dropped; the order cleared): such an action is not memoized.
  struct MemoDelta {
    std::vector<uint8_t> state, unsharded;
    std::vector<size_t> order_tail;
    std::vector<uint32_t> pops;
    // the flags the action set, when it changed them (-1: left as they were; a forward's key does not hold them)
    int8_t reduce_grads = -1, reshard_after_backward = -1;
  };
  static std::optional<MemoDelta> memo_delta(const MemoSnapshot& before, const MemoSnapshot& after);
  void memo_apply(const MemoDelta& d);

 private:
  enum class State : uint8_t { kIdle, kForward, kPreBackward, kPostBackward };
  struct Unit {
    FsdpUnit spec;
    State state = State::kIdle;
    bool unsharded = false;
    T ag_result;                         // _all_gather_result: the flat all-gather output until copy-out
    T ar_state;                          // HSDP: _all_reduce_state's all_reduce_input (the reduce-dtype output)
    std::vector<size_t> post_forward_indices;  // _post_forward_indices
  };
  Unit& unit(int32_t id);
  T shard_row(size_t i, int32_t layer);  // load: row i's padded shard and its unsharded parameter
  std::vector<T> move_then_shard();      // load under accelerate: every unit's shards, in fully_shard's order
  void shard_on_device(LoadedModel& w, DType model_dtype);  // load of a 4-bit base: whole on the GPU, then shards
  std::vector<const Unit*> wrapping_order() const;  // fsdp2_prepare_model's fully_shard calls
  void unshard(Unit& u);
  void wait_for_unshard(Unit& u);
  void reshard(Unit& u);
  void pre_backward(Unit& u);
  void post_backward(Unit& u);
  void set_module_params(const Unit& u, bool unsharded);
  T backward_hook(const char* name, T x, size_t ui, bool post);

  Engine& e_;
  const Inventory& inv_;
  FsdpOptions o_;
  std::vector<Unit> units_;
  LoadedModel* w_ = nullptr;
  std::vector<T> unsharded_;  // per row: the unsharded parameter (autograd's leaf)
  std::vector<T> sharded_;    // per row: the sharded parameter (a view of its padded shard)
  std::vector<T> sgrad_;      // per row: the sharded gradient
  T ag_state_;                // comm_ctx.all_gather_state: the forward's last all-gather output
  T rs_state_;                // comm_ctx.reduce_scatter_state: the last reduce-scatter input
  std::vector<size_t> post_forward_order_;  // comm_ctx.post_forward_order (unit indices)
  bool reduce_grads_ = true;  // FSDPParamGroup.reduce_grads
  bool reshard_after_backward_ = true;  // FSDPParamGroup.reshard_after_backward
  std::vector<T> accumulated_;  // per row: FSDPParam.unsharded_accumulated_grad (the reduce dtype)
  // unit(id)'s index: the embedding's, the tail's (-1: none), the first layer unit's and its layer
  int64_t embed_ = -1, tail_ = -1, layer0_ = -1, root_unit_ = -1;
  int32_t first_layer_ = 0;
  size_t root_ = 0;
};

}  // namespace trainmem::sim
