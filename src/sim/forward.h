// Internal: the loaded model and the forward programs of each family.
#pragma once

#include <fmt/format.h>

#include <array>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"
#include "trainmem/ddp.h"
#include "trainmem/inventory.h"
#include "trainmem/model.h"

namespace trainmem::sim {

// A parameter name formatted into an inline buffer: forward programs look up every parameter by its
// transformers name, once per layer and step, and this keeps those lookups free of heap allocations.
struct ParamName {
  std::array<char, 160> buf{};
  size_t len = 0;
  operator std::string_view() const { return {buf.data(), len}; }  // NOLINT: used where names are looked up
  const char* c_str() const { return buf.data(); }
};
[[noreturn]] void throw_name_too_long(std::string_view prefix);
template <typename... A>
ParamName param_name(fmt::format_string<A...> f, A&&... a) {
  ParamName n;
  const auto r = fmt::format_to_n(n.buf.data(), n.buf.size() - 1, f, std::forward<A>(a)...);
  if (r.size >= n.buf.size() - 1) throw_name_too_long({n.buf.data(), n.buf.size() - 1});
  n.len = r.size;
  return n;
}

// The model on the device: its parameters and buffers as simulated tensors, by inventory row.
struct LoadedModel {
  std::vector<T> params;
  std::vector<T> buffers;
  std::unordered_map<std::string_view, int> param_row, buffer_row;
  const Inventory* inv = nullptr;
  // Called with a parameter's row each time the forward code takes it (p(), opt()): DeepSpeed ZeRO-3's
  // pre-forward module hook gathers the module's parameters (Loop::z3_use).
  std::function<void(int)> on_use;

  // The parameter named `name`, or an empty handle when the model has none (an optional bias).
  const T& p(std::string_view name) const;
  const T* opt(std::string_view name) const;
  const T& buf(std::string_view name) const;

  // The parameter of layer `layer` whose name `name()` makes from the string literal `suffix`, or nullptr when
  // the model has none (`required`: throws as p() does). The row is looked up by name once per (layer, suffix)
  // and remembered: a forward program takes each layer's parameters by the same literals in every micro-batch,
  // step and recompute (simulation bookkeeping: the same row as p() and opt(), and the same on_use call).
  template <typename Name>
  const T* layer_param(uint64_t layer, const char* suffix, bool required, Name&& name) const {
    if (layer >= layer_rows_.size()) layer_rows_.resize(layer + 1);
    auto& rows = layer_rows_[layer];
    int row = -2;
    for (const auto& [s, r] : rows) {
      if (s == suffix) row = r;
    }
    if (row == -2) {
      const auto it = param_row.find(name());
      row = it == param_row.end() ? -1 : it->second;
      rows.emplace_back(suffix, row);
    }
    if (row < 0) return required ? &p(name()) : nullptr;  // p() throws
    if (on_use) on_use(row);
    return &params[static_cast<size_t>(row)];
  }

 private:
  mutable std::vector<std::vector<std::pair<const char*, int>>> layer_rows_;  // by layer: (suffix, row or -1)
};

// Parameter row i whole on the device in its stored dtype, as model.to(device) leaves it (load_model's own
// parameters; FSDP2's ignored ones, FsdpOptions::ignore_packed_4bit).
T whole_parameter(Engine& e, const Inventory& inv, size_t i, DType model_dtype);

// model.to(device): parameters and buffers allocated in nn.Module._apply order. `make_param`, when given, makes
// parameter row i instead (FSDP2's sharded parameters). `after_param`, when set, runs on each parameter as it is
// created (DeepSpeed's zero.Init partitions it there). `make_buffer`, when given, makes buffer row b instead (FSDP1
// moves the buffers with the root unit). `adapters_last` false: LoRA adapter rows in inventory order (beside their
// base rows) rather than after every base row.
LoadedModel load_model(Engine& e, const Inventory& inv, DType model_dtype,
                       const std::function<T(size_t)>& make_param = {},
                       const std::function<void(size_t, T&)>& after_param = {},
                       const std::function<T(size_t)>& make_buffer = {}, bool adapters_last = true);

// c10d broadcast_coalesced (comm.cpp), as the root rank runs it: the tensors grouped by
// compute_bucket_assignment_by_size(tensors, {buffer_size}) (trainmem/ddp.h assign_buckets); each group's
// BroadcastWork flattens it (torch::utils::flatten_dense_tensors: a view for one tensor, at::cat otherwise) and at
// most two are in flight ("We maintain a maximum of 2 in flight broadcast operations"): the oldest finishes (its
// flat tensor freed) before a third is created; the root copies nothing back. DDP's _sync_module_states and
// FSDP1's sync_module_states run it.
void broadcast_coalesced(Engine& e, const std::vector<BucketInput>& tensors, uint64_t buffer_size, Category category,
                         const char* what);

// What the model's forward returns.
struct ForwardOut {
  T logits;
  T loss;  // empty when no targets were given
};

// Each family's forward, transliterated from the Python it models. `targets` null: no loss in the model.
ForwardOut nanogpt_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& idx, const T* targets);
ForwardOut gpt2_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut llama_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut gpt_neox_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut opt_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut phi_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut bert_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut falcon_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
// T5ForConditionalGeneration: `ids` are the encoder's input ids, `labels` (B, target_seq) the decoder's targets;
// the batch's attention_mask comes in Ctx::attention_mask.
ForwardOut t5_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& ids, const T* labels);
ForwardOut stack_forward(Ctx& c, const ModelSpec& m, const LoadedModel& w, const T& x);
T sum_loss(Ctx& c, const T& y);  // y.sum()

// transformers' ForCausalLMLoss (loss_utils.py): logits.float(), labels padded with -100 and shifted,
// cross_entropy over (B*T, V).
T causal_lm_loss(Ctx& c, const T& logits, const T& labels);

}  // namespace trainmem::sim
