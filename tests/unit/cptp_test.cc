// --cp C --tp T: context parallel composed with tensor parallel, one rank (CP rank 0, TP rank 0), as accelerate runs
// it (16cb6eb examples/torch_native_parallelism/nd_parallel.py: ParallelismConfig(dp_shard_size, tp_size, cp_size),
// its mesh ["dp_replicate", "dp_shard", "cp", "sp", "tp"] (parallelism_config.py _get_mesh), the model sharded by
// transformers' tp_plan="auto" on mesh["tp"], the batch by context_parallel on mesh["cp"], FSDP2 on the flattened
// "dp_shard_cp"). The claims, each checked against the single-axis simulations already validated or against
// figures worked here by hand:
//  - TP shapes the model: the rank's parameters (and FSDP2's shards of them) are plain --tp's, whatever the CP;
//  - CP shapes the batch: every op outside attention is plain --tp's at --seq T / C, byte for byte;
//  - the ring runs on the TP-local q, k, v ((B, H/T, L, D) plain tensors): its buffers are plain --cp's for a model
//    of H/T heads and Hk/T KV heads of the same head_dim;
//  - --cp 1 and --tp 1 are the single-axis paths, byte for byte.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/nccl.h"
#include "trainmem/plan.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

// TinyLlama's shapes (hidden 2048, 32 heads and 4 KV heads of 64, intermediate 5632, vocabulary 32000), two
// layers, batch 1, bf16 autocast (SDPA's flash kernel), as cp_test.cc runs them.
// With --cp above 1, CP rank 0 (--cp-rank 0): the derivations here are rank 0's ring (the other ranks, and the
// choice of the worst, are cp_test.cc's).
Scenario tiny(uint64_t seq, std::initializer_list<std::pair<const char*, std::string>> extra = {}) {
  Scenario s = testing::tiny_llama(seq, extra);
  if (s.train.cp > 1 && !s.train.cp_rank) set_field(s, "cp_rank", "0");
  return s;
}

using Ev = std::tuple<int, std::string, uint64_t>;  // (event kind, label, bytes)

// Every event (all categories) in order, as (kind, label, bytes)
std::vector<Ev> all_events(const Estimate& e) {
  std::vector<Ev> out;
  for (const Event& ev : e.sim->timeline.events) {
    out.emplace_back(static_cast<int>(ev.kind), std::string(ev.label.what), ev.bytes.value);
  }
  return out;
}

// The ring's own buffers: the events labelled "cp ..." (cp_attention.cc), with their phase
std::vector<std::tuple<int, std::string, uint64_t, int>> ring_events(const Estimate& e) {
  std::vector<std::tuple<int, std::string, uint64_t, int>> out;
  for (const Event& ev : e.sim->timeline.events) {
    const std::string_view w(ev.label.what);
    if (w.starts_with("cp ") || w.starts_with("recompute: cp ")) {
      out.emplace_back(static_cast<int>(ev.kind), std::string(w), ev.bytes.value, static_cast<int>(ev.phase));
    }
  }
  return out;
}

// One category's events outside attention's SDPA call: without the sdpa node's tensors and the copy that ring
// attention's contiguous output makes of transformers' transpose(1, 2).contiguous() (cp_test.cc derives it)
std::vector<Ev> outside_attention(const Estimate& e, Category c) {
  std::vector<Ev> out;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.category != c) continue;
    const std::string_view w(ev.label.what);
    if (w.find("sdpa") != std::string_view::npos || w == "attn output contiguous") continue;
    out.emplace_back(static_cast<int>(ev.kind), std::string(w), ev.bytes.value);
  }
  return out;
}

// The rank's communicators as (kind, ranks, stride between members)
using Group = std::tuple<ProcessGroup::Kind, uint64_t, uint64_t>;
std::vector<Group> groups_of(const TrainSetup& s) {
  std::vector<Group> out;
  for (const ProcessGroup& p : process_groups(s)) out.emplace_back(p.kind, p.ranks, p.stride);
  return out;
}

// The field of the FieldError that resolving and simulating `s` throws, "accepted" when none
std::string refused_field(const Scenario& s) {
  try {
    run(s);
  } catch (const FieldError& e) {
    return std::string(e.field());
  }
  return "accepted";
}

uint64_t allocs_labelled(const Estimate& e, std::string_view what, uint64_t bytes) {
  uint64_t n = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && std::string_view(ev.label.what) == what) {
      EXPECT_EQ(ev.bytes.value, bytes) << what;
      ++n;
    }
  }
  return n;
}

