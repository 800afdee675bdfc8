// NCCL's device memory per rank: what the communicators a rank joins allocate outside PyTorch's caching
// allocator (cuMem allocations, in nvidia-smi but never in memory_allocated()/memory_reserved()). It shrinks
// what the caching allocator can reserve, so the verdict subtracts it beside the CUDA context.
//
// Modelled version: NCCL 2.27.5, the one PyTorch 2.9's CUDA 12 wheels ship (pytorch
// .ci/docker/ci_commit_pins/nccl-cu12.txt "v2.27.5-1"; generate_binary_build_matrix.py
// "nvidia-nccl-cu12==2.27.5"). Every constant below is from that tag of github.com/NVIDIA/nccl.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trainmem/units.h"

namespace trainmem {

struct GpuSpec;
struct TrainSetup;

namespace nccl {

// src/include/device.h: NCCL_STEPS 8; LL: NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x
// sizeof(union ncclLLFifoLine) 16; LL128: NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x
// sizeof(uint64_t); Simple: DEFAULT_BUFFSIZE (1 << 22) (src/init.cc computeBuffSizes, unless NCCL_LL_BUFFSIZE,
// NCCL_LL128_BUFFSIZE or NCCL_BUFFSIZE override them).
inline constexpr uint64_t kSteps = 8;
inline constexpr uint64_t kLlBytes = 8ull * 512 * kSteps * 16;           // 524,288
inline constexpr uint64_t kLl128Bytes = 120ull * 640 * kSteps * 8;      // 4,915,200
inline constexpr uint64_t kSimpleBytes = 1ull << 22;                    // 4,194,304
// src/include/comm.h: struct ncclSendMem / ncclRecvMem are unions padded to MEM_ALIGN 4096.
inline constexpr uint64_t kConnHeaderBytes = 4096;
// src/include/comm.h CUDA_IPC_MIN 2097152: src/transport/p2p.cc p2pSendSetup/p2pRecvSetup ALIGN_SIZE the
// buffer of each connection to it (and ncclP2pAllocateShareableBuffer to the cuMem granularity, 2 MiB).
inline constexpr uint64_t kIpcMinBytes = 2ull << 20;
// src/transport/nvls.cc: NVLS_NCHANNELS_SM90 16, NCCL_NVLS_CHUNKSIZE default 128 KiB; ncclNvlsBufferSetup:
// buffSize = chunk x NCCL_STEPS, nvlsPerRankSize = nChannels x 2 x buffSize, nvlsTotalSize = that x nHeads,
// allocated (nvlsAllocateMem: cuMemCreate of the size aligned to the 2 MiB recommended granularity) on every GPU,
// plus the credits (ncclNvlsSetup: creditSize = nChannels x 2 x 64 x nHeads), allocated the same way.
inline constexpr uint64_t kNvlsChannelsSm90 = 16;
inline constexpr uint64_t kNvlsChunkBytes = 128ull << 10;
// ncclNvlsSetup's credits: 64 B per channel, direction and head (memSize = 64; 16 in 2.22).
inline constexpr uint64_t kNvlsCreditBytes = 64;

// NVLS's buffer rule changed twice; the ledger uses 2.27.5's, the others are here to compare published logs:
// - k2_18: 2.18.x to 2.20.x (nvls.cc ncclNvlsSetup): nvlsPerRankSize = nChannels x 2 x (buffSize + memSize), the
//   communicator's coll channels, buffSize = the Simple protocol's buffer (4 MiB), memSize = NVLS_MEM_ALIGN_SIZE
//   (1 << 21), no separate credits;
// - k2_21: 2.21.x: the same with buffSize = NCCL_NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS;
// - k2_22: 2.22.x to 2.28.x (ncclNvlsBufferSetup): nvlsPerRankSize = nvlsChannels (NVLS_NCHANNELS_SM90 16) x 2 x
//   chunk x NCCL_STEPS, and the credits apart (coll channels x 2 x 64 B x nHeads; 16 B in 2.22).
// Each is x nHeads (one per local rank) and one cuMemCreate aligned to the 2 MiB granularity (nvlsAllocateMem).
enum class NvlsRule { k2_18, k2_21, k2_22 };
inline constexpr uint64_t kNvlsMemAlignBytes = 1ull << 21;  // nvls.cc NVLS_MEM_ALIGN_SIZE
// The NVLS buffers one GPU holds under `rule`: the buffer (and, from 2.22, the credits) allocations.
uint64_t nvls_bytes(NvlsRule rule, uint64_t coll_channels, uint64_t heads);

// cuMem (NCCL_CUMEM_ENABLE default -2: on where the driver supports it, src/misc/cudawrap.cc ncclCuMemEnable):
// every device allocation is its own cuMemCreate, ALIGN_SIZE'd to the CU_MEM_ALLOC_GRANULARITY_MINIMUM of the
// device (src/include/alloc.h ncclCuMemAlloc), 2 MiB on sm_80/sm_90 (the 2,097,152 B sending end of a 4,096 B
// header, NVIDIA/nccl#1685). A small structure thus costs the GPU 2 MiB.
inline constexpr uint64_t kCuMemGranularity = 2ull << 20;
// The per-communicator device structures, each its own ncclCudaCallocAsync (so 2 MiB each under cuMem):
// src/init.cc devCommSetup: devCommAndChans and comm.rankToLocalRank;
inline constexpr uint64_t kCommStructAllocs = 2;
// src/channel.cc initChannel, per channel: sharedRes->devPeers[c], channel->devPeers, channel->devRingUserRanks.
// Every coll channel is initialised at init (init.cc setupChannel), and the P2P channels up to p2pnChannels
// (graph/paths.cc ncclTopoComputeP2pChannels: pow2Up(min(nChannels, NCCL_MAX_P2P_NCHANNELS 64)), "Init channels
// that weren't used so far").
inline constexpr uint64_t kChannelStructAllocs = 3;
// src/channel.cc initNvlsChannel, per coll channel when NVLS is on (nvls.cc ncclNvlsSetup): channel->nvlsDevPeers.
inline constexpr uint64_t kNvlsChannelStructAllocs = 1;
// paths.cc ncclTopoComputeP2pChannels: the channels initChannel sets up, pow2Up of the coll channels (at most 64).
uint64_t initialised_channels(uint64_t coll_channels);
// What NCCL's first collective takes from cudaMemGetInfo beyond its own allocations, once per process (NCCL's
// device code: enqueue.cc ncclInitKernelsForDevice queries every kernel, which loads it), measured on an H100:
// 184,549,376 B both with cuMem (591,396,864 - 194 x 2 MiB of structures) and without (723,517,440 - 512 MiB of
// net.cc's shared buffer - 2 MiB of structures), validate/measured/nccl/h100-80gb-hbm3_nccl2.28.9_one_rank.json.
// NCCL 2.28.9 (torch 2.11's cu13 wheel), the version measured; 2.27.5's code is taken to be the same size. sm_90 only.
inline constexpr uint64_t kProcessCodeBytesSm90 = 184549376;

// One P2P connection's two ends as this rank holds them, per channel (p2p.cc p2pSendSetup/p2pRecvSetup):
// the receiving end holds every protocol's buffer, except Simple when P2P read is on, which the sending end
// then holds. P2P read is on for NVLink between two sm_80 GPUs only (src/graph/paths.cc ncclTopoCheckP2p:
// "Enable P2P Read for Ampere/NVLink only"). On sm_90 that is 10,485,760 B received and 2,097,152 B sent,
// the two sizes NCCL_DEBUG_SUBSYS=ALLOC logs on 8 x H100 (NVIDIA/nccl#1685).
struct Connection {
  uint64_t recv = 0, send = 0;
  uint64_t total() const { return recv + send; }
};
// Over NVLink (the only links the GPU catalog gives a channel count for).
Connection p2p_connection(uint32_t sm);

// A connection to a rank on another node (src/transport/net.cc, non-shared buffers as rings and trees use):
// sendProxyConnect puts LL in host memory and LL128 + Simple on the GPU when GPUDirect RDMA is used (useGdr),
// aligned to CUDA_IPC_MIN; recvProxyConnect puts all three on the GPU with GDR. Without GDR every buffer is in
// host memory (cudaHostAlloc'd), and ncclSendMem/ncclRecvMem are host memory either way.
struct NetConnection {
  Connection gpu;   // on the GPU
  Connection host;  // pinned host memory
};
NetConnection net_connection(bool gdr);

}  // namespace nccl

// How a rank's NCCL is set up: --nccl-channels, --nccl-nvls, --nccl-tree, --nccl-gdr, --gpus-per-node.
struct NcclSetup {
  // Ring channels per communicator (NCCL_DEBUG=INFO's "N coll channels"); empty: the GPU catalog's reading.
  std::optional<uint32_t> channels;
  // NVLink SHARP (NCCL_NVLS_ENABLE); empty: on where NCCL turns it on (sm_90 with NVSwitch multicast, more
  // than 2 GPUs of the communicator on the node).
  std::optional<bool> nvls;
  // The tree algorithm's connections (NCCL_ALGO; NCCL_RUNTIME_CONNECT=1, the default with cuMem, connects an
  // algorithm at the first collective the tuner gives it): empty or false: not counted (ring and NVLS are).
  std::optional<bool> tree;
  // GPUDirect RDMA for connections to other nodes (graph/paths.cc ncclTopoCheckGdr: NIC within PXB of the GPU,
  // reads on sm_80 and newer); empty: on (HGX/DGX nodes put a NIC under each GPU's PCIe switch).
  std::optional<bool> gdr;
  uint64_t gpus_per_node = 8;  // an HGX node's 8 GPUs; a group's ranks are consecutive (rank = node x this + local)
  // --net-gbps: the per-GPU inter-node bandwidth, per direction, GB/s; empty: the GPU catalog's (GpuPerf::net_gbps)
  std::optional<double> net_gbps;
};

// A process group of this rank, as the parallel layout makes it.
struct ProcessGroup {
  std::string name;    // "data parallel (the world group)"
  uint64_t ranks = 1;  // its size
  // A group this rank only sends to and receives from its neighbours in (the pipeline's batch_isend_irecv):
  // P2P connections to `p2p_peers` ranks instead of the collectives' ring. 0: a collectives group.
  uint64_t p2p_peers = 0;
  // The distance between consecutive members' global ranks: 1 for the innermost mesh dimension; the data-parallel
  // group under --tp T strides over the TP groups (T). Its members on this rank's node: ceil(gpus_per_node / stride).
  uint64_t stride = 1;
  // kDataReplicate: HSDP's dp_replicate group (--dp-shard K < dp), whose all-reduce follows each unit's
  // reduce-scatter; kData is then the dp_shard group
  enum class Kind { kData, kContext, kTensor, kPipeline, kDataReplicate };
  Kind kind = Kind::kData;
};

// The members of `g` on one node, ranks consecutive per node: ceil(gpus_per_node / stride), at most its size. Fewer
// than g.ranks: the group spans nodes.
uint64_t local_ranks(const ProcessGroup& g, uint64_t gpus_per_node);

// What one communicator allocates on this rank.
struct NcclCommunicator {
  std::string name;
  uint64_t ranks = 1, local_ranks = 1;  // the group and its members on this rank's node
  uint64_t channels = 0;                // ring channels
  Bytes ring;                           // channels x (receiving + sending end) of the ring's P2P connections
  Bytes nvls;                           // NVLS unicast buffers (0 when NVLS is off)
  uint64_t p2p_peers = 0;               // a send/recv group: the neighbours connected
  Bytes p2p;                            // their connections: peers x channels x (receiving + sending end)
  uint64_t nodes = 1;                   // nodes the group spans (ranks / local ranks, rounded up)
  // Ring channels whose send (and receive) crosses to another node on this rank: channels / local ranks, rounded
  // up (one rank per node sends a channel's ring off the node); their ends are net connections, not P2P ones.
  uint64_t net_channels = 0;
  Bytes net;                            // those net connections' GPU buffers (in `ring`'s place for them)
  Bytes tree;                           // the tree's connections beyond the ring's (0 unless counted)
  Bytes tree_uncounted;                 // what they would be when not counted (the report names it)
  Bytes structures;                     // device structures, each a 2 MiB cuMem allocation
  Bytes host;                           // pinned host memory of net connections without GDR (not on the GPU)
  Bytes gpu_total() const { return ring + nvls + p2p + net + tree + structures; }
};

struct NcclLedger {
  std::string version = "2.27.5";
  std::string channel_source;  // where the channel count came from
  bool known = true;           // false: no channel count for this GPU (nothing counted; the report says so)
  std::vector<NcclCommunicator> communicators;
  Bytes total;  // on the GPU, all communicators and `code`
  Bytes host;   // pinned host memory (net buffers without GDR)
  Bytes code;   // once per process with any communicator: NCCL's device code (kProcessCodeBytesSm90; 0 elsewhere)
  bool code_known = true;  // false: communicators on a GPU without a measured code size (the report says so)
};

// The process groups a rank of `s` runs collectives in: the data-parallel group (the world, which DDP,
// DeepSpeed and FSDP use by default) when there are several ranks.
// `pp_rank`: the pipeline rank simulated (its neighbours); empty: the most a pipeline rank has.
std::vector<ProcessGroup> process_groups(const TrainSetup& s, std::optional<uint64_t> pp_rank = std::nullopt);

// The communicators of a rank in `groups` (groups of one rank make none: NCCL sets up no connection) on `gpu`.
NcclLedger nccl_ledger(const std::vector<ProcessGroup>& groups, const GpuSpec& gpu, const NcclSetup& setup);

}  // namespace trainmem
