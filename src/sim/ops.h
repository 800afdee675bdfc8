// The op library: each function does what the torch function of the same name does to memory on CUDA in
// PyTorch 2.x (what it allocates, what autograd saves, what its backward allocates and frees), with autocast
// applied the way aten/src/ATen/autocast_mode.cpp applies it. Model forward programs call these.
// B=micro-batch T=seq C=hidden H=heads D=head-dim V=vocab
#pragma once

#include <functional>

#include <optional>
#include <string>
#include <vector>

#include "engine.h"
#include "trainmem/runtime.h"

namespace trainmem::sim {

// Gradient checkpointing of the layers run_layers() runs (src/sim/layers.h).
struct CheckpointPolicy {
  // kSelective: torchtitan's op-level SAC (Engine::sac_saves) inside a non-reentrant checkpoint
  enum Mode { kNone, kFull, kSelective } mode = kNone;
  bool reentrant = false;  // torch.utils.checkpoint's use_reentrant
  uint64_t every = 1;      // checkpoint layers with index % every == 0 (transformers' every_n_layers)
};

// LoRA on the model's linears (PEFT): the adapters of each base weight row, by row, and the adapter config.
struct LoraPolicy {
  std::vector<std::pair<T, T>> by_base_row;  // (lora_A, lora_B) weights; empty handles: not adapted
  double dropout = 0.0;
};

// bitsandbytes 4-bit linears (nn/modules.py Linear4bit, autograd/_functions.py MatMul4Bit, bnb <= 0.49).
struct Quant4bitPolicy {
  std::vector<std::pair<uint64_t, uint64_t>> dims_by_row;  // (out, in) of each packed weight row; (0, 0): none
  DType compute = DType::kF32;  // bnb_4bit_compute_dtype (transformers' default None: float32)
  DType quantized = DType::kF32;  // QuantState.dtype: the weight's dtype when it was quantized
  bool double_quant = false;    // the absmax is dequantized (float32, one per 64 elements) first
};

// transformers' DynamicCache while generating (cache_utils.py DynamicLayer): per layer the keys and values,
// (B, KV, past, D) each, that every forward grows by torch.cat. Null in Ctx when the forward keeps no cache
// (training, one inference pass).
struct KvCache {
  std::vector<T> keys, values;
  std::vector<DType> dtype;  // per layer: DynamicLayer.lazy_initialization's `self.dtype = key_states.dtype`
  uint64_t past = 0;  // tokens cached before the current forward: past_key_values.get_seq_length()
};

struct Ctx;
// FSDP2's module hooks (fully_shard's forward pre/post hooks, src/sim/fsdp.cc) at the boundaries of its units:
// `unit` is a decoder layer's index or kFsdpUnitEmbed / kFsdpUnitTail (trainmem/fsdp.h). pre_forward takes the
// unit's input and returns what the unit runs on (RegisterPostBackwardFunction's output); post_forward takes its
// output and returns it with the pre-backward hook registered.
struct FsdpHooks {
  virtual ~FsdpHooks() = default;
  virtual T pre_forward(Ctx& c, int32_t unit, T input) = 0;
  virtual T post_forward(Ctx& c, int32_t unit, T output) = 0;
};

// Forward-pass state: autocast (with its cache of 16-bit weight copies), the layer being built (for labels),
// training mode, and the runtime facts.
struct Ctx {
  Engine& e;
  bool autocast = false;
  DType ac_dtype = DType::kBF16;
  std::vector<T> ac_cache;  // cached casts, indexed by parameter row
  int32_t layer = -1;
  bool training = true;
  // torch.inference_mode() around the forward (Loop::inference), not torch.no_grad(): from 2.11 autocast does not
  // cache weight casts under it (RuntimeFacts::autocast_caches_in_inference_mode)
  bool inference_mode = false;
  // The nanoGPT fork of seed 000 binds the layer-norm outputs of a block to locals, which keeps them alive
  // until the block returns (its trace frees both after the MLP's residual add).
  bool seed000_block_locals = false;
  CheckpointPolicy checkpoint;
  LoraPolicy lora;
  Quant4bitPolicy quant;
  KvCache* kv = nullptr;  // past_key_values while generating (Loop::generate)
  // generate() passes position_ids of (B, q) (GenerationMixin._prepare_position_ids_for_generation): the model
  // then makes none of its own, and the rotary embedding computes B rows. Null: the model's (1, T) ones.
  const T* position_ids = nullptr;
  // --cp N: torch's context_parallel over N ranks; the forward program runs at the rank's seq / N tokens and
  // sdpa() runs ring attention (cp.h, cp_attention.cc). 1: no context parallelism.
  uint64_t cp = 1;
  uint64_t cp_rank = 0;  // the CP rank simulated (TrainSetup::cp_rank): which ring steps it runs (cp.h ring_steps)
  // The batch's other inputs, as a tokenizer and the Trainer's collator make them: token_type_ids (BERT's
  // encoders) and attention_mask (the encoders and T5), (B, T) int64 each, made with the batch. Null: not passed.
  const T* token_type_ids = nullptr;
  const T* attention_mask = nullptr;
  // The loss over the final hidden states (TrainSetup::loss): 0 chunks is transformers' ForCausalLMLoss over
  // the whole logits, N > 0 torchtune's chunked output head and CEWithChunkedOutputLoss with N chunks.
  uint64_t loss_chunks = 0;
  // Liger-Kernel's fused linear cross-entropy in place of the head and the loss (TrainSetup::loss)
  bool liger_fused = false;
  uint64_t logits_to_keep = 0;  // transformers' logits_to_keep; 0: every position
  // enable_input_require_grads: the input embedding's output is made to require grad (its weight's row)
  int32_t input_embedding_row = -1;
  FsdpHooks* fsdp = nullptr;  // --sharding fsdp2: fully_shard's hooks; null otherwise
  std::vector<std::string> warnings;  // what the simulated program would warn about, each once
  // Called where a parameter-holding module's forward returns ahead of other work (the head, before the loss):
  // DeepSpeed ZeRO-3's post-forward hook releases its gathered parameters (Loop::z3_release_live).
  std::function<void()> module_done;
  // Pipeline parallelism (pp.h): the stage a forward runs. The first stage embeds the ids; a later one takes
  // `input` (its received activations) instead; only layers [begin, end) run (run_layers); the last stage
  // runs the final norm, the head and the loss. The defaults are the whole model.
  struct PpStage {
    bool first = true, last = true;
    uint64_t begin = 0, end = UINT64_MAX;
    const T* input = nullptr;
  } pp;

