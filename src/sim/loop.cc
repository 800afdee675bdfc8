// The training loop around the model, per LoopKind: what it allocates and keeps alive between the
// model's forward and the optimizer's step.
#include <fmt/format.h>

#include <algorithm>

#include "../families/registry.h"
#include "forward.h"
#include "trainmem/error.h"
#include "trainmem/sim.h"

namespace trainmem {

namespace {
constexpr NameRow<LoopKind> kLoops[] = {
    {LoopKind::kAuto, "auto", "the model implementation's own loop"},
    {LoopKind::kNanoGpt, "nanogpt", "nanoGPT train.py"},
    {LoopKind::kHf, "hf", "transformers Trainer"},
    {LoopKind::kSeed000, "seed000", "the nanoGPT fork of seed 000's memory trace"},
    {LoopKind::kPlain, "plain", "loss = model(x).sum(); backward; step; zero_grad (seed 003)"},
};
}  // namespace

std::span<const NameRow<LoopKind>> name_table(LoopKind) { return kLoops; }
std::string_view loop_name(LoopKind k) { return name_of(k); }

// "auto" is the default, not a spelling the CLI accepts for --loop
std::optional<LoopKind> parse_loop(std::string_view s) {
  const auto k = parse_name<LoopKind>(s);
  return k == LoopKind::kAuto ? std::nullopt : k;
}

SimOptions resolved(const SimOptions& o, const ModelSpec& m) {
  SimOptions r = o;
  if (r.loop == LoopKind::kAuto) r.loop = default_loop(m);
  return r;
}

// nanoGPT's train.py for nanoGPT's model, the Trainer for transformers' models, seed 003's plain loop for a
// layer stack: the registry's program says which.
LoopKind default_loop(const ModelSpec& m) { return program_for(m).loop; }

namespace sim {

namespace {


// multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): kChunkSize elements per chunk; _foreach_norm
// keeps one float partial per chunk of every tensor.
constexpr uint64_t kForeachChunkElems = 65536;

struct Loop {
  const ModelSpec& m;
  const Inventory& inv;
  const TrainSetup& s;
  const SimOptions& o;
  Engine& e;
  Ctx c;
  LoadedModel w;
  OptimizerImpl opt_impl;
  bool scaler;  // GradScaler active: float16 autocast
  T scale, growth_tracker;  // GradScaler state
  std::vector<T> state;     // optimizer state tensors, created on the first step
  T X, Y;                   // the current batch
  T kept_logits;            // nanoGPT: `logits` lives until the next forward returns
  T kept_loss;              // the training script's `loss` variable, rebound each micro-batch
  const Program& program;   // the family's forward for this implementation (src/families/registry.cc)
  const bool features;      // a float feature batch without targets (InputKind::kFeatures)

  Loop(const ModelSpec& m_, const Inventory& inv_, const TrainSetup& s_, const SimOptions& o_, Engine& e_)
      : m(m_), inv(inv_), s(s_), o(o_), e(e_), c(e_), program(program_for(m_)), features(input_kind(m_) == InputKind::kFeatures) {}

  T batch_tensor(const char* what) {
    if (features) {
      return e.leaf(Shape{s.batch, m.stack_input}, param_dtype(s.precision), Category::kInputs, Label{what});
    }
    return e.leaf(Shape{s.batch, s.seq}, DType::kI64, Category::kInputs, Label{what});
  }

  void get_batch() {
    // x, y = x.to(device), y.to(device): x first. Rebinding releases the previous batch unless autograd
    // still holds it (embedding saves the ids, nll_loss the targets).
    T x = batch_tensor(features ? "input x" : "input ids");
    T y = features ? T() : batch_tensor("targets");
    X = std::move(x);
    Y = std::move(y);
  }

  // The seed 000 fork warms cuBLAS up before building the model (its dummy_step): seed 000's workspace demo,
  // out = a.mm(a); out.backward(gradient) with 2x2 float32 tensors.
  void warmup() {
    const Shape s2{2, 2};
    auto t = [&](const char* what) { return e.empty(s2, DType::kF32, Category::kTemporaries, Label{what}); };
    e.phase = Phase::kSetup;
    T a = t("warm-up a");
    T out = t("warm-up a.mm(a)");
    e.gemm(false);  // the Python thread's cuBLAS workspace
    T gradient = t("warm-up gradient");
    e.phase = Phase::kBackward;
    T g_mat2 = t("warm-up grad");
    e.gemm(false);  // the autograd thread's cuBLAS workspace
    { T g_self = t("warm-up grad"); }  // summed into the first in place
    e.phase = Phase::kSetup;
  }

