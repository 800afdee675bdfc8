// HSDP: --sharding fsdp2 --dp-shard K, fully_shard over a (dp_replicate, dp_shard) = (dp / K, K) mesh (fsdp.h
// apply_hsdp_mesh, src/sim/fsdp.cc post_backward). FSDP2 is not in torch 1.13 (the CPU oracle's): no oracle runs
// it here. These tests pin (a) the shard arithmetic over dp_shard, worked by hand from torch.chunk(t, K, dim=0)
// (FSDPParam._init_sharded_param with HSDPMeshInfo's shard_mesh_size), not over dp; (b) that HSDP with one
// replica is FSDP2 byte for byte, that HSDP over (R, K) holds what FSDP2 over K ranks holds (the all-reduce
// aside), and that the states shrink by R against FSDP2 over the whole dp; (c) foreach_reduce's HSDP branch: the
// reduce-dtype output kept in _all_reduce_state to the final callback, the upcast on the all-reduce stream.
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/fsdp.h"
#include "trainmem/nccl.h"
#include "trainmem/plan.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

// fsdp_test's llama: 2 layers, hidden 64, 4 heads of 16 with 2 KV heads, intermediate 200, vocab 1001.
Scenario tiny(const std::string& dp, std::initializer_list<std::pair<const char*, std::string>> more = {}) {
  Scenario s = testing::scenario_of(
      "llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"overrides", "hidden_size=64"},
                     {"overrides", "intermediate_size=200"}, {"overrides", "num_attention_heads=4"},
                     {"overrides", "num_key_value_heads=2"}, {"overrides", "head_dim=16"}, {"overrides", "vocab_size=1001"},
                     {"batch", "1"}, {"seq", "32"}, {"dp", dp}, {"sharding", "fsdp2"}});
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

// (a) --dp 12 --dp-shard 4: every parameter chunked over 4 ranks, by hand (rows / 4 rounded up, x the other dims):
//   embedding 1001 x 64: ceil(1001 / 4) = 251 rows -> 16,064 (over dp = 12 it would be 84 rows: 5,376)
//   layer: q_proj 64 x 64 -> 16 x 64 = 1,024; k_proj, v_proj 32 x 64 -> 8 x 64 = 512 each; o_proj 1,024;
//          gate/up 200 x 64 -> 50 x 64 = 3,200 each; down 64 x 200 -> 16 x 200 = 3,200; norms 64 -> 16 each:
//          12,704 (x 4 = the layer's 50,816 parameters)
//   tail: norm 16 + lm_head 16,064 = 16,080
// The last shard rank (3) holds 1001 - 3 x 251 = 248 rows of each embedding: 3 padding rows x 64, twice.
TEST(HsdpShard, UnitsShardOverDpShardNotDp) {
  const Estimate e = run(tiny("12", {{"dp_shard", "4"}}));
  ASSERT_TRUE(e.fsdp.has_value());
  const FsdpFigures& f = *e.fsdp;
  EXPECT_EQ(f.options.ranks, 4u);
  EXPECT_EQ(f.options.replicate, 3u);
  ASSERT_EQ(f.units.size(), 4u);
  EXPECT_EQ(f.units[0].shard_numel, 16064u);
  EXPECT_EQ(f.units[1].shard_numel, 12704u);
  EXPECT_EQ(f.units[3].shard_numel, 16080u);
  const uint64_t shards = 16064 + 2 * 12704 + 16080;
  EXPECT_EQ(f.sharded_params.value, 4 * shards);  // fp32 shards (accelerate's upcast under bf16-amp)
  EXPECT_EQ(f.sharded_grads.value, 4 * shards);
  EXPECT_EQ(f.padding_elems, 0u);  // rank 0: full chunks
  // --dp-rank 7 is shard rank 7 mod 4 = 3 of replica 7 / 4 = 1 (dp_shard the inner mesh dimension)
  const Estimate last = run(tiny("12", {{"dp_shard", "4"}, {"dp_rank", "7"}}));
  EXPECT_EQ(last.fsdp->options.rank, 3u);
  EXPECT_EQ(last.fsdp->options.replicate_rank, 1u);
  EXPECT_EQ(last.fsdp->padding_elems, 2u * 3 * 64);
  // the all-gather output of a layer: 4 x its shard in bf16
  uint64_t ag = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind == Event::kAlloc && std::string_view(ev.label.what) == "FSDP all-gather output" && ev.label.layer == 1) {
      EXPECT_EQ(ev.bytes.value, 4u * 12704 * 2);
      ++ag;
    }
  }
  EXPECT_GT(ag, 0u);
}

