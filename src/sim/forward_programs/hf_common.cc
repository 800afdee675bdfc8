// Pieces shared by the transformers models: the eager attention mask, rotary embeddings, eager and SDPA
// attention interfaces, activations, and ForCausalLMLoss (transformers 5.x).
// B=micro-batch T=seq C=hidden H=heads KV=kv-heads D=head-dim V=vocab R=rotary dims
#include "hf_common.h"

#include <fmt/format.h>

#include <algorithm>

#include "../layers.h"
#include "trainmem/error.h"

namespace trainmem::sim {

T lm_head_logits(Ctx& c, const LoadedModel& w, const T& hidden, const char* head, const char* tied, const char* what,
                 const char* bias) {
  const T* h = w.opt(head);
  // LlamaForCausalLM.forward (and the other *ForCausalLM): slice_indices = slice(-logits_to_keep, None);
  // logits = self.lm_head(hidden_states[:, slice_indices, :]); logits_to_keep=0 is slice(0, None), every position.
  const uint64_t Tn = hidden.shape()[1];
  const T kept = c.logits_to_keep ? slice_dim1(c, hidden, Tn - c.logits_to_keep, Tn) : hidden;
  T logits = linear(c, kept, h ? *h : w.p(tied), bias ? &w.p(bias) : nullptr, what);
  if (c.module_done) c.module_done();  // the head module's forward returns (DeepSpeed ZeRO-3 releases it)
  return logits;
}

ForwardOut causal_lm_output(Ctx& c, T logits, const T* labels) {
  ForwardOut out;
  out.logits = std::move(logits);
  if (!labels) return out;
  if (c.logits_to_keep) {
    // Training with logits_to_keep (trainmem's reading, as GRPO-style trainers do): the loss is over the kept
    // positions, so the labels passed are labels[:, -logits_to_keep:], a view of the batch's labels; with the
    // whole (B, T) labels ForCausalLMLoss would fail on the (B, logits_to_keep, V) logits.
    const Shape ls{labels->shape()[0], c.logits_to_keep};
    const T kept = c.e.view(*labels, ls, (*labels)->strides);
    out.loss = causal_lm_loss(c, out.logits, kept);
  } else {
    out.loss = causal_lm_loss(c, out.logits, *labels);
  }
  return out;
}

// GenericForSequenceClassification.forward (modeling_layers.py, 5.x), once the base model has returned
// hidden_states (last_hidden_state, bound in the caller):
//   logits = self.score(hidden_states)                                              (B, T, N)
//   non_pad_mask = (input_ids != self.config.pad_token_id).to(logits.device, torch.int32)
//   token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
//   last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)                  int64 (B,)
//   pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]   (B, N)
//   loss = self.loss_function(...): ForSequenceClassificationLoss (loss_utils.py), problem_type None,
//     num_labels > 1 and int64 labels: single_label_classification, fixed_cross_entropy(pooled_logits.view(-1,
//     num_labels), labels.view(-1)): F.cross_entropy(ignore_index=-100, reduction="mean")
// The locals (logits, non_pad_mask, token_indices, last_non_pad_token) live until forward returns; the model
// returns pooled_logits.
ForwardOut sequence_classification_output(Ctx& c, const ModelSpec& m, const T& score, const T& hidden, const T& ids,
                                          const T* labels) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  const T logits = linear(c, hidden, score, nullptr, "score");
  T non_pad_mask;
  {
    T ne = c.e.empty(Shape{B, Tn}, DType::kBool, Category::kTemporaries, c.L("input_ids != pad_token_id"));
    non_pad_mask = c.e.empty(Shape{B, Tn}, DType::kI32, Category::kActivations, c.L("non_pad_mask .to(int32)"));
  }
  const T token_indices = c.e.empty(Shape{Tn}, DType::kI32, Category::kActivations, c.L("token_indices"));
  T last_non_pad_token;
  {
    T product = c.e.empty(Shape{B, Tn}, DType::kI32, Category::kTemporaries, c.L("token_indices * non_pad_mask"));
    last_non_pad_token = c.e.empty(Shape{B}, DType::kI64, Category::kActivations, c.L("argmax(-1)"));
  }
  ForwardOut out;
  {
    // saved by IndexBackward0 (an activation, not a temporary)
    const T rows = c.e.empty(Shape{B}, DType::kI64, Category::kActivations, c.L("torch.arange(batch_size)"));
    out.logits = index_pair(c, logits, rows, last_non_pad_token, "pooled_logits");
  }
  if (labels) out.loss = cross_entropy(c, view(c, out.logits, Shape{B, m.num_labels}), view(c, *labels, Shape{B}));
  return out;
}

