// Model ingestion: a Hugging Face config.json (or nanoGPT's GPTConfig keys, or an "mlp" layer stack) becomes
// a ModelSpec. Missing keys take the default of transformers' <ModelType>Config, stated next to each key with
// its source (a missing key that shapes the model, such as the layer count, also adds a warning); keys of the
// file that no supported architecture reads are ignored, as transformers does, but a --set of one is an error
// (it would change nothing). Files come through a FileReader so that tests never touch the disk.
#pragma once

#include <cstdint>
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
  MoeRouting moe_routing = MoeRouting::kBalanced;  // mixture-of-experts models: per-expert token counts
  MoeExperts moe_experts = MoeExperts::kEager;     // mixture-of-experts models: experts_implementation
  std::optional<Head> head;            // the task head; default: architectures[0]'s, else the family's own
  std::optional<uint64_t> num_labels;  // a classification head's labels; default: the config's
  // "key=value" (--set), applied to the config before it is read; a key the model type does not read is an
  // error naming the nearest one it does.
  std::vector<std::string> overrides;
};

class FileReader {
 public:
  virtual ~FileReader() = default;
  // The whole file, or nullopt when it cannot be opened.
  virtual std::optional<std::string> read(const std::string& path) const = 0;
  // Whether `path` is a folder (a model folder holds its config.json).
  virtual bool is_directory(const std::string& /*path*/) const { return false; }
};

// The largest config file DiskFileReader reads. The largest real config.json is a few hundred KB; the bound
// only stops a wrong path (a checkpoint, /dev/zero) from being read into memory whole, or forever.
inline constexpr uint64_t kMaxConfigFileBytes = 64ull << 20;

class DiskFileReader final : public FileReader {
 public:
  // Throws trainmem::Error for a path that is not a regular file (a device, a pipe) or is larger than
  // kMaxConfigFileBytes.
  std::optional<std::string> read(const std::string& path) const override;
  bool is_directory(const std::string& path) const override;
};

// A config.json compiled into the binary (data/models/<name>.json).
struct Preset {
  std::string_view name;
  std::string_view json;
};
std::span<const Preset> presets();
const Preset* find_preset(std::string_view name);

// Resolves req.model as a preset name first, then as a file path, or a folder holding a config.json.
// `warnings` (when given) receives the defaults taken for missing shape keys, one line each, for the caller
// to show: "<origin>: key "num_hidden_layers" is missing; using transformers' LlamaConfig default 32".
// No preset produces a warning.
ModelSpec load_model(const ModelRequest& req, const FileReader& files,
                     std::vector<std::string>* warnings = nullptr);

// Parses one config.json text. `origin` names it in error messages (a path, or "preset gpt2").
ModelSpec model_from_json(std::string_view text, std::string_view origin, const ModelRequest& req,
                          std::vector<std::string>* warnings = nullptr);

std::optional<Impl> parse_impl(std::string_view s);
std::optional<AttnImpl> parse_attn_impl(std::string_view s);

}  // namespace trainmem
