// The inter-node network in the step time (step_time.cc Fabric): a collective over a process group whose ranks
// span nodes (nccl.cc process_groups: ranks consecutive per node, tensor parallel innermost, pipeline outermost)
// runs its ring at the network's per-GPU bandwidth (the catalog's reference node: DGX H100 one 400 Gb/s NIC per
// GPU = 50 GB/s, DGX A100 200 Gb/s = 25 GB/s; or --net-gbps), a group within a node at the link's (NVLink), checked
// here against the ring arithmetic done by hand (nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n of the
// buffer per rank, all-gather and reduce-scatter (n-1)/n of the whole).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/flops.h"
#include "trainmem/gpu.h"

namespace trainmem {
namespace {

using Fields = std::vector<std::pair<const char*, std::string>>;

// TinyLlama's shapes (hidden 2048, 32 heads, 4 KV heads) cut to 2 layers, bf16, on H100s
Estimate run(const Fields& extra) {
  Scenario s = testing::scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=2"}, {"batch", "1"},
                                                       {"seq", "64"}, {"precision", "bf16"}, {"gpu", "h100-80gb"}});
  for (const auto& [f, v] : extra) set_field(s, f, v);
  return testing::run(s);
}

bool has_note(const StepTime& t, const std::string& what) {
  for (const std::string& n : t.notes) {
    if (n.find(what) != std::string::npos) return true;
  }
  return false;
}

// DDP's buckets all-reduced over `dp` ranks at `bw` bytes/s, by hand
double ddp_by_hand(const Estimate& e, double dp, double bw) {
  const std::vector<uint64_t>& b = e.ddp->rebuilt_buckets.empty() ? e.ddp->initial_buckets : e.ddp->rebuilt_buckets;
  double s = 0;
  for (uint64_t x : b) s += 2.0 * (dp - 1) / dp * static_cast<double>(x) / bw;
  return s;
}

TEST(NetTime, TheCatalogHasTheReferenceNodesNetwork) {
  EXPECT_EQ(find_gpu("h100-80gb").perf.net_gbps, 50.0);  // DGX H100: 8 x ConnectX-7 400 Gb/s, one per GPU
  EXPECT_EQ(find_gpu("h200").perf.net_gbps, 50.0);
  EXPECT_EQ(find_gpu("a100-80gb").perf.net_gbps, 25.0);  // DGX A100: 8 x ConnectX-6 HDR 200 Gb/s
  EXPECT_EQ(find_gpu("a100-40gb").perf.net_gbps, 25.0);
  EXPECT_EQ(find_gpu("l4").perf.net_gbps, 0.0);  // a PCIe card: no reference multi-node system
  EXPECT_FALSE(find_gpu("h100-80gb").perf.net_source.empty());
}

TEST(NetTime, DdpOverTwoNodesRunsItsBucketsAtTheNetwork) {
  const Estimate one = run({{"dp", "8"}}), two = run({{"dp", "16"}});
  ASSERT_TRUE(one.ddp && two.ddp && one.time && two.time);
  // 8 ranks: one node, NVLink's 450 GB/s; 16 ranks: two nodes, the NIC's 50 GB/s
  EXPECT_NEAR(one.time->comm_seconds, ddp_by_hand(one, 8, 450e9), 1e-15);
  EXPECT_NEAR(two.time->comm_seconds, ddp_by_hand(two, 16, 50e9), 1e-15);
  EXPECT_GT(two.time->comm_seconds, 8 * one.time->comm_seconds);
  EXPECT_FALSE(has_note(*one.time, "span nodes"));
  EXPECT_TRUE(has_note(*two.time, "data-parallel groups span nodes"));
  // 16 GPUs in one node: NVLink again
  const Estimate big = run({{"dp", "16"}, {"gpus_per_node", "16"}});
  EXPECT_NEAR(big.time->comm_seconds, ddp_by_hand(big, 16, 450e9), 1e-15);
  // --net-gbps replaces the catalog's network
  const Estimate slow = run({{"dp", "16"}, {"net_gbps", "12.5"}});
  EXPECT_NEAR(slow.time->comm_seconds, ddp_by_hand(slow, 16, 12.5e9), 1e-15);
  EXPECT_TRUE(has_note(*slow.time, "(--net-gbps)"));
}

TEST(NetTime, ACardWithoutAReferenceNodeKeepsItsLinkAndSaysSo) {
  const Estimate e = run({{"dp", "16"}, {"gpu", "l4"}});
  ASSERT_TRUE(e.time);
  EXPECT_NEAR(e.time->comm_seconds, ddp_by_hand(e, 16, 32e9), 1e-15);  // PCIe 4.0 x16
  EXPECT_TRUE(has_note(*e.time, "pass --net-gbps"));
}