namespace {

// `self += other` on a tensor that requires grad: no new storage; AddBackward0 becomes self's grad_fn and
// passes the gradient to both.
T add_in_place(Ctx& c, const T& self, const T& other) {
  T out = c.e.view(self, self.shape(), self->strides);
  c.e.record("AddBackward0", {&self, &other}, {&out}, {}, [](Engine&, Node&, Grads& g) {
    return Grads{g[0], g[0]};
  });
  return out;
}

}  // namespace

ForwardOut chunked_causal_lm(Ctx& c, const LoadedModel& w, T hidden, const char* head, const char* tied,
                             const char* what, const T* labels) {
  if (!labels) throw Error("internal: torchtune's chunked loss needs labels (the hf training loop)");
  const uint64_t n = c.loss_chunks;
  const uint64_t B = hidden.shape()[0], Tn = hidden.shape()[1];
  const uint64_t Tc = Tn / n;  // resolve() makes n divide T, so .chunk and .tensor_split agree
  // torchtune/modules/transformer.py TransformerDecoder.chunked_output:
  //   [self.output(chunk) for chunk in last_hidden_state.chunk(self.num_output_chunks, dim=1)]
  // every chunk's logits (B, T/n, V) are made before the loss runs, in the model's compute dtype.
  const T* hw = w.opt(head);
  std::vector<T> logits;
  for (const T& chunk : chunk_dim1(c, hidden, n)) logits.push_back(linear(c, chunk, hw ? *hw : w.p(tied), nullptr, what));
  // TransformerDecoder.forward returns the list; the loss runs in the recipe, after the decoder's final hidden
  // states `h` went out of scope (kept only where a chunk's matmul saved it).
  hidden.reset();
  // The recipe (torchtune/recipes/full_finetune_single_device.py _loss_step) shifts the labels:
  //   labels = torch.hstack((labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]]))
  // a new (B, T) int64 tensor; the ignore cache (B, 1) was made once in setup and is a temporary here.
  T ignore = c.e.empty(Shape{B, 1}, DType::kI64, Category::kTemporaries, c.L("ignore_labels_cache"));
  const T shifted = c.e.empty(Shape{B, Tn}, DType::kI64, Category::kActivations, c.L("shifted labels"));
  // torchtune/modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss.forward:
  //   total_elements = (labels != self.ignore_index).sum()
  T total_elements;
  {
    T ne = c.e.empty(Shape{B, Tn}, DType::kBool, Category::kTemporaries, c.L("labels != ignore_index"));
    total_elements = c.e.empty(Shape{}, DType::kI64, Category::kActivations, c.L("total_elements"));
  }
  //   labels = [target_chunk.reshape(-1) for target_chunk in labels.tensor_split(n, dim=1)]
  // a (B, T/n) column slice is contiguous only when B == 1; otherwise reshape copies it.
  std::vector<T> label_chunks;
  for (uint64_t i = 0; i < n; ++i) {
    label_chunks.push_back(B == 1 ? c.e.view(shifted, Shape{Tc}, Strides{1})
                                  : c.e.empty(Shape{B * Tc}, DType::kI64, Category::kActivations, c.L("labels chunk")));
  }
  //   logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]   (views)
  //   total_loss = 0.0
  //   for logits_chunk, labels_chunk in zip(logits, labels):
  //       total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index, reduction="sum")
  //   return total_loss / total_elements
  // each chunk's float32 copy is freed once its log_softmax is taken (LogSoftmaxBackward0 saves its result).
  T total;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t V = logits[i].shape().back();
    T flat = view(c, logits[i], Shape{B * Tc, V});
    T loss = cross_entropy(c, to(c, flat, DType::kF32, "logits_chunk.float()"), label_chunks[i]);
    total = i == 0 ? add_scalar(c, loss, "0.0 + chunk loss") : add_in_place(c, total, loss);
  }
  ForwardOut out;
  out.loss = div(c, total, total_elements, "total_loss / total_elements");
  // `del logits` after the loss: the chunks' logits are not returned.
  return out;
}

// Liger-Kernel at commit ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c (2026-08-21),
// src/liger_kernel/ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward:
//   inc_factor = triton.cdiv(V, H); chunk_size = triton.next_power_of_2(triton.cdiv(BT, inc_factor));
//   num_chunks = triton.cdiv(BT, chunk_size)
LigerChunking liger_chunking(uint64_t bt, uint64_t v, uint64_t h) {
  if (bt == 0 || v == 0 || h == 0) throw Error("internal: Liger's chunking needs BT, V and H > 0");
  const uint64_t want = ceil_div(bt, ceil_div(v, h));
  uint64_t size = 1;  // triton.next_power_of_2: the smallest power of two >= n (want <= bt, so no overflow)
  while (size < want) size *= 2;
  return LigerChunking{size, ceil_div(bt, size)};
}

