// model_type "mlp": an nn.Sequential layer stack, `loss = model(x).sum()` (seed 003's experiments).
#include <fmt/format.h>

#include "../forward.h"

namespace trainmem::sim {

ForwardOut stack_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& x0) {
  T x = x0;
  for (size_t i = 0; i < m.stack.size(); ++i) {
    c.layer = static_cast<int32_t>(i);
    const StackLayer& s = m.stack[i];
    switch (s.op) {
      case StackOp::kLinear:
        x = linear(c, x, w.p(param_name("{}.weight", i)), w.opt(param_name("{}.bias", i)), "linear");
        break;
      case StackOp::kRelu: x = relu(c, x, "relu"); break;
      case StackOp::kGelu: x = gelu(c, x, "gelu"); break;
      case StackOp::kSigmoid: x = sigmoid(c, x, "sigmoid"); break;
      case StackOp::kLayerNorm:
        x = layer_norm(c, x, w.opt(param_name("{}.weight", i)), w.opt(param_name("{}.bias", i)), "layer_norm");
        break;
    }
  }
  c.layer = -1;
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
