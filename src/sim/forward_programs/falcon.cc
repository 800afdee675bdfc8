// transformers' FalconForCausalLM (modeling_falcon.py, 5.x: read at zucchini-nlp/transformers@e241202, a fork
// of main), labels given, use_cache=False; under generate() (c.kv) the layers update the DynamicCache and the
// masks are built from generate()'s 2-D attention_mask. Three layer layouts (new_decoder_architecture: grouped kv heads and
// ln_attn/ln_mlp or one input_layernorm; multi_query + parallel_attn: falcon-7b; sequential: falcon-rw), rotary
// or ALiBi positions, FalconLinear's unfused matmul and bias.
// B=micro-batch T=seq C=hidden NH=heads KV=kv-heads D=head-dim S=key length F=ffn V=vocab
#include <fmt/format.h>

#include <algorithm>
#include <memory>

#include "../layers.h"
#include "hf_common.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace {

// Layer l's modules, looked up by their transformers names (transformer.h.{l}.{module}.weight / .bias).
struct Layer {
  const LoadedModel& w;
  uint64_t l;
  const T& weight(const char* module) const { return w.p(param_name("transformer.h.{}.{}.weight", l, module)); }
  const T* bias(const char* module) const { return w.opt(param_name("transformer.h.{}.{}.bias", l, module)); }
};

// What FalconModel makes once and hands every layer: the causal mask (null under SDPA without ALiBi), the
// ALiBi tensor (B * NH, 1, S) (null for rotary models) and the rotary cos/sin.
struct Positions {
  const T* mask = nullptr;
  const T* alibi = nullptr;
  Rotary rot;
};

bool quantized(const Ctx& c, const T& w) {
  const int32_t row = w->label.row;
  return w->is_param && row >= 0 && static_cast<size_t>(row) < c.quant.dims_by_row.size() &&
         c.quant.dims_by_row[static_cast<size_t>(row)].first != 0;
}

// FalconLinear.forward: `hidden_states = input @ self.weight.T; if self.bias is None: return hidden_states;
// return hidden_states + self.bias` ("we did not fuse matmul and bias during training"): the matmul folds the
// input to (B*T, in) and runs mm, then the bias add is a second op with its own output.
T falcon_linear(Ctx& c, const Layer& L, const char* name, const T& x, const char* what) {
  const T& weight = L.weight(name);
  const T* bias = L.bias(name);
  // bitsandbytes replaces every nn.Linear (FalconLinear is one) with its Linear4bit, whose forward is its own
  if (quantized(c, weight)) return linear(c, x, weight, bias, what);
  T h = linear(c, x, weight, nullptr, what);  // input @ self.weight.T
  if (!bias) return h;
  return add(c, h, *bias, "FalconLinear + self.bias");
}

struct Qkv {
  T q, k, v;
};

// FalconAttention._split_heads: (B, T, NH, D) query, key and value (views of fused_qkv, or copies).
Qkv split_heads(Ctx& c, const ModelSpec& m, const T& fused) {
  const uint64_t B = fused.shape()[0], Tn = fused.shape()[1], NH = m.attn.heads, D = m.attn.head_dim;
  switch (m.attn.falcon_qkv) {
    case FalconQkv::kGroups: {
      // qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
      // query = qkv[:, :, :, :-2]; key = qkv[:, :, :, [-2]]; value = qkv[:, :, :, [-1]]
      // key = torch.broadcast_to(key, query.shape); value = torch.broadcast_to(value, query.shape)
      // query, key, value = [x.flatten(2, 3) for x in (query, key, value)]
      const uint64_t KV = m.attn.kv_heads, n = NH / KV;
      const T qkv = view(c, fused, Shape{B, Tn, KV, n + 2, D});
      const T query = slice_dim(c, qkv, 3, 0, n);
      T key = index_list1(c, qkv, 3, "qkv[:, :, :, [-2]]");
      T value = index_list1(c, qkv, 3, "qkv[:, :, :, [-1]]");
      key = expand(c, key, query.shape());
      value = expand(c, value, query.shape());
      const Shape flat{B, Tn, NH, D};
      return Qkv{reshape(c, query, flat), reshape(c, key, flat), reshape(c, value, flat)};
    }
    case FalconQkv::kPerHead: {
      // fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
      // return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]
      const T qkv = view(c, fused, Shape{B, Tn, NH, 3, D});
      return Qkv{select_dim(c, qkv, 3), select_dim(c, qkv, 3), select_dim(c, qkv, 3)};
    }
    case FalconQkv::kMultiQuery: {
      // fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
      // return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]
      const T qkv = view(c, fused, Shape{B, Tn, NH + 2, D});
      return Qkv{slice_dim(c, qkv, 2, 0, NH), index_list1(c, qkv, 2, "fused_qkv[..., [-2], :]"),
                 index_list1(c, qkv, 2, "fused_qkv[..., [-1], :]")};
    }
    case FalconQkv::kNone: break;
  }
  throw Error("internal: a falcon model without a query_key_value layout");
}

