// transformers' GPTNeoXForCausalLM (modeling_gpt_neox.py, 5.x), labels given, use_cache=False.
// B=micro-batch T=seq C=hidden H=heads D=head-dim R=rotary dims F=ffn V=vocab
#include <fmt/format.h>

#include "../layers.h"
#include "hf_common.h"

namespace trainmem::sim {

namespace {

T neox_attention(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& x, const Rotary& rot,
                 const T* mask) {
  auto n = [l](const char* s) { return param_name("gpt_neox.layers.{}.attention.{}", l, s); };
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], H = m.attn.heads, D = m.attn.head_dim;
  T q, k, v;
  {
    // qkv = self.query_key_value(x).view(B, T, -1, 3 * D).transpose(1, 2); q, k, v = qkv.chunk(3, dim=-1)
    T qkv = linear(c, x, w.p(n("query_key_value.weight")), w.opt(n("query_key_value.bias")), "attention.query_key_value");
    qkv = transpose(c, view(c, qkv, Shape{B, Tn, H, 3 * D}), 1, 2);
    std::vector<T> parts = split_last(c, qkv, {D, D, D});
    q = parts[0];
    k = parts[1];
    v = parts[2];
  }
  std::tie(q, k) = apply_rotary_qk(c, q, k, rot);
  kv_update(c, l, k, v);  // past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)
  T o;
  if (m.attn_impl == AttnImpl::kEager) {
    o = eager_attention(c, q, k, v, mask, 1, m.dropout.attn, "attn * scaling", 0.0).output;
  } else {
    o = sdpa_attention(c, q, k, v, 1, m.dropout.attn);
  }
  q.reset();
  k.reset();
  v.reset();
  o = contiguous(c, reshape(c, o, Shape{B, Tn, H * D}), "attn output contiguous");
  return linear(c, o, w.p(n("dense.weight")), w.opt(n("dense.bias")), "attention.dense");
}

T neox_mlp(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& x) {
  auto n = [l](const char* s) { return param_name("gpt_neox.layers.{}.mlp.{}", l, s); };
  T h = linear(c, x, w.p(n("dense_h_to_4h.weight")), w.opt(n("dense_h_to_4h.bias")), "mlp.dense_h_to_4h");
  h = activation(c, m.mlp.act, h);
  return linear(c, h, w.p(n("dense_4h_to_h.weight")), w.opt(n("dense_4h_to_h.bias")), "mlp.dense_4h_to_h");
}

T neox_layer(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& hidden, const Rotary& rot,
             const T* mask) {
  auto n = [l](const char* s) { return param_name("gpt_neox.layers.{}.{}", l, s); };
  T attn;
  {
    T h = layer_norm(c, hidden, &w.p(n("input_layernorm.weight")), &w.p(n("input_layernorm.bias")), "input_layernorm");
    attn = neox_attention(c, m, w, l, h, rot, mask);
  }
  attn = dropout(c, attn, m.dropout.resid, "post_attention_dropout");
  if (m.parallel_residual) {
    // x = x + attn(ln1(x)) + mlp(ln2(x)): hidden_states = mlp_output + attn_output + hidden_states
    T mlp_out;
    {
      T h = layer_norm(c, hidden, &w.p(n("post_attention_layernorm.weight")), &w.p(n("post_attention_layernorm.bias")),
                       "post_attention_layernorm");
      mlp_out = dropout(c, neox_mlp(c, m, w, l, h), m.dropout.resid, "post_mlp_dropout");
    }
    return add(c, add(c, mlp_out, attn, "mlp + attn"), hidden, "+ hidden");
  }
  attn = add(c, attn, hidden, "attn + hidden");
  T mlp_out;
  {
    T h = layer_norm(c, attn, &w.p(n("post_attention_layernorm.weight")), &w.p(n("post_attention_layernorm.bias")),
                     "post_attention_layernorm");
    mlp_out = dropout(c, neox_mlp(c, m, w, l, h), m.dropout.resid, "post_mlp_dropout");
  }
  return add(c, mlp_out, attn, "mlp + attn");
}

T neox_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  c.layer = -1;
  // inputs_embeds = self.embed_in(input_ids): a local of GPTNeoXModel.forward, alive to its end
  T inputs_embeds = embedding(c, w.p("gpt_neox.embed_in.weight"), ids, "embed_in");
  return rotary_decoder_body(
      c, m, ids, inputs_embeds.dtype(),
      // hidden_states = self.emb_dropout(inputs_embeds)
      [&] { return dropout(c, inputs_embeds, m.dropout.resid, "emb_dropout"); },
      w.buf("gpt_neox.rotary_emb.inv_freq"),
      [&](uint64_t l, T h, const Rotary& rot, const T* mask) { return neox_layer(c, m, w, l, h, rot, mask); },
      [&](const T& h) {
        return layer_norm(c, h, &w.p("gpt_neox.final_layer_norm.weight"), &w.p("gpt_neox.final_layer_norm.bias"),
                          "final_layer_norm");
      });
}

}  // namespace

ForwardOut gpt_neox_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  T hidden = neox_model(c, m, w, ids);
  if (c.loss_chunks) {
    return chunked_causal_lm(c, w, std::move(hidden), "embed_out.weight", "gpt_neox.embed_in.weight", "embed_out", labels);
  }
  return causal_lm_output(
      c, lm_head_logits(c, w, hidden, "embed_out.weight", "gpt_neox.embed_in.weight", "embed_out"), labels);
}

}  // namespace trainmem::sim
