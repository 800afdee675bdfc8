// Normalisation, softmax, attention and the loss.
// B=micro-batch T=seq H=heads D=head-dim N=rows V=vocab
#include "ops_util.h"
#include "trainmem/error.h"

namespace trainmem::sim {

using detail::grad_empty;
using detail::grad_like;

T layer_norm(Ctx& c, const T& x0, const T* w0, const T* b0, const char* what) {
  // layer_norm is on autocast's fp32 list: a 16-bit input is copied to float32, and that copy is what
  // NativeLayerNormBackward0 saves.
  const T x = autocast_fp32(c, x0);
  const T w = w0 ? autocast_fp32(c, *w0) : T();
  const T b = b0 ? autocast_fp32(c, *b0) : T();
  // layer_norm_cuda (aten/src/ATen/native/cuda/layer_norm_kernel.cu): auto X = input.expect_contiguous(): a
  // non-contiguous input (Phi's q_layernorm on the transposed (B, H, T, D) query) is copied for the kernel and
  // the copy dies when the op returns; autograd saves the input itself. Y = empty_like(*X) (contiguous); mean and
  // rstd have one float (acc_type) per row.
  const bool strided = !is_contiguous(x.shape(), x->strides);
  T x_copy;
  if (strided) x_copy = c.e.empty(x.shape(), x.dtype(), Category::kTemporaries, c.L("layer_norm input expect_contiguous"));
  T out = c.e.empty(x.shape(), x.dtype(), Category::kActivations, c.L(what));
  const Shape rows{detail::rows_of(x.shape()).value};
  T mean = c.e.empty(rows, DType::kF32, Category::kActivations, c.L("layer_norm mean"));
  T rstd = c.e.empty(rows, DType::kF32, Category::kActivations, c.L("layer_norm rstd"));
  // FLOPs: layer_norm's kernel, ~8 per element (mean, variance, normalise, scale, shift), reading x and writing y
  detail::count_pointwise(c.e, FlopKind::kNorm, x.shape().numel().value, 8, 1, x.dtype());
  Saved saved{x, mean, rstd};
  if (w) saved.push_back(w);
  if (b) saved.push_back(b);
  const bool gx = x->requires_grad;
  const Shape xs = x.shape();
  const DType xd = x.dtype();
  const Shape ws = w ? w.shape() : Shape{};
  const DType wd = w ? w.dtype() : DType::kF32;
  const bool hw = static_cast<bool>(w), hb = static_cast<bool>(b);
  c.e.record("NativeLayerNormBackward0", {&x, w ? &w : nullptr, b ? &b : nullptr}, {&out}, std::move(saved),
             [gx, xs, xd, ws, wd, hw, hb, strided](Engine& e, Node&, Grads& g) {
               Grads r(3);
               if (!g[0]) return r;
               // layer_norm_backward_cuda: auto X = input.expect_contiguous() again, alive until it returns
               T x_copy;
               if (strided) x_copy = e.empty(xs, xd, Category::kTemporaries, g[0]->label);
               // FLOPs: layer_norm_backward, ~8 per element, reading grad and x, writing dX
               detail::count_pointwise(e, FlopKind::kNorm, xs.numel().value, 8, 2, xd);
               if (gx) r[0] = grad_empty(e, xs, xd, g[0]->label);  // dX = empty_like(*X)
               if (hw) r[1] = grad_empty(e, ws, wd, g[0]->label);  // dgamma
               if (hb) r[2] = grad_empty(e, ws, wd, g[0]->label);  // dbeta
               return r;
             });
  return out;
}

namespace {

// _softmax / _log_softmax of x into `out_dt`. SoftMax.cpp: with a dtype different from the input's, CUDA
// half input to float output runs in one kernel (half_to_float); any other combination first copies the
// input to the dtype (a temporary, freed when the op returns).
T softmax_like(Ctx& c, const T& x0, std::optional<DType> dtype, bool log, const char* what) {
  // softmax and log_softmax are fp32_set_opt_dtype under autocast: float32 unless a dtype is passed.
  if (c.autocast && !dtype && is_floating(x0.dtype())) dtype = DType::kF32;
  const DType out_dt = dtype.value_or(x0.dtype());
  T x = x0;
  const bool half_to_float = x0.dtype() == DType::kF16 && out_dt == DType::kF32;
  if (out_dt != x0.dtype() && !half_to_float) x = to(c, x0, out_dt, "softmax input cast");
  T out = c.e.empty_strided(x.shape(), dense_strides_like(x.shape(), x->strides), out_dt, Category::kActivations,
                            c.L(what));
  const DType in_dt = x.dtype();
  // FLOPs: softmax's kernel, ~5 per element (max, exp, sum, divide; log for log_softmax), reading x, writing out
  detail::count_pointwise(c.e, FlopKind::kNorm, x.shape().numel().value, 5, 1, out_dt);
  c.e.record(log ? "LogSoftmaxBackward0" : "SoftmaxBackward0", {&x}, {&out}, {out},
             [in_dt, log](Engine& e, Node& n, Grads& g) {
               if (!g[0]) return Grads{T()};
               // FLOPs: softmax_backward, ~4 per element, reading grad and output, writing the input's gradient
               detail::count_pointwise(e, FlopKind::kNorm, g[0].shape().numel().value, 4, 2, g[0].dtype());
               T gi = grad_like(e, g[0], in_dt);  // the gradient in the input's dtype
               if (!log) {
                 // softmax_backward_cuda_out: "Tensor tmp = grad * output;" before the kernel. CUDA only, and
                 // inside the op: a temporary (the CPU oracle's live timeline, validate/cpu/live.py, leaves
                 // backward's temporaries out).
                 T tmp = e.empty_strided(g[0].shape(), dense_strides_like(g[0].shape(), g[0]->strides),
                                         detail::promote(g[0], n.saved[0]), Category::kTemporaries,
                                         Label{"softmax_backward tmp = grad * output"});
               }
               return Grads{gi};
             });
  return out;
}

}  // namespace

T softmax(Ctx& c, const T& x, std::optional<DType> dtype, const char* what) {
  return softmax_like(c, x, dtype, false, what);
}

T log_softmax(Ctx& c, const T& x, std::optional<DType> dtype, const char* what) {
  return softmax_like(c, x, dtype, true, what);
}

T cross_entropy(Ctx& c, const T& logits, const T& target) {
  // Loss.cpp cross_entropy_loss: nll_loss_nd(log_softmax(self, 1, self.scalar_type()), target, ...). The
  // explicit dtype keeps log_softmax in the logits' dtype under autocast; nll_loss is on the fp32 list, so
  // a 16-bit log-probability tensor is copied to float32 and NllLossBackward0 saves that copy.
  const T lsm = log_softmax(c, logits, logits.dtype(), "log_softmax");
  const T x = autocast_fp32(c, lsm);
  T loss = c.e.empty(Shape{}, x.dtype(), Category::kActivations, c.L("loss"));
  T total_weight = c.e.empty(Shape{}, x.dtype(), Category::kActivations, c.L("nll total_weight"));
  const Shape xs = x.shape();
  const DType xd = x.dtype();
  // FLOPs: nll_loss reads one log-probability per row and reduces them: one per row
  const uint64_t nll_rows = detail::rows_of(xs).value;
  c.e.count(FlopKind::kElementwise, nll_rows, detail::nbytes(nll_rows, xd), xd);
  c.e.record("NllLossBackward0", {&x}, {&loss}, {x, target, total_weight},
             [xs, xd](Engine& e, Node&, Grads& g) {
               // nll_loss_backward: a zero-filled gradient the size of the log-probabilities.
               if (!g[0]) return Grads{T()};
               // FLOPs: the zero fill and one write per row: a write of the whole gradient
               e.count(FlopKind::kElementwise, detail::rows_of(xs).value, detail::nbytes(xs.numel().value, xd), xd);
               return Grads{grad_empty(e, xs, xd, Label{"nll_loss grad"})};
             });
  return loss;
}

// ---- scaled dot product attention ------------------------------------------------------------------------

// On sm_90 and sm_100 recent PyTorch's sdp_utils.cpp (check_prefer_cudnn_attention) puts cuDNN attention first
// in the priority order; measured in 2.11 only (the H100/H200 traces of validate/measured/).
namespace {
// The cuDNN SDPA backward execution plan's own workspace beyond the graph's intermediate tensors (the dQ
// accumulator, the softmax sum, GQA's full-head dK/dV): 256 B in every one of the 24 backward calls that
// validate/cuda/sdpa_probe.py measured on an H100 (torch 2.11.0+cu130, cuDNN 9.19.0): 12 shape and GQA forms
// (batch 1 to 4, 8 to 32 heads, lengths 333 to 4096, head dims 64, 96 and 128, with and without GQA), under the
// cuDNN backend forced and under PyTorch's default choice, which is cuDNN there
// (validate/measured/probes/h100-80gb-hbm3_sdpa_backward_probe.jsonl). No source line states it; a measurement.
constexpr uint64_t kCudnnSdpaBackwardPlanWorkspace = 256;
bool cudnn_attention_first(const Ctx& c) {
  const uint32_t sm = c.rt().sm;
  return c.rt().torch >= TorchVersion{2, 11} && (sm == 90 || sm == 100);
}
}  // namespace

SdpaBackend sdpa_backend(const Ctx& c, const T& q, const T& v, bool has_mask, double dropout_p) {
  (void)dropout_p;
  const uint64_t D = q.shape().back(), Dv = v.shape().back();
  const DType dt = c.autocast ? c.ac_dtype : q.dtype();
  const uint32_t sm = c.rt().sm;
  // sdp_utils.cpp: flash needs fp16/bf16, sm80+, no attention mask, a head dim that is a multiple of 8 and
  // at most 256; memory-efficient attention also takes float32 and masks.
  SdpaBackend be = SdpaBackend::kMath;
  if ((dt == DType::kF16 || dt == DType::kBF16) && sm >= 80 && !has_mask && D % 8 == 0 && D <= 256) {
    be = SdpaBackend::kFlash;
  } else if (sm >= 50 && D % 8 == 0 && (dt != DType::kBF16 || sm >= 80)) {
    be = SdpaBackend::kEfficient;
  }
  // A value head dim other than the query's (DeepSeek-V3's MLA: qk_head_dim 192, v_head_dim 128): sdp_utils.cpp
  // check_head_dim_size_flash wants query, key and value of one last dim; check_head_dim_size_mem_efficient
  // wants query and key equal and both last dims multiples of the alignment (8 here, as above).
  if (Dv != D && be == SdpaBackend::kFlash) be = SdpaBackend::kEfficient;
  if (be == SdpaBackend::kEfficient && Dv % 8 != 0) be = SdpaBackend::kMath;
  // With a mask where cuDNN attention comes first, it takes the call (fp16/bf16, head dims equal, a multiple of 8
  // up to 128); its output follows the query's layout like flash's, as the H200 trace of the masked Phi-3-mini
  // run shows (the output copy of `.transpose(1, 2).contiguous()` behind a cat-built query). Its backward makes
  // cuDNN's one workspace (kCudnnSdpaBackwardPlanWorkspace).
  if (has_mask && cudnn_attention_first(c) && be == SdpaBackend::kEfficient && Dv == D && Dv % 8 == 0 && Dv <= 128 &&
      (dt == DType::kBF16 || dt == DType::kF16)) {
    be = SdpaBackend::kCudnn;
  }
  return be;
}

namespace {

uint64_t round_up_to(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

T sdpa_math(Ctx& c, const T& q, const T& k, const T& v, const T* mask, double dropout_p, bool is_causal) {
  // attention.cpp _scaled_dot_product_attention_math (2.5+): 16-bit inputs are upcast to float32 copies,
  // q and k are scaled (new tensors), the scores are a float32 (B, H, L, S) tensor, softmax saves its result.
  const DType origin = q.dtype();
  T qa = to(c, q, DType::kF32, "sdpa math q fp32");
  T ka = to(c, k, DType::kF32, "sdpa math k fp32");
  T va = to(c, v, DType::kF32, "sdpa math v fp32");
  T qs = mul_scalar(c, qa, "sdpa math scaled q");
  T kt = transpose(c, ka, -2, -1);
  T ks = mul_scalar(c, kt, "sdpa math scaled k");
  if (ks.shape()[1] != qs.shape()[1]) {  // at::matmul expands a broadcast batch dim (one key head)
    Shape s = ks.shape();
    s.d[1] = qs.shape()[1];
    ks = expand(c, ks, s);
  }
  T attn = matmul(c, qs, ks, "sdpa math scores");
  if (mask || is_causal) {
    // the mask is added in place (attn.add_(mask)); a causal mask is built as a bool (L, S) then made float
    T m = c.e.empty(Shape{q.shape()[2], k.shape()[2]}, DType::kF32, Category::kTemporaries, c.L("sdpa causal mask"));
  }
  attn = softmax(c, attn, std::nullopt, "sdpa math softmax");
  attn = dropout(c, attn, dropout_p, "sdpa math dropout");
  if (va.shape()[1] != attn.shape()[1]) {
    Shape s = va.shape();
    s.d[1] = attn.shape()[1];
    va = expand(c, va, s);
  }
  T out = matmul(c, attn, va, "sdpa math output");
  return to(c, out, origin, "sdpa math output cast");
}

}  // namespace

T sdpa(Ctx& c, const T& q0, const T& k0, const T& v0, const T* mask0, double dropout_p, bool is_causal,
       bool enable_gqa) {
  // scaled_dot_product_attention is on autocast's lower_precision_fp list: every floating tensor argument is
  // cast, attn_mask included (a float mask, such as Falcon's ALiBi bias folded into the causal mask, becomes a
  // 16-bit copy per call, which the kernel saves for backward; the H200 trace of validate/measured/open/
  // (Falcon-RW-1B) shows it per layer). The cached_cast calls in WrapFunction_'s argument list run last
  // argument first under GCC: the mask, then value, key, query.
  const T mask_cast = mask0 ? autocast_lowp(c, *mask0) : T();
  const T* mask = mask0 ? &mask_cast : nullptr;
  const T v = autocast_lowp(c, v0);
  const T k = autocast_lowp(c, k0);
  const T q = autocast_lowp(c, q0);
  if (!c.training) dropout_p = 0.0;
  const bool broadcast_kv = !enable_gqa && k.shape()[1] != q.shape()[1];
  const SdpaBackend be = broadcast_kv ? SdpaBackend::kMath : sdpa_backend(c, q, v, mask != nullptr, dropout_p);
  const uint64_t Dv = v.shape()[3];
  const bool cudnn_first = cudnn_attention_first(c);
  // attention.cpp scaled_dot_product_attention: after choosing the backend, convert_boolean_attn_mask turns a
  // bool mask into `at::where(attn_mask, 0.0, -inf)` in the query's dtype: two 0-dim scalars, then a new
  // tensor of the mask's (expanded) shape, which the kernel saves for backward (the H200 Phi-3-mini trace shows
  // the two 2-byte scalars and the 16 MiB (B, 1, T, KV) bf16 mask per layer).
  T converted;
  if (mask && mask->dtype() == DType::kBool) {
    T zero = c.e.empty(Shape{}, q.dtype(), Category::kTemporaries, c.L("attn_mask where 0.0"));
    T ninf = c.e.empty(Shape{}, q.dtype(), Category::kTemporaries, c.L("attn_mask where -inf"));
    converted = c.e.empty(mask->shape(), q.dtype(), Category::kActivations, c.L("attn_mask (bool to additive)"));
    mask = &converted;
  }
  // --cp N: the call goes to context_parallel's ring attention (cp_attention.cc)
  if (c.cp > 1) return ring_sdpa(c, q, k, v, mask != nullptr, dropout_p, is_causal, be == SdpaBackend::kFlash);
  if (be == SdpaBackend::kMath) return sdpa_math(c, q, k, v, mask, dropout_p, is_causal);
  const uint64_t B = q.shape()[0], H = q.shape()[1], L = q.shape()[2], D = q.shape()[3];
  const uint64_t Hk = k.shape()[1], S = k.shape()[2];
  // The kernels take (B, L, H, D) views (q.transpose(1, 2)) and the caller sees the output's (B, H, L, D)
  // transpose. The efficient kernel allocates its output (B, L, H, D) (at::empty({B, M, num_heads, Kv})); the
  // flash kernel's mha_fwd allocates `out = at::empty_like(q_padded)`, which keeps q_t's strides when they are
  // dense: a query that is physically (B, H, L, D) (a torch.cat's result, as GPT-NeoX's partial rotary gives)
  // makes a (B, H, L, D) output, and the caller's `.transpose(1, 2).contiguous()` then copies it. The H100
  // trace of validate/measured/ (Pythia-160m, fp16 autocast) shows that copy.
  const bool flash = be == SdpaBackend::kFlash || be == SdpaBackend::kCudnn;  // their shared allocations
  // The two 0-dim int64 philox tensors (seed, offset) that the op returns and saves: the efficient kernel
  // makes them on the CUDA device without dropout; the flash kernel makes them on the CPU. On sm_90 and sm_100
  // PyTorch's recent sdp_utils.cpp (check_prefer_cudnn_attention) puts cuDNN attention first in the priority
  // order, and cuDNN's kernel, which like flash allocates its output in the query's layout and keeps a (B, H, L)
  // float32 logsumexp, makes them on the CUDA device: the H100/H200 traces of validate/measured/ (torch 2.11,
  // Llama, Qwen, nanoGPT under SDPA) show two 8-byte allocations per layer beside the logsumexp, kept to the
  // backward. Only 2.11 is measured; earlier releases keep flash's CPU tensors here.
  const bool philox = dropout_p == 0.0 && (!flash || cudnn_first);
  // the kernel that runs where flash is chosen: cuDNN's where it comes first
  const bool cudnn_runs = be == SdpaBackend::kCudnn || (flash && cudnn_first);
  T out, lse, seed, offset;
  // FLOPs (flops.h): QK^T and AV over the (query, key) pairs the kernel computes. Causal: the fused kernels skip
  // the tiles above the diagonal, counted as the pairs on or below it (bottom-right aligned when L < S, as
  // flash-attention >= 2.1 aligns it); otherwise every pair.
  const uint64_t pairs_per_head = is_causal && L <= S
      ? detail::sat_add(detail::sat_mul(L, S - L), detail::sat_mul(L, L + 1) / 2)
      : detail::sat_mul(L, S);
  const uint64_t pairs = detail::sat_mul(detail::sat_mul(B, H), pairs_per_head);
  const DType adt = q.dtype();
  // bytes: q, out (B, H, L, D) and k, v (B, Hk, S, D) once each, and the float32 logsumexp
  const uint64_t qo_bytes = detail::nbytes(detail::sat_mul(detail::sat_mul(B, H), detail::sat_mul(L, D)), adt);
  const uint64_t kv_bytes = detail::nbytes(detail::sat_mul(detail::sat_mul(B, Hk),
                                                       detail::sat_mul(S, detail::sat_add(D, Dv))), adt);
  const uint64_t lse_bytes = detail::nbytes(detail::sat_mul(detail::sat_mul(B, H), L), DType::kF32);
  // the op's outputs (output, logsumexp, philox seed and offset) are what selective checkpointing keeps
  c.e.sac_op(SacOp::kSdpa, {&out, &lse, &seed, &offset}, [&] {
    // FLOPs: 2·pairs·D for QK^T and 2·pairs·Dv for AV
    c.e.count(FlopKind::kAttention,
              detail::sat_add(detail::sat_mul(2, detail::sat_mul(pairs, D)),
                          detail::sat_mul(2, detail::sat_mul(pairs, Dv))),
              detail::sat_add(detail::sat_mul(qo_bytes, 2), detail::sat_add(kv_bytes, lse_bytes)),
              adt);
    // where cuDNN is first (2.11, sm_90/sm_100) the traces show the two philox tensors before the output and
    // the logsumexp; the flash and efficient kernels make them after
    auto make_philox = [&] {
      seed = c.e.empty(Shape{}, DType::kI64, Category::kActivations, c.L("sdpa philox seed"));
      offset = c.e.empty(Shape{}, DType::kI64, Category::kActivations, c.L("sdpa philox offset"));
    };
    if (philox && cudnn_first) make_philox();
    const Shape blhd{B, L, H, Dv};
    Strides qt = q->strides;  // q.transpose(1, 2)
    std::swap(qt[1], qt[2]);
    const Strides st = flash && Dv == D && is_dense(blhd, qt) ? qt : contiguous_strides(blhd);
    T out_blhd = c.e.empty_strided(blhd, st, q.dtype(), Category::kActivations, c.L("sdpa output"));
    Shape os{B, H, L, Dv};
    Strides ost = out_blhd->strides;
    std::swap(ost[1], ost[2]);
    out = c.e.view(out_blhd, os, ost);
    out_blhd.reset();
    // logsumexp, float32: flash (B, H, L) (flash_api.cpp); efficient pads L to a multiple of 32 (kAlignLSE).
    // attention.cpp asks the efficient and cuDNN kernels for it only when should_compute_logsumexp(q, k, v):
    // `any_inputs_require_grad && GradMode::is_enabled()`; without it the efficient kernel's is (B, H, 0) and
    // cuDNN's is not made (the H100 trace of validate/measured/open/*_hf_gen_llama3_* under generate()'s no_grad:
    // seed, offset and the output, no (B, H, L) float32). The flash kernel always makes one.
    const bool wants_lse = c.e.grad_mode && (q->requires_grad || k->requires_grad || v->requires_grad);
    constexpr uint64_t kAlignLse = 32;
    if (wants_lse || (be == SdpaBackend::kFlash && !cudnn_runs)) {
      lse = c.e.empty(Shape{B, H, flash ? L : round_up_to(L, kAlignLse)}, DType::kF32, Category::kActivations,
                      c.L("sdpa logsumexp"));
    }
    if (philox && !cudnn_first) make_philox();
  });
  Saved saved{q, k, v, out, lse};
  if (mask) saved.push_back(*mask);
  if (philox) {
    saved.push_back(std::move(seed));
    saved.push_back(std::move(offset));
  }
  const DType dt = q.dtype();
  c.e.record(be == SdpaBackend::kCudnn ? "ScaledDotProductCudnnAttentionBackward0"
             : flash                    ? "ScaledDotProductFlashAttentionBackward0"
                                        : "ScaledDotProductEfficientAttentionBackward0",
             {&q, &k, &v}, {&out}, std::move(saved),
             [flash, cudnn_runs, B, H, L, D, Hk, S, dt, pairs, Dv, qo_bytes, kv_bytes, lse_bytes](Engine& e, Node& n, Grads& g) {
               Grads r(3);
               if (!g[0]) return r;
               // FLOPs: FlashAttention-2's backward (Dao 2023, Algorithm 2; the memory-efficient kernel does the
               // same products): it recomputes S = QK^T (2·pairs·D), then dV = P^T dO (2·pairs·Dv), dP = dO V^T
               // (2·pairs·Dv), dQ = dS K and dK = dS^T Q (2·pairs·D each). Bytes: q, k, v, out, dO, lse read;
               // dq, dk, dv written.
               e.count(FlopKind::kAttention,
                       detail::sat_add(detail::sat_mul(6, detail::sat_mul(pairs, D)),
                                   detail::sat_mul(4, detail::sat_mul(pairs, Dv))),
                       detail::sat_add(detail::sat_mul(qo_bytes, 4),
                                   detail::sat_add(detail::sat_mul(kv_bytes, 2), lse_bytes)),
                       dt);
               // dq, dk, dv = empty_like(q, k, v): q, k, v are the first three saved tensors
               auto like_saved = [&](size_t i) {
                 const T& t = n.saved[i];
                 return e.empty_strided(t.shape(), dense_strides_like(t.shape(), t->strides), dt, Category::kBackward,
                                        g[0]->label);
               };
               // every kernel makes the three gradients first, then its own scratch
               r[0] = like_saved(0);
               r[1] = like_saved(1);
               r[2] = like_saved(2);
               if (cudnn_runs) {
                 // cuDNN attention's backward (PyTorch's MHA.cpp run_cudnn_SDP_bprop through cudnn-frontend's
                 // SDPA backward graph): after dq, dk, dv, one workspace from the cuDNN graph, freed
                 // when it returns: the float32 dQ accumulator (B, H, L, D), the float32 softmax sum (B, H, L),
                 // under GQA the full-head dK and dV in the inputs' dtype (B, H, S, D) each, and the execution
                 // plan's own kCudnnSdpaBackwardPlanWorkspace. Measured on an H100 (torch 2.11, cuDNN 9.19) over
                 // 12 shape and GQA forms: validate/measured/probes/h100-80gb-hbm3_sdpa_backward_probe.jsonl
                 // (validate/cuda/sdpa_probe.py), every workspace equal to this sum to the byte.
                 const uint64_t bhl = detail::sat_mul(detail::sat_mul(B, H), L);
                 uint64_t ws = detail::sat_add(detail::nbytes(detail::sat_mul(bhl, D), DType::kF32),
                                               detail::nbytes(bhl, DType::kF32));
                 if (Hk != H) {
                   ws = detail::sat_add(ws, detail::sat_mul(2, detail::nbytes(detail::sat_mul(detail::sat_mul(B, H),
                                                                                               detail::sat_mul(S, D)), dt)));
                 }
                 ws = detail::sat_add(ws, kCudnnSdpaBackwardPlanWorkspace);
                 T workspace = e.empty(Shape{ws}, DType::kU8, Category::kTemporaries, Label{"cuDNN attention backward workspace"});
               } else if (flash) {
                 // mha_bwd: after dq, dk, dv, softmax_d and dq_accum in float32 with the sequence rounded
                 // up to 128 and the head dim to 32 (64 above 128); GQA expands dk/dv to all heads first.
                 const uint64_t Lr = round_up_to(L, 128);
                 const uint64_t Dr = round_up_to(round_up_to(D, 8), D <= 128 ? 32 : 64);
                 T softmax_d = e.empty(Shape{B, H, Lr}, DType::kF32, Category::kTemporaries, Label{"flash softmax_d"});
                 T dq_accum = e.empty(Shape{B, Lr, H, Dr}, DType::kF32, Category::kTemporaries, Label{"flash dq_accum"});
                 if (Hk != H) {
                   T dk_exp = e.empty(Shape{B, S, H, D}, dt, Category::kTemporaries, Label{"flash dk_expanded"});
                   T dv_exp = e.empty(Shape{B, S, H, D}, dt, Category::kTemporaries, Label{"flash dv_expanded"});
                 }
               } else {
                 // attention_backward.cu: after grad_out.contiguous() and the three gradients, delta (B, H, L) float32
                 T delta = e.empty(Shape{B, H, L}, DType::kF32, Category::kTemporaries, Label{"efficient attention delta"});
               }
               return r;
             });
  return out;
}

}  // namespace trainmem::sim
