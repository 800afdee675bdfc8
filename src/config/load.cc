// Loading a model: find the config (preset, file, or a folder's config.json), apply --set overrides, dispatch on
// model_type, and check that every --set key was read.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <utility>

#include "families.h"
#include "key_reader.h"
#include "../families/registry.h"
#include "trainmem/config.h"
#include "trainmem/error.h"

namespace trainmem {

namespace {

// Parses a config text. Every way it can fail is a trainmem::Error naming the origin, including a number
// beyond a double (1e400), which nlohmann reports as out_of_range rather than as a parse error.
nlohmann::json parse_config(std::string_view text, std::string_view origin) {
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    throw Error(fmt::format("{}: the file is empty (expected a JSON object like a config.json)", origin));
  }
  // The keys leading to the value being parsed, to name the key of an out-of-range number (nlohmann gives no
  // position for it). A key event's depth is the number of open objects and arrays; an object that ends
  // drops the keys inside it.
  std::vector<std::string> path;
  const auto track = [&path](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    const auto d = static_cast<size_t>(std::max(depth, 0));
    if (event == nlohmann::json::parse_event_t::key && d > 0) {
      path.resize(d);
      path.back() = parsed.get<std::string>();
    } else if (event == nlohmann::json::parse_event_t::object_end && path.size() > d) {
      path.resize(d);
    }
    return true;
  };
  try {
    // Without the callback first: nlohmann's callback parser is quadratic in the entries of an array (a
    // million-entry array took minutes); the callback runs only to name the key of an out-of-range number.
    try {
      return nlohmann::json::parse(text);
    } catch (const nlohmann::json::out_of_range& e) {
      if (e.id != 406) throw;
    }
    return nlohmann::json::parse(text, track);
  } catch (const nlohmann::json::out_of_range& e) {
    if (e.id != 406) throw Error(fmt::format("{}: not valid JSON: {}", origin, e.what()));
    // "[json.exception.out_of_range.406] number overflow parsing '1e400'": show the number, cut short.
    const std::string what = e.what();
    const size_t open = what.find('\''), close = what.rfind('\'');
    std::string number = open < close ? what.substr(open + 1, close - open - 1) : what;
    if (number.size() > 40) number = number.substr(0, 37) + "...";
    std::string key;
    for (const std::string& k : path) key += k.empty() ? "" : (key.empty() ? "" : ".") + k;
    throw Error(fmt::format("{}: not valid JSON: a number is out of range: {}{} (beyond the largest double, "
                            "about 1.8e308)", origin, key.empty() ? "" : fmt::format("key \"{}\" = ", key),
                            number));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON: {}", origin, e.what()));
  }
}

// "key=value": the value is read as JSON when it parses (numbers, true/false, null, quoted strings) and as a
// plain string otherwise; "a.b=v" sets a nested key. Returns the top-level key ("a").
std::string apply_override(nlohmann::json& obj, const std::string& kv, std::string_view origin) {
  const size_t eq = kv.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw Error(fmt::format("--set \"{}\": expected key=value (e.g. --set n_layer=24)", kv));
  }
  const std::string key = kv.substr(0, eq), raw = kv.substr(eq + 1);
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(raw);
  } catch (const nlohmann::json::out_of_range&) {
    // A number beyond a double (1e400) is a typo, not text that happens to look like a number.
    if (raw.find_first_not_of("0123456789+-.eE") != std::string::npos) {
      value = raw;
    } else {
      throw Error(fmt::format("{}: --set \"{}\": the number {} is out of range (beyond the largest double, about "
                              "1.8e308)", origin, kv, raw));
    }
  } catch (const nlohmann::json::exception&) {
    value = raw;
  }
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
  return key.substr(0, key.find('.'));
}

