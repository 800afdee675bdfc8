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
  // structures: init.cc devCommSetup 2 + channel.cc initChannel 3 per channel on pow2Up(32) = 32 channels, plus
  // initNvlsChannel 1 per coll channel, each a 2 MiB cuMem allocation: (2 + 96 + 32) x 2 MiB = 260 MiB
  EXPECT_EQ(c.structures.value, 260u << 20);
  EXPECT_EQ(l.code.value, 176u << 20);  // once per process
  EXPECT_EQ(l.total, c.ring + c.nvls + c.structures + l.code);
}

TEST(Nccl, StructuresAreWhatAOneRankCommunicatorTookOnAnH100) {
  // validate/measured/nccl/h100-80gb-hbm3_nccl2.28.9_one_rank.json: NCCL_DEBUG_SUBSYS=ALLOC logs 194 device
  // allocations (init.cc devCommAndChans and rankToLocalRank; channel.cc:42, :45, :56 on each of the 64 channels
  // of "64 coll channels"), 64,356 B in all, and cuMemGetAllocationGranularity gives 2 MiB. The first collective
  // took 591,396,864 B with cuMem and 723,517,440 B without, 536,870,912 of them net.cc's shared buffer (logged).
  const uint64_t allocs = nccl::kCommStructAllocs + nccl::kChannelStructAllocs * nccl::initialised_channels(64);
  EXPECT_EQ(allocs, 2u + 3 * 64);
  const uint64_t with_cumem = 591396864, without = 723517440 - 536870912;
  // without cuMem the 194 cudaMallocs (64,356 B) share one 2 MiB page; the rest of both runs is the same
  // per-process cost: the rule's structures explain the difference to the byte
  EXPECT_EQ(with_cumem - without, allocs * nccl::kCuMemGranularity - nccl::kCuMemGranularity);
  EXPECT_EQ(with_cumem - allocs * nccl::kCuMemGranularity, nccl::kProcessCodeBytesSm90);
  // and the ledger's structures for a communicator of 64 channels (2 ranks: no NVLS) are those 194 allocations
  NcclSetup s;
  s.channels = 64;
  EXPECT_EQ(nccl_ledger({{"world", 2}}, find_gpu("h100-80gb"), s).communicators[0].structures.value,
            allocs * (2u << 20));
}

TEST(Nccl, NvlsRulesPerVersionReproduceThePublishedLogs) {
  // vLLM#9699 (8 x H200, NCCL 2.20-era log line, nvls.cc ncclNvlsSetup's INFO): "nHeads 8 buffSize 4194304 memSize
  // 2097152 nvlsPerRankSize 301989888 nvlsTotalSize 2415919104": 2.18-2.20 rule, nChannels x 2 x (4 MiB + 2 MiB)
  // per head; 301,989,888 / (2 x 6 MiB) = 24 coll channels
  EXPECT_EQ(301989888u % (2u * (6u << 20)), 0u);
  EXPECT_EQ(nccl::nvls_bytes(nccl::NvlsRule::k2_18, 24, 8), 2415919104u);
  // 2.21: chunk 128 KiB x 8 steps instead of the Simple buffer: 24 x 2 x 3 MiB x 8 = 1,152 MiB
  EXPECT_EQ(nccl::nvls_bytes(nccl::NvlsRule::k2_21, 24, 8), 1152ull << 20);
  // 2.22-2.28: 16 NVLS channels x 2 x 1 MiB x 8 heads = 256 MiB, credits 24 x 2 x 64 x 8 = 24 KiB -> 2 MiB
  EXPECT_EQ(nccl::nvls_bytes(nccl::NvlsRule::k2_22, 24, 8), 258ull << 20);
  // 4 GPUs of a communicator on the node: 4 heads, 128 MiB + 2 MiB
  EXPECT_EQ(nccl::nvls_bytes(nccl::NvlsRule::k2_22, 32, 4), 130ull << 20);
}

