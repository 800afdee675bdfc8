// GPT-2 as Hugging Face transformers builds it (GPT2LMHeadModel, modeling_gpt2.py) and as nanoGPT builds it
// (GPT, model.py). Same computation, different layouts: HF uses Conv1D with weight (in, out), nanoGPT uses
// nn.Linear with weight (out, in); nanoGPT can drop every bias (bias=False).
// B=micro-batch T=seq C=hidden L=layers V=vocab P=position rows F=ffn
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

void gpt2_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, P = m.embed.position_rows, F = m.mlp.ffn;
  const uint64_t QKV = 3 * C;  // c_attn projects to q, k and v at once
  t.param("transformer.wte.weight", {V, C});
  t.param("transformer.wpe.weight", {P, C});
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string h = fmt::format("transformer.h.{}.", l);
    t.param(h + "ln_1.weight", {C});
    t.param(h + "ln_1.bias", {C});
    t.param(h + "attn.c_attn.weight", {C, QKV});  // Conv1D(nf=3C, nx=C): weight (nx, nf)
    t.param(h + "attn.c_attn.bias", {QKV});
    t.param(h + "attn.c_proj.weight", {C, C});
    t.param(h + "attn.c_proj.bias", {C});
    t.param(h + "ln_2.weight", {C});
    t.param(h + "ln_2.bias", {C});
    t.param(h + "mlp.c_fc.weight", {C, F});
    t.param(h + "mlp.c_fc.bias", {F});
    t.param(h + "mlp.c_proj.weight", {F, C});
    t.param(h + "mlp.c_proj.bias", {C});
  }
  t.param("transformer.ln_f.weight", {C});
  t.param("transformer.ln_f.bias", {C});
  // lm_head.weight (V, C) is transformer.wte.weight (tie_word_embeddings=True) and is listed once.
  if (!m.embed.tied) t.param("lm_head.weight", {V, C});
  gpt2_buffers(m, t);
}

// transformers 5.x GPT-2 registers no buffers ("No longer used as we directly use our masks instead"); 4.x had
// a bool causal mask (1, 1, P, P) and a scalar masked_bias per layer.
void gpt2_buffers(const ModelSpec&, Table&) {}

void nanogpt_tensors(const ModelSpec& m, Table& t) {
  const uint64_t C = m.hidden, V = m.embed.vocab_size, P = m.embed.position_rows, F = m.mlp.ffn;
  const bool b = m.norm.bias;  // GPTConfig.bias: biases in Linears and LayerNorms
  t.param("transformer.wte.weight", {V, C});
  t.param("transformer.wpe.weight", {P, C});
  for (uint64_t l = 0; l < m.layers; ++l) {
    const std::string h = fmt::format("transformer.h.{}.", l);
    t.param(h + "ln_1.weight", {C});
    if (b) t.param(h + "ln_1.bias", {C});
    t.param(h + "attn.c_attn.weight", {3 * C, C});  // nn.Linear(C, 3C): weight (out, in)
    if (b) t.param(h + "attn.c_attn.bias", {3 * C});
    t.param(h + "attn.c_proj.weight", {C, C});
    if (b) t.param(h + "attn.c_proj.bias", {C});
    // Without flash attention (attn_impl eager) CausalSelfAttention registers the causal mask as a float32
    // buffer: register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size,
    // block_size)), persistent by default. Seed 000 counts it: 4 bytes x T^2 x L.
    if (m.attn_impl == AttnImpl::kEager) t.buffer(h + "attn.bias", {1, 1, P, P}, DType::kF32, true);
    t.param(h + "ln_2.weight", {C});
    if (b) t.param(h + "ln_2.bias", {C});
    t.param(h + "mlp.c_fc.weight", {F, C});
    if (b) t.param(h + "mlp.c_fc.bias", {F});
    t.param(h + "mlp.c_proj.weight", {C, F});
    if (b) t.param(h + "mlp.c_proj.bias", {C});
  }
  t.param("transformer.ln_f.weight", {C});
  if (b) t.param("transformer.ln_f.bias", {C});
  // lm_head.weight is tied: `self.transformer.wte.weight = self.lm_head.weight` (model.py).
}

}  // namespace trainmem::models
