// The GPU catalog (data/gpus/gpus.json, compiled in): memory sizes and compute capability per card, each
// with the public reading it comes from.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "trainmem/flops.h"
#include "trainmem/units.h"

namespace trainmem {

struct GpuSpec {
  std::string name;        // catalog key, e.g. "a100-80gb"
  std::string torch_name;  // torch.cuda.get_device_name(), e.g. "NVIDIA A100-SXM4-80GB"
  uint32_t sm = 0;         // compute capability x 10 (80 = sm_80)
  uint32_t multiprocessors = 0;  // SMs (cudaDeviceProp::multiProcessorCount): reduction kernels' scratch
  uint64_t datasheet_gb = 0;
  Bytes runtime_total;     // CUDA runtime total (cudaMemGetInfo total): what the process can use at most
  Bytes smi_total;         // nvidia-smi Total
  Bytes context;           // memory the process holds outside the caching allocator (CUDA context, kernels)
  std::string source;
  std::string context_source;
  // NCCL (nccl.h): NVLink through NVSwitch (NVLS multicast on sm_90 and newer), and the ring channels NCCL
  // builds on an 8-GPU node of these cards as a public NCCL_DEBUG=INFO log shows them (0: no reading).
  bool nvswitch = false;
  uint32_t nccl_ring_channels = 0;
  std::string nccl_source;
  GpuPerf perf;  // datasheet peaks and bandwidths for the step time (perf.known() false where not catalogued)
};

const std::vector<GpuSpec>& gpu_catalog();
// Throws trainmem::Error listing the known names when `name` is not in the catalog.
const GpuSpec& find_gpu(std::string_view name);

}  // namespace trainmem