  ForwardOut run_forward(const T* targets) { return program.forward(c, m, w, X, targets); }

  T scale_loss(T loss) {
    // loss = loss / gradient_accumulation_steps (a python number: a new 0-dim tensor)
    if (s.grad_accum > 1 || o.loop == LoopKind::kNanoGpt || o.loop == LoopKind::kSeed000) {
      loss = mul_scalar(c, loss, "loss / grad_accum");
    }
    return loss;
  }

  T scaler_scale(const T& loss) {
    if (!scaler) return loss;
    if (!scale) {
      // GradScaler._lazy_init_scale_growth_tracker: _scale (float32) and _growth_tracker (int32)
      scale = e.leaf(Shape{}, DType::kF32, Category::kTemporaries, Label{"GradScaler _scale"});
      growth_tracker = e.leaf(Shape{}, DType::kI32, Category::kTemporaries, Label{"GradScaler _growth_tracker"});
    }
    return mul(c, loss, scale, "scaled loss");  // outputs * self._scale
  }

  // One micro-batch: forward (+ loss) under autocast, then backward.
  void micro_batch(uint32_t step, uint32_t micro, SimResult& r, bool record) {
    e.step = step;
    e.micro = micro;
    e.phase = Phase::kForward;
    if (o.loop == LoopKind::kHf) get_batch();  // Trainer: _prepare_inputs moves this micro-batch's tensors
    T loss;
    {
      ForwardOut out;
      if (o.loop == LoopKind::kSeed000) {
        out = run_forward(nullptr);
        e.phase = Phase::kLoss;
        // model_step: F.cross_entropy(logits.view(-1, V), Y.view(-1)) outside the model; the logits are not
        // kept.
        const uint64_t V = out.logits.shape().back();
        const T flat = view(c, out.logits, Shape{out.logits.shape().numel().value / V, V});
        const T tflat = view(c, Y, Shape{Y.shape().numel().value});
        out.loss = cross_entropy(c, flat, tflat);
        out.logits.reset();
      } else if (features) {
        out = run_forward(nullptr);
        e.phase = Phase::kLoss;
        out.loss = sum_loss(c, out.logits);  // loss = y.sum()
        kept_logits = std::move(out.logits);  // `y = model(x)` stays bound until the next forward
      } else {
        out = run_forward(&Y);
        if (o.loop == LoopKind::kNanoGpt) kept_logits = std::move(out.logits);  // `logits, loss = model(X, Y)`
      }
      e.phase = Phase::kLoss;
      kept_loss.reset();  // `loss = model(...)` rebinds the script's variable
      loss = scale_loss(std::move(out.loss));
      c.exit_autocast();  // the `with ctx:` block ends
    }
    if (o.loop == LoopKind::kNanoGpt || o.loop == LoopKind::kSeed000) get_batch();  // prefetch
    if (record) {
      r.after_forward = Moment{e.event_count(), e.phase, step, micro, e.live()};
      r.saved_activations = e.saved_bytes();
    }
    e.phase = Phase::kBackward;
    T scaled = scaler_scale(loss);
    // the script keeps `loss` bound (nanoGPT, the seed 000 fork, the Trainer's returned loss); seed 003 calls
    // y.sum().backward() on a temporary
    if (o.loop != LoopKind::kPlain) kept_loss = std::move(loss);
    loss.reset();
    if (!scaled->requires_grad || !scaled->grad_fn) {
      // what loss.backward() raises in PyTorch, as bad input: nothing trainable is reached
      throw Error("loss.backward() would fail: \"element 0 of tensors does not require grad and does not have a "
                  "grad_fn\": no trainable parameter is reached from the loss (everything before it is frozen, or "
                  "reentrant checkpointing without --input-require-grads true cut the graph)");
    }
    e.backward(scaled);
  }