TEST(Nccl, NetConnectionsAreOnTheGpuWithGdrAndOnTheHostWithout) {
  // net.cc sendProxyConnect: LL128 + Simple on the GPU with GDR, 4,915,200 + 4,194,304 = 9,109,504 B -> 10 MiB
  // (CUDA_IPC_MIN); recvProxyConnect: LL + LL128 + Simple = 9,633,792 B -> 10 MiB; LL of the sender and the two
  // 4 KiB ncclSendMem/ncclRecvMem per end in host memory
  const nccl::NetConnection gdr = nccl::net_connection(true);
  EXPECT_EQ(gdr.gpu.send, 10u << 20);
  EXPECT_EQ(gdr.gpu.recv, 10u << 20);
  EXPECT_EQ(gdr.host.send, 524288u + 8192u);
  EXPECT_EQ(gdr.host.recv, 8192u);
  const nccl::NetConnection host = nccl::net_connection(false);
  EXPECT_EQ(host.gpu.total(), 0u);
  EXPECT_EQ(host.host.total(), 9633792u + 9633792u + 4u * 4096u);
}

TEST(Nccl, AGroupSpanningNodesSendsItsRingOffTheNodeOnSomeChannels) {
  // 16 H100s, 8 per node: the ring leaves a node at one local rank per channel, 32 / 8 = 4 channels each way per
  // rank; those ends are net connections (10 + 10 MiB with GDR) instead of P2P ones (10 + 2 MiB)
  const GpuSpec& h100 = find_gpu("h100-80gb");
  const NcclCommunicator c = nccl_ledger({{"world", 16}}, h100, {}).communicators[0];
  EXPECT_EQ(c.nodes, 2u);
  EXPECT_EQ(c.net_channels, 4u);
  EXPECT_EQ(c.ring.value, 28u * 12 * (1u << 20));
  EXPECT_EQ(c.net.value, 4u * 20 * (1u << 20));
  EXPECT_EQ(c.host.value, 4u * (524288u + 16384u));
  // without GDR the net buffers leave the GPU for pinned host memory
  NcclSetup nogdr;
  nogdr.gdr = false;
  const NcclLedger h = nccl_ledger({{"world", 16}}, h100, nogdr);
  EXPECT_EQ(h.communicators[0].net.value, 0u);
  EXPECT_EQ(h.host.value, 4u * (2u * 9633792u + 4u * 4096u));
  // the data-parallel group under --tp 8: one member per node, every channel crosses (ring 0, net 32 x 20 MiB)
  const NcclCommunicator x = nccl_ledger({{"dp", 2, 0, 8}}, h100, {}).communicators[0];
  EXPECT_EQ(x.local_ranks, 1u);
  EXPECT_EQ(x.ring.value, 0u);
  EXPECT_EQ(x.net.value, 32u * 20 * (1u << 20));
}

TEST(Nccl, TheTreeIsNamedButCountedOnlyWhenAsked) {
  // one node of 8: a chain, a rank inside it adds one receiving and one sending end per channel beyond the ring's
  // (32 x 12 MiB); 2 local ranks share the ring's peer (nothing); across 2 nodes the head channels (4) add one
  // net peer both ways (4 x 20 MiB)
  const GpuSpec& h100 = find_gpu("h100-80gb");
  const NcclCommunicator off = nccl_ledger({{"world", 8}}, h100, {}).communicators[0];
  EXPECT_EQ(off.tree.value, 0u);
  EXPECT_EQ(off.tree_uncounted.value, 384u << 20);
  NcclSetup on;
  on.tree = true;
  EXPECT_EQ(nccl_ledger({{"world", 8}}, h100, on).communicators[0].tree.value, 384u << 20);
  EXPECT_EQ(nccl_ledger({{"world", 2}}, h100, on).communicators[0].tree.value, 0u);
  EXPECT_EQ(nccl_ledger({{"world", 16}}, h100, on).communicators[0].tree.value, (384u + 80u) << 20);
}

TEST(Nccl, InitialisedChannelsArePowersOfTwo) {
  // graph/paths.cc ncclTopoComputeP2pChannels: p2pnChannels = pow2Up(nChannels), channels beyond nChannels init'd
  EXPECT_EQ(nccl::initialised_channels(24), 32u);
  EXPECT_EQ(nccl::initialised_channels(32), 32u);
  EXPECT_EQ(nccl::initialised_channels(2), 2u);
  EXPECT_EQ(nccl::initialised_channels(33), 64u);
}

