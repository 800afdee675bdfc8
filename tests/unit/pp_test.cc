// Pipeline parallelism (pp.h): torchtitan's stage split and PyTorch's schedules against their own formulas, and
// the simulated ranks against the non-pipeline simulation of the same layers.
#include <gtest/gtest.h>

#include <cstring>

#include <algorithm>
#include <functional>
#include <map>

#include "test_util.h"
#include "trainmem/pp.h"
#include "trainmem/report.h"

namespace trainmem {
namespace {

using testing::from_json;

// [begin, end) of each stage, by hand from torchtitan's _generate_llm_fqn_per_model_part (b5bcd76):
// effective = layers + 1 + 1; per = effective // stages; the first `effective % stages` stages get one more;
// the first stage's count includes 1 for tok_embeddings, the last's 1 for norm + lm_head.
TEST(Pp, StageSplitIsTorchtitans) {
  auto ranges = [](const std::vector<PpStagePart>& v) {
    std::vector<std::pair<uint64_t, uint64_t>> r;
    for (const PpStagePart& p : v) r.emplace_back(p.layer_begin, p.layer_end);
    return r;
  };
  using R = std::vector<std::pair<uint64_t, uint64_t>>;
  // llama-3-8b, 32 layers over 4: effective 34, per 8, extra 2 -> 9-1, 9, 8, 8-1
  EXPECT_EQ(ranges(pp_stage_split(4, 32)), (R{{0, 8}, {8, 17}, {17, 25}, {25, 32}}));
  // llama-3-70b, 80 layers over 4: effective 82, per 20, extra 2 -> 21-1, 21, 20, 20-1
  EXPECT_EQ(ranges(pp_stage_split(4, 80)), (R{{0, 20}, {20, 41}, {41, 61}, {61, 80}}));
  // torchtitan's docstring example: (2, 3, input_weight=2, output_weight=2): effective 7, per 3, extra 1 ->
  // 4-2 layers, then 3-2
  EXPECT_EQ(ranges(pp_stage_split(2, 3, 2, 2)), (R{{0, 2}, {2, 3}}));
  const auto v = pp_stage_split(4, 32);
  EXPECT_TRUE(v[0].embeddings && !v[0].head && !v[1].embeddings && !v[2].head && v[3].head && !v[3].embeddings);
  // a single stage gets everything
  EXPECT_EQ(ranges(pp_stage_split(1, 5)), (R{{0, 5}}));
  // torchtitan raises: more stages than effective layers; a weight above the layers per stage
  EXPECT_THROW(pp_stage_split(8, 5), Error);
  EXPECT_THROW(pp_stage_split(4, 6, 3, 1), Error);  // effective 10, per 2 < input_weight 3
}

// PyTorch's Schedule1F1B: warmup_chunks = min(n_microbatches, num_stages - stage_index) forwards before the
// first backward, and one forward per backward after it: at most warmup_chunks in flight. ScheduleGPipe runs
// every forward first: n_microbatches in flight.
TEST(Pp, InFlightMicroBatchesAreTheSchedulesWarmup) {
  for (uint64_t pp = 1; pp <= 8; ++pp) {
    for (uint64_t m = pp; m <= 3 * pp; ++m) {
      for (uint64_t rank = 0; rank < pp; ++rank) {
        const uint64_t warmup = std::min(m, pp - rank);
        const auto a = pp_rank_actions(PpSchedule::k1f1b, rank, pp, m);
        EXPECT_EQ(pp_max_in_flight(a, rank), warmup) << pp << " " << m << " " << rank;
        // every micro-batch once forward, once backward, the backward after its forward, in micro-batch order
        ASSERT_EQ(a.size(), 2 * m);
        uint64_t f = 0, b = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          if (a[i].forward) {
            EXPECT_EQ(a[i].micro, f++);
          } else {
            EXPECT_EQ(a[i].micro, b++);
            EXPECT_LT(a[i].micro, f);
          }
        }
        // the first `warmup` actions are forwards, then a backward
        for (size_t i = 0; i < warmup; ++i) EXPECT_TRUE(a[i].forward);
        EXPECT_FALSE(a[warmup].forward);
        EXPECT_EQ(pp_max_in_flight(pp_rank_actions(PpSchedule::kGpipe, rank, pp, m), rank), m);
      }
    }
  }
}

// ScheduleInterleaved1F1B against Megatron's theoretical_memory_usage.py (compute_activation_memory, NVIDIA/
// Megatron-LM 38644dd): the first stage holds L * interleaved_schedule_memory_penalty layer-micro-batches, with
// penalty = 1 + (p - 1) / (p * v), where every stage has L / (p v) layers and the warmup is not capped by the
// micro-batches (m >= 2p here); without interleaving, L * min(1, m / p).
TEST(Pp, InterleavedFirstRankHoldsMegatronsPenalty) {
  for (uint64_t p = 2; p <= 8; ++p) {
    for (uint64_t v = 2; v <= 4; ++v) {
      for (uint64_t k = 2; k <= 4; ++k) {
        const uint64_t m = k * p, per_stage = 3, L = p * v * per_stage;
        const auto a = pp_rank_actions(PpSchedule::kInterleaved1f1b, 0, p, m, v);
        const uint64_t held = pp_max_weighted_in_flight(a, [&](uint64_t) { return per_stage; });
        // L * (1 + (p - 1) / (p v)) = L + (p - 1) * per_stage, exactly
        EXPECT_EQ(held, L + (p - 1) * per_stage) << p << " " << v << " " << m;
        // every stage of the rank runs each micro-batch forward once and backward once, in order
        for (uint64_t st : pp_rank_stages(0, p, v)) {
          uint64_t f = 0, b = 0;
          for (const PpAction& x : a) {
            if (x.stage != st) continue;
            if (x.forward) {
              EXPECT_EQ(x.micro, f++);
            } else {
              EXPECT_EQ(x.micro, b++);
              EXPECT_LT(x.micro, f);
            }
          }
          EXPECT_EQ(f, m);
          EXPECT_EQ(b, m);
        }
      }
    }
    for (uint64_t m = 1; m <= 3 * p; ++m) {
      const uint64_t per_stage = 5, L = p * per_stage;
      const auto a = pp_rank_actions(PpSchedule::k1f1b, 0, p, std::max(m, p));
      // Megatron: L * min(1, m / p); PyTorch requires m >= p for 1F1B, so the min is 1 there
      EXPECT_EQ(pp_max_weighted_in_flight(a, [&](uint64_t) { return per_stage; }), L);
    }
  }
  // ScheduleInterleaved1F1B raises unless the rounds divide the micro-batches: 4 ranks, 10 micro-batches ->
  // 2 rounds (fine); 4 ranks, 9 -> 2 rounds (raises)
  EXPECT_NO_THROW(pp_rank_actions(PpSchedule::kInterleaved1f1b, 0, 4, 10, 2));
  EXPECT_THROW(pp_rank_actions(PpSchedule::kInterleaved1f1b, 0, 4, 9, 2), Error);
  // torchtitan's loop-style placement: rank r holds stages r, r + p, ...
  EXPECT_EQ(pp_rank_stages(1, 4, 3), (std::vector<uint64_t>{1, 5, 9}));
}

// A small Llama: 8 layers, fp32 or bf16 weights (torchtitan's training.dtype; no autocast under a pipeline).
constexpr const char* kLlama = R"({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": false,
                                   "num_hidden_layers": )";