// `a @ b` for (B, H, ...) operands where b may have one head (multi-query): torch.matmul expands the batch dims to
// the broadcast shape first (a copy when the strides do not allow merging them).
T bmatmul(Ctx& c, const T& a, const T& b, const char* what) {
  if (b.shape()[1] == a.shape()[1]) return matmul(c, a, b, what);
  Shape s = b.shape();
  s.d[1] = a.shape()[1];
  return matmul(c, a, expand(c, b, s), what);
}

struct AttnResult {
  T output;   // self.dense(...), (B, T, C)
  T weights;  // attention_scores / attention_probs (eager), returned with the output; empty under SDPA
};

// FalconAttention.forward (eager and sdpa). Its locals (fused_qkv, the scores before the softmax) stay bound
// until it returns.
AttnResult falcon_attention(Ctx& c, const ModelSpec& m, const Layer& L, const T& x, const Positions& pos) {
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], NH = m.attn.heads, D = m.attn.head_dim;
  // num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
  const uint64_t KVr = m.attn.falcon_qkv == FalconQkv::kGroups ? NH : m.attn.kv_heads;
  const T fused = falcon_linear(c, L, "self_attention.query_key_value", x, "self_attention.query_key_value");
  Qkv s = split_heads(c, m, fused);
  // query_layer = query_layer.transpose(1, 2).reshape(batch_size, self.num_heads, query_length, self.head_dim)
  // (key and value with num_kv_heads)
  T q = reshape(c, transpose(c, s.q, 1, 2), Shape{B, NH, Tn, D});
  T k = reshape(c, transpose(c, s.k, 1, 2), Shape{B, KVr, Tn, D});
  T v = reshape(c, transpose(c, s.v, 1, 2), Shape{B, KVr, Tn, D});
  s = Qkv{};
  const bool sdpa_impl = m.attn_impl == AttnImpl::kSdpa;
  AttnResult r;
  if (!pos.alibi) {
    // cos, sin = position_embeddings; query_layer, key_layer = apply_rotary_pos_emb(query_layer, key_layer, ...)
    q = apply_rotary(c, q, pos.rot);
    k = apply_rotary(c, k, pos.rot);
    kv_update(c, L.l, k, v);  // layer_past.update(key_layer, value_layer, self.layer_idx, cache_kwargs)
    T o;
    if (sdpa_impl) {
      // scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=is_causal):
      // no mask (AttentionMaskConverter._ignore_causal_mask_sdpa), is_causal = query_length > 1; one key head
      // (multi_query) is not GQA: SDPA broadcasts it in its math kernel
      o = sdpa(c, q, k, v, nullptr, 0.0, Tn > 1, /*enable_gqa=*/false);
    } else {
      // attention_scores = query_layer @ key_layer.transpose(-1, -2); attention_scores /= math.sqrt(self.head_dim)
      T scores = bmatmul(c, q, transpose(c, k, -1, -2), "attention_scores");
      scale_(c, scores, "DivBackward1");
      // attention_scores = F.softmax(attention_scores + attention_mask, dim=-1, dtype=hidden_states.dtype)
      // ("It is unclear why dropout is not applied here (while it is with alibi).")
      scores = softmax(c, add(c, scores, *pos.mask, "attention_scores + attention_mask"), x.dtype(),
                       "attention_scores softmax");
      o = bmatmul(c, scores, v, "attention_scores @ value_layer");
      r.weights = scores;
    }
    // attn_output.view(B, NH, T, D).permute(0, 2, 1, 3).reshape(B, T, NH * D); attn_output = self.dense(...)
    o = reshape(c, transpose(c, view(c, o, Shape{B, NH, Tn, D}), 1, 2), Shape{B, Tn, NH * D});
    r.output = falcon_linear(c, L, "self_attention.dense", o, "self_attention.dense");
    return r;
  }
  kv_update(c, L.l, k, v);
  const T mask = slice_dim(c, *pos.mask, 3, 0, k.shape()[2]);  // attention_mask[:, :, :, : key_layer.shape[-2]]
  const uint64_t S = k.shape()[2];
  if (sdpa_impl) {
    // scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=self.attention_dropout.p if
    // self.training else 0.0, is_causal=False (a mask is given))
    T o = sdpa(c, q, k, v, &mask, m.dropout.attn, false, /*enable_gqa=*/false);
    // attn_output.transpose(1, 2).reshape(batch_size, query_length, self.num_heads * self.head_dim)
    o = reshape(c, transpose(c, o, 1, 2), Shape{B, Tn, NH * D});
    r.output = falcon_linear(c, L, "self_attention.dense", o, "self_attention.dense");
    return r;
  }
  // matmul_result = query_layer @ key_layer.transpose(-1, -2)
  const T matmul_result = bmatmul(c, q, transpose(c, k, -1, -2), "matmul_result");
  // attention_scores = matmul_result.view(batch_size, self.num_heads, query_length, kv_length)
  T scores = view(c, matmul_result, Shape{B, NH, Tn, S});
  // if input_dtype == torch.float16 or input_dtype == torch.bfloat16: attention_scores = attention_scores.to(float32)
  if (scores.dtype() == DType::kF16 || scores.dtype() == DType::kBF16) {
    scores = to(c, scores, DType::kF32, "attention_scores.to(torch.float32)");
  }
  // attention_logits = attention_scores + alibi.view(batch_size, self.num_heads, 1, -1)
  T logits = add(c, scores, view(c, *pos.alibi, Shape{B, NH, 1, S}), "attention_scores + alibi");
  scale_(c, logits, "MulBackward1");  // attention_logits *= self.inv_norm_factor
  // attention_probs = F.softmax(attention_logits + attention_mask, dim=-1, dtype=hidden_states.dtype)
  T probs = softmax(c, add(c, logits, mask, "attention_logits + attention_mask"), x.dtype(), "attention_probs");
  probs = dropout(c, probs, m.dropout.attn, "attention_dropout");  // self.attention_dropout(attention_probs)
  // attn_output = (attention_probs_reshaped @ value_layer).flatten(0, 1); attn_output = self._merge_heads(...)
  T o = bmatmul(c, view(c, probs, Shape{B, NH, Tn, S}), v, "attention_probs @ value_layer");
  o = view(c, o, Shape{B * NH, Tn, D});
  // _merge_heads: x.view(B, NH, T, D).permute(0, 2, 1, 3).reshape(B, T, NH * D)
  o = reshape(c, transpose(c, view(c, o, Shape{B, NH, Tn, D}), 1, 2), Shape{B, Tn, NH * D});
  r.output = falcon_linear(c, L, "self_attention.dense", o, "self_attention.dense");
  r.weights = probs;
  return r;
}

