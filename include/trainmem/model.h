// ModelSpec: the nn.Module that training builds, fully resolved from a config (hf_config.h): every field
// that changes a parameter, a buffer or the forward computation. Families share one struct; the per-family
// tables (src/models/*.cc) read only the fields that apply to them.
// B=micro-batch T=seq C=hidden L=layers NH=heads KV=kv-heads D=head-dim F=ffn V=vocab E=experts
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainmem/names.h"

namespace trainmem {

// Which code builds and runs the model.
enum class Impl {
  kHf,       // Hugging Face transformers' modeling_<model_type>.py
  kNanoGpt,  // karpathy/nanoGPT model.py
  kStack,    // a plain stack of layers (model_type "mlp"), for allocator experiments (seed 003)
};

// The architecture family: which table of tensors and which forward pass.
enum class Family {
  kGpt2,     // GPT-2 (HF Conv1D layout) and nanoGPT (nn.Linear layout)
  kLlama,    // llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3
  kGptNeox,  // gpt_neox (Pythia)
  kOpt,      // opt
  kPhi,      // phi (phi-1, phi-1.5, phi-2)
  kFalcon,   // falcon (falcon-rw, falcon-7b, falcon-40b/180b layouts)
  kStack,    // mlp layer stack
  kBert,     // bert (an encoder: BertModel under a task head)
  kRoberta,  // roberta (BertModel's layers under RoBERTa's embeddings and heads)
  kT5,       // t5 (T5ForConditionalGeneration: an encoder stack and a decoder stack)
};

// The task head on top of the model (the class transformers builds: config.json's architectures[0], or --head).
enum class Head {
  kCausalLm,  // ...ForCausalLM / ...LMHeadModel: lm_head over the vocabulary, shifted labels
  kMaskedLm,  // ...ForMaskedLM: the MLM prediction head over the vocabulary, labels (B, T) with -100 where unmasked
  kSeqCls,    // ...ForSequenceClassification: num_labels logits per sequence, labels (B,)
  kTokenCls,  // ...ForTokenClassification: num_labels logits per token, labels (B, T)
};

// attn_implementation: "eager" (explicit softmax(QK^T)V) or "sdpa" (F.scaled_dot_product_attention).
enum class AttnImpl { kEager, kSdpa };

enum class NormKind { kLayerNorm, kRmsNorm };

// Activation functions by how they are computed, because that decides what autograd saves: a fused
// F.gelu saves its input once, transformers' NewGELUActivation is a chain of elementwise ops that each save.
enum class Act {
  kGeluNew,   // "gelu_new": 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*pow(x,3)))) as separate torch ops
  kGeluFast,  // "gelu_fast": 0.5*x*(1+tanh(x*0.7978845608*(1+0.044715*x*x))) as separate torch ops
  kGeluTanh,  // "gelu_pytorch_tanh": F.gelu(x, approximate="tanh"), one fused op
  kGeluErf,   // "gelu": F.gelu(x) / nn.GELU(), exact erf form, one fused op
  kQuickGelu, // "quick_gelu": x * sigmoid(1.702 * x)
  kSilu,      // "silu" / "swish": F.silu
  kRelu,      // "relu"
  kSigmoid,
};

struct EmbeddingSpec {
  uint64_t vocab_size = 0;          // V: rows of the token embedding and of lm_head
  uint64_t position_rows = 0;       // rows of a learned position table; 0 when positions are rotary
  bool tied = false;                // lm_head.weight is the token embedding (named_parameters lists it once)
  uint64_t proj_dim = 0;            // OPT word_embed_proj_dim when it differs from C (project_in/project_out)
  bool scaled_by_sqrt_hidden = false;  // Gemma multiplies the embeddings by sqrt(C)
  // lm_head has a bias (V,): Phi's PhiForCausalLM builds nn.Linear(hidden_size, vocab_size, bias=True); no
  // config key sets it. Listed even when the weight is tied (the bias is the head's own parameter).
  bool head_bias = false;
};

// How FalconAttention._split_heads (modeling_falcon.py) cuts the fused query_key_value output: by kv group,
// `view(B, T, -1, NH // KV + 2, D)` (new_decoder_architecture); per head q|k|v, `view(B, T, NH, 3, D)`
// (multi_query=False); or NH query heads then one key and one value head, `view(B, T, NH + 2, D)` (multi_query).
// kNone: every other family.
enum class FalconQkv { kNone, kGroups, kPerHead, kMultiQuery };

struct AttentionSpec {
  uint64_t heads = 0;       // NH
  uint64_t kv_heads = 0;    // KV (== NH without grouped-query attention)
  uint64_t head_dim = 0;    // D (usually C / NH, explicit for Gemma and Qwen3)
  bool fused_qkv = false;   // one (NH+2KV)*D projection (GPT-2 c_attn, NeoX query_key_value, Phi-3 qkv_proj)
  bool qkv_bias = false;
  bool out_bias = false;
  bool qk_norm = false;     // Qwen3: RMSNorm(D) on q and k
  uint64_t rotary_dim = 0;  // rotated dims per head (partial rotary for NeoX/Phi); 0 when not rotary
  double softcap = 0.0;     // Gemma2 attn_logit_softcapping; 0 = off
  // The window of the layers that attend to a sliding window (config sliding_window; 0: no layer does). It
  // changes what generate()'s DynamicCache keeps (DynamicSlidingWindowLayer) once a sequence reaches it.
  uint64_t sliding_window = 0;
  // Gemma3 (gemma3_text) layer_types: true where layer i is "sliding_attention" (its own mask and its own rotary
  // table), false for "full_attention". Empty for every other family (one mask, one rotary table).
  std::vector<bool> sliding_layers;
  // Falcon's config alibi (falcon-rw-1b/7b): ALiBi biases added to the attention scores (build_alibi_tensor) in
  // place of rotary positions, which FalconModel still computes. false for every other family.
  bool alibi = false;
  FalconQkv falcon_qkv = FalconQkv::kNone;  // Falcon's query_key_value layout (above)
  // DeepSeek-V3 multi-head latent attention (DeepseekV3Attention, model_type deepseek_v3); kv_lora_rank 0: none.
  // heads stays NH, head_dim is qk_head_dim = qk_nope + qk_rope (queries and keys), rotary_dim is qk_rope.
  struct Mla {
    uint64_t q_lora_rank = 0;   // config q_lora_rank; 0: None (one q_proj instead of q_a_proj / q_b_proj)
    uint64_t kv_lora_rank = 0;  // config kv_lora_rank
    uint64_t qk_nope = 0;       // config qk_nope_head_dim
    uint64_t qk_rope = 0;       // config qk_rope_head_dim
    uint64_t v_head_dim = 0;    // config v_head_dim
    bool interleave = false;    // config rope_interleave: apply_rotary_pos_emb_interleave
  } mla;
};

struct MlpSpec {
  uint64_t ffn = 0;            // F: intermediate size
  bool gated = false;          // down(act(gate(x)) * up(x)) instead of fc2(act(fc1(x)))
  bool fused_gate_up = false;  // Phi-3 gate_up_proj
  bool bias = false;
  Act act = Act::kGeluTanh;
};

// Which experts the router picks is data-dependent; the step simulator needs per-expert token counts, so they
// are an explicit assumption (Scenario field moe_routing).
enum class MoeRouting {
  kBalanced,  // the B*T*k assignments spread as evenly as possible over the E experts, remainder to the lowest
  kWorst,     // every token routed to the same k experts (experts 0..k-1 each get all B*T tokens)
};

// transformers 5.x `experts_implementation` (integrations/moe.py): the experts' eager loop, or
// grouped_mm_experts_forward (sorted token-expert pairs, two torch._grouped_mm calls).
enum class MoeExperts { kEager, kGroupedMm };

struct MoeSpec {
  uint64_t experts = 0;  // E; 0 = a dense MLP
  uint64_t top_k = 0;    // experts per token
  MoeRouting routing = MoeRouting::kBalanced;
  MoeExperts impl = MoeExperts::kEager;
  uint64_t ffn = 0;             // F of each expert (mixtral: intermediate_size; qwen*_moe: moe_intermediate_size)
  uint64_t shared_ffn = 0;      // qwen2_moe shared_expert_intermediate_size (a gated shared expert); 0: none
  bool norm_topk_prob = true;   // the router renormalizes the top-k weights (mixtral always; qwen*_moe: the key)
  uint64_t sparse_step = 1;     // qwen*_moe decoder_sparse_step: layer l is sparse when (l + 1) % step == 0
  std::vector<uint64_t> dense_layers;  // qwen*_moe mlp_only_layers: layers with a dense MLP
  // deepseek_v3 group-limited routing (DeepseekV3MoE.route_tokens_to_experts): n_group groups of experts, the
  // top topk_group of them kept per token. 0: no grouped routing (every other family).
  uint64_t groups = 0;
  uint64_t topk_groups = 0;
};

struct NormSpec {
  NormKind kind = NormKind::kLayerNorm;
  bool bias = true;     // LayerNorm bias (nanoGPT bias=False drops it; RMSNorm has none)
  bool affine = true;   // OPT layer_norm_elementwise_affine
};

// Dropout probabilities in training mode (0 = the op is skipped: F.dropout with p=0 returns its input).
struct DropoutSpec {
  double embd = 0.0;    // after the embeddings (GPT-2 embd_pdrop, nanoGPT dropout)
  double attn = 0.0;    // on the attention probabilities (attn_pdrop, attention_dropout)
  double resid = 0.0;   // after the attention and MLP output projections (resid_pdrop, hidden_dropout)
  double act = 0.0;     // after the MLP activation (OPT activation_dropout)
};

// An encoder-decoder model (T5): the decoder's stack and the relative position buckets (T5Config). Zero
// for every decoder-only family.
struct EncDecSpec {
  uint64_t decoder_layers = 0;    // num_decoder_layers (T5's default: num_layers)
  uint64_t rel_buckets = 0;       // relative_attention_num_buckets: rows of relative_attention_bias
  uint64_t rel_max_distance = 0;  // relative_attention_max_distance (the buckets' range; no tensor shape)
};

// One layer of the "mlp" layer stack (seed 003's nn.Sequential experiments).
enum class StackOp { kLinear, kRelu, kGelu, kSigmoid, kLayerNorm };
struct StackLayer {
  StackOp op = StackOp::kLinear;
  uint64_t out_features = 0;  // kLinear only
  bool bias = true;           // kLinear and kLayerNorm
};

struct ModelSpec {
  std::string name;        // preset name or file path
  std::string model_type;  // as in config.json
  std::string source;      // where the config comes from
  Impl impl = Impl::kHf;
  Family family = Family::kGpt2;
  AttnImpl attn_impl = AttnImpl::kSdpa;

