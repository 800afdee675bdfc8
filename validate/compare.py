#!/usr/bin/env python3
"""Compare trainmem with every committed GPU measurement (validate/measured/*.json, format
trainmem-measurement-v1: written by validate/cuda/measure.py, or transcribed from a published measurement).

For each file it runs `trainmem estimate <trainmem_args> --format json`, compares each measured figure with
trainmem's, and prints one row per figure. Exit status 1 when any figure is outside its tolerance.

    /usr/bin/python3 validate/compare.py --trainmem build/trainmem
    /usr/bin/python3 validate/compare.py --trainmem build/trainmem --file /tmp/one.json

A figure is {"bytes": N, "uncertainty_bytes": U} (U: what rounding in the source leaves open, 0 when the
number was read exactly) or, for parameters, {"count": N}. It passes when
|trainmem - N| <= tolerance * N + U. When a file holds the allocator's trace, the sequence of blocks of 1 MiB
or more (their requested sizes) is compared with trainmem's timeline as well (reported, not judged: it shows where a prediction starts
to differ).
"""

import argparse
import difflib
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FORMAT = "trainmem-measurement-v1"

# figure -> (path in `trainmem estimate --format json`, relative tolerance, why that tolerance)
FIGURES = {
    "parameters": (("parameters", "count"), 0.0, "exact: sum(p.numel() for p in model.parameters())"),
    "steady_state_allocated_bytes": (("memory", "steady_state_bytes"), 0.0005,
                                     "issue 4: memory_allocated() at a step's start within 0.05%"),
    "after_forward_allocated_bytes": (("memory", "after_forward_allocated_bytes"), 0.005,
                                      "as the peak: within 0.5%"),
    "peak_allocated_bytes": (("memory", "peak_allocated_bytes"), 0.005,
                             "issue 3: max_memory_allocated() within 0.5%"),
    "steady_state_reserved_bytes": (("memory", "steady_state_reserved_bytes"), 0.01,
                                    "reserved is whole segments (2 MiB / 20 MiB / rounded): within 1%"),
    "after_forward_reserved_bytes": (("memory", "after_forward_reserved_bytes"), 0.01, "within 1%"),
    "peak_reserved_bytes": (("memory", "peak_reserved_bytes"), 0.01, "max_memory_reserved() within 1%"),
    # --generate N (validate/cuda/measure.py run_inference): the prompt's forward and the one-token forwards
    "prefill_peak_allocated_bytes": (("generation", "prefill_peak_allocated_bytes"), 0.005, "as the peak: within 0.5%"),
    "decode_peak_allocated_bytes": (("generation", "decode_peak_allocated_bytes"), 0.005, "as the peak: within 0.5%"),
    "device_total_bytes": (("memory", "device_total_bytes"), 0.03,
                           "nvidia-smi: reserved plus the catalog's CUDA context, one reading per GPU that "
                           "drivers move by tens of MiB: within 3%"),
}


