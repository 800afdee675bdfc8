// libFuzzer harness: the bytes are a config.json text, read the way `trainmem --model file.json` reads one
// (model_from_json), then every stage that takes a ModelSpec: the inventory, the parameter count, the seeds'
// closed forms and, for a small model, a short simulated step.
//
// trainmem::Error is the library's one way to refuse input, so it is the only exception caught here: anything
// else (std::out_of_range, nlohmann::json's exceptions, std::bad_alloc, ...) escapes and libFuzzer reports it
// as a crash, as do the sanitizers' findings. A refusal's message is checked too (fuzz_checks.h).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trainmem/config.h"
#include "fuzz_checks.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/formulas.h"
#include "trainmem/inventory.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"

namespace {

constexpr const char* kHarness = "fuzz_config";

// A model this small simulates in milliseconds; larger ones are left to the other stages.
constexpr uint64_t kMaxSimulatedParams = 50'000'000;
constexpr uint64_t kMaxSimulatedLayers = 8;

template <typename F>
void refused_or_ok(F&& f) {
  trainmem_fuzz::refused_or_ok(kHarness, std::forward<F>(f));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    std::vector<std::string> warnings;
    const trainmem::ModelSpec m = trainmem::model_from_json(text, "fuzz.json", trainmem::ModelRequest{}, &warnings);
    const trainmem::Inventory inv = trainmem::build_inventory(m);
    const trainmem::Elems params = trainmem::parameter_count(inv);
    (void)trainmem::trainable_count(inv);
    (void)trainmem::buffer_elems(inv);

    trainmem::TrainSetup setup;
    setup.batch = 1;
    setup.seq = 16;
    // Each closed form refuses on its own (a model its form does not describe, a product beyond 64 bits).
    refused_or_ok([&] { (void)trainmem::seed001_contract(m, setup); });
    refused_or_ok([&] { (void)trainmem::seed002_korthikanti(m, setup); });
    refused_or_ok([&] { (void)trainmem::seed000_peak(m, inv, setup); });

    if (params.value < kMaxSimulatedParams && m.layers <= kMaxSimulatedLayers) {
      trainmem::validate_setup(m, setup);
      const trainmem::Estimate e = trainmem::estimate(m, inv, setup, trainmem::SimOptions{});
      (void)e;
    }
  } catch (const trainmem::Error& e) {
    trainmem_fuzz::check_message(e, kHarness);
    // Refused with a message for the user: the expected outcome for most inputs.
  }
  return 0;
}
