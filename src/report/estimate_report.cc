// `trainmem estimate`: the breakdown table and the JSON contract.
#include <fmt/format.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "json_text.h"
#include "time_report.h"
#include "text_table.h"
#include "trainmem/report.h"
#include "trainmem/tp.h"

namespace trainmem {

namespace {

// --pp: a rank's stages and their modules, "embeddings, layers 0-7" or "stage 1: layers 5-9; stage 5: ..."
std::string pp_stage_modules(const std::vector<PpStagePart>& parts) {
  std::string out;
  for (const PpStagePart& p : parts) {
    std::string layers = p.layers() == 0 ? std::string("no layers")
                                         : fmt::format("layers {}-{}", p.layer_begin, p.layer_end - 1);
    if (p.embeddings) layers = "embeddings, " + layers;
    if (p.head) layers += ", norm, lm_head, loss";
    if (parts.size() > 1) layers = fmt::format("stage {}: {}", p.stage, layers);
    out += (out.empty() ? "" : "; ") + layers;
  }
  return out;
}

// per stage, "4" or "6 + 5"
std::string pp_in_flight(const std::vector<uint64_t>& v) {
  std::string out;
  for (uint64_t x : v) out += (out.empty() ? "" : " + ") + std::to_string(x);
  return out;
}

// --tp N: what the rank holds of the model and the collectives' buffers (tp.h, tp_ops.h).
std::string render_tp_note(const Estimate& e) {
  const ModelSpec& m = e.model;
  const TpSplit t = tp_split(m);
  if (m.ep > 1) {
    // --ep N (ep.h): DistributedConfig(tp_size=N, ep_size=N)
    return fmt::format(
        "expert parallel, rank 0 of {} (transformers DistributedConfig(tp_size={}, ep_size={})): {} parameters in\n"
        "  shards (experts {} of {} here, grouped_gemm Shard(0); q/k/v colwise: {} heads, {} kv heads; o_proj\n"
        "  rowwise; lm_head {} vocabulary rows), {} replicated (embed_tokens, norms, router). Simulated: the\n"
        "  ep_router's mask of non-local experts, the experts' output all-reduce (a new tensor), and the attention's\n"
        "  TP collectives. One communicator: the EP group is the TP group (NCCL's buffers: with the GPU, below).\n",
        m.ep, m.ep, m.ep, with_commas(t.sharded), m.moe.experts / m.ep, m.moe.experts, m.attn.heads,
        m.attn.kv_heads, m.embed.vocab_size / m.tp, with_commas(t.replicated));
  }
  if (m.sp) {
    // --sequence-parallel (sp.h): PyTorch-native TP + SP, torchtitan's plan on transformers' modules
    return fmt::format(
        "tensor + sequence parallel, rank 0 of {} (torch.distributed.tensor.parallel, torchtitan's plan and\n"
        "  loss_parallel): {} parameters in shards (q/k/v/gate/up colwise: {} heads, {} kv heads, ffn {} here;\n"
        "  o_proj/down_proj rowwise; embed_tokens and lm_head {} vocabulary rows), {} replicated (norms). The\n"
        "  residual stream, norms and adds hold seq / {} tokens. Simulated: each PrepareModuleInput all-gather (the\n"
        "  all_gather_into_tensor buffer, then torch.cat's whole sequence, which q/k/v and gate/up save or cast), each\n"
        "  rowwise reduce-scatter (torch.cat copy, then the shard), the vocabulary-parallel embedding's MaskPartial,\n"
        "  lm_head's input gather, loss_parallel's log_softmax and fused backward on the (B*T, V/tp) logits, and the\n"
        "  collectives' backward (reduce-scatter <-> all-gather). NCCL's buffers of the TP group: with the GPU, below.\n",
        m.tp, with_commas(t.sharded), m.attn.heads, m.attn.kv_heads, m.mlp.ffn, m.embed.vocab_size / m.tp,
        with_commas(t.replicated), m.tp);
  }
  return fmt::format(
      "tensor parallel, rank 0 of {} (transformers tp_plan=\"auto\"): {} parameters in shards (q/k/v/gate/up\n"
      "  colwise: {} heads, {} kv heads, ffn {} here; o_proj/down_proj rowwise; lm_head {} vocabulary rows), {}\n"
      "  replicated (embed_tokens, norms). Simulated: all_reduce_forward's clone after each rowwise linear,\n"
      "  all_reduce_backward's gradient clone before each colwise one, lm_head's all_gather (tp - 1 empty_like\n"
      "  shards, then the whole logits by torch.cat). NCCL's buffers of the TP group: with the GPU, below.\n",
      m.tp, with_commas(t.sharded), m.attn.heads, m.attn.kv_heads, m.mlp.ffn, m.embed.vocab_size / m.tp,
      with_commas(t.replicated));
}

std::string headline(const Estimate& e) {
  const ModelSpec& m = e.model;
  const TrainSetup& s = e.setup;
  std::string accum = s.grad_accum > 1 ? fmt::format(", {} micro-batches per step", s.grad_accum) : "";
  if (e.ddp) accum += fmt::format("; per rank, {} ranks (DDP)", e.ddp->ranks);
  if (e.zero) accum += fmt::format("; per rank, {} ranks (DeepSpeed ZeRO-{})", e.zero->options.ranks, e.zero->options.stage);
  // --cp N (cp.h): the seq printed is the rank's share
  if (s.cp > 1) {
    accum += fmt::format("; CP rank {} of {}{} (torch context_parallel, ring attention with all-gathered K/V): seq {} "
                         "of {} per rank", s.cp_rank.value_or(0), s.cp, e.cp ? ", the worst" : "", s.seq, s.cp_seq);
  }
  if (e.pp) {
    accum += fmt::format("; pipeline rank {} of {} ({}), {} micro-batches, {}", e.pp->shown, e.pp->ranks,
                         pp_stage_modules(e.pp->rows[e.pp->shown].parts), e.pp->micro_batches, name_of(e.pp->schedule));
  }
  if (e.fsdp && e.fsdp->options.replicate > 1) {
    // HSDP (--dp-shard K): the shard group and the replicate groups
    accum += fmt::format("; per rank, HSDP over {} ranks: {} replicas x {}-rank shard groups (FSDP2)",
                         e.fsdp->options.replicate * e.fsdp->options.ranks, e.fsdp->options.replicate, e.fsdp->options.ranks);
  } else if (e.fsdp) {
    accum += fmt::format("; per rank, {} ranks (FSDP2)", e.fsdp->options.ranks);
  }
  if (e.fsdp1) accum += fmt::format("; per rank, {} ranks (FSDP1)", e.fsdp1->options.ranks);
  if (m.tp > 1 && m.ep > 1) {
    accum += fmt::format("; per rank, {} expert-parallel ranks (ep_size = tp_size)", m.ep);
  } else if (m.sp) {
    accum += fmt::format("; per rank, {} tensor + sequence parallel ranks (seq {} per rank between blocks)", m.tp, s.seq / m.tp);
  } else if (m.tp > 1) {
    accum += fmt::format("; per rank, {} tensor-parallel ranks (tp_plan=\"auto\")", m.tp);
  }
  if (s.cp > 1 && m.tp > 1) {
    // --cp C --tp T (scenario.cc resolve_cp): accelerate's mesh (dp_shard, cp, tp), TP innermost; one rank shown
    accum += fmt::format("; layout dp {} x cp {} x tp {} = {} GPUs, this rank CP rank {} and TP rank 0", s.dp, s.cp,
                         m.tp, checked_mul(checked_mul(s.dp, s.cp, "dp x cp"), m.tp, "dp x cp x tp"),
                         s.cp_rank.value_or(0));
  }
  const bool inference = s.task == Task::kInference;
  return fmt::format(
      "{} (model_type {}, {} code, {} attention{}): batch {} x seq {}, {}, {}{}\n"
      "{}, PyTorch {}, sm_{}; parameters: {} ({})\n",
      m.name, m.model_type, impl_name(m.impl), attn_impl_name(m.attn_impl), moe_routing_note(m), s.batch, s.seq,
      precision_name(s.precision),
      step_label(s),
      accum,
      inference ? std::string("model.eval()")
      : e.pp    ? std::string("torchtitan's training step around torch.distributed.pipelining")
                : fmt::format("{} training loop", loop_name(e.options.loop)),
      torch_version_name(e.options.torch), e.options.sm, with_commas(e.state.parameters.value),
      (e.state.parameters.value >= 1'000'000'000 ? fmt::format("{:.2f} B", static_cast<double>(e.state.parameters.value) / 1e9)
                                           : fmt::format("{:.1f} M", static_cast<double>(e.state.parameters.value) / 1e6)) +
          (!e.pp ? std::string() : e.pp->virtual_stages > 1 ? std::string(", this rank's stages") : std::string(", this rank's stage")));
}

std::string where(const Estimate& e) {
  // --generate: step 1 is the prompt's forward, step k the forward of the k-th new token's input
  if (e.generation) {
    return e.peak.step <= 1 ? std::string("the prefill (the prompt's forward)")
                            : fmt::format("decode step {} of {} (the one-token forward that yields token {})",
                                          e.peak.step - 1, e.generation->new_tokens - 1, e.peak.step);
  }
  return moment_name(e.peak.phase, e.peak.step, e.setup.grad_accum > 1 || e.pp ? e.peak.micro : 0);
}

std::string render_generation_table(const GenerationFigures& g, const TrainSetup& s) {
  using TT = report::TextTable;
  TT t({{"generate()", TT::kLeft}, {"bytes", TT::kRight}, {"size", TT::kRight}, {"what", TT::kLeft}});
  auto row = [&](const char* name, Bytes b, const std::string& what) {
    t.row({name, with_commas(b.value), format_bytes(b), what});
  };
  row("kv cache per token", g.kv_per_token,
      fmt::format("keys and values of every layer for one more token of each of the {} sequences", s.batch));
  row("kv cache at end", g.kv_cache_end,
      fmt::format("{} tokens cached: the prompt and every new token but the last", with_commas(g.cached_tokens)));
  row("prefill peak", g.prefill_peak_allocated, "max memory_allocated() over the prompt's forward");
  if (g.new_tokens > 1) {
    row("decode peak", g.decode_peak_allocated,
        fmt::format("max memory_allocated() over the {} one-token forwards", g.new_tokens - 1));
  }
  row("at the end", g.end_allocated, "memory_allocated() after the last token, the cache still held");
  row("reserved at end", g.end_reserved, "memory_reserved() then: each torch.cat asks for a larger block");
  return t.str();
}

}  // namespace

std::string render_nccl(const NcclLedger& l) {
  std::string out;
  for (const NcclCommunicator& c : l.communicators) {
    if (!l.known) {
      out += fmt::format("  NCCL {}: {}, {} ranks: not counted, {}\n", l.version, c.name, c.ranks, l.channel_source);
      continue;
    }
    if (c.p2p_peers > 0) {
      out += fmt::format("  NCCL {}: {}, {} ranks: P2P to {} neighbour(s) x {} channels x {} = {}\n", l.version, c.name,
                         c.ranks, c.p2p_peers, c.channels,
                         format_bytes(Bytes(c.p2p.value / (c.p2p_peers * std::max<uint64_t>(c.channels, 1)))),
                         format_bytes(c.p2p));
      continue;
    }
    // the ring's P2P (NVLink) channels, then those whose ends cross nodes (net), NVLS, the tree, the structures
    const uint64_t p2p_channels = c.channels - c.net_channels;
    std::vector<std::string> parts;
    if (p2p_channels > 0) {
      parts.push_back(fmt::format("ring {} channels x {} = {}", p2p_channels, format_bytes(Bytes(c.ring.value / p2p_channels)),
                                  format_bytes(c.ring)));
    }
    if (c.net_channels > 0) {
      const char* what = p2p_channels > 0 ? "net" : "ring over the network";
      parts.push_back(c.net.value == 0 ? fmt::format("{} {} channels in host memory", what, c.net_channels)
                                       : fmt::format("{} {} channels x {} = {}", what, c.net_channels,
                                                     format_bytes(Bytes(c.net.value / c.net_channels)), format_bytes(c.net)));
    }
    if (c.nvls.value > 0) parts.push_back(fmt::format("NVLS {}", format_bytes(c.nvls)));
    if (c.tree.value > 0) parts.push_back(fmt::format("tree {}", format_bytes(c.tree)));
    if (c.structures.value > 0) parts.push_back(fmt::format("structures {}", format_bytes(c.structures)));
    out += fmt::format("  NCCL {}: {}, {} ranks ({} on the node): ", l.version, c.name, c.ranks, c.local_ranks);
    for (size_t i = 0; i < parts.size(); ++i) out += (i > 0 ? ", " : "") + parts[i];
    out += "\n";
  }
  // What the ledger leaves out, by name (nccl.h): the tree unless --nccl-tree true, and host memory
  Bytes tree_uncounted, host;
  for (const NcclCommunicator& c : l.communicators) {
    tree_uncounted += c.tree_uncounted;
    host += c.host;
  }
  if (l.known && !l.communicators.empty()) {
    out += l.code_known ? fmt::format("  NCCL's device code, once per process: {} (its first collective on an H100, NCCL "
                                      "2.28.9, beyond its allocations)\n", format_bytes(l.code))
                        : std::string("  NCCL's device code, once per process: not counted (measured on an H100 only)\n");
  }
  if (l.known && tree_uncounted.value > 0) {
    out += fmt::format("    not counted: the tree's {} (connected at the first all-reduce NCCL's tuner gives Tree; "
                       "--nccl-tree true counts it)\n", format_bytes(tree_uncounted));
  }
  if (l.known && host.value > 0) {
    out += fmt::format("    pinned host memory (not on the GPU): {} of net buffers (--nccl-gdr false puts them all there)\n", format_bytes(host));
  }
  if (l.known && !l.communicators.empty()) {
    out += fmt::format("    channels: {}{}\n", l.channel_source == "--nccl-channels" ? "" : "the GPU catalog's NCCL log (trainmem "
                       "gpus --json); --nccl-channels sets them", l.channel_source == "--nccl-channels" ? "--nccl-channels" : "");
  }
  return out;
}

std::string render_verdict(const DeviceVerdict& v, const GpuSpec* gpu) {
  std::string out = fmt::format("{}{}: {} total, {} outside PyTorch{}, {} for the caching allocator\n", v.gpu,
                                gpu ? " (" + gpu->torch_name + ")" : "", format_bytes(v.capacity),
                                format_bytes(v.context),
                                v.nccl.total.value > 0 ? fmt::format(" + {} of NCCL buffers", format_bytes(v.nccl.total)) : "",
                                format_bytes(v.usable));
  out += render_nccl(v.nccl);
  if (v.fits) {
    out += fmt::format("FITS: {} of headroom at the reserved peak\n", format_bytes(Bytes(static_cast<uint64_t>(v.headroom))));
    if (v.alloc_retries > 0) {
      out += fmt::format("  only because the allocator released its cache {} time(s) when cudaMalloc failed "
                         "(num_alloc_retries;\n  each a synchronizing cudaFree): reserved peaks at {} on this card, "
                         "not the {} above\n",
                         v.alloc_retries, format_bytes(v.peak_reserved), format_bytes(v.unlimited_peak_reserved));
    }
    return out;
  }
  const DeviceVerdict::Oom& o = *v.oom;
  out += fmt::format(
      "DOES NOT FIT: out of memory in {}, allocating {} for {} ({}; cudaMalloc of a {} segment)\n"
      "  allocated {}, reserved {} after releasing the cache; short by at least {}\n",
      moment_name(o.phase, o.step), format_bytes(o.requested), o.tensor, category_name(o.category),
      format_bytes(o.segment),
      format_bytes(o.allocated), format_bytes(o.reserved), format_bytes(o.short_by));
  if (o.live.empty()) return out + "  it is the first allocation: nothing else is live yet\n";
  using TT = report::TextTable;
  TT t({{"largest live tensors", TT::kLeft}, {"category", TT::kLeft}, {"size", TT::kRight}});
  for (const LiveTensor& l : o.live) t.row({l.name, std::string(category_name(l.category)), format_bytes(l.bytes)});
  t.rule();
  t.row({"all live tensors", "", format_bytes(o.live_total)});
  for (size_t c = 0; c < kCategoryCount; ++c) {
    if (o.live_by_category[c].value == 0) continue;
    t.row({"", std::string(category_name(static_cast<Category>(c))), format_bytes(o.live_by_category[c])});
  }
  return out + t.str();
}

std::string fragmentation_note(const AllocatorFigures& m) {
  if (!large_fragmentation(m)) return "";
  return fmt::format(
      "  note: {} of the reserved memory ({}) is cached but not allocated at the reserved peak. Best-fit placement\n"
      "  left free blocks between live tensors that the next large request could not use, so a new segment was\n"
      "  cudaMalloc'd; a neighbouring batch or sequence can reserve a whole segment more or less (reserved can\n"
      "  even fall as the batch grows). --alloc-conf expandable_segments:True avoids most of it.\n",
      report::percent(m.fragmentation.value, m.peak_reserved.value), format_bytes(m.fragmentation));
}

// --dp N: the Reducer's buckets (construction and rebuild) and what is not counted.
std::string render_ddp_note(const DdpFigures& d) {
  auto sum = [](const std::vector<uint64_t>& v) {
    uint64_t b = 0;
    for (uint64_t x : v) b = checked_add(b, x, "DDP bucket bytes");
    return Bytes(b);
  };
  auto largest = [](const std::vector<uint64_t>& v) { return v.empty() ? Bytes{} : Bytes(*std::max_element(v.begin(), v.end())); };
  std::string out = fmt::format(
      "DDP, per rank of {}: bucket_cap_mb {} (first bucket {}), gradient_as_bucket_view {}, "
      "find_unused_parameters {} (every rank alike)\n",
      d.ranks, format_bytes(Bytes(d.bucket_cap_bytes)), format_bytes(Bytes(d.first_bucket_cap_bytes)),
      d.gradient_as_bucket_view ? "true" : "false", d.find_unused_parameters ? "true" : "false");
  out += fmt::format("  construction: {} bucket(s), {} in all (largest {})\n", d.initial_buckets.size(),
                     format_bytes(sum(d.initial_buckets)), format_bytes(largest(d.initial_buckets)));
  if (!d.rebuilt_buckets.empty()) {
    out += fmt::format("  rebuilt at the first forward after a synchronized backward (step {}), in gradient-ready "
                       "order: {} bucket(s) (largest {})\n",
                       d.rebuild_step, d.rebuilt_buckets.size(), format_bytes(largest(d.rebuilt_buckets)));
  } else if (!d.rebuilds) {
    out += "  no rebuild (find_unused_parameters=True keeps the construction's buckets)\n";
  } else {
    out += "  the rebuild comes at the first forward after a synchronized backward, past the simulated steps "
           "(--steps)\n";
  }
  out += "  NCCL's communicator buffers are outside the caching allocator: with --gpu, under the verdict\n";
  return out;
}

// --pp N: every rank's stage and peak, the worst named (the table above is rank f.shown's).
std::string render_pp_note(const PpFigures& f, TorchVersion torch) {
  using TT = report::TextTable;
  const bool verdict = !f.rows.empty() && f.rows[0].fits.has_value();
  std::vector<std::pair<std::string, TT::Align>> cols = {
      {"rank", TT::kRight},          {"stage", TT::kLeft},           {"in flight", TT::kRight},
      {"weights", TT::kRight},       {"saved activations", TT::kRight}, {"peak allocated", TT::kRight},
      {"peak reserved", TT::kRight}};
  if (verdict) cols.push_back({"fits", TT::kLeft});
  TT t(cols);
  for (const PpRankFigures& r : f.rows) {
    std::vector<std::string> cells = {std::to_string(r.rank) + (r.rank == f.worst ? " *" : ""), pp_stage_modules(r.parts),
                                      pp_in_flight(r.in_flight), format_bytes(r.weights),
                                      format_bytes(r.saved_activations), format_bytes(r.peak_allocated),
                                      format_bytes(r.peak_reserved)};
    if (verdict) cells.push_back(*r.fits ? "yes" : "no");
    t.row(std::move(cells));
  }
  std::string out = fmt::format(
      "pipeline: {} ranks{}, {} over {} micro-batches (torch.distributed.pipelining, torchtitan's stage split); every "
      "rank simulated\n",
      f.ranks, f.virtual_stages > 1 ? fmt::format(" x {} stages", f.virtual_stages) : "", name_of(f.schedule),
      f.micro_batches);
  out += t.str();
  const PpRankFigures& w = f.rows[f.worst];
  out += fmt::format("  worst rank: {} ({}), {}; the tables above are rank {}'s{}\n", w.rank,
                     pp_stage_modules(w.parts),
                     verdict ? "the least headroom on the GPU"
                             : fmt::format("the highest peak reserved ({})", format_bytes(w.peak_reserved)),
                     f.shown, f.shown == f.worst ? "" : " (--rank)");
  out += "  in flight: micro-batches whose forward ran and whose backward has not (the schedule's warmup); each "
         "keeps its saved activations, its received input and its output until its backward\n";
  // PyTorch 2.11 (RuntimeFacts::pp_stage_backward_releases_input_grads, PR #164329): the input gradient leaves the
  // buffer's .grad and lives in the schedule's send ops
  out += fmt::format(
      "  buffers (PyTorch {}): each stage but the first keeps a receive buffer per micro-batch ({}), each stage but "
      "the last a gradient receive buffer per micro-batch; the last stage keeps every micro-batch's logits "
      "(output_chunks) until the next step and concatenates them when step() returns; the first step starts with "
      "each stage's shape inference (a no_grad forward on zeros)\n",
      torch_version_name(torch),
      runtime_facts(torch, 90).pp_stage_backward_releases_input_grads
          ? "the gradient it sends back lives in the schedule's send ops until the next backward's (1F1B) or the "
            "next backward starts (GPipe)"
          : "and its .grad until the next step");
  out += "  NCCL's send/recv buffers are outside the caching allocator: with --gpu, under the verdict\n";
  return out;
}

// --sharding zero2: the partitions, the per-rank model states beside DeepSpeed's estimator, what is not counted.
// --sharding zero3: the partitions, where the model states live (device / host), DeepSpeed's estimator.
std::string render_zero3_note(const Estimate& e) {
  const ZeroFigures& z = *e.zero;
  const ZeroOptions& o = z.options;
  std::string out = fmt::format(
      "DeepSpeed ZeRO-3, rank {} of {}: reduce_bucket_size {} elements, param_persistence_threshold {}, offload {}\n",
      o.rank, o.ranks, o.reduce_bucket_elems, o.param_persistence_threshold,
      o.offload_optimizer && o.offload_params ? "optimizer,params" : o.offload_optimizer ? "optimizer"
      : o.offload_params ? "params" : "none");
  out += fmt::format("  partitions: ceil(numel / {}) elements per parameter ({} elements of padding on the last rank, "
                     "inside its partitions: every rank alike); {} persistent parameters ({} elements) kept whole\n",
                     o.ranks, z.partition_padding, z.persistent_params, z.persistent_numel);
  out += fmt::format("  model states per rank: bf16 partitions {}{} + persistent {} + grad partitions {}{} + fp32 {}{} + "
                     "optimizer {}{}; IPG buffer {}\n",
                     format_bytes(z.lp_partitions), o.offload_params ? " (host)" : "", format_bytes(z.persistent_full),
                     format_bytes(z.grad_partitions), o.offload_optimizer ? " (host)" : "", format_bytes(z.fp32_partitions),
                     o.offload_optimizer ? " (host)" : "", format_bytes(z.optimizer_state),
                     o.offload_optimizer ? " (host)" : "", format_bytes(z.ipg_buffers));
  out += fmt::format("  on the device: {}; DeepSpeed's estimate_zero3_model_states_mem_needs: {} (4 x largest layer "
                     "{} + per-rank states)\n",
                     format_bytes(z.device_states),
                     z.deepspeed_zero3_estimate.value ? format_bytes(z.deepspeed_zero3_estimate)
                                                      : std::string("no row for params offload alone"),
                     z.largest_param);
  if (!z.host.empty()) {
    out += fmt::format("  host memory (CPU RAM) of this rank: {} pinned + {} pageable\n", format_bytes(z.host_pinned),
                       format_bytes(z.host_pageable));
    for (const ZeroFigures::HostRow& h : z.host) {
      out += fmt::format("    {:>12}  {}  {}\n", format_bytes(h.bytes), h.pinned ? "pinned  " : "pageable", h.what);
    }
  }
  out += fmt::format("  simulated per module: gather on use, release at the next module; from step 2 (the trace): "
                     "persistent parameters kept until the optimizer step, reuse within max_reuse_distance {} kept, prefetch of "
                     "prefetch_bucket_size {} (max_live_parameters {}); NCCL's buffers are outside the caching "
                     "allocator (with --gpu, under the verdict)\n",
                     o.max_reuse_distance, o.prefetch_bucket_elems, o.max_live_parameters);
  return out;
}

// --cp N without --cp-rank: every CP rank's peaks, the worst (shown) marked.
std::string render_cp_note(const CpFigures& f) {
  using TT = report::TextTable;
  const bool verdict = !f.rows.empty() && f.rows[0].fits.has_value();
  std::vector<std::pair<std::string, TT::Align>> cols = {
      {"CP rank", TT::kRight}, {"ring steps (whole q + half k/v, half q + whole k/v)", TT::kLeft},
      {"peak allocated", TT::kRight}, {"peak reserved", TT::kRight}};
  if (verdict) cols.push_back({"fits", TT::kLeft});
  TT t(cols);
  const uint64_t n = f.rows.size();
  for (const CpFigures::Row& r : f.rows) {
    // cp.h ring_steps: after the causal local step, `rank` steps of the whole query, the rest of half of it
    std::vector<std::string> cells = {std::to_string(r.rank) + (r.rank == f.worst ? " *" : ""),
                                      fmt::format("1 causal + {} + {}", r.rank, n - 1 - r.rank),
                                      format_bytes(r.peak_allocated), format_bytes(r.peak_reserved)};
    if (verdict) cells.push_back(*r.fits ? "yes" : "no");
    t.row(std::move(cells));
  }
  const CpFigures::Row& w = f.rows[f.worst];
  return fmt::format("context parallel: {} ranks, every one simulated (the load-balanced ring's steps differ by "
                     "rank)\n{}  worst rank: {}, {}; the tables above are its\n",
                     n, t.str(), w.rank,
                     verdict ? "the least headroom on the GPU"
                             : fmt::format("the highest peak reserved ({})", format_bytes(w.peak_reserved)));
}

std::string render_zero_note(const Estimate& e) {
  const ZeroFigures& z = *e.zero;
  const ZeroOptions& o = z.options;
  if (o.stage == 3) return render_zero3_note(e);
  std::string out = fmt::format(
      "DeepSpeed ZeRO-{}, rank {} of {}: reduce_bucket_size {} elements, overlap_comm {}, contiguous_gradients {}\n",
      o.stage, o.rank, o.ranks, o.reduce_bucket_elems, o.overlap_comm ? "true" : "false",
      o.contiguous_gradients ? "true" : "false");
  for (size_t g = 0; g < z.group_numel.size(); ++g) {
    out += fmt::format("  group {}: {} elements, flat {} (aligned to 2 x {}), partition {}, params_in_partition {}\n", g,
                       z.group_numel[g], z.group_aligned[g], o.ranks, z.group_partition[g], z.group_in_partition[g]);
  }
  const Bytes grads = o.stage == 1 ? z.full_grads : z.grads_in_partition;
  const Bytes states = z.bit16_flat + grads + z.fp32_master + z.optimizer_state;
  out += fmt::format("  model states per rank: bf16 flat {} + {} {} + fp32 master {} + optimizer {} = {}\n",
                     format_bytes(z.bit16_flat), o.stage == 1 ? "full bf16 grads" : "partition grads", format_bytes(grads),
                     format_bytes(z.fp32_master), format_bytes(z.optimizer_state), format_bytes(states));
  out += fmt::format("  with the step's fp32 gradient partition ({}): {}", format_bytes(z.fp32_grad),
                     format_bytes(states + z.fp32_grad));
  out += o.stage == 2 ? fmt::format("; DeepSpeed's estimate_zero2_model_states_mem_needs (2P + 18P/N): {}\n",
                                    format_bytes(z.deepspeed_estimate))
                      : std::string("\n");
  // --dp-rank: the partitions are alike in size; the parameters each holds (params_in_partition, boundary ones in
  // full) differ by rank, and with them grads_in_partition: the default is the rank that holds the most
  if (z.rank_rows.empty()) {
    uint64_t here = 0;
    for (uint64_t n : z.group_in_partition) here = checked_add(here, n, "ZeRO partition elements");
    out += fmt::format("  other ranks: partitions alike in size; params_in_partition hold {} elements here, the most {} "
                       "on rank {}{}\n",
                       with_commas(here), with_commas(z.fullest.in_partition_numel), z.fullest.rank,
                       z.fullest.rank == o.rank ? " (this one)" : "");
    if (o.ranks > kZeroRanksSearched) {
      out += fmt::format("  (over {} ranks the layouts are not searched: the fullest partition's rank is shown; --dp-rank "
                         "picks another)\n", kZeroRanksSearched);
    }
  } else {
    // every class of alike ranks simulated (estimate_zero_ranks), the worst shown
    uint64_t simulated = 0;
    for (const ZeroFigures::RankRow& r : z.rank_rows) simulated += r.ranks;
    out += fmt::format("  ranks: {} layouts of params_in_partition over {} ranks, {} simulated ({} ranks); the worst, "
                       "shown: rank {}{}\n",
                       z.rank_classes, o.ranks, z.rank_rows.size(), simulated, o.rank,
                       z.rank_rows.size() < z.rank_classes ? " (of the fullest simulated)" : "");
    std::vector<size_t> order(z.rank_rows.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return z.rank_rows[a].peak_reserved > z.rank_rows[b].peak_reserved;
    });
    std::string list;
    for (size_t k = 0; k < order.size() && k < 4; ++k) {
      const ZeroFigures::RankRow& r = z.rank_rows[order[k]];
      list += fmt::format("{}rank {}{}: {} held, peak {} reserved", k ? "; " : "", r.rank,
                          r.ranks > 1 ? fmt::format(" (+{} alike)", r.ranks - 1) : "", with_commas(r.in_partition_numel),
                          format_bytes(r.peak_reserved));
    }
    out += fmt::format("    {}{}\n", list, order.size() > 4 ? "; ..." : "");
  }
  out += fmt::format("  IPG buffers per backward: {}; NCCL's buffers are outside the caching allocator (with --gpu, "
                     "under the verdict)\n",
                     format_bytes(z.ipg_buffers));
  return out;
}

