// The FLOP ledger's totals and names (trainmem/flops.h).
#include "trainmem/flops.h"

#include "trainmem/units.h"

namespace trainmem {

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
    for (uint64_t f : row) t = checked_add(t, f, "FLOPs of the step");
  }
  return t;
}

uint64_t FlopLedger::total_bytes() const {
  uint64_t t = 0;
  for (const auto& row : bytes) {
    for (uint64_t b : row) t = checked_add(t, b, "bytes moved by the step");
  }
  return t;
}

uint64_t FlopLedger::phase_flops(WorkPhase p) const {
  uint64_t t = 0;
  for (uint64_t f : flops[static_cast<size_t>(p)]) t = checked_add(t, f, "FLOPs of the step");
  return t;
}

uint64_t FlopLedger::kind_flops(FlopKind k) const {
  uint64_t t = 0;
  for (const auto& row : flops) t = checked_add(t, row[static_cast<size_t>(k)], "FLOPs of the step");
  return t;
}

}  // namespace trainmem
