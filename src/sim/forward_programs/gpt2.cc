// transformers' GPT2LMHeadModel (modeling_gpt2.py, 5.x), labels given, use_cache=False.
// B=micro-batch T=seq C=hidden H=heads D=head-dim V=vocab
#include <fmt/format.h>

#include "../layers.h"
#include "hf_common.h"

namespace trainmem::sim {

namespace {

// GPT2Attention.forward returns (attn_output, attn_weights): the eager weights (None after SDPA) go back to the
// block with the output.
AttnOut gpt2_attention(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& x, const T* mask) {
  auto n = [l](const char* s) { return param_name("transformer.h.{}.attn.{}", l, s); };
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], C = m.hidden, H = m.attn.heads, D = m.attn.head_dim;
  T q, k, v;
  {
    std::vector<T> qkv = split_last(c, conv1d(c, x, w.p(n("c_attn.weight")), w.p(n("c_attn.bias")), "attn.c_attn"),
                                    {C, C, C});
    k = transpose(c, view(c, qkv[1], Shape{B, Tn, H, D}), 1, 2);
    v = transpose(c, view(c, qkv[2], Shape{B, Tn, H, D}), 1, 2);
    q = transpose(c, view(c, qkv[0], Shape{B, Tn, H, D}), 1, 2);
  }
  kv_update(c, l, k, v);  // past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)
  T o;
  T weights;
  if (m.attn_impl == AttnImpl::kEager) {
    // eager_attention_forward (GPT-2): matmul, / torch.full([], sqrt(D)), + mask, softmax (no dtype),
    // .type(value.dtype), dropout, matmul, transpose(1, 2)
    T s = matmul(c, q, transpose(c, k, -1, -2), "attn q@k^T");
    {
      T denom = full_scalar(c, s.dtype(), "torch.full([], sqrt(D))");
      s = div(c, s, denom, "attn / sqrt(D)");
    }
    if (mask) s = add(c, s, *mask, "attn + mask");
    s = softmax(c, s, std::nullopt, "attn softmax");
    s = to(c, s, v.dtype(), "attn weights .type(v.dtype)");
    s = dropout(c, s, m.dropout.attn, "attn dropout");
    o = transpose(c, matmul(c, s, v, "attn @ v"), 1, 2);
    weights = s;
  } else {
    o = sdpa_attention(c, q, k, v, 1, m.dropout.attn);
  }
  // attn_output.reshape(*shape[:-2], -1).contiguous(): a copy for the eager transpose, a view after SDPA
  o = reshape(c, o, Shape{B, Tn, C});
  o = contiguous(c, o, "attn output contiguous");
  o = conv1d(c, o, w.p(n("c_proj.weight")), w.p(n("c_proj.bias")), "attn.c_proj");
  return AttnOut{dropout(c, o, m.dropout.resid, "attn resid dropout"), weights};
}

T gpt2_mlp(Ctx& c, const ModelSpec& m, const LoadedModel& w, uint64_t l, const T& x) {
  auto n = [l](const char* s) { return param_name("transformer.h.{}.mlp.{}", l, s); };
  T h = conv1d(c, x, w.p(n("c_fc.weight")), w.p(n("c_fc.bias")), "mlp.c_fc");
  h = activation(c, m.mlp.act, h);
  h = conv1d(c, h, w.p(n("c_proj.weight")), w.p(n("c_proj.bias")), "mlp.c_proj");
  return dropout(c, h, m.dropout.resid, "mlp dropout");
}

// GPT2Model.forward: returns the final hidden states; its locals (embeddings, mask) die when it returns.
T gpt2_model(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids) {
  const uint64_t B = ids.shape()[0], Tn = ids.shape()[1];
  c.layer = -1;
  T inputs_embeds = embedding(c, w.p("transformer.wte.weight"), ids, "wte");
  // cache_position = torch.arange(T); position_ids = cache_position.unsqueeze(0)
  T position_ids = model_position_ids(c, Tn);
  T position_embeds = embedding(c, w.p("transformer.wpe.weight"), position_ids, "wpe");
  T hidden = add(c, inputs_embeds, position_embeds, "inputs_embeds + position_embeds");
  T mask;
  if (m.attn_impl == AttnImpl::kEager) mask = eager_mask(c, B, Tn, inputs_embeds.dtype());
  hidden = dropout(c, hidden, m.dropout.embd, "embd dropout");
  hidden = run_layers(c, m.layers, std::move(hidden), LayerArgs{mask, {}, {}, position_ids, /*positional=*/true}, [&](uint64_t l, T h, const LayerArgs& a) {  // GPT2Block.forward
    auto n = [l](const char* s) { return param_name("transformer.h.{}.{}", l, s); };
    T residual = h;
    h = layer_norm(c, h, &w.p(n("ln_1.weight")), &w.p(n("ln_1.bias")), "ln_1");
    // `attn_output, self_attn_weights = self.attn(...)`: both stay bound until the block returns (the
    // weights matter under no_grad, as in a reentrant checkpoint's first forward, where nothing else keeps them)
    AttnOut attn = gpt2_attention(c, m, w, l, h, a.mask ? &a.mask : nullptr);
    h = add(c, attn.output, residual, "attn_output + residual");
    residual = h;
    h = layer_norm(c, h, &w.p(n("ln_2.weight")), &w.p(n("ln_2.bias")), "ln_2");
    // `feed_forward_hidden_states = self.mlp(hidden_states)`; `hidden_states = residual + feed_forward_hidden_states`:
    // ln_2's output is dropped by that rebinding, after the add
    T feed_forward = gpt2_mlp(c, m, w, l, h);
    h = add(c, residual, feed_forward, "residual + feed_forward");
    // the frame's locals die as the block returns, in CPython's order (co_varnames): residual, attn_output,
    // self_attn_weights, feed_forward_hidden_states. The H100 trace of validate/measured/ (GPT-2 eager inference,
    // fp32) frees them so; where nothing else holds them (no_grad) their order places the next layer's blocks.
    residual.reset();
    attn.output.reset();
    attn.weights.reset();
    feed_forward.reset();
    return h;
  });
  T out = layer_norm(c, hidden, &w.p("transformer.ln_f.weight"), &w.p("transformer.ln_f.bias"), "ln_f");
  // The frame's locals die as forward returns, in CPython's order (co_varnames: the arguments position_ids and
  // inputs_embeds, then position_embeds, then the causal mask), not C++'s reverse one: the H100 trace of HF GPT-2
  // (eager, fp32) frees the 12 MiB embeddings, then the 3 MiB position embeddings, then the 16 MiB mask.
  position_ids.reset();
  inputs_embeds.reset();
  position_embeds.reset();
  mask.reset();
  return out;
}

}  // namespace

ForwardOut gpt2_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels) {
  // GPT2LMHeadModel.forward: the transformer outputs (holding the final hidden states) live until it returns.
  T hidden = gpt2_model(c, m, w, ids);
  if (c.loss_chunks) {
    return chunked_causal_lm(c, w, std::move(hidden), "lm_head.weight", "transformer.wte.weight", "lm_head", labels);
  }
  return causal_lm_output(c, lm_head_logits(c, w, hidden, "lm_head.weight", "transformer.wte.weight", "lm_head"),
                          labels);
}

}  // namespace trainmem::sim
