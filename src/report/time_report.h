// The step time's JSON object, shared by estimate's and fit's JSON reports.
#pragma once

#include <nlohmann/json.hpp>

#include "trainmem/flops.h"

namespace trainmem {

nlohmann::json step_time_json(const StepTime& t);

}  // namespace trainmem
