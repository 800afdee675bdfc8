// fit(): doubling then bisection over the micro-batch (or the sequence length), each probe a full estimate
// (step simulation and caching-allocator replay under the device limit); and the changes that would let a
// setup fit when its smallest size does not.
#include "trainmem/fit.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>

#include "trainmem/error.h"
#include "trainmem/fsdp.h"
#include "trainmem/fsdp1.h"
#include "trainmem/zero.h"
#include "trainmem/family.h"

namespace trainmem {

Bytes Margin::of(const GpuSpec& gpu) const {
  if (bytes) return *bytes;
  return Bytes(checked_mul(gpu.runtime_total.value / 10000, basis_points, "safety margin") +
               gpu.runtime_total.value % 10000 * basis_points / 10000);
}

std::string Margin::describe() const {
  if (bytes) return format_bytes(*bytes);
  return basis_points % 100 == 0 ? fmt::format("{}%", basis_points / 100)
                                 : fmt::format("{}.{:02}%", basis_points / 100, basis_points % 100);
}

namespace {

[[noreturn]] void bad_margin(std::string_view s) {
  throw FieldError("margin", fmt::format("\"{}\": expected a share of the GPU like 5% or 2.5% (below 100%), or a size "
                          "with its unit like 2GiB, 512MiB or 1000000B",
                          s));
}

// Digits only, at most 18 of them (no overflow).
std::optional<uint64_t> digits(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

}  // namespace

Margin parse_margin(std::string_view s) {
  Margin m;
  if (!s.empty() && s.back() == '%') {
    std::string_view num = s.substr(0, s.size() - 1);
    const size_t dot = num.find('.');
    std::string_view whole = num.substr(0, dot);
    std::string_view frac = dot == std::string_view::npos ? std::string_view() : num.substr(dot + 1);
    if (dot != std::string_view::npos && (frac.empty() || frac.size() > 2)) bad_margin(s);
    const auto w = digits(whole);
    const auto f = frac.empty() ? std::optional<uint64_t>(0) : digits(frac);
    if (!w || !f || *w >= 100) bad_margin(s);
    m.basis_points = *w * 100 + (frac.size() == 1 ? *f * 10 : *f);
    return m;
  }
  // GB is refused here: a margin in vendor gigabytes is more likely a mistyped GiB
  if (s.size() >= 2 && s.substr(s.size() - 2) == "GB") bad_margin(s);
  bool unit = false;
  const auto b = parse_size(s, &unit);
  if (!b || (!unit && *b != 0)) bad_margin(s);  // a bare number other than 0 needs a unit
  m.bytes = Bytes(*b);
  return m;
}

namespace {
constexpr NameRow<FitDimension> kDimensions[] = {
    {FitDimension::kBatch, "batch", "the largest micro-batch at the given sequence length"},
    {FitDimension::kSeq, "seq", "the longest sequence at the given micro-batch (1 unless given)"},
};
}  // namespace

std::span<const NameRow<FitDimension>> name_table(FitDimension) { return kDimensions; }
std::optional<FitDimension> parse_fit_dimension(std::string_view s) { return parse_name<FitDimension>(s); }
std::string_view fit_dimension_name(FitDimension d) { return name_of(d); }

FitRequest fit_request(std::string_view solve, std::string_view margin) {
  FitRequest req;
  const auto d = parse_fit_dimension(solve);
  if (!d) throw FieldError("solve", fmt::format("\"{}\": expected batch or seq", solve));
  req.solve = *d;
  req.margin = parse_margin(margin);
  return req;
}

namespace {

// A setup to search over: the model (and its inventory), the training setup, the simulator options.
struct Candidate {
  ModelSpec model;
  Inventory inv;
  TrainSetup setup;
  SimOptions options;
  AllocatorConfig alloc;
};

// The work one fit may do, in simulated events over all its probes (the searches of its suggestions
// included): each event is simulated once and replayed twice (without and with the device limit), about
// seven seconds for this many on two cores. A probe's events do not depend on the size searched, so a setup
// whose single step is large (many layers, many --steps) reaches it after few probes, and fit says so.
inline constexpr uint64_t kFitEventBudget = uint64_t{1} << 23;  // 8,388,608

struct Budget {
  uint64_t events = 0;
  uint64_t probes = 0;
};

class Search {
 public:
  Search(const Candidate& c, const GpuSpec& gpu, Bytes margin, FitDimension dim, Budget& budget)
      : c_(c), gpu_(gpu), margin_(margin), dim_(dim), budget_(budget) {}

