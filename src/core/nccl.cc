// NCCL 2.27.5's buffers per communicator (nccl.h). PyTorch 2.9's CUDA 13 wheels ship nvidia-nccl-cu13 2.27.7
// instead; `git diff v2.27.5-1 v2.27.7-1` touches none of the files these rules come from (transport/nvls.cc,
// p2p.cc, net.cc, channel.cc, include/device.h, comm.h, alloc.h, graph/connect.cc; init.cc and enqueue.cc only in
// ncclCommDestroy/ncclCommAbort and kernel attribute queries), so the same constants hold for both wheels.
#include "trainmem/nccl.h"

#include <fmt/format.h>

#include <algorithm>

#include "trainmem/error.h"
#include "trainmem/fsdp.h"
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

NetConnection net_connection(bool gdr) {
  NetConnection c;
  // net.cc sendProxyConnect: NCCL_NET_MAP_ADD_POINTER(map, 0, p != NCCL_PROTO_LL && useGdr, buffSizes[p], ..);
  // the device bank ALIGN_SIZE'd to CUDA_IPC_MIN (ncclP2pAllocateShareableBuffer); ncclSendMem/ncclRecvMem (4 KiB
  // each) in host memory
  const uint64_t send_dev = kLl128Bytes + kSimpleBytes;
  const uint64_t send_host = kLlBytes + 2 * kConnHeaderBytes;
  // recvProxyConnect: every protocol in the device bank with GDR (cuMem-aligned by ncclP2pAllocateShareableBuffer)
  const uint64_t recv_dev = kLlBytes + kLl128Bytes + kSimpleBytes;
  const uint64_t recv_host = 2 * kConnHeaderBytes;
  if (gdr) {
    c.gpu = {round_up(recv_dev, kIpcMinBytes), round_up(send_dev, kIpcMinBytes)};
    c.host = {recv_host, send_host};
  } else {
    c.host = {recv_dev + recv_host, send_dev + send_host};
  }
  return c;
}

uint64_t nvls_bytes(NvlsRule rule, uint64_t coll_channels, uint64_t heads) {
  const uint64_t chunk_steps = kNvlsChunkBytes * kSteps;  // buffSize = nvlsStepSize x NCCL_STEPS
  switch (rule) {
    case NvlsRule::k2_18:
      return round_up(checked_mul(coll_channels * 2 * (kSimpleBytes + kNvlsMemAlignBytes), heads, "NVLS buffers"),
                      kCuMemGranularity);
    case NvlsRule::k2_21:
      return round_up(checked_mul(coll_channels * 2 * (chunk_steps + kNvlsMemAlignBytes), heads, "NVLS buffers"),
                      kCuMemGranularity);
    case NvlsRule::k2_22:
      break;
  }
  const uint64_t buffers = round_up(checked_mul(kNvlsChannelsSm90 * 2 * chunk_steps, heads, "NVLS buffers"), kCuMemGranularity);
  const uint64_t credits = round_up(checked_mul(coll_channels * 2 * kNvlsCreditBytes, heads, "NVLS credits"), kCuMemGranularity);
  return buffers + credits;
}

