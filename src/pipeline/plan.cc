// trainmem plan (plan.h): enumerate the ways to run a step on a cluster, simulate those that can fit, rank by the
// step time. Every rule lives in resolve(), estimate() and step_time(); this file only chooses setups, bounds the
// search and orders the answers.
#include "trainmem/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <tuple>
#include <atomic>
#include <mutex>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "trainmem/error.h"
#include "trainmem/estimate.h"
#include "trainmem/fsdp.h"
#include "trainmem/units.h"

namespace trainmem {

namespace {

// The work one plan may do, in simulated events over all its estimates (a pipeline's ranks each count): eight times
// fit's bound on work (kFitEventBudget, fit.cc). A 70B estimate at 80 layers (two steps) is about 40,000 events, so
// this is some 1,600 single-rank estimates (a pipeline rank's, with every micro-batch, takes several times more).
// The README's 70B plan on 64 H100s uses more than half of it (4 s on two cores): it outgrew the earlier 2^25 when
// the reduction kernels' staging buffers (cuda_reduce.h) added their events. Reaching it ends the search, and the
// families not tried are listed as such.
inline constexpr uint64_t kPlanEventBudget = uint64_t{1} << 26;  // 67,108,864
// A pipeline's estimate simulates every stage over every micro-batch (the schedule's receive buffers and output
// chunks are one per micro-batch, so no micro-batch stands for another): plan tries only splits of at most this
// many stage micro-batches (stages x micro-batches), about a third of a second of simulation for a 70B model. A
// pipeline of more than 8 stages needs more even at the fewest micro-batches its schedule takes (one per stage).
inline constexpr uint64_t kPlanPipelineWork = 64;
// Worker threads of the screening pass (at most the machine's cores).
inline constexpr unsigned kPlanThreads = 4;

// The fields plan chooses. A user who gives one keeps it in every setup (the search is over the rest); the
// data-parallel size and the accumulation follow from --gpus and --global-batch and cannot be given.
constexpr std::string_view kChosen[] = {"tp", "pp", "cp", "sharding", "dp_shard", "checkpointing", "precision",
                                        "optimizer_impl", "pp_schedule", "pp_virtual_stages", "batch"};
constexpr std::string_view kDerived[] = {"dp", "grad_accum", "micro_batches", "gpu"};
// Fields of a data-parallel or pipeline layout, left out of the reference simulation (one rank, one micro-batch),
// where resolve() refuses them (they apply with --dp or --pp above 1).
constexpr std::string_view kLayoutFields[] = {
    "gpus", "sharding", "bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "reduce_bucket_size",
    "overlap_comm", "offload", "param_persistence_threshold", "prefetch_bucket_size", "max_live_parameters",
    "max_reuse_distance", "reshard_after_forward", "fsdp1_prefetch", "pp", "pp_schedule", "micro_batches",
    "pp_virtual_stages", "rank", "dp_rank", "cp_rank", "batch", "nccl_channels", "nccl_nvls", "gpus_per_node", "nccl_tree",
    "nccl_gdr", "dp_shard"};

bool contains(std::span<const std::string_view> names, std::string_view f) {
  return std::find(names.begin(), names.end(), f) != names.end();
}

std::vector<uint64_t> divisors(uint64_t n) {
  std::vector<uint64_t> out;
  for (uint64_t d = 1; d <= n && d <= (uint64_t{1} << 32); ++d) {
    if (n % d == 0) out.push_back(d);
    if (d > 1 && d * d > n) break;
  }
  // the small ones found up to sqrt(n); their partners complete the list
  const size_t k = out.size();
  for (size_t i = 0; i < k; ++i) {
    const uint64_t p = n / out[i];
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<uint64_t> powers_of_two_dividing(uint64_t n, uint64_t max) {
  std::vector<uint64_t> out;
  for (uint64_t v = 1; v <= max && n % v == 0; v *= 2) out.push_back(v);
  return out;
}

// A family the library refuses: its verdict with the library's words (a FieldError's field apart, for the front
// end to name as its flag).
void refuse(PlanFamily& f, const Error& e) {
  f.verdict = PlanVerdict::kRefused;
  if (const auto* fe = dynamic_cast<const FieldError*>(&e)) {
    f.why_field = fe->field();
    f.why = fe->detail();
  } else {
    f.why = e.what();
  }
}

// One simulated setup.
struct Probe {
  bool fits = false;
  uint64_t retries = 0;  // times the allocator released its cache to stay within the limit
  int64_t headroom = 0;
  Bytes reserved, device_total;
  std::optional<uint64_t> worst;
  std::optional<StepTime> time;
  std::string failure;
};

class Planner {
 public:
  Planner(std::vector<FieldChange> given, const PlanRequest& r, const FileReader& files)
      : given_(std::move(given)), req_(r), files_(files) {}

  PlanResult run();

 private:
  bool given(std::string_view f) const {
    return std::any_of(given_.begin(), given_.end(), [&](const FieldChange& c) { return c.field == f; });
  }
  std::string given_value(std::string_view f) const {
    std::string v;
    for (const FieldChange& c : given_) {
      if (c.field == f) v = c.value;
    }
    return v;
  }
  // The user's fields with plan's on top (plan_fields). The reference of a compute class (one rank, one
  // micro-batch of one sequence) drops the user's layout fields.
  Scenario scenario(const std::vector<FieldChange>& changes, bool reference = false) const {
    std::vector<FieldChange> user;
    for (const FieldChange& c : given_) {
      if (!reference || !contains(kLayoutFields, c.field)) user.push_back(c);
    }
    return scenario_from(plan_fields(user, changes));
  }
  std::optional<PlanRow> search(PlanFamily& f);
  // Whether resolve() refuses the family at its smallest micro-batch (then its verdict says why).
  bool refused(PlanFamily& f) const {
    try {
      resolve(scenario(f.setup.changes()), files_);
      return false;
    } catch (const Error& e) {
      refuse(f, e);
    }
    return true;
  }
  // sequences per data-parallel rank per step
  uint64_t rank_batch(const PlanSetup& p) const { return req_.global_batch / p.dp; }
  void try_foreach(PlanRow& row);
  Probe simulate(const PlanSetup& p);
  double bound_seconds(const PlanSetup& p, uint64_t micro_batch);
  std::optional<double> class_seconds_per_sequence(const PlanSetup& p);

  std::vector<FieldChange> given_;
  PlanRequest req_;
  const FileReader& files_;
  GpuSpec gpu_;
  Bytes margin_;
  uint64_t seq_ = 0;
  // counted by every simulation, from the worker threads too
  std::atomic<uint64_t> events_ = 0, simulations_ = 0, references_ = 0;
  std::mutex classes_mu_;
  // the products of one sequence on one rank, per compute class (tp, cp, checkpointing, precision)
  std::map<std::tuple<uint64_t, uint64_t, Checkpointing, Precision>, std::optional<double>> classes_;
};

Probe Planner::simulate(const PlanSetup& p) {
  const ResolvedScenario r = resolve(scenario(p.changes()), files_);
  const bool pipeline = r.setup.pp > 1;
  // ZeRO-1/2: estimate simulates every class of alike ranks to name the worst (estimate.cc estimate_zero_ranks).
  // One rank that does not fit already rules the setup out, so the fullest partition's rank is tried first and
  // the others only when it fits; a setup ruled out so shows that rank's shortfall (the worst rank's is no less).
  const TrainSetup& s = r.setup;
  if (s.dp > 1 && !s.dp_rank && (s.sharding == Sharding::kZero1 || s.sharding == Sharding::kZero2)) {
    TrainSetup fullest = s;
    fullest.dp_rank = zero_fullest_rank(zero_group_numels(r.inventory), s.dp).rank;
    const Estimate e = estimate(r.model, r.inventory, fullest, r.options, r.alloc);
    events_ += e.sim->timeline.events.size();
    ++simulations_;
    const DeviceVerdict v = device_verdict(e, gpu_, r.alloc, margin_);
    if (!v.fits) {
      Probe out;
      out.fits = false;
      out.retries = v.alloc_retries;
      out.headroom = v.headroom;
      if (v.oom) out.failure = fmt::format("out of memory in {} on rank {}", v.oom->tensor, *fullest.dp_rank);
      return out;
    }
  }
  // as fit probes: without the device limit, then the verdict replayed with it (a pipeline decides its worst
  // rank on the device, so it is given the GPU)
  const Estimate e = pipeline ? estimate(r.model, r.inventory, r.setup, r.options, r.alloc, &gpu_, margin_)
                              : estimate(r.model, r.inventory, r.setup, r.options, r.alloc);
  const uint64_t ranks = pipeline ? e.pp->ranks : e.zero && !e.zero->rank_rows.empty() ? e.zero->rank_rows.size() : 1;
  events_ += checked_mul(e.sim->timeline.events.size(), ranks, "events");
  simulations_ += ranks;
  const DeviceVerdict v = pipeline ? *e.device : device_verdict(e, gpu_, r.alloc, margin_);
  Probe out;
  out.fits = v.fits;
  out.retries = v.alloc_retries;
  out.headroom = v.headroom;
  if (pipeline) out.worst = e.pp->worst;
  if (v.fits) {
    out.reserved = v.peak_reserved;
    out.device_total = v.peak_reserved + gpu_.context + v.nccl.total;
    out.time = e.time ? e.time : step_time(e, gpu_);
  } else if (v.oom) {
    out.failure = fmt::format("out of memory in {}", v.oom->tensor);
  }
  return out;
}

// The products (matmuls and attention) of one sequence on a rank of this compute class, in seconds at the
// roofline's product rate: one reference simulation of a single micro-batch of one sequence on one data-parallel
// rank (the products do not depend on the sharding, and their FLOPs are linear in the micro-batch). Under a
// pipeline the class is the whole model's (the stages together compute what one rank does without it); its mixed
// precision is FSDP's bf16 parameters, whose products are autocast's. Empty when the reference is refused: the
// family is then tried without a bound.
std::optional<double> Planner::class_seconds_per_sequence(const PlanSetup& p) {
  // torchtitan's FSDP2 (fp32 parameters, bf16 compute): autocast's products
  const Precision compute = p.mixed && p.precision == Precision::kFp32 ? Precision::kBf16Amp : p.precision;
  const auto key = std::make_tuple(p.tp, p.cp, p.checkpointing, compute);
  {
    std::lock_guard<std::mutex> lock(classes_mu_);
    auto it = classes_.find(key);
    if (it != classes_.end()) return it->second;
  }
  std::optional<double> out;
  try {
    std::vector<FieldChange> changes = {{"gpu", gpu_.name},
                                        {"tp", std::to_string(p.tp)},
                                        {"cp", std::to_string(p.cp)},
                                        {"checkpointing", std::string(name_of(p.checkpointing))},
                                        {"precision", std::string(precision_name(compute))},
                                        {"batch", "1"},
                                        {"grad_accum", "1"}};
    const ResolvedScenario r = resolve(scenario(changes, /*reference=*/true), files_);
    const Estimate e = estimate(r.model, r.inventory, r.setup, r.options, r.alloc);
    events_ += e.sim->timeline.events.size();
    ++references_;
    if (!e.sim->flops.overflow) out = products_seconds(e.sim->flops, gpu_.perf);
  } catch (const Error&) {
    // refused as a reference (a rule that depends on the layout): no bound for the class
  }
  std::lock_guard<std::mutex> lock(classes_mu_);
  classes_.emplace(key, out);
  return out;
}

// The least time a step of setup `p` at micro-batch `micro_batch` can take (plan.h).
double Planner::bound_seconds(const PlanSetup& p, uint64_t micro_batch) {
  const std::optional<double> per_seq = class_seconds_per_sequence(p);
  if (!per_seq) return 0;
  const double l = static_cast<double>(rank_batch(p));
  if (p.pp <= 1) return *per_seq * l;
  // step_time's pipeline (pipeline_step_time): M * max_r(f_r + b_r) + the other ranks' sum of (f_r + b_r) / v,
  // at least (M + (p - 1) / v) / p of one micro-batch of the whole model (max >= the mean), M = L / micro-batch
  const double pp = static_cast<double>(p.pp), mb = static_cast<double>(micro_batch);
  const double v = static_cast<double>(std::max<uint64_t>(p.virtual_stages, 1));
  return *per_seq * (l + (pp - 1) * mb / v) / pp;
}


// The precisions searched for a layout, each as its framework spells mixed and pure bf16 training:
// - DeepSpeed ZeRO: bf16 {enabled: true} is its mixed precision (bf16 parameters, fp32 master partitions in the
//   optimizer; estimate refuses autocast under it), and it has no pure bf16 mode;
// - torchtitan's FSDP2 (`titan`: data-parallel ranks under a pipeline, or over the TP + SP model): training.dtype
//   float32 with FSDP2's bf16 MixedPrecisionPolicy (--precision fp32; autocast and bf16 are refused there);
// - torchtitan's pipeline without FSDP2: only training.dtype bf16, pure;
// - otherwise torch.autocast(bf16) over fp32 weights (mixed) and model.to(bfloat16) (pure).
std::vector<Precision> precision_choices(bool zero, bool titan, uint64_t pp) {
  if (zero) return {Precision::kBf16};
  if (titan) return {Precision::kFp32};
  if (pp > 1) return {Precision::kBf16};
  return {Precision::kBf16Amp, Precision::kBf16};
}
// --precision bf16-amp given: mixed precision, as each framework runs it (DeepSpeed's bf16 with fp32 masters under
// ZeRO; torchtitan's fp32 parameters with FSDP2's bf16 policy); any other precision as given.
Precision given_precision(Precision p, bool zero, bool titan) {
  if (p != Precision::kBf16Amp) return p;
  if (zero) return Precision::kBf16;
  if (titan) return Precision::kFp32;
  return p;
}
bool is_mixed(Precision p, bool zero, bool titan) {
  if (p == Precision::kBf16Amp || p == Precision::kFp16Amp) return true;
  if (p == Precision::kBf16 && zero) return true;
  return p == Precision::kFp32 && titan;
}

double tokens_per_second(uint64_t global_batch, uint64_t seq, double seconds) {
  return seconds > 0 ? static_cast<double>(global_batch) * static_cast<double>(seq) / seconds
                     : std::numeric_limits<double>::infinity();
}

// Why the first row is first, dimension by dimension: against the fastest row that differs from it in each searched
// dimension, how much slower that one is and where it spends the time the first does not (the step time's parts:
// forward, backward, recompute, optimizer kernels, exposed communication, and what else the schedule adds); where
// no row differs in checkpointing or sharding, what became of the lighter checkpointing and the other shardings of
// the first row's layout (does not fit, refused, no time).
std::string time_difference(const StepTime& a, const StepTime& b) {
  auto parts = [](const StepTime& t) {
    std::vector<std::pair<std::string, double>> v = {{"forward", t.phase_seconds[0]},
                                                     {"backward", t.phase_seconds[1]},
                                                     {"recompute", t.phase_seconds[2]},
                                                     {"the optimizer step", t.phase_seconds[3]},
                                                     {"exposed communication", t.comm_exposed_seconds}};
    double rest = t.step_seconds;
    for (const auto& [name, sec] : v) rest -= sec;
    v.push_back({"the pipeline's bubble and sends", std::max(0.0, rest)});
    return v;
  };
  const auto pa = parts(a), pb = parts(b);
  std::vector<std::pair<double, std::string>> diffs;
  for (size_t i = 0; i < pa.size(); ++i) {
    const double d = pb[i].second - pa[i].second;
    if (d * 1e3 >= 0.05) diffs.push_back({d, pa[i].first});
  }
  std::sort(diffs.rbegin(), diffs.rend());
  std::string why;
  for (size_t i = 0; i < diffs.size() && i < 2; ++i) {
    why += fmt::format("{}{:.1f} ms more in {}", i ? ", " : "", diffs[i].first * 1e3, diffs[i].second);
  }
  return why;
}

std::vector<std::string> best_reasons(const PlanResult& r) {
  std::vector<std::string> out;
  if (r.rows.empty()) return out;
  const PlanRow& a = r.rows[0];
  out.push_back(fmt::format("{}, micro-batch {} x {}: the fastest of {} setups that fit, {} tokens/s, MFU {:.1f}%",
                            plan_family_name(a.setup), a.setup.batch, a.setup.accumulation, r.ranked_total,
                            with_commas(static_cast<uint64_t>(a.time.tokens_per_second + 0.5)), a.time.mfu * 100));
  if (r.rows.size() > 1) {
    const PlanRow& b = r.rows[1];
    const double pct = (1 - b.time.tokens_per_second / a.time.tokens_per_second) * 100;
    const std::string why = time_difference(a.time, b.time);
    out.push_back(fmt::format("against #2 ({}, micro-batch {} x {}): {} fewer tokens/s{}", plan_family_name(b.setup),
                              b.setup.batch, b.setup.accumulation,
                              pct >= 0.1 ? fmt::format("{:.1f}%", pct) : fmt::format("{:.3f}%", pct),
                              why.empty() ? "" : "; it spends " + why));
  }
  using Dim = std::pair<const char*, std::function<std::string(const PlanSetup&)>>;
  const std::vector<Dim> dims = {
      {"tp", [](const PlanSetup& p) { return std::to_string(p.tp); }},
      {"pp", [](const PlanSetup& p) { return std::to_string(p.pp); }},
      {"cp", [](const PlanSetup& p) { return std::to_string(p.cp); }},
      {"sharding", [](const PlanSetup& p) {
         const std::string n = plan_sharding_name(p);
         return n.empty() ? std::string("none") : n;
       }},
      {"checkpointing", [](const PlanSetup& p) { return std::string(name_of(p.checkpointing)); }},
      {"precision", [](const PlanSetup& p) { return plan_precision_name(p); }},
  };
  // the same as `a` but in dimension `d` (precision aside when d is the sharding: DeepSpeed's bf16 is its mixed
  // precision)
  auto differs_only_in = [&](const PlanSetup& p, size_t d) {
    if (dims[d].second(p) == dims[d].second(a.setup)) return false;
    for (size_t i = 0; i < dims.size(); ++i) {
      if (i == d || (std::string_view(dims[d].first) == "sharding" && std::string_view(dims[i].first) == "precision")) {
        continue;
      }
      if (dims[i].second(p) != dims[i].second(a.setup)) return false;
    }
    return true;
  };
  for (size_t d = 0; d < dims.size(); ++d) {
    const auto& [dim, value] = dims[d];
    bool found = false;
    for (size_t k = 1; k < r.rows.size() && !found; ++k) {
      const PlanRow& b = r.rows[k];
      if (!differs_only_in(b.setup, d)) continue;
      found = true;
      if (k == 1) continue;  // #2, said above
      const double pct = (1 - b.time.tokens_per_second / a.time.tokens_per_second) * 100;
      const std::string why = time_difference(a.time, b.time);
      out.push_back(fmt::format("against {} {} (#{}, micro-batch {} x {}): {} fewer tokens/s{}", dim, value(b.setup),
                                k + 1, b.setup.batch, b.setup.accumulation,
                                pct >= 0.1 ? fmt::format("{:.1f}%", pct) : fmt::format("{:.3f}%", pct),
                                why.empty() ? "" : "; it spends " + why));
    }
    // the other values of this dimension that have no row
    std::vector<std::string> others;
    std::vector<const PlanFamily*> candidates;  // the simulated ones first: their figure is their own
    for (const PlanFamily& f : r.families) {
      if (!f.screened) candidates.push_back(&f);
    }
    for (const PlanFamily& f : r.families) {
      if (f.screened) candidates.push_back(&f);
    }
    for (const PlanFamily* fp : candidates) {
      const PlanFamily& f = *fp;
      if (f.verdict == PlanVerdict::kRanked || !differs_only_in(f.setup, d)) continue;
      std::string what(plan_verdict_name(f.verdict));
      if (f.verdict == PlanVerdict::kDoesNotFit) {
        what = fmt::format("{}short by {} at micro-batch {}", f.screened ? "does not fit (a lighter variant is " : "",
                           format_bytes(Bytes(static_cast<uint64_t>(-f.best_headroom))), f.smallest_batch);
        if (f.screened) what += ")";
      }
      // one entry per value (DDP's pure and mixed variants say the same)
      const std::string v = value(f.setup);
      if (std::none_of(others.begin(), others.end(), [&](const std::string& o) { return o.rfind(v + " ", 0) == 0; })) {
        others.push_back(fmt::format("{} {}", v, what));
      }
    }
    if (!others.empty()) {
      std::string list;
      for (const std::string& o : others) list += (list.empty() ? "" : ", ") + o;
      out.push_back(fmt::format("{} otherwise: {}", dim, list));
    }
  }
  return out;
}

// One family: the micro-batches searched from 1 up (a family that does not fit one sequence costs one
// simulation), by doubling and bisection over the divisors of the rank's batch, as fit searches; its best timed
// setup becomes a row.
std::optional<PlanRow> Planner::search(PlanFamily& f) {
  const PlanSetup base = f.setup;
  const uint64_t rank_batch_ = rank_batch(base);
  std::vector<uint64_t> sizes;
  uint64_t cut = 0;  // the largest micro-batch left out for the pipeline's work (0: none)
  if (given("batch")) {
    sizes = {base.batch};
  } else {
    for (uint64_t d : divisors(rank_batch_)) {
      // a pipeline's schedule needs at least as many micro-batches as stages (PipelineScheduleSingle raises)
      if (base.pp > 1 && base.schedule != PpSchedule::kInterleaved1f1b && rank_batch_ / d < base.pp) continue;
      // and every rank simulates every micro-batch (the receive buffers are one per micro-batch, so they cannot be
      // extrapolated): micro-batches too small for plan's bound on a pipeline's work are left to estimate
      if (base.pp > 1 && checked_mul(base.pp, rank_batch_ / d, "pipeline work") > kPlanPipelineWork) {
        cut = d;
        continue;
      }
      sizes.push_back(d);
    }
  }
  if (sizes.empty()) {
    f.verdict = PlanVerdict::kBudget;
    f.why = fmt::format("every split of its {} sequences per rank into micro-batches needs more than {} stage "
                        "micro-batches ({} stages x micro-batches), plan's bound on a pipeline's work",
                        rank_batch_, kPlanPipelineWork, base.pp);
    return std::nullopt;
  }
  std::map<uint64_t, Probe> probes;
  auto probe = [&](size_t i) -> const Probe& {
    const uint64_t b = sizes[i];
    auto it = probes.find(b);
    if (it != probes.end()) return it->second;
    PlanSetup p = base;
    p.batch = b;
    p.accumulation = rank_batch_ / b;
    if (probes.empty()) return probes.emplace(b, simulate(p)).first->second;  // refused: the family is
    // a larger micro-batch that the library refuses (its sizes past 64 bits, past a bound) does not fit, as in fit
    Probe q;
    try {
      q = simulate(p);
    } catch (const Error& e) {
      q.failure = e.what();
    }
    return probes.emplace(b, q).first->second;
  };
  try {
    if (!probe(0).fits) {
      // Memory grows with the micro-batch but for accumulation's own buffers: accelerate's FSDP2 keeps every
      // unsharded gradient under no_sync from the first micro-batch to the last (fsdp.h), which one micro-batch
      // of the whole rank batch (no accumulation) does not; that one is tried too.
      if (base.sharding == Sharding::kFsdp2 && base.pp <= 1 && base.sharded() && sizes.size() > 1) probe(sizes.size() - 1);
    } else {
      size_t lo = 0, hi = sizes.size();  // lo fits; hi (when < size) does not
      for (size_t next = 1; next < sizes.size(); next = std::min(sizes.size() - 1, next * 2)) {
        if (!probe(next).fits) {
          hi = next;
          break;
        }
        lo = next;
        if (next == sizes.size() - 1) break;
      }
      while (hi < sizes.size() && hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        (probe(mid).fits ? lo : hi) = mid;
      }
      if (base.sharding == Sharding::kFsdp2 && base.pp <= 1 && base.sharded() && lo + 1 < sizes.size()) {
        probe(sizes.size() - 1);  // no accumulation (above)
      }
    }
  } catch (const Error& e) {
    refuse(f, e);
    return std::nullopt;
  }
  std::optional<PlanRow> found;
  bool fits = false;
  for (const auto& [b, p] : probes) {
    if (!p.fits) continue;
    fits = true;
    if (!p.time) continue;
    PlanRow row;
    row.setup = base;
    row.setup.batch = b;
    row.setup.accumulation = rank_batch_ / b;
    row.peak_reserved = p.reserved;
    row.device_total = p.device_total;
    row.headroom = p.headroom;
    row.pp_worst_rank = p.worst;
    row.alloc_retries = p.retries;
    row.time = *p.time;
    row.bound_tokens_per_second = tokens_per_second(req_.global_batch, seq_, bound_seconds(row.setup, b));
    if (!found || row.time.tokens_per_second > found->time.tokens_per_second) found = row;
  }
  const Probe& first = probes.begin()->second;
  if (!fits) {
    f.best_headroom = first.headroom;
    f.smallest_batch = probes.begin()->first;
    if (cut > 0) {
      // the smaller micro-batches that might fit were not simulated: not a "does not fit"
      f.verdict = PlanVerdict::kBudget;
      f.why = fmt::format("does not fit at micro-batch {} (short by {}); micro-batches of {} and less, more than {} "
                          "stage micro-batches, were not simulated", f.smallest_batch,
                          format_bytes(Bytes(static_cast<uint64_t>(-f.best_headroom))), cut, kPlanPipelineWork);
      return std::nullopt;
    }
    f.verdict = PlanVerdict::kDoesNotFit;
    f.why = first.failure;
    return std::nullopt;
  }
  if (!found) {
    f.verdict = PlanVerdict::kNoTime;
    f.why = "it fits, but step_time has no model of this setup's communication yet";
    return std::nullopt;
  }
  f.verdict = PlanVerdict::kRanked;
  f.setup = found->setup;
  return found;
}

// The same setup with torch.optim's foreach code path (plan searches with the fused kernels): a setup whose fused
// update does not fit would not fit foreach's either (the same state, and the foreach update's intermediates on
// top: torch/optim/adamw.py _multi_tensor_adamw), so it is tried for the ranked rows only.
void Planner::try_foreach(PlanRow& row) {
  if (given("optimizer_impl") || row.setup.optimizer_impl != OptimizerImpl::kFused) return;
  PlanSetup p = row.setup;
  p.optimizer_impl = OptimizerImpl::kForeach;
  try {
    const Probe q = simulate(p);
    PlanRow::Foreach f;
    f.fits = q.fits;
    f.peak_reserved = q.reserved;
    if (q.time) f.step_seconds = q.time->step_seconds;
    row.foreach = f;
  } catch (const Error&) {
    // foreach refused for this setup: the fused row stands alone
  }
}

PlanResult Planner::run() {
  for (std::string_view f : kDerived) {
    if (given(f)) {
      throw FieldError(std::string(f), fmt::format("{}: plan derives it (--gpus gives the GPU and the ranks, "
                                                   "--global-batch the accumulation); leave it out",
                                                   given_value(f)));
    }
  }
  if (!given("gpus")) throw FieldError("gpus", "missing: plan needs the cluster, like --gpus 64xh100-80gb");
  if (req_.global_batch == 0) {
    throw FieldError("global_batch", "missing: plan needs the sequences per optimizer step over the cluster");
  }
  const Scenario user = scenario({});
  if (user.train.task != Task::kTrain) {
    throw FieldError("task", fmt::format("{}: plan ranks training setups", name_of(user.train.task)));
  }
  // "64xh100-80gb" (set_field checked its form)
  const size_t x = user.gpus.find_first_of("xX");
  const uint64_t n = std::stoull(user.gpus.substr(0, x));
  try {
    gpu_ = resolve_gpu(user.gpus.substr(x + 1));
  } catch (const FieldError& e) {
    throw FieldError("gpus", fmt::format("{}: {}", user.gpus, e.detail()));
  }
  margin_ = req_.margin.of(gpu_);
  // as fit refuses it: a margin that leaves the caching allocator nothing (before NCCL's buffers, which depend on
  // the layout) is the request's mistake, not every family's
  if (usable_bytes(gpu_, margin_).value == 0) {
    throw FieldError("margin", fmt::format("{}: with the {} CUDA context it leaves nothing of the {}'s {} for "
                                           "PyTorch", req_.margin.describe(), format_bytes(gpu_.context), gpu_.name,
                                           format_bytes(gpu_.runtime_total)));
  }
  seq_ = user.train.seq;
  uint64_t per_node = user.train.nccl.gpus_per_node;
  if (req_.nodes > 0) {
    if (given("gpus_per_node")) {
      throw FieldError("nodes", fmt::format("{}: give --nodes or --gpus-per-node, not both", req_.nodes));
    }
    if (n % req_.nodes != 0) {
      throw FieldError("nodes", fmt::format("{}: {} GPUs do not spread evenly over {} nodes", req_.nodes, n, req_.nodes));
    }
    per_node = n / req_.nodes;
    given_.push_back({"gpus_per_node", std::to_string(per_node)});
  }
  // One rank of one sequence, without the layout (a layout the user fixed, --tp 2 over the default DDP, is the
  // search's to refuse): the model, and what no layout changes (a bad model, a sequence past the model's positions,
  // a bad override), the user's to fix, said up front as estimate says it rather than as every family's refusal.
  const ResolvedScenario model =
      resolve(scenario({{"gpu", gpu_.name}, {"batch", "1"}, {"grad_accum", "1"}}, /*reference=*/true), files_);
  // plan ranks by the step time: a card without datasheet peaks has none
  if (!gpu_.perf.known()) {
    throw FieldError("gpus", fmt::format("{}: plan ranks setups by their step time, and the catalog has no datasheet "
                                         "peaks for {} (trainmem gpus --format json: perf); fit answers what fits it",
                                         user.gpus, gpu_.name));
  }
  const uint64_t layers = model.model.layers;

  PlanResult out;
  out.model = model.model.name;
  out.gpu = gpu_;
  out.gpus = n;
  out.gpus_per_node = std::min(per_node, n);  // a cluster smaller than a node fills part of one
  out.global_batch = req_.global_batch;
  out.seq = seq_;
  out.margin = margin_;
  // in the field table's order, as scenario_from applies them (every front end then words the same command)
  out.given = given_;
  auto place = [](const std::string& name) {
    const auto fs = scenario_fields();
    return std::find_if(fs.begin(), fs.end(), [&](const Field& f) { return f.name == name; }) - fs.begin();
  };
  std::stable_sort(out.given.begin(), out.given.end(),
                   [&](const FieldChange& a, const FieldChange& b) { return place(a.field) < place(b.field); });
  for (std::string_view f : kChosen) {
    if (given(f)) out.fixed.push_back(fmt::format("{} {}", f, given_value(f)));
  }

  // HSDP (--sharding fsdp2 --dp-shard K, fsdp.h): each FSDP2 family of a layout gets a twin sharded within a node
  // and replicated across nodes, K = the data-parallel ranks of one node (per_node / (tp x cp): tensor and context
  // parallel are the inner mesh dimensions), where 1 < K < dp and K divides dp, placed right after it; without a
  // pipeline only (estimate simulates HSDP under one, with --dp-shard given: each pipeline family's probes simulate
  // every stage, and the twins' would spend plan's bound on work that FSDP2's own layouts need). The search grows
  // by one FSDP2 family per multi-node layout without a pipeline: its 5 shardings become 6. A --dp-shard K the user
  // gives keeps the FSDP2 families whose dp K divides (K = dp: FSDP2 over the whole dp), and only them.
  // A layout with cp > 1 gets no twin (hsdp_node_shard_degree: HSDP over dp_shard x cp is simulated when asked,
  // not searched), but keeps its FSDP2 families under a given --dp-shard (apply_hsdp_mesh: the (dp_replicate,
  // dp_shard_cp) mesh); a given --dp-shard drops layouts without data parallelism.
  const auto add_hsdp = [&](std::vector<PlanFamily>& fams, size_t first, uint64_t dp, uint64_t tp, uint64_t pp,
                            uint64_t cp) {
    if (given("dp_shard") && dp <= 1) {
      fams.resize(first);
      return;
    }
    if (dp <= 1) return;
    if (given("dp_shard")) {
      const uint64_t k = user.train.dp_shard.value_or(0);
      std::vector<PlanFamily> kept(fams.begin(), fams.begin() + static_cast<std::ptrdiff_t>(first));
      for (size_t i = first; i < fams.size(); ++i) {
        if (fams[i].setup.sharding != Sharding::kFsdp2 || k < 2 || k > dp || dp % k != 0) continue;
        kept.push_back(fams[i]);
        kept.back().setup.dp_shard = k;
      }
      fams = std::move(kept);
      return;
    }
    const uint64_t k = hsdp_node_shard_degree(dp, tp, cp, per_node);
    if (pp > 1 || k == 0) return;
    std::vector<PlanFamily> twinned(fams.begin(), fams.begin() + static_cast<std::ptrdiff_t>(first));
    for (size_t i = first; i < fams.size(); ++i) {
      twinned.push_back(fams[i]);
      if (fams[i].setup.sharding != Sharding::kFsdp2) continue;
      twinned.push_back(fams[i]);
      twinned.back().setup.dp_shard = k;
    }
    fams = std::move(twinned);
  };

  // The families, in the enumeration's order (the least parallel first: the tie-break among equal bounds).
  std::vector<PlanFamily> families;
  const bool torch_optim = is_torch_optim(user.train.optimizer);
  // tensor (and context) parallel groups of consecutive ranks stay within a node only when they divide it
  const std::vector<uint64_t> tps = given("tp") ? std::vector<uint64_t>{user.train.tp} : powers_of_two_dividing(n, per_node);
  for (uint64_t tp : tps) {
    if (n % tp != 0 || (!given("tp") && per_node % tp != 0)) continue;
    const std::vector<uint64_t> pps =
        given("pp") ? std::vector<uint64_t>{user.train.pp} : powers_of_two_dividing(n / tp, std::min(n / tp, layers));
    for (uint64_t pp : pps) {
      if ((n / tp) % pp != 0) continue;
      const std::vector<uint64_t> cps =
          given("cp") ? std::vector<uint64_t>{user.train.cp} : powers_of_two_dividing(n / tp / pp, per_node);
      for (uint64_t cp : cps) {
        if ((n / tp / pp) % cp != 0 || (!given("cp") && per_node % (tp * cp) != 0)) continue;
        // context x tensor parallel layouts (resolve_cp simulates them) are searched only when --cp and --tp are
        // both given: enumerated by default they would spend plan's bound on work that finds the other layouts
        // (70B on 64 GPUs: two fitting setups lost to it)
        if (cp > 1 && tp > 1 && !(given("cp") && given("tp"))) continue;
        // pipeline x context parallel layouts (torchtitan's, simulated under FSDP2: resolve_cp) likewise only when
        // --cp and --pp are both given: each is every pipeline rank's every CP rank
        if (cp > 1 && pp > 1 && !(given("cp") && given("pp"))) continue;
        const uint64_t dp = n / tp / pp / cp;
        std::vector<Sharding> shardings = {Sharding::kDdp};
        if (dp > 1 && given("sharding")) shardings = {user.train.sharding};
        if (dp > 1 && !given("sharding")) {
          shardings = {Sharding::kDdp, Sharding::kZero1, Sharding::kZero2, Sharding::kFsdp2, Sharding::kZero3};
        }
        // --cp: FSDP2 over the dp x cp ranks, as accelerate and torchtitan run context parallel (fsdp.h
        // fsdp2_mesh_ranks); the weights replicated on the CP ranks without data parallelism (accelerate's
        // ACCELERATE_ALLOW_CP_STANDALONE path); DDP and ZeRO with CP are refused by resolve_cp, so not tried
        if (cp > 1 && !given("sharding")) {
          shardings = dp > 1 ? std::vector<Sharding>{Sharding::kFsdp2} : std::vector<Sharding>{Sharding::kDdp, Sharding::kFsdp2};
        } else if (cp > 1 && dp == 1 && given("sharding")) {
          shardings = {user.train.sharding};
        }
        std::vector<Checkpointing> ckpts = {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull};
        if (given("checkpointing")) ckpts = {user.train.checkpointing};
        std::vector<std::pair<PpSchedule, uint64_t>> schedules = {{PpSchedule::k1f1b, 1}};
        if (pp > 1 && given("pp_schedule")) {
          schedules = {{user.train.pp_schedule, user.train.pp_schedule == PpSchedule::kInterleaved1f1b
                                                    ? std::max<uint64_t>(user.train.pp_virtual_stages, 2) : 1}};
        } else if (pp > 1 && given("pp_virtual_stages")) {
          // stages per rank given: the interleaved schedule is the one that takes them
          schedules = {{PpSchedule::kInterleaved1f1b, user.train.pp_virtual_stages}};
        } else if (pp > 1 && dp == 1) {
          // (with dp > 1, FSDP2 under interleaved-1f1b is simulated, one FSDP root per stage module, but searched only
          // when --pp-schedule or --pp-virtual-stages asks for it: its layouts, twice the stage micro-batches of
          // 1F1B's, would spend the bound on work that the other layouts' variants need)
          schedules.push_back({PpSchedule::kInterleaved1f1b, 2});
        }
        const size_t first_of_layout = families.size();
        for (Sharding sh : shardings) {
          const bool zero = PlanSetup{.dp = dp, .sharding = sh}.deepspeed();
          // torchtitan's FSDP2 and its precision policy: under a pipeline (the only sharding there) and over the
          // TP + SP model (resolve_sp_fsdp)
          // (with --cp, torchtitan's FSDP2 shards over the CP ranks also with one data-parallel rank)
          const bool titan = (dp > 1 || (cp > 1 && sh == Sharding::kFsdp2)) &&
                             (pp > 1 || (user.train.sequence_parallel && sh == Sharding::kFsdp2));
          for (Precision pr : given("precision") ? std::vector<Precision>{given_precision(user.train.precision, zero, titan)}
                                                 : precision_choices(zero, titan, pp)) {
            for (Checkpointing ck : ckpts) {
              for (const auto& [schedule, v] : (pp > 1 ? schedules : decltype(schedules){{PpSchedule::k1f1b, 1}})) {
                PlanFamily f;
                PlanSetup& p = f.setup;
                p.dp = dp;
                p.tp = tp;
                p.pp = pp;
                p.cp = cp;
                p.sharding = sh;
                p.checkpointing = ck;
                p.precision = pr;
                p.mixed = is_mixed(pr, zero, titan);
                p.schedule = schedule;
                p.virtual_stages = v;
                // torch.optim's fused kernels where the optimizer is torch's own (DeepSpeed ZeRO runs its own)
                if (given("optimizer_impl")) {
                  p.optimizer_impl = user.train.optimizer_impl;
                } else if (torch_optim && !zero) {
                  p.optimizer_impl = OptimizerImpl::kFused;
                }
                p.batch = given("batch") ? user.train.batch : 1;
                families.push_back(f);
              }
            }
          }
        }
        add_hsdp(families, first_of_layout, dp, tp, pp, cp);
      }
    }
  }

  // The rank batch and the bound of each family, then the families best bound first.
  for (PlanFamily& f : families) {
    PlanSetup& p = f.setup;
    if (req_.global_batch % p.dp != 0) {
      f.verdict = PlanVerdict::kBatch;
      f.why = fmt::format("the global batch of {} sequences does not divide into {} data-parallel ranks",
                          req_.global_batch, p.dp);
      continue;
    }
    const uint64_t l = req_.global_batch / p.dp;
    if (l % p.batch != 0) {
      f.verdict = PlanVerdict::kBatch;
      f.why = fmt::format("{} sequences per data-parallel rank do not divide into micro-batches of {}", l, p.batch);
      continue;
    }
    if (p.pp > 1 && p.schedule != PpSchedule::kInterleaved1f1b && l / p.batch < p.pp) {
      f.verdict = PlanVerdict::kBatch;
      f.why = fmt::format("{} micro-batches per step are fewer than the {} pipeline stages (the schedule needs at "
                          "least one per stage)", l / p.batch, p.pp);
      continue;
    }
    p.accumulation = l / p.batch;
    f.bound_tokens_per_second = tokens_per_second(req_.global_batch, seq_, bound_seconds(p, p.batch));
  }
  std::stable_sort(families.begin(), families.end(), [](const PlanFamily& a, const PlanFamily& b) {
    const bool ra = a.verdict == PlanVerdict::kRanked, rb = b.verdict == PlanVerdict::kRanked;
    if (ra != rb) return ra;
    return a.bound_tokens_per_second > b.bound_tokens_per_second;
  });

  std::vector<PlanRow> rows;
  // (bytes, not vector<bool>'s shared bits: the screening workers below set their own groups' entries)
  std::vector<uint8_t> done(families.size(), 0);
  for (size_t i = 0; i < families.size(); ++i) done[i] = families[i].verdict != PlanVerdict::kRanked;  // kBatch
  auto try_family = [&](size_t i) {
    PlanFamily& f = families[i];
    done[i] = true;
    // the N-th best found so far: a family whose bound is below it cannot enter the top N
    std::vector<double> speeds;
    for (const PlanRow& r : rows) speeds.push_back(r.time.tokens_per_second);
    std::sort(speeds.rbegin(), speeds.rend());
    if (speeds.size() >= req_.top && f.bound_tokens_per_second < speeds[req_.top - 1]) {
      f.verdict = PlanVerdict::kPruned;
      f.why = fmt::format("at most {:.0f} tokens/s, below the {}th best found ({:.0f})", f.bound_tokens_per_second,
                          req_.top, speeds[req_.top - 1]);
      return;
    }
    // HSDP's twin (add_hsdp) comes after its FSDP2 sibling (the same family over all the dp ranks: an equal bound,
    // enumerated first); when that one does not fit, neither does the twin, which keeps more (pass 1 below)
    if (f.setup.dp_shard > 0) {
      for (const PlanFamily& g : families) {
        const PlanSetup& a = g.setup;
        const PlanSetup& b = f.setup;
        if (a.dp_shard != 0 || g.verdict != PlanVerdict::kDoesNotFit || a.tp != b.tp || a.pp != b.pp || a.cp != b.cp ||
            a.dp != b.dp || a.sharding != b.sharding || a.schedule != b.schedule ||
            a.virtual_stages != b.virtual_stages || a.optimizer_impl != b.optimizer_impl ||
            a.checkpointing != b.checkpointing || a.precision != b.precision || a.mixed != b.mixed) {
          continue;
        }
        f.verdict = PlanVerdict::kDoesNotFit;
        f.screened = true;
        f.best_headroom = g.best_headroom;
        f.smallest_batch = g.smallest_batch;
        f.why = fmt::format("not simulated: it keeps more than {}, which", plan_family_name(a));
        return;
      }
    }
    if (events_ >= kPlanEventBudget) {
      f.verdict = PlanVerdict::kBudget;
      f.why = fmt::format("the search simulated {} events, its bound on work", with_commas(events_.load()));
      return;
    }
    if (std::optional<PlanRow> row = search(f)) {
      row->order = i;
      rows.push_back(*row);
    }
  };
  // Pass 1, one layout at a time (the families equal but for checkpointing and precision), best bound first: the
  // variant that keeps the least (full checkpointing keeps only each layer's input, selective more, none every
  // saved tensor; pure bf16 keeps 2-byte weights, gradients and states where mixed precision keeps fp32 ones) at
  // the layout's smallest micro-batch. When it does not fit, no variant of the layout does, and they are not
  // simulated.
  // HSDP's twin of an FSDP2 layout (add_hsdp) is screened with it: sharded over K < dp ranks it keeps larger
  // shards of every state than FSDP2 over the dp ranks (the gathered layers alike, up to torch.chunk's padding
  // rows), so it ranks after them, and when FSDP2's lightest variant does not fit, HSDP's are not simulated.
  auto keeps = [](const PlanSetup& p) {
    const int ck = p.checkpointing == Checkpointing::kFull ? 0 : p.checkpointing == Checkpointing::kSelective ? 1 : 2;
    return std::make_tuple(ck, p.mixed ? 1 : 0, p.dp_shard > 0 ? 1 : 0);
  };
  auto layout = [](const PlanSetup& p) {
    return std::make_tuple(p.tp, p.pp, p.cp, p.dp, p.sharding, p.schedule, p.virtual_stages, p.optimizer_impl);
  };
  std::vector<std::vector<size_t>> groups;
  std::vector<bool> screened(families.size(), false);
  for (size_t i = 0; i < families.size(); ++i) {
    if (done[i] || screened[i]) continue;
    std::vector<size_t> group;
    for (size_t j = i; j < families.size(); ++j) {
      if (!done[j] && layout(families[j].setup) == layout(families[i].setup)) group.push_back(j);
    }
    for (size_t j : group) screened[j] = true;
    size_t least = group.front();
    for (size_t j : group) {
      if (keeps(families[j].setup) < keeps(families[least].setup)) least = j;
    }
    std::swap(*std::find(group.begin(), group.end(), least), group.front());
    groups.push_back(group);
  }
  // The layouts are independent, so they are screened on every core (each simulation is single-threaded and
  // touches only its own estimate); no family is pruned in this pass, whose rows arrive in any order.
  std::mutex rows_mu;
  std::atomic<size_t> next = 0;
  auto screen = [&] {
    for (size_t g = next++; g < groups.size(); g = next++) {
      const size_t least = groups[g].front();
      done[least] = true;
      PlanFamily& l = families[least];
      // (no bound on work here: which layouts a shared budget would leave out would depend on the threads' timing;
      // each screening costs a few simulations, and pass 2 keeps to the bound)
      std::optional<PlanRow> row = search(l);
      if (row) {
        row->order = least;
        std::lock_guard<std::mutex> lock(rows_mu);
        rows.push_back(*row);
      }
      if (l.verdict != PlanVerdict::kDoesNotFit) continue;
      for (size_t j : groups[g]) {
        if (j == least) continue;
        done[j] = true;
        PlanFamily& f = families[j];
        // a variant resolve() refuses (selective checkpointing under context parallelism) is refused, not
        // "does not fit"
        if (refused(f)) continue;
        f.verdict = PlanVerdict::kDoesNotFit;
        f.screened = true;
        f.best_headroom = l.best_headroom;  // its lighter variant's (the report says whose)
        f.smallest_batch = l.smallest_batch;
        f.why = fmt::format("not simulated: it keeps more than {}, which", plan_family_name(l.setup));
      }
    }
  };
  {
    const unsigned workers = std::max(1u, std::min(std::thread::hardware_concurrency(), kPlanThreads));
    std::vector<std::thread> pool;
    try {
      for (unsigned w = 1; w < workers; ++w) pool.emplace_back(screen);
    } catch (const std::system_error&) {
      // no threads here (WebAssembly without pthreads): the calling thread screens every layout
    }
    screen();
    for (std::thread& t : pool) t.join();
  }
  // Pass 2: the other variants of the layouts that may fit, best bound first.
  for (size_t i = 0; i < families.size(); ++i) {
    if (!done[i]) try_family(i);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const PlanRow& a, const PlanRow& b) {
    // equal times (ZeRO-1 and ZeRO-2 often are) in the enumeration's order, whatever order the workers found them in
    if (a.time.tokens_per_second != b.time.tokens_per_second) return a.time.tokens_per_second > b.time.tokens_per_second;
    return a.order < b.order;
  });
  out.ranked_total = rows.size();
  if (rows.size() > req_.top) rows.resize(req_.top);
  for (PlanRow& row : rows) try_foreach(row);
  out.rows = std::move(rows);
  out.families = std::move(families);
  out.simulations = simulations_;
  out.reference_simulations = references_;
  out.best_reason = best_reasons(out);
  out.notes.push_back(fmt::format(
      "searched: tensor, pipeline and context parallel sizes in powers of two (tensor and context parallel within "
      "a node of {} GPUs), every sharding of the data-parallel ranks, checkpointing none, selective and full, "
      "precision bf16-amp and bf16, each family's micro-batches from 1 by doubling and bisection; fields given "
      "are kept", std::min(per_node, n)));
  if (!given("precision")) {
    out.notes.push_back("bf16 is pure bfloat16 training (weights, gradients and AdamW states in bfloat16): faster and "
                        "smaller, but not the numerics of mixed precision; --precision bf16-amp searches mixed "
                        "precision only (under a pipeline, torchtitan's: fp32 parameters with FSDP2's bf16 policy)");
  }
  out.notes.push_back("not searched: GPipe (1F1B has its bubble and keeps fewer micro-batches in flight), "
                      "interleaved 1F1B with data parallelism unless --pp-schedule interleaved-1f1b asks for it (it would spend "
                      "the bound on work), zero-bubble schedules (not simulated), sizes other than "
                      "powers of two");
  return out;
}

}  // namespace

PlanResult plan(std::span<const FieldChange> given, const PlanRequest& r, const FileReader& files) {
  return Planner(std::vector<FieldChange>(given.begin(), given.end()), r, files).run();
}

PlanRequest plan_request(std::string_view global_batch, std::string_view nodes, std::string_view top,
                         std::string_view margin) {
  auto number = [](std::string_view field, std::string_view s, uint64_t max, bool zero_ok) -> uint64_t {
    if (s.empty() && zero_ok) return 0;
    const std::string expected = fmt::format("an integer in [{}, {}]", zero_ok ? 0 : 1, max);
    if (s.empty() || s.size() > 12 || s.find_first_not_of("0123456789") != std::string_view::npos) {
      throw FieldError(std::string(field), fmt::format("\"{}\": expected {}", s, expected));
    }
    const uint64_t v = std::stoull(std::string(s));
    if (v > max || (v == 0 && !zero_ok)) throw FieldError(std::string(field), fmt::format("\"{}\": expected {}", s, expected));
    return v;
  };
  PlanRequest r;
  // at most a million sequences per step and 65,536 nodes: beyond any cluster, and every product of them fits
  // 64 bits with the sequence
  r.global_batch = global_batch.empty() ? 0 : number("global_batch", global_batch, uint64_t{1} << 20, false);
  r.nodes = nodes.empty() ? 0 : number("nodes", nodes, uint64_t{1} << 16, false);  // empty: not given
  r.top = number("top", top, 1000, false);
  r.margin = parse_margin(margin);
  return r;
}

bool PlanSetup::deepspeed() const {
  return dp > 1 && (sharding == Sharding::kZero1 || sharding == Sharding::kZero2 || sharding == Sharding::kZero3);
}

std::vector<FieldChange> plan_fields(std::span<const FieldChange> given, std::span<const FieldChange> chosen) {
  std::vector<FieldChange> out;
  for (const FieldChange& g : given) {
    if (std::none_of(chosen.begin(), chosen.end(), [&](const FieldChange& c) { return c.field == g.field; })) {
      out.push_back(g);
    }
  }
  out.insert(out.end(), chosen.begin(), chosen.end());
  return out;
}

std::vector<FieldChange> PlanSetup::changes() const {
  std::vector<FieldChange> c = {{"tp", std::to_string(tp)},
                                {"pp", std::to_string(pp)},
                                {"cp", std::to_string(cp)}};
  if (sharded()) c.push_back({"sharding", std::string(name_of(sharding))});
  if (hsdp()) c.push_back({"dp_shard", std::to_string(dp_shard)});
  c.push_back({"checkpointing", std::string(name_of(checkpointing))});
  c.push_back({"precision", std::string(precision_name(precision))});
  if (optimizer_impl != OptimizerImpl::kAuto) c.push_back({"optimizer_impl", std::string(name_of(optimizer_impl))});
  c.push_back({"batch", std::to_string(batch)});
  if (pp > 1) {
    c.push_back({"pp_schedule", std::string(name_of(schedule))});
    if (schedule == PpSchedule::kInterleaved1f1b) c.push_back({"pp_virtual_stages", std::to_string(virtual_stages)});
    c.push_back({"micro_batches", std::to_string(accumulation)});
  } else {
    c.push_back({"grad_accum", std::to_string(accumulation)});
  }
  return c;
}

std::string plan_sharding_name(const PlanSetup& s) {
  if (s.hsdp()) return fmt::format("hsdp {}x{}", s.dp / s.dp_shard, s.dp_shard);
  return s.sharded() ? std::string(name_of(s.sharding)) : "";
}

std::string plan_family_name(const PlanSetup& s) {
  std::string out = fmt::format("tp{} pp{}", s.tp, s.pp);
  if (s.cp > 1) out += fmt::format(" cp{}", s.cp);
  out += fmt::format(" dp{}", s.dp);
  if (s.sharded()) out += fmt::format(" {}", name_of(s.sharding));
  if (s.hsdp()) out += fmt::format(" hsdp{}x{}", s.dp / s.dp_shard, s.dp_shard);  // replicas x shard
  if (s.pp > 1) {
    out += fmt::format(" {}", name_of(s.schedule));
    if (s.schedule == PpSchedule::kInterleaved1f1b) out += fmt::format("x{}", s.virtual_stages);
  }
  out += fmt::format(" {} {}", name_of(s.checkpointing), plan_precision_name(s));
  return out;
}

std::string plan_precision_name(const PlanSetup& s) {
  return fmt::format("{} {}", s.mixed ? "mixed" : "pure", s.precision == Precision::kFp32 && !s.mixed ? "fp32" : "bf16");
}

std::string_view plan_verdict_name(PlanVerdict v) {
  switch (v) {
    case PlanVerdict::kRanked: return "ranked";
    case PlanVerdict::kDoesNotFit: return "does not fit";
    case PlanVerdict::kRefused: return "not simulated";
    case PlanVerdict::kNoTime: return "no step time";
    case PlanVerdict::kBatch: return "batch does not divide";
    case PlanVerdict::kPruned: return "pruned by the bound";
    case PlanVerdict::kBudget: return "not tried (bound on work)";
  }
  return "";
}

}  // namespace trainmem
