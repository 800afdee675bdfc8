// --dp N --sharding fsdp1: one rank of FSDP1 (FullyShardedDataParallel) under accelerate (fsdp1.h,
// src/sim/fsdp1.cc). No GPU here: these tests pin the flat-parameter arithmetic to numbers worked by hand from the
// source's rules (_flat_param.py _init_flat_param_and_metadata: before each parameter a padding of
// aligned - total % aligned when below aligned, aligned = 16 bytes / the dtype's size; then a padding of
// W - total % W when below W; _get_shard: chunks of ceil(total / W)), the Trainer's units, and what the simulated
// rank allocates. validate/cpu/fsdp1.py checks the same layouts against PyTorch 1.13's FlatParamHandle.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp1.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::run;

// A layout against its hand numbers: each parameter's offset, the alignment and world-size padding, S.
struct Hand {
  std::vector<uint64_t> offsets;  // empty: not checked
  uint64_t params, align, world, shard, ranks;
};
void expect_layout(const Fsdp1Layout& l, const Hand& h) {
  if (!h.offsets.empty()) EXPECT_EQ(l.offsets, h.offsets);
  EXPECT_EQ(l.params, h.params);
  EXPECT_EQ(l.align_padding, h.align);
  EXPECT_EQ(l.world_padding, h.world);
  EXPECT_EQ(l.shard_numel, h.shard);
  EXPECT_EQ(l.padded_unsharded_numel, h.shard * h.ranks);
}

TEST(Fsdp1Layout, AlignmentIsSixteenBytes) {
  EXPECT_EQ(fsdp1_aligned_numel(DType::kBF16), 8u);
  EXPECT_EQ(fsdp1_aligned_numel(DType::kF16), 8u);
  EXPECT_EQ(fsdp1_aligned_numel(DType::kF32), 4u);
}

// numels 5, 3, 10 with 8-element alignment on 8 ranks: 5 at 0, pad 3, 3 at 8, pad 5, 10 at 16, total 26, pad 6 to
// 32 = 8 x 4. Without alignment (use_orig_params=False): 18 elements, S = ceil(18 / 8) = 3, 24 gathered, the
// last ranks' shards F.pad-ded (6 elements).
TEST(Fsdp1Layout, PaddingByHand) {
  const Fsdp1Layout a = fsdp1_layout({5, 3, 10}, 8, 8);
  expect_layout(a, {{0, 8, 16}, 18, 8, 6, 4, 8});
  EXPECT_EQ(a.unpadded_numel, 32u);
  // rank r holds [4r, 4r + 4): the 5 at [0, 5) gives 4 to rank 0 and 1 to rank 1, the 3 at [8, 11) 3 to rank 2,
  // the 10 at [16, 26) 4, 4, 2 to ranks 4, 5, 6; rank 3 and rank 7 hold padding only
  const uint64_t in_shard[3][8] = {{4, 1, 0, 0, 0, 0, 0, 0}, {0, 0, 3, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 4, 4, 2, 0}};
  for (size_t p = 0; p < 3; ++p) {
    for (uint64_t r = 0; r < 8; ++r) EXPECT_EQ(fsdp1_numel_in_shard(a, p, r), in_shard[p][r]) << p << " " << r;
  }
  const Fsdp1Layout u = fsdp1_layout({5, 3, 10}, 0, 8);
  expect_layout(u, {{0, 5, 8}, 18, 0, 6, 3, 8});
  EXPECT_EQ(u.unpadded_numel, 18u);
  EXPECT_THROW(fsdp1_layout({}, 8, 8), Error);
}

// GPT-2 124M's block in fp32 (4-element alignment) on 7 ranks: ln_1 768 + 768, c_attn 768 x 2304 = 1,769,472 +
// 2,304, c_proj 589,824 + 768, ln_2 768 + 768, c_fc 2,359,296 + 3,072, mlp.c_proj 2,359,296 + 768 = 7,087,872
// elements, every one a multiple of 4 (no alignment padding); 7,087,872 = 7 x 1,012,553 + 1: 6 elements of
// world-size padding, 7,087,878 = 7 x 1,012,554.
TEST(Fsdp1Layout, Gpt2BlockOnSevenRanks) {
  expect_layout(fsdp1_layout({768, 768, 1769472, 2304, 589824, 768, 768, 768, 2359296, 3072, 2359296, 768},
                             fsdp1_aligned_numel(DType::kF32), 7),
                {{}, 7087872, 0, 6, 1012554, 7});
}

