// FSDP2 over a tensor-parallel rank (--tp T --sharding fsdp2, dp = D): accelerate's fsdp2_prepare_model calls
// fully_shard with mesh=torch_device_mesh[("dp_shard_cp",)] over the model transformers already sharded
// (DistributedConfig(tp_size=T), ParallelismConfig mesh order dp_replicate, dp_shard, cp, sp, tp), and
// FSDPParam._init_sharding_spec_tp (torch _fully_shard/_fsdp_param.py) hands _init_sharded_param the DTensor's
// `_local_tensor`, chunked on dim 0 over the D ranks. The figures below are worked by hand from Llama-3-8B's config
// (hidden 4096, 32 heads, 8 kv heads, head_dim 128, ffn 14336, vocab 128256, untied) and the two rules:
// transformers' colwise/rowwise shards of 1/T, then torch.chunk(local, D, dim=0) with rank 0's chunk ceil(rows/D).
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;
using testing::scenario_of;

// One TP-local decoder layer at T = 8: q_proj 512 x 4096 (4 heads), k/v_proj 128 x 4096 (1 kv head), o_proj
// 4096 x 512, gate/up_proj 1792 x 4096, down_proj 4096 x 1792, two replicated norms of 4096.
constexpr uint64_t kLocalLayer = 512 * 4096 + 2 * 128 * 4096 + 4096 * 512 + 3 * 1792 * 4096 + 2 * 4096;
// The rank's TP-local parameters: embed_tokens replicated (128256 x 4096), 32 layers, the final norm, lm_head's
// colwise 16032 x 4096 (128256 / 8).
constexpr uint64_t kLocalParams = 128256ull * 4096 + 32 * kLocalLayer + 4096 + 16032ull * 4096;

TEST(TpFsdp, Llama3_8bT8TimesD2ShardsTheTpLocalModel) {
  static_assert(kLocalLayer == 27271168);
  const Estimate e = run(scenario_of("llama-3-8b", {{"gpus", "16xh100-80gb"}, {"tp", "8"}, {"sharding", "fsdp2"},
                                                    {"batch", "1"}, {"seq", "4096"}}));
  ASSERT_TRUE(e.fsdp.has_value());
  const FsdpFigures& f = *e.fsdp;
  EXPECT_EQ(f.options.ranks, 2u);
  ASSERT_EQ(f.units.size(), 34u);
  EXPECT_EQ(f.units[1].params, kLocalLayer);
  // all_gather_outputs: D x the padded shard, in param_dtype bf16 = the TP-local layer's bf16 bytes
  EXPECT_EQ(f.units[1].shard_numel * 2 * 2, kLocalLayer * 2);
  // fp32 shard + fp32 gradient + two fp32 Adam moments (accelerate's upcast) over D = 2; nothing padded
  EXPECT_EQ(f.sharded_params.value + f.sharded_grads.value + f.optimizer_state.value, 16 * kLocalParams / 2);
  EXPECT_EQ(f.local_elems, kLocalParams / 2);
  EXPECT_EQ(f.padding_elems, 0u);
  // NCCL: the data-parallel group's 2 members are 8 ranks apart (TP innermost), on two nodes: no NVLS; the TP
  // group fills the node. Neither is the world group.
  ASSERT_TRUE(e.device.has_value());
  ASSERT_EQ(e.device->nccl.communicators.size(), 2u);
  const NcclCommunicator& dp = e.device->nccl.communicators[0];
  const NcclCommunicator& tp = e.device->nccl.communicators[1];
  EXPECT_EQ(dp.name, "data parallel");
  EXPECT_EQ(dp.ranks, 2u);
  EXPECT_EQ(dp.local_ranks, 1u);
  EXPECT_EQ(dp.nvls.value, 0u);
  EXPECT_EQ(tp.name, "tensor parallel");
  EXPECT_EQ(tp.local_ranks, 8u);
  EXPECT_GT(tp.nvls.value, 0u);
}

// D = 3 pads the TP-local dim 0 (not the global one): per layer, rank 0's chunks are ceil(rows / 3) rows of the
// local shapes: q 171 x 4096, k/v 43 x 4096, o 1366 x 512, gate/up 598 x 4096, down 1366 x 1792, norms 1366.
TEST(TpFsdp, UnevenDataParallelPadsTheLocalDim0) {
  const Estimate e = run(scenario_of("llama-3-8b", {{"gpus", "24xh100-80gb"}, {"tp", "8"}, {"sharding", "fsdp2"},
                                                    {"batch", "1"}, {"seq", "1024"}}));
  ASSERT_TRUE(e.fsdp.has_value());
  const uint64_t shard = 171 * 4096 + 2 * 43 * 4096 + 1366 * 512 + 2 * 598 * 4096 + 1366 * 1792 + 2 * 1366;
  EXPECT_EQ(shard, 9101484u);
  EXPECT_EQ(e.fsdp->units[1].shard_numel, shard);
  EXPECT_EQ(e.fsdp->units[1].params, kLocalLayer);
}

