// model_type "mlp": a layer stack for allocator experiments (seed 003), e.g.
//   {"model_type": "mlp", "input": 256, "layers": [{"linear": 250}]}
//   {"model_type": "mlp", "input": 200, "layers": [{"linear": 100}, "relu", {"linear": 200}, "sigmoid"]}
// A layer is {"linear": out_features, "bias": true|false} or one of "relu", "gelu", "sigmoid", "layer_norm".
#include <fmt/format.h>

#include <algorithm>

#include "families.h"
#include "trainmem/error.h"

namespace trainmem::config {

void read_stack(const KeyReader& r, ModelSpec& m) {
  m.family = Family::kStack;
  m.stack_input = r.integer({"input"}, std::nullopt, 1, kMaxWidth);
  const nlohmann::json* layers = r.find({"layers"});
  if (!layers) r.fail_missing({"layers"}, "a non-empty list of layers");
  if (!layers->is_array() || layers->empty()) r.fail("layers", *layers, "a non-empty list of layers");
  if (layers->size() > kMaxLayers) {
    throw Error(fmt::format("{}: key \"layers\" has {} entries: expected at most {} (the bound on layers)", r.origin(),
                            layers->size(), kMaxLayers));
  }
  m.hidden = m.stack_input;
  for (size_t i = 0; i < layers->size(); ++i) {
    const nlohmann::json& l = (*layers)[i];
    const std::string key = fmt::format("layers[{}]", i);
    StackLayer s;
    if (l.is_string()) {
      const std::string op = l.get<std::string>();
      if (op == "relu") s.op = StackOp::kRelu;
      else if (op == "gelu") s.op = StackOp::kGelu;
      else if (op == "sigmoid") s.op = StackOp::kSigmoid;
      else if (op == "layer_norm") s.op = StackOp::kLayerNorm;
      else r.fail(key, l, "\"relu\", \"gelu\", \"sigmoid\", \"layer_norm\" or {\"linear\": N}");
    } else if (l.is_object() && l.contains("linear")) {
      KeyReader lr(l, fmt::format("{}: {}", r.origin(), key));
      s.op = StackOp::kLinear;
      s.out_features = lr.integer({"linear"}, std::nullopt, 1, kMaxWidth);
      s.bias = lr.boolean({"bias"}, true);
      m.hidden = s.out_features;
    } else {
      r.fail(key, l, "\"relu\", \"gelu\", \"sigmoid\", \"layer_norm\" or {\"linear\": N}");
    }
    m.stack.push_back(s);
  }
  m.layers = m.stack.size();
  // loss = model(x).sum(); loss.backward() needs a parameter to reach: PyTorch raises "element 0 of tensors does
  // not require grad and does not have a grad_fn" for a stack of activations alone.
  const bool trains = std::any_of(m.stack.begin(), m.stack.end(), [](const StackLayer& s) {
    return s.op == StackOp::kLinear || s.op == StackOp::kLayerNorm;
  });
  if (!trains) {
    r.fail("layers", *layers, "at least one layer with parameters ({\"linear\": N} or \"layer_norm\"): a stack of "
                              "activations alone has nothing to train, and backward() would fail");
  }
}

}  // namespace trainmem::config
