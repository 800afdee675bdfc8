#!/usr/bin/env python3
"""Structural checks of trainmem's pictures (timeline --plot, --format html, estimate --plot).

The SVG is parsed as XML (xml.etree), and what it draws is read back through its own axis and compared with
trainmem's JSON output for the same scenario and with the GPU catalog:
  - the peak label states the JSON's peak live bytes;
  - the top of the stacked areas at the peak's column is that peak, within one pixel;
  - the capacity line is at the GPU's runtime total (gpus --format json), within one pixel;
  - the legend names exactly the categories that hold live bytes at some event (timeline --by event JSON);
  - the same command writes the same bytes twice; the HTML page holds the same SVG;
  - the breakdown's bar adds up to the JSON's live bytes at the peak, its marks sit at the JSON's figures.
Usage: check_svg.py --trainmem build/trainmem --out DIR
"""
import argparse
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

NS = {"svg": "http://www.w3.org/2000/svg"}
# Without a GPU the peak nearly fills the plot (one pixel is 1/500 of the axis); with one, the capacity line
# is drawn too. Three steps: the down-sampling keeps each column's fullest moment (several events per pixel).
SCENARIO = ["--model", "nanogpt-gpt2", "--batch", "2", "--seq", "256", "--attention", "eager", "--steps", "3"]
GPU = "l4"


def run(exe, args, ok=(0, 1)):
    p = subprocess.run([exe] + args, capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"`trainmem {' '.join(args)}` exited {p.returncode}:\n{p.stderr}")
    return p.stdout


def format_bytes(b):  # units.cc's format_bytes
    if b >= 1 << 30:
        return f"{b / (1 << 30):.2f} GiB"
    if b >= 1 << 20:
        return f"{b / (1 << 20):.1f} MiB"
    if b >= 1 << 10:
        return f"{b / (1 << 10):.1f} KiB"
    return f"{b} B"


def step_function(d):
    """The top edge of an area path written as M x y (H x V y)* H x ... : a list of (x0, x1, y) segments."""
    tokens = re.findall(r"[MHVZ]|-?[0-9.]+", d)
    assert tokens[0] == "M", d
    x, y = float(tokens[1]), float(tokens[2])
    segs, i = [], 3
    while i < len(tokens):
        cmd = tokens[i]
        if cmd == "Z":
            break
        v = float(tokens[i + 1])
        i += 2
        if cmd == "H":
            if v < x:  # the area turns back along its bottom edge: the top is done
                break
            segs.append((x, v, y))
            x = v
        elif cmd == "V":
            y = v
    return segs


def y_at(segs, x):
    for x0, x1, y in segs:
        if x0 <= x <= x1:
            return y
    raise AssertionError(f"no segment at x={x}")


def byte_scale(root, group_id):
    """(y of 0 bytes, pixels per byte) from the axis' tick lines and their data-bytes."""
    ticks = [(int(l.get("data-bytes")), float(l.get("y1"))) for l in root.find(f".//svg:g[@id='{group_id}']", NS)
             .findall("svg:line", NS)]
    (b0, y0), (b1, y1) = ticks[0], ticks[-1]
    return y0, (y0 - y1) / (b1 - b0)


