// Memoized pipeline actions: a pipeline rank runs the same forward and backward of a stage for micro-batch after
// micro-batch, and most of them emit exactly the events of an earlier one up to a renaming of storage ids. The
// loop (Loop::pp_train) asks ActionMemo before each action; a micro-batch whose forward and backward match a
// recorded pair (its "template") has both replayed from the template's events instead of simulated, and the
// result is the same timeline, byte for byte, as the full simulation's (tests/unit/memo_test.cc compares every
// event, with memoization on and off, over the pipeline configurations).
//
// WHY A REPLAY IS EXACT (the argument the design rests on; each rule below is checked where it is cited)
//
// 1. What an action reads. A pipeline action is pp_forward or pp_backward of one (stage, micro-batch). Its code
//    reads: the forward program and the model (the same for every action of the stage: program, ModelSpec,
//    TrainSetup, the stage's part, the LoadedModel's parameter handles, which FSDP2 swaps per unit); the Ctx (its
//    flags, the autocast cache, the FSDP2 root the step's previous forward left there, which a checkpoint's
//    recompute in backward reads); the engine (grad mode, stream, phase, count weight, the workspaces of the
//    thread its gemms run on made or not, the .grad of its own stage's parameters made or not (a stage's graph
//    accumulates into its own rows only, its FSDP2 root's hooks touch its own units' rows, tied embeddings are
//    refused under --pp, clipping and the optimizer run outside actions; rule 3 still compares every .grad
//    handle), the count_step filter, the
//    nodes of its own graph only: a backward walks from its root and frees its own graph tag); its stage's FSDP2
//    root (Fsdp2::memo_key: every value the hooks branch on, pre_backward's prefetch reduced to whether it has an
//    effect, the backward-only state in a backward's key only); and, for the storage ids it names, the ids the
//    engine hands out next. The key (key_of) is the action's static position (stage, forward or backward, the
//    stage's first forward, first and last backward of the step, the stage of the previous forward) followed by
//    the state words the loop computes (Loop::memo_probe) from those values; where a value is a handle the key
//    holds whether it exists, and rules 2 and 3 make that enough (no event of a replay names a handle's storage,
//    and no template changes a handle).
//    Not covered, so every action is simulated (Loop::memo_allowed): gradient hooks that read more (DDP's Reducer,
//    DeepSpeed ZeRO's, FSDP1's, the optimizer in backward), ZeRO-3's parameter-use and pre-node hooks, LoRA,
//    4-bit weights, the encoders' extra inputs, and a later stage under PyTorch 2.10 and later (its backward
//    leaves its input's gradient in a per-stage handle, PpLocal::sending). Context parallelism is covered: the
//    ring's buffers are the SDPA call's own, allocated and freed inside it, and its node saves what flash's does.
// 2. What an action writes, and how a replay writes the same. Events: the template's, read from the timeline
//    (never changed once written), with their step and micro-batch set and each storage id renamed: an id the
//    template's action allocated is its offset in that action's range of new ids (ids are handed out in order,
//    Engine::alloc_storage); in a backward, an id the template's forward allocated is its offset in that forward's
//    range; any other id must be "fixed": allocated before the pipeline's first action (parameters, FSDP2's
//    unsharded parameters) and none of the per-micro-batch or per-step storages the loop names (roles: receive
//    buffers, the batch). An action whose events name any other storage is not a template. Live bytes and the
//    peak follow from the events (Engine::replay_event, as emit and emit_alloc). The storage table gets the
//    template's entries for the renamed ids (a forward's at its end, a backward's and its forward's after the
//    backward) and the fixed ids' state after it (category, resize, stream, label). The node sequence advances by
//    the template's count; the FLOP ledger gets the template's recorded counts (Engine::CountCall, filtered by the
//    replaying step). The stage's FSDP2 root changes by the template's delta (Fsdp2::memo_delta: unit states set,
//    the flags set where the template changed them, the post-forward order extended, indices pushed and popped),
//    which applies to any state with the same key; every other root must not change. The Ctx gets the stage's
//    root as pp_stage_forward leaves it (the loop, after a replayed forward).
// 3. Nothing else changes. A template's action must leave every persistent handle as it found it: the engine's
//    workspaces, .grad handles and leaves' gradients, FSDP2's handles (memo_delta), the autocast cache, the
//    warnings and the Ctx fields it sets and restores. The loop's per-step lists (the last stage's outputs and
//    losses, a later stage's input gradients) may grow by handles on the action's own storages (escapes), which
//    a replay appends too (Engine::adopt). What a forward allocated must be held only by its own graph and chunk and the escapes (live at the
//    forward's end, untouched until its backward begins, freed by its backward's end but the escapes, each held by
//    its list alone); what its backward allocated likewise. So between a replayed forward and its backward the
//    only thing missing is the micro-batch's graph and chunk, which nothing but that backward reads: the storages
//    its graph saves are kept as a phantom graph for saved_bytes() (Engine::phantoms), and a backward that frees
//    the last real graph while a phantom is pending does not clear the leaves' gradients (Engine::backward).
// 4. The pairing. A forward is replayed only from a pair whose backward's static position is the one this
//    micro-batch's backward will have (known from the schedule), or from a recorded forward with that backward
//    position whose backward has not run yet (a pipeline's warm-up forwards): when this micro-batch's backward
//    comes, that template must have become a pair (its backward recorded and passing rule 3) and the full key
//    is compared; if either fails (a state the forward's replay could not foresee) the run throws MemoMismatch
//    and simulate() runs the whole simulation again without memoization: a mismatch costs time, never a byte.
// Templates are per simulation (an ActionMemo lives in the Loop): no cache outlives a call or is shared across
// threads.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "engine.h"
#include "fsdp.h"