// Llama-3-8B on 8 ranks with bf16 compute (8-element alignment). A decoder layer: q 4096 x 4096 = 16,777,216,
// k and v 1024 x 4096 = 4,194,304 each, o 16,777,216, gate/up/down 14336 x 4096 = 58,720,256 each, two norms of
// 4,096: 218,112,000, divisible by 8: S = 27,264,000, no padding. The root: embed_tokens 128256 x 4096 =
// 525,336,576, norm 4,096, lm_head 525,336,576: 1,050,677,248, S = 131,334,656. On 6 ranks the root needs 2
// elements of world-size padding (1,050,677,248 = 6 x 175,112,874 + 4): S = 175,112,875.
TEST(Fsdp1Layout, Llama3LayerAndRootByHand) {
  const std::vector<uint64_t> layer{16777216, 4194304, 4194304, 16777216, 58720256, 58720256, 58720256, 4096, 4096};
  const Fsdp1Layout l = fsdp1_layout(layer, 8, 8);
  expect_layout(l, {{}, 218112000, 0, 0, 27264000, 8});
  // rank 0's shard [0, 27,264,000): q (16,777,216), k (4,194,304), v (4,194,304), o's first 2,098,176
  const uint64_t rank0[9] = {16777216, 4194304, 4194304, 2098176, 0, 0, 0, 0, 0};
  for (size_t p = 0; p < 9; ++p) EXPECT_EQ(fsdp1_numel_in_shard(l, p, 0), rank0[p]) << p;
  expect_layout(fsdp1_layout({525336576, 4096, 525336576}, 8, 8), {{}, 1050677248, 0, 0, 131334656, 8});
  expect_layout(fsdp1_layout({525336576, 4096, 525336576}, 8, 6), {{}, 1050677248, 0, 2, 175112875, 6});
}

// A llama of 2 layers, hidden 60, 4 heads of 16 with 2 KV heads, intermediate 200, vocab 1001, on 8 ranks: 60 is
// not a multiple of 8, so the norms and the root get alignment padding.
//   layer (bf16 compute, 8-element alignment): q 64 x 60 = 3,840 at 0, k 32 x 60 = 1,920 at 3,840, v 1,920 at
//   5,760, o 60 x 64 = 3,840 at 7,680, gate/up 200 x 60 = 12,000 at 11,520 and 23,520, down 60 x 200 = 12,000 at
//   35,520, input_layernorm 60 at 47,520, pad 4, post_attention_layernorm 60 at 47,584, pad 4 to 47,648 = 8 x 5,956
//   root: embed_tokens 1001 x 60 = 60,060 at 0, pad 4, norm 60 at 60,064, pad 4, lm_head 60,060 at 60,128, pad 4 to
//   120,192 = 8 x 15,024
// Rank 0's shards hold parameters only (its ranges end before any padding): 5,956 x 2 + 15,024 = 26,936 elements.
Scenario tiny(std::initializer_list<std::pair<const char*, std::string>> more = {}) {
  Scenario s = testing::scenario_of("llama-3-8b", {{"batch", "1"}, {"seq", "32"}, {"dp", "8"}, {"sharding", "fsdp1"}});
  for (const char* o : {"num_hidden_layers=2", "hidden_size=60", "intermediate_size=200", "num_attention_heads=4",
                        "num_key_value_heads=2", "head_dim=16", "vocab_size=1001"}) {
    set_field(s, "overrides", o);
  }
  for (const auto& [f, v] : more) set_field(s, f, v);
  return s;
}

