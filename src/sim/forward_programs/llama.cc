// transformers' LlamaForCausalLM and relatives (modeling_llama.py and the files generated from it, 5.x):
// llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral (its sparse MoE block: moe.cc). Labels given,
// use_cache=False. deepseek_v3 (modular_deepseek_v3.py @000c33f: LlamaDecoderLayer / LlamaModel /
// LlamaForCausalLM with its own attention, mla_attention here, and MoE block, moe.cc).
// B=micro-batch T=seq C=hidden H=heads KV=kv-heads D=head-dim F=ffn V=vocab E=experts
#include <fmt/format.h>

#include "../layers.h"
#include "../sp_ops.h"
#include "../tp_ops.h"
#include "hf_common.h"
#include "trainmem/error.h"
#include "trainmem/fsdp.h"

namespace trainmem::sim {

namespace {

bool is_gemma(const ModelSpec& m) {
  return m.model_type == "gemma" || m.model_type == "gemma2" || m.model_type == "gemma3_text";
}
// Gemma3Attention normalizes q and k after `.transpose(1, 2)` (on the (B, H, T, D) view); Qwen3 before it.
bool qk_norm_after_transpose(const ModelSpec& m) { return m.model_type == "gemma3_text"; }

// LlamaRMSNorm: input_dtype = h.dtype; h = h.to(float32); variance = h.pow(2).mean(-1, keepdim=True);
// h = h * torch.rsqrt(variance + eps); return weight * h.to(input_dtype).
// GemmaRMSNorm: output = x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps);
// output = output * (1.0 + weight.float()); return output.type_as(x). Gemma3RMSNorm: output = self._norm(x.float())
// with _norm(x) = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps); output = output * (1.0 +
// self.weight.float()); return output.type_as(x): the same ops.
T rms_norm(Ctx& c, const ModelSpec& m, const T& x, const T& weight, const char* what) {
  const DType in = x.dtype();
  T h = to(c, x, DType::kF32, "rms_norm h.to(float32)");
  T r;
  // LlamaRMSNorm binds `variance`, which lives until forward returns; Gemma's _norm computes it inline
  T var = mean_last(c, pow_scalar(c, h, "rms_norm h.pow(2)"), "rms_norm variance");
  r = rsqrt(c, add_scalar(c, var, "rms_norm variance + eps"), "rms_norm rsqrt");
  if (is_gemma(m)) var.reset();
  h = mul(c, h, r, "rms_norm h * rsqrt");
  r.reset();
  if (is_gemma(m)) {
    T wf = to(c, weight, DType::kF32, "weight.float()");
    T one = add_scalar(c, wf, "1.0 + weight");
    wf.reset();
    h = mul(c, h, one, what);
    return to(c, h, in, "rms_norm type_as(x)");
  }
  return mul(c, weight, to(c, h, in, "rms_norm h.to(input_dtype)"), what);
}

// A decoder layer's norm: Starcoder2's nn.LayerNorm(hidden_size, eps=config.norm_epsilon) (weight and bias); every
// other Llama-shaped model's RMSNorm.
T block_norm(Ctx& c, const ModelSpec& m, const T& x, const T& weight, const T* bias, const char* what) {
  if (m.norm.kind == NormKind::kLayerNorm) return layer_norm(c, x, &weight, bias, what);
  return rms_norm(c, m, x, weight, what);
}

struct Layer {
  const LoadedModel& w;
  uint64_t l;
  ParamName n(const char* s) const { return param_name("model.layers.{}.{}", l, s); }
  // s: a string literal (the parameter's row is remembered by its address, LoadedModel::layer_param)
  const T& p(const char* s) const { return *w.layer_param(l, s, true, [&] { return n(s); }); }
  const T* o(const char* s) const { return w.layer_param(l, s, false, [&] { return n(s); }); }
  const T& buf(const char* s) const { return w.buf(n(s)); }
};

// DeepseekV3Attention.forward (modular_deepseek_v3.py @000c33f), multi-head latent attention:
//   query_shape = (batch_size, seq_length, -1, self.qk_head_dim)
//   key_shape = (batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)
//   if self.q_lora_rank is None: q_states = self.q_proj(hidden_states)
//   else: q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
//   q_states = q_states.view(query_shape).transpose(1, 2)
//   q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
//   compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
//   k_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
//   k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(key_shape).transpose(1, 2)
//   k_pass, value_states = torch.split(k_pass, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
//   k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
//   cos, sin = position_embeddings
//   if self.config.rope_interleave: q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
//   else: q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
//   k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
//   query_states = torch.cat((q_pass, q_rot), dim=-1)
//   key_states = torch.cat((k_pass, k_rot), dim=-1)
//   if past_key_values is not None: key_states, value_states = past_key_values.update(...)
//   (flash_attention_2 only: value_states padded to qk_head_dim, and the output sliced back: not modelled, no
//   --attention flash)
//   attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, ...)
//   attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous(); self.o_proj(attn_output)
// Every local (q_pass keeps q_states alive, compressed_kv, k_pass and value_states the kv_b_proj output) lives
// until the method returns. The softmax scale (qk_head_dim ** -0.5, times yarn's mscale**2) is a value.
AttnOut mla_attention(Ctx& c, const ModelSpec& m, const Layer& L, const T& x, const Rotary& rot, const T* mask) {
  const auto& a = m.attn.mla;
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], H = m.attn.heads, QK = m.attn.head_dim;
  const uint64_t R = a.qk_rope, NOPE = a.qk_nope, V = a.v_head_dim;
  T q_states;
  if (a.q_lora_rank == 0) {
    q_states = linear(c, x, L.p("self_attn.q_proj.weight"), nullptr, "attn.q_proj");
  } else {
    T qa = linear(c, x, L.p("self_attn.q_a_proj.weight"), L.o("self_attn.q_a_proj.bias"), "attn.q_a_proj");
    qa = rms_norm(c, m, qa, L.p("self_attn.q_a_layernorm.weight"), "attn.q_a_layernorm");
    q_states = linear(c, qa, L.p("self_attn.q_b_proj.weight"), nullptr, "attn.q_b_proj");
  }
  q_states = transpose(c, view(c, q_states, Shape{B, Tn, H, QK}), 1, 2);
  T q_pass, q_rot;
  {
    std::vector<T> parts = split_last(c, q_states, {NOPE, R});
    q_pass = std::move(parts[0]);
    q_rot = std::move(parts[1]);
  }
  const T compressed_kv = linear(c, x, L.p("self_attn.kv_a_proj_with_mqa.weight"),
                                 L.o("self_attn.kv_a_proj_with_mqa.bias"), "attn.kv_a_proj_with_mqa");
  T k_pass, k_rot;
  {
    std::vector<T> parts = split_last(c, compressed_kv, {a.kv_lora_rank, R});
    k_pass = std::move(parts[0]);
    k_rot = std::move(parts[1]);
  }
  k_pass = rms_norm(c, m, k_pass, L.p("self_attn.kv_a_layernorm.weight"), "attn.kv_a_layernorm");
  k_pass = linear(c, k_pass, L.p("self_attn.kv_b_proj.weight"), nullptr, "attn.kv_b_proj");
  k_pass = transpose(c, view(c, k_pass, Shape{B, Tn, H, NOPE + V}), 1, 2);
  T value_states;
  {
    std::vector<T> parts = split_last(c, k_pass, {NOPE, V});
    k_pass = std::move(parts[0]);
    value_states = std::move(parts[1]);
  }
  k_rot = view(c, k_rot, Shape{B, 1, Tn, R});
  if (a.interleave) {
    // apply_rotary_pos_emb_interleave: q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d) (a
    // copy), k the same, then LlamaRotaryEmbedding's q_embed / k_embed; the copies are the function's locals
    auto deinterleave = [&](const T& t) {
      const Shape& s = t.shape();
      return reshape(c, transpose(c, view(c, t, Shape{s[0], s[1], s[2], R / 2, 2}), 4, 3), s);
    };
    T qi = deinterleave(q_rot);
    T ki = deinterleave(k_rot);
    q_rot = apply_rotary(c, qi, rot);
    k_rot = apply_rotary(c, ki, rot);
  } else {
    T q_embed = apply_rotary(c, q_rot, rot);
    T k_embed = apply_rotary(c, k_rot, rot);
    q_rot = std::move(q_embed);
    k_rot = std::move(k_embed);
  }
  k_rot = expand(c, k_rot, Shape{B, H, Tn, R});
  T query_states = cat_last(c, {q_pass, q_rot}, "torch.cat((q_pass, q_rot))");
  T key_states = cat_last(c, {k_pass, k_rot}, "torch.cat((k_pass, k_rot))");
  kv_update(c, L.l, key_states, value_states);  // past_key_values.update(key_states, value_states, ...)
  AttnOut out;
  if (m.attn_impl == AttnImpl::kEager) {
    out = eager_attention(c, query_states, key_states, value_states, mask, 1, m.dropout.attn, "attn * scaling", 0.0);
  } else {
    out.output = sdpa_attention(c, query_states, key_states, value_states, 1, m.dropout.attn);
  }
  out.output = contiguous(c, reshape(c, out.output, Shape{B, Tn, H * V}), "attn output contiguous");
  out.output = linear(c, out.output, L.p("self_attn.o_proj.weight"), L.o("self_attn.o_proj.bias"), "attn.o_proj");
  return out;
}

// A RowwiseParallel linear (tensor_parallel.py 5.x): _prepare_input_fn moves the bias aside (mod._bias = mod.bias;
// mod.bias = None), so F.linear runs without it on the rank's input shard; _prepare_output_fn:
// outputs = all_reduce_forward(outputs) (a clone, all-reduced), then `outputs = outputs + mod._bias` when biased.
T rowwise_linear(Ctx& c, const T& x, const T& w, const T* bias, const char* what) {
  T partial = linear(c, x, w, nullptr, what);
  T out = tp_all_reduce_forward(c, partial, "tp all_reduce_forward clone");
  partial.reset();
  if (bias) out = add(c, out, *bias, "rowwise outputs + _bias");
  return out;
}

AttnOut attention(Ctx& c, const ModelSpec& m, const Layer& L, const T& x, const Rotary& rot, const T* mask) {
  if (m.attn.mla.kv_lora_rank > 0) return mla_attention(c, m, L, x, rot, mask);
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], H = m.attn.heads, KV = m.attn.kv_heads, D = m.attn.head_dim;
  const Shape qs{B, Tn, H, D}, kvs{B, Tn, KV, D};
  T q, k, v;
  if (m.attn.fused_qkv) {
    // Phi-3: qkv = self.qkv_proj(x); query = qkv[..., :H*D]; key = ...; value = ... (views)
    T qkv = linear(c, x, L.p("self_attn.qkv_proj.weight"), nullptr, "attn.qkv_proj");
    q = transpose(c, view(c, slice_last(c, qkv, 0, H * D), qs), 1, 2);
    k = transpose(c, view(c, slice_last(c, qkv, H * D, (H + KV) * D), kvs), 1, 2);
    v = transpose(c, view(c, slice_last(c, qkv, (H + KV) * D, (H + 2 * KV) * D), kvs), 1, 2);
  } else {
    const bool norm_before = m.attn.qk_norm && !qk_norm_after_transpose(m);
    // Under tensor parallelism (tp.h) q/k/v are colwise: each module's pre-hook (ColwiseParallel._prepare_input_fn)
    // passes all_reduce_backward(input), a view of x whose backward all-reduces a clone of its gradient
    // Under sequence parallelism (sp.h) x is PrepareModuleInput's gathered Replicate DTensor: torch's
    // ColwiseParallel._prepare_input_fn finds it in its desired layout and adds nothing
    auto colwise_in = [&]() { return m.tp > 1 && !m.sp ? tp_all_reduce_backward(c, x) : x; };
    q = view(c, linear(c, colwise_in(), L.p("self_attn.q_proj.weight"), L.o("self_attn.q_proj.bias"), "attn.q_proj"), qs);
    if (norm_before) q = rms_norm(c, m, q, L.p("self_attn.q_norm.weight"), "attn.q_norm");
    q = transpose(c, q, 1, 2);
    k = view(c, linear(c, colwise_in(), L.p("self_attn.k_proj.weight"), L.o("self_attn.k_proj.bias"), "attn.k_proj"), kvs);
    if (norm_before) k = rms_norm(c, m, k, L.p("self_attn.k_norm.weight"), "attn.k_norm");
    k = transpose(c, k, 1, 2);
    v = transpose(c, view(c, linear(c, colwise_in(), L.p("self_attn.v_proj.weight"), L.o("self_attn.v_proj.bias"), "attn.v_proj"), kvs), 1, 2);
    if (m.attn.qk_norm && !norm_before) {
      // Gemma3Attention: query_states = self.q_norm(query_states); key_states = self.k_norm(key_states), after
      // the three projections are viewed and transposed
      q = rms_norm(c, m, q, L.p("self_attn.q_norm.weight"), "attn.q_norm");
      k = rms_norm(c, m, k, L.p("self_attn.k_norm.weight"), "attn.k_norm");
    }
  }
  std::tie(q, k) = apply_rotary_qk(c, q, k, rot, m.model_type == "phi3" ? RotaryCat::kEachAlways : RotaryCat::kPartialPairs);
  kv_update(c, L.l, k, v);  // past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)
  AttnOut a;
  if (m.attn_impl == AttnImpl::kEager) {
    a = eager_attention(c, q, k, v, mask, H / KV, m.dropout.attn, "attn * scaling", m.attn.softcap);
  } else {
    a.output = sdpa_attention(c, q, k, v, H / KV, m.dropout.attn, mask);
  }
  // query_states, key_states and value_states are the forward's locals: they live until it returns, after o_proj,
  // and CPython frees them then in that order (what autograd saved lives on regardless). Under no_grad
  // (inference, a checkpointed forward) that keeps q alive across o_proj: the H100 trace of
  // validate/measured/open/*_hf_gen_llama3_* frees the sdpa output, the rotated query and the layer's normed
  // input together after o_proj.
  auto drop_qkv = [&] {
    q.reset();
    k.reset();
    v.reset();
  };
  // attn_output.reshape(*input_shape, -1).contiguous(); self.o_proj(attn_output)
  a.output = contiguous(c, reshape(c, a.output, Shape{B, Tn, H * D}), "attn output contiguous");
  if (m.sp) {
    // RowwiseParallel(output_layouts=Shard(1)): the local product is Partial, reduce-scattered over the sequence
    // (sp_ops.h); the partial sums die with the output hook's frame. sp_check refuses a biased o_proj.
    T partial = linear(c, a.output, L.p("self_attn.o_proj.weight"), nullptr, "attn.o_proj");
    a.output = sp_reduce_scatter_seq(c, partial, m.tp, "attn.o_proj reduce_scatter (Partial -> Shard(1))");
    drop_qkv();
    return a;
  }
  if (m.tp > 1) {
    a.output = rowwise_linear(c, a.output, L.p("self_attn.o_proj.weight"), L.o("self_attn.o_proj.bias"), "attn.o_proj");
    drop_qkv();
    return a;
  }
  a.output = linear(c, a.output, L.p("self_attn.o_proj.weight"), L.o("self_attn.o_proj.bias"), "attn.o_proj");
  drop_qkv();
  return a;
}

