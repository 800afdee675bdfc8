// trainmem plan (plan.h): it only chooses, so every row must be what `estimate` says for its fields; the search's
// bounds and shortcuts (the throughput bound, the screening by the variant that keeps the least) must never
// change the answer; and what the user gives is kept.
#include "trainmem/plan.h"

#include <gtest/gtest.h>

#include <set>

#include "test_util.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

std::vector<FieldChange> fields(std::initializer_list<std::pair<const char*, std::string>> f) {
  std::vector<FieldChange> out;
  for (const auto& [k, v] : f) out.push_back({k, v});
  return out;
}

PlanRequest request(uint64_t global_batch, size_t top = 10) {
  PlanRequest r;
  r.global_batch = global_batch;
  r.top = top;
  return r;
}

// TinyLlama on 8 A100 40GB: every sharding fits, so the ranking has many rows.
const PlanResult& tinyllama() {
  static const PlanResult r = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "8xa100-40gb"}, {"seq", "2048"}}),
                                   request(16), MapFileReader());
  return r;
}

// Llama 3 8B at 8k on 8 A100 40GB: most families do not fit, which exercises the screening.
const PlanResult& llama8b() {
  static const PlanResult r = plan(fields({{"model", "llama-3-8b"}, {"gpus", "8xa100-40gb"}, {"seq", "8192"}}),
                                   request(16), MapFileReader());
  return r;
}

// The estimate a user gets by running a row's fields (the "run it" line's), and its verdict with plan's margin kept
// free (as fit judges a fit).
struct RowRun {
  Estimate e;
  DeviceVerdict with_margin;
};
RowRun run_of(const PlanResult& r, const PlanSetup& s) {
  const ResolvedScenario rs = resolve(scenario_from(plan_fields(r.given, s.changes())), MapFileReader());
  Estimate e = estimate(rs);
  // a pipeline's estimate carries its worst rank's verdict; plan replays it with the margin
  const DeviceVerdict v = s.pp > 1 ? *estimate(rs.model, rs.inventory, rs.setup, rs.options, rs.alloc, &*rs.gpu,
                                               r.margin).device
                                   : device_verdict(e, *rs.gpu, rs.alloc, r.margin);
  return {std::move(e), v};
}

TEST(Plan, EveryRowIsWhatEstimateSaysForItsFields) {
  const PlanResult& r = tinyllama();
  ASSERT_GE(r.rows.size(), 5u);
  for (const PlanRow& row : r.rows) {
    const RowRun run = run_of(r, row.setup);
    ASSERT_TRUE(run.e.time && run.e.device) << plan_family_name(row.setup);
    EXPECT_EQ(run.e.time->step_seconds, row.time.step_seconds) << plan_family_name(row.setup);
    EXPECT_EQ(run.e.setup.dp * run.e.setup.batch * run.e.setup.grad_accum, 16u) << plan_family_name(row.setup);
    // memory as fit judges it: with the margin kept free
    EXPECT_TRUE(run.with_margin.fits) << plan_family_name(row.setup);
    EXPECT_EQ(run.with_margin.peak_reserved.value, row.peak_reserved.value) << plan_family_name(row.setup);
    EXPECT_EQ(run.with_margin.headroom, row.headroom) << plan_family_name(row.setup);
    EXPECT_EQ(run.with_margin.alloc_retries, row.alloc_retries) << plan_family_name(row.setup);
  }
}

TEST(Plan, RowsAreFastestFirstAndNoFasterThanTheirBound) {
  const PlanResult& r = tinyllama();
  for (size_t i = 1; i < r.rows.size(); ++i) {
    EXPECT_GE(r.rows[i - 1].time.tokens_per_second, r.rows[i].time.tokens_per_second);
  }
  for (const PlanRow& row : r.rows) {
    EXPECT_GE(row.bound_tokens_per_second, row.time.tokens_per_second) << plan_family_name(row.setup);
  }
  EXPECT_GE(r.ranked_total, r.rows.size());
  EXPECT_FALSE(r.best_reason.empty());
}

