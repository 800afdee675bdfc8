// transformers' T5ForConditionalGeneration (modeling_t5.py), labels given, use_cache=False (as every training
// program here: no EncoderDecoderCache), eager attention (T5Attention has one code path: explicit matmul, no
// scaling, softmax). The encoder takes the --seq input ids and the collator's attention mask; the decoder takes
// _shift_right(labels) of --target-seq tokens; the loss is CrossEntropyLoss(ignore_index=-100) over the logits.
// Transliterated from huggingface/transformers src/transformers/models/t5/modeling_t5.py at 6b8b757 (the one
// upstream version the source index holds): T5Stack's masks (_update_causal_mask, the encoder's extended mask,
// invert_attention_mask), _shift_right, the stacks' forwards, and T5Attention's own path (q/k/v views, scores,
// compute_bias, `scores += position_bias_masked`, softmax(scores.float()).type_as(scores), the o projection), which
// 5.x kept until PR #47014 (merged 2026-07) moved it to the attention interface. Not modelled yet: that interface
// (eager_attention_forward with scaling=1.0 and the bias as a kwarg, and SDPA), and 5.x T5Stack's masks from
// masking_utils (create_causal_mask / create_bidirectional_mask), which change mask temporaries only.
// B=micro-batch T=encoder seq N=decoder seq (--target-seq) C=d_model H=num_heads D=d_kv I=H*D F=d_ff V=vocab
#include <fmt/format.h>

#include "../layers.h"
#include "../ops_util.h"
#include "hf_common.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace {

// A tensor made outside autograd (masks, position buckets, index arithmetic).
T plain(Ctx& c, const Shape& s, DType dt, const char* what, Category cat = Category::kTemporaries) {
  return c.e.empty(s, dt, cat, c.L(what));
}

// One index of a tuple index that spans its whole dim (`x[:, :, -seq_length:, :]` with seq_length the dim's size):
// python_variable_indexing's applySlicing records a slice per index (start -seq_length or a `:` with stop
// PY_SSIZE_T_MAX is never the no-op shortcut's `start == 0 && stop == length`), each a view whose SliceBackward0
// (slice_backward) allocates zeros of the input's size and copies the gradient in.
T whole_slice(Ctx& c, const T& x) {
  T out = c.e.view(x, x.shape(), x->strides);
  const Shape in = x.shape();
  c.e.record("SliceBackward0", {&x}, {&out}, {}, [in](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? detail::grad_empty(e, in, g[0].dtype(), g[0]->label) : T()};
  });
  return out;
}

// T5LayerNorm.forward: variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True);
// hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon); `if self.weight.dtype in
// [torch.float16, torch.bfloat16]: hidden_states = hidden_states.to(self.weight.dtype)`; return self.weight *
// hidden_states. The rsqrt multiplies the input itself (not its float32 copy): float32 by type promotion.
T t5_layer_norm(Ctx& c, const T& x, const T& weight, const char* what) {
  // `variance` is a local: bound until forward returns
  const T var = mean_last(c, pow_scalar(c, to(c, x, DType::kF32, "t5_norm .to(float32)"), "t5_norm pow(2)"),
                          "t5_norm variance");
  T r = rsqrt(c, add_scalar(c, var, "t5_norm variance + eps"), "t5_norm rsqrt");  // the sum dies with the call
  T h = mul(c, x, r, "t5_norm h * rsqrt");
  r.reset();
  if (weight.dtype() == DType::kF16 || weight.dtype() == DType::kBF16) h = to(c, h, weight.dtype(), "t5_norm .to(weight.dtype)");
  return mul(c, weight, h, what);
}

