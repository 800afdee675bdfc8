// Readers shared by the config families.
#include <fmt/format.h>

#include "families.h"
#include "trainmem/error.h"

namespace trainmem::config {

namespace {

struct ActName {
  std::string_view name;
  Act act;
};

// transformers' ACT2FN (activations.py) spellings that the supported models use, and nanoGPT's nn.GELU().
constexpr ActName kActivations[] = {
    {"gelu_new", Act::kGeluNew},          {"gelu_fast", Act::kGeluFast},
    {"gelu_pytorch_tanh", Act::kGeluTanh}, {"gelu", Act::kGeluErf},
    {"quick_gelu", Act::kQuickGelu},      {"silu", Act::kSilu},
    {"swish", Act::kSilu},                {"relu", Act::kRelu},
    {"sigmoid", Act::kSigmoid},
};

}  // namespace

Act read_activation(const KeyReader& r, std::initializer_list<std::string_view> keys, std::string_view def) {
  std::string key(*keys.begin());
  const nlohmann::json* v = r.find(keys, &key);
  const std::string name = v ? (v->is_string() ? v->get<std::string>() : std::string()) : std::string(def);
  for (const ActName& a : kActivations) {
    if (a.name == name) return a.act;
  }
  std::string allowed;
  for (const ActName& a : kActivations) allowed += (allowed.empty() ? "" : ", ") + std::string(a.name);
  // Not `v ? *v : json(name)`: that copies *v, recursively, and the value may be a 100,000-deep array.
  if (v) r.fail(key, *v, "one of " + allowed);
  r.fail(key, nlohmann::json(name), "one of " + allowed);
}

double read_probability(const KeyReader& r, std::initializer_list<std::string_view> keys, double def) {
  return r.number(keys, def, 0.0, 1.0);
}

void read_heads(const KeyReader& r, std::initializer_list<std::string_view> head_keys, uint64_t def_heads,
                std::string_view defaults_of, std::initializer_list<std::string_view> width_keys, uint64_t width,
                AttentionSpec& a) {
  a.heads = r.shape(head_keys, def_heads, 1, kMaxHeads, defaults_of);
  if (a.kv_heads == 0) a.kv_heads = a.heads;
  if (a.head_dim == 0) {
    if (width % a.heads != 0) {
      std::string key(*head_keys.begin());
      r.find(head_keys, &key);
      std::string wkey(*width_keys.begin());
      r.find(width_keys, &wkey);
      r.fail(key, a.heads, fmt::format("a divisor of \"{}\" = {} (the head width is {} / heads)", wkey, width,
                                       wkey));
    }
    a.head_dim = width / a.heads;
  }
  if (a.heads % a.kv_heads != 0) {
    std::string key(*head_keys.begin());
    r.find(head_keys, &key);
    r.fail("num_key_value_heads", a.kv_heads,
           fmt::format("a divisor of \"{}\" = {} (each key/value head serves a group of query heads)", key,
                       a.heads));
  }
}

void check_rotary_dims(const KeyReader& r, std::string_view key, const ModelSpec& m) {
  if (m.attn.rotary_dim % 2 == 0) return;
  throw Error(fmt::format("{}: key \"{}\" gives {} rotary dims per head (head_dim {}): expected an even number "
                          "(rotate_half splits the rotated dims in two halves, and cos/sin hold one frequency per "
                          "pair: arange(0, dim, 2))", r.origin(), key, m.attn.rotary_dim, m.attn.head_dim));
}

}  // namespace trainmem::config