TEST(Fsdp1Units, TrainerUnitsAndRankZeroStatesByHand) {
  const Estimate e = run(tiny());
  const Fsdp1Figures& f = e.fsdp1.value();
  std::vector<std::string> names;
  for (const Fsdp1Unit& u : f.units) names.push_back(u.name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.layers.0", "model.layers.1", "model (root)"}));
  expect_layout(f.units[0].layout, {{0, 3840, 5760, 7680, 11520, 23520, 35520, 47520, 47584}, 47640, 4, 4, 5956, 8});
  expect_layout(f.units[2].layout, {{0, 60064, 60128}, 120180, 8, 4, 15024, 8});
  // bf16-amp: fp32 flat parameters (accelerate's upcast), bf16 gathers and reduce-scatters; the Trainer's
  // use_orig_params and NO_PREFETCH
  const Fsdp1Options& o = f.options;
  EXPECT_EQ(std::tuple(o.orig_dtype, o.param_dtype, o.reduce_dtype, o.use_orig_params, o.backward_prefetch),
            std::tuple(DType::kF32, DType::kBF16, DType::kBF16, true, false));
  // rank 0: 26,936 elements of parameters in its shards; fp32 parameters and gradients, foreach AdamW's two moments
  // (its step on the CPU); 8 + 8 + 12 padding elements over all ranks
  EXPECT_EQ(std::tuple(f.shard_elems, f.local_elems, f.padding_elems), std::tuple(26936u, 26936u, 28u));
  EXPECT_EQ(std::tuple(f.sharded_params.value, f.sharded_grads.value, f.optimizer_state.value, e.state.weights.value),
            std::tuple(4u * 26936, 4u * 26936, 8u * 26936, 4u * 26936));
}

// --dp-rank 7, the last rank: its shard of each layer ends with the 4 elements of alignment padding before
// post_attention_layernorm and the 4 of world-size padding ([41,692, 47,648)), the root's with its 4 of world-size
// padding: 26,936 - 2 x 8 - 4 = 26,916 parameter elements, the same padded S per unit.
TEST(Fsdp1Units, TheLastRankHoldsThePadding) {
  const Fsdp1Figures f = run(tiny({{"dp_rank", "7"}})).fsdp1.value();
  EXPECT_EQ(std::tuple(f.options.rank, f.shard_elems, f.local_elems), std::tuple(uint64_t{7}, uint64_t{26936}, uint64_t{26916}));
  EXPECT_EQ(f.optimizer_state.value, 8u * 26916);
}

// How many flat parameters (the root's and the layers') are unsharded at once in the backward.
uint64_t most_unsharded_in_backward(const Estimate& e) {
  uint64_t now = 0, most = 0;
  for (const Event& ev : e.sim->timeline.events) {
    const std::string_view w = ev.label.what;
    if (w != "FSDP1 unsharded flat parameter" && w != "FSDP1 unsharded flat parameter (model (root))") continue;
    now = ev.kind == Event::kAlloc ? now + 1 : ev.kind == Event::kFree ? now - 1 : now;
    if (ev.phase == Phase::kBackward) most = std::max(most, now);
  }
  return most;
}

TEST(Fsdp1Sim, BuffersByNameSizeAndStream) {
  const Estimate e = run(tiny());
  struct Want {
    const char* what;
    uint64_t bytes;
    Stream stream;
    uint64_t times;  // in step 2, for layer 1
    uint64_t seen = 0;
  };
  // the forward's unshard and the pre-backward's (FULL_SHARD resharded it after forward); one of each in the
  // post-backward
  Want want[] = {{"FSDP1 unsharded flat parameter", 8u * 5956 * 2, Stream::kFsdp1Unshard, 2},
                 {"FSDP1 low-precision shard (_mp_shard)", 5956u * 2, Stream::kFsdp1PreUnshard, 2},
                 {"FSDP1 unsharded flat gradient", 47648u * 2, Stream::kDefault, 1},
                 {"FSDP1 new_sharded_grad", 5956u * 2, Stream::kFsdp1PostBackward, 1},
                 {"FSDP1 sharded gradient", 5956u * 4, Stream::kFsdp1PostBackward, 1}};
  LiveBytes live;
  for (const Event& ev : e.sim->timeline.events) {
    apply(live, ev);
    const std::string_view w = ev.label.what;
    if (w == "FSDP1 unsharded flat parameter (model (root))") EXPECT_EQ(ev.bytes.value, 120192u * 2);
    if (ev.kind != Event::kAlloc || ev.step != 2 || ev.label.layer != 1) continue;
    for (Want& x : want) {
      if (w != x.what) continue;
      ++x.seen;
      EXPECT_EQ(ev.bytes.value, x.bytes) << x.what;
      EXPECT_EQ(ev.stream, x.stream) << x.what;
    }
  }
  for (const Want& x : want) EXPECT_EQ(x.seen, x.times) << x.what;
  // NO_PREFETCH: in the backward the root's flat parameter and the running layer's, no more
  EXPECT_EQ(most_unsharded_in_backward(e), 2u);
  EXPECT_EQ(live.by_category[static_cast<size_t>(Category::kFsdpBuffers)].value, 0u);
  // the optimizer's state: rank 0's views, 26,936 fp32 elements, two moments each
  EXPECT_EQ(live.by_category[static_cast<size_t>(Category::kOptimizer)].value, 8u * 26936);
}

// The setup of rank 0 of 8 for Llama-3-8B cut to 4 layers under bf16 autocast, allocation for allocation, as
// validate/measured/open/h200_hf_dist_fsdp1x8_llama3_4layers_sdpa_b2_t2048_bf16amp.json recorded it (a fake process
// group on an H200) and as FSDP(model, device_id, sync_module_states=True) makes it, unit by unit (the layers, then
// the root): _move_module_to_device's breadth-first walk (a layer's two norms, then q, k, v, o, gate, up, down;
// the root's lm_head, embed_tokens, norm, then the two rotary buffers); _sync_module_params_and_buffers'
// broadcast_coalesced over the unit's buffers and parameters in 250 MiB buckets (a layer: [q, k, v, o, gate] 384
// MiB, [up, down] 448 MiB, [2 norms] 32 KiB; the root: [2 buffers, embed_tokens], [norm, lm_head]: a bucket closes
// once it reaches 250 MiB, and one of a single tensor is a view); the FlatParameter (torch.cat); its shard (/ 8).
// Reserved when the model is wrapped: 15,235,809,280 B measured (it was 7.18 GB short before the broadcasts).
TEST(Fsdp1Load, MovesBroadcastsFlattensAndShardsEachUnitAsMeasured) {
  const Estimate e = run(testing::scenario_of(
      "llama-3-8b", {{"overrides", "num_hidden_layers=4"}, {"batch", "2"}, {"seq", "2048"}, {"dp", "8"},
                     {"sharding", "fsdp1"}, {"precision", "bf16-amp"}, {"torch", "2.11"}}));
  const uint64_t H = 4096, KV = 1024, F = 14336, V = 128256, W = 8;
  const uint64_t layer = 2 * H * H + 2 * KV * H + 3 * F * H + 2 * H;  // 218,112,000: no padding at 8 ranks
  std::vector<uint64_t> want;
  for (int l = 0; l < 4; ++l) {
    for (uint64_t x : {H, H, H * H, KV * H, KV * H, H * H, F * H, F * H, H * F}) want.push_back(4 * x);
    for (uint64_t x : {2 * H * H + 2 * KV * H + F * H, 2 * F * H, 2 * H, layer, layer / W}) want.push_back(4 * x);
  }
  const uint64_t root = 2 * V * H + H;
  const uint64_t inv_freq = 128 / 2;  // head_dim / 2 float32 elements, and original_inv_freq alike
  for (uint64_t x : {V * H, V * H, H, inv_freq, inv_freq, 2 * inv_freq + V * H, H + V * H, root, root / W}) {
    want.push_back(4 * x);
  }
  const testing::SetupAllocs got = testing::setup_allocs(e);
  EXPECT_EQ(got.bytes, want);
  EXPECT_EQ(got.reserved, 15235809280u);
}

// backward_prefetch BACKWARD_PRE: each pre-backward hook all-gathers the unit before it in post-forward order
// (_ExecOrderData.get_handle_to_backward_prefetch: index - 1); the root's, on the loss, the last layer's. So the
// root, the running layer and the prefetched one are unsharded at once; the step gathers each layer once in the
// backward all the same.
TEST(Fsdp1Sim, BackwardPrePrefetchesOneUnitAhead) {
  const Estimate e = run(tiny({{"fsdp1_prefetch", "backward_pre"}}));
  ASSERT_TRUE(e.fsdp1->options.backward_prefetch);
  EXPECT_EQ(most_unsharded_in_backward(e), 3u);
  const Estimate none = run(tiny({{"fsdp1_prefetch", "none"}}));
  EXPECT_EQ(most_unsharded_in_backward(none), 2u);
  EXPECT_THROW(run(tiny({{"fsdp1_prefetch", "backward_post"}})), Error);
}

TEST(Fsdp1Report, NamesTheFlatParametersAndTheJson) {
  const Estimate e = run(tiny());
  const std::string text = render_estimate_table(e, nullptr), json = render_estimate_json(e, nullptr);
  for (const char* want : {"per rank, 8 ranks (FSDP1)", "FSDP1 (FullyShardedDataParallel through accelerate",
                           "flat 47,648 = 47,640 parameters + 4 alignment + 4 world-size padding; shard S 5,956"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
  for (const char* want : {"\"fsdp1\"", "\"shard_numel\": 15024", "\"world_padding\": 4"}) {
    EXPECT_NE(json.find(want), std::string::npos) << want << "\n" << json;
  }
}

// Llama-3-8B on 8 ranks, rank 0, by hand: 32 layers x 27,264,000 + 131,334,656 = 1,003,782,656 shard elements,
// all parameters on rank 0 (no padding anywhere): fp32 parameters 4,015,130,624 B, fp32 gradients the same, AdamW
// 8,030,261,248 B.
TEST(Fsdp1Units, Llama3On8RanksPerRankStates) {
  const Estimate e = run(testing::scenario_of("llama-3-8b", {{"batch", "1"}, {"seq", "64"}, {"dp", "8"},
                                                             {"sharding", "fsdp1"}, {"overrides", "num_hidden_layers=2"}}));
  // two layers keep the test fast: 2 x 27,264,000 + 131,334,656 = 185,862,656
  ASSERT_TRUE(e.fsdp1.has_value());
  EXPECT_EQ(e.fsdp1->shard_elems, 185862656u);
  EXPECT_EQ(e.fsdp1->sharded_params.value, 4u * 185862656);
  EXPECT_EQ(e.fsdp1->optimizer_state.value, 8u * 185862656);
  const uint64_t full = 32u * 27264000 + 131334656;
  EXPECT_EQ(full, 1003782656u);
  EXPECT_EQ(4 * full, 4015130624u);
  EXPECT_EQ(8 * full, 8030261248u);
}

TEST(Fsdp1Refusals, WhatIsNotSimulated) {
  auto refused = [](std::initializer_list<std::pair<const char*, std::string>> more, const char* what) {
    const std::string why = testing::error_of([&] { run(tiny(more)); });
    EXPECT_NE(why.find(what), std::string::npos) << why;
  };
  refused({{"checkpointing", "selective"}}, "the Trainer checkpoints whole decoder layers");
  refused({{"precision", "fp16-amp"}}, "sharded gradient scaler");
  refused({{"torch", "2.0"}}, "PyTorch >= 2.1");
  refused({{"loop", "nanogpt"}}, "--loop hf");
  refused({{"reshard_after_forward", "false"}}, "FSDP2's setting");
  refused({{"bucket_cap_mb", "25"}}, "DDP setting");
  refused({{"optimizer", "sgd"}}, "AdamW/Adam");
  refused({{"overrides", "tie_word_embeddings=true"}}, "tied input/output embeddings");
  const std::string g = testing::error_of([] {
    run(testing::scenario_of("gpt2", {{"overrides", "n_layer=2"}, {"dp", "8"}, {"sharding", "fsdp1"}}));
  });
  EXPECT_NE(g.find("llama family"), std::string::npos) << g;
}

// --- gradient accumulation (no_sync) and gradient checkpointing -------------------------------------------------

// Live bytes of the tensors whose label starts with `prefix`, right after event `upto` (exclusive).
uint64_t live_labelled(const Estimate& e, std::string_view prefix, size_t upto) {
  uint64_t live = 0;
  for (size_t i = 0; i < upto && i < e.sim->timeline.events.size(); ++i) {
    const Event& ev = e.sim->timeline.events[i];
    if (std::string_view(ev.label.what).rfind(prefix, 0) != 0) continue;
    if (ev.kind == Event::kAlloc) live += ev.bytes.value;
    if (ev.kind == Event::kFree) live -= ev.bytes.value;
  }
  return live;
}
// The index of the first event of step `step`'s micro-batch `micro`.
size_t first_event_of(const Estimate& e, uint32_t step, uint32_t micro) {
  for (size_t i = 0; i < e.sim->timeline.events.size(); ++i) {
    const Event& ev = e.sim->timeline.events[i];
    if (ev.step == step && ev.micro == micro) return i;
  }
  ADD_FAILURE() << "no micro-batch " << micro << " in step " << step;
  return 0;
}
// Allocations labelled `what` in step 2's micro-batch `micro` (0: any), and their bytes.
std::pair<uint64_t, uint64_t> allocs_of(const Estimate& e, std::string_view what, uint32_t micro) {
  uint64_t n = 0, bytes = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc || ev.step != 2 || (micro != 0 && ev.micro != micro) || what != ev.label.what) continue;
    ++n;
    bytes += ev.bytes.value;
  }
  return {n, bytes};
}

// --grad-accum 2: the Trainer's first micro-batch runs under accelerator.no_sync (FSDP1's _sync_gradients False).
// _post_backward_hook then returns before the reduce-scatter, keeping flat_param.grad: each unit's unpadded
// unsharded flat gradient in param_dtype (bf16), padding tensors included (_unpadded_unsharded_size), by hand
// (tiny()'s layouts): 2 layers x 47,648 + the root's 120,192 = 215,488 elements, 430,976 bytes, live from the
// first micro-batch's backward to the second's post-backward hooks. FULL_SHARD still frees the unsharded flat
// parameters in the no_sync backward (_should_free_in_backward: RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES), and only
// the synced micro-batch reduce-scatters, one new_sharded_grad per unit.
TEST(Fsdp1NoSync, KeepsEachUnitsUnshardedFlatGradientBetweenMicroBatches) {
  const Estimate e = run(tiny({{"grad_accum", "2"}}));
  const uint64_t kept = (2u * 47648 + 120192) * 2;
  EXPECT_EQ(kept, 430976u);
  EXPECT_EQ(e.fsdp1->no_sync_kept_grads.value, kept);
  EXPECT_EQ(e.sim->micro_batches_simulated, 2u);
  for (uint32_t step : {1u, 2u}) {
    EXPECT_EQ(live_labelled(e, "FSDP1 unsharded flat gradient", first_event_of(e, step, 2)), kept) << step;
  }
  EXPECT_EQ(allocs_of(e, "FSDP1 new_sharded_grad", 1).first, 0u);
  EXPECT_EQ(allocs_of(e, "FSDP1 new_sharded_grad", 2).first, 2u);  // the layers' (the root's is labelled apart)
  EXPECT_EQ(allocs_of(e, "FSDP1 new_sharded_grad (model (root))", 2).first, 1u);
  // each layer gathered in the forward and again in the backward, and freed after each, in both micro-batches
  for (uint32_t micro : {1u, 2u}) EXPECT_EQ(allocs_of(e, "FSDP1 unsharded flat parameter", micro).first, 4u) << micro;
  // the second micro-batch's AccumulateGrad sums into the kept gradient: no second one stays
  EXPECT_EQ(live_labelled(e, "FSDP1 unsharded flat gradient", e.sim->timeline.events.size()), 0u);
  LiveBytes live;
  for (const Event& ev : e.sim->timeline.events) apply(live, ev);
  EXPECT_EQ(live.by_category[static_cast<size_t>(Category::kFsdpBuffers)].value, 0u);
  // the optimizer still steps rank 0's 26,936 fp32 shard elements
  EXPECT_EQ(live.by_category[static_cast<size_t>(Category::kOptimizer)].value, 8u * 26936);
}

// _use_unsharded_grad_views, in the first no_sync post-backward of a step: a parameter whose .grad is None and whose
// sharded view (1-d, fp32) differs from its gradient view (the original shape, bf16) gets
// `param.grad = torch.empty_like(param)` before `param.grad.data = view`: rank 0's in-shard elements in fp32, once.
// tiny()'s rank 0 holds q (3,840), k (1,920) and 196 of v's elements of each layer ([0, 5,956)) and 15,024 of
// embed_tokens: 7 allocations, 4 x (2 x 5,956 + 15,024) = 107,744 bytes. The next micro-batches find .grad set.
TEST(Fsdp1NoSync, GradViewsAllocateEmptyLikeInTheFirstMicroBatchOnly) {
  const Estimate e = run(tiny({{"grad_accum", "3"}}));
  EXPECT_EQ(e.sim->micro_batches_simulated, 3u);
  const char* what = "FSDP1 _use_unsharded_grad_views empty_like(param)";
  EXPECT_EQ(allocs_of(e, what, 1), std::pair(uint64_t{7}, uint64_t{107744}));
  EXPECT_EQ(allocs_of(e, what, 2).first, 0u);
  EXPECT_EQ(allocs_of(e, what, 3).first, 0u);
  EXPECT_EQ(4u * (2 * 5956 + 15024), 107744u);
}

// A middle micro-batch (2 .. grad_accum - 1) starts with the kept gradients and its AccumulateGrad adds a new flat
// gradient to each; its state at the end is the first's (the same tensors), so micro-batch 2 stands for all of them:
// --grad-accum 3, 4 and 8 give the same peak and reserved bytes. With checkpointing (small activations) that middle
// micro-batch is where the peak is, above --grad-accum 2's (whose second micro-batch reduce-scatters).
TEST(Fsdp1NoSync, MiddleMicroBatchesRepeatTheSecond) {
  const auto peak = [](const char* ga, const char* ckpt) {
    const Estimate e = run(tiny({{"grad_accum", ga}, {"checkpointing", ckpt}}));
    return std::tuple(e.sim->peak.live.total.value, e.sim->peak.micro, e.memory.peak_reserved.value);
  };
  for (const char* ckpt : {"none", "full"}) {
    EXPECT_EQ(peak("3", ckpt), peak("4", ckpt)) << ckpt;
    EXPECT_EQ(peak("3", ckpt), peak("8", ckpt)) << ckpt;
    EXPECT_GE(std::get<0>(peak("3", ckpt)), std::get<0>(peak("2", ckpt))) << ckpt;
  }
}

// --checkpointing full under FSDP1: GradientCheckpointingLayer checkpoints the decoder layer inside its FSDP unit,
// so each layer saves its input only, as without sharding: byte for byte the saved activations of the same model in
// bf16 under DDP, unsharded (whose weights are bf16 as FSDP1's unsharded flat parameters are), reentrant or not, with
// gradient accumulation too; one more layer saves one more bf16 (1, 32, 60) input, 3,840 bytes.
TEST(Fsdp1Checkpointing, SavedActivationsAreTheUnshardedModels) {
  const auto saved = [](std::initializer_list<std::pair<const char*, std::string>> more) {
    return run(tiny(more)).sim->saved_activations.value;
  };
  const uint64_t plain = saved({{"checkpointing", "full"}, {"sharding", "ddp"}, {"precision", "bf16"}});
  EXPECT_EQ(saved({{"checkpointing", "full"}}), plain);
  EXPECT_EQ(saved({{"checkpointing", "full"}, {"checkpoint_reentrant", "true"}}), plain);
  EXPECT_EQ(saved({{"checkpointing", "full"}, {"grad_accum", "2"}}), plain);
  EXPECT_EQ(saved({{"checkpointing", "full"}, {"overrides", "num_hidden_layers=3"}}) - saved({{"checkpointing", "full"}}),
            1u * 32 * 60 * 2);
}

// The recompute runs on the unit's unsharded flat parameter, gathered once by the unit's _pre_backward_hook (on
// the layer's output, before the checkpoint's backward): every tensor layer 1 allocates in step 2's backward is
// allocated while layer 1's flat parameter is, the layer is gathered twice a step (forward, pre-backward) as
// without checkpointing, and at most the root's and one layer's flat parameters are unsharded in the backward.
TEST(Fsdp1Checkpointing, RecomputeRunsOnTheUnitsGatheredFlatParameter) {
  for (const char* reentrant : {"false", "true"}) {
    const Estimate e = run(tiny({{"checkpointing", "full"}, {"checkpoint_reentrant", reentrant}}));
    bool gathered = false;
    uint64_t recomputed = 0, outside = 0;
    for (const Event& ev : e.sim->timeline.events) {
      if (ev.step != 2 || ev.label.layer != 1) continue;
      if (std::string_view(ev.label.what) == "FSDP1 unsharded flat parameter") {
        gathered = ev.kind == Event::kAlloc;
        continue;
      }
      if (ev.phase != Phase::kBackward || ev.kind != Event::kAlloc || ev.category != Category::kActivations) continue;
      ++recomputed;
      if (!gathered) ++outside;
    }
    EXPECT_GT(recomputed, 0u) << reentrant;
    EXPECT_EQ(outside, 0u) << reentrant;
    EXPECT_EQ(allocs_of(e, "FSDP1 unsharded flat parameter", 0).first, 4u) << reentrant;
    EXPECT_EQ(most_unsharded_in_backward(e), 2u) << reentrant;
  }
}

// The report and the JSON say what no_sync keeps and where the recompute runs.
TEST(Fsdp1Report, SaysWhatNoSyncKeeps) {
  const Estimate e = run(tiny({{"grad_accum", "2"}, {"checkpointing", "full"}}));
  const std::string text = render_estimate_table(e, nullptr), json = render_estimate_json(e, nullptr);
  for (const char* want : {"no_sync (2 micro-batches", "unsharded gradients kept between micro-batches, 420.9 KiB",
                           "gradient checkpointing inside each FSDP unit (non-reentrant)"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
  for (const char* want : {"\"no_sync\"", "\"kept_unsharded_grad_bytes\": 430976",
                           "no_sync: unsharded gradients kept between micro-batches"}) {
    EXPECT_NE(json.find(want), std::string::npos) << want << "\n" << json;
  }
}

// Llama-3-8B on 8 ranks, --grad-accum 2, by hand from the layouts (no padding): no_sync keeps each unit's flat
// gradient, N_flat bf16 elements: 32 layers x 218,112,000 + the root's 1,050,677,248 = 8,030,261,248 elements,
// 16,060,522,496 B (14.96 GiB) for the whole model; the 2-layer model simulated here keeps 2 x 218,112,000 +
// 1,050,677,248 = 1,486,901,248 elements, 2,973,802,496 B, live when the second micro-batch starts.
TEST(Fsdp1NoSync, Llama3On8RanksKeptGradientsByHand) {
  const Estimate e = run(testing::scenario_of("llama-3-8b", {{"batch", "1"}, {"seq", "64"}, {"dp", "8"}, {"grad_accum", "2"},
                                                             {"sharding", "fsdp1"}, {"overrides", "num_hidden_layers=2"}}));
  EXPECT_EQ(2u * 218112000 + 1050677248, 1486901248u);
  EXPECT_EQ(e.fsdp1->no_sync_kept_grads.value, 2973802496u);
  EXPECT_EQ(live_labelled(e, "FSDP1 unsharded flat gradient", first_event_of(e, 2, 2)), 2973802496u);
  EXPECT_EQ(uint64_t{2} * (uint64_t{32} * 218112000 + 1050677248), uint64_t{16060522496});
}

// Llama-3-8B on 8 ranks, batch 2 x seq 4096 with checkpointing: the peak is in the loss's backward (log_softmax's
// gradient), before any unit's post-backward hook; there a no_sync micro-batch holds what the same point holds
// without accumulation plus every kept flat gradient, so --grad-accum 4 peaks exactly 16,060,522,496 B above
// --grad-accum 1, in a middle micro-batch.
TEST(Fsdp1NoSync, Llama3PeakRisesByTheKeptGradients) {
  const auto peak = [](const char* ga) {
    const Estimate e = run(testing::scenario_of("llama-3-8b", {{"batch", "2"}, {"seq", "4096"}, {"dp", "8"},
                                                               {"sharding", "fsdp1"}, {"checkpointing", "full"},
                                                               {"grad_accum", ga}}));
    return std::pair(e.sim->peak.live.total.value, e.sim->peak.micro);
  };
  const auto [one, one_micro] = peak("1");
  const auto [four, four_micro] = peak("4");
  EXPECT_EQ(four - one, uint64_t{16060522496});
  EXPECT_EQ(four_micro, 2u);
}

}  // namespace
}  // namespace trainmem
