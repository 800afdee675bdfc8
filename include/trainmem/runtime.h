// Facts of the PyTorch runtime that decide bytes, by PyTorch version and GPU architecture. Every constant
// names the source file of PyTorch it comes from.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "trainmem/cuda_reduce.h"
#include "trainmem/units.h"

namespace trainmem {

struct TorchVersion {
  int major = 2, minor = 9;
  friend auto operator<=>(TorchVersion, TorchVersion) = default;
};
std::optional<TorchVersion> parse_torch_version(std::string_view s);  // "2.9", "2.9.1", "1.13"
std::string torch_version_name(TorchVersion v);

// How cuBLASLt gets its workspace.
enum class LtWorkspace {
  kNone,        // not counted (the library allocates it itself)
  kPerCall,     // allocated through the caching allocator around each cuBLASLt gemm and freed after it
  kPersistent,  // one per (handle, stream), kept
};

struct RuntimeFacts {
  TorchVersion torch;
  uint32_t sm = 80;
  // cuBLAS workspace per (handle, stream), allocated through the caching allocator on the first gemm of each
  // thread. 0 when cuBLAS allocates it itself (not visible in memory_allocated).
  Bytes cublas_workspace;
  LtWorkspace lt_mode = LtWorkspace::kNone;
  Bytes cublaslt_workspace;
  // Whether autocast keeps its cached 16-bit copy of an fp32 weight under torch.inference_mode() (autocast_mode.cpp
  // cached_cast's can_try_cache). PR #165068 (fixing issue #158232, merged 2025-12-10) added
  // `!c10::InferenceMode::is_enabled()`: every use casts anew and the copy dies after the op. Measured on an H100
  // with torch 2.11.0+cu130 (validate/measured/h100-80gb-hbm3_hf_infer_qwen2_0.5b_*): no cached copies. Whether the
  // 2.10 release branch took the PR is not settled here (its merge fell at the branch cut): 2.10 keeps caching.
  // Under torch.no_grad() (generate()) the cache is kept in every version.
  bool autocast_caches_in_inference_mode = true;
  // Whether torch.distributed.pipelining's stage_backward hands a stage input's gradient over instead of leaving it
  // on the receive buffer. PR #164329 ("[PP]: Optimize memory by early releasing stage inputs' gradients", opened
  // 2025-10-01, after the 2.9 branch cut) added to _backward.py stage_backward `grad_inputs.append(val.grad)` the
  // line `val.grad = None` (2.11.0: torch/distributed/pipelining/_backward.py:379-386): the gradient then lives only
  // in bwd_cache, which get_bwd_send_ops pops into the P2POp list the schedule holds (stage.py:488, 503). In 2.9 it
  // stays the buffer's .grad until the next step's clear_runtime_states (stage.py clear_runtime_states).
  bool pp_stage_backward_releases_input_grads = false;
  // Whether a generated backward node declares (and so releases, in release_variables()) its saved tensors in the
  // sorted order of their names: BmmBackward0 drops mat2_ before self_. Seed 000's trace (torch 2.0) frees self
  // first; the H100 traces (torch 2.11) free mat2 first, and so does the generated Functions.h of the releases with
  // compiled autograd's compiled_args (after 2.0). The release that switched is not pinned: 2.1 to 2.10 are taken
  // as 2.11.
  bool saved_variables_sorted = false;
  // The device properties the reduction kernels read (cuda_reduce.h): the SM count comes with the card
  // (SimOptions::multiprocessors), the resident threads per SM with its compute capability.
  CudaDevice device{kGenericGpuMultiprocessors, 2048};
};

// aten/src/ATen/cuda/CublasHandlePool.cpp (2.x): "/* :4096:2:16:8 default, 32MiB for Hopper */"
//   default_size = sm90 ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8
// Seed 000 and seed 003 measured 8,519,680 B per workspace on an A100 and on Colab GPUs.
inline constexpr uint64_t kCublasWorkspaceBytes = 4096ull * 1024 * 2 + 16ull * 1024 * 8;  // 8,519,680
inline constexpr uint64_t kCublasWorkspaceSm90Bytes = 4096ull * 8 * 1024;                 // 33,554,432
// aten/src/ATen/cuda/CublasHandlePool.cpp: CUBLASLT_WORKSPACE_SIZE in KiB, "default size in KiB according
// to #73328": 1024.
inline constexpr uint64_t kCublasLtWorkspaceBytes = 1024ull * 1024;

// The runtime facts of a PyTorch version on a GPU of compute capability `sm` (80 = sm_80).
RuntimeFacts runtime_facts(TorchVersion v, uint32_t sm);

}  // namespace trainmem
