// libFuzzer harness: one command-line value, read by every parser a flag goes through.
//
// Input: "<field>\n<value>" when the text before the first newline names a field (the files under
// tests/hostile/flags are written so), otherwise the first byte picks the field (byte % count) and the rest is
// the value. The fields are Scenario's (scenario_fields()) plus "margin" (fit's --margin). The value then goes
// to set_field(field, value) and, whatever the field, to parse_size, parse_margin, parse_alloc_conf (for
// several PyTorch versions) and resolve_gpu, each on its own.
//
// trainmem::Error (FieldError included) is the expected refusal and the only exception caught; anything else
// escapes and libFuzzer reports it. A value set_field accepts must also read back: field_text() of it is
// accepted again and reads the same (checked with abort(), so a failure is a finding); a refusal's message is
// checked too (fuzz_checks.h).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trainmem/allocator.h"
#include "fuzz_checks.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/gpu.h"
#include "trainmem/runtime.h"
#include "trainmem/scenario.h"
#include "trainmem/units.h"

namespace {

constexpr const char* kHarness = "fuzz_flags";

const std::vector<std::string_view>& field_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> n;
    for (const trainmem::Field& f : trainmem::scenario_fields()) n.push_back(f.name);
    n.push_back("margin");
    return n;
  }();
  return names;
}

template <typename F>
void refused_or_ok(F&& f) {
  trainmem_fuzz::refused_or_ok(kHarness, std::forward<F>(f));
}

[[noreturn]] void finding(const char* what, std::string_view field, std::string_view detail) {
  std::fprintf(stderr, "fuzz_flags: %s (field %.*s): %.*s\n", what, static_cast<int>(field.size()), field.data(),
               static_cast<int>(detail.size()), detail.data());
  std::abort();
}

void check_round_trip(const trainmem::Scenario& s, std::string_view field) {
  for (const trainmem::Field& f : trainmem::scenario_fields()) {
    if (f.name == field && f.repeatable) return;  // overrides, freeze: field_text has no single value to give
  }
  const std::string text = trainmem::field_text(s, field);
  if (text.empty()) return;  // a default that is not a value (impl, loop)
  trainmem::Scenario again;
  try {
    trainmem::set_field(again, field, text);
  } catch (const trainmem::Error& e) {
    finding("field_text() of an accepted value is refused", field, e.what());
  }
  if (trainmem::field_text(again, field) != text) finding("field_text() does not read back", field, text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const auto& names = field_names();
  std::string_view field, value;
  if (const size_t nl = in.find('\n'); nl != std::string_view::npos) {
    for (std::string_view n : names) {
      if (in.substr(0, nl) == n) {
        field = n;
        value = in.substr(nl + 1);
      }
    }
  }
  if (field.empty()) {
    field = names[data[0] % names.size()];
    value = in.substr(1);
  }

  if (field != "margin") {
    refused_or_ok([&] {
      trainmem::Scenario s;
      trainmem::set_field(s, field, value);
      check_round_trip(s, field);
    });
  }

  refused_or_ok([&] {
    bool unit = false;
    if (const auto v = trainmem::parse_size(value, &unit)) (void)trainmem::format_bytes(trainmem::Bytes(*v));
  });
  refused_or_ok([&] {
    const trainmem::Margin m = trainmem::parse_margin(value);
    (void)m.describe();
    for (const trainmem::GpuSpec& g : trainmem::gpu_catalog()) (void)trainmem::usable_bytes(g, m.of(g));
  });
  for (const trainmem::TorchVersion t : {trainmem::TorchVersion{1, 13}, trainmem::TorchVersion{2, 5},
                                         trainmem::TorchVersion{2, 9}, trainmem::TorchVersion{2, 11}}) {
    refused_or_ok([&] { (void)trainmem::parse_alloc_conf(value, t); });
  }
  refused_or_ok([&] {
    const trainmem::GpuSpec g = trainmem::resolve_gpu(value);
    (void)trainmem::usable_bytes(g, trainmem::Margin{}.of(g));
  });
  return 0;
}