// The index of the first unit of each kind, in the kinds' order (FSDP's units of one kind are alike).
template <typename Unit, typename Kind>
std::vector<size_t> first_unit_of_each(const std::vector<Unit>& units, std::initializer_list<Kind> kinds) {
  std::vector<size_t> out;
  for (Kind k : kinds) {
    const auto it = std::find_if(units.begin(), units.end(), [k](const Unit& u) { return u.kind == k; });
    if (it != units.end()) out.push_back(static_cast<size_t>(it - units.begin()));
  }
  return out;
}

// --sharding fsdp2: the units, the per-rank sharded states, the gathered and reduce-scatter buffers per unit.
std::string render_fsdp_note(const Estimate& e) {
  const FsdpFigures& f = *e.fsdp;
  const FsdpOptions& o = f.options;
  const auto dt = [](DType d) { return std::string(dtype_name(d)); };
  std::string out;
  if (f.torchtitan_pp) {
    // torchtitan's apply_fsdp on one pipeline stage: its units are the stage's (fsdp_stage_units)
    uint64_t layers = 0;
    bool embed = false, tail = false;
    for (const FsdpUnit& u : f.units) {
      layers += u.kind == FsdpUnit::kLayer ? 1 : 0;
      embed = embed || u.kind == FsdpUnit::kEmbed;
      tail = tail || u.kind == FsdpUnit::kTail;
    }
    const size_t roots = f.root_begin.size();
    out = fmt::format("FSDP2 (fully_shard as torchtitan v0.2.0's apply_fsdp on {}), rank {} of {}: {} "
                      "units ({}{} decoder layers{}); reshard_after_forward false (torchtitan: not pp_enabled)\n",
                      roots > 1 ? fmt::format("each of this rank's {} pipeline stages, one FSDP root each", roots)
                                : std::string("this pipeline stage"),
                      o.rank, o.ranks, f.units.size(), embed ? "the embedding, " : "", layers,
                      tail ? ", the tail [model.norm, lm_head]" : "");
    out += fmt::format("  MixedPrecisionPolicy: param_dtype {}, reduce_dtype {} over {} shards (torchtitan's "
                       "mixed_precision_param / mixed_precision_reduce, training.dtype float32; no autocast)\n",
                       dt(o.param_dtype), dt(o.reduce_dtype), dt(o.orig_dtype));
  } else if (f.torchtitan_sp) {
    // torchtitan's apply_fsdp after apply_non_moe_tp (fsdp.h resolve_sp_fsdp): the TP-local DTensors' local tensors
    out = fmt::format(
        "FSDP2 (fully_shard as torchtitan's apply_fsdp after its TP + SP plan), rank {} of {} on the dp dimension of "
        "the (dp_shard, tp) mesh, sharding this TP rank's local parameters on dim 0: {} units (the embedding, {} "
        "decoder layers, the tail [model.norm, lm_head]); reshard_after_forward {} (the tail: false)\n",
        o.rank, o.ranks, f.units.size(), f.units.size() - 2, o.reshard_after_forward ? "true" : "false");
    out += fmt::format("  MixedPrecisionPolicy: param_dtype {}, reduce_dtype {} over {} shards (torchtitan's "
                       "mixed_precision_param / mixed_precision_reduce, training.dtype float32; no autocast)\n",
                       dt(o.param_dtype), dt(o.reduce_dtype), dt(o.orig_dtype));
  } else {
    const bool root_unit = !f.units.empty() && f.units.front().kind == FsdpUnit::kRoot;  // PEFT's final norm
    out = fmt::format(
      "FSDP2 (fully_shard through accelerate's fsdp2_prepare_model), rank {} of {}: {} units ({}the embedding, {} decoder "
      "layers, the tail {}); reshard_after_forward {} (the tail{}: false)\n",
      o.rank, o.ranks, f.units.size(), root_unit ? "the root's model.norm, " : "", f.units.size() - (root_unit ? 3 : 2),
      root_unit ? "[lm_head]" : "[model.norm, lm_head]", o.reshard_after_forward ? "true" : "false",
      root_unit ? " and the root" : "");
    // --cp N (fsdp.h fsdp2_mesh_ranks): the mesh is dp_shard x cp, flattened
    // (under HSDP the flattened group is each replica's dp_shard x cp: the HSDP line below)
    if (e.setup.cp > 1) {
      out += fmt::format("  mesh: accelerate's flattened \"dp_shard_cp\" ({} data-parallel x {} context-parallel ranks); "
                         "this rank is data-parallel rank {}'s CP rank {}, its activations the CP rank's\n",
                         o.replicate > 1 ? o.ranks / e.setup.cp : e.setup.dp, e.setup.cp, e.setup.dp_rank.value_or(0),
                         e.setup.cp_rank.value_or(0));
    }
  }
  if (o.replicate > 1) {
    // HSDP (--dp-shard K, fsdp.h apply_hsdp_mesh; src/sim/fsdp.cc post_backward)
    uint64_t held = 0;  // the reduce-scatter outputs (trainable rows: all of them but under LoRA)
    DType reduce_dtype = o.reduce_dtype, orig_dtype = o.orig_dtype;  // the trainable units' (LoRA: the adapters')
    for (const FsdpUnit& u : f.units) {
      held = checked_add(held, u.grad_numel, "HSDP all-reduce");
      if (u.grad_numel) reduce_dtype = u.reduce_dtype, orig_dtype = u.grad_orig_dtype;
    }
    const bool upcast = reduce_dtype != orig_dtype;
    out += fmt::format("  HSDP mesh (dp_replicate, {}) = ({}, {}): shard rank {} of replica {}; states sharded over the "
                       "{} ranks of the shard group and replicated over the {} replicas; each unit's reduce-scatter "
                       "(shard group) is followed by an in-place all-reduce of its {} output over the replicate group "
                       "(all_reduce_stream){}\n",
                       e.setup.cp > 1 ? "dp_shard_cp" : "dp_shard", o.replicate, o.ranks, o.rank, o.replicate_rank,
                       o.ranks, o.replicate, dt(reduce_dtype),
                       upcast ? fmt::format("; FSDPParamGroup._all_reduce_state keeps each unit's {} output until the "
                                            "final callback ({} for every unit), and its {} upcast comes from the "
                                            "all-reduce stream's pool",
                                            dt(reduce_dtype), format_bytes(bytes_of(Elems(held), reduce_dtype)),
                                            dt(orig_dtype))
                              : "; the output is the sharded gradient itself, kept by _all_reduce_state to the "
                                "final callback at no extra cost");
  }
  if (!f.torchtitan_pp && !f.torchtitan_sp) out += o.mixed ? fmt::format("  MixedPrecisionPolicy: param_dtype {}, reduce_dtype {}, output_dtype {} over {} shards "
                               "(accelerate's mixed_precision \"bf16\"; no autocast: _prepare_fsdp2 does not wrap the forward)\n",
                               dt(o.param_dtype), dt(o.reduce_dtype), dt(o.param_dtype), dt(o.orig_dtype))
                 : o.peft && std::any_of(f.units.begin(), f.units.end(), [](const FsdpUnit& u) { return u.gather_dtype == DType::kU8; })
                     ? fmt::format("  MixedPrecisionPolicy(): no casts; every parameter keeps its dtype, the base {} and PEFT's "
                                   "adapters float32: a layer's all-gather mixes them (uint8, over their bytes), its "
                                   "reduce-scatter is the adapters' (float32)\n", dt(o.orig_dtype))
                     : fmt::format("  MixedPrecisionPolicy(): no casts; {} shards, gathers and reduce-scatters\n", dt(o.orig_dtype));
  if (o.peft && !f.torchtitan_pp && !f.torchtitan_sp) {
    // PEFT LoRA under FSDP2 (fsdp.h FsdpOptions::peft; src/sim/fsdp.cc)
    uint64_t trainable = 0;
    for (const FsdpUnit& u : f.units) trainable = checked_add(trainable, u.trainable_params, "FSDP trainable");
    out += fmt::format("  PEFT LoRA: {} of {} parameters trainable (the adapters, in their layer's unit); the frozen rows "
                       "of each unit are all-gathered with them and never reduce-scattered: gradients, reduce-scatters and "
                       "optimizer state cover the adapters only. The model is the PeftModel, where accelerate's "
                       "_find_final_norm finds no norm: model.norm stays in the root unit, gathered at the forward's "
                       "start and kept to the final callback\n",
                       with_commas(trainable), with_commas(e.state.parameters.value));
  }
  if (f.ignored_rows > 0) {
    // QLoRA (FsdpOptions::ignore_packed_4bit)
    out += fmt::format("  bitsandbytes 4-bit base: {} Params4bit ({}) whole on every rank: uint8 quant_storage is not "
                       "floating, so accelerate passes them to fully_shard as ignored_params (torch >= 2.7); "
                       "--quant-storage bf16 lets FSDP2 shard them\n",
                       f.ignored_rows, format_bytes(f.ignored_params));
  }
  if (o.bnb_4bit && !o.ignore_packed_4bit) {
    // --quant-storage bf16 (FsdpOptions::ignore_packed_4bit false)
    out += "  bitsandbytes 4-bit base stored as bfloat16 (bnb_4bit_quant_storage): the Params4bit are frozen floating "
           "parameters, sharded in their layers' units (the packed ((n + 1) / 4, 1) storage chunked on dim 0) and "
           "all-gathered as they are, no cast\n";
  }
  const uint64_t p_all = e.state.parameters.value;
  out += fmt::format("  sharded states per rank: parameters {} + gradients {} + optimizer {} = {} ({} of {} elements "
                     "local, {} padding)\n",
                     format_bytes(f.sharded_params), format_bytes(f.sharded_grads), format_bytes(f.optimizer_state),
                     format_bytes(f.sharded_params + f.sharded_grads + f.optimizer_state), with_commas(f.local_elems),
                     with_commas(p_all), with_commas(f.padding_elems));
  // --dp-rank: every rank's shards are padded alike; torch.chunk leaves the real rows short on the last ranks, whose
  // optimizer state (over the unpadded local shards) is the smallest
  out += fmt::format("  other ranks (--dp-rank): shards padded alike; real elements {} on rank 0, {} on rank {}: rank 0 "
                     "holds the most\n",
                     with_commas(f.first_rank_elems), with_commas(f.last_rank_elems), o.ranks - 1);
  // per distinct unit shape: the embedding, one decoder layer (they are alike), the tail (those the rank holds)
  // (per-parameter dtypes, fsdp_unit_buffers: under LoRA a uint8 all-gather when the inputs' dtypes differ, a copy-in
  // of the cast parameters only, a reduce-scatter of the trainable rows only)
  // the decoder layers by their buffers: one line for all when they are alike, else one for the first of each
  // kind (--freeze: a frozen layer gathers as the others and reduce-scatters nothing), with how many share it
  const auto same_buffers = [](const FsdpUnit& a, const FsdpUnit& b) {
    return a.gather_numel == b.gather_numel && a.gather_dtype == b.gather_dtype && a.copy_in_numel == b.copy_in_numel &&
           a.grad_numel == b.grad_numel && a.params == b.params;
  };
  std::vector<std::pair<size_t, uint64_t>> shown;  // unit index, how many layers like it (0: not a layer)
  for (size_t i : first_unit_of_each(f.units, {FsdpUnit::kRoot, FsdpUnit::kEmbed})) shown.emplace_back(i, 0);
  for (size_t i = 0; i < f.units.size(); ++i) {
    if (f.units[i].kind != FsdpUnit::kLayer) continue;
    const auto like = std::find_if(shown.begin(), shown.end(), [&](const std::pair<size_t, uint64_t>& s) {
      return s.second > 0 && same_buffers(f.units[s.first], f.units[i]);
    });
    if (like != shown.end()) {
      ++like->second;
    } else {
      shown.emplace_back(i, 1);
    }
  }
  for (size_t i : first_unit_of_each(f.units, {FsdpUnit::kTail})) shown.emplace_back(i, 0);
  const uint64_t layer_kinds = static_cast<uint64_t>(
      std::count_if(shown.begin(), shown.end(), [](const std::pair<size_t, uint64_t>& s) { return s.second > 0; }));
  for (const auto& [i, alike] : shown) {
    const FsdpUnit& u = f.units[i];
    const Bytes gathered = bytes_of(Elems(checked_mul(u.gather_numel, o.ranks, "FSDP gathered")), u.gather_dtype);
    const uint64_t reduced = checked_mul(u.grad_numel, o.ranks, "FSDP reduced");
    const std::string which = alike == 0        ? ""
                              : layer_kinds == 1 ? " (each layer)"
                              : alike == 1       ? " (this layer only)"
                                                 : fmt::format(" (and {} more like it)", alike - 1);
    out += fmt::format("  {}{}: {} parameters; all-gather output {} ({}){}, unsharded parameters {}; {}\n",
                       u.name, which, with_commas(u.params),
                       format_bytes(gathered), dt(u.gather_dtype),
                       u.copy_in_numel ? fmt::format(" with a {} copy-in", format_bytes(bytes_of(Elems(u.copy_in_numel), u.copy_in_dtype))) : "",
                       format_bytes(gathered),
                       u.grad_numel == 0 ? std::string("no reduce-scatter (no trainable parameter)")
                                         : fmt::format("reduce-scatter input {} ({}), output {}",
                                                       format_bytes(bytes_of(Elems(reduced), u.reduce_dtype)),
                                                       dt(u.reduce_dtype),
                                                       format_bytes(bytes_of(Elems(u.grad_numel), u.reduce_dtype))));
  }
  if (f.torchtitan_pp) {
    uint64_t gathered = 0;
    for (const FsdpUnit& u : f.units) {
      gathered = checked_add(gathered, checked_mul(u.shard_numel, o.ranks, "FSDP gathered"), "FSDP gathered");
    }
    if (f.root_begin.size() > 1) {
      out += fmt::format("  under the pipeline (stage.py backward_maybe_with_nosync, per stage): each stage's parameters are "
                         "all-gathered by its first forward and stay unsharded through every micro-batch until that "
                         "stage's last backward, {} in {} for the {} stages; each unit's gradients accumulate unsharded in "
                         "{} (unsharded_accumulated_grad, {} for all) from its first backward and are reduce-scattered "
                         "once, after its stage's last\n",
                         format_bytes(bytes_of(Elems(gathered), o.param_dtype)), dt(o.param_dtype), f.root_begin.size(),
                         dt(o.reduce_dtype), format_bytes(bytes_of(e.state.parameters, o.reduce_dtype)));
    } else {
      out += fmt::format("  under the pipeline (stage.py backward_maybe_with_nosync): the stage's parameters are all-gathered "
                         "by its first forward and stay unsharded, {} in {}, through every micro-batch until the last "
                         "backward; each unit's gradients accumulate unsharded in {} (unsharded_accumulated_grad, {}) from "
                         "its first backward and are reduce-scattered once, after the last\n",
                         format_bytes(bytes_of(Elems(gathered), o.param_dtype)), dt(o.param_dtype), dt(o.reduce_dtype),
                         format_bytes(bytes_of(e.state.parameters, o.reduce_dtype)));
    }
  }
  if (e.setup.grad_accum > 1 && f.torchtitan_sp) {
    // torchtitan's trainer calls no no_sync (loop.cc micro_batch)
    out += fmt::format("  gradient accumulation: torchtitan's trainer reduce-scatters every micro-batch's gradients ({} "
                       "reduce-scatter per unit and micro-batch) and adds them into the sharded gradients in place\n",
                       dt(o.reduce_dtype));
  } else if (e.setup.grad_accum > 1) {
    Bytes kept;  // the trainable rows' unsharded .grad, in their unit's gradient dtype
    for (const FsdpUnit& u : f.units) kept += bytes_of(Elems(u.trainable_params), u.grad_dtype);
    DType kept_dtype = o.param_dtype;
    for (const FsdpUnit& u : f.units) kept_dtype = u.trainable_params ? u.grad_dtype : kept_dtype;
    out += fmt::format("  gradient accumulation: accelerate's no_sync (set_requires_gradient_sync(False)) keeps every unsharded "
                       ".grad, {} in {}, from the first micro-batch's backward to the last one's reduce-scatters\n",
                       format_bytes(kept), dt(kept_dtype));
  }
  out += "  streams: the copy-in and all-gather output come from the all-gather copy-in stream's pool, the reduce-scatter "
         "output and the sharded gradients from the reduce-scatter stream's; the caching allocator reuses a block on its "
         "own stream only\n"
         "  NCCL's communicator buffers are outside the caching allocator (with --gpu, under the verdict)\n";
  if (f.root_begin.size() > 1) {
    out += "  each stage's FSDP root has streams of its own (FSDPCommContext.lazy_init in its lazy init): its buffers' "
           "blocks are cached apart from the other stages'\n";
  }
  return out;
}