ForwardOut liger_fused_causal_lm(Ctx& c, const LoadedModel& w, T hidden, const char* head, const char* tied,
                                 const T* labels) {
  if (!labels) throw Error("internal: Liger's fused linear cross-entropy needs labels (the hf training loop)");
  const T* hp = w.opt(head);
  const T weight = hp ? *hp : w.p(tied);
  const uint64_t B = hidden.shape()[0], Tn = hidden.shape()[1], H = hidden.shape()[2];
  const uint64_t V = weight.shape()[0];
  const uint64_t BT = checked_mul(B, Tn, "liger BT = B*T");
  const DType dt = hidden.dtype();
  // `logits_chunk = _input_chunk @ weight.t()` "in the original precision": without autocast (resolve() refuses
  // it) the two must share a dtype, as torch.matmul requires.
  if (weight.dtype() != dt) {
    throw Error(fmt::format("--loss liger-fused: the final hidden states are {} but the head weight is {}; Liger's "
                            "_input_chunk @ weight.t() needs one dtype", dtype_name(dt), dtype_name(weight.dtype())));
  }
  // src/liger_kernel/transformers/model/llama.py lce_forward (training, labels given: skip_logits):
  //   kept_hidden_states = hidden_states[:, slice(-0, None), :]   (logits_to_keep=0: a view of every position)
  //   lce_maybe_trainable_lm_head -> LigerForCausalLMLoss(hidden_states, self.lm_head.weight, labels, ...)
  // model/loss_utils.py LigerForCausalLMLoss: the labels are shifted, not the hidden states:
  //   labels = nn.functional.pad(labels, (0, 1), value=ignore_index); shift_labels = labels[..., 1:].contiguous()
  //   hidden_states = hidden_states.view(-1, hidden_size)    (a view: the final norm's output is contiguous)
  T loss;
  {
    T padded = c.e.empty(Shape{B, Tn + 1}, DType::kI64, Category::kTemporaries, c.L("padded labels"));
    const Shape ss{B, Tn};
    const Strides st{static_cast<int64_t>(Tn + 1), 1};
    // contiguous (a view of the padded labels) only when B == 1, as in causal_lm_loss
    T shift = is_contiguous(ss, st) ? c.e.view(padded, ss, st)
                                    : c.e.empty(ss, DType::kI64, Category::kTemporaries, c.L("shift_labels"));
    T x = view(c, hidden, Shape{BT, H});
    // fixed_fused_linear_cross_entropy: reduction="mean" (the loop passes no num_items_in_batch), so the
    // Function's loss is returned as it is and backward's grad_output is ones_like(loss).
    // LigerFusedLinearCrossEntropyFunction.forward runs fused_linear_cross_entropy_forward (an autograd
    // Function's forward records no graph):
    const bool in_rg = x->requires_grad, w_rg = weight->requires_grad;
    const bool grad = c.e.grad_mode;
    c.e.grad_mode = false;
    // grad_input = torch.zeros_like(_input); grad_weight = torch.zeros_like(weight) if input_requires_grad and
    // weight_needs_grad (accum_dtype=None: the weight's dtype); both are saved for backward.
    T grad_input = c.e.empty(Shape{BT, H}, dt, Category::kActivations, c.L("liger grad_input"));
    T grad_weight = in_rg && w_rg ? c.e.empty(Shape{V, H}, dt, Category::kActivations, c.L("liger grad_weight")) : T();
    // loss_1d = torch.zeros(BT, dtype=torch.float32); target_mask = target != ignore_index (a local until the
    // function returns); total_n_non_ignore = target_mask.sum().item() drops the 0-dim sum at once
    T loss_1d = c.e.empty(Shape{BT}, DType::kF32, Category::kTemporaries, c.L("liger loss_1d"));
    T target_mask = c.e.empty(Shape{BT}, DType::kBool, Category::kTemporaries, c.L("target != ignore_index"));
    { T n = c.e.empty(Shape{}, DType::kI64, Category::kTemporaries, c.L("target_mask.sum()")); }
    const LigerChunking k = liger_chunking(BT, V, H);
    T logits_chunk, grad_logits_chunk;
    for (uint64_t i = 0; i < k.count; ++i) {
      const uint64_t rows = std::min(k.size, BT - i * k.size);
      // logits_chunk = _input_chunk @ weight.t()  (chunk_size x V): made while the previous chunk's logits are
      // still held by grad_logits_chunk; .contiguous() returns it
      logits_chunk = c.e.empty(Shape{rows, V}, dt, Category::kTemporaries, c.L("liger logits_chunk"));
      // liger_cross_entropy_kernel writes loss_1d's slice and the gradient into logits_chunk in place;
      // grad_logits_chunk = logits_chunk drops the previous chunk
      grad_logits_chunk = logits_chunk;
      // grad_input[start_idx:end_idx] = grad_logits_chunk @ weight: a (chunk, H) result copied into the slice
      if (in_rg) T tmp = c.e.empty(Shape{rows, H}, dt, Category::kTemporaries, c.L("grad_logits_chunk @ weight"));
      if (grad_weight) {
        // grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float(): the addmm(out_dtype) branch
        // needs a float32 grad_weight with 16-bit logits, which the storage-dtype path never has. The (V, H) mm
        // result dies once .float() returns (its bound method's reference), before the in-place add; .float()
        // of a float32 tensor is the tensor itself.
        T mm = c.e.empty(Shape{V, H}, dt, Category::kTemporaries, c.L("mm(grad_logits_chunk.t(), _input_chunk)"));
        T f = dt == DType::kF32 ? mm : c.e.empty(Shape{V, H}, DType::kF32, Category::kTemporaries, c.L("mm(...).float()"));
        mm.reset();
      }
    }
    // loss = torch.sum(loss_1d); grad_weight.to(weight.dtype) is grad_weight itself (accum_dtype=None)
    loss = c.e.empty(Shape{}, DType::kF32, Category::kActivations, c.L("torch.sum(loss_1d)"));
    // the function returns: loss_1d, target_mask and the last chunk's logits die
    logits_chunk.reset();
    grad_logits_chunk.reset();
    loss_1d.reset();
    target_mask.reset();
    c.e.grad_mode = grad;
    // ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None, ...)
    Saved saved = grad_weight ? Saved{grad_input, grad_weight} : Saved{grad_input};
    c.e.record("LigerFusedLinearCrossEntropyFunctionBackward", {&x, &weight}, {&loss}, std::move(saved),
               [](Engine& e, Node& n, Grads&) {
                 // fused_linear_cross_entropy_backward: torch.equal(grad_output, torch.tensor(1.0, device=...))
                 // makes a 0-dim float32 tensor; grad_output is 1.0, so no element_mul_kernel runs and the
                 // precomputed gradients are returned as they are (grad_input to the final norm, grad_weight to
                 // the head's AccumulateGrad).
                 { T one = e.empty(Shape{}, DType::kF32, Category::kTemporaries, Label{"torch.tensor(1.0)"}); }
                 return Grads{n.saved[0], n.saved.size() > 1 ? n.saved[1] : T()};
               });
    // LigerForCausalLMLoss returns: the labels die; lce_forward returns: the hidden states die with `outputs`
  }
  hidden.reset();
  ForwardOut out;
  out.loss = std::move(loss);
  return out;
}

