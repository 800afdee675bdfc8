// The FLOP ledger's totals and names (trainmem/flops.h).
#include "trainmem/flops.h"


namespace trainmem {

namespace {
// Totals saturate like the counts (FlopLedger::overflow)
uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}
}  // namespace

std::string_view flop_kind_name(FlopKind k) {
  switch (k) {
    case FlopKind::kMatmul: return "matmul";
    case FlopKind::kAttention: return "attention";
    case FlopKind::kElementwise: return "elementwise";
    case FlopKind::kNorm: return "norm/softmax";
    case FlopKind::kOptimizer: return "optimizer";
  }
  return "?";
}

std::string_view work_phase_name(WorkPhase p) {
  switch (p) {
    case WorkPhase::kForward: return "forward";
    case WorkPhase::kBackward: return "backward";
    case WorkPhase::kRecompute: return "recompute";
    case WorkPhase::kOptimizer: return "optimizer";
  }
  return "?";
}

uint64_t FlopLedger::total_flops() const {
  uint64_t t = 0;
  for (const auto& row : flops) {
    for (uint64_t f : row) t = sat_add(t, f);
  }
  return t;
}

uint64_t FlopLedger::total_bytes() const {
  uint64_t t = 0;
  for (const auto& row : bytes) {
    for (uint64_t b : row) t = sat_add(t, b);
  }
  return t;
}

uint64_t FlopLedger::phase_flops(WorkPhase p) const {
  uint64_t t = 0;
  for (uint64_t f : flops[static_cast<size_t>(p)]) t = sat_add(t, f);
  return t;
}

uint64_t FlopLedger::kind_flops(FlopKind k) const {
  uint64_t t = 0;
  for (const auto& row : flops) t = sat_add(t, row[static_cast<size_t>(k)]);
  return t;
}

}  // namespace trainmem