TEST(CpTpSim, TheRanksParametersAreTpsAndItsStatesDoNotDependOnCp) {
  const Estimate ct = run(tiny(256, {{"cp", "2"}, {"tp", "2"}}));
  const Estimate tp = run(tiny(256, {{"tp", "2"}}));
  EXPECT_EQ(ct.model.attn.heads, 16u);  // 32 / 2 local heads
  EXPECT_EQ(ct.model.attn.kv_heads, 2u);
  EXPECT_EQ(ct.state.weights.value, tp.state.weights.value);
  EXPECT_EQ(ct.state.gradients.value, tp.state.gradients.value);
  EXPECT_EQ(ct.state.optimizer_state.value, tp.state.optimizer_state.value);
  // by hand, fp32 weights of TP rank 0 (tp.cc's plan): embed_tokens 32000 x 2048 and the norms whole; per layer
  // q 1024 x 2048, k and v 128 x 2048, o 2048 x 1024, gate and up 2816 x 2048, down 2048 x 2816; lm_head 16000 rows
  const uint64_t layer = 1024 * 2048 + 2 * 128 * 2048 + 2048 * 1024 + 3 * 2816 * 2048 + 2 * 2048;
  const uint64_t params = 32000ull * 2048 + 2 * layer + 2048 + 16000ull * 2048;
  EXPECT_EQ(ct.state.weights.value, 4 * params);
}

// Derivation (cp_test.cc's, with TP's local model): context_parallel shards input_ids, labels and position_ids to
// T / C tokens, so every module but attention sees the tensors of a --tp run at T / C; attention's node saves the
// local q, k, v, the merged output and logsumexp, of that run's shapes; rank 0's ring output is a contiguous
// (B, H/tp, L, D) tensor, so transformers' transpose(1, 2).contiguous() is a copy that o_proj saves:
// B x L x (H / tp) x D x 2 bytes more per layer.
TEST(CpTpSim, ARankRunsTheTpModelAtSeqOverCpPlusOneOutputCopyPerLayer) {
  const uint64_t layers = 2, B = 1, L = 128, H = 32 / 2, D = 64;
  const Estimate ct = run(tiny(256, {{"cp", "2"}, {"tp", "2"}}));
  const Estimate local = run(tiny(128, {{"tp", "2"}}));
  EXPECT_EQ(ct.setup.seq, 128u);
  EXPECT_EQ(ct.setup.cp_seq, 256u);
  EXPECT_EQ(ct.memory.steady_state.value, local.memory.steady_state.value);
  EXPECT_EQ(ct.peak.saved_activations.value, local.peak.saved_activations.value + layers * B * L * H * D * 2);
  EXPECT_EQ(layers * B * L * H * D * 2, 524288u);
  // every op outside SDPA, byte for byte and in order: the activations (TP's all-reduce clones and lm_head's
  // all-gathered logits included), the inputs, the autocast copies and the weights' gradients. (The backward's
  // gradients differ at attention's boundary as plain CP's do: CpTpSim.CpAddsUnderTpWhatItAddsWithoutTp.)
  for (Category c : {Category::kActivations, Category::kInputs, Category::kWeightCopies, Category::kGradients}) {
    const std::vector<Ev> a = outside_attention(ct, c), b = outside_attention(local, c);
    EXPECT_FALSE(a.empty()) << category_name(c);
    EXPECT_EQ(a, b) << category_name(c);
  }
}

// (kind, label, bytes) -> count, over one category's events
std::map<Ev, int64_t> counts(const Estimate& e, Category c) {
  std::map<Ev, int64_t> m;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.category == c) ++m[Ev{static_cast<int>(ev.kind), std::string(ev.label.what), ev.bytes.value}];
  }
  return m;
}
// What `with` has more (positive) or less (negative) than `without`, event by event
std::map<Ev, int64_t> delta(const Estimate& with, const Estimate& without, Category c) {
  std::map<Ev, int64_t> d = counts(with, c);
  for (const auto& [k, n] : counts(without, c)) d[k] -= n;
  std::erase_if(d, [](const auto& kv) { return kv.second == 0; });
  return d;
}