T causal_lm_loss(Ctx& c, const T& logits0, const T& labels0) {
  // loss_utils.py ForCausalLMLoss: logits = logits.float(); labels = F.pad(labels, (0, 1), value=-100);
  // shift_labels = labels[..., 1:].contiguous(); cross_entropy(logits.view(-1, V), shift_labels.view(-1))
  const uint64_t V = logits0.shape().back();
  const uint64_t B = labels0.shape()[0], Tn = labels0.shape()[1];
  T logits = to(c, logits0, DType::kF32, "logits.float()");
  T labels = c.e.empty(Shape{B, Tn + 1}, DType::kI64, Category::kActivations, c.L("padded labels"));
  // labels[..., 1:] has strides (T+1, 1): contiguous only when B == 1 (a size-1 dim's stride does not count),
  // and then .contiguous() returns the view itself, which keeps the padded (1, T+1) storage.
  const Shape ss{B, Tn};
  Strides st{static_cast<int64_t>(Tn + 1), 1};
  T shift = is_contiguous(ss, st) ? c.e.view(labels, ss, st)
                                  : c.e.empty(ss, DType::kI64, Category::kActivations, c.L("shift_labels"));
  const T flat = view(c, logits, Shape{B * Tn, V});
  const T tflat = view(c, shift, Shape{B * Tn});
  return cross_entropy(c, flat, tflat);
}

