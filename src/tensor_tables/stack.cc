// model_type "mlp": an nn.Sequential of Linear / activation / LayerNorm layers, the shape of seed 003's
// allocator experiments (e.g. nn.Linear(256, 250)). Parameters are named by their index in the Sequential.
#include <fmt/format.h>

#include "table.h"

namespace trainmem::models {

void stack_tensors(const ModelSpec& m, Table& t) {
  uint64_t width = m.stack_input;
  for (size_t i = 0; i < m.stack.size(); ++i) {
    const StackLayer& s = m.stack[i];
    if (s.op == StackOp::kLinear) {
      t.param(fmt::format("{}.weight", i), {s.out_features, width});
      if (s.bias) t.param(fmt::format("{}.bias", i), {s.out_features});
      width = s.out_features;
    } else if (s.op == StackOp::kLayerNorm) {
      t.param(fmt::format("{}.weight", i), {width});
      if (s.bias) t.param(fmt::format("{}.bias", i), {width});
    }
  }
}

}  // namespace trainmem::models
