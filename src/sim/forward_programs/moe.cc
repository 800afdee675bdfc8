// The sparse mixture-of-experts block of transformers 5.x, shared by every MoE family. Read from
// huggingface/transformers: models/mixtral/modeling_mixtral.py (MixtralTopKRouter, MixtralExperts,
// MixtralSparseMoeBlock, as of main in 2026), models/qwen2_moe/modular_qwen2_moe.py @001f85b and
// models/qwen3_moe/modular_qwen3_moe.py @00eb116, and integrations/moe.py @0261a46 (use_experts_implementation:
// config._experts_implementation "eager" runs the class's own forward, "grouped_mm" grouped_mm_experts_forward,
// both modelled here (MoeSpec::impl); "batched_mm" is not). The experts are one module with 3-D parameters
// gate_up_proj (E, 2F, C) and down_proj (E, C, F). DeepseekV3MoE (models/deepseek_v3/modular_deepseek_v3.py
// @000c33f): its own router and shared experts around the same experts (DeepseekV3NaiveMoe(MixtralExperts)).
// Routing is data-dependent: the tokens each expert gets come from MoeSpec::routing (routed_tokens()).
// B=micro-batch T=seq N=B*T tokens C=hidden F=expert ffn E=experts k=experts per token n=tokens of one expert
#include <vector>

#include "hf_common.h"
#include "../tp_ops.h"
#include "trainmem/error.h"
#include "trainmem/units.h"