T eager_mask(Ctx& c, uint64_t B, uint64_t Tn, DType dt) {
  // masking_utils eager_mask: the bool mask of sdpa_mask, then torch.where(mask, torch.tensor(0.0, dtype),
  // finfo(dtype).min): a (B, 1, T, KV) tensor in the embeddings' dtype. KV is DynamicLayer.get_mask_sizes'
  // kv_length, past + T (T without a cache). sdpa_mask broadcasts the mask function over
  // _non_vmap_expansion_sdpa's (B,1,1,1), (1,1,1,1), (1,1,T,1), (1,1,1,KV) indices; the causal (and sliding
  // window) functions read only q_idx and kv_idx, so without a padding mask (trainmem's inputs have none)
  // the bool tensor is (1, 1, T, KV), then `.expand(batch_size, -1, q_length, kv_length)`, a view. The H100
  // traces of validate/measured/ (GPT-2 eager, B = 4) show its 1 MiB at T = 1024.
  const uint64_t kv = checked_add(c.kv ? c.kv->past : 0, Tn, "the attention mask's key length");
  T bool_mask = c.e.empty(Shape{1, 1, Tn, kv}, DType::kBool, Category::kTemporaries, c.L("causal mask (bool)"));
  T zero = c.e.empty(Shape{}, dt, Category::kTemporaries, c.L("mask zero"));
  return c.e.empty(Shape{B, 1, Tn, kv}, dt, Category::kActivations, c.L("causal mask"));
}

T sdpa_sliding_mask(Ctx& c, uint64_t B, uint64_t Tn, uint64_t window) {
  // masking_utils.create_sliding_window_causal_mask under SDPA once kv_length >= sliding_window
  // (_ignore_causal_mask_sdpa no longer skips it): sdpa_mask with mask_function =
  // sliding_window_causal_mask_function(window) = and_masks(sliding_window_overlay(window), causal_mask_function),
  // broadcast over _non_vmap_expansion_sdpa's indices, which the functions read only as q_idx and kv_idx: a
  // (1, 1, T, KV) bool tensor, then `.expand(batch_size, -1, q_length, kv_length)`. The allocations in their
  // order, as the H200 trace of validate/measured/open/ (Phi-3-mini, window 2047, T = 2048) shows them.
  const uint64_t kv = checked_add(c.kv ? c.kv->past : 0, Tn, "the attention mask's key length");
  auto t = [&](Shape s, DType dt, const char* what) { return c.e.empty(s, dt, Category::kTemporaries, c.L(what)); };
  T batch_arange = t(Shape{B}, DType::kI64, "mask batch_arange");   // torch.arange(batch_size)
  T head_arange = t(Shape{1}, DType::kI64, "mask head_arange");     // torch.arange(1)
  T q_arange;
  {
    T a = t(Shape{Tn}, DType::kI64, "mask q_arange");                // torch.arange(q_length) + q_offset
    q_arange = t(Shape{Tn}, DType::kI64, "mask q_arange + q_offset");
  }
  T kv_arange;
  {
    T a = t(Shape{kv}, DType::kI64, "mask kv_arange");               // torch.arange(kv_length) + kv_offset
    kv_arange = t(Shape{kv}, DType::kI64, "mask kv_arange + kv_offset");
  }
  // and_mask: result = q_idx.new_ones((), dtype=torch.bool); for each function: result = result & mask(...)
  T result = t(Shape{}, DType::kBool, "mask and_masks result");
  {
    T shifted = t(Shape{1, 1, Tn, 1}, DType::kI64, "q_idx - sliding_window");  // sliding_window_overlay
    T overlay = t(Shape{1, 1, Tn, kv}, DType::kBool, "sliding_window_overlay");  // q_idx - w < kv_idx
    shifted.reset();
    T anded = t(Shape{1, 1, Tn, kv}, DType::kBool, "mask result & sliding");
    overlay.reset();
    result = anded;
  }
  {
    T causal = t(Shape{1, 1, Tn, kv}, DType::kBool, "causal_mask_function");  // kv_idx <= q_idx
    T anded = t(Shape{1, 1, Tn, kv}, DType::kBool, "sliding window causal mask (bool)");
    causal.reset();
    result = anded;
  }
  return expand(c, result, Shape{B, 1, Tn, kv});
}

