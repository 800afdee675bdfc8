// The caching allocator replay's index of a pool's cached blocks (caching_allocator.cc): PyTorch's
// BlockComparatorSize order within one stream's pool, (size, address), and get_free_block's best fit over it, kept
// in size classes for speed. A template over the block type (any type with uint64_t `size` and `addr`) so that the
// tests can compare it with a std::set of the same order.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace trainmem::alloc {

// A pool's cached blocks in (size, address) order (simulation bookkeeping, not the modelled allocator's; the
// order and every lookup are std::set's), in bins by size. bin(size) never decreases as the size grows (the power
// of two below it and the next four bits: 16 bins an octave), so a block in a later bin is larger than any in an
// earlier one and the order is the bins' in turn: best fit is the smallest block of at least the size in its own
// bin, or else the first block of the next bin that holds any (a bitmap of the non-empty bins, a bit scan). Each
// bin is sorted by DEcreasing (size, address), so that best fit mostly takes its last entry. A bin holds a few
// blocks (or many of one size, searched by halving), so an insert or erase moves a few entries: one sorted vector
// of a pool's tens of blocks moved tens, and sorted distinct sizes churned as split remainders' sizes came and went.
template <typename Block>
class FreeSet {
 public:
  // Where a block is: its bin and its index there.
  struct Place {
    size_t bin = 0, idx = 0;
    Block* b = nullptr;
  };
  // The first block of at least `size` bytes in the order (the lowest address among the smallest such size); b is
  // nullptr when there is none. When that block is `skip` and another follows it in the order, the one that follows.
  Place best_fit(uint64_t size, const Block* skip) const {
    if (bins_.empty()) return {};
    const size_t i = bin(size);
    const std::vector<Entry>& l = bins_[i];
    // the bin's blocks of at least `size` come first (the bin is in decreasing order); the last of them is the one
    const auto k = static_cast<size_t>(
        std::partition_point(l.begin(), l.end(), [size](const Entry& e) { return e.size >= size; }) - l.begin());
    Place p = k > 0 ? Place{i, k - 1, l[k - 1].b} : first_from(i + 1);
    if (!p.b || p.b != skip) return p;
    if (p.idx > 0) return {p.bin, p.idx - 1, bins_[p.bin][p.idx - 1].b};
    const Place next = first_from(p.bin + 1);
    return next.b ? next : p;
  }
  // Removes the block found at `p` (by best_fit, with no insert or erase since).
  void erase(const Place& p) {
    std::vector<Entry>& l = bins_[p.bin];
    l.erase(l.begin() + static_cast<std::ptrdiff_t>(p.idx));
    if (l.empty()) used_[p.bin / 64] &= ~(uint64_t{1} << (p.bin % 64));
  }
  void insert(Block* b) {
    if (bins_.empty()) bins_.resize(kBins);
    const size_t i = bin(b->size);
    std::vector<Entry>& l = bins_[i];
    const auto it = find(l, b->size, b->addr);
    if (it != l.end() && it->size == b->size && it->addr == b->addr) return;
    l.insert(it, Entry{b->size, b->addr, b});
    used_[i / 64] |= uint64_t{1} << (i % 64);
  }
  void erase(const Block* b) {
    if (bins_.empty()) return;
    const size_t i = bin(b->size);
    std::vector<Entry>& l = bins_[i];
    const auto it = find(l, b->size, b->addr);
    if (it == l.end() || it->size != b->size || it->addr != b->addr) return;
    erase(Place{i, static_cast<size_t>(it - l.begin()), it->b});
  }
  // The blocks in the order (size, then address).
  std::vector<Block*> blocks() const {
    std::vector<Block*> out;
    for (const std::vector<Entry>& l : bins_) {
      for (auto it = l.rbegin(); it != l.rend(); ++it) out.push_back(it->b);
    }
    return out;
  }

 private:
  struct Entry {
    uint64_t size;  // b->size
    uint64_t addr;  // b->addr
    Block* b;
  };
  // bin(size): 16 bins an octave from 512 bytes (every size below 1 KiB shares the first octave's bins: only the
  // order of the bins matters, not their widths) up to 2^64
  static constexpr size_t kOctaves = 64 - 9;
  static constexpr size_t kBins = kOctaves * 16;
  static size_t bin(uint64_t size) {
    if (size < 1024) return size < 512 ? 0 : static_cast<size_t>((size >> 5) & 15);
    const int octave = 63 - std::countl_zero(size);
    return static_cast<size_t>(octave - 9) * 16 + static_cast<size_t>((size >> (octave - 4)) & 15);
  }
  // the first entry of `l` not ordered after (size, addr) (a bin is in decreasing order)
  static typename std::vector<Entry>::iterator find(std::vector<Entry>& l, uint64_t size, uint64_t addr) {
    return std::partition_point(l.begin(), l.end(), [size, addr](const Entry& e) {
      return e.size > size || (e.size == size && e.addr > addr);
    });
  }
  // the first block in the order of the first bin from `i` on that holds any (its last entry)
  Place first_from(size_t i) const {
    for (size_t w = i / 64; w < used_.size(); ++w) {
      uint64_t bits = used_[w];
      if (w == i / 64) bits &= i % 64 == 0 ? ~uint64_t{0} : ~((uint64_t{1} << (i % 64)) - 1);
      if (bits != 0) {
        const size_t j = w * 64 + static_cast<size_t>(std::countr_zero(bits));
        return {j, bins_[j].size() - 1, bins_[j].back().b};
      }
    }
    return {};
  }
  std::vector<std::vector<Entry>> bins_;             // kBins once a block was inserted
  std::array<uint64_t, (kBins + 63) / 64> used_{};  // bit i: bins_[i] is not empty
};

}  // namespace trainmem::alloc
