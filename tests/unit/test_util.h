// Helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "trainmem/config.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/scenario.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"

namespace trainmem::testing {

// Files served from memory, so tests never touch the disk.
class MapFileReader final : public FileReader {
 public:
  std::map<std::string, std::string> files;
  std::optional<std::string> read(const std::string& path) const override {
    auto it = files.find(path);
    if (it == files.end()) return std::nullopt;
    return it->second;
  }
};

inline ModelSpec preset(const std::string& name, AttnImpl attn = AttnImpl::kSdpa) {
  ModelRequest req;
  req.model = name;
  req.attention = attn;
  return load_model(req, MapFileReader());
}

inline ModelSpec from_json(const std::string& text, const std::vector<std::string>& overrides = {}) {
  ModelRequest req;
  req.overrides = overrides;
  return model_from_json(text, "test.json", req);
}

// A training setup: micro-batch, sequence and precision (the rest at their defaults).
inline TrainSetup train_setup(uint64_t batch, uint64_t seq, Precision p = Precision::kBf16Amp) {
  TrainSetup s;
  s.batch = batch;
  s.seq = seq;
  s.precision = p;
  return s;
}

// Seed 000's model at a small batch (B=2, T=256, eager attention, bf16 autocast): the structure of the step is
// the same as at B=12, and it runs fast. Estimated once per test program.
inline const Estimate& seed000_small() {
  static const Estimate e = [] {
    const ModelSpec m = preset("nanogpt-gpt2", AttnImpl::kEager);
    return estimate(m, build_inventory(m), train_setup(2, 256), SimOptions{});
  }();
  return e;
}

// Seed 000's measured run: nanoGPT GPT-2 small without flash attention, B=12, T=1024, float16 autocast with
// GradScaler, the fork's training loop, PyTorch 2.0 on an A100 (validate/measured/seed000_trace.json).
struct Seed000Run {
  ModelSpec m = preset("nanogpt-gpt2", AttnImpl::kEager);
  TrainSetup s;
  SimOptions o;
  explicit Seed000Run(uint32_t steps) {
    s.batch = 12;
    s.seq = 1024;
    s.precision = Precision::kFp16Amp;
    o.loop = LoopKind::kSeed000;
    o.torch = TorchVersion{2, 0};
    o.sm = 80;
    o.steps = steps;
  }
};

// A Scenario of `model` (a preset) with `fields` set in order, as a front end sets them
// ({"overrides", "n_layer=2"} may repeat).
inline Scenario scenario_of(const std::string& model,
                            std::initializer_list<std::pair<const char*, std::string>> fields) {
  Scenario s;
  s.model.model = model;
  for (const auto& [f, v] : fields) set_field(s, f, v);
  return s;
}

// TinyLlama's shapes (32 heads, 4 KV heads of 64), two layers, batch 1 at `seq` tokens, bf16 autocast (SDPA runs
// the flash kernel), then `extra` (the context-parallel tests: cp_test.cc, cpfsdp_test.cc).
inline Scenario tiny_llama(uint64_t seq, std::initializer_list<std::pair<const char*, std::string>> extra = {}) {
  Scenario s = scenario_of("tinyllama-1.1b", {{"overrides", "num_hidden_layers=2"},
                                              {"batch", "1"},
                                              {"seq", std::to_string(seq)},
                                              {"precision", "bf16-amp"}});
  for (const auto& [k, v] : extra) set_field(s, k, v);
  return s;
}

// The model of validate/cuda/fsdp2_lora_probe.py (fsdp_lora_test.cc, fsdp_qlora_test.cc, fsdp_freeze_test.cc): llama,
// hidden 256, intermediate 688, 4 heads of 64, 2 KV heads, vocab 1000, 2 layers; batch 1 x seq 64; then `extra`.
inline Scenario fsdp2_probe_model(std::initializer_list<std::pair<const char*, std::string>> extra = {}) {
  Scenario s = scenario_of(
      "llama-3-8b", {{"overrides", "num_hidden_layers=2"}, {"overrides", "hidden_size=256"},
                     {"overrides", "intermediate_size=688"}, {"overrides", "num_attention_heads=4"},
                     {"overrides", "num_key_value_heads=2"}, {"overrides", "head_dim=64"}, {"overrides", "vocab_size=1000"},
                     {"batch", "1"}, {"seq", "64"}});
  for (const auto& [k, v] : extra) set_field(s, k, v);
  return s;
}

// One category's events in the order the step allocates and frees them: (event kind, label, bytes, stream)
inline std::vector<std::tuple<int, std::string, uint64_t, int>> category_events(const Estimate& e, Category c) {
  std::vector<std::tuple<int, std::string, uint64_t, int>> out;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.category != c) continue;
    out.emplace_back(static_cast<int>(ev.kind), std::string(ev.label.what), ev.bytes.value, static_cast<int>(ev.stream));
  }
  return out;
}

// The setup's allocations (before the first step), in order, and the replay's reserved bytes when it ends.
struct SetupAllocs {
  std::vector<uint64_t> bytes;
  uint64_t reserved = 0;
};
inline SetupAllocs setup_allocs(const Estimate& e) {
  SetupAllocs out;
  for (size_t i = 0; i < e.sim->timeline.events.size(); ++i) {
    const Event& ev = e.sim->timeline.events[i];
    if (ev.phase != Phase::kSetup) break;
    out.reserved = e.alloc->reserved[i];
    if (ev.kind == Event::kAlloc) out.bytes.push_back(ev.bytes.value);
  }
  return out;
}

// The pipeline of every front end: resolve, then estimate (presets from memory).
inline Estimate run(const Scenario& s) { return estimate(resolve(s, MapFileReader())); }

// The message of the trainmem::Error that `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace trainmem::testing