void kv_update(Ctx& c, uint64_t layer, T& k, T& v) {
  if (!c.kv) return;
  // cache_utils.py DynamicLayer.update: the first call makes torch.tensor([]) (no storage) and then, like every
  // later call, `self.keys = torch.cat([self.keys, key_states], dim=-2)`: a new (B, KV, past + T, D) tensor,
  // the previous one freed when the attribute is rebound; then the values the same way. The caller rebinds
  // key_states and value_states to what update returns: the whole cache.
  // lazy_initialization makes both empty tensors in the keys' dtype, and torch.cat's result dtype promotes over
  // every input, the empty one too: under autocast, where the rotated keys are float32 (q * cos with float32
  // cos) and the values 16-bit, the values are cached in float32 as well.
  if (c.kv->dtype.size() <= layer) c.kv->dtype.resize(layer + 1);
  if (c.kv->keys.size() <= layer || !c.kv->keys[layer]) c.kv->dtype[layer] = k.dtype();
  const DType init = c.kv->dtype[layer];
  auto grow = [&](std::vector<T>& slot, const T& x, const char* what) {
    if (slot.size() <= layer) slot.resize(layer + 1);
    Shape s = x.shape();
    s.d[2] = checked_add(slot[layer] ? slot[layer].shape()[2] : 0, s[2], "the KV cache's length");
    const DType cached = slot[layer] ? slot[layer].dtype() : init;
    const DType dt = cached == x.dtype() ? cached : DType::kF32;  // float32 with anything, fp16 with bf16
    T grown = c.e.empty(s, dt, Category::kKvCache, c.L(what));
    slot[layer] = grown;
    return grown;
  };
  // `key_states, value_states = past_key_values.update(...)`: both are rebound after update returns, so the
  // rotated keys and the projected values die after both torch.cat (the H100 trace of validate/measured/
  // (Mistral-7B shapes, generate) allocates both grown tensors before either is freed)
  T keys = grow(c.kv->keys, k, "past_key_values keys (torch.cat)");
  T values = grow(c.kv->values, v, "past_key_values values (torch.cat)");
  k = std::move(keys);
  v = std::move(values);
}

T model_position_ids(Ctx& c, uint64_t Tn) {
  if (c.position_ids) return *c.position_ids;
  return c.e.empty(Shape{1, Tn}, DType::kI64, Category::kActivations, c.L("position_ids"));
}

T rotary_decoder_body(Ctx& c, const ModelSpec& m, const T& ids, DType embeds_dtype,
                      const std::function<T()>& embed_dropout, const T& inv_freq, const RotaryLayer& layer,
                      const std::function<T(const T&)>& final_norm) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  // position_ids = cache_position.unsqueeze(0) (or generate()'s)
  T position_ids = model_position_ids(c, Tn);
  // causal_mask = create_causal_mask(...): materialized for eager only (sdpa runs is_causal without one)
  T mask;
  if (m.attn_impl == AttnImpl::kEager) mask = eager_mask(c, B, Tn, embeds_dtype);
  T hidden = embed_dropout();
  // position_embeddings = self.rotary_emb(hidden_states, position_ids)
  const Rotary rot = rotary_embedding(c, inv_freq, Tn, hidden.dtype());
  // `layer` by value: a checkpointed layer runs again in backward, after this function (and the caller's
  // temporary std::function `layer` refers to) has returned
  hidden = run_layers(c, m.layers, std::move(hidden), LayerArgs{mask, rot.cos, rot.sin, position_ids},
                      [layer](uint64_t l, T h, const LayerArgs& a) {
                        return layer(l, std::move(h), Rotary{a.cos, a.sin}, a.mask ? &a.mask : nullptr);
                      });
  return final_norm(hidden);
}

Rotary rotary_embedding(Ctx& c, const T& inv_freq, uint64_t Tn, DType x_dtype) {
  // LlamaRotaryEmbedding.forward under @torch.no_grad(), autocast disabled, position_ids (1, T):
  // freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2);
  // emb = cat((freqs, freqs), -1); cos = emb.cos() * attention_scaling; sin likewise; cast to x.dtype.
  const bool grad = c.e.grad_mode;
  const bool ac = c.autocast;
  c.e.grad_mode = false;
  c.autocast = false;
  const uint64_t half = inv_freq.shape()[0];
  const uint64_t rows = c.position_ids ? c.position_ids->shape()[0] : 1;
  T inv = to(c, inv_freq, DType::kF32, "inv_freq.float()");
  // inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1): a view
  T inv_e = expand(c, reshape(c, inv, Shape{1, half, 1}), Shape{rows, half, 1});
  T pos = c.e.empty(Shape{rows, 1, Tn}, DType::kF32, Category::kActivations, c.L("position_ids.float()"));
  T freqs = transpose(c, matmul(c, inv_e, pos, "rotary freqs"), 1, 2);
  T emb = cat_last(c, {freqs, freqs}, "rotary emb");
  T cos = mul_scalar(c, mul_scalar(c, emb, "emb.cos()"), "cos * attention_scaling");
  T sin = mul_scalar(c, mul_scalar(c, emb, "emb.sin()"), "sin * attention_scaling");
  Rotary r;
  r.cos = to(c, cos, x_dtype, "cos.to(x.dtype)");
  r.sin = to(c, sin, x_dtype, "sin.to(x.dtype)");
  // `return cos.to(...), sin.to(...)`: freqs, emb, cos and sin are the function's locals, freed when it returns,
  // in the order CPython clears a frame's locals (co_varnames: inv_freq_expanded, position_ids_expanded, freqs,
  // emb, cos, sin). The H100 trace of validate/measured/open/*_hf_gen_llama3_* (transformers 5.17) frees the
  // (B, 64) inverse frequencies, the positions, freqs, emb, cos and sin together after both casts.
  inv_e.reset();
  inv.reset();
  pos.reset();
  freqs.reset();
  emb.reset();
  cos.reset();
  sin.reset();
  c.e.grad_mode = grad;
  c.autocast = ac;
  return r;
}