  void clip_grad_norm() {
    // torch.nn.utils.clip_grad_norm_(params, 1.0), foreach path: _foreach_norm (one partial per 64Ki-element
    // chunk of every tensor, then one float per tensor), torch.stack of the norms, the total norm, the
    // clip coefficient; the grads are scaled in place.
    e.phase = Phase::kGradClip;
    uint64_t max_chunks = 1;
    // over the parameters that have a .grad (clip_grad_norm_ skips p.grad is None: the frozen ones, and any
    // the backward did not reach)
    uint64_t n = 0;
    for (size_t i = 0; i < inv.parameters.size(); ++i) {
      if (!e.grad(static_cast<int32_t>(i))) continue;
      ++n;
      max_chunks = std::max(max_chunks, ceil_div(inv.parameters[i].elems.value, kForeachChunkElems));
    }
    T norms;
    {
      T partial = e.empty(Shape{n * max_chunks}, DType::kF32, Category::kTemporaries, Label{"clip_grad_norm_ partials"});
      norms = e.empty(Shape{n}, DType::kF32, Category::kTemporaries, Label{"clip_grad_norm_ per-tensor norms"});
    }
    T total;
    {
      T stacked = e.empty(Shape{n}, DType::kF32, Category::kTemporaries, Label{"clip_grad_norm_ stack"});
      total = e.empty(Shape{}, DType::kF32, Category::kTemporaries, Label{"clip_grad_norm_ total"});
    }
    T coef = e.empty(Shape{}, DType::kF32, Category::kTemporaries, Label{"clip_grad_norm_ clip_coef"});
    T clamped = e.empty(Shape{}, DType::kF32, Category::kTemporaries, Label{"clip_grad_norm_ clamped"});
  }

  void optimizer_step(bool first) {
    e.phase = Phase::kOptimizer;
    if (s.optimizer == Optimizer::kNone) return;
    const bool adam = s.optimizer == Optimizer::kAdamW || s.optimizer == Optimizer::kAdam;
    const auto groups = param_groups();
    if (first && !groups.empty()) {
      for (const StateTensor& t : optimizer_shared_state(s.optimizer)) {
        state.push_back(e.empty(Shape::of(t.shape), t.dtype, Category::kOptimizer, Label{t.what}));
      }
    }
    for (const std::vector<size_t>& group : groups) {
      if (first) {
        // the state of each parameter, created lazily at its first step in parameter order
        // (optimizer_state_tensors: torch.optim's _init_group, bitsandbytes' init_state, Adafactor's step)
        for (size_t i : group) {
          const T& p = w.params[i];
          const Label l{intern_name(inv.parameters[i].name), -1, static_cast<int32_t>(i)};
          for (const StateTensor& t : optimizer_state_tensors(s.optimizer, opt_impl, inv.parameters[i].shape, p.dtype())) {
            if (t.paged) continue;  // cudaMallocManaged: not the caching allocator's (StateBytes::paged_optimizer_state)
            state.push_back(e.empty(Shape::of(t.shape), t.dtype, Category::kOptimizer, l));
          }
        }
      }
      if (adam && opt_impl == OptimizerImpl::kForeach) {
        // _multi_tensor_adam: exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs), one tensor per
        // parameter of the group, alive until the group's update returns.
        std::vector<T> sqrt;
        for (size_t i : group) {
          sqrt.push_back(e.empty(w.params[i].shape(), w.params[i].dtype(), Category::kTemporaries,
                                 Label{"adam exp_avg_sq_sqrt", -1, static_cast<int32_t>(i)}));
        }
      } else if (adam && opt_impl == OptimizerImpl::kForLoop) {
        // _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), per parameter
        for (size_t i : group) {
          T sq = e.empty(w.params[i].shape(), w.params[i].dtype(), Category::kTemporaries, Label{"adam sqrt"});
          T denom = e.empty(w.params[i].shape(), w.params[i].dtype(), Category::kTemporaries, Label{"adam denom"});
        }
      } else if (s.optimizer == Optimizer::kAdafactor) {
        for (size_t i : group) adafactor_update(i);
      }
      // bitsandbytes' 8-bit, paged and Lion updates are one in-place kernel per parameter: no temporaries
    }
  }