// (b) HSDP with one replica (--dp-shard = --dp) is FSDP2: the same estimate, byte for byte, JSON and table.
TEST(HsdpEquivalence, OneReplicaIsFsdp2ByteForByte) {
  const Estimate a = run(tiny("8"));
  const Estimate b = run(tiny("8", {{"dp_shard", "8"}}));
  EXPECT_EQ(b.fsdp->options.replicate, 1u);
  EXPECT_EQ(render_estimate_json(a, nullptr), render_estimate_json(b, nullptr));
  EXPECT_EQ(render_estimate_table(a, nullptr), render_estimate_table(b, nullptr));
  ASSERT_EQ(a.sim->timeline.events.size(), b.sim->timeline.events.size());
}

// (b) HSDP over (2, 8) holds what FSDP2 over 8 ranks holds. In fp32 (reduce dtype = orig dtype) the reduced shard
// is the sharded gradient itself, so the all-reduce adds no buffer: every allocation alike, the peaks equal.
TEST(HsdpEquivalence, TwoReplicasOfEightHoldWhatFsdp2OverEightHolds) {
  const Estimate a = run(tiny("8", {{"precision", "fp32"}}));
  const Estimate b = run(tiny("16", {{"precision", "fp32"}, {"dp_shard", "8"}}));
  EXPECT_EQ(a.fsdp->sharded_params, b.fsdp->sharded_params);
  EXPECT_EQ(a.fsdp->sharded_grads, b.fsdp->sharded_grads);
  EXPECT_EQ(a.fsdp->optimizer_state, b.fsdp->optimizer_state);
  EXPECT_EQ(a.sim->peak.live.total, b.sim->peak.live.total);
  ASSERT_GT(a.sim->timeline.events.size(), 100u);
  ASSERT_EQ(a.sim->timeline.events.size(), b.sim->timeline.events.size());
  for (size_t i = 0; i < a.sim->timeline.events.size(); ++i) {
    const Event& x = a.sim->timeline.events[i];
    const Event& y = b.sim->timeline.events[i];
    ASSERT_EQ(x.kind, y.kind) << i;
    ASSERT_EQ(x.bytes, y.bytes) << i;
    ASSERT_EQ(x.stream, y.stream) << i;
  }
}

// (b) the states shrink by exactly R against FSDP2 over the whole dp when every dim 0 divides: vocab 1024 and
// intermediate 256 over 16 ranks (no padding on any rank), HSDP (2, 8) holds twice FSDP2 (16)'s shards.
TEST(HsdpEquivalence, StatesAreReplicaTimesFsdp2OverDp) {
  const auto even = [](const std::string& dp, std::initializer_list<std::pair<const char*, std::string>> more) {
    Scenario s = tiny(dp, more);
    set_field(s, "overrides", "vocab_size=1024");
    set_field(s, "overrides", "intermediate_size=256");
    return run(s);
  };
  const Estimate full = even("16", {});
  const Estimate hsdp = even("16", {{"dp_shard", "8"}});
  const Estimate four = even("16", {{"dp_shard", "4"}});
  EXPECT_EQ(full.fsdp->padding_elems, 0u);
  EXPECT_EQ(hsdp.fsdp->sharded_params.value, 2 * full.fsdp->sharded_params.value);
  EXPECT_EQ(hsdp.fsdp->sharded_grads.value, 2 * full.fsdp->sharded_grads.value);
  EXPECT_EQ(hsdp.fsdp->optimizer_state.value - 2 * full.fsdp->optimizer_state.value, 0u);
  EXPECT_EQ(four.fsdp->sharded_params.value, 4 * full.fsdp->sharded_params.value);
  // and by hand: 1024 x 64 x 2 embeddings + 2 layers of (4 x 64 x 64 / 2 ... ) = the model's parameters / 8
  const uint64_t params = 2 * 1024 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 256 * 64 + 2 * 64) + 64;
  EXPECT_EQ(hsdp.fsdp->sharded_params.value, 4 * params / 8);
}

