// The family registry: one descriptor per architecture family says everything the pipeline needs to know
// about it (which model_type values it reads, how each is read, which tensor table and forward program each
// implementation has, and what its input looks like). Adding a family is one row in registry.cc plus the
// three functions it names; docs/adding-a-model.md lists every step.
#pragma once

#include <span>
#include <string_view>

#include "trainmem/family.h"
#include "trainmem/model.h"
#include "trainmem/sim.h"

namespace trainmem {

namespace config { class KeyReader; }
namespace models { class Table; }
namespace sim {
struct Ctx;
struct LoadedModel;
struct ForwardOut;
class T;
}  // namespace sim

// Fills a ModelSpec from one config.json object (src/config).
using ConfigReader = void (*)(const config::KeyReader& r, std::string_view model_type, ModelSpec& m);
// Lists the parameters and buffers in registration order (src/tensor_tables).
using TensorTable = void (*)(const ModelSpec& m, models::Table& t);
// The model's forward (and loss when `targets` is given), op by op (src/sim/forward_programs).
using ForwardProgram = sim::ForwardOut (*)(sim::Ctx& c, const ModelSpec& m, const sim::LoadedModel& w,
                                           const sim::T& input, const sim::T* targets);

// A model_type value and how its config is read.
struct ModelType {
  std::string_view name;  // config.json "model_type"
  ConfigReader read;
  Impl default_impl;      // the code that builds it unless --impl says otherwise
};

// One implementation of the family: the code that builds the nn.Module and runs it.
struct Program {
  Impl impl;
  TensorTable tensors;
  ForwardProgram forward;
  LoopKind loop;  // the training script that comes with this code (LoopKind::kAuto resolves to it)
};

struct FamilyDescriptor {
  Family family;
  std::string_view name;                 // family_name()
  std::span<const ModelType> model_types;
  std::span<const Program> programs;
  InputKind input;
  // Where layer i's parameters live ("model.layers" -> "model.layers.3"): names timeline rows and OOM reports
  // with the model's own names. Empty for a layer stack, whose layers are named by their index alone.
  std::string_view layer_prefix;
  // get_input_embeddings()'s weight (enable_input_require_grads hooks its output); empty for a layer stack
  std::string_view input_embedding;
  // PEFT's default target_modules for the family (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
  std::span<const std::string_view> lora_targets;
  // The task heads the family's program builds (--head, config.json's architectures), its own head first;
  // empty: the causal-LM head only (every decoder family).
  std::span<const Head> heads = {};
};

std::span<const FamilyDescriptor> families();
const FamilyDescriptor& family_descriptor(Family f);
// The family that reads `model_type`, or nullptr; `type` receives its entry.
const FamilyDescriptor* find_model_type(std::string_view model_type, const ModelType** type = nullptr);
// The program of m's family and implementation; throws trainmem::Error when that pairing does not exist.
const Program& program_for(const ModelSpec& m);

}  // namespace trainmem