TEST(Plan, EveryFamilyEndsInOneVerdictAndRankedOnesAreRows) {
  const PlanResult& r = tinyllama();
  std::set<std::string> names;
  size_t ranked = 0;
  for (const PlanFamily& f : r.families) {
    EXPECT_TRUE(names.insert(plan_family_name(f.setup)).second) << plan_family_name(f.setup);
    if (f.verdict == PlanVerdict::kRanked) ++ranked;
    if (f.verdict == PlanVerdict::kRefused) EXPECT_FALSE(f.why.empty()) << plan_family_name(f.setup);
  }
  EXPECT_EQ(ranked, r.ranked_total);
  // the bound's reference simulations are counted apart from the searched ones
  EXPECT_GT(r.reference_simulations, 0u);
  EXPECT_GT(r.simulations, r.rows.size());
}

// The bound prunes only what cannot be in the top N: asking for one row gives the first row of ten, with fewer
// simulations.
TEST(Plan, PruningByTheBoundDoesNotChangeTheBest) {
  const PlanResult one =
      plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "8xa100-40gb"}, {"seq", "2048"}}), request(16, 1), MapFileReader());
  const PlanResult& ten = tinyllama();
  ASSERT_EQ(one.rows.size(), 1u);
  EXPECT_EQ(plan_family_name(one.rows[0].setup), plan_family_name(ten.rows[0].setup));
  EXPECT_EQ(one.rows[0].time.step_seconds, ten.rows[0].time.step_seconds);
  size_t pruned = 0;
  for (const PlanFamily& f : one.families) pruned += f.verdict == PlanVerdict::kPruned;
  EXPECT_GT(pruned, 0u);
  EXPECT_LT(one.simulations, ten.simulations);
}

// A family screened out because a variant of its layout that keeps less does not fit, simulated here: it does
// not fit either (the screening's assumption, checked on every such family of the plan).
TEST(Plan, AFamilyScreenedOutDoesNotFitWhenSimulated) {
  const PlanResult& r = llama8b();
  size_t checked = 0;
  for (const PlanFamily& f : r.families) {
    if (f.verdict != PlanVerdict::kDoesNotFit || !f.screened) continue;
    PlanSetup s = f.setup;
    s.batch = f.smallest_batch;
    s.accumulation = 16 / s.dp / s.batch;
    const RowRun run = run_of(r, s);
    EXPECT_FALSE(run.with_margin.fits) << plan_family_name(s);
    ++checked;
  }
  EXPECT_GE(checked, 3u);
}

TEST(Plan, FieldsGivenAreKeptInEverySetup) {
  const PlanResult r = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "8xa100-40gb"}, {"seq", "2048"},
                                    {"checkpointing", "full"}, {"tp", "2"}}),
                            request(16), MapFileReader());
  ASSERT_FALSE(r.rows.empty());
  for (const PlanFamily& f : r.families) {
    EXPECT_EQ(f.setup.checkpointing, Checkpointing::kFull);
    EXPECT_EQ(f.setup.tp, 2u);
  }
  EXPECT_EQ(r.fixed, (std::vector<std::string>{"tp 2", "checkpointing full"}));
}