// (c) bf16-amp (accelerate: fp32 shards, bf16 reduce): each unit's bf16 reduce-scatter output is all-reduced in
// place and held in _all_reduce_state until finalize_backward in the final callback; the fp32 upcast (the
// sharded gradients) is allocated on the all-reduce stream (post_reduce_stream = all_reduce_stream). Without HSDP
// the bf16 output dies when foreach_reduce returns and the upcast comes from the reduce-scatter stream.
TEST(HsdpSim, AllReduceOutputHeldToTheFinalCallbackUpcastOnItsStream) {
  const Estimate e = run(tiny("16", {{"dp_shard", "8"}}));
  const std::string held = "FSDP reduce-scatter output (all-reduced, held to the final callback)";
  uint64_t held_live = 0, held_max = 0, upcasts = 0, held_allocs = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.step != 2) continue;
    const std::string_view w = ev.label.what;
    const bool is_held = w.rfind(held, 0) == 0;
    if (ev.kind == Event::kAlloc && is_held) {
      ++held_allocs;
      EXPECT_EQ(ev.stream, Stream::kFsdpReduceScatter);
      held_live += ev.bytes.value;
      held_max = std::max(held_max, held_live);
    }
    if (ev.kind == Event::kFree && is_held) held_live -= ev.bytes.value;
    if (ev.kind == Event::kAlloc && w.rfind("FSDP sharded gradients (reduce-scatter output upcast)", 0) == 0) {
      ++upcasts;
      EXPECT_EQ(ev.stream, Stream::kFsdpAllReduce);
    }
  }
  EXPECT_EQ(held_allocs, 4u);  // the embedding, 2 layers, the tail
  EXPECT_EQ(upcasts, 4u);
  EXPECT_EQ(held_live, 0u);    // all freed by the step's end
  // all four at once before the final callback: the units' shards over 8 (fsdp_test's hand figures) in bf16
  EXPECT_EQ(held_max, 2u * (8064 + 2 * 6352 + 8072));
  // FSDP2 over 8: no held output; the upcast on the reduce-scatter stream
  const Estimate f = run(tiny("8"));
  for (const Event& ev : f.sim->timeline.events) {
    const std::string_view w = ev.label.what;
    EXPECT_EQ(w.rfind(held, 0), std::string_view::npos);
    if (ev.kind == Event::kAlloc && w.rfind("FSDP sharded gradients (reduce-scatter output upcast)", 0) == 0) {
      EXPECT_EQ(ev.stream, Stream::kFsdpReduceScatter);
    }
  }
  EXPECT_EQ(e.fsdp->sharded_params, f.fsdp->sharded_params);
}

