// Helpers shared by the unit tests.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "trainmem/config.h"
#include "trainmem/error.h"

namespace trainmem::testing {

// Files served from memory, so tests never touch the disk.
class MapFileReader final : public FileReader {
 public:
  std::map<std::string, std::string> files;
  std::optional<std::string> read(const std::string& path) const override {
    auto it = files.find(path);
    if (it == files.end()) return std::nullopt;
    return it->second;
  }
};

inline ModelSpec preset(const std::string& name, AttnImpl attn = AttnImpl::kSdpa) {
  ModelRequest req;
  req.model = name;
  req.attention = attn;
  return load_model(req, MapFileReader());
}

inline ModelSpec from_json(const std::string& text, const std::vector<std::string>& overrides = {}) {
  ModelRequest req;
  req.overrides = overrides;
  return model_from_json(text, "test.json", req);
}

// The message of the trainmem::Error that `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace trainmem::testing