ModelSpec small_llama(uint64_t layers) { return from_json(std::string(kLlama) + std::to_string(layers) + "}"); }

TrainSetup pp_setup(uint64_t pp, uint64_t micro, PpSchedule sch = PpSchedule::k1f1b) {
  TrainSetup s = testing::train_setup(2, 32, Precision::kFp32);
  s.pp = pp;
  s.micro_batches = micro;
  s.pp_schedule = sch;
  return s;
}

// A stage's saved activations at its most-in-flight moment are in-flight x what one micro-batch of its layers
// saves. The per-micro-batch bytes come from the non-pipeline simulation: S(L) - S(L - k) is what k more
// layers save (each layer saves its input and its own tensors), plus the rotary table (cos, sin), which the
// model computes once per forward and every layer saves, and which each stage computes for itself.
TEST(Pp, SavedActivationsAreInFlightTimesOneMicroBatchOfTheStagesLayers) {
  const uint64_t L = 8, pp = 4, M = 5;
  for (PpSchedule sch : {PpSchedule::k1f1b, PpSchedule::kGpipe}) {
    const ModelSpec m = small_llama(L);
    const TrainSetup s = pp_setup(pp, M, sch);
    const auto parts = pp_stage_split(pp, L);
    for (uint64_t r = 1; r + 1 < pp; ++r) {  // the middle stages: layers only
      TrainSetup one = s;
      one.rank = r;
      const Estimate e = estimate(m, build_inventory(m), one, SimOptions{});
      ASSERT_TRUE(e.pp);
      const uint64_t k = parts[r].layers();
      const TrainSetup plain = testing::train_setup(2, 32, Precision::kFp32);
      const ModelSpec full = small_llama(L), fewer = small_llama(L - k);
      const Bytes per_layers = estimate(full, build_inventory(full), plain, SimOptions{}).peak.saved_activations -
                               estimate(fewer, build_inventory(fewer), plain, SimOptions{}).peak.saved_activations;
      const Bytes rope(2 * 32 * m.attn.head_dim * 4);  // cos and sin, (1, T, D) float32
      const uint64_t in_flight = sch == PpSchedule::kGpipe ? M : std::min(M, pp - r);
      EXPECT_EQ(e.pp->rows[r].in_flight, std::vector<uint64_t>{in_flight});
      EXPECT_EQ(e.peak.saved_activations.value, in_flight * (per_layers + rope).value) << "rank " << r;
    }
  }
}

