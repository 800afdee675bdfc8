#include "trainmem/buffer_cache.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <new>

namespace trainmem::detail {

namespace {

// Buffers below this size come from operator new as usual: the C library maps larger ones afresh (glibc's
// M_MMAP_THRESHOLD starts at 128 KiB) and reuses smaller ones without new pages.
constexpr size_t kMinCached = size_t{128} << 10;  // 128 KiB
// What one thread keeps: a pipeline estimate's ranks (a timeline, its replay's two figure arrays, the storage
// table each), within a bound on the memory held.
constexpr size_t kSlots = 16;
constexpr size_t kMaxHeld = size_t{256} << 20;  // 256 MiB
// Every buffer starts with a header that records its capacity (a reused buffer may be larger than asked).
constexpr size_t kHeader = alignof(std::max_align_t) > 16 ? alignof(std::max_align_t) : 16;

struct Cache {
  std::array<void*, kSlots> base{};
  std::array<size_t, kSlots> bytes{};
  size_t n = 0, held = 0;
  ~Cache() {
    for (size_t i = 0; i < n; ++i) ::operator delete(base[i]);
    n = 0;
    dead() = true;
  }
  // Set once the thread's cache is destroyed: a buffer given back afterwards (a thread-local or static vector
  // destroyed later) is freed.
  static bool& dead() {
    thread_local bool d = false;
    return d;
  }
};

Cache& cache() {
  thread_local Cache c;
  return c;
}

size_t& capacity_of(void* base) { return *static_cast<size_t*>(base); }

}  // namespace

void* reuse_allocate(size_t bytes) {
  if (bytes < kMinCached) return ::operator new(bytes);
  if (!Cache::dead()) {
    Cache& c = cache();
    // the smallest kept buffer that holds `bytes`, and no more than twice that (a small request leaves a large
    // buffer for a large one)
    size_t best = c.n;
    for (size_t i = 0; i < c.n; ++i) {
      if (c.bytes[i] >= bytes && c.bytes[i] / 2 <= bytes && (best == c.n || c.bytes[i] < c.bytes[best])) best = i;
    }
    if (best < c.n) {
      void* base = c.base[best];
      c.held -= c.bytes[best];
      c.base[best] = c.base[c.n - 1];
      c.bytes[best] = c.bytes[c.n - 1];
      --c.n;
      return static_cast<char*>(base) + kHeader;
    }
  }
  void* base = ::operator new(bytes + kHeader);
  capacity_of(base) = bytes;
  return static_cast<char*>(base) + kHeader;
}

void reuse_deallocate(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes < kMinCached) {
    ::operator delete(p);
    return;
  }
  void* base = static_cast<char*>(p) - kHeader;
  const size_t cap = capacity_of(base);
  if (!Cache::dead()) {
    Cache& c = cache();
    if (c.n < kSlots && c.held + cap <= kMaxHeld) {
      c.base[c.n] = base;
      c.bytes[c.n] = cap;
      ++c.n;
      c.held += cap;
      return;
    }
  }
  ::operator delete(base);
}

}  // namespace trainmem::detail
