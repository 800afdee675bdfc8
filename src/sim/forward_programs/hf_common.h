// Internal: pieces shared by the transformers model programs.
#pragma once

#include <functional>
#include <vector>

#include "../forward.h"

namespace trainmem::sim {

struct Rotary {
  T cos, sin;  // (1, T, R) in the hidden states' dtype
};
struct AttnOut {
  T output;   // (B, T, H, D) contiguous
  T weights;  // returned to the caller with the output (dropped by the decoder layer)
};

// The eager attention mask (B, 1, T, past + T): past is what c.kv holds (0 without a cache).
T eager_mask(Ctx& c, uint64_t B, uint64_t Tn, DType dt);
// `key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)` while
// generating (c.kv set): k and v become the layer's whole cached keys and values; without a cache they stay.
void kv_update(Ctx& c, uint64_t layer, T& k, T& v);
// The model's position_ids: (1, T) from cache_position (`position_ids = cache_position.unsqueeze(0)`), or the
// (B, T) ones generate() passes (c.position_ids), which the model takes as they are.
T model_position_ids(Ctx& c, uint64_t Tn);
// cos and sin of the rotary embedding, (rows, T, R) with rows the batch of the position ids (c.position_ids's,
// else 1).
Rotary rotary_embedding(Ctx& c, const T& inv_freq, uint64_t Tn, DType x_dtype);
T apply_rotary(Ctx& c, const T& x, const Rotary& r);
// q and k together, in apply_rotary_pos_emb's order. kPartialPairs (GPT-NeoX, Llama): with partial rotary both
// rotations, then both cats; none with full rotary. kEachAlways (Phi-3): q rotated and concatenated with its
// pass-through part, then k, the cat made even when that part is empty.
enum class RotaryCat { kPartialPairs, kEachAlways };
std::pair<T, T> apply_rotary_qk(Ctx& c, const T& q, const T& k, const Rotary& r,
                                RotaryCat cat = RotaryCat::kPartialPairs);
// The body of a rotary decoder's model after its embedding (GPTNeoXModel.forward, PhiModel.forward):
// position_ids, the eager causal mask (in the embeddings' dtype), `embed_dropout` (which returns the hidden states
// and rebinds what the caller's Python rebinds), cos/sin from `inv_freq`, the layers through run_layers(), then
// `final_norm`. The position ids, mask and cos/sin are the Python's locals: they live until the final norm is made.
using RotaryLayer = std::function<T(uint64_t layer, T hidden, const Rotary& rot, const T* mask)>;
T rotary_decoder_body(Ctx& c, const ModelSpec& m, const T& ids, DType embeds_dtype,
                      const std::function<T()>& embed_dropout, const T& inv_freq, const RotaryLayer& layer,
                      const std::function<T(const T&)>& final_norm);
T repeat_kv(Ctx& c, const T& x, uint64_t n_rep);
AttnOut eager_attention(Ctx& c, const T& q, const T& k, const T& v, const T* mask, uint64_t n_rep,
                        double dropout_p, const char* scale_op, double softcap);
// transformers' sdpa_attention_forward; `mask`: an attention mask the model built (the SDPA sliding-window mask)
T sdpa_attention(Ctx& c, const T& q, const T& k, const T& v, uint64_t n_rep, double dropout_p,
                 const T* mask = nullptr);
// The (B, 1, T, KV) bool sliding-window causal mask SDPA gets once the keys reach the window (an expanded view)
T sdpa_sliding_mask(Ctx& c, uint64_t B, uint64_t Tn, uint64_t window);
T activation(Ctx& c, Act a, const T& x);
// *ForCausalLM's head: logits = lm_head(hidden), through the input embedding `tied` when the model has no
// `head` parameter (tie_word_embeddings). `bias`: the head's bias parameter where it has one (Phi).
T lm_head_logits(Ctx& c, const LoadedModel& w, const T& hidden, const char* head, const char* tied, const char* what,
                 const char* bias = nullptr);
// The forward's result: the logits, and the loss when labels are given.
ForwardOut causal_lm_output(Ctx& c, T logits, const T* labels);
// GenericForSequenceClassification (modeling_layers.py): `score` (N, C) without bias over every position, pooled
// at the last non-pad token (pad_token_id given), and single_label_classification's CrossEntropyLoss.
ForwardOut sequence_classification_output(Ctx& c, const ModelSpec& m, const T& score, const T& hidden, const T& ids,
                                          const T* labels);
// torchtune's chunked output head and CEWithChunkedOutputLoss in place of the head and the loss above (the
// loss is c.loss_chunks > 0): no whole logits are returned.
ForwardOut chunked_causal_lm(Ctx& c, const LoadedModel& w, T hidden, const char* head, const char* tied,
                             const char* what, const T* labels);

// The sparse mixture-of-experts block of transformers 5.x (moe.cc): MixtralSparseMoeBlock's router
// (MixtralTopKRouter) and experts (MixtralExperts, eager), for every MoE family.
struct SharedExpert {  // qwen2_moe: shared_expert (Qwen2MoeMLP) and shared_expert_gate; nullptr: none
  const T* gate_proj = nullptr;
  const T* up_proj = nullptr;
  const T* down_proj = nullptr;
  const T* gate = nullptr;  // shared_expert_gate.weight (1, C)
};
struct MoeParams {
  const T& router;   // gate.weight (E, C)
  const T& gate_up;  // experts.gate_up_proj (E, 2F, C)
  const T& down;     // experts.down_proj (E, C, F)
  SharedExpert shared;
};
// Tokens each expert gets from `tokens` tokens under the routing assumption m.moe.routing.
std::vector<uint64_t> routed_tokens(const MoeSpec& moe, uint64_t tokens);
// hidden (B, T, C) -> (B, T, C)
T sparse_moe_block(Ctx& c, const ModelSpec& m, const MoeParams& p, const T& hidden);

// DeepseekV3MoE (moe.cc): gate (DeepseekV3TopkRouter), experts (MixtralExperts' layout), shared_experts.
struct DeepseekMoeParams {
  const T& router;       // gate.weight (E, C)
  const T& router_bias;  // gate.e_score_correction_bias (E,), a buffer
  const T& gate_up;      // experts.gate_up_proj (E, 2F, C)
  const T& down;         // experts.down_proj (E, C, F)
  const T& shared_gate;  // shared_experts.gate_proj.weight (S, C)
  const T& shared_up;    // shared_experts.up_proj.weight (S, C)
  const T& shared_down;  // shared_experts.down_proj.weight (C, S)
};
// hidden (B, T, C) -> (B, T, C)
T deepseek_moe_block(Ctx& c, const ModelSpec& m, const DeepseekMoeParams& p, const T& hidden);

// Liger-Kernel's chunking in fused_linear_cross_entropy_forward: rows of logits per chunk and chunks.
struct LigerChunking {
  uint64_t size = 0;
  uint64_t count = 0;
};
LigerChunking liger_chunking(uint64_t bt, uint64_t v, uint64_t h);
// Liger-Kernel's lce_forward with LigerFusedLinearCrossEntropyFunction in place of the head and the loss (the
// loss is c.liger_fused): the head's gradients are computed in forward, one chunk of logits at a time.
ForwardOut liger_fused_causal_lm(Ctx& c, const LoadedModel& w, T hidden, const char* head, const char* tied,
                                 const T* labels);

}  // namespace trainmem::sim