namespace {

T rotate_half(Ctx& c, const T& x) {
  const uint64_t D = x.shape().back();
  T x1 = slice_last(c, x, 0, D / 2);
  T x2 = slice_last(c, x, D / 2, D);
  return cat_last(c, {neg(c, x2, "rotate_half -x2"), x1}, "rotate_half");
}

}  // namespace

T apply_rotary(Ctx& c, const T& x, const Rotary& r) {
  // q_embed = (q * cos) + (rotate_half(q) * sin), cos/sin unsqueezed to (1, 1, T, R); with partial rotary
  // (NeoX, Phi-3) only the first R dims rotate and the rest is concatenated back.
  const T cos = unsqueeze(c, r.cos, 1);
  const T sin = unsqueeze(c, r.sin, 1);
  const uint64_t D = x.shape().back(), R = r.cos.shape().back();
  if (R == D) {
    T a = mul(c, x, cos, "q * cos");
    T b = mul(c, rotate_half(c, x), sin, "rotate_half(q) * sin");
    return add(c, a, b, "rotary embed");
  }
  T rot = slice_last(c, x, 0, R);
  T pass = slice_last(c, x, R, D);
  T a = mul(c, rot, cos, "q_rot * cos");
  T b = mul(c, rotate_half(c, rot), sin, "rotate_half(q_rot) * sin");
  T embed = add(c, a, b, "rotary embed");
  a.reset();
  b.reset();
  return cat_last(c, {embed, pass}, "cat([q_embed, q_pass])");
}

std::pair<T, T> apply_rotary_qk(Ctx& c, const T& q, const T& k, const Rotary& r, RotaryCat cat) {
  if (cat == RotaryCat::kEachAlways) {
    // modeling_phi3.py apply_rotary_pos_emb: `q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin),
    // q_pass], dim=-1)`, then k the same: each tensor rotated and concatenated in turn, the cat made even when
    // q_pass is empty (full rotary), a copy. The H200 trace of validate/measured/open/ (Phi-3-mini) shows it.
    const uint64_t D = q.shape().back(), R = r.cos.shape().back();
    auto one = [&](const T& x, const char* what) {
      T embed = apply_rotary(c, slice_last(c, x, 0, R), r);
      return cat_last(c, {embed, slice_last(c, x, R, D)}, what);
    };
    T qo = one(q, "cat([q_embed, q_pass])");
    return {qo, one(k, "cat([k_embed, k_pass])")};
  }
  // apply_rotary_pos_emb (modeling_gpt_neox.py, modeling_phi3.py, 5.x) with partial rotary: both rotated
  // halves first, `q_embed = (q_rot * cos) + ...; k_embed = (k_rot * cos) + ...`, then both concatenations,
  // `q_embed = torch.cat([q_embed, q_pass], dim=-1); k_embed = torch.cat([k_embed, k_pass], dim=-1)`. The
  // order shows in the H100 trace of validate/measured/ (Pythia-160m). With full rotary there is no cat.
  const uint64_t D = q.shape().back(), R = r.cos.shape().back();
  if (R == D) {
    T qe = apply_rotary(c, q, r);
    return {qe, apply_rotary(c, k, r)};
  }
  Rotary whole = r;  // the rotated parts, [..., :R]: apply_rotary's full-width branch on each
  T q_embed = apply_rotary(c, slice_last(c, q, 0, R), whole);
  T k_embed = apply_rotary(c, slice_last(c, k, 0, R), whole);
  T qo = cat_last(c, {q_embed, slice_last(c, q, R, D)}, "cat([q_embed, q_pass])");
  q_embed.reset();
  T ko = cat_last(c, {k_embed, slice_last(c, k, R, D)}, "cat([k_embed, k_pass])");
  return {qo, ko};
}

T repeat_kv(Ctx& c, const T& x, uint64_t n_rep) {
  // hidden_states[:, :, None, :, :].expand(B, KV, n_rep, T, D).reshape(B, KV * n_rep, T, D): a copy
  if (n_rep == 1) return x;
  const Shape& s = x.shape();
  T e = expand(c, unsqueeze(c, x, 2), Shape{s[0], s[1], n_rep, s[2], s[3]});
  return reshape(c, e, Shape{s[0], s[1] * n_rep, s[2], s[3]});
}

