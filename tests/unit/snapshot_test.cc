// PyTorch memory snapshots: the pickle reader and writer (pickle.h), the allocator's trace, the alignment of
// two allocation sequences and the diff (snapshot.h). Pickles written by CPython 3.11's pickle module are
// spelled out byte by byte where a test needs one (their opcodes: Lib/pickletools.py).
#include "trainmem/snapshot.h"

#include <gtest/gtest.h>

#include <string>

#include "test_util.h"
#include "trainmem/pickle.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::error_of;
using namespace std::string_literals;

TEST(Pickle, WhatItWritesReadsBackTheSame) {
  const PyValue v = PyDict{{"segments", PyList{}},
                           {"n", PyList{0, 255, 256, 65535, 65536, -1, -129, int64_t{1} << 40, -(int64_t{1} << 40),
                                        std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}},
                           {"s", PyList{"", "alloc", std::string(300, 'x'), "alloc"}},
                           {"t", PyTuple{{0, 0}}},
                           {"b", PyList{true, false, PyValue()}},
                           {"f", 0.5}};
  const PyValue r = pickle_loads(pickle_dumps(v), "test");
  const PyList& n = *r.get("n")->list();
  ASSERT_EQ(n.size(), 11u);
  EXPECT_EQ(*n[0].integer(), 0);
  EXPECT_EQ(*n[3].integer(), 65535);
  EXPECT_EQ(*n[5].integer(), -1);
  EXPECT_EQ(*n[6].integer(), -129);
  EXPECT_EQ(*n[7].integer(), int64_t{1} << 40);
  EXPECT_EQ(*n[8].integer(), -(int64_t{1} << 40));
  EXPECT_EQ(*n[9].integer(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(*n[10].integer(), std::numeric_limits<int64_t>::min());
  const PyList& s = *r.get("s")->list();
  EXPECT_EQ(*s[2].str(), std::string(300, 'x'));
  EXPECT_EQ(*s[3].str(), "alloc");  // a memoized repeat
  EXPECT_EQ(r.get("t")->list()->size(), 2u);
  EXPECT_TRUE(std::get<bool>(r.get("b")->list()->at(0).v));
  EXPECT_TRUE(r.get("b")->list()->at(2).is_none());
  EXPECT_EQ(std::get<double>(r.get("f")->v), 0.5);
}

TEST(Pickle, ReadsProtocol4AsPythonWritesIt) {
  // pickle.dumps({'a': [1, 'x'], 'b': None}, protocol=4)
  const std::string p = "\x80\x04\x95\x15\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01" "a\x94]\x94(K\x01\x8c\x01x\x94"
                        "e\x8c\x01" "b\x94Nu."s;
  const PyValue v = pickle_loads(p, "p4");
  EXPECT_EQ(*v.get("a")->list()->at(0).integer(), 1);
  EXPECT_EQ(*v.get("a")->list()->at(1).str(), "x");
  EXPECT_TRUE(v.get("b")->is_none());
}

TEST(Pickle, SharedContainersFromTheMemoAreRead) {
  // x = []; pickle.dumps([x, x], protocol=2): the second is a BINGET of the first
  const std::string p = "\x80\x02]q\x00(]q\x01h\x01" "e."s;
  const PyValue v = pickle_loads(p, "shared");
  EXPECT_EQ(v.list()->size(), 2u);
}

TEST(Pickle, RefusesAClassWithItsOpcode) {
  // pickle.dumps(collections.OrderedDict(), protocol=2) starts with GLOBAL 'collections OrderedDict'
  const std::string p = "\x80\x02" "ccollections\nOrderedDict\nq\x00)Rq\x01."s;
  EXPECT_EQ(error_of([&] { pickle_loads(p, "od.pickle"); }),
            "od.pickle: not a snapshot pickle trainmem reads: opcode 0x63 (GLOBAL): only dicts, lists, tuples, str, "
            "int, float, bool and None are read (at byte 2)");
}

TEST(Pickle, RefusesATruncatedPickle) {
  const std::string full = pickle_dumps(PyDict{{"segments", PyList{"abc"}}});
  for (size_t n = 0; n < full.size(); ++n) {
    EXPECT_FALSE(error_of([&] { pickle_loads(full.substr(0, n), "cut"); }).empty()) << n;
  }
}

TEST(Pickle, RefusesHostileLengthsAndIndices) {
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02X\xff\xff\xff\xff."s, "h"); }).find("a string of 4294967295 bytes"),
            std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xff."s, "h"); }).find("a FRAME of"),
            std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02h\x07."s, "h"); }).find("memo GET of 7, never stored"), std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02\x8b\x00\x00\x00\x01."s, "h"); }).find("an integer of 16777216 bytes"),
            std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x01N."s, "h"); }).find("pickle protocol 1"), std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("(dp0\n."s, "h"); }).find("not a pickle of protocol 2 or later"), std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02NN."s, "h"); }).find("STOP with 2 values"), std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02N.x"s, "h"); }).find("1 bytes after the pickle's STOP"), std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02" "e."s, "h"); }).find("APPENDS without a MARK"), std::string::npos);
  EXPECT_NE(error_of([] { pickle_loads("\x80\x02}(NNNu."s, "h"); }).find("odd number"), std::string::npos);
}

