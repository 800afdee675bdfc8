// Reports of what the model is: preset listing, GPU catalog, parameter inventory.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "json_text.h"
#include "text_table.h"
#include "trainmem/report.h"
#include "trainmem/scenario.h"

namespace trainmem {

std::vector<ModelListing> model_listings() {
  std::vector<ModelListing> rows;
  for (const Preset& p : presets()) {
    Scenario s;
    s.model.model = std::string(p.name);
    const ResolvedScenario r = resolve_model(s, DiskFileReader());
    rows.push_back({r.model.name, r.model.model_type, parameter_count(r.inventory), r.model.source});
  }
  return rows;
}

std::string render_models_table(const std::vector<ModelListing>& models) {
  report::TextTable t({{"preset", report::TextTable::kLeft},
                       {"model_type", report::TextTable::kLeft},
                       {"parameters", report::TextTable::kRight},
                       {"", report::TextTable::kRight}});
  for (const auto& m : models) {
    t.row({m.name, m.model_type, with_commas(m.parameters.value),
           fmt::format("{:.2f} B", static_cast<double>(m.parameters.value) / 1e9)});
  }
  return t.str("");
}

std::string render_models_json(const std::vector<ModelListing>& models) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& m : models) {
    out.push_back({{"name", m.name}, {"model_type", m.model_type}, {"parameters", m.parameters.value},
                   {"source", m.source}});
  }
  return report::json_text(out);
}

std::string render_gpus_table(const std::vector<GpuSpec>& gpus) {
  report::TextTable t({{"gpu", report::TextTable::kLeft},
                       {"device name", report::TextTable::kLeft},
                       {"sm", report::TextTable::kRight},
                       {"runtime total", report::TextTable::kRight},
                       {"nvidia-smi total", report::TextTable::kRight}});
  for (const auto& g : gpus) {
    t.row({g.name, g.torch_name, std::to_string(g.sm), fmt::format("{} MiB", g.runtime_total.value / kMiB),
           fmt::format("{} MiB", g.smi_total.value / kMiB)});
  }
  return t.str("");
}

std::string render_inventory_table(const ModelSpec& m, const Inventory& inv, DType dtype) {
  std::string out = fmt::format("{}: model_type {}, {} implementation, {} attention; parameters stored as {}\n\n",
                                m.name, m.model_type, impl_name(m.impl), attn_impl_name(m.attn_impl),
                                dtype_name(dtype));
  auto section = [&](const std::vector<TensorRow>& rows, bool buffers) {
    report::TextTable t({{buffers ? "buffer" : "parameter", report::TextTable::kLeft},
                         {"shape", report::TextTable::kLeft},
                         {"dtype", report::TextTable::kLeft},
                         {"elements", report::TextTable::kRight},
                         {"bytes", report::TextTable::kRight}});
    Elems n;
    Bytes b;
    for (const auto& r : rows) {
      const DType d = stored_dtype(r, dtype);
      const Bytes rb = stored_bytes(r, dtype);  // packed for a 4-bit weight
      n += r.elems;
      b += rb;
      t.row({r.name + (buffers && !r.persistent ? " (non-persistent)" : ""), shape_string(r.shape),
             std::string(dtype_name(d)) + (r.packed_4bit ? " (4-bit, packed)" : ""), with_commas(r.elems.value), with_commas(rb.value)});
    }
    t.rule();
    t.row({fmt::format("{} {}", rows.size(), buffers ? "buffers" : "parameter tensors"), "", "",
           with_commas(n.value), with_commas(b.value)});
    return t.str("");
  };
  out += section(inv.parameters, false);
  out += "\n";
  out += inv.buffers.empty() ? "  (no buffers)\n" : section(inv.buffers, true);
  const Bytes pb = parameter_bytes(inv, dtype);
  out += fmt::format("\ntotal parameters: {} ({}), buffers: {} elements ({})\n",
                     with_commas(parameter_count(inv).value), format_bytes(pb), with_commas(buffer_elems(inv).value),
                     format_bytes(buffer_bytes(inv, dtype)));
  // only when something is frozen, so that the listing of a plain model stays as it was
  if (trainable_count(inv) != parameter_count(inv)) {
    out += fmt::format("trainable: {} ({:.4f}% of all parameters; the rest frozen)\n", with_commas(trainable_count(inv).value),
                       100.0 * static_cast<double>(trainable_count(inv).value) /
                           static_cast<double>(std::max<uint64_t>(parameter_count(inv).value, 1)));
  }
  return out;
}