// FalconMLP.forward: x = self.act(self.dense_h_to_4h(x)); x = self.dense_4h_to_h(x)
T falcon_mlp(Ctx& c, const ModelSpec& m, const Layer& L, const T& x) {
  T h = activation(c, m.mlp.act, falcon_linear(c, L, "mlp.dense_h_to_4h", x, "mlp.dense_h_to_4h"));
  return falcon_linear(c, L, "mlp.dense_4h_to_h", h, "mlp.dense_4h_to_h");
}

T norm(Ctx& c, const Layer& L, const char* name, const T& x) { return layer_norm(c, x, &L.weight(name), L.bias(name), name); }

// FalconDecoderLayer.forward; returns (output, attn_weights) as the Python does.
AttnResult falcon_layer(Ctx& c, const ModelSpec& m, const Layer& L, const T& hidden, const Positions& pos) {
  T residual = hidden;
  T attn_ln, mlp_ln;
  if (m.parallel_residual && m.norms_per_layer == 2) {
    attn_ln = norm(c, L, "ln_attn", hidden);  // new_decoder_architecture and num_ln_in_parallel_attn == 2
    mlp_ln = norm(c, L, "ln_mlp", hidden);
  } else {
    attn_ln = norm(c, L, "input_layernorm", hidden);
  }
  AttnResult a = falcon_attention(c, m, L, attn_ln, pos);
  if (!m.parallel_residual) {
    // residual = dropout_add(attention_output, residual, self.config.attention_dropout, training=self.training)
    residual = add(c, residual, dropout(c, a.output, m.dropout.attn, "dropout_add"), "residual + attention");
    mlp_ln = norm(c, L, "post_attention_layernorm", residual);
  } else if (!mlp_ln) {
    mlp_ln = attn_ln;  // mlp_layernorm_out = attention_layernorm_out
  }
  T mlp_out = falcon_mlp(c, m, L, mlp_ln);
  // if self.config.new_decoder_architecture or self.config.parallel_attn: mlp_output += attention_output
  if (m.parallel_residual) add_(c, mlp_out, a.output);
  // output = dropout_add(mlp_output, residual, self.config.hidden_dropout, training=self.training)
  T out = add(c, residual, dropout(c, mlp_out, m.dropout.resid, "dropout_add"), "residual + mlp");
  return AttnResult{out, a.weights};
}

