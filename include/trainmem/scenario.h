// Scenario: everything one question is about (the model, how it is trained, the runtime it runs on), and
// resolve(): the one place that applies every default and cross-field rule to it. Front ends (the CLI, later
// Python and the web page) only fill a Scenario, field by field with set_field() or directly, and call
//   resolve(scenario) -> estimate(resolved) / fit(resolved, request)
// so that their numbers can never differ.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/allocator.h"
#include "trainmem/config.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/runtime.h"
#include "trainmem/setup.h"
#include "trainmem/sim.h"

namespace trainmem {

struct Scenario {
  ModelRequest model;          // preset or config.json path, implementation, attention, key overrides
  TrainSetup train;            // micro-batch, sequence, precision, optimizer, gradient accumulation;
                               // train.gpu: a catalog name or a memory size ("24GiB"), empty for none
  TorchVersion torch{2, 9};    // the PyTorch whose runtime behaviour is modelled
  std::string alloc_conf;      // PYTORCH_CUDA_ALLOC_CONF, read for that PyTorch version
  // --gpus "8xh100-80gb": N GPUs of one kind, a shorthand resolve() turns into the data-parallel ranks (train.dp
  // = N / (tp x pp x cp)) and the device (train.gpu); empty when not given
  std::string gpus;
  LoopKind loop = LoopKind::kAuto;  // the training script; kAuto: the model implementation's own
  uint32_t steps = 2;          // optimizer steps simulated (the first creates the optimizer state)
  std::vector<std::string> given;  // the fields set by set_field(), in order: a rule may depend on whether a
                                   // value was asked for or is a default (fit solves for one not given)
  bool was_given(std::string_view field) const;
};

// The fields a front end can set by name, with their help; the CLI makes one flag of each ("--" + the name
// with '-' for '_', except overrides, which is --set).
enum class FieldGroup { kModel, kTraining, kRuntime };
struct Field {
  std::string_view name;     // "batch", "optimizer_impl"
  std::string_view help;
  FieldGroup group;
  bool repeatable = false;   // overrides: one "key=value" per call
};
std::span<const Field> scenario_fields();
// Parses `value` as the field's type and stores it; throws FieldError naming the field, the value and what
// was expected. Values are checked on their own here; rules between fields are resolve()'s.
void set_field(Scenario& s, std::string_view field, std::string_view value);
// The field's current value as text (what set_field would accept), for help and for wording changes.
std::string field_text(const Scenario& s, std::string_view field);

// A change to one field, as fit's suggestions return them; the front end words it.
struct FieldChange {
  std::string field;
  std::string value;
};
Scenario with_changes(Scenario s, std::span<const FieldChange> changes);

// A Scenario from fields given by name (a front end's flags or keywords), applied in the field table's order
// whatever order they were given in (a field that resets another, lora before lora_dtype, reads the same from
// every front end); the values of a repeatable field in their order. A name that is no field throws Error
// naming the nearest field.
Scenario scenario_from(std::span<const FieldChange> given);

// A Scenario with every default applied and every rule checked: what the pipeline's stages read.
struct ResolvedScenario {
  Scenario request;          // as asked
  ModelSpec model;
  Inventory inventory;
  TrainSetup setup;          // optimizer implementation resolved; gpu: the device's name
  SimOptions options;        // loop resolved; the GPU architecture from the device (sm_80 without one)
  AllocatorConfig alloc;
  std::optional<GpuSpec> gpu;
  std::vector<std::string> warnings;  // said to the user, not errors: a default taken, a slow kernel chosen
};

// The memory size a device must have to be given by size ("24GiB"): a GPU of this generic architecture.
inline constexpr uint32_t kGenericGpuSm = 80;

ResolvedScenario resolve(const Scenario& s, const FileReader& files);
ResolvedScenario resolve(const Scenario& s);  // files from the disk

// The model alone (its tensors, as `trainmem params` and `trainmem models` list them): resolve() with a
// one-token sequence, so that no training default (a 1,024-token sequence) refuses a model with a shorter
// learned position table (bert-base-uncased's 512).
ResolvedScenario resolve_model(Scenario s, const FileReader& files);

// The device `text` names: a catalog entry (case-insensitive), or a memory size such as "24GiB" or "80GB"
// (a generic sm_80 card with that much for the CUDA runtime and no context of its own). Throws FieldError
// naming the gpu field.
GpuSpec resolve_gpu(std::string_view text);

}  // namespace trainmem
