// NCCL's buffers outside the caching allocator (nccl.h): the per-connection sizes from NCCL 2.27.5's rules,
// checked against the sizes NCCL logs on H100s, the NVLS arithmetic, which groups make communicators, and how
// the verdict subtracts them.
#include <gtest/gtest.h>

#include "test_util.h"
#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/gpu.h"
#include "trainmem/nccl.h"
#include "trainmem/report.h"
#include "trainmem/setup.h"

namespace trainmem {
namespace {

using testing::run;

TEST(Nccl, ProtocolBuffersAreNcclDefaults) {
  // src/init.cc DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE; research/parallel.md sums them to
  // 9,633,792 B
  EXPECT_EQ(nccl::kLlBytes, 524288u);
  EXPECT_EQ(nccl::kLl128Bytes, 4915200u);
  EXPECT_EQ(nccl::kSimpleBytes, 4194304u);
  EXPECT_EQ(nccl::kLlBytes + nccl::kLl128Bytes + nccl::kSimpleBytes, 9633792u);
}

TEST(Nccl, AnH100ConnectionIsTheTwoAllocationSizesNcclLogs) {
  // NVIDIA/nccl#1685 (8 x H100, NCCL_DEBUG_SUBSYS=ALLOC): "two types of buffer being allocated, one type of
  // size 10485760, the other type of size 2097152" -- the receiving and the sending end of a P2P connection
  const nccl::Connection c = nccl::p2p_connection(90);
  EXPECT_EQ(c.recv, 10485760u);
  EXPECT_EQ(c.send, 2097152u);
}

TEST(Nccl, P2PReadOnAmpereMovesTheSimpleBufferToTheSender) {
  // paths.cc: P2P read for sm_80 over NVLink; recv = 4096 + LL + LL128 = 5,443,584 -> 6 MiB; send = 4096 + 4 MiB
  // -> 6 MiB (each aligned to CUDA_IPC_MIN, 2 MiB)
  const nccl::Connection c = nccl::p2p_connection(80);
  EXPECT_EQ(c.recv, 6u << 20);
  EXPECT_EQ(c.send, 6u << 20);
}

TEST(Nccl, OneRankMakesNoCommunicatorAndEightH100sRingAndNvls) {
  const GpuSpec& h100 = find_gpu("h100-80gb");
  EXPECT_TRUE(nccl_ledger({{"world", 1}}, h100, {}).communicators.empty());
  const NcclLedger l = nccl_ledger({{"world", 8}}, h100, {});
  ASSERT_EQ(l.communicators.size(), 1u);
  const NcclCommunicator& c = l.communicators[0];
  EXPECT_EQ(c.channels, 32u);  // the catalog's reading (NVIDIA/nccl#1685)
  EXPECT_EQ(c.ring.value, 32u * 12 * (1u << 20));
  // NVLS: 16 channels x 2 x (128 KiB x 8 steps) x 8 heads = 256 MiB, plus credits 32 x 2 x 64 x 8 = 32 KiB -> 2 MiB
  EXPECT_EQ(c.nvls.value, 258u << 20);
  EXPECT_EQ(l.total, c.ring + c.nvls);
}

TEST(Nccl, NvlsNeedsMoreThanTwoLocalGpusAndCanBeTurnedOff) {
  const GpuSpec& h100 = find_gpu("h100-80gb");
  EXPECT_EQ(nccl_ledger({{"world", 2}}, h100, {}).communicators[0].nvls.value, 0u);  // "gpuCount <= 2"
  NcclSetup off;
  off.nvls = false;
  EXPECT_EQ(nccl_ledger({{"world", 8}}, h100, off).communicators[0].nvls.value, 0u);
  // the A100 has NVSwitch but no multicast (sm_80): ring only, 24 channels of 12 MiB
  const NcclLedger a = nccl_ledger({{"world", 8}}, find_gpu("a100-80gb"), {});
  EXPECT_EQ(a.total.value, 24u * 12 * (1u << 20));
}

TEST(Nccl, AGpuWithoutAChannelReadingCountsNothingAndSaysSo) {
  const NcclLedger l = nccl_ledger({{"world", 4}}, find_gpu("rtx-4090"), {});
  EXPECT_FALSE(l.known);
  EXPECT_EQ(l.total.value, 0u);
  EXPECT_NE(l.channel_source.find("--nccl-channels"), std::string::npos);
  NcclSetup s;
  s.channels = 2;
  EXPECT_EQ(nccl_ledger({{"world", 4}}, find_gpu("rtx-4090"), s).total.value, 2u * 12 * (1u << 20));
}

TEST(Nccl, TheVerdictLeavesTheCachingAllocatorWhatNcclDoesNotHold) {
  const Estimate one = run(testing::scenario_of("gpt2", {{"batch", "1"}, {"seq", "128"}, {"gpu", "h100-80gb"}}));
  const Estimate eight = run(testing::scenario_of("gpt2", {{"batch", "1"}, {"seq", "128"}, {"gpus", "8xh100-80gb"}}));
  ASSERT_TRUE(one.device && eight.device);
  EXPECT_EQ(one.device->nccl.total.value, 0u);
  EXPECT_EQ(eight.device->nccl.total.value, (384u + 258u) << 20);
  EXPECT_EQ(one.device->usable - eight.device->usable, eight.device->nccl.total);
  const std::string text = render_estimate_table(eight, &find_gpu("h100-80gb"));
  EXPECT_NE(text.find("ring 32 channels x 12.0 MiB = 384.0 MiB, NVLS 258.0 MiB"), std::string::npos) << text;
}

TEST(Nccl, APipelineRankConnectsToItsNeighboursOnly) {
  // PipelineStage's batch_isend_irecv: the first and last ranks of a 1F1B pipeline have one neighbour, the others
  // two; each neighbour is a P2P connection (receiving + sending end) per channel
  TrainSetup s;
  s.pp = 4;
  s.tp = 8;
  const GpuSpec& h100 = find_gpu("h100-80gb");
  const auto groups = process_groups(s, 1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].name, "tensor parallel");  // the world is 32 ranks
  EXPECT_EQ(groups[1].p2p_peers, 2u);
  EXPECT_EQ(process_groups(s, 3)[1].p2p_peers, 1u);
  const NcclLedger l = nccl_ledger(process_groups(s, 0), h100, {});
  EXPECT_EQ(l.communicators[1].p2p.value, 32u * 12 * (1u << 20));
  EXPECT_EQ(l.communicators[1].ring.value, 0u);
  s.pp_schedule = PpSchedule::kInterleaved1f1b;  // stages wrap around: rank 0 also feeds from rank 3
  EXPECT_EQ(process_groups(s, 0)[1].p2p_peers, 2u);
}

TEST(Nccl, ChannelsAreBoundedByNcclsMaxchannels) {
  EXPECT_THROW(testing::scenario_of("gpt2", {{"nccl_channels", "65"}}), Error);
  EXPECT_THROW(testing::scenario_of("gpt2", {{"nccl_channels", "0"}}), Error);
}

}  // namespace
}  // namespace trainmem
