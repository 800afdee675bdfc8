// Loading a model: find the config (preset or file), apply --set overrides, dispatch on model_type.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "families.h"
#include "key_reader.h"
#include "trainmem/config.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

// Supported model_type values, for error messages.
constexpr std::string_view kModelTypes =
    "gpt2, nanogpt, llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral, gpt_neox, opt, mlp";

// "key=value": the value is read as JSON when it parses (numbers, true/false, null, quoted strings) and as a
// plain string otherwise; "a.b=v" sets a nested key.
void apply_override(nlohmann::json& obj, const std::string& kv, std::string_view origin) {
  const size_t eq = kv.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw Error(fmt::format("--set \"{}\": expected key=value (e.g. --set n_layer=24)", kv));
  }
  const std::string key = kv.substr(0, eq), raw = kv.substr(eq + 1);
  nlohmann::json value = nlohmann::json::parse(raw, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = raw;
  nlohmann::json* target = &obj;
  std::string rest = key;
  for (size_t dot; (dot = rest.find('.')) != std::string::npos; rest = rest.substr(dot + 1)) {
    nlohmann::json& child = (*target)[rest.substr(0, dot)];
    if (child.is_null()) child = nlohmann::json::object();
    if (!child.is_object()) {
      throw Error(fmt::format("{}: --set \"{}\": \"{}\" is not an object", origin, kv, rest.substr(0, dot)));
    }
    target = &child;
  }
  (*target)[rest] = std::move(value);
}

void resolve_impl(ModelSpec& m, const std::string& model_type, const ModelRequest& req, std::string_view origin) {
  const Impl def = model_type == "nanogpt" ? Impl::kNanoGpt : (model_type == "mlp" ? Impl::kStack : Impl::kHf);
  m.impl = req.impl.value_or(def);
  if (model_type == "mlp") {
    if (m.impl != Impl::kStack) {
      throw Error(fmt::format("{}: --impl {} cannot build model_type \"mlp\" (a layer stack)", origin,
                              impl_name(m.impl)));
    }
    return;
  }
  if (m.impl == Impl::kStack) {
    throw Error(fmt::format("{}: --impl stack only builds model_type \"mlp\"", origin));
  }
  if (m.impl == Impl::kNanoGpt && m.family != Family::kGpt2) {
    throw Error(fmt::format("{}: --impl nanogpt builds GPT-2 shaped models only (model_type gpt2 or nanogpt), "
                            "not model_type \"{}\"", origin, model_type));
  }
  if (m.impl == Impl::kHf && model_type == "nanogpt" && !m.norm.bias) {
    throw Error(fmt::format("{}: --impl hf builds a nanoGPT config as transformers' GPT-2, which always has "
                            "biases; this config has \"bias\" = false (use --impl nanogpt)", origin));
  }
}

}  // namespace

std::optional<std::string> DiskFileReader::read(const std::string& path) const {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return ss.str();
}

const Preset* find_preset(std::string_view name) {
  for (const Preset& p : presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::optional<Impl> parse_impl(std::string_view s) {
  if (s == "hf") return Impl::kHf;
  if (s == "nanogpt") return Impl::kNanoGpt;
  if (s == "stack") return Impl::kStack;
  return std::nullopt;
}

std::optional<AttnImpl> parse_attn_impl(std::string_view s) {
  if (s == "eager") return AttnImpl::kEager;
  if (s == "sdpa") return AttnImpl::kSdpa;
  return std::nullopt;
}

ModelSpec model_from_json(std::string_view text, std::string_view origin, const ModelRequest& req) {
  nlohmann::json obj = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (obj.is_discarded()) {
    if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
      throw Error(fmt::format("{}: the file is empty (expected a JSON object like a config.json)", origin));
    }
    // Parse again with exceptions on to report the position of the syntax error.
    try {
      const nlohmann::json unused = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw Error(fmt::format("{}: not valid JSON: {}", origin, e.what()));
    }
    throw Error(fmt::format("{}: not valid JSON", origin));
  }
  if (!obj.is_object()) {
    throw Error(fmt::format("{}: expected a JSON object (a config.json), got a JSON {}", origin, obj.type_name()));
  }
  for (const std::string& kv : req.overrides) apply_override(obj, kv, origin);

  const std::string where(origin);
  config::KeyReader r(obj, where);
  ModelSpec m;
  m.name = where;
  m.model_type = r.text({"model_type"}, std::nullopt);
  m.source = r.text({"_source"}, where);
  m.attn_impl = req.attention;
  const std::string& t = m.model_type;
  if (t == "gpt2") {
    config::read_gpt2(r, m);
  } else if (t == "nanogpt") {
    config::read_nanogpt(r, m);
  } else if (t == "gpt_neox") {
    config::read_gpt_neox(r, m);
  } else if (t == "opt") {
    config::read_opt(r, m);
  } else if (t == "mlp") {
    config::read_stack(r, m);
  } else if (!config::read_llama_family(r, t, m)) {
    r.fail("model_type", obj["model_type"], fmt::format("one of {}", kModelTypes));
  }
  resolve_impl(m, t, req, origin);
  return m;
}

ModelSpec load_model(const ModelRequest& req, const FileReader& files) {
  if (const Preset* p = find_preset(req.model)) {
    ModelSpec m = model_from_json(p->json, fmt::format("preset {}", p->name), req);
    m.name = std::string(p->name);
    return m;
  }
  std::optional<std::string> text = files.read(req.model);
  if (!text) {
    throw Error(fmt::format("--model \"{}\": not a preset (see `trainmem models`) and no readable file at that "
                            "path", req.model));
  }
  return model_from_json(*text, req.model, req);
}

}  // namespace trainmem