// --sequence-parallel true given: FSDP2 over the TP + SP model is torchtitan's (resolve_sp_fsdp), which takes
// training.dtype float32 with fully_shard's bf16 policy and refuses autocast and pure bf16; plan searches it with
// that mixed precision, as under a pipeline, and its row runs as estimate says (it was refused for every precision).
TEST(Plan, SequenceParallelLayoutsWithDataParallelismGetTorchtitansPrecision) {
  const PlanResult r = plan(fields({{"model", "llama-3-8b"}, {"overrides", "num_hidden_layers=2"},
                                    {"gpus", "16xh100-80gb"}, {"tp", "8"}, {"sequence_parallel", "true"},
                                    {"seq", "2048"}, {"checkpointing", "none"}}),
                            request(8), MapFileReader());
  const PlanFamily* fsdp = nullptr;
  for (const PlanFamily& f : r.families) {
    if (f.setup.pp == 1 && f.setup.dp == 2 && f.setup.sharding == Sharding::kFsdp2 && f.setup.dp_shard == 0) fsdp = &f;
  }
  ASSERT_NE(fsdp, nullptr);
  EXPECT_EQ(fsdp->setup.precision, Precision::kFp32);
  EXPECT_TRUE(fsdp->setup.mixed);
  EXPECT_EQ(fsdp->verdict, PlanVerdict::kRanked) << fsdp->why;
  for (const PlanRow& row : r.rows) {
    if (row.setup.sharding != Sharding::kFsdp2 || row.setup.pp != 1) continue;
    const RowRun run = run_of(r, row.setup);
    ASSERT_TRUE(run.e.fsdp.has_value());
    EXPECT_TRUE(run.e.fsdp->torchtitan_sp);
    EXPECT_TRUE(run.with_margin.fits);
  }
}

TEST(Plan, AGlobalBatchThatDoesNotDivideRejectsTheLayoutWithTheReason) {
  const PlanResult r = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "8xa100-40gb"}, {"seq", "2048"},
                                    {"tp", "1"}, {"pp", "1"}, {"cp", "1"}}),
                            request(12), MapFileReader());
  EXPECT_TRUE(r.rows.empty());
  for (const PlanFamily& f : r.families) {
    EXPECT_EQ(f.verdict, PlanVerdict::kBatch);
    EXPECT_NE(f.why.find("does not divide into 8 data-parallel ranks"), std::string::npos) << f.why;
  }
}

TEST(Plan, NothingFitsListsEveryFamilyWithItsReason) {
  const PlanResult r = plan(fields({{"model", "llama-2-13b"}, {"gpus", "2xt4"}, {"seq", "4096"}}), request(2),
                            MapFileReader());
  EXPECT_TRUE(r.rows.empty());
  ASSERT_FALSE(r.families.empty());
  for (const PlanFamily& f : r.families) {
    EXPECT_NE(f.verdict, PlanVerdict::kRanked);
    if (f.verdict == PlanVerdict::kDoesNotFit) EXPECT_LT(f.best_headroom, 0);
  }
}

TEST(Plan, BadRequestsNameTheField) {
  auto field_of = [](auto&& f) {
    try {
      f();
    } catch (const FieldError& e) {
      return e.field();
    }
    return std::string("none");
  };
  const MapFileReader files;
  EXPECT_EQ(field_of([&] { plan(fields({{"model", "gpt2"}}), request(8), files); }), "gpus");
  EXPECT_EQ(field_of([&] { plan(fields({{"model", "gpt2"}, {"gpus", "8xh100-80gb"}}), request(0), files); }),
            "global_batch");
  EXPECT_EQ(field_of([&] {
              plan(fields({{"model", "gpt2"}, {"gpus", "8xh100-80gb"}, {"grad_accum", "4"}}), request(8), files);
            }),
            "grad_accum");
  EXPECT_EQ(field_of([&] {
              plan(fields({{"model", "gpt2"}, {"gpus", "8xh100-80gb"}, {"task", "inference"}}), request(8), files);
            }),
            "task");
  EXPECT_EQ(field_of([&] { plan(fields({{"model", "gpt2"}, {"gpus", "8xrtx-3090"}}), request(8), files); }),
            "gpus");  // no datasheet peaks: no step time to rank by
  PlanRequest margin = request(8);
  margin.margin = parse_margin("100GiB");  // more than the card
  EXPECT_EQ(field_of([&] { plan(fields({{"model", "gpt2"}, {"gpus", "2xa100-80gb"}}), margin, files); }), "margin");
  EXPECT_EQ(field_of([&] { plan(fields({{"model", "gpt2"}, {"gpus", "2xnope"}}), request(8), files); }), "gpus");
  EXPECT_EQ(field_of([] { plan_request("8", "0", "10", "5%"); }), "nodes");
  EXPECT_EQ(plan_request("8", "", "10", "5%").nodes, 0u);  // not given
  PlanRequest nodes = request(8);
  nodes.nodes = 3;
  EXPECT_EQ(field_of([&] { plan(fields({{"model", "gpt2"}, {"gpus", "8xh100-80gb"}}), nodes, files); }), "nodes");
  EXPECT_EQ(field_of([] { plan_request("-1", "", "10", "5%"); }), "global_batch");
  EXPECT_EQ(field_of([] { plan_request("8", "", "0", "5%"); }), "top");
  EXPECT_EQ(field_of([] { plan_request("8", "x", "10", "5%"); }), "nodes");
}

