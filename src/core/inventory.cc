#include "trainmem/inventory.h"

#include <algorithm>

#include "../families/registry.h"
#include "../tensor_tables/table.h"
#include "trainmem/error.h"

namespace trainmem {

namespace models {

static Elems shape_elems(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = checked_mul(n, d, "element count of a tensor shape");
  return Elems(n);
}

void Table::param(std::string name, std::vector<uint64_t> shape) {
  TensorRow r;
  r.elems = shape_elems(shape);
  r.name = std::move(name);
  r.shape = std::move(shape);
  r.dtype = DType::kF32;  // nn.Module parameters are created in the default dtype, float32
  r.kind = RowKind::kParameter;
  inv_.parameters.push_back(std::move(r));
}

void Table::raw_param(std::string name, std::vector<uint64_t> shape) {
  param(std::move(name), std::move(shape));
  inv_.parameters.back().not_linear = true;
}

void Table::buffer(std::string name, std::vector<uint64_t> shape, DType dtype, bool persistent) {
  TensorRow r;
  r.elems = shape_elems(shape);
  r.name = std::move(name);
  r.shape = std::move(shape);
  r.dtype = dtype;
  r.kind = RowKind::kBuffer;
  r.persistent = persistent;
  r.load_after = inv_.parameters.size();
  inv_.buffers.push_back(std::move(r));
}

}  // namespace models

Inventory build_inventory(const ModelSpec& spec) {
  models::Table t;
  program_for(spec).tensors(spec, t);
  return t.take();
}

Elems parameter_count(const Inventory& inv) {
  Elems n;
  for (const auto& r : inv.parameters) n += r.elems;
  return n;
}

Elems trainable_count(const Inventory& inv) {
  Elems n;
  for (const auto& r : inv.parameters) {
    if (r.trainable) n += r.elems;
  }
  return n;
}

Bytes trainable_bytes(const Inventory& inv, DType dtype) { return bytes_of(trainable_count(inv), dtype); }

size_t trainable_rows(const Inventory& inv) {
  size_t n = 0;
  for (const auto& r : inv.parameters) n += r.trainable ? 1 : 0;
  return n;
}

Elems buffer_elems(const Inventory& inv) {
  Elems n;
  for (const auto& r : inv.buffers) n += r.elems;
  return n;
}

Bytes parameter_bytes(const Inventory& inv, DType dtype) {
  Bytes b;
  for (const auto& r : inv.parameters) b += stored_bytes(r, dtype);
  return b;
}

namespace {
// functional.py quantize_4bit: `mod = dtype2bytes[quant_storage] * 2; out = torch.zeros(((n + 1) // mod, 1),
// dtype=quant_storage)`
uint64_t packed_elems(const TensorRow& r) { return (r.elems.value + 1) / (2 * itemsize(r.packed_storage)); }
}  // namespace

std::vector<uint64_t> stored_shape(const TensorRow& r) {
  if (!r.packed_4bit) return r.shape;
  return {packed_elems(r), 1};
}

Bytes stored_bytes(const TensorRow& r, DType model_dtype) {
  if (r.packed_4bit) return bytes_of(Elems(packed_elems(r)), r.packed_storage);
  return bytes_of(r.elems, stored_dtype(r, model_dtype));
}

DType stored_dtype(const TensorRow& r, DType model_dtype) {
  if (r.packed_4bit) return r.packed_storage;
  if (r.fp32 && (r.kind == RowKind::kParameter || is_floating(r.dtype))) return DType::kF32;
  if (r.kind == RowKind::kParameter) return model_dtype;
  // nn.Module.to(dtype) casts floating-point tensors only.
  return is_floating(r.dtype) ? model_dtype : r.dtype;
}

Bytes buffer_bytes(const Inventory& inv, DType model_dtype) {
  Bytes b;
  for (const auto& r : inv.buffers) b += bytes_of(r.elems, stored_dtype(r, model_dtype));
  return b;
}

namespace {

// The output head and the embeddings are not "linear" for PEFT's all-linear (the head is excluded on purpose,
// the embeddings are nn.Embedding).
bool is_linear_weight(const TensorRow& r) {
  const std::string& n = r.name;
  auto ends = [&](std::string_view s) { return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0; };
  if (r.shape.size() != 2 || !ends(".weight") || r.not_linear) return false;
  if (n == "lm_head.weight" || n == "embed_out.weight") return false;
  return n.find("embed") == std::string::npos && n.find(".wte.") == std::string::npos &&
         n.find(".wpe.") == std::string::npos;
}

// PEFT's check_target_module_exists: the module name equals a target or ends with "." + target.
bool targeted(const std::string& module, const std::vector<std::string>& targets) {
  for (const std::string& t : targets) {
    if (module == t) return true;
    if (module.size() > t.size() && module.compare(module.size() - t.size(), t.size(), t) == 0 &&
        module[module.size() - t.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

}  // namespace

size_t add_lora_rows(Inventory& inv, uint64_t r, const std::vector<std::string>& targets, bool fp32, bool conv1d) {
  const bool all_linear = targets.size() == 1 && targets[0] == "all-linear";
  std::vector<TensorRow> out;
  out.reserve(inv.parameters.size() * 2);
  size_t adapted = 0;
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    TensorRow base = inv.parameters[i];
    base.trainable = false;  // get_peft_model: every base parameter frozen (_mark_only_adapters_as_trainable)
    const std::string module = base.name.size() > 7 ? base.name.substr(0, base.name.size() - 7) : "";
    const bool hit = is_linear_weight(base) && (all_linear ? true : targeted(module, targets));
    out.push_back(base);
    if (!hit) continue;
    const int32_t base_row = static_cast<int32_t>(out.size() - 1);
    // the module's bias (if any) stays next to its weight; the adapters follow (named_parameters order)
    if (i + 1 < inv.parameters.size() && inv.parameters[i + 1].name == module + ".bias") {
      TensorRow bias = inv.parameters[++i];
      bias.trainable = false;
      out.push_back(bias);
    }
    // nn.Linear weight (out, in); transformers' Conv1D keeps (in, out) (PEFT: fan_in_fan_out=True)
    const uint64_t in = conv1d ? base.shape[0] : base.shape[1];
    const uint64_t o = conv1d ? base.shape[1] : base.shape[0];
    auto adapter = [&](const char* which, uint64_t rows, uint64_t cols) {
      TensorRow a;
      a.name = module + "." + which + ".default.weight";
      a.shape = {rows, cols};
      a.elems = Elems(checked_mul(rows, cols, "a LoRA adapter's elements"));
      a.adapter = true;
      a.fp32 = fp32;
      a.adapts = base_row;
      out.push_back(std::move(a));
    };
    adapter("lora_A", r, in);  // nn.Linear(in, r, bias=False)
    adapter("lora_B", o, r);   // nn.Linear(r, out, bias=False)
    ++adapted;
  }
  inv.parameters = std::move(out);
  return adapted;
}

size_t quantize_4bit_rows(Inventory& inv, bool double_quant, DType storage) {
  // bitsandbytes functional.py quantize_4bit (blocksize 64) and, with compress_statistics, quantize_blockwise
  // of the absmax (blocksize 256); nn/modules.py Params4bit. Every small tensor is its own allocation.
  constexpr uint64_t kBlock = 64, kNestedBlock = 256;
  constexpr uint64_t kCode4bit = 16;     // get_4bit_type: the 16 NF4 or FP4 values, float32
  constexpr uint64_t kDynamicMap = 256;  // create_dynamic_map: state2.code, float32, copied per layer
  std::vector<TensorRow> buffers;
  size_t quantized = 0;
  for (size_t i = 0; i < inv.parameters.size(); ++i) {
    TensorRow& r = inv.parameters[i];
    if (r.adapter || !is_linear_weight(r)) continue;
    r.packed_4bit = true;
    r.packed_storage = storage;  // Linear4bit(quant_storage=...): transformers' bnb_4bit_quant_storage
    r.trainable = false;  // Params4bit(requires_grad=False)
    ++quantized;
    const uint64_t blocks = ceil_div(r.elems.value, kBlock);
    auto state = [&](const std::string& what, uint64_t n, DType dt) {
      TensorRow b;
      b.name = r.name + ".quant_state." + what;
      b.shape = {n};
      b.elems = Elems(n);
      b.dtype = dt;
      b.kind = RowKind::kBuffer;
      b.persistent = false;
      b.fp32 = dt == DType::kF32;
      b.load_after = i + 1;  // quantized as the weight moves to the device, before the next parameter
      buffers.push_back(std::move(b));
    };
    if (double_quant) {
      state("absmax", blocks, DType::kU8);  // qabsmax: the absmax quantized to 8 bits
      state("state2.absmax", ceil_div(blocks, kNestedBlock), DType::kF32);
      state("state2.code", kDynamicMap, DType::kF32);
      state("offset", 1, DType::kF32);  // _absmax.mean(): a 0-d tensor
    } else {
      state("absmax", blocks, DType::kF32);
    }
    state("code", kCode4bit, DType::kF32);
  }
  // keep the buffers in load order
  for (TensorRow& b : buffers) inv.buffers.push_back(std::move(b));
  std::stable_sort(inv.buffers.begin(), inv.buffers.end(),
                   [](const TensorRow& a, const TensorRow& b) { return a.load_after < b.load_after; });
  return quantized;
}

std::string shape_string(const std::vector<uint64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

}  // namespace trainmem
