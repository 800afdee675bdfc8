// transformers' PhiForCausalLM (modeling_phi.py, 5.x; generated from modular_phi.py), labels given,
// use_cache=False. One input_layernorm per layer feeds the attention and the MLP in parallel.
// B=micro-batch T=seq C=hidden H=heads KV=kv-heads D=head-dim R=rotary dims F=ffn V=vocab
#include <fmt/format.h>

#include "../layers.h"
#include "hf_common.h"
#include "trainmem/error.h"

namespace trainmem::sim {

namespace {

struct Layer {
  const LoadedModel& w;
  uint64_t l;
  ParamName n(const char* s) const { return param_name("model.layers.{}.{}", l, s); }
  const T& p(const char* s) const { return w.p(n(s)); }
};

// PhiAttention.forward. Its locals stay bound until it returns: query_rot / key_rot (the rotated parts, which
// nothing saves), query_pass / key_pass (views of the projections, or of the q/k LayerNorm outputs) and the
// query/key/value states keep their storages alive until then.
AttnOut phi_attention(Ctx& c, const ModelSpec& m, const Layer& L, const T& x, const Rotary& rot, const T* mask) {
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], H = m.attn.heads, KV = m.attn.kv_heads, D = m.attn.head_dim;
  const uint64_t R = m.attn.rotary_dim;
  // hidden_shape = (*input_shape, -1, self.head_dim)
  // query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)   (k_proj, v_proj likewise)
  T q = transpose(c, view(c, linear(c, x, L.p("self_attn.q_proj.weight"), &L.p("self_attn.q_proj.bias"),
                                    "attn.q_proj"), Shape{B, Tn, H, D}), 1, 2);
  T k = transpose(c, view(c, linear(c, x, L.p("self_attn.k_proj.weight"), &L.p("self_attn.k_proj.bias"),
                                    "attn.k_proj"), Shape{B, Tn, KV, D}), 1, 2);
  T v = transpose(c, view(c, linear(c, x, L.p("self_attn.v_proj.weight"), &L.p("self_attn.v_proj.bias"),
                                    "attn.v_proj"), Shape{B, Tn, KV, D}), 1, 2);
  if (m.attn.qk_norm) {
    // if self.qk_layernorm: query_states = self.q_layernorm(query_states); key_states = self.k_layernorm(...)
    // (nn.LayerNorm on the transposed, non-contiguous (B, H, T, D) view)
    q = layer_norm(c, q, &L.p("self_attn.q_layernorm.weight"), &L.p("self_attn.q_layernorm.bias"), "attn.q_layernorm");
    k = layer_norm(c, k, &L.p("self_attn.k_layernorm.weight"), &L.p("self_attn.k_layernorm.bias"), "attn.k_layernorm");
  }
  // Partial rotary embedding:
  // query_rot, query_pass = (query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims :])
  // key_rot, key_pass = (key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :])
  T q_rot = slice_last(c, q, 0, R);
  const T q_pass = slice_last(c, q, R, D);
  T k_rot = slice_last(c, k, 0, R);
  const T k_pass = slice_last(c, k, R, D);
  // query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin): q_embed = (q * cos) +
  // (rotate_half(q) * sin), then k_embed likewise (the rotary part is the whole of q_rot)
  q_rot = apply_rotary(c, q_rot, rot);
  k_rot = apply_rotary(c, k_rot, rot);
  // query_states = torch.cat((query_rot, query_pass), dim=-1); key_states = torch.cat((key_rot, key_pass), dim=-1)
  q = cat_last(c, {q_rot, q_pass}, "cat((query_rot, query_pass))");
  k = cat_last(c, {k_rot, k_pass}, "cat((key_rot, key_pass))");
  kv_update(c, L.l, k, v);  // past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)
  AttnOut a;
  if (m.attn_impl == AttnImpl::kEager) {
    // eager_attention_forward(self, q, k, v, mask, dropout=..., scaling=self.scaling): the Llama kernel
    a = eager_attention(c, q, k, v, mask, H / KV, m.dropout.attn, "attn * scaling", 0.0);
  } else {
    a.output = sdpa_attention(c, q, k, v, H / KV, m.dropout.attn);
  }
  // attn_output = attn_output.reshape(*input_shape, -1).contiguous(); attn_output = self.dense(attn_output)
  a.output = contiguous(c, reshape(c, a.output, Shape{B, Tn, H * D}), "attn output contiguous");
  a.output = linear(c, a.output, L.p("self_attn.dense.weight"), &L.p("self_attn.dense.bias"), "attn.dense");
  return a;
}

// PhiMLP: hidden_states = self.fc1(hidden_states); self.activation_fn(...); self.fc2(...)
T phi_mlp(Ctx& c, const ModelSpec& m, const Layer& L, const T& x) {
  T h = linear(c, x, L.p("mlp.fc1.weight"), &L.p("mlp.fc1.bias"), "mlp.fc1");
  h = activation(c, m.mlp.act, h);
  return linear(c, h, L.p("mlp.fc2.weight"), &L.p("mlp.fc2.bias"), "mlp.fc2");
}

// PhiDecoderLayer.forward
T phi_layer(Ctx& c, const ModelSpec& m, const Layer& L, const T& residual, const Rotary& rot, const T* mask) {
  // residual = hidden_states; hidden_states = self.input_layernorm(hidden_states)
  const T h = layer_norm(c, residual, &L.p("input_layernorm.weight"), &L.p("input_layernorm.bias"),
                         "input_layernorm");
  // attn_outputs, self_attn_weights = self.self_attn(...): the weights (eager) stay bound until the layer returns
  AttnOut a = phi_attention(c, m, L, h, rot, mask);
  // attn_outputs = self.resid_dropout(attn_outputs)
  T attn = dropout(c, a.output, m.dropout.resid, "resid_dropout (attn)");
  a.output.reset();
  // feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
  T ff = dropout(c, phi_mlp(c, m, L, h), m.dropout.resid, "resid_dropout (mlp)");
  // hidden_states = attn_outputs + feed_forward_hidden_states + residual
  return add(c, add(c, attn, ff, "attn + ff"), residual, "+ residual");
}

// PhiModel.forward: returns the final hidden states; its locals (embeddings, mask, cos/sin) die with it.
T phi_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  c.layer = -1;
  // inputs_embeds = self.embed_tokens(input_ids)
  T inputs_embeds = embedding(c, w.p("model.embed_tokens.weight"), ids, "embed_tokens");
  return rotary_decoder_body(
      c, m, ids, inputs_embeds.dtype(),
      [&] {
        // inputs_embeds = self.embed_dropout(inputs_embeds); hidden_states = inputs_embeds
        inputs_embeds = dropout(c, inputs_embeds, m.dropout.embd, "embed_dropout");
        return inputs_embeds;
      },
      w.buf("model.rotary_emb.inv_freq"),
      [&](uint64_t l, T h, const Rotary& rot, const T* mask) { return phi_layer(c, m, Layer{w, l}, h, rot, mask); },
      [&](const T& h) {
        // hidden_states = self.final_layernorm(hidden_states)
        return layer_norm(c, h, &w.p("model.final_layernorm.weight"), &w.p("model.final_layernorm.bias"),
                          "final_layernorm");
      });
}

}  // namespace

ForwardOut phi_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  // check_loss() refuses --loss chunked and liger-fused for Phi: neither has the lm_head's bias
  if (c.loss_chunks || c.liger_fused) throw Error("internal: Phi's lm_head bias is not part of a chunked or fused loss");
  T hidden = phi_model(c, m, w, ids);
  // logits = self.lm_head(hidden_states[:, slice_indices, :]); loss = self.loss_function(logits, labels, ...)
  return causal_lm_output(c, lm_head_logits(c, w, hidden, "lm_head.weight", "model.embed_tokens.weight", "lm_head",
                                            "lm_head.bias"),
                          labels);
}

}  // namespace trainmem::sim
