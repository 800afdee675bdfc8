"""The live-memory timeline of one real training step on CPU, in the bytes CUDA torch 2.x would hold.

measure.py's storage registry (a TorchDispatchMode below autograd) is active over forward, backward and the
optimizer step. For every storage an ATen op returns it records the tick (one per op) at which it appeared and
the tick at which its StorageWeakRef was first seen expired (a C++ weak reference to the StorageImpl: it expires
exactly when the last tensor, SavedVariable or closure lets go). From those spans this module rebuilds the live
bytes after every op: the same quantity as trainmem's `live_total_bytes` (requested bytes of live tensors, no
allocator rounding), which trainmem's peak of live bytes is taken from.

What the registry cannot see, and so what the comparison leaves out on trainmem's side:
  * Allocations inside one ATen kernel (the mode is off while an op runs): CPU kernels' scratch buffers, and
    on CUDA the cuBLAS workspaces and a kernel's own temporaries. trainmem's `workspaces` category is
    CUDA-only and is subtracted; kernel temporaries trainmem models are listed by `kernel_internal` in grid.py.
  * Storages made before the step (parameters, buffers, the batch): a constant base, added on both sides.

Where CPU torch 1.13 differs from CUDA torch 2.x (checked in measure._cuda_torch2_bytes, whose rules this
reuses per storage):
  * a storage whose CUDA size differs (dropout's noise: a bool mask on CUDA; LayerNorm's mean/rstd in float32
    for 16-bit inputs on CUDA) counts at its CUDA size over its whole span;
  * RMSNorm's pow(2) temporary, which torch 1.13's MeanBackward1 saves (`self`): torch 2.x saves no tensor there,
    so it dies when Python drops it, right after the mean returns. measure's registry notes each grad-mode mean
    of a pow made by the op before it (mean_temps), in forward and in a checkpoint's recomputation alike; its span
    ends at the tick after that mean.
"""


def build(registry, exclude, cuda_bytes=None, mean_only=(), steps=()):
    """Live bytes after every tick. exclude: storage keys not counted (parameters, buffers, inputs: the base).
    cuda_bytes: storage key -> bytes on CUDA where it differs. mean_only: the pow(2) temporaries that torch
    1.13's MeanBackward1 keeps and torch 2.x lets die after the mean (measure's registry.mean_temps). steps: keys to drop entirely (CPU optimizer `step` scalars).
    Returns {"ticks": n, "live": [bytes per tick], "allocs": [(tick, bytes, op, shape, dtype)], "frees":
    [(tick, bytes)], "marks": {name: tick}}."""
    cuda_bytes = cuda_bytes or {}
    exclude = set(exclude) | _profiler_handles(registry)
    spans = _accumulate_in_place(registry, exclude)
    n = registry.tick + 1
    delta = [0] * (n + 1)
    allocs = []
    frees = []
    for key, (start, end) in spans.items():
        if key in exclude or key in steps:
            continue
        _ref, _cdata, nbytes, op, shape, dtype = registry.rows[key]
        b = cuda_bytes.get(key, nbytes)
        if key in mean_only:
            end = _after_next_mean(registry.ops, start, end)
        if b == 0:
            continue
        delta[start] += b
        allocs.append((start, b, op, shape, dtype))
        if end is not None:
            delta[end] -= b
            frees.append((end, b))
    live = []
    acc = 0
    for t in range(n):
        acc += delta[t]
        live.append(acc)
    allocs.sort()
    frees.sort()
    return {"ticks": n, "live": live, "allocs": allocs, "frees": frees, "marks": dict(registry.marks)}


def _accumulate_in_place(registry, exclude):
    """The spans as CUDA torch 2.x would have them. Where torch 1.13's engine summed two gradients out of place
    (registry.accumulations) and the old buffer entry died right after (the buffer held its last reference),
    torch 2.x's InputBuffer::accumulate adds into it instead (old_var.add_(var), can_accumulate_inplace): the sum
    is no new storage, and the old one lives on as long as the sum did. Adds `exclude`s the sums merged away."""
    spans = {k: list(v) for k, v in registry.spans.items()}
    root = {}
    for t, old, new in registry.accumulations:
        # `old` may be an earlier sum merged away here (a third gradient for the same input: the experts' slices
        # of a 3-D parameter in a MoE block); it stands for its root, into which 2.x keeps adding in place
        if old not in spans or new not in spans or (old in exclude and old not in root):
            continue
        if registry.spans[old][1] == t + 1:
            r = root.get(old, old)
            spans[r][1] = spans[new][1]
            root[new] = r
            exclude.add(new)
    return spans


