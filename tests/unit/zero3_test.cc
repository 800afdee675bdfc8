// --dp N --sharding zero3 [--offload optimizer|params]: one rank of DeepSpeed ZeRO stage 3 (zero.h, loop.cc).
// No GPU here: these tests pin the partition arithmetic against literal values worked by hand from the source's
// rules (deepspeedai/DeepSpeed edaa722, 0.19.6: runtime/zero/partition_parameters.py _partition_param /
// _padding_size, parameter_offload.py mark_persistent_parameters, stage3.py _create_fp16_sub_groups,
// runtime/comm/coalesced_collectives.py reduce_scatter_coalesced), DeepSpeed's published estimator rows for
// t5-3b (docs/code-docs/source/memory.rst), and what the simulated rank allocates.
#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"
#include "trainmem/zero.h"

namespace trainmem {
namespace {

using testing::run;

// _partition_param: tensor_size = ds_numel + (world - ds_numel % world if the remainder else 0); partition_size =
// tensor_size // world. 10 on 4: 12 // 4 = 3 (padding 2); 8 on 4: 2 (0); 1 on 8: 1 (7); 0 on 8: 0.
TEST(Zero3Partition, DsTensorIsTheWorldPaddedShare) {
  EXPECT_EQ(zero3_partition_numel(10, 4), 3u);
  EXPECT_EQ(zero3_padding(10, 4), 2u);
  EXPECT_EQ(zero3_partition_numel(8, 4), 2u);
  EXPECT_EQ(zero3_padding(8, 4), 0u);
  EXPECT_EQ(zero3_partition_numel(1, 8), 1u);
  EXPECT_EQ(zero3_padding(1, 8), 7u);
  EXPECT_EQ(zero3_partition_numel(0, 8), 0u);
  // t5-3b's shared embedding, 32128 x 1024 = 32,899,072 on 8 ranks: 4,112,384 each, no padding; on 7:
  // 32,899,072 = 7 * 4,699,867 + 3, so 4,699,868 each and 4 elements of padding
  EXPECT_EQ(zero3_partition_numel(32899072, 8), 4112384u);
  EXPECT_EQ(zero3_partition_numel(32899072, 7), 4699868u);
  EXPECT_EQ(zero3_padding(32899072, 7), 4u);
}

// mark_persistent_parameters: in named_parameters() order, `if ds_numel + total > model_threshold: continue`, then
// persistent when ds_numel <= param_threshold.
TEST(Zero3Partition, PersistenceThresholds) {
  const std::vector<uint64_t> n{5, 200000, 100000, 100001, 3};
  EXPECT_EQ(zero3_persistent(n, 100000, kZero3DefaultModelPersistence), (std::vector<char>{1, 0, 1, 0, 1}));
  // model threshold 100,004: 5 (total 5); 100,000 would make 100,005: skipped; 3 (total 8)
  EXPECT_EQ(zero3_persistent(n, 100000, 100004), (std::vector<char>{1, 0, 0, 0, 1}));
  EXPECT_EQ(zero3_persistent(n, 0, kZero3DefaultModelPersistence), (std::vector<char>{0, 0, 0, 0, 0}));
}

// _create_fp16_sub_groups: one group when sub_group_size >= the group's partition elements; otherwise cut once the
// running sum reaches sub_group_size (or at the last parameter).
TEST(Zero3Partition, SubGroupsAndTheReduceScatterBuffer) {
  EXPECT_EQ(zero3_sub_groups({4, 4, 4}, 100), (std::vector<uint64_t>{12}));
  EXPECT_EQ(zero3_sub_groups({4, 4, 4}, 5), (std::vector<uint64_t>{8, 4}));
  EXPECT_EQ(zero3_sub_groups({6, 1}, 5), (std::vector<uint64_t>{6, 1}));
  // reduce_scatter_coalesced: a single tensor divisible by the world is a view; otherwise world * sum(ceil(n / w))
  EXPECT_EQ(zero3_reduce_scatter_flat({8}, 4), 0u);
  EXPECT_EQ(zero3_reduce_scatter_flat({10}, 4), 12u);
  EXPECT_EQ(zero3_reduce_scatter_flat({3, 5}, 4), 12u);  // (1 + 2) * 4
}

Scenario zero3_scenario(std::initializer_list<std::pair<const char*, std::string>> more = {}) {
  Scenario s = testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"batch", "1"}, {"seq", "32"}, {"dp", "8"},
                                             {"sharding", "zero3"}, {"precision", "bf16"}});
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

