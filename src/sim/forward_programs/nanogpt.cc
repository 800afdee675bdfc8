// nanoGPT's GPT (karpathy/nanoGPT model.py), line by line. Python locals are C++ locals, so every tensor is
// released where the Python program drops its last reference.
// B=micro-batch T=seq C=hidden NH=heads HS=head size V=vocab
#include <fmt/format.h>

#include "../forward.h"
#include "../layers.h"

namespace trainmem::sim {

namespace {

struct Block {
  const T& ln1_w;
  const T* ln1_b;
  const T& attn_w;
  const T* attn_b;
  const T& proj_w;
  const T* proj_b;
  const T* mask;  // attn.bias buffer, without flash attention
  const T& ln2_w;
  const T* ln2_b;
  const T& fc_w;
  const T* fc_b;
  const T& fc2_w;
  const T* fc2_b;
};

Block block_params(const LoadedModel& w, const ModelSpec& m, uint64_t l) {
  auto n = [l](const char* s) { return param_name("transformer.h.{}.{}", l, s); };
  const bool eager = m.attn_impl == AttnImpl::kEager;
  return Block{w.p(n("ln_1.weight")),       w.opt(n("ln_1.bias")),     w.p(n("attn.c_attn.weight")),
               w.opt(n("attn.c_attn.bias")), w.p(n("attn.c_proj.weight")), w.opt(n("attn.c_proj.bias")),
               eager ? &w.buf(n("attn.bias")) : nullptr,
               w.p(n("ln_2.weight")),       w.opt(n("ln_2.bias")),     w.p(n("mlp.c_fc.weight")),
               w.opt(n("mlp.c_fc.bias")),   w.p(n("mlp.c_proj.weight")), w.opt(n("mlp.c_proj.bias"))};
}

// CausalSelfAttention.forward
T attention(Ctx& c, const ModelSpec& m, const Block& p, const T& x) {
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], C = x.shape()[2], NH = m.attn.heads, HS = C / NH;
  std::vector<T> qkv = split_last(c, linear(c, x, p.attn_w, p.attn_b, "attn.c_attn"), {C, C, C});
  T k = transpose(c, view(c, qkv[1], Shape{B, Tn, NH, HS}), 1, 2);
  T q = transpose(c, view(c, qkv[0], Shape{B, Tn, NH, HS}), 1, 2);
  T v = transpose(c, view(c, qkv[2], Shape{B, Tn, NH, HS}), 1, 2);
  T y;
  if (!p.mask) {
    y = sdpa(c, q, k, v, nullptr, m.dropout.attn, /*is_causal=*/true);
  } else {
    T att = mul_scalar(c, matmul(c, q, transpose(c, k, -2, -1), "attn q@k^T"), "attn scores");
    {
      // self.bias[:,:,:T,:T] == 0: a bool tensor, saved by masked_fill
      T eq = c.e.empty(Shape{1, 1, Tn, Tn}, DType::kBool, Category::kActivations, c.L("causal mask == 0"));
      att = masked_fill(c, att, eq, "attn masked scores");
    }
    att = softmax(c, att, std::nullopt, "attn softmax");
    att = dropout(c, att, m.dropout.attn, "attn dropout");
    y = matmul(c, att, v, "attn att@v");
  }
  y = view(c, contiguous(c, transpose(c, y, 1, 2), "attn y contiguous"), Shape{B, Tn, C});
  y = dropout(c, linear(c, y, p.proj_w, p.proj_b, "attn.c_proj"), m.dropout.resid, "attn resid dropout");
  return y;
}

// MLP.forward
T mlp(Ctx& c, const ModelSpec& m, const Block& p, const T& x0) {
  T x = linear(c, x0, p.fc_w, p.fc_b, "mlp.c_fc");
  x = gelu(c, x, "mlp.gelu");
  x = linear(c, x, p.fc2_w, p.fc2_b, "mlp.c_proj");
  x = dropout(c, x, m.dropout.resid, "mlp dropout");
  return x;
}

// Block.forward: x = x + self.attn(self.ln_1(x)); x = x + self.mlp(self.ln_2(x))
T block(Ctx& c, const ModelSpec& m, const Block& p, T x) {
  if (c.seed000_block_locals) {
    T h1 = layer_norm(c, x, &p.ln1_w, p.ln1_b, "ln_1");
    x = add(c, x, attention(c, m, p, h1), "residual (attn)");
    T h2 = layer_norm(c, x, &p.ln2_w, p.ln2_b, "ln_2");
    x = add(c, x, mlp(c, m, p, h2), "residual (mlp)");
    h1.reset();  // CPython clears a frame's locals in the order they were first bound
    h2.reset();
    return x;
  }
  T a;
  {
    T h = layer_norm(c, x, &p.ln1_w, p.ln1_b, "ln_1");
    a = attention(c, m, p, h);
  }
  x = add(c, x, a, "residual (attn)");
  a.reset();
  {
    T h = layer_norm(c, x, &p.ln2_w, p.ln2_b, "ln_2");
    a = mlp(c, m, p, h);
  }
  x = add(c, x, a, "residual (mlp)");
  return x;
}

}  // namespace

ForwardOut nanogpt_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& idx, const T* targets) {
  const uint64_t Tn = idx.shape()[1];
  c.layer = -1;
  // pos = torch.arange(0, t, dtype=torch.long, device=device)
  T pos = c.e.empty(Shape{Tn}, DType::kI64, Category::kActivations, c.L("pos"));
  T tok_emb = embedding(c, w.p("transformer.wte.weight"), idx, "wte");
  T pos_emb = embedding(c, w.p("transformer.wpe.weight"), pos, "wpe");
  T x = dropout(c, add(c, tok_emb, pos_emb, "tok_emb + pos_emb"), m.dropout.embd, "embd dropout");
  x = run_layers(c, m.layers, std::move(x), LayerArgs{},
                 [&](uint64_t l, T h, const LayerArgs&) { return block(c, m, block_params(w, m, l), h); });
  x = layer_norm(c, x, &w.p("transformer.ln_f.weight"), w.opt("transformer.ln_f.bias"), "ln_f");
  ForwardOut out;
  // lm_head is tied to wte
  if (!targets && !c.e.grad_mode) {
    // model.py GPT.forward without targets: "inference-time mini-optimization: only forward the lm_head on the
    // very last position": lm_head(x[:, [-1], :]), an index with a list, so a (B, 1, C) copy. Only reached
    // under no_grad/inference_mode (--task inference); seed 000's fork computes its loss outside the model on
    // whole logits, with grad mode on.
    T last = c.e.empty(Shape{x.shape()[0], 1, x.shape()[2]}, x.dtype(), Category::kActivations, c.L("x[:, [-1], :]"));
    out.logits = linear(c, last, w.p("transformer.wte.weight"), nullptr, "lm_head");
  } else {
    out.logits = linear(c, x, w.p("transformer.wte.weight"), nullptr, "lm_head");
  }
  if (targets) {
    const uint64_t V = out.logits.shape().back();
    const T flat = view(c, out.logits, Shape{out.logits.shape().numel().value / V, V});
    const T tflat = view(c, *targets, Shape{targets->shape().numel().value});
    out.loss = cross_entropy(c, flat, tflat);
  }
  // Leaving forward() drops the locals in the order CPython clears them (co_varnames order).
  pos.reset();
  tok_emb.reset();
  pos_emb.reset();
  x.reset();
  return out;
}

}  // namespace trainmem::sim