TEST(Nccl, NvlsNeedsMoreThanTwoLocalGpusAndCanBeTurnedOff) {
  const GpuSpec& h100 = find_gpu("h100-80gb");
  EXPECT_EQ(nccl_ledger({{"world", 2}}, h100, {}).communicators[0].nvls.value, 0u);  // "gpuCount <= 2"
  NcclSetup off;
  off.nvls = false;
  EXPECT_EQ(nccl_ledger({{"world", 8}}, h100, off).communicators[0].nvls.value, 0u);
  // the A100 has NVSwitch but no multicast (sm_80): ring only, 24 channels of 6 + 6 MiB (P2P read), and the
  // structures on pow2Up(24) = 32 initialised channels: (2 + 3 x 32) x 2 MiB
  const NcclLedger a = nccl_ledger({{"world", 8}}, find_gpu("a100-80gb"), {});
  EXPECT_EQ(a.total.value, (24u * 12 + 196u) * (1u << 20));
}

TEST(Nccl, AGpuWithoutAChannelReadingCountsNothingAndSaysSo) {
  const NcclLedger l = nccl_ledger({{"world", 4}}, find_gpu("rtx-4090"), {});
  EXPECT_FALSE(l.known);
  EXPECT_EQ(l.total.value, 0u);
  EXPECT_NE(l.channel_source.find("--nccl-channels"), std::string::npos);
  NcclSetup s;
  s.channels = 2;
  // structures: (2 + 3 x 2 channels) x 2 MiB
  EXPECT_EQ(nccl_ledger({{"world", 4}}, find_gpu("rtx-4090"), s).total.value, (2u * 12 + 16u) * (1u << 20));
}

TEST(Nccl, TheVerdictLeavesTheCachingAllocatorWhatNcclDoesNotHold) {
  const Estimate one = run(testing::scenario_of("gpt2", {{"batch", "1"}, {"seq", "128"}, {"gpu", "h100-80gb"}}));
  const Estimate eight = run(testing::scenario_of("gpt2", {{"batch", "1"}, {"seq", "128"}, {"gpus", "8xh100-80gb"}}));
  ASSERT_TRUE(one.device && eight.device);
  EXPECT_EQ(one.device->nccl.total.value, 0u);
  EXPECT_EQ(eight.device->nccl.total.value, (384u + 258u + 260u + 176u) << 20);
  EXPECT_EQ(one.device->usable - eight.device->usable, eight.device->nccl.total);
  const std::string text = render_estimate_table(eight, &find_gpu("h100-80gb"));
  EXPECT_NE(text.find("ring 32 channels x 12.0 MiB = 384.0 MiB, NVLS 258.0 MiB, structures 260.0 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("not counted: the tree's 384.0 MiB"), std::string::npos) << text;
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
  EXPECT_EQ(l.communicators[1].structures.value, (2u + 3 * 32) * (2u << 20));
  EXPECT_EQ(l.communicators[1].ring.value, 0u);
  s.pp_schedule = PpSchedule::kInterleaved1f1b;  // stages wrap around: rank 0 also feeds from rank 3
  EXPECT_EQ(process_groups(s, 0)[1].p2p_peers, 2u);
}

TEST(Nccl, TreeAndGdrAreScenarioFields) {
  EXPECT_THROW(testing::scenario_of("gpt2", {{"nccl_tree", "maybe"}}), Error);
  EXPECT_THROW(testing::scenario_of("gpt2", {{"nccl_gdr", "2"}}), Error);
  const Estimate e = run(testing::scenario_of(
      "gpt2", {{"batch", "1"}, {"seq", "128"}, {"gpus", "16xh100-80gb"}, {"nccl_tree", "true"}, {"nccl_gdr", "false"}}));
  ASSERT_TRUE(e.device);
  const NcclCommunicator& c = e.device->nccl.communicators.at(0);
  EXPECT_EQ(c.tree.value, 384u << 20);  // the chain in the node; the net part moved to host memory
  EXPECT_EQ(c.net.value, 0u);
  // ring's 4 crossing channels and the tree's 4 head channels x 1 peer, each both ends in host memory
  EXPECT_EQ(e.device->nccl.host.value, 8u * (2u * 9633792u + 4u * 4096u));
}

TEST(Nccl, ChannelsAreBoundedByNcclsMaxchannels) {
  EXPECT_THROW(testing::scenario_of("gpt2", {{"nccl_channels", "65"}}), Error);
  EXPECT_THROW(testing::scenario_of("gpt2", {{"nccl_channels", "0"}}), Error);
}

}  // namespace
}  // namespace trainmem