  FitProbe probe(uint64_t size) {
    auto it = probes_.find(size);
    if (it != probes_.end()) return it->second;
    if (budget_.events >= kFitEventBudget) {
      throw Error(fmt::format("fit stops after {} probes: they simulated {} events, its bound on work ({}); a "
                              "step of this setup is large ({}): try {} or ask estimate for single sizes",
                              budget_.probes, with_commas(budget_.events), with_commas(kFitEventBudget),
                              c_.setup.generate > 0 ? "layers x new tokens" : "layers x steps",
                              c_.setup.generate > 0 ? "fewer --generate tokens" : "fewer --steps"));
    }
    TrainSetup s = c_.setup;
    (dim_ == FitDimension::kBatch ? s.batch : s.seq) = size;
    FitProbe p;
    p.batch = s.batch;
    p.seq = s.seq;
    try {
      // --pp: every rank simulated, each with its verdict; the estimate is the rank with the least headroom
      const bool pipeline = c_.setup.pp > 1;
      const Estimate e = pipeline ? estimate(c_.model, c_.inv, s, c_.options, c_.alloc, &gpu_, margin_)
                                  : estimate(c_.model, c_.inv, s, c_.options, c_.alloc);
      budget_.events += e.sim->timeline.events.size() * (pipeline ? e.pp->ranks : 1);
      ++budget_.probes;
      const DeviceVerdict v = pipeline ? *e.device : device_verdict(e, gpu_, c_.alloc, margin_);
      if (pipeline) p.pp_worst_rank = e.pp->worst;
      p.fits = v.fits;
      p.alloc_retries = v.alloc_retries;
      p.peak_allocated = e.memory.peak_allocated;
      p.peak_reserved = e.memory.peak_reserved;
      p.large_fragmentation = large_fragmentation(e.memory);
      if (v.fits) {
        p.time = step_time(e, gpu_);
        p.reserved_on_device = v.peak_reserved;
        p.device_total = v.peak_reserved + gpu_.context + v.nccl.total;
      }
      p.headroom = v.headroom;
      if (v.oom) {
        p.failure = fmt::format("out of memory in {}: {} for {} ({})", moment_name(v.oom->phase, v.oom->step),
                                format_bytes(v.oom->requested), v.oom->tensor, category_name(v.oom->category));
      }
    } catch (const Error& err) {
      // Beyond 64-bit byte counts nothing fits; the smallest size is validated before any search.
      if (size == 1) throw;
      p.fits = false;
      p.failure = err.what();
    }
    probes_.emplace(size, p);
    return p;
  }

  // The largest size in [1, cap] that fits, or nullopt when 1 does not.
  std::optional<uint64_t> largest(uint64_t cap) {
    if (!probe(1).fits) return std::nullopt;
    uint64_t lo = 1, hi = 0;  // lo fits; hi (when non-zero) does not
    while (hi == 0) {
      if (lo == cap) return lo;
      const uint64_t next = lo > cap / 2 ? cap : lo * 2;
      if (probe(next).fits) {
        lo = next;
      } else {
        hi = next;
      }
    }
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      (probe(mid).fits ? lo : hi) = mid;
    }
    return lo;
  }

  std::vector<FitProbe> probes() const {
    std::vector<FitProbe> out;
    for (const auto& [size, p] : probes_) out.push_back(p);
    return out;
  }