def _profiler_handles(registry):
    """Storages of torch.autograd.profiler.record_function, which Optimizer.step enters: its handle (1.13:
    `self.handle = torch.zeros(1)` in __init__, then `torch.ops.profiler._record_function_enter`'s result). CPU
    tensors on every device: never GPU memory."""
    keys = set()
    by_tick = {}
    for key, (start, _end) in registry.spans.items():
        by_tick.setdefault(start, []).append(key)
    for t, op in enumerate(registry.ops):
        if op.startswith("profiler."):
            keys.update(by_tick.get(t, ()))
            for k in by_tick.get(t - 1, ()):
                row = registry.rows[k]
                if registry.ops[t - 1] == "aten.zeros.default" and row[4] == [1]:
                    keys.add(k)
    return keys


def _after_next_mean(ops, start, end):
    """The tick after the first aten.mean at or after `start`+1 (the storage dies when the mean returns and
    Python drops its input), never later than the measured end."""
    for t in range(start + 1, len(ops)):
        if ops[t].startswith("aten.mean"):
            return t + 1 if end is None else min(t + 1, end)
    return end


def from_events(ev):
    """A timeline (as build returns it) from measure's `live_events`: the live bytes recomputed from the spans."""
    n = ev["ticks"]
    delta = [0] * (n + 1)
    for a in ev["allocs"]:
        delta[a[0]] += a[1]
    for f in ev["frees"]:
        delta[f[0]] -= f[1]
    live, acc = [], 0
    for t in range(n):
        acc += delta[t]
        live.append(acc)
    return {"ticks": n, "live": live, "allocs": [tuple(a) for a in ev["allocs"]],
            "frees": [tuple(f) for f in ev["frees"]], "marks": dict(ev["marks"])}


def summary(tl, base):
    """Peak and phase figures of a timeline, with `base` (bytes alive before the step) added: the peak of the
    whole step, and each segment's peak and end (oracle_segments)."""
    live = tl["live"]
    peak_t = max(range(len(live)), key=lambda t: live[t]) if live else 0
    out = {"base_bytes": base, "peak_bytes": base + (live[peak_t] if live else 0), "peak_tick": peak_t,
           "allocations": len(tl["allocs"]), "frees": len(tl["frees"])}
    for seg, figures in oracle_segments(tl, base).items():
        out[f"peak of {seg}"] = figures["peak"]
        out[f"end of {seg}"] = figures["end"]
    return out


# ---- comparison with trainmem's timeline (`trainmem timeline --by event --format json --steps 1`)

# trainmem phases -> the oracle's segments (the model computes its loss inside forward)
_SEGMENTS = (("forward", ("forward", "loss"), "end of forward"),
             ("backward", ("backward",), "end of backward"),
             ("optimizer step", ("optimizer step",), "end of optimizer step"))


# trainmem tensors that exist only inside one CUDA op (made and freed before it returns): a CPU run has no such
# allocation, and a Python mode could not see it if it had. In backward these are exactly trainmem's
# `temporaries` (softmax_backward's tmp = grad * output, embedding backward's sort buffers, the flash and
# efficient attention kernels' scratch); in forward the ones named here.
# layer_norm_cuda's expect_contiguous() copy of a strided input (Phi's q_layernorm / k_layernorm).
KERNEL_INTERNAL_FORWARD = ("sdpa causal mask", "layer_norm input expect_contiguous")


def _internal(r):
    if r["category"] != "temporaries":
        return False
    return r["phase"] == "backward" or any(k in r["tensor"] for k in KERNEL_INTERNAL_FORWARD)


