// Memoized pipeline actions (src/sim/memo.h): every pipeline rank of several configurations simulated with
// memoization on and off (SimOptions::memo), and everything the simulation returns compared: every event (kind,
// categories, phase, step, micro-batch, storage id, bytes, label, stream), the moments, the saved activations, the
// FLOP ledger, the gradients, the warnings; then the whole pipeline's estimate rendered as JSON, byte for byte.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/pp.h"
#include "trainmem/report.h"
#include "trainmem/sim.h"
#include "trainmem/timeline.h"
#include "trainmem/tp.h"

namespace trainmem {
namespace {

// llama of 8 layers, hidden 64 (the ppfsdp_test model)
ModelSpec llama8() {
  return testing::from_json(R"({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": false,
                                "num_hidden_layers": 8})");
}

void expect_same_moment(const Moment& a, const Moment& b, const char* what) {
  EXPECT_EQ(a.event, b.event) << what;
  EXPECT_EQ(a.phase, b.phase) << what;
  EXPECT_EQ(a.step, b.step) << what;
  EXPECT_EQ(a.micro, b.micro) << what;
  EXPECT_EQ(a.live.total, b.live.total) << what;
  for (size_t c = 0; c < kCategoryCount; ++c) EXPECT_EQ(a.live.by_category[c], b.live.by_category[c]) << what << " " << c;
}

// Every field of two simulations; stops at the first differing event (with its index).
void expect_same(const SimResult& a, const SimResult& b, const std::string& where) {
  SCOPED_TRACE(where);
  ASSERT_EQ(a.timeline.events.size(), b.timeline.events.size());
  for (size_t i = 0; i < a.timeline.events.size(); ++i) {
    const Event& x = a.timeline.events[i];
    const Event& y = b.timeline.events[i];
    const bool same = x.kind == y.kind && x.category == y.category && x.from == y.from && x.phase == y.phase &&
                      x.step == y.step && x.micro == y.micro && x.storage == y.storage && x.bytes == y.bytes &&
                      std::strcmp(x.label.what, y.label.what) == 0 && x.label.layer == y.label.layer &&
                      x.label.row == y.label.row && x.stream == y.stream;
    ASSERT_TRUE(same) << "event " << i << ": " << x.label.what << " (storage " << x.storage << ", micro " << x.micro
                      << ") vs " << y.label.what << " (storage " << y.storage << ", micro " << y.micro << ")";
  }
  expect_same_moment(a.peak, b.peak, "peak");
  expect_same_moment(a.steady, b.steady, "steady");
  expect_same_moment(a.after_forward, b.after_forward, "after_forward");
  EXPECT_EQ(a.saved_activations, b.saved_activations);
  EXPECT_EQ(a.activations_at_peak, b.activations_at_peak);
  EXPECT_EQ(a.micro_batches_simulated, b.micro_batches_simulated);
  EXPECT_EQ(a.param_has_grad, b.param_has_grad);
  EXPECT_EQ(a.warnings, b.warnings);
  const FlopLedger& f = a.flops;
  const FlopLedger& g = b.flops;
  EXPECT_EQ(f.flops, g.flops);
  EXPECT_EQ(f.bytes, g.bytes);
  EXPECT_EQ(f.kernels, g.kernels);
  EXPECT_EQ(f.overflow, g.overflow);
  ASSERT_EQ(f.rows.size(), g.rows.size());
  for (size_t i = 0; i < f.rows.size(); ++i) {
    EXPECT_TRUE(f.rows[i].kind == g.rows[i].kind && f.rows[i].phase == g.rows[i].phase && f.rows[i].dtype == g.rows[i].dtype &&
                f.rows[i].flops == g.rows[i].flops && f.rows[i].bytes == g.rows[i].bytes && f.rows[i].count == g.rows[i].count)
        << "kernel row " << i;
  }
  EXPECT_EQ(f.tp_all_reduces, g.tp_all_reduces);
  EXPECT_EQ(f.tp_all_reduce_bytes, g.tp_all_reduce_bytes);
  EXPECT_EQ(f.tp_all_gathers, g.tp_all_gathers);
  EXPECT_EQ(f.tp_all_gather_bytes, g.tp_all_gather_bytes);
  EXPECT_EQ(f.dp_all_gathers, g.dp_all_gathers);
  EXPECT_EQ(f.dp_all_gather_bytes, g.dp_all_gather_bytes);
  EXPECT_EQ(f.dp_largest_gather_bytes, g.dp_largest_gather_bytes);
  EXPECT_EQ(f.dp_reduce_scatters, g.dp_reduce_scatters);
  EXPECT_EQ(f.dp_reduce_scatter_bytes, g.dp_reduce_scatter_bytes);
}

struct Case {
  std::string name;
  std::function<void(TrainSetup&)> set;
  uint64_t tp = 1;
  bool expect_replays = true;  // the configuration has repeated micro-batches the memo covers
  TorchVersion torch{2, 9};
};

// Each rank of the case simulated both ways; returns the actions replayed over its ranks.
uint64_t check_case(const Case& c) {
  ModelSpec m = llama8();
  if (c.tp > 1) apply_tensor_parallel(m, c.tp);
  Inventory inv = build_inventory(m);
  if (c.tp > 1) mark_tp_shards(m, inv);
  TrainSetup s = testing::train_setup(1, 32, Precision::kFp32);
  s.tp = c.tp;
  c.set(s);
  SimOptions o;
  o.loop = LoopKind::kHf;
  o.torch = c.torch;
  SimOptions off = o;
  off.memo = false;
  // the whole pipeline's estimate, every rank, rendered
  const Estimate whole_on = estimate(m, inv, s, o);
  const Estimate whole_off = estimate(m, inv, s, off);
  EXPECT_EQ(render_estimate_json(whole_on, nullptr), render_estimate_json(whole_off, nullptr)) << c.name;
  EXPECT_EQ(render_estimate_table(whole_on, nullptr), render_estimate_table(whole_off, nullptr)) << c.name;
  // each rank's simulation as estimate() makes it (src/pipeline/estimate.cc)
  uint64_t replayed = 0;
  TrainSetup ps = s;
  ps.optimizer_impl = OptimizerImpl::kFused;
  const std::vector<PpStagePart> split = pp_stage_split(s.pp * std::max<uint64_t>(s.pp_virtual_stages, 1), m.layers);
  for (uint64_t rank = 0; rank < s.pp; ++rank) {
    const SimOptions ro = pp_rank_options(o, s, split, rank);
    SimOptions roff = ro;
    roff.memo = false;
    const Inventory stage_inv = pp_stage_inventory(inv, ro.pp.parts);
    const SimResult a = simulate(m, stage_inv, ps, ro);
    const SimResult b = simulate(m, stage_inv, ps, roff);
    EXPECT_FALSE(a.memo_fell_back) << c.name << " rank " << rank;
    EXPECT_EQ(b.memo_replayed, 0u);
    expect_same(a, b, c.name + " rank " + std::to_string(rank));
    replayed += a.memo_replayed;
  }
  std::printf("%s: %llu actions replayed over %llu ranks\n", c.name.c_str(), static_cast<unsigned long long>(replayed),
              static_cast<unsigned long long>(s.pp));
  if (c.expect_replays) EXPECT_GT(replayed, 0u) << c.name << ": nothing replayed, the comparison shows nothing";
  return replayed;
}

void pp_fsdp(TrainSetup& s, uint64_t pp, uint64_t micro, uint64_t dp) {
  s.pp = pp;
  s.micro_batches = micro;
  s.dp = dp;
  s.sharding = Sharding::kFsdp2;
}

TEST(Memo, OneFOneBWithFsdp2) {
  check_case({"1f1b fsdp2", [](TrainSetup& s) { pp_fsdp(s, 2, 6, 4); }});
}

TEST(Memo, OneFOneBPlain) {
  check_case({"1f1b", [](TrainSetup& s) {
                s.pp = 4;
                s.micro_batches = 8;
              }});
}

TEST(Memo, GPipeWithFsdp2AndFullCheckpointing) {
  check_case({"gpipe fsdp2 full ac", [](TrainSetup& s) {
                pp_fsdp(s, 2, 5, 2);
                s.pp_schedule = PpSchedule::kGpipe;
                s.checkpointing = Checkpointing::kFull;
              }});
}

// Every rank holds two stages (rank 0 stages 0 and 2), each with its FSDP2 root.
TEST(Memo, InterleavedWithFsdp2Roots) {
  check_case({"interleaved fsdp2", [](TrainSetup& s) {
                pp_fsdp(s, 2, 4, 8);
                s.pp_schedule = PpSchedule::kInterleaved1f1b;
                s.pp_virtual_stages = 2;
              }});
}

// The same with TP and selective checkpointing. When the backward's key named every parameter's .grad, stage 0's
// backward met stage 2's gradients its template had not seen and the run fell back (the key now names the stage's
// own, Loop::memo_probe); the abandoned run's live checkpoint frames then reached the fallback's engine through the
// node pool (Engine::~Engine now drops them).
TEST(Memo, InterleavedTpFsdp2SelectiveCheckpointing) {
  check_case({"interleaved tp2 fsdp2 selective", [](TrainSetup& s) {
                pp_fsdp(s, 2, 8, 2);
                s.pp_schedule = PpSchedule::kInterleaved1f1b;
                s.pp_virtual_stages = 2;
                s.checkpointing = Checkpointing::kSelective;
              },
              2});
}

TEST(Memo, TpPpFsdp2SelectiveCheckpointing) {
  check_case({"tp2 pp2 fsdp2 selective", [](TrainSetup& s) {
                pp_fsdp(s, 2, 8, 2);
                s.checkpointing = Checkpointing::kSelective;
              },
              2});
}

// Context parallel around the pipeline (torchtitan's): every SDPA the ring, whose buffers are the action's own;
// the whole estimate simulates both CP ranks, the per-rank check runs CP rank 0. With and without selective
// checkpointing (whose frame keeps the ring's outputs).
TEST(Memo, OneFOneBWithFsdp2AndContextParallel) {
  for (Checkpointing ck : {Checkpointing::kNone, Checkpointing::kSelective}) {
    check_case({"1f1b fsdp2 cp2", [ck](TrainSetup& s) {
                  pp_fsdp(s, 2, 6, 2);
                  s.cp = 2;
                  s.cp_seq = 2 * s.seq;  // the rank's seq / cp tokens are the setup's seq (resolve_cp)
                  s.checkpointing = ck;
                }});
  }
}

TEST(Memo, HsdpGradAccum) {
  check_case({"hsdp", [](TrainSetup& s) {
                pp_fsdp(s, 2, 6, 4);
                s.dp_shard = 2;
              }});
}

// PyTorch 2.11's send lifetimes (PpLocal::sending): the first stage is memoized, a later stage is not
// (Loop::memo_allowed), and every rank's output is the full simulation's.
TEST(Memo, Torch211OneFOneBAndGPipe) {
  for (PpSchedule sch : {PpSchedule::k1f1b, PpSchedule::kGpipe}) {
    Case c{"2.11", [sch](TrainSetup& s) {
             s.pp = 2;
             s.micro_batches = 6;
             s.pp_schedule = sch;
           }};
    c.torch = TorchVersion{2, 11};
    check_case(c);
  }
}

TEST(Memo, Bf16WithoutFsdp) {
  check_case({"1f1b bf16", [](TrainSetup& s) {
                s.precision = Precision::kBf16;
                s.pp = 2;
                s.micro_batches = 6;
              }});
}

// The benchmark's ranks (bench/trainmem_bench.cc BM_EstimatePpFsdpRank70B_T8192): Llama-3-70B shapes over TP8 x
// PP4 x FSDP2 dp 2, 8 micro-batches of 1F1B, selective checkpointing, T = 8192, one rank alone, both ways.
SimResult llama70b_rank(uint64_t rank, bool memo, SimResult* off) {
  ModelRequest req;
  req.model = "llama-3-8b";
  req.overrides = {"hidden_size=8192", "num_hidden_layers=80", "num_attention_heads=64", "num_key_value_heads=8",
                   "intermediate_size=28672"};
  ModelSpec m = load_model(req, testing::MapFileReader());
  apply_tensor_parallel(m, 8);
  Inventory inv = build_inventory(m);
  mark_tp_shards(m, inv);
  TrainSetup s = testing::train_setup(1, 8192, Precision::kFp32);
  s.checkpointing = Checkpointing::kSelective;
  s.tp = 8;
  pp_fsdp(s, 4, 8, 2);
  SimOptions o;
  o.loop = LoopKind::kHf;
  TrainSetup ps = s;
  ps.optimizer_impl = OptimizerImpl::kFused;
  SimOptions ro = pp_rank_options(o, s, pp_stage_split(s.pp, m.layers), rank);
  ro.memo = memo;
  const Inventory stage_inv = pp_stage_inventory(inv, ro.pp.parts);
  if (off) {
    SimOptions roff = ro;
    roff.memo = false;
    *off = simulate(m, stage_inv, ps, roff);
  }
  return simulate(m, stage_inv, ps, ro);
}

TEST(Memo, Llama70BTp8Pp4Fsdp2Rank0) {
  SimResult b;
  const SimResult a = llama70b_rank(0, true, &b);
  EXPECT_FALSE(a.memo_fell_back);
  // of 16 actions a step (F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7): step 1 replays F2-F6 (F2-F4 from F1
  // while its backward is still to come, F5 and F6 from the pair it became) and B2-B6; step 2 F1-F6 and B1-B6.
  // F0 and B0 (the first forward, the backward that makes the .grad handles) and F7 and B7 (the stage's last
  // backward) are simulated every step.
  EXPECT_EQ(a.memo_replayed, 22u);
  expect_same(a, b, "70B rank 0");
}

// The last stage (one micro-batch in flight): its input gradients, kept to the next step, are escapes of each
// backward (PpChunk::input_grad).
TEST(Memo, Llama70BTp8Pp4Fsdp2LastRank) {
  SimResult b;
  const SimResult a = llama70b_rank(3, true, &b);
  EXPECT_FALSE(a.memo_fell_back);
  // F0 B0 F1 B1 ... F7 B7 a step: step 1 replays F2-F6 and B2-B6 (F1's pair the template; F7's backward is the
  // stage's last, a position no pair has yet), step 2 F1-F6 and B1-B6 (its first actions find the workspaces made)
  EXPECT_EQ(a.memo_replayed, 22u);
  expect_same(a, b, "70B rank 3");
}

}  // namespace
}  // namespace trainmem