uint64_t initialised_channels(uint64_t coll_channels) {
  uint64_t p = 1;
  while (p < coll_channels) p *= 2;  // pow2Up
  return std::min<uint64_t>(p, 64);  // NCCL_MAX_P2P_NCHANNELS default MAXCHANNELS 64
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
  if (const uint64_t k = hsdp_shard_degree(s); k > 0) {
    // HSDP (--sharding fsdp2 --dp-shard K < dp, fsdp.h): fully_shard's 2-D mesh (dp_replicate, dp_shard) makes one
    // group per dimension (DeviceMesh._init_process_groups: a new_group / split_group per mesh dimension), the
    // all-gathers and reduce-scatters in the dp_shard group (HSDPMeshInfo.shard_process_group), the all-reduce in the
    // dp_replicate group (replicate_process_group). dp_shard is inside dp_replicate in both frameworks' mesh orders
    // (accelerate ["dp_replicate", "dp_shard", "cp", "sp", "tp"], torchtitan ["pp", "dp_replicate", "dp_shard", "cp",
    // "tp"]): a shard group's members are T ranks apart, a replicate group's K x T (on other nodes when K x T fills one).
    // Under --cp C the shard dimension is the flattened dp_shard x cp group of K x C ranks (apply_hsdp_mesh:
    // accelerate's fsdp_dim_names ("dp_replicate", "dp_shard_cp"); its own process group, as below), and a replicate
    // group's members are K x C x T apart.
    const uint64_t w = checked_mul(k, std::max<uint64_t>(s.cp, 1), "HSDP shard ranks (dp_shard x cp)");
    g.push_back({name(s.cp > 1 ? "FSDP2 dp_shard x cp (HSDP shard)" : "data parallel shard (HSDP dp_shard)", w), w, 0,
                 s.tp, ProcessGroup::Kind::kData});
    g.push_back({name("data parallel replicate (HSDP dp_replicate)", s.dp / k), s.dp / k, 0,
                 checked_mul(w, s.tp, "HSDP stride"), ProcessGroup::Kind::kDataReplicate});
  } else if (s.cp > 1 && s.sharding == Sharding::kFsdp2) {
    // --cp N --sharding fsdp2 (fsdp.h fsdp2_mesh_ranks): fully_shard's all-gathers and reduce-scatters run on the
    // flattened "dp_shard_cp" mesh's group of dp x cp ranks. DeviceMesh._flatten (_create_flatten_mesh) builds a
    // new DeviceMesh with its own process group, also when dp is 1 and its ranks are the cp group's (it returns
    // the mesh itself only when the flattened name is the 1-D mesh's own: "dp_shard_cp" is not "cp"). No
    // collective of the model runs on the "dp_shard" group alone, so it gets no communicator.
    const uint64_t w = checked_mul(s.dp, s.cp, "FSDP2 dp x cp ranks");
    g.push_back({name("FSDP2 dp_shard x cp", w), w, 0, s.tp, ProcessGroup::Kind::kData});
  } else if (s.dp > 1) {
    // under --tp T (FSDP2 over the TP-local model, fsdp.cc): accelerate's ParallelismConfig._get_mesh orders the
    // mesh ["dp_replicate", "dp_shard", "cp", "sp", "tp"], TP innermost, so the data-parallel group's members are
    // T ranks apart (on different nodes when T fills one)
    g.push_back({name("data parallel", s.dp), s.dp, 0, s.tp, ProcessGroup::Kind::kData});
  }
  // --cp N: context_parallel's mesh["cp"] group (its all-gather and all-to-all: cp.h); under --tp T its members
  // are T ranks apart (accelerate's mesh order ["dp_replicate", "dp_shard", "cp", "sp", "tp"], TP innermost)
  if (s.cp > 1) g.push_back({name("context parallel", s.cp), s.cp, 0, std::max<uint64_t>(s.tp, 1), ProcessGroup::Kind::kContext});
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
    // Device structures (init.cc devCommSetup, channel.cc initChannel on every initialised channel, and
    // initNvlsChannel when NVLS is on), each a cuMem allocation of the 2 MiB granularity
    const uint64_t struct_allocs = nccl::kCommStructAllocs + nccl::kChannelStructAllocs * nccl::initialised_channels(channels);
    c.structures = Bytes(checked_mul(struct_allocs, nccl::kCuMemGranularity, "NCCL structures"));
    if (g.p2p_peers > 0) {
      // send/recv: a connection to each neighbour on each of its "p2p channels per peer", which NVSwitch nodes log
      // equal to the coll channels ("16 coll channels, ... 16 p2p channels, 16 p2p channels per peer", 8 x H800,
      // NVIDIA/nccl#892; 32 per pair of H100s, #1685); p2p.cc sizes them as the ring's. Neighbours on another
      // node would use net.cc's shared P2P buffers instead (NCCL_NET_SHARED_BUFFERS): counted as NVLink ones.
      c.p2p_peers = g.p2p_peers;
      c.p2p = Bytes(checked_mul(checked_mul(g.p2p_peers, channels, "NCCL p2p"), conn.total(), "NCCL p2p buffers"));
      l.total += c.gpu_total();
      l.communicators.push_back(std::move(c));
      continue;
    }
    // A group spanning nodes: on each channel one rank per node sends the ring off the node and one receives it
    // (graph/connect.cc: the ring leaves a node at its last local rank); a rank holds channels / local ranks of
    // each, net connections (net.cc) in their P2P ends' place.
    c.nodes = ceil_div(g.ranks, std::max<uint64_t>(c.local_ranks, 1));
    c.net_channels = c.nodes > 1 ? std::min(channels, ceil_div(channels, c.local_ranks)) : 0;
    const nccl::NetConnection net = nccl::net_connection(setup.gdr.value_or(true));
    c.ring = Bytes(checked_mul(channels - c.net_channels, conn.total(), "NCCL ring buffers"));
    c.net = Bytes(checked_mul(c.net_channels, net.gpu.total(), "NCCL net buffers"));
    c.host = Bytes(checked_mul(c.net_channels, net.host.total(), "NCCL net host buffers"));
    // The tree (transport.cc ncclTransportTreeConnect: on every channel, send and receive with the tree's up and
    // down peers, connIndex 0, so a peer the ring already connects is shared). In a node the tree is a chain: a
    // rank inside it adds a receiving end from its down peer and a sending end to its up peer beyond the ring's
    // (none with 2 local ranks: the one peer is both). Across nodes, the node's head rank (a channel's first local
    // rank: channels / local ranks of them) connects to up to 3 other nodes in the double binary tree (graph/
    // trees.cc ncclGetDtree: a parent and two children), both ways, over the network: other nodes' heads, not the
    // ranks the ring enters from, unless the group has one member per node, where the ring's own net connection
    // is taken to be shared with one of them (with 2 nodes, the one peer is both ring neighbours).
    uint64_t tree = c.local_ranks > 2 ? checked_mul(channels, conn.total(), "NCCL tree buffers") : 0;
    uint64_t tree_host = 0;
    if (c.nodes > 1) {
      const uint64_t peers = std::min<uint64_t>(3, c.nodes - 1) - (c.local_ranks == 1 ? 1 : 0);
      const uint64_t conns = checked_mul(c.net_channels, peers, "NCCL tree");
      tree += checked_mul(conns, net.gpu.total(), "NCCL tree net buffers");
      tree_host = checked_mul(conns, net.host.total(), "NCCL tree host buffers");
    }
    (setup.tree.value_or(false) ? c.tree : c.tree_uncounted) = Bytes(tree);
    if (setup.tree.value_or(false)) c.host += Bytes(tree_host);
    // NVLS (nvls.cc ncclNvlsInit): off for 2 or fewer GPUs ("gpuCount <= 2"), else on where the device has
    // multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: NVSwitch systems of sm_90 and newer); one head per
    // local rank (graph/search.cc: the NVLS graph's maxChannels = min(NCCL_MAX_NVLS_ARITY, GPUs), "NVLS channels
    // correspond to GPUs pulling from NVLS"; the "NVLS Head" lines of NVIDIA/nccl#1453's 8-GPU nodes).
    const bool nvls = setup.nvls.value_or(gpu.sm >= 90 && gpu.nvswitch) && c.local_ranks > 2;
    if (nvls) {
      if (gpu.sm >= 100) throw FieldError("nccl_nvls", "true: NVLS on sm_100 and newer is not modelled (pass false)");
      c.nvls = Bytes(nccl::nvls_bytes(nccl::NvlsRule::k2_22, channels, c.local_ranks));
      // nvls.cc ncclNvlsSetup -> channel.cc initNvlsChannel on every coll channel: nvlsDevPeers
      c.structures += Bytes(checked_mul(channels * nccl::kNvlsChannelStructAllocs, nccl::kCuMemGranularity, "NVLS structures"));
    }
    l.total += c.gpu_total();
    l.host += c.host;
    l.communicators.push_back(std::move(c));
  }
  // NCCL's device code, loaded once per process at the first collective (measured on sm_90 only)
  if (l.known && !l.communicators.empty()) {
    l.code_known = gpu.sm == 90;
    if (l.code_known) {
      l.code = Bytes(nccl::kProcessCodeBytesSm90);
      l.total += l.code;
    }
  }
  return l;
}

}  // namespace trainmem