TEST(NetTime, TensorParallelStaysOnTheNodeWhileFsdpCrossesIt) {
  // 32 GPUs as TP 4 x FSDP2 8: each TP group is 4 consecutive ranks (one node); each data-parallel group strides
  // over them (ranks 4 apart: 2 per node of 8, 4 nodes)
  const Estimate e = run({{"gpus", "32xh100-80gb"}, {"tp", "4"}, {"sharding", "fsdp2"}});
  ASSERT_TRUE(e.time && e.fsdp);
  ASSERT_EQ(e.setup.dp, 8u);
  const FlopLedger& l = e.sim->flops;
  double tp = 0;
  for (size_t p = 0; p < kWorkPhases; ++p) {
    tp += 2.0 * 3 / 4 * static_cast<double>(l.tp_all_reduce_bytes[p]) / 450e9 +
          3.0 / 4 * static_cast<double>(l.tp_all_gather_bytes[p]) / 450e9;
  }
  EXPECT_GT(tp, 0.0);
  const FsdpOptions& o = e.fsdp->options;
  double fsdp = 0;
  for (const FsdpUnit& u : e.fsdp->units) {
    const double full = static_cast<double>(u.shard_numel) * 8;
    const double ag = 7.0 / 8 * full * static_cast<double>(itemsize(o.param_dtype)) / 50e9;
    fsdp += ag + (u.reshard_after_forward && u.kind != FsdpUnit::kRoot ? ag : 0.0);
    fsdp += 7.0 / 8 * full * static_cast<double>(itemsize(o.reduce_dtype)) / 50e9;
  }
  EXPECT_NEAR(e.time->comm_seconds, tp + fsdp, 1e-12);
  EXPECT_TRUE(has_note(*e.time, "data-parallel groups span nodes"));
  EXPECT_FALSE(has_note(*e.time, "tensor-parallel groups"));
  // nodes of 2 GPUs: the TP group of 4 spans two of them and runs at the network too
  const Estimate small = run({{"gpus", "32xh100-80gb"}, {"tp", "4"}, {"sharding", "fsdp2"}, {"gpus_per_node", "2"}});
  EXPECT_NEAR(small.time->comm_seconds, tp * 9 + fsdp, 1e-12);  // 450 / 50
  EXPECT_TRUE(has_note(*small.time, "tensor-parallel groups and data-parallel groups span nodes"));
}

TEST(NetTime, PipelineSendsBetweenNodesRunAtTheNetwork) {
  // 4 pipeline ranks, 4 micro-batches, 1F1B: 3 stage boundaries, each crossed twice on the fill and drain by a
  // (B, T, C) = (1, 64, 2048) bf16 tensor
  const double hidden = 64.0 * 2048 * 2;
  const Fields base = {{"overrides", "num_hidden_layers=4"}, {"pp", "4"}, {"micro_batches", "4"}};
  Fields two = base;
  two.push_back({"gpus_per_node", "2"});
  const Estimate on = run(base), split = run(two);
  ASSERT_TRUE(on.time && on.time->pipeline && split.time && split.time->pipeline);
  EXPECT_NEAR(on.time->pipeline->send_seconds, 2 * 3 * hidden / 450e9, 1e-18);
  EXPECT_FALSE(has_note(*on.time, "span nodes"));
  // nodes of 2: ranks {0, 1} and {2, 3}; the boundary 1 -> 2 crosses
  EXPECT_NEAR(split.time->pipeline->send_seconds, 2 * 2 * hidden / 450e9 + 2 * 1 * hidden / 50e9, 1e-18);
  EXPECT_TRUE(has_note(*split.time, "1 of the 3 stage boundaries span nodes"));
  // interleaved, 2 stages per rank over nodes of 1 GPU: all 7 boundaries (the wrap from rank 3 to 0 too) cross
  Fields inter = {{"overrides", "num_hidden_layers=8"}, {"pp", "4"}, {"micro_batches", "4"},
                  {"pp_schedule", "interleaved-1f1b"}, {"pp_virtual_stages", "2"}, {"gpus_per_node", "1"}};
  const Estimate i = run(inter);
  ASSERT_TRUE(i.time && i.time->pipeline);
  EXPECT_NEAR(i.time->pipeline->send_seconds, 2 * 7 * hidden / 50e9, 1e-18);
}

TEST(NetTime, NetGbpsIsADecimalBandwidth) {
  Scenario s;
  for (const char* bad : {"0", "-5", "abc", "1e3", "", "100001"}) {
    if (std::string(bad).empty()) continue;  // empty: the catalog's (reset)
    EXPECT_THROW(set_field(s, "net_gbps", bad), Error) << bad;
  }
  set_field(s, "net_gbps", "12.5");
  EXPECT_EQ(field_text(s, "net_gbps"), "12.5");
  set_field(s, "net_gbps", "");
  EXPECT_EQ(field_text(s, "net_gbps"), "");
}

}  // namespace
}  // namespace trainmem