// --tp 1 given, or --dp 1 (one data-parallel rank of --tp 8), reproduce the uncomposed estimates byte for byte.
void expect_same(const Estimate& a, const Estimate& b) {
  EXPECT_EQ(a.memory.peak_allocated.value, b.memory.peak_allocated.value);
  EXPECT_EQ(a.memory.peak_reserved.value, b.memory.peak_reserved.value);
  EXPECT_EQ(a.state.weights.value, b.state.weights.value);
  EXPECT_EQ(a.state.optimizer_state.value, b.state.optimizer_state.value);
  EXPECT_EQ(a.fsdp.has_value(), b.fsdp.has_value());
}

TEST(TpFsdp, TpOneOrDpOneIsTheUncomposedEstimate) {
  const Scenario base = scenario_of("llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"gpus", "8xh100-80gb"},
                                                   {"sharding", "fsdp2"}, {"batch", "1"}, {"seq", "512"}});
  Scenario tp1 = base;
  set_field(tp1, "tp", "1");
  expect_same(run(base), run(tp1));
  const Scenario tp8 = scenario_of("llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"tp", "8"},
                                                  {"gpu", "h100-80gb"}, {"batch", "1"}, {"seq", "512"}});
  Scenario dp1 = tp8;  // --gpus 8 with --tp 8: dp = 1
  set_field(dp1, "gpus", "8xh100-80gb");
  expect_same(run(tp8), run(dp1));
}

TEST(TpFsdp, TheTailUnitsPreBackwardPrefetchesTheLastLayer) {
  // fully_shard's post-forward hook on [norm, lm_head] runs on the logits that TP's output hook gathered, and
  // registers the tail's pre-backward hook, which prefetches the previous unit (the last decoder layer): its
  // all-gather is issued before lm_head's backward runs, as without TP. (A tail without its post-forward would
  // gather the last layer only when that layer's own backward starts.) Under sequence parallelism (torchtitan's
  // apply_fsdp, sp_fsdp_test) the tail's post-forward runs on lm_head's Shard(-1) logits, with the same effect.
  struct Case {
    const char* tp;
    bool sp;
  };
  for (const Case k : {Case{"1", false}, Case{"2", false}, Case{"2", true}}) {
    const char* tp = k.sp ? "2 (sequence parallel)" : k.tp;
    Scenario s = scenario_of("llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"overrides", "vocab_size=1024"}, {"tp", k.tp},
                                            {"dp", "2"}, {"sharding", "fsdp2"}, {"precision", k.sp ? "fp32" : "bf16"},
                                            {"batch", "1"}, {"seq", "64"}});
    if (k.sp) set_field(s, "sequence_parallel", "true");
    const Estimate e = run(s);
    size_t gather = 0, head_backward = 0;
    size_t i = 0;
    for (const Event& ev : e.sim->timeline.events) {
      ++i;
      if (ev.step != 2 || ev.kind != Event::kAlloc || ev.phase != Phase::kBackward) continue;
      const std::string_view w = ev.label.what;
      if (!gather && ev.label.layer == 1 && w.find("FSDP all-gather output") != std::string_view::npos) gather = i;
      if (!head_backward && ev.label.row == kRowBackwardOf && w.rfind("lm_head", 0) == 0) head_backward = i;
    }
    ASSERT_NE(gather, 0u) << "tp " << tp;
    ASSERT_NE(head_backward, 0u) << "tp " << tp;
    EXPECT_LT(gather, head_backward) << "tp " << tp;
  }
}

TEST(TpFsdp, WhatIsStillRefused) {
  const auto msg = [](const Scenario& s) {
    try {
      (void)run(s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // DDP over a TP rank: refused as accelerate and torchtitan refuse it; ZeRO: not simulated
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "8"}, {"gpus", "16xh100-80gb"}})).find("DDP has not supported > 1D parallelism"),
            std::string::npos);
  EXPECT_NE(msg(scenario_of("llama-3-8b", {{"tp", "8"}, {"gpus", "16xh100-80gb"}, {"sharding", "zero1"}}))
                .find("zero1"), std::string::npos);
}

}  // namespace
}  // namespace trainmem