namespace trainmem::sim {

std::vector<uint64_t> routed_tokens(const MoeSpec& moe, uint64_t tokens) {
  const uint64_t E = moe.experts, k = moe.top_k;
  std::vector<uint64_t> n(E, 0);
  if (moe.routing == MoeRouting::kWorst) {
    // every token's top-k are the same k experts: 0..k-1 get every token, the others none
    for (uint64_t e = 0; e < k && e < E; ++e) n[e] = tokens;
    return n;
  }
  // balanced: assignment a = token * k + slot goes to expert a % E (a token's k experts are distinct, k <= E):
  // floor(N*k / E) each, one more for the first (N*k) % E experts
  const uint64_t a = checked_mul(tokens, k, "token-expert assignments");
  for (uint64_t e = 0; e < E; ++e) n[e] = a / E + (e < a % E ? 1 : 0);
  return n;
}

namespace {

struct Routing {
  T logits;       // router_logits: returned by the router and bound to `_` in the block
  T top_k_weights;  // (N, k) float32
  T top_k_index;    // (N, k) int64
};

// MixtralTopKRouter.forward:
//   hidden_states = hidden_states.reshape(-1, self.hidden_dim)
//   router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
//   router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
//   router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
//   router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
//   return router_logits, router_top_value, router_indices
// Qwen2MoeTopKRouter.forward (modular_qwen2_moe.py @001f85b; Qwen3MoeTopKRouter inherits it): the logits are
// rebound to the probabilities, which are what it returns, and the renormalization depends on the config:
//   router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
//   router_logits = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
//   router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)  # (seq_len, top_k)
//   if self.norm_topk_prob:
//       router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
//   router_top_value = router_top_value.to(router_logits.dtype)   # float32 already
//   return router_logits, router_top_value, router_indices
Routing router(Ctx& c, const ModelSpec& m, const T& router_weight, const T& hidden) {
  Routing r;
  const T h = view(c, hidden, hidden.shape());
  TopK top;
  if (m.model_type == "mixtral") {
    r.logits = linear(c, h, router_weight, nullptr, "router F.linear");
    const T probs = softmax(c, to(c, r.logits, DType::kF32, "router_logits.float()"), std::nullopt, "router softmax");
    top = topk_last(c, probs, m.moe.top_k, "router topk");
  } else {
    r.logits = softmax(c, linear(c, h, router_weight, nullptr, "router F.linear"), DType::kF32, "router softmax");
    top = topk_last(c, r.logits, m.moe.top_k, "router topk");
  }
  if (m.moe.norm_topk_prob) {
    div_(c, top.values, sum_last_keepdim(c, top.values, "router_top_value.sum()"),
         "router_top_value /= (original_self)");
  }
  r.top_k_weights = std::move(top.values);
  r.top_k_index = std::move(top.indices);
  return r;
}

// MixtralExperts.forward (eager):
//   final_hidden_states = torch.zeros_like(hidden_states)
//   with torch.no_grad():
//       expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
//       expert_mask = expert_mask.permute(2, 1, 0)
//       expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
//   for expert_idx in expert_hit:
//       expert_idx = expert_idx[0]
//       if expert_idx == self.num_experts: continue
//       top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
//       current_state = hidden_states[token_idx]
//       gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
//       current_hidden_states = self.act_fn(gate) * up
//       current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
//       current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
//       final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
//   return final_hidden_states
T experts(Ctx& c, const ModelSpec& m, const MoeParams& p, const T& hidden, const T& top_k_index,
          const T& top_k_weights) {
  const uint64_t N = hidden.shape()[0], k = m.moe.top_k;
  const uint64_t F = m.moe.ffn;
  // Under expert parallelism (ep.h) the module holds E / ep experts (MoEParamShard sets module.num_experts to the
  // local count) and rank 0's are global experts [0, E/ep): their tokens are the first E/ep of the routing
  // assumption's counts. The EP router (ep_router_mask) sends every other assignment to the sentinel index
  // num_experts, which the loop skips (`if expert_idx == self.num_experts: continue`); one_hot takes it as one
  // more class (num_classes = num_experts + 1, as the 5.x expert loops that run under the ep_router sentinel
  // encode it: one_hot raises on an index >= num_classes).
  const uint64_t E = m.ep > 1 ? m.moe.experts / m.ep : m.moe.experts;
  const uint64_t classes = m.ep > 1 ? E + 1 : E;
  std::vector<uint64_t> counts = routed_tokens(m.moe, N);
  counts.resize(E);
  uint64_t local = 0;
  for (uint64_t n : counts) local += n;
  const bool sentinel = m.ep > 1 && local < checked_mul(N, k, "token-expert assignments");
  T final_hs = zeros_like(c, hidden, "experts final_hidden_states");
  T expert_mask, expert_hit;
  {
    // no_grad, integer tensors: one_hot (N, k, E) int64 (permute is a view); the (E,) int64 sum and the (E,) bool
    // comparison are temporaries of the expression; nonzero gives (hit, 1) int64
    expert_mask = c.e.empty(Shape{top_k_index.shape()[0], k, classes}, DType::kI64, Category::kActivations,
                            c.L("experts one_hot expert_mask"));
    T sum = c.e.empty(Shape{classes}, DType::kI64, Category::kActivations, c.L("expert_mask.sum(dim=(-1, -2))"));
    T hit = c.e.empty(Shape{classes}, DType::kBool, Category::kActivations, c.L("torch.greater(..., 0)"));
    sum.reset();
    uint64_t hits = sentinel ? 1 : 0;
    for (uint64_t n : counts) hits += n > 0 ? 1 : 0;
    expert_hit = c.e.empty(Shape{hits, 1}, DType::kI64, Category::kActivations, c.L("expert_hit nonzero()"));
  }
  T top_k_pos, token_idx, current_state, gate, up, cur;  // the loop's locals, rebound every iteration
  for (uint64_t e = 0; e < E; ++e) {
    const uint64_t n = counts[e];
    if (n == 0) continue;  // not in expert_hit
    { T eq = c.e.empty(Shape{}, DType::kBool, Category::kActivations, c.L("expert_idx == num_experts")); }
    {
      // torch.where(cond) is cond.nonzero().unbind(1): one (n, 2) int64 tensor and two column views of it
      T nz = c.e.empty(Shape{n, 2}, DType::kI64, Category::kActivations, c.L("torch.where(expert_mask[expert_idx])"));
      top_k_pos = c.e.view(nz, Shape{n}, Strides{2});
      token_idx = c.e.view(nz, Shape{n}, Strides{2});
    }
    current_state = index_rows(c, hidden, token_idx, "experts hidden_states[token_idx]");
    {
      std::vector<T> parts =
          split_last(c, linear(c, current_state, select0(c, p.gate_up), nullptr, "experts gate_up linear"), {F, F});
      gate = std::move(parts[0]);
      up = std::move(parts[1]);
    }
    cur = mul(c, activation(c, m.mlp.act, gate), up, "experts act(gate) * up");
    cur = linear(c, cur, select0(c, p.down), nullptr, "experts down linear");
    cur = mul(c, cur, index_pair_unsqueeze(c, top_k_weights, token_idx, top_k_pos, "top_k_weights[token_idx, top_k_pos, None]"),
              "experts * top_k_weights");
    index_add_(c, final_hs, token_idx, to(c, cur, final_hs.dtype(), "current_hidden_states.to(dtype)"));
  }
  if (sentinel) {
    // the sentinel's iteration: `expert_idx == self.num_experts` is a 0-d bool, then `continue`
    T eq = c.e.empty(Shape{}, DType::kBool, Category::kActivations, c.L("expert_idx == num_experts"));
  }
  return final_hs;
}

// EpRouterParallel.transform_output_post_forward (integrations/tensor_parallel.py, the DTensor backend; the
// router's forward hook under "ep_router"), rank 0 of ep, num_local_experts = num_experts // ep_size:
//   router_logits, router_scores, router_indices = output
//   non_local_mask = (router_indices // num_local_experts) != ep_rank
//   router_scores = router_scores.masked_fill(non_local_mask, 0.0)
//   router_indices = router_indices.masked_fill(non_local_mask, -1)
//   if num_local_experts > 1:
//       router_indices = torch.fmod(router_indices, num_local_experts)
//   else:
//       router_indices = router_indices.masked_fill(router_indices > 0, 0).masked_fill(router_indices < 0, -1)
//   router_indices = router_indices.masked_fill(router_indices == -1, num_local_experts)
//   return router_logits, router_scores, router_indices
// The masked scores are a new (N, k) tensor whose MaskedFillBackward0 saves the (N, k) bool mask; the integer
// ops build no graph. The previous scores and indices stay alive as long as something else holds them (the
// router's own graph), as without the hook.
void ep_router_mask(Ctx& c, const ModelSpec& m, T& scores, T& indices) {
  const Shape s = indices.shape();
  const uint64_t local = m.moe.experts / m.ep;
  auto i64 = [&](const char* what) { return c.e.empty(s, DType::kI64, Category::kActivations, c.L(what)); };
  auto mask = [&](const char* what) { return c.e.empty(s, DType::kBool, Category::kActivations, c.L(what)); };
  T non_local;
  {
    T div = i64("router_indices // num_local_experts");
    non_local = mask("non_local_mask = (...) != ep_rank");
  }
  scores = masked_fill(c, scores, non_local, "router_scores.masked_fill(non_local_mask, 0.0)");
  indices = i64("router_indices.masked_fill(non_local_mask, -1)");
  if (local > 1) {
    indices = i64("torch.fmod(router_indices, num_local_experts)");
  } else {
    { T gt = mask("router_indices > 0"); indices = i64("router_indices.masked_fill(router_indices > 0, 0)"); }
    { T lt = mask("router_indices < 0"); indices = i64(".masked_fill(router_indices < 0, -1)"); }
  }
  T eq = mask("router_indices == -1");
  indices = i64("router_indices.masked_fill(router_indices == -1, num_local_experts)");
}

// integrations/moe.py @0261a46 grouped_mm_experts_forward (experts_implementation="grouped_mm"; gate_up_proj is
// not transposed, MixtralExperts has no biases and no _apply_gate):
//   final_hidden_states = torch.zeros_like(hidden_states)
//   expert_ids = top_k_index.reshape(-1)
//   token_idx = torch.arange(num_tokens, device=device).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
//   perm = torch.argsort(expert_ids, stable=True)
//   inv_perm = torch.argsort(perm, stable=True)
//   sample_weights = top_k_weights.reshape(-1)  # (S,)
//   current_hidden_states = hidden_states[token_idx]  # (S, hidden_dim)
//   expert_ids_g = expert_ids[perm]
//   sample_weights_g = sample_weights[perm]
//   current_states_g = current_hidden_states[perm]
//   num_tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
//   offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
//   gate_up_out = torch._grouped_mm(current_states_g, self.gate_up_proj.transpose(-2, -1), offs=offsets)
//   gate, up = gate_up_out.chunk(2, dim=-1)
//   hidden_after_activation = self.act_fn(gate) * up
//   out_per_sample_g = torch._grouped_mm(hidden_after_activation, self.down_proj.transpose(-2, -1), offs=offsets)
//   out_per_sample_g = out_per_sample_g * sample_weights_g.unsqueeze(-1)
//   out_per_sample = out_per_sample_g[inv_perm]
//   final_hidden_states.index_add_(0, token_idx, out_per_sample.to(final_hidden_states.dtype))
//   return final_hidden_states
// Every local lives until the function returns. The routing decides nothing here but the values: the sizes
// are S = N*k rows whatever experts the tokens go to.
T experts_grouped_mm(Ctx& c, const ModelSpec& m, const MoeParams& p, const T& hidden, const T& top_k_index,
                     const T& top_k_weights) {
  const uint64_t N = hidden.shape()[0], E = m.moe.experts, k = m.moe.top_k, F = m.moe.ffn;
  const uint64_t S = checked_mul(N, k, "token-expert assignments");
  auto ints = [&](uint64_t n, DType dt, const char* what) {
    return c.e.empty(Shape{n}, dt, Category::kActivations, c.L(what));
  };
  T final_hs = zeros_like(c, hidden, "experts final_hidden_states");
  const T expert_ids = c.e.view(top_k_index, Shape{S}, Strides{1});
  T token_idx;
  {
    // arange (N,); .unsqueeze(1).expand(-1, k) are views; reshape(-1) copies unless k == 1 (then a view)
    T ar = ints(N, DType::kI64, "torch.arange(num_tokens)");
    token_idx = k == 1 ? c.e.view(ar, Shape{S}, Strides{1}) : ints(S, DType::kI64, "token_idx reshape(-1)");
  }
  auto argsort = [&](const char* what) {
    // argsort(stable=True) is sort(stable=True)'s indices: the sorted values are made first and dropped
    { T values = ints(S, DType::kI64, "argsort values"); }
    return ints(S, DType::kI64, what);
  };
  const T perm = argsort("perm = argsort(expert_ids)");
  const T inv_perm = argsort("inv_perm = argsort(perm)");
  const T sample_weights = view(c, top_k_weights, Shape{S});
  const T current_hidden_states = index_rows(c, hidden, token_idx, "experts hidden_states[token_idx]");
  const T expert_ids_g = ints(S, DType::kI64, "expert_ids[perm]");
  const T sample_weights_g = index_rows(c, sample_weights, perm, "sample_weights[perm]");
  const T current_states_g = index_rows(c, current_hidden_states, perm, "current_hidden_states[perm]");
  T num_tokens_per_expert;
  {
    T f = ints(S, DType::kF32, "expert_ids_g.float()");  // histc's argument, dropped when histc returns
    num_tokens_per_expert = ints(E, DType::kF32, "num_tokens_per_expert = torch.histc(...)");
  }
  const T offsets = ints(E, DType::kI32, "offsets = cumsum(..., dtype=int32)");
  T gate, up;
  {
    std::vector<T> parts = split_last(
        c, grouped_mm(c, current_states_g, transpose(c, p.gate_up, 1, 2), offsets, "experts grouped_mm gate_up"), {F, F});
    gate = std::move(parts[0]);
    up = std::move(parts[1]);
  }
  const T hidden_after_activation = mul(c, activation(c, m.mlp.act, gate), up, "experts act(gate) * up");
  T out_g = grouped_mm(c, hidden_after_activation, transpose(c, p.down, 1, 2), offsets, "experts grouped_mm down");
  out_g = mul(c, out_g, unsqueeze(c, sample_weights_g, -1), "out_per_sample_g * sample_weights_g");
  const T out_per_sample = index_rows(c, out_g, inv_perm, "out_per_sample_g[inv_perm]");
  index_add_(c, final_hs, token_idx, to(c, out_per_sample, final_hs.dtype(), "out_per_sample.to(dtype)"));
  return final_hs;
}

// Qwen2MoeMLP (GemmaMLP's forward): down_proj(act_fn(gate_proj(x)) * up_proj(x))
T shared_expert(Ctx& c, const ModelSpec& m, const SharedExpert& s, const T& x) {
  T h;
  {
    T a = activation(c, m.mlp.act, linear(c, x, *s.gate_proj, nullptr, "shared_expert.gate_proj"));
    T u = linear(c, x, *s.up_proj, nullptr, "shared_expert.up_proj");
    h = mul(c, a, u, "shared_expert act(gate) * up");
  }
  return linear(c, h, *s.down_proj, nullptr, "shared_expert.down_proj");
}

}  // namespace

// DeepseekV3MoE.forward (modular_deepseek_v3.py @000c33f):
//   residuals = hidden_states
//   orig_shape = hidden_states.shape
//   router_logits = self.gate(hidden_states)
//   topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
//   hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
//   hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
//   hidden_states = hidden_states + self.shared_experts(residuals)
//   return hidden_states
// DeepseekV3TopkRouter.forward:
//   hidden_states = hidden_states.view(-1, self.config.hidden_size)
//   router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
// route_tokens_to_experts (no torch.no_grad: its ops build graph; what no loss reaches is freed with its tensors):
//   router_logits = router_logits.sigmoid()
//   router_logits_for_choice = router_logits + self.gate.e_score_correction_bias
//   group_scores = (router_logits_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
//                   .topk(2, dim=-1)[0].sum(dim=-1))
//   group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
//   group_mask = torch.zeros_like(group_scores)
//   group_mask.scatter_(1, group_idx, 1)
//   score_mask = (group_mask.unsqueeze(-1).expand(-1, self.n_group, self.n_routed_experts // self.n_group)
//                 .reshape(-1, self.n_routed_experts))
//   scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
//   topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
//   topk_weights = router_logits.gather(1, topk_indices)
//   if self.norm_topk_prob:
//       denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
//       topk_weights /= denominator
//   topk_weights = topk_weights * self.routed_scaling_factor
//   return topk_indices, topk_weights
// The forward's router_logits (the linear's output) lives until the block returns. The experts each get the
// tokens of the routing assumption (routed_tokens()), which does not follow the group limit: the sizes do
// not depend on which groups the experts are in.
T deepseek_moe_block(Ctx& c, const ModelSpec& m, const DeepseekMoeParams& p, const T& x) {
  if (m.moe.top_k > m.moe.experts) throw Error("internal: top_k above the number of experts");
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], C = x.shape()[2];
  const uint64_t N = checked_mul(B, Tn, "tokens"), E = m.moe.experts, K = m.moe.top_k;
  const uint64_t G = m.moe.groups, TG = m.moe.topk_groups;
  T router_logits;
  {
    const T h = view(c, x, Shape{N, C});
    router_logits = linear(c, to(c, h, DType::kF32, "hidden_states.type(torch.float32)"),
                           to(c, p.router, DType::kF32, "gate.weight.type(torch.float32)"), nullptr, "gate F.linear");
  }
  T topk_indices, topk_weights;
  {
    const T scores = sigmoid(c, router_logits, "router_logits.sigmoid()");
    // From router_logits_for_choice to the last topk the graph leads to no loss (topk_indices are integers):
    // torch frees such a branch's nodes, and what they saved, with the last tensor that holds them. The
    // simulator keeps every recorded node until backward, so the branch runs without grad here and the two
    // tensors its nodes would keep are held for as long as those nodes live: group .topk(2)'s indices
    // (TopkBackward0, reached through group_scores' SumBackward1) and the masked_fill mask
    // (MaskedFillBackward0, held by scores_for_choice), both until the method returns.
    const bool grad = c.e.grad_mode;
    c.e.grad_mode = false;
    const T for_choice = add(c, scores, p.router_bias, "router_logits + e_score_correction_bias");
    T group_scores, top2_indices;
    {
      TopK top2 = topk_last(c, view(c, for_choice, Shape{N, G, E / G}), 2, "group .topk(2, dim=-1)");
      top2_indices = std::move(top2.indices);  // the tuple's [0]: the indices stay only as TopkBackward0's
      group_scores = sum_last(c, top2.values, "group_scores .sum(dim=-1)");
    }
    T group_idx;
    {
      TopK t = topk_last(c, group_scores, TG, "torch.topk(group_scores, k=topk_group)");
      group_idx = std::move(t.indices);
    }
    // torch.zeros_like(group_scores), then scatter_(1, group_idx, 1) in place (no new storage, no graph)
    const T group_mask = zeros_like(c, group_scores, "group_mask = zeros_like(group_scores)");
    const T score_mask = reshape(c, expand(c, unsqueeze(c, group_mask, -1), Shape{N, G, E / G}), Shape{N, E});
    T scores_for_choice, inverted;
    {
      T as_bool = c.e.empty(Shape{N, E}, DType::kBool, Category::kActivations, c.L("score_mask.bool()"));
      inverted = c.e.empty(Shape{N, E}, DType::kBool, Category::kActivations, c.L("~score_mask.bool()"));
      as_bool.reset();
      scores_for_choice = masked_fill(c, for_choice, inverted, "scores_for_choice masked_fill");
    }
    {
      TopK t = topk_last(c, scores_for_choice, K, "torch.topk(scores_for_choice, k=top_k)");
      topk_indices = std::move(t.indices);
    }
    c.e.grad_mode = grad;
    topk_weights = gather_last(c, scores, topk_indices, "router_logits.gather(1, topk_indices)");
    T denominator;
    if (m.moe.norm_topk_prob) {
      denominator = add_scalar(c, sum_last_keepdim(c, topk_weights, "topk_weights.sum(dim=-1, keepdim=True)"),
                               "denominator + 1e-20");
      div_(c, topk_weights, denominator, "topk_weights /= denominator");
    }
    topk_weights = mul_scalar(c, topk_weights, "topk_weights * routed_scaling_factor");
  }  // route_tokens_to_experts returns: its locals go
  const T hidden = view(c, x, Shape{N, C});
  const SharedExpert none{};
  const MoeParams e{p.router, p.gate_up, p.down, none};
  T out = m.moe.impl == MoeExperts::kGroupedMm ? experts_grouped_mm(c, m, e, hidden, topk_indices, topk_weights)
                                               : experts(c, m, e, hidden, topk_indices, topk_weights);
  out = view(c, out, Shape{B, Tn, C});
  // DeepseekV3MLP (Qwen2MoeMLP): down_proj(act_fn(gate_proj(x)) * up_proj(x)) on the block's input
  const T shared = shared_expert(c, m, SharedExpert{&p.shared_gate, &p.shared_up, &p.shared_down, nullptr}, x);
  return add(c, out, shared, "hidden_states + shared_experts(residuals)");
}