T mlp(Ctx& c, const ModelSpec& m, const Layer& L, const T& x) {
  if (m.mlp.fused_gate_up) {
    // Phi3MLP: up_states = gate_up_proj(x); gate, up_states = up_states.chunk(2, -1);
    // up_states = up_states * act(gate); return down_proj(up_states)
    const uint64_t F = m.mlp.ffn;
    T up;
    {
      std::vector<T> parts = split_last(c, linear(c, x, L.p("mlp.gate_up_proj.weight"), nullptr, "mlp.gate_up_proj"), {F, F});
      up = mul(c, parts[1], activation(c, m.mlp.act, parts[0]), "mlp up * act(gate)");
    }
    return linear(c, up, L.p("mlp.down_proj.weight"), nullptr, "mlp.down_proj");
  }
  if (!m.mlp.gated) {
    // Starcoder2MLP: hidden_states = self.c_fc(hidden_states); self.act(...); self.c_proj(...); then
    // nn.functional.dropout(hidden_states, p=self.residual_dropout) (the layer's resid_mlp_dropout below)
    T h = linear(c, x, L.p("mlp.c_fc.weight"), L.o("mlp.c_fc.bias"), "mlp.c_fc");
    h = activation(c, m.mlp.act, h);
    return linear(c, h, L.p("mlp.c_proj.weight"), L.o("mlp.c_proj.bias"), "mlp.c_proj");
  }
  // LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); under tensor parallelism gate/up are colwise (each
  // input through its pre-hook's all_reduce_backward) and down rowwise (tp.h)
  auto colwise_in = [&]() { return m.tp > 1 && !m.sp ? tp_all_reduce_backward(c, x) : x; };
  T h;
  {
    T a = activation(c, m.mlp.act, linear(c, colwise_in(), L.p("mlp.gate_proj.weight"), L.o("mlp.gate_proj.bias"), "mlp.gate_proj"));
    T u = linear(c, colwise_in(), L.p("mlp.up_proj.weight"), L.o("mlp.up_proj.bias"), "mlp.up_proj");
    h = mul(c, a, u, "mlp act(gate) * up");
  }
  if (m.sp) {  // RowwiseParallel(output_layouts=Shard(1)), as o_proj (attention above)
    T partial = linear(c, h, L.p("mlp.down_proj.weight"), nullptr, "mlp.down_proj");
    h.reset();
    return sp_reduce_scatter_seq(c, partial, m.tp, "mlp.down_proj reduce_scatter (Partial -> Shard(1))");
  }
  if (m.tp > 1) return rowwise_linear(c, h, L.p("mlp.down_proj.weight"), L.o("mlp.down_proj.bias"), "mlp.down_proj");
  return linear(c, h, L.p("mlp.down_proj.weight"), L.o("mlp.down_proj.bias"), "mlp.down_proj");
}