// Interleaved: a rank's saved activations at its fullest moment are, per stage, the chunks in flight then times
// what one micro-batch of that stage's layers saves (the non-pipeline difference, plus the stage's rotary table).
TEST(Pp, InterleavedSavedActivationsAreTheChunksInFlight) {
  const uint64_t L = 16, pp = 4, v = 2, M = 8;
  const ModelSpec m = small_llama(L);
  TrainSetup s = pp_setup(pp, M, PpSchedule::kInterleaved1f1b);
  s.pp_virtual_stages = v;
  const auto parts = pp_stage_split(pp * v, L);
  const TrainSetup plain = testing::train_setup(2, 32, Precision::kFp32);
  auto saved = [&](uint64_t layers) {
    const ModelSpec x = small_llama(layers);
    return estimate(x, build_inventory(x), plain, SimOptions{}).peak.saved_activations;
  };
  const Bytes full = saved(L);
  const Bytes rope(2 * 32 * m.attn.head_dim * 4);
  for (uint64_t r = 1; r + 1 < pp; ++r) {  // ranks whose stages hold neither the embeddings nor the head
    s.rank = r;
    const Estimate e = estimate(m, build_inventory(m), s, SimOptions{});
    // the first moment the rank holds the most (chunks weighted by layers + 1, as the simulator finds it)
    const auto a = pp_rank_actions(PpSchedule::kInterleaved1f1b, r, pp, M, v);
    auto weight = [&](uint64_t st) { return parts[st].layers() + 1; };
    const uint64_t most = pp_max_weighted_in_flight(a, weight);
    std::map<uint64_t, uint64_t> now;
    uint64_t total = 0;
    for (const PpAction& x : a) {
      now[x.stage] += x.forward ? 1 : uint64_t(-1);
      total += x.forward ? weight(x.stage) : -weight(x.stage);
      if (x.forward && total == most) break;
    }
    Bytes expected;
    for (const auto& [st, n] : now) expected += (full - saved(L - parts[st].layers()) + rope) * n;
    EXPECT_EQ(e.peak.saved_activations, expected) << "rank " << r;
  }
}