// --dp-shard's refusals: field, value and what is expected (the CLI exits 2 on a FieldError).
TEST(HsdpErrors, BadShardDegreesAreRefusedWithTheirReason) {
  const auto message = [](const Scenario& s) {
    try {
      (void)run(s);
    } catch (const FieldError& e) {
      EXPECT_EQ(e.field(), "dp_shard");
      return std::string(e.what());
    }
    ADD_FAILURE() << "not refused";
    return std::string();
  };
  std::string m = message(tiny("16", {{"dp_shard", "3"}}));
  EXPECT_NE(m.find("3: expected a divisor of --dp 16 from 2 to 16 (2, 4, 8, 16"), std::string::npos) << m;
  m = message(tiny("16", {{"dp_shard", "32"}}));
  EXPECT_NE(m.find("32: expected a divisor of --dp 16"), std::string::npos) << m;
  m = message(tiny("16", {{"dp_shard", "1"}}));
  EXPECT_NE(m.find("--sharding ddp"), std::string::npos) << m;
  m = message(tiny("16", {{"dp_shard", "8"}, {"sharding", "zero2"}}));
  EXPECT_NE(m.find("it applies with --sharding fsdp2"), std::string::npos) << m;
}

// NCCL: the dp_shard group (K ranks, T apart) and the dp_replicate group (R ranks, K x T apart), one communicator
// each, in place of the one data-parallel group.
TEST(HsdpNccl, ShardAndReplicateGroups) {
  TrainSetup s;
  s.dp = 16;
  s.sharding = Sharding::kFsdp2;
  s.dp_shard = 8;
  std::vector<ProcessGroup> g = process_groups(s);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].ranks, 8u);
  EXPECT_EQ(g[0].stride, 1u);
  EXPECT_EQ(g[0].kind, ProcessGroup::Kind::kData);
  EXPECT_EQ(g[1].ranks, 2u);
  EXPECT_EQ(g[1].stride, 8u);
  EXPECT_EQ(g[1].kind, ProcessGroup::Kind::kDataReplicate);
  EXPECT_EQ(local_ranks(g[1], 8), 1u);  // one member per node: the replicate ring runs over the network
  s.tp = 2;
  s.dp = 8;
  s.dp_shard = 4;
  g = process_groups(s);
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0].stride, 2u);
  EXPECT_EQ(g[1].stride, 8u);
  EXPECT_EQ(g[2].kind, ProcessGroup::Kind::kTensor);
  s.dp_shard = 8;  // one replica: the data-parallel group as before
  g = process_groups(s);
  EXPECT_EQ(g[0].ranks, 8u);
  EXPECT_EQ(g[1].kind, ProcessGroup::Kind::kTensor);
}

// Step time: HSDP runs its gathers and reduce-scatters in the 8-rank shard group, within a node (NVLink), and
// all-reduces each unit's reduced shard over the 2-rank replicate group through the NIC; FSDP2 over 16 ranks runs
// everything across the nodes. The all-reduce's time is 2 (R - 1) / R x the shards' bytes / the network's bandwidth
// (nccl-tests' bus bandwidth), computed here from the units.
TEST(HsdpTime, AllReduceOverTheReplicateGroupAtTheNetwork) {
  Scenario h = tiny("16", {{"dp_shard", "8"}, {"gpu", "h100-80gb"}});
  Scenario f = tiny("16", {{"gpu", "h100-80gb"}});
  Scenario k = tiny("8", {{"gpu", "h100-80gb"}});
  const Estimate eh = run(h), ef = run(f), ek = run(k);
  ASSERT_TRUE(eh.time && ef.time && ek.time);
  // the gathers and reduce-scatters of HSDP (2, 8) are FSDP2 (8)'s, on the node's link: the difference is the
  // all-reduce (its exposed part is what the backward does not hide)
  uint64_t shards = 0;
  for (const FsdpUnit& u : eh.fsdp->units) shards += u.shard_numel;
  const double net = 50e9;  // DGX H100's 400 Gb/s ConnectX-7 per GPU (data/gpus/gpus.json)
  const double ar = 2.0 * (2 - 1) / 2 * static_cast<double>(shards * 2) / net;
  EXPECT_NEAR(eh.time->comm_seconds - ek.time->comm_seconds, ar, 1e-12);
  bool noted = false;
  for (const std::string& n : eh.time->notes) noted = noted || n.find("HSDP replicate groups span nodes") != std::string::npos;
  EXPECT_TRUE(noted);
  // FSDP2 over 16 ranks crosses the nodes with every gather: more communication than HSDP's
  EXPECT_GT(ef.time->comm_seconds, eh.time->comm_seconds);
}

