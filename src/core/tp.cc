// Tensor parallelism per rank under transformers 5.x's own TP (tp_plan="auto"); see tp.h.
//
// The plan, for the model types modelled here (each configuration_<type>.py @008e574 / @001f85b, identical):
//   base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
//     "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
//     "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
// and <Type>ForCausalLM._tp_plan = {"lm_head": "colwise_gather_output"} (5.x, e.g. Qwen3ForCausalLM /
// Qwen2ForCausalLM, generated from LlamaForCausalLM). embed_tokens and the norms have no entry: replicated
// ("Tensor sharding plan for ... not found, using default 'replicate' plan", shard_and_distribute_module).
// Shards (tensor_parallel.py, 5.x): ColwiseParallel.shard_tensor: weight get_tensor_shard(..., -2), bias (-1);
// RowwiseParallel.shard_tensor: weight get_tensor_shard(..., -1), bias param[...] (whole).
#include "trainmem/tp.h"

#include <fmt/format.h>

#include <string>

#include "trainmem/ep.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

// The modules of base_model_tp_plan / _tp_plan, by the name after "model.layers.N." (or the top-level name).
TpStyle module_style(std::string_view module) {
  for (std::string_view m : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}) {
    if (module.ends_with(m)) return TpStyle::kColwise;
  }
  for (std::string_view m : {"self_attn.o_proj", "mlp.down_proj"}) {
    if (module.ends_with(m)) return TpStyle::kRowwise;
  }
  if (module == "lm_head") return TpStyle::kColwiseGatherOutput;
  return TpStyle::kReplicated;
}

}  // namespace

TpStyle tp_style(const ModelSpec& m, std::string_view name) {
  (void)m;  // one plan for every model type tp_check accepts
  // _get_parameter_tp_plan: the module's entry covers "<module>.weight" and "<module>.bias" (is_weight=True)
  const size_t dot = name.rfind('.');
  if (dot == std::string_view::npos) return TpStyle::kReplicated;
  const std::string_view module = name.substr(0, dot);
  if (module != "lm_head" && module.substr(0, 13) != "model.layers.") return TpStyle::kReplicated;
  return module_style(module);
}

void tp_check(const ModelSpec& m, uint64_t tp) {
  if (tp <= 1) return;
  if (m.family != Family::kLlama || m.impl != Impl::kHf) {
    throw Error(fmt::format("{}: tensor parallelism is simulated for the Llama-shaped decoders (llama, mistral, "
                            "qwen2: transformers' base_model_tp_plan); {} is a {} model",
                            tp, m.name, family_name(m.family)));
  }
  if (m.model_type != "llama" && m.model_type != "mistral" && m.model_type != "qwen2") {
    throw Error(fmt::format("{}: {} (model_type {}) has its own tensor-parallel plan (q/k norms, fused or "
                            "packed projections, experts or sandwich norms), which is not simulated yet; llama, "
                            "mistral and qwen2 are", tp, m.name, m.model_type));
  }
  if (m.moe.experts > 0 || m.attn.fused_qkv || m.mlp.fused_gate_up || !m.mlp.gated || m.attn.qk_norm) {
    throw Error(fmt::format("{}: {} is not the plain Llama layout the plan shards", tp, m.name));
  }
  tp_check_head_and_shards(m, tp, true);
}

void tp_check_head_and_shards(const ModelSpec& m, uint64_t tp, bool dense_mlp) {
  if (m.head != Head::kCausalLm) {
    throw Error(fmt::format("{}: only the causal-LM head (lm_head: colwise_gather_output) is simulated; {} "
                            "has another head", tp, m.name));
  }
  if (m.embed.tied) {
    // lm_head is colwise_gather_output while embed_tokens is replicated: one tied tensor cannot be both, and
    // how 5.x's loading resolves that was not read
    throw Error(fmt::format("{}: {} ties lm_head to embed_tokens (tie_word_embeddings); the plan shards "
                            "lm_head and replicates embed_tokens, and what transformers does with the tied tensor "
                            "is not simulated", tp, m.name));
  }
  // get_tensor_shard gives ceil(n / tp) rows to the first ranks and fewer (or none) to the last: uneven shards
  // that the attention's view(..., -1, head_dim) with config-wide num_key_value_groups, and _AllGather's
  // empty_like(x) list, do not handle. Refused rather than simulated as if even.
  auto divides = [&](const char* key, uint64_t n) {
    if (n % tp != 0) {
      throw Error(fmt::format("{}: {} = {} of {} is not divisible by {}: transformers' get_tensor_shard would "
                              "give uneven shards (ceil(n/tp) rows to the first ranks), which is not simulated",
                              tp, key, n, m.name, tp));
    }
  };
  divides("num_attention_heads", m.attn.heads);
  divides("num_key_value_heads", m.attn.kv_heads);
  if (dense_mlp) divides("intermediate_size", m.mlp.ffn);
  divides("vocab_size", m.embed.vocab_size);
}

void apply_tensor_parallel(ModelSpec& m, uint64_t tp) {
  if (tp <= 1) return;
  tp_check(m, tp);
  // head_dim stays (LlamaAttention: hidden_shape = (*input_shape, -1, self.head_dim), the local heads inferred);
  // num_key_value_groups = num_attention_heads // num_key_value_heads (from the config) equals the local ratio
  m.attn.heads /= tp;
  m.attn.kv_heads /= tp;
  m.mlp.ffn /= tp;
  m.tp = tp;
}

void mark_tp_shards(const ModelSpec& local, Inventory& inv) {
  if (local.tp <= 1) return;
  for (TensorRow& r : inv.parameters) {
    const TpStyle s = tp_style(local, r.name);
    const bool bias = r.name.ends_with(".bias");
    switch (s) {
      case TpStyle::kReplicated: r.tp_dim = -1; break;
      case TpStyle::kColwise:
      case TpStyle::kColwiseGatherOutput: r.tp_dim = 0; break;  // Shard(-2) of (out, in); a bias Shard(-1) = dim 0
      case TpStyle::kRowwise: r.tp_dim = bias ? -1 : 1; break;   // Shard(-1) of (out, in); the bias replicated
    }
    // sequence parallelism (sp.h): embed_tokens is RowwiseParallel on nn.Embedding, Shard(0) of its (V, C) weight
    if (local.sp && r.name == "model.embed_tokens.weight") r.tp_dim = 0;
  }
}

TpSplit tp_split(const ModelSpec& local) {
  Inventory inv = build_inventory(local);
  mark_tp_shards(local, inv);
  mark_ep_shards(local, inv);  // expert parallelism (ep.h): the experts' Shard(0)
  TpSplit t;
  for (const TensorRow& r : inv.parameters) (r.tp_dim >= 0 ? t.sharded : t.replicated) += r.elems.value;
  return t;
}

}  // namespace trainmem
