// Config reader for Phi (phi-1, phi-1.5, phi-2): transformers' PhiConfig. Every default is the one of
// configuration_phi.py (transformers 5.x), so that a config.json missing a key builds what transformers builds.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"

namespace trainmem::config {

// transformers PhiConfig (configuration_phi.py, 5.x dataclass fields): vocab_size=51200, hidden_size=2048,
// intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=None (__post_init__:
// -> num_attention_heads), resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, hidden_act="gelu_new",
// max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False, qk_layernorm=False;
// __post_init__: kwargs.setdefault("partial_rotary_factor", 0.5).
// modeling_phi.py hard-wires the rest: q/k/v_proj and dense are nn.Linear(..., bias=True), PhiMLP's fc1/fc2 are
// nn.Linear with bias, one input_layernorm (nn.LayerNorm) per layer feeding attention and MLP in parallel
// (hidden_states = attn_outputs + feed_forward_hidden_states + residual), final_layernorm, and
// PhiForCausalLM.lm_head = nn.Linear(hidden_size, vocab_size, bias=True).
void read_phi(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "transformers' PhiConfig";
  m.family = Family::kPhi;
  m.embed.vocab_size = r.shape({"vocab_size"}, 51200, 1, kMaxVocab, kDefaults);
  m.hidden = r.shape({"hidden_size"}, 2048, 1, kMaxWidth, kDefaults);
  m.mlp.ffn = r.shape({"intermediate_size"}, 8192, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"num_hidden_layers"}, 24, 1, kMaxLayers, kDefaults);
  // num_key_value_heads=None -> num_attention_heads (read_heads); PhiAttention: head_dim = hidden_size //
  // num_attention_heads (PhiConfig has no head_dim key)
  m.attn.kv_heads = r.optional_integer({"num_key_value_heads"}, 1, kMaxHeads).value_or(0);
  read_heads(r, {"num_attention_heads"}, 32, kDefaults, {"hidden_size"}, m.hidden, m.attn);
  // PhiAttention: self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor); the rotary embedding's
  // inv_freq has rotary_ndims / 2 frequencies (_compute_default_rope_parameters: dim = int(head_dim *
  // partial_rotary_factor)).
  const double f = r.number({"partial_rotary_factor"}, 0.5, 0.0, 1.0);
  m.attn.rotary_dim = static_cast<uint64_t>(static_cast<double>(m.attn.head_dim) * f);
  if (m.attn.rotary_dim == 0) {
    r.fail("partial_rotary_factor", f,
           fmt::format("a factor that leaves at least 2 rotary dims of the head's {} (0 rotary dims is not "
                       "simulated)", m.attn.head_dim));
  }
  check_rotary_dims(r, "partial_rotary_factor", m);
  m.max_positions = 0;  // rotary positions: max_position_embeddings does not bound training sequences
  m.attn.qkv_bias = m.attn.out_bias = true;
  m.attn.qk_norm = r.boolean({"qk_layernorm"}, false);  // q_layernorm / k_layernorm: nn.LayerNorm(head_dim)
  m.mlp.gated = false;
  m.mlp.bias = true;
  m.mlp.act = read_activation(r, {"hidden_act"}, "gelu_new");
  m.norm = {NormKind::kLayerNorm, true, true};
  m.norms_per_layer = 1;
  m.parallel_residual = true;
  m.embed.tied = r.boolean({"tie_word_embeddings"}, false);
  m.embed.head_bias = true;
  m.dropout.embd = read_probability(r, {"embd_pdrop"}, 0.0);
  m.dropout.resid = read_probability(r, {"resid_pdrop"}, 0.0);
  m.dropout.attn = read_probability(r, {"attention_dropout"}, 0.0);
}

}  // namespace trainmem::config