// transformers builds the class that "architectures" names (AutoModelFor... reads architectures[0]'s suffix).
// Each family models the heads its registry row lists: a decoder the causal-LM head (lm_head over the
// vocabulary), an encoder the masked-LM, sequence- and token-classification heads. Modelling another head than
// the one named would be silently wrong, so an unknown suffix is refused. No "architectures" at all (nanoGPT,
// hand-written configs) means the family's own head (the first it lists). --head overrides all of it.
std::optional<Head> head_of_architectures(const config::KeyReader& r) {
  const nlohmann::json* a = r.find({"architectures"});
  if (!a || a->is_null()) return std::nullopt;
  constexpr std::string_view kList = "a list of class names like [\"LlamaForCausalLM\"]";
  if (!a->is_array()) r.fail("architectures", *a, kList);
  std::optional<Head> head;
  for (const nlohmann::json& c : *a) {
    if (!c.is_string()) r.fail("architectures", *a, kList);
    const std::string& name = c.get_ref<const std::string&>();
    Head h;
    if (name.ends_with("ForCausalLM") || name.ends_with("LMHeadModel") || name == "T5ForConditionalGeneration") {
      // T5ForConditionalGeneration: T5's language-model head (an encoder-decoder's lm_head over the vocabulary)
      h = Head::kCausalLm;
    } else if (name.ends_with("ForMaskedLM")) {
      h = Head::kMaskedLm;
    } else if (name.ends_with("ForSequenceClassification")) {
      h = Head::kSeqCls;
    } else if (name.ends_with("ForTokenClassification")) {
      h = Head::kTokenCls;
    } else {
      r.fail("architectures", *a,
             "...ForCausalLM, ...LMHeadModel, ...ForMaskedLM, ...ForSequenceClassification or "
             "...ForTokenClassification; other task heads (question answering, multiple choice, pretraining) are "
             "not modelled yet (--head picks one that is)");
    }
    if (head && *head != h) {
      r.fail("architectures", *a, "classes of one head (these name two: --head picks one)");
    }
    head = h;
  }
  return head;
}

// m.head and m.num_labels: --head, else architectures[0]'s, else the family's own; the head must be one the
// family's program builds. num_labels as PreTrainedConfig resolves it: len(id2label) when id2label is given,
// else num_labels (default 2); --num-labels overrides both.
void resolve_head(const config::KeyReader& r, const ModelRequest& req, ModelSpec& m) {
  constexpr uint64_t kMaxLabels = kMaxNumLabels;  // a classifier's rows (model.h), the bound --num-labels has too
  const std::optional<Head> named = head_of_architectures(r);
  const std::span<const Head> heads = family_descriptor(m.family).heads;
  m.head = req.head.value_or(named.value_or(heads.empty() ? Head::kCausalLm : heads.front()));
  const bool built = heads.empty() ? m.head == Head::kCausalLm
                                   : std::find(heads.begin(), heads.end(), m.head) != heads.end();
  if (!built) {
    std::string list;
    for (Head h : heads) list += (list.empty() ? "" : ", ") + std::string(head_name(h));
    // A decoder's ...ForSequenceClassification (score without bias, pooled at the last non-pad token) is not
    // simulated yet: refused rather than modelled as the causal LM
    const std::string built_list = list.empty() ? "causal-lm" : list;
    if (req.head) {
      throw Error(fmt::format("{}: --head {}: the {} head is not simulated for model_type \"{}\" (its family builds: "
                              "{})", r.origin(), head_name(m.head), head_name(m.head), m.model_type, built_list));
    }
    r.fail("architectures", *r.find({"architectures"}),
           fmt::format("a class of a head simulated for model_type \"{}\" ({}); its {} head is not simulated yet "
                       "(--head picks another)", m.model_type, built_list, head_name(m.head)));
  }
  // configuration_utils.py PreTrainedConfig: `if id2label is not None: num_labels = len(id2label)`, else
  // num_labels (default 2). Both keys are read for every model, so that --set of either is accepted.
  uint64_t labels = r.integer({"num_labels"}, 2, 1, kMaxLabels);
  if (const nlohmann::json* ids = r.find({"id2label"}); ids && !ids->is_null()) {
    if (!ids->is_object() || ids->empty()) r.fail("id2label", *ids, "an object mapping label ids to names");
    labels = ids->size();
  }
  m.num_labels = req.num_labels.value_or(labels);
  const bool classifier = m.head == Head::kSeqCls || m.head == Head::kTokenCls;
  if (req.num_labels && !classifier) {
    throw Error(fmt::format("{}: --num-labels {}: the {} head has no labels of its own (only seq-cls and token-cls "
                            "heads do)", r.origin(), *req.num_labels, head_name(m.head)));
  }
  // problem_type (PreTrainedConfig, default None): the sequence classifiers' loss reads it first
  // (ForSequenceClassificationLoss / BertForSequenceClassification.forward: "regression" -> MSELoss,
  // "multi_label_classification" -> BCEWithLogitsLoss over float labels); None with num_labels > 1 and int64
  // labels is "single_label_classification", the CrossEntropyLoss simulated here. Read for every model, so that
  // a config that names another loss is refused rather than simulated as the wrong one.
  const nlohmann::json* problem_key = r.find({"problem_type"});
  const std::string problem = problem_key && !problem_key->is_null() ? r.text({"problem_type"}, "") : "";
  if (!problem.empty() && problem != "single_label_classification") {
    r.fail("problem_type", problem,
           "\"single_label_classification\" or none: the regression (MSELoss) and multi-label (BCEWithLogitsLoss) "
           "losses are not simulated");
  }
  if (m.head == Head::kSeqCls && m.family != Family::kBert && m.family != Family::kRoberta) {
    // GenericForSequenceClassification.forward pools at the last token that is not config.pad_token_id
    // ((input_ids != pad_token_id) ... .argmax(-1)); with pad_token_id None it raises for batch sizes above 1 and
    // takes the last position otherwise. trainmem simulates the first case only: a pad token id must be given.
    const nlohmann::json* pad = r.find({"pad_token_id"});
    if (!pad || pad->is_null()) {
      throw Error(fmt::format("{}: the seq-cls head of model_type \"{}\" needs pad_token_id (transformers pools at the "
                              "last non-pad token and refuses batches above 1 without one): --set pad_token_id=N",
                              r.origin(), m.model_type));
    }
    m.pad_token_id = r.integer({"pad_token_id"}, 0, 0, config::kMaxVocab - 1);
  }
  if (m.head == Head::kSeqCls && m.num_labels < 2) {
    // BertForSequenceClassification / ForSequenceClassificationLoss: num_labels == 1 -> problem_type "regression"
    // (MSELoss); a token classifier's loss is CrossEntropyLoss whatever num_labels is
    throw Error(fmt::format("{}: num_labels {}: with 1 label transformers computes a regression loss (MSELoss), "
                            "which is not simulated; use 2 or more (--num-labels)", r.origin(), m.num_labels));
  }
}