  uint64_t hidden = 0;          // C
  uint64_t layers = 0;          // L
  uint64_t max_positions = 0;   // longest sequence the model accepts (learned tables); 0 = unbounded
  EmbeddingSpec embed;
  AttentionSpec attn;
  MlpSpec mlp;
  MoeSpec moe;
  NormSpec norm;
  uint64_t norms_per_layer = 2;  // Gemma2 has 4
  bool final_norm = true;        // OPT-350m (do_layer_norm_before=False) has none
  bool pre_norm = true;          // OPT do_layer_norm_before
  bool parallel_residual = false;  // NeoX use_parallel_residual
  double final_softcap = 0.0;    // gemma3_text final_logit_softcapping (None: 0 = off); gemma2's is in llama.cc
  DropoutSpec dropout;           // probabilities used in model.train()
  EncDecSpec encdec;             // t5 only: m.layers is the encoder's num_layers
  // Tensor-parallel ranks (tp.h): >1 when this spec is one rank's local model under transformers' tp_plan="auto"
  // (heads, kv_heads, ffn already divided; lm_head holds vocab_size / tp rows). 1: no tensor parallelism.
  uint64_t tp = 1;
  // Sequence parallelism with tp (sp.h): PyTorch-native TP + SP (torchtitan's plan on transformers' modules); the
  // residual stream holds seq / tp tokens, embed_tokens vocab_size / tp rows. false: transformers' tp_plan.
  bool sp = false;
  // Expert-parallel ranks (ep.h): >1 when this spec is one rank's local model under DistributedConfig(tp_size=ep,
  // ep_size=ep): moe.experts stays the global E (the replicated router's), the experts' tensors hold E / ep.
  uint64_t ep = 1;