DType listing_dtype(std::string_view text) {
  const auto d = parse_dtype(text);
  if (!d || !is_floating(*d)) throw FieldError("dtype", fmt::format("\"{}\": expected float32, float16 or bfloat16", text));
  return *d;
}

std::string render_inventory_json(const ModelSpec& m, const Inventory& inv, DType dtype) {
  auto rows = [&](const std::vector<TensorRow>& rs, bool buffers) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& r : rs) {
      const DType d = stored_dtype(r, dtype);
      nlohmann::json row = {{"name", r.name}, {"shape", r.shape}, {"dtype", dtype_name(d)},
                            {"elements", r.elems.value}, {"bytes", stored_bytes(r, dtype).value}};
      if (r.packed_4bit) row["packed_4bit"] = true;
      if (buffers) row["persistent"] = r.persistent;
      a.push_back(row);
    }
    return a;
  };
  nlohmann::json out = {
      {"model", {{"name", m.name}, {"model_type", m.model_type}, {"impl", impl_name(m.impl)},
                 {"attention", attn_impl_name(m.attn_impl)}, {"source", m.source}}},
      {"dtype", dtype_name(dtype)},
      {"parameters", rows(inv.parameters, false)},
      {"buffers", rows(inv.buffers, true)},
      {"totals", {{"parameter_count", parameter_count(inv).value}, {"trainable_count", trainable_count(inv).value},
                  {"parameter_bytes", parameter_bytes(inv, dtype).value},
                  {"buffer_elements", buffer_elems(inv).value},
                  {"buffer_bytes", buffer_bytes(inv, dtype).value}}},
  };
  return report::json_text(out);
}

std::string render_gpus_json(const std::vector<GpuSpec>& gpus) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& g : gpus) {
    out.push_back({{"name", g.name}, {"torch_name", g.torch_name}, {"sm", g.sm}, {"datasheet_gb", g.datasheet_gb},
                   {"runtime_total_bytes", g.runtime_total.value}, {"smi_total_bytes", g.smi_total.value},
                   {"context_bytes", g.context.value}, {"source", g.source}, {"context_source", g.context_source}});
    if (g.nccl_ring_channels > 0) {
      out.back()["nvswitch"] = g.nvswitch;
      out.back()["nccl_ring_channels"] = g.nccl_ring_channels;
      out.back()["nccl_source"] = g.nccl_source;
    }
    // the step time's facts (flops.h GpuPerf): datasheet peaks and bandwidths with their sources, where catalogued
    if (const GpuPerf& p = g.perf; p.known()) {
      nlohmann::json perf = {{"fp32_tflops", p.fp32_tflops}, {"tf32_tflops", p.tf32_tflops},
                             {"bf16_tflops", p.bf16_tflops}, {"fp16_tflops", p.fp16_tflops},
                             {"hbm_gbps", p.hbm_gbps},       {"link_gbps", p.link_gbps},
                             {"matmul_efficiency", p.matmul_efficiency}, {"source", p.source},
                             {"efficiency_source", p.efficiency_source}};
      if (p.net_gbps > 0) {
        perf["net_gbps"] = p.net_gbps;
        perf["net_node"] = p.net_node;
        perf["net_source"] = p.net_source;
      }
      out.back()["perf"] = std::move(perf);
    }
  }
  return report::json_text(out);
}

}  // namespace trainmem