// TP x PP (tensor parallelism shapes the rank's model, the pipeline picks its layers): the same per-stage rule
// over transformers' tp_plan shards, against the non-pipeline TP simulation of the same layers.
TEST(Pp, ComposesWithTensorParallelism) {
  const uint64_t L = 8, pp = 4, M = 5;
  auto saved = [&](uint64_t layers, bool pipeline, uint64_t rank) {
    Scenario s = testing::scenario_of("tinyllama-1.1b", {{"tp", "2"}, {"batch", "1"}, {"seq", "64"}, {"precision", "bf16"}});
    set_field(s, "overrides", "num_hidden_layers=" + std::to_string(layers));
    if (pipeline) {
      set_field(s, "pp", std::to_string(pp));
      set_field(s, "micro_batches", std::to_string(M));
      set_field(s, "rank", std::to_string(rank));
    }
    return testing::run(s);
  };
  const auto parts = pp_stage_split(pp, L);
  const Bytes full = saved(L, false, 0).peak.saved_activations;
  for (uint64_t r = 1; r + 1 < pp; ++r) {
    const Estimate e = saved(L, true, r);
    ASSERT_TRUE(e.pp);
    EXPECT_EQ(e.model.tp, 2u);
    const uint64_t k = parts[r].layers();
    const Bytes per_layers = full - saved(L - k, false, 0).peak.saved_activations;
    const Bytes rope(2 * 64 * e.model.attn.head_dim * 2);  // cos and sin, (1, T, D) bfloat16
    EXPECT_EQ(e.peak.saved_activations.value, std::min(M, pp - r) * (per_layers + rope).value) << "rank " << r;
  }
}

// The estimate names the worst rank (highest peak reserved) and shows it unless --rank picks another.
TEST(Pp, WorstRankIsTheHighestPeakReserved) {
  const ModelSpec m = small_llama(8);
  const Estimate e = estimate(m, build_inventory(m), pp_setup(4, 8), SimOptions{});
  ASSERT_TRUE(e.pp);
  ASSERT_EQ(e.pp->rows.size(), 4u);
  for (const PpRankFigures& r : e.pp->rows) EXPECT_LE(r.peak_reserved.value, e.pp->rows[e.pp->worst].peak_reserved.value);
  EXPECT_EQ(e.pp->shown, e.pp->worst);
  EXPECT_EQ(e.memory.peak_reserved, e.pp->rows[e.pp->worst].peak_reserved);
  TrainSetup s = pp_setup(4, 8);
  s.rank = 2;
  const Estimate e2 = estimate(m, build_inventory(m), s, SimOptions{});
  EXPECT_EQ(e2.pp->shown, 2u);
  EXPECT_EQ(e2.memory.peak_reserved, e2.pp->rows[2].peak_reserved);
  // the stages' weights add up to the model's
  Bytes w;
  for (const PpRankFigures& r : e.pp->rows) w += r.weights;
  EXPECT_EQ(w, parameter_bytes(build_inventory(m), DType::kF32));
}

// PyTorch 2.11's stage_backward sets the stage input's .grad to None once it has read it (PR #164329,
// _backward.py:379-386): the gradient then lives only in the send ops the schedule holds, gone when
// _step_microbatches returns. 2.9 leaves it as the receive buffer's .grad until the next step's
// clear_runtime_states, which runs after the steady-state moment (the step's start). So at that moment a 2.11 rank
// holds exactly what a 2.9 rank holds less every micro-batch's input gradient (M x B x T x C in the parameters'
// dtype: 2.9 keeps all M, each the buffer's .grad, and 2.11 none past _step_microbatches), and the first stage,
// which receives nothing, holds the same.
TEST(Pp, Torch211ReleasesStageInputGradientsBeforeTheNextStep) {
  const uint64_t pp = 4, M = 8;
  const ModelSpec m = small_llama(8);
  const Inventory inv = build_inventory(m);
  const uint64_t hidden = 2 * 32 * 64 * 4;  // B x T x C float32
  for (PpSchedule sch : {PpSchedule::k1f1b, PpSchedule::kGpipe}) {
    for (uint64_t r = 0; r < pp; ++r) {
      TrainSetup s = pp_setup(pp, M, sch);
      s.rank = r;
      SimOptions o29, o211;
      o29.torch = TorchVersion{2, 9};
      o211.torch = TorchVersion{2, 11};
      const Estimate a = estimate(m, inv, s, o29), b = estimate(m, inv, s, o211);
      const uint64_t before = a.memory.steady_state.value, after = b.memory.steady_state.value;
      ASSERT_GE(before, after) << "rank " << r;
      EXPECT_EQ(before - after, r == 0 ? 0 : M * hidden) << "rank " << r;
      // the weights, the buffers and the logits kept are the same in both releases
      EXPECT_EQ(a.pp->rows[r].weights, b.pp->rows[r].weights);
    }
  }
}