// build_alibi_tensor(mask, self.num_heads, dtype=inputs_embeds.dtype) for the all-ones (B, S) mask: no tensor
// here requires grad. Returns (B * NH, 1, S) in `dt`.
T alibi_tensor(Ctx& c, uint64_t B, uint64_t S, uint64_t NH, DType dt) {
  auto t = [&](Shape s, DType d, const char* what) { return c.e.empty(s, d, Category::kActivations, c.L(what)); };
  uint64_t cp2 = 1;  // closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
  while (cp2 * 2 <= NH) cp2 *= 2;
  // base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
  T base = t(Shape{}, DType::kF32, "alibi base");
  T powers = t(Shape{cp2}, DType::kI32, "alibi powers");  // torch.arange(1, 1 + cp2, dtype=torch.int32)
  T slopes = t(Shape{cp2}, DType::kF32, "alibi slopes");        // torch.pow(base, powers)
  T extra_base, extra_powers;
  if (cp2 != NH) {
    const uint64_t rem = std::min(cp2, NH - cp2);  // num_remaining_heads
    extra_base = t(Shape{}, DType::kF32, "alibi extra_base");
    extra_powers = t(Shape{rem}, DType::kI32, "alibi extra_powers");  // torch.arange(1, 1 + 2 * rem, 2)
    T p = t(Shape{rem}, DType::kF32, "torch.pow(extra_base, extra_powers)");
    T cat = t(Shape{NH}, DType::kF32, "alibi slopes (cat)");  // torch.cat([slopes, torch.pow(...)], dim=0)
    p.reset();  // the call's list goes first, then the name is rebound
    slopes = std::move(cat);
  }
  // arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
  T arange;
  {
    T cs = t(Shape{B, S}, DType::kI64, "attention_mask.cumsum(-1)");
    T m1 = t(Shape{B, S}, DType::kI64, "cumsum - 1");
    cs.reset();
    arange = t(Shape{B, S}, DType::kI64, "arange_tensor");
  }
  // alibi = slopes[..., None].bfloat16() * arange_tensor
  T alibi;
  {
    T sb = t(Shape{NH, 1}, DType::kBF16, "slopes.bfloat16()");
    alibi = t(Shape{B, NH, S}, DType::kBF16, "alibi");
  }
  // return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)
  T out = dt == DType::kBF16 ? c.e.view(alibi, Shape{B * NH, 1, S}, Strides{static_cast<int64_t>(S), 1, 1})
                             : t(Shape{B * NH, 1, S}, dt, "alibi.to(dtype)");
  // the frame's locals go in their order: base, powers, slopes, extra_base, extra_powers, arange_tensor, alibi
  base.reset();
  powers.reset();
  slopes.reset();
  extra_base.reset();
  extra_powers.reset();
  arange.reset();
  alibi.reset();
  return out;
}

