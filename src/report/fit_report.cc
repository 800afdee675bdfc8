// `trainmem fit`: the answer (largest micro-batch or sequence), the probes that found it, and the changes that
// would make a setup fit when its smallest size does not.
#include <fmt/format.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "json_text.h"
#include "time_report.h"
#include "text_table.h"
#include "trainmem/error.h"
#include "trainmem/report.h"

namespace trainmem {

namespace {

std::string signed_bytes(int64_t b) {
  const std::string s = format_bytes(Bytes(static_cast<uint64_t>(b < 0 ? -b : b)));
  return b < 0 ? "-" + s : s;
}

std::string dimension_word(FitDimension d) { return d == FitDimension::kBatch ? "micro-batch" : "sequence"; }

nlohmann::json probe_json(const FitProbe& p) {
  nlohmann::json j = {{"batch", p.batch},
                      {"seq", p.seq},
                      {"fits", p.fits},
                      {"peak_allocated_bytes", p.peak_allocated.value},
                      {"peak_reserved_bytes", p.peak_reserved.value},
                      {"reserved_on_device_bytes", p.fits ? nlohmann::json(p.reserved_on_device.value) : nlohmann::json()},
                      {"device_total_bytes", p.fits ? nlohmann::json(p.device_total.value) : nlohmann::json()},
                      {"headroom_bytes", p.headroom},
                      {"alloc_retries", p.alloc_retries},
                      {"fragmentation_is_large", p.large_fragmentation}};
  if (!p.failure.empty()) j["failure"] = p.failure;
  if (p.pp_worst_rank) j["pp_worst_rank"] = *p.pp_worst_rank;
  return j;
}

}  // namespace

// Reserved memory need not grow with the size: best-fit placement can leave a whole segment cached at one
// size and not at the next. Say so where the probes show it, or where fragmentation is a large share.
std::string fit_fragmentation_note(const FitResult& r) {
  const FitProbe* falls_from = nullptr;
  const FitProbe* falls_to = nullptr;
  for (size_t i = 1; i < r.probes.size(); ++i) {
    if (r.probes[i].peak_reserved < r.probes[i - 1].peak_reserved && r.probes[i].peak_reserved.value > 0) {
      falls_from = &r.probes[i - 1];
      falls_to = &r.probes[i];
      break;
    }
  }
  const bool large = std::any_of(r.probes.begin(), r.probes.end(), [](const FitProbe& p) { return p.large_fragmentation; });
  if (!falls_from && !large) return "";
  const bool by_batch = r.solve == FitDimension::kBatch;
  std::string out = "  note: ";
  if (falls_from) {
    out += fmt::format("reserved falls from {} at {} {} to {} at {}: ", format_bytes(falls_from->peak_reserved),
                       dimension_word(r.solve), by_batch ? falls_from->batch : falls_from->seq,
                       format_bytes(falls_to->peak_reserved), by_batch ? falls_to->batch : falls_to->seq);
  }
  out += "fragmentation (cached blocks that best fit could not use) is a large share of reserved at some sizes tried,\n"
         "  and it can differ by a whole segment between neighbouring sizes; the answer is checked at itself and the\n"
         "  next size. --alloc-conf expandable_segments:True avoids most of it.\n";
  return out;
}

std::string cli_flag(std::string_view field) {
  if (field == "overrides") return "--set";
  std::string flag = "--" + std::string(field);
  for (char& ch : flag) ch = ch == '_' ? '-' : ch;
  return flag;
}

std::string cli_words(std::span<const FieldChange> changes) {
  std::string s;
  for (const FieldChange& c : changes) s += (s.empty() ? "" : " ") + cli_flag(c.field) + " " + c.value;
  return s;
}

std::string cli_words(const FitSuggestion& sg) { return cli_words(sg.changes); }

std::string error_message(const Error& e) {
  if (const auto* f = dynamic_cast<const FieldError*>(&e)) return cli_flag(f->field()) + " " + f->detail();
  return e.what();
}

std::string render_fit_table(const FitResult& r) {
  const ModelSpec& m = r.model;
  const TrainSetup& s = r.setup;
  const bool by_batch = r.solve == FitDimension::kBatch;
  std::string out = fmt::format(
      "{} (model_type {}, {} code, {} attention{}): {}, {}, {}, {}, PyTorch {}\n", m.name, m.model_type,
      impl_name(m.impl), attn_impl_name(m.attn_impl), moe_routing_note(m),
      by_batch ? fmt::format("seq {}", s.seq) : fmt::format("micro-batch {}", s.batch), precision_name(s.precision),
      step_label(s), loop_label(r.setup, r.options.loop),
      torch_version_name(r.options.torch));
  out += fmt::format("{} ({}): {} total, {} outside PyTorch{}, {} safety margin: the caching allocator may reserve {}\n",
                     r.gpu.name, r.gpu.torch_name, format_bytes(r.gpu.runtime_total), format_bytes(r.gpu.context),
                     r.nccl.total.value > 0 ? fmt::format(" + {} of NCCL buffers", format_bytes(r.nccl.total)) : "",
                     format_bytes(r.margin), format_bytes(r.limit));
  out += render_nccl(r.nccl);
  out += '\n';
  if (r.largest) {
    out += fmt::format("LARGEST {} THAT FITS: {}{}\n", by_batch ? "MICRO-BATCH" : "SEQUENCE", with_commas(*r.largest),
                       !r.capped ? ""
                       : by_batch || r.model.max_positions == 0
                           ? fmt::format(" (the largest {} trainmem tries)", dimension_word(r.solve))
                           : fmt::format(" (all {} positions of the model's learned position table)",
                                         with_commas(r.model.max_positions)));
  } else {
    const FitProbe& one = r.probes.front();
    out += fmt::format("DOES NOT FIT even at {} 1: {}\n", dimension_word(r.solve), one.failure);
  }
  const FitProbe* at_largest = nullptr;
  for (const FitProbe& p : r.probes) {
    if (r.largest && (by_batch ? p.batch : p.seq) == *r.largest) at_largest = &p;
  }
  if (at_largest && at_largest->time) {
    out += render_step_time(*at_largest->time, r.gpu, r.setup, at_largest->pp_worst_rank.value_or(0));
  }
  using TT = report::TextTable;
  TT t({{by_batch ? "batch" : "seq", TT::kRight}, {"peak allocated", TT::kRight},
        {"reserved, no limit", TT::kRight}, {"reserved here", TT::kRight}, {"nvidia-smi", TT::kRight},
        {"headroom", TT::kRight}, {"fits", TT::kLeft}});
  for (const FitProbe& p : r.probes) {
    if (p.fits) {
      t.row({with_commas(by_batch ? p.batch : p.seq), format_bytes(p.peak_allocated), format_bytes(p.peak_reserved),
             format_bytes(p.reserved_on_device), format_bytes(p.device_total), signed_bytes(p.headroom),
             p.alloc_retries ? fmt::format("yes, after {} cache flush(es)", p.alloc_retries) : "yes"});
    } else if (p.peak_allocated.value == 0) {  // the sizes overflow 64 bits
      t.row({with_commas(by_batch ? p.batch : p.seq), "-", "-", "-", "-", "-", "no: " + p.failure});
    } else {
      t.row({with_commas(by_batch ? p.batch : p.seq), format_bytes(p.peak_allocated), format_bytes(p.peak_reserved),
             "-", "-", signed_bytes(p.headroom), "no: " + p.failure});
    }
  }
  out += '\n';
  out += t.str();
  out += "  reserved, no limit: max_memory_reserved on a card with room to spare; reserved here: on this GPU, where "
         "the allocator\n  releases its cache before it fails; headroom: what is left, or (negative) at least what is "
         "missing\n";
  if (!r.probes.empty() && r.probes.front().pp_worst_rank) {
    // --pp: each probe simulated every pipeline rank
    std::string ranks;
    for (const FitProbe& p : r.probes) {
      if (p.pp_worst_rank) ranks += fmt::format("{}{} {}: rank {}", ranks.empty() ? "" : ", ", by_batch ? "batch" : "seq",
                                                with_commas(by_batch ? p.batch : p.seq), *p.pp_worst_rank);
    }
    out += "  pipeline: each size simulates every rank; the figures are the worst rank's (the least headroom): " + ranks +
           "\n";
  }
  out += fit_fragmentation_note(r);
  if (r.suggestions_cut) out += "  note: fit reached its bound on work before simulating every change below\n";
  if (!r.suggestions.empty()) {
    out += r.largest ? fmt::format("\nchanges that would raise the answer (each simulated; saves: at {} 1):\n",
                                   dimension_word(r.solve))
                     : fmt::format("\nchanges that would save memory (each simulated at {} 1):\n", dimension_word(r.solve));
    TT c({{"change", TT::kLeft}, {"reserved, no limit", TT::kRight}, {"saves", TT::kRight}, {"fits", TT::kLeft},
          {by_batch ? "largest batch" : "largest seq", TT::kRight}, {"what it means", TT::kLeft}});
    for (const FitSuggestion& sg : r.suggestions) {
      if (!sg.at_one) {
        c.row({cli_words(sg), "-", "-", "-", "-", sg.what});
        continue;
      }
      c.row({cli_words(sg), format_bytes(sg.at_one->peak_reserved), signed_bytes(sg.saves), sg.at_one->fits ? "yes" : "no",
             sg.largest ? with_commas(*sg.largest) : "-", sg.what});
    }
    out += c.str();
  }
  if (!r.sharding_ladder.empty()) {
    // least sharded first: the first that fits is the smallest sharding that does
    std::string tried;
    for (const FitResult::ShardingTry& t : r.sharding_ladder) {
      tried += fmt::format("{}{} {}", tried.empty() ? "" : ", ", t.sharding,
                           t.fits ? fmt::format("fits (largest {} {})", dimension_word(r.solve), with_commas(*t.largest))
                                  : std::string("does not fit"));
    }
    // (--cp N: FSDP2 shards over the dp x cp ranks)
    const uint64_t ranks = r.setup.dp * std::max<uint64_t>(r.setup.cp, 1);
    out += r.smallest_sharding
               ? fmt::format("smallest sharding that fits the {} ranks: {} (tried, least sharded first: {})\n",
                             ranks, *r.smallest_sharding, tried)
               : fmt::format("no sharding of the {} ranks fits (tried, least sharded first: {})\n", ranks, tried);
  }
  if (!r.not_helpful.empty()) {
    std::string names;
    for (const auto& n : r.not_helpful) names += (names.empty() ? "" : ", ") + cli_words(n);
    out += r.largest ? fmt::format("not listed, as they would not raise the answer: {}\n", names)
                     : fmt::format("not listed, as they would save nothing here: {}\n", names);
  }
  return out;
}

std::string render_fit_json(const FitResult& r) {
  nlohmann::json probes = nlohmann::json::array();
  for (const FitProbe& p : r.probes) probes.push_back(probe_json(p));
  nlohmann::json sugs = nlohmann::json::array();
  for (const FitSuggestion& sg : r.suggestions) {
    nlohmann::json changes = nlohmann::json::array();
    for (const FieldChange& ch : sg.changes) changes.push_back({{"field", ch.field}, {"value", ch.value}});
    nlohmann::json j = {{"change", cli_words(sg)}, {"changes", changes}, {"what", sg.what},
                        {"simulated", sg.at_one.has_value()}};
    if (sg.at_one) {
      j["at_smallest"] = probe_json(*sg.at_one);
      j["saves_bytes"] = sg.saves;
      j["largest"] = sg.largest ? nlohmann::json(*sg.largest) : nlohmann::json();
    }
    sugs.push_back(std::move(j));
  }
  std::vector<std::string> not_helpful;
  for (const auto& n : r.not_helpful) not_helpful.push_back(cli_words(n));
  const TrainSetup& s = r.setup;
  nlohmann::json out = {
      {"model", r.model.name},
      {"setup", {{"batch", s.batch}, {"seq", s.seq}, {"precision", precision_name(s.precision)},
                 {"optimizer", optimizer_name(s.optimizer)}, {"optimizer_impl", optimizer_impl_name(s.optimizer_impl)},
                 {"attention", attn_impl_name(r.model.attn_impl)},
                 {"moe_routing", r.model.moe.experts > 0 ? nlohmann::json(moe_routing_name(r.model.moe.routing))
                                                         : nlohmann::json()},
                 {"loop", loop_name(r.options.loop)},
                 {"torch", torch_version_name(r.options.torch)}, {"grad_accum", s.grad_accum}}},
      {"solve", fit_dimension_name(r.solve)},
      {"gpu", {{"name", r.gpu.name}, {"capacity_bytes", r.gpu.runtime_total.value},
               {"context_bytes", r.gpu.context.value}}},
      {"margin_bytes", r.margin.value},
      {"limit_bytes", r.limit.value},
      {"nccl_bytes", r.nccl.total.value},
      {"largest", r.largest ? nlohmann::json(*r.largest) : nlohmann::json()},
      {"fits", r.largest.has_value()},
      {"capped", r.capped},
      {"cap", r.cap},
      {"probes", probes},
      {"suggestions", sugs},
      {"not_helpful", not_helpful},
      {"warnings", r.warnings},
      {"suggestions_cut", r.suggestions_cut},
      {"smallest_sharding", r.smallest_sharding ? nlohmann::json(*r.smallest_sharding) : nlohmann::json()},
  };
  for (const FitProbe& p : r.probes) {  // the step time at the largest size that fits
    if (r.largest && (r.solve == FitDimension::kBatch ? p.batch : p.seq) == *r.largest && p.time) {
      out["time"] = step_time_json(*p.time);
    }
  }
  return report::json_text(out);
}

}  // namespace trainmem
