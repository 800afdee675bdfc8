// NCCL 2.27.5's buffers per communicator (nccl.h).
#include "trainmem/nccl.h"

#include <fmt/format.h>

#include <algorithm>

#include "trainmem/error.h"
#include "trainmem/gpu.h"
#include "trainmem/setup.h"
#include "trainmem/units.h"

namespace trainmem {

namespace nccl {

Connection p2p_connection(uint32_t sm) {
  const bool read = sm == 80;  // paths.cc ncclTopoCheckP2p: P2P read for Ampere (sm_80) over NVLink only
  // p2pSendSetup: sendSize = sizeof(ncclSendMem) (+ the Simple buffer when reading); p2pRecvSetup: recvSize =
  // sizeof(ncclRecvMem) + every protocol's buffer but Simple when reading; each ALIGN_SIZE(.., CUDA_IPC_MIN)
  Connection c;
  c.send = round_up(kConnHeaderBytes + (read ? kSimpleBytes : 0), kIpcMinBytes);
  c.recv = round_up(kConnHeaderBytes + kLlBytes + kLl128Bytes + (read ? 0 : kSimpleBytes), kIpcMinBytes);
  return c;
}

}  // namespace nccl

uint64_t local_ranks(const ProcessGroup& g, uint64_t gpus_per_node) {
  return std::min(g.ranks, ceil_div(gpus_per_node, std::max<uint64_t>(g.stride, 1)));
}

std::vector<ProcessGroup> process_groups(const TrainSetup& s, std::optional<uint64_t> pp_rank) {
  std::vector<ProcessGroup> g;
  // one NCCL communicator per process group, created at its first collective (ProcessGroupNCCL::getNCCLComm)
  const uint64_t world = s.dp * s.tp * s.pp * s.cp;  // resolve() bounded each factor and their product
  auto name = [&](const char* what, uint64_t n) { return fmt::format("{}{}", what, n == world ? " (the world group)" : ""); };
  if (s.dp > 1) {
    // under --tp T (FSDP2 over the TP-local model, fsdp.cc): accelerate's ParallelismConfig._get_mesh orders the
    // mesh ["dp_replicate", "dp_shard", "cp", "sp", "tp"], TP innermost, so the data-parallel group's members are
    // T ranks apart (on different nodes when T fills one)
    g.push_back({name("data parallel", s.dp), s.dp, 0, s.tp, ProcessGroup::Kind::kData});
  }
  // --cp N: context_parallel's mesh["cp"] group (its all-gather and all-to-all: cp.h)
  if (s.cp > 1) g.push_back({name("context parallel", s.cp), s.cp, 0, 1, ProcessGroup::Kind::kContext});
  // tensor parallelism (tp.h; with dp > 1 only under --sharding fsdp2, fsdp.cc): transformers' initialize_tensor_parallelism makes
  // init_device_mesh(device_type, (tp_size,)), a 1-D mesh over the world, whose group is the default one, where
  // _AllReduceForward / _AllReduceBackward / _AllGather run (device_mesh.get_group()); under a pipeline, the
  // group of the rank's stage
  if (s.tp > 1) g.push_back({name("tensor parallel", s.tp), s.tp, 0, 1, ProcessGroup::Kind::kTensor});
  // the pipeline (pp.h): PipelineStage's batch_isend_irecv to the previous and the next stage's rank (the
  // interleaved schedule's stages wrap around: rank pp - 1 feeds rank 0's next stage)
  if (s.pp > 1) {
    const bool wraps = s.pp_schedule == PpSchedule::kInterleaved1f1b;
    uint64_t peers = s.pp > 2 ? 2 : 1;
    if (!wraps && pp_rank && (*pp_rank == 0 || *pp_rank + 1 == s.pp)) peers = 1;
    // torchtitan's mesh ["pp", "dp_replicate", "dp_shard", "cp", "tp"]: pp outermost, so neighbours are dp x tp x
    // cp ranks apart (the P2P connections do not depend on it; the report's "on the node" does)
    g.push_back({name("pipeline send/recv", s.pp), s.pp, peers, s.dp * s.tp * s.cp, ProcessGroup::Kind::kPipeline});
  }
  return g;
}

NcclLedger nccl_ledger(const std::vector<ProcessGroup>& groups, const GpuSpec& gpu, const NcclSetup& setup) {
  NcclLedger l;
  uint64_t channels = 0;
  if (setup.channels) {
    channels = *setup.channels;
    l.channel_source = "--nccl-channels";
  } else if (gpu.nccl_ring_channels > 0) {
    channels = gpu.nccl_ring_channels;
    l.channel_source = gpu.nccl_source;
  } else {
    l.known = false;
    l.channel_source = fmt::format("no NCCL channel count is known for the {}: pass --nccl-channels N (the \"N coll "
                                   "channels\" NCCL_DEBUG=INFO prints)",
                                   gpu.name);
  }
  const nccl::Connection conn = nccl::p2p_connection(gpu.sm);
  for (const ProcessGroup& g : groups) {
    if (g.ranks < 2) continue;  // a communicator of one rank connects to no peer
    NcclCommunicator c;
    c.name = g.name;
    c.ranks = g.ranks;
    c.local_ranks = local_ranks(g, setup.gpus_per_node);
    c.channels = channels;
    if (!l.known) {
      l.communicators.push_back(std::move(c));
      continue;
    }
    // The ring: on every channel a rank receives from its predecessor and sends to its successor, two
    // connections "regardless of the scale" (sjeaugey, NVIDIA/nccl#864). Connections that cross nodes go over
    // the network transport instead (net.cc), counted here like NVLink ones.
    if (g.p2p_peers > 0) {
      // send/recv: a connection to each neighbour on each of its "p2p channels per peer", which NVSwitch nodes log
      // equal to the coll channels ("16 coll channels, ... 16 p2p channels, 16 p2p channels per peer", 8 x H800,
      // NVIDIA/nccl#892; 32 per pair of H100s, #1685); p2p.cc sizes them as the ring's
      c.p2p_peers = g.p2p_peers;
      c.p2p = Bytes(checked_mul(checked_mul(g.p2p_peers, channels, "NCCL p2p"), conn.total(), "NCCL p2p buffers"));
      l.total += c.p2p;
      l.communicators.push_back(std::move(c));
      continue;
    }
    c.ring = Bytes(checked_mul(channels, conn.total(), "NCCL ring buffers"));
    // NVLS (nvls.cc ncclNvlsInit): off for 2 or fewer GPUs ("gpuCount <= 2"), else on where the device has
    // multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: NVSwitch systems of sm_90 and newer); one head per
    // local rank (the "NVLS Head" lines of NVIDIA/nccl#1453's 8-GPU nodes).
    const bool nvls = setup.nvls.value_or(gpu.sm >= 90 && gpu.nvswitch) && c.local_ranks > 2;
    if (nvls) {
      if (gpu.sm >= 100) throw FieldError("nccl_nvls", "true: NVLS on sm_100 and newer is not modelled (pass false)");
      const uint64_t per_rank = nccl::kNvlsChannelsSm90 * 2 * nccl::kNvlsChunkBytes * nccl::kSteps;
      c.nvls = Bytes(round_up(checked_mul(per_rank, c.local_ranks, "NVLS buffers"), nccl::kIpcMinBytes));
      // ncclNvlsSetup's credits: nChannels (the ring's) x 2 x 64 B x nHeads, its own aligned allocation
      c.nvls += Bytes(round_up(checked_mul(channels * 2 * 64, c.local_ranks, "NVLS credits"), nccl::kIpcMinBytes));
    }
    l.total += c.ring + c.nvls;
    l.communicators.push_back(std::move(c));
  }
  return l;
}

}  // namespace trainmem