def lookup(obj, path):
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def trainmem(exe, args):
    r = subprocess.run([exe] + args, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"trainmem {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def trace_blocks(trace, min_bytes):
    """Sizes of the allocations in a measured trace, in order. PyTorch's trace records each `alloc` with the
    size that was asked for (CUDACachingAllocator's record_trace(TraceEntry::ALLOC, ..., orig_size)), so these
    compare with the requested bytes of trainmem's timeline."""
    if not isinstance(trace, dict) or "events" not in trace:
        return None
    alloc = [int(k) for k, v in trace.get("actions", {}).items() if v == "alloc"]
    code = alloc[0] if alloc else 0
    return [e[1] for e in trace["events"] if e[0] == code and e[1] >= min_bytes]


def timeline_blocks(exe, args, min_bytes):
    """Requested bytes of trainmem's allocations of at least min_bytes, in order."""
    text = trainmem(exe, ["timeline"] + args + ["--by", "event", "--format", "csv", "--min-bytes", str(min_bytes)])
    lines = text.splitlines()
    head = lines[0].split(",")
    kind, size = head.index("kind"), head.index("bytes")
    out = []
    for line in lines[1:]:
        # the tensor column may be quoted and hold commas: count from both ends
        cells = line.split(",")
        if cells[kind] == "alloc":
            value = int(cells[size - len(head)])
            if value >= min_bytes:
                out.append(value)
    return out


def compare_file(exe, path):
    with open(path) as f:
        m = json.load(f)
    if m.get("format") != FORMAT:
        return None
    args = list(m["trainmem_args"])
    est = json.loads(trainmem(exe, ["estimate"] + args + ["--format", "json"]))
    rows, ok = [], True
    for name, measured in m.get("figures", {}).items():
        if name not in FIGURES:
            raise RuntimeError(f"{path}: unknown figure {name!r}; known: {', '.join(FIGURES)}")
        jpath, tol, why = FIGURES[name]
        predicted = lookup(est, jpath)
        value = measured.get("count", measured.get("bytes"))
        unc = measured.get("uncertainty_bytes", 0)
        if predicted is None:
            rows.append((name, value, None, None, False, "trainmem does not report it for these flags"))
            ok = False
            continue
        diff = predicted - value
        passed = abs(diff) <= tol * value + unc
        ok = ok and passed
        rows.append((name, value, predicted, diff, passed, why))
    trace = None
    blocks = trace_blocks(m.get("trace"), 1 << 20)
    if blocks:
        predicted = timeline_blocks(exe, args, 1 << 20)
        sm = difflib.SequenceMatcher(a=blocks, b=predicted, autojunk=False)
        prefix = 0
        while prefix < min(len(blocks), len(predicted)) and blocks[prefix] == predicted[prefix]:
            prefix += 1
        trace = {"measured": len(blocks), "predicted": len(predicted), "same_prefix": prefix,
                 "match_ratio": round(sm.ratio(), 4), "truncated": bool(m["trace"].get("truncated"))}
    return {"file": os.path.relpath(path, ROOT), "name": m.get("name", ""), "source": m.get("source", ""),
            "ok": ok, "rows": rows, "trace": trace}


def report(result):
    lines = [f"{result['file']}: {result['source']}"]
    for name, value, predicted, diff, passed, why in result["rows"]:
        if predicted is None:
            lines.append(f"  FAIL {name}: measured {value:,}; {why}")
            continue
        rel = 0.0 if value == 0 else 100.0 * diff / value
        lines.append(f"  {'ok  ' if passed else 'FAIL'} {name:32} measured {value:>16,}  trainmem {predicted:>16,}"
                     f"  {diff:>+14,} ({rel:+.3f}%)  [{why}]")
    if result["trace"]:
        t = result["trace"]
        lines.append(f"  trace: {t['measured']} measured blocks >= 1 MiB, {t['predicted']} predicted; same first "
                     f"{t['same_prefix']}; sequence match {t['match_ratio']:.1%}"
                     + (" (measured trace truncated)" if t["truncated"] else ""))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainmem", default=os.path.join(ROOT, "build", "trainmem"))
    ap.add_argument("--file", action="append", help="compare these files (default: validate/measured/*.json)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    exe = os.path.abspath(args.trainmem)
    files = args.file or sorted(glob.glob(os.path.join(HERE, "measured", "*.json")))
    results = []
    for path in files:
        r = compare_file(exe, os.path.abspath(path))
        if r is None:
            continue
        results.append(r)
        print(report(r))
    if not results:
        print("no measurement of format %s found in %s" % (FORMAT, ", ".join(files) or "validate/measured"))
        return 1
    failed = [r["file"] for r in results if not r["ok"]]
    print(f"\n{len(results)} measurement(s), {sum(len(r['rows']) for r in results)} figures: "
          + ("all within tolerance" if not failed else "FAILED: " + ", ".join(failed)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