// In every category, what --cp 2 adds to (and removes from) a --tp 2 rank at --seq T / 2 is exactly what it adds
// to a single GPU of a model with that rank's heads (16 heads, 2 KV heads of 64) at T / 2: the ring's buffers,
// its output and the copy of it, its one dK/dV buffer in place of the flash backward's dk and dv, and nothing
// else. The TP parts (the all-reduce clones, lm_head's all-gather, the local MLP) cancel in neither.
TEST(CpTpSim, CpAddsUnderTpWhatItAddsWithoutTp) {
  const Estimate ct = run(tiny(256, {{"cp", "2"}, {"tp", "2"}}));
  const Estimate tp = run(tiny(128, {{"tp", "2"}}));
  auto local_heads = [](uint64_t seq, std::initializer_list<std::pair<const char*, std::string>> extra) {
    Scenario s = tiny(seq, extra);
    for (const char* o : {"num_attention_heads=16", "num_key_value_heads=2", "head_dim=64"}) set_field(s, "overrides", o);
    return run(s);
  };
  const Estimate cp = local_heads(256, {{"cp", "2"}});
  const Estimate one = local_heads(128, {});
  size_t changed = 0;
  for (size_t i = 0; i < kCategoryCount; ++i) {
    const Category c = static_cast<Category>(i);
    EXPECT_EQ(delta(ct, tp, c), delta(cp, one, c)) << category_name(c);
    changed += !delta(ct, tp, c).empty();
  }
  EXPECT_GE(changed, 3u);  // activations, backward gradients, temporaries
}

// The ring's buffers are those of plain --cp on a model with the TP rank's heads (16 heads, 2 KV heads, head_dim
// 64 kept: LlamaAttention's view(..., -1, head_dim)), event for event; and by hand from torch's rules:
// _AllGatherRotater gathers cat(k.flatten(), v.flatten()) of C x 2 x B x (Hk / T) x L x D bf16 elements once per
// call (forward and backward), _AllToAllRotater sends one float32 dK/dV buffer of 2 x B x (Hk / T) x L x D per ring
// step of each backward call.
TEST(CpTpSim, TheRingBuffersArePlainCpsOverTheLocalHeads) {
  const Estimate ct = run(tiny(256, {{"cp", "2"}, {"tp", "2"}, {"steps", "1"}}));
  Scenario heads = tiny(256, {{"cp", "2"}, {"steps", "1"}});
  for (const char* o : {"num_attention_heads=16", "num_key_value_heads=2", "head_dim=64"}) set_field(heads, "overrides", o);
  const Estimate cp = run(heads);
  EXPECT_FALSE(ring_events(ct).empty());
  EXPECT_EQ(ring_events(ct), ring_events(cp));
  const uint64_t layers = 2, C = 2, B = 1, Hk = 4 / 2, L = 128, D = 64;
  EXPECT_EQ(allocs_labelled(ct, "cp kv all-gather", C * 2 * B * Hk * L * D * 2), 2 * layers);
  EXPECT_EQ(allocs_labelled(ct, "cp grad kv all-to-all", 2 * B * Hk * L * D * 4), C * layers);
}

TEST(CpTpSim, CpOneAndTpOneAreTheSingleAxisPaths) {
  const Estimate tp = run(tiny(256, {{"tp", "2"}}));
  const Estimate tp_cp1 = run(tiny(256, {{"tp", "2"}, {"cp", "1"}}));
  EXPECT_EQ(all_events(tp), all_events(tp_cp1));
  EXPECT_EQ(tp.memory.peak_reserved.value, tp_cp1.memory.peak_reserved.value);
  const Estimate cp = run(tiny(256, {{"cp", "2"}}));
  const Estimate cp_tp1 = run(tiny(256, {{"cp", "2"}, {"tp", "1"}}));
  EXPECT_EQ(all_events(cp), all_events(cp_tp1));
  EXPECT_EQ(cp.memory.peak_reserved.value, cp_tp1.memory.peak_reserved.value);
}

