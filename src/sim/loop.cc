// The training loop around the model, per LoopKind: what it allocates and keeps alive between the
// model's forward and the optimizer's step.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include <deque>
#include <unordered_map>

#include "../families/registry.h"
#include "forward.h"
#include "fsdp.h"
#include "fsdp1.h"
#include "memo.h"
#include "ops_util.h"
#include "trainmem/ddp.h"
#include "trainmem/error.h"
#include "trainmem/fsdp.h"
#include "trainmem/pp.h"
#include "trainmem/sim.h"
#include "trainmem/zero.h"

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

std::string loop_label(const TrainSetup& s, LoopKind k) {
  return s.task == Task::kInference ? std::string("model.eval()") : fmt::format("{} loop", loop_name(k));
}

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
  std::vector<T> adafactor_rms;  // transformers' Adafactor state["RMS"] per parameter, replaced every step
  T X, Y;                   // the current batch
  T batch_token_type_ids, batch_attention_mask;  // encoders' and T5's other inputs (Loop::bind_model_inputs)
  T kept_logits;            // nanoGPT: `logits` lives until the next forward returns
  T kept_loss;              // the training script's `loss` variable, rebound each micro-batch
  const Program& program;   // the family's forward for this implementation (src/families/registry.cc)
  const bool features;      // a float feature batch without targets (InputKind::kFeatures)

  // DistributedDataParallel (ddp.h): this rank's Reducer
  DdpOptions ddp;
  std::vector<int32_t> ddp_rows;     // DDP's parameter list (_build_params_for_reducer): the trainable rows
  std::vector<T> ddp_buckets;        // bucket.gradients, in the Reducer's bucket order
  std::vector<int32_t> ddp_bucket_of;  // per inventory row: its bucket (-1: none)
  std::vector<int32_t> ddp_arrival;  // rebuilt_params_: rows in gradient-ready order, first synced backward
  bool ddp_sync = true;              // require_backward_grad_sync of this micro-batch (no_sync otherwise)
  bool ddp_forward_sync = true;      // require_forward_param_sync: set by the previous forward
  bool ddp_rebuilt = false;

  // FSDP2 (fsdp.h): this rank's fully_shard units
  FsdpOptions fsdp_opt;
  std::unique_ptr<Fsdp2> fsdp;
  // Under a pipeline: the FSDP2 root of each stage this rank holds, by o.pp.parts index (torchtitan applies
  // apply_fsdp to each model part: with interleaved-1f1b several roots, `fsdp` the first and fsdp_more the others)
  std::vector<Fsdp2*> pp_fsdp;
  std::vector<std::unique_ptr<Fsdp2>> fsdp_more;
  // The optimizer state's shape of row i: the local shard's under FSDP2 (zeros_like of the DTensor)
  // FSDP1 (fsdp1.h): this rank's FullyShardedDataParallel units
  std::unique_ptr<Fsdp1> fsdp1;
  uint32_t synced_micro = 1;  // the step's last simulated micro-batch, the one that synchronises gradients (train())
  std::vector<uint64_t> state_shape(size_t i) const {
    // FSDP1 with use_orig_params: the optimizer steps each original parameter's 1-d view of its shard elements
    if (fsdp1) return {fsdp1->numel_in_shard(i)};
    return fsdp ? fsdp_shard(inv.parameters[i].shape, fsdp_opt.ranks, fsdp_opt.rank).local_shape : inv.parameters[i].shape;
  }

  Loop(const ModelSpec& m_, const Inventory& inv_, const TrainSetup& s_, const SimOptions& o_, Engine& e_)
      : m(m_), inv(inv_), s(s_), o(o_), e(e_), c(e_), program(program_for(m_)), features(input_kind(m_) == InputKind::kFeatures) {}

  T batch_tensor(const char* what) {
    if (features) {
      return e.leaf(Shape{s.batch, m.stack_input}, param_dtype(s.precision), Category::kInputs, Label{what});
    }
    return e.leaf(Shape{s.batch, s.seq}, DType::kI64, Category::kInputs, Label{what});
  }

  // The labels as the head's collator makes them: (B,) for sequence classification (DataCollatorWithPadding's
  // "labels"), (B, T) otherwise (DataCollatorForLanguageModeling, DataCollatorForTokenClassification, and the
  // causal LM's copy of the input ids).
  T labels_tensor() {
    if (m.head == Head::kSeqCls) return e.leaf(Shape{s.batch}, DType::kI64, Category::kInputs, Label{"labels"});
    // T5: DataCollatorForSeq2Seq's labels, the decoder's (B, target_seq) tokens
    if (m.family == Family::kT5) {
      return e.leaf(Shape{s.batch, s.target_seq ? s.target_seq : s.seq}, DType::kI64, Category::kInputs, Label{"labels"});
    }
    return batch_tensor("targets");
  }

  // The encoders' batch besides input_ids, in the collator's key order (the tokenizer's model_input_names):
  // BertTokenizer's token_type_ids, then attention_mask, int64 (B, T) each; all ones, as padding to the batch's
  // longest sequence (--seq) leaves them. Decoders get neither (their batches are input_ids and labels). The new
  // tensors are all made before the previous batch's are released (`inputs = ...` rebinds the dict at the end).
  // T5's batch (Seq2SeqTrainer / Trainer with DataCollatorForSeq2Seq) is input_ids, attention_mask (int64 ones:
  // tokenizer.pad of unpadded rows) and labels, moved to the device in that order.
  bool has_attention_mask() const {
    return m.family == Family::kBert || m.family == Family::kRoberta || m.family == Family::kT5;
  }
  // RobertaTokenizer.model_input_names = ["input_ids", "attention_mask"]: no token_type_ids in a RoBERTa batch
  // (RobertaEmbeddings then gathers its zeros buffer); BertTokenizer's has them.
  bool token_types() const { return m.family == Family::kBert; }
  // Trainer._prepare_inputs moves the batch dict key by key: input_ids (`x`), token_type_ids, attention_mask,
  // labels (the collators add "labels" last; none for inference)
  void bind_model_inputs(T x, bool with_labels) {
    T tt = token_types() ? batch_tensor("token_type_ids") : T();
    T mask = batch_tensor("attention_mask");
    T y = with_labels ? labels_tensor() : T();
    X = std::move(x);
    batch_token_type_ids = std::move(tt);
    batch_attention_mask = std::move(mask);
    Y = std::move(y);
    c.token_type_ids = batch_token_type_ids ? &batch_token_type_ids : nullptr;
    c.attention_mask = &batch_attention_mask;
  }

  void get_batch() {
    // x, y = x.to(device), y.to(device): x first. Rebinding releases the previous batch unless autograd
    // still holds it (embedding saves the ids, nll_loss the targets).
    T x = batch_tensor(features ? "input x" : "input ids");
    if (has_attention_mask()) {
      bind_model_inputs(std::move(x), true);
      return;
    }
    T y = features ? T() : labels_tensor();
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
  ForwardOut run_forward_on(const T& ids) { return program.forward(c, m, w, ids, nullptr); }

  // The training steps: o.steps optimizer steps of grad_accum micro-batches (at most two simulated each).
  void train(SimResult& r) {
    // FSDP1 under no_sync simulates three: a middle micro-batch (2 .. grad_accum - 1) starts with the unsharded
    // gradients the first one kept and accumulates into them, which the first does not (Fsdp1::set_sync).
    // accelerate's FSDP2 keeps its unsharded gradients under no_sync too, but its middle micro-batches are not
    // simulated: their backward starts with the same kept gradients as the last one's (which frees them unit by unit
    // where a middle one keeps them). Simulated (2026-11-27) on Llama-3-8B over 8 ranks, seq 256 to 8192, without,
    // selective and full checkpointing, bf16-amp, bf16 and fp32: a middle micro-batch left every peak as it was and
    // moved reserved by at most 2 MiB, and cost plan's search half as many events again per accumulating FSDP2 probe
    // (two fitting setups of the README's 70B plan fell out of its bound).
    const uint32_t micros = static_cast<uint32_t>(std::min<uint64_t>(s.grad_accum, fsdp1 ? 3 : 2));
    synced_micro = micros;
    r.micro_batches_simulated = micros;
    for (uint32_t step = 1; step <= o.steps; ++step) {
      for (uint32_t micro = 1; micro <= micros; ++micro) {
        if (step == o.steps && micro == 1) {
          // memory_allocated() just before the next step's forward
          r.steady = Moment{e.event_count() == 0 ? 0 : e.event_count() - 1, Phase::kForward, step, micro, e.live()};
        }
        // micro-batch 1 stands for the grad_accum - 1 micro-batches before the last (the same ops; only the last
        // synchronises the gradients): its kernels count that many times in the FLOP ledger (Engine::count_weight)
        e.count_weight = micro == 1 && s.grad_accum > 2 ? s.grad_accum - 1 : 1;
        // FSDP1: micro-batch 1 is itself, micro-batch 2 stands for the grad_accum - 2 middle ones. The state they
        // leave is the same (each unit's kept flat_param.grad, accumulated in place; the parameters' .grad views
        // already set), so every middle one runs micro-batch 2's ops on micro-batch 2's live tensors.
        if (fsdp1 && micros == 3) e.count_weight = micro == 2 ? s.grad_accum - 2 : 1;
        micro_batch(step, micro, r, step == o.steps && micro == micros);
        if (zopt.on && z3) {
          z3_epilogue();  // ZeRO-3: the bucket's remainder reduced, the last modules released
        } else if (zopt.on) {
          zero_epilogue(micro == micros);  // the last gradient hook of the backward runs it
        }
        e.count_weight = 1;
      }
      if (step == o.steps) {  // which parameters the backward reached: they have gradients and optimizer state
        r.param_has_grad.assign(inv.parameters.size(), 0);
        for (size_t i = 0; i < inv.parameters.size(); ++i) {
          const bool stepped = i < stepped_in_backward.size() && stepped_in_backward[i];
          // ZeRO: the epilogue clears every .grad; the hooks recorded which parameters got one
          const bool reduced = i < zero_reached.size() && zero_reached[i];
          r.param_has_grad[i] = e.grad(static_cast<int32_t>(i)) || stepped || reduced ? 1 : 0;
        }
      }
      if (s.optimizer_in_backward) continue;  // stepped and zeroed in backward (Loop::step_in_backward)
      if (zopt.on) {
        // The Trainer's accelerator.clip_grad_norm_ returns None under DeepSpeed (accelerate accelerator.py:
        // "`accelerator.backward(loss)` is doing that automatically"; the engine clips with gradient_clipping =
        // max_grad_norm in unscale_and_clip_grads); engine.step -> the ZeRO step, then
        // zero_grad (set_to_none: the .grads are None already)
        if (z3) {
          z3_step(step == 1);
        } else {
          zero_step(step == 1);
        }
        zero_grad();
        continue;
      }
      if (o.loop != LoopKind::kPlain) clip_grad_norm();  // grad_clip / max_grad_norm = 1.0
      optimizer_step(step == 1);
      zero_grad();
    }
  }

  // --task inference: `with torch.inference_mode(): outputs = model(input_ids)` in model.eval(), once per step.
  // No graph is recorded, so nothing is saved for backward and each layer's temporaries die as the code drops
  // them; the script's `outputs` (the logits) stays bound until the next call returns.
  void inference(SimResult& r) {
    r.micro_batches_simulated = 1;
    e.grad_mode = false;  // torch.inference_mode()
    c.inference_mode = true;
    for (uint32_t step = 1; step <= o.steps; ++step) {
      e.step = step;
      e.micro = 1;
      e.phase = Phase::kForward;
      if (step == o.steps) {
        r.steady = Moment{e.event_count() == 0 ? 0 : e.event_count() - 1, Phase::kForward, step, 1, e.live()};
      }
      if (has_attention_mask()) {  // the tokenizer's input_ids, token_type_ids and attention_mask, moved to the device
        bind_model_inputs(batch_tensor("input ids"), false);
      } else {
        X = batch_tensor("input ids");  // input_ids = batch.to(device): rebinding frees the previous batch
      }
      ForwardOut out = run_forward(nullptr);
      c.exit_autocast();
      kept_logits = std::move(out.logits);  // `outputs = model(...)` rebinds the script's variable
      if (step == o.steps) {
        r.after_forward = Moment{e.event_count(), e.phase, step, 1, e.live()};
        r.saved_activations = e.saved_bytes();
      }
    }
    r.param_has_grad.assign(inv.parameters.size(), 0);  // no backward: no parameter gets a gradient
  }

  // --task inference --generate N: model.generate(input_ids, max_new_tokens=N), greedy, with transformers'
  // default DynamicCache, as transformers 5.x (>= 5.3) runs it (generation/utils.py GenerationMixin.generate
  // and _sample; notes with quotes in validate/cpu/README.md): the prompt's forward (_prefill), then one forward
  // per new token over that token alone, every layer's keys and values appended to the cache by torch.cat
  // (kv_update in hf_common.cc). generate() passes logits_to_keep=1, so each forward's logits are (B, 1, V).
  // Step i of the timeline is the forward that yields token i (step 1: the prefill). Tensors of B elements or
  // fewer (next_tokens, unfinished_sequences, the eos fill, the stopping criteria's flags, 0-d ones) are left
  // out: each is one 512-byte block of the small pool. The cache dies when generate() returns.
  void generate(SimResult& r) {
    r.micro_batches_simulated = 1;
    e.grad_mode = false;  // generate() runs under torch.no_grad(); inference_mode() around it changes nothing
    c.logits_to_keep = 1;
    const uint64_t B = s.batch, V = m.embed.vocab_size;
    auto ids = [&](uint64_t cols, const char* what, Category cat = Category::kInputs) {
      return e.empty(Shape{B, cols}, DType::kI64, cat, Label{what});
    };
    e.micro = 1;
    e.step = 1;
    e.phase = Phase::kForward;
    r.steady = Moment{e.event_count() == 0 ? 0 : e.event_count() - 1, Phase::kForward, 1, 1, e.live()};
    X = batch_tensor("input ids");  // the prompt, (B, T)
    const T prompt = X;             // the caller's `input_ids`: generate() rebinds its own name only
    // _prepare_attention_mask_for_generation, pad_token_id set (the eos when the config has none):
    // default_attention_mask = torch.ones(...); isin(inputs, pad).any(); inputs.ne(pad).long();
    // mask_from_padding * can_infer + default * ~can_infer
    T attention_mask;
    {
      T ones = ids(s.seq, "default_attention_mask (ones)", Category::kTemporaries);
      { T isin = e.empty(Shape{B, s.seq}, DType::kBool, Category::kTemporaries, Label{"isin(inputs, pad_token_id)"}); }
      T from_padding;
      {
        T ne = e.empty(Shape{B, s.seq}, DType::kBool, Category::kTemporaries, Label{"inputs.ne(pad_token_id)"});
        from_padding = ids(s.seq, "attention_mask_from_padding (.long())", Category::kTemporaries);
      }
      T a = ids(s.seq, "mask_from_padding * can_infer", Category::kTemporaries);
      T b = ids(s.seq, "default * ~can_infer", Category::kTemporaries);
      attention_mask = ids(s.seq, "attention_mask");
    }
    // _prepare_position_ids_for_generation: attention_mask.long().cumsum(-1) - 1, .masked_fill(mask == 0, 0)
    T position_ids;
    {
      T minus;
      {
        T cumsum = ids(s.seq, "attention_mask.cumsum(-1)", Category::kTemporaries);
        minus = ids(s.seq, "cumsum - 1", Category::kTemporaries);
      }
      T zero = e.empty(Shape{B, s.seq}, DType::kBool, Category::kTemporaries, Label{"attention_mask == 0"});
      position_ids = ids(s.seq, "position_ids");
    }
    KvCache kv;
    c.kv = &kv;
    T next_logits;                 // `next_token_logits` stays bound until the next step rebinds it
    T model_ids, model_pos;        // a decode step's `model_inputs`, replaced by the next step's
    for (uint64_t i = 0; i < s.generate; ++i) {
      e.step = static_cast<uint32_t>(i + 1);
      const uint64_t q = i == 0 ? s.seq : 1;  // the prompt, then the newest token
      const uint64_t len = X.shape()[1];
      ForwardOut out;
      {
        // prepare_inputs_for_generation: input_ids[:, -q:].clone(); position_ids sliced and cloned when their
        // length differs from q (every decode step), passed as they are at the prefill
        T new_ids = ids(q, "model_inputs input_ids (clone)");
        T new_pos = q == position_ids.shape()[1] ? position_ids : ids(q, "model_inputs position_ids (clone)");
        model_ids = std::move(new_ids);
        model_pos = std::move(new_pos);
        c.position_ids = &model_pos;
        // no exit_autocast() between forwards: `with torch.autocast(...): model.generate(...)` is one region,
        // so its cast weights are made by the prefill and reused by every decode step
        out = run_forward_on(model_ids);
        c.position_ids = nullptr;
        if (i == 0) {  // _prefill's model_inputs die when it returns
          model_ids.reset();
          model_pos.reset();
        }
      }
      if (kv.keys.size() != m.layers) {  // a forward program that does not call kv_update (hf_common.h)
        throw Error(fmt::format("generation is not modelled for model_type {} yet: its forward keeps no KV cache",
                                m.model_type));
      }
      kv.past += q;
      // _update_model_kwargs_for_generation: next_position_ids = arange(1).view(1, -1) + position_ids[..., -1:]
      // + 1, then torch.cat([position_ids, next_position_ids], dim=-1); attention_mask = torch.cat(
      // [attention_mask, attention_mask.new_ones((B, 1))], dim=-1)
      {
        T plus = ids(1, "position_ids[..., -1:] + arange", Category::kTemporaries);
        T next = ids(1, "next_position_ids", Category::kTemporaries);
        plus.reset();
        position_ids = ids(kv.past + 1, "position_ids (torch.cat)");
      }
      {
        T ones = ids(1, "attention_mask.new_ones((B, 1))", Category::kTemporaries);
        attention_mask = ids(kv.past + 1, "attention_mask (torch.cat)");
      }
      // next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32); greedy: argmax;
      // input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
      next_logits = e.empty(Shape{B, V}, DType::kF32, Category::kActivations, Label{"next_token_logits (float32 copy)"});
      X = ids(len + 1, "input_ids (torch.cat)");
      out = ForwardOut{};  // del outputs
      if (i == 0) {
        r.after_forward = Moment{e.event_count(), e.phase, 1, 1, e.live()};  // the prefill and its token done
        r.saved_activations = e.saved_bytes();
      }
    }
    // the end: the last token appended and the cache still held, before generate() returns and drops its
    // locals (validate/cpu/generate.py marks "end of generate" at the same point)
    r.generation_end = Moment{e.event_count(), e.phase, e.step, 1, e.live()};
    next_logits.reset();  // generate() returns
    model_ids.reset();
    model_pos.reset();
    c.kv = nullptr;  // generate() returns: the cache and its kwargs go
    c.exit_autocast();
    r.param_has_grad.assign(inv.parameters.size(), 0);
  }

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
    if (ddp.on) ddp_pre_forward(micro == synced_micro);
    // accelerate's no_sync; torchtitan's trainer over the sequence-parallel model (resolve_sp_fsdp) calls none
    // (trainer.py forward_backward_step per micro-batch): each micro-batch's gradients are reduce-scattered and
    // accumulate sharded
    if (fsdp) fsdp->set_requires_gradient_sync(s.sequence_parallel || micro == synced_micro);
    // FSDP1: the Trainer's no_sync for every micro-batch but the last (trainer.py _inner_training_loop:
    // functools.partial(self.accelerator.no_sync, model=model) unless sync_each_batch, DeepSpeed or the last)
    if (fsdp1) fsdp1->set_sync(micro == synced_micro);
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
        if (fsdp) fsdp->root_pre_forward();  // FSDP2: the root's own parameters (PEFT's final norm), if any
        out = run_forward(&Y);
        if (fsdp) fsdp->root_post_forward();  // FSDP2: the root's post-forward, once the model's forward returns
        if (fsdp1) fsdp1->root_post_forward();  // FSDP1: the root FullyShardedDataParallel's _post_forward
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
    if (fsdp1) fsdp1->root_pre_backward();  // FSDP1: the root's pre-backward hook on the loss
    e.backward(scaled);
    if (fsdp) fsdp->final_callback();  // FSDP2's queued _root_post_backward_final_callback
    if (fsdp1) fsdp1->final_callback();  // FSDP1's queued _post_backward_final_callback
  }

  // --- DistributedDataParallel -------------------------------------------------------------------------

  // A tensor as c10d's bucket assignment sees it: DDP's index `k`, its bytes and dtype as stored on the device
  BucketInput bucket_input(uint32_t k, const TensorRow& r) const {
    const DType dt = stored_dtype(r, param_dtype(s.precision));
    return {k, bytes_of(r.elems, dt).value, dt};
  }

  // The module's states as _sync_module_states lists them: named_parameters(), then named_buffers()
  // (broadcast_buffers=True, DDP's default, which neither the Trainer nor nanoGPT changes).
  std::vector<BucketInput> module_states(bool params) const {
    std::vector<BucketInput> v;
    uint32_t k = 0;
    if (params) {
      for (const TensorRow& r : inv.parameters) v.push_back(bucket_input(k++, r));
    }
    for (const TensorRow& r : inv.buffers) v.push_back(bucket_input(k++, r));
    return v;
  }

  // Allocates the buckets of `assignment` (DDP parameter indices) in order: Reducer::initialize_buckets,
  // `bucket.gradients = at::empty({bucketSize}, options)` per bucket.
  void ddp_allocate(const std::vector<DdpBucket>& assignment, std::vector<std::vector<DdpBucket>>& sizes) {
    ddp_bucket_of.assign(inv.parameters.size(), -1);
    for (const DdpBucket& b : assignment) {
      const auto n = static_cast<int32_t>(ddp_buckets.size());
      ddp_buckets.push_back(e.empty(Shape{b.bytes / itemsize(b.dtype)}, b.dtype, Category::kDdpBuckets,
                                    Label{intern_name(fmt::format("DDP bucket {} ({} tensors)", n, b.indices.size()))}));
      for (uint32_t k : b.indices) ddp_bucket_of[static_cast<size_t>(ddp_rows[k])] = n;
    }
    sizes.push_back(assignment);
  }

  // DistributedDataParallel(model) after the model is on the device (distributed.py __init__):
  // _sync_module_states, then _ddp_init_helper's Reducer with its first bucket assignment.
  void ddp_construct(SimResult& r) {
    e.phase = Phase::kSetup;
    sim::broadcast_coalesced(e, module_states(true), kDdpBroadcastBucketBytes, Category::kDdpBuckets,
                             "DDP _sync_module_states broadcast (flat)");
    std::vector<BucketInput> params;
    for (size_t i = 0; i < inv.parameters.size(); ++i) {
      if (!inv.parameters[i].trainable) continue;  // `if param.requires_grad`
      params.push_back(bucket_input(static_cast<uint32_t>(ddp_rows.size()), inv.parameters[i]));
      ddp_rows.push_back(static_cast<int32_t>(i));
    }
    if (params.empty()) throw Error("DDP: no parameter requires grad (DistributedDataParallel refuses such a module)");
    // _ddp_init_helper: `if static_graph is True or self.find_unused_parameters is False: bucket_size_limits =
    // [sys.maxsize]`, else [first bucket cap, bucket_bytes_cap]; the buckets are passed reversed
    // (`list(reversed(bucket_indices))`) to approximate gradient-ready order
    const std::vector<uint64_t> limits = ddp.find_unused ? std::vector<uint64_t>{ddp.first_bucket_bytes, ddp.bucket_bytes}
                                                         : std::vector<uint64_t>{UINT64_MAX};
    std::vector<DdpBucket> a = assign_buckets(params, limits, false);
    std::reverse(a.begin(), a.end());
    ddp_sizes = &r.ddp_buckets;
    ddp_rebuild_step = &r.ddp_rebuild_step;
    ddp_allocate(a, *ddp_sizes);
    // Reducer::initialize_local_used_map (find_unused_parameters): local_used_map_dev_ = at::empty(
    // {variable_count}, int32) on the parameters' device (local_used_map_ itself is on the CPU)
    if (ddp.find_unused) {
      ddp_local_used = e.empty(Shape{params.size()}, DType::kI32, Category::kDdpBuckets, Label{"DDP local_used_map_dev_"});
    }
  }
  T ddp_local_used;

  // DDP.forward's _pre_forward: Reducer::rebuild_buckets once, after the first synced backward, then
  // _sync_buffers when the previous forward asked for it (require_forward_param_sync).
  void ddp_pre_forward(bool sync) {
    ddp_sync = sync;
    if (ddp.rebuild && !ddp_rebuilt && !ddp_arrival.empty()) {
      // rebuild_buckets: compute_bucket_assignment_by_size(rebuilt_params_, {first_bucket_bytes_cap_,
      // bucket_bytes_cap_}, ..., rebuilt_param_indices_) in gradient-ready order, then initialize_buckets, which
      // starts with `buckets_.clear()`: the Reducer drops the old buckets before it allocates the new ones (a
      // .grad that still views them would keep them: gradient_as_bucket_view with gradients kept, which
      // zero_grad(set_to_none=True) rules out in the modelled loops). Not modelled: the reference the last
      // all-reduce may still hold. ProcessGroupNCCL stashes a collective's tensors (stashed_for_allocator_safety_,
      // shared with the watchdog's copy of the work) until work.wait() or until the watchdog sees the work
      // complete; the Reducer waits on the future, not the work, so the old bucket lives on until the
      // watchdog's next pass if the rebuild comes sooner (a transient 2x of the buckets). On torch 1.13 gloo
      // the old bucket is seen alive past the rebuild (validate/cpu/ddp.py's notes).
      ddp_rebuilt = true;
      *ddp_rebuild_step = e.step;
      std::vector<BucketInput> ready;
      std::vector<int32_t> index_of(inv.parameters.size(), -1);
      for (size_t k = 0; k < ddp_rows.size(); ++k) index_of[static_cast<size_t>(ddp_rows[k])] = static_cast<int32_t>(k);
      for (int32_t row : ddp_arrival) {
        ready.push_back(bucket_input(static_cast<uint32_t>(index_of[static_cast<size_t>(row)]),
                                     inv.parameters[static_cast<size_t>(row)]));
      }
      if (ready.size() != ddp_rows.size()) {
        throw Error("DDP: a trainable parameter got no gradient in the first backward; DDP without "
                    "find_unused_parameters would fail (\"Expected to have finished reduction in the prior iteration\")");
      }
      const std::vector<DdpBucket> a = assign_buckets(ready, {ddp.first_bucket_bytes, ddp.bucket_bytes}, true);
      ddp_buckets.clear();
      ddp_allocate(a, *ddp_sizes);
      if (ddp.bucket_view) {  // initialize_bucket_views: a defined .grad is copied in and replaced by the view
        for (int32_t row : ddp_rows) {
          if (e.grad(row)) ddp_view_grad(row);
        }
      }
    }
    if (ddp_forward_sync) {
      sim::broadcast_coalesced(e, module_states(false), kDdpBroadcastBucketBytes, Category::kDdpBuckets,
                               "DDP _sync_buffers broadcast (flat)");
    }
    // _post_forward: require_forward_param_sync = grad enabled and require_backward_grad_sync
    ddp_forward_sync = sync;
  }
  std::vector<std::vector<DdpBucket>>* ddp_sizes = nullptr;
  uint32_t* ddp_rebuild_step = nullptr;  // SimResult::ddp_rebuild_step

  // .grad = the bucket view (gradient_as_bucket_view): the tensor autograd produced is released
  void ddp_view_grad(int32_t row) {
    T& g = e.grad(row);
    const T& bucket = ddp_buckets[static_cast<size_t>(ddp_bucket_of[static_cast<size_t>(row)])];
    if (g && g->storage == bucket->storage) return;  // `grad.is_alias_of(bucket_view)`
    const Shape shape = w.params[static_cast<size_t>(row)].shape();
    T v = e.view(bucket, shape, contiguous_strides(shape));
    g = std::move(v);
  }

  // The Reducer's autograd hook (a post hook of the parameter's AccumulateGrad): mark_variable_ready_dense
  // copies the grad into its bucket view (at::mul_out into the view: no allocation) or, with
  // gradient_as_bucket_view, makes .grad that view. The bucket's all-reduce is in place; finalize_backward copies
  // the result back into .grad (finalize_bucket_dense: no allocation). Skipped under no_sync.
  void ddp_hook(int32_t row) {
    if (!ddp_sync) return;
    if (ddp.rebuild && !ddp_rebuilt) ddp_arrival.push_back(row);  // push_rebuilt_params
    if (ddp.bucket_view) ddp_view_grad(row);
  }

  // --- DeepSpeed ZeRO stage 2 (zero.h): DeepSpeedZeroOptimizer, deepspeed/runtime/zero/stage_1_and_2.py -------

  struct ZeroGroup {
    std::vector<int32_t> rows;  // the group's trainable rows, in order (bit16_groups[i])
    ZeroGroupLayout layout;     // for the simulated rank
    T flat;                     // bit16_groups_flat[i]: the parameters are views of it
    T master;                   // single_partition_of_fp32_groups[i]
    std::vector<T> pads;        // get_flat_partition's zeros padding averaged_gradients[i] (boundary only)
  };
  ZeroOptions zopt;
  std::vector<ZeroGroup> zgroups;
  std::vector<int32_t> zero_group_of, zero_pos_of;  // per inventory row: its group and position (-1: none)
  std::vector<char> zero_mine;                      // is_param_in_current_partition
  T zero_buf[2];                // ipg_buckets[dtype].buffer: buf_0 (+ buf_1 with overlap_comm)
  int zero_index = 0;           // bucket.index
  uint64_t zero_elems = 0;      // bucket.elements
  std::vector<int32_t> zero_bucket_rows;  // bucket.params
  bool zero_ready = false;      // ready_for_gradients
  T zero_gip;                   // grads_in_partition (allocated lazily in copy_grads_in_partition)
  T zero_held;                  // all_grad_tensors: the first backward's partition gradients until the step
  bool zero_boundary_done = false;  // averaged_gradients built (the boundary's epilogue ran)
  std::vector<char> zero_reached;   // per inventory row: its gradient hook ran

  Shape row_shape(int32_t row) const { return w.params[static_cast<size_t>(row)].shape(); }
  uint64_t row_numel(int32_t row) const { return inv.parameters[static_cast<size_t>(row)].elems.value; }
  const ZeroParamPlace& zero_place(int32_t row) const {
    const auto r = static_cast<size_t>(row);
    return zgroups[static_cast<size_t>(zero_group_of[r])].layout.places[static_cast<size_t>(zero_pos_of[r])];
  }

  // `param.data = <view>`: the tensor keeps its identity (autograd, the optimizer's references) and takes the
  // view's storage; its old storage goes with its last reference.
  void set_data(const T& t, const T& src) {
    e.retain(src->storage);
    const uint64_t old = t->storage;
    t->storage = src->storage;
    e.release(old);
  }

  // deepspeed.initialize -> DeepSpeedEngine._configure_zero_optimizer -> DeepSpeedZeroOptimizer.__init__, once
  // the Trainer's model is on the device in bf16 (see resolve_zero for the precision).
  void zero_construct() {
    e.phase = Phase::kSetup;
    const DType bit16 = param_dtype(s.precision);
    // The Trainer's optimizer groups (zero_param_groups), each one bit16_groups[i]
    zero_group_of.assign(inv.parameters.size(), -1);
    zero_pos_of.assign(inv.parameters.size(), -1);
    zero_mine.assign(inv.parameters.size(), 0);
    zero_reached.assign(inv.parameters.size(), 0);
    for (std::vector<int32_t>& rows : zero_param_groups(inv)) {
      const auto gi = static_cast<int32_t>(zgroups.size());
      ZeroGroup& g = zgroups.emplace_back();
      g.rows = std::move(rows);
      std::vector<uint64_t> numels;
      for (size_t k = 0; k < g.rows.size(); ++k) {
        numels.push_back(row_numel(g.rows[k]));
        zero_group_of[static_cast<size_t>(g.rows[k])] = gi;
        zero_pos_of[static_cast<size_t>(g.rows[k])] = static_cast<int32_t>(k);
      }
      g.layout = zero_group_layout(numels, zopt.ranks, zopt.rank);
      for (uint32_t k : g.layout.in_partition) zero_mine[static_cast<size_t>(g.rows[k])] = 1;
      // `empty_cache()` before each group's flatten (runtime/utils.py empty_cache: the accelerator's
      // empty_cache and reset_peak_memory_stats): the previous group's freed weights go back to the driver
      e.empty_cache();
      // flatten_dense_tensors_aligned: align_dense_tensors appends torch.zeros(alignment - remaining) on the
      // parameters' device, then _flatten_dense_tensors (at::cat) makes the flat buffer; the padded list dies
      // when the function returns. ("need 2x model size on accelerator to flatten in place": the CPU fallback
      // when the device lacks room is not modelled.)
      {
        const uint64_t pad = g.layout.aligned_numel - g.layout.numel;
        if (pad == 0 && g.rows.size() == 1) {
          // flatten_dense_tensors (torch/csrc/utils/tensor_flatten.h) of one tensor: `if (tensors.size() == 1)
          // return tensors[0].contiguous().view({-1});`: a view of the parameter itself, nothing allocated
          const T& p = w.params[static_cast<size_t>(g.rows.front())];
          g.flat = e.view(p, Shape{g.layout.aligned_numel}, contiguous_strides(Shape{g.layout.aligned_numel}));
        } else {
          T zeros = pad ? e.empty(Shape{pad}, bit16, Category::kTemporaries, Label{"ZeRO align_dense_tensors pad"}) : T();
          g.flat = e.empty(Shape{g.layout.aligned_numel}, bit16, Category::kWeights,
                           Label{intern_name(fmt::format("ZeRO bit16_groups_flat[{}]", gi))});
        }
      }
      // _update_model_bit16_weights: each parameter's .data becomes its slice of the flat buffer (the
      // separately allocated weights are freed)
      for (int32_t row : g.rows) {
        const T& p = w.params[static_cast<size_t>(row)];
        set_data(p, e.view(g.flat, p.shape(), contiguous_strides(p.shape())));
      }
      // weights_partition = parallel_partitioned_bit16_groups[i][partition_id].detach().clone().to(device,
      // dtype=master_weights_and_grads_dtype): a bit16 clone, its fp32 copy, then the clone goes
      {
        T clone = e.empty(Shape{g.layout.partition_size}, bit16, Category::kTemporaries, Label{"ZeRO partition .clone()"});
        g.master = e.empty(Shape{g.layout.partition_size}, DType::kF32, Category::kOptimizer,
                           Label{intern_name(fmt::format("ZeRO fp32 master partition [{}]", gi))});
      }
    }
    if (zgroups.empty()) throw Error("DeepSpeed ZeRO: no parameter requires grad");
    // initialize_optimizer_states: every group's fp32 partition gets .grad = torch.zeros(partition_size), then
    // (not offloaded) `group.grad = None` for all; the optimizer's state is created lazily at the first step
    // (the Adagrad special case aside)
    {
      std::vector<T> zeros;
      for (const ZeroGroup& g : zgroups) {
        zeros.push_back(e.empty(Shape{g.layout.partition_size}, DType::kF32, Category::kTemporaries,
                                Label{"ZeRO initialize_optimizer_states zero grad"}));
      }
    }
  }

  // The gradient hook of each parameter (create_gradient_handling_hooks -> grad_handling_hook ->
  // process_gradients -> reduce_ready_partitions_and_remove_grads -> reduce_independent_p_g_buckets_and_remove_grads),
  // after AccumulateGrad.
  void zero_hook(int32_t row) {
    if (!inv.parameters[static_cast<size_t>(row)].trainable || zero_group_of[static_cast<size_t>(row)] < 0) return;
    const DType bit16 = param_dtype(s.precision);
    // setup_buckets (once per backward: ready_for_gradients): buf_0 = torch.empty(int(reduce_bucket_size),
    // dtype=self.dtype), and buf_1 with overlap_comm
    if (!zero_ready) {
      zero_ready = true;
      zero_buf[0] = e.empty(Shape{zopt.reduce_bucket_elems}, bit16, Category::kZeroBuckets, Label{"ZeRO IPG buffer buf_0"});
      if (zopt.overlap_comm) {
        zero_buf[1] = e.empty(Shape{zopt.reduce_bucket_elems}, bit16, Category::kZeroBuckets, Label{"ZeRO IPG buffer buf_1"});
      }
      zero_index = 0;
    }
    zero_reached[static_cast<size_t>(row)] = 1;
    // process_gradients: `if self.partition_gradients or self.overlap_comm:` reduce_ready_partitions_and_remove_grads,
    // which reduces `if self.partition_gradients or self.is_gradient_accumulation_boundary()`. Stage 1 without
    // overlap_comm leaves the full bit16 .grad to the engine's reduce_gradients at the boundary.
    const bool boundary = e.micro == synced_micro;
    if (zopt.stage == 1 && !(zopt.overlap_comm && boundary)) return;
    zero_bucket_add(row);
  }

  // reduce_independent_p_g_buckets_and_remove_grads (contiguous_gradients)
  void zero_bucket_add(int32_t row) {
    const uint64_t n = row_numel(row);
    if (n == 0) return;
    // `if bucket.elements + param.numel() > self.reduce_bucket_size`: reduce, then swap buffers with overlap_comm
    if (zero_elems + n > zopt.reduce_bucket_elems) {
      zero_reduce_ipg();
      if (zopt.overlap_comm) zero_index = 1 - zero_index;
    }
    // a parameter larger than the bucket is reduced from its own .grad (extra_large_param_to_reduce); the others
    // are copied into the bucket and `grad_reduc.data = new_grad_tensor.data.view_as(grad_reduc)`: the grad
    // autograd made is freed
    if (n <= zopt.reduce_bucket_elems) {
      const Shape sh = row_shape(row);
      e.grad(row) = e.view(zero_buf[zero_index], sh, contiguous_strides(sh));
    }
    zero_elems += n;
    zero_bucket_rows.push_back(row);
  }

  // reduce_ipg_grads: average_tensor on the bucket's filled part (reduce_scatter: allreduce_and_scatter, which
  // flattens each small bucket of slices before its all-reduce), then per parameter: this rank's partition ->
  // copy_grads_in_partition, the others' -> clear_grad_attribute (.grad = None); bucket.clear().
  void zero_reduce_ipg() {
    if (zero_bucket_rows.empty()) return;
    const DType bit16 = param_dtype(s.precision);
    std::vector<const ZeroParamPlace*> places;
    for (int32_t row : zero_bucket_rows) places.push_back(&zero_place(row));
    for (uint64_t a : zero_reduce_flat_allocs(zero_bucket_slices(places), zopt.reduce_bucket_elems)) {
      // allreduce_bucket: tensor = self.flatten(bucket) (at::cat of the slices), all-reduced in place, copied back
      // into this rank's slices; the copy dies when allreduce_and_copy_with_multiple_ranks returns
      if (a) {
        T flat = e.empty(Shape{a}, bit16, Category::kZeroBuckets, Label{"ZeRO allreduce_bucket flatten (cat)"});
      }
    }
    for (int32_t row : zero_bucket_rows) {
      if (zero_mine[static_cast<size_t>(row)]) {
        // copy_grads_in_partition: grads_in_partition = torch.empty(sum of numel of params_in_partition over the
        // groups), once per backward; the grad is copied in and re-pointed
        if (!zero_gip) {
          uint64_t total = 0;
          for (const ZeroGroup& g : zgroups) total = checked_add(total, g.layout.in_partition_numel, "ZeRO partition");
          zero_gip = e.empty(Shape{total}, bit16, Category::kGradients, Label{"ZeRO grads_in_partition"});
        }
        const Shape sh = row_shape(row);
        e.grad(row) = e.view(zero_gip, sh, contiguous_strides(sh));
      } else if (zopt.stage == 2) {
        e.grad(row).reset();  // clear_grad_attribute; stage 1 keeps it (a view of the IPG buffer) until the epilogue
      }
    }
    zero_bucket_rows.clear();
    zero_elems = 0;
  }

  // independent_gradient_partition_epilogue, when the backward's last gradient hook has run.
  // The engine's _backward_epilogue after loss.backward() -> allreduce_gradients: stage 2 every micro-batch
  // (overlapping_partition_gradients_reduce_epilogue); stage 1 at the accumulation boundary only
  // (reduce_gradients: without overlap_comm, every parameter with a .grad, in group order, through the bucket,
  // then the same epilogue).
  void zero_epilogue(bool boundary) {
    if (!zero_ready) return;
    if (zopt.stage == 1) {
      if (!boundary) return;  // the full bit16 gradients accumulate in .grad; the IPG buffers stay
      if (!zopt.overlap_comm) {
        for (const ZeroGroup& g : zgroups) {
          for (int32_t row : g.rows) {
            if (e.grad(row)) zero_bucket_add(row);
          }
        }
      }
    }
    zero_reduce_ipg();
    // all_grad_tensors[i] = get_all_grad_tensors(params_in_partition[i]): references to their .grad (views of
    // grads_in_partition; zeros_like for one without a .grad); a later micro-batch's are added in place
    if (!zero_held) {
      zero_held = zero_gip;
      for (const ZeroGroup& g : zgroups) {
        for (uint32_t k : g.layout.in_partition) {
          const int32_t row = g.rows[k];
          if (e.grad(row)) continue;
          throw Error(fmt::format("DeepSpeed ZeRO: parameter {} got no gradient in the backward (get_all_grad_tensors' "
                                  "zeros_like is not simulated)", inv.parameters[static_cast<size_t>(row)].name));
        }
      }
    }
    if (boundary) {
      // averaged_gradients[i] = get_flat_partition(..., return_tensor_list=True): narrowed views, plus torch.zeros
      // for a partition that runs past the group's elements (or holds no parameter)
      for (ZeroGroup& g : zgroups) {
        std::vector<uint64_t> pad;
        (void)zero_partition_slices(g.layout, &pad);
        for (uint64_t n : pad) {
          g.pads.push_back(e.empty(Shape{n}, param_dtype(s.precision), Category::kGradients, Label{"ZeRO partition zeros"}));
        }
      }
      zero_boundary_done = true;
    }
    // _release_ipg_buffers: bucket.buffer.clear(), grads_in_partition = None; _clear_param_grad_only: every
    // p.grad = None (the partition's gradients live on in all_grad_tensors / averaged_gradients)
    zero_buf[0].reset();
    zero_buf[1].reset();
    zero_gip.reset();
    for (T& g : e.grads()) g.reset();
    zero_ready = false;
  }

  // DeepSpeedZeroOptimizer.step (not offloaded), from the engine's step at the accumulation boundary.
  void zero_step(bool first) {
    e.phase = Phase::kOptimizer;
    const DType bit16 = param_dtype(s.precision);
    // check_overflow (bf16: bfloat16_config.check_grad_overflow, default True, precision_config.py) ->
    // has_overflow_partitioned_grads_serial: invalid_grad_count = torch.zeros([1]); per averaged gradient
    // _has_inf_or_nan: x.float(), isnan, isinf, logical_or, .float(), .max() (the locals die when it returns)
    {
      T count = e.empty(Shape{1}, DType::kF32, Category::kTemporaries, Label{"ZeRO invalid_grad_count"});
      for (const ZeroGroup& g : zgroups) {
        for (uint64_t n : zero_partition_slices(g.layout)) {
          T f = e.empty(Shape{n}, DType::kF32, Category::kTemporaries, Label{"ZeRO _has_inf_or_nan x.float()"});
          T nan = e.empty(Shape{n}, DType::kBool, Category::kTemporaries, Label{"ZeRO _has_inf_or_nan isnan"});
          T inf = e.empty(Shape{n}, DType::kBool, Category::kTemporaries, Label{"ZeRO _has_inf_or_nan isinf"});
          T either = e.empty(Shape{n}, DType::kBool, Category::kTemporaries, Label{"ZeRO _has_inf_or_nan logical_or"});
          T ef = e.empty(Shape{n}, DType::kF32, Category::kTemporaries, Label{"ZeRO _has_inf_or_nan .float()"});
          T mx = e.empty(Shape{}, DType::kF32, Category::kTemporaries, Label{"ZeRO _has_inf_or_nan .max()"});
        }
      }
    }
    // scaled_global_norm -> get_grad_norm_direct per group: torch.linalg.vector_norm(g.data.double()) per
    // gradient of params_in_partition (zip with the params: the zeros pad is not normed); the 0-d norms are kept
    // until torch.stack(all_norms). float64 is 8 bytes an element; the simulator's DType has no float64, so the
    // int64 rows stand for it (the bytes are what count).
    {
      std::vector<T> groups_norm;
      for (const ZeroGroup& g : zgroups) {
        std::vector<T> norms;
        const std::vector<uint64_t> sl = zero_partition_slices(g.layout);
        for (size_t k = 0; k < sl.size() && k < g.layout.in_partition.size(); ++k) {
          T d = e.empty(Shape{sl[k]}, DType::kI64, Category::kTemporaries, Label{"ZeRO grad norm g.double()"});
          norms.push_back(e.empty(Shape{}, DType::kI64, Category::kTemporaries, Label{"ZeRO grad norm"}));
        }
        T stacked = e.empty(Shape{norms.size()}, DType::kI64, Category::kTemporaries, Label{"ZeRO grad norm stack"});
        norms.clear();
        groups_norm.push_back(e.empty(Shape{}, DType::kF32, Category::kTemporaries, Label{"ZeRO group grad norm"}));
      }
    }
    for (size_t gi = 0; gi < zgroups.size(); ++gi) {
      ZeroGroup& g = zgroups[gi];
      const uint64_t ps = g.layout.partition_size;
      // flat_grad_partition = self.flatten(averaged_gradients[i]) (a view for a single tensor, at::cat
      // otherwise); single_grad_partition = flat_grad_partition.to(fp32); del flat_grad_partition
      T single;
      {
        const size_t pieces = zero_partition_slices(g.layout).size();
        T flat = pieces > 1 ? e.empty(Shape{ps}, bit16, Category::kTemporaries, Label{"ZeRO flat_grad_partition (cat)"}) : T();
        single = e.empty(Shape{ps}, DType::kF32, Category::kGradients, Label{"ZeRO single_grad_partition (fp32)"});
      }
      // averaged_gradients[i] = None; all_grad_tensors[i] = None: the partition's gradients go once no group
      // holds them
      g.pads.clear();
      if (gi + 1 == zgroups.size()) zero_held.reset();
      // unscale_and_clip_grads: in place. _optimizer_step(i): optimizer.step() over this group's fp32 partition
      zero_adam(g.layout.partition_size, first, Label{intern_name(fmt::format("ZeRO fp32 partition [{}] state", gi))});
      // single_partition_of_fp32_groups[i].grad = None; the bit16 partition copy_ is in place
      single.reset();
    }
    // all_gather_dp_groups -> all_gather_into_tensor_dp_groups (dist.has_all_gather_into_tensor()): into the flat
    // buffers, in place
    zero_boundary_done = false;
  }

  // torch AdamW/Adam over one fp32 partition: a DeepSpeed config without an "optimizer" section gets the
  // Trainer's own (transformers integrations/deepspeed.py deepspeed_optim_sched: trainer.create_optimizer(),
  // zero_allow_untested_optimizer); __init__ sets param_group['params'] = [the fp32 partition].
  // its state at the first step, and the update's temporaries as Loop::step_group models them.
  // Adam over one fp32 partition of `numel` elements (ZeRO-1/2's group, ZeRO-3's sub-group): its state, made at
  // the first step under `state_label`, and the step's temporaries
  void zero_adam(uint64_t numel, bool first, Label state_label) {
    // FLOPs: torch AdamW over the fp32 partition (count_update's constants), one launch per op
    for (uint64_t k = 0; k < kAdamUnfusedKernels; ++k) {
      e.count(FlopKind::kOptimizer, per_kernel(detail::sat_mul(numel, kAdamWFlopsPerElement), kAdamUnfusedKernels),
              per_kernel(detail::sat_mul(numel, kAdamUnfusedPasses * 4), kAdamUnfusedKernels), DType::kF32);
    }
    const Shape sh{numel};
    if (first) {
      for (const StateTensor& t : optimizer_state_tensors(s.optimizer, opt_impl, {numel}, DType::kF32,
                                                          bnb_block_size(s.optimizer_version))) {
        state.push_back(e.empty(Shape::of(t.shape), t.dtype, Category::kOptimizer, state_label));
      }
    }
    if (opt_impl == OptimizerImpl::kForeach) {
      T sqrt = e.empty(sh, DType::kF32, Category::kTemporaries, Label{"adam exp_avg_sq_sqrt"});
    } else if (opt_impl == OptimizerImpl::kForLoop) {
      T sq = e.empty(sh, DType::kF32, Category::kTemporaries, Label{"adam sqrt"});
      T denom = e.empty(sh, DType::kF32, Category::kTemporaries, Label{"adam denom"});
    }
  }

  // --- DeepSpeed ZeRO-3 (zero.h): zero.Init (runtime/zero/partition_parameters.py), the parameter coordinator
  // (partitioned_param_coordinator.py) and DeepSpeedZeroOptimizer_Stage3 (stage3.py), 0.19.6 ---------------
  // Policy (not per-tensor timing): a module's parameters are all-gathered when the forward code first takes one
  // of them (the pre-forward hook's fetch_sub_module) or when a backward node that saved one runs (the
  // pre-backward hook), and released when the next module is gathered, when the head's forward returns, and at
  // the end of the backward (the post-forward / post-backward hooks' release_sub_module). The first forward and
  // backward have no complete trace (reset_step at that forward: INVALID -> RECORD; they record it): every
  // parameter of a module is released after it, persistent ones included (release_sub_module's untraced branch),
  // and nothing is prefetched. From the second forward the trace is complete (RECORD -> COMPLETE): persistent
  // parameters stay gathered until the optimizer step releases everything (__params_to_release skips ds_persist;
  // step -> _partition_all_parameters), a module reused within max_reuse_distance elements of the trace keeps its
  // parameters, and each fetch prefetches the next modules of the trace up to prefetch_bucket_size elements
  // (z3_prefetch). An all-gather is complete when issued and a release frees at once (record_stream's delay on the
  // all-gather stream is not modelled).
  bool z3 = false;
  std::vector<uint64_t> z3_part;                  // per row: ds_tensor elements, ceil(numel / world)
  std::vector<char> z3_persist;                   // per row: ds_persist
  std::vector<int32_t> z3_module_of;              // per row: its module (the name before the last '.')
  std::vector<std::vector<int32_t>> z3_modules;   // per module: its rows
  std::vector<T> z3_ds;                           // per row: ds_tensor on the device (empty when on the host)
  std::vector<T> z3_flat_of;                      // per row: the all-gathered buffer its .data views
  std::vector<int32_t> z3_live;                   // modules gathered and not yet released
  std::vector<T> z3_fp32;                         // fp32_partitioned_groups_flat per sub-group (device)
  std::vector<uint64_t> z3_sub;                   // sub-group partition elements
  T z3_nothing;                                   // torch.empty(0): what free_param points .data at
  T z3_lp, z3_grad_flat, z3_ipg;                  // lp_param_buffer, grad_partitions_flat_buffer, IPG buffer
  uint64_t z3_ipg_elems = 0;
  std::vector<int32_t> z3_ipg_rows;
  bool z3_traced = false;                         // the coordinator's trace is complete
  // The coordinator's trace (__submodule_order): the modules in the order the first forward and backward used them
  // (a module used twice in a row counted once); from the second step each release looks max_reuse_distance
  // elements ahead in it (__params_to_release).
  std::vector<int32_t> z3_trace;
  std::vector<uint64_t> z3_trace_numel;   // prefix sums of the modules' ds_numel along the trace
  std::vector<size_t> z3_trace_next;      // per position: the module's next position (npos: none)
  std::vector<size_t> z3_live_pos;        // per live module: its trace position
  size_t z3_pos = 0;                      // the current position (this forward and backward)
  size_t z3_next = 0;                     // the next position (a traced step)
  size_t z3_queue = 0;                    // __param_queue's head, as a trace position (a traced step)
  // __n_available_params: elements gathered since this forward began (reset_step sets it to 0 at every forward's
  // start; a release of an older gather takes it below zero, as in Python)
  int64_t z3_available = 0;
  int32_t z3_last = -1;                   // the module used last
  std::vector<uint64_t> z3_module_numel;  // per module: the ds_numel of its parameters

  void z3_init() {
    z3 = true;
    const size_t n = inv.parameters.size();
    std::vector<uint64_t> numels;
    for (size_t i = 0; i < n; ++i) numels.push_back(inv.parameters[i].elems.value);
    for (uint64_t x : numels) z3_part.push_back(zero3_partition_numel(x, zopt.ranks));
    // mark_persistent_parameters over module.named_parameters() (the inventory's order)
    z3_persist = zero3_persistent(numels, zopt.param_persistence_threshold, zopt.model_persistence_threshold);
    z3_module_of.assign(n, -1);
    std::unordered_map<std::string_view, int32_t> ids;
    for (size_t i = 0; i < n; ++i) {
      const std::string_view name = inv.parameters[i].name;
      const size_t dot = name.rfind('.');
      const std::string_view mod = dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
      auto [it, added] = ids.emplace(mod, static_cast<int32_t>(z3_modules.size()));
      if (added) z3_modules.emplace_back();
      z3_modules[static_cast<size_t>(it->second)].push_back(static_cast<int32_t>(i));
      z3_module_of[i] = it->second;
    }
    z3_module_numel.assign(z3_modules.size(), 0);
    for (size_t i = 0; i < n; ++i) z3_module_numel[static_cast<size_t>(z3_module_of[i])] += numels[i];
    z3_ds.resize(n);
    z3_flat_of.resize(n);
    zero_reached.assign(n, 0);
  }

  // zero.Init as from_pretrained runs it under the Trainer's HfDeepSpeedConfig: each parameter is partitioned
  // as its module is built (_partition_param: ds_tensor = torch.empty(partition_size) on the device, or the CPU
  // for offload_param unless ds_persist; free_param: param.data = torch.empty(0)). The full parameter is made
  // first (the module's own __init__), then freed.
  void z3_partition_at_load(size_t i, T& p) {
    const DType bit16 = param_dtype(s.precision);
    if (!z3_nothing) z3_nothing = e.empty(Shape{0}, bit16, Category::kWeights, Label{"ZeRO-3 torch.empty(0)"});
    if (!zopt.offload_params || z3_persist[i]) {
      z3_ds[i] = e.empty(Shape{z3_part[i]}, bit16, Category::kWeights, Label{"ZeRO-3 ds_tensor"});
    }
    set_data(p, z3_nothing);
  }

  // DeepSpeedZeroOptimizer_Stage3.__init__ (deepspeed.initialize -> _configure_zero_optimizer).
  void z3_construct() {
    e.phase = Phase::kSetup;
    const DType bit16 = param_dtype(s.precision);
    std::vector<int32_t> rows;  // the optimizer's groups in order (fp16_groups)
    for (const std::vector<int32_t>& g : zero_param_groups(inv)) {
      std::vector<uint64_t> parts;
      for (int32_t r : g) {
        rows.push_back(r);
        parts.push_back(z3_part[static_cast<size_t>(r)]);
      }
      for (uint64_t x : zero3_sub_groups(parts, zopt.sub_group_size)) z3_sub.push_back(x);
    }
    if (rows.empty()) throw Error("DeepSpeed ZeRO-3: no parameter requires grad");
    uint64_t total = 0;
    for (int32_t r : rows) total = checked_add(total, z3_part[static_cast<size_t>(r)], "ZeRO-3 partitions");
    // _create_fp16_partitions_with_defragmentation: `if not self.offload_param: self.lp_param_buffer =
    // defragment(parameter_partitions)`: one flat buffer, each ds_tensor re-pointed into it (the old ones freed)
    if (zopt.offload_params) {
      // param_groups_fp16_flat_cpu_memory (pinned host) and _move_to_flat_buffer: `src.data = dest.data` for every
      // trainable ds_tensor, the persistent ones' device partitions too
      for (int32_t r : rows) z3_ds[static_cast<size_t>(r)].reset();
    } else {
      z3_lp = e.empty(Shape{total}, bit16, Category::kWeights, Label{"ZeRO-3 lp_param_buffer"});
      for (int32_t r : rows) {
        const auto i = static_cast<size_t>(r);
        z3_ds[i] = e.view(z3_lp, Shape{z3_part[i]}, contiguous_strides(Shape{z3_part[i]}));
      }
    }
    // _create_fp32_partitions: `converted = fp16_partitioned_groups_flat[i].to(device, dtype=fp32)`;
    // `.clone().detach()` kept; with offload_optimizer both on the CPU (host memory, see the estimate)
    if (!zopt.offload_optimizer) {
      for (uint64_t x : z3_sub) {
        T converted = e.empty(Shape{x}, DType::kF32, Category::kTemporaries, Label{"ZeRO-3 fp16 partition .to(fp32)"});
        z3_fp32.push_back(e.empty(Shape{x}, DType::kF32, Category::kOptimizer, Label{"ZeRO-3 fp32 partition"}));
      }
      // initialize_optimizer_states: gradient_buffer = torch.zeros(largest sub-group, fp32) on the device, each
      // group's .grad a narrow of it, all set to None at the end (not offloaded)
      T gradient_buffer = e.empty(Shape{*std::max_element(z3_sub.begin(), z3_sub.end())}, DType::kF32,
                                  Category::kTemporaries, Label{"ZeRO-3 initialize_optimizer_states gradient_buffer"});
    }
    // _setup_for_real_optimizer: `if self.contiguous_gradients:` bucket.buffer = torch.empty(reduce_bucket_size,
    // dtype) on the device, kept; grad_partitions_flat_buffer = torch.zeros(sum partition_numel) on self.device
    // (the CPU with offload_optimizer, pinned with pin_memory)
    if (zopt.contiguous_gradients) {
      z3_ipg = e.empty(Shape{zopt.reduce_bucket_elems}, bit16, Category::kZeroBuckets, Label{"ZeRO-3 IPG buffer"});
    }
    if (!zopt.offload_optimizer) {
      z3_grad_flat = e.empty(Shape{total}, bit16, Category::kGradients, Label{"ZeRO-3 grad_partitions_flat_buffer"});
    }
  }

  // __params_to_release (complete trace): the module at trace position `pos` keeps its parameters when it is
  // used again before max_reuse_distance elements of the trace's modules (from the next position on) are passed
  bool z3_reused_soon(size_t pos) const {
    if (pos >= z3_trace_next.size() || z3_trace_next[pos] == std::string::npos) return false;
    return z3_trace_numel[z3_trace_next[pos]] - z3_trace_numel[pos + 1] < zopt.max_reuse_distance;
  }

  // release_sub_module for every module in use (__release_param -> param.partition(): .data = torch.empty(0)).
  // Without a trace every parameter of the module goes; with one, persistent parameters and those reused within
  // max_reuse_distance stay.
  void z3_release_live() {
    for (size_t k = 0; k < z3_live.size(); ++k) {
      if (z3_traced && z3_reused_soon(z3_live_pos[k])) continue;
      for (int32_t r : z3_modules[static_cast<size_t>(z3_live[k])]) {
        const auto i = static_cast<size_t>(r);
        if (!z3_flat_of[i]) continue;
        if (z3_traced && z3_persist[i]) continue;  // __params_to_release: `if not p.ds_persist`
        set_data(w.params[i], z3_nothing);
        z3_flat_of[i].reset();
        z3_available -= static_cast<int64_t>(inv.parameters[i].elems.value);
      }
    }
    z3_live.clear();
    z3_live_pos.clear();
  }

  // a module's pre-forward / pre-backward hook: the trace records it (first step) or advances (later steps)
  void z3_touch(int32_t mod) {
    if (mod == z3_last) return;
    z3_last = mod;
    if (!z3_traced) {
      z3_trace.push_back(mod);
      z3_pos = z3_trace.size() - 1;
    } else {
      z3_pos = z3_next++;
      // the same program runs every step; a different module order would make DeepSpeed invalidate its trace
      if (z3_pos >= z3_trace.size() || z3_trace[z3_pos] != mod) {
        throw Error("internal: DeepSpeed ZeRO-3's module trace differs between steps");
      }
    }
  }

  // the trace is complete: its prefix sums and next uses
  void z3_finish_trace() {
    z3_trace_numel.assign(z3_trace.size() + 1, 0);
    for (size_t t = 0; t < z3_trace.size(); ++t) {
      z3_trace_numel[t + 1] = checked_add(z3_trace_numel[t], z3_module_numel[static_cast<size_t>(z3_trace[t])], "ZeRO-3 trace");
    }
    z3_trace_next.assign(z3_trace.size(), std::string::npos);
    std::vector<size_t> seen(z3_modules.size(), std::string::npos);
    for (size_t t = z3_trace.size(); t-- > 0;) {
      z3_trace_next[t] = seen[static_cast<size_t>(z3_trace[t])];
      seen[static_cast<size_t>(z3_trace[t])] = t;
    }
  }

  // modules `ms` start their forward or backward: the modules in use before are released (their post hooks), each
  // of `ms` is traced and gathered
  void z3_enter(const std::vector<int32_t>& ms) {
    z3_release_live();
    for (int32_t mod : ms) {
      if (std::find(z3_live.begin(), z3_live.end(), mod) != z3_live.end()) continue;
      z3_touch(mod);
      z3_gather(mod);
      z3_live.push_back(mod);
      z3_live_pos.push_back(z3_pos);
      if (z3_traced) z3_prefetch();
    }
  }

  // _fetch_sub_module_impl with a complete trace: the current module's entries leave __param_queue, then
  // `while self.__param_queue and numel_prefetching < max_params_to_prefetch` (min(max_live_parameters -
  // __n_available_params, prefetch_bucket_size)) pops the next entries and all-gathers those NOT_AVAILABLE. Here
  // by module (the trace's unit), each module's parameters gathered together.
  void z3_prefetch() {
    if (z3_queue <= z3_pos) z3_queue = z3_pos + 1;
    const int64_t room = static_cast<int64_t>(zopt.max_live_parameters) - z3_available;  // both below 2^63
    if (zopt.prefetch_bucket_elems == 0 || room <= 0) return;
    const uint64_t budget = std::min(static_cast<uint64_t>(room), zopt.prefetch_bucket_elems);
    uint64_t prefetching = 0;
    while (z3_queue < z3_trace.size() && prefetching < budget) {
      const int32_t mod = z3_trace[z3_queue++];
      for (int32_t r : z3_modules[static_cast<size_t>(mod)]) {
        if (!z3_flat_of[static_cast<size_t>(r)]) prefetching += inv.parameters[static_cast<size_t>(r)].elems.value;
      }
      z3_gather(mod);
    }
  }

  // fetch_sub_module -> __all_gather_params -> all_gather_coalesced over the module's NOT_AVAILABLE parameters
  // (partition_parameters.py): one parameter goes through _all_gather_sequential, param_buffer = torch.empty(
  // ceil(ds_numel / world) * world) and param.data = param_buffer.narrow(0, 0, ds_numel).view(ds_shape) (the
  // padded buffer stays); several through _all_gather_dtype, flat_tensor = torch.empty(partition_sz * world)
  // and, in AllGatherCoalescedHandle.wait, each param.data = torch.cat(its parts) (numel elements); the flat
  // tensor goes with the handle once every parameter has been popped from the in-flight registry.
  void z3_gather(int32_t mod) {
    const DType bit16 = param_dtype(s.precision);
    uint64_t per_rank = 0;
    std::vector<int32_t> todo;
    for (int32_t r : z3_modules[static_cast<size_t>(mod)]) {
      if (z3_flat_of[static_cast<size_t>(r)]) continue;
      todo.push_back(r);
      per_rank = checked_add(per_rank, z3_part[static_cast<size_t>(r)], "ZeRO-3 gather");
    }
    if (todo.empty()) return;
    for (int32_t r : todo) z3_available += static_cast<int64_t>(inv.parameters[static_cast<size_t>(r)].elems.value);
    const uint64_t gathered = checked_mul(per_rank, zopt.ranks, "ZeRO-3 gather");
    e.count_dp_collective(true, bytes_of(Elems(gathered), bit16).value);  // the step time's (step_time.cc)
    // offload_param: the inputs are `p.ds_tensor.to(device)` copies of the CPU partitions, alive until the
    // all-gather's input is assembled (a persistent parameter's ds_tensor is on the device already)
    auto host_copies = [&] {
      std::vector<T> copies;
      if (!zopt.offload_params) return copies;
      for (int32_t r : todo) {
        const auto i = static_cast<size_t>(r);
        if (z3_ds[i]) continue;  // on the device
        copies.push_back(e.empty(Shape{z3_part[i]}, bit16, Category::kTemporaries, Label{"ZeRO-3 ds_tensor.to(device)"}));
      }
      return copies;
    };
    if (todo.size() == 1) {
      const auto i = static_cast<size_t>(todo[0]);
      T buf = e.empty(Shape{gathered}, bit16, Category::kWeights, Label{"ZeRO-3 all-gathered param_buffer"});
      (void)host_copies();
      const Shape sh = row_shape(todo[0]);
      set_data(w.params[i], e.view(buf, sh, contiguous_strides(sh)));
      z3_flat_of[i] = std::move(buf);
      return;
    }
    T flat = e.empty(Shape{gathered}, bit16, Category::kZeroBuckets, Label{"ZeRO-3 all_gather_coalesced flat_tensor"});
    (void)host_copies();  // torch.cat([...], out=partitions[rank]): the copies die with the list
    for (int32_t r : todo) {
      const auto i = static_cast<size_t>(r);
      const Shape sh = row_shape(r);
      T data = e.empty(sh, bit16, Category::kWeights, Label{"ZeRO-3 all-gathered param (torch.cat)"});
      set_data(w.params[i], data);
      z3_flat_of[i] = std::move(data);
    }
  }

  // the forward code takes parameter `row` (LoadedModel::on_use): its module's pre-forward hook, unless the
  // module is the one running
  void z3_use(int row) {
    const int32_t mod = z3_module_of[static_cast<size_t>(row)];
    if (mod == z3_last && std::find(z3_live.begin(), z3_live.end(), mod) != z3_live.end()) return;
    z3_enter({mod});
  }

  // a backward node is about to run (Engine::pre_node): the modules of the parameters it saved, and of those it
  // sends a gradient to (the module's backward: DeepSpeed's pre-backward hook gathers every parameter of the
  // module whose output gradient arrives, the embedding's weight too, whose backward does not read it)
  void z3_pre_node(Node& n) {
    std::vector<int32_t> need;
    auto want = [&](int32_t row) {
      if (row < 0 || static_cast<size_t>(row) >= z3_module_of.size()) return;
      const int32_t mod = z3_module_of[static_cast<size_t>(row)];
      if (std::find(need.begin(), need.end(), mod) == need.end()) need.push_back(mod);
    };
    for (const T& t : n.saved) {
      if (t && t->is_param) want(t->label.row);
    }
    for (uint8_t k = 0; k < n.n_next; ++k) {
      if (n.next[k].node && n.next[k].node->is_accumulate && n.next[k].node->leaf < 0) want(n.next[k].node->param);
    }
    if (need.empty()) return;
    bool all_live = true;
    for (int32_t mod : need) all_live = all_live && std::find(z3_live.begin(), z3_live.end(), mod) != z3_live.end();
    if (all_live) return;
    z3_enter(need);
  }

  // the parameter's gradient hook (create_reduce_and_remove_grad_hooks -> reduce_ready_partitions_and_remove_grads
  // -> reduce_independent_p_g_buckets_and_remove_grads)
  void z3_grad_hook(int32_t row) {
    const auto i = static_cast<size_t>(row);
    if (!inv.parameters[i].trainable || !e.grad(row)) return;
    zero_reached[i] = 1;
    const uint64_t n = inv.parameters[i].elems.value;
    // `if bucket.elements + param.ds_numel > self.reduce_bucket_size and bucket.elements > 0`
    if (z3_ipg_elems + n > zopt.reduce_bucket_elems && z3_ipg_elems > 0) z3_reduce_ipg();
    // __add_grad_to_ipg_bucket: `if self.contiguous_gradients and bucket.elements + param.grad.numel() <=
    // self.reduce_bucket_size`: copied into the buffer and param.grad.data = the buffer's view (the grad
    // autograd made is freed); otherwise the grad itself is kept for the reduction
    if (zopt.contiguous_gradients && z3_ipg_elems + n <= zopt.reduce_bucket_elems) {
      const Shape sh = row_shape(row);
      e.grad(row) = e.view(z3_ipg, sh, contiguous_strides(sh));
    }
    z3_ipg_elems += n;
    z3_ipg_rows.push_back(row);
  }

  // __reduce_and_partition_ipg_grads: reduce_scatter True -> __avg_scatter_grads -> reduce_scatter_coalesced (the
  // interleaved flat buffer, zero3_reduce_scatter_flat), then partition_grads copies each partition into
  // grad_partitions_flat_buffer (offload: the host buffer, through a device copy `grad_buffer.to(device)` of each
  // partition) and sets param.grad = None
  void z3_reduce_ipg() {
    if (z3_ipg_rows.empty()) return;
    const DType bit16 = param_dtype(s.precision);
    std::vector<uint64_t> numels;
    for (int32_t r : z3_ipg_rows) numels.push_back(inv.parameters[static_cast<size_t>(r)].elems.value);
    {
      // the collective's input: world x the partitions, whether the flat buffer is a cat or a view
      uint64_t parts = 0;
      for (int32_t r : z3_ipg_rows) parts = checked_add(parts, z3_part[static_cast<size_t>(r)], "ZeRO-3 reduce-scatter");
      e.count_dp_collective(false, bytes_of(Elems(checked_mul(parts, zopt.ranks, "ZeRO-3 reduce-scatter")), bit16).value);
      const uint64_t flat = zero3_reduce_scatter_flat(numels, zopt.ranks);
      T buf = flat ? e.empty(Shape{flat}, bit16, Category::kZeroBuckets, Label{"ZeRO-3 reduce_scatter_coalesced cat"}) : T();
      for (int32_t r : z3_ipg_rows) {
        const auto i = static_cast<size_t>(r);
        // contains_real_data: partition_numel * rank < ds_numel (rank 0: any parameter with elements)
        if (zopt.offload_optimizer && inv.parameters[i].elems.value > 0) {
          T dev = e.empty(Shape{z3_part[i]}, bit16, Category::kTemporaries, Label{"ZeRO-3 grad_buffer.to(device)"});
        }
        e.grad(r).reset();
      }
    }
    z3_ipg_rows.clear();
    z3_ipg_elems = 0;
  }

  // the engine's backward epilogue: independent_gradient_partition_epilogue reduces what is left in the bucket;
  // the last modules' post-backward hooks release them
  void z3_epilogue() {
    z3_reduce_ipg();
    z3_release_live();
    if (!z3_traced) {
      z3_traced = true;
      z3_finish_trace();
    }
    // the next forward's _start_of_forward_hook -> reset_step: the trace completes (it was recorded from the first
    // forward: INVALID -> RECORD at that forward's reset_step, RECORD -> COMPLETE at the next), the fetch queue and
    // __n_available_params start again
    z3_pos = z3_next = z3_queue = 0;
    z3_available = 0;
    z3_last = -1;
  }

  // DeepSpeedZeroOptimizer_Stage3.step (not offloaded): per sub-group, _prepare_fp32_grad_for_sub_group
  // (the partition's gradients .to(fp32) as the fp32 partition's .grad), the optimizer step over the fp32
  // partition (state created at the first step), the grad dropped, the bf16 partition copied back in place.
  // With offload_optimizer everything here runs on the CPU (DeepSpeedCPUAdam): nothing on the device.
  void z3_step(bool first) {
    e.phase = Phase::kOptimizer;
    // step -> _partition_all_parameters -> release_and_reset_all: every gathered parameter is released, the
    // persistent ones too (parameter_offload.py partition_all_parameters, partitioned_param_coordinator.py)
    for (size_t i = 0; i < z3_flat_of.size(); ++i) {
      if (!z3_flat_of[i]) continue;
      set_data(w.params[i], z3_nothing);
      z3_flat_of[i].reset();
    }
    z3_live.clear();
    z3_live_pos.clear();
    // (the overflow check runs for float16 only: _overflow_check_and_loss_scale_update)
    if (zopt.offload_optimizer) return;  // the norms and the update run on the CPU
    // _get_norm_groups -> get_grad_norm_direct per group: g.to(device).double().norm(2) per gradient partition
    // (the float64 copy dies with the expression; the 0-d norms live until torch.stack). float64 is 8 bytes an
    // element: the simulator's int64 rows stand for it.
    {
      std::vector<T> norms;
      for (const std::vector<int32_t>& g : zero_param_groups(inv)) {
        for (int32_t r : g) {
          T d = e.empty(Shape{z3_part[static_cast<size_t>(r)]}, DType::kI64, Category::kTemporaries,
                        Label{"ZeRO-3 grad norm g.double()"});
          norms.push_back(e.empty(Shape{}, DType::kI64, Category::kTemporaries, Label{"ZeRO-3 grad norm"}));
        }
      }
      T stacked = e.empty(Shape{norms.size()}, DType::kI64, Category::kTemporaries, Label{"ZeRO-3 grad norm stack"});
    }
    for (size_t gi = 0; gi < z3_sub.size(); ++gi) {
      const Shape sh{z3_sub[gi]};
      // _prepare_fp32_grad_for_sub_group: self.flatten(averaged_gradients[i]) (at::cat of the partitions' views
      // of grad_partitions_flat_buffer) .to(fp32); the bf16 cat dies with the expression
      T g32;
      {
        T cat = e.empty(sh, param_dtype(s.precision), Category::kTemporaries, Label{"ZeRO-3 flatten(averaged_gradients)"});
        g32 = e.empty(sh, DType::kF32, Category::kGradients, Label{"ZeRO-3 fp32 grad partition"});
      }
      zero_adam(z3_sub[gi], first, Label{"ZeRO-3 fp32 partition state"});
    }
  }

  // FSDP1: accelerate's clip_grad_norm_ calls FullyShardedDataParallel.clip_grad_norm_ (fully_sharded_data_parallel.py,
  // not torch.nn.utils' foreach path): _get_grad_norm's per-gradient torch.linalg.vector_norm(grad, dtype=float32)
  // scalars, their torch.stack and its vector_norm (local_sharded_norm, bound until the method returns), then
  // total_norm = local_sharded_norm ** norm_type (all-reduced in place) and ** (1 / norm_type), clip_coef =
  // max_norm / (total_norm + 1e-6), clip_coef_clamped = torch.clamp(clip_coef, max=1.0); each grad.mul_ in place
  // (clip_coef_clamped.to(grad's device and dtype): float32 already, no copy)
  void fsdp1_clip_grad_norm() {
    e.phase = Phase::kGradClip;
    uint64_t n = 0;
    for (size_t i = 0; i < inv.parameters.size(); ++i) n += e.grad(static_cast<int32_t>(i)) ? 1 : 0;
    if (n == 0) return;  // `if len(params_with_grad) == 0: return zero`
    const Label l{"FSDP1 clip_grad_norm_"};
    T local;
    {
      std::vector<T> norms;
      for (uint64_t k = 0; k < n; ++k) norms.push_back(e.empty(Shape{}, DType::kF32, Category::kTemporaries, l));
      T stacked = e.empty(Shape{n}, DType::kF32, Category::kTemporaries, l);
      local = e.empty(Shape{}, DType::kF32, Category::kTemporaries, l);
    }
    T total = e.empty(Shape{}, DType::kF32, Category::kTemporaries, l);  // ** norm_type
    total = e.empty(Shape{}, DType::kF32, Category::kTemporaries, l);    // ** (1.0 / norm_type), rebound
    T coef;
    {
      T plus = e.empty(Shape{}, DType::kF32, Category::kTemporaries, l);  // total_norm + 1e-6
      coef = e.empty(Shape{}, DType::kF32, Category::kTemporaries, l);    // max_norm / (...)
    }
    T clamped = e.empty(Shape{}, DType::kF32, Category::kTemporaries, l);
  }

  void clip_grad_norm() {
    if (fsdp1) {
      fsdp1_clip_grad_norm();
      return;
    }
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
      // (FSDP2: torch.nn.utils.clip_grad_norm_ over the sharded DTensor gradients, accelerate's clip_grad_norm_)
      const uint64_t elems = fsdp ? e.grad(static_cast<int32_t>(i)).shape().numel().value : inv.parameters[i].elems.value;
      max_chunks = std::max(max_chunks, ceil_div(elems, kForeachChunkElems));
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

  // transformers' Adafactor.step's loop locals (adafactor_update)
  struct AdafactorLocals {
    T grad, p32, update;
  };

  void optimizer_step(bool first) {
    e.phase = Phase::kOptimizer;
    if (s.optimizer == Optimizer::kNone) return;
    const auto groups = param_groups();
    AdafactorLocals af;  // transformers' Adafactor: its locals live until step() returns
    if (first && !groups.empty()) create_shared_state();
    for (const std::vector<size_t>& group : groups) step_group(group, first, af);
  }

  // State created once per optimizer object on its first step (bitsandbytes' quantization maps)
  void create_shared_state() {
    for (const StateTensor& t : optimizer_shared_state(s.optimizer)) {
      state.push_back(e.empty(Shape::of(t.shape), t.dtype, Category::kOptimizer, Label{t.what}));
    }
  }

  // Optimizer-in-backward, torchtune's (training/memory.py create_optim_in_bwd_wrapper /
  // register_optim_in_bwd_hooks; recipes/full_finetune_single_device.py optimizer_in_bwd): one optimizer per
  // parameter, `optim_dict[param].step()` then `optim_dict[param].zero_grad()` (set_to_none) in the
  // parameter's post-accumulate-grad hook. So each parameter's state is created lazily at its first update,
  // inside backward, and its .grad is freed right after: the backward holds only the gradients in flight.
  // The recipe then skips its own optimizer.step() and zero_grad().
  std::vector<char> stepped_in_backward;
  void step_in_backward(int32_t i) {
    const size_t pi = static_cast<size_t>(i);
    if (s.optimizer == Optimizer::kNone || !inv.parameters[pi].trainable) return;
    if (stepped_in_backward.size() < inv.parameters.size()) stepped_in_backward.resize(inv.parameters.size());
    const bool first = !stepped_in_backward[pi];
    stepped_in_backward[pi] = 1;
    // each parameter's optimizer is an object of its own, with its own name2qmap (Optimizer8bit.__init__)
    if (first && needs_shared_state(optimizer_state_tensors(s.optimizer, opt_impl, inv.parameters[pi].shape,
                                                            w.params[pi].dtype(), bnb_block_size(s.optimizer_version)))) {
      create_shared_state();
    }
    AdafactorLocals af;
    step_group({pi}, first, af);
    e.grads()[pi].reset();
  }

  // One parameter group of optimizer.step(): the state of its parameters on the first step, then the update.
  // FLOPs per element of one update, by optimizer (trainmem/flops.h), or 0 where not counted:
  // torch/optim/adam.py _single_tensor_adam (torch 2.x), AdamW: param.mul_(1 - lr * weight_decay) 1,
  // exp_avg.lerp_(grad, 1 - beta1) 3, exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) 1 + 3,
  // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps) 3, param.addcdiv_(exp_avg, denom,
  // value=-step_size) 3: 14 (Adam without the decoupled decay: 13 + grad.add(param, alpha=wd) 2 = 15 with
  // weight decay; the Trainer's Adam runs without: 13). torch/optim/sgd.py _single_tensor_sgd: param.add_(grad,
  // alpha=-lr) 2; with momentum buf.mul_(momentum).add_(grad, alpha=1 - dampening) 1 + 2 more: 5.
  static constexpr uint64_t kAdamWFlopsPerElement = 14, kAdamFlopsPerElement = 13;
  static constexpr uint64_t kSgdFlopsPerElement = 2, kSgdMomentumFlopsPerElement = 5;
  // Tensor passes over device memory per element: the fused kernel (_fused_adamw_) reads param, grad, exp_avg,
  // exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7. The foreach and single-tensor paths run one kernel per
  // op above, each reading its operands and writing its result: mul_ 2, lerp_ 3, mul_ 2, addcmul_ 4, sqrt 2,
  // div_ 2, add_ 2, addcdiv_ 4: 21. SGD: add_ 3; with momentum mul_ 2, add_ 3, add_ 3: 8.
  static constexpr uint64_t kAdamFusedPasses = 7, kAdamUnfusedPasses = 21, kAdamUnfusedKernels = 8;
  // One of `kernels` equal launches' share of a saturated-or-exact total (a saturated total stays saturated)
  static uint64_t per_kernel(uint64_t total, uint64_t kernels) { return total == UINT64_MAX ? total : total / kernels; }
  void count_update(const std::vector<size_t>& group) {
    uint64_t per = 0, passes = 0, kernels = 1;
    const bool fused = opt_impl == OptimizerImpl::kFused;
    switch (s.optimizer) {
      case Optimizer::kAdamW:
      case Optimizer::kAdam:
        per = s.optimizer == Optimizer::kAdamW ? kAdamWFlopsPerElement : kAdamFlopsPerElement;
        passes = fused ? kAdamFusedPasses : kAdamUnfusedPasses;
        kernels = fused ? 1 : kAdamUnfusedKernels;
        break;
      case Optimizer::kSgd: per = kSgdFlopsPerElement, passes = 3; break;
      case Optimizer::kSgdMomentum: per = kSgdMomentumFlopsPerElement, passes = 8, kernels = 3; break;
      default: return;  // bitsandbytes' and Adafactor's updates are not counted (StepTime's notes say so)
    }
    uint64_t elems = 0;
    DType dt = DType::kF32;
    for (size_t i : group) {
      if (i >= e.grads().size() || !e.grads()[i]) continue;
      elems = detail::sat_add(elems, Shape::of(state_shape(i)).numel().value);
      dt = w.params[i].dtype();
    }
    if (elems == 0) return;
    // foreach/fused: one launch per op over the whole group (multi_tensor_apply's chunking not modelled)
    for (uint64_t k = 0; k < kernels; ++k) {
      e.count(FlopKind::kOptimizer, per_kernel(detail::sat_mul(elems, per), kernels),
              per_kernel(detail::sat_mul(detail::sat_mul(elems, passes), itemsize(dt)), kernels), dt);
    }
  }

  void step_group(const std::vector<size_t>& group, bool first, AdafactorLocals& af) {
    const bool adam = s.optimizer == Optimizer::kAdamW || s.optimizer == Optimizer::kAdam;
    count_update(group);  // FLOPs of the update (before the state exists on the first step: not counted then)
    {
      if (first && s.optimizer != Optimizer::kAdafactor) {  // transformers' Adafactor: in adafactor_update
        // the state of each parameter, created lazily at its first step in parameter order
        // (optimizer_state_tensors: torch.optim's _init_group, bitsandbytes' init_state, Adafactor's step)
        for (size_t i : group) {
          const T& p = w.params[i];
          const Label l{intern_name(inv.parameters[i].name), -1, static_cast<int32_t>(i)};
          for (const StateTensor& t : optimizer_state_tensors(s.optimizer, opt_impl, state_shape(i), p.dtype(),
                                                                  bnb_block_size(s.optimizer_version))) {
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
        // The Python list goes last element first (CPython's list_dealloc: `while (--i >= 0)
        // Py_XDECREF(op->ob_item[i])`), as the H100 traces of foreach AdamW show.
        while (!sqrt.empty()) sqrt.pop_back();
      } else if (adam && opt_impl == OptimizerImpl::kForLoop) {
        // _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), per parameter.
        // The sqrt dies as soon as the division returns; `denom` is a local of the loop, so it stays bound until
        // the next parameter's assignment rebinds it (after that parameter's sqrt and division exist), and the
        // last one until the function returns. (Found by the CPU oracle's live timeline, validate/cpu/live.py.)
        T denom;
        for (size_t i : group) {
          T sq = e.empty(w.params[i].shape(), w.params[i].dtype(), Category::kTemporaries, Label{"adam sqrt"});
          T next = e.empty(w.params[i].shape(), w.params[i].dtype(), Category::kTemporaries, Label{"adam denom"});
          sq.reset();
          denom = std::move(next);
        }
      } else if (s.optimizer == Optimizer::kAdafactor) {
        for (size_t i : group) adafactor_update(i, first, af);
      } else if (s.optimizer == Optimizer::kAdafactorTorch) {
        adafactor_torch_group(group);
      }
      // bitsandbytes' 8-bit, paged and Lion updates are one in-place kernel per parameter: no temporaries
    }
  }

  // transformers optimization.py Adafactor.step, as the Trainer builds it (optim="adafactor":
  // scale_parameter=False, relative_step=False, so lr is a float; beta1=None: no exp_avg; weight_decay 0).
  // Its locals `grad`, `p_data_fp32` and `update` are Python names of one loop over every group's parameters:
  // each lives until the next parameter rebinds it (its successor allocated first) and until step() returns.
  void adafactor_update(size_t i, bool first, AdafactorLocals& af) {
    const T& p = w.params[i];
    const Shape ps = p.shape();
    const bool half = p.dtype() != DType::kF32;
    auto f32 = [&](const Shape& sh, const char* what) {
      return e.empty(sh, DType::kF32, Category::kTemporaries, Label{what, -1, static_cast<int32_t>(i)});
    };
    // grad = p.grad, then grad.float() for a 16-bit gradient (rebinding drops the previous parameter's copy)
    af.grad = half ? f32(ps, "adafactor grad.float()") : T();
    const Label l{intern_name(inv.parameters[i].name), -1, static_cast<int32_t>(i)};
    if (adafactor_rms.size() < inv.parameters.size()) adafactor_rms.resize(inv.parameters.size());
    if (first) {  // State Initialization (len(state) == 0): the factored moments; state["RMS"] = 0 (a number)
      for (const StateTensor& t : optimizer_state_tensors(s.optimizer, opt_impl, inv.parameters[i].shape, p.dtype(),
                                                          bnb_block_size(s.optimizer_version))) {
        if (std::string_view(t.what) == "RMS") continue;
        state.push_back(e.empty(Shape::of(t.shape), t.dtype, Category::kOptimizer, l));
      }
    }
    af.p32 = half ? f32(ps, "adafactor p.float()") : T();  // p_data_fp32
    {
      // state["RMS"] = self._rms(p_data_fp32): norm(2) (0-d), divided (the new 0-d RMS), then the old RMS goes
      T norm = f32(Shape{}, "adafactor p_data_fp32.norm(2)");
      T rms = e.empty(Shape{}, DType::kF32, Category::kOptimizer, l);
      norm = T();
      adafactor_rms[i] = std::move(rms);
    }
    {
      // update = (grad**2) + eps[0]
      T sq = f32(ps, "adafactor grad**2");
      T sum = f32(ps, "adafactor grad**2 + eps");
      sq = T();
      af.update = std::move(sum);
    }
    if (ps.n >= 2) {
      Shape row = ps;
      row.n = static_cast<uint8_t>(ps.n - 1);
      Shape col = ps;
      col.d[ps.n - 2] = ps.d[ps.n - 1];
      col.n = static_cast<uint8_t>(ps.n - 1);
      Shape row_mean = row;
      row_mean.d[row.n - 1] = 1;
      { T m = f32(row, "adafactor update.mean(dim=-1)"); }  // exp_avg_sq_row.mul_(beta2t).add_(...)
      { T m = f32(col, "adafactor update.mean(dim=-2)"); }
      // _approx_sq_grad: r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1);
      // c_factor = col.unsqueeze(-2).rsqrt(); torch.mul(r_factor, c_factor); its locals go when it returns
      T r;
      {
        T m = f32(row_mean, "adafactor exp_avg_sq_row.mean(dim=-1, keepdim=True)");
        r = f32(row, "adafactor r_factor");
      }
      T c = f32(col, "adafactor c_factor");
      T prod = f32(ps, "adafactor r_factor * c_factor");
      r = T();
      c = T();
      af.update = std::move(prod);  // update.mul_(grad): in place
    } else {
      af.update = f32(ps, "adafactor exp_avg_sq.rsqrt()");  // .mul_(grad): in place
    }
    {
      // update.div_((self._rms(update) / clip_threshold).clamp_(min=1.0)): three 0-d tensors in turn
      T norm = f32(Shape{}, "adafactor update.norm(2)");
      T rms = f32(Shape{}, "adafactor _rms(update)");
      norm = T();
      T clip = f32(Shape{}, "adafactor _rms(update) / clip_threshold");
      rms = T();
    }
    // update.mul_(lr) in place; p_data_fp32.add_(-update): -update is a new tensor; p.copy_(p_data_fp32)
    { T neg = f32(ps, "adafactor -update"); }
  }

  // torch/optim/_adafactor.py _single_tensor_adafactor over one parameter group (Adafactor.step calls it once
  // per group; foreach=None selects it). Its locals row_mean, col_mean, grad_squared, var_estimate and update
  // are Python names rebound each iteration, so each stays alive until the next parameter rebinds it (the new
  // tensor is allocated before the old one is released) and until the function returns.
  void adafactor_torch_group(const std::vector<size_t>& group) {
    T row_mean, col_mean, grad_squared, var_estimate, update;
    for (size_t i : group) {
      const T& p = w.params[i];
      const Shape ps = p.shape();
      auto tmp = [&](const Shape& sh, const char* what) {
        return e.empty(sh, p.dtype(), Category::kTemporaries, Label{what, -1, static_cast<int32_t>(i)});
      };
      { T norm = tmp(Shape{}, "adafactor param.norm(2)"); }  // .item() drops it
      if (ps.n > 1) {
        // row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        Shape row = ps, col = ps;
        row.d[ps.n - 1] = 1;
        col.d[ps.n - 2] = 1;
        row_mean = tmp(row, "adafactor row_mean");
        col_mean = tmp(col, "adafactor col_mean");
        var_estimate = tmp(ps, "adafactor row_var @ col_var");
        Shape corner = row;
        corner.d[ps.n - 2] = 1;
        { T m = tmp(corner, "adafactor row_var.mean(dim=-2, keepdim=True)"); }  // clamp_, div_ in place
      } else {
        grad_squared = tmp(ps, "adafactor grad * grad");
        var_estimate = tmp(ps, "adafactor variance.clone()");
      }
      update = var_estimate;  // var_estimate.clamp_(min=eps1 * eps1).rsqrt_(), then update.mul_(grad): in place
      { T norm = tmp(Shape{}, "adafactor update.norm(2)"); }  // .item() drops it; param.add_ is in place
    }
  }

  // The optimizer's parameter groups, in order: the weight-decayed tensors, then the rest (in_decay_group).
  std::vector<std::vector<size_t>> param_groups() const {
    std::vector<size_t> decay, rest;
    // The trainable rows (frozen parameters are not given to the optimizer) that have a .grad: torch.optim
    // skips `p.grad is None` (_init_group), so a parameter the backward never reached (a reentrant checkpoint
    // whose input does not require grad) gets no state and no update.
    std::vector<size_t> all;
    for (size_t i = 0; i < inv.parameters.size(); ++i) {
      if (!inv.parameters[i].trainable || !e.grad(static_cast<int32_t>(i))) continue;
      all.push_back(i);
      (in_decay_group(inv.parameters[i]) ? decay : rest).push_back(i);
    }
    if (o.loop == LoopKind::kPlain) return {all};
    return {decay, rest};
  }

  // --- Pipeline parallelism (pp.h): one rank's stage under torch.distributed.pipelining ------------------
  // PipelineStage (torch/distributed/pipelining/stage.py) and the schedules (schedules.py) of PyTorch 2.9 as
  // torchtitan v0.2.0's train step runs them (pp_schedule.step(inputs, target=targets, losses=losses), its
  // result dropped), one stage per rank or several (interleaved-1f1b). The rank's inventory holds its stages'
  // rows only (pp_stage_inventory).
  struct PpChunk {
    T input;   // the stage's input: the micro-batch's ids (first stage) or the received buffer as a grad leaf
    T output;  // fwd_cache's stage_output: the hidden states sent on, or the last stage's logits
    T loss;    // the last stage: _maybe_compute_loss's loss (its backward root)
    // the received buffer's .grad (a later stage): the buffer is the stage's, so the gradient outlives the
    // micro-batch's graph (Engine::requires_grad_leaf's sink) and goes to pp_input_grads after the backward
    T input_grad;
  };
  // One stage this rank holds (several with interleaved-1f1b, in stage order)
  struct PpLocal {
    PpStagePart part;
    std::vector<T> recv;       // args_recv_info[i].buffer, one per micro-batch (not on the first stage)
    std::vector<T> grad_recv;  // grad_recv_info[i].buffer, one per micro-batch (not on the last stage)
    std::vector<PpChunk> chunks;  // fwd_cache, by micro-batch
    // PyTorch 2.10 and later (RuntimeFacts::pp_stage_backward_releases_input_grads): the input gradient of the
    // stage's latest backward, held by the send ops the schedule keeps (pp_backward), not by the buffer's .grad
    T sending;
  };
  std::vector<PpLocal> pp_locals;
  std::vector<T> pp_input_grads;  // the recv buffers' .grad (bwd_cache), until clear_runtime_states
  std::vector<T> pp_losses;     // _internal_losses of the step
  // the last stage's output_chunks: every micro-batch's logits, until the next step's clear_runtime_states
  // (PyTorch 2.9 forward_one_chunk: `if self.is_last: self.output_chunks.append(output)`; step() has no
  // return_outputs yet, pytorch PR #165822 of October 2025)
  std::vector<T> pp_output_chunks;

  // The hidden states a stage receives and sends: (B, T, C) in the parameters' dtype (the embeddings' output;
  // the residual adds keep it without autocast, which check_pipeline requires). pp_forward checks each output.
  // Under sequence parallelism (sp.h) the residual stream between blocks is the rank's Shard(1) local tensor, (B,
  // T/tp, C): what a stage sends (torchtitan's pipeline over the TP + SP model, its stages' outputs local tensors).
  Shape pp_hidden_shape() const { return Shape{s.batch, m.sp ? s.seq / m.tp : s.seq, m.hidden}; }
  DType pp_hidden_dtype() const {
    // under FSDP2 (torchtitan's MixedPrecisionPolicy): the unsharded parameters' param_dtype, the embeddings' and
    // the layers' outputs too
    return fsdp && fsdp_opt.mixed ? fsdp_opt.param_dtype : param_dtype(s.precision);
  }

  // The FSDP2 root of the stage module `stage` (nullptr without FSDP2)
  Fsdp2* pp_fsdp_of(uint64_t stage) const {
    for (size_t j = 0; j < pp_fsdp.size(); ++j) {
      if (o.pp.parts[j].stage == stage) return pp_fsdp[j];
    }
    return nullptr;
  }

  PpLocal& pp_local(uint64_t stage) {
    for (PpLocal& l : pp_locals) {
      if (l.part.stage == stage) return l;
    }
    throw Error("internal: a pipeline action for a stage this rank does not hold");
  }

  // The stage's forward: its layers on `x` (the ids on the first stage, the received activations elsewhere),
  // then the head and, given labels, the loss on the last (Ctx::pp).
  ForwardOut pp_stage_forward(const PpStagePart& part, const T& x, const T* labels) {
    c.pp.first = part.embeddings;
    c.pp.last = part.head;
    c.pp.begin = part.layer_begin;
    c.pp.end = part.layer_end;
    c.pp.input = &x;
    Fsdp2* root = pp_fsdp_of(part.stage);
    if (root) c.fsdp = root;  // the stage module's own FSDP root and units
    ForwardOut out = program.forward(c, m, w, x, labels);
    if (root) root->root_post_forward();  // FSDP2: the stage module is the root; its post-forward
    c.pp = Ctx::PpStage{};
    return out;
  }

  // _initialize_stage(s) in the first step, once the batch is on the device (_step_microbatches, before any
  // action). Per stage, PipelineStage._prepare_forward_infra: runtime shape inference (torchtitan builds its
  // stages without input_args), i.e. _shape_inference's `args = tree_map_only(torch.Tensor, lambda x:
  // torch.zeros_like(x, device=self.device), args)` and `with torch.no_grad(): outputs = self.submod(*args)`,
  // every tensor of it gone when it returns (the outputs are sent on as meta tensors); then one receive buffer
  // per micro-batch (`_make_tensor_from_meta(inp, self.device)`, requires_grad_(True)) on every stage but the
  // first. Then each stage's _prepare_backward_infra: one gradient receive buffer per micro-batch
  // (_create_grad_recv_info) on every stage but the last. The buffers live as long as the stage.
  // (PipelineScheduleMulti._initialize_stages: every stage's forward infrastructure, then every backward one.)
  void pp_initialize() {
    const PpOptions& p = o.pp;
    for (const PpStagePart& part : p.parts) {
      PpLocal l;
      l.part = part;
      l.chunks.resize(p.micro_batches);
      {
        const bool grad = e.grad_mode;
        e.grad_mode = false;
        // the first stage's args are micro-batch 0's ids (zeros_like of them); a later stage's the received
        // activations' shape
        const T x = part.embeddings
                        ? e.empty(Shape{s.batch, s.seq}, DType::kI64, Category::kTemporaries, Label{"shape inference zeros_like(ids)"})
                        : e.empty(pp_hidden_shape(), pp_hidden_dtype(), Category::kTemporaries,
                                  Label{"shape inference zeros_like(input)"});
        ForwardOut out = pp_stage_forward(part, x, nullptr);
        e.grad_mode = grad;
      }
      for (uint64_t i = 0; i < p.micro_batches && !part.embeddings; ++i) {
        l.recv.push_back(e.empty(pp_hidden_shape(), pp_hidden_dtype(), Category::kActivations,
                                 Label{intern_name(fmt::format("pp recv buffer (stage {}, micro-batch {})", part.stage, i))}));
      }
      pp_locals.push_back(std::move(l));
    }
    for (PpLocal& l : pp_locals) {
      for (uint64_t i = 0; i < p.micro_batches && !l.part.head; ++i) {
        l.grad_recv.push_back(e.empty(pp_hidden_shape(), pp_hidden_dtype(), Category::kBackward,
                                      Label{intern_name(fmt::format("pp grad recv buffer (stage {}, micro-batch {})", l.part.stage, i))}));
      }
    }
  }

  // forward_one_chunk, then (last stage) _maybe_compute_loss
  void pp_forward(PpLocal& l, uint64_t i, const T& ids, const T& labels) {
    const PpStagePart& part = l.part;
    const uint64_t B = s.batch;
    T x;
    if (part.embeddings) {
      // the batch split by tensor_split along dim 0: micro-batch i's rows, a view
      x = e.view(ids, Shape{B, s.seq}, ids->strides);
    } else {
      // the buffer, requires_grad_(True): a leaf whose .grad backward fills
      x = e.requires_grad_leaf(l.recv[i], /*held_by_graph=*/false, &l.chunks[i].input_grad);
    }
    T y;
    if (part.head) y = e.view(labels, Shape{B, s.seq}, labels->strides);
    ForwardOut out = pp_stage_forward(part, x, part.head ? &y : nullptr);
    if (!part.head && (out.logits.shape().numel() != pp_hidden_shape().numel() || out.logits.dtype() != pp_hidden_dtype())) {
      throw Error("internal: a pipeline stage's output is not the (B, T, C) hidden states in the parameters' dtype");
    }
    PpChunk& ch = l.chunks[i];
    if (part.head) pp_output_chunks.push_back(out.logits);
    ch.input = std::move(x);
    ch.output = std::move(out.logits);
    ch.loss = std::move(out.loss);
  }

  // backward_one_chunk: stage_backward(stage_output, output_grads, input_values) runs
  // torch.autograd.backward(loss) on the last stage, torch.autograd.backward(stage_output,
  // grad_tensors=grads_output) elsewhere, then takes each input's .grad (bwd_cache, sent back by get_bwd_send_ops;
  // the buffer's .grad stays until the next step's clear_runtime_states). fwd_cache.pop drops the chunk.
  void pp_backward(PpLocal& l, uint64_t i, bool last_backward) {
    PpChunk& ch = l.chunks[i];
    Fsdp2* root = pp_fsdp_of(l.part.stage);  // the stage module's FSDP root (stage.py self.submod)
    if (root) root->pp_begin_backward();  // FSDP2 (fsdp.h): no reduce-scatter, no reshard, in every backward
    if (l.part.head) {
      pp_losses.push_back(ch.loss);
      e.backward(ch.loss);
    } else {
      e.backward(ch.output, l.grad_recv[i]);
    }
    if (root) root->pp_end_backward();  // the final callback the backward queued
    if (!l.part.embeddings) {
      T grad = std::move(ch.input_grad);  // the buffer's .grad (Engine::requires_grad_leaf's sink)
      if (e.runtime().pp_stage_backward_releases_input_grads) {
        // 2.11 stage_backward: `grad_inputs.append(val.grad); val.grad = None` (_backward.py:379-386); bwd_cache
        // holds the list until get_bwd_send_ops pops it into the P2POp list (stage.py:488, 503), which the
        // schedule keeps in a local. Schedule1F1B (schedules.py:906-960): `bwd_sends = get_bwd_send_ops(...)`
        // right after each backward, so the previous backward's gradient goes when this one's arrives;
        // ScheduleGPipe (schedules.py:735-750): `ops = get_bwd_recv_ops(i)` at the next iteration's start drops
        // it before the next backward (pp_backward_starts). The last one goes when _step_microbatches returns.
        l.sending = std::move(grad);
      } else {
        pp_input_grads.push_back(std::move(grad));
      }
    }
    // then, after the stage's last backward, its reduce-scatters: in 2.9 inside backward_one_chunk(last_backward=
    // True), where the gradients stay on the buffers anyway; in 2.11 perform_reduce_grad after the schedule's loop
    // (Schedule1F1B and ScheduleGPipe _step_microbatches), once the last backward's send ops replaced the previous
    // ones: only the last input gradient is alive during them
    if (root && last_backward) root->pp_post_backward();
    ch = PpChunk{};
  }

  // ScheduleGPipe (PyTorch 2.10 and later): the previous backward's send ops, `ops`, are replaced by the next
  // micro-batch's receive ops before its backward (schedules.py:735-737)
  void pp_backward_starts(PpLocal& l) {
    if (o.pp.schedule == PpSchedule::kGpipe && e.runtime().pp_stage_backward_releases_input_grads) l.sending.reset();
  }

  // --- Memoized pipeline actions (memo.h): what the loop tells ActionMemo ---------------------------------
  std::unique_ptr<ActionMemo> memo;
  std::vector<uint64_t> memo_roles_all;  // every receive buffer's and every step's batch storages
  // Memoization's argument (memo.h rule 1) covers the pipeline with or without FSDP2, tensor, sequence and context
  // parallelism, and checkpointing; not the gradient and module hooks of DDP, ZeRO, FSDP1 or the optimizer in
  // backward, LoRA, 4-bit weights or the encoders' extra inputs: there every action runs.
  // A later stage's input gradient goes to its chunk (PpChunk::input_grad) and then to pp_input_grads, a per-step
  // list, in the backward's own action (an escape, memo.h rule 3).
  // Not a later stage under PyTorch 2.10 and later: its backward hands the input gradient to PpLocal::sending, a
  // handle outside the per-step lists, which the next backward (1F1B) or its start (GPipe) replaces.
  bool memo_allowed() const {
    bool sends = false;
    for (const PpStagePart& part : o.pp.parts) sends = sends || !part.embeddings;
    sends = sends && e.runtime().pp_stage_backward_releases_input_grads;
    return o.memo && o.pp.on && !sends && !ddp.on && !zopt.on && !z3 && !fsdp1 && !e.post_accumulate_grad &&
           !e.pre_node && !c.module_done && !w.on_use && c.lora.by_base_row.empty() &&
           c.quant.dims_by_row.empty() && !c.kv && !c.position_ids && !c.token_type_ids && !c.attention_mask &&
           !s.optimizer_in_backward;
  }
  // The rank's stage (index into pp_locals, o.pp.parts' order) of each parameter row, for memo_probe
  std::vector<size_t> memo_param_stage;
  // The state an action of the rank's stage `stage` reads (memo.h rule 1) and the handles it must leave as they
  // were (rule 3). Of the gradients, those of the stage's own parameters: its graph accumulates into them and its
  // FSDP2 root reduces them, and no action reads another stage's (an interleaved rank's other stage changes them
  // between two of its actions); rule 3 still checks every .grad handle.
  MemoProbe memo_probe(uint64_t stage) {
    MemoProbe p;
    auto id = [](const T& t) { return t ? t->storage : UINT64_MAX; };
    uint64_t fsdp_index = UINT64_MAX;
    for (size_t j = 0; j < pp_fsdp.size(); ++j) {
      if (c.fsdp == pp_fsdp[j]) fsdp_index = j;
    }
    uint64_t ac_cached = 0;
    for (const T& t : c.ac_cache) ac_cached += t ? 1 : 0;
    p.words = {e.grad_mode ? 1u : 0u, static_cast<uint64_t>(e.stream), static_cast<uint64_t>(e.phase), e.count_weight,
               c.autocast ? 1u : 0u, static_cast<uint64_t>(c.ac_dtype), static_cast<uint64_t>(static_cast<int64_t>(c.layer)),
               c.training ? 1u : 0u, c.inference_mode ? 1u : 0u, c.fsdp ? (fsdp_index == UINT64_MAX ? 1u : 2 + fsdp_index) : 0u,
               ac_cached,
               // the workspaces of the thread the action's gemms run on (Engine::gemm: the autograd thread's in
               // backward, the python thread's otherwise; the loop sets the phase per action)
               e.workspace_bits() & (e.phase == Phase::kBackward ? 10u : 5u)};
    uint64_t word = 0;  // which of the stage's parameters have a .grad, 64 a word
    size_t bits = 0;
    for (size_t i = 0; i < e.grads().size(); ++i) {
      if (memo_param_stage[i] != stage) continue;
      word |= (e.grads()[i] ? uint64_t{1} : 0) << bits;
      if (++bits == 64) {
        p.words.push_back(word);
        word = 0;
        bits = 0;
      }
    }
    p.words.push_back(word);
    e.persistent_ids(p.persistent);
    p.persistent.push_back(c.ac_cache.size());
    for (const T& t : c.ac_cache) p.persistent.push_back(id(t));
    p.persistent.push_back(c.warnings.size());
    // the Ctx fields an action sets and restores (pp_stage_forward, the layers' c.layer, autocast regions)
    p.persistent.insert(p.persistent.end(), {static_cast<uint64_t>(static_cast<int64_t>(c.layer)), c.autocast ? 1u : 0u,
                                             c.training ? 1u : 0u, c.inference_mode ? 1u : 0u, c.pp.first ? 1u : 0u,
                                             c.pp.last ? 1u : 0u, c.pp.begin, c.pp.end, c.pp.input ? 1u : 0u,
                                             static_cast<uint64_t>(c.ac_dtype), c.input_embedding_row < 0 ? 0u : 1u});
    p.roots = pp_fsdp;
    p.lists = {&pp_output_chunks, &pp_input_grads, &pp_losses};
    return p;
  }
  // The per-micro-batch and per-step storages a stage's graph may save (memo.h rule 2), by role.
  std::vector<uint64_t> memo_roles(const PpLocal& l, uint64_t i, const T& ids, const T& labels) const {
    auto id = [](const T& t) { return t ? t->storage : UINT64_MAX; };
    return {i < l.recv.size() ? id(l.recv[i]) : UINT64_MAX, i < l.grad_recv.size() ? id(l.grad_recv[i]) : UINT64_MAX,
            id(ids), id(labels)};
  }

  void pp_train(SimResult& r) {
    const PpOptions& p = o.pp;
    r.micro_batches_simulated = static_cast<uint32_t>(p.micro_batches);
    bool has_first = false, has_last = false;
    for (const PpStagePart& part : p.parts) {
      has_first = has_first || part.embeddings;
      has_last = has_last || part.head;
    }
    // the moment this rank holds the most: the most chunks in flight, each weighted by its stage's layers (+1
    // so that a stage without layers counts)
    auto weight = [&](uint64_t stage) {
      for (const PpStagePart& part : p.parts) {
        if (part.stage == stage) return part.layers() + 1;
      }
      throw Error("internal: a pipeline action for a stage this rank does not hold");
    };
    const uint64_t most = pp_max_weighted_in_flight(p.actions, weight);
    // FSDP2's manual post-backward follows each stage's last backward of the step: PipelineScheduleMulti.
    // _step_microbatches (PyTorch 2.9) `backward_counter[stage_index] += 1; last_backward =
    // backward_counter[stage_index] == self._n_microbatches` passed to backward_one_chunk; the single-stage
    // schedules' last backward is the stage's n-th too (Schedule1F1B: `last_backward=bwd_mb_index ==
    // self._n_microbatches - 1`; ScheduleGPipe: `last_backward = i == self._n_microbatches - 1`)
    std::vector<uint64_t> backward_counter;
    bool recorded = false;
    for (uint32_t step = 1; step <= o.steps; ++step) {
      e.step = step;
      e.micro = 1;
      e.phase = Phase::kForward;
      if (step == o.steps) r.steady = Moment{e.event_count() == 0 ? 0 : e.event_count() - 1, Phase::kForward, step, 1, e.live()};
      // step(): clear_runtime_states() of each stage: fwd_cache and output_chunks cleared, every receive
      // buffer's .grad set to None
      pp_output_chunks.clear();
      pp_input_grads.clear();
      pp_losses.clear();
      // the batch on the device: the ids where the first stage is, the labels where the last is (torchtitan's
      // trainer passes arg_mbs to the first stage and target_mbs to the last)
      const Shape whole{checked_mul(s.batch, p.micro_batches, "batch x micro-batches"), s.seq};
      T ids = has_first ? e.leaf(whole, DType::kI64, Category::kInputs, Label{"input ids"}) : T();
      T labels = has_last ? e.leaf(whole, DType::kI64, Category::kInputs, Label{"labels"}) : T();
      if (step == 1) pp_initialize();
      if (step == 1 && memo_allowed()) {
        // memoized actions (memo.h): storages made before the first action are fixed, but the roles'
        memo = std::make_unique<ActionMemo>(e, e.storage_count(), [this](uint64_t stage) { return memo_probe(stage); });
        for (const TensorRow& row : inv.parameters) memo_param_stage.push_back(pp_row_place(row.name, o.pp.parts).part);
        for (const PpLocal& l : pp_locals) {
          for (const T& t : l.recv) memo_roles_all.push_back(t->storage);
          for (const T& t : l.grad_recv) memo_roles_all.push_back(t->storage);
        }
      }
      if (memo) {
        for (const T* t : {&ids, &labels}) {
          if (*t) memo_roles_all.push_back((*t)->storage);
        }
        std::vector<uint64_t> sorted = memo_roles_all;
        std::sort(sorted.begin(), sorted.end());
        memo->set_roles(std::move(sorted));
      }
      backward_counter.assign(pp_locals.size(), 0);
      // each action's static position for the memo (the same every step): its stage's first forward, first and
      // last backward (the last as backward_counter finds it below), and where each forward's backward is
      std::vector<MemoAction> plan(p.actions.size());
      std::vector<size_t> backward_of(p.actions.size(), SIZE_MAX);
      if (memo) {
        std::vector<uint64_t> forwards(pp_locals.size(), 0), backwards(pp_locals.size(), 0);
        uint64_t previous_forward = 0;
        for (size_t k = p.actions.size(); k-- > 0;) {
          if (p.actions[k].forward) {
            previous_forward = static_cast<uint64_t>(&pp_local(p.actions[k].stage) - pp_locals.data());
            break;
          }
        }
        for (size_t k = 0; k < p.actions.size(); ++k) {
          const PpAction& a = p.actions[k];
          const size_t j = static_cast<size_t>(&pp_local(a.stage) - pp_locals.data());
          MemoAction& ma = plan[k];
          ma.stage = j;
          ma.micro = a.micro;
          ma.forward = a.forward;
          ma.graph = static_cast<uint32_t>(j * p.micro_batches + a.micro + 1);
          ma.previous_forward_stage = previous_forward;
          if (a.forward) previous_forward = j;
          if (a.forward) {
            ma.first_forward = forwards[j]++ == 0;
          } else {
            ma.first_backward = backwards[j] == 0;
            ma.last_backward = ++backwards[j] == p.micro_batches;
            for (size_t f = 0; f < k; ++f) {
              if (plan[f].forward && plan[f].stage == j && plan[f].micro == a.micro) backward_of[f] = k;
            }
          }
        }
      }
      uint64_t now = 0;
      for (size_t k = 0; k < p.actions.size(); ++k) {
        const PpAction& a = p.actions[k];
        PpLocal& l = pp_local(a.stage);
        const size_t j = static_cast<size_t>(&l - pp_locals.data());
        e.micro = static_cast<uint32_t>(a.micro + 1);
        // each (stage, micro-batch) graph apart (Engine::graph)
        e.graph = static_cast<uint32_t>(j * p.micro_batches + a.micro + 1);
        if (a.forward) {
          e.phase = Phase::kForward;
          if (memo && backward_of[k] != SIZE_MAX) {
            const std::vector<uint64_t> roles = memo_roles(l, a.micro, ids, labels);
            if (memo->replay_forward(plan[k], plan[backward_of[k]], roles)) {
              // what pp_stage_forward leaves in the Ctx: the stage's FSDP2 root (c.pp back to its default, which
              // the probe checks every action leaves as it found)
              if (Fsdp2* root = pp_fsdp_of(l.part.stage)) c.fsdp = root;
            } else {
              memo->begin(plan[k], roles, &plan[backward_of[k]]);
              pp_forward(l, a.micro, ids, labels);
              memo->end(plan[k]);
            }
          } else {
            pp_forward(l, a.micro, ids, labels);
          }
          now += weight(a.stage);
          if (step == o.steps && now == most && !recorded) {
            recorded = true;
            r.after_forward = Moment{e.event_count(), e.phase, step, e.micro, e.live()};
            r.saved_activations = e.saved_bytes();
          }
        } else {
          e.phase = Phase::kBackward;
          const bool last_backward = ++backward_counter[j] == p.micro_batches;
          pp_backward_starts(l);
          if (memo) {
            if (!memo->replay_backward(plan[k])) {
              memo->begin(plan[k], memo_roles(l, a.micro, ids, labels));
              pp_backward(l, a.micro, last_backward);
              memo->end(plan[k]);
            }
          } else {
            pp_backward(l, a.micro, last_backward);
          }
          now -= weight(a.stage);
        }
      }
      e.graph = 0;
      if (memo) r.memo_replayed = memo->replayed();
      // _step_microbatches returns: its locals (PyTorch 2.10 and later: the last backward's send ops) go
      for (PpLocal& l : pp_locals) l.sending.reset();
      if (!pp_output_chunks.empty()) {
        // step() returns self._merge_outputs(self._stage.output_chunks): merge_chunks with no spec concatenates
        // them along dim 0 (microbatch.py: torch.cat(values_to_cat, dim=arg.split_dim)); torchtitan's train step
        // (v0.2.0, the release of PyTorch 2.9's time) drops the result at once
        const T& first = pp_output_chunks.front();
        Shape merged = first.shape();
        merged.d[0] = checked_mul(merged.d[0], pp_output_chunks.size(), "merged outputs");
        T cat = e.empty(merged, first.dtype(), Category::kTemporaries, Label{"pp step(): _merge_outputs torch.cat(output_chunks)"});
      }
      // the losses: _update_losses hands _internal_losses to the trainer's `losses` list and clears its own
      // (schedules.py:316-321, 2.11; the same in 2.9), and torchtitan's forward_backward_step returns
      // torch.mean(torch.stack(losses)), its list dying with it: none is left at the next step's start
      pp_losses.clear();
      if (step == o.steps) {
        r.param_has_grad.assign(inv.parameters.size(), 0);
        for (size_t i = 0; i < inv.parameters.size(); ++i) r.param_has_grad[i] = e.grad(static_cast<int32_t>(i)) ? 1 : 0;
      }
      // torchtitan's train_step after the pipeline: clip_grad_norm_ (max_norm 1.0), optimizers.step(), zero_grad
      clip_grad_norm();
      optimizer_step(step == 1);
      zero_grad();
    }
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

namespace {
SimResult simulate_once(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o0);
}  // namespace

SimResult simulate(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o0) {
  // TRAINMEM_MEMO=0 in the environment turns memoization off (the same output: for timing the difference)
  if (o0.memo && o0.pp.on) {
    if (const char* v = std::getenv("TRAINMEM_MEMO"); v && std::string_view(v) == "0") {
      SimOptions full = o0;
      full.memo = false;
      return simulate_once(m, inv, s, full);
    }
  }
  try {
    return simulate_once(m, inv, s, o0);
  } catch (const sim::MemoMismatch&) {
    // a replayed forward's backward met a state its template's did not (memo.h rule 4): every action simulated
    SimOptions full = o0;
    full.memo = false;
    SimResult r = simulate_once(m, inv, s, full);
    r.memo_fell_back = true;
    return r;
  }
}

namespace {
SimResult simulate_once(const ModelSpec& m, const Inventory& inv, const TrainSetup& s, const SimOptions& o0) {
  validate_setup(m, s);
  const SimOptions o = resolved(o0, m);
  SimResult r;
  // About 30 events per parameter tensor, step and simulated micro-batch for transformer layers, about twice that
  // with checkpointing's recomputation; only a capacity hint (growing by doubling copies and touches twice the
  // memory: for a pipeline rank's 100,000 events a tenth of its time).
  const size_t micro = std::min<uint64_t>(o.pp.on ? o.pp.micro_batches : s.grad_accum, o.pp.on ? 4096 : 2);
  const size_t recompute = s.checkpointing == Checkpointing::kNone ? 1 : 2;
  r.timeline.events.reserve(std::min<size_t>(32 * (inv.parameters.size() + 8) * o.steps * std::max<size_t>(micro, 1) *
                                             recompute, size_t{1} << 22));
  sim::Engine e(&r.timeline);
  RuntimeFacts facts = runtime_facts(o.torch, o.sm);
  facts.device.multiprocessors = o.multiprocessors;
  e.set_runtime(facts);
  sim::Loop loop(m, inv, s, o, e);
  loop.c.autocast = uses_autocast(s.precision);
  if (s.checkpointing != Checkpointing::kNone) {
    loop.c.checkpoint.mode = s.checkpointing == Checkpointing::kSelective ? sim::CheckpointPolicy::kSelective
                                                                          : sim::CheckpointPolicy::kFull;
    loop.c.checkpoint.reentrant = s.checkpoint_reentrant.value_or(default_checkpoint_reentrant(m.impl));
    loop.c.checkpoint.every = std::max<uint64_t>(s.checkpoint_every, 1);
  }
  loop.c.ac_dtype = compute_dtype(s.precision);
  // the loss the forward programs end with (hf_common.cc causal_lm_head)
  loop.c.loss_chunks = s.loss == LossKind::kChunked ? s.loss_chunks : 0;
  loop.c.liger_fused = s.loss == LossKind::kLigerFused;
  loop.c.logits_to_keep = s.logits_to_keep;
  loop.c.cp = s.cp;  // --cp: ring attention in sdpa() (the sequence is already the rank's: resolve_cp)
  loop.c.cp_rank = s.cp_rank.value_or(0);
  loop.c.seed000_block_locals = o.loop == LoopKind::kSeed000;
  loop.opt_impl = resolve_optimizer_impl(s.optimizer, s.optimizer_impl, m.impl);
  // seed 003's layer-stack script runs no GradScaler
  loop.scaler = s.precision == Precision::kFp16Amp && !loop.features;

  e.phase = Phase::kSetup;
  if (o.loop == LoopKind::kSeed000) loop.warmup();
  // FSDP2 (fsdp.h): accelerate's fsdp2_prepare_model in Trainer.train(), the model sharded unit by unit as it
  // reaches the device
  // (under a pipeline: torchtitan's apply_fsdp on the rank's stage module, resolve_pp_fsdp / fsdp_stage_units)
  // (over the sequence-parallel model: torchtitan's apply_fsdp after its TP + SP plan, resolve_sp_fsdp)
  loop.fsdp_opt = resolve_fsdp2_policy(s, m, o.loop, o.torch, o.pp.on);
  // accelerate 16cb6eb Accelerator.prepare sends FSDP2 to _prepare_fsdp2, which never calls prepare_model: no
  // autocast wraps the forward under --precision bf16-amp (MixedPrecisionPolicy's bf16 parameters make the compute
  // bf16). torchtitan's paths take --precision fp32, no autocast either way.
  if (loop.fsdp_opt.on) loop.c.autocast = false;
  // DeepSpeed ZeRO-3: zero.Init partitions each parameter as it is made (Loop::z3_partition_at_load)
  loop.zopt = resolve_zero(s, o.loop, o.torch);
  if (loop.zopt.on && loop.zopt.stage == 3) {
    loop.z3_init();
    loop.w = sim::load_model(e, inv, param_dtype(s.precision), {},
                             [&loop](size_t i, sim::T& p) { loop.z3_partition_at_load(i, p); });
  } else if (const Fsdp1Options f1 = resolve_fsdp1(s, m, o.loop, o.torch); f1.on) {
    // FSDP1 (fsdp1.h): accelerate's prepare_model wraps FSDP(model, ...) in Trainer.train(); the grad hook counts
    // each unit's gradients (its FlatParameter's AccumulateGrad post-hook)
    loop.fsdp1 = std::make_unique<sim::Fsdp1>(e, inv, f1, fsdp1_units(m, inv, f1));
    loop.fsdp1->load(loop.w, param_dtype(s.precision));
    loop.c.fsdp = loop.fsdp1.get();
    e.post_accumulate_grad = [&loop](int32_t i) { loop.fsdp1->grad_ready(i); };
  } else if (loop.fsdp_opt.on && o.pp.on) {
    // torchtitan's pipeline_llm: `for i, m in enumerate(model_parts): m = parallelize_fn(m, ...)`, apply_fsdp on
    // each stage module (model part) the rank holds: one FSDP root per stage, its units the stage's
    std::vector<std::vector<FsdpUnit>> roots = fsdp_stage_roots(inv, o.pp.parts, loop.fsdp_opt);
    for (size_t j = 0; j < roots.size(); ++j) {
      auto root = std::make_unique<sim::Fsdp2>(e, inv, loop.fsdp_opt, std::move(roots[j]), j);
      loop.pp_fsdp.push_back(root.get());
      if (j == 0) {
        loop.fsdp = std::move(root);
      } else {
        loop.fsdp_more.push_back(std::move(root));
      }
    }
    sim::Fsdp2::load_roots(loop.pp_fsdp, loop.w, param_dtype(s.precision));
    loop.c.fsdp = loop.fsdp.get();
  } else if (loop.fsdp_opt.on) {
    loop.fsdp = std::make_unique<sim::Fsdp2>(e, inv, loop.fsdp_opt, fsdp_units(m, inv, loop.fsdp_opt));
    loop.fsdp->load(loop.w, param_dtype(s.precision));
    loop.c.fsdp = loop.fsdp.get();
  } else {
    loop.w = sim::load_model(e, inv, param_dtype(s.precision));
  }
  // PEFT's wrapped linears: lora_A is the row after... its base (adapts), lora_B the row after lora_A
  for (size_t i = 0; i + 1 < inv.parameters.size(); ++i) {
    const TensorRow& a = inv.parameters[i];
    if (!a.adapter || a.adapts < 0) continue;
    auto& by_row = loop.c.lora.by_base_row;
    if (by_row.size() < inv.parameters.size()) by_row.resize(inv.parameters.size());
    // (FSDP2: the unsharded adapters, which the unit's all-gather fills before its forward)
    by_row[static_cast<size_t>(a.adapts)] = loop.fsdp ? std::pair<sim::T, sim::T>{loop.fsdp->unsharded(i), loop.fsdp->unsharded(i + 1)}
                                                      : std::pair<sim::T, sim::T>{loop.w.params[i], loop.w.params[i + 1]};
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
  // DistributedDataParallel(model): nanoGPT wraps before its first get_batch, the Trainer in train() before its
  // loop; the Reducer's hook runs after each AccumulateGrad (a post hook of the grad accumulator)
  loop.ddp = resolve_ddp(s, o.loop, o.torch);
  if (loop.ddp.on) {
    loop.ddp_construct(r);
    e.post_accumulate_grad = [&loop](int32_t i) { loop.ddp_hook(i); };
  }
  // DeepSpeed ZeRO-2 (zero.h): the Trainer's deepspeed.initialize in train(), before its loop; the ZeRO
  // optimizer's gradient hooks run after each AccumulateGrad (register_grad_hook)
  if (loop.zopt.on && loop.z3) {
    // ZeRO-3: the optimizer's buffers; the coordinator's hooks on the forward's parameter uses and the backward's
    // nodes, the reduce hooks after each AccumulateGrad
    loop.z3_construct();
    loop.w.on_use = [&loop](int i) { loop.z3_use(i); };
    loop.c.module_done = [&loop] { loop.z3_release_live(); };
    e.pre_node = [&loop](sim::Node& n) { loop.z3_pre_node(n); };
    e.post_accumulate_grad = [&loop](int32_t i) { loop.z3_grad_hook(i); };
  } else if (loop.zopt.on) {
    loop.zero_construct();
    e.post_accumulate_grad = [&loop](int32_t i) { loop.zero_hook(i); };
  }
  if (o.loop != LoopKind::kHf && s.task == Task::kTrain && !o.pp.on) loop.get_batch();
  if (s.optimizer_in_backward) {
    e.post_accumulate_grad = [&loop](int32_t i) { loop.step_in_backward(i); };
  }

  // FLOPs: the last simulated step (steady state: the optimizer state exists), or the whole of generate()
  e.count_step = s.task == Task::kInference && s.generate > 0 ? -1 : static_cast<int64_t>(o.steps);
  if (s.task == Task::kInference && s.generate > 0) {
    loop.generate(r);
  } else if (s.task == Task::kInference) {
    loop.inference(r);
  } else if (o.pp.on) {  // one rank of a pipeline (pp.h)
    loop.pp_train(r);
  } else {
    loop.train(r);
  }

  // The peak: the highest total of live requested bytes over the run (tracked by the engine at each
  // allocation, the only event that raises it).
  const size_t best_i = e.peak_event();
  const LiveBytes& at_best = e.peak_live();
  r.peak = sim::moment_at(r.timeline, best_i, at_best);
  e.stop_recording();
  r.warnings = loop.c.warnings;
  r.flops = e.flops();
  if (e.lost_events()) throw Error("the host ran out of memory while recording the simulated step");
  for (Category cat : {Category::kActivations, Category::kWeightCopies, Category::kBackward, Category::kTemporaries}) {
    r.activations_at_peak += at_best.by_category[static_cast<size_t>(cat)];
  }
  return r;
}
}  // namespace

}  // namespace trainmem

