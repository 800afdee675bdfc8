// What a CUDA reduction kernel takes from the caching allocator besides its output: gpu_reduce_kernel
// (aten/src/ATen/native/cuda/Reduce.cuh, PyTorch 2.x; read at cyyever/pytorch@0660972, a mirror of main). Its
// launch configuration (setReduceConfig) splits a long reduction across thread blocks when each thread would
// otherwise sum at least 256 values and the outputs leave SMs idle; the blocks then meet in a global staging buffer
// (ReduceConfig::global_memory_size) and count themselves in semaphores (semaphore_size), both allocated before the
// launch and freed after it. A gradient reduced by autograd's sum_to (a bias, an RMSNorm weight: the (B·T, C)
// gradient summed over its B·T rows) takes one: 128 MiB at B·T = C = 4096 on an H100.
//
// The rule depends on the device (its SM count and resident threads per SM), so it is transliterated, not
// tabulated. Checked against validate/measured/probes/h100-80gb-hbm3_reduce_probe.jsonl (105 sums on an H100 with
// torch 2.11, every staging buffer and semaphore to the byte; tests/unit/cuda_reduce_test.cc).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace trainmem {

// The device properties setReduceConfig reads (cudaDeviceProp).
struct CudaDevice {
  uint32_t multiprocessors = 0;     // multiProcessorCount
  uint32_t max_threads_per_sm = 0;  // maxThreadsPerMultiProcessor
};

// The SM count of the card a device given only by its size stands for (scenario.h kGenericGpuSm, sm_80): the
// A100's 108 (NVIDIA A100 Tensor Core GPU Architecture whitepaper; the GPU catalog's a100 entries).
inline constexpr uint32_t kGenericGpuMultiprocessors = 108;

// maxThreadsPerMultiProcessor by compute capability x 10 (80 = sm_80): "Maximum number of resident threads per
// SM" in the CUDA C++ Programming Guide's "Technical Specifications per Compute Capability" table: 2048 on 7.0,
// 8.0, 8.7, 9.0 and 10.x; 1024 on 7.5; 1536 on 8.6, 8.9 and 12.x.
uint32_t max_threads_per_sm(uint32_t sm);

// One reduction: the input's sizes and element strides (up to 5 dims), which dims are reduced (bit i: dim i), and
// the element sizes of the input, the accumulator (arg_t: float for float, half and bfloat16 sums; double for
// double) and the output.
struct ReduceShape {
  std::array<uint64_t, 5> sizes{};
  std::array<int64_t, 5> strides{};
  uint8_t ndim = 0;
  uint32_t reduced = 0;
  uint32_t in_bytes = 4, acc_bytes = 4, out_bytes = 4;
};

// One kernel launch's scratch: the staging buffer and the semaphores (both 0 when the launch does not reduce
// across blocks).
struct ReduceLaunch {
  uint64_t staging = 0;
  uint64_t semaphores = 0;
};

struct ReduceScratch {
  // AccumulationBuffer: a reduction too large for 32-bit indexing runs as several launches (with_32bit_indexing);
  // an output that cannot accumulate in itself (16-bit in and out) gets a buffer of accumulator-sized elements,
  // allocated before the first launch and freed after the last. 0: none.
  uint64_t accumulation = 0;
  // In launch order, each distinct (staging, semaphores) pair once: a repeat leaves the allocator as it found it
  // (src/core/cuda_reduce.cc).
  std::vector<ReduceLaunch> launches;
};

// Throws std::invalid_argument on a shape with no elements or more than 5 dims.
ReduceScratch reduce_scratch(const ReduceShape& r, const CudaDevice& d);

}  // namespace trainmem