// --cp 2 --tp 2 --dp 2 --sharding fsdp2: FSDP2 over the flattened dp_shard x cp mesh (W = 4) of TP rank 0's local
// parameters. torch.chunk on dim 0 by hand (ceil(rows / 4)): q 1024 -> 256 rows of 2048, k and v 128 -> 32, o
// 2048 -> 512 rows of 1024, gate and up 2816 -> 704 rows of 2048, down 2048 -> 512 rows of 2816, the two norms
// 2048 -> 512; no padding. The shards, their buffers and the states are those of --tp 2 --dp 4 --sharding fsdp2
// (the same W over the same local model), byte for byte.
TEST(CpTpFsdp, StatesAreFsdpOverDpTimesCpOfTheTpLocalModel) {
  const Estimate ctf = run(tiny(256, {{"cp", "2"}, {"tp", "2"}, {"dp", "2"}, {"sharding", "fsdp2"}}));
  const Estimate tpf = run(tiny(128, {{"tp", "2"}, {"dp", "4"}, {"sharding", "fsdp2"}}));
  ASSERT_TRUE(ctf.fsdp.has_value());
  ASSERT_TRUE(tpf.fsdp.has_value());
  EXPECT_EQ(ctf.fsdp->options.ranks, 4u);
  EXPECT_EQ(ctf.fsdp->options.rank, 0u);
  ASSERT_EQ(ctf.fsdp->units.size(), 4u);
  const uint64_t layer_shard = 256 * 2048 + 2 * 32 * 2048 + 512 * 1024 + 2 * 704 * 2048 + 512 * 2816 + 2 * 512;
  EXPECT_EQ(ctf.fsdp->units[1].shard_numel, layer_shard);
  EXPECT_EQ(ctf.fsdp->units[0].shard_numel, 8000u * 2048);  // embed_tokens 32000 rows (replicated by TP) / 4
  EXPECT_EQ(ctf.fsdp->local_elems, tpf.fsdp->local_elems);
  EXPECT_EQ(ctf.fsdp->optimizer_state.value, tpf.fsdp->optimizer_state.value);
  EXPECT_EQ(ctf.state.weights.value, tpf.state.weights.value);
  EXPECT_EQ(ctf.state.gradients.value, tpf.state.gradients.value);
  EXPECT_EQ(ctf.memory.steady_state.value, tpf.memory.steady_state.value);
  const auto a = testing::category_events(ctf, Category::kFsdpBuffers);
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a, testing::category_events(tpf, Category::kFsdpBuffers));
  // and its activations outside attention are the FSDP2 + TP rank's at seq / cp
  for (Category c : {Category::kActivations, Category::kInputs}) {
    EXPECT_EQ(outside_attention(ctf, c), outside_attention(tpf, c)) << category_name(c);
  }
}

// HSDP (--dp-shard K) with --cp C and --tp T: accelerate's (dp_replicate, dp_shard, cp, tp) mesh, fully_shard over
// ("dp_replicate", "dp_shard_cp") (fsdp.cc apply_hsdp_mesh): shard groups of K x C ranks of TP rank 0's local
// parameters, D / K replicas. --dp 4 --dp-shard 2 --cp 2 --tp 2: shard groups of 4, two replicas: the shards (by
// hand above: W = 4) and every FSDP buffer, the replicate all-reduce's included, of --tp 2 --dp 8 --dp-shard 4 at
// seq / cp (shard groups of 4, two replicas, the same local model).
TEST(CpTpFsdp, HsdpShardsOverDpShardTimesCpOfTheTpLocalModel) {
  const Estimate h = run(tiny(256, {{"cp", "2"}, {"tp", "2"}, {"dp", "4"}, {"dp_shard", "2"}, {"sharding", "fsdp2"}}));
  const Estimate t = run(tiny(128, {{"tp", "2"}, {"dp", "8"}, {"dp_shard", "4"}, {"sharding", "fsdp2"}}));
  ASSERT_TRUE(h.fsdp.has_value());
  EXPECT_EQ(h.fsdp->options.ranks, 4u);
  EXPECT_EQ(h.fsdp->options.replicate, 2u);
  const uint64_t layer_shard = 256 * 2048 + 2 * 32 * 2048 + 512 * 1024 + 2 * 704 * 2048 + 512 * 2816 + 2 * 512;
  EXPECT_EQ(h.fsdp->units[1].shard_numel, layer_shard);
  EXPECT_EQ(h.fsdp->local_elems, t.fsdp->local_elems);
  EXPECT_EQ(h.state.optimizer_state.value, t.state.optimizer_state.value);
  EXPECT_EQ(testing::category_events(h, Category::kFsdpBuffers), testing::category_events(t, Category::kFsdpBuffers));
  EXPECT_FALSE(testing::category_events(h, Category::kFsdpBuffers).empty());
  // the communicators: the shard group (K x C = 4 ranks, T apart), the replicate group (2, K x C x T = 8 apart),
  // the CP group (T apart) and the TP group
  using K = ProcessGroup::Kind;
  EXPECT_EQ(groups_of(h.setup),
            (std::vector<Group>{{K::kData, 4, 2}, {K::kDataReplicate, 2, 8}, {K::kContext, 2, 2}, {K::kTensor, 2, 1}}));
}

// --gpus N: N = dp x cp x tp (scenario.cc resolve divides by tp, pp and cp; dp is what is left)
TEST(CpTpGpus, GpusAreDpTimesCpTimesTp) {
  const Estimate g = run(tiny(256, {{"cp", "2"}, {"tp", "2"}, {"gpus", "8xh100-80gb"}, {"sharding", "fsdp2"}}));
  EXPECT_EQ(g.setup.dp, 2u);
  EXPECT_EQ(g.fsdp->options.ranks, 4u);
  EXPECT_EQ(run(tiny(256, {{"cp", "2"}, {"tp", "2"}, {"gpus", "4xh100-80gb"}})).setup.dp, 1u);
  // 12 / 4 = 3 GPUs left for --cp 2
  EXPECT_EQ(refused_field(tiny(256, {{"cp", "2"}, {"tp", "4"}, {"gpus", "12xh100-80gb"}})), "gpus");
}