T decoder_layer(Ctx& c, const ModelSpec& m, const Layer& L, T hidden, const Rotary& rot, const T* mask) {
  const bool sandwich = m.norms_per_layer == 4;  // Gemma2, Gemma3
  T residual = hidden;
  hidden = block_norm(c, m, hidden, L.p("input_layernorm.weight"), L.o("input_layernorm.bias"), "input_layernorm");
  // `hidden_states, _ = self.self_attn(...)`: `_` keeps the attention weights (eager) bound until the layer
  // returns; under no_grad (a reentrant checkpoint's first forward) nothing else keeps them
  AttnOut a;
  if (m.sp) {
    // sequence parallelism (sp.h): input_layernorm ran on the rank's (B, T/tp, C) (SequenceParallel); self_attn's
    // PrepareModuleInput all-gathers hidden_states to Replicate (B, T, C), which q/k/v save; the layer's
    // `hidden_states` keeps the norm's shard until the attention returns
    T gathered = sp_all_gather_seq(c, hidden, m.tp, "self_attn PrepareModuleInput all_gather (Shard(1) -> Replicate)");
    a = attention(c, m, L, gathered, rot, mask);
  } else {
    a = attention(c, m, L, hidden, rot, mask);
  }
  hidden = std::move(a.output);
  if (sandwich) hidden = rms_norm(c, m, hidden, L.p("post_attention_layernorm.weight"), "post_attention_layernorm");
  hidden = add(c, residual, dropout(c, hidden, m.dropout.resid, "resid_attn_dropout"), "residual + attn");
  residual = hidden;
  hidden = block_norm(c, m, hidden, L.p(sandwich ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"),
                      sandwich ? nullptr : L.o("post_attention_layernorm.bias"),
                      sandwich ? "pre_feedforward_layernorm" : "post_attention_layernorm");
  if (is_moe_layer(m, L.l) && m.model_type == "deepseek_v3") {
    // DeepseekV3DecoderLayer (LlamaDecoderLayer's forward): hidden_states = self.mlp(hidden_states), a
    // DeepseekV3MoE from layer first_k_dense_replace on (moe.cc)
    const DeepseekMoeParams p{L.p("mlp.gate.weight"), L.buf("mlp.gate.e_score_correction_bias"),
                              L.p("mlp.experts.gate_up_proj"), L.p("mlp.experts.down_proj"),
                              L.p("mlp.shared_experts.gate_proj.weight"), L.p("mlp.shared_experts.up_proj.weight"),
                              L.p("mlp.shared_experts.down_proj.weight")};
    hidden = deepseek_moe_block(c, m, p, hidden);
  } else if (is_moe_layer(m, L.l)) {
    // MixtralDecoderLayer / Qwen2MoeDecoderLayer: hidden_states = self.mlp(hidden_states), a sparse MoE block
    // (moe.cc); qwen2_moe's shared expert is a LlamaMLP-shaped module
    const SharedExpert shared{L.o("mlp.shared_expert.gate_proj.weight"), L.o("mlp.shared_expert.up_proj.weight"),
                              L.o("mlp.shared_expert.down_proj.weight"), L.o("mlp.shared_expert_gate.weight")};
    hidden = sparse_moe_block(c, m, MoeParams{L.p("mlp.gate.weight"), L.p("mlp.experts.gate_up_proj"),
                                              L.p("mlp.experts.down_proj"), shared}, hidden);
  } else if (m.sp) {
    // mlp's PrepareModuleInput(Shard(1) -> Replicate): gate_proj and up_proj share the gathered (B, T, C)
    T gathered = sp_all_gather_seq(c, hidden, m.tp, "mlp PrepareModuleInput all_gather (Shard(1) -> Replicate)");
    hidden = mlp(c, m, L, gathered);
  } else {
    hidden = mlp(c, m, L, hidden);
  }
  if (sandwich) hidden = rms_norm(c, m, hidden, L.p("post_feedforward_layernorm.weight"), "post_feedforward_layernorm");
  return add(c, residual, dropout(c, hidden, m.dropout.resid, "resid_mlp_dropout"), "residual + mlp");
}

// Gemma3TextModel.forward (5.x) from the masks on: causal_mask_mapping = {"full_attention":
// create_causal_mask(...), "sliding_attention": create_sliding_window_causal_mask(...)} (both made, for eager
// each a (B, 1, T, T) mask in the embeddings' dtype; sdpa runs is_causal without one on the full-attention layers,
// and on the sliding ones until the keys reach the window); position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type) for each
// layer type; then decoder_layer(hidden_states, attention_mask=causal_mask_mapping[layer_types[i]],
// position_embeddings=position_embeddings[layer_types[i]], position_ids=position_ids, ...).
T gemma3_text_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, T inputs_embeds, const T& position_ids) {
  const uint64_t B = inputs_embeds.shape()[0], Tn = inputs_embeds.shape()[1];
  T full_mask, sliding_mask;
  if (m.attn_impl == AttnImpl::kEager) {
    full_mask = eager_mask(c, B, Tn, inputs_embeds.dtype());
    sliding_mask = eager_mask(c, B, Tn, inputs_embeds.dtype());
  } else if (m.attn.sliding_window > 0 && (c.kv ? c.kv->past : 0) + Tn >= m.attn.sliding_window) {
    // SDPA: create_sliding_window_causal_mask materializes the sliding layers' bool mask once kv_length reaches
    // sliding_window (_ignore_causal_mask_sdpa skips it only below), as for Mistral (gemma3_text_model's caller);
    // the full-attention layers keep is_causal. The H100 trace of validate/measured/open/ (whole Gemma-3 1B,
    // window 512, T = 2048) shows its four (T, T) bool tensors right after the embeddings.
    sliding_mask = sdpa_sliding_mask(c, B, Tn, m.attn.sliding_window);
  }
  T hidden = inputs_embeds;
  // set(config.layer_types): taken in order of first use (the tensor table's order)
  Rotary sliding_rot, full_rot;
  bool sliding_done = false, full_done = false;
  for (bool sliding : m.attn.sliding_layers) {
    bool& done = sliding ? sliding_done : full_done;
    if (done) continue;
    done = true;
    (sliding ? sliding_rot : full_rot) =
        rotary_embedding(c, w.buf(sliding ? "model.rotary_emb.sliding_attention_inv_freq" : "model.rotary_emb.full_attention_inv_freq"),
                         Tn, hidden.dtype());
  }
  std::vector<LayerArgs> args;
  for (bool sliding : m.attn.sliding_layers) {
    args.push_back(sliding ? LayerArgs{sliding_mask, sliding_rot.cos, sliding_rot.sin, position_ids}
                           : LayerArgs{full_mask, full_rot.cos, full_rot.sin, position_ids});
  }
  hidden = run_layers(c, m.layers, std::move(hidden), args, [&](uint64_t l, T h, const LayerArgs& a) {
    return decoder_layer(c, m, Layer{w, l}, h, Rotary{a.cos, a.sin}, a.mask ? &a.mask : nullptr);
  });
  hidden = fsdp_pre_forward(c, kFsdpUnitTail, std::move(hidden));  // FSDP2: the tail unit starts at the final norm
  return block_norm(c, m, hidden, w.p("model.norm.weight"), w.opt("model.norm.bias"), "norm");
}

