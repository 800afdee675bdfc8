// KeyReader: reads typed values out of one config.json object. Every error names the file (origin), the
// key, the value found and what was expected. A key given as null counts as absent (transformers does the
// same: `head_dim: null` means "derive it").
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace trainmem::config {

class KeyReader {
 public:
  KeyReader(const nlohmann::json& obj, std::string origin) : obj_(obj), origin_(std::move(origin)) {}

  // Top-level keys set by --set, in the order given. Among the aliases of one find(), the one set last wins
  // over the others, even over one the file has: `--set num_hidden_layers=3` on a GPT-2 config that holds
  // "n_layer" must not silently lose to it.
  void set_overridden(std::vector<std::string> keys) { overridden_ = std::move(keys); }
  // Where shape() reports the defaults it takes (nullptr: nowhere).
  void set_warnings(std::vector<std::string>* warnings) { warnings_ = warnings; }
  // Every key find() was asked for (all aliases, present or not): the keys this reader knows.
  const std::set<std::string, std::less<>>& asked() const { return asked_; }

  // The first of `keys` present (aliases, e.g. {"n_embd", "hidden_size"}), or nullptr.
  const nlohmann::json* find(std::initializer_list<std::string_view> keys, std::string* found = nullptr) const;
  bool has(std::initializer_list<std::string_view> keys) const { return find(keys) != nullptr; }
  // Whether `key` is given as null (by the file or by --set), where null means something other than absent
  // (DeepseekV3Config q_lora_rank: absent is the default 1536, None is "no query compression").
  bool given_null(std::string_view key) const;

  // An integer in [lo, hi]. Absent: `def`, or an error when `def` is empty (the key is required).
  uint64_t integer(std::initializer_list<std::string_view> keys, std::optional<uint64_t> def, uint64_t lo,
                   uint64_t hi) const;
  // integer() for a key that shapes the model (layers, widths, heads, vocabulary, ...): a config without it
  // builds with the default, but silently modelling a default-sized model is a surprise, so it warns
  // "<origin>: key "<key>" is missing; using <defaults_of> default <def>".
  uint64_t shape(std::initializer_list<std::string_view> keys, uint64_t def, uint64_t lo, uint64_t hi,
                 std::string_view defaults_of) const;
  std::optional<uint64_t> optional_integer(std::initializer_list<std::string_view> keys, uint64_t lo,
                                           uint64_t hi) const;
  bool boolean(std::initializer_list<std::string_view> keys, std::optional<bool> def) const;
  double number(std::initializer_list<std::string_view> keys, std::optional<double> def, double lo,
                double hi) const;
  std::string text(std::initializer_list<std::string_view> keys, std::optional<std::string> def) const;

  // Throws trainmem::Error: "<origin>: key "<key>" = <value>: <expected>".
  [[noreturn]] void fail(std::string_view key, const nlohmann::json& value, std::string_view expected) const;
  [[noreturn]] void fail_missing(std::initializer_list<std::string_view> keys, std::string_view expected) const;
  const std::string& origin() const { return origin_; }

 private:
  const nlohmann::json& obj_;
  std::string origin_;
  std::vector<std::string> overridden_;
  std::vector<std::string>* warnings_ = nullptr;
  mutable std::set<std::string, std::less<>> asked_;  // find() is const: reading is what records a key
};

// Ranges accepted for sizes. They are far above any real model and keep every derived byte count and table
// within reach (a model with 10^9 layers is a typo, not a model).
// The deepest published transformers have ~100-130 layers (GPT-3 96, PaLM 118, Llama 3.1 405B 126); 1,024
// leaves eight times that and keeps one simulated step within about a second and a few hundred MB (a layer
// is ~60 timeline events per micro-batch). Also the most entries an "mlp" layer stack may have.
inline constexpr uint64_t kMaxLayers = 1'024;
inline constexpr uint64_t kMaxWidth = 1ull << 24;      // hidden, ffn, head_dim, proj dims: 16,777,216
inline constexpr uint64_t kMaxHeads = 1ull << 16;      // attention / kv heads: 65,536
inline constexpr uint64_t kMaxVocab = 1ull << 32;      // 4,294,967,296 tokens
inline constexpr uint64_t kMaxPositions = 1ull << 32;  // learned position rows
inline constexpr uint64_t kMaxExperts = 1ull << 16;

// The name of `known` nearest to `name`, for "did you mean" (a name that holds it in order first, then the
// fewest edits); "" when `known` is empty.
std::string nearest_name(std::string_view name, const std::set<std::string, std::less<>>& known);

}  // namespace trainmem::config
