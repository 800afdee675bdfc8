// The tensor inventory of a model: one row per parameter and per buffer, in the order named_parameters()
// and named_buffers() list them, with transformers' (or nanoGPT's) names. Totals are sums of rows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainmem/dtype.h"
#include "trainmem/model.h"
#include "trainmem/units.h"

namespace trainmem {

enum class RowKind { kParameter, kBuffer };

struct TensorRow {
  std::string name;                 // e.g. "transformer.h.0.attn.c_attn.weight"
  std::vector<uint64_t> shape;      // e.g. {768, 2304}
  Elems elems;                      // product of shape
  DType dtype = DType::kF32;        // dtype at construction (parameters: float32)
  RowKind kind = RowKind::kParameter;
  bool persistent = true;           // buffers: registered with persistent=True (saved in state_dict)
  // Parameters: requires_grad. A frozen row (a fine-tuned model's base weights) gets no .grad, no optimizer
  // state and no clipping; the optimizer and clip_grad_norm_ see the trainable rows only (nanoGPT's
  // configure_optimizers and the Trainer's optimizer groups both filter on p.requires_grad).
  bool trainable = true;
  // A LoRA adapter (lora_A/lora_B of a PEFT-wrapped Linear): created after the model is on the device, so
  // loaded after every base row; kept in float32 when `fp32` (PEFT >= 0.12 upcasts 16-bit adapters,
  // cast_adapter_dtype), else in the model's dtype.
  bool adapter = false;
  // Stored as float32 whatever the model's dtype: PEFT's upcast adapters, the rows that
  // prepare_model_for_kbit_training casts to float32, and bitsandbytes' float32 quantization state.
  bool fp32 = false;
  int32_t adapts = -1;  // lora_A: the row of the base weight it adapts
  // A bitsandbytes 4-bit weight (Params4bit): `shape` stays the Linear's (out, in) and `elems` its element
  // count, but the storage is the packed data of dtype `packed_storage` (bnb_4bit_quant_storage), ((n + 1) /
  // (2 x itemsize), 1) elements (functional.py quantize_4bit: uint8 by default, (n + 1) / 2 bytes).
  bool packed_4bit = false;
  DType packed_storage = DType::kU8;
  // A 2-D nn.Parameter of a module that is not an nn.Linear (transformers 5.x MoE routers: MixtralTopKRouter's
  // `self.weight = nn.Parameter(...)`): PEFT's LoRA (all-linear or by name) and bitsandbytes leave it alone.
  bool not_linear = false;
  // Buffers: how many parameter rows nn.Module._apply moves to the device before this buffer (children
  // first, then a module's own parameters, then its own buffers): the allocation order of model.to(device).
  size_t load_after = 0;
  // Tensor parallelism (tp.h): the dim of which this rank holds 1/tp (0: a colwise weight or bias, 1: a rowwise
  // weight); -1: replicated on every TP rank (or no TP).
  int8_t tp_dim = -1;
};

struct Inventory {
  std::vector<TensorRow> parameters;
  std::vector<TensorRow> buffers;
};

// Every parameter and buffer of the model that `spec` describes.
Inventory build_inventory(const ModelSpec& spec);

Elems parameter_count(const Inventory& inv);
// The optimizer group a parameter joins: nanoGPT's configure_optimizers and transformers' Trainer both put the
// weight-decayed tensors (nanoGPT: dim >= 2; Trainer: all but biases and norm weights, which for the supported
// models are exactly the 1-D tensors) in a first group and the rest in a second.
inline bool in_decay_group(const TensorRow& r) { return r.shape.size() >= 2; }
// Elements and bytes of the trainable parameters only (TensorRow::trainable).
Elems trainable_count(const Inventory& inv);

// PEFT's LoRA on the model (peft: tuners/lora/layer.py LoraLayer.update_layer): for each targeted Linear
// weight (out, in), rows lora_A (r, in) and lora_B (out, r) after it, every base row frozen. `targets` are
// module-name suffixes (PEFT's target_modules), or {"all-linear"}: every 2-D Linear/Conv1D weight but the
// embeddings and the output head. `conv1d`: the model's linears are transformers' Conv1D, weights (in, out).
// Returns how many modules were adapted.
size_t add_lora_rows(Inventory& inv, uint64_t r, const std::vector<std::string>& targets, bool fp32, bool conv1d);
Bytes trainable_bytes(const Inventory& inv, DType dtype);
size_t trainable_rows(const Inventory& inv);
Elems buffer_elems(const Inventory& inv);
// Bytes of all parameters after model.to(dtype) (adapters kept in float32 stay so).
Bytes parameter_bytes(const Inventory& inv, DType dtype);
// A row's storage on the device: its shape and dtype after model.to(model_dtype) (packed for a 4-bit row).
std::vector<uint64_t> stored_shape(const TensorRow& r);
Bytes stored_bytes(const TensorRow& r, DType model_dtype);

// bitsandbytes 4-bit quantization of every Linear weight but the output head (transformers'
// BitsAndBytesConfig, llm_int8_skip_modules defaulting to lm_head): each weight becomes packed data, with its
// quantization state as extra rows (kept as buffers: device memory the module holds that is not a
// parameter). Returns how many weights were quantized.
size_t quantize_4bit_rows(Inventory& inv, bool double_quant, DType storage = DType::kU8);

// The dtype of a row after model.to(model_dtype): parameters and floating-point buffers take model_dtype,
// other buffers (bool masks, int64 ids) keep theirs. A float32 model leaves every row as constructed.
DType stored_dtype(const TensorRow& r, DType model_dtype);
// Bytes of all buffers after model.to(model_dtype).
Bytes buffer_bytes(const Inventory& inv, DType model_dtype);

// The shape as "(768, 2304)".
std::string shape_string(const std::vector<uint64_t>& shape);

}  // namespace trainmem