// T5Attention._relative_position_bucket(relative_position (Q, K), bidirectional, num_buckets, max_distance), op by
// op: every intermediate is an int64, bool or float32 (Q, K) tensor outside autograd.
T relative_position_bucket(Ctx& c, const T& relative_position, bool bidirectional) {
  const Shape s = relative_position.shape();
  auto i64 = [&](const char* w) { return plain(c, s, DType::kI64, w); };
  T buckets;  // `relative_buckets = 0`: a Python int until a tensor is added to it
  T rp;
  if (bidirectional) {
    // relative_buckets += (relative_position > 0).to(torch.long) * num_buckets  (0 + tensor: a new tensor)
    T prod;
    {
      T gt = plain(c, s, DType::kBool, "rel_pos > 0");
      T lng = i64("(rel_pos > 0).to(long)");
      gt.reset();
      prod = i64("* num_buckets");
    }
    buckets = plain(c, s, DType::kI64, "relative_buckets (0 + ...)", Category::kActivations);  // saved by the embedding
    prod.reset();
    rp = i64("torch.abs(relative_position)");
  } else {
    // relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    T mn;
    {
      T z = i64("torch.zeros_like(relative_position)");
      mn = i64("torch.min(relative_position, zeros)");
    }
    rp = i64("-torch.min(...)");
  }
  T is_small = plain(c, s, DType::kBool, "is_small = rel_pos < max_exact");
  // max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) *
  // (num_buckets - max_exact)).to(torch.long)
  T large;
  {
    T f = plain(c, s, DType::kF32, "relative_position.float()");
    T d = plain(c, s, DType::kF32, "/ max_exact");
    f.reset();
    T lg = plain(c, s, DType::kF32, "torch.log(...)");
    d.reset();
    T d2 = plain(c, s, DType::kF32, "/ math.log(max_distance / max_exact)");
    lg.reset();
    T m2 = plain(c, s, DType::kF32, "* (num_buckets - max_exact)");
    d2.reset();
    T l2 = i64(".to(torch.long)");
    m2.reset();
    large = i64("relative_position_if_large");
  }
  {
    // torch.min(relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    T full = i64("torch.full_like(rp_if_large, num_buckets - 1)");
    T mn = i64("torch.min(rp_if_large, full)");
    full.reset();
    large = std::move(mn);
  }
  {
    T where = i64("torch.where(is_small, rel_pos, rp_if_large)");
    if (!buckets) {  // int += tensor: a new tensor (saved by the embedding)
      buckets = plain(c, s, DType::kI64, "relative_buckets (0 + where)", Category::kActivations);
    }
    // a tensor: `+=` adds in place
  }
  return buckets;
}

// T5Attention.compute_bias(query_length, key_length, device, cache_position) with cache_position given:
// context_position = cache_position[:, None] (a view); memory_position = torch.arange(key_length)[None, :];
// relative_position = memory_position - context_position; buckets; values = self.relative_attention_bias(buckets)
// (Q, K, H); values.permute([2, 0, 1]).unsqueeze(0): (1, H, Q, K).
T compute_bias(Ctx& c, const T& rel_bias, uint64_t Q, uint64_t K, bool bidirectional) {
  // context_position, memory_position, relative_position and the buckets are locals: freed when compute_bias returns
  T memory = plain(c, Shape{K}, DType::kI64, "memory_position (arange)");
  T relative = plain(c, Shape{Q, K}, DType::kI64, "relative_position");
  T buckets = relative_position_bucket(c, relative, bidirectional);
  T values = embedding(c, rel_bias, buckets, "relative_attention_bias");
  // permute([2, 0, 1]) as two transposes (the same strides; neither view saves anything)
  values = transpose(c, transpose(c, values, 1, 2), 0, 1);
  return unsqueeze(c, values, 0);
}

struct AttnIn {
  const T* mask;             // the stack's extended mask, added to the position bias where it is computed
  T* position_bias;          // the stack's position_bias (null handle until block 0 computes it)
  const T* rel_bias;         // relative_attention_bias.weight of block 0's self-attention, else null
  bool bidirectional;        // not self.is_decoder
};