// Fields given next to the ones plan chooses: stages per rank pick the interleaved schedule; bf16-amp is each
// framework's mixed precision (DeepSpeed's bf16, torchtitan's fp32 with FSDP2's bf16 policy under a pipeline).
TEST(Plan, GivenFieldsAreReadAsEachFrameworkRunsThem) {
  const PlanResult v = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "2xh100-80gb"}, {"seq", "2048"},
                                    {"pp", "2"}, {"pp_virtual_stages", "4"}}),
                            request(8), MapFileReader());
  for (const PlanFamily& f : v.families) {
    EXPECT_EQ(f.setup.schedule, PpSchedule::kInterleaved1f1b);
    EXPECT_EQ(f.setup.virtual_stages, 4u);
  }
  const PlanResult m = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "8xh100-80gb"}, {"seq", "2048"},
                                    {"precision", "bf16-amp"}}),
                            request(16), MapFileReader());
  bool pipeline_fsdp = false, zero = false;
  for (const PlanFamily& f : m.families) {
    EXPECT_TRUE(f.setup.mixed) << plan_family_name(f.setup);
    if (f.setup.pp > 1 && f.setup.dp > 1 && f.setup.cp == 1 && f.setup.sharding == Sharding::kFsdp2) {
      pipeline_fsdp = true;
      EXPECT_EQ(f.setup.precision, Precision::kFp32);
      EXPECT_NE(f.verdict, PlanVerdict::kRefused) << plan_family_name(f.setup) << ": " << f.why;
    }
    if (f.setup.dp > 1 && f.setup.sharding == Sharding::kZero2) {
      zero = true;
      EXPECT_EQ(f.setup.precision, Precision::kBf16);
    }
  }
  EXPECT_TRUE(pipeline_fsdp && zero);
}

// --nodes spreads the GPUs: tensor parallelism stays within a node.
TEST(Plan, TensorParallelismStaysWithinANode) {
  PlanRequest r = request(16);
  r.nodes = 4;  // 2 GPUs per node
  const PlanResult p = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "8xa100-40gb"}, {"seq", "2048"}}), r,
                            MapFileReader());
  EXPECT_EQ(p.gpus_per_node, 2u);
  for (const PlanFamily& f : p.families) EXPECT_LE(f.setup.tp, 2u);
  // 12 GPUs a node: groups of 8 consecutive ranks would straddle two nodes, so tp and tp x cp divide 12
  PlanRequest twelve = request(48);
  twelve.nodes = 2;
  const PlanResult q = plan(fields({{"model", "tinyllama-1.1b"}, {"gpus", "24xh100-80gb"}, {"seq", "1024"},
                                    {"pp", "1"}, {"sharding", "fsdp2"}, {"checkpointing", "full"}, {"precision", "bf16"}}),
                            twelve, MapFileReader());
  for (const PlanFamily& f : q.families) EXPECT_EQ(12 % (f.setup.tp * f.setup.cp), 0u) << plan_family_name(f.setup);
}

}  // namespace
}  // namespace trainmem