  // transformers' Adafactor.step for one parameter (optimization.py): float32 copies of a 16-bit grad and
  // parameter, update = grad**2 + eps, the row and column means, the factored estimate r * c (a new tensor),
  // then in-place scaling; the float32 parameter is copied back.
  void adafactor_update(size_t i) {
    const T& p = w.params[i];
    const Shape ps = p.shape();
    const bool half = p.dtype() != DType::kF32;
    auto f32 = [&](const Shape& sh, const char* what) {
      return e.empty(sh, DType::kF32, Category::kTemporaries, Label{what, -1, static_cast<int32_t>(i)});
    };
    T g32 = half ? f32(ps, "adafactor grad.float()") : T();
    T p32 = half ? f32(ps, "adafactor p.float()") : T();
    T update;
    {
      T sq = f32(ps, "adafactor grad**2");
      update = f32(ps, "adafactor grad**2 + eps");
    }
    if (ps.n >= 2) {
      Shape row = ps;
      row.n = static_cast<uint8_t>(ps.n - 1);
      Shape col = ps;
      col.d[ps.n - 2] = ps.d[ps.n - 1];
      col.n = static_cast<uint8_t>(ps.n - 1);
      { T mean_row = f32(row, "adafactor update.mean(-1)"); }
      { T mean_col = f32(col, "adafactor update.mean(-2)"); }
      // _approx_sq_grad: r_factor = (row / row.mean(-1, keepdim)).rsqrt_(); c_factor = col.rsqrt(); r * c
      T r = f32(row, "adafactor r_factor");
      T c = f32(col, "adafactor c_factor");
      update = f32(ps, "adafactor r_factor * c_factor");
    } else {
      update = f32(ps, "adafactor exp_avg_sq.rsqrt()");
    }
  }

  // The optimizer's parameter groups, in order. nanoGPT's configure_optimizers and transformers' Trainer
  // both put the weight-decayed tensors (nanoGPT: dim >= 2; Trainer: all but biases and norm weights, which
  // for the supported models are exactly the 1-D tensors) in a first group and the rest in a second.
  std::vector<std::vector<size_t>> param_groups() const {
    std::vector<size_t> decay, rest;
    // The trainable rows (frozen parameters are not given to the optimizer) that have a .grad: torch.optim
    // skips `p.grad is None` (_init_group), so a parameter the backward never reached (a reentrant checkpoint
    // whose input does not require grad) gets no state and no update.
    std::vector<size_t> all;
    for (size_t i = 0; i < inv.parameters.size(); ++i) {
      if (!inv.parameters[i].trainable || !e.grad(static_cast<int32_t>(i))) continue;
      all.push_back(i);
      (inv.parameters[i].shape.size() >= 2 ? decay : rest).push_back(i);
    }
    if (o.loop == LoopKind::kPlain) return {all};
    return {decay, rest};
  }