// GPT-2 with 2 layers: 53,561,088 elements (wte 38,597,376, wpe 786,432, per layer 2 x 768 + 1,769,472 + 2,304 +
// 589,824 + 768 + 2 x 768 + 2,359,296 + 3,072 + 2,359,296 + 768, ln_f 2 x 768), every tensor a multiple of 8: the
// partitions sum to 53,561,088 / 8 = 6,695,136. Persistent (<= 1e5 elements): every bias and layer norm, 2 x 9,984
// + 1,536 = 21,504 elements in 18 tensors.
TEST(Zero3Sim, Gpt2TwoLayersModelStatesByHand) {
  const Estimate e = run(zero3_scenario());
  ASSERT_TRUE(e.zero.has_value());
  const ZeroFigures& z = *e.zero;
  EXPECT_EQ(z.options.stage, 3u);
  EXPECT_EQ(z.persistent_params, 18u);
  EXPECT_EQ(z.persistent_numel, 21504u);
  EXPECT_EQ(z.partition_padding, 0u);
  EXPECT_EQ(z.lp_partitions.value, 2u * 6695136);
  EXPECT_EQ(z.grad_partitions.value, 2u * 6695136);
  EXPECT_EQ(z.fp32_partitions.value, 4u * 6695136);
  EXPECT_EQ(z.optimizer_state.value, 8u * 6695136);  // foreach AdamW's exp_avg, exp_avg_sq (the step on the CPU)
  EXPECT_EQ(z.persistent_full.value, 2u * 21504);
  EXPECT_EQ(z.ipg_buffers.value, 2u * 500000000);
  EXPECT_EQ(z.device_states.value, 16u * 6695136 + 2u * 21504 + 2u * 500000000);
  EXPECT_TRUE(z.host.empty());
  // estimate_zero3_model_states_mem_needs (no offload): 4 * largest layer (wte) + int(18 * P / 8)
  EXPECT_EQ(z.deepspeed_zero3_estimate.value, 4u * 38597376 + 18u * 53561088 / 8);

  // The timeline: after setup the weights are the partitions (no full weight outlives zero.Init), the optimizer
  // category the fp32 partitions; at the step of the last step, the persistent parameters stay gathered.
  LiveBytes live;
  const size_t wk = static_cast<size_t>(Category::kWeights), ok = static_cast<size_t>(Category::kOptimizer);
  bool checked = false;
  uint64_t max_setup_weights = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (!checked && ev.phase != Phase::kSetup) {
      EXPECT_EQ(live.by_category[wk].value, z.lp_partitions.value);
      EXPECT_EQ(live.by_category[ok].value, z.fp32_partitions.value);
      checked = true;
    }
    apply(live, ev);
    if (ev.phase == Phase::kSetup) max_setup_weights = std::max(max_setup_weights, live.by_category[wk].value);
  }
  EXPECT_TRUE(checked);
  // zero.Init: the largest full tensor (wte) and the partitions made so far, never the whole model
  EXPECT_LT(max_setup_weights, 2u * 38597376 + 2u * 6695136 * 2);
  EXPECT_EQ(live.by_category[wk].value, z.lp_partitions.value + z.persistent_full.value);
}

// The gathered buffers: a module of one NOT_AVAILABLE parameter gathers into ceil(numel / 8) * 8 elements kept as
// its data; a module of several into one flat_tensor, then each parameter its own torch.cat copy.
TEST(Zero3Sim, GatherBuffersFollowAllGatherCoalesced) {
  const Estimate e = run(zero3_scenario());
  size_t flats = 0, singles = 0, cats = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc) continue;
    const std::string_view w = ev.label.what;
    if (w == "ZeRO-3 all_gather_coalesced flat_tensor") ++flats;
    if (w == "ZeRO-3 all-gathered param_buffer") ++singles;
    if (w == "ZeRO-3 all-gathered param (torch.cat)") ++cats;
    if (w == "ZeRO-3 all-gathered param_buffer" && ev.phase == Phase::kForward && ev.step == 1) {
      // wte (38,597,376) or wpe (786,432): single-parameter modules, already multiples of 8
      EXPECT_TRUE(ev.bytes.value == 2u * 38597376 || ev.bytes.value == 2u * 786432) << ev.bytes.value;
    }
  }
  EXPECT_GT(flats, 0u);
  EXPECT_GT(singles, 0u);
  EXPECT_GT(cats, flats);
}

