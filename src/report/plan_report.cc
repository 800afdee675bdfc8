// trainmem plan's table and JSON (plan.h): the ranked setups, why the first is first, and why each family that
// has no row has none.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <nlohmann/json.hpp>

#include "text_table.h"
#include "time_report.h"
#include "trainmem/plan.h"
#include "trainmem/report.h"

namespace trainmem {

namespace {

std::string ms(double s) { return fmt::format("{:.1f} ms", s * 1e3); }
std::string tokens(double t) { return with_commas(static_cast<uint64_t>(t + 0.5)); }

std::string sharding_cell(const PlanSetup& s) {
  const std::string n = plan_sharding_name(s);
  return n.empty() ? "-" : n;
}
std::string schedule_cell(const PlanSetup& s) {
  if (s.pp <= 1) return "-";
  if (s.schedule == PpSchedule::kInterleaved1f1b) return fmt::format("{} x{}", name_of(s.schedule), s.virtual_stages);
  return std::string(name_of(s.schedule));
}
// The optimizer's code path, and what foreach would cost instead of fused: "fused (foreach +4.8 ms)".
std::string optimizer_cell(const PlanSetup& s, const PlanRow& row) {
  // kAuto: plan leaves the code path to the optimizer's own code (DeepSpeed's under ZeRO, bitsandbytes' for its
  // optimizers)
  std::string out = s.optimizer_impl != OptimizerImpl::kAuto ? std::string(name_of(s.optimizer_impl))
                    : s.deepspeed()                          ? "deepspeed"
                                                             : "its own";
  if (row.foreach) {
    if (!row.foreach->fits) {
      out += " (foreach: does not fit)";
    } else if (row.foreach->step_seconds) {
      out += fmt::format(" (foreach {:+.1f} ms)", (*row.foreach->step_seconds - row.time.step_seconds) * 1e3);
    }
  }
  return out;
}

// A family's reason, as the CLI words errors (a field by its flag).
std::string why_text(const PlanFamily& f) {
  if (f.verdict == PlanVerdict::kDoesNotFit) {
    const std::string short_by = format_bytes(Bytes(static_cast<uint64_t>(-f.best_headroom)));
    if (f.screened) return fmt::format("{}, short by {} at micro-batch {}", f.why, short_by, f.smallest_batch);
    return fmt::format("short by {} at micro-batch {}{}", short_by, f.smallest_batch,
                       f.why.empty() ? "" : " (" + f.why + ")");
  }
  if (!f.why_field.empty()) return cli_flag(f.why_field) + " " + f.why;
  return f.why;
}

}  // namespace

std::string render_plan_table(const PlanResult& r) {
  std::string out = fmt::format(
      "{} on {} x {} ({} per node): global batch {} x {} tokens = {} tokens per step, {} kept free per GPU (in "
      "every fit, headroom and shortfall below)\n",
      r.model, r.gpus, r.gpu.name, r.gpus_per_node, r.global_batch, r.seq,
      with_commas(r.global_batch * r.seq), format_bytes(r.margin));
  if (!r.fixed.empty()) {
    std::string f;
    for (const std::string& x : r.fixed) f += (f.empty() ? "" : ", ") + x;
    out += "kept as given: " + f + "\n";
  }
  out += "\n";
  if (r.rows.empty()) {
    out += "NO SETUP FITS and is timed: every family is listed below with its reason\n";
  } else {
    out += fmt::format("{} setups fit; the fastest {}:\n", r.ranked_total, r.rows.size());
    report::TextTable t({{"#", report::TextTable::kRight},
                         {"tokens/s", report::TextTable::kRight},
                         {"step", report::TextTable::kRight},
                         {"MFU", report::TextTable::kRight},
                         {"tp", report::TextTable::kRight},
                         {"pp", report::TextTable::kRight},
                         {"cp", report::TextTable::kRight},
                         {"dp", report::TextTable::kRight},
                         {"sharding", report::TextTable::kLeft},
                         {"schedule", report::TextTable::kLeft},
                         {"checkpointing", report::TextTable::kLeft},
                         {"precision", report::TextTable::kLeft},
                         {"micro-batch", report::TextTable::kRight},
                         {"optimizer", report::TextTable::kLeft},
                         {"reserved", report::TextTable::kRight},
                         {"headroom", report::TextTable::kRight}});
    for (size_t i = 0; i < r.rows.size(); ++i) {
      const PlanRow& row = r.rows[i];
      const PlanSetup& s = row.setup;
      t.row({std::to_string(i + 1), tokens(row.time.tokens_per_second), ms(row.time.step_seconds),
             fmt::format("{:.1f}%", row.time.mfu * 100), std::to_string(s.tp), std::to_string(s.pp),
             std::to_string(s.cp), std::to_string(s.dp), sharding_cell(s), schedule_cell(s),
             std::string(name_of(s.checkpointing)), plan_precision_name(s),
             fmt::format("{} x {}", s.batch, s.accumulation), optimizer_cell(s, row), format_bytes(row.peak_reserved),
             format_bytes(Bytes(static_cast<uint64_t>(std::max<int64_t>(row.headroom, 0)))) +
                 (row.alloc_retries > 0 ? " *" : "")});
    }
    out += t.str();
    if (std::any_of(r.rows.begin(), r.rows.end(), [](const PlanRow& row) { return row.alloc_retries > 0; })) {
      out += "  * fits only because the caching allocator releases its cache to stay under the limit (slower; "
             "estimate's peak reserved, without a limit, is higher)\n";
    }
    out += "\nbest: " + r.best_reason.front() + "\n";
    for (size_t i = 1; i < r.best_reason.size(); ++i) out += "  " + r.best_reason[i] + "\n";
    for (const std::string& n : r.rows[0].time.notes) out += "  its step time: " + n + "\n";
    const std::vector<FieldChange> run = plan_fields(r.given, r.rows[0].setup.changes());
    out += "  run it: trainmem estimate " + cli_words(run) + "\n";
  }
  // the families without a row, grouped by verdict and reason
  std::map<std::pair<PlanVerdict, std::string>, std::vector<const PlanFamily*>> groups;
  size_t rejected = 0;
  for (const PlanFamily& f : r.families) {
    if (f.verdict == PlanVerdict::kRanked) continue;
    ++rejected;
    // one group per reason, its numbers aside (the same rule refusing tp 2 and tp 4); the first family's message
    // is shown
    std::string key;
    if (f.verdict == PlanVerdict::kRefused && !f.why_field.empty()) {
      key = f.why_field;  // one group per refusing field: its first message shows the rule
    } else if (f.verdict != PlanVerdict::kDoesNotFit && f.verdict != PlanVerdict::kPruned) {
      for (char ch : why_text(f)) {
        if (!std::isdigit(static_cast<unsigned char>(ch))) {
          key += ch;
        } else if (key.empty() || key.back() != '#') {
          key += '#';
        }
      }
    }
    groups[{f.verdict, key}].push_back(&f);
  }
  out += fmt::format("\n{} families searched, {} with a row; {} without:\n", r.families.size(),
                     r.families.size() - rejected, rejected);
  for (const auto& [key, fams] : groups) {
    const auto& [verdict, why] = key;
    out += fmt::format("  {} ({}){}\n", plan_verdict_name(verdict), fams.size(),
                       why.empty() ? ":" : ": " + why_text(*fams.front()));
    const size_t shown = verdict == PlanVerdict::kDoesNotFit ? 6 : 3;
    std::vector<const PlanFamily*> list = fams;
    if (verdict == PlanVerdict::kDoesNotFit) {
      // the closest to fitting first
      std::stable_sort(list.begin(), list.end(),
                       [](const PlanFamily* a, const PlanFamily* b) { return a->best_headroom > b->best_headroom; });
    }
    for (size_t i = 0; i < list.size() && i < shown; ++i) {
      const PlanFamily& f = *list[i];
      std::string detail;
      if (verdict == PlanVerdict::kDoesNotFit) detail = ": " + why_text(f);
      if (verdict == PlanVerdict::kPruned) detail = ": " + f.why;
      out += fmt::format("    {}{}\n", plan_family_name(f.setup), detail);
    }
    if (list.size() > shown) out += fmt::format("    ... and {} more\n", list.size() - shown);
  }
  out += fmt::format("\nsimulated: {} rank steps ({} references of the throughput bound)\n", r.simulations,
                     r.reference_simulations);
  for (const std::string& n : r.notes) out += "note: " + n + "\n";
  return out;
}

std::string render_plan_json(const PlanResult& r) {
  auto setup_json = [](const PlanSetup& s) {
    nlohmann::json fields = nlohmann::json::object();
    for (const FieldChange& c : s.changes()) fields[c.field] = c.value;
    return nlohmann::json{{"family", plan_family_name(s)}, {"dp", s.dp}, {"precision", plan_precision_name(s)}, {"fields", fields}};
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const PlanRow& row : r.rows) {
    nlohmann::json j = setup_json(row.setup);
    if (row.foreach) {
      j["foreach"] = {{"fits", row.foreach->fits}, {"peak_reserved_bytes", row.foreach->peak_reserved.value}};
      if (row.foreach->step_seconds) j["foreach"]["step_seconds"] = *row.foreach->step_seconds;
    }
    j["peak_reserved_bytes"] = row.peak_reserved.value;
    j["device_total_bytes"] = row.device_total.value;
    j["headroom_bytes"] = row.headroom;
    j["alloc_retries"] = row.alloc_retries;
    if (row.pp_worst_rank) j["pp_worst_rank"] = *row.pp_worst_rank;
    j["time"] = step_time_json(row.time);
    j["bound_tokens_per_second"] = row.bound_tokens_per_second;
    rows.push_back(j);
  }
  nlohmann::json families = nlohmann::json::array();
  for (const PlanFamily& f : r.families) {
    nlohmann::json j = setup_json(f.setup);
    j["verdict"] = plan_verdict_name(f.verdict);
    j["why"] = why_text(f);
    j["bound_tokens_per_second"] = f.bound_tokens_per_second;
    if (f.verdict == PlanVerdict::kDoesNotFit) {
      // screened: not simulated; the headroom is its lighter variant's (it does not fit either)
      j[f.screened ? "lighter_variant_headroom_bytes" : "headroom_bytes"] = f.best_headroom;
      j["screened"] = f.screened;
    }
    families.push_back(j);
  }
  nlohmann::json out = {{"model", r.model},
                        {"gpu", r.gpu.name},
                        {"gpus", r.gpus},
                        {"gpus_per_node", r.gpus_per_node},
                        {"global_batch", r.global_batch},
                        {"seq", r.seq},
                        {"margin_bytes", r.margin.value},
                        {"fixed", r.fixed},
                        {"rows", rows},
                        {"ranked_total", r.ranked_total},
                        {"best_reason", r.best_reason},
                        {"families", families},
                        {"simulations", r.simulations},
                        {"reference_simulations", r.reference_simulations},
                        {"notes", r.notes}};
  return out.dump(2) + "\n";
}

}  // namespace trainmem
