// Reports: what trainmem prints. Tables for people (binary units and shares, like bloaty), JSON for programs
// (integers for every byte count). Each render_* function is pure: it returns the text.
#pragma once

#include <string>
#include <vector>

#include "trainmem/estimate.h"
#include "trainmem/formulas.h"
#include "trainmem/gpu.h"
#include "trainmem/inventory.h"

namespace trainmem {

struct ModelListing {
  std::string name;
  std::string model_type;
  Elems parameters;
  std::string source;
};

std::string render_models_table(const std::vector<ModelListing>& models);
std::string render_models_json(const std::vector<ModelListing>& models);
std::string render_gpus_table(const std::vector<GpuSpec>& gpus);

std::string render_inventory_table(const ModelSpec& m, const Inventory& inv, DType dtype);
std::string render_inventory_json(const ModelSpec& m, const Inventory& inv, DType dtype);

struct FormulaReport {
  ModelSpec model;
  TrainSetup setup;
  Elems inventory_parameters;
  Seed001Contract seed001;
  Seed002Korthikanti seed002;
  Seed000Peak seed000;
};
std::string render_formulas_table(const FormulaReport& f);
std::string render_formulas_json(const FormulaReport& f);

std::string render_estimate_table(const Estimate& e, const GpuSpec* gpu);
std::string render_verdict(const DeviceVerdict& v, const GpuSpec* gpu);
std::string render_estimate_json(const Estimate& e, const GpuSpec* gpu);

}  // namespace trainmem