// T5Attention.forward(hidden_states, mask, key_value_states, position_bias, ...), use_cache=False.
T t5_attention(Ctx& c, const ModelSpec& m, const LoadedModel& w, const std::string& p, const T& x, const T* kv,
               const AttnIn& in) {
  const uint64_t B = x.shape()[0], Q = x.shape()[1], H = m.attn.heads, D = m.attn.head_dim;
  auto W = [&](const char* s) -> const T& { return w.p(param_name("{}{}", p, s)); };
  const T& src = kv ? *kv : x;  // current_states = key_value_states if is_cross_attention else hidden_states
  const uint64_t K = src.shape()[1];
  // query_states = self.q(hidden_states).view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
  T q = transpose(c, view(c, linear(c, x, W("q.weight"), nullptr, "attn.q"), Shape{B, Q, H, D}), 1, 2);
  T k = linear(c, src, W("k.weight"), nullptr, "attn.k");
  T v = linear(c, src, W("v.weight"), nullptr, "attn.v");
  k = transpose(c, view(c, k, Shape{B, K, H, D}), 1, 2);
  v = transpose(c, view(c, v, Shape{B, K, H, D}), 1, 2);
  // scores = torch.matmul(query_states, key_states.transpose(3, 2))
  T scores = matmul(c, q, transpose(c, k, 3, 2), "attn q@k^T");
  T real_seq_length;
  if (!*in.position_bias) {
    T bias;
    if (in.rel_bias) {
      // real_seq_length = query_length if query_length is not None else cache_position[-1] + 1 (self-attention:
      // no query_length; a 0-dim tensor bound until forward returns)
      real_seq_length = plain(c, Shape{}, DType::kI64, "cache_position[-1] + 1");
      bias = compute_bias(c, *in.rel_bias, Q, K, in.bidirectional);
      // position_bias = position_bias[:, :, -seq_length:, :]: four slices, each the whole dim here
      for (int d = 0; d < 4; ++d) bias = whole_slice(c, bias);
    } else {
      // position_bias = torch.zeros((1, self.n_heads, seq_length, key_length), dtype=scores.dtype)
      bias = plain(c, Shape{1, H, Q, K}, scores.dtype(), "position_bias zeros", Category::kActivations);
    }
    // if mask is not None: position_bias = position_bias + mask[:, :, :, : key_states.shape[-2]]
    if (in.mask) bias = add(c, bias, *in.mask, "position_bias + mask");
    *in.position_bias = bias;
  }
  add_(c, scores, *in.position_bias);  // scores += position_bias_masked
  // attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores): each temporary dies when the
  // next call returns; scores, the query/key/value states and attn_weights are locals, bound until forward returns
  T a;
  {
    T sm;
    {
      T f = to(c, scores, DType::kF32, "scores.float()");
      sm = softmax(c, f, std::nullopt, "attn softmax");
    }
    a = to(c, sm, scores.dtype(), "attn weights .type_as(scores)");
  }
  a = dropout(c, a, m.dropout.attn, "attn dropout");
  T o = matmul(c, a, v, "attn @ v");
  // attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim); self.o(attn_output)
  o = view(c, contiguous(c, transpose(c, o, 1, 2), "attn output contiguous"), Shape{B, Q, H * D});
  return linear(c, o, W("o.weight"), nullptr, "attn.o");
}