// FalconModel._update_causal_mask: the eager (or ALiBi) mask, (B, 1, T, S) or with ALiBi folded in (B, NH, T, S);
// null under SDPA without ALiBi (_ignore_causal_mask_sdpa). `padding`: generate() passed its 2-D all-ones
// attention_mask (B, S), which the mask is built from (training and a plain inference pass give none).
T causal_mask(Ctx& c, const ModelSpec& m, uint64_t B, uint64_t Tn, uint64_t S, DType dt, const T* alibi, bool padding) {
  auto t = [&](Shape s, DType d, const char* what) { return c.e.empty(s, d, Category::kActivations, c.L(what)); };
  if (m.attn_impl == AttnImpl::kSdpa && !alibi) {
    // AttentionMaskConverter._ignore_causal_mask_sdpa: no mask, or `torch.all(attention_mask == 1)` with
    // query_length == 1 or key_value_length == query_length (every forward of generate()): True
    if (padding) {
      T eq = t(Shape{B, S}, DType::kBool, "attention_mask == 1");
      T all = t(Shape{}, DType::kBool, "torch.all(...)");
      eq.reset();
    }
    return T();
  }
  // _prepare_4d_causal_attention_mask_with_cache_position (target_length = past_seen_tokens + sequence_length):
  // causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
  T cm = t(Shape{Tn, S}, dt, "causal_mask (torch.full)");
  if (Tn != 1) cm = t(Shape{Tn, S}, dt, "causal_mask (torch.triu)");  // torch.triu(causal_mask, diagonal=1)
  {
    // causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)   (in place)
    T ar = t(Shape{S}, DType::kI64, "torch.arange(target_length)");
    T gt = t(Shape{Tn, S}, DType::kBool, "arange > cache_position");
    ar.reset();
  }
  // causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
  T mask = c.e.view(cm, Shape{B, 1, Tn, S}, Strides{0, 0, static_cast<int64_t>(S), 1});
  cm.reset();
  if (padding) {
    // causal_mask = causal_mask.clone(); padding_mask = causal_mask[:, :, :, :mask_length] +
    // attention_mask[:, None, None, :]; padding_mask = padding_mask == 0;
    // causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
    mask = t(Shape{B, 1, Tn, S}, dt, "causal_mask.clone()");
    T pad = t(Shape{B, 1, Tn, S}, dt, "causal_mask + attention_mask");
    pad = t(Shape{B, 1, Tn, S}, DType::kBool, "padding_mask == 0");
    { T filled = t(Shape{B, 1, Tn, S}, dt, "masked_fill(padding_mask, min_dtype)"); }  // copied in, then dropped
  }  // padding_mask goes when the function returns
  if (!alibi) return mask;
  // alibi = alibi.reshape(batch_size, -1, *alibi.shape[1:])
  // causal_mask = torch.masked_fill(alibi / math.sqrt(self.config.hidden_size // self.num_heads),
  //                                 causal_mask < -1, min_dtype)
  const uint64_t NH = m.attn.heads;
  T d = t(Shape{B, NH, 1, S}, (*alibi).dtype(), "alibi / sqrt(head_dim)");
  T lt = t(Shape{B, 1, Tn, S}, DType::kBool, "causal_mask < -1");
  T filled = t(Shape{B, NH, Tn, S}, (*alibi).dtype(), "causal_mask (alibi)");
  d.reset();  // the call's arguments, in order, then the old causal_mask when the name is rebound
  lt.reset();
  mask.reset();
  if (padding && m.attn_impl == AttnImpl::kSdpa) {
    // `attention_mask is not None and attention_mask.device.type in ["cuda", ...]`:
    // AttentionMaskConverter._unmask_unattended(causal_mask, min_dtype) =
    // expanded_mask.mul(~torch.all(expanded_mask == min_dtype, dim=-1, keepdim=True))
    T inv;
    {
      T eq = t(Shape{B, NH, Tn, S}, DType::kBool, "causal_mask == min_dtype");
      T all = t(Shape{B, NH, Tn, 1}, DType::kBool, "torch.all(..., dim=-1, keepdim=True)");
      eq.reset();
      inv = t(Shape{B, NH, Tn, 1}, DType::kBool, "~torch.all(...)");
    }
    filled = t(Shape{B, NH, Tn, S}, (*alibi).dtype(), "causal_mask (_unmask_unattended)");
  }
  return filled;
}

