// The replay's index of cached blocks (src/alloc/free_set.h) against the structure it stands for: PyTorch's
// std::set<Block*, BlockComparatorSize> of one stream's pool, ordered by (size, address), whose best fit
// (get_free_block) is lower_bound on the size. Random inserts, erases (by block and at a found place) and best-fit
// lookups, with sizes from 1 byte to 2^64 - 1 and a `skip` block (the expandable segment's mapped tail, which best fit
// passes over when another block follows it), must give the same block every time and the same order throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "alloc/free_set.h"

namespace trainmem {
namespace {

struct TestBlock {
  uint64_t addr = 0;
  uint64_t size = 0;
};

struct BySizeThenAddress {
  bool operator()(const TestBlock* a, const TestBlock* b) const {
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
  }
};

TEST(FreeSet, BestFitAndOrderAreStdSetsUnderRandomOperations) {
  std::mt19937_64 rng(20261127);
  for (int trial = 0; trial < 400; ++trial) {
    alloc::FreeSet<TestBlock> fs;
    std::set<TestBlock*, BySizeThenAddress> ref;
    std::vector<std::unique_ptr<TestBlock>> owned;
    const int mode = trial % 4;
    const auto size = [&]() -> uint64_t {
      switch (mode) {
        case 0: return 1 + rng() % 4096;                                // the small sizes, one size class below 1 KiB
        case 1: return (1 + rng() % 64) * 512;                          // rounded requests
        case 2: return (uint64_t{1} << (rng() % 64)) + (rng() % 3 == 0 ? rng() % 1000 : 0);  // class edges
        default: {
          const uint64_t s = rng() >> (rng() % 64);                      // every octave
          return s ? s : 1;
        }
      }
    };
    for (int op = 0; op < 300; ++op) {
      const int kind = static_cast<int>(rng() % 3);
      if (kind == 0 || ref.empty()) {
        auto b = std::make_unique<TestBlock>(TestBlock{rng() % 50, size()});  // few addresses: equal sizes collide
        if (ref.count(b.get())) continue;                                     // (size, address) is unique in a pool
        fs.insert(b.get());
        ref.insert(b.get());
        owned.push_back(std::move(b));
      } else if (kind == 1) {
        auto it = ref.begin();
        std::advance(it, static_cast<long>(rng() % ref.size()));
        fs.erase(*it);
        ref.erase(it);
      } else {
        const uint64_t want_size = size();
        const TestBlock* skip = nullptr;
        if (rng() % 2) {
          auto it = ref.begin();
          std::advance(it, static_cast<long>(rng() % ref.size()));
          skip = *it;
        }
        // std::set: the first of at least want_size; when that is `skip`, the one after it if any
        const TestBlock key{0, want_size};
        auto it = ref.lower_bound(const_cast<TestBlock*>(&key));
        TestBlock* want = it == ref.end() ? nullptr : *it;
        if (want && want == skip && std::next(it) != ref.end()) want = *std::next(it);
        const auto p = fs.best_fit(want_size, skip);
        ASSERT_EQ(p.b, want) << "trial " << trial << " op " << op << " size " << want_size;
        if (p.b && rng() % 2) {  // malloc takes it from where best fit found it
          fs.erase(p);
          ref.erase(p.b);
        }
      }
      const std::vector<TestBlock*> order = fs.blocks();
      ASSERT_TRUE(std::equal(order.begin(), order.end(), ref.begin(), ref.end())) << "trial " << trial << " op " << op;
    }
  }
}

}  // namespace
}  // namespace trainmem