// The communicators under accelerate's mesh (dp_shard, cp, tp), TP innermost: the TP group's members are
// consecutive, the CP group's T apart, the flattened dp_shard_cp group's T apart.
TEST(CpTpGpus, CommunicatorsFollowTheMeshOrder) {
  TrainSetup s = run(tiny(256, {{"cp", "2"}, {"tp", "4"}, {"dp", "2"}, {"sharding", "fsdp2"}})).setup;
  const auto g = process_groups(s);
  using K = ProcessGroup::Kind;
  EXPECT_EQ(groups_of(s), (std::vector<Group>{{K::kData, 4, 4}, {K::kContext, 2, 4}, {K::kTensor, 4, 1}}));
  // on 8 GPUs per node: all 2 CP members on the node (ceil(8 / 4) = 2)
  EXPECT_EQ(local_ranks(g[1], 8), 2u);
  s.tp = 1;  // without TP the CP group is consecutive, as before
  EXPECT_EQ(process_groups(s)[1].stride, 1u);
}

// plan searches CP x TP layouts when --cp and --tp are both given (each row's figure is estimate's), and does not
// enumerate them otherwise (plan.cc: they would spend its bound on work that finds the other layouts).
TEST(CpTpPlan, PlanSearchesCpTimesTpOnlyWhenBothAreGiven) {
  auto fields = [](std::initializer_list<std::pair<const char*, std::string>> f) {
    std::vector<FieldChange> out;
    for (const auto& [k, v] : f) out.push_back({k, v});
    return out;
  };
  PlanRequest req;
  req.global_batch = 8;
  req.top = 3;
  const PlanResult both = plan(fields({{"model", "tinyllama-1.1b"}, {"overrides", "num_hidden_layers=2"},
                                       {"gpus", "8xa100-80gb"}, {"seq", "1024"}, {"cp", "2"}, {"tp", "2"}}),
                               req, testing::MapFileReader());
  ASSERT_FALSE(both.rows.empty());
  for (const PlanRow& r : both.rows) {
    EXPECT_EQ(r.setup.cp, 2u);
    EXPECT_EQ(r.setup.tp, 2u);
    EXPECT_EQ(r.setup.dp, 2u);  // 8 GPUs = dp 2 x cp 2 x tp 2
  }
  const PlanResult neither = plan(fields({{"model", "tinyllama-1.1b"}, {"overrides", "num_hidden_layers=2"},
                                          {"gpus", "8xa100-80gb"}, {"seq", "1024"}}),
                                  req, testing::MapFileReader());
  bool tp_alone = false, cp_alone = false;
  for (const PlanFamily& f : neither.families) {
    EXPECT_FALSE(f.setup.cp > 1 && f.setup.tp > 1) << plan_family_name(f.setup);
    tp_alone |= f.setup.tp > 1;
    cp_alone |= f.setup.cp > 1;
  }
  EXPECT_TRUE(tp_alone);
  EXPECT_TRUE(cp_alone);
}

TEST(CpTpRefusals, TheOtherRefusalsStand) {
  const std::pair<Scenario, const char*> cases[] = {
      {tiny(256, {{"cp", "2"}, {"tp", "2"}, {"sequence_parallel", "true"}}), "cp"},  // check_sp_setup
      {tiny(256, {{"cp", "2"}, {"tp", "2"}, {"pp", "2"}}), "pp"},
      {tiny(256, {{"cp", "2"}, {"tp", "2"}, {"dp", "2"}}), "dp"},  // check_tp_setup: DDP over TP
      {tiny(256, {{"cp", "2"}, {"tp", "2"}, {"attention", "eager"}}), "attention"},
      {tiny(256, {{"cp", "2"}, {"tp", "2"}, {"sharding", "zero2"}, {"dp", "2"}}), "dp"},
      {tiny(256, {{"cp", "2"}, {"tp", "2"}, {"task", "inference"}}), "task"},
      {tiny(256, {{"cp", "2"}, {"tp", "8"}}), "tp"},  // 4 KV heads do not divide by 8
      {testing::scenario_of("mistral-7b", {{"overrides", "num_hidden_layers=2"}, {"seq", "256"}, {"cp", "2"}, {"tp", "2"}}), "cp"},
  };
  for (const auto& [s, field] : cases) EXPECT_EQ(refused_field(s), field);
}

}  // namespace
}  // namespace trainmem
