// Ring attention under torch's context_parallel (cp.h), one rank: what
// torch/distributed/tensor/experimental/_context_parallel/_attention.py allocates per SDPA call.
//
// context_parallel() dispatches aten._scaled_dot_product_flash_attention and its backward to
// _scaled_dot_product_ring_flash_attention(_backward) -> _templated_ring_attention(_backward) (_sdpa_handler's
// call_maps). Autograd sees one flash-attention node whose saved tensors are the local q, k, v, the merged
// output and logsumexp (as without CP, at the rank's seq / cp tokens); everything else below is a transient of
// the op, freed when it returns. The rank simulated is Ctx::cp_rank (TrainSetup::cp_rank; estimate() simulates
// every CP rank and names the worst): with the head-tail load balancer its steps 1 to rank take the whole q with
// the first half of the received k, v (`i <= rank`), the later ones the second half of q with the whole received
// k, v (`i > rank`, partial=True) (cp.h ring_steps). The CPU oracle (validate/cpu/ring_attention.py) runs the
// transliterated op for every rank.
#include <fmt/format.h>

#include "ops_util.h"
#include "trainmem/cp.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace {
uint64_t round_up(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }
}  // namespace

T ring_sdpa(Ctx& c, const T& q, const T& k, const T& v, bool has_mask, double dropout_p, bool is_causal, bool flash) {
  if (has_mask || dropout_p != 0.0) {
    // _scaled_dot_product_ring_efficient/cudnn_attention: `if attn_bias is not None: raise NotImplementedError`;
    // attention dropout would add the kernel's philox state per ring step: not simulated
    throw Error("cp: context parallel is simulated for SDPA without an attention mask and without attention dropout");
  }
  if (!flash) {
    // the ring merges an unpadded logsumexp of (B, H, L); the efficient kernel pads L to 32 and takes a
    // philox state per call: not simulated
    throw Error("cp: context parallel is simulated for SDPA's flash kernel only (bf16/fp16 compute on sm_80+, "
                "head dim a multiple of 8 up to 256); this setup runs the memory-efficient or math kernel");
  }
  if (!is_causal) {
    // _templated_ring_attention: `if not is_causal and _cp_options.enable_load_balance: raise RuntimeError(
    // "Load balancing requires `is_causal=True`.")`
    throw Error("cp: context parallel's load-balanced ring attention requires is_causal=True SDPA calls");
  }
  Engine& e = c.e;
  const uint64_t n = c.cp, rank = c.cp_rank;
  const uint64_t B = q.shape()[0], H = q.shape()[1], L = q.shape()[2], D = q.shape()[3];
  const uint64_t Hk = k.shape()[1];
  const DType dt = q.dtype();
  const std::vector<RingStep> steps = ring_steps(L, n, rank);
  const uint64_t kv_elems = cp_kv_cat_bytes(B, Hk, L, D, dt) / itemsize(dt);
  auto tmp = [&](Shape s, DType d, const char* what) { return e.empty(s, d, Category::kTemporaries, c.L(what)); };
  // the (query, key) pairs of ring step i, over the batch and heads: step 0 is causal over equal lengths
  auto step_pairs = [&](size_t i) {
    const RingStep& st = steps[i];
    const uint64_t per_head =
        i == 0 ? detail::sat_mul(st.q_len, st.q_len + 1) / 2 : detail::sat_mul(st.q_len, st.kv_len);
    return detail::sat_mul(detail::sat_mul(B, H), per_head);
  };
  uint64_t ring_pairs = 0;
  for (size_t i = 0; i < steps.size(); ++i) ring_pairs = detail::sat_add(ring_pairs, step_pairs(i));

  T out, lse;
  // Selective checkpointing (torchtitan's op-level SAC): context_parallel routes F.scaled_dot_product_attention's
  // inputs to DTensors, so the op the policy's dispatch mode sees is aten._scaled_dot_product_flash_attention
  // itself, on the save list; the ring runs inside it, under the DTensor handler, with the mode off (a mode's
  // func runs with the mode popped). So the frame keeps the ring's merged output and logsumexp, and the recompute
  // in backward takes them without running the ring again (Engine::sac_op, as sdpa()'s flash call).
  c.e.sac_op(SacOp::kSdpa, {&out, &lse}, [&] {
    // key = key.contiguous(); value = value.contiguous()
    T kc = is_contiguous(k.shape(), k->strides) ? T() : tmp(k.shape(), dt, "cp key contiguous");
    T vc = is_contiguous(v.shape(), v->strides) ? T() : tmp(v.shape(), dt, "cp value contiguous");
    T sent, gathered, block_out, block_lse, acc_out, acc_lse;
    for (size_t i = 0; i < steps.size(); ++i) {
      const RingStep& st = steps[i];
      // i > 0: rotater.next_buffer() waits on the all-gather: the cat it sent is released (a view of the
      // gathered buffer is taken, no copy)
      if (i == 1) {
        sent.reset();
        // key = next_kv[: key.numel()].reshape(key.shape) (and value): the contiguous() copies lose their only
        // reference (found by the CPU oracle, validate/cpu/ring_attention.py)
        kc.reset();
        vc.reset();
      }
      if (i + 1 < steps.size()) {
        // next_kv = torch.cat([key.flatten(), value.flatten()]); next_kv = rotater.exchange_buffers(next_kv):
        // the all-gather runs once (_AllGatherRotater: `if self._aggregated_buffer is None`), and
        // exchange_buffers returns None, so later cats are freed at once
        T cat = tmp(Shape{kv_elems}, dt, "cp kv cat");
        if (i == 0) {
          gathered = tmp(Shape{n * kv_elems}, dt, "cp kv all-gather");  // ft_c.all_gather_tensor(gather_dim=0)
          sent = std::move(cat);
        }
      }
      // out, logsumexp, *rest = op(q, k, v, is_causal=...): the flash kernel's (B, q, H, D) output and its
      // float32 (B, H, q) logsumexp; the loop's variables drop the previous step's only after the call
      T o = tmp(Shape{B, st.q_len, H, D}, dt, "cp ring step out");
      // FLOPs (flops.h): this step's flash call, QK^T and AV over its pairs (the causal first step's triangle)
      e.count(FlopKind::kAttention, detail::sat_mul(4, detail::sat_mul(step_pairs(i), D)),
              // bytes: q and the step's out (B, H, q, D), k and v (B, Hk, kv, D), once each
              detail::nbytes(
                  detail::sat_mul(detail::sat_mul(2 * B, D),
                                  detail::sat_add(detail::sat_mul(H, st.q_len), detail::sat_mul(Hk, st.kv_len))),
                  dt),
              dt);
      T l = tmp(Shape{B, H, st.q_len}, DType::kF32, "cp ring step logsumexp");
      block_out = std::move(o);
      block_lse = std::move(l);
      // _SDPAMerger.step: out.to(torch.float32) (convert_to_f32 = True); lse is float32 already (no copy)
      T b32 = dt == DType::kF32 ? block_out : tmp(Shape{B, H, st.q_len, D}, DType::kF32, "cp merge block out fp32");
      if (i == 0) {
        acc_out = b32;
        acc_lse = block_lse;
        continue;
      }
      const bool last = i + 1 == steps.size();
      // _merge_one: out = out - F.sigmoid(block_lse - lse) * (out - block_out)
      T nout;
      {
        T d = tmp(Shape{B, H, st.q_len, 1}, DType::kF32, "cp merge block_lse - lse");
        T s = tmp(Shape{B, H, st.q_len, 1}, DType::kF32, "cp merge sigmoid");
        d.reset();
        T diff = tmp(Shape{B, H, st.q_len, D}, DType::kF32, "cp merge out - block_out");
        T prod = tmp(Shape{B, H, st.q_len, D}, DType::kF32, "cp merge sigmoid * diff");
        s.reset();
        diff.reset();
        nout = tmp(Shape{B, H, st.q_len, D}, DType::kF32, "cp merged out");
      }
      // lse = lse - F.logsigmoid(lse - block_lse)
      T nlse;
      {
        T d = tmp(Shape{B, H, st.q_len, 1}, DType::kF32, "cp merge lse - block_lse");
        T s = tmp(Shape{B, H, st.q_len, 1}, DType::kF32, "cp merge logsigmoid");
        d.reset();
        // the last merge's logsumexp is the one the op returns (results(): squeeze and .to(float32), no copy)
        nlse = last && !st.partial ? e.empty(Shape{B, H, st.q_len, 1}, DType::kF32, Category::kActivations,
                                             c.L("sdpa logsumexp"))
                                   : tmp(Shape{B, H, st.q_len, 1}, DType::kF32, "cp merged logsumexp");
      }
      if (st.partial) {
        // _partial_update(..., idx=1, add=False): torch.cat of the two halves, a new full-length tensor
        T full_lse = last ? e.empty(Shape{B, H, L, 1}, DType::kF32, Category::kActivations, c.L("sdpa logsumexp"))
                          : tmp(Shape{B, H, L, 1}, DType::kF32, "cp merged logsumexp (cat)");
        acc_lse = std::move(full_lse);
        T full_out = tmp(Shape{B, H, L, D}, DType::kF32, "cp merged out (cat)");
        acc_out = std::move(full_out);
      } else {
        acc_lse = std::move(nlse);
        acc_out = std::move(nout);
      }
    }
    // results(): self._out.to(out dtype): a new (B, H, L, D) tensor in the merged output's layout (.to keeps a
    // dense tensor's strides). When the last merge was a partial one (every rank but the last) it was a torch.cat,
    // which returns a contiguous tensor, so the output is (B, H, L, D)-contiguous: the caller's transpose(1,
    // 2).contiguous() copies it. On the last rank every merge is a full one, `out - sigmoid(..) * (out -
    // block_out)`, whose result takes its first operand's layout: the flash kernel's (B, L, H, D), from step 0's
    // output (TensorIterator's stride order; torch 1.13 on CPU gives the last rank's output strides (L*H*D, D,
    // H*D, 1) and every other rank's contiguous ones), so that copy is free.
    const bool flash_layout = !steps.back().partial;
    Strides st = contiguous_strides(Shape{B, L, H, D});  // (B, L, H, D) dense, seen as (B, H, L, D)
    std::swap(st[1], st[2]);
    out = e.empty_strided(Shape{B, H, L, D}, flash_layout ? st : contiguous_strides(Shape{B, H, L, D}), dt,
                          Category::kActivations, c.L("sdpa output (ring attention)"));
    lse = std::move(acc_lse);
    // leaving _templated_ring_attention frees the merger's float32 output, the last step's out and
    // logsumexp, the gathered K/V (the rotater) and the contiguous copies
  });
  const uint64_t gqa_heads = H;
  c.e.record("ScaledDotProductFlashAttentionBackward0 (ring)", {&q, &k, &v}, {&out}, Saved{q, k, v, out, lse},
             [n, rank, B, H, L, D, Hk, dt, kv_elems, gqa_heads, ring_pairs](Engine& eng, Node& nd, Grads& g) {
               Grads r(3);
               if (!g[0]) return r;
               // FLOPs: the ring's backward runs the forward's steps, each flash's backward (5 products of
               // 2·pairs·D: QK^T again, dV, dP, dQ, dK); bytes as flash's over the local q and the gathered k, v
               eng.count(FlopKind::kAttention, detail::sat_mul(10, detail::sat_mul(ring_pairs, D)),
                         detail::nbytes(detail::sat_mul(detail::sat_mul(B, H), detail::sat_mul(D, 6 * L)), dt), dt);
               const Label lab = g[0]->label;
               auto btmp = [&](Shape s, DType d, const char* what) {
                 return eng.empty(s, d, Category::kTemporaries, Label{what, lab.layer, kRowNamedInBackward});
               };
               const std::vector<RingStep> bsteps = ring_steps(L, n, rank);
               // _templated_ring_attention_backward: accum_dtype float32 (convert_to_f32);
               // grad_query/key/value = torch.zeros_like(..., dtype=accum_dtype)
               T gq = btmp(Shape{B, H, L, D}, DType::kF32, "cp grad_query fp32");
               T gk = btmp(Shape{B, Hk, L, D}, DType::kF32, "cp grad_key fp32");
               T gv = btmp(Shape{B, Hk, L, D}, DType::kF32, "cp grad_value fp32");
               const T& sk = nd.saved[1];
               const T& sv = nd.saved[2];
               T kc = is_contiguous(sk.shape(), sk->strides) ? T() : btmp(sk.shape(), dt, "cp key contiguous");
               T vc = is_contiguous(sv.shape(), sv->strides) ? T() : btmp(sv.shape(), dt, "cp value contiguous");
               // the op's Python variables: next_kv (kv_cat), the K/V rotater's gathered buffer, grad_query_/
               // key_/value_ (dq_, dk_, dv_), lse's half copy, the K/V-gradient rotater's received buffer
               // (rot_buf, its _buffer) and sent one (rot_pending, its _pending_input), next_grad_kv (ngkv);
               // grad_key / grad_value (gk, gv) hold the f32 zeros, a received buffer they are views of, or a
               // torch.cat of their own
               T kv_cat, gathered, dq_, dk_, dv_, lse_half, rot_buf, rot_pending, ngkv;
               for (size_t i = 0; i < bsteps.size(); ++i) {
                 const RingStep& st = bsteps[i];
                 if (i == 1) {
                   // key = buffer[pointer : pointer + key.numel()].reshape(key.shape) (and value): the
                   // contiguous() copies lose their only reference
                   kc.reset();
                   vc.reset();
                 }
                 if (i + 1 < bsteps.size()) {
                   // next_kv = torch.cat([key.flatten(), value.flatten()]); kv_rotater.exchange_buffers(next_kv)
                   // (the all-gather once; next_kv keeps the cat until the next one)
                   T cat = btmp(Shape{kv_elems}, dt, "cp kv cat");
                   if (i == 0) gathered = btmp(Shape{n * kv_elems}, dt, "cp kv all-gather");
                   kv_cat = std::move(cat);
                 }
                 if (st.partial) {
                   // logsumexp.chunk(2, dim=seq_dim)[1].contiguous(): a float32 (B, H, L/2) copy, kept by the
                   // loop's `lse` until the next step's (found by the CPU oracle)
                   T half = btmp(Shape{B, H, st.q_len}, DType::kF32, "cp logsumexp half contiguous");
                   lse_half = std::move(half);
                 }
                 // the flash backward of this step (as the non-CP kernel: ops_nn.cc sdpa, mha_bwd): dq, dk, dv
                 // in the input dtype, softmax_d and dq_accum in float32 (sequence rounded up to 128, head dim
                 // to 32, or 64 above 128), GQA's expanded dk/dv; grad_query_ etc. drop the previous step's
                 // only after the call
                 {
                   const uint64_t Lr = round_up(st.q_len, 128);
                   const uint64_t Dr = round_up(round_up(D, 8), D <= 128 ? 32 : 64);
                   T ndq = btmp(Shape{B, H, st.q_len, D}, dt, "cp ring step dq");
                   T ndk = btmp(Shape{B, Hk, st.kv_len, D}, dt, "cp ring step dk");
                   T ndv = btmp(Shape{B, Hk, st.kv_len, D}, dt, "cp ring step dv");
                   {
                     T softmax_d = btmp(Shape{B, H, Lr}, DType::kF32, "flash softmax_d");
                     T dq_accum = btmp(Shape{B, Lr, H, Dr}, DType::kF32, "flash dq_accum");
                     if (Hk != gqa_heads) {
                       T dk_exp = btmp(Shape{B, st.kv_len, H, D}, dt, "flash dk_expanded");
                       T dv_exp = btmp(Shape{B, st.kv_len, H, D}, dt, "flash dv_expanded");
                     }
                   }
                   dq_ = std::move(ndq);
                   dk_ = std::move(ndk);
                   dv_ = std::move(ndv);
                 }
                 if (i > 0) {
                   // next_grad_kv = dkv_rotater.next_buffer(): the previous send is done (_pending_input = None)
                   // and the variable takes the received buffer: the sent cat is released
                   rot_pending.reset();
                   ngkv = rot_buf;
                   // grad_key / grad_value = views of it (the old ones released: the f32 zeros, an earlier
                   // received buffer, or their cats)
                   gk = rot_buf;
                   gv = rot_buf;
                   if (i <= rank) {
                     // grad_key = _partial_update(grad_key, grad_key_, idx=0, add=True): the first half added in
                     // place, then torch.cat of the chunks, a new tensor (and grad_value likewise)
                     T ngk = btmp(Shape{B, Hk, L, D}, DType::kF32, "cp grad_key (cat)");
                     gk = std::move(ngk);
                     T ngv = btmp(Shape{B, Hk, L, D}, DType::kF32, "cp grad_value (cat)");
                     gv = std::move(ngv);
                   }
                   // else grad_key += grad_key_: in place
                 }
                 // next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()]) (float32);
                 // dkv_rotater.exchange_buffers: ft_c.permute_tensor, a new buffer of the same size, then the old
                 // one released (kept by grad_key and grad_value when they are views of it)
                 ngkv = btmp(Shape{kv_elems}, DType::kF32, "cp grad kv cat");
                 T nb = btmp(Shape{kv_elems}, DType::kF32, "cp grad kv all-to-all");
                 rot_buf = std::move(nb);
                 rot_pending = ngkv;
                 if (i > rank) {
                   // grad_query = _partial_update(grad_query, grad_query_, idx=1, add=True): torch.cat
                   T ngq = btmp(Shape{B, H, L, D}, DType::kF32, "cp grad_query (cat)");
                   gq = std::move(ngq);
                 }
                 // else grad_query += grad_query_: in place
               }
               // grad_query.to(query.dtype); next_grad_kv = dkv_rotater.next_buffer().to(key.dtype) (the sent cat
               // released once the new buffer is made); grad_key and grad_value become views of that one buffer
               r[0] = eng.empty(Shape{B, H, L, D}, dt, Category::kBackward, lab);
               gq.reset();
               rot_pending.reset();
               T dkv = eng.empty(Shape{kv_elems}, dt, Category::kBackward, lab);
               ngkv.reset();
               gk.reset();
               gv.reset();
               r[1] = eng.view(dkv, Shape{B, Hk, L, D}, contiguous_strides(Shape{B, Hk, L, D}));
               r[2] = eng.view(dkv, Shape{B, Hk, L, D}, contiguous_strides(Shape{B, Hk, L, D}));
               return r;
             });
  return out;
}

}  // namespace trainmem::sim
