// Reads the compiled-in GPU catalog once.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "key_reader.h"
#include "trainmem/error.h"
#include "trainmem/gpu.h"

namespace trainmem {

namespace detail {
std::string_view gpu_catalog_json();  // generated from data/gpus/gpus.json
}

namespace {

std::vector<GpuSpec> parse_catalog() {
  const nlohmann::json doc = nlohmann::json::parse(detail::gpu_catalog_json());
  std::vector<GpuSpec> out;
  for (const nlohmann::json& g : doc.at("gpus")) {
    config::KeyReader r(g, "data/gpus/gpus.json");
    GpuSpec s;
    s.name = r.text({"name"}, std::nullopt);
    s.torch_name = r.text({"torch_name"}, std::nullopt);
    s.sm = static_cast<uint32_t>(r.integer({"sm"}, std::nullopt, 10, 200));
    s.multiprocessors = static_cast<uint32_t>(r.integer({"multiprocessors"}, std::nullopt, 1, 1024));
    r.text({"multiprocessors_source"}, std::nullopt);  // required: every figure names its reading
    s.datasheet_gb = r.integer({"datasheet_gb"}, std::nullopt, 1, 100000);
    s.runtime_total = Bytes(checked_mul(r.integer({"runtime_total_mib"}, std::nullopt, 1, 1u << 30), kMiB, "GPU"));
    s.smi_total = Bytes(checked_mul(r.integer({"smi_total_mib"}, std::nullopt, 1, 1u << 30), kMiB, "GPU"));
    s.context = Bytes(checked_mul(r.integer({"context_mib"}, std::nullopt, 0, 1u << 20), kMiB, "GPU"));
    s.source = r.text({"source"}, std::nullopt);
    s.context_source = r.text({"context_source"}, std::nullopt);
    if (g.contains("nccl_ring_channels")) {
      s.nvswitch = r.boolean({"nvswitch"}, std::nullopt);
      s.nccl_ring_channels = static_cast<uint32_t>(r.integer({"nccl_ring_channels"}, std::nullopt, 1, 64));
      s.nccl_source = r.text({"nccl_source"}, std::nullopt);
    }
    if (g.contains("peak_fp32_tflops")) {  // the roofline's facts (trainmem/flops.h)
      auto number = [&](const char* key) {
        const nlohmann::json& v = g.at(key);
        if (!v.is_number() || v.get<double>() < 0) {
          throw Error(fmt::format("data/gpus/gpus.json: {}: \"{}\" must be a number >= 0", s.name, key));
        }
        return v.get<double>();
      };
      s.perf.fp32_tflops = number("peak_fp32_tflops");
      s.perf.tf32_tflops = number("peak_tf32_tflops");
      s.perf.bf16_tflops = number("peak_bf16_tflops");
      s.perf.fp16_tflops = number("peak_fp16_tflops");
      s.perf.hbm_gbps = number("hbm_gbps");
      s.perf.link_gbps = number("link_gbps");
      if (g.contains("net_gbps")) {  // the reference node's network (trainmem/flops.h GpuPerf::net_gbps)
        s.perf.net_gbps = number("net_gbps");
        s.perf.net_node = r.text({"net_node"}, std::nullopt);
        s.perf.net_source = r.text({"net_source"}, std::nullopt);
      }
      s.perf.matmul_efficiency = number("matmul_efficiency");
      if (s.perf.matmul_efficiency <= 0 || s.perf.matmul_efficiency > 1) {
        throw Error(fmt::format("data/gpus/gpus.json: {}: \"matmul_efficiency\" must be in (0, 1]", s.name));
      }
      s.perf.source = r.text({"perf_source"}, std::nullopt);
      s.perf.efficiency_source = r.text({"efficiency_source"}, std::nullopt);
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

const std::vector<GpuSpec>& gpu_catalog() {
  static const std::vector<GpuSpec> catalog = parse_catalog();
  return catalog;
}

const GpuSpec& find_gpu(std::string_view name) {
  for (const GpuSpec& g : gpu_catalog()) {
    if (g.name == name) return g;
  }
  std::string names;
  for (const GpuSpec& g : gpu_catalog()) names += (names.empty() ? "" : ", ") + g.name;
  throw FieldError("gpu", fmt::format("\"{}\": unknown GPU; expected one of {}", name, names));
}

}  // namespace trainmem
