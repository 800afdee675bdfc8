// JSON as trainmem prints it: indented, one trailing newline, and text that is not UTF-8 (a file name, say)
// replaced by U+FFFD rather than aborting the dump.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace trainmem::report {

inline std::string json_text(const nlohmann::json& j, int indent = 2) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace trainmem::report
