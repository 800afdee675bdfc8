// transformers' LlamaForCausalLM and relatives (modeling_llama.py and the files generated from it, 5.x):
// llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral (its sparse MoE block: moe.cc). Labels given,
// use_cache=False.
// B=micro-batch T=seq C=hidden H=heads KV=kv-heads D=head-dim F=ffn V=vocab E=experts
#include <fmt/format.h>

#include "../layers.h"
#include "hf_common.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace {

bool is_gemma(const ModelSpec& m) { return m.model_type == "gemma" || m.model_type == "gemma2"; }

// LlamaRMSNorm: input_dtype = h.dtype; h = h.to(float32); variance = h.pow(2).mean(-1, keepdim=True);
// h = h * torch.rsqrt(variance + eps); return weight * h.to(input_dtype).
// GemmaRMSNorm: output = x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps);
// output = output * (1.0 + weight.float()); return output.type_as(x).
T rms_norm(Ctx& c, const ModelSpec& m, const T& x, const T& weight, const char* what) {
  const DType in = x.dtype();
  T h = to(c, x, DType::kF32, "rms_norm h.to(float32)");
  T r;
  {
    T var = mean_last(c, pow_scalar(c, h, "rms_norm h.pow(2)"), "rms_norm variance");
    r = rsqrt(c, add_scalar(c, var, "rms_norm variance + eps"), "rms_norm rsqrt");
  }
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

struct Layer {
  const LoadedModel& w;
  uint64_t l;
  ParamName n(const char* s) const { return param_name("model.layers.{}.{}", l, s); }
  const T& p(const char* s) const { return w.p(n(s)); }
  const T* o(const char* s) const { return w.opt(n(s)); }
};

AttnOut attention(Ctx& c, const ModelSpec& m, const Layer& L, const T& x, const Rotary& rot, const T* mask) {
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
    q = view(c, linear(c, x, L.p("self_attn.q_proj.weight"), L.o("self_attn.q_proj.bias"), "attn.q_proj"), qs);
    if (m.attn.qk_norm) q = rms_norm(c, m, q, L.p("self_attn.q_norm.weight"), "attn.q_norm");
    q = transpose(c, q, 1, 2);
    k = view(c, linear(c, x, L.p("self_attn.k_proj.weight"), L.o("self_attn.k_proj.bias"), "attn.k_proj"), kvs);
    if (m.attn.qk_norm) k = rms_norm(c, m, k, L.p("self_attn.k_norm.weight"), "attn.k_norm");
    k = transpose(c, k, 1, 2);
    v = transpose(c, view(c, linear(c, x, L.p("self_attn.v_proj.weight"), L.o("self_attn.v_proj.bias"), "attn.v_proj"), kvs), 1, 2);
  }
  q = apply_rotary(c, q, rot);
  k = apply_rotary(c, k, rot);
  AttnOut a;
  if (m.attn_impl == AttnImpl::kEager) {
    a = eager_attention(c, q, k, v, mask, H / KV, m.dropout.attn, "attn * scaling", m.attn.softcap);
  } else {
    a.output = sdpa_attention(c, q, k, v, H / KV, m.dropout.attn);
  }
  q.reset();
  k.reset();
  v.reset();
  // attn_output.reshape(*input_shape, -1).contiguous(); self.o_proj(attn_output)
  a.output = contiguous(c, reshape(c, a.output, Shape{B, Tn, H * D}), "attn output contiguous");
  a.output = linear(c, a.output, L.p("self_attn.o_proj.weight"), L.o("self_attn.o_proj.bias"), "attn.o_proj");
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
  // LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))
  T h;
  {
    T a = activation(c, m.mlp.act, linear(c, x, L.p("mlp.gate_proj.weight"), L.o("mlp.gate_proj.bias"), "mlp.gate_proj"));
    T u = linear(c, x, L.p("mlp.up_proj.weight"), L.o("mlp.up_proj.bias"), "mlp.up_proj");
    h = mul(c, a, u, "mlp act(gate) * up");
  }
  return linear(c, h, L.p("mlp.down_proj.weight"), L.o("mlp.down_proj.bias"), "mlp.down_proj");
}