T sparse_moe_block(Ctx& c, const ModelSpec& m, const MoeParams& p, const T& x) {
  if (m.moe.top_k > m.moe.experts) throw Error("internal: top_k above the number of experts");
  const uint64_t B = x.shape()[0], Tn = x.shape()[1], C = x.shape()[2];
  const uint64_t N = checked_mul(B, Tn, "tokens");
  // MixtralSparseMoeBlock.forward (router_jitter_noise == 0: the config reader refuses other values), and
  // Qwen3MoeSparseMoeBlock.forward, the same without the jitter:
  //   hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
  //   _, top_k_weights, top_k_index = self.gate(hidden_states)
  //   hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)
  //   hidden_states = hidden_states.reshape(batch_size, sequence_length, hidden_dim)
  // Qwen2MoeSparseMoeBlock.forward runs its shared expert first and adds it, gated, at the end:
  //   shared_expert_output = self.shared_expert(hidden_states_reshaped)
  //   _, routing_weights, selected_experts = self.gate(hidden_states_reshaped)
  //   expert_output = self.experts(hidden_states_reshaped, selected_experts, routing_weights)
  //   shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states_reshaped)) * shared_expert_output
  //   expert_output += shared_expert_output
  //   expert_output = expert_output.reshape(batch_size, sequence_length, hidden_dim)
  const T hidden = view(c, x, Shape{N, C});
  const bool shared = p.shared.gate != nullptr;
  T shared_out;
  if (shared) shared_out = shared_expert(c, m, p.shared, hidden);
  Routing r = router(c, m, p.router, hidden);
  if (m.ep > 1) ep_router_mask(c, m, r.top_k_weights, r.top_k_index);  // the "ep_router" hook (ep.h)
  T out = m.moe.impl == MoeExperts::kGroupedMm ? experts_grouped_mm(c, m, p, hidden, r.top_k_index, r.top_k_weights)
                                               : experts(c, m, p, hidden, r.top_k_index, r.top_k_weights);
  if (m.ep > 1) {
    // "moe_tp_experts" (MoEExpertsParallel, is_expert_parallel=True): transform_inputs_pre_forward gives the
    // experts hidden_states = _AllReduceBackward.apply(hidden_states.to_local(), tp_group): identity forward (a
    // view), backward dist.all_reduce(grad) in place: no storage, nothing simulated. transform_output_post_forward:
    // DTensor.from_local(output, mesh, [Partial()]).redistribute(placements=(Replicate(),)).to_local(): the
    // functional all_reduce writes a new tensor of the output's shape (the local partial sums are dropped);
    // backward: _RedistributeBackward keeps a Replicate gradient for a Partial source (no division, no copy):
    // the identity, tp_all_reduce_forward's op.
    out = tp_all_reduce_forward(c, out, "moe_tp_experts all_reduce (Partial -> Replicate)");
  }
  if (shared) {
    shared_out = mul(c, sigmoid(c, linear(c, hidden, *p.shared.gate, nullptr, "shared_expert_gate"), "sigmoid(shared_expert_gate)"),
                     shared_out, "sigmoid(gate) * shared_expert_output");
    add_(c, out, shared_out);
  }
  return reshape(c, out, Shape{B, Tn, C});
}

}  // namespace trainmem::sim