// Schedule1F1B's last stage (one warmup micro-batch) runs F0 B0 F1 B1 ...: while forward m runs (m >= 1), the
// gradients the stage sent back so far are alive as backward gradients. In 2.9 every one of them is its buffer's
// .grad until the next step: m of them. In 2.11 only the latest, which `bwd_sends` holds until the next backward's
// send ops replace it (schedules.py:927): one.
TEST(Pp, Torch211OneF1BHoldsThePreviousInputGradientThroughTheNextForward) {
  const uint64_t pp = 2, M = 4;
  const ModelSpec m = small_llama(8);
  const Inventory inv = build_inventory(m);
  const uint64_t hidden = 2 * 32 * 64 * 4;  // B x T x C float32
  for (TorchVersion v : {TorchVersion{2, 9}, TorchVersion{2, 11}}) {
    TrainSetup s = pp_setup(pp, M);
    s.rank = pp - 1;
    SimOptions o;
    o.torch = v;
    const Estimate e = estimate(m, inv, s, o);
    ASSERT_TRUE(e.sim);
    LiveBytes live;
    std::map<uint32_t, uint64_t> at_forward;  // micro-batch (1-based) -> backward gradients as its forward starts
    for (const Event& ev : e.sim->timeline.events) {
      // (the first allocation: the step's first events free what clear_runtime_states drops)
      if (ev.step == 2 && ev.phase == Phase::kForward && ev.kind == Event::kAlloc && !at_forward.count(ev.micro)) {
        at_forward[ev.micro] = live.by_category[static_cast<size_t>(Category::kBackward)].value;
      }
      apply(live, ev);
    }
    ASSERT_EQ(at_forward.size(), M);
    for (uint32_t mb = 1; mb <= M; ++mb) {
      const uint64_t held = v == TorchVersion{2, 9} ? mb - 1 : (mb > 1 ? 1 : 0);
      EXPECT_EQ(at_forward[mb], held * hidden) << torch_version_name(v) << " micro-batch " << mb;
    }
  }
}

// Under FSDP2 the stage's reduce-scatters follow its last backward: in 2.9 inside backward_one_chunk(last_backward=
// True), with every micro-batch's input gradient still its buffer's .grad (M of them); in 2.11 in
// perform_reduce_grad after Schedule1F1B's loop, once the last backward's send ops replaced the previous ones: one.
TEST(Pp, Torch211ReduceScattersSeeOnlyTheLastInputGradient) {
  const uint64_t pp = 2, M = 4;
  const ModelSpec m = small_llama(8);
  const Inventory inv = build_inventory(m);
  std::map<int, uint64_t> at_reduce;  // torch minor -> backward gradients live at the step's first reduce-scatter
  for (TorchVersion v : {TorchVersion{2, 9}, TorchVersion{2, 11}}) {
    TrainSetup s = pp_setup(pp, M);
    s.rank = pp - 1;
    s.dp = 2;
    s.sharding = Sharding::kFsdp2;
    SimOptions o;
    o.torch = v;
    const Estimate e = estimate(m, inv, s, o);
    ASSERT_TRUE(e.sim);
    LiveBytes live;
    for (const Event& ev : e.sim->timeline.events) {
      if (ev.step == 2 && ev.kind == Event::kAlloc && std::strstr(ev.label.what, "reduce-scatter input")) {
        at_reduce[v.minor] = live.by_category[static_cast<size_t>(Category::kBackward)].value;
        break;
      }
      apply(live, ev);
    }
  }
  ASSERT_EQ(at_reduce.size(), 2u);
  EXPECT_GT(at_reduce[11], 0u);
  EXPECT_EQ(at_reduce[9], M * at_reduce[11]);
}