// T5LayerFF: forwarded = self.layer_norm(h); forwarded = self.DenseReluDense(forwarded); h + self.dropout(forwarded)
T t5_ff(Ctx& c, const ModelSpec& m, const LoadedModel& w, const std::string& p, const T& hidden) {
  auto W = [&](const char* s) -> const T& { return w.p(param_name("{}{}", p, s)); };
  T out;
  {
    T x = t5_layer_norm(c, hidden, W("layer_norm.weight"), "ff.layer_norm");
    T h;
    if (m.mlp.gated) {
      // T5DenseGatedActDense: hidden_gelu = self.act(self.wi_0(x)); hidden_linear = self.wi_1(x);
      // hidden_states = hidden_gelu * hidden_linear
      T g = activation(c, m.mlp.act, linear(c, x, W("DenseReluDense.wi_0.weight"), nullptr, "ff.wi_0"));
      T lin = linear(c, x, W("DenseReluDense.wi_1.weight"), nullptr, "ff.wi_1");
      h = mul(c, g, lin, "hidden_gelu * hidden_linear");
    } else {
      // T5DenseActDense: hidden_states = self.act(self.wi(x))
      h = activation(c, m.mlp.act, linear(c, x, W("DenseReluDense.wi.weight"), nullptr, "ff.wi"));
    }
    h = dropout(c, h, m.dropout.act, "ff dropout");
    // `if hidden_states.dtype != self.wo.weight.dtype and self.wo.weight.dtype != torch.int8:
    // hidden_states = hidden_states.to(self.wo.weight.dtype)`
    const T& wo = W("DenseReluDense.wo.weight");
    h = to(c, h, wo.dtype(), "ff .to(wo.weight.dtype)");
    out = linear(c, h, wo, nullptr, "ff.wo");
  }
  return add(c, hidden, dropout(c, out, m.dropout.resid, "ff residual dropout"), "h + ff");
}

// T5Block.forward (use_cache=False): self-attention, (decoder) cross-attention, feed-forward, each pre-norm with a
// residual add. The fp16 clamps (`if hidden_states.dtype == torch.float16`) are refused in t5_forward.
T t5_block(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, bool decoder, T hidden, const AttnIn& self,
           const T* enc, const AttnIn& cross) {
  const std::string p = fmt::format("{}.block.{}.layer.", decoder ? "decoder" : "encoder", l);
  {
    // T5LayerSelfAttention: normed = self.layer_norm(h); h = h + self.dropout(self.SelfAttention(normed, ...)[0]);
    // normed_hidden_states is a local of that forward: bound until after the residual add
    T normed = t5_layer_norm(c, hidden, w.p(param_name("{}0.layer_norm.weight", p)), "self_attn.layer_norm");
    T attn = t5_attention(c, m, w, p + "0.SelfAttention.", normed, nullptr, self);
    hidden = add(c, hidden, dropout(c, attn, m.dropout.resid, "self_attn dropout"), "h + self_attn");
  }
  if (decoder) {
    // T5Block: query_length=cache_position[-1] + 1 (a 0-dim tensor made for the call)
    T query_length = plain(c, Shape{}, DType::kI64, "query_length = cache_position[-1] + 1");
    T normed = t5_layer_norm(c, hidden, w.p(param_name("{}1.layer_norm.weight", p)), "cross_attn.layer_norm");
    T attn = t5_attention(c, m, w, p + "1.EncDecAttention.", normed, enc, cross);
    hidden = add(c, hidden, dropout(c, attn, m.dropout.resid, "cross_attn dropout"), "h + cross_attn");
  }
  return t5_ff(c, m, w, p + (decoder ? "2." : "1."), hidden);
}

// ModuleUtilsMixin.invert_attention_mask / the encoder's extended mask: mask[:, None, None, :] (a view),
// .to(dtype) (int64 -> float: a copy), (1.0 - mask), * torch.finfo(dtype).min: (B, 1, 1, T) each.
T inverted_mask(Ctx& c, uint64_t B, uint64_t Tn, DType dt) {
  const Shape s{B, 1, 1, Tn};
  T f = plain(c, s, dt, "mask.to(dtype)");
  T one_minus = plain(c, s, dt, "1.0 - mask");
  T out = plain(c, s, dt, "(1.0 - mask) * finfo.min", Category::kActivations);
  one_minus.reset();  // the temporary, then the rebound .to() copy
  f.reset();
  return out;
}