  // The task head and its size. Every decoder family defaults to kCausalLm; an encoder to its config's
  // architectures[0] (BertForMaskedLM -> kMaskedLm). num_labels: PreTrainedConfig's (len(id2label), else
  // num_labels, default 2), read for the classification heads only.
  Head head = Head::kCausalLm;
  uint64_t num_labels = 2;
  // BERT-style embeddings: token_type_embeddings rows (type_vocab_size); 0 for every other family.
  uint64_t type_vocab = 0;
  // RoBERTa: position ids start at padding_idx + 1 (create_position_ids_from_input_ids); 0 for BERT.
  uint64_t position_offset = 0;
  uint64_t pad_token_id = 0;  // RoBERTa: create_position_ids_from_input_ids' padding_idx
  double classifier_dropout = 0.0;  // BERT classifier_dropout (None: hidden_dropout_prob)

  // model_type "mlp" only
  uint64_t stack_input = 0;
  std::vector<StackLayer> stack;
};

// Whether decoder layer `l` has a sparse MoE block (Qwen2MoeDecoderLayer: `layer_idx not in mlp_only_layers and
// num_experts > 0 and (layer_idx + 1) % decoder_sparse_step == 0`; every layer of a mixtral).
inline bool is_moe_layer(const ModelSpec& m, uint64_t l) {
  if (m.moe.experts == 0 || (l + 1) % m.moe.sparse_step != 0) return false;
  for (uint64_t d : m.moe.dense_layers) {
    if (d == l) return false;
  }
  return true;
}

std::span<const NameRow<Impl>> name_table(Impl);
std::span<const NameRow<AttnImpl>> name_table(AttnImpl);
std::span<const NameRow<Act>> name_table(Act);
std::span<const NameRow<MoeRouting>> name_table(MoeRouting);
std::span<const NameRow<MoeExperts>> name_table(MoeExperts);
std::span<const NameRow<Head>> name_table(Head);

std::string_view family_name(Family f);
std::string_view impl_name(Impl i);
std::string_view attn_impl_name(AttnImpl a);
std::string_view act_name(Act a);
std::string_view moe_routing_name(MoeRouting r);
std::string_view head_name(Head h);
// A classifier's labels (--num-labels, a config's num_labels or id2label): far above any label set, and small
// enough that every product with a batch and a sequence stays checked, not slow.
inline constexpr uint64_t kMaxNumLabels = uint64_t{1} << 24;
// ", balanced MoE routing" for a mixture-of-experts model (the assumption its numbers rest on), "" otherwise.
std::string moe_routing_note(const ModelSpec& m);

}  // namespace trainmem
