// The step simulator: runs the training loop tensor by tensor (model load, forward, loss, backward,
// optimizer step, zero_grad) over the simulated PyTorch runtime and returns the timeline with its summary.
#pragma once

#include <string>

#include "trainmem/ddp.h"
#include "trainmem/flops.h"
#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/pp.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"
#include "trainmem/timeline.h"

namespace trainmem {

// The training script around the model: what it keeps alive and when.
enum class LoopKind {
  kAuto,     // the model implementation's own: nanogpt for --impl nanogpt, hf for transformers, plain for stacks
  kNanoGpt,  // nanoGPT train.py: `logits, loss = model(X, Y)` keeps the logits until the next forward
             // returns; the next batch is fetched right after the forward; GradScaler for float16; grad clip
             // 1.0; zero_grad(set_to_none=True)
  kHf,       // transformers Trainer: the batch is moved to the device for each micro-batch, the loss comes
             // from the model's output (logits dropped before backward), grad clip 1.0 (max_grad_norm),
             // zero_grad(set_to_none=True)
  kSeed000,  // the nanoGPT fork of seed 000 (as its memory trace shows): loss computed outside the model and
             // the logits dropped before backward, next batch prefetched, GradScaler, grad clip 1.0, gradients
             // kept between steps (zero_grad(set_to_none=False))
  kPlain,    // `loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()` (seed 003)
};
std::span<const NameRow<LoopKind>> name_table(LoopKind);  // auto, nanogpt, hf, seed000, plain
std::string_view loop_name(LoopKind k);
// The script that runs, for report headers: "hf loop", or "model.eval()" for --task inference.
std::string loop_label(const TrainSetup& s, LoopKind k);
std::optional<LoopKind> parse_loop(std::string_view s);
LoopKind default_loop(const ModelSpec& m);
// `o` with kAuto replaced by the model's default loop.
struct SimOptions;
SimOptions resolved(const SimOptions& o, const ModelSpec& m);

struct SimOptions {
  LoopKind loop = LoopKind::kAuto;
  TorchVersion torch{2, 9};
  uint32_t sm = 80;
  // The device's SM count, which sizes the reduction kernels' staging buffers (cuda_reduce.h); without a card,
  // the generic sm_80 device's
  uint32_t multiprocessors = kGenericGpuMultiprocessors;
  uint32_t steps = 2;  // optimizer steps to run (the first creates the optimizer state)
  PpOptions pp;        // --pp > 1: the simulated rank's pipeline stage and schedule (pp.h); estimate() sets it
  // Internal (no CLI option): a pipeline rank replays the micro-batches that repeat an earlier one's events
  // (src/sim/memo.h) instead of simulating them; the same output byte for byte. False simulates every action
  // (tests/unit/memo_test.cc compares the two).
  bool memo = true;
};

// A moment of the timeline: the event index and the live bytes right after it.
struct Moment {
  size_t event = 0;
  Phase phase = Phase::kSetup;
  uint32_t step = 0, micro = 0;
  LiveBytes live;
};

struct SimResult {
  Timeline timeline;
  Moment peak;                  // the highest total of live requested bytes
  Moment steady;                // just before a forward once the loop is in steady state
  Moment after_forward;         // right after the loss of the steady micro-batch (before backward); with
                                // --generate, after the prefill
  Moment generation_end;        // --generate: after the last new token, before generate() frees the cache
  Bytes saved_activations;      // storages autograd holds at the end of that forward, each once, excluding
                                // parameters and buffers (requested bytes)
  Bytes activations_at_peak;    // activations + autocast copies + backward in flight + temporaries at the peak
  uint32_t micro_batches_simulated = 0;
  std::vector<uint8_t> param_has_grad;  // per inventory row: a .grad after the last step's backward
  std::vector<std::string> warnings;    // what the simulated program would warn about
  // DDP (dp > 1): the Reducer's buckets in its order: [0] at construction, [1] after the rebuild at the first
  // forward after a synced backward (absent when it does not rebuild)
  std::vector<std::vector<DdpBucket>> ddp_buckets;
  uint32_t ddp_rebuild_step = 0;  // the optimizer step whose forward rebuilt them (0: no rebuild simulated)
  FlopLedger flops;               // the FLOPs and bytes of the last simulated step's kernels (flops.h)
  // Diagnostics of the memoized pipeline actions (src/sim/memo.h), not reported: actions replayed, and whether the
  // run fell back to simulating every action (a replayed forward whose backward's state differed from its
  // template's)
  uint64_t memo_replayed = 0;
  bool memo_fell_back = false;
};

SimResult simulate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o);

}  // namespace trainmem