// T5Stack._update_causal_mask -> _prepare_4d_causal_attention_mask_with_cache_position (eager, no cache), with the
// stack's own attention_mask = torch.ones(batch_size, mask_seq_length) (float32): (B, 1, N, N) in `dt`.
T decoder_causal_mask(Ctx& c, uint64_t B, uint64_t N, DType dt, const T& ones) {
  T causal;
  {
    T full = plain(c, Shape{N, N}, dt, "torch.full((N, N), min)");
    if (N != 1) causal = plain(c, Shape{N, N}, dt, "torch.triu(causal_mask, 1)");  // full freed on rebinding
    else causal = full;
  }
  {
    // causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)  (in place)
    T ar = plain(c, Shape{N}, DType::kI64, "torch.arange(target_length)");
    T gt = plain(c, Shape{N, N}, DType::kBool, "arange > cache_position");
    ar.reset();
  }
  // causal_mask[None, None, :, :].expand(B, 1, -1, -1).clone()
  causal = plain(c, Shape{B, 1, N, N}, dt, "causal_mask (clone)", Category::kActivations);
  {
    // padding_mask = causal_mask[:, :, :, :N] + attention_mask[:, None, None, :]; padding_mask = padding_mask == 0
    const DType sum_dt = (dt == DType::kF32 || ones.dtype() == DType::kF32) ? DType::kF32 : dt;
    T pad = plain(c, Shape{B, 1, N, N}, sum_dt, "causal_mask + attention_mask");
    T eq = plain(c, Shape{B, 1, N, N}, DType::kBool, "padding_mask == 0");
    pad.reset();
    // causal_mask[..., :N] = causal_mask[..., :N].masked_fill(padding_mask, min_dtype): a new tensor copied in
    T filled = plain(c, Shape{B, 1, N, N}, dt, "masked_fill(padding_mask, min)");
  }
  return causal;
}

// T5Stack.forward of one stack: embeddings, masks, dropout, the blocks (position_bias from block 0 passed on),
// final_layer_norm, dropout.
T t5_stack(Ctx& c, const ModelSpec& m, const LoadedModel& w, bool decoder, const T& ids, const T* enc,
           const T* enc_mask) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  const char* s = decoder ? "decoder" : "encoder";
  c.layer = -1;
  T inputs_embeds = embedding(c, w.p("shared.weight"), ids, decoder ? "decoder embed_tokens" : "encoder embed_tokens");
  const DType dt = inputs_embeds.dtype();
  // cache_position = torch.arange(past_key_values_length, past_key_values_length + seq_length)
  T cache_position = plain(c, Shape{Tn}, DType::kI64, "cache_position", Category::kActivations);
  T mask, ones, enc_ext;
  if (decoder) {
    // attention_mask is None: attention_mask = torch.ones(batch_size, mask_seq_length) (float32)
    ones = plain(c, Shape{B, Tn}, DType::kF32, "attention_mask = torch.ones", Category::kActivations);
    mask = decoder_causal_mask(c, B, Tn, dt, ones);
    // encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask) in self.dtype (the
    // parameters' dtype)
    enc_ext = inverted_mask(c, B, enc->shape()[1], w.p("shared.weight").dtype());
  } else {
    // causal_mask = attention_mask[:, None, None, :].to(dtype=inputs_embeds.dtype); (1.0 - causal_mask) * finfo.min
    (void)enc_mask;
    mask = inverted_mask(c, B, Tn, dt);
  }
  T hidden = dropout(c, inputs_embeds, m.dropout.embd, "stack dropout");  // inputs_embeds stays bound
  T position_bias, enc_dec_bias;
  const uint64_t layers = decoder ? m.encdec.decoder_layers : m.layers;
  const uint64_t offset = decoder ? m.layers : 0;  // decoder blocks are timeline layers L.. (layer_name)
  hidden = run_layers(c, layers, std::move(hidden), LayerArgs{}, [&](uint64_t l, T h, const LayerArgs&) {
    c.layer = static_cast<int32_t>(offset + l);
    const T* rel = l == 0 ? &w.p(fmt::format("{}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", s)) : nullptr;
    const AttnIn self{&mask, &position_bias, rel, !decoder};
    const AttnIn cross{&enc_ext, &enc_dec_bias, nullptr, false};
    return t5_block(c, m, w, l, decoder, std::move(h), self, enc, cross);
  });
  c.layer = -1;
  hidden = t5_layer_norm(c, hidden, w.p(fmt::format("{}.final_layer_norm.weight", s)), "final_layer_norm");
  return dropout(c, hidden, m.dropout.resid, "final dropout");
}

}  // namespace