// Levenshtein distance, for "did you mean".
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Whether `a`'s characters appear in `b` in order: "n_layer" and "num_layers" in "num_hidden_layers".
bool is_subsequence(std::string_view a, std::string_view b) {
  size_t i = 0;
  for (size_t j = 0; i < a.size() && j < b.size(); ++j) i += a[i] == b[j] ? 1 : 0;
  return i == a.size();
}

// The known key nearest to `key`: a key that contains it in order (another family's shorter spelling, a
// dropped letter) first, then the fewest edits. "_source" is trainmem's note on where a preset comes from,
// never what a user meant.
std::string nearest_key(std::string_view key, const std::set<std::string, std::less<>>& known) {
  std::string best;
  std::pair<bool, size_t> best_rank{true, 0};
  for (const std::string& k : known) {
    if (k == "_source") continue;
    const std::pair<bool, size_t> rank{!is_subsequence(key, k), edit_distance(key, k)};
    if (best.empty() || rank < best_rank) best = k, best_rank = rank;
  }
  return best;
}

// A --set of a key that the reader never asked for would change nothing: a typo (num_hidden_layer) or a key of
// another family or tool (lora_r). Keys of the file that nothing reads stay ignored, as in transformers.
void check_overrides_were_read(const config::KeyReader& r, const std::vector<std::string>& kvs,
                               const std::vector<std::string>& keys, const std::string& model_type) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (r.asked().contains(keys[i])) continue;
    const std::string nearest = nearest_key(keys[i], r.asked());
    throw Error(fmt::format("{}: --set \"{}\": no supported architecture reads key \"{}\" for model_type "
                            "\"{}\"{}", r.origin(), kvs[i], keys[i], model_type,
                            nearest.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", nearest)));
  }
}

// The implementation that builds the model: the one asked for, or the model type's own; it must be one of
// the family's programs (src/families/registry.cc).
void resolve_impl(ModelSpec& m, const ModelType& type, const ModelRequest& req, std::string_view origin) {
  m.impl = req.impl.value_or(type.default_impl);
  const std::string_view model_type = type.name;
  const FamilyDescriptor& fam = family_descriptor(m.family);
  const bool built = std::any_of(fam.programs.begin(), fam.programs.end(),
                                 [&](const Program& p) { return p.impl == m.impl; });
  if (!built) {
    std::string impls;
    for (const Program& p : fam.programs) impls += (impls.empty() ? "" : " or ") + std::string(impl_name(p.impl));
    if (m.impl == Impl::kNanoGpt) {
      throw Error(fmt::format("{}: --impl nanogpt builds GPT-2 shaped models only (model_type gpt2 or nanogpt), "
                              "not model_type \"{}\"", origin, model_type));
    }
    throw Error(fmt::format("{}: --impl {} cannot build model_type \"{}\" (the {} family is built by --impl {})",
                            origin, impl_name(m.impl), model_type, fam.name, impls));
  }
  if (m.impl == Impl::kHf && model_type == "nanogpt" && !m.norm.bias) {
    throw Error(fmt::format("{}: --impl hf builds a nanoGPT config as transformers' GPT-2, which always has "
                            "biases; this config has \"bias\" = false (use --impl nanogpt)", origin));
  }
}