namespace trainmem::sim {

// A replayed forward's backward found a key its template's backward did not have: rerun without memoization.
struct MemoMismatch {};

// The static position of one action (the key's first words).
struct MemoAction {
  uint64_t stage = 0;  // the index of the rank's stage (PpLocal) it runs
  uint64_t micro = 0;
  bool forward = true;
  bool first_forward = false;   // the stage's first forward of the step
  bool first_backward = false;  // the stage's first backward of the step
  bool last_backward = false;   // the stage's last backward of the step (FSDP2's reduce-scatters follow it)
  // the stage of the step's last forward before it (the step's last forward for the first actions): the FSDP2
  // root it left in Ctx::fsdp, which a checkpoint's recompute in backward reads
  uint64_t previous_forward_stage = 0;
  uint32_t graph = 0;           // Engine::graph while it runs
};

// What the loop supplies about the state around an action (Loop::memo_probe).
struct MemoProbe {
  std::vector<uint64_t> words;       // the key's state words (rule 1)
  std::vector<uint64_t> persistent;  // the persistent handles' storage ids and the lists' sizes (rule 3)
  std::vector<Fsdp2*> roots;         // the rank's FSDP2 roots (their snapshots and deltas)
  // the loop's per-step lists an action may append to (outputs, losses, input gradients): what it appends is a
  // handle on a storage of its own or its forward's (an escape, rule 3), which a replay appends too
  std::vector<std::vector<T>*> lists;
};

class ActionMemo {
 public:
  // `fixed_below`: storages before the first action; `role_ids`: every per-micro-batch or per-step storage the loop
  // names (none of them is fixed); `probe`: computes the MemoProbe of the current state for an action of the
  // rank's stage (MemoAction::stage) given.
  ActionMemo(Engine& e, uint64_t fixed_below, std::function<MemoProbe(uint64_t stage)> probe);
  ~ActionMemo() { e_.count_tape = nullptr; }  // (an action that threw leaves the engine recording into tape_)
  ActionMemo(const ActionMemo&) = delete;
  ActionMemo& operator=(const ActionMemo&) = delete;
  // The per-step roles: the batch's storages change every step (set before the step's first action).
  void set_roles(std::vector<uint64_t> all_role_ids) { all_roles_ = std::move(all_role_ids); }

  // A forward: replays it when a pair or a recorded forward matches (true), else false and the caller simulates it
  // between begin() and end(). `backward`: the static position of the same micro-batch's backward. `roles`: the storage
  // of each role for this micro-batch (UINT64_MAX: none), the same roles in the same order for every action.
  bool replay_forward(const MemoAction& a, const MemoAction& backward, const std::vector<uint64_t>& roles);
  // A backward: replays it when its forward was replayed (throws MemoMismatch when the key differs from the
  // template's), else false.
  bool replay_backward(const MemoAction& a);
  // Around an action simulated: records it when it may become a template (a forward whose key has no pair or
  // recorded forward yet; the backward of a recorded forward), else nothing. `backward`: a forward's backward's
  // static position.
  void begin(const MemoAction& a, const std::vector<uint64_t>& roles, const MemoAction* backward = nullptr);
  void end(const MemoAction& a);

