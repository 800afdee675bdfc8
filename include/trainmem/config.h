// Model ingestion: a Hugging Face config.json (or nanoGPT's GPTConfig keys, or an "mlp" layer stack) becomes
// a ModelSpec. Missing keys take the default of transformers' <ModelType>Config, stated next to each key with
// its source; keys that no supported architecture reads are ignored. Files come through a FileReader so that
// tests never touch the disk.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/model.h"

namespace trainmem {

struct ModelRequest {
  std::string model = "gpt2";          // a preset name (trainmem models) or a path to a config.json
  std::optional<Impl> impl;            // default: nanogpt for model_type "nanogpt", hf otherwise
  AttnImpl attention = AttnImpl::kSdpa;
  std::vector<std::string> overrides;  // "key=value" (--set), applied to the config before it is read
};

class FileReader {
 public:
  virtual ~FileReader() = default;
  // The whole file, or nullopt when it cannot be opened.
  virtual std::optional<std::string> read(const std::string& path) const = 0;
};

class DiskFileReader final : public FileReader {
 public:
  std::optional<std::string> read(const std::string& path) const override;
};

// A config.json compiled into the binary (data/models/<name>.json).
struct Preset {
  std::string_view name;
  std::string_view json;
};
std::span<const Preset> presets();
const Preset* find_preset(std::string_view name);

// Resolves req.model as a preset name first, then as a file path.
ModelSpec load_model(const ModelRequest& req, const FileReader& files);

// Parses one config.json text. `origin` names it in error messages (a path, or "preset gpt2").
ModelSpec model_from_json(std::string_view text, std::string_view origin, const ModelRequest& req);

std::optional<Impl> parse_impl(std::string_view s);
std::optional<AttnImpl> parse_attn_impl(std::string_view s);

}  // namespace trainmem