// plan: on 2 nodes of 8, each FSDP2 family without a pipeline or context parallel whose data-parallel ranks span
// nodes has one HSDP twin sharded over the node's data-parallel ranks (8 / tp); every HSDP row is what estimate
// says for its fields, and no family with cp > 1 is a twin.
TEST(HsdpPlan, TwinsShardWithinANodeAndRowsAreEstimates) {
  PlanRequest req;
  req.global_batch = 16;
  req.top = 40;
  const std::vector<FieldChange> given = {{"model", "tinyllama-1.1b"}, {"gpus", "16xa100-80gb"}, {"seq", "1024"},
                                          {"checkpointing", "full"}, {"precision", "bf16"}};
  const PlanResult r = plan(given, req, testing::MapFileReader());
  size_t fsdp2_spanning = 0, twins = 0;
  for (const PlanFamily& f : r.families) {
    const PlanSetup& p = f.setup;
    // (a layout with context parallel gets no twin: HSDP over dp_shard x cp is simulated when asked, not searched)
    if (p.sharding == Sharding::kFsdp2 && p.dp_shard == 0 && p.pp == 1 && p.cp == 1 && p.dp > 8 / p.tp &&
        8 / p.tp > 1) {
      ++fsdp2_spanning;
    }
    if (p.dp_shard == 0) continue;
    ++twins;
    EXPECT_EQ(p.pp, 1u);
    EXPECT_EQ(p.sharding, Sharding::kFsdp2);
    EXPECT_EQ(p.cp, 1u) << plan_family_name(p);
    EXPECT_EQ(p.dp_shard, 8 / p.tp) << plan_family_name(p);
    EXPECT_LT(p.dp_shard, p.dp);
  }
  EXPECT_GT(twins, 0u);
  EXPECT_EQ(twins, fsdp2_spanning);
  size_t hsdp_rows = 0;
  for (const PlanRow& row : r.rows) {
    if (row.setup.dp_shard == 0) continue;
    ++hsdp_rows;
    const Estimate e = estimate(resolve(scenario_from(plan_fields(r.given, row.setup.changes())), testing::MapFileReader()));
    ASSERT_TRUE(e.time && e.fsdp);
    EXPECT_EQ(e.fsdp->options.replicate * e.fsdp->options.ranks, row.setup.dp);
    EXPECT_EQ(e.time->step_seconds, row.time.step_seconds) << plan_family_name(row.setup);
  }
  EXPECT_GT(hsdp_rows, 0u);
}

// fit: with DDP ranks spanning nodes, HSDP (sharded over a node) is the rung before FSDP2 over every rank.
TEST(HsdpFit, TheRungBeforeFsdp2) {
  Scenario s = testing::scenario_of("llama-3-8b", {{"gpus", "16xh100-80gb"}, {"seq", "2048"}});
  const FitResult r = fit(s, FitRequest{}, testing::MapFileReader());
  std::vector<std::string> ladder;
  for (const FitResult::ShardingTry& t : r.sharding_ladder) ladder.push_back(t.sharding);
  EXPECT_EQ(ladder, (std::vector<std::string>{"zero1", "zero2", "fsdp2 --dp-shard 8", "fsdp2", "fsdp1", "zero3"}));
  // one node: no HSDP rung
  Scenario one = testing::scenario_of("llama-3-8b", {{"gpus", "8xh100-80gb"}, {"seq", "2048"}});
  for (const FitResult::ShardingTry& t : fit(one, FitRequest{}, testing::MapFileReader()).sharding_ladder) {
    EXPECT_EQ(t.sharding.find("dp-shard"), std::string::npos);
  }
}

}  // namespace
}  // namespace trainmem
