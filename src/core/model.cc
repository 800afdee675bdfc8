#include "trainmem/model.h"

#include "../families/registry.h"

namespace trainmem {

namespace {
constexpr NameRow<Impl> kImpls[] = {
    {Impl::kHf, "hf", "Hugging Face transformers' modeling_<model_type>.py"},
    {Impl::kNanoGpt, "nanogpt", "karpathy/nanoGPT model.py"},
    {Impl::kStack, "stack", "an nn.Sequential layer stack (model_type mlp)"},
};
constexpr NameRow<AttnImpl> kAttnImpls[] = {
    {AttnImpl::kEager, "eager", "softmax(QK^T)V as explicit ops"},
    {AttnImpl::kSdpa, "sdpa", "F.scaled_dot_product_attention"},
};
constexpr NameRow<Act> kActs[] = {
    {Act::kGeluNew, "gelu_new", ""},     {Act::kGeluFast, "gelu_fast", ""}, {Act::kGeluTanh, "gelu_pytorch_tanh", ""},
    {Act::kGeluErf, "gelu", ""},         {Act::kQuickGelu, "quick_gelu", ""}, {Act::kSilu, "silu", ""},
    {Act::kRelu, "relu", ""},            {Act::kSigmoid, "sigmoid", ""},
};
constexpr NameRow<MoeRouting> kMoeRoutings[] = {
    {MoeRouting::kBalanced, "balanced", "the B*T*k token-expert assignments spread evenly over the experts"},
    {MoeRouting::kWorst, "worst", "every token routed to the same k experts"},
};
constexpr NameRow<MoeExperts> kMoeExperts[] = {
    {MoeExperts::kEager, "eager", "MixtralExperts.forward: a loop over the experts that got tokens"},
    {MoeExperts::kGroupedMm, "grouped_mm", "grouped_mm_experts_forward: sorted pairs, two torch._grouped_mm"},
};
constexpr NameRow<Head> kHeads[] = {
    {Head::kCausalLm, "causal-lm", "...ForCausalLM: next-token logits over the vocabulary"},
    {Head::kMaskedLm, "masked-lm", "...ForMaskedLM: masked-token logits over the vocabulary"},
    {Head::kSeqCls, "seq-cls", "...ForSequenceClassification: num_labels logits per sequence"},
    {Head::kTokenCls, "token-cls", "...ForTokenClassification: num_labels logits per token"},
};
}  // namespace

std::span<const NameRow<Head>> name_table(Head) { return kHeads; }
std::string_view head_name(Head h) { return name_of(h); }
std::span<const NameRow<Impl>> name_table(Impl) { return kImpls; }
std::span<const NameRow<AttnImpl>> name_table(AttnImpl) { return kAttnImpls; }
std::span<const NameRow<Act>> name_table(Act) { return kActs; }
std::span<const NameRow<MoeRouting>> name_table(MoeRouting) { return kMoeRoutings; }
std::span<const NameRow<MoeExperts>> name_table(MoeExperts) { return kMoeExperts; }

std::string_view family_name(Family f) { return family_descriptor(f).name; }
std::string_view impl_name(Impl i) { return name_of(i); }
std::string_view attn_impl_name(AttnImpl a) { return name_of(a); }
std::string_view act_name(Act a) { return name_of(a); }
std::string_view moe_routing_name(MoeRouting r) { return name_of(r); }
std::string moe_routing_note(const ModelSpec& m) {
  if (m.moe.experts == 0) return std::string();
  return ", " + std::string(name_of(m.moe.routing)) + " MoE routing" +
         (m.moe.impl == MoeExperts::kGroupedMm ? ", grouped_mm experts" : "");
}

}  // namespace trainmem
