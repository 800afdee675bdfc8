// transformers' OPTForCausalLM (modeling_opt.py, 5.x), labels given, use_cache=False.
// B=micro-batch T=seq C=hidden W=word_embed_proj_dim H=heads D=head-dim F=ffn V=vocab
#include <fmt/format.h>

#include "../layers.h"
#include "hf_common.h"

namespace trainmem::sim {

namespace {

T opt_attention(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& x, const T* mask) {
  auto n = [l](const char* s) { return param_name("model.decoder.layers.{}.self_attn.{}", l, s); };
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], H = m.attn.heads, D = m.attn.head_dim;
  const Shape hs{B, Tn, H, D};
  // query_states = self.q_proj(hidden_states) * self.scaling
  T q = mul_scalar(c, linear(c, x, w.p(n("q_proj.weight")), w.opt(n("q_proj.bias")), "self_attn.q_proj"), "q * scaling");
  q = transpose(c, view(c, q, hs), 1, 2);
  T k = linear(c, x, w.p(n("k_proj.weight")), w.opt(n("k_proj.bias")), "self_attn.k_proj");
  T v = linear(c, x, w.p(n("v_proj.weight")), w.opt(n("v_proj.bias")), "self_attn.v_proj");
  k = transpose(c, view(c, k, hs), 1, 2);
  v = transpose(c, view(c, v, hs), 1, 2);
  kv_update(c, l, k, v);  // past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)
  T o;
  if (m.attn_impl == AttnImpl::kEager) {
    o = eager_attention(c, q, k, v, mask, 1, m.dropout.attn, "attn * 1.0", 0.0).output;  // scaling=1.0
  } else {
    o = sdpa_attention(c, q, k, v, 1, m.dropout.attn);
  }
  q.reset();
  k.reset();
  v.reset();
  o = contiguous(c, reshape(c, o, Shape{B, Tn, H * D}), "attn output contiguous");
  return linear(c, o, w.p(n("out_proj.weight")), w.opt(n("out_proj.bias")), "self_attn.out_proj");
}

T opt_layer(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, T hidden, const T* mask) {
  auto n = [l](const char* s) { return param_name("model.decoder.layers.{}.{}", l, s); };
  auto ln = [&](const T& x, const char* name) {
    return layer_norm(c, x, w.opt(n(param_name("{}.weight", name).c_str())), w.opt(n(param_name("{}.bias", name).c_str())), name);
  };
  const Shape shape = hidden.shape();
  const uint64_t C = shape.back();
  T residual = hidden;
  if (m.pre_norm) hidden = ln(hidden, "self_attn_layer_norm");
  hidden = opt_attention(c, m, w, l, hidden, mask);
  hidden = dropout(c, hidden, m.dropout.resid, "attn dropout");
  hidden = add(c, residual, hidden, "residual + attn");
  if (!m.pre_norm) hidden = ln(hidden, "self_attn_layer_norm");
  // hidden_states = hidden_states.reshape(-1, C); residual = hidden_states
  hidden = reshape(c, hidden, Shape{shape.numel().value / C, C});
  residual = hidden;
  if (m.pre_norm) hidden = ln(hidden, "final_layer_norm");
  hidden = linear(c, hidden, w.p(n("fc1.weight")), w.opt(n("fc1.bias")), "fc1");
  hidden = activation(c, m.mlp.act, hidden);
  hidden = linear(c, hidden, w.p(n("fc2.weight")), w.opt(n("fc2.bias")), "fc2");
  hidden = dropout(c, hidden, m.dropout.resid, "fc dropout");
  hidden = view(c, add(c, residual, hidden, "residual + mlp"), shape);
  if (!m.pre_norm) hidden = ln(hidden, "final_layer_norm");
  return hidden;
}

T opt_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  c.layer = -1;
  T inputs_embeds = embedding(c, w.p("model.decoder.embed_tokens.weight"), ids, "embed_tokens");
  // attention_mask = torch.ones(B, T) (float32); position_ids = (torch.cumsum(mask, 1) * mask - 1).long()
  // generate() passes its own attention_mask and (B, q) position_ids (c.position_ids): the decoder makes neither
  T attention_mask;
  T position_ids;
  if (c.position_ids) {
    position_ids = *c.position_ids;
  } else {
    attention_mask = c.e.empty(Shape{B, Tn}, DType::kF32, Category::kActivations, c.L("attention_mask (ones)"));
    T cs = c.e.empty(Shape{B, Tn}, DType::kF32, Category::kTemporaries, c.L("cumsum"));
    T prod = c.e.empty(Shape{B, Tn}, DType::kF32, Category::kTemporaries, c.L("cumsum * mask"));
    cs.reset();
    T minus = c.e.empty(Shape{B, Tn}, DType::kF32, Category::kTemporaries, c.L("- 1"));
    prod.reset();
    position_ids = c.e.empty(Shape{B, Tn}, DType::kI64, Category::kActivations, c.L("position_ids"));
  }
  T mask;
  if (m.attn_impl == AttnImpl::kEager) mask = eager_mask(c, B, Tn, inputs_embeds.dtype());
  T pos_embeds;
  {
    // OPTLearnedPositionalEmbedding: super().forward(position_ids + self.offset)
    T shifted = c.e.empty(Shape{B, Tn}, DType::kI64, Category::kActivations, c.L("position_ids + 2"));
    pos_embeds = embedding(c, w.p("model.decoder.embed_positions.weight"), shifted, "embed_positions");
  }
  if (const T* pin = w.opt("model.decoder.project_in.weight")) {
    inputs_embeds = linear(c, inputs_embeds, *pin, nullptr, "project_in");
  }
  T hidden = add(c, inputs_embeds, pos_embeds, "inputs_embeds + pos_embeds");
  hidden = run_layers(c, m.layers, std::move(hidden), LayerArgs{mask, {}, {}, position_ids}, [&](uint64_t l, T h, const LayerArgs& a) {
    return opt_layer(c, m, w, l, h, a.mask ? &a.mask : nullptr);
  });
  if (m.final_norm) {
    hidden = layer_norm(c, hidden, w.opt("model.decoder.final_layer_norm.weight"),
                        w.opt("model.decoder.final_layer_norm.bias"), "final_layer_norm");
  }
  if (const T* pout = w.opt("model.decoder.project_out.weight")) hidden = linear(c, hidden, *pout, nullptr, "project_out");
  return hidden;
}

}  // namespace

ForwardOut opt_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  T hidden = opt_model(c, m, w, ids);
  // logits = self.lm_head(outputs[0]).contiguous()
  if (c.loss_chunks) {
    return chunked_causal_lm(c, w, std::move(hidden), "lm_head.weight", "model.decoder.embed_tokens.weight", "lm_head", labels);
  }
  return causal_lm_output(
      c, lm_head_logits(c, w, hidden, "lm_head.weight", "model.decoder.embed_tokens.weight", "lm_head"), labels);
}

}  // namespace trainmem::sim