T decoder_layer(Ctx& c, const ModelSpec& m, const Layer& L, T hidden, const Rotary& rot, const T* mask) {
  const bool sandwich = m.norms_per_layer == 4;  // Gemma2
  T residual = hidden;
  hidden = rms_norm(c, m, hidden, L.p("input_layernorm.weight"), "input_layernorm");
  // `hidden_states, _ = self.self_attn(...)`: `_` keeps the attention weights (eager) bound until the layer
  // returns; under no_grad (a reentrant checkpoint's first forward) nothing else keeps them
  AttnOut a = attention(c, m, L, hidden, rot, mask);
  hidden = std::move(a.output);
  if (sandwich) hidden = rms_norm(c, m, hidden, L.p("post_attention_layernorm.weight"), "post_attention_layernorm");
  hidden = add(c, residual, dropout(c, hidden, m.dropout.resid, "resid_attn_dropout"), "residual + attn");
  residual = hidden;
  hidden = rms_norm(c, m, hidden, L.p(sandwich ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"),
                    sandwich ? "pre_feedforward_layernorm" : "post_attention_layernorm");
  if (is_moe_layer(m, L.l)) {
    // MixtralDecoderLayer / Qwen2MoeDecoderLayer: hidden_states = self.mlp(hidden_states), a sparse MoE block
    // (moe.cc); qwen2_moe's shared expert is a LlamaMLP-shaped module
    const SharedExpert shared{L.o("mlp.shared_expert.gate_proj.weight"), L.o("mlp.shared_expert.up_proj.weight"),
                              L.o("mlp.shared_expert.down_proj.weight"), L.o("mlp.shared_expert_gate.weight")};
    hidden = sparse_moe_block(c, m, MoeParams{L.p("mlp.gate.weight"), L.p("mlp.experts.gate_up_proj"),
                                              L.p("mlp.experts.down_proj"), shared}, hidden);
  } else {
    hidden = mlp(c, m, L, hidden);
  }
  if (sandwich) hidden = rms_norm(c, m, hidden, L.p("post_feedforward_layernorm.weight"), "post_feedforward_layernorm");
  return add(c, residual, dropout(c, hidden, m.dropout.resid, "resid_mlp_dropout"), "residual + mlp");
}

// LlamaModel.forward: returns the final hidden states; its locals (embeddings, mask, cos/sin) die with it.
T llama_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  c.layer = -1;
  T inputs_embeds = embedding(c, w.p("model.embed_tokens.weight"), ids, "embed_tokens");
  if (m.embed.scaled_by_sqrt_hidden) {
    // GemmaTextScaledWordEmbedding: super().forward(ids) * self.embed_scale.to(self.weight.dtype)
    T scale = to(c, w.buf("model.embed_tokens.embed_scale"), w.p("model.embed_tokens.weight").dtype(), "embed_scale.to()");
    inputs_embeds = mul(c, inputs_embeds, scale, "embeddings * embed_scale");
  }
  T position_ids = c.e.empty(Shape{1, Tn}, DType::kI64, Category::kActivations, c.L("position_ids"));
  T mask;
  if (m.attn_impl == AttnImpl::kEager) mask = eager_mask(c, B, Tn, inputs_embeds.dtype());
  T hidden = inputs_embeds;
  const Rotary rot = rotary_embedding(c, w.buf("model.rotary_emb.inv_freq"), Tn, hidden.dtype());
  hidden = dropout(c, hidden, m.dropout.embd, "embd dropout");
  hidden = run_layers(c, m.layers, std::move(hidden), LayerArgs{mask, rot.cos, rot.sin, position_ids},
                      [&](uint64_t l, T h, const LayerArgs& a) {
                        return decoder_layer(c, m, Layer{w, l}, h, Rotary{a.cos, a.sin}, a.mask ? &a.mask : nullptr);
                      });
  return rms_norm(c, m, hidden, w.p("model.norm.weight"), "norm");
}

}  // namespace

ForwardOut llama_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  T hidden = llama_model(c, m, w, ids);
  if (c.liger_fused) {  // resolve() refuses gemma2 (softcapping) and autocast with it
    return liger_fused_causal_lm(c, w, std::move(hidden), "lm_head.weight", "model.embed_tokens.weight", labels);
  }
  if (c.loss_chunks) {  // resolve() refuses gemma2 (softcapping) with it
    return chunked_causal_lm(c, w, std::move(hidden), "lm_head.weight", "model.embed_tokens.weight", "lm_head", labels);
  }
  T logits = lm_head_logits(c, w, hidden, "lm_head.weight", "model.embed_tokens.weight", "lm_head");
  if (m.model_type == "gemma2") {
    // final_logit_softcapping: logits / cap, tanh, * cap
    logits = mul_scalar(c, logits, "logits / softcap");
    logits = tanh(c, logits, "logits tanh");
    logits = mul_scalar(c, logits, "logits * softcap");
  }
  return causal_lm_output(c, std::move(logits), labels);
}

}  // namespace trainmem::sim