// LlamaModel.forward: returns the final hidden states; its locals (embeddings, mask, cos/sin) die with it.
T llama_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  // a later pipeline stage (Ctx::pp) takes its received activations (B, T, C) in place of the embeddings
  const T& shaped = c.pp.first ? ids : *c.pp.input;
  // (under sequence parallelism a later stage receives the rank's (B, T/tp, C) shard of the residual stream; the
  // sequence is still T: the backend's forward passes position_ids = arange(T), sp.h)
  const uint64_t B = shaped.shape()[0];
  const uint64_t Tn = !c.pp.first && m.sp ? checked_mul(shaped.shape()[1], m.tp, "sequence") : shaped.shape()[1];
  c.layer = -1;
  if (c.pp.first) (void)fsdp_pre_forward(c, kFsdpUnitEmbed, T());  // FSDP2: the embedding's unit (its input ids need no grad)
  T rs_pending;  // sequence parallelism: the embedding's reduce-scatter input, kept by its work until the first norm
  T inputs_embeds = !c.pp.first ? *c.pp.input
                    : m.sp ? sp_vocab_embedding(c, w.p("model.embed_tokens.weight"), ids, m.tp, "embed_tokens (this rank's V/tp)", rs_pending)
                           : embedding(c, w.p("model.embed_tokens.weight"), ids, "embed_tokens");
  if (c.pp.first && m.embed.scaled_by_sqrt_hidden) {
    // GemmaTextScaledWordEmbedding: super().forward(ids) * self.embed_scale.to(self.weight.dtype)
    T scale = to(c, w.buf("model.embed_tokens.embed_scale"), w.p("model.embed_tokens.weight").dtype(), "embed_scale.to()");
    inputs_embeds = mul(c, inputs_embeds, scale, "embeddings * embed_scale");
  }
  if (c.pp.first) inputs_embeds = fsdp_post_forward(c, kFsdpUnitEmbed, std::move(inputs_embeds));
  T position_ids = model_position_ids(c, Tn);
  // sequence parallelism (sp.h): position_ids (1, T) come from the caller (the backend's forward passes
  // torch.arange(seq).unsqueeze(0)); LlamaModel still makes cache_position = torch.arange(0, inputs_embeds.shape[1])
  // over the rank's T / tp embeddings, alive until it returns
  T cache_position;
  if (m.sp) cache_position = c.e.empty(Shape{Tn / m.tp}, DType::kI64, Category::kActivations, c.L("cache_position (T/tp)"));
  if (!m.attn.sliding_layers.empty()) return gemma3_text_model(c, m, w, std::move(inputs_embeds), position_ids);
  T mask;
  if (m.attn_impl == AttnImpl::kEager) {
    mask = eager_mask(c, B, Tn, inputs_embeds.dtype());
  } else if (m.attn.sliding_window > 0 && (c.kv ? c.kv->past : 0) + Tn >= m.attn.sliding_window &&
             (m.model_type == "mistral" || m.model_type == "mixtral" || m.model_type == "phi3" ||
              m.model_type == "starcoder2")) {
    // SDPA: _ignore_causal_mask_sdpa skips the mask only while kv_length < sliding_window. These four slide on
    // every layer (their configs' sliding_window, read_sliding_window); gemma2 and qwen2/qwen3 slide on some
    // layers only, whose SDPA mask is not simulated yet (the README's "Not yet" says so).
    mask = sdpa_sliding_mask(c, B, Tn, m.attn.sliding_window);
  }
  T hidden = inputs_embeds;
  const Rotary rot = rotary_embedding(c, w.buf("model.rotary_emb.inv_freq"), Tn, hidden.dtype());
  if (c.pp.first) hidden = dropout(c, hidden, m.dropout.embd, "embd dropout");
  rs_pending.reset();  // wait_tensor at the first norm's first op (SequenceParallel's DTensor.from_local)
  hidden = run_layers(c, m.layers, std::move(hidden), LayerArgs{mask, rot.cos, rot.sin, position_ids},
                      [&](uint64_t l, T h, const LayerArgs& a) {
                        return decoder_layer(c, m, Layer{w, l}, h, Rotary{a.cos, a.sin}, a.mask ? &a.mask : nullptr);
                      });
  if (!c.pp.last) return hidden;  // a pipeline stage before the last: its output is the hidden states
  hidden = fsdp_pre_forward(c, kFsdpUnitTail, std::move(hidden));  // FSDP2: the tail unit starts at the final norm
  return block_norm(c, m, hidden, w.p("model.norm.weight"), w.opt("model.norm.bias"), "norm");
}

}  // namespace

