// Config reader for Falcon (falcon-rw-1b/7b, falcon-7b, falcon-40b/180b): transformers' FalconConfig. Every default
// is the one of configuration_falcon.py (transformers 5.x, the @strict dataclass of main; read at
// zucchini-nlp/transformers@3f83236, a fork of main), so that a config.json missing a key builds what transformers
// builds. The layouts are modeling_falcon.py's (5.x, zucchini-nlp/transformers@e241202): FalconAttention's
// query_key_value and _split_heads, FalconDecoderLayer's layer norms.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"
#include "trainmem/units.h"

namespace trainmem::config {

namespace {

// FalconDecoderLayer.__init__ / forward: which layer norms a layer has and whether attention and MLP run in
// parallel. Layouts transformers cannot run (an AttributeError or an unbound mlp_layernorm_out in forward) are
// refused here.
void read_falcon_layout(const KeyReader& r, bool new_arch, ModelSpec& m) {
  // parallel_attn: bool | None = True; num_ln_in_parallel_attn: int | None = None
  const bool parallel = r.boolean({"parallel_attn"}, true);
  const std::optional<uint64_t> num_ln = r.optional_integer({"num_ln_in_parallel_attn"}, 0, kMaxLayers);
  if (new_arch) {
    // "if config.num_ln_in_parallel_attn is None and config.new_decoder_architecture:
    //     config.num_ln_in_parallel_attn = 2"
    const uint64_t n = num_ln.value_or(2);
    // forward reads self.ln_attn (num_ln 2) or sets mlp_layernorm_out only when parallel_attn and num_ln == 1
    if (!parallel) {
      r.fail("parallel_attn", false,
             "true with \"new_decoder_architecture\": true (FalconDecoderLayer.forward has no layer norm to run "
             "otherwise: it registers input_layernorm and post_attention_layernorm but reads ln_attn/ln_mlp)");
    }
    if (n != 1 && n != 2) {
      r.fail("num_ln_in_parallel_attn", n,
             "1 or 2 with \"new_decoder_architecture\": true (FalconDecoderLayer.forward leaves mlp_layernorm_out "
             "unset otherwise)");
    }
    m.parallel_residual = true;
    m.norms_per_layer = n;  // ln_attn + ln_mlp, or one input_layernorm
    return;
  }
  if (parallel) {
    // __init__ registers ln_attn and ln_mlp for num_ln 2, but the old architecture's forward runs input_layernorm
    if (num_ln == 2u) {
      r.fail("num_ln_in_parallel_attn", 2,
             "not 2 without \"new_decoder_architecture\" (FalconDecoderLayer.forward runs input_layernorm, which "
             "__init__ does not register then)");
    }
    m.parallel_residual = true;
    m.norms_per_layer = 1;  // input_layernorm, shared by attention and MLP
    return;
  }
  m.parallel_residual = false;
  m.norms_per_layer = 2;  // post_attention_layernorm, then input_layernorm
}

}  // namespace

// transformers FalconConfig (configuration_falcon.py, 5.x): vocab_size=65024, hidden_size=4544,
// num_hidden_layers=32, num_attention_heads=71, num_ln_in_parallel_attn=None, hidden_dropout=0.0,
// attention_dropout=0.0, num_kv_heads=None, alibi=False, new_decoder_architecture=False, multi_query=True,
// parallel_attn=True, bias=False, max_position_embeddings=2048, ffn_hidden_size=None, activation="gelu",
// tie_word_embeddings=True. __post_init__: `n_embed = kwargs.pop("n_embed", None); self.hidden_size =
// self.hidden_size if n_embed is None else n_embed` (n_embed wins), num_kv_heads None -> num_attention_heads,
// ffn_hidden_size None -> hidden_size * 4. There is no attribute_map in 5.x: n_layer and n_head are not read.
// modeling_falcon.py hard-wires the rest: every FalconLinear has bias=config.bias, the layer norms are
// nn.LayerNorm (with bias), lm_head is nn.Linear(hidden_size, vocab_size, bias=False), and FalconModel always
// builds FalconRotaryEmbedding (head_dim = hidden_size // num_attention_heads), alibi or not.
void read_falcon(const KeyReader& r, ModelSpec& m) {
  constexpr std::string_view kDefaults = "transformers' FalconConfig";
  m.family = Family::kFalcon;
  m.embed.vocab_size = r.shape({"vocab_size"}, 65024, 1, kMaxVocab, kDefaults);
  m.hidden = r.shape({"n_embed", "hidden_size"}, 4544, 1, kMaxWidth, kDefaults);
  m.layers = r.shape({"num_hidden_layers"}, 32, 1, kMaxLayers, kDefaults);
  read_heads(r, {"num_attention_heads"}, 71, kDefaults, {"hidden_size"}, m.hidden, m.attn);
  const uint64_t NH = m.attn.heads;
  const uint64_t num_kv = r.optional_integer({"num_kv_heads"}, 1, kMaxHeads).value_or(NH);
  const bool new_arch = r.boolean({"new_decoder_architecture"}, false);
  const bool multi_query = r.boolean({"multi_query"}, true);  // ignored under new_decoder_architecture
  // FalconAttention.__init__: qkv_out_dim = (num_kv_heads * 2 + num_attention_heads) * head_dim (new
  // architecture), hidden_size + 2 * head_dim (multi_query), 3 * hidden_size (otherwise).
  if (new_arch) {
    // _split_heads: fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
    if (NH % num_kv != 0) {
      r.fail("num_kv_heads", num_kv,
             fmt::format("a divisor of \"num_attention_heads\" = {} (each key/value group serves NH / KV query "
                         "heads)", NH));
    }
    m.attn.kv_heads = num_kv;
    m.attn.falcon_qkv = FalconQkv::kGroups;
  } else if (multi_query) {
    m.attn.kv_heads = 1;  // self.num_kv_heads = ... else 1
    m.attn.falcon_qkv = FalconQkv::kMultiQuery;
  } else {
    // forward reshapes the keys to (batch, self.num_kv_heads, T, D) with self.num_kv_heads = config.num_kv_heads,
    // while _split_heads makes num_heads of them: any other value fails there
    if (num_kv != NH) {
      r.fail("num_kv_heads", num_kv,
             fmt::format("\"num_attention_heads\" = {} (or no value) with \"multi_query\": false and no "
                         "\"new_decoder_architecture\" (FalconAttention.forward reshapes the {} key heads of "
                         "_split_heads to num_kv_heads)", NH, NH));
    }
    m.attn.kv_heads = NH;
    m.attn.falcon_qkv = FalconQkv::kPerHead;
  }
  m.attn.fused_qkv = true;
  read_falcon_layout(r, new_arch, m);
  m.mlp.ffn = r.optional_integer({"ffn_hidden_size"}, 1, kMaxWidth).value_or(0);
  if (m.mlp.ffn == 0) m.mlp.ffn = checked_mul(m.hidden, uint64_t{4}, "ffn_hidden_size = hidden_size * 4");
  m.mlp.act = read_activation(r, {"activation"}, "gelu");  // FalconMLP: self.act = get_activation(config.activation)
  const bool bias = r.boolean({"bias"}, false);
  m.attn.qkv_bias = m.attn.out_bias = m.mlp.bias = bias;
  m.attn.alibi = r.boolean({"alibi"}, false);
  // FalconRotaryEmbedding (built in FalconModel for every config): dim = hidden_size // num_attention_heads
  m.attn.rotary_dim = m.attn.head_dim;
  check_rotary_dims(r, "num_attention_heads", m);
  // rotary or ALiBi positions: max_position_embeddings (read by the rotary embedding only) bounds nothing
  r.optional_integer({"max_position_embeddings"}, 1, kMaxPositions);
  m.max_positions = 0;
  m.norm = {NormKind::kLayerNorm, true, true};
  m.embed.tied = r.boolean({"tie_word_embeddings"}, true);
  m.dropout.attn = read_probability(r, {"attention_dropout"}, 0.0);
  m.dropout.resid = read_probability(r, {"hidden_dropout"}, 0.0);
}

}  // namespace trainmem::config