// Offload (memory.rst's t5-3b rows name the same three settings): what moves to the host, pinned or pageable.
TEST(Zero3Sim, OffloadMovesStatesToTheHost) {
  const Estimate o = run(zero3_scenario({{"offload", "optimizer"}}));
  const ZeroFigures& z = *o.zero;
  EXPECT_EQ(z.host_pageable.value, 4u * 6695136 + 8u * 6695136);  // fp32 partitions + DeepSpeedCPUAdam state
  EXPECT_EQ(z.host_pinned.value, 4u * 6695136 + 2u * 6695136);     // fp32 .grad buffers + bf16 grad partitions
  EXPECT_EQ(z.device_states.value, 2u * 6695136 + 2u * 21504 + 2u * 500000000);
  EXPECT_EQ(z.deepspeed_zero3_estimate.value, 4u * 38597376 + 2u * 53561088 / 8);
  const Estimate b = run(zero3_scenario({{"offload", "optimizer,params"}}));
  EXPECT_EQ(b.zero->host_pinned.value, 2u * 6695136 + 4u * 6695136 + 2u * 6695136);
  EXPECT_EQ(b.zero->device_states.value, 2u * 21504 + 2u * 500000000);
  EXPECT_EQ(b.zero->deepspeed_zero3_estimate.value, 4u * 38597376);
  // the simulated device: no fp32 partition, optimizer state or grad partition buffer
  EXPECT_EQ(b.state.optimizer_state.value, 0u);
  const std::string j = render_estimate_json(b, nullptr);
  EXPECT_NE(j.find("\"host\""), std::string::npos);
  EXPECT_NE(j.find("\"pinned_bytes\""), std::string::npos);
  const std::string t = render_estimate_table(b, nullptr);
  EXPECT_NE(t.find("host memory (CPU RAM)"), std::string::npos) << t;
}

// t5-3b (t5-small with t5-3b's sizes: 2,851,598,336 parameters, memory.rst's "2851M"; largest layer the shared
// embedding, 32,899,072: "32.90M"): DeepSpeed's estimator as trainmem reports it matches the printed per-GPU GB
// (= GiB) on 8 GPUs: 6.10 / 0.79 / 0.12.
TEST(Zero3Published, T5_3bEstimatorRowsOfMemoryRst) {
  auto gib = [](Bytes b) { return static_cast<double>(b.value) / (1ull << 30); };
  for (const auto& [offload, printed] : {std::pair{"none", 6.10}, std::pair{"optimizer", 0.79},
                                         std::pair{"optimizer,params", 0.12}}) {
    Scenario s = testing::scenario_of("t5-small", {{"batch", "1"}, {"seq", "8"}, {"dp", "8"}, {"sharding", "zero3"},
                                                   {"precision", "bf16"}, {"offload", offload}});
    for (const char* kv : {"d_model=1024", "d_ff=16384", "num_layers=24", "num_decoder_layers=24", "num_heads=32",
                           "d_kv=128"}) {
      set_field(s, "overrides", kv);
    }
    const Estimate e = run(s);
    EXPECT_EQ(e.state.parameters.value, 2851598336u);
    EXPECT_EQ(e.zero->largest_param, 32899072u);
    EXPECT_NEAR(gib(e.zero->deepspeed_zero3_estimate), printed, 0.005) << offload;
  }
}

TEST(Zero3Refusals, WhatIsNotSimulated) {
  auto refused = [](const Scenario& s, const char* what) {
    try {
      run(s);
      ADD_FAILURE() << "expected a refusal mentioning " << what;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << err.what();
    }
  };
  refused(zero3_scenario({{"sharding", "zero2"}, {"offload", "params"}}), "only with --sharding zero3");
  refused(zero3_scenario({{"offload", "optimizer"}, {"grad_accum", "2"}}), "not simulated yet");
  refused(zero3_scenario({{"offload", "optimizer"}, {"optimizer", "sgd"}}), "AdamW");
  refused(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"offload", "optimizer"}}), "zero3");
}

}  // namespace
}  // namespace trainmem