// --sharding fsdp1: the FlatParameters, the per-rank sharded states, the unsharded flat buffers per unit.
std::string render_fsdp1_note(const Estimate& e) {
  const Fsdp1Figures& f = *e.fsdp1;
  const Fsdp1Options& o = f.options;
  const auto dt = [](DType d) { return std::string(dtype_name(d)); };
  std::string out = fmt::format(
      "FSDP1 (FullyShardedDataParallel through accelerate, fsdp_config version 1), rank {} of {}: {} FlatParameters "
      "({} decoder layers by TRANSFORMER_BASED_WRAP, the root with model.embed_tokens, model.norm, lm_head); "
      "FULL_SHARD, use_orig_params true, backward_prefetch {}, forward_prefetch false, limit_all_gathers true\n",
      o.rank, o.ranks, f.units.size(), f.units.size() - 1, o.backward_prefetch ? "BACKWARD_PRE" : "None (the Trainer's NO_PREFETCH)");
  out += o.mixed ? fmt::format("  MixedPrecision: param_dtype {}, reduce_dtype {}, buffer_dtype {} over {} flat parameters "
                               "(accelerate's mixed_precision \"bf16\"; autocast still wraps the forward)\n",
                               dt(o.param_dtype), dt(o.reduce_dtype), dt(o.param_dtype), dt(o.orig_dtype))
                 : fmt::format("  no MixedPrecision: {} flat parameters, gathers and reduce-scatters\n", dt(o.orig_dtype));
  out += fmt::format("  sharded states per rank: parameters {} + gradients {} + optimizer {} = {} ({} shard elements, {} "
                     "of them parameters; {} padding elements over all ranks)\n",
                     format_bytes(f.sharded_params), format_bytes(f.sharded_grads), format_bytes(f.optimizer_state),
                     format_bytes(f.sharded_params + f.sharded_grads + f.optimizer_state), with_commas(f.shard_elems),
                     with_commas(f.local_elems), with_commas(f.padding_elems));
  // one decoder layer (they are alike) and the root
  for (size_t i : first_unit_of_each(f.units, {Fsdp1Unit::kLayer, Fsdp1Unit::kRoot})) {
    const Fsdp1Unit& u = f.units[i];
    const Fsdp1Layout& l = u.layout;
    out += fmt::format("  {}{}: flat {} = {} parameters + {} alignment + {} world-size padding; shard S {} ({}); "
                       "unsharded flat parameter W x S {} ({}){}; unsharded flat gradient {} ({}), sharded gradient {}\n",
                       u.name, u.kind == Fsdp1Unit::kLayer ? " (each layer)" : "", with_commas(l.unpadded_numel),
                       with_commas(l.params), with_commas(l.align_padding), with_commas(l.world_padding),
                       with_commas(l.shard_numel), format_bytes(bytes_of(Elems(l.shard_numel), o.orig_dtype)),
                       with_commas(l.padded_unsharded_numel), format_bytes(bytes_of(Elems(l.padded_unsharded_numel), o.param_dtype)),
                       o.mixed ? fmt::format(" with a {} _mp_shard", format_bytes(bytes_of(Elems(l.shard_numel), o.param_dtype))) : "",
                       format_bytes(bytes_of(Elems(l.unpadded_numel), o.param_dtype)), dt(o.param_dtype),
                       format_bytes(bytes_of(Elems(l.shard_numel), o.orig_dtype)));
  }
  out += "  the root's flat parameter stays unsharded from its forward to its post-backward (the last), and each unit's "
         "views' gradients wait in the backward until its last one arrives; the sharded gradients stay allocated until "
         "the next forward (_reset_flat_param_grad_info_if_needed)\n"
         "  streams: _full_param_padded from the unshard stream's pool, _mp_shard from the pre-unshard stream's, the "
         "sharded gradients from the post-backward stream's; record_stream frees are replayed where the program frees\n"
         "  NCCL's communicator buffers are outside the caching allocator (with --gpu, under the verdict)\n";
  const TrainSetup& s = e.setup;
  if (s.grad_accum > 1) {
    out += fmt::format("  no_sync ({} micro-batches, the Trainer's accelerator.no_sync for all but the last): unsharded "
                       "gradients kept between micro-batches, {} ({} flat gradients in {}); the parameters still "
                       "reshard after each backward (FULL_SHARD), the last micro-batch reduce-scatters the accumulated "
                       "gradients\n",
                       s.grad_accum, format_bytes(f.no_sync_kept_grads), f.units.size(), dt(o.param_dtype));
  }
  if (s.checkpointing == Checkpointing::kFull) {
    out += fmt::format("  gradient checkpointing inside each FSDP unit ({}): the unit's pre-backward hook unshards its "
                       "flat parameter before the recompute, which reuses the forward's parameter views\n",
                       s.checkpoint_reentrant.value_or(default_checkpoint_reentrant(e.model.impl)) ? "reentrant" : "non-reentrant");
  }
  return out;
}