def check_timeline(exe, out, fails, scenario, gpu):
    name = "timeline" + (f"-{gpu}" if gpu else "")
    svg_path = out / f"{name}.svg"
    tl = json.loads(run(exe, ["timeline"] + scenario + ["--by", "event", "--format", "json", "--plot", str(svg_path)]))
    svg_bytes = svg_path.read_bytes()
    root = ET.fromstring(svg_bytes)  # valid XML, or this raises
    peak = tl["peak"]["live_tensor_bytes"]

    g = root.find(".//svg:g[@id='peak']", NS)
    if int(g.get("data-bytes")) != peak:
        fails.append(f"peak data-bytes {g.get('data-bytes')} != JSON peak {peak}")
    label = "".join(t.text for t in g.findall("svg:text", NS))
    if label != f"peak {format_bytes(peak)}":
        fails.append(f"peak label {label!r}, expected 'peak {format_bytes(peak)}'")

    y_zero, px_per_byte = byte_scale(root, "y-axis")
    xp = float(g.find("svg:circle", NS).get("cx"))
    areas = root.findall(".//svg:g[@id='areas']/svg:path", NS)
    top_y = min(y_at(step_function(a.get("d")), xp) for a in areas)
    want_y = y_zero - peak * px_per_byte
    if abs(top_y - want_y) > 1.0:
        fails.append(f"stack top at the peak column y={top_y:.2f}, the peak's bytes are at y={want_y:.2f}")
    bands = len(root.findall(".//svg:g[@id='phases']/svg:rect", NS))
    print(f"svg ({name}): stack top at the peak {top_y:.1f} px, peak {peak:,} bytes at {want_y:.1f} px, "
          f"{len(tl['rows'])} events in {bands} phase bands")

    # Every column: its events are [k n / c, (k + 1) n / c) (plot.h, kPlotColumns = 900); the stack's top is the
    # most live bytes after any of them, the allocated and reserved curves the most allocated and reserved.
    rows = tl["rows"]
    n = len(rows)
    assert n == tl["events_total"] and all(r["first_event"] == i for i, r in enumerate(rows)), "one row per event"
    c = min(n, 900)
    frame = root.find(".//svg:g[@id='x-axis']/svg:rect", NS)
    x0, width = float(frame.get("x")), float(frame.get("width"))
    tops = [step_function(a.get("d")) for a in areas]
    curves = {k: step_function(root.find(f".//svg:path[@id='{k}']", NS).get("d")) for k in ("allocated", "reserved")}
    worst = {"live": 0.0, "allocated": 0.0, "reserved": 0.0}
    for k in range(c):
        col = rows[k * n // c:(k + 1) * n // c]
        x = x0 + (k + 0.5) * width / c
        want = {"live": max(r["live_total_bytes"] for r in col),
                "allocated": max(r["allocated_bytes"] for r in col),
                "reserved": max(r["reserved_bytes"] for r in col)}
        got = {"live": min(y_at(t, x) for t in tops), "allocated": y_at(curves["allocated"], x),
               "reserved": y_at(curves["reserved"], x)}
        for key in want:
            worst[key] = max(worst[key], abs(got[key] - (y_zero - want[key] * px_per_byte)))
    for key, off in worst.items():
        if off > 1.0:
            fails.append(f"{name}: a column's {key} is drawn {off:.2f} px from the most {key} bytes among its events")
    print(f"svg ({name}): {c} columns; largest offsets from each column's maximum: "
          + ", ".join(f"{k} {v:.2f} px" for k, v in worst.items()))

    cl = root.find(".//svg:g[@id='capacity']/svg:line", NS)
    if gpu:
        gpus = {x["name"]: x for x in json.loads(run(exe, ["gpus", "--format", "json"]))}
        cap = gpus[gpu]["runtime_total_bytes"]
        cap_y = y_zero - cap * px_per_byte
        if cl is None or abs(float(cl.get("y1")) - cap_y) > 1.0:
            fails.append(f"capacity line at y={None if cl is None else cl.get('y1')}, {gpu}'s {cap:,} bytes are at y={cap_y:.2f}")
    elif cl is not None:
        fails.append("a capacity line without a GPU")

    present = {c for r in tl["rows"] for c, b in r["live_bytes"].items() if b > 0}
    legend = {x.get("data-category") for x in root.findall(".//svg:g[@id='legend']/svg:g", NS)}
    if legend != present:
        fails.append(f"legend {sorted(legend)} != categories with live bytes {sorted(present)}")
    drawn = {a.get("data-category") for a in areas}
    if drawn != present:
        fails.append(f"areas {sorted(drawn)} != categories with live bytes {sorted(present)}")

    again = out / f"{name}-again.svg"
    run(exe, ["timeline"] + scenario + ["--plot", str(again)])
    if again.read_bytes() != svg_bytes:
        fails.append("the same timeline drew different bytes")

    html = run(exe, ["timeline"] + scenario + ["--format", "html"])
    if not html.startswith("<!DOCTYPE html>") or svg_bytes.decode() not in html or "</html>" not in html:
        fails.append("the HTML page does not hold the same SVG")


def check_breakdown(exe, out, fails):
    svg_path = out / "breakdown.svg"
    est = json.loads(run(exe, ["estimate"] + SCENARIO + ["--gpu", GPU, "--format", "json", "--plot", str(svg_path)]))
    root = ET.fromstring(svg_path.read_bytes())
    bar = root.findall(".//svg:g[@id='bar']/svg:rect", NS)
    total = sum(int(r.get("data-bytes")) for r in bar)
    if total != est["memory"]["live_tensors_at_peak_bytes"]:
        fails.append(f"breakdown bar adds up to {total}, JSON live at the peak {est['memory']['live_tensors_at_peak_bytes']}")
    for mark, want in (("allocated", est["memory"]["peak_allocated_bytes"]),
                       ("reserved", est["memory"]["peak_reserved_bytes"]),
                       ("capacity", est["device"]["capacity_bytes"])):
        g = root.find(f".//svg:g[@id='{mark}']", NS)
        if g is None or int(g.get("data-bytes")) != want:
            fails.append(f"breakdown mark {mark}: {None if g is None else g.get('data-bytes')} != {want}")
    verdict = root.find(".//svg:text[@id='verdict']", NS).text
    if not verdict.startswith(f"FITS the {GPU}"):
        fails.append(f"breakdown verdict {verdict!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainmem", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fails = []
    check_timeline(a.trainmem, out, fails, SCENARIO, None)
    check_timeline(a.trainmem, out, fails, SCENARIO + ["--gpu", GPU], GPU)
    check_breakdown(a.trainmem, out, fails)
    for f in fails:
        print("FAIL:", f)
    print("svg: all checks passed" if not fails else f"svg: {len(fails)} check(s) failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