ForwardOut llama_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  T hidden = llama_model(c, m, w, ids);
  if (!c.pp.last) return ForwardOut{std::move(hidden), T()};  // sent to the next pipeline stage
  hidden = fsdp_pre_forward(c, kFsdpUnitLmHead, std::move(hidden));  // FSDP2 under PEFT: the tail [lm_head] starts here
  if (m.head == Head::kSeqCls) return sequence_classification_output(c, m, w.p("score.weight"), hidden, ids, labels);
  if (c.liger_fused) {  // resolve() refuses gemma2 (softcapping) and autocast with it
    return liger_fused_causal_lm(c, w, std::move(hidden), "lm_head.weight", "model.embed_tokens.weight", labels);
  }
  if (c.loss_chunks) {  // resolve() refuses gemma2 (softcapping) with it
    return chunked_causal_lm(c, w, std::move(hidden), "lm_head.weight", "model.embed_tokens.weight", "lm_head", labels);
  }
  if (m.sp) {
    // sequence parallelism (sp.h): the backend's forward runs lm_head on the model's last_hidden_state, a
    // ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) under
    // loss_parallel: the final norm's (B, T/tp, C) all-gathered (the product saves it, or its autocast copy),
    // this rank's (B, T, V/tp) logits kept sharded, and torchtitan's cross_entropy_loss on them (sp_ops.h); the
    // trainer drops `pred` before backward
    T gathered = sp_all_gather_seq(c, hidden, m.tp, "lm_head input all_gather (Shard(1) -> Replicate)");
    ForwardOut out;
    out.logits = linear(c, gathered, w.p("lm_head.weight"), nullptr, "lm_head (this rank's V/tp, Shard(-1))");
    gathered.reset();
    // FSDP2 over the TP + SP model (fsdp.h resolve_sp_fsdp): the tail unit [norm, lm_head]'s post-forward hook
    // runs after lm_head's TP output hook (parallelize_module registered it first), on the Shard(-1) logits
    out.logits = fsdp_post_forward(c, kFsdpUnitTail, std::move(out.logits));
    hidden.reset();
    if (labels) out.loss = sp_loss_parallel_cross_entropy(c, out.logits, *labels, m.tp);
    return out;
  }
  if (m.tp > 1) {
    // LlamaForCausalLM.forward: logits = self.lm_head(hidden_states[:, slice_indices, :]), lm_head being
    // colwise_gather_output (ColwiseParallel(gather_output=True)): the pre-hook's all_reduce_backward, this rank's
    // (B, T, V/tp) logits, and the post-hook's all_gather to the whole (B, T, V); the local logits die with the
    // hook's frame. resolve() refuses the chunked and fused losses and gemma2 with --tp.
    const uint64_t Tn = hidden.shape()[1];
    T kept = c.logits_to_keep ? slice_dim1(c, hidden, Tn - c.logits_to_keep, Tn) : hidden;
    kept = tp_all_reduce_backward(c, kept);
    T local = linear(c, kept, w.p("lm_head.weight"), nullptr, "lm_head (this rank's V/tp)");
    kept.reset();
    T logits = tp_all_gather_last(c, local, m.tp, "lm_head all_gather");
    local.reset();
    // FSDP2 over TP: fully_shard's post-forward hook of the tail unit runs after the TP output hook (registered
    // before it by parallelize_module), on the gathered logits, as in the branch below
    logits = fsdp_post_forward(c, kFsdpUnitTail, std::move(logits));
    return causal_lm_output(c, std::move(logits), labels);
  }
  T logits = lm_head_logits(c, w, hidden, "lm_head.weight", "model.embed_tokens.weight", "lm_head");
  logits = fsdp_post_forward(c, kFsdpUnitTail, std::move(logits));  // FSDP2: the tail unit ends with lm_head
  if (m.model_type == "gemma2" || m.final_softcap > 0) {
    // final_logit_softcapping (gemma2 always; gemma3_text when set): logits / cap, tanh, * cap
    logits = mul_scalar(c, logits, "logits / softcap");
    logits = tanh(c, logits, "logits tanh");
    logits = mul_scalar(c, logits, "logits * softcap");
  }
  return causal_lm_output(c, std::move(logits), labels);
}

}  // namespace trainmem::sim