ModelSpec read_model(std::string_view text, std::string_view origin, const ModelRequest& req,
                     std::vector<std::string>& warnings) {
  nlohmann::json obj = parse_config(text, origin);
  if (!obj.is_object()) {
    throw Error(fmt::format("{}: expected a JSON object (a config.json), got a JSON {}", origin, obj.type_name()));
  }
  std::vector<std::string> overridden;
  for (const std::string& kv : req.overrides) overridden.push_back(apply_override(obj, kv, origin));

  const std::string where(origin);
  config::KeyReader r(obj, where);
  r.set_overridden(overridden);
  r.set_warnings(&warnings);
  ModelSpec m;
  m.name = where;
  m.model_type = r.text({"model_type"}, std::nullopt);
  m.source = r.text({"_source"}, where);
  m.attn_impl = req.attention;
  m.moe.routing = req.moe_routing;
  m.moe.impl = req.moe_experts;
  const std::string& t = m.model_type;
  // The family registry says which reader reads this model_type (src/families/registry.cc).
  const ModelType* type = nullptr;
  if (t == "distilbert") {
    // modeling_distilbert.py: its own module names and layout (transformer.layer.N.attention.q_lin, sa_layer_norm,
    // vocab_transform/vocab_layer_norm/vocab_projector, pre_classifier) are not simulated
    r.fail("model_type", obj["model_type"], fmt::format("one of {} (DistilBERT is not simulated yet)",
                                                        supported_model_types()));
  }
  if (!find_model_type(t, &type)) r.fail("model_type", obj["model_type"], fmt::format("one of {}", supported_model_types()));
  type->read(r, t, m);
  resolve_head(r, req, m);
  check_overrides_were_read(r, req.overrides, overridden, t);
  resolve_impl(m, *type, req, origin);
  return m;
}

}  // namespace

std::string config::nearest_name(std::string_view name, const std::set<std::string, std::less<>>& known) {
  return nearest_key(name, known);
}

std::optional<std::string> DiskFileReader::read(const std::string& path) const {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return std::nullopt;
  const auto too_large = [&] {
    return Error(fmt::format("{}: larger than {} MiB, the most read as a config.json (real ones are at most a "
                             "few hundred KB)", path, kMaxConfigFileBytes >> 20));
  };
  // A device or a pipe may never end (/dev/zero) or block; a config.json is a regular file.
  if (!fs::is_regular_file(st)) {
    throw Error(fmt::format("{}: not a regular file (expected a config.json of at most {} MiB)", path,
                            kMaxConfigFileBytes >> 20));
  }
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > kMaxConfigFileBytes) throw too_large();
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  // Bounded while reading too: a file can grow, and /proc files report size 0.
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigFileBytes) throw too_large();
  }
  if (in.bad()) return std::nullopt;
  return text;
}

bool DiskFileReader::is_directory(const std::string& path) const {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

const Preset* find_preset(std::string_view name) {
  for (const Preset& p : presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::optional<Impl> parse_impl(std::string_view s) { return parse_name<Impl>(s); }
std::optional<AttnImpl> parse_attn_impl(std::string_view s) { return parse_name<AttnImpl>(s); }

ModelSpec model_from_json(std::string_view text, std::string_view origin, const ModelRequest& req,
                          std::vector<std::string>* warnings) {
  std::vector<std::string> found;
  try {
    ModelSpec m = read_model(text, origin, req, found);
    if (warnings) warnings->insert(warnings->end(), found.begin(), found.end());
    return m;
  } catch (const nlohmann::json::exception& e) {
    // The readers check each value's type before using it, so this is a gap in them; it is still about this
    // input, not an internal failure, so it names the input.
    throw Error(fmt::format("{}: cannot read the config: {}", origin, e.what()));
  }
}

ModelSpec load_model(const ModelRequest& req, const FileReader& files, std::vector<std::string>* warnings) {
  if (const Preset* p = find_preset(req.model)) {
    ModelSpec m = model_from_json(p->json, fmt::format("preset {}", p->name), req, warnings);
    m.name = std::string(p->name);
    return m;
  }
  if (files.is_directory(req.model)) {
    // A model folder (a Hugging Face snapshot, a save_pretrained() output) describes its model in config.json.
    const std::string path = req.model + (req.model.ends_with('/') ? "" : "/") + "config.json";
    std::optional<std::string> text = files.read(path);
    if (!text) throw Error(fmt::format("--model \"{}\": a directory without a config.json", req.model));
    return model_from_json(*text, path, req, warnings);
  }
  std::optional<std::string> text = files.read(req.model);
  if (!text) {
    throw Error(fmt::format("--model \"{}\": not a preset (see `trainmem models`) and no readable file at that "
                            "path", req.model));
  }
  return model_from_json(*text, req.model, req, warnings);
}

}  // namespace trainmem