std::string render_estimate_table(const Estimate& e, const GpuSpec* gpu) {
  using TT = report::TextTable;
  TT t({{"at the peak", TT::kLeft}, {"bytes", TT::kRight}, {"size", TT::kRight}, {"share", TT::kRight},
        {"what", TT::kLeft}});
  const uint64_t total = e.peak.live_total.value;
  for (const Component& c : e.peak.components) {
    t.row({c.name, with_commas(c.bytes.value), format_bytes(c.bytes), report::percent(c.bytes.value, total), c.note});
  }
  t.rule();
  t.row({"live tensors", with_commas(total), format_bytes(e.peak.live_total), "100.0%", "peak, in " + where(e)});
  std::string out = headline(e) + "\n" + t.str();

  TT a({{"caching allocator", TT::kLeft}, {"bytes", TT::kRight}, {"size", TT::kRight}, {"what", TT::kLeft}});
  auto row = [&](const char* name, Bytes b, const std::string& what) {
    a.row({name, with_commas(b.value), format_bytes(b), what});
  };
  if (e.generation) {
    row("before generate", e.memory.steady_state, "memory_allocated() before generate(): the model");
    row("after prefill", e.memory.after_forward, "memory_allocated() after the prompt's forward and its token");
  } else {
    row("steady state", e.memory.steady_state, "memory_allocated() before a step's forward");
    row("after forward", e.memory.after_forward,
        e.setup.task == Task::kInference ? "memory_allocated() after the forward, its logits still bound"
                                         : "memory_allocated() after forward and loss, before backward");
  }
  row("saved activations", e.peak.saved_activations, "what autograd holds at the end of forward (tensors)");
  row("peak allocated", e.memory.peak_allocated, "max_memory_allocated(): blocks, with rounding gaps");
  row("peak reserved", e.memory.peak_reserved, fmt::format("max_memory_reserved(): {} cudaMalloc segments", e.memory.segments));
  row("fragmentation", e.memory.fragmentation, "reserved but not allocated at the peaks");
  if (e.state.paged_optimizer_state.value > 0) {
    row("paged optimizer", e.state.paged_optimizer_state,
        "bitsandbytes' paged states: cudaMallocManaged, outside the caching allocator (in nvidia-smi while resident)");
  }
  if (e.device && e.device->fits) {
    row("nvidia-smi", e.device->device_total,
        fmt::format("{} + {} outside PyTorch", e.device->alloc_retries > 0 ? "reserved on this GPU" : "peak reserved",
                    format_bytes(e.device->context + e.device->nccl.total)));
  } else if (e.device) {
    // More than the card has: not something nvidia-smi could show, but what a card would need to hold it.
    row("would need", e.device->device_total,
        fmt::format("peak reserved + {} outside PyTorch: more than the {}'s {}",
                    format_bytes(e.device->context + e.device->nccl.total), e.device->gpu,
                    format_bytes(e.device->capacity)));
  }
  out += '\n';
  out += a.str();
  out += fragmentation_note(e.memory);
  if (e.generation) out += '\n' + render_generation_table(*e.generation, e.setup);
  if (e.ddp) out += '\n' + render_ddp_note(*e.ddp);
  if (e.zero) out += '\n' + render_zero_note(e);
  if (e.cp) out += '\n' + render_cp_note(*e.cp);
  if (e.pp) out += '\n' + render_pp_note(*e.pp, e.options.torch);
  if (e.fsdp) out += '\n' + render_fsdp_note(e);
  if (e.fsdp1) out += '\n' + render_fsdp1_note(e);
  if (e.model.tp > 1) out += '\n' + render_tp_note(e);
  if (e.device) {
    out += '\n';
    out += render_verdict(*e.device, gpu);
  }
  if (e.time && gpu) out += '\n' + render_step_time(*e.time, *gpu, e.setup, e.pp ? e.pp->shown : 0);
  return out;
}