def trainmem_segments(tm):
    """Per segment: the allocation events [(bytes, tensor, live after)] and the live bytes at its end, from the
    rows of step 1. `workspaces` (cuBLAS) are CUDA-only: subtracted from every live figure, and their events
    dropped."""
    rows = [r for r in tm["rows"] if r["step"] == 1]
    inside = 0  # bytes of kernel-internal tensors alive at a row: subtracted from its live figure
    for r in rows:
        if _internal(r):
            inside += r["bytes"] if r["kind"] == "alloc" else -r["bytes"]
        r["_inside"] = inside
    out = {}
    setup = [r for r in tm["rows"] if r["step"] == 0]
    base = _tm_live(setup[-1]) if setup else 0
    for seg, phases, _mark in _SEGMENTS:
        rs = [r for r in rows if r["phase"] in phases]
        allocs = [(r["bytes"], r["tensor"], _tm_live(r)) for r in rs
                  if r["kind"] == "alloc" and r["category"] != "workspaces" and not _internal(r)]
        out[seg] = {"allocs": allocs, "end": _tm_live(rs[-1]) if rs else None,
                    "peak": max((_tm_live(r) for r in rs), default=None)}
    return base, out


def _minus(a, b):
    """The sizes in a that b lacks (multiset difference)."""
    left = list(b)
    out = []
    for x in a:
        if x in left:
            left.remove(x)
        else:
            out.append(x)
    return out


def _tm_live(r):
    return r["live_total_bytes"] - r["live_bytes"].get("workspaces", 0) - r.get("_inside", 0)


def oracle_segments(tl, base):
    """The same per segment from a live.build timeline: allocation events [(bytes, op, live after its op,
    tick)]."""
    live = tl["live"]
    out = {}
    lo = 0
    for seg, _phases, mark in _SEGMENTS:
        hi = tl["marks"].get(mark)
        if hi is None:
            continue
        # the ticks after the previous segment's end mark, through this one's (tick 0, before any op, is empty)
        allocs = [(b, op, base + live[t], t) for (t, b, op, _shape, _dt) in tl["allocs"] if lo < t <= hi]
        out[seg] = {"allocs": allocs, "end": base + live[hi], "peak": base + max(live[lo + 1:hi + 1])}
        lo = hi
    return out


def compare(measured, tm):
    """Event by event and at the peaks, measure's output against `trainmem timeline --by event --format json
    --steps 1`. Returns (failures, events, segments): what must match and does not (the bytes alive before the
    step), the event-by-event differences per segment (empty when exact), and per segment the measured and
    predicted peak and end."""
    tl = from_events(measured["live_events"])
    base = measured["live_timeline"]["base_bytes"]
    tm_base, tms = trainmem_segments(tm)
    ors = oracle_segments(tl, base)
    failures = []
    if tm_base != base:
        failures.append(f"before the step: trainmem {tm_base:,} B live, measured {base:,} B")
    problems = []
    rows = []
    for seg, _p, _m in _SEGMENTS:
        if seg not in ors:
            continue
        o, t = ors[seg], tms[seg]
        osz = [a[0] for a in o["allocs"]]
        tsz = [a[0] for a in t["allocs"]]
        if sorted(osz) != sorted(tsz):
            extra_o = _minus(osz, tsz)
            extra_t = _minus(tsz, osz)
            problems.append(f"{seg}: different tensors: only measured {extra_o[:6]}{'...' if len(extra_o) > 6 else ''}"
                            f", only trainmem {extra_t[:6]}{'...' if len(extra_t) > 6 else ''}")
        elif osz != tsz:
            i = next((k for k in range(min(len(osz), len(tsz))) if osz[k] != tsz[k]), min(len(osz), len(tsz)))
            problems.append(f"{seg}: allocation #{i} differs: measured "
                            f"{o['allocs'][i][:2] if i < len(osz) else 'none'} vs trainmem "
                            f"{t['allocs'][i][:2] if i < len(tsz) else 'none'} ({len(osz)} vs {len(tsz)} allocations)")
        else:
            # live bytes after each op (the oracle sees an op's several outputs together: compare after its last)
            for k in range(len(osz)):
                last_of_op = k + 1 == len(osz) or o["allocs"][k + 1][3] != o["allocs"][k][3]
                if last_of_op and o["allocs"][k][2] != t["allocs"][k][2]:
                    problems.append(f"{seg}: live bytes after allocation #{k} ({t['allocs'][k][1]}, "
                                    f"{o['allocs'][k][1]}): measured {o['allocs'][k][2]:,} vs trainmem "
                                    f"{t['allocs'][k][2]:,}")
                    break
        rows.append({"segment": seg, "allocations": len(osz), "measured_peak": o["peak"], "trainmem_peak": t["peak"],
                     "measured_end": o["end"], "trainmem_end": t["end"]})
    return failures, problems, rows

