// model_type "mlp": an nn.Sequential layer stack, `loss = model(x).sum()` (seed 003's experiments).
#include <fmt/format.h>

#include "../forward.h"
#include "../layers.h"

namespace trainmem::sim {

ForwardOut stack_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& x0) {
  // nn.Sequential.forward: `input = module(input)` for each module
  T x = run_layers(c, m.stack.size(), x0, LayerArgs{}, [&](uint64_t i, T h, const LayerArgs&) {
    switch (m.stack[i].op) {
      case StackOp::kLinear: return linear(c, h, w.p(param_name("{}.weight", i)), w.opt(param_name("{}.bias", i)), "linear");
      case StackOp::kRelu: return relu(c, h, "relu");
      case StackOp::kGelu: return gelu(c, h, "gelu");
      case StackOp::kSigmoid: return sigmoid(c, h, "sigmoid");
      case StackOp::kLayerNorm:
        return layer_norm(c, h, w.opt(param_name("{}.weight", i)), w.opt(param_name("{}.bias", i)), "layer_norm");
    }
    return h;
  });
  ForwardOut out;
  out.logits = x;  // y = model(x)
  return out;
}

T sum_loss(Ctx& c, const T& y) {
  // y.sum(): a 0-dim tensor; SumBackward0's grad.expand(sizes) is a view (no allocation).
  T loss = c.e.empty(Shape{}, y.dtype(), Category::kActivations, c.L("y.sum()"));
  const Shape ys = y.shape();
  c.e.record("SumBackward0", {&y}, {&loss}, {}, [ys](Engine& e, Node&, Grads& g) {
    return Grads{g[0] ? e.view(g[0], ys, Strides{}) : T()};
  });
  return loss;
}

}  // namespace trainmem::sim