ForwardOut t5_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  if (!labels) {
    throw Error(fmt::format("{}: T5 for inference is not simulated yet (--task inference: a labels-free call passes "
                            "its own decoder_input_ids; --generate: generate() encodes once and grows an "
                            "EncoderDecoderCache of self- and cross-attention keys and values); train it instead",
                            m.name));
  }
  // T5ForConditionalGeneration computes its own CrossEntropyLoss over the whole logits: no logits_to_keep, and
  // neither torchtune's chunked head nor Liger's fused kernel has a T5 version
  if (c.loss_chunks || c.liger_fused || c.logits_to_keep) {
    throw Error(fmt::format("{}: T5ForConditionalGeneration's loss is CrossEntropyLoss over all the logits; "
                            "--loss chunked, --loss liger-fused and --logits-to-keep are not for it", m.name));
  }
  if (!c.attention_mask) throw Error("internal: T5's forward needs the batch's attention_mask");
  // the layer lambda hands block 0's position_bias to the later blocks, which a checkpointed (recomputed) layer
  // would have to pass as T5Stack's checkpoint call does (positional arguments): not simulated
  if (c.checkpoint.mode != CheckpointPolicy::kNone) {
    throw Error(fmt::format("{}: gradient checkpointing of T5's blocks is not simulated yet (block 0's position_bias "
                            "is passed to every block as a checkpoint argument)", m.name));
  }
  // T5Block clamps float16 hidden states after each sub-layer (torch.isinf(...).any(), torch.where, torch.clamp)
  if (w.p("shared.weight").dtype() == DType::kF16) {
    throw Error(fmt::format("{}: a float16 T5 (T5Block's inf clamps after every sub-layer) is not simulated yet; "
                            "use fp32, bf16 or an autocast precision", m.name));
  }
  const uint64_t B = labels->shape()[0], N = labels->shape()[1];
  T enc = t5_stack(c, m, w, false, ids, nullptr, c.attention_mask);
  T dec_ids;
  {
    // _shift_right(labels): shifted = input_ids.new_zeros(input_ids.shape); shifted[..., 1:] =
    // input_ids[..., :-1].clone(); shifted[..., 0] = decoder_start_token_id; shifted.masked_fill_(shifted == -100,
    // pad_token_id)
    dec_ids = plain(c, Shape{B, N}, DType::kI64, "decoder_input_ids (new_zeros)", Category::kActivations);
    if (N > 1) {
      T clone = plain(c, Shape{B, N - 1}, DType::kI64, "labels[..., :-1].clone()");
    }
    T eq = plain(c, Shape{B, N}, DType::kBool, "shifted == -100");
  }
  // decoder_outputs (and encoder_outputs) stay bound until forward returns: their hidden states with them
  const T dec_out = t5_stack(c, m, w, true, dec_ids, &enc, c.attention_mask);
  T seq = dec_out;
  // if self.config.tie_word_embeddings: sequence_output = sequence_output * (self.model_dim**-0.5)
  if (m.embed.tied) seq = mul_scalar(c, seq, "sequence_output * d_model**-0.5");
  ForwardOut out;
  out.logits = linear(c, seq, w.opt("lm_head.weight") ? w.p("lm_head.weight") : w.p("shared.weight"), nullptr, "lm_head");
  // loss_fct = CrossEntropyLoss(ignore_index=-100); loss = loss_fct(lm_logits.view(-1, lm_logits.size(-1)),
  // labels.view(-1))
  const uint64_t V = out.logits.shape().back();
  out.loss = cross_entropy(c, view(c, out.logits, Shape{B * N, V}), view(c, *labels, Shape{B * N}));
  return out;
}

}  // namespace trainmem::sim
