#include "trainmem/runtime.h"

#include <fmt/format.h>

#include <charconv>

namespace trainmem {

std::optional<TorchVersion> parse_torch_version(std::string_view s) {
  TorchVersion v;
  const char* p = s.data();
  const char* end = s.data() + s.size();
  auto r = std::from_chars(p, end, v.major);
  if (r.ec != std::errc() || r.ptr == end || *r.ptr != '.') return std::nullopt;
  r = std::from_chars(r.ptr + 1, end, v.minor);
  if (r.ec != std::errc()) return std::nullopt;
  if (r.ptr != end) {  // an optional patch level: ".1"
    int patch = 0;
    if (*r.ptr != '.') return std::nullopt;
    r = std::from_chars(r.ptr + 1, end, patch);
    if (r.ec != std::errc() || r.ptr != end) return std::nullopt;
  }
  if (v < TorchVersion{1, 13} || v > TorchVersion{2, 11}) return std::nullopt;
  return v;
}

std::string torch_version_name(TorchVersion v) { return fmt::format("{}.{}", v.major, v.minor); }

RuntimeFacts runtime_facts(TorchVersion v, uint32_t sm) {
  RuntimeFacts f;
  f.torch = v;
  f.sm = sm;
  f.device.max_threads_per_sm = max_threads_per_sm(sm);
  if (v < TorchVersion{2, 0}) {
    // 1.13's ATen/cuda/CUDAContext.h has no workspace API: cuBLAS allocates its own workspace outside the
    // caching allocator, so it does not appear in memory_allocated.
    f.cublas_workspace = Bytes(0);
    f.lt_mode = LtWorkspace::kNone;
    return f;
  }
  // 2.0 (PR #89027 / #91564, Jan 2023): the :4096:2:16:8 default, 32 MiB on Hopper (major 9, minor 0).
  f.cublas_workspace = Bytes(sm == 90 ? kCublasWorkspaceSm90Bytes : kCublasWorkspaceBytes);
  f.cublaslt_workspace = Bytes(kCublasLtWorkspaceBytes);
  f.autocast_caches_in_inference_mode = v < TorchVersion{2, 11};  // PR #165068 (runtime.h)
  f.pp_stage_backward_releases_input_grads = v >= TorchVersion{2, 10};  // PR #164329 (runtime.h)
  f.saved_variables_sorted = v > TorchVersion{2, 0};  // (runtime.h)
  if (v <= TorchVersion{2, 7}) {
    f.lt_mode = LtWorkspace::kPerCall;  // CUDABlas.cpp: allocator.allocate(workspaceSize) inside each Lt gemm
  } else {
    // PR #156495: "LT now allocates one workspace per handle+stream". CublasHandlePool.cpp makes the Lt
    // workspace share the cuBLAS one only when TORCH_CUBLASLT_UNIFIED_WORKSPACE is set (an opt-in, per its
    // "Note [hipblaslt handles]"). Measured on an H100 with torch 2.11.0+cu130
    // (validate/measured/h100-80gb-hbm3_hf_gpt2_*.json, hf_pythia_*): the first addmm with a bias allocates
    // 1,048,576 B right after the 32 MiB cuBLAS workspace, and the block stays live to the end of the run.
    f.lt_mode = LtWorkspace::kPersistent;
  }
  return f;
}

}  // namespace trainmem
