// libFuzzer harness: the bytes are the file given to `trainmem diff --snapshot`, read the way it reads one
// (read_measured_trace: a torch.cuda.memory._snapshot() pickle, or a trainmem-measurement-v1 JSON), and the
// pickle reader on its own (pickle_loads), whose every result the writer must pickle again and the reader read
// back to the same bytes (pickle_dumps is deterministic).
//
// trainmem::Error is the only exception caught (fuzz_checks.h): a crash, a sanitizer report, any other
// exception or a bad refusal message is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fuzz_checks.h"
#include "trainmem/pickle.h"
#include "trainmem/snapshot.h"

namespace {
constexpr const char* kHarness = "fuzz_snapshot";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  trainmem_fuzz::refused_or_ok(kHarness, [&] { (void)trainmem::read_measured_trace(bytes, "fuzz.pickle"); });
  trainmem_fuzz::refused_or_ok(kHarness, [&] {
    const trainmem::PyValue v = trainmem::pickle_loads(bytes, "fuzz.pickle");
    const std::string again = trainmem::pickle_dumps(v);
    const std::string third = trainmem::pickle_dumps(trainmem::pickle_loads(again, "round trip"));
    if (again != third) {
      std::fprintf(stderr, "%s: a pickle written by pickle_dumps reads back to other bytes\n", kHarness);
      std::abort();
    }
  });
  return 0;
}
