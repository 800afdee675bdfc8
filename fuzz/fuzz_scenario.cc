// libFuzzer harness: a request built field by field, as a front end builds one, then resolve(), estimate()
// and, rarely, fit(): the path every `trainmem estimate` / `trainmem fit` takes.
//
// Input: lines "field=value", applied in order with set_field() (the first refusal ends the run, as it ends
// the CLI). The model is never a path: a line "model=NAME" picks one of a few small presets (kPresets; any
// other name is ignored), gpt2 by default, cut to 2 layers by an "overrides" line before the fuzzed ones
// ("overrides=n_layer=6" lines may change that). The micro-batch starts at 1 and the sequence at 16 (set
// directly, so they count as not given). A line "fit" (or "fit=seq") asks for fit() as well when a gpu is set
// and the input's length is a multiple of 8: a search simulates dozens of steps (up to a second), so only one
// in eight mutations of an input that asks for it pays for one.
//
// Every run is bounded: the step is simulated only for at most kMaxLayers layers, kMaxTokens tokens per
// micro-batch, kMaxMicro micro-batches per step and kMaxSteps steps, and fit only for at most 2 layers.
//
// trainmem::Error is the expected refusal and the only exception caught; anything else escapes and libFuzzer
// reports it. The figures are checked against what estimate.h and fit.h promise (abort() on a violation), and
// a refusal's message as fuzz_checks.h says.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fuzz_checks.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/scenario.h"

namespace {

constexpr const char* kHarness = "fuzz_scenario";

struct SmallPreset {
  std::string_view name;
  std::string_view layers_override;  // cuts the preset to 2 layers
};
constexpr SmallPreset kPresets[] = {
    {"gpt2", "n_layer=2"},
    {"qwen3-0.6b", "num_hidden_layers=2"},
    {"pythia-160m", "num_hidden_layers=2"},
    {"opt-125m", "num_hidden_layers=2"},
    {"nanogpt-gpt2", "n_layer=2"},
};

constexpr uint64_t kMaxLayers = 4;
constexpr uint64_t kMaxTokens = 4096;  // batch * seq
constexpr uint64_t kMaxMicro = 4;      // grad_accum
constexpr uint32_t kMaxSteps = 4;
constexpr uint64_t kMaxFitLayers = 2;

[[noreturn]] void finding(const char* what, long long a, long long b) {
  std::fprintf(stderr, "fuzz_scenario: %s (%lld, %lld)\n", what, a, b);
  std::abort();
}

void check_verdict(const trainmem::DeviceVerdict& v) {
  if (v.fits && v.headroom < 0) finding("fits with a negative headroom", v.headroom, 0);
  if (!v.fits && v.headroom > 0) finding("does not fit but has a positive headroom", v.headroom, 0);
  if (v.fits == v.oom.has_value()) finding("fits and the OOM disagree", v.fits, v.oom.has_value());
}

void check_estimate(const trainmem::Estimate& e) {
  const trainmem::AllocatorFigures& m = e.memory;
  if (m.peak_reserved < m.peak_allocated) {
    finding("peak reserved below peak allocated", static_cast<long long>(m.peak_reserved.value),
            static_cast<long long>(m.peak_allocated.value));
  }
  if (m.fragmentation.value != m.peak_reserved.value - m.peak_allocated.value) {
    finding("fragmentation is not reserved - allocated", static_cast<long long>(m.fragmentation.value), 0);
  }
  trainmem::Bytes sum;
  for (const trainmem::Component& c : e.peak.components) sum += c.bytes;
  if (sum != e.peak.live_total) {
    finding("components do not sum to the live total", static_cast<long long>(sum.value),
            static_cast<long long>(e.peak.live_total.value));
  }
  if (e.device) check_verdict(*e.device);
}

void check_fit(const trainmem::FitResult& f) {
  for (const trainmem::FitProbe& p : f.probes) {
    if (p.fits && p.headroom < 0) finding("fit probe fits with a negative headroom", p.headroom, 0);
    if (!p.fits && p.headroom > 0) finding("fit probe does not fit but has a positive headroom", p.headroom, 0);
  }
  if (f.largest) {
    bool found = false;
    for (const trainmem::FitProbe& p : f.probes) {
      const uint64_t size = f.solve == trainmem::FitDimension::kBatch ? p.batch : p.seq;
      if (size == *f.largest) {
        found = true;
        if (!p.fits) finding("the answer's probe does not fit", static_cast<long long>(*f.largest), 0);
      }
    }
    if (!found) finding("the answer was never probed", static_cast<long long>(*f.largest), 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  try {
    trainmem::Scenario s;
    s.train.batch = 1;
    s.train.seq = 16;
    const SmallPreset* preset = &kPresets[0];
    bool want_fit = false;
    trainmem::FitRequest fit_request;
    // The model first: the layer cut must come before the fuzzed overrides so that they can change it.
    for (size_t pos = 0; pos <= in.size();) {
      const size_t nl = std::min(in.find('\n', pos), in.size());
      const std::string_view line = in.substr(pos, nl - pos);
      pos = nl + 1;
      if (line.starts_with("model=")) {
        for (const SmallPreset& p : kPresets) {
          if (line.substr(6) == p.name) preset = &p;
        }
      }
    }
    trainmem::set_field(s, "model", preset->name);
    trainmem::set_field(s, "overrides", preset->layers_override);
    for (size_t pos = 0; pos <= in.size();) {
      const size_t nl = std::min(in.find('\n', pos), in.size());
      const std::string_view line = in.substr(pos, nl - pos);
      pos = nl + 1;
      if (line.empty() || line.starts_with("model=")) continue;
      if (line == "fit" || line.starts_with("fit=")) {
        want_fit = true;
        if (line == "fit=seq") fit_request.solve = trainmem::FitDimension::kSeq;
        continue;
      }
      const size_t eq = line.find('=');
      if (eq == std::string_view::npos) return 0;
      const std::string_view field = line.substr(0, eq);
      bool known = false;
      for (const trainmem::Field& f : trainmem::scenario_fields()) known = known || f.name == field;
      if (!known) return 0;
      trainmem::set_field(s, field, line.substr(eq + 1));
    }

    const trainmem::ResolvedScenario r = trainmem::resolve(s);
    const bool small = r.model.layers <= kMaxLayers && r.setup.grad_accum <= kMaxMicro &&
                       r.options.steps <= kMaxSteps && r.setup.batch <= kMaxTokens &&
                       r.setup.seq <= kMaxTokens && r.setup.batch * r.setup.seq <= kMaxTokens;
    if (!small) return 0;
    check_estimate(trainmem::estimate(r));

    if (want_fit && size % 8 == 0 && r.gpu && r.model.layers <= kMaxFitLayers && r.options.steps <= 2 && r.setup.grad_accum == 1) {
      if (fit_request.solve == trainmem::FitDimension::kSeq) fit_request.max_seq = kMaxTokens;
      check_fit(trainmem::fit(s, fit_request, trainmem::DiskFileReader{}));
    }
  } catch (const trainmem::Error& e) {
    trainmem_fuzz::check_message(e, kHarness);
    // Refused with a message for the user.
  }
  return 0;
}