 private:
  const Candidate& c_;
  const GpuSpec& gpu_;
  Bytes margin_;
  FitDimension dim_;
  Budget& budget_;
  std::map<uint64_t, FitProbe> probes_;
};

// The inventory of the model with another attention (nanoGPT's eager attention has mask buffers, sdpa none):
// the fresh one, unless the scenario changed the rows (frozen, LoRA, 4-bit), which attention does not touch
// for the models that take those.
Inventory same_rows_as(const Inventory& base, Inventory fresh) {
  const bool owned = std::any_of(base.parameters.begin(), base.parameters.end(), [](const TensorRow& r) {
    return !r.trainable || r.adapter || r.packed_4bit || r.fp32;
  });
  return owned ? base : fresh;
}

uint64_t cap_for(const Candidate& c, FitDimension dim, const FitRequest& r) {
  if (dim == FitDimension::kBatch) return r.max_batch;
  uint64_t cap = r.max_seq;
  if (c.model.max_positions > 0) cap = std::min(cap, c.model.max_positions);  // a learned position table
  return cap;
}

// Changes that save memory, each simulated. `original`: the search's probe of the setup at size 1. When that
// did not fit, a change is listed when it saves memory at size 1; when it did (`answer` is the size found),
// when it raises the answer.
void suggest(const Candidate& base, const FitProbe& original, std::optional<uint64_t> answer, const GpuSpec& gpu,
             Bytes margin, const FitRequest& r, Budget& budget, FitResult& out) {
  auto saves = [&](const FitProbe& p) {
    return signed_difference(original.peak_reserved.value, p.peak_reserved.value, "the memory a change saves");
  };
  auto add = [&](std::vector<FieldChange> changes, std::string what, const Candidate& c) {
    if (budget.events >= kFitEventBudget) {  // the answer stands; the rest of the changes go unsimulated
      out.suggestions_cut = true;
      return;
    }
    FitSuggestion sug;
    sug.changes = std::move(changes);
    sug.what = std::move(what);
    Search s(c, gpu, margin, out.solve, budget);
    sug.at_one = s.probe(1);
    sug.saves = saves(*sug.at_one);
    // a sharding of the ranks: kept for the ladder, whatever the list below keeps
    const bool sharding = sug.changes.front().field == "sharding";
    if (sharding) {
      std::string name = sug.changes.front().value;
      // HSDP's rung: "fsdp2 --dp-shard K"
      if (sug.changes.size() > 1 && sug.changes[1].field == "dp_shard") name += " --dp-shard " + sug.changes[1].value;
      out.sharding_ladder.push_back({name, sug.at_one->fits, std::nullopt});
      if (sug.at_one->fits) out.sharding_ladder.back().largest = s.largest(cap_for(c, out.solve, r));
    }
    if (!answer && sug.saves <= 0 && !sug.at_one->fits) {
      out.not_helpful.push_back(sug.changes);  // it would cost memory, or save none, here
      return;
    }
    sug.largest = s.largest(cap_for(c, out.solve, r));
    if (answer && sug.largest.value_or(0) <= *answer) {
      out.not_helpful.push_back(sug.changes);  // the answer stays as it is
      return;
    }
    out.suggestions.push_back(std::move(sug));
  };
  std::vector<FieldChange> all_changes;
  Candidate all = base;

  // (FSDP2 under --pp, or over the sequence-parallel model, is torchtitan's training.dtype float32 only:
  // resolve_pp_fsdp, resolve_sp_fsdp)
  const bool pp_fsdp = torchtitan_fsdp2(base.setup);
  if ((base.setup.precision == Precision::kFp32 || uses_autocast(base.setup.precision)) && !pp_fsdp) {
    Candidate c = base;
    c.setup.precision = Precision::kBf16;
    add({{"precision", "bf16"}}, "weights, gradients and optimizer state in bfloat16 (model.to(torch.bfloat16))", c);
    all.setup.precision = Precision::kBf16;
    all_changes.push_back({"precision", "bf16"});
  }
  // (autocast is refused under --pp: torchtitan's mixed precision there is FSDP's)
  if (base.setup.precision == Precision::kFp32 && base.setup.pp <= 1 && !pp_fsdp) {
    Candidate c = base;
    c.setup.precision = Precision::kBf16Amp;
    add({{"precision", "bf16-amp"}}, "bfloat16 autocast: 16-bit activations, float32 weights and optimizer state", c);
  }
  // T5Attention has one (eager) code path: no SDPA to switch to
  if (base.model.attn_impl == AttnImpl::kEager && base.model.family != Family::kT5) {
    Candidate c = base;
    c.model.attn_impl = AttnImpl::kSdpa;
    c.inv = same_rows_as(base.inv, build_inventory(c.model));
    add({{"attention", "sdpa"}}, "scaled_dot_product_attention: no (B, H, T, T) scores or probabilities kept", c);
    all.model.attn_impl = AttnImpl::kSdpa;
    all.inv = same_rows_as(base.inv, build_inventory(all.model));
    all_changes.push_back({"attention", "sdpa"});
  }
  const bool adam = base.setup.optimizer == Optimizer::kAdamW || base.setup.optimizer == Optimizer::kAdam;
  if (adam && resolve_optimizer_impl(base.setup.optimizer, base.setup.optimizer_impl, base.model.impl) ==
                  OptimizerImpl::kForeach) {
    Candidate c = base;
    c.setup.optimizer_impl = OptimizerImpl::kFused;
    add({{"optimizer_impl", "fused"}}, "fused=True: the step needs no multi-tensor temporaries", c);
    all.setup.optimizer_impl = OptimizerImpl::kFused;
    all_changes.push_back({"optimizer_impl", "fused"});
  }
  if (!base.alloc.expandable_segments) {
    Candidate c = base;
    c.alloc.expandable_segments = true;
    add({{"alloc_conf", "expandable_segments:True"}},
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: segments grow in place, less fragmentation", c);
    all.alloc.expandable_segments = true;
    all_changes.push_back({"alloc_conf", "expandable_segments:True"});
  }
  // (inference records no graph: checkpointing has nothing to save there)
  // (T5: checkpointing its blocks is not simulated yet, t5_forward refuses it)
  if (base.setup.checkpointing == Checkpointing::kNone && base.setup.task == Task::kTrain &&
      base.model.family != Family::kT5) {
    Candidate c = base;
    c.setup.checkpointing = Checkpointing::kFull;
    add({{"checkpointing", "full"}},
        "gradient checkpointing of every layer: each keeps only its input, backward recomputes it (one more "
        "forward of compute)", c);
    all.setup.checkpointing = Checkpointing::kFull;
    all_changes.push_back({"checkpointing", "full"});
    // torchtitan's selective AC: between none and full, keeping the matmul and attention outputs. Not part
    // of "all of the above", which takes full; not with a 4-bit base, which resolve() refuses for selective,
    // nor under sequence parallelism (sp.h), whose selective policy resolve() refuses too. (Under --cp the policy
    // keeps the ring's outputs: cp_attention.cc.)
    if (base.setup.quant.type == Quantize::kNone && !base.model.sp) {
      Candidate sel = base;
      sel.setup.checkpointing = Checkpointing::kSelective;
      sel.setup.checkpoint_reentrant = false;
      add({{"checkpointing", "selective"}},
          "torchtitan's op-level selective checkpointing: layers keep their matmul (all but every second mm) and "
          "attention outputs and recompute the rest in backward", sel);
    }
  }
  if (all_changes.size() > 1) add(all_changes, "all of the above together", all);
  // Several ranks of DDP: the shardings, least sharded first (the "smallest sharding that fits" is the first of
  // them that does): DeepSpeed ZeRO partitions the optimizer state (stage 1), the gradients (stage 2) and the
  // parameters (stage 3) over them, FSDP2 all three per parameter. Offered where that rank is simulated
  // (resolve_zero: the Trainer's loop, torch Adam(W), bf16 weights, no 4-bit base, ZeRO's own bf16 precision going
  // with it; resolve_fsdp: accelerate's fully_shard over a Llama-shaped model, its own mixed precision).
  if (base.setup.dp > 1 && base.setup.sharding == Sharding::kDdp) {
    struct Rung {
      Sharding sharding;
      const char* name;
      bool bf16;  // ZeRO runs bf16 weights; FSDP2 keeps the setup's precision (accelerate's MixedPrecisionPolicy)
      const char* what;
    };
    constexpr Rung kLadder[] = {
        {Sharding::kZero1, "zero1", true, "DeepSpeed ZeRO-1: optimizer state partitioned over the ranks"},
        {Sharding::kZero2, "zero2", true, "DeepSpeed ZeRO-2: optimizer state and gradients partitioned over the ranks"},
        {Sharding::kFsdp2, "fsdp2", false, "FSDP2 (accelerate's fully_shard): parameters, gradients and optimizer "
                                           "state sharded per parameter, each layer gathered when it runs"},
        {Sharding::kFsdp1, "fsdp1", false, "FSDP1 (accelerate's FullyShardedDataParallel): one flat parameter per "
                                           "layer and the root, sharded, each gathered when it runs"},
        {Sharding::kZero3, "zero3", true, "DeepSpeed ZeRO-3: parameters, gradients and optimizer state partitioned, "
                                          "gathered per module"},
    };
    for (const Rung& rung : kLadder) {
      Candidate c = base;
      c.setup.sharding = rung.sharding;
      if (rung.bf16) c.setup.precision = Precision::kBf16;
      // the DDP settings do not apply to these ranks
      c.setup.bucket_cap_mb.reset();
      c.setup.gradient_as_bucket_view.reset();
      c.setup.find_unused_parameters.reset();
      // FSDP2 is simulated with non-reentrant checkpointing (resolve_fsdp): a reentrant setup (QLoRA's
      // prepare_model_for_kbit_training turns it on) takes use_reentrant=False with it, a change the row names
      const bool to_non_reentrant = rung.sharding == Sharding::kFsdp2 && reentrant_checkpointing(c.setup, c.model.impl);
      if (to_non_reentrant) c.setup.checkpoint_reentrant = false;
      try {
        if (rung.sharding == Sharding::kFsdp2) {
          (void)resolve_fsdp(c.setup, c.model, c.options.loop, c.options.torch);
        } else if (rung.sharding == Sharding::kFsdp1) {
          (void)resolve_fsdp1(c.setup, c.model, c.options.loop, c.options.torch);
        } else {
          (void)resolve_zero(c.setup, c.options.loop, c.options.torch);
        }
      } catch (const Error&) {
        continue;  // not simulated for this setup
      }
      // HSDP (fsdp.h), the rung before FSDP2: the same fully_shard, sharded within a node (K = the node's
      // data-parallel ranks, tensor and context parallel being the inner mesh dimensions) and replicated across
      // nodes; offered where the data-parallel ranks span nodes in whole nodes (1 < K < dp, K divides dp)
      const uint64_t k = hsdp_node_shard_degree(c.setup.dp, base.setup.tp, base.setup.cp, base.setup.nccl.gpus_per_node);
      if (rung.sharding == Sharding::kFsdp2 && k > 0) {
        Candidate h = c;
        h.setup.dp_shard = k;
        std::vector<FieldChange> hsdp{{"sharding", "fsdp2"}, {"dp_shard", std::to_string(k)}};
        if (to_non_reentrant) hsdp.push_back({"checkpoint_reentrant", "false"});
        add(std::move(hsdp),
            fmt::format("HSDP (FSDP2 over a {} x {} dp_replicate x dp_shard mesh): parameters, gradients and optimizer "
                        "state sharded over a node's {} ranks, replicated across the {} nodes",
                        c.setup.dp / k, k, k, c.setup.dp / k),
            h);
      }
      std::vector<FieldChange> changes{{"sharding", rung.name}};
      if (rung.bf16 && base.setup.precision != Precision::kBf16) changes.push_back({"precision", "bf16"});
      if (to_non_reentrant) changes.push_back({"checkpoint_reentrant", "false"});
      add(std::move(changes), rung.what, c);
    }
    for (const FitResult::ShardingTry& t : out.sharding_ladder) {
      if (t.fits) {
        out.smallest_sharding = t.sharding;
        break;
      }
    }
  }
  // --cp N with the weights replicated on the CP ranks (accelerate's ACCELERATE_ALLOW_CP_STANDALONE path): FSDP2
  // over the flattened dp x cp mesh, as accelerate and torchtitan run context parallel (fsdp.h fsdp2_mesh_ranks)
  if (base.setup.cp > 1 && base.setup.sharding != Sharding::kFsdp2) {
    Candidate c = base;
    c.setup.sharding = Sharding::kFsdp2;
    bool simulated = true;
    try {
      (void)resolve_fsdp(c.setup, c.model, c.options.loop, c.options.torch);
    } catch (const Error&) {
      simulated = false;  // not simulated for this setup
    }
    if (simulated) {
      add({{"sharding", "fsdp2"}}, "FSDP2 over the dp x cp ranks (accelerate's dp_shard_cp mesh): parameters, "
                                   "gradients and optimizer state sharded over the context-parallel ranks too", c);
      for (const FitResult::ShardingTry& t : out.sharding_ladder) {
        if (t.fits) {
          out.smallest_sharding = t.sharding;
          break;
        }
      }
    }
  }
  // (not under context or sequence parallelism: their lengths must divide by 2 x cp or tp, and the resolved
  // setup's --seq under --cp is the rank's share; fit refuses solving for seq with them)
  if (!answer && out.solve == FitDimension::kBatch && base.setup.seq > 1 && budget.events < kFitEventBudget &&
      base.setup.cp <= 1 && !base.setup.sequence_parallel) {
    // The other dimension: the longest sequence that fits one sequence per micro-batch.
    Candidate c = base;
    c.setup.batch = 1;
    Search s(c, gpu, margin, FitDimension::kSeq, budget);
    FitSuggestion sug;
    const auto longest = s.largest(base.setup.seq - 1);
    sug.changes = {{"seq", std::to_string(longest.value_or(1))}};
    sug.at_one = s.probe(longest.value_or(1));
    // Why not even one token fits: where the step at one token runs out of memory, in the simulation's words
    // (the optimizer's temporaries can be what does not fit, not the model state).
    sug.what = longest ? "the longest sequence below the requested one that fits at micro-batch 1"
                       : "not even a one-token sequence fits: " + sug.at_one->failure;
    sug.saves = saves(*sug.at_one);
    if (longest) sug.largest = 1;
    out.suggestions.push_back(std::move(sug));
  }
}

}  // namespace

FitResult fit(const ModelSpec& m, const TrainSetup& s0, const SimOptions& o, const AllocatorConfig& ac,
              const GpuSpec& gpu, const FitRequest& r) {
  return fit(m, build_inventory(m), s0, o, ac, gpu, r);
}

FitResult fit(const ModelSpec& m, const Inventory& inv, const TrainSetup& s0, const SimOptions& o,
              const AllocatorConfig& ac, const GpuSpec& gpu, const FitRequest& r) {
  if (r.solve == FitDimension::kSeq && input_kind(m) == InputKind::kFeatures) {
    throw FieldError("solve", fmt::format("seq: {} is a layer stack, which has no sequence axis; solve for the batch",
                            m.name));
  }
  // The solved size is the search's to choose: the setup is checked at the smallest one.
  TrainSetup s = s0;
  (r.solve == FitDimension::kBatch ? s.batch : s.seq) = 1;
  validate_setup(m, s);
  Candidate base{m, inv, s, resolved(o, m), ac};
  base.options.sm = gpu.sm;
  base.options.multiprocessors = gpu.multiprocessors;
  FitResult out;
  out.model = m;
  out.setup = s;
  out.setup.optimizer_impl = resolve_optimizer_impl(s.optimizer, s.optimizer_impl, m.impl);
  out.options = base.options;
  out.solve = r.solve;
  out.gpu = gpu;
  out.margin = r.margin.of(gpu);
  out.nccl = nccl_ledger(process_groups(out.setup), gpu, out.setup.nccl);
  const NcclLedger& nccl = out.nccl;
  out.limit = usable_bytes(gpu, out.margin, nccl);
  if (out.limit.value == 0) {
    throw FieldError("margin", fmt::format("{}: with the {} CUDA context and {} of NCCL buffers it leaves nothing of "
                                           "the {}'s {} for PyTorch", r.margin.describe(), format_bytes(gpu.context),
                                           format_bytes(nccl.total), gpu.name, format_bytes(gpu.runtime_total)));
  }
  out.cap = cap_for(base, r.solve, r);
  Budget budget;
  Search search(base, gpu, out.margin, r.solve, budget);
  out.largest = search.largest(out.cap);
  out.capped = out.largest && *out.largest == out.cap;
  out.probes = search.probes();
  (r.solve == FitDimension::kBatch ? out.setup.batch : out.setup.seq) = out.largest.value_or(1);
  // the probe of size 1 is the first; when the answer is capped nothing can raise it
  if (!out.capped) suggest(base, out.probes.front(), out.largest, gpu, out.margin, r, budget, out);
  return out;
}

FitResult fit(const Scenario& s0, const FitRequest& r, const FileReader& files) {
  Scenario s = s0;
  // The solved size is the search's to find; the other one is given (the micro-batch defaults to 1 when
  // solving for the sequence).
  if (r.solve == FitDimension::kBatch && s.was_given("batch")) {
    throw FieldError("batch", fmt::format("{}: fit finds the micro-batch; leave it out, or keep it and find the "
                                          "sequence by solving for seq", s.train.batch));
  }
  if (r.solve == FitDimension::kSeq && s.was_given("seq")) {
    throw FieldError("seq", fmt::format("{}: when solving for seq, fit finds the sequence length; leave it out",
                                        s.train.seq));
  }
  if (r.solve == FitDimension::kSeq && s.train.sequence_parallel) {
    // sequence parallelism (sp.h) simulates sequences that divide by --tp; the search tries every length
    throw FieldError("sequence_parallel", "true: fit's search over sequence lengths is not simulated with sequence "
                                          "parallelism (the lengths must divide by --tp); solve for batch at a given --seq");
  }
  if (r.solve == FitDimension::kSeq && s.train.cp > 1) {
    // context parallel (cp.h) shards sequences that divide by 2 x --cp (the head-tail load balancer); the search
    // tries every length
    throw FieldError("cp", fmt::format("{}: fit's search over sequence lengths is not simulated with context "
                                       "parallelism (the lengths must divide by 2 x --cp); solve for batch at a given "
                                       "--seq", s.train.cp));
  }
  if (r.solve == FitDimension::kSeq && !s.was_given("batch")) s.train.batch = 1;
  (r.solve == FitDimension::kBatch ? s.train.batch : s.train.seq) = 1;  // checked at the smallest size
  if (s.train.gpu.empty() && s.gpus.empty()) {
    throw FieldError("gpu", "\"\": expected a GPU from the catalog (trainmem gpus), or --gpus NxGPU: fit needs a "
                            "device");
  }
  const ResolvedScenario rs = resolve(s, files);
  FitResult out = fit(rs.model, rs.inventory, rs.setup, rs.options, rs.alloc, *rs.gpu, r);
  out.warnings = rs.warnings;
  return out;
}

}  // namespace trainmem