  void warn(const std::string& w) {
    for (const std::string& x : warnings) {
      if (x == w) return;
    }
    warnings.push_back(w);
  }

  explicit Ctx(Engine& eng) : e(eng) {}
  Label L(const char* what) const { return Label{what, layer, -1}; }
  // Leaving the outermost autocast region clears the cache (torch.clear_autocast_cache()); the copies live
  // on while backward nodes hold them.
  void exit_autocast() { ac_cache.clear(); }
  const RuntimeFacts& rt() const { return e.runtime(); }
};

// ---- dtype casts and autocast ------------------------------------------------------------------------
T to(Ctx& c, const T& x, DType dt, const char* what);          // x.to(dt): x itself when dt matches
T autocast_lowp(Ctx& c, const T& x);                            // an argument of a lower_precision_fp op
T autocast_fp32(Ctx& c, const T& x);                            // an argument of an fp32 op

// ---- elementwise -------------------------------------------------------------------------------------
T add(Ctx& c, const T& a, const T& b, const char* what);
T sub(Ctx& c, const T& a, const T& b, const char* what);
T mul(Ctx& c, const T& a, const T& b, const char* what);
T div(Ctx& c, const T& a, const T& b, const char* what);
T add_scalar(Ctx& c, const T& a, const char* what);  // a + python number
T mul_scalar(Ctx& c, const T& a, const char* what);  // a * python number (also a / number)
T neg(Ctx& c, const T& a, const char* what);
T pow_scalar(Ctx& c, const T& a, const char* what);  // torch.pow(a, number): an fp32 op under autocast
T rsqrt(Ctx& c, const T& a, const char* what);        // an fp32 op under autocast
T tanh(Ctx& c, const T& a, const char* what);
T sigmoid(Ctx& c, const T& a, const char* what);
T relu(Ctx& c, const T& a, const char* what);
T gelu(Ctx& c, const T& a, const char* what);         // F.gelu, erf or tanh approximation: one fused op
T silu(Ctx& c, const T& a, const char* what);
T mean_last(Ctx& c, const T& a, const char* what);    // a.mean(-1, keepdim=True)
T dropout(Ctx& c, const T& a, double p, const char* what);
T masked_fill(Ctx& c, const T& a, const T& mask, const char* what);
T full_scalar(Ctx& c, DType dt, const char* what);    // torch.full([], v, dtype=dt, device=cuda)

// ---- views and copies ----------------------------------------------------------------------------------
T view(Ctx& c, const T& x, const Shape& s);           // x.view(s)
T reshape(Ctx& c, const T& x, const Shape& s);        // a view when possible, otherwise a copy
T transpose(Ctx& c, const T& x, int i, int j);        // x.transpose(i, j)
T unsqueeze(Ctx& c, const T& x, int dim);
T expand(Ctx& c, const T& x, const Shape& s);         // stride-0 broadcast view
T contiguous(Ctx& c, const T& x, const char* what);   // x itself when contiguous, otherwise a copy
std::vector<T> split_last(Ctx& c, const T& x, std::vector<uint64_t> sizes);  // x.split(sizes, dim=-1)
T slice_last(Ctx& c, const T& x, uint64_t begin, uint64_t end);             // x[..., begin:end]
T slice_dim1(Ctx& c, const T& x, uint64_t begin, uint64_t end);             // x[:, begin:end]
std::vector<T> chunk_dim1(Ctx& c, const T& x, uint64_t n);  // x.chunk(n, dim=1), n dividing x.size(1)
T cat_last(Ctx& c, std::vector<T> xs, const char* what);                    // torch.cat(xs, dim=-1)
T slice_dim(Ctx& c, const T& x, int dim, uint64_t begin, uint64_t end);     // x[..., begin:end, ...] on `dim`
T select_dim(Ctx& c, const T& x, int dim);  // x[..., i, ...] with a Python int on `dim`: a view without that dim

// ---- products ------------------------------------------------------------------------------------------
// F.linear / nn.Linear: weight (out, in), optional bias.
T linear(Ctx& c, const T& x, const T& w, const T* b, const char* what);
// transformers' Conv1D: torch.addmm(bias, x.view(-1, nx), weight) with weight (nx, nf), then view back.
T conv1d(Ctx& c, const T& x, const T& w, const T& b, const char* what);
// torch.matmul for batched operands (3-D or 4-D): the batch dims are merged by reshape (a copy when the
// strides do not allow a view) and one bmm runs.
T matmul(Ctx& c, const T& a, const T& b, const char* what);
T embedding(Ctx& c, const T& weight, const T& ids, const char* what);

// ---- normalisation, softmax ------------------------------------------------------------------------------
T layer_norm(Ctx& c, const T& x, const T* w, const T* b, const char* what);
// F.softmax / F.log_softmax over the last dim; `dtype` as passed explicitly (autocast sets float32 when
// none is given).
T softmax(Ctx& c, const T& x, std::optional<DType> dtype, const char* what);
T log_softmax(Ctx& c, const T& x, std::optional<DType> dtype, const char* what);

// ---- attention -----------------------------------------------------------------------------------------
enum class SdpaBackend { kFlash, kEfficient, kMath, kCudnn };
SdpaBackend sdpa_backend(const Ctx& c, const T& q, const T& v, bool has_mask, double dropout_p);
// F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p, is_causal) with q, k, v (B, H, T, D).
// enable_gqa=false with fewer key/value heads than query heads (Falcon's multi-query SDPA call): no fused kernel
// takes it (sdp_utils.h check_batch_size_and_num_heads_dense: "the same num_heads"), so the math kernel runs and
// its matmuls broadcast k and v.
T sdpa(Ctx& c, const T& q, const T& k, const T& v, const T* mask, double dropout_p, bool is_causal,
       bool enable_gqa = true);
// The same call under torch's context_parallel (Ctx::cp > 1): ring attention's per-call buffers, rank 0
// (cp_attention.cc, cp.h). `flash`: the kernel sdpa() picked is the flash one (the only one simulated).
T ring_sdpa(Ctx& c, const T& q, const T& k, const T& v, bool has_mask, double dropout_p, bool is_causal, bool flash);

// ---- indexing, top-k and in-place updates (the mixture-of-experts block) -------------------------------
// torch.zeros_like(x): a new tensor outside the graph.
T zeros_like(Ctx& c, const T& x, const char* what);
// x[i] with a Python int or a 0-dim integer tensor (TensorIndexing.h applySelect): a view of row i of dim 0.
// SelectBackward0 saves nothing; select_backward allocates zeros of x's whole size and copies the gradient in.
T select0(Ctx& c, const T& x);
// x[index] with a 1-D int64 index on dim 0 (advanced indexing, aten::index): a new (n, ...) tensor.
// IndexBackward0 saves the index, not x; its backward is new_zeros(x's size).index_put_(indices, grad, True).
T index_rows(Ctx& c, const T& x, const T& index, const char* what);
// x[..., [i], ...] with a Python list of one int on `dim` (Falcon's `qkv[..., [-2], :]`): python_variable_indexing.cpp
// makes the list an int64 tensor on x's device (sequenceToVariable -> indexing_tensor_from_data with x's options),
// then aten::index gives a new tensor with that dim of size 1. IndexBackward0 saves the index, not x.
T index_list1(Ctx& c, const T& x, int dim, const char* what);
// x[i0, i1, None] on a 2-D x with two 1-D int64 indices of n entries: the None unsqueezes x first
// (applySlicing), then aten::index gives (n, 1). IndexBackward0 saves both indices.
T index_pair_unsqueeze(Ctx& c, const T& x, const T& i0, const T& i1, const char* what);
// x[i0, i1] on a 3-D x (B, T, N) with two 1-D int64 indices of n entries (aten::index): a new (n, N).
// IndexBackward0 saves both indices, x only by its sizes.
T index_pair(Ctx& c, const T& x, const T& i0, const T& i1, const char* what);
// self.index_add_(0, index, source), in place: `self` is rebound to the result (the same storage).
void index_add_(Ctx& c, T& self, const T& index, const T& source);
// torch.topk(x, k, dim=-1): values in x's dtype and int64 indices, (..., k) each.
struct TopK {
  T values, indices;
};
TopK topk_last(Ctx& c, const T& x, uint64_t k, const char* what);
// x.sum(dim=-1, keepdim=True): SumBackward1 saves nothing; its backward is grad.expand(x's size), a view.
T sum_last_keepdim(Ctx& c, const T& x, const char* what);
// x.sum(dim=-1) (keepdim=False): SumBackward1 saves nothing; its backward unsqueezes and expands grad (views).
T sum_last(Ctx& c, const T& x, const char* what);
// x.gather(-1, index) with an int64 index of x's rank (DeepseekV3MoE: router_logits.gather(1, topk_indices) on
// (N, E)): (..., k) in x's dtype. derivatives.yaml "self: gather_backward(grad, self, dim, index, sparse_grad)":
// GatherBackward0 saves self and index; gather_backward is zeros_like(self).scatter_add_(dim, index, grad).
T gather_last(Ctx& c, const T& x, const T& index, const char* what);
// torch._grouped_mm(x (S, in), w (E, in, out), offs=offs): one (S, out) output in x's dtype. derivatives.yaml:
// "self: _grouped_mm_mat1_backward(grad, mat2, ...)", "mat2: _grouped_mm_mat2_backward(grad, self, ...)": saves x
// when w needs a gradient, w when x does, and offs.
T grouped_mm(Ctx& c, const T& x, const T& w, const T& offs, const char* what);
// self += other, in place (add_): `self` is rebound to the result. AddBackward0 saves nothing.
void add_(Ctx& c, T& self, const T& other);
// self /= other, in place (div_): `self` is rebound to the result. When other needs a gradient the autograd
// kernel first saves original_self = self.clone() (div's other formula reads self).
void div_(Ctx& c, T& self, const T& other, const char* what);
// self *= number or self /= number, in place (mul_ / div_ with a Python number): `self` is rebound to the result.
// MulBackward1 / DivBackward1 keep only the number; the backward is one new tensor (grad * or / the number).
void scale_(Ctx& c, T& self, const char* node);

// ---- loss ----------------------------------------------------------------------------------------------
// F.cross_entropy(logits (N, V), target (N,)) with class indices: log_softmax + nll_loss, as the composite
// ATen op does it (and as autocast intercepts nll_loss).
T cross_entropy(Ctx& c, const T& logits, const T& target);

}  // namespace trainmem::sim