AttnOut eager_attention(Ctx& c, const T& q, const T& k0, const T& v0, const T* mask, uint64_t n_rep,
                        double dropout_p, const char* scale_op, double softcap) {
  // eager_attention_forward (transformers 5.x, models/llama/modeling_llama.py)
  T k = repeat_kv(c, k0, n_rep);
  T v = repeat_kv(c, v0, n_rep);
  T w = matmul(c, q, transpose(c, k, 2, 3), "attn q@k^T");
  w = mul_scalar(c, w, scale_op);  // * scaling
  if (softcap > 0) {  // Gemma2: / softcap, tanh, * softcap
    w = mul_scalar(c, w, "attn / softcap");
    w = tanh(c, w, "attn tanh");
    w = mul_scalar(c, w, "attn * softcap");
  }
  if (mask) w = add(c, w, *mask, "attn + mask");
  w = to(c, softmax(c, w, DType::kF32, "attn softmax"), q.dtype(), "attn weights .to(q.dtype)");
  w = dropout(c, w, dropout_p, "attn dropout");
  T o = matmul(c, w, v, "attn @ v");
  o = contiguous(c, transpose(c, o, 1, 2), "attn output contiguous");
  return AttnOut{o, w};
}

T sdpa_attention(Ctx& c, const T& q, const T& k0, const T& v0, uint64_t n_rep, double dropout_p, const T* mask) {
  // integrations/sdpa_attention.py: GQA goes to SDPA's enable_gqa (use_gqa_in_sdpa: torch >= 2.5 and
  // attention_mask is None); otherwise repeat_kv copies k and v. is_causal = q_len > 1 and no mask.
  const bool gqa = c.rt().torch >= TorchVersion{2, 5} && q.shape()[3] <= 256 && !mask;
  T k = gqa ? k0 : repeat_kv(c, k0, n_rep);
  T v = gqa ? v0 : repeat_kv(c, v0, n_rep);
  T o = sdpa(c, q, k, v, mask, dropout_p, !mask && q.shape()[2] > 1);
  return contiguous(c, transpose(c, o, 1, 2), "attn output contiguous");
}

T activation(Ctx& c, Act a, const T& x) {
  switch (a) {
    case Act::kGeluErf:
    case Act::kGeluTanh: return gelu(c, x, "act (gelu)");
    case Act::kSilu: return silu(c, x, "act (silu)");
    case Act::kRelu: return relu(c, x, "act (relu)");
    case Act::kSigmoid: return sigmoid(c, x, "act (sigmoid)");
    case Act::kQuickGelu: {
      // x * torch.sigmoid(1.702 * x)
      T s = sigmoid(c, mul_scalar(c, x, "1.702 * x"), "sigmoid(1.702x)");
      return mul(c, x, s, "quick_gelu");
    }
    case Act::kGeluNew: {
      // NewGELUActivation: 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 *
      // torch.pow(input, 3.0)))). pow is an fp32 op under autocast, so the right-hand side is float32.
      T half = mul_scalar(c, x, "gelu_new 0.5*x");
      T inner;
      {
        T p = pow_scalar(c, x, "gelu_new x^3");
        T b = mul_scalar(c, p, "gelu_new 0.044715*x^3");
        p.reset();
        T s = add(c, x, b, "gelu_new x + 0.044715x^3");
        b.reset();
        T d = mul_scalar(c, s, "gelu_new sqrt(2/pi)*(...)");
        s.reset();
        T t = tanh(c, d, "gelu_new tanh");
        d.reset();
        inner = add_scalar(c, t, "gelu_new 1 + tanh");
      }
      return mul(c, half, inner, "gelu_new");
    }
    case Act::kGeluFast: {
      // FastGELUActivation: 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input *
      // input)))
      T half = mul_scalar(c, x, "gelu_fast 0.5*x");
      T inner;
      {
        T ax = mul_scalar(c, x, "gelu_fast x*0.79788");
        T b = mul_scalar(c, x, "gelu_fast 0.044715*x");
        T bb = mul(c, b, x, "gelu_fast 0.044715*x*x");
        b.reset();
        T one = add_scalar(c, bb, "gelu_fast 1 + ...");
        bb.reset();
        T prod = mul(c, ax, one, "gelu_fast product");
        ax.reset();
        one.reset();
        T t = tanh(c, prod, "gelu_fast tanh");
        prod.reset();
        inner = add_scalar(c, t, "gelu_fast 1 + tanh");
      }
      return mul(c, half, inner, "gelu_fast");
    }
  }
  throw Error("internal: unknown activation");
}

}  // namespace trainmem::sim