// The refusals: what this program does not simulate, and why.
void check_supported(const Ctx& c, const ModelSpec& m) {
  if (c.checkpoint.mode != CheckpointPolicy::kNone && (m.attn.alibi || m.attn_impl == AttnImpl::kEager)) {
    throw Error(
        "--checkpointing with falcon is simulated with --attention sdpa and rotary positions only: the layer takes "
        "the ALiBi tensor as a keyword argument and returns its eager attention weights, which trainmem's checkpoint "
        "does not carry");
  }
  const bool lora = std::any_of(c.lora.by_base_row.begin(), c.lora.by_base_row.end(),
                                [](const std::pair<T, T>& ab) { return static_cast<bool>(ab.first); });
  if (lora && m.attn.qkv_bias) {
    throw Error(
        "--lora with a falcon \"bias\": true is not simulated: PEFT's lora.Linear adds the adapters after "
        "FalconLinear's separate `+ self.bias`, and trainmem's LoRA path runs inside the matmul before it");
  }
}

T falcon_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  c.layer = -1;
  // inputs_embeds = self.word_embeddings(input_ids): bound until forward returns
  const T inputs_embeds = embedding(c, w.p("transformer.word_embeddings.weight"), ids, "word_embeddings");
  const DType dt = inputs_embeds.dtype();
  // generate() passes its 2-D attention_mask (B, past + T), all ones, and (B, T) position_ids (c.position_ids)
  const bool generating = c.kv != nullptr;
  const uint64_t S = checked_add(generating ? c.kv->past : 0, Tn, "past + seq_length");
  T ones, alibi;
  if (m.attn.alibi) {
    // mask = torch.ones((batch_size, seq_length + past_key_values_length), dtype=torch.long) if attention_mask
    // is None else attention_mask
    if (!generating) ones = c.e.empty(Shape{B, S}, DType::kI64, Category::kActivations, c.L("alibi mask (torch.ones)"));
    alibi = alibi_tensor(c, B, S, m.attn.heads, dt);
  }
  // cache_position = torch.arange(past, past + seq_length); position_ids = cache_position.unsqueeze(0) unless
  // given (generate()'s)
  const T cache_position =
      generating ? c.e.empty(Shape{Tn}, DType::kI64, Category::kActivations, c.L("cache_position")) : T();
  const T position_ids = model_position_ids(c, Tn);
  const T mask = causal_mask(c, m, B, Tn, S, dt, alibi ? &alibi : nullptr, generating);
  // position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids), ALiBi models too
  Positions pos;
  pos.rot = rotary_embedding(c, w.buf("transformer.rotary_emb.inv_freq"), Tn, dt);
  pos.mask = mask ? &mask : nullptr;
  pos.alibi = alibi ? &alibi : nullptr;
  // outputs = block(...); hidden_states = outputs[0]: `outputs` keeps the layer's attention weights until the next
  // block returns (they matter without grad, where no softmax saves them)
  auto held = std::make_shared<T>();
  // (the mask and cos/sin ride in the layer's arguments; check_supported refuses a checkpoint with ALiBi)
  const T* alibi_arg = pos.alibi;
  T hidden = run_layers(c, m.layers, inputs_embeds, LayerArgs{mask, pos.rot.cos, pos.rot.sin, position_ids},
                        [&c, &m, &w, alibi_arg, held](uint64_t l, T h, const LayerArgs& a) {
                          const Positions p{a.mask ? &a.mask : nullptr, alibi_arg, Rotary{a.cos, a.sin}};
                          AttnResult r = falcon_layer(c, m, Layer{w, l}, h, p);
                          *held = std::move(r.weights);
                          return r.output;
                        });
  hidden = layer_norm(c, hidden, &w.p("transformer.ln_f.weight"), &w.p("transformer.ln_f.bias"), "ln_f");
  held->reset();
  return hidden;
}

}  // namespace

ForwardOut falcon_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  check_supported(c, m);
  T hidden = falcon_model(c, m, w, ids);
  if (c.loss_chunks) {
    return chunked_causal_lm(c, w, std::move(hidden), "lm_head.weight", "transformer.word_embeddings.weight",
                             "lm_head", labels);
  }
  // lm_logits = self.lm_head(hidden_states[:, slice_indices, :]); loss = self.loss_function(lm_logits, labels, ...)
  return causal_lm_output(
      c, lm_head_logits(c, w, hidden, "lm_head.weight", "transformer.word_embeddings.weight", "lm_head"), labels);
}

}  // namespace trainmem::sim