  uint64_t replayed() const { return replayed_; }  // actions replayed (for tests)

 private:
  enum Kind : uint8_t { kInside, kForward, kFixed };
  // One recorded action: its events are the timeline's [ev0, ev1) (never changed once recorded); a storage id in
  // them is the action's own when >= st0, its forward's (a backward's) when in [f_st0, f_st1), else fixed.
  struct Segment {
    std::vector<uint64_t> key;
    size_t ev0 = 0, ev1 = 0;
    uint64_t st0 = 0, st1 = 0, f_st0 = 0, f_st1 = 0;
    std::vector<StorageInfo> inside_final;  // a forward's range at its end (its backward changes the table's)
    std::vector<std::pair<uint64_t, StorageInfo>> fixed_final;  // fixed storages it touched, after it
    uint64_t seq = 0;
    std::vector<Engine::CountCall> counts;
    std::vector<Fsdp2::MemoDelta> fsdp;  // the stage's root's, when it has one
    struct Escape {  // a handle appended to list `list` on the storage (kind, offset)
      uint8_t list = 0;
      size_t pos = 0;  // its index in the list (the template's)
      Kind kind = kInside;
      uint64_t off = 0;
      TensorImpl like;  // its shape, strides, dtype and label
      uint32_t refs = 0;  // the storage's references at the action's end
    };
    std::vector<Escape> escapes;
    bool ok = false;
  };
  struct Pair {
    Segment f, b;
    // the forward graph's kept and saved storages (Engine::kept_ids): (kInside, offset), (kFixed, id), or (role
    // index + 3)
    std::array<std::vector<std::pair<uint8_t, uint64_t>>, 2> saved;
    std::vector<std::pair<uint64_t, StorageInfo>> escaped_final;  // the escapes' entries at the backward's end
  };
  struct Pending {  // a recorded forward, until its backward
    uint64_t serial = 0;  // its number among the recorded forwards (completed_ names the pair it became)
    Segment f;
    std::vector<uint64_t> b_static;
    std::array<std::vector<std::pair<uint8_t, uint64_t>>, 2> saved;
    std::vector<std::pair<uint64_t, Category>> live;  // its storages live at its end
    bool ok = false;
  };
  struct Phantom {  // a replayed forward, until its backward
    // its template: pairs_[pair], or (from_pending) the recorded forward `serial`, whose backward had not run
    // then: the pair that forward became (completed_), when its backward comes
    size_t pair = 0;
    bool from_pending = false;
    uint64_t serial = 0;
    uint64_t st0 = 0;
    uint32_t graph = 0;
  };
  std::vector<uint64_t> key_of(const MemoAction& a, const MemoProbe& p) const;
  bool fixed(uint64_t id) const;
  void emit(const Segment& s, uint64_t inside0, uint64_t forward0);
  void escape(const Segment& s, const MemoProbe& p, uint64_t inside0, uint64_t forward0);

  Engine& e_;
  uint64_t fixed_below_;
  std::function<MemoProbe(uint64_t)> probe_;
  std::vector<uint64_t> all_roles_;  // sorted
  std::vector<Pair> pairs_;
  std::map<std::pair<uint64_t, uint64_t>, Pending> pending_;  // by (stage, micro)
  std::map<std::pair<uint64_t, uint64_t>, Phantom> phantoms_;
  std::map<uint64_t, size_t> completed_;  // a recorded forward's serial -> the pair it became
  uint64_t serials_ = 0;
  // the action being recorded
  bool recording_ = false;
  Segment cur_;
  MemoProbe before_;
  std::vector<uint64_t> b_static_;
  std::vector<Fsdp2::MemoSnapshot> snaps_;
  std::vector<std::vector<uint64_t>> lists0_;  // the lists' storages before the action
  std::vector<uint64_t> roles_;
  std::vector<Engine::CountCall> tape_;
  bool rest0_ = false;
  uint64_t replayed_ = 0;
};

}  // namespace trainmem::sim
