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

}  // namespace nccl

// How a rank's NCCL is set up: --nccl-channels, --nccl-nvls, --gpus-per-node.
struct NcclSetup {
  // Ring channels per communicator (NCCL_DEBUG=INFO's "N coll channels"); empty: the GPU catalog's reading.
  std::optional<uint32_t> channels;
  // NVLink SHARP (NCCL_NVLS_ENABLE); empty: on where NCCL turns it on (sm_90 with NVSwitch multicast, more
  // than 2 GPUs of the communicator on the node).
  std::optional<bool> nvls;
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
  enum class Kind { kData, kContext, kTensor, kPipeline };
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
};

struct NcclLedger {
  std::string version = "2.27.5";
  std::string channel_source;  // where the channel count came from
  bool known = true;           // false: no channel count for this GPU (nothing counted; the report says so)
  std::vector<NcclCommunicator> communicators;
  Bytes total;
};

// The process groups a rank of `s` runs collectives in: the data-parallel group (the world, which DDP,
// DeepSpeed and FSDP use by default) when there are several ranks.
// `pp_rank`: the pipeline rank simulated (its neighbours); empty: the most a pipeline rank has.
std::vector<ProcessGroup> process_groups(const TrainSetup& s, std::optional<uint64_t> pp_rank = std::nullopt);

// The communicators of a rank in `groups` (groups of one rank make none: NCCL sets up no connection) on `gpu`.
NcclLedger nccl_ledger(const std::vector<ProcessGroup>& groups, const GpuSpec& gpu, const NcclSetup& setup);

}  // namespace trainmem