TEST(Pickle, RefusesNestingDeeperThanItsLimit) {
  // ] followed by TUPLE1 a thousand times: a tuple inside a tuple ... inside a list
  const std::string p = "\x80\x02]"s + std::string(1000, '\x85') + ".";
  EXPECT_NE(error_of([&] { pickle_loads(p, "deep"); }).find("nested more than 64 deep"), std::string::npos);
}

TEST(Pickle, RefusesARecursiveStructure) {
  // l = []; l.append(l); pickle.dumps(l, protocol=2)
  const std::string p = "\x80\x02]q\x00h\x00" "a."s;
  EXPECT_NE(error_of([&] { pickle_loads(p, "rec"); }).find("a recursive structure"), std::string::npos);
}

TEST(AlignSizes, LinesUpTheLongestCommonSubsequence) {
  const std::vector<uint64_t> measured = {1, 2, 9, 3, 4, 5, 7};
  const std::vector<uint64_t> predicted = {1, 2, 3, 4, 8, 5, 7};
  const auto pairs = align_sizes(measured, predicted);
  const std::vector<std::pair<size_t, size_t>> want = {{0, 0}, {1, 1}, {3, 2}, {4, 3}, {5, 5}, {6, 6}};
  EXPECT_EQ(pairs, want);
}

TEST(AlignSizes, IdenticalAndDisjointSequences) {
  const std::vector<uint64_t> a = {5, 6, 7};
  EXPECT_EQ(align_sizes(a, a).size(), 3u);
  EXPECT_TRUE(align_sizes(a, {1, 2}).empty());
  EXPECT_TRUE(align_sizes({}, a).empty());
}

TEST(AlignSizes, FallsBackToAGreedyMatchPastTheEditBudget) {
  // every other size differs: more than kMaxAlignEdits edits, the greedy match still finds the common ones
  std::vector<uint64_t> a, b;
  for (uint64_t i = 0; i < 2 * kMaxAlignEdits; ++i) {
    a.push_back(i % 2 ? 1000000 + i : i);
    b.push_back(i % 2 ? 2000000 + i : i);
  }
  const auto pairs = align_sizes(a, b);
  EXPECT_EQ(pairs.size(), kMaxAlignEdits);
  for (const auto& [i, j] : pairs) EXPECT_EQ(a[i], b[j]);
}

ResolvedScenario small_run(const std::string& conf = "") {
  Scenario s;
  set_field(s, "model", "nanogpt-gpt2");
  set_field(s, "attention", "eager");
  set_field(s, "batch", "1");
  set_field(s, "seq", "64");
  if (!conf.empty()) set_field(s, "alloc_conf", conf);
  return resolve(s);
}