  void zero_grad() {
    e.phase = Phase::kZeroGrad;
    if (o.loop == LoopKind::kSeed000) return;  // set_to_none=False: the gradients are zeroed in place
    for (T& g : e.grads()) g.reset();         // set_to_none=True
  }
};

Moment moment_at(const Timeline& tl, size_t index, const LiveBytes& live) {
  const Event& ev = tl.events[index];
  return Moment{index, ev.phase, ev.step, ev.micro, live};
}

}  // namespace

}  // namespace sim

SimResult simulate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o0) {
  validate_setup(m, s);
  const SimOptions o = resolved(o0, m);
  SimResult r;
  // About 30 events per parameter tensor and step for transformer layers; only a capacity hint.
  r.timeline.events.reserve(std::min<size_t>(32 * (inv.parameters.size() + 8) * o.steps, size_t{1} << 22));
  sim::Engine e(&r.timeline);
  e.set_runtime(runtime_facts(o.torch, o.sm));
  sim::Loop loop(m, inv, s, o, e);
  loop.c.autocast = uses_autocast(s.precision);
  if (s.checkpointing == Checkpointing::kFull) {
    loop.c.checkpoint.mode = sim::CheckpointPolicy::kFull;
    loop.c.checkpoint.reentrant = s.checkpoint_reentrant.value_or(default_checkpoint_reentrant(m.impl));
    loop.c.checkpoint.every = std::max<uint64_t>(s.checkpoint_every, 1);
  }
  loop.c.ac_dtype = compute_dtype(s.precision);
  // the loss the forward programs end with (hf_common.cc causal_lm_head)
  loop.c.loss_chunks = s.loss == LossKind::kChunked ? s.loss_chunks : 0;
  loop.c.logits_to_keep = s.logits_to_keep;
  loop.c.seed000_block_locals = o.loop == LoopKind::kSeed000;
  loop.opt_impl = resolve_optimizer_impl(s.optimizer, s.optimizer_impl, m.impl);
  // seed 003's layer-stack script runs no GradScaler
  loop.scaler = s.precision == Precision::kFp16Amp && !loop.features;

  e.phase = Phase::kSetup;
  if (o.loop == LoopKind::kSeed000) loop.warmup();
  loop.w = sim::load_model(e, inv, param_dtype(s.precision));
  // PEFT's wrapped linears: lora_A is the row after... its base (adapts), lora_B the row after lora_A
  for (size_t i = 0; i + 1 < inv.parameters.size(); ++i) {
    const TensorRow& a = inv.parameters[i];
    if (!a.adapter || a.adapts < 0) continue;
    auto& by_row = loop.c.lora.by_base_row;
    if (by_row.size() < inv.parameters.size()) by_row.resize(inv.parameters.size());
    by_row[static_cast<size_t>(a.adapts)] = {loop.w.params[i], loop.w.params[i + 1]};
    ++i;
  }
  loop.c.lora.dropout = s.lora.dropout;
  // bitsandbytes 4-bit weights: their Linear's shape, the compute dtype and the dtype they were quantized from
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    const TensorRow& r = inv.parameters[i];
    if (!r.packed_4bit) continue;
    auto& dims = loop.c.quant.dims_by_row;
    if (dims.size() < inv.parameters.size()) dims.resize(inv.parameters.size());
    dims[i] = {r.shape[0], r.shape[1]};
  }
  loop.c.quant.compute = s.quant.compute;
  loop.c.quant.quantized = param_dtype(s.precision);  // QuantState.dtype: the weight's dtype at quantization
  loop.c.quant.double_quant = s.quant.double_quant;
  if (s.input_require_grads.value_or(false)) {
    const std::string_view emb = family_descriptor(m.family).input_embedding;
    for (size_t i = 0; i < inv.parameters.size(); ++i) {
      if (inv.parameters[i].name == emb) loop.c.input_embedding_row = static_cast<int32_t>(i);
    }
  }
  if (o.loop != LoopKind::kHf) loop.get_batch();

  const uint32_t micros = static_cast<uint32_t>(std::min<uint64_t>(s.grad_accum, 2));
  r.micro_batches_simulated = micros;
  for (uint32_t step = 1; step <= o.steps; ++step) {
    for (uint32_t micro = 1; micro <= micros; ++micro) {
      if (step == o.steps && micro == 1) {
        // memory_allocated() just before the next step's forward
        r.steady = Moment{e.event_count() == 0 ? 0 : e.event_count() - 1, Phase::kForward, step, micro, e.live()};
      }
      loop.micro_batch(step, micro, r, step == o.steps && micro == micros);
    }
    if (step == o.steps) {  // which parameters the backward reached: they have gradients and optimizer state
      r.param_has_grad.assign(inv.parameters.size(), 0);
      for (size_t i = 0; i < inv.parameters.size(); ++i) r.param_has_grad[i] = e.grad(static_cast<int32_t>(i)) ? 1 : 0;
    }
    if (o.loop != LoopKind::kPlain) loop.clip_grad_norm();  // grad_clip / max_grad_norm = 1.0
    loop.optimizer_step(step == 1);
    loop.zero_grad();
  }

  // The peak: the highest total of live requested bytes over the run (tracked by the engine at each
  // allocation, the only event that raises it).
  const size_t best_i = e.peak_event();
  const LiveBytes& at_best = e.peak_live();
  r.peak = sim::moment_at(r.timeline, best_i, at_best);
  e.stop_recording();
  r.warnings = loop.c.warnings;
  if (e.lost_events()) throw Error("the host ran out of memory while recording the simulated step");
  for (Category cat : {Category::kActivations, Category::kWeightCopies, Category::kBackward, Category::kTemporaries}) {
    r.activations_at_peak += at_best.by_category[static_cast<size_t>(cat)];
  }
  return r;
}

}  // namespace trainmem
