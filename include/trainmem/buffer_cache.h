// Large buffers reused within a thread: a simulation's timeline, its storage table and the allocator replay's
// per-event figures are megabytes each, written once; faulting in fresh pages for each of them cost a pipeline
// estimate about a tenth of its time. Their vectors take their memory through ReuseAllocator, which keeps a few
// freed large buffers per thread and hands them to the next request that fits (simulation bookkeeping: no
// simulated figure depends on where a buffer lives; every buffer is written before it is read, as a vector's
// elements are). Retention: each thread keeps at most 16 freed buffers and 256 MiB (buffer_cache.cc) until it exits;
// a long-lived caller (the C API, the WebAssembly page) holds at most that much between estimates.
#pragma once

#include <cstddef>
#include <vector>

namespace trainmem {

namespace detail {
// A buffer of at least `bytes` bytes (aligned for any type): from this thread's cache when one fits, otherwise
// new. Small requests go straight to operator new.
void* reuse_allocate(size_t bytes);
// Gives back a buffer from reuse_allocate: kept for reuse while the thread's cache has room, otherwise freed.
void reuse_deallocate(void* p, size_t bytes) noexcept;
}  // namespace detail

template <typename X>
struct ReuseAllocator {
  using value_type = X;
  ReuseAllocator() = default;
  template <typename Y>
  ReuseAllocator(const ReuseAllocator<Y>&) noexcept {}  // NOLINT: rebinding, as std::allocator
  X* allocate(size_t n) { return static_cast<X*>(detail::reuse_allocate(n * sizeof(X))); }
  void deallocate(X* p, size_t n) noexcept { detail::reuse_deallocate(p, n * sizeof(X)); }
  template <typename Y>
  bool operator==(const ReuseAllocator<Y>&) const noexcept {
    return true;
  }
};

// A vector whose buffer comes from ReuseAllocator.
template <typename X>
using ReuseVector = std::vector<X, ReuseAllocator<X>>;

}  // namespace trainmem
