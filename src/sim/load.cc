#include <fmt/format.h>

#include <algorithm>
#include <deque>

#include "forward.h"
#include "trainmem/error.h"

namespace trainmem::sim {

void throw_name_too_long(std::string_view prefix) {
  throw Error(fmt::format("internal: parameter name too long: {}...", prefix));
}

const T& LoadedModel::p(std::string_view name) const {
  auto it = param_row.find(name);
  if (it == param_row.end()) throw Error(fmt::format("internal: the model has no parameter {}", name));
  if (on_use) on_use(it->second);
  return params[it->second];
}

const T* LoadedModel::opt(std::string_view name) const {
  auto it = param_row.find(name);
  if (it == param_row.end()) return nullptr;
  if (on_use) on_use(it->second);
  return &params[it->second];
}

const T& LoadedModel::buf(std::string_view name) const {
  auto it = buffer_row.find(name);
  if (it == buffer_row.end()) throw Error(fmt::format("internal: the model has no buffer {}", name));
  return buffers[it->second];
}

namespace {

Shape shape_of(const TensorRow& r) { return Shape::of(stored_shape(r)); }

}  // namespace

T whole_parameter(Engine& e, const Inventory& inv, size_t i, DType model_dtype) {
  const TensorRow& r = inv.parameters[i];
  return e.parameter(shape_of(r), stored_dtype(r, model_dtype), static_cast<int32_t>(i),
                     Label{intern_name(r.name), -1, static_cast<int32_t>(i)}, r.trainable);
}

LoadedModel load_model(Engine& e, const Inventory& inv, DType model_dtype, const std::function<T(size_t)>& make_param,
                       const std::function<void(size_t, T&)>& after_param,
                       const std::function<T(size_t)>& make_buffer, bool adapters_last) {
  LoadedModel w;
  w.inv = &inv;
  w.params.resize(inv.parameters.size());
  w.buffers.resize(inv.buffers.size());
  size_t b = 0;
  auto load_buffers_before = [&](size_t param_index) {
    for (; b < inv.buffers.size() && inv.buffers[b].load_after <= param_index; ++b) {
      const TensorRow& r = inv.buffers[b];
      w.buffers[b] = make_buffer ? make_buffer(b)
                                 : e.leaf(shape_of(r), stored_dtype(r, model_dtype), Category::kBuffers,
                                          Label{intern_name(r.name), -1, static_cast<int32_t>(b)});
      w.buffer_row.emplace(r.name, static_cast<int>(b));
    }
  };
  auto load_param = [&](size_t i) {
    const TensorRow& r = inv.parameters[i];
    if (make_param) {
      w.params[i] = make_param(i);
      w.param_row.emplace(r.name, static_cast<int>(i));
      return;
    }
    w.params[i] = whole_parameter(e, inv, i, model_dtype);
    w.param_row.emplace(r.name, static_cast<int>(i));
    if (after_param) after_param(i, w.params[i]);
  };
  // The base model (buffers interleaved where nn.Module._apply moves them; load_after counts base rows)...
  size_t base = 0;
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    if (inv.parameters[i].adapter) {
      if (!adapters_last) load_param(i);
      continue;
    }
    load_buffers_before(base++);
    load_param(i);
  }
  load_buffers_before(base);
  // ...then the LoRA adapters, which get_peft_model creates on the device once the model is there.
  for (size_t i = 0; i < inv.parameters.size() && adapters_last; ++i) {
    if (inv.parameters[i].adapter) load_param(i);
  }
  return w;
}

void broadcast_coalesced(Engine& e, const std::vector<BucketInput>& tensors, uint64_t buffer_size, Category category,
                         const char* what) {
  if (tensors.empty()) return;
  std::deque<T> in_flight;
  for (const DdpBucket& b : assign_buckets(tensors, {buffer_size}, false)) {
    if (in_flight.size() >= 2) in_flight.pop_front();
    T flat;
    if (b.indices.size() > 1) flat = e.empty(Shape{b.bytes / itemsize(b.dtype)}, b.dtype, category, Label{what});
    in_flight.push_back(std::move(flat));
  }
}

}  // namespace trainmem::sim
