#!/usr/bin/env python3
"""Tests of validate/compare.py's mechanics (ctest validate.compare_mechanics): that a figure passes exactly up
to its tolerance plus the stated uncertainty, and that a measured allocator trace is read as requested sizes
and lined up with trainmem's timeline. The measurements here are built from trainmem's own output on purpose:
they test the comparison, not the model (validate.gpu_measurements does that with real measurements).

    /usr/bin/python3 validate/test_compare.py --trainmem build/trainmem
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402

ARGS = ["--model", "gpt2", "--set", "n_layer=2", "--batch", "2", "--seq", "128", "--gpu", "a100-40gb"]


def write(tmp, name, obj):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def measurement(figures, trace=None):
    m = {"format": compare.FORMAT, "name": "synthetic", "source": "test_compare.py", "trainmem_args": ARGS,
         "figures": figures}
    if trace is not None:
        m["trace"] = trace
    return m


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainmem", required=True)
    exe = os.path.abspath(ap.parse_args(argv).trainmem)
    est = json.loads(compare.trainmem(exe, ["estimate"] + ARGS + ["--format", "json"]))
    peak = est["memory"]["peak_allocated_bytes"]
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        # measured = trainmem + delta; allowed: tolerance x measured + uncertainty
        tol = compare.FIGURES["peak_allocated_bytes"][1]
        edge = int(tol * peak)
        over = int(tol * peak * 1.02)
        for delta, unc, expect in ((0, 0, True), (edge, 0, True), (over, 0, False), (over, int(tol * peak * 0.03), True)):
            r = compare.compare_file(exe, write(tmp, "m.json", measurement(
                {"peak_allocated_bytes": {"bytes": peak + delta, "uncertainty_bytes": unc},
                 "parameters": {"count": est["parameters"]["count"]}})))
            check(r["ok"] == expect, f"peak allocated off by {delta:,} B with uncertainty {unc:,} B: "
                                     f"{'passes' if expect else 'fails'}")
        r = compare.compare_file(exe, write(tmp, "p.json", measurement(
            {"parameters": {"count": est["parameters"]["count"] + 1}})))
        check(not r["ok"], "a parameter count off by one fails")

        # A trace made of trainmem's own requested sizes lines up entirely; one changed size is found where it is.
        sizes = compare.timeline_blocks(exe, ARGS, 1 << 20)
        check(len(sizes) > 20, f"the timeline has allocations of 1 MiB or more ({len(sizes)})")
        events = [[0, s, 0] for s in sizes] + [[1, sizes[0], 0]]  # frees are not compared
        trace = {"actions": {"0": "alloc", "1": "free_completed"}, "events": events, "truncated": False}
        r = compare.compare_file(exe, write(tmp, "t.json", measurement({}, trace)))
        t = r["trace"]
        check(t["same_prefix"] == len(sizes) == t["measured"] == t["predicted"] and t["match_ratio"] == 1.0,
              "a trace of trainmem's own sizes matches all the way")
        k = len(sizes) // 2
        events[k][1] += 512
        r = compare.compare_file(exe, write(tmp, "t2.json", measurement({}, trace)))
        check(r["trace"]["same_prefix"] == k, f"a size changed at allocation {k} is where the match stops")
        small = {"actions": {"0": "alloc"}, "events": [[0, 1000, 0]] * 5, "truncated": False}
        r = compare.compare_file(exe, write(tmp, "t3.json", measurement({}, small)))
        check(r["trace"] is None, "allocations under 1 MiB are left out of the comparison")
        r = compare.compare_file(exe, write(tmp, "other.json", {"format": "something-else"}))
        check(r is None, "files of another format are skipped")
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
