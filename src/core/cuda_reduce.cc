// gpu_reduce_kernel's scratch, transliterated (trainmem/cuda_reduce.h): TensorIterator's reorder_dimensions and
// coalesce_dimensions (aten/src/ATen/TensorIterator.cpp), with_32bit_indexing's halving, and Reduce.cuh's
// setReduceConfig, get_output_vec_size, ReduceConfig::set_block_dimension, global_memory_size and semaphore_size.
#include "trainmem/cuda_reduce.h"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>

namespace trainmem {

uint32_t max_threads_per_sm(uint32_t sm) {
  if (sm == 75) return 1024;
  if (sm == 86 || sm == 89 || sm >= 120) return 1536;
  return 2048;
}

namespace {

// Reduce.cuh: mnt_wrapper<scalar_t>::MAX_NUM_THREADS (512; 256 only for complex double, never simulated), the
// warp size, and setReduceConfig's min_values_per_thread / max_values_per_thread.
constexpr int64_t kMaxNumThreads = 512;
constexpr int64_t kWarpSize = 32;
constexpr int64_t kMinValuesPerThread = 16;
constexpr int64_t kMaxValuesPerThread = 256;
// gpu_reduce_kernel<scalar_t, out_t>'s default vt0 = input_vec_size = 4. (Newer sum_functors pass
// input_vec_size 8 for 16-bit inputs, which turns "vectorize along input" off; that changes block.x only for
// reductions too short to reduce across blocks, so the scratch is the same either way.)
constexpr int64_t kInputVecSize = 4;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Reduce.cuh last_pow2: the largest power of two not above n (at least 1).
int64_t last_pow2(int64_t n) {
  int64_t p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// A TensorIterator over (output, input), dims fastest first: byte strides, the output's 0 on reduced dims.
struct Iter {
  int ndim = 0;
  std::array<int64_t, 5> shape{}, out{}, in{};
  int64_t in_offset = 0;  // the input's first element, in elements from its (512-byte aligned) block
};

Iter make_iter(const ReduceShape& r) {
  if (r.ndim == 0 || r.ndim > 5) throw std::invalid_argument("reduce_scratch: a reduction needs 1 to 5 dims");
  const int n = r.ndim;
  Iter it;
  it.ndim = n;
  // make_reduction: the output is allocated with the reduced dims kept as 1 (contiguous) and broadcast over the
  // input (compute_strides: stride 0 where its size 1 meets a larger one).
  int64_t os = r.out_bytes;
  for (int i = n - 1; i >= 0; --i) {
    if (r.sizes[i] == 0) throw std::invalid_argument("reduce_scratch: a reduction of no elements");
    if (r.sizes[i] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max() / 16)) {
      throw std::invalid_argument("reduce_scratch: a dim too large");
    }
    it.shape[i] = static_cast<int64_t>(r.sizes[i]);
    it.in[i] = r.strides[i] * static_cast<int64_t>(r.in_bytes);
    const bool reduced = ((r.reduced >> i) & 1u) && r.sizes[i] != 1;
    it.out[i] = reduced ? 0 : os;
    if (!reduced) os *= it.shape[i];
  }
  // reorder_dimensions: perm starts reversed, then an insertion sort by should_swap (is_reduction: the output's
  // reduced dims first; then each operand's strides ascending, equal strides the smaller size first).
  std::array<int, 5> perm{};
  for (int i = 0; i < n; ++i) perm[i] = n - 1 - i;
  const auto should_swap = [&](int d0, int d1) -> int {
    for (int op = 0; op < 2; ++op) {
      const auto& st = op == 0 ? it.out : it.in;
      const int64_t s0 = st[d0], s1 = st[d1];
      if (op == 0 && ((s0 == 0) != (s1 == 0))) return s1 == 0 ? 1 : -1;
      if (s0 == 0 || s1 == 0) continue;
      if (s0 < s1) return -1;
      if (s0 > s1) return 1;
      if (it.shape[d0] > it.shape[d1]) return 1;
    }
    return 0;
  };
  for (int i = 1; i < n; ++i) {
    int d1 = i;
    for (int d0 = i - 1; d0 >= 0; --d0) {
      const int c = should_swap(perm[d0], perm[d1]);
      if (c > 0) {
        std::swap(perm[d0], perm[d1]);
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  Iter p = it;
  for (int i = 0; i < n; ++i) {
    p.shape[i] = it.shape[perm[i]];
    p.out[i] = it.out[perm[i]];
    p.in[i] = it.in[perm[i]];
  }
  // coalesce_dimensions: neighbours merge when either has size 1 or every operand steps evenly across them.
  int prev = 0;
  for (int d = 1; d < n; ++d) {
    const bool can = p.shape[prev] == 1 || p.shape[d] == 1 ||
                     (p.shape[prev] * p.out[prev] == p.out[d] && p.shape[prev] * p.in[prev] == p.in[d]);
    if (can) {
      if (p.shape[prev] == 1) {
        p.out[prev] = p.out[d];
        p.in[prev] = p.in[d];
      }
      p.shape[prev] *= p.shape[d];
    } else {
      ++prev;
      p.shape[prev] = p.shape[d];
      p.out[prev] = p.out[d];
      p.in[prev] = p.in[d];
    }
  }
  p.ndim = prev + 1;
  return p;
}

int64_t numel(const Iter& it) {
  int64_t e = 1;
  for (int d = 0; d < it.ndim; ++d) e *= it.shape[d];
  return e;
}

// TensorIteratorBase::can_use_32bit_indexing
bool can_use_32bit_indexing(const Iter& it) {
  if (numel(it) > kInt32Max) return false;
  for (const auto* st : {&it.out, &it.in}) {
    int64_t max_offset = 1;
    for (int d = 0; d < it.ndim; ++d) max_offset += (it.shape[d] - 1) * (*st)[d];
    if (max_offset > kInt32Max) return false;
  }
  return true;
}

// get_dim_to_split: the dim of the largest extent (size - 1) * |stride| over the operands, the last on ties.
int dim_to_split(const Iter& it) {
  int64_t max_extent = -1;
  int dim = -1;
  for (int d = it.ndim - 1; d >= 0; --d) {
    for (const auto* st : {&it.out, &it.in}) {
      const int64_t extent = (it.shape[d] - 1) * std::abs((*st)[d]);
      if (extent > max_extent) {
        max_extent = extent;
        dim = d;
      }
    }
  }
  return dim;
}

// setReduceConfig for one 32-bit launch; only what global_memory_size and semaphore_size read.
ReduceLaunch launch_scratch(const Iter& it, const ReduceShape& r, const CudaDevice& dev) {
  int num_reduce_dims = 0;
  int64_t num_outputs = 1;
  for (int d = 0; d < it.ndim; ++d) {
    if (it.out[d] == 0) {
      ++num_reduce_dims;
    } else {
      num_outputs *= it.shape[d];
    }
  }
  const int64_t inputs_per_output = numel(it) / num_outputs;
  const int64_t scalar = r.in_bytes;
  const bool fastest = num_reduce_dims == it.ndim || it.in[0] < it.in[num_reduce_dims];
  int64_t dim0 = fastest ? inputs_per_output : num_outputs;
  const int64_t dim1 = fastest ? num_outputs : inputs_per_output;
  const int64_t fastest_moving_stride = fastest ? it.in[0] : it.in[num_reduce_dims];
  int64_t output_vec_size = 1;
  if (fastest_moving_stride == scalar) {
    if (fastest && dim0 > 128 && num_reduce_dims == 1) {
      dim0 /= kInputVecSize;  // "vectorize along input"
    } else if (!fastest) {
      // get_output_vec_size: 4, halved until it divides the input's base address (in elements), the output
      // dim's size and every other input stride (in elements).
      int64_t v = 4;
      const auto update = [&v](int64_t x) {
        while (x % v != 0) v /= 2;
      };
      update(it.in_offset);
      update(it.shape[num_reduce_dims]);
      for (int d = 0; d < it.ndim; ++d) {
        if (d != num_reduce_dims) update(it.in[d] / scalar);
      }
      output_vec_size = v;
      dim0 /= output_vec_size;
    }
  }
  // set_block_dimension
  const int64_t max_num_threads = kMaxNumThreads / output_vec_size;
  const int64_t dim0_pow2 = dim0 < max_num_threads ? last_pow2(dim0) : max_num_threads;
  const int64_t dim1_pow2 = dim1 < max_num_threads ? last_pow2(dim1) : max_num_threads;
  int64_t block_width = std::min(dim0_pow2, kWarpSize);
  const int64_t block_height = std::min(dim1_pow2, max_num_threads / block_width);
  block_width = std::min(dim0_pow2, max_num_threads / block_height);
  const int64_t num_threads = block_width * block_height;

  int64_t step_input = 1, step_output = 1;
  const bool block_x_reduce = fastest;  // input_mult[0] = split_input(block_width), else split the outputs
  (fastest ? step_input : step_output) *= block_width;
  const int64_t warp_split_threshold = std::min(block_height * 16, kMaxValuesPerThread);
  const bool split_across_warps = div_up(inputs_per_output, step_input) >= warp_split_threshold;
  (split_across_warps ? step_input : step_output) *= block_height;

  const int64_t blocks_per_sm = static_cast<int64_t>(dev.max_threads_per_sm) / num_threads;
  const int64_t target_grid_size = static_cast<int64_t>(dev.multiprocessors) * blocks_per_sm;
  const int64_t grid = div_up(num_outputs / output_vec_size, step_output);
  const int64_t values_per_thread = div_up(inputs_per_output, step_input);
  int64_t ctas_per_output = 1;
  if (split_across_warps && values_per_thread >= kMaxValuesPerThread && grid <= target_grid_size) {
    const int64_t c1 = div_up(target_grid_size, grid);
    const int64_t c2 = div_up(values_per_thread, kMinValuesPerThread);
    const int64_t c3 = div_up(values_per_thread, kMaxValuesPerThread);
    ctas_per_output = std::max(std::min(c1, c2), c3);
  }
  if (ctas_per_output <= 1) return {};  // input_mult[CTA] stays 0: no global reduction
  ReduceLaunch l;
  uint64_t size = static_cast<uint64_t>(r.acc_bytes) * static_cast<uint64_t>(num_outputs) *
                  static_cast<uint64_t>(ctas_per_output);
  if (!block_x_reduce) size *= static_cast<uint64_t>(block_width * output_vec_size);
  l.staging = size;
  l.semaphores = sizeof(int32_t) * static_cast<uint64_t>(grid);
  return l;
}

// gpu_reduce_kernel's recursion over with_32bit_indexing: SplitUntil32Bit halves the iterator along
// dim_to_split, the first floor(n/2) first (TensorIteratorBase::split). A huge reduction runs thousands of
// launches, nearly all alike: only the first of each distinct (staging, semaphores) pair is kept. Each launch
// frees what it took before the next one allocates, so a repeat takes the block its first occurrence left free
// (the cache keeps it, merged back whole) and leaves the allocator as it found it: dropping repeats changes no
// block, segment or peak. Sub-iterators of the same shape and input alignment have the same launches, so they
// are derived once (`seen`).
using LaunchList = std::vector<ReduceLaunch>;
struct SplitKey {
  std::array<int64_t, 5> shape;
  int64_t align;
  bool operator<(const SplitKey& o) const { return shape != o.shape ? shape < o.shape : align < o.align; }
};

void add_distinct(LaunchList& out, const ReduceLaunch& l) {
  for (const ReduceLaunch& o : out) {
    if (o.staging == l.staging && o.semaphores == l.semaphores) return;
  }
  out.push_back(l);
}

const LaunchList& launches(const Iter& it, const ReduceShape& r, const CudaDevice& dev,
                           std::map<SplitKey, LaunchList>& seen) {
  const SplitKey key{it.shape, it.in_offset % 4};  // get_output_vec_size reads the offset modulo 4 at most
  if (auto f = seen.find(key); f != seen.end()) return f->second;
  LaunchList out;
  if (can_use_32bit_indexing(it)) {
    out.push_back(launch_scratch(it, r, dev));
  } else {
    const int d = dim_to_split(it);
    Iter first = it, second = it;
    const int64_t copy_size = it.shape[d] / 2;
    first.shape[d] = copy_size;
    second.shape[d] = it.shape[d] - copy_size;
    second.in_offset += copy_size * (it.in[d] / static_cast<int64_t>(r.in_bytes));
    for (const ReduceLaunch& l : launches(first, r, dev, seen)) add_distinct(out, l);
    for (const ReduceLaunch& l : launches(second, r, dev, seen)) add_distinct(out, l);
  }
  return seen.emplace(key, std::move(out)).first->second;
}

}  // namespace

ReduceScratch reduce_scratch(const ReduceShape& r, const CudaDevice& dev) {
  if (dev.multiprocessors == 0 || dev.max_threads_per_sm == 0) {
    throw std::invalid_argument("reduce_scratch: the device's SM count and threads per SM are needed");
  }
  const Iter it = make_iter(r);
  ReduceScratch s;
  // can_accumulate_in_output is false for half -> half and bfloat16 -> bfloat16; only then, and only when the
  // reduction needs several launches, an AccumulationBuffer of acc-sized elements per output element (when the
  // accumulator is wider than the output).
  const bool can_accumulate_in_output = !(r.in_bytes == 2 && r.out_bytes == 2);
  const bool fits_32bit = can_use_32bit_indexing(it);
  if (!can_accumulate_in_output && !fits_32bit && r.out_bytes < r.acc_bytes) {
    int64_t out_bytes = r.out_bytes;
    for (int d = 0; d < it.ndim; ++d) out_bytes = std::max(out_bytes, it.shape[d] * it.out[d]);
    s.accumulation = static_cast<uint64_t>(out_bytes / r.out_bytes) * r.acc_bytes;
  }
  if (fits_32bit) {
    s.launches = {launch_scratch(it, r, dev)};  // one launch (every RMSNorm mean of a step): no halving to memoize
    return s;
  }
  std::map<SplitKey, LaunchList> seen;
  s.launches = launches(it, r, dev, seen);
  return s;
}

}  // namespace trainmem