// The version gate: 2.9 and 2.11 are simulated; 2.11 only with the single-stage schedules, whose send lifetimes
// are transcribed (Schedule1F1B, ScheduleGPipe), not with its interleaved schedule (a _PipelineScheduleRuntime,
// schedules.py:2507); releases whose pipelining was not read are refused.
TEST(Pp, Torch211IsSimulatedForTheSingleStageSchedulesOnly) {
  const ModelSpec m = small_llama(8);
  const Inventory inv = build_inventory(m);
  auto err = [&](TrainSetup s, TorchVersion v) {
    SimOptions o;
    o.torch = v;
    try {
      estimate(m, inv, s, o);
    } catch (const Error& x) {
      return std::string(x.what());
    }
    return std::string();
  };
  TrainSetup inter = pp_setup(4, 8, PpSchedule::kInterleaved1f1b);
  inter.pp_virtual_stages = 2;
  EXPECT_EQ(err(inter, TorchVersion{2, 9}), "");
  EXPECT_NE(err(inter, TorchVersion{2, 11}).find("_PipelineScheduleRuntime"), std::string::npos);
  for (TorchVersion v : {TorchVersion{2, 8}, TorchVersion{2, 10}}) {
    EXPECT_NE(err(pp_setup(4, 8), v).find("2.9's and 2.11's"), std::string::npos) << torch_version_name(v);
  }
  for (PpSchedule sch : {PpSchedule::k1f1b, PpSchedule::kGpipe}) EXPECT_EQ(err(pp_setup(4, 8, sch), TorchVersion{2, 11}), "");
}

// What is not simulated is refused with its reason.
TEST(Pp, RefusesWhatIsNotSimulated) {
  const ModelSpec m = small_llama(8);
  const Inventory inv = build_inventory(m);
  auto err = [&](TrainSetup s) {
    try {
      estimate(m, inv, s, SimOptions{});
    } catch (const Error& x) {
      return std::string(x.what());
    }
    return std::string();
  };
  // each setting that is not simulated, and a word of its message
  const std::pair<std::function<void(TrainSetup&)>, const char*> refused[] = {
      {[](TrainSetup& s) { s.pp_schedule = PpSchedule::kInterleaved1f1b; s.pp_virtual_stages = 1; },
       "at least 2 stages per rank"},
      {[](TrainSetup& s) { s.pp_virtual_stages = 2; }, "exactly one stage per rank"},
      {[](TrainSetup& s) { s.pp_schedule = PpSchedule::kZeroBubble; }, "zero-bubble"},
      {[](TrainSetup& s) { s.micro_batches = 3; }, "at least the number of stages"},
      {[](TrainSetup& s) { s.dp = 2; }, "--dp"},
      {[](TrainSetup& s) { s.precision = Precision::kBf16Amp; }, "autocast"},
      {[](TrainSetup& s) { s.lora.on = true; }, "LoRA"},
  };
  for (const auto& [change, word] : refused) {
    TrainSetup s = pp_setup(4, 8);
    change(s);
    EXPECT_NE(err(s).find(word), std::string::npos) << word;
  }
  const ModelSpec tied = from_json(R"({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
                                       "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
                                       "tie_word_embeddings": true})");
  EXPECT_THROW(estimate(tied, build_inventory(tied), pp_setup(4, 8), SimOptions{}), Error);
}

}  // namespace
}  // namespace trainmem