TEST(AllocatorTrace, ReplaysToTheAllocatorsFigures) {
  for (const std::string conf : {"", "expandable_segments:True"}) {
    const ResolvedScenario r = small_run(conf);
    const Estimate e = estimate(r);
    const AllocatorTrace t = trace_allocator(e.sim->timeline, r.alloc, e.options.torch);
    uint64_t reserved = 0, allocated = 0;
    for (const AllocatorSegmentState& s : t.segments) {
      reserved += s.size;
      for (const AllocatorBlockState& b : s.blocks) allocated += b.allocated ? b.size : 0;
    }
    EXPECT_EQ(reserved, e.alloc->reserved.back()) << conf;
    EXPECT_EQ(allocated, e.alloc->allocated.back()) << conf;
    int64_t segs = 0;
    for (const AllocatorTraceEntry& x : t.entries) {
      if (x.action == AllocatorTraceEntry::kSegmentAlloc || x.action == AllocatorTraceEntry::kSegmentMap) segs += static_cast<int64_t>(x.size);
      if (x.action == AllocatorTraceEntry::kSegmentFree || x.action == AllocatorTraceEntry::kSegmentUnmap) segs -= static_cast<int64_t>(x.size);
    }
    EXPECT_EQ(static_cast<uint64_t>(segs), reserved) << conf;
  }
}

TEST(SnapshotDiff, TheExportReadBackIsTheSimulatedRunExactly) {
  const ResolvedScenario r = small_run();
  const Estimate e = estimate(r);
  const MeasuredTrace m = read_measured_trace(render_snapshot_pickle(e, r.alloc), "self.pickle");
  const SnapshotDiff d = diff_snapshot(e, m);
  EXPECT_EQ(d.aligned, d.predicted_allocs);
  EXPECT_EQ(d.aligned, d.measured_allocs);
  EXPECT_FALSE(d.diverge_measured);
  for (const auto& rows : {d.moments, d.categories}) {
    for (const SnapshotDiffRow& row : rows) EXPECT_EQ(row.predicted, row.measured) << row.name;
  }
}

TEST(SnapshotDiff, AMissingAllocationShowsAsUnmatchedAtThePeak) {
  const ResolvedScenario r = small_run();
  const Estimate e = estimate(r);
  MeasuredTrace m = read_measured_trace(render_snapshot_pickle(e, r.alloc), "self.pickle");
  // one more block of 1 MiB from the start to the end of the run, at an address no other block has
  m.actions.insert(m.actions.begin(), MeasuredTrace::Action{true, 1, 1048576});
  const SnapshotDiff d = diff_snapshot(e, m);
  EXPECT_EQ(d.categories.back().name, "total");
  EXPECT_EQ(*d.categories.back().measured, *d.categories.back().predicted + 1048576);
  EXPECT_EQ(d.categories[d.categories.size() - 2].name, "unmatched");
  EXPECT_EQ(*d.categories[d.categories.size() - 2].measured, 1048576u);
  EXPECT_EQ(d.same_prefix, 0u);
}

TEST(ReadMeasuredTrace, RefusesWhatIsNeitherASnapshotNorAMeasurement) {
  EXPECT_NE(error_of([] { read_measured_trace("", "e"); }).find("the file is empty"), std::string::npos);
  EXPECT_NE(error_of([] { read_measured_trace("hello", "t.txt"); }).find("neither a snapshot pickle"), std::string::npos);
  EXPECT_NE(error_of([] { read_measured_trace("{\"format\": \"x\"}", "j.json"); }).find("trainmem-measurement-v1"),
            std::string::npos);
  // a snapshot without a trace: _snapshot() before _record_memory_history()
  EXPECT_NE(error_of([] { read_measured_trace(pickle_dumps(PyDict{{"segments", PyList{}}, {"device_traces", PyList{PyList{}}}}), "n.pickle"); })
                .find("every device trace is empty"),
            std::string::npos);
  // the legacy torch.cuda.memory_snapshot(): a list of segments
  EXPECT_NE(error_of([] { read_measured_trace(pickle_dumps(PyList{}), "l.pickle"); }).find("segments only"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              read_measured_trace(pickle_dumps(PyDict{{"device_traces", PyList{PyList{PyDict{{"action", "alloc"},
                                                                                                {"addr", -5},
                                                                                                {"size", 1}}}}}}),
                                  "neg.pickle");
            }).find("\"addr\" is not a non-negative integer"),
            std::string::npos);
}

}  // namespace
}  // namespace trainmem