std::string render_estimate_json(const Estimate& e, const GpuSpec* gpu) {
  const ModelSpec& m = e.model;
  const TrainSetup& s = e.setup;
  nlohmann::json comps = nlohmann::json::array();
  for (const Component& c : e.peak.components) comps.push_back({{"name", c.name}, {"bytes", c.bytes.value}, {"note", c.note}});
  nlohmann::json out = {
      {"model", {{"name", m.name}, {"model_type", m.model_type}, {"source", m.source}}},
      {"setup", {{"model", m.name}, {"impl", impl_name(m.impl)}, {"attention", attn_impl_name(m.attn_impl)},
                 {"moe_routing", m.moe.experts > 0 ? nlohmann::json(moe_routing_name(m.moe.routing)) : nlohmann::json()},
                 {"batch", s.batch}, {"seq", s.seq}, {"precision", precision_name(s.precision)},
                 {"optimizer", optimizer_name(s.optimizer)}, {"optimizer_impl", optimizer_impl_name(s.optimizer_impl)},
                 {"grad_accum", s.grad_accum}, {"gpu", s.gpu.empty() ? nlohmann::json() : nlohmann::json(s.gpu)},
                 {"loop", loop_name(e.options.loop)}, {"torch", torch_version_name(e.options.torch)},
                 {"steps", e.options.steps},
                 {"sm", e.options.sm}, {"param_dtype", dtype_name(param_dtype(s.precision))},
                 {"compute_dtype", dtype_name(compute_dtype(s.precision))}}},
      {"parameters", {{"count", e.state.parameters.value}, {"trainable", e.state.trainable.value}}},
      {"memory", {{"weights_bytes", e.state.weights.value}, {"buffers_bytes", e.state.buffers.value},
                  {"gradients_bytes", e.state.gradients.value}, {"optimizer_state_bytes", e.state.optimizer_state.value},
                  {"optimizer_moments_bytes", e.state.optimizer_moments.value},
                  {"optimizer_steps_bytes", e.state.optimizer_steps.value}, {"inputs_bytes", e.state.inputs.value},
                  {"paged_optimizer_state_bytes", e.state.paged_optimizer_state.value},
                  {"saved_activations_bytes", e.peak.saved_activations.value},
                  {"activations_bytes", e.peak.activations.value}, {"steady_state_bytes", e.memory.steady_state.value},
                  {"steady_state_reserved_bytes", e.memory.steady_state_reserved.value},
                  {"after_forward_allocated_bytes", e.memory.after_forward.value},
                  {"after_forward_reserved_bytes", e.memory.after_forward_reserved.value},
                  {"peak_tensor_bytes", e.peak.live_total.value},
                  {"live_tensors_at_peak_bytes", e.peak.live_total.value},
                  {"peak_reserved_without_limit_bytes", e.memory.peak_reserved.value},
                  {"fragmentation_is_large", large_fragmentation(e.memory)},
                  {"peak_allocated_bytes", e.memory.peak_allocated.value}, {"peak_phase", phase_name(e.peak.phase)},
                  {"peak_step", e.peak.step}, {"peak_micro_batch", e.peak.micro},
                  {"peak_reserved_bytes", e.memory.peak_reserved.value}, {"fragmentation_bytes", e.memory.fragmentation.value},
                  {"segments", e.memory.segments}}},
      {"peak_components", comps},
  };
  out["setup"]["task"] = name_of(s.task);
  out["setup"]["dp"] = s.dp;
  out["setup"]["cp"] = s.cp;  // --cp N: setup.seq is the rank's share of cp_seq
  if (s.cp > 1) out["setup"]["cp_seq"] = s.cp_seq;
  if (s.cp > 1 && e.model.tp > 1) {
    // --cp C --tp T: accelerate's (dp_shard, cp, tp) mesh (ParallelismConfig._get_mesh; dp_replicate outermost
    // under HSDP, --dp-shard K: e.fsdp's replicate groups), the rank simulated
    const uint64_t replicate = e.fsdp ? e.fsdp->options.replicate : 1;
    out["layout"] = {{"dp", s.dp}, {"cp", s.cp}, {"tp", e.model.tp}, {"gpus", checked_mul(checked_mul(s.dp, s.cp, "dp x cp"), e.model.tp, "dp x cp x tp")},
                     {"cp_rank", s.cp_rank.value_or(0)}, {"tp_rank", 0}, {"dp_rank", s.dp_rank.value_or(0)}};
    // the mesh's dimensions outermost first, as [name, size] (an array: the order is the layout)
    nlohmann::json mesh = nlohmann::json::array();
    if (replicate > 1) mesh.push_back({"dp_replicate", replicate});
    mesh.push_back({"dp_shard", s.dp / replicate});
    mesh.push_back({"cp", s.cp});
    mesh.push_back({"tp", e.model.tp});
    out["layout"]["mesh"] = mesh;
  }
  if (e.model.tp > 1) {  // tensor parallelism (tp.h): this rank's local model
    const TpSplit t = tp_split(e.model);
    out["tp"] = {{"ranks", e.model.tp}, {"sequence_parallel", e.model.sp},
                 {"plan", e.model.sp ? "torchtitan TP+SP (parallelize_module), loss_parallel" : "transformers tp_plan=auto"},
                 {"sharded_parameters", t.sharded}, {"replicated_parameters", t.replicated}};
    if (e.model.ep > 1) {  // expert parallelism (ep.h): ep = tp, the experts' Shard(0)
      out["ep"] = {{"ranks", e.model.ep}, {"local_experts", e.model.moe.experts / e.model.ep},
                   {"experts", e.model.moe.experts}, {"plan", "transformers DistributedConfig(tp_size=ep, ep_size=ep)"}};
    }
  }
  if (const auto& d = e.ddp) {
    out["ddp"] = {{"ranks", d->ranks},
                  {"per_rank", true},
                  {"bucket_cap_bytes", d->bucket_cap_bytes},
                  {"first_bucket_cap_bytes", d->first_bucket_cap_bytes},
                  {"gradient_as_bucket_view", d->gradient_as_bucket_view},
                  {"find_unused_parameters", d->find_unused_parameters},
                  {"initial_bucket_bytes", d->initial_buckets},
                  {"rebuilt_bucket_bytes", d->rebuilt_buckets},
                  {"rebuilds", d->rebuilds},
                  {"rebuild_step", d->rebuild_step},
                  {"initial_bucket_params", d->initial_params},
                  {"rebuilt_bucket_params", d->rebuilt_params},
                  {"nccl_buffers", "outside the caching allocator: device.nccl (with a GPU)"}};
  }
  if (const auto& z = e.zero) {
    const ZeroOptions& o = z->options;
    nlohmann::json& j = out["zero"];
    j = {{"stage", o.stage}, {"ranks", o.ranks}, {"rank", o.rank}, {"per_rank", true}};
    j["reduce_bucket_size"] = o.reduce_bucket_elems;
    j["allgather_bucket_size"] = o.allgather_bucket_elems;
    j["overlap_comm"] = o.overlap_comm;
    j["contiguous_gradients"] = o.contiguous_gradients;
    // per parameter group, then this rank's model states and buffers in bytes
    const std::pair<const char*, const std::vector<uint64_t>*> groups[] = {
        {"group_numel", &z->group_numel}, {"group_aligned_numel", &z->group_aligned},
        {"group_partition_size", &z->group_partition}, {"group_params_in_partition_numel", &z->group_in_partition}};
    for (const auto& [key, v] : groups) j[key] = *v;
    const std::pair<const char*, Bytes> bytes[] = {
        {"bit16_flat_bytes", z->bit16_flat}, {"grads_in_partition_bytes", z->grads_in_partition},
        {"fp32_master_bytes", z->fp32_master}, {"optimizer_state_bytes", z->optimizer_state},
        {"ipg_buffer_bytes", z->ipg_buffers}, {"full_grads_bytes", z->full_grads}, {"fp32_grad_partition_bytes", z->fp32_grad},
        {"deepspeed_estimate_bytes", z->deepspeed_estimate}};
    for (const auto& [key, b] : bytes) j[key] = b.value;
    j["nccl_buffers"] = "outside the caching allocator: device.nccl (with a GPU)";
    if (o.stage < 3) {
      // the rank shown and how it was chosen: every class of alike ranks simulated (rank_rows), or the fullest
      j["fullest_rank"] = z->fullest.rank;
      j["fullest_in_partition_numel"] = z->fullest.in_partition_numel;
      nlohmann::json rows = nlohmann::json::array();
      for (const ZeroFigures::RankRow& r : z->rank_rows) {
        rows.push_back({{"rank", r.rank}, {"alike_ranks", r.ranks}, {"in_partition_numel", r.in_partition_numel},
                        {"peak_allocated_bytes", r.peak_allocated.value}, {"peak_reserved_bytes", r.peak_reserved.value},
                        {"fits", r.fits}});
      }
      j["rank_classes"] = z->rank_classes;
      j["ranks_simulated"] = std::move(rows);
    }
    if (o.stage == 3) {
      // ZeRO-3 and offload: added keys only
      j["offload_optimizer"] = o.offload_optimizer;
      j["offload_params"] = o.offload_params;
      j["pin_memory"] = o.pin_memory;
      j["param_persistence_threshold"] = o.param_persistence_threshold;
      j["prefetch_bucket_size"] = o.prefetch_bucket_elems;
      j["max_live_parameters"] = o.max_live_parameters;
      j["max_reuse_distance"] = o.max_reuse_distance;
      j["persistent_params"] = z->persistent_params;
      j["persistent_numel"] = z->persistent_numel;
      j["partition_padding_numel"] = z->partition_padding;
      j["largest_param_numel"] = z->largest_param;
      const std::pair<const char*, Bytes> b3[] = {
          {"lp_partitions_bytes", z->lp_partitions}, {"persistent_full_bytes", z->persistent_full},
          {"grad_partitions_bytes", z->grad_partitions}, {"fp32_partitions_bytes", z->fp32_partitions},
          {"fp32_grad_buffers_bytes", z->fp32_grad_buffers}, {"device_states_bytes", z->device_states},
          {"deepspeed_zero3_estimate_bytes", z->deepspeed_zero3_estimate}};
      for (const auto& [key, b] : b3) j[key] = b.value;
      nlohmann::json& h = out["host"];
      h = {{"pinned_bytes", z->host_pinned.value}, {"pageable_bytes", z->host_pageable.value},
           {"total_bytes", (z->host_pinned + z->host_pageable).value}};
      h["rows"] = nlohmann::json::array();
      for (const ZeroFigures::HostRow& r : z->host) {
        h["rows"].push_back({{"what", r.what}, {"bytes", r.bytes.value}, {"pinned", r.pinned}});
      }
    }
  }
  if (const auto& f = e.pp) {
    // --pp N: every rank (added keys only; the rest of the document is rank pp.shown_rank's)
    nlohmann::json ranks = nlohmann::json::array();
    for (const PpRankFigures& r : f->rows) {
      nlohmann::json stages = nlohmann::json::array();
      for (size_t k = 0; k < r.parts.size(); ++k) {
        const PpStagePart& p = r.parts[k];
        stages.push_back({{"stage", p.stage}, {"layers", {p.layer_begin, p.layer_end}}, {"embeddings", p.embeddings},
                          {"head", p.head}, {"in_flight_micro_batches", r.in_flight[k]}});
      }
      nlohmann::json j = {{"rank", r.rank}, {"stages", stages}, {"weights_bytes", r.weights.value},
                          {"saved_activations_bytes", r.saved_activations.value},
                          {"live_tensors_at_peak_bytes", r.peak_live.value},
                          {"peak_allocated_bytes", r.peak_allocated.value},
                          {"peak_reserved_bytes", r.peak_reserved.value}};
      if (r.fits) j["fits"] = *r.fits;
      ranks.push_back(std::move(j));
    }
    out["ranks"] = std::move(ranks);
    out["pp"] = {{"ranks", f->ranks}, {"schedule", name_of(f->schedule)}, {"micro_batches", f->micro_batches},
                 {"virtual_stages", f->virtual_stages},
                 {"worst_rank", f->worst}, {"shown_rank", f->shown}};
  }
  out["setup"]["pp"] = s.pp;
  if (s.cp > 1) out["setup"]["cp_rank"] = s.cp_rank.value_or(0);  // the CP rank simulated (the worst without --cp-rank)
  if (const auto& f = e.cp) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const CpFigures::Row& r : f->rows) {
      nlohmann::json j = {{"rank", r.rank}, {"peak_allocated_bytes", r.peak_allocated.value},
                          {"peak_reserved_bytes", r.peak_reserved.value}};
      if (r.fits) j["fits"] = *r.fits;
      ranks.push_back(std::move(j));
    }
    out["cp"] = {{"ranks", std::move(ranks)}, {"worst_rank", f->worst}};
  }
  if (const auto& f = e.fsdp) {
    const FsdpOptions& o = f->options;
    nlohmann::json& j = out["fsdp"];
    j = {{"ranks", o.ranks}, {"rank", o.rank}, {"per_rank", true},
         // HSDP (--dp-shard K): the (dp_replicate, dp_shard) mesh; ranks and rank are the shard group's
         // (under --cp the flattened shard mesh is dp x cp ranks: "ranks"; "dp_shard" is the data-parallel factor)
         {"dp_replicate", o.replicate}, {"dp_shard", s.dp_shard.value_or(s.dp)}, {"replica", o.replicate_rank},
         {"framework", f->torchtitan_pp   ? "torchtitan apply_fsdp (pipeline stage)"
                        : f->torchtitan_sp ? "torchtitan apply_fsdp (after its TP + SP plan)"
                                           : "accelerate fsdp2_prepare_model"},
         {"reshard_after_forward", o.reshard_after_forward}, {"orig_dtype", dtype_name(o.orig_dtype)},
         {"param_dtype", dtype_name(o.param_dtype)}, {"reduce_dtype", dtype_name(o.reduce_dtype)},
         {"mixed_precision", o.mixed}};
    nlohmann::json units = nlohmann::json::array();
    // (per-parameter dtypes, fsdp_unit_buffers: without LoRA gather_numel = copy_in_numel (mixed) = grad_numel =
    // shard_numel, in param_dtype and reduce_dtype)
    for (const FsdpUnit& u : f->units) {
      const uint64_t gathered = checked_mul(u.gather_numel, o.ranks, "FSDP gathered");
      const uint64_t reduced = checked_mul(u.grad_numel, o.ranks, "FSDP reduced");
      nlohmann::json ju = {{"name", u.name}, {"params", u.params}, {"shard_numel", u.shard_numel},
                       {"reshard_after_forward", u.kind == FsdpUnit::kTail || u.kind == FsdpUnit::kRoot ? false : o.reshard_after_forward},
                       {"all_gather_output_bytes", bytes_of(Elems(gathered), u.gather_dtype).value},
                       {"all_gather_copy_in_bytes", bytes_of(Elems(u.copy_in_numel), u.copy_in_dtype).value},
                       {"reduce_scatter_input_bytes", bytes_of(Elems(reduced), u.reduce_dtype).value},
                       {"reduce_scatter_output_bytes", bytes_of(Elems(u.grad_numel), u.reduce_dtype).value},
                       // HSDP: the reduce-scatter output all-reduced over dp_replicate in place (0 without HSDP)
                       {"all_reduce_bytes", o.replicate > 1 ? bytes_of(Elems(u.grad_numel), u.reduce_dtype).value : 0}};
      if (o.peft) {  // LoRA: the unit's dtype and its trainable part
        ju["all_gather_dtype"] = dtype_name(u.gather_dtype);
        ju["trainable_params"] = u.trainable_params;
      }
      units.push_back(std::move(ju));
    }
    if (o.peft) j["peft_lora"] = true;
    j["units"] = std::move(units);
    // under a pipeline: the index in units of each FSDP root's first unit, one root per stage module the rank holds
    if (f->torchtitan_pp) j["root_first_units"] = f->root_begin;
    j["sharded_param_bytes"] = f->sharded_params.value;
    if (f->ignored_rows > 0) j["ignored_4bit_param_bytes"] = f->ignored_params.value;  // whole on every rank
    j["sharded_grad_bytes"] = f->sharded_grads.value;
    j["optimizer_state_bytes"] = f->optimizer_state.value;
    j["local_elems"] = f->local_elems;
    j["padding_elems"] = f->padding_elems;
    j["rank0_local_elems"] = f->first_rank_elems;  // --dp-rank: rank 0 holds the most real elements,
    j["last_rank_local_elems"] = f->last_rank_elems;  // the last rank the fewest
    j["nccl_buffers"] = "outside the caching allocator: device.nccl (with a GPU)";
    if (s.cp > 1) j["mesh"] = {{"name", "dp_shard_cp"}, {"dp_shard", s.dp}, {"cp", s.cp}};  // --cp N (fsdp.h)
  }
  if (const auto& f = e.fsdp1) {
    const Fsdp1Options& o = f->options;
    nlohmann::json units = nlohmann::json::array();
    for (const Fsdp1Unit& u : f->units) {
      const Fsdp1Layout& l = u.layout;
      units.push_back({{"name", u.name}, {"params", l.params}, {"flat_numel", l.unpadded_numel},
                       {"align_padding", l.align_padding}, {"world_padding", l.world_padding},
                       {"shard_numel", l.shard_numel}, {"padded_unsharded_numel", l.padded_unsharded_numel},
                       {"unsharded_flat_param_bytes", bytes_of(Elems(l.padded_unsharded_numel), o.param_dtype).value},
                       {"mp_shard_bytes", o.mixed ? bytes_of(Elems(l.shard_numel), o.param_dtype).value : 0},
                       {"unsharded_flat_grad_bytes", bytes_of(Elems(l.unpadded_numel), o.param_dtype).value},
                       {"sharded_grad_bytes", bytes_of(Elems(l.shard_numel), o.orig_dtype).value}});
    }
    out["fsdp1"] = {
        {"ranks", o.ranks}, {"rank", o.rank}, {"per_rank", true},
        {"framework", "accelerate FullyShardedDataParallel (fsdp_version 1)"}, {"sharding_strategy", "FULL_SHARD"},
        {"use_orig_params", o.use_orig_params}, {"backward_prefetch", o.backward_prefetch ? "BACKWARD_PRE" : "None"},
        {"limit_all_gathers", true}, {"orig_dtype", dtype_name(o.orig_dtype)}, {"param_dtype", dtype_name(o.param_dtype)},
        {"reduce_dtype", dtype_name(o.reduce_dtype)}, {"mixed_precision", o.mixed}, {"units", std::move(units)},
        {"sharded_param_bytes", f->sharded_params.value}, {"sharded_grad_bytes", f->sharded_grads.value},
        {"optimizer_state_bytes", f->optimizer_state.value}, {"local_elems", f->local_elems},
        {"shard_elems", f->shard_elems}, {"padding_elems", f->padding_elems},
        {"nccl_buffers", "outside the caching allocator: device.nccl (with a GPU)"}};
    if (s.grad_accum > 1) {
      out["fsdp1"]["no_sync"] = {{"micro_batches", s.grad_accum},
                                 {"kept", "no_sync: unsharded gradients kept between micro-batches"},
                                 {"kept_unsharded_grad_bytes", f->no_sync_kept_grads.value},
                                 {"kept_grad_dtype", dtype_name(o.param_dtype)}};
    }
    if (s.checkpointing == Checkpointing::kFull) {
      out["fsdp1"]["checkpointing"] = {{"inside_unit", true}, {"reentrant", s.checkpoint_reentrant.value_or(default_checkpoint_reentrant(e.model.impl))},
                                       {"recompute_unshard", "the unit's _pre_backward_hook"}};
    }
  }
  out["setup"]["generate"] = s.generate;
  if (const auto& g = e.generation) {
    out["generation"] = {{"new_tokens", g->new_tokens},
                         {"cached_tokens", g->cached_tokens},
                         {"kv_cache_per_token_bytes", g->kv_per_token.value},
                         {"kv_cache_end_bytes", g->kv_cache_end.value},
                         {"prefill_peak_allocated_bytes", g->prefill_peak_allocated.value},
                         {"decode_peak_allocated_bytes", g->decode_peak_allocated.value},
                         {"end_allocated_bytes", g->end_allocated.value},
                         {"end_reserved_bytes", g->end_reserved.value}};
  }
  if (e.device) {
    const DeviceVerdict& v = *e.device;
    out["memory"]["device_total_bytes"] = e.device->device_total.value;
    nlohmann::json d = {{"name", v.gpu}, {"torch_name", gpu ? gpu->torch_name : ""}, {"sm", gpu ? gpu->sm : 0},
                        {"capacity_bytes", v.capacity.value}, {"context_bytes", v.context.value},
                        {"usable_bytes", v.usable.value}, {"fits", v.fits}, {"headroom_bytes", v.headroom},
                        {"peak_reserved_bytes", v.peak_reserved.value},
                        {"peak_reserved_on_this_gpu_bytes", v.peak_reserved.value},
                        {v.fits ? "nvidia_smi_bytes" : "would_need_bytes", v.device_total.value},
                        {"alloc_retries", v.alloc_retries}};
    nlohmann::json comms = nlohmann::json::array();
    for (const NcclCommunicator& c : v.nccl.communicators) {
      comms.push_back({{"group", c.name}, {"ranks", c.ranks}, {"local_ranks", c.local_ranks}, {"channels", c.channels},
                       {"ring_bytes", c.ring.value}, {"nvls_bytes", c.nvls.value}, {"p2p_peers", c.p2p_peers},
                       {"p2p_bytes", c.p2p.value}, {"nodes", c.nodes}, {"net_channels", c.net_channels},
                       {"net_bytes", c.net.value}, {"tree_bytes", c.tree.value},
                       {"tree_not_counted_bytes", c.tree_uncounted.value}, {"structures_bytes", c.structures.value},
                       {"host_bytes", c.host.value}});
    }
    d["nccl"] = {{"version", v.nccl.version}, {"counted", v.nccl.known}, {"channel_source", v.nccl.channel_source},
                 {"communicators", comms}, {"total_bytes", v.nccl.total.value}, {"host_bytes", v.nccl.host.value},
                 {"code_bytes", v.nccl.code.value}, {"code_counted", v.nccl.code_known}};
    if (v.oom) {
      const DeviceVerdict::Oom& o = *v.oom;
      nlohmann::json live = nlohmann::json::array();
      for (const LiveTensor& l : o.live) {
        live.push_back({{"name", l.name}, {"category", category_name(l.category)}, {"bytes", l.bytes.value},
                        {"block_bytes", l.block.value}});
      }
      d["oom"] = {{"phase", phase_name(o.phase)}, {"step", o.step}, {"micro_batch", o.micro}, {"tensor", o.tensor},
                  {"category", category_name(o.category)},
                  {"requested_bytes", o.requested.value}, {"segment_bytes", o.segment.value},
                  {"allocated_bytes", o.allocated.value}, {"reserved_bytes", o.reserved.value},
                  {"overflow_bytes", o.overflow.value}, {"short_by_bytes", o.short_by.value}, {"live_tensor_bytes", o.live_total.value},
                  {"largest_live_tensors", live}};
      nlohmann::json by_cat = nlohmann::json::object();
      for (size_t c = 0; c < kCategoryCount; ++c) {
        by_cat[std::string(category_name(static_cast<Category>(c)))] = o.live_by_category[c].value;
      }
      d["oom"]["live_bytes_by_category"] = by_cat;
    }
    out["device"] = d;
  }
  if (e.time) out["time"] = step_time_json(*e.time);
  return report::json_text(out);
}

}  // namespace trainmem
